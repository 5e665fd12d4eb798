"""A userspace TCP proxy that adds latency (and optionally caps bandwidth) on the way to the endpoint.

This kernel has no netem, so the delay is added here: every new connection waits ``delay`` before it
is connected upstream, and every response (the first bytes the server sends after the client sent a
request) is held for ``delay``. With ``delay=0`` it measures its own overhead.

A benchmark runs it in a process of its own (:class:`ProxyProcess`): in the benchmark's process it
would share one interpreter lock with the readers it measures, and every contender's round trip would
wait for the readers' Python as well as for the delay (16 threads of raw boto3 GETs through a 20 ms
proxy: 390 GETs/s with the proxy in their process, 560 with it in its own).

It can also join two network namespaces (``listen_ns``, ``upstream_ns``: paths such as
``/var/run/netns/NAME``): it listens in one and connects in the other, each socket made while its
thread is in that namespace. ``benchmarks/cluster/clusterbox.py`` puts the object store behind a shaped link
this way (listening in the store's namespace, SeaweedFS on the machine's loopback), and reaches a
Prometheus in a namespace from the machine's.

    python benchmarks/shared/latency_proxy.py UPSTREAM_PORT DELAY_MS
    python benchmarks/shared/latency_proxy.py --listen ADDR:PORT --listen-ns NS --upstream ADDR:PORT [--upstream-ns NS] [--delay-ms N]
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def netns(path: str | None) -> Iterator[None]:
    """This thread in the network namespace at ``path`` (None: where it is) until the block ends."""
    if path is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(there, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {path}: {os.strerror(err)}")
        try:
            yield
        finally:
            if libc.setns(here, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(here)
        os.close(there)


class LatencyProxy:
    def __init__(self, upstream_port: int, delay: float = 0.0, bandwidth: float | None = None, *,
                 listen: tuple[str, int] = ("127.0.0.1", 0), listen_ns: str | None = None,
                 upstream_host: str = "127.0.0.1", upstream_ns: str | None = None) -> None:
        self.upstream_port = upstream_port
        self.delay = delay
        self.bandwidth = bandwidth
        self.listen, self.listen_ns = listen, listen_ns
        self.upstream_host, self.upstream_ns = upstream_host, upstream_ns
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://{self.listen[0]}:{self.port}"

    def start(self) -> LatencyProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._shutdown)
            self._thread.join(10)

    def _shutdown(self) -> None:
        assert self._loop is not None
        self._server.close()
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        self._loop.call_later(0.1, self._loop.stop)

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        with netns(self.listen_ns):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(self.listen)
        sock.listen(512)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._client, sock=sock))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _client(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        if self.delay:
            await asyncio.sleep(self.delay)
        try:
            with netns(self.upstream_ns):
                usock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            usock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(usock, (self.upstream_host, self.upstream_port))
            except OSError:
                usock.close()
                raise
            usock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ureader, uwriter = await asyncio.open_connection(sock=usock)
        except OSError:
            cwriter.close()
            return
        state = {"request_pending": False}

        async def upstream() -> None:
            while data := await creader.read(1 << 16):
                state["request_pending"] = True
                uwriter.write(data)
                await uwriter.drain()
            uwriter.close()

        async def downstream() -> None:
            while data := await ureader.read(1 << 16):
                if state["request_pending"] and self.delay:
                    state["request_pending"] = False
                    await asyncio.sleep(self.delay)
                state["request_pending"] = False
                if self.bandwidth:
                    await asyncio.sleep(len(data) / self.bandwidth)
                cwriter.write(data)
                await cwriter.drain()
            cwriter.close()

        try:
            await asyncio.gather(upstream(), downstream())
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (cwriter, uwriter):
                w.close()


def spawn(args: list[str], **popen: Any) -> tuple[subprocess.Popen[str], str]:
    """This proxy started as a child process with the command-line ``args`` (``popen``: more for
    :class:`subprocess.Popen`), once it listens, and the endpoint it listens at. RuntimeError, the child
    ended, if it does not start."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], stdout=subprocess.PIPE,
                            text=True, **popen)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("proxy on http://"):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the latency proxy did not start (it said {line!r})")
    return proc, line.split()[-1]


class ProxyProcess:
    """A :class:`LatencyProxy` to ``127.0.0.1:upstream_port`` in a child process (see the module's
    text): ``endpoint`` and ``stop()`` as the in-process one."""

    def __init__(self, upstream_port: int, delay: float = 0.0) -> None:
        self.delay = delay
        self._proc, self.endpoint = spawn(["--upstream", f"127.0.0.1:{upstream_port}", "--delay-ms",
                                           repr(delay * 1000), "--until-eof"], stdin=subprocess.PIPE)
        self.port = int(self.endpoint.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def main() -> None:
    import argparse
    import signal

    if len(sys.argv) == 3 and all(a.replace(".", "").isdigit() for a in sys.argv[1:]):  # UPSTREAM_PORT DELAY_MS
        sys.argv[1:] = ["--upstream", f"127.0.0.1:{sys.argv[1]}", "--delay-ms", sys.argv[2]]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", default="127.0.0.1:0", metavar="ADDR:PORT")
    ap.add_argument("--listen-ns", metavar="PATH", help="the network namespace to listen in")
    ap.add_argument("--upstream", required=True, metavar="ADDR:PORT")
    ap.add_argument("--upstream-ns", metavar="PATH", help="the network namespace to connect in")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--until-eof", action="store_true",
                    help="exit when standard input closes (the process that started it ended)")
    args = ap.parse_args()
    lhost, _, lport = args.listen.rpartition(":")
    uhost, _, uport = args.upstream.rpartition(":")
    proxy = LatencyProxy(int(uport), args.delay_ms / 1000, listen=(lhost, int(lport)), listen_ns=args.listen_ns,
                         upstream_host=uhost, upstream_ns=args.upstream_ns).start()
    print(f"proxy on {proxy.endpoint}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.until_eof:
        sys.stdin.read()
        return
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
