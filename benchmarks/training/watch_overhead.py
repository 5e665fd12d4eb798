"""What ``epochfs.watch`` costs the training loop per step: a loop over the same items bare and through
``watch`` (reporting in the background every 5 s to a mount point with no daemon behind it, so every
report fails, the worst case), best of 5 runs of 1,000,000 steps.

    .venv/bin/python benchmarks/training/watch_overhead.py [--steps 1000000]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from epochfs.watch import watch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1_000_000)
    args = ap.parse_args()
    items = list(range(args.steps))
    with tempfile.TemporaryDirectory() as nowhere:
        bare, watched = [], []
        for _ in range(5):
            start = time.perf_counter()
            for _ in items:
                pass
            bare.append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in watch(items, nowhere, job="overhead"):
                pass
            watched.append(time.perf_counter() - start)
    per_step = (min(watched) - min(bare)) / args.steps
    print(f"watch costs {per_step * 1e6:.2f} us per step ({args.steps} steps, best of 5; a bare loop step: "
          f"{min(bare) / args.steps * 1e9:.0f} ns)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
