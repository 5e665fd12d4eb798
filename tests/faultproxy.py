"""A fault-injecting HTTP proxy between the daemon and the local S3 endpoint.

Each request passes through unchanged unless the current :class:`Fault` selects it (by request number,
every N-th, or a seeded rate), in which case the proxy answers with the chosen failure instead:

    error500       500 InternalError
    slowdown       503 SlowDown with ``Retry-After: <retry_after>``
    throttle429    429 TooManyRequests
    reset          the connection is reset before any answer
    stall_headers  nothing is sent for ``stall`` seconds, then the connection is closed
    stall_body     headers and half of the body, then ``stall`` seconds of silence, then close
    truncate       headers with the full Content-Length, half of the body, then close
    wrong_range    a ranged answer whose Content-Range (and body) is another range
    full_200       a ranged request answered 200 with the whole object
    drip_body      headers, then the body one byte every ``stall`` seconds
    drip_headers   the status line and headers one byte every ``stall`` seconds
    slow_body      headers, then the body spread evenly over ``stall`` seconds (a slow link that works)
    no_etag        the answer without its ETag header
    other_etag     the answer with another ETag than the one asked for
    flip_body      the request's body passed on with one byte changed (bits rotted on the way up)
    region         301 PermanentRedirect with ``x-amz-bucket-region: <region>`` for a request signed for
                   another region (as S3 answers a wrong --region); requests signed for it pass

Only the requests that match ``methods`` (and, if ``ranged_only``, carry a Range header) are counted.
"""

from __future__ import annotations

import http.client
import http.server
import random
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field

KINDS = ("error500", "slowdown", "throttle429", "reset", "stall_headers", "stall_body", "truncate",
         "wrong_range", "full_200", "denied403", "drip_body", "drip_headers", "slow_body", "no_etag", "other_etag", "region",
         "flip_body")


@dataclass
class Fault:
    kind: str
    at: set[int] = field(default_factory=set)  # 1-based numbers of matching requests
    every: int = 0
    rate: float = 0.0
    seed: int = 0
    methods: tuple[str, ...] = ("GET",)
    ranged_only: bool = True
    retry_after: float = 1.0
    stall: float = 30.0
    region: str = "eu-north-1"

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        self._rng = random.Random(self.seed)

    def selects(self, n: int) -> bool:
        if n in self.at:
            return True
        if self.every and n % self.every == 0:
            return True
        return bool(self.rate) and self._rng.random() < self.rate


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.fault: Fault | None = None
        self.matching = 0
        self.injected = 0
        self.redirects = 0  # answers of the "region" kind that were redirects
        self.delay = 0.0  # seconds every request waits before it is passed on (a distant endpoint)
        self.log: list[tuple[float, str, str, str]] = []  # (time, method, path, what happened)
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                proxy._handle(self)

            do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def set(self, fault: Fault | None) -> None:
        with self._lock:
            self.fault = fault
            self.matching = 0
            self.injected = 0

    def events(self, what: str) -> list[float]:
        return [t for t, _m, _p, w in self.log if w == what]

    # -- request handling ------------------------------------------------------------------------------

    def _choose(self, method: str, headers: http.client.HTTPMessage) -> str | None:
        with self._lock:
            fault = self.fault
            if fault is None or method not in fault.methods or (fault.ranged_only and "Range" not in headers):
                return None
            self.matching += 1
            if not fault.selects(self.matching):
                return None
            self.injected += 1
            return fault.kind

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        if self.delay:
            time.sleep(self.delay)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        kind = self._choose(h.command, h.headers)
        fault = self.fault
        self.log.append((time.monotonic(), h.command, h.path, kind or "pass"))
        if kind == "reset":
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.close_connection = True
            h.connection.close()
            return
        if kind == "stall_headers":
            time.sleep(fault.stall if fault else 30)
            h.close_connection = True
            return
        if kind == "region" and fault and f"/{fault.region}/s3/" not in h.headers.get("Authorization", ""):
            with self._lock:
                self.redirects += 1
            xml = b"<?xml version='1.0'?><Error><Code>PermanentRedirect</Code><Message>injected</Message></Error>"
            h.send_response(301)
            h.send_header("x-amz-bucket-region", fault.region)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(xml)))
            h.end_headers()
            h.wfile.write(xml)
            return
        if kind in ("error500", "slowdown", "throttle429", "denied403"):
            status, code = {"error500": (500, "InternalError"), "slowdown": (503, "SlowDown"),
                            "throttle429": (429, "TooManyRequests"), "denied403": (403, "AccessDenied")}[kind]
            xml = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
            h.send_response(status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(xml)))
            if kind == "slowdown" and fault:
                h.send_header("Retry-After", f"{fault.retry_after:g}")
            h.end_headers()
            h.wfile.write(xml)
            return

        headers = {k: v for k, v in h.headers.items()}
        if kind == "full_200":
            headers.pop("Range", None)
        if kind == "wrong_range":
            first, _, last = headers["Range"].removeprefix("bytes=").partition("-")
            shift = 1 if int(first) == 0 else -1
            headers["Range"] = f"bytes={int(first) + shift}-{int(last) + shift}"
        if kind == "flip_body" and body:
            at = len(body) // 2
            body = body[:at] + bytes([body[at] ^ 0x20]) + body[at + 1:]
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        try:
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except ConnectionRefusedError:  # the endpoint behind is down: so is the proxy, to the client
            h.close_connection = True
            return
        finally:
            conn.close()
        if kind == "drip_headers":
            head = f"HTTP/1.1 {resp.status} {resp.reason}\r\nContent-Length: {len(data)}\r\n".encode()
            _drip(h, head, fault.stall if fault else 1.5)
            h.close_connection = True
            return
        h.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() in ("transfer-encoding", "connection", "content-length"):
                continue
            if k.lower() == "etag" and kind == "no_etag":
                continue
            h.send_header(k, '"0123456789abcdef0123456789abcdef"' if k.lower() == "etag" and kind == "other_etag" else v)
        if h.command == "HEAD":  # (the size of what a GET would answer)
            h.send_header("Content-Length", resp.getheader("Content-Length") or "0")
            h.end_headers()
            return
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if kind == "drip_body":
            _drip(h, data, fault.stall if fault else 1.5)
            h.close_connection = True
            return
        if kind == "slow_body":
            piece = max(1, len(data) // 64)
            for at in range(0, len(data), piece):
                h.wfile.write(data[at:at + piece])
                h.wfile.flush()
                time.sleep((fault.stall if fault else 1.5) * piece / max(1, len(data)))
            return
        if kind == "truncate":
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        if kind == "stall_body":
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            time.sleep(fault.stall if fault else 30)
            h.close_connection = True
            return
        h.wfile.write(data)


def _drip(h: http.server.BaseHTTPRequestHandler, data: bytes, interval: float) -> None:
    """Send ``data`` one byte every ``interval`` seconds, until the client goes away."""
    try:
        for i in range(len(data)):
            h.wfile.write(data[i:i + 1])
            h.wfile.flush()
            time.sleep(interval)
    except OSError:
        pass
