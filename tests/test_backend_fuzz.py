"""A fuzz loop over what an S3 endpoint answers to block GETs: random statuses, headers and bodies.

Whatever the endpoint sends, a block read returns exactly the asked-for bytes of the pinned version or
raises one of epochfs's errors, within its deadline; and nothing an answer says leaves the client
unable to read from an honest endpoint afterwards (the region it signs for, a credential reset).
Bodies are never altered in place: bytes that arrive with every check passing are the server's word
(TLS guards them on the wire)."""

from __future__ import annotations

import http.server
import random
import re
import threading
import time

import pytest

from epochfs.backend import BackendSettings
from epochfs.backend.s3 import S3Backend
from epochfs.core.errors import EpochfsError
from epochfs.daemon.config import Source
from epochfs.dev.sample import pattern

KEY = "obj.bin"
SIZE = 3 << 20
ETAG = '"0123456789abcdef0123456789abcdef"'
DATA = pattern(KEY, 0, 0, SIZE)
_RANGE = re.compile(r"bytes=(\d+)-(\d+)")
_STATUSES = [200, 206, 206, 206, 204, 301, 304, 307, 400, 403, 404, 409, 412, 416, 429, 500, 503, 599, 999]
_CODES = ["SlowDown", "AccessDenied", "NoSuchKey", "PreconditionFailed", "InternalError", "ExpiredToken",
          "PermanentRedirect", "AuthorizationHeaderMalformed", "x" * 200, "<", ""]


def _junk(rng: random.Random, n: int) -> str:
    return "".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(n + 1)))


