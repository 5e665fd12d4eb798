"""``--memory-limit``: how a limit is split, the budget of fetches ahead, and a real mount under load
whose resident set stays within 1.1x the limit with every byte right."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import trio

from epochfs.core.memory import MARGIN, MemoryBudget, MemoryTooSmall, default_limit, split
from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import EPOCHFS

MiB, GiB = 1 << 20, 1 << 30


def test_a_limit_is_split_within_what_is_left_after_the_baseline():
    for limit in (160 * MiB, 512 * MiB, 2 * GiB, 8 * GiB):
        for block in (1 * MiB, 4 * MiB, 16 * MiB):
            try:
                s = split(limit, 80 * MiB, block, 16)
            except MemoryTooSmall:
                assert limit - 80 * MiB - MARGIN < 3 * block
                continue
            held = s.demand_slots * block + s.ahead + s.recent + s.whole + s.pool
            assert held <= limit - 80 * MiB - MARGIN, (limit, block, s)
            assert 1 <= s.demand_slots <= 16 and s.ahead >= block and s.recent >= block


def test_a_limit_too_small_says_what_it_must_hold():
    with pytest.raises(MemoryTooSmall, match=r"at least \d+M"):
        split(100 * MiB, 80 * MiB, 4 * MiB, 16)


def test_the_default_is_a_sixteenth_of_the_machine_within_bounds():
    assert default_limit(4 * GiB) == 512 * MiB
    assert default_limit(24 * GiB) == 1536 * MiB
    assert default_limit(1 << 40) == 8 * GiB


def test_fetches_ahead_wait_for_room_unless_a_reader_waits_for_them():
    async def main():
        budget = MemoryBudget(8 * MiB)
        await budget.acquire(4 * MiB)
        await budget.acquire(4 * MiB)
        order = []
        urgent = {"now": False}

        async def late(name, urgent_fn=lambda: False):
            await budget.acquire(4 * MiB, urgent_fn)
            order.append(name)

        async with trio.open_nursery() as n:
            n.start_soon(late, "waits")
            n.start_soon(late, "urgent", lambda: urgent["now"])
            await trio.sleep(0.1)
            assert order == [] and budget.held == 8 * MiB
            urgent["now"] = True  # a reader came to wait for it: it goes, counted, over the share
            await trio.sleep(0.1)
            assert order == ["urgent"] and budget.held == 12 * MiB
            budget.release(4 * MiB)
            budget.release(4 * MiB)
            await trio.sleep(0.1)
        assert order == ["urgent", "waits"] and budget.held == 8 * MiB
        assert budget.throttled_seconds >= 0.2

    trio.run(main)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@requires_fuse
def test_sixteen_readers_and_an_order_larger_than_the_limit_stay_within_it(s3_client, fresh_bucket, mount_factory,
                                                                          tmp_path):
    """--memory-limit 160M: 16 readers of 16 files of 24 MiB (384 MiB) at once with their order handed
    over: the resident set, sampled every 20 ms, never passes 1.1x the limit, every byte is right, the
    fetches ahead waited for room, and status says so."""
    files = [SampleFile(f"big/f{i:02d}.bin", 24 * MiB + 4099 * i) for i in range(16)]
    upload(s3_client, fresh_bucket, "", files)
    limit = 160 * MiB
    with mount_factory(f"s3://{fresh_bucket}", "--memory-limit", "160M", "--cache-size", "2G") as m:
        pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
        manifest = tmp_path / "order.txt"
        manifest.write_text("".join(f.key + "\n" for f in files))
        subprocess.run([*EPOCHFS, "prefetch", str(m.mountpoint), "--manifest", str(manifest), "--epoch", "0"],
                       check=True, capture_output=True, timeout=60)
        peak, done, wrong = [0], threading.Event(), []

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _rss(pid))
                time.sleep(0.02)

        def read(f):
            with open(m.path(f.key), "rb") as fh:
                if fh.read() != f.content():
                    wrong.append(f.key)

        sampler = threading.Thread(target=sample)
        sampler.start()
        readers = [threading.Thread(target=read, args=(f,)) for f in files]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        done.set()
        sampler.join()
        assert wrong == []
        assert peak[0] <= 1.1 * limit, f"peak resident set {peak[0] / MiB:.0f} MiB over 1.1x {limit / MiB:.0f} MiB"
        mem = m.status()["memory"]
        assert mem["limit"] == limit and mem["throttled_seconds"] > 0, mem
        assert mem["held"]["ahead"] == 0 and mem["resident"] <= 1.1 * limit, mem


@requires_fuse
def test_a_limit_that_cannot_hold_the_daemon_is_refused_at_mount(fresh_bucket, mount_factory, tmp_path, s3):
    (tmp_path / "mnt").mkdir()
    for value, says in (("10M", "at least 64M"), ("100M", "cannot hold what the daemon needs")):
        r = subprocess.run([*EPOCHFS, "mount", f"s3://{fresh_bucket}", str(tmp_path / "mnt"), "--endpoint-url",
                            s3.endpoint, "--cache-dir", str(tmp_path / "cache"), "--memory-limit", value,
                            "--metrics-addr", "off"], capture_output=True, text=True, timeout=60, env=s3.env())
        assert r.returncode == 2 and says in r.stderr, (value, r.stderr)
    out = subprocess.run([*EPOCHFS, "mount", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--memory-limit" in out and "never failed" in " ".join(out.split()), out
