"""The measurements: fio streams, small-file rates, time to first byte, a training simulation, and the
raw boto3 baselines. Each returns plain numbers."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from epochfs.prefetch.manifest import partition, shuffled

HERE = Path(__file__).resolve().parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seq_read(path: Path) -> float:
    """Bytes/s of one sequential reader of ``path`` in 1 MiB reads into one buffer (what a shard loader
    reading into its own memory does). Not ``read()``, which allocates each MiB afresh: at page-cache
    speed that allocation (glibc maps it and the kernel faults its pages in, until glibc's adaptive
    threshold moves) weighs on the copy: a 256 MiB file in the page cache of the local disk read at
    4,813 MiB/s in a process's first such pass and 6,700-7,100 in the next ones; into one buffer,
    6,300-7,300 from the first."""
    buf = bytearray(1 << 20)
    start, n = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    return n / (time.perf_counter() - start)


def host_cpu() -> tuple[int, int]:
    """The host's busy and total CPU ticks (``/proc/stat``; idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


class OutsideLoad:
    """How busy work outside this run kept the machine while it measured: each second, the CPU time of
    the processes that are neither this one's descendants nor started for it (a command line naming the
    run's work directory: the mounts' daemons, detached from it), as a share of all the machine's cores.
    Kernel threads are left out (they do the run's own I/O). A run measured on a busy machine reads as a
    result otherwise (cold small files at 0.36x JuiceFS where a quiet machine gives 1.44x)."""

    #: Outside work above this share of the machine (median over the run) marks the run as busy.
    BUSY = 0.10

    def __init__(self, work: Path | None = None, interval: float = 1.0) -> None:
        self.work = str(work) if work is not None else None
        self.interval = interval
        self.samples: list[float] = []
        self.unsettled = 0  # settle() calls that ran out of time with the machine still busy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outside-load", daemon=True)

    def start(self) -> OutsideLoad:
        self._thread.start()
        return self

    def _ticks(self) -> dict[int, int]:
        """CPU ticks of each process outside the run, by pid."""
        me = os.getpid()
        parent: dict[int, int] = {}
        ticks: dict[int, int] = {}
        ours: set[int] = {me}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    raw = f.read()
                fields = raw[raw.rindex(b")") + 2:].split()
                ppid, flags = int(fields[1]), int(fields[6])
                if flags & 0x00200000 or ppid == 2 or pid == 2:  # PF_KTHREAD, or a kernel thread
                    continue
                parent[pid], ticks[pid] = ppid, int(fields[11]) + int(fields[12])
                if self.work:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if self.work.encode() in f.read():
                            ours.add(pid)
            except (OSError, ValueError, IndexError):
                continue
        outside = {}
        for pid, t in ticks.items():
            p, seen = pid, 0
            while p not in ours and p in parent and seen < 64:
                p, seen = parent[p], seen + 1
            if p not in ours:
                outside[pid] = t
        return outside

    def _run(self) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        cores = os.cpu_count() or 1
        before, t0 = self._ticks(), time.monotonic()
        while not self._stop.wait(self.interval):
            now, t1 = self._ticks(), time.monotonic()
            used = sum(t - before[pid] for pid, t in now.items() if pid in before and t >= before[pid])
            self.samples.append(used / hz / max(1e-6, (t1 - t0) * cores))
            before, t0 = now, t1

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> dict[str, Any]:
        s = sorted(self.samples)
        median = statistics.median(s) if s else None
        return {"median": median, "max": s[-1] if s else None, "samples": len(s), "unsettled": self.unsettled,
                "busy": bool(self.unsettled) or (median is not None and median > self.BUSY)}

    def text(self) -> str:
        return load_text_of(self.summary())


