"""Where the daemon's time goes on a read of small files: py-spy samples of the epochfs daemon,
summarised as the share of samples in which each function appears (inclusive), heaviest first.
Cold (empty cache) by default; ``--warm`` reads everything once, drops the page cache, then profiles
the second pass (served from the block cache).

    sudo .venv/bin/python benchmarks/profiles/profile.py [--files 3000] [--threads 16] [--warm] [--latency-ms 20] [--out FILE]

``--latency-ms`` puts the endpoint behind ``latency_proxy.py`` (in a process of its own), as
``readpath.py --latency-ms`` does: the cold path when every fetch waits on a far endpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import wait_mounted  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402

from epochfs.control import request
from epochfs.dev import pagecache
from epochfs.dev.sample import SampleFile, upload, write_tree
from epochfs.dev.servers import LocalS3

HERE = Path(__file__).resolve().parent


def summarise(raw: Path, top: int) -> tuple[int, list[tuple[float, str]]]:
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        for frame in {f.split(" (")[0] for f in stack.split(";")}:
            inclusive[frame] += n
    return total, [(n / total, name) for name, n in inclusive.most_common(top)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--size-kib", type=int, default=100, help="size of each file (e.g. 262144: large files)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--warm", action="store_true", help="profile a second pass, from the block cache")
    ap.add_argument("--gil", action="store_true", help="only samples of the thread holding the GIL (CPU in Python)")
    ap.add_argument("--floor", action="store_true",
                    help="profile the floor of our stack instead (benchmarks/peers/floor.py over the same files on local disk)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="added per request and new connection (a proxy)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    work = HERE.parent / "work" / "profile"
    subprocess.run(["fusermount3", "-uz", str(work / "mnt")], capture_output=True)
    shutil.rmtree(work, ignore_errors=True)
    (work / "mnt").mkdir(parents=True)
    server = LocalS3(work / "s3").start()
    proxy = ProxyProcess(server.port, args.latency_ms / 1000) if args.latency_ms else None
    try:
        files = [SampleFile(f"s/{i:05d}.jpg", args.size_kib * 1024) for i in range(args.files)]
        upload(server.client(), "profile", "", files)
        if args.floor:
            write_tree(str(work / "raw"), files)
            floor = subprocess.Popen([sys.executable, str(HERE.parent / "peers" / "floor.py"), str(work / "raw"), str(work / "mnt")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_mounted(work / "mnt")
            pid = floor.pid
        else:
            subprocess.run([sys.executable, "-m", "epochfs", "mount", "s3://profile", str(work / "mnt"),
                            "--endpoint-url", proxy.endpoint if proxy else server.endpoint, "--cache-dir", str(work / "cache"), "--metrics-addr",
                            "off"], env=server.env(), check=True)
            pid = int(os.getxattr(work / "mnt", "user.epochfs.pid"))

        def read(f: SampleFile) -> int:
            n = 0
            with open(work / "mnt" / f.key, "rb", buffering=0) as fh:
                while chunk := fh.read(1 << 20):
                    n += len(chunk)
            return n

        if args.warm:
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(read, files))
            if not args.floor:
                request(work / "mnt", "status")  # the daemon answers: fills are written behind, let them land
            time.sleep(2)
            pagecache.drop()  # (holding the lock the test suite's page-cache tests hold)
        raw = work / "samples.txt"
        spy_proc = subprocess.Popen([spy, "record", "-p", str(pid), "-o", str(raw), "-f", "raw", "-r", "200",
                                     "--threads", *(["--gil"] if args.gil else [])],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(read, files))
        rate = len(files) / (time.perf_counter() - start)
        spy_proc.send_signal(2)
        spy_proc.wait()
        if args.floor:
            subprocess.run(["fusermount3", "-u", str(work / "mnt")], check=True)
            floor.wait(30)
        else:
            subprocess.run([sys.executable, "-m", "epochfs", "umount", str(work / "mnt")], check=True)
    finally:
        if proxy:
            proxy.stop()
        server.stop()
    mib_s = rate * args.size_kib / 1024
    lines = [f"{'the floor: ' if args.floor else ''}{'warm' if args.warm else 'cold'} read of {args.files} x {args.size_kib} KiB files with {args.threads} "
             f"threads{f', {args.latency_ms:g} ms added' if args.latency_ms else ''}: {rate:.0f} files/s, {mib_s:.0f} MiB/s",
             f"share of the daemon's ({'GIL-holding' if args.gil else 'non-idle'}) samples in which each "
             "function appears:"]
    total, shares = summarise(raw, args.top)
    lines[-1] = lines[-1].replace("samples", f"samples ({total} at 200 Hz)", 1)
    lines += [f"{share:6.1%}  {name}" for share, name in shares]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
