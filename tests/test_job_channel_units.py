"""The control channel through the mount and the caller's rights, without a mount: the frames, the
sessions (:class:`MountChannel`), the permission decision, the checks of what a caller may read, and
what the prefetcher, the jobs' view and the server refuse a user who is not an operator."""

from __future__ import annotations

import os
import random
from collections import namedtuple

import pytest
import trio

from epochfs.control import frames as f
from epochfs.control import protocol as p
from epochfs.control.caller import RIGHTS, Caller, allowed, groups_of_task, operator_of
from epochfs.control.inmount import MountChannel, People
from epochfs.control.jobs import MAX_ENTRIES_PER_UID, Jobs, JobTaken, Report
from epochfs.control.server import ControlServer
from epochfs.core.access import PathAccess
from epochfs.core.errors import NotPermitted

from .test_scheduler import BS, objs, with_prefetcher

ALICE = Caller(1001, 1001, frozenset({1001}), 11)
BOB = Caller(1002, 1002, frozenset({1002}), 12)


# -- frames -----------------------------------------------------------------------------------------------

def test_frames_carry_their_bytes_and_anything_else_is_refused_never_raised():
    sid = os.urandom(16)
    frame = f.frame_in(sid, f.SEND, b"x" * f.PAYLOAD)
    assert len(frame) == f.FRAME and f.parse_in(bytes(frame)) == (sid, f.SEND, b"x" * f.PAYLOAD)
    assert f.parse_out(f.frame_out(f.END, b"reply")) == (f.END, b"reply")
    with pytest.raises(ValueError):
        f.frame_in(sid, f.SEND, b"x" * (f.PAYLOAD + 1))
    rng = random.Random(5)
    for _ in range(3000):
        raw = bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 3, 23, 24, 25, 200, f.FRAME])))
        for parse in (f.parse_in, f.parse_out):
            try:
                parse(raw)
            except f.BadFrame:
                pass
    assert f.COMMAND >> 30 == 3 and (f.COMMAND >> 16) & 0x3FFF == f.FRAME  # _IOWR: the kernel copies both ways


# -- who may do what --------------------------------------------------------------------------------------

def test_the_permission_decision_is_the_kernels():
    assert allowed(0o640, 1001, 50, ALICE, 4)  # owner bits
    assert not allowed(0o440, 1001, 50, ALICE, 2)
    assert not allowed(0o044, 1001, 1002, ALICE, 4)  # the owner's bits decide for the owner, not "other"
    member = Caller(1003, 7, frozenset({50}))
    assert allowed(0o640, 1001, 50, member, 4) and not allowed(0o600, 1001, 50, member, 4)  # a supplementary group
    assert allowed(0o604, 1001, 50, BOB, 4) and not allowed(0o640, 1001, 50, BOB, 4)
    assert allowed(0o000, 5, 5, Caller(0, 0), 4)  # root reads and searches anything
    assert allowed(0o555, 5, 5, BOB, 1) and not allowed(0o444, 5, 5, BOB, 1)


def test_operators_are_root_the_daemons_user_and_the_control_group():
    assert operator_of(0, 0, frozenset(), None) and operator_of(os.geteuid(), 0, frozenset(), None)
    assert not operator_of(4242, 4242, frozenset({7}), None)
    assert operator_of(4242, 4242, frozenset({7}), 7) and operator_of(4242, 7, frozenset(), 7)
    assert set(RIGHTS) == set(p.OPERATIONS), "every operation has its right in the table"


def test_a_tasks_groups_are_read_only_for_its_own_uid():
    mine = groups_of_task(os.getpid(), os.geteuid())
    assert set(os.getgroups()) <= mine | {os.getegid()}
    assert groups_of_task(os.getpid(), os.geteuid() + 1) == frozenset()  # a pid of another uid grants nothing
    assert groups_of_task(2**22 + 12345, 0) == frozenset()  # gone


Node = namedtuple("Node", "path is_dir mode uid gid")


def test_a_name_is_readable_only_through_directories_the_caller_may_search():
    tree = {"": Node("", True, 0o755, 0, 0), "pub": Node("pub", True, 0o755, 0, 0),
            "pub/a": Node("pub/a", False, 0o444, 0, 0), "priv": Node("priv", True, 0o700, 0, 0),
            "priv/b": Node("priv/b", False, 0o444, 0, 0), "grp": Node("grp", True, 0o750, 0, 1001),
            "grp/c": Node("grp/c", False, 0o440, 0, 1001), "pub/mine": Node("pub/mine", False, 0o600, 1002, 0)}
    asked = []

    def resolve(path):
        asked.append(path)
        return tree.get(path)

    access = PathAccess(resolve, lambda n: (n.mode, n.uid, n.gid), BOB)
    assert access.readable(tree["pub/a"]) and access.readable(tree["pub/mine"])
    assert not access.readable(tree["priv/b"])  # a world-readable file in a directory BOB may not search
    assert not access.readable(tree["grp/c"]) and PathAccess(tree.get, lambda n: (n.mode, n.uid, n.gid),
                                                            ALICE).readable(tree["grp/c"])
    assert access.readable(tree["pub"]) and not access.readable(tree["priv"])
    assert asked.count("") == 1 and asked.count("pub") == 1, "each directory is decided once per request"
    deep = "/".join(f"d{i}" for i in range(3000))  # deeper than Python's recursion limit
    assert not PathAccess(lambda path: None, lambda n: (0o777, 0, 0), BOB).searchable(deep)