def load_text_of(m: dict[str, Any] | None) -> str:
    """The report's line on the load outside a run (:meth:`OutsideLoad.summary`), with a warning where it
    makes the run no result."""
    if not m or not m["samples"]:
        return "Load outside this run: not sampled"
    line = (f"Load outside this run while it measured: median {m['median']:.0%}, at most {m['max']:.0%} of the "
            f"machine's {os.cpu_count()} cores ({m['samples']} samples)")
    if m["unsettled"]:
        line += f"; the machine never went quiet before {m['unsettled']} of its steps"
    if m["busy"]:
        line = ("**BUSY MACHINE: these figures are not a result** (other work competed with the passes; "
                "rerun on a quiet machine). " + line)
    return line


_LOAD: OutsideLoad | None = None


def outside_load() -> OutsideLoad | None:
    """The run's load watcher (started by :func:`start_run`), if any."""
    return _LOAD


def settle(busy_below: float = 0.15, most: float = 60.0) -> float:
    """Wait until the machine is quiet (what was just written is on disk and the CPUs are busy less than
    ``busy_below`` of one second), at most ``most`` seconds; the seconds waited. After an upload or a
    conversion the S3 server and the kernel keep writing for a while: a repetition measured then is
    slowed by them (a local-disk epoch at 66% instead of 90% in one run)."""
    started = time.monotonic()
    os.sync()

    while time.monotonic() - started < most:
        b0, a0 = host_cpu()
        time.sleep(1.0)
        b1, a1 = host_cpu()
        if (b1 - b0) <= busy_below * max(1, a1 - a0):
            break
    else:
        log(f"the machine is still busy after {most:.0f} s: what follows is measured on a busy machine")
        if _LOAD is not None:
            _LOAD.unsettled += 1
    return time.monotonic() - started


def drop_page_cache() -> None:
    """Drop the machine's page cache, holding the lock the test suite's page-cache tests hold (a run beside
    them would drop the caches they count on, and they ours)."""
    from epochfs.dev import pagecache

    pagecache.drop()


def fio_seq(files: list[Path]) -> float:
    """Aggregate bytes/s of len(files) concurrent sequential readers (fio job files in benchmarks/peers/fio)."""
    job = HERE / "fio" / f"seq-read-{len(files)}.fio"
    env = dict(os.environ, **{f"FILE{i}": str(f) for i, f in enumerate(files)})
    out = subprocess.run(["fio", "--output-format=json", str(job)], env=env, capture_output=True, text=True,
                         check=True, timeout=1800)
    data = json.loads(out.stdout[out.stdout.index("{"):])
    return float(sum(j["read"]["bw_bytes"] for j in data["jobs"]))


def small_files_rate(root: Path, keys: list[str], threads: int, *, buffered: bool = False) -> float:
    """Files per second reading whole files with ``threads`` readers pulling from one queue; opened with
    ``buffering=0``, or with Python's default buffering if ``buffered`` (as PIL and most datasets open
    files: ``open()`` then asks whether the file is a terminal, which on FUSE is a request to the daemon)."""
    it = iter(keys)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                key = next(it, None)
            if key is None:
                return
            with open(root / key, "rb", buffering=-1 if buffered else 0) as f:
                while f.read(1 << 20):
                    pass

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for fut in [pool.submit(worker) for _ in range(threads)]:
            fut.result()
    return len(keys) / (time.perf_counter() - start)


def ttfb(root: Path, keys: list[str]) -> float:
    """Median seconds from open() to the first byte, over ``keys``."""
    times = []
    for key in keys:
        start = time.perf_counter()
        with open(root / key, "rb", buffering=0) as f:
            f.read(1)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- boto3 baselines ----------------------------------------------------------------------------------

def boto_single(client: Any, bucket: str, key: str) -> float:
    start = time.perf_counter()
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    n = 0
    while chunk := body.read(1 << 20):
        n += len(chunk)
    return n / (time.perf_counter() - start)


