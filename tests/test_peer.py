"""The cluster cache tier through real mounts: several daemons on this machine (loopback peer ports,
separate cache directories, one redis-server, one S3 endpoint) reading one dataset. Every node reads
byte-exact; the cluster fetches about one copy from the backend; ``owned`` caches add up; a member killed
mid-read, answering garbage, answering too slowly or with another token is bypassed in bounded time; a
member joining takes over its share."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from epochfs.devserver import LocalRedis, free_ports
from epochfs.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import EPOCHFS, drop_all_caches, read_all

pytestmark = requires_fuse

MiB = 1 << 20
FILES = [SampleFile(f"d/{i:02d}.bin", size) for i, size in enumerate(
    [3 * MiB + 17, 1, 4095, 700_001, 2 * MiB, 5 * MiB - 3, 65_536, 1_500_000, 3, 2 * MiB + 1] * 2)]
TOTAL = sum(f.size for f in FILES)


@pytest.fixture(scope="module")
def dataset(s3, s3_client):
    s3_client.create_bucket(Bucket="peers")
    upload(s3_client, "peers", "ds/", FILES)
    return "s3://peers/ds"


@pytest.fixture
def redis_url(tmp_path):
    server = LocalRedis(tmp_path / "redis").start()
    yield server.url
    server.stop()


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "peer-token"
    path.write_text(os.urandom(16).hex() + "\n")
    path.chmod(0o600)
    return path


class Cluster:
    def __init__(self, mount_factory, s3, dataset: str, redis_url: str, token_file: Path, tmp_path: Path):
        self.make, self.s3, self.dataset = mount_factory, s3, dataset
        self.redis_url, self.token_file, self.tmp = redis_url, token_file, tmp_path
        subprocess.run([*EPOCHFS, "import", dataset, "--meta", redis_url, "--endpoint-url", s3.endpoint],
                       check=True, capture_output=True, env=s3.env())
        self.nodes = []

    def node(self, *args: str, port: int | None = None, start: bool = True):
        n = len(self.nodes)
        port = port or free_ports(1)[0]
        m = self.make(self.dataset, "--meta", self.redis_url, "--peer-listen", f"127.0.0.1:{port}",
                      "--peer-token-file", str(self.token_file), "--block-size", "1M",
                      *args, name=f"n{n}", cache_dir=self.tmp / f"c{n}")
        m.peer_addr = f"127.0.0.1:{port}"
        if start:
            m.start()
        self.nodes.append(m)
        return m

    def wait_members(self, count: int, nodes=None, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        for m in nodes or self.nodes:
            while len(m.status()["peer"]["members"]) != count:
                assert time.monotonic() < deadline, m.status()["peer"]
                time.sleep(0.2)


@pytest.fixture
def cluster(mount_factory, s3, dataset, redis_url, token_file, tmp_path):
    return Cluster(mount_factory, s3, dataset, redis_url, token_file, tmp_path)


def backend_bytes(m) -> int:
    c = m.status()["cache"]
    return c["demand_bytes"] + c["prefetch_bytes"]


def read_everything(m, order_seed: int, read_size: int = 70_001) -> None:
    files = FILES[:]
    random.Random(order_seed).shuffle(files)
    for f in files:
        assert read_all(m.path(f.key), read_size) == f.content(), f.key


def drop_all(m) -> None:
    """Drop the kernel's page cache, so the next reads reach the daemons."""
    drop_all_caches()


