"""Epoch manifests on real mounts: prefetch ahead of a training-like reader, Belady eviction against
the offline optimum, warmup, plan, and the control channel's checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from epochfs.dev.sample import SampleFile, upload
from epochfs.prefetch.manifest import shuffled

from .conftest import requires_fuse
from .helpers import EPOCHFS, drop_all_caches, offline_min_misses, wait_idle

pytestmark = requires_fuse
KiB, MiB = 1 << 10, 1 << 20


def dataset(n: int, size_fn) -> list[SampleFile]:
    return [SampleFile(f"shard-{i % 4}/sample-{i:04d}.bin", size_fn(i)) for i in range(n)]


def epochfs(*args: str, check: bool = True, cwd=None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*EPOCHFS, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def train_epoch(m, order: list[SampleFile], step: float) -> None:
    """A simulated training loop: read each sample whole, verify it, then 'compute' for ``step`` s."""
    for f in order:
        with open(m.path(f.key), "rb", buffering=0) as fh:
            assert fh.read() == f.content(), f.key
        time.sleep(step)


def hits_and_misses(m) -> tuple[int, int]:
    c = m.status()["cache"]
    return c["hits"], c["misses"]


@pytest.mark.page_cache
def test_first_epoch_runs_from_cache_with_a_manifest(s3_client, fresh_bucket, mount_factory, tmp_path):
    files = dataset(100, lambda i: 150 * KiB + 3 * i)
    upload(s3_client, fresh_bucket, "", files)
    order = shuffled(files, seed=3, epoch=0)
    manifest = tmp_path / "epoch0.txt"
    manifest.write_text("".join(f.key + "\n" for f in order))

    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M", name="with") as m:
        epochfs("prefetch", str(m.mountpoint), "--manifest", str(manifest), "--epoch", "0")
        train_epoch(m, order, step=0.02)
        hits, misses = hits_and_misses(m)
        assert hits / (hits + misses) >= 0.95, (hits, misses)
        status = m.status()
        assert status["prefetch"]["file_position"] == len(order) - 1
        assert status["prefetch"]["fetched_blocks"] >= 95

    drop_all_caches()
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M", "--no-learned-order", name="without",
                       cache_dir=tmp_path / "cache-without") as m:  # (no order at all: neither handed over nor learned)
        train_epoch(m, order, step=0.02)
        hits, misses = hits_and_misses(m)
        assert misses >= len(order) and hits <= len(order) * 0.05, (hits, misses)


def test_a_reader_that_pauses_keeps_its_lead(s3, s3_client, fresh_bucket, mount_factory, tmp_path):
    """30 ms to the endpoint. An epoch handed over before the reader starts, and a reader that stops
    halfway (validation, a checkpoint): what it reads after the pause was fetched during it, so the
    reads after it are hits, as fast as the reader goes (its rate before the pause does not count the
    pause)."""
    from epochfs import Client

    from .faultproxy import FaultProxy

    files = dataset(60, lambda i: MiB - 7 * i)  # one block each
    upload(s3_client, fresh_bucket, "", files)
    order = shuffled(files, seed=5, epoch=0)
    proxy = FaultProxy(s3.port).start()
    proxy.delay = 0.03
    try:
        with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M", "--endpoint-url", proxy.endpoint) as m:
            Client(m.mountpoint).hand_over([f.key for f in order], epoch=0)
            time.sleep(4)  # the reader has not started: a paused reader
            head = order[:25]
            train_epoch(m, head, step=0.0)
            c = m.status()["cache"]
            assert c["hit_bytes"] >= 0.95 * sum(f.size for f in head), c
            time.sleep(4)  # validation
            before = m.status()["cache"]
            train_epoch(m, order[25:], step=0.0)
            after = m.status()["cache"]
            hits = after["hit_bytes"] - before["hit_bytes"]
            assert hits >= 0.95 * sum(f.size for f in order[25:]), (hits, after)
    finally:
        proxy.stop()


@pytest.mark.page_cache
def test_second_epoch_backend_bytes_are_near_the_offline_optimum(s3_client, fresh_bucket, mount_factory, tmp_path):
    n, size = 64, 256 * KiB
    files = dataset(n, lambda i: size)
    upload(s3_client, fresh_bucket, "", files)
    e0, e1 = shuffled(files, seed=9, epoch=0), shuffled(files, seed=9, epoch=1)
    for name, order in (("e0", e0), ("e1", e1)):
        (tmp_path / f"{name}.txt").write_text("".join(f.key + "\n" for f in order))
    capacity = n // 2 * size
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "256K", "--cache-size", str(capacity),
                       "--readahead", "0") as m:
        epochfs("prefetch", str(m.mountpoint), "--manifest", str(tmp_path / "e0.txt"), "--epoch", "0")
        epochfs("prefetch", str(m.mountpoint), "--manifest", str(tmp_path / "e1.txt"), "--epoch", "1")
        assert m.status()["prefetch"]["files"] == 2 * n
        train_epoch(m, e0, step=0.01)
        # A dataset larger than the page cache: the second epoch's reads reach the daemon (files in the
        # page cache are opened and read with no request, so the plan would not hear of them).
        drop_all_caches()
        train_epoch(m, e1, step=0.01)
        c = wait_idle(m)["cache"]
        backend = c["demand_bytes"] + c["prefetch_bytes"]
        assert m.status()["store"]["used_bytes"] <= capacity
    optimum_second = (offline_min_misses([f.key.encode() for f in e0 + e1], n // 2) - n) * size
    second = backend - n * size  # the first epoch reads every block once, whatever the policy
    assert optimum_second <= second <= 1.05 * optimum_second, (second, optimum_second)


def test_the_ranks_of_one_node_handed_over_from_the_shell_are_merged_and_read_from_cache(
        s3_client, fresh_bucket, mount_factory, tmp_path):
    files = dataset(60, lambda i: 120 * KiB + 7 * i)
    upload(s3_client, fresh_bucket, "", files)
    paths = tmp_path / "paths.txt"
    paths.write_text("".join(f.key + "\n" for f in files))
    by_key = {f.key: f for f in files}
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "256K", "--readahead", "0") as m:
        shares = []
        for rank in (0, 1):
            r = epochfs("prefetch", str(m.mountpoint), "--manifest", str(paths), "--seed", "4", "--epoch", "0",
                        "--rank", str(rank), "--world-size", "2")
            assert ("merged" in r.stdout) == (rank == 1), r.stdout
            out = tmp_path / f"r{rank}.txt"
            epochfs("manifest", str(paths), "--seed", "4", "--epoch", "0", "--rank", str(rank), "--world-size", "2",
                    "-o", str(out))
            shares.append([by_key[k] for k in out.read_text().split()])
        assert m.status()["prefetch"]["files"] == len(files)
        readers = [threading.Thread(target=train_epoch, args=(m, share, 0.02)) for share in shares]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        hits, misses = hits_and_misses(m)
        assert hits / (hits + misses) >= 0.95, (hits, misses)  # appended, rank 1's share is read cold


def test_control_channel_rejects_other_users(request, mount_factory, sample_bucket):
    # A cache directory other users can traverse (pytest's own tmp dirs are private), so that only the
    # daemon's credential check stands between them and the socket.
    base = Path(tempfile.mkdtemp(prefix="epochfs-ctl-"))
    os.chmod(base, 0o755)
    cache = base / "cache"
    cache.mkdir(mode=0o755)
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    with mount_factory(f"s3://{sample_bucket}/data", cache_dir=cache) as m:
        os.chmod(cache, 0o755)  # the daemon made it private at start-up; open it again for this probe
        sock = os.getxattr(m.mountpoint, "user.epochfs.control").decode()
        os.chmod(sock, 0o777)
        probe = (
            "import os, socket, json, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "s.sendall(json.dumps({'op': 'status'}).encode() + b'\\n')\n"
            "print(s.recv(65536).decode())\n"
        )
        out = subprocess.run(["python3", "-c", probe, sock], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        assert reply["ok"] is False and "permission denied" in reply["error"]
        assert m.status()["pid"] > 0  # root still gets answers
        assert "refused a request from uid 65534" in m.log()


def test_malformed_manifest_is_rejected_with_the_line_and_the_mount_keeps_working(
        tmp_path, mount_factory, sample_bucket, sample_files):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(f'{{"path": "{sample_files[0].key}"}}\n{{"path": 42}}\n')
    unknown = tmp_path / "unknown.txt"
    unknown.write_text(f"{sample_files[0].key}\n# comment\nno/such/file.bin\n")
    with mount_factory(f"s3://{sample_bucket}/data") as m:
        # the same manifest error is the same exit code (2: an input error) from every command
        for cmd in (["prefetch", str(m.mountpoint)], ["warmup", str(m.mountpoint)],
                    ["plan", "--cache-size", "1G", "--mount", str(m.mountpoint)]):
            r = epochfs(*cmd, "--manifest", str(bad_json), check=False)
            assert r.returncode == 2 and f"{bad_json}:2:" in r.stderr, (cmd, r.stderr)
        r = epochfs("prefetch", str(m.mountpoint), "--manifest", str(unknown), check=False)
        assert r.returncode == 2 and f"{unknown}:3:" in r.stderr and "not in the snapshot" in r.stderr
        r = epochfs("warmup", str(m.mountpoint), "--manifest", str(unknown), check=False)
        assert r.returncode == 2 and "not in the snapshot" in r.stderr
        assert m.status()["prefetch"]["blocks"] == 0
        f = sample_files[30]
        assert m.path(f.key).read_bytes() == f.content()


def test_warmup_check_and_plan(tmp_path, s3_client, fresh_bucket, mount_factory):
    files = dataset(40, lambda i: 300 * KiB + i)
    upload(s3_client, fresh_bucket, "", files)
    manifest = tmp_path / "all.txt"
    manifest.write_text("".join(f.key + "\n" for f in files))
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M") as m:
        r = epochfs("warmup", str(m.mountpoint), "--check", "--manifest", str(manifest))
        assert r.stdout.startswith("0.0% cached")
        r = epochfs("warmup", str(m.mountpoint), str(m.path("shard-1")))
        assert "warmed" in r.stdout
        r = epochfs("warmup", str(m.mountpoint), "--check", "--manifest", str(manifest))
        assert r.stdout.startswith("25.0% cached"), r.stdout
        r = epochfs("warmup", str(m.mountpoint), "--manifest", str(manifest))
        r = epochfs("warmup", str(m.mountpoint), "--check", "--manifest", str(manifest))
        assert r.stdout.startswith("100.0% cached") and "40 of 40 files" in r.stdout
        before = m.status()["cache"]
        for f in files:
            assert m.path(f.key).read_bytes() == f.content()
        after = m.status()["cache"]
        assert after["demand_fetches"] == before["demand_fetches"] and after["misses"] == before["misses"]

        r = epochfs("plan", "--manifest", str(manifest), "--cache-size", "6M", "--block-size", "1M",
                    "--mount", str(m.mountpoint), "--seed", "1", "--epoch", "1", "--previous-manifest",
                    str(manifest), "--json")
        plan = json.loads(r.stdout)
        assert plan["epoch_bytes"] == sum(f.size for f in files)
        pol = plan["policies"]
        assert pol["manifest"]["backend_bytes"] <= pol["lru"]["backend_bytes"]
        assert 0 < pol["manifest"]["hit_ratio"] < 1
        r = epochfs("plan", "--manifest", str(manifest), "--cache-size", "6M", "--block-size", "1M",
                    "--mount", str(m.mountpoint))  # a cold epoch: the prediction says what it means
        assert "fetched from the backend" in r.stdout and "cached when the epoch begins" in r.stdout
        assert "predicts backend traffic, not the hit ratio a prefetched epoch shows" in r.stdout.replace("\n", " ")
        assert "assumptions: blocks of 1.0 MiB (--block-size)" in r.stdout  # what it assumed, said
        assert "no backend bandwidth given" in r.stdout


def test_warmup_takes_the_whole_mount_and_paths_from_the_current_directory(
        tmp_path, s3_client, fresh_bucket, mount_factory):
    files = dataset(12, lambda i: 50 * KiB + i)
    upload(s3_client, fresh_bucket, "", files)
    shard1 = sum(f.size for f in files if f.key.startswith("shard-1/"))
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M") as m:
        r = epochfs("warmup", str(m.mountpoint), ".", cwd=m.path("shard-1"))  # a shell's "."
        assert f"epochfs: warmed {shard1 / KiB:.1f} KiB of" in r.stdout, r.stdout
        r = epochfs("warmup", str(m.mountpoint), "sample-0005.bin", cwd=m.path("shard-1"))
        assert "warmed" in r.stdout
        r = epochfs("warmup", str(m.mountpoint), "shard-2", cwd=tmp_path, check=False)  # not the mount root's
        assert r.returncode == 2 and f"did you mean {m.path('shard-2')}?" in r.stderr, r.stderr
        r = epochfs("warmup", str(m.mountpoint), "--check")
        assert r.stdout.startswith("25.0% cached"), r.stdout
        r = epochfs("warmup", str(m.mountpoint), str(m.mountpoint))  # the mount root named
        r = epochfs("warmup", str(m.mountpoint), "--check")
        assert r.stdout.startswith("100.0% cached") and "12 of 12 files" in r.stdout, r.stdout
        epochfs("warmup", str(m.mountpoint))  # nothing named: the whole mount, already cached


def test_manifest_helper_writes_rank_shares(tmp_path):
    paths = tmp_path / "paths.txt"
    paths.write_text("".join(f"img/{i:03d}.jpg\n" for i in range(10)))
    shares = []
    for rank in range(3):
        out = tmp_path / f"r{rank}.txt"
        epochfs("manifest", str(paths), "--seed", "5", "--epoch", "2", "--rank", str(rank), "--world-size", "3",
                "-o", str(out))
        shares.append(out.read_text().split())
    assert all(len(s) == 4 for s in shares)
    assert len(set().union(*shares)) == 10