def boto_parallel(client: Any, bucket: str, keys: list[tuple[str, int]], concurrency: int, part: int) -> float:
    ranges = [(k, o, min(part, size - o)) for k, size in keys for o in range(0, size, part)]

    def get(r: tuple[str, int, int]) -> int:
        k, o, n = r
        return len(client.get_object(Bucket=bucket, Key=k, Range=f"bytes={o}-{o + n - 1}")["Body"].read())

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(get, ranges))
    return total / (time.perf_counter() - start)


def boto_small_rate(client: Any, bucket: str, keys: list[str], threads: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(), keys))
    return len(keys) / (time.perf_counter() - start)


def boto_ttfb(client: Any, bucket: str, keys: list[str]) -> float:
    times = []
    for k in keys:
        start = time.perf_counter()
        client.get_object(Bucket=bucket, Key=k, Range="bytes=0-0")["Body"].read()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- training simulation (MLPerf Storage style) -------------------------------------------------------

def train(root: Path, keys: list[str], *, accelerators: int, batch: int, compute: float, workers: int,
          epochs: int, seed: int, before_epoch: Callable[[list[str], int], None]) -> list[float]:
    """AU per epoch reading files under ``root``, with the page cache dropped before every epoch (as
    for a dataset larger than memory: every epoch reaches the file system). See :func:`simulate`."""
    def read(key: str) -> int:
        return len((root / key).read_bytes())

    def epoch_start(order: list[str], epoch: int) -> None:
        drop_page_cache()
        before_epoch(order, epoch)

    return simulate(read, keys, accelerators=accelerators, batch=batch, compute=compute, workers=workers,
                    epochs=epochs, seed=seed, before_epoch=epoch_start)


