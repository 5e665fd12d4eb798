"""MLPerf Storage's engine, DLIO, saving checkpoints beside training: what a save costs the accelerators,
how long until it is durable, and how fast a fresh node restores it, for each contender.

    bash benchmarks/dlio/dlio-setup.sh        # once: DLIO 2.0.0 in benchmarks/work/.venv-dlio
    sudo .venv/bin/python benchmarks/dlio/dlio_checkpoint.py [--latency-ms 20] [--accelerators 2] [--out F]

DLIO's unet3d workload scaled as ``dlio.py`` scales it (the same dataset, calibration and launch), with
its own checkpointing on: every rank (``checkpoint.type=all_ranks``) ``torch.save``s unet3d's
``model_size`` of state (499 MB, and DLIO's 24.7 MB layer file) after every other epoch, into a folder
on the contender's mount: a ``--writeback`` mount for epochfs and JuiceFS CE, the same disk for local
disk. DLIO leaves the save out of its AU (the epoch's duration includes it), so the save is counted
here: an epoch's AU with its save counted is DLIO's AU x (epoch - save) / epoch, from DLIO's own
per-epoch timestamps (``per_epoch_stats.json``), and the save's time is rank 0's, as DLIO times it.

After DLIO ends: the time until the last save is durable in the backend (epochfs: ``epochfs sync``
returns; JuiceFS: its staging directory is empty), then the last save restored the way MLPerf Storage
v2 restores (each rank its own files, page cache dropped, the slowest rank's time): on the node that
wrote it and on a fresh node (an empty cache), every tensor checked (DLIO's tensors are zeros of a
known size). The daemon's CPU per GiB saved is the run's CPU through durability less that of the same
run without checkpointing (both cold, the same reads), for epochfs only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import VENV_BIN, Contender, Epochfs, Juicefs, RawDisk  # noqa: E402
from dlio import BATCH, BUCKET, PREFIX, THREADS, dlio, prepare, upload  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import drop_page_cache, load_text, log, machine, save_results, start_run  # noqa: E402

from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL_SIZE = 499153191  # unet3d_h100.yaml's checkpoint.model_size
TIMEOUT = 600.0
RESTORE = """
import sys, time, torch
t = time.perf_counter(); n = 0
for path in sys.argv[2:]:
    state = torch.load(path, weights_only=True)
    for name, tensor in state.items():
        if tensor.dtype != torch.int8 or bool(tensor.any()):
            raise SystemExit(f"{path}: tensor {name} is not the zeros DLIO saved")
        n += tensor.numel()
if n < int(sys.argv[1]):
    raise SystemExit(f"{n} elements restored, {sys.argv[1]} expected")
print(time.perf_counter() - t, n)
"""


def checkpoint_overrides(folder: Path, model_size: int) -> list[str]:
    return ["++workload.workflow.checkpoint=True", f"++workload.checkpoint.checkpoint_folder={folder}",
            "++workload.checkpoint.checkpoint_after_epoch=2", "++workload.checkpoint.epochs_between_checkpoints=2",
            "++workload.checkpoint.type=all_ranks", f"++workload.checkpoint.model_size={model_size}"]


def epochs_of(out: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each epoch: DLIO's AU, its duration, its saves' duration, the AU with the saves counted."""
    stats = json.loads((out / "per_epoch_stats.json").read_text())
    rows = []
    for i, au in enumerate(summary["metric"]["train_au_percentage"]):
        epoch = stats[str(i + 1)]
        duration = float(epoch["duration"])
        save = sum(float(v["duration"]) for k, v in epoch.items() if k.startswith("ckpt"))
        rows.append({"epoch": i + 1, "au": au, "duration_s": duration, "save_s": save,
                     "au_counted": au * (duration - save) / duration if duration > 0 else 0.0})
    return rows


