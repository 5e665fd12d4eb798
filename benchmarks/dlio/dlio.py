"""MLPerf Storage's engine, DLIO, reading through each contender: how many simulated accelerators a
storage system keeps at >= 90% accelerator utilisation (AU), the number the field reports.

    bash benchmarks/dlio/dlio-setup.sh        # once: DLIO 2.0.0 in benchmarks/work/.venv-dlio
    sudo .venv/bin/python benchmarks/dlio/dlio.py [--latency-ms 0 20] [--accelerators 1 2 3 4 6 8] [--out F]

DLIO's own unet3d workload (PyTorch, npz, its reader and its AU), scaled to this machine and said so:
``--files`` files (a multiple of 24: DLIO's sampler needs the rank count to divide it) of ``--file-mib``
MiB instead of 168 of 140 MiB, batches of 4, 2 read threads a rank, and a ``computation_time`` set so
that one accelerator asks ``--fraction`` of what local disk delivers to one cold reader (measured at
the start of the run, shared by every contender and latency). Each contender is mounted fresh (an
empty cache), the page cache dropped, for each accelerator count; ``--epochs`` epochs, the first cold.
DLIO is run as MLPerf runs it: ``mpiexec -n N``, one rank an accelerator (``dlio_launch.py``: a stub
for its TensorFlow profiler import, barriers that sleep instead of spinning), its tracer off.

Contenders: local disk (the same files, the physical limit), epochfs as a plain mount (DLIO hands over
no order: the way users first try it) and JuiceFS CE with its defaults, behind the latency proxy at
each ``--latency-ms``. Per run: DLIO's AU per epoch and its mean, its throughput, the GETs the backend
answered, the daemon's CPU seconds. The dataset fits in this machine's memory, so epochs after the
first may be served from the page cache for every contender alike (MLPerf asks for a dataset five
times the memory: what the first epoch shows is the storage path's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import VENV_BIN, Contender, Epochfs, Juicefs, RawDisk  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402
from workloads import drop_page_cache, load_text, log, machine, save_results, start_run  # noqa: E402

from epochfs.dev.servers import LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
DLIO_PYTHON = HERE.parent / "work" / ".venv-dlio" / "bin" / "python"
BUCKET, PREFIX = "bench", "dlio/"
BATCH, THREADS = 4, 2


def dlio(args: argparse.Namespace, data: Path, out: Path, *, ranks: int, epochs: int, compute: float,
         generate: bool = False) -> dict[str, Any]:
    """One DLIO run over ``data`` (its ``train/`` folder); its summary.json."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    record = args.file_mib << 20
    overrides = [
        "workload=unet3d_h100", f"++workload.workflow.generate_data={generate}",
        f"++workload.workflow.train={not generate}", "++workload.workflow.checkpoint=False",
        f"++workload.dataset.data_folder={data}", f"++workload.dataset.num_files_train={args.files}",
        "++workload.dataset.num_files_eval=0", f"++workload.dataset.record_length={record}",
        "++workload.dataset.record_length_stdev=0", f"++workload.dataset.record_length_resize={record}",
        f"++workload.reader.batch_size={BATCH}", f"++workload.reader.read_threads={THREADS}",
        f"++workload.train.epochs={epochs}", f"++workload.train.computation_time={compute}",
        f"++workload.output.folder={out}", "++workload.metric.au=0.90",
    ]
    bin_dir = DLIO_PYTHON.parent
    env = {**os.environ, "DFTRACER_ENABLE": "0", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    cmd = [str(bin_dir / "mpiexec"), "-n", str(ranks), str(DLIO_PYTHON), str(HERE / "dlio_launch.py"), *overrides]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=out)
    if r.returncode != 0:
        raise RuntimeError(f"DLIO failed ({' '.join(cmd[:4])} ...): {r.stderr[-3000:]}")
    if generate:
        return {}
    return json.loads((out / "summary.json").read_text())


