"""A userspace TCP proxy that adds latency (and optionally caps bandwidth) on the way to the endpoint.

This kernel has no netem, so the delay is added here: every new connection waits ``delay`` before it
is connected upstream, and every response (the first bytes the server sends after the client sent a
request) is held for ``delay``. With ``delay=0`` it measures its own overhead.
"""

from __future__ import annotations

import asyncio
import threading
import time


class LatencyProxy:
    def __init__(self, upstream_port: int, delay: float = 0.0, bandwidth: float | None = None) -> None:
        self.upstream_port = upstream_port
        self.delay = delay
        self.bandwidth = bandwidth
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
        self._server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _client(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        if self.delay:
            await asyncio.sleep(self.delay)
        try:
            ureader, uwriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
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


if __name__ == "__main__":
    import sys

    proxy = LatencyProxy(int(sys.argv[1]), float(sys.argv[2]) / 1000).start()
    print(f"proxy on {proxy.endpoint}", flush=True)
    while True:
        time.sleep(3600)
