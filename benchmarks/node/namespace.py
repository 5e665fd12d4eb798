"""The namespace at scale: mount time, daemon memory, lookup and readdir latency, and the time to
publish one checkpoint, at 20 k, 200 k, 1 M (and, asked for, 10 M) objects: the current code beside an
earlier revision of it, in the same run, each in a fresh process.

The dataset is synthetic (1,000 class directories of image-sized files), written straight into the
embedded metadata store of a fresh cache directory with each revision's own code, so the measurement is
the namespace's part of a mount (what the daemon does before it answers), not a listing:

  first mount  the stored snapshot, nothing derived from it yet (the earlier code builds its tree, the
               current one its index)
  remount      the same again: what every later restart costs
  RSS          VmRSS and RssAnon of the remounted process (the interpreter and libraries included)
  lookup       resolve a random path, then look its name up in its parent (median of 20,000 distinct
               paths: cold, each asked for the first time; warm: the same again)
  readdir      every entry of one class directory with its node, per entry
  publish      one checkpoint published into the dataset (Snapshots.apply: the store's new version and
               the tree switched to it), and the longest a reader thread's lookup waited meanwhile

Then, through a real mount of a ``file://`` directory of ``--fuse-files`` empty files (100 per
directory) with the page cache and the kernel's entries dropped before each pass: ``stat`` of every
file (a LOOKUP and GETATTR each) and a listing with attributes of every directory (READDIR), per file,
medians of 3 passes.

    sudo .venv/bin/python benchmarks/node/namespace.py --baseline REV [--sizes 20000,200000,1000000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from epochfs.dev import pagecache

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

#: Runs in a fresh interpreter with PYTHONPATH at one revision's src/. argv: phase, cache dir, count,
#: and the shared store's URL (or "-": the embedded store).
CHILD = r'''
import json, os, random, sys, threading, time
phase, cache, count, meta = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
meta, name = (None, None) if meta == "-" else (meta, os.path.basename(cache))
from pathlib import Path
from epochfs.meta import open_meta
from epochfs.meta.snapshots import Snapshots, SnapshotSettings
from epochfs.core.records import ObjectInfo
SOURCE = "file:///synthetic"
DIRS = 1000

def key(i):
    return f"train/c{i % DIRS:04d}/img{i:09d}.jpg"

def objects():
    return (ObjectInfo(key(i), 100_000 + i % 5000, 1_700_000_000_000_000_000 + i, f'"{i:x}"') for i in range(count))

def status():
    text = Path("/proc/self/status").read_text()
    field = lambda name: int(text.split(name + ":")[1].split()[0]) * 1024
    return {"rss": field("VmRSS"), "anon": field("RssAnon"), "hwm": field("VmHWM")}

out = {}
if phase == "store":
    t = time.perf_counter()
    open_meta(meta, Path(cache), name).save(SOURCE, objects())
    out["store_s"] = time.perf_counter() - t
    print(json.dumps(out)); sys.exit()

t = time.perf_counter()
snaps = Snapshots(open_meta(meta, Path(cache), name),
                  SnapshotSettings(source_id=SOURCE, cache_dir=Path(cache), name=name), lambda: iter(()))
out["mount_s"] = time.perf_counter() - t
out.update(status())
if phase == "first":
    print(json.dumps(out)); sys.exit()

ns = snaps.namespace
rng = random.Random(1)
picks = [key(i) for i in rng.sample(range(count), min(count, 20000))]
for label in ("lookup_us", "lookup_warm_us"):
    times = []
    for p in picks:
        t = time.perf_counter()
        node = ns.resolve(p)
        parent = ns.resolve(p.rpartition("/")[0])
        found = ns.lookup(parent.inode, p.rpartition("/")[2].encode())
        times.append(time.perf_counter() - t)
        assert found is not None and found.inode == node.inode
    times.sort()
    out[label] = times[len(times) // 2] * 1e6
d = ns.resolve("train/c0007")
t = time.perf_counter()
if hasattr(ns, "entries"):
    listed = [(n, c) for n, c in ns.entries(d.inode)]
else:
    listed = [(n, ns.node(d.children[n])) for n in d.names]
out["readdir_us_per_entry"] = (time.perf_counter() - t) / len(listed) * 1e6
out["readdir_entries"] = len(listed)

import trio
stall = {"max": 0.0, "run": True}

def reader():
    i = 0
    while stall["run"]:
        t = time.perf_counter()
        snaps.namespace.resolve(picks[i % len(picks)])
        stall["max"] = max(stall["max"], time.perf_counter() - t)
        i += 1
        time.sleep(0.0005)

ckpt = ObjectInfo("checkpoints/step-000100.pt", 1 << 30, 1_800_000_000_000_000_000, '"ckpt"')

async def publish():
    await snaps.apply({ckpt.key: ckpt}, set())

th = threading.Thread(target=reader)
th.start()
time.sleep(0.2)
stall["max"] = 0.0
t = time.perf_counter()
trio.run(publish)
out["publish_s"] = time.perf_counter() - t
time.sleep(0.05)
stall["run"] = False
th.join()
out["reader_stall_ms"] = stall["max"] * 1e3
assert snaps.namespace.resolve(ckpt.key) is not None
snaps.close()
print(json.dumps(out))
'''


def run_child(src: Path, phase: str, cache: Path, count: int, meta: str = "-") -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    result = subprocess.run([sys.executable, "-c", CHILD, phase, str(cache), str(count), meta], env=env,
                            capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"{phase} at {count} ({src}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(src: Path, count: int, work: Path, meta: str = "-") -> dict:
    cache = Path(tempfile.mkdtemp(dir=work))
    out = run_child(src, "store", cache, count, meta)
    first = run_child(src, "first", cache, count, meta)
    out.update({"first_mount_s": first["mount_s"], "first_rss": first["rss"], "first_anon": first["anon"],
                "first_hwm": first["hwm"]})
    out.update(run_child(src, "remount", cache, count, meta))
    subprocess.run(["rm", "-rf", str(cache)], check=False)
    return out


def fuse_pass(src: Path, data: Path, work: Path, files: int) -> dict:
    """Per-file seconds of stat and of listing through a mount of ``data`` with ``src``'s code."""
    cache, mnt = Path(tempfile.mkdtemp(dir=work)), Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PYTHONPATH": str(src)}
    subprocess.run([sys.executable, "-m", "epochfs", "mount", f"file://{data}", str(mnt), "--cache-dir", str(cache),
                    "--metrics-targets", "off", "--metrics-addr", "127.0.0.1:0"], env=env, check=True,
                   capture_output=True, timeout=600)
    out: dict = {"stat": [], "readdir": []}
    try:
        dirs = sorted(os.listdir(mnt))
        for _ in range(3):
            for what in ("stat", "readdir"):
                pagecache.drop()  # the kernel forgets entries and inodes (under the page-cache lock)
                t = time.perf_counter()
                n = 0
                for d in dirs:
                    if what == "stat":
                        for i in range(100):
                            os.stat(mnt / d / f"f{i:03d}")
                            n += 1
                    else:
                        with os.scandir(mnt / d) as it:
                            for entry in it:
                                entry.stat()
                                n += 1
                assert n == files, (what, n)
                out[what].append((time.perf_counter() - t) / n)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        subprocess.run(["rm", "-rf", str(cache)], check=False)
    return {f"{k}_us": statistics.median(v) * 1e6 for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the revision to compare with (a git commit)")
    parser.add_argument("--sizes", default="20000,200000,1000000", help="object counts, comma-separated")
    parser.add_argument("--current-only-above", type=int, default=0,
                        help="run only the current code for sizes above this (the earlier one may not fit)")
    parser.add_argument("--shared", action="store_true",
                        help="also through a shared store (a local redis-server): publish, mount, mount again")
    parser.add_argument("--fuse-files", type=int, default=20000, help="files of the mounted pass (0: skip it)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="epochfs-nsbench-", dir="/var/tmp"))
    base = work / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(base), args.baseline],
                   check=True, capture_output=True)
    results: dict = {"baseline": args.baseline, "current": subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "sizes": {}}
    try:
        for count in sizes:
            row = {}
            for name, src in (("baseline", base / "src"), ("current", ROOT / "src")):
                if name == "baseline" and args.current_only_above and count > args.current_only_above:
                    continue
                print(f"{name} at {count:,} objects ...", flush=True)
                row[name] = measure(src, count, work)
                print(f"  {row[name]}", flush=True)
            results["sizes"][str(count)] = row
        if args.shared:
            sys.path.insert(0, str(ROOT / "src"))
            from epochfs.dev.servers import LocalRedis

            server = LocalRedis(work / "redis").start()
            try:
                for count in sizes:
                    for name, src in (("baseline", base / "src"), ("current", ROOT / "src")):
                        print(f"{name} at {count:,} objects through Redis ...", flush=True)
                        got = measure(src, count, work, server.url)
                        print(f"  {got}", flush=True)
                        results.setdefault("shared", {}).setdefault(str(count), {})[name] = got
            finally:
                server.stop()
        if args.fuse_files:
            data = work / "data"
            for d in range(args.fuse_files // 100):
                (data / f"d{d:04d}").mkdir(parents=True)
                for i in range(100):
                    (data / f"d{d:04d}" / f"f{i:03d}").touch()
            results["fuse"] = {"files": args.fuse_files}
            for _ in range(2):  # interleaved: baseline, current, baseline, current
                for name, src in (("baseline", base / "src"), ("current", ROOT / "src")):
                    print(f"{name} through a mount of {args.fuse_files:,} files ...", flush=True)
                    got = fuse_pass(src, data, work, args.fuse_files)
                    print(f"  {got}", flush=True)
                    results["fuse"].setdefault(name, []).append(got)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
        subprocess.run(["rm", "-rf", str(work)], check=False)
    stamp = datetime.date.today().isoformat()
    args.out.mkdir(exist_ok=True)
    (args.out / f"{stamp}-namespace.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{stamp}-namespace.md").write_text(report(results))
    print(report(results))


def report(results: dict) -> str:
    gib = 1 << 30
    lines = [f"# Namespace at scale: {results['current']} beside {results['baseline']}", "",
             "| objects | code | first mount s | remount s | RSS MiB | anon MiB | lookup µs cold / warm "
             "| readdir µs/entry | publish 1 s | reader stall ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for count, row in results["sizes"].items():
        for name, r in row.items():
            lines.append(f"| {int(count):,} | {name} | {r['first_mount_s']:.2f} | {r['mount_s']:.2f} | "
                         f"{r['rss'] / (1 << 20):.0f} | {r['anon'] / (1 << 20):.0f} | "
                         f"{r['lookup_us']:.1f} / {r.get('lookup_warm_us', float('nan')):.1f} | "
                         f"{r['readdir_us_per_entry']:.2f} | {r['publish_s']:.3f} | {r['reader_stall_ms']:.1f} |")
    if "shared" in results:
        lines += ["", "Through a shared store (Redis): publish the snapshot, a node's first mount of that version, "
                  "its next mount, publish one checkpoint:", "",
                  "| objects | code | import s | first mount s | remount s | RSS MiB | publish 1 s | reader stall ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for count, row in results["shared"].items():
            for name, r in row.items():
                lines.append(f"| {int(count):,} | {name} | {r['store_s']:.2f} | {r['first_mount_s']:.2f} | "
                             f"{r['mount_s']:.2f} | {r['rss'] / (1 << 20):.0f} | {r['publish_s']:.3f} | "
                             f"{r['reader_stall_ms']:.1f} |")
    if "fuse" in results:
        f = results["fuse"]
        lines += ["", f"Through a mount of {f['files']:,} files (µs per file, page cache and kernel entries "
                  "dropped; each pass twice, interleaved):", "", "| code | stat | listing with attributes |",
                  "|---|---|---|"]
        for name in ("baseline", "current"):
            runs = f.get(name, [])
            lines.append(f"| {name} | " + " / ".join(f"{r['stat_us']:.0f}" for r in runs) + " | "
                         + " / ".join(f"{r['readdir_us']:.0f}" for r in runs) + " |")
    sizes = list(results["sizes"])
    if len(sizes) > 1:
        lo, hi = results["sizes"][sizes[0]], results["sizes"][sizes[-1]]
        for name in ("baseline", "current"):
            if name in lo and name in hi:
                lines.append(f"\n{name}: remount at {int(sizes[-1]):,} costs "
                             f"{(hi[name]['rss'] - lo[name]['rss']) / gib:.3f} GiB more RSS than at "
                             f"{int(sizes[0]):,}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