def simulate(read: Callable[[str], int], keys: list[str], *, accelerators: int, batch: int, compute: float,
             workers: int, epochs: int, seed: int,
             before_epoch: Callable[[list[str], int], None] = lambda order, epoch: None) -> list[float]:
    """AU per epoch: compute time / wall time of each simulated accelerator (first step excluded),
    averaged over accelerators. Each accelerator reads (``read(key)``) its DistributedSampler share of a
    fresh seeded shuffle in batches through a pool of ``workers`` readers that keeps two batches ahead,
    then 'computes' (sleeps) for ``compute`` seconds per batch."""
    results = []
    for epoch in range(epochs):
        order = shuffled(keys, seed, epoch)
        before_epoch(order, epoch)
        aus: list[float] = []

        def accelerator(rank: int, order: list[str], aus: list[float]) -> None:
            share = partition(order, rank, accelerators)
            batches = [share[i:i + batch] for i in range(0, len(share), batch)]
            with ThreadPoolExecutor(workers) as pool:
                def load(b: list[str]) -> int:
                    return sum(read(k) for k in b)

                pending = [pool.submit(load, b) for b in batches[:2]]
                nxt = 2
                first_done = None
                for _ in batches:
                    pending.pop(0).result()
                    if nxt < len(batches):
                        pending.append(pool.submit(load, batches[nxt]))
                        nxt += 1
                    time.sleep(compute)
                    if first_done is None:
                        first_done = time.perf_counter()
                wall = time.perf_counter() - first_done
            steps = len(batches) - 1
            aus.append(min(1.0, steps * compute / wall) if steps and wall > 0 else 1.0)

        threads = [threading.Thread(target=accelerator, args=(r, order, aus)) for r in range(accelerators)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.append(sum(aus) / len(aus))
    return results


def shard_and_files(files: int, large_mib: int) -> tuple[list[Any], Any]:
    """The read-path data set: ``files`` x 100 KiB in 20 directories and one ``large_mib`` MiB shard."""
    from epochfs.dev.sample import SampleFile

    small = [SampleFile(f"s/{i % 20:02d}/{i:05d}.jpg", 100 * 1024) for i in range(files)]
    return small, SampleFile("large/shard.tar", large_mib << 20)


#: The file that marks a directory as a benchmark's own work directory (made when the tool makes it):
#: only such a directory is ever cleared.
WORK_MARK = ".epochfs-benchmark-work"


def _unescape(field: str) -> str:
    """A path of /proc/self/mountinfo (spaces, tabs, newlines and backslashes escaped as octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def fuse_mounts_under(work: Path, mountinfo: str | None = None) -> list[str]:
    """The FUSE mounts at or under ``work``, whole path components only (``/srv/box`` holds
    ``/srv/box/m``, never ``/srv/box2/m``), deepest first, from ``/proc/self/mountinfo``."""
    text = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
    root = os.path.normpath(str(work))
    found = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(" "), right.split(" ")
        if not sep or len(fields) < 5 or not tail or not tail[0].startswith("fuse"):
            continue
        point = os.path.normpath(_unescape(fields[4]))
        if point == root or point.startswith(root.rstrip("/") + "/"):
            found.append(point)
    return sorted(found, key=lambda p: -p.count("/"))


def fresh_workdir(work: Path) -> None:
    """Clear what a previous run left under ``work`` (its FUSE mounts, the processes it started) and
    make it again, marked as this tool's (:data:`WORK_MARK`). A directory that exists, holds anything
    and was not made by a benchmark is refused (``--work /tmp`` would clear other jobs' files)."""
    work = Path(os.path.abspath(work))
    ours = Path(__file__).resolve().parents[1] / "work"  # (the tools' default place: theirs whatever it holds)
    if work.exists() and not work.is_relative_to(ours) and (
            not work.is_dir() or (any(work.iterdir()) and not (work / WORK_MARK).exists())):
        raise SystemExit(f"--work {work}: exists and is not a benchmark's work directory (no {WORK_MARK} in "
                         "it): give a new directory, or an earlier run's")
    stop_leftovers(work)
    for point in fuse_mounts_under(work):
        subprocess.run(["fusermount3", "-uz", point], capture_output=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / WORK_MARK).write_text("made by epochfs's benchmarks: cleared at the start of each run\n")
    global _LOAD
    if _LOAD is None:  # (the run begins: the load outside it is watched until it ends)
        _LOAD = OutsideLoad(work).start()


def stop_leftovers(work: Path) -> list[int]:
    """Kill the processes an earlier run under ``work`` left (killed before its tear-down): those whose
    command line names a path under ``work`` (the servers, proxies and daemons a run starts all do).
    Their pids."""
    mine, needle = os.getpid(), (os.path.normpath(str(work)).rstrip("/") + "/").encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (mine, os.getppid()):
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP (kill, timeout, systemd, CI) end a run as Ctrl-C does: through its tear-down."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def machine() -> dict[str, Any]:
    """The machine a run measured, for its results: CPUs, CPU model, memory, kernel, Python, the disk."""
    mem = Path("/proc/meminfo").read_text().split()[1]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    here = Path(__file__).resolve().parent
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": round(int(mem) / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "outside_load": _LOAD.summary() if _LOAD is not None else None,
            "disk": subprocess.run(["df", "-h", str(here)], capture_output=True, text=True).stdout.splitlines()[-1]}


def save_results(target: Path, out: dict[str, Any], text: str) -> None:
    """A benchmark's results: the JSON at ``target``, its markdown report beside it (``.md``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if _LOAD is not None:
        out = {**out, "outside_load": _LOAD.summary()}
    target.write_text(json.dumps(out, indent=1, default=str) + "\n")
    target.with_suffix(".md").write_text(text)


def start_run(work: Path) -> bool:
    """A benchmark's preamble: it needs root (FUSE mounts, dropping the page cache); a fresh ``work``."""
    if os.geteuid() != 0:
        print("needs root (FUSE mounts, dropping the page cache)", file=sys.stderr)
        return False
    stop_on_signals()
    fresh_workdir(work)
    return True


def load_text(m: dict[str, Any] | None = None) -> str:
    """The report's line on the load outside the run: of the summary ``m`` a run saved, else of this
    run's watcher so far."""
    return load_text_of(m if m is not None else _LOAD.summary() if _LOAD is not None else None)