def restore(files: dict[int, list[Path]], elements: int) -> float:
    """The slowest rank's time to ``torch.load`` and check its files (one process a rank, at once)."""
    drop_page_cache()
    procs = [subprocess.Popen([str(VENV_BIN / "python"), "-c", RESTORE, str(elements), *map(str, paths)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for paths in files.values()]
    times = []
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT)
        if p.returncode != 0:
            raise RuntimeError(f"restore failed: {err[-2000:]}")
        times.append(float(out.split()[0]))
    return max(times)


def last_save(folder: Path, ranks: int, epochs: int) -> dict[int, list[Path]]:
    """Each rank's files of the last save (DLIO names them ``*-EPOCH-STEP-RANK.pt``)."""
    last = max(e for e in range(2, epochs + 1, 2))
    files: dict[int, list[Path]] = {r: [] for r in range(ranks)}
    for p in sorted(folder.iterdir()):
        parts = p.stem.split("-")
        if int(parts[-3]) == last:
            files[int(parts[-1])].append(p)
    if not all(files.values()):
        raise RuntimeError(f"the last save ({last}) is missing a rank's files in {folder}: {sorted(folder.iterdir())}")
    return files


def durable(c: Contender) -> float:
    """Seconds until everything saved is in the backend."""
    t = time.perf_counter()
    if isinstance(c, Epochfs):
        subprocess.run([str(VENV_BIN / "epochfs"), "sync", str(c.root)], check=True, capture_output=True,
                       timeout=TIMEOUT)
    elif isinstance(c, Juicefs):
        deadline = time.monotonic() + TIMEOUT
        while any("rawstaging" in Path(d).parts and files for d, _, files in os.walk(c.cache)):
            if time.monotonic() > deadline:
                raise RuntimeError("JuiceFS's staging directory did not empty")
            time.sleep(0.05)
    else:
        os.sync()
    return time.perf_counter() - t


def run_one(args: argparse.Namespace, c: Contender, server: LocalS3, n: int, compute: float, out: Path,
            folder: Path, *, save: bool) -> dict[str, Any]:
    c.mount()  # (an empty cache)
    bucket = getattr(c, "volume", "") or BUCKET
    drop_page_cache()
    gets0, cpu0 = server.request_count(bucket), c.usage()["cpu"]
    more = checkpoint_overrides(folder, args.model_size) if save else []
    summary = dlio(args, c.root, out, ranks=n, epochs=args.epochs,
                   compute=compute, more=more)
    row: dict[str, Any] = {"accelerators": n, "saves": save, "epochs": epochs_of(out, summary),
                           "au_mean": summary["metric"]["train_au_mean_percentage"]}
    if save:
        row["durable_s"] = durable(c)
    row["daemon_cpu_s"] = c.usage()["cpu"] - cpu0
    row["backend_gets"] = server.request_count(bucket) - gets0
    if not save:
        c.unmount()
        return row
    files = last_save(folder, n, args.epochs)
    row["saved_bytes"] = sum(p.stat().st_size for ps in files.values() for p in ps)
    elements = args.model_size  # (each rank's model tensor at least)
    row["restore_here_s"] = restore(files, elements)
    if not isinstance(c, RawDisk):
        c.unmount()
        c.mount()  # a fresh node: an empty cache, the same backend
        gets0 = server.request_count(bucket)
        bytes0 = c.status()["backend"]["bytes"] if isinstance(c, Epochfs) else None
        row["restore_fresh_s"] = restore(files, elements)
        row["restore_fresh_gets"] = server.request_count(bucket) - gets0
        if bytes0 is not None:
            row["restore_fresh_backend_bytes"] = c.status()["backend"]["bytes"] - bytes0
        c.unmount()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[20.0])
    ap.add_argument("--accelerators", type=int, nargs="+", default=[2])
    ap.add_argument("--files", type=int, default=240, help="files of the dataset (a multiple of 24)")
    ap.add_argument("--file-mib", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=4, help="epochs (a save after every other one; at least 2)")
    ap.add_argument("--fraction", type=float, default=0.25,
                    help="what one accelerator asks, as a fraction of local disk's cold rate (default 0.25)")
    ap.add_argument("--model-size", type=int, default=MODEL_SIZE, help="bytes of model state a rank saves")
    ap.add_argument("--contenders", nargs="+", default=["local disk", "epochfs", "JuiceFS"],
                    help="of: 'local disk', epochfs, JuiceFS (each --writeback)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip epochfs's run without checkpointing (its CPU per GiB saved is then not reported)")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "dlio-checkpoint")
    ap.add_argument("--out", type=Path, help="results JSON (a .md beside it); default: "
                                             "benchmarks/dlio/results/DATE-dlio-checkpoint.json")
    args = ap.parse_args()
    if args.files % 24 or args.epochs < 2:
        ap.error("--files must be a multiple of 24 and --epochs at least 2")
    if not (HERE.parent / "work" / ".venv-dlio" / "bin" / "python").exists():
        print(f"DLIO is not installed: bash {HERE / 'dlio-setup.sh'}", file=sys.stderr)
        return 2
    if not start_run(args.work):
        return 2
    data, rate, compute = prepare(args)
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(),
                           "command": " ".join(sys.argv), "files": args.files, "file_mib": args.file_mib,
                           "batch": BATCH, "read_threads": THREADS, "epochs": args.epochs, "fraction": args.fraction,
                           "model_size": args.model_size, "local_cold_samples_s": rate, "computation_time": compute,
                           "runs": []}
    server = LocalS3(args.work / "s3").start()
    try:
        upload(server.client(), data)
        for latency in args.latency_ms:
            proxy = ProxyProcess(server.port, latency / 1000)
            try:
                cases: list[tuple[Contender, bool]] = []
                if "local disk" in args.contenders and latency == args.latency_ms[0]:
                    cases.append((RawDisk(args.work, "", BUCKET, PREFIX, 0, data_dir=data), True))
                if "epochfs" in args.contenders:
                    e = Epochfs(args.work / f"lat{latency:g}", proxy.endpoint, BUCKET, PREFIX, 1 << 34,
                                manifest=False, name="epochfs --writeback")
                    e.extra = ["--writeback"]
                    e.tuning += ", --writeback"
                    cases += [(e, True)] + ([] if args.no_baseline else [(e, False)])
                if "JuiceFS" in args.contenders:
                    j = Juicefs(args.work / f"lat{latency:g}", proxy.endpoint, BUCKET, PREFIX, 1 << 34)
                    j.name, j.extra, j.tuning = "JuiceFS --writeback", ["--writeback"], j.tuning + ", --writeback"
                    cases.append((j, True))
                for c, save in cases:
                    for n in args.accelerators:
                        folder = (args.work / "local-checkpoints" if isinstance(c, RawDisk)
                                  else c.root / "checkpoints") / f"{n}-{latency:g}"
                        run_dir = args.work / "runs" / f"{c.name.split()[0]}-{latency:g}-{n}-{'save' if save else 'none'}"
                        row = run_one(args, c, server, n, compute, run_dir, folder, save=save)
                        row.update(contender=c.name, latency_ms=0.0 if isinstance(c, RawDisk) else latency,
                                   tuning=c.tuning)
                        out["runs"].append(row)
                        log(f"{c.name} {row['latency_ms']:g} ms, {n} accelerators, saves {save}: "
                            + " ".join(f"{e['au_counted']:.0f}% ({e['save_s']:.2f} s)" for e in row["epochs"])
                            + (f", durable {row['durable_s']:.1f} s, restore {row['restore_here_s']:.2f} s here, "
                               f"{row.get('restore_fresh_s', 0):.2f} s fresh" if save else "")
                            + f", {row['daemon_cpu_s']:.1f} s CPU")
            finally:
                proxy.stop()
    finally:
        server.stop()
    text = report(out)
    print(text)
    save_results(args.out or HERE / "results" / f"{out['date']}-dlio-checkpoint.json", out, text)
    return 0


