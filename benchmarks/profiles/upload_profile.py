"""Where the CPU goes while a 1 GiB checkpoint uploads from an epochfs --writeback mount: CPU seconds of
the daemon and of the local S3 server during `epochfs sync`, and py-spy samples (--gil --threads) of the
daemon's threads while they hold the GIL.

    sudo .venv/bin/python benchmarks/profiles/upload_profile.py | tee benchmarks/profiles/results/<date>-upload-profile.txt
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import proc_usage  # noqa: E402
from workloads import start_run  # noqa: E402

from epochfs.dev.servers import LocalS3  # noqa: E402

BIN = Path(sys.executable).parent
SECONDS, RATE = 6, 200


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path(__file__).resolve().parents[1] / "work" / "upload-profile")
    work = ap.parse_args().work
    if not start_run(work):
        return 2
    server = LocalS3(work / "s3").start()
    mnt = work / "mnt"
    mnt.mkdir()
    try:
        server.client().create_bucket(Bucket="ckpt")
        subprocess.run([str(BIN / "epochfs"), "mount", "s3://ckpt/job", str(mnt), "--writeback", "--endpoint-url",
                        server.endpoint, "--cache-dir", str(work / "cache"), "--metrics-addr", "off"],
                       env=server.env(), check=True)
        pid = int(os.getxattr(mnt, "user.epochfs.pid"))
        data = os.urandom(1 << 30)
        with open(mnt / "ckpt.pt", "wb", buffering=0) as f:
            for off in range(0, len(data), 4 << 20):
                f.write(data[off:off + (4 << 20)])
        raw = work / "raw.txt"
        spy = subprocess.Popen([str(BIN / "py-spy"), "record", "--pid", str(pid), "--duration", str(SECONDS),
                                "--rate", str(RATE), "--format", "raw", "--output", str(raw), "--threads", "--gil",
                                "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        start, daemon0, s30 = time.time(), proc_usage(pid)["cpu"], proc_usage(server.proc.pid)["cpu"]
        subprocess.run([str(BIN / "epochfs"), "sync", str(mnt)], check=True)
        print(f"upload of 1 GiB: {time.time() - start:.1f} s; CPU: daemon {proc_usage(pid)['cpu'] - daemon0:.2f} s, "
              f"S3 server {proc_usage(server.proc.pid)['cpu'] - s30:.2f} s")
        spy.wait()
        threads: collections.Counter[str] = collections.Counter()
        leaves: collections.Counter[str] = collections.Counter()
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")
            threads[frames[0][:60]] += int(n)
            leaves[frames[-1][:110]] += int(n)
        print(f"GIL-holding samples: {sum(threads.values())} of {SECONDS * RATE} ({SECONDS} s at {RATE} Hz)")
        for name, n in threads.most_common(8):
            print(f"{n:6d}  {name}")
        for name, n in leaves.most_common(15):
            print(f"{n:6d}  {name}")
    finally:
        subprocess.run([str(BIN / "epochfs"), "umount", str(mnt)], capture_output=True)
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