def test_three_nodes_read_byte_exact_and_fetch_one_copy_from_the_backend(cluster):
    nodes = [cluster.node() for _ in range(3)]
    cluster.wait_members(3)
    threads = [threading.Thread(target=read_everything, args=(m, i)) for i, m in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for m in nodes:  # the reads asserted inside the threads; check again here where a failure shows
        read_everything(m, 99)
    total = sum(backend_bytes(m) for m in nodes)
    assert TOTAL <= total <= 1.1 * TOTAL, (total, TOTAL)
    stats = [m.status()["peer"] for m in nodes]
    assert sum(p["bytes_in"] for p in stats) == sum(p["bytes_out"] for p in stats) > TOTAL
    assert all(p["requests"]["served"] > 0 and p["requests"]["ok"] > 0 for p in stats)
    assert all(p["requests"][k] == 0 for p in stats for k in ("unavailable", "bad", "declined", "rejected"))
    text = subprocess.run([*EPOCHFS, "status", str(nodes[0].mountpoint)], capture_output=True, text=True).stdout
    assert "cluster    3 members, keeping all blocks" in text and nodes[1].peer_addr in text


def test_owned_caches_add_up(cluster):
    cache = str(int(TOTAL * 0.6) // MiB * MiB)  # each node holds 60%, three hold it all (shares vary)
    nodes = [cluster.node("--peer-cache", "owned", "--cache-size", cache) for _ in range(3)]
    cluster.wait_members(3)
    for i, m in enumerate(nodes):
        read_everything(m, i)
    first = sum(backend_bytes(m) for m in nodes)
    assert first <= 1.1 * TOTAL
    for m in nodes:
        drop_all(m)
    for i, m in enumerate(nodes):
        read_everything(m, 10 + i)
    second = sum(backend_bytes(m) for m in nodes) - first
    assert second <= 0.05 * TOTAL, (second, TOTAL)
    for m in nodes:
        assert m.status()["store"]["used_bytes"] <= int(cache)


def test_owned_warmup_by_manifest_warms_the_owners(cluster, tmp_path):
    cache = str(int(TOTAL * 0.6) // MiB * MiB)
    nodes = [cluster.node("--peer-cache", "owned", "--cache-size", cache) for _ in range(3)]
    cluster.wait_members(3)
    a = nodes[0]
    manifest = tmp_path / "epoch0.txt"
    manifest.write_text("".join(f.key + "\n" for f in FILES))
    result = subprocess.run([*EPOCHFS, "warmup", str(a.mountpoint), "--manifest", str(manifest)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    others = [m.status()["peer"] for m in nodes[1:]]
    assert all(p["requests"]["served"] > 0 for p in others)  # the owners were asked ...
    assert sum(p["bytes_out"] for p in others) == 0  # ... only to warm: no bytes came back
    warmed = sum(backend_bytes(m) for m in nodes)
    assert TOTAL <= warmed <= 1.1 * TOTAL  # the whole epoch is in the cluster's caches
    assert a.status()["store"]["used_bytes"] < 0.6 * TOTAL  # a kept only its own share
    read_everything(a, 0)  # byte-exact, and nothing more from the backend
    assert sum(backend_bytes(m) for m in nodes) == warmed
    out = sum(m.status()["peer"]["bytes_out"] for m in nodes[1:])
    assert a.status()["peer"]["bytes_in"] == out > 0  # the blocks of the others came from them


def test_a_member_killed_mid_read_is_bypassed_in_bounded_time(cluster):
    a = cluster.node("--peer-cache", "owned", "--backend-concurrency", "4")  # (4 read-through blocks kept)
    b = cluster.node()
    cluster.wait_members(2)
    read_everything(a, 0)  # b's share of the blocks now lives only in b's cache
    drop_all(a)
    pid = int(os.getxattr(b.mountpoint, "user.epochfs.pid"))
    errors, halfway, killed = [], threading.Event(), threading.Event()

    def reader():
        try:
            for n, f in enumerate(FILES * 2):
                if n == len(FILES) // 2:
                    halfway.set()
                    killed.wait(10)  # b dies between two reads of this pass
                assert read_all(a.path(f.key), 4096) == f.content(), f.key
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    assert halfway.wait(30)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    killed.set()
    t.join(60)
    assert not t.is_alive() and not errors, errors
    assert time.monotonic() - start < 30
    p = a.status()["peer"]
    assert p["requests"]["unavailable"] >= 1 and b.peer_addr in p["down"], (p, a.log()[-3000:])
    cluster.wait_members(1, [a])  # its heartbeat expired
    assert "bypassed" in a.log()


def test_a_taken_peer_port_fails_the_mount_with_a_clear_message(cluster):
    a = cluster.node()
    port = int(a.peer_addr.rsplit(":", 1)[1])
    b = cluster.node(port=port, start=False)
    result = b.start(expect_ok=False)
    assert result.returncode != 0 and f"--peer-listen 127.0.0.1:{port}" in result.stderr
    assert not os.path.ismount(b.mountpoint)


class FakePeer:
    """A member that answers every request with ``answer(request bytes)`` (or sleeps)."""

    def __init__(self, answer):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer = answer
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        with conn:
            try:
                data = conn.recv(65536)
                self.requests += 1
                reply = self.answer(data)
                if reply:
                    conn.sendall(reply)
            except OSError:
                pass

    def close(self):
        self.sock.close()


def register(redis_url: str, member: str, seconds: float = 3600) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    now = float(r.time()[0])
    r.zadd("epochfs:s3://peers/ds/:peers", {member: now + seconds})


@pytest.mark.parametrize("behaviour", ["garbage", "wrong_length", "wrong_checksum", "slow", "refused_after_accept"])
def test_a_member_answering_wrong_or_slowly_is_bypassed(cluster, redis_url, behaviour):
    def answer(request: bytes) -> bytes:
        if behaviour == "garbage":
            return b"\x00\xffnot http at all\r\n\r\n" * 10
        if behaviour == "slow":
            time.sleep(30)
            return b""
        if behaviour == "refused_after_accept":
            return b""
        body = b"x" * 1000
        checksum = "0" * 32 if behaviour == "wrong_checksum" else "1" * 32
        return (f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nX-Epochfs-Checksum: {checksum}\r\n\r\n"
                .encode() + body)

    fake = FakePeer(answer)
    try:
        a = cluster.node("--peer-timeout", "1")
        register(redis_url, fake.addr)
        cluster.wait_members(2)
        start = time.monotonic()
        read_everything(a, 3)
        assert time.monotonic() - start < 20
        p = a.status()["peer"]
        assert fake.requests >= 1
        assert p["requests"]["ok"] == 0 and p["requests"]["unavailable"] + p["requests"]["bad"] >= 1
        assert fake.addr in p["down"]
    finally:
        fake.close()


def test_a_member_with_another_token_is_bypassed_and_refused(cluster, tmp_path):
    a = cluster.node()
    other = tmp_path / "other-token"
    other.write_text("another-secret-of-enough-length")
    other.chmod(0o600)
    cluster.token_file, saved = other, cluster.token_file
    b = cluster.node()
    cluster.token_file = saved
    cluster.wait_members(2)
    read_everything(b, 4)
    assert a.status()["peer"]["requests"]["rejected"] >= 1
    p = b.status()["peer"]
    assert p["requests"]["declined"] >= 1 and a.peer_addr in p["down"]
    assert "--peer-token-file" in b.log()


def test_the_peer_port_serves_block_ids_only(cluster):
    import urllib.error
    import urllib.request

    a = cluster.node()
    for path in ("/", "/d/00.bin", "/v1/block/../../etc/passwd", "/v1/block/" + "ab" * 16 + "?k=d/00.bin&e=x&i=0&n=1"):
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(f"http://{a.peer_addr}{path}", timeout=5)
        assert exc.value.code in (401, 404)  # unsigned, or not a block id
    rng = random.Random(7)
    for _ in range(200):  # arbitrary bytes never end the port
        with socket.create_connection(("127.0.0.1", int(a.peer_addr.split(":")[1])), timeout=5) as s:
            s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 400))) + b"\r\n\r\n")
            try:
                s.recv(100)
            except OSError:
                pass
    read_everything(a, 5)
    assert a.status()["peer"]["requests"]["rejected"] >= 200


def test_a_member_joining_takes_over_its_share(cluster):
    a, b = cluster.node(), cluster.node()
    cluster.wait_members(2)
    read_everything(a, 6)
    c = cluster.node()
    cluster.wait_members(3)
    for m in (a, b):
        drop_all(m)
    read_everything(b, 7)
    served_by_c = c.status()["peer"]["requests"]["served"]
    assert served_by_c > 0  # b asked c for the blocks c now owns
    read_everything(c, 8)