# -- sessions through the mount --------------------------------------------------------------------------

def run_channel(fn, *, callers=None):
    """``fn(channel)`` with a channel whose server echoes each request line back 3 times."""
    seen = []

    async def serve(stream, caller):
        seen.append(caller)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = await stream.receive_some(1 << 16)
            if not chunk:
                return
            buf += chunk
        await stream.send_all(buf * 3)

    async def main():
        channel = MountChannel(serve, callers or (lambda uid, gid, pid: Caller(uid, gid, pid=pid, operator=uid == 0)))
        async with trio.open_nursery() as n:
            await n.start(channel.run)
            result = await fn(channel)
            n.cancel_scope.cancel()
        return result, seen

    return trio.run(main)


async def ask(channel, uid, sid, request, *, gid=None):
    """The reply to ``request`` sent in SEND frames and read in RECV frames as ``uid``."""
    gid = uid if gid is None else gid
    for at in range(0, len(request), f.PAYLOAD):
        state, data = f.parse_out(await channel.call(uid, gid, 99, bytes(f.frame_in(sid, f.SEND,
                                                                                   request[at:at + f.PAYLOAD]))))
        assert state == f.TAKEN, data
    out = b""
    while True:
        state, data = f.parse_out(await channel.call(uid, gid, 99, bytes(f.frame_in(sid, f.RECV))))
        assert state in (f.MORE, f.END, f.WAIT), data
        out += data
        if state == f.END:
            return out


def test_a_session_carries_long_requests_and_replies_exactly():
    request = bytes(random.Random(1).getrandbits(7) | 0x20 for _ in range(100_000)) + b"\n"

    async def fn(channel):
        return await ask(channel, 1001, b"a" * 16, request)

    (reply, seen) = run_channel(fn)
    assert reply == request * 3 and seen[0].uid == 1001


def test_a_session_is_its_uids_alone_and_each_uid_holds_a_few():
    async def fn(channel):
        sid = b"s" * 16
        assert f.parse_out(await channel.call(1001, 1001, 5, bytes(f.frame_in(sid, f.SEND, b"half"))))[0] == f.TAKEN
        stolen = f.parse_out(await channel.call(1002, 1002, 6, bytes(f.frame_in(sid, f.RECV))))
        pushed = f.parse_out(await channel.call(1002, 1002, 6, bytes(f.frame_in(sid, f.SEND, b"x\n"))))
        closed = f.parse_out(await channel.call(1002, 1002, 6, bytes(f.frame_in(sid, f.CLOSE))))
        rest = await ask(channel, 1001, sid, b" line\n")
        held = [f.parse_out(await channel.call(1003, 1003, 7, bytes(f.frame_in(bytes([i]) * 16, f.SEND, b"x"))))[0]
                for i in range(MountChannel.PER_UID + 1)]
        root = f.parse_out(await channel.call(0, 0, 8, bytes(f.frame_in(b"r" * 16, f.SEND, b"x"))))[0]
        return stolen, pushed, closed, rest, held, root

    (stolen, pushed, closed, rest, held, root), _ = run_channel(fn)
    assert stolen[0] == f.FAILED and b"no such session" in stolen[1]
    assert pushed == (f.FAILED, b"that session id is taken; choose another")  # nothing of it reached the session
    assert closed[0] == f.END and rest == b"half line\n" * 3  # another uid's CLOSE closed nothing
    assert held == [f.TAKEN] * MountChannel.PER_UID + [f.BUSY] and root == f.TAKEN


def test_fuzzed_frames_are_answered_and_never_raise():
    rng = random.Random(9)

    async def fn(channel):
        states = set()
        for i in range(2000):
            sid = bytes([rng.randrange(4)]) * 16
            raw = (bytes(f.frame_in(sid, rng.choice([f.SEND, f.RECV, f.CLOSE]),
                                    bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 40)))
                                    + rng.choice([b"", b"\n"])))
                   if i % 3 else bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64))))
            with trio.fail_after(MountChannel.RECV_WAIT + 5):
                states.add(f.parse_out(await channel.call(rng.choice([0, 1001, 1002]), 1, 1, raw))[0])
        return states

    states, _ = run_channel(fn)
    assert f.FAILED in states and f.TAKEN in states


