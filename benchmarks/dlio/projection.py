"""What an 8-accelerator node needs to keep MLPerf Storage's unet3d at its H100 rate, projected from what
was measured here: where a Python daemon stands, and which fast path carries the rest.

    python benchmarks/dlio/projection.py --cold benchmarks/dlio/results/DATE-dlio-cold.json \
        --readpath benchmarks/peers/results/DATE-readpath-2core-20ms.json

Inputs, each from a committed result: the daemon's CPU seconds per GiB of a cold epoch read as a plain
mount (DLIO, one epoch, one accelerator: ``dlio.py --epochs 1 --accelerators 1``, every byte fetched from
the backend, the order learned), and per warm GiB through the daemon and with ``--passthrough``, the
kernel reading the cache's own file (``readpath.py --variant=--passthrough``, medians of its repetitions). The rate: MLPerf Storage's unet3d asks 2.66 GiB/s per H100
at >= 90% AU. Cores are the daemon's CPU seconds per GiB times the node's GiB/s; the link is the node's
GiB/s in Gbit/s. A Python daemon's request loop runs on one core (its worker threads add some), so what
one core carries is the figure to set against one accelerator's rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

GiB = 1 << 30
UNET3D_H100 = 2.66  # GiB/s per accelerator at >= 90% AU (MLPerf Storage v1.0, unet3d)


def readpath_cpu(rows: list[dict[str, Any]], who: str, what: str) -> float:
    return statistics.median(next(r["values"] for r in rows if r["who"] == who and r["what"] == what))


def project(cold: dict[str, Any], readpath: dict[str, Any], accelerators: int = 8) -> dict[str, Any]:
    gib = cold["files"] * cold["file_mib"] / 1024
    learned = [r for r in cold["runs"] if r["contender"] == "epochfs" and r["accelerators"] == 1]
    if not learned or cold["epochs"] != 1:
        raise SystemExit("--cold: a dlio.py run of one epoch with epochfs at 1 accelerator")
    per_gib = {
        "cold, through the daemon (learned order)": statistics.median(r["daemon_cpu_s"] for r in learned) / gib,
        "warm, through the daemon": readpath_cpu(readpath["rows"], "epochfs", "daemon CPU s per warm GiB"),
        "warm, passthrough (the kernel reads the cache's own file)":
            readpath_cpu(readpath["rows"], "epochfs-variant", "daemon CPU s per warm GiB"),
    }
    rate = accelerators * UNET3D_H100
    rows = [{"path": path, "cpu_s_per_gib": s, "cores": s * rate,
             "one_core_gib_s": (1 / s) if s > 0 else None} for path, s in per_gib.items()]
    return {"accelerators": accelerators, "gib_s": rate, "gbit_s": rate * GiB * 8 / 1e9, "rows": rows,
            "cold_au": {f"{r['latency_ms']:g} ms": r["au_per_epoch"][0] for r in learned}}


def report(p: dict[str, Any], sources: list[str]) -> str:
    lines = ["# Projection: an 8-accelerator unet3d H100 node", "",
             f"{p['accelerators']} accelerators x {UNET3D_H100} GiB/s = {p['gib_s']:.1f} GiB/s "
             f"({p['gbit_s']:.0f} Gbit/s) at >= 90% AU. Inputs: " + ", ".join(f"`{s}`" for s in sources) + ".", "",
             "| path | daemon CPU s per GiB (measured) | daemon cores for the node | what one core carries |",
             "|---|---|---|---|"]
    for r in p["rows"]:
        one = "no daemon work" if r["one_core_gib_s"] is None else f"{r['one_core_gib_s']:.1f} GiB/s"
        lines.append(f"| {r['path']} | {r['cpu_s_per_gib']:.2f} | {r['cores']:.1f} | {one} |")
    lines += ["", f"- **The link**: a cold epoch moves every byte over the node's link: {p['gbit_s']:.0f} Gbit/s, "
              "two 100 GbE ports at full rate, or a cache tier of nodes whose links add up to it "
              "(`epochfs plan --cluster` sizes it); a warm epoch reads the node's NVMe cache at "
              f"{p['gib_s']:.1f} GiB/s (three to four PCIe 4.0 drives).",
              "- **A Python daemon's place**: its request loop is one core. Through the daemon, one core "
              "carries a fraction of one accelerator's 2.66 GiB/s cold, and less than one accelerator's warm; "
              "so at the H100 rate the daemon is the control plane (what to fetch, in which order, verified "
              "into the cache) and the bytes of warm large files go through the kernel: passthrough "
              "(the kernel reads the cache's own file: no daemon work per read, no second copy; the default "
              "for a dataset of large files) and the page cache for what fits in memory. Cold, the bytes must "
              "come through someone's process once; several mounts (one a dataset shard) or cache nodes "
              "spread that over cores.",
              "- **Measured on this 2-core machine** (the cold first epoch at 1 accelerator, the learned order): "
              + ", ".join(f"{k}: {v:.0f}% AU" for k, v in p["cold_au"].items()) + "."]
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> str:
    """A path as the note names it: from the repository's root where it lies inside it."""
    root = Path(__file__).resolve().parents[2]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cold", type=Path, required=True, help="dlio.py results of one epoch (JSON)")
    ap.add_argument("--readpath", type=Path, required=True, help="readpath.py results with --variant=--passthrough")
    ap.add_argument("--out", type=Path, help="write the note here (markdown)")
    args = ap.parse_args()
    p = project(json.loads(args.cold.read_text()), json.loads(args.readpath.read_text()))
    text = report(p, [_shown(args.cold), _shown(args.readpath)])
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
