"""The daemon's end of the control channel through the mount (:mod:`.frames`): the ioctls of the mount's
control file become sessions, each a stream the control server answers exactly as it answers a
connection of its socket (:meth:`epochfs.control.server.ControlServer.serve_stream`), with the caller
the kernel named in the ioctl's header.

Bounded like the socket: at most :data:`MountChannel.MAX_SESSIONS` sessions at once and
:data:`MountChannel.PER_UID` of one uid (operators aside), request bytes taken only as the server reads
them (:data:`MountChannel.BUFFER` waiting at most), reply bytes held only until the client reads them,
and a session nobody has used for :data:`MountChannel.IDLE` seconds is ended. A session belongs to the
uid that opened it: a frame of another uid naming it is answered as if it did not exist. A frame is
answered within :data:`MountChannel.RECV_WAIT` seconds (``WAIT``: ask again), so no request of the
mount waits long on the channel. All state lives on the trio thread.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from epochfs.control import frames as f
from epochfs.control.caller import Caller

log = logging.getLogger(__name__)

Serve = Callable[["SessionStream", Caller], Awaitable[None]]


class _Session:
    def __init__(self, sid: bytes, caller: Caller) -> None:
        self.sid = sid
        self.caller = caller
        self.inbox = bytearray()  # request bytes the server has not read yet
        self.outbox = bytearray()  # reply bytes the client has not read yet
        self.sent_all = False  # the client has begun to read the reply: nothing more comes in
        self.answered = False  # the server is done with the session
        self.used = trio.current_time()
        self.scope = trio.CancelScope()
        self.lock = trio.Lock()  # one frame at a time
        self._changed = trio.Event()

    def poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()


class SessionStream:
    """A session as the control server sees a connection: bytes in, bytes out."""

    def __init__(self, session: _Session, limit: int) -> None:
        self._s = session
        self._limit = limit

    async def receive_some(self, max_bytes: int = 1 << 16) -> bytes:
        s = self._s
        await s.until(lambda: bool(s.inbox) or s.sent_all)
        data = bytes(s.inbox[:max_bytes])
        del s.inbox[:max_bytes]
        s.poke()
        return data

    async def send_all(self, data: bytes) -> None:
        s = self._s
        view = memoryview(data)
        while view:
            await s.until(lambda: len(s.outbox) < self._limit)
            take = self._limit - len(s.outbox)
            s.outbox += view[:take]
            view = view[take:]
            s.poke()


class MountChannel:
    MAX_SESSIONS = 64
    PER_UID = 16  # (a node's ranks of one job, each handing over and reporting at once)
    BUFFER = 1 << 20  # request bytes, and reply bytes, a session holds at most
    IDLE = 60.0  # seconds a session may go unused
    RECV_WAIT = 10.0  # seconds one frame waits for reply bytes
    SEND_WAIT = 60.0  # seconds one frame waits for the server to take bytes

    def __init__(self, serve: Serve, caller_of: Callable[[int, int, int], Caller]) -> None:
        self.serve = serve
        self.caller_of = caller_of
        self._sessions: dict[bytes, _Session] = {}
        self._nursery: trio.Nursery | None = None
        self.refused = 0  # sessions refused for the bounds

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:
                    await trio.sleep(self.IDLE / 4)
                    self._sweep()
            finally:
                self._nursery = None

    def _sweep(self) -> None:
        now = trio.current_time()
        for s in list(self._sessions.values()):
            if now - s.used > self.IDLE:
                self._end(s)

    def _end(self, s: _Session) -> None:
        s.scope.cancel()
        s.answered = True
        s.poke()
        if self._sessions.get(s.sid) is s:
            del self._sessions[s.sid]

    async def call(self, uid: int, gid: int, pid: int, data: bytes) -> bytes:
        """The answer to one frame from the caller the kernel names (``uid``, ``gid``, ``pid``)."""
        try:
            sid, kind, payload = f.parse_in(data)
        except f.BadFrame as exc:
            return f.frame_out(f.FAILED, f"malformed frame: {exc}".encode())
        s = self._sessions.get(sid)
        if s is not None and s.caller.uid != uid:
            s = None  # (another uid's session: as if there were none)
        if kind == f.CLOSE:
            if s is not None:
                self._end(s)
            return f.frame_out(f.END)
        if s is None:
            if kind != f.SEND:
                return f.frame_out(f.FAILED, b"no such session (it ended, or was idle too long)")
            if sid in self._sessions:
                return f.frame_out(f.FAILED, b"that session id is taken; choose another")
            s, refusal = self._open(sid, uid, gid, pid)
            if s is None:
                return f.frame_out(f.BUSY if refusal.startswith("busy") else f.FAILED, refusal.encode())
        s.used = trio.current_time()
        async with s.lock:
            out = await (self._send(s, payload) if kind == f.SEND else self._receive(s))
        s.used = trio.current_time()
        return out

    def _open(self, sid: bytes, uid: int, gid: int, pid: int) -> tuple[_Session | None, str]:
        caller = self.caller_of(uid, gid, pid)
        mine = sum(1 for s in self._sessions.values() if s.caller.uid == uid)
        if len(self._sessions) >= self.MAX_SESSIONS or (not caller.operator and mine >= self.PER_UID):
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                log.warning("control: refused a session of uid %d: %d open (%d of that uid); %d refused so far", uid,
                            len(self._sessions), mine, self.refused)
            return None, "busy: the daemon has as many requests open as it takes (of this user, or in all); retry"
        if self._nursery is None:
            return None, "the daemon is stopping"
        s = _Session(sid, caller)
        self._sessions[sid] = s
        self._nursery.start_soon(self._answer, s)
        return s, ""

    async def _answer(self, s: _Session) -> None:
        try:
            with s.scope:
                await self.serve(SessionStream(s, self.BUFFER), s.caller)
        except Exception:  # the last line of defence: a session never takes the daemon down
            log.exception("control: unexpected error serving a session through the mount")
        finally:
            s.answered = True
            s.poke()

    async def _send(self, s: _Session, payload: bytes) -> bytes:
        if s.answered or s.sent_all:
            return f.frame_out(f.STOP)
        with trio.move_on_after(self.SEND_WAIT):
            await s.until(lambda: len(s.inbox) < self.BUFFER or s.answered)
        if s.answered:
            return f.frame_out(f.STOP)
        if len(s.inbox) >= self.BUFFER:
            self._end(s)
            return f.frame_out(f.FAILED, b"the daemon did not take the request in time")
        s.inbox += payload
        s.poke()
        return f.frame_out(f.TAKEN)

    async def _receive(self, s: _Session) -> bytes:
        if not s.sent_all:
            s.sent_all = True
            s.poke()
        with trio.move_on_after(self.RECV_WAIT):
            await s.until(lambda: bool(s.outbox) or s.answered)
        if not s.outbox:
            if not s.answered:
                return f.frame_out(f.WAIT)
            self._end(s)
            return f.frame_out(f.END)
        data = bytes(s.outbox[:f.REPLY_PAYLOAD])
        del s.outbox[:f.REPLY_PAYLOAD]
        s.poke()
        if s.answered and not s.outbox:
            self._end(s)
            return f.frame_out(f.END, data)
        return f.frame_out(f.MORE, data)
