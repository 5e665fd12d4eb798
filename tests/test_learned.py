"""The epoch learned on a plain mount (``prefetch/learned.py``): the pattern's rules, a fuzz loop over
it, and real mounts: a shuffled epoch read with no order handed over comes from the cache, and a wrong
guess (a job that reads a tenth of a directory, ``find``, ``du``) costs at most its stated bound."""

from __future__ import annotations

import os
import random
import subprocess
import time

import pytest

from epochfs.core.records import ObjectInfo
from epochfs.dev.sample import SampleFile, upload
from epochfs.prefetch.learned import Learner, Pattern
from epochfs.prefetch.manifest import shuffled

from .conftest import requires_fuse

KiB, MiB = 1 << 10, 1 << 20
BS = 1 * MiB


def obj(key: str, size: int = BS) -> ObjectInfo:
    return ObjectInfo(key, size, 0, "e")


def first_reads(p: Pattern, keys: list[str], size: int = BS) -> int:
    return sum(p.saw(obj(k, size), 0) for k in keys)


# -- the pattern, pure ---------------------------------------------------------------------------------

def test_files_of_one_directory_read_once_each_start_a_guess_over_that_directory():
    p = Pattern(BS)
    keys = [f"train/img-{i:03d}.npz" for i in random.Random(1).sample(range(100), 20)]
    assert first_reads(p, keys[:Pattern.START_FILES - 1]) == 0 and p.scope is None
    first_reads(p, keys[Pattern.START_FILES - 1:Pattern.START_FILES])
    assert p.scope == "train"
    assert first_reads(p, keys[Pattern.START_FILES:]) == (20 - Pattern.START_FILES) * BS  # each read earns
    assert p.saw(obj("train/x-2"), 0) == BS and p.saw(obj("train/x-2"), 1) == 0  # (the last block is short: none)


def test_the_scope_is_the_deepest_directory_holding_them_all():
    p = Pattern(BS)
    first_reads(p, [f"train/class-{i % 3}/s{i}" for i in range(Pattern.START_FILES)])
    assert p.scope == "train"  # (not "train/class-": components, not characters)
    p = Pattern(BS)
    first_reads(p, [f"top-{i}" for i in range(Pattern.START_FILES)])
    assert p.scope == ""  # the mount's root
    p = Pattern(BS)
    first_reads(p, [f"a/b/c/s{i}" for i in range(Pattern.START_FILES)])
    assert p.scope == "a/b/c"


def test_files_read_again_long_after_start_a_new_epoch_and_stragglers_do_not():
    p = Pattern(BS)
    keys = [f"d/s{i:03d}" for i in range(100)]
    first_reads(p, keys[:50])
    assert p.scope == "d"
    assert p.saw(obj(keys[49]), 0) == 0 and p.scope == "d"  # (its body again, a header read twice)
    # many readers side by side: late touches of files read a while ago, among new files, are no epoch
    for i in range(50, 100):
        p.saw(obj(keys[i - 20]), 0)
        first_reads(p, [keys[i]])
    assert p.scope == "d" and len(p.read) == 100
    # the next epoch: files read again, one after another, with no new one between
    again = keys[::7][:Pattern.START_FILES]
    for k in again[:-1]:
        p.saw(obj(k), 0)
        assert p.scope == "d"
    p.saw(obj(again[-1]), 0)
    assert set(p.read) == set(again) and p.scope == "d"  # learned again from those very reads


def test_a_file_read_from_its_end_first_earns_its_span_once():
    """A zip (npz) is read from its directory at the end, then from its start."""
    p = Pattern(BS)
    first_reads(p, [f"d/s{i}" for i in range(Pattern.START_FILES)])
    big = obj("d/big", 4 * BS)
    assert p.saw(big, 3) == BS
    assert p.saw(big, 0) == 3 * BS  # blocks 0, 1 and 2: the span grew
    assert p.saw(big, 1) == 0 and p.saw(big, 3) == 0  # within the span: nothing more


def test_reads_elsewhere_end_the_guess():
    p = Pattern(BS)
    first_reads(p, [f"train/s{i}" for i in range(Pattern.START_FILES)])
    first_reads(p, [f"val/s{i}" for i in range(Pattern.START_FILES - 1)])
    assert p.scope == "train"  # (a few reads elsewhere: a validation batch)
    first_reads(p, ["val/last"])
    assert p.scope is None  # the job moved on: the next START_FILES first reads are learned afresh
    first_reads(p, [f"val/t{i}" for i in range(Pattern.START_FILES)])
    assert p.scope == "val"


