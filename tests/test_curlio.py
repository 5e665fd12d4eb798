"""libcurl without Python in the transfer (epochfs.transport.curlio): bodies land whole and bounded in
aligned memory, header lines are read once the transfer ended, and every failure is an exception that
leaves the handle usable."""

import http.server
import os
import random
import socket
import threading

import pycurl
import pytest

from epochfs.transport import curlio
from epochfs.transport.buffers import is_aligned


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies: dict[str, bytes] = {}
    extra_headers: dict[str, list[tuple[str, str]]] = {}

    def do_GET(self):
        body = self.bodies[self.path]
        self.send_response(200 if body else 204)
        for name, value in self.extra_headers.get(self.path, []):
            self.send_header(name, value)
        self.send_header("ETag", f'"{len(body)}"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Handler.bodies, _Handler.extra_headers = {}, {}
    yield srv
    srv.shutdown()
    srv.server_close()


def _get(easy, server, path, limit):
    easy.setopt(pycurl.URL, f"http://127.0.0.1:{server.server_port}{path}")
    easy.setopt(pycurl.PROXY, "")
    return easy.perform(limit)


@pytest.mark.parametrize("size", [4095, 4096])
def test_a_body_that_fills_its_limit_keeps_its_last_byte(server, size):
    """The memory stream ends a full buffer with a null byte: it must land past the body, never on its
    last byte (the buffer has one byte more than the limit)."""
    body = os.urandom(size - 1) + b"\xff"
    _Handler.bodies["/b"] = body
    fields, got = _get(curlio.Easy(), server, "/b", 4096)
    assert bytes(got) == body and fields["etag"] == f'"{size}"'
    assert is_aligned(got) or size % 4096


def test_one_byte_over_the_limit_is_an_overflow_and_the_handle_goes_on(server):
    _Handler.bodies["/over"] = os.urandom(4097)
    _Handler.bodies["/ok"] = os.urandom(100)
    easy = curlio.Easy()
    with pytest.raises(curlio.Failed) as caught:
        _get(easy, server, "/over", 4096)
    assert curlio.overflowed(caught.value)
    assert bytes(_get(easy, server, "/ok", 4096)[1]) == _Handler.bodies["/ok"]


def test_an_empty_answer_is_an_empty_body(server):
    _Handler.bodies["/empty"] = b""
    easy = curlio.Easy()
    fields, body = _get(easy, server, "/empty", 4096)
    assert bytes(body) == b"" and easy.getinfo(pycurl.RESPONSE_CODE) == 204 and fields["etag"] == '"0"'


def test_header_lines_past_the_bound_fail_the_transfer_not_the_handle(server):
    _Handler.bodies["/big"] = b"x"
    _Handler.extra_headers["/big"] = [(f"x-filler-{i}", "y" * 1000) for i in range(curlio.HEAD_MAX // 1000 + 2)]
    _Handler.bodies["/ok"] = b"fine"
    easy = curlio.Easy()
    with pytest.raises(curlio.Failed):
        _get(easy, server, "/big", 4096)
    assert bytes(_get(easy, server, "/ok", 4096)[1]) == b"fine"


def test_a_refused_connection_is_a_failure_with_libcurls_words():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed again: nothing listens there)
    easy = curlio.Easy()
    easy.setopt(pycurl.URL, f"http://127.0.0.1:{port}/")
    easy.setopt(pycurl.PROXY, "")
    with pytest.raises(curlio.Failed) as caught:
        easy.perform(4096)
    assert caught.value.code == pycurl.E_COULDNT_CONNECT and caught.value.message
    assert not curlio.overflowed(caught.value)


def test_the_last_answers_fields_are_returned():
    raw = (b"HTTP/1.1 100 Continue\r\nX-First: 1\r\n\r\n"
           b"HTTP/1.1 206 Partial Content\r\nETag: \"abc\"\r\nContent-Range: bytes 0-9/100\r\n"
           b"x-amz-request-id:  r1 \r\n\r\n")
    assert curlio.parse_head(raw) == {"etag": '"abc"', "content-range": "bytes 0-9/100", "x-amz-request-id": "r1"}


def test_many_transfers_from_many_threads_each_get_their_own_bytes(server):
    """Seeded sizes around the limit, eight threads, a handle each, kept-alive connections reused."""
    rng = random.Random(7)
    for i in range(64):
        _Handler.bodies[f"/{i}"] = os.urandom(rng.choice([1, 4095, 4096, 4097, rng.randrange(1, 70000)]))
    wrong: list[str] = []

    def worker(paths):
        easy = curlio.Easy()
        for path in paths:
            body = _Handler.bodies[path]
            try:
                got = _get(easy, server, path, 65536)[1]
            except curlio.Failed as exc:
                if not (len(body) > 65536 and curlio.overflowed(exc)):
                    wrong.append(f"{path}: {exc.message}")
                continue
            if bytes(got) != body:
                wrong.append(path)

    paths = list(_Handler.bodies) * 3
    rng.shuffle(paths)
    threads = [threading.Thread(target=worker, args=(paths[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_callback_options_are_refused():
    with pytest.raises(ValueError):
        curlio.Easy().setopt(pycurl.WRITEFUNCTION, 0)
