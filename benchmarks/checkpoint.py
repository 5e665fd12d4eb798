"""Checkpoint saves, side by side: how long the training loop waits for a save to return, and how long
until the checkpoint is in the backend. One writer saves a checkpoint of --gib GiB sequentially in 4 MiB
writes (what torch.save to a file does), then waits for the backend.

Contenders, each on the same local S3 endpoint:
  local disk            write + close on the disk the caches use (the floor of "returns")
  local disk + boto3    the usual pattern: save locally, then boto3 upload_file (multipart, 10 threads)
  epochfs --writeback   close returns at local speed; `epochfs sync` returns when it is in the backend
  s3fs                  uploads on close (multipart, 16 parallel parts)
  rclone                --vfs-cache-mode writes --vfs-write-back 0s: close returns, uploads in background

"In backend" is measured by polling HEAD for the full size (and for epochfs by `epochfs sync`); every
object is read back once and compared with what was written.

Then the accelerators' side of the upload: the training simulation (benchmarks/workloads.py::simulate,
4 accelerators, cold cache) reads small files through an epochfs --writeback mount while nothing is
saved, while a checkpoint is saved and uploaded through the same mount, and the same with
--upload-bandwidth: accelerator utilisation (AU) of each.

    sudo .venv/bin/python benchmarks/checkpoint.py [--gib 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import VENV_BIN, proc_usage, wait_mounted  # noqa: E402
from workloads import drop_page_cache, log, simulate, start_run  # noqa: E402

from epochfs.devserver import ACCESS_KEY, SECRET_KEY, LocalS3  # noqa: E402
from epochfs.sample import SampleFile, upload  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
CHUNK = 4 * MiB


def save(path: Path, data: memoryview) -> float:
    """Seconds for a sequential write of ``data`` and close."""
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for off in range(0, len(data), CHUNK):
            f.write(data[off:off + CHUNK])
    return time.perf_counter() - start


def wait_in_backend(client: Any, bucket: str, key: str, size: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.head_object(Bucket=bucket, Key=key)["ContentLength"] == size:
                return
        except client.exceptions.ClientError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{key} did not reach the backend in {timeout}s")


def check(client: Any, bucket: str, key: str, digest: str) -> None:
    h = hashlib.blake2b()
    for chunk in client.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(MiB):
        h.update(chunk)
    if h.hexdigest() != digest:
        raise RuntimeError(f"{key} in the backend differs from what was written")


class Fs:
    def __init__(self, work: Path, name: str) -> None:
        self.name = name
        self.mnt, self.cache = work / name / "mnt", work / name / "cache"
        self.pid: int | None = None

    def mount(self, server: LocalS3, prefix: str) -> None:
        self.unmount()
        shutil.rmtree(self.cache, ignore_errors=True)
        self.cache.mkdir(parents=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        self._mount(server, prefix)
        wait_mounted(self.mnt)

    def _mount(self, server: LocalS3, prefix: str) -> None:
        raise NotImplementedError

    def unmount(self) -> None:
        if self.mnt.exists() and os.path.ismount(self.mnt):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
            deadline = time.monotonic() + 60
            while self.pid and Path(f"/proc/{self.pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)
        self.pid = None

    def durable(self, client: Any, key: str, size: int) -> None:
        wait_in_backend(client, "ckpt", key, size)


class EpochfsWb(Fs):
    extra: tuple[str, ...] = ()  # more mount flags

    def _mount(self, server: LocalS3, prefix: str) -> None:
        subprocess.run([str(VENV_BIN / "epochfs"), "mount", f"s3://ckpt/{prefix}", str(self.mnt), "--writeback",
                        "--endpoint-url", server.endpoint, "--cache-dir", str(self.cache), "--cache-size", "40G",
                        "--metrics-addr", "off", *self.extra], env=server.env(), check=True)
        self.pid = int(os.getxattr(self.mnt, "user.epochfs.pid"))

    def durable(self, client: Any, key: str, size: int) -> None:
        subprocess.run([str(VENV_BIN / "epochfs"), "sync", str(self.mnt)], check=True)
        wait_in_backend(client, "ckpt", key, size, timeout=5)


class S3fsRw(Fs):
    def _mount(self, server: LocalS3, prefix: str) -> None:
        passwd = self.cache.parent / "passwd"
        passwd.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        passwd.chmod(0o600)
        subprocess.run(["s3fs", f"ckpt:/{prefix}", str(self.mnt), "-o",
                        f"url={server.endpoint},use_path_request_style,passwd_file={passwd},"
                        f"use_cache={self.cache},parallel_count=16,multipart_size=16"], check=True)


class RcloneWrites(Fs):
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
        fs.extra = tuple(extra)
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
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated contenders (default: all)")
    ap.add_argument("--au-compute-ms", type=float, default=60.0,
                    help="compute time per batch of the training simulation (0: skip the AU part)")
    ap.add_argument("--au-upload-bandwidth", default="400MB", help="the capped case's --upload-bandwidth")
    ap.add_argument("--work", type=Path, default=HERE / "work" / "checkpoint")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    size = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    data = memoryview(os.urandom(size))
    digest = hashlib.blake2b(data).hexdigest()
    rows: dict[tuple[str, str], list[float]] = {}
    only = set(filter(None, args.only.split(",")))

    def record(who: str, what: str, value: float) -> None:
        rows.setdefault((who, what), []).append(value)
        log(f"{who:22s} {what:28s} {value:8.2f}")

    server = LocalS3(args.work / "s3").start()
    mounts = {"epochfs --writeback": EpochfsWb(args.work, "epochfs"), "s3fs": S3fsRw(args.work, "s3fs"),
              "rclone": RcloneWrites(args.work, "rclone")}
    try:
        import boto3.s3.transfer

        client = server.client()
        client.create_bucket(Bucket="ckpt")
        local = args.work / "local"
        local.mkdir()
        for rep in range(args.reps):
            log(f"repetition {rep + 1} of {args.reps}, {size / MiB:.0f} MiB")
            key = f"local/rep{rep}.pt"
            if not only or "local disk" in only:
                drop_page_cache()
                returned = save(local / "ckpt.pt", data)
                record("local disk", "save returns (s)", returned)
                start = time.perf_counter()
                client.upload_file(str(local / "ckpt.pt"), "ckpt", key, Config=boto3.s3.transfer.TransferConfig(
                    multipart_threshold=64 * MiB, multipart_chunksize=16 * MiB, max_concurrency=10))
                record("local disk + boto3", "save returns (s)", returned)
                record("local disk + boto3", "in backend (s)", returned + time.perf_counter() - start)
                check(client, "ckpt", key, digest)
                (local / "ckpt.pt").unlink()
            for name, fs in mounts.items():
                if only and name not in only:
                    continue
                prefix = f"{fs.name}{rep}"
                fs.mount(server, prefix)
                drop_page_cache()
                before = proc_usage(fs.pid)["cpu"] if fs.pid else 0.0
                start = time.perf_counter()
                returned = save(fs.mnt / "ckpt.pt", data)
                record(name, "save returns (s)", returned)
                fs.durable(client, f"{prefix}/ckpt.pt", size)
                record(name, "in backend (s)", time.perf_counter() - start)
                if fs.pid:
                    record(name, "daemon CPU (s)", proc_usage(fs.pid)["cpu"] - before)
                fs.unmount()
                check(client, "ckpt", f"{prefix}/ckpt.pt", digest)
        aus = au_during_upload(server, args.work, data, [
            ("idle", []), ("saving", []),
            (f"saving, --upload-bandwidth {args.au_upload_bandwidth}", ["--upload-bandwidth", args.au_upload_bandwidth])],
            args.au_compute_ms / 1000) if args.au_compute_ms > 0 else {}
    finally:
        for fs in mounts.values():
            fs.unmount()
        server.stop()

    med = {k: statistics.median(v) for k, v in rows.items()}
    floor_ret = med.get(("local disk", "save returns (s)"))
    floor_up = med.get(("local disk + boto3", "in backend (s)"))
    lines = [f"# Checkpoint saves, {datetime.date.today().isoformat()}: one {size / MiB:.0f} MiB file in 4 MiB "
             f"writes; medians of {args.reps}", "",
             "| contender | save returns (s) | vs local disk | in backend (s) | vs local + boto3 | daemon CPU (s) |",
             "|---|---|---|---|---|---|"]
    for who in ["local disk", "local disk + boto3", *mounts]:
        ret, up, cpu = (med.get((who, w)) for w in ("save returns (s)", "in backend (s)", "daemon CPU (s)"))
        if ret is None:
            continue
        lines.append(f"| {who} | {ret:.2f} | {ret / floor_ret:.2f}x | " + (f"{up:.2f} | {up / floor_up:.2f}x | "
                     if up is not None and floor_up else "| | ") + (f"{cpu:.2f} |" if cpu is not None else "|"))
    if aus:
        lines += ["", f"Training simulation (4 accelerators, 8 x 100 KiB per step, {args.au_compute_ms:g} ms compute, "
                  "cold cache) through the same --writeback mount:", "", "| during the epoch | AU |", "|---|---|"]
        lines += [f"| {name} | {au:.1%} |" for name, au in aus.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{datetime.date.today().isoformat()}-checkpoint-{args.gib:g}gib"
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps({"bytes": size, "reps": args.reps, "au": aus, "rows": [
        {"who": k[0], "what": k[1], "values": v} for k, v in rows.items()]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
