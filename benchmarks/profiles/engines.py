"""The engines that could fetch a cold block stream, side by side in one run: one object read as parallel
ranged GETs (the server's page cache dropped before each run), with the process's CPU seconds per GiB
beside each rate. What the cold path of the mount chooses from (see ``epochfs.transport.httpio``):

- *boto3*: 8 threads, 8 MiB ranges (the plain client of benchmarks/peers/readpath.py);
- *curl, bytes*: libcurl easy handles, 8 threads, the body collected with ``bytearray.extend`` (what
  epochfs did before);
- *curl, aligned*: libcurl writing into epochfs's aligned, pooled buffers itself, no Python callback
  (``epochfs.transport.curlio.Easy``: the
  engine of short ranges);
- *curl multi*: one thread driving 8 transfers through a multi handle;
- *awscrt*: the AWS Common Runtime's S3 client (8 MiB parts, its own C threads), the body handed to
  Python (``on_body``) or written to a file by the runtime (``recv_filepath``);
- *httpio*: ``epochfs.transport.httpio``, 8 threads, straight into aligned buffers (the engine of long ranges);
- *epochfs backend*: ``S3Backend.read_range`` of 4 MiB blocks from 5 threads, signed, checked and
  pinned to the ETag: what a mount's cold stream asks of it with the default readahead.

    sudo .venv/bin/python benchmarks/profiles/engines.py [--size-mib 256] [--reps 3]

``awscrt`` is in the ``bench`` extra. Requests other than boto3's and the backend's are unsigned (the
local endpoint takes them).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import drop_page_cache, log, start_run  # noqa: E402

from epochfs.dev.servers import ACCESS_KEY, SECRET_KEY, LocalS3  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
BUCKET, KEY = "bench", "big.bin"


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def threaded(get: Callable[[int, int], int], size: int, threads: int, part: int) -> int:
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda o: get(o, min(part, size - o)), range(0, size, part)))


def engines(server: LocalS3, size: int) -> dict[str, Callable[[], int]]:
    import pycurl

    from epochfs.backend import BackendSettings, open_backend
    from epochfs.daemon.config import Source
    from epochfs.transport import curlio, httpio

    def new_handle() -> pycurl.Curl:
        handle = pycurl.Curl()
        handle.setopt(pycurl.NOSIGNAL, 1)
        handle.setopt(pycurl.BUFFERSIZE, 512 << 10)
        return handle

    url = f"{server.endpoint}/{BUCKET}/{KEY}"
    local = threading.local()

    def curl_get(aligned: bool) -> Callable[[int, int], int]:
        def get(offset: int, n: int) -> int:
            if aligned:
                easy = getattr(local, "easy", None)
                if easy is None:
                    easy = local.easy = curlio.Easy()
                easy.setopt(pycurl.URL, url)
                easy.setopt(pycurl.RANGE, f"{offset}-{offset + n - 1}")
                return len(easy.perform(n)[1])
            handle = getattr(local, "curl", None)
            if handle is None:
                handle = local.curl = new_handle()
            handle.setopt(pycurl.URL, url)
            handle.setopt(pycurl.RANGE, f"{offset}-{offset + n - 1}")
            body = bytearray()
            handle.setopt(pycurl.WRITEFUNCTION, body.extend)
            handle.perform()
            return len(body)
        return get

    def curl_multi(transfers: int = 8, part: int = 8 * MiB) -> int:
        multi = pycurl.CurlMulti()
        free = [new_handle() for _ in range(transfers)]
        todo, active, total = list(range(0, size, part)), {}, 0
        while todo or active:
            while todo and free:
                handle, offset = free.pop(), todo.pop(0)
                answer = bytearray()
                handle.setopt(pycurl.WRITEFUNCTION, answer.extend)
                handle.setopt(pycurl.URL, url)
                handle.setopt(pycurl.RANGE, f"{offset}-{min(offset + part, size) - 1}")
                multi.add_handle(handle)
                active[handle] = answer
            while multi.perform()[0] == pycurl.E_CALL_MULTI_PERFORM:
                pass
            multi.select(1.0)
            while True:
                queued, ok, failed = multi.info_read()
                for handle in ok:
                    total += len(active.pop(handle))
                    multi.remove_handle(handle)
                    free.append(handle)
                if failed:
                    raise RuntimeError(f"curl multi: {failed}")
                if not queued:
                    break
        return total

    def crt(to_file: bool) -> Callable[[], int]:
        def run() -> int:
            from awscrt import auth, http, io, s3

            loop = io.EventLoopGroup()
            bootstrap = io.ClientBootstrap(loop, io.DefaultHostResolver(loop))
            signing = auth.AwsSigningConfig(
                algorithm=auth.AwsSigningAlgorithm.V4, signature_type=auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
                service="s3", region="us-east-1",
                credentials_provider=auth.AwsCredentialsProvider.new_static(ACCESS_KEY, SECRET_KEY))
            client = s3.S3Client(bootstrap=bootstrap, region="us-east-1", signing_config=signing, part_size=8 * MiB,
                                 throughput_target_gbps=10.0, tls_mode=s3.S3RequestTlsMode.DISABLED)
            got = [0]
            target = HERE.parent / "work" / "engines-crt.bin"

            def on_body(chunk: bytes, offset: int, **_: object) -> None:
                got[0] += len(chunk)

            request = http.HttpRequest("GET", f"/{BUCKET}/{KEY}",
                                       http.HttpHeaders([("host", url.split("/")[2])]))
            where = {"recv_filepath": str(target)} if to_file else {"on_body": on_body}
            client.make_request(request=request, type=s3.S3RequestType.GET_OBJECT, **where).finished_future.result()
            if to_file:
                got[0] = target.stat().st_size
                target.unlink()
            return got[0]
        return run

    def stream_get(offset: int, n: int) -> int:
        client = getattr(local, "http", None)
        if client is None:
            client = local.http = httpio.Client("127.0.0.1", server.port, None)
        status, _, body = client.get(f"/{BUCKET}/{KEY}", {"Range": f"bytes={offset}-{offset + n - 1}"}, n,
                                     time.monotonic() + 60)
        assert status == 206, status
        return len(body)

    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1")
    backend = open_backend(BackendSettings(Source.parse(f"s3://{BUCKET}"), endpoint_url=server.endpoint))
    etag = server.client().head_object(Bucket=BUCKET, Key=KEY)["ETag"]
    s3 = server.client()

    def boto_get(offset: int, n: int) -> int:
        return len(s3.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={offset}-{offset + n - 1}")["Body"].read())

    return {
        "boto3, 8 x 8 MiB": lambda: threaded(boto_get, size, 8, 8 * MiB),
        "curl, bytes, 8 x 8 MiB": lambda: threaded(curl_get(False), size, 8, 8 * MiB),
        "curl, aligned, 8 x 8 MiB": lambda: threaded(curl_get(True), size, 8, 8 * MiB),
        "curl multi, 8 x 8 MiB": curl_multi,
        "awscrt, on_body, 8 MiB parts": crt(False),
        "awscrt, recv_filepath, 8 MiB parts": crt(True),
        "httpio, 8 x 8 MiB": lambda: threaded(stream_get, size, 8, 8 * MiB),
        "epochfs backend, 5 x 4 MiB": lambda: threaded(
            lambda o, n: len(backend.read_range(KEY, etag, o, n)), size, 5, 4 * MiB),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "engines")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    size = args.size_mib * MiB
    server = LocalS3(args.work / "s3").start()
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        client = server.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key=KEY, Body=os.urandom(size))
        runs = engines(server, size)
        for rep in range(args.reps):
            log(f"repetition {rep + 1} of {args.reps}")
            for name, run in (runs.items() if rep % 2 == 0 else reversed(runs.items())):
                drop_page_cache()
                started, before = time.perf_counter(), cpu()
                n = run()
                seconds, used = time.perf_counter() - started, cpu() - before
                assert n == size, f"{name}: {n} bytes of {size}"
                rows.setdefault(name, []).append((n / seconds / MiB, used / (n / (1 << 30))))
                log(f"{name:36s} {rows[name][-1][0]:8.1f} MiB/s {rows[name][-1][1]:5.2f} CPU s/GiB")
    finally:
        server.stop()
    reference = statistics.median(r[0] for r in rows["boto3, 8 x 8 MiB"])
    lines = [f"# Fetch engines, {datetime.date.today().isoformat()}: one {args.size_mib} MiB object, "
             f"{os.cpu_count()} cores; medians of {args.reps}", "",
             "The server's page cache is dropped before each run; CPU is the benchmark process's (the server's "
             "is not counted).", "",
             "| engine | MiB/s | / boto3 | CPU s per GiB |", "|---|---|---|---|"]
    for name, values in rows.items():
        rate, used = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        lines.append(f"| {name} | {rate:.0f} | {rate / reference:.2f}x | {used:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{datetime.date.today().isoformat()}-engines"
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps(
        {"size_mib": args.size_mib, "reps": args.reps,
         "rows": [{"engine": k, "mib_s": [v[0] for v in vs], "cpu_s_per_gib": [v[1] for v in vs]}
                  for k, vs in rows.items()]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