# -- what a user who is not an operator may not do -----------------------------------------------------------

def test_another_users_order_is_never_replaced_merged_into_or_grown_past_the_share(tmp_path):
    mine, theirs = objs(20, prefix="a"), objs(20, prefix="b")

    async def fn(cache, pf, backend):
        await pf.load(mine, epoch=0, rank=0, uid=1001, operator=False)
        with pytest.raises(NotPermitted, match="another user's order"):
            await pf.load(theirs, epoch=0, replace=True, uid=1002, operator=False)
        merged = await pf.load(theirs, epoch=0, rank=1, uid=1002, operator=False)
        with pytest.raises(NotPermitted, match="--user-share"):
            await pf.load(objs(30, prefix="c"), epoch=1, uid=1002, operator=False, share_blocks=40)
        own = await pf.load(objs(5, prefix="d"), epoch=0, rank=0, uid=1001, operator=False, share_blocks=40)
        forced = await pf.load(theirs, replace=True, uid=0, operator=True)  # an operator may
        return merged, own, forced, dict(pf.handed_by)

    merged, own, forced, handed = with_prefetcher(tmp_path, fn)
    assert merged["merged"] is False and merged["appended"] is True  # queued after, not interleaved
    assert own["merged"] is True  # a user's own ranks still merge
    assert forced["queued_files"] == 20 and set(handed) == {1001, 1002, 0}


def test_a_warmup_is_cancelled_only_by_its_starter_and_bounded_per_user(tmp_path):
    async def fn(cache, pf, backend):
        job = pf.warmup(objs(4, prefix="w"), uid=1001, operator=False, share_bytes=1 << 30)
        assert pf.cancel(job.id, uid=1002, operator=False) is None  # (another user's: as if there were none)
        assert pf.cancel(job.id + 99, uid=1002, operator=False) is None  # (the same answer as a missing one)
        assert not pf.job(job.id, uid=1001, operator=False).cancelled
        with pytest.raises(NotPermitted, match="--user-share"):
            pf.warmup(objs(4, prefix="x"), uid=1002, operator=False, share_bytes=1)
        return pf.cancel(job.id, uid=1001, operator=False).cancelled

    assert with_prefetcher(tmp_path, fn) is True


def test_a_job_name_is_its_first_reporters_and_each_uid_holds_a_bounded_view():
    jobs = Jobs()
    r = Report("resnet", 0, 10, 1.0, 2.0)
    jobs.check(r, 1001, operator=False)
    jobs.report(r, 1.0, uid=1001)
    with pytest.raises(JobTaken, match="another user"):
        jobs.check(Report("resnet", 1, 1, 0.0, 0.0), 1002, operator=False)
    jobs.check(Report("resnet", 1, 1, 0.0, 0.0), 0, operator=True)  # an operator may
    for i in range(MAX_ENTRIES_PER_UID):
        jobs.check(Report(f"flood{i}", 0, 1, 0.0, 0.0), 1002, operator=False)
        jobs.report(Report(f"flood{i}", 0, 1, 0.0, 0.0), 2.0, uid=1002)
    with pytest.raises(JobTaken, match="already reports"):
        jobs.check(Report("one-more", 0, 1, 0.0, 0.0), 1002, operator=False)
    (mine,) = [j for j in jobs.statistics() if j.job == "resnet"]
    assert mine.uid == 1001 and mine.steps == 10


def test_what_changes_the_mount_for_everybody_needs_an_operator(tmp_path):
    called = []

    async def handler(request, *, caller):
        called.append(caller)
        return {}

    server = ControlServer(tmp_path / "s.sock", {p.Refresh: handler, p.Status: handler})

    async def main():
        return [await server.dispatch(p.Refresh(), caller=BOB), await server.dispatch(p.Status(), caller=BOB),
                await server.dispatch(p.Refresh(), caller=Caller(1002, 1002, operator=True))]

    refused, status, operator = trio.run(main)
    assert refused["ok"] is False and refused["kind"] == "permission" and "--control-group" in refused["error"]
    assert status["ok"] is True and operator["ok"] is True and called == [BOB, Caller(1002, 1002, operator=True)]
    assert server.refused == {"refresh": 1}