class Hostile:
    """An endpoint whose answers are honest (mode ``honest``) or random mutations of an honest answer."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.honest = False
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def do_GET(self) -> None:
                m = _RANGE.fullmatch(self.headers.get("Range", ""))
                first, last = (int(m.group(1)), int(m.group(2))) if m else (0, SIZE - 1)
                with outer.lock:
                    status, headers, body = outer.answer(first, min(last, SIZE - 1))
                try:
                    self.send_response_only(status)
                    for name, value in headers:
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"

    def answer(self, first: int, last: int) -> tuple[int, list[tuple[str, str]], bytes]:
        body = DATA[first:last + 1]
        honest = [("ETag", ETAG), ("Content-Range", f"bytes {first}-{last}/{SIZE}")]
        if self.honest:
            return 206, [*honest, ("Content-Length", str(len(body)))], body
        r = self.rng
        status = r.choice(_STATUSES)
        headers = list(honest)
        for _ in range(r.randrange(4)):  # mutate, drop, duplicate or add headers
            what = r.randrange(8)
            if what == 0 and headers:
                headers.pop(r.randrange(len(headers)))
            elif what == 1:
                headers.append(("ETag", r.choice([ETAG, '"other"', "", _junk(r, 40), ETAG.strip('"')])))
            elif what == 2:
                a, b = r.randrange(-2, SIZE + 2), r.randrange(-2, SIZE + 2)
                headers.append(("Content-Range", r.choice([f"bytes {a}-{b}/{SIZE}", f"bytes {first}-{last}/*",
                                                           f"bytes {first}-{last}", _junk(r, 30)])))
            elif what == 3:
                headers.append(("Retry-After", r.choice(["0", "0.2", "-5", "nan", "inf", "1e308", _junk(r, 8)])))
            elif what == 4:
                headers.append(("x-amz-bucket-region", r.choice(["eu-west-1", "", "a:b:c", "us east",
                                                                 _junk(r, 50), "x" * 100])))
            elif what == 5:
                headers = [(n.lower() if r.random() < 0.5 else n.upper(), v) for n, v in headers]
            elif what == 6:
                headers.append((_junk(r, 10).replace(":", "") or "X", _junk(r, 40)))
            else:
                headers.append(("Content-Type", "application/xml"))
        shape = r.randrange(6)
        if shape == 0:  # an error document, maybe with a region in it
            body = (f"<?xml version='1.0'?><Error><Code>{r.choice(_CODES)}</Code>"
                    f"<Region>{r.choice(['eu-west-1', 'ap-south-1', _junk(r, 20)])}</Region></Error>").encode()
        elif shape == 1:  # shorter
            body = body[:r.randrange(len(body) + 1)]
        elif shape == 2:  # longer: the bytes after the range
            body = DATA[first:min(SIZE, last + 1 + r.randrange(1, 5000))] + b"\0" * r.randrange(2)
        elif shape == 3:  # another range of the object, same length, and an answer that says so
            shift = r.choice([-1, 1]) * r.randrange(1, 4096)
            lo = max(0, min(SIZE - len(body), first + shift))
            if lo != first:
                body = DATA[lo:lo + len(body)]
                headers = [(n, f"bytes {lo}-{lo + len(body) - 1}/{SIZE}") if n.lower() == "content-range" else (n, v)
                           for n, v in headers]
        framing = r.randrange(4)
        if framing == 0:
            headers.append(("Content-Length", str(len(body))))
        elif framing == 1:  # a Content-Length that disagrees with the body
            headers.append(("Content-Length", str(max(0, len(body) + r.randrange(-100, 100)))))
        # otherwise no Content-Length: the body ends when the connection closes
        return status, headers, body

    def stop(self) -> None:
        self.server.shutdown()


@pytest.fixture
def credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fuzz")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fuzz-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.mark.parametrize("engine", ["curl", "stream"])
@pytest.mark.parametrize("seed", range(2))
def test_random_answers_give_the_exact_bytes_or_an_error_within_the_deadline(credentials, seed, engine):
    """Both engines of block GETs: ranges shorter than STREAM_MIN through libcurl, longer ones through
    epochfs.transport.httpio."""
    from epochfs.backend.s3 import STREAM_MIN

    endpoint = Hostile(seed)
    timeout = 0.8
    backend = S3Backend(BackendSettings(Source.parse("s3://bucket/"), endpoint_url=endpoint.endpoint,
                                        timeout=timeout, attempts=3))
    rng = random.Random(seed)
    served = failed = 0
    try:
        for _ in range(120):
            if engine == "curl":
                start = rng.randrange(SIZE)
                length = rng.randrange(1, min(SIZE - start, 200_000) + 1)
            else:
                length = rng.randrange(STREAM_MIN, STREAM_MIN + 600_000)
                start = rng.randrange(SIZE - length)
            began = time.monotonic()
            try:
                data = backend.read_range(KEY, ETAG, start, length)
            except EpochfsError:
                failed += 1
            else:
                served += 1
                assert bytes(data) == DATA[start:start + length]
            assert time.monotonic() - began < timeout + 1.0
            # Whatever region an answer named, the client still signs for a well-formed one.
            assert re.fullmatch(r"[a-z0-9-]{2,40}", backend._region), backend._region
        # Nothing the endpoint said leaves the client unable to read from it once it is honest.
        endpoint.honest = True
        for start, length in [(0, 100), (SIZE - 7, 7), (12345, 65536), (5, STREAM_MIN), (0, SIZE)]:
            assert bytes(backend.read_range(KEY, ETAG, start, length)) == DATA[start:start + length]
    finally:
        backend.close()
        endpoint.stop()
    assert served and failed  # the loop exercised both outcomes


def _listing_entry(r: random.Random, i: int) -> tuple[str, bool]:
    """One <Contents> of a listing under prefix ``p/``, and whether an honest reader keeps it."""
    fields = {"Key": f"p/k{i}", "Size": str(r.randrange(10**6)), "ETag": f'"{i:032x}"',
              "LastModified": "2026-01-01T00:00:00.000Z"}
    keep = True
    for _ in range(r.choice([0, 0, 1, 2])):
        name = r.choice(list(fields))
        value = r.choice([None, "", "-1", str(1 << 47), "abc", "1e3", _junk(r, 30), "x" * 5000,
                          "9999-12-31T23:59:59.000Z", "0001-01-01T00:00:00.000Z", "other/k", "p/"])
        if value is None:
            del fields[name]
        else:
            fields[name] = value.replace("<", "").replace("&", "")
        keep = False  # whether it is still servable is the code's to decide; it must not break the rest
    body = "".join(f"<{k}>{v}</{k}>" for k, v in fields.items())
    return f"<Contents>{body}</Contents>", keep


@pytest.mark.parametrize("seed", range(2))
def test_random_listings_give_servable_objects_or_an_error(credentials, seed):
    """A listing's entries reach the stores only within their bounds; an answer that is not a listing
    is an error of epochfs's own (a mount reports it, a refresh keeps the snapshot it has)."""
    from epochfs.backend.base import listing_problem
    from epochfs.meta.base import decode_objects, encode_objects
    from epochfs.meta.index import build as build_namespace

    rng = random.Random(seed)
    state = {"xml": ""}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            body = state["xml"].encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    backend = S3Backend(BackendSettings(Source.parse("s3://bucket/p/"), endpoint_url=f"http://127.0.0.1:{server.server_port}",
                                        timeout=2.0, attempts=1))
    outcomes = {"listed": 0, "refused": 0}
    try:
        for _ in range(150):
            entries = [_listing_entry(rng, i) for i in range(rng.randrange(1, 6))]
            state["xml"] = ('<?xml version="1.0"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                            "<Name>bucket</Name><Prefix>p/</Prefix><IsTruncated>false</IsTruncated>"
                            + "".join(e for e, _ in entries) + "</ListBucketResult>")
            try:
                objects = list(backend.list_objects())
            except EpochfsError:
                outcomes["refused"] += 1
                continue
            outcomes["listed"] += 1
            keys = {o.key for o in objects}
            assert {f"k{i}" for i, (_, keep) in enumerate(entries) if keep} <= keys  # nothing honest lost
            for o in objects:
                assert listing_problem(o) is None and -(1 << 63) <= o.mtime_ns < 1 << 63
            assert decode_objects(encode_objects(objects)) == objects  # every store can hold them
            build_namespace(objects)
    finally:
        backend.close()
        server.shutdown()
    assert outcomes["listed"] and outcomes["refused"]
