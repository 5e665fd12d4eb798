"""What a cache node spends to serve: the CPU of one warmed cache node (`epochfs serve`) per GiB it sends
to a `--peer-role client` reader, and the reader's own, side by side in one run for the code of this
checkout and, with `--compare-src`, another's (an older version's `src/`, run under the same
interpreter and packages).

The node is warmed with `epochfs cluster warmup` (every block in its cache, fetched once from the local
S3 endpoint), then a client with a cache of its own reads the whole dataset in 1 MiB reads, twice: with
the node's page cache warm (the blocks in memory) and dropped (read from its cache disk). The CPU is the
processes' user + system time (/proc/PID/stat, all threads, the kernel's work for them included: a
`sendfile` is counted), divided by the bytes the node served meanwhile. The backend bytes of the reading
epochs are reported (0 expected: every byte from the cache node).

    sudo .venv/bin/python benchmarks/cluster/serve_cost.py [--mib 1024] [--compare-src /path/to/older/src]

On one machine the node, the client and the reader share two cores over loopback: the seconds say little,
the CPU per GiB is what to read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cache_nodes import ENV, EPOCHFS, Client, Server, shards, wait_members  # noqa: E402
from workloads import drop_page_cache, log, start_run  # noqa: E402

from epochfs.dev.sample import upload  # noqa: E402
from epochfs.dev.servers import LocalRedis, LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB, GiB = 1 << 20, 1 << 30
TICK = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def sendfile_floor(path: Path, size: int) -> dict[str, float]:
    """The floor of any sender on this machine: one thread sending ``size`` bytes of a file in the page
    cache to a reader over loopback TCP with ``sendfile`` in 4 MiB calls, nothing else; its CPU per GiB
    (user, system: on loopback the kernel's receive path runs partly in the sender's time)."""
    import resource
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def reader() -> None:
        with socket.create_connection(listener.getsockname()) as c:
            buf, got = bytearray(MiB), 0
            while got < size and (n := c.recv_into(buf)):
                got += n

    with open(path, "rb") as f:
        while f.read(64 * MiB):  # (into the page cache)
            pass
    t = threading.Thread(target=reader)
    t.start()
    conn, _ = listener.accept()
    fd = os.open(path, os.O_RDONLY)
    before = resource.getrusage(resource.RUSAGE_THREAD)
    at = 0
    while at < size:
        at += os.sendfile(conn.fileno(), fd, at, min(4 * MiB, size - at))
    after = resource.getrusage(resource.RUSAGE_THREAD)
    t.join()
    os.close(fd)
    conn.close()
    listener.close()
    return {"user_s_per_gib": (after.ru_utime - before.ru_utime) / (size / GiB),
            "system_s_per_gib": (after.ru_stime - before.ru_stime) / (size / GiB)}


def read_everything(client: Client, keys: list[str], contents: dict[str, bytes]) -> int:
    """Read every file in 1 MiB reads into one buffer; the files that were wrong."""
    wrong, buf = 0, bytearray(MiB)
    for key in keys:
        got = bytearray()
        with open(client.mnt / key, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                got += buf[:n]
        wrong += bytes(got) != contents[key]
    return wrong


def one_version(label: str, src: Path | None, work: Path, endpoint: str, redis_url: str, token: Path,
                keys: list[str], contents: dict[str, bytes], total: int) -> dict[str, Any]:
    ENV.pop("PYTHONPATH", None)
    if src is not None:
        ENV["PYTHONPATH"] = str(src)
    subprocess.run(["redis-cli", "-u", redis_url, "flushall"], check=True, capture_output=True)
    subprocess.run([EPOCHFS, "import", "s3://bench/ds", "--meta", redis_url, "--endpoint-url", endpoint],
                   env=os.environ | ENV, check=True, capture_output=True)
    server, client = Server(work, f"{label}-server"), Client(work, f"{label}-client")
    server.start(endpoint, redis_url, token)
    try:
        wait_members([server], 1)
        r = subprocess.run([EPOCHFS, "cluster", "warmup", "s3://bench/ds", "--meta", redis_url, "--peer-token-file",
                            str(token), "--quiet"], capture_output=True, text=True, env=os.environ | ENV)
        if r.returncode != 0:
            raise RuntimeError(f"cluster warmup: {r.stderr}")
        result: dict[str, Any] = {"src": str(src) if src else "this checkout"}
        for cache in ("page cache warm", "page cache dropped"):
            client.mount(endpoint, redis_url, token)  # (a fresh cache of its own each time)
            try:
                if cache == "page cache dropped":
                    drop_page_cache()
                node, reader = server.status(), client.status()
                node_cpu, client_cpu = cpu_seconds(node["pid"]), cpu_seconds(reader["pid"])
                node_user = cpu_times(node["pid"])[0]
                sent, backend = node["peer"]["bytes_out"], server.backend_bytes()
                wrong = read_everything(client, keys, contents)
                node_after = server.status()
                served = node_after["peer"]["bytes_out"] - sent
                result[cache] = {
                    "served_bytes": served, "wrong_files": wrong,
                    "node_cpu_s_per_gib": (cpu_seconds(node["pid"]) - node_cpu) / (served / GiB) if served else None,
                    "node_user_cpu_s_per_gib": (cpu_times(node["pid"])[0] - node_user) / (served / GiB) if served else None,
                    "client_cpu_s_per_gib": (cpu_seconds(reader["pid"]) - client_cpu) / (total / GiB),
                    "from_files_bytes": node_after["peer"].get("bytes_out_from_files", 0)
                    - node["peer"].get("bytes_out_from_files", 0),
                    "backend_bytes": server.backend_bytes() - backend + client.backend_bytes()}
                log(f"{label} ({cache}): {json.dumps(result[cache])}")
            finally:
                client.unmount()
        return result
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="dataset size")
    ap.add_argument("--compare-src", type=Path, help="another version's src/ directory, measured the same way")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "serve-cost")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    files, total = shards(args.mib, [16, 32, 64])
    keys = [f.key for f in files]
    contents = {f.key: f.content() for f in files}
    token = args.work / "token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    s3 = LocalS3(args.work / "s3").start()
    redis = LocalRedis(args.work / "redis").start()
    ENV.update(s3.env())
    out: dict[str, Any] = {"files": len(files), "bytes": total, "versions": {}}
    try:
        upload(s3.client(), "bench", "ds/", files)
        versions = [("this", None)] + ([("compared", args.compare_src.resolve())] if args.compare_src else [])
        for label, src in versions:
            out["versions"][label] = one_version(label, src, args.work, s3.endpoint, redis.url, token, keys,
                                                 contents, total)
    finally:
        redis.stop()
        s3.stop()
    floor_file = args.work / "floor.bin"
    with open(floor_file, "wb") as f:
        for _ in range(512):
            f.write(os.urandom(MiB))
    out["sendfile_floor"] = sendfile_floor(floor_file, 512 * MiB)
    floor_file.unlink()
    if "compared" in out["versions"]:
        for cache in ("page cache warm", "page cache dropped"):
            this, then = out["versions"]["this"][cache], out["versions"]["compared"][cache]
            if this["node_cpu_s_per_gib"] and then["node_cpu_s_per_gib"]:
                this["node_cpu_vs_compared"] = this["node_cpu_s_per_gib"] / then["node_cpu_s_per_gib"]
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    (args.out / f"{stamp}-serve-cost.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# Serving cost of a cache node ({stamp})", "",
             f"{len(files)} files, {total / GiB:.2f} GiB; one warmed cache node, one `--peer-role client` reader.", "",
             "| code | node's page cache | node CPU s/GiB sent (user) | sent from files | client CPU s/GiB | backend bytes | wrong files |",
             "|---|---|---|---|---|---|---|"]
    for label, v in out["versions"].items():
        for cache in ("page cache warm", "page cache dropped"):
            r = v[cache]
            node = (f"{r['node_cpu_s_per_gib']:.3f} ({r['node_user_cpu_s_per_gib']:.3f})"
                    if r["node_cpu_s_per_gib"] is not None else "-")
            files_share = f"{r['from_files_bytes'] / r['served_bytes']:.0%}" if r["served_bytes"] else "-"
            lines.append(f"| {label} ({v['src']}) | {cache.split()[-1]} | {node} | {files_share} | "
                         f"{r['client_cpu_s_per_gib']:.3f} | {r['backend_bytes']} | {r['wrong_files']} |")
    fl = out["sendfile_floor"]
    lines += ["", f"The floor (a bare `sendfile` loop over loopback, one thread, nothing else): "
              f"{fl['user_s_per_gib'] + fl['system_s_per_gib']:.3f} s/GiB "
              f"({fl['user_s_per_gib']:.3f} user, {fl['system_s_per_gib']:.3f} system)."]
    (args.out / f"{stamp}-serve-cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