def test_a_few_uids_or_one_users_namespace_range_cannot_keep_anybody_else_out(tmp_path):
    """Four uids each holding their share of sessions, and then a user namespace's thousands of uids
    (one person by /etc/subuid): every other user still gets a session at once, and the person holding
    the most gives up its oldest; a newcomer of a person holding as many as anybody is told busy."""
    subuid = tmp_path / "subuid"
    subuid.write_text("nobody:200000:65536\n# a comment\nbadline\n")
    os.chmod(subuid, 0o644)
    people = People(str(subuid))

    async def fn(channel):
        channel.people = people

        async def open_one(uid: int, i: int) -> int:
            return f.parse_out(await channel.call(uid, uid, 7, bytes(f.frame_in(i.to_bytes(16, "big"), f.SEND,
                                                                                   b'{"op": '))))[0]

        held = [await open_one(1100 + i // MountChannel.PER_UID, i) for i in range(MountChannel.MAX_SESSIONS)]
        full = len(channel._sessions)
        newcomer = await ask(channel, 1999, b"n" * 16, b"status\n")  # (the oldest of the four's went for it)
        ns = [await open_one(200000 + i, 1000 + i) for i in range(MountChannel.PER_UID + 4)]
        other = await ask(channel, 1998, b"o" * 16, b"status\n")
        person_of_ns = people.of(200000 + 12345)
        return held, full, newcomer, ns, other, person_of_ns, channel.taken

    (held, full, newcomer, ns, other, person_of_ns, taken), _ = run_channel(fn)
    assert held == [f.TAKEN] * MountChannel.MAX_SESSIONS and full == MountChannel.MAX_SESSIONS
    assert newcomer == b"status\n" * 3 and other == b"status\n" * 3
    assert person_of_ns != 200000 + 12345  # a range of /etc/subuid is its owner's
    got = ns.count(f.TAKEN)  # taken from the four while they held more: up to an equal share, and no more
    assert ns == [f.TAKEN] * got + [f.BUSY] * (len(ns) - got)
    assert MountChannel.MAX_SESSIONS // 5 <= got <= MountChannel.PER_UID  # one person, however many uids
    assert taken >= got


def test_a_session_that_drips_ends_at_its_lifetime():
    async def fn(channel):
        channel.LIFETIME, channel.IDLE = 0.5, 60.0
        sid = b"d" * 16
        assert f.parse_out(await channel.call(1001, 1001, 5, bytes(f.frame_in(sid, f.SEND, b"{"))))[0] == f.TAKEN
        for drips in range(8):  # a byte every 0.2 s: never idle
            await trio.sleep(0.2)
            channel._sweep()
            if sid not in channel._sessions:
                return drips
            assert f.parse_out(await channel.call(1001, 1001, 5, bytes(f.frame_in(sid, f.SEND, b" "))))[0] == f.TAKEN
        return None

    drips, _ = run_channel(fn)
    assert drips is not None and drips >= 1  # used all along, and ended all the same


def test_subuid_ranges_count_only_from_roots_own_file(tmp_path):
    subuid = tmp_path / "subuid"
    subuid.write_text("1500:300000:100\n")
    os.chmod(subuid, 0o666)  # (writable by anybody: a user could claim anybody's uid as theirs)
    assert People(str(subuid)).of(300005) == 300005
    os.chmod(subuid, 0o644)
    assert People(str(subuid)).of(300005) == People(str(subuid)).of(300099) != 300005
    assert People(str(tmp_path / "none")).of(5) == 5


def test_back_to_back_warmups_count_against_the_share_for_a_while_and_only_the_starter_sees_one(tmp_path):
    """``--user-share`` bounded only warmups not yet done, so one user's warmups one after the other could
    cycle the whole cache; and any user could read any warmup (its files, errors naming keys) by id."""
    share = 4 * BS

    async def fn(cache, pf, backend):
        first = pf.warmup(objs(4, prefix="a"), uid=1001, operator=False, share_bytes=share)
        await first.done.wait()
        assert first.done_bytes == share
        with pytest.raises(NotPermitted, match="--user-share") as refused:
            pf.warmup(objs(4, prefix="b"), uid=1001, operator=False, share_bytes=share)
        other = pf.warmup(objs(1, prefix="c"), uid=1002, operator=False, share_bytes=share)  # (a share of its own)
        seen = (pf.job(first.id, uid=1002, operator=False), pf.job(first.id, uid=1001, operator=False),
                pf.job(first.id))
        pf._share.window = 0.0  # (the window passed)
        again = pf.warmup(objs(4, prefix="b"), uid=1001, operator=False, share_bytes=share)
        return str(refused.value), other, seen, again

    refused, other, (by_other, by_starter, by_operator), again = with_prefetcher(tmp_path, fn)
    from epochfs.core.text import human

    assert f"over the {human(share)}" in refused and "frees in" in refused  # (in words, and when it frees)
    assert other is not None and again is not None
    assert by_other is None and by_starter is by_operator is not None