def split_au(row: dict[str, Any]) -> tuple[float, float, float]:
    """Mean AU (save counted) of the epochs that save, of the later ones that do not, the mean save time."""
    saving = [e for e in row["epochs"] if e["save_s"] > 0]
    others = [e for e in row["epochs"][1:] if e["save_s"] == 0]  # (the first epoch is cold: left out)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return (mean([e["au_counted"] for e in saving]), mean([e["au_counted"] for e in others]),
            mean([e["save_s"] for e in saving]))


def report(out: dict[str, Any]) -> str:
    m = out["machine"]
    lines = [f"# DLIO checkpointing beside training (MLPerf Storage's engine), {out['date']}", "",
             f"Machine: {m['cpu']}, {m['cpus']} cores, {m['memory_gib']:g} GiB, Linux {m['kernel']}. Command: "
             f"`{out['command']}`.", "", load_text(), "",
             f"DLIO 2.0.0 unet3d scaled as dlio.py: {out['files']} files of {out['file_mib']} MiB, batches of "
             f"{out['batch']}, {out['read_threads']} read threads a rank, {out['epochs']} epochs, computation_time "
             f"{out['computation_time']:.3f} s a batch. Each rank saves {out['model_size'] / 1e6:.0f} MB of model "
             "state (and DLIO's 24.7 MB layer file) with torch.save after epochs 2, 4, ..., no fsync (DLIO's way); "
             "the save is counted in the AU here. Restore: each rank torch.loads its part of the last save, page "
             "cache dropped, the slowest rank; a fresh node is a new mount with an empty cache.", "",
             "| contender | latency | accelerators | AU per epoch, save counted (save s) | saving epochs' AU | "
             "later epochs' AU | ratio | save s | durable s | restore here s | restore fresh s | fresh GETs | "
             "daemon CPU s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["runs"]:
        if not r["saves"]:
            continue
        saving, others, save = split_au(r)
        lines.append(f"| {r['contender']} | {r['latency_ms']:g} ms | {r['accelerators']} | "
                     + " ".join(f"{e['au_counted']:.1f}%" + (f" ({e['save_s']:.2f})" if e["save_s"] else "")
                                for e in r["epochs"])
                     + f" | {saving:.1f}% | {others:.1f}% | {saving / others:.2f} | {save:.2f} | "
                     f"{r['durable_s']:.1f} | {r['restore_here_s']:.2f} | "
                     + (f"{r['restore_fresh_s']:.2f} | {r['restore_fresh_gets']}" if "restore_fresh_s" in r
                        else "— | —") + f" | {r['daemon_cpu_s']:.1f} |")
    baselines = {(r["contender"], r["latency_ms"], r["accelerators"]): r for r in out["runs"] if not r["saves"]}
    cost = []
    for r in out["runs"]:
        base = baselines.get((r["contender"], r["latency_ms"], r["accelerators"]))
        if r["saves"] and base is not None:
            saved_gib = r["saved_bytes"] * (r["epochs"][-1]["epoch"] // 2) / 2**30
            per = (r["daemon_cpu_s"] - base["daemon_cpu_s"]) / saved_gib
            cost.append(f"- {r['contender']} {r['latency_ms']:g} ms, {r['accelerators']} accelerators: "
                        f"{r['daemon_cpu_s']:.1f} s of daemon CPU with the saves (through durable), "
                        f"{base['daemon_cpu_s']:.1f} s without (AU per epoch "
                        + " ".join(f"{e['au']:.1f}%" for e in base["epochs"])
                        + f"): **{per:.2f} s per GiB saved** ({saved_gib:.2f} GiB).")
    if cost:
        lines += ["", "The daemon's CPU per GiB saved (the run with saves less the same run without):", "", *cost]
    fresh = [r for r in out["runs"] if "restore_fresh_backend_bytes" in r]
    for r in fresh:
        lines.append(f"- {r['contender']}: the fresh node's restore fetched "
                     f"{r['restore_fresh_backend_bytes'] / 2**20:.1f} MiB from the backend for "
                     f"{r['saved_bytes'] / 2**20:.1f} MiB of files.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
