"""What one of the cluster box's shaped links carries: a plain HTTP server in a namespace whose link is
shaped to ``--rate-mib`` MiB/s, and 1, 4 and 16 parallel downloads of one large file from another
namespace. Prints, per number of flows, the payload rate and the bytes the link's counter saw, each as
a share of the shaped rate: what a step of ``clusterbox.py`` can expect of a link at best.

    sudo .venv/bin/python benchmarks/cluster/goodput.py [--rate-mib 18] [--size-mib 64]

Measured 2026-12-06 (18 MiB/s): 0.94, 0.96 and 0.96 of the rate at 1, 4 and 16 flows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from netbox import NetBox  # noqa: E402

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-mib", type=float, default=18.0, help="the serving host's link, each direction")
    ap.add_argument("--size-mib", type=int, default=64, help="the file each flow downloads")
    ap.add_argument("--flows", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    rate = args.rate_mib * MiB
    with tempfile.TemporaryDirectory() as served, NetBox("efgp") as box:
        Path(served, "f.bin").write_bytes(os.urandom(args.size_mib * MiB))
        srv = box.host("srv", rate_in=rate, rate_out=rate)
        cli = box.host("cli")
        server = srv.popen(sys.executable, "-m", "http.server", "8000", "--bind", srv.address, "--directory", served)
        try:
            time.sleep(1.5)
            for flows in args.flows:
                sent0, t0 = srv.sent_bytes(), time.monotonic()
                procs = [subprocess.Popen(cli.command("curl", "-s", "-o", "/dev/null", "--noproxy", "*", "-w",
                                                      "%{size_download}", f"http://{srv.address}:8000/f.bin"),
                                          stdout=subprocess.PIPE) for _ in range(flows)]
                got = sum(int(p.communicate()[0] or 0) for p in procs)
                seconds = time.monotonic() - t0
                print(json.dumps({"flows": flows, "payload_of_rate": round(got / seconds / rate, 3),
                                  "counted_of_rate": round((srv.sent_bytes() - sent0) / seconds / rate, 3)}))
        finally:
            server.terminate()
            server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
