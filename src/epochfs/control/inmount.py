"""The daemon's end of the control channel through the mount (:mod:`.frames`): the ioctls of the mount's
control file become sessions, each a stream the control server answers exactly as it answers a
connection of its socket (:meth:`epochfs.control.server.ControlServer.serve_stream`), with the caller
the kernel named in the ioctl's header.

Bounded like the socket: at most :data:`MountChannel.MAX_SESSIONS` sessions at once and
:data:`MountChannel.PER_UID` of one person (operators aside), request bytes taken only as the server reads
them (:data:`MountChannel.BUFFER` waiting at most), reply bytes held only until the client reads them;
a session nobody has used for :data:`MountChannel.IDLE` seconds is ended, and so is any session
:data:`MountChannel.LIFETIME` seconds after it opened, used or not (one that drips a byte now and then
holds nothing for long). A session belongs to the uid that opened it: a frame of another uid naming it
is answered as if it did not exist. A frame is answered within :data:`MountChannel.RECV_WAIT` seconds
(``WAIT``: ask again), so no request of the mount waits long on the channel.

**Fair when full.** A person is a uid, or, for the uids a user namespace maps from a user's range in
``/etc/subuid`` (root's file: its users cannot write it), that user: the thousands of uids one person can
assume count as one. When the sessions are all taken, a newcomer whose person holds fewer sessions than
some other person takes the oldest session of the person holding the most (that session ends, its
client is told it ended); a newcomer whose person already holds as many as anybody is told busy. So no
set of uids one person has, nor any number of people each holding a few, keeps anybody else out: each
person gets a session as soon as it asks. All state lives on the trio thread.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
from collections import Counter
from collections.abc import Awaitable, Callable

import trio

from epochfs.control import frames as f
from epochfs.control.caller import Caller

log = logging.getLogger(__name__)

Serve = Callable[["SessionStream", Caller], Awaitable[None]]


SUBUID = "/etc/subuid"


class People:
    """Who a uid is: the user whose ``/etc/subuid`` range holds it (a user namespace's uids), else the
    uid itself. The file is read again when it changes, and trusted only as root's and writable by
    nobody else (any other is ignored, with a warning once)."""

    MAX_RANGES = 65536

    def __init__(self, path: str = SUBUID) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime) of the file read
        self._ranges: list[tuple[int, int, int]] = []  # (first, end, owner uid)
        self._warned = False

    def of(self, uid: int) -> int:
        self._refresh()
        for first, end, owner in self._ranges:
            if first <= uid < end:
                return owner
        return uid

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self._ranges = None, []
            return
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key == self._seen:
            return
        self._seen, self._ranges = key, []
        if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or not stat.S_ISREG(st.st_mode):
            if not self._warned:
                log.warning("control: %s is not root's own file; its ranges are not used to tell people apart",
                            self.path)
                self._warned = True
            return
        try:
            with open(self.path, "rb") as f:
                text = f.read(1 << 22).decode("utf-8", "replace")
        except OSError:
            return
        for line in text.splitlines()[:self.MAX_RANGES]:
            name, _, rest = line.strip().partition(":")
            first, _, count = rest.partition(":")
            if not (first.isdigit() and count.isdigit()) or line.startswith("#"):
                continue
            owner = int(name) if name.isdigit() else _uid_of(name)
            if owner is not None:
                self._ranges.append((int(first), int(first) + int(count), owner))


def _uid_of(name: str) -> int | None:
    try:
        return pwd.getpwnam(name).pw_uid
    except (KeyError, OSError):
        return None


class _Session:
    def __init__(self, sid: bytes, caller: Caller, person: int) -> None:
        self.sid = sid
        self.caller = caller
        self.person = person
        self.opened = trio.current_time()
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
    LIFETIME = 300.0  # seconds a session lives at most, used or not
    RECV_WAIT = 10.0  # seconds one frame waits for reply bytes
    SEND_WAIT = 60.0  # seconds one frame waits for the server to take bytes

    def __init__(self, serve: Serve, caller_of: Callable[[int, int, int], Caller], *,
                 people: People | None = None) -> None:
        self.serve = serve
        self.caller_of = caller_of
        self.people = people if people is not None else People()
        self.taken = 0  # sessions ended for a newcomer whose person held fewer
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
            if now - s.used > self.IDLE or now - s.opened > self.LIFETIME:
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
        person = -1 if caller.operator else self.people.of(uid)  # (operators: one person, never bounded)
        held = Counter(s.person for s in self._sessions.values())
        mine = held[person]
        if (not caller.operator and mine >= self.PER_UID) or (
                len(self._sessions) >= self.MAX_SESSIONS and not self._make_room(held, mine)):
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                log.warning("control: refused a session of uid %d: %d open (%d of that user's); %d refused so far",
                            uid, len(self._sessions), mine, self.refused)
            return None, "busy: the daemon has as many requests open as it takes (of this user, or in all); retry"
        if self._nursery is None:
            return None, "the daemon is stopping"
        s = _Session(sid, caller, person)
        self._sessions[sid] = s
        self._nursery.start_soon(self._answer, s)
        return s, ""

    def _make_room(self, held: Counter[int], mine: int) -> bool:
        """End the oldest session of the person holding the most, if that is more than ``mine`` (the
        newcomer's person's count); whether one was ended."""
        users = [(person, n) for person, n in held.items() if person != -1]  # (operators' are never taken)
        if not users:
            return False
        most, count = max(users, key=lambda kv: kv[1])
        if count <= mine:
            return False
        oldest = min((s for s in self._sessions.values() if s.person == most), key=lambda s: s.opened)
        self.taken += 1
        if self.taken == 1 or self.taken % 100 == 0:
            log.warning("control: ended a session of uid %d (its user held %d of the %d) for a user holding %d; "
                        "%d so far", oldest.caller.uid, count, len(self._sessions), mine, self.taken)
        self._end(oldest)
        return True

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
