"""``benchmarks/shared/latency_proxy.py`` in a process of its own (:class:`ProxyProcess`), as every benchmark
runs it: it forwards both ways, holds each answer for its delay, and never outlives the process that
started it (stopped, or that process gone without stopping it)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "shared"))
import latency_proxy  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402

DELAY = 0.15


@pytest.fixture
def upstream():
    """A server on 127.0.0.1 that answers each request with its bytes reversed, until the client closes."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data[::-1])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.close()


def ask(port: int, request: bytes) -> tuple[bytes, float]:
    """The answer to ``request`` on a new connection to ``port``, and the seconds it took."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        answer = b""
        while len(answer) < len(request):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer, time.monotonic() - started


def test_the_proxy_forwards_and_holds_each_answer_for_its_delay(upstream):
    proxy = ProxyProcess(upstream, DELAY)
    try:
        assert proxy.endpoint == f"http://127.0.0.1:{proxy.port}"
        answer, seconds = ask(proxy.port, b"0123456789")
        assert answer == b"9876543210"
        # a new connection waits the delay before it is connected upstream, and the answer the delay again
        assert seconds >= 2 * DELAY * 0.9
        direct, _ = ask(upstream, b"ab")
        assert direct == b"ba"
    finally:
        proxy.stop()
    assert proxy._proc.returncode is not None


def test_the_proxy_ends_when_the_process_that_started_it_is_gone(upstream):
    proxy = ProxyProcess(upstream, 0.0)
    assert proxy._proc.stdin is not None
    proxy._proc.stdin.close()  # what the kernel does when the benchmark dies without stopping it
    proxy._proc.wait(10)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2).close()


def test_a_proxy_that_cannot_start_says_so(monkeypatch):
    monkeypatch.setattr(latency_proxy.sys, "executable", "/bin/false")  # a child that exits at once, silent
    with pytest.raises(RuntimeError, match="did not start"):
        ProxyProcess(1, 0.0)