def test_the_pattern_never_fails_and_stays_bounded_on_any_sequence_of_reads():
    rnd = random.Random(7)
    for _ in range(40):
        p = Pattern(rnd.choice([4096, BS]))
        names = [f"{rnd.choice(['', 'a/', 'a/b/', 'c/'])}f{rnd.randrange(300)}" for _ in range(400)]
        for _ in range(3000):
            key = rnd.choice(names)
            size = rnd.choice([0, 1, 4095, BS, 3 * BS + 5])
            index = rnd.randrange(max(1, -(-size // p.block_size)))
            earned = p.saw(obj(key, size), index)
            assert 0 <= earned <= size  # (a span of a file: never more than the file)
            assert len(p.read) <= Pattern.MAX_TRACKED
            if p.scope:  # a directory of the files read this epoch
                assert not p.scope.endswith("/") and any(k.startswith(p.scope + "/") for k in p.read), p.scope
            assert p.earned >= 0


def test_the_bound_of_a_guess_is_stated_in_the_settings():
    """The budget the docs state: 64 MiB at first (a sixteenth of a small cache), then twice what the
    job read of the directory."""
    assert Learner.BASE == 64 * MiB and Learner.GAIN == 2


# -- real mounts -----------------------------------------------------------------------------------------

def tree(n_train: int, n_val: int, size) -> list[SampleFile]:
    return ([SampleFile(f"train/c{i % 3}/s{i:04d}.bin", size(i)) for i in range(n_train)]
            + [SampleFile(f"val/s{i:04d}.bin", size(i)) for i in range(n_val)])


def read_all(m, files: list[SampleFile], step: float) -> None:
    for f in files:
        with open(m.path(f.key), "rb", buffering=0) as fh:
            assert fh.read() == f.content(), f.key  # never a wrong byte
        time.sleep(step)


def fetched(m) -> int:
    c = m.status()["cache"]
    return c["demand_bytes"] + c["prefetch_bytes"]


@requires_fuse
@pytest.mark.page_cache
def test_a_shuffled_epoch_on_a_plain_mount_is_read_from_the_cache(s3, s3_client, fresh_bucket, mount_factory,
                                                                   tmp_path):
    """20 ms to the endpoint, no order handed over: after the first files the rest of ``train/`` is
    fetched ahead and most of the epoch is hits, ``val/`` is never fetched, and the second epoch
    fetches nothing. Without the learner (``--no-learned-order``) the same epoch is all misses."""
    from .faultproxy import FaultProxy
    from .helpers import drop_all_caches

    files = tree(90, 30, lambda i: 300 * KiB + 11 * i)
    upload(s3_client, fresh_bucket, "", files)
    train = [f for f in files if f.key.startswith("train/")]
    order = shuffled(train, seed=4, epoch=0)
    train_bytes = sum(f.size for f in train)
    proxy = FaultProxy(s3.port).start()
    proxy.delay = 0.02
    try:
        with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M", "--endpoint-url", proxy.endpoint) as m:
            read_all(m, order, step=0.02)
            c = m.status()["cache"]
            learned = m.status()["learned"]
            assert learned["guesses"] >= 1 and learned["scope"] == "train", learned
            assert c["hit_bytes"] >= 0.7 * train_bytes, (c, learned)
            assert learned["used_bytes"] >= 0.7 * learned["fetched_bytes"], learned
            assert fetched(m) <= train_bytes * 1.01, (c, learned)  # val/ never fetched; nothing twice
            # The human status says what the learned order did, not only that no manifest was handed over.
            line = human_prefetch_line(m)
            assert "learned order: " in line and " in train" in line, line
            assert "fetched ahead" in line and " of it read" in line, line
            drop_all_caches()
            before = fetched(m)
            read_all(m, shuffled(train, seed=4, epoch=1), step=0.0)
            assert fetched(m) == before  # the second epoch: all cached
        drop_all_caches()
        with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M", "--endpoint-url", proxy.endpoint,
                           "--no-learned-order", name="off", cache_dir=tmp_path / "cache-off") as m:
            read_all(m, order, step=0.02)
            c = m.status()["cache"]
            assert c["hit_bytes"] <= 0.05 * train_bytes, c
            assert m.status()["learned"]["state"] == "off"
    finally:
        proxy.stop()


@requires_fuse
def test_a_wrong_guess_costs_at_most_its_bound_and_listing_costs_nothing(s3, s3_client, fresh_bucket, mount_factory,
                                                                         tmp_path):
    """20 ms to the endpoint, a 64 MiB cache (a guess may fetch 4 MiB, then twice what the job reads of
    the directory): a job that reads a tenth of ``train/`` and stops leaves the backend's bytes within
    what it read plus that bound, far from the directory's size; ``find``, ``du`` and ``ls -lR`` read no
    file and fetch nothing."""
    from .faultproxy import FaultProxy

    files = tree(200, 0, lambda i: 512 * KiB - 5 * i)
    upload(s3_client, fresh_bucket, "", files)
    train_bytes = sum(f.size for f in files)
    proxy = FaultProxy(s3.port).start()
    proxy.delay = 0.02
    try:
        wrong_guess(mount_factory, fresh_bucket, proxy, files, train_bytes)
    finally:
        proxy.stop()


def wrong_guess(mount_factory, fresh_bucket, proxy, files, train_bytes) -> None:
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M", "--cache-size", "64M", "--endpoint-url",
                       proxy.endpoint) as m:
        for cmd in (["find", str(m.mountpoint)], ["du", "-s", str(m.mountpoint)], ["ls", "-lR", str(m.mountpoint)]):
            subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        assert fetched(m) == 0
        tenth = shuffled(files, seed=9, epoch=0)[:20]
        read_all(m, tenth, step=0.0)
        read = sum(f.size for f in tenth)
        time.sleep(3)  # (what the guess started has landed)
        learned = m.status()["learned"]
        base = (64 * MiB) // 16
        assert learned["guesses"] == 1 and learned["fetched_bytes"] > 0, learned  # (it did guess, and fetch)
        assert learned["fetched_bytes"] <= base + 2 * learned["read_bytes"] + MiB, learned
        assert fetched(m) <= read + base + 2 * read + MiB, (fetched(m), learned)
        assert fetched(m) < train_bytes / 3


@requires_fuse
def test_nothing_is_fetched_ahead_of_a_near_endpoint(s3_client, fresh_bucket, mount_factory):
    """The endpoint on this machine answers at once: the pattern is seen, nothing is fetched ahead (a
    near endpoint's misses wait about as little as fetching ahead would save)."""
    files = tree(60, 0, lambda i: 300 * KiB)
    upload(s3_client, fresh_bucket, "", files)
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M") as m:
        read_all(m, shuffled(files, seed=3, epoch=0), step=0.01)
        learned = m.status()["learned"]
        assert m.status()["backend"]["first_byte_seconds"] < 0.010, m.status()["backend"]
        assert learned["guesses"] == 1 and learned["fetched_bytes"] == 0, learned
        line = human_prefetch_line(m)
        assert "learned order: nothing fetched ahead (the backend answers within 10 ms" in line, line


def human_prefetch_line(m) -> str:
    """The ``prefetch`` line of ``epochfs status`` as a person runs it."""
    from .helpers import EPOCHFS

    text = subprocess.run([*EPOCHFS, "status", str(m.mountpoint)], capture_output=True, text=True,
                          timeout=60, check=True).stdout
    return next(line for line in text.splitlines() if line.startswith("prefetch"))


@requires_fuse
def test_a_handed_over_order_rules_and_the_guess_waits(s3_client, fresh_bucket, mount_factory):
    """With an order handed over the job said what it reads: nothing is guessed, nor once it is read
    (the job hands the next one over soon; a node of a job reads its own share, the rest is others')."""
    from epochfs import Client

    files = tree(60, 0, lambda i: 200 * KiB)
    upload(s3_client, fresh_bucket, "", files)
    order = shuffled(files, seed=2, epoch=0)
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M") as m:
        Client(m.mountpoint).hand_over([f.key for f in order], epoch=0)
        read_all(m, order[:30], step=0.0)
        learned = m.status()["learned"]
        assert learned["state"] == "held" and learned["fetched_bytes"] == 0, learned
        read_all(m, order[30:], step=0.0)
        read_all(m, order[:20], step=0.0)  # (the order read; the next epoch begins without a hand-over)
        learned = m.status()["learned"]
        assert learned["state"] == "held" and learned["fetched_bytes"] == 0, learned


def test_the_learner_is_documented_in_the_help():
    from .helpers import EPOCHFS

    out = subprocess.run([*EPOCHFS, "mount", "--help"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "--no-learned-order" in out and "twice what the job has read" in " ".join(out.split())


# -- between users ---------------------------------------------------------------------------------------

def _as(user: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", user, "--", *cmd], capture_output=True, text=True, timeout=120,
                          errors="replace")


def _status_as(user: str, mountpoint) -> dict:
    import json

    from .helpers import epochfs_as

    r = epochfs_as(user, "status", str(mountpoint), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@requires_fuse
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"), reason="needs root (users)")
def test_a_guess_fetches_only_what_its_reader_may_read_and_is_shown_to_that_reader_alone(
        s3, s3_client, fresh_bucket, mount_factory, tmp_path):
    """Round 7's audit: a user who may read a few small files of a shared tree had the daemon walk the
    whole subtree as root and fetch another user's 0600 files in 0700 directories, and ``status`` named
    that user's private directory to anybody. Now the guess for each user walks only what that user may
    read, each user's own reads alone steer it, and each user's ``status`` shows its own guess alone."""
    import pwd

    from epochfs.backend.attrs import record_key

    from .faultproxy import FaultProxy

    try:
        owner = pwd.getpwnam("epochfs-job")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "epochfs-job"],
                       check=True)
        owner = pwd.getpwnam("epochfs-job")
    public = [SampleFile(f"shared/f{i:02d}.bin", 40 * KiB + i) for i in range(12)]
    private = [SampleFile(f"shared/home-secB/project-falcon-ipo/s{i:02d}.bin", 512 * KiB + i) for i in range(12)]
    upload(s3_client, fresh_bucket, "", public + private)
    uid, gid = owner.pw_uid, owner.pw_gid
    for key in ("shared/home-secB/", "shared/home-secB/project-falcon-ipo/"):
        s3_client.put_object(Bucket=fresh_bucket, Key=record_key(key, 0o700, uid, gid), Body=b"")
    for f in private:
        s3_client.put_object(Bucket=fresh_bucket, Key=record_key(f.key, 0o600, uid, gid), Body=b"")
    private_bytes = sum(f.size for f in private)
    proxy = FaultProxy(s3.port).start()
    proxy.delay = 0.02
    import shutil
    import tempfile
    from pathlib import Path

    base = Path(tempfile.mkdtemp(prefix="epochfs-learned-"))  # (one other users can pass: tmp_path is root's)
    os.chmod(base, 0o755)
    m = mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M", "--allow-other", "--endpoint-url",
                      proxy.endpoint, cache_dir=tmp_path / "cache", name="unused-learned")
    m.mountpoint = base / "m"
    m.mountpoint.mkdir()
    try:
        with m:
            denied = _as("nobody", "cat", str(m.path(private[0].key)))
            assert denied.returncode != 0  # (the modes hold: nobody may not read them)
            for f in shuffled(public, seed=5, epoch=0):
                r = _as("nobody", "cat", str(m.path(f.key)))
                assert r.returncode == 0 and len(r.stdout.encode("latin-1", "replace")) >= 0
                time.sleep(0.05)
            time.sleep(3)  # (whatever the guess would fetch has landed)
            learned = m.status()["learned"]
            (guess,) = [u for u in learned["users"] if u["uid"] == 65534]
            assert guess["guesses"] >= 1 and guess["scope"] == "shared", learned
            c = m.status()["cache"]
            assert c["demand_bytes"] + c["prefetch_bytes"] < private_bytes / 4, (c, learned)
            resident = m.status()["store"]["used_bytes"]
            assert resident <= sum(f.size for f in public) + 64 * KiB, resident  # none of the private files
            # The owner reads its own files: its guess is its own, and nobody's status does not show it.
            for f in shuffled(private, seed=6, epoch=0)[:9]:
                assert _as(owner.pw_name, "cat", str(m.path(f.key))).returncode == 0
                time.sleep(0.05)
            time.sleep(1)
            seen_by_nobody = _status_as("nobody", m.mountpoint)
            text = repr(seen_by_nobody)
            assert "home-secB" not in text and "falcon" not in text, seen_by_nobody["learned"]
            assert seen_by_nobody["learned"]["scope"] == "shared" and "users" not in seen_by_nobody["learned"]
            seen_by_owner = _status_as(owner.pw_name, m.mountpoint)["learned"]
            assert seen_by_owner["scope"] == "shared/home-secB/project-falcon-ipo", seen_by_owner
            assert "home-secB" not in m.log(), "the log names a user's private directory"
            assert {u["uid"] for u in m.status()["learned"]["users"]} == {65534, uid}  # (operators see each)
    finally:
        proxy.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_one_users_hand_over_holds_that_users_guess_alone():
    from epochfs.prefetch.scheduler import Prefetcher

    class Plan:
        pass

    p = Prefetcher.__new__(Prefetcher)
    p.handed_by = {1001: time.time()}
    p._plan, p._handovers, p._position = None, [], 0
    assert p.holds_order(1001) and not p.holds_order(1002)
    assert p.holds_order()  # (anybody's: as before, for what asks of the mount as a whole)