def run_one(args: argparse.Namespace, c: Contender, server: LocalS3, n: int, compute: float,
            out: Path) -> dict[str, Any]:
    c.mount()  # (an empty cache)
    bucket = getattr(c, "volume", "") or BUCKET  # (JuiceFS reads chunks of its own volume's bucket)
    drop_page_cache()
    gets0, cpu0 = server.request_count(bucket), c.usage()["cpu"]
    summary = dlio(args, c.root, out, ranks=n, epochs=args.epochs, compute=compute)
    row = {"accelerators": n, "au_per_epoch": summary["metric"]["train_au_percentage"],
           "au_mean": summary["metric"]["train_au_mean_percentage"],
           "throughput_samples_s": summary["metric"]["train_throughput_mean_samples_per_second"],
           "backend_gets": server.request_count(bucket) - gets0, "daemon_cpu_s": c.usage()["cpu"] - cpu0}
    if isinstance(c, Epochfs):  # what the order learned on the plain mount fetched, and what the job used of it
        status = json.loads(subprocess.run([str(VENV_BIN / "epochfs"), "status", str(c.root), "--json"], check=True,
                                           capture_output=True, text=True).stdout)
        row["learned"] = status.get("learned")
        row["hit_bytes"] = status["cache"]["hit_bytes"]
    c.unmount()
    return row


def largest(rows: list[dict[str, Any]], key: str, line: float) -> int:
    """The largest accelerator count at or over ``line`` percent AU (0: none)."""
    return max((r["accelerators"] for r in rows if key_au(r, key) >= line), default=0)


def key_au(row: dict[str, Any], key: str) -> float:
    return float(row["au_per_epoch"][0] if key == "first" else row["au_mean"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0])
    ap.add_argument("--accelerators", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--files", type=int, default=240, help="files of the dataset (a multiple of 24)")
    ap.add_argument("--file-mib", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.25,
                    help="what one accelerator asks, as a fraction of local disk's cold rate (default 0.25)")
    ap.add_argument("--contenders", nargs="+", default=["local disk", "epochfs", "JuiceFS"],
                    help="of: 'local disk', epochfs, epochfs-unlearned (epochfs with --no-learned-order), JuiceFS")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "dlio")
    ap.add_argument("--out", type=Path, help="results JSON (a .md beside it); default: benchmarks/dlio/results/DATE-dlio.json")
    args = ap.parse_args()
    if args.files % 24:
        ap.error("--files must be a multiple of 24 (DLIO's sampler needs the rank count to divide it)")
    if not DLIO_PYTHON.exists():
        print(f"DLIO is not installed: bash {HERE / 'dlio-setup.sh'}", file=sys.stderr)
        return 2
    if not start_run(args.work):
        return 2
    data = args.work / "data"
    log(f"generating {args.files} x {args.file_mib} MiB with DLIO (unet3d npz)")
    dlio(args, data, args.work / "generate", ranks=1, epochs=1, compute=0.0, generate=True)
    local = RawDisk(args.work, "", BUCKET, PREFIX, 0, data_dir=data)
    drop_page_cache()
    calibrated = dlio(args, data, args.work / "calibrate", ranks=1, epochs=1, compute=0.0)
    rate = calibrated["metric"]["train_throughput_samples_per_second"][0]
    compute = BATCH / (args.fraction * rate)
    log(f"local disk, one cold reader: {rate:.1f} samples/s; computation_time {compute:.3f} s a batch of {BATCH}")
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(),
                           "command": " ".join(sys.argv), "files": args.files, "file_mib": args.file_mib,
                           "batch": BATCH, "read_threads": THREADS, "epochs": args.epochs, "fraction": args.fraction,
                           "local_cold_samples_s": rate, "computation_time": compute, "runs": []}
    server = LocalS3(args.work / "s3").start()
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        for f in sorted((data / "train").iterdir()):
            client.upload_file(str(f), BUCKET, f"{PREFIX}train/{f.name}")
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}valid/", Body=b"")  # (DLIO lists it, empty as it is)
        for latency in args.latency_ms:
            proxy = ProxyProcess(server.port, latency / 1000)
            try:
                contenders: list[Contender] = []
                if "local disk" in args.contenders and latency == args.latency_ms[0]:
                    contenders.append(local)
                if "epochfs" in args.contenders:
                    contenders.append(Epochfs(args.work / f"lat{latency:g}", proxy.endpoint, BUCKET, PREFIX, 1 << 34,
                                              manifest=False, name="epochfs"))
                if "epochfs-unlearned" in args.contenders:  # (the same mount, the order not learned: the A/B)
                    plain = Epochfs(args.work / f"lat{latency:g}-unlearned", proxy.endpoint, BUCKET, PREFIX, 1 << 34,
                                    manifest=False, name="epochfs-unlearned")
                    plain.extra = ["--no-learned-order"]
                    plain.tuning += ", --no-learned-order"
                    contenders.append(plain)
                if "JuiceFS" in args.contenders:
                    contenders.append(Juicefs(args.work / f"lat{latency:g}", proxy.endpoint, BUCKET, PREFIX, 1 << 34))
                for c in contenders:
                    for n in args.accelerators:
                        row = run_one(args, c, server, n, compute, args.work / "runs" / f"{c.name}-{latency:g}-{n}")
                        row.update(contender=c.name, latency_ms=0.0 if c is local else latency, tuning=c.tuning)
                        out["runs"].append(row)
                        log(f"{c.name} {row['latency_ms']:g} ms, {n} accelerators: AU "
                            + " ".join(f"{a:.0f}%" for a in row["au_per_epoch"]) + f" (mean {row['au_mean']:.0f}%), "
                            f"{row['backend_gets']} GETs, {row['daemon_cpu_s']:.1f} s CPU")
            finally:
                proxy.stop()
    finally:
        server.stop()
    text = report(out)
    print(text)
    target = args.out or HERE / "results" / f"{out['date']}-dlio.json"
    save_results(target, out, text)
    return 0


def report(out: dict[str, Any]) -> str:
    m = out["machine"]
    lines = [f"# DLIO (MLPerf Storage's engine), unet3d scaled, {out['date']}", "",
             f"Machine: {m['cpu']}, {m['cpus']} cores, {m['memory_gib']:g} GiB, Linux {m['kernel']}. Command: "
             f"`{out['command']}`.", "", load_text(), "",
             f"{out['files']} files of {out['file_mib']} MiB (npz, DLIO-generated), batches of {out['batch']}, "
             f"{out['read_threads']} read threads a rank, {out['epochs']} epochs; one accelerator asks "
             f"{out['fraction']:.0%} of local disk's cold rate ({out['local_cold_samples_s']:.1f} samples/s): "
             f"computation_time {out['computation_time']:.3f} s a batch.", "",
             "| contender | latency | accelerators | AU per epoch | AU mean | samples/s | backend GETs | daemon CPU s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in out["runs"]:
        lines.append(f"| {r['contender']} | {r['latency_ms']:g} ms | {r['accelerators']} | "
                     + " ".join(f"{a:.0f}%" for a in r["au_per_epoch"])
                     + f" | {r['au_mean']:.0f}% | {r['throughput_samples_s']:.1f} | {r['backend_gets']} | "
                     f"{r['daemon_cpu_s']:.1f} |")
    lines += ["", "| contender | latency | most accelerators at >= 90% AU (mean) | the same, first epoch |",
              "|---|---|---|---|"]
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in out["runs"]:
        groups.setdefault((r["contender"], r["latency_ms"]), []).append(r)
    for (name, latency), rows in groups.items():
        lines.append(f"| {name} | {latency:g} ms | {largest(rows, 'mean', 90)} | {largest(rows, 'first', 90)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
