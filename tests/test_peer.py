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

from epochfs.dev.sample import SampleFile, upload
from epochfs.dev.servers import LocalRedis, free_ports

from .conftest import requires_fuse
from .helpers import EPOCHFS, drop_all_caches, read_all

pytestmark = requires_fuse

MiB = 1 << 20
FILES = [SampleFile(f"d/{i:02d}.bin", size) for i, size in enumerate(
    [3 * MiB + 17, 1, 4095, 700_001, 2 * MiB, 5 * MiB - 3, 65_536, 1_500_000, 3, 2 * MiB + 1] * 2)]
TOTAL = sum(f.size for f in FILES)
# An ``owned`` node's cache, with room to spare for its share: three nodes' shares of these 42 blocks (the
# ring ranks random ports) reach 21 MiB in none of 20,000 draws, 16 MiB (60%) in 1.5% of them, and an
# owner that must evict sends every later reader of its blocks to the backend again.
OWNED_CACHE = str(int(TOTAL * 0.75) // MiB * MiB)


@pytest.fixture(scope="module")
def dataset(s3, s3_client):
    upload(s3_client, "peers", "ds/", FILES)  # (creates the bucket; a create retried under load finds it ours)
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


@pytest.mark.page_cache
def test_owned_caches_add_up(cluster):
    nodes = [cluster.node("--peer-cache", "owned", "--cache-size", OWNED_CACHE) for _ in range(3)]
    cluster.wait_members(3)
    for i, m in enumerate(nodes):
        read_everything(m, i)
    first = sum(backend_bytes(m) for m in nodes)
    assert first <= 1.1 * TOTAL, (first, TOTAL, [m.status()["peer"] for m in nodes])
    held = sum(m.status()["store"]["used_bytes"] for m in nodes)
    assert TOTAL <= held <= 1.1 * TOTAL, (held, TOTAL)  # one copy in all (keeping every block read: 2.2x)
    for m in nodes:
        drop_all(m)
    for i, m in enumerate(nodes):
        read_everything(m, 10 + i)
    second = sum(backend_bytes(m) for m in nodes) - first
    assert second <= 0.05 * TOTAL, (second, TOTAL)
    for m in nodes:
        assert m.status()["store"]["used_bytes"] <= int(OWNED_CACHE)


def test_owned_warmup_by_manifest_warms_the_owners(cluster, tmp_path):
    nodes = [cluster.node("--peer-cache", "owned", "--cache-size", OWNED_CACHE) for _ in range(3)]
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
    held = [m.status()["store"]["used_bytes"] for m in nodes]
    assert TOTAL <= sum(held) <= 1.1 * TOTAL and held[0] < TOTAL, (held, TOTAL)  # a kept only its own share
    read_everything(a, 0)  # byte-exact, and nothing more from the backend
    assert sum(backend_bytes(m) for m in nodes) == warmed
    out = sum(m.status()["peer"]["bytes_out"] for m in nodes[1:])
    assert a.status()["peer"]["bytes_in"] == out > 0  # the blocks of the others came from them


@pytest.mark.page_cache
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
    assert p["requests"]["unavailable"] >= 1 and b.peer_addr not in p["members"], (p, a.log()[-3000:])
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
        self.requests: list[bytes] = []
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
                while True:
                    data = conn.recv(65536)
                    if not data:
                        return
                    self.requests.append(data)
                    reply = self.answer(data)
                    if not reply:
                        return
                    conn.sendall(reply)
            except OSError:
                pass

    def block_requests(self) -> list[bytes]:
        return [r for r in self.requests if b"/block/" in r.split(b"\r\n", 1)[0]]

    def close(self):
        self.sock.close()


def register(redis_url: str, member: str, seconds: float = 3600) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    now = float(r.time()[0])
    r.zadd("epochfs:s3://peers/ds/:peers", {member: now + seconds})


def junk_answer(request: bytes) -> bytes:
    """What a fake member without the token can do best: 200 to everything, junk with its checksum."""
    import xxhash

    first = request.split(b"\r\n", 1)[0]
    if b"/hello" in first:
        return b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nX-Epochfs-Answer: " + b"0" * 32 + b"\r\n\r\n"
    length = 4096
    if b"&n=" in first:
        length = int(first.split(b"&n=")[1].split(b"&")[0].split(b" ")[0])
    body = b"J" * length
    return (f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\nX-Epochfs-Checksum: {xxhash.xxh3_128_hexdigest(body)}"
            f"\r\nX-Epochfs-Answer: {xxhash.xxh3_128_hexdigest(body)}\r\n\r\n").encode() + body


def wait_down(m, member: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while member not in (p := m.status()["peer"])["down"]:
        assert time.monotonic() < deadline, p
        time.sleep(0.2)
    return p


@pytest.mark.parametrize("behaviour", ["junk_with_checksum", "slow", "not_found",
                                       *(pytest.param(b, marks=pytest.mark.slow) for b in ("garbage", "refused_after_accept"))])
def test_a_member_without_the_token_is_never_asked_for_a_block(cluster, redis_url, behaviour):
    def answer(request: bytes) -> bytes:
        if behaviour == "junk_with_checksum":
            return junk_answer(request)
        if behaviour == "garbage":
            return b"\x00\xffnot http at all\r\n\r\n" * 10
        if behaviour == "slow":
            time.sleep(30)
            return b""
        if behaviour == "not_found":  # a metrics port or any other HTTP server
            return b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found"
        return b""

    fake = FakePeer(answer)
    try:
        a = cluster.node("--peer-timeout", "1")
        register(redis_url, fake.addr)
        p = wait_down(a, fake.addr)
        assert fake.addr not in p["members"] and fake.requests  # it was asked to prove itself
        start = time.monotonic()
        read_everything(a, 3)
        assert time.monotonic() - start < 20
        assert fake.block_requests() == []
        assert a.status()["peer"]["requests"]["ok"] == 0
        deadline = time.monotonic() + 10
        while "not trusted" not in a.log():  # (a slow one is told so once its proof times out)
            assert time.monotonic() < deadline, a.log()[-2000:]
            time.sleep(0.2)
    finally:
        fake.close()


@pytest.mark.page_cache
def test_junk_from_a_planted_member_is_never_served_nor_cached(cluster, redis_url, tmp_path):
    """The audit's attack: a fake member planted in the store by a user without the token, answering
    junk with its checksum. Nothing of it is served, now or after a remount without the tier."""
    fake = FakePeer(junk_answer)
    try:
        a = cluster.node()
        register(redis_url, fake.addr)
        wait_down(a, fake.addr)
        read_everything(a, 11)
        drop_all(a)
        read_everything(a, 12)
        assert fake.block_requests() == []
    finally:
        fake.close()
    a.stop()
    plain = cluster.make(cluster.dataset, "--meta", cluster.redis_url, name="plain", cache_dir=cluster.tmp / "c0")
    plain.start()
    read_everything(plain, 13)


def signed_get(addr: str, target: str, keys, to: str | None = None, headers=None):
    """A request made with the cluster's token for member ``to`` (default: ``addr``), sent to ``addr``:
    (status, answer headers, body, the request's headers)."""
    import http.client

    if headers is None:
        headers, _ = keys.headers(to or addr, target, time.time())
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", target, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read(), headers
    finally:
        conn.close()


def test_a_captured_request_is_worthless_elsewhere_and_once_used(cluster):
    from epochfs.peer import wire

    keys = wire.Keys(cluster.token_file.read_text().strip().encode())
    a, b = cluster.node(), cluster.node()
    cluster.wait_members(2)
    for m in (a, b):
        read_everything(m, 21)
    assert a.status()["peer"]["requests"]["ok"] > 0
    # a hello made for a, sent to b: refused (a request is bound to the member it is made for)
    st, hdrs, _, _ = signed_get(b.peer_addr, wire.HELLO, keys, to=a.peer_addr)
    assert st == 401 and wire.ANSWER_HEADER not in hdrs
    # made for b, sent to b: answered, and the answer is authenticated
    st, hdrs, body, sent = signed_get(b.peer_addr, wire.HELLO, keys)
    assert st == 200 and keys.answer_ok(sent[wire.AUTH_HEADER], 200, body, hdrs[wire.ANSWER_HEADER])
    # the same request again (a replay): refused
    st, hdrs, _, _ = signed_get(b.peer_addr, wire.HELLO, keys, headers=sent)
    assert st == 401 and wire.ANSWER_HEADER not in hdrs
    # a block request captured on its way to b is refused a second time, and after b restarts on the same
    # address (its memory of used requests is new) too; a hello says when b started, so askers sign no earlier
    from epochfs.core.blocks import block_id

    f = FILES[0]
    etag = cluster.s3.client().head_object(Bucket="peers", Key="ds/" + f.key)["ETag"]
    req = wire.BlockRequest(block_id("s3://peers/ds/", f.key, etag, 0, block_size=MiB), f.key, etag, 0, MiB)
    st, hdrs, body, captured = signed_get(b.peer_addr, req.target(), keys)
    assert st == 200 and len(body) == MiB
    st, hdrs, _, _ = signed_get(b.peer_addr, req.target(), keys, headers=captured)
    assert st == 401 and wire.ANSWER_HEADER not in hdrs
    b.stop()
    b.start()
    st, hdrs, body, _ = signed_get(b.peer_addr, req.target(), keys, headers=captured)
    assert st == 401 and wire.ANSWER_HEADER not in hdrs and b"before this member started" in body
    st, hdrs, body, sent = signed_get(b.peer_addr, wire.HELLO, keys)  # a hello is answered at once ...
    assert st == 200 and keys.answer_ok(sent[wire.AUTH_HEADER], 200, body, hdrs[wire.ANSWER_HEADER])
    assert body.isdigit()  # (the plain hello: the start second alone, as members of older versions take it)
    since = int(body)
    assert since > int(captured[wire.TIME_HEADER])  # ... with the second b started
    st, hdrs, body, sent = signed_get(b.peer_addr, wire.HELLO_SIZED, keys)  # and the size of its cache (its
    assert st == 200 and keys.answer_ok(sent[wire.AUTH_HEADER], 200, body, hdrs[wire.ANSWER_HEADER])  # weight)
    assert wire.parse_hello(body) == (since, 10 << 30)  # (the default --cache-size)
    headers, _ = keys.headers(b.peer_addr, req.target(), max(time.time(), since))
    st, _, body, _ = signed_get(b.peer_addr, req.target(), keys, headers=headers)
    assert st == 200 and len(body) == MiB


def test_connections_without_the_token_cannot_hold_the_peer_port_shut(cluster):
    a, b = cluster.node(), cluster.node()
    cluster.wait_members(2)
    port = int(a.peer_addr.rsplit(":", 1)[1])
    held = []
    try:
        for _ in range(200):  # more than every slot, each sending an unsigned request now and then
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /v2/hello HTTP/1.1\r\nHost: x\r\n\r\n")
            held.append(s)
        read_everything(b, 22)
        p = b.status()["peer"]
        assert p["requests"]["ok"] > 0 and a.peer_addr in p["members"], p
    finally:
        for s in held:
            s.close()


@pytest.mark.page_cache
def test_hostile_member_addresses_cost_the_readers_nothing(cluster, redis_url, s3):
    listeners = []
    try:
        for _ in range(50):  # accept, never answer
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(64)
            listeners.append(s)
        a = cluster.node("--peer-timeout", "5")
        metrics_port = a.status()["metrics_addr"].rsplit(":", 1)[1]
        s3_port = s3.endpoint.rsplit(":", 1)[1]
        entries = [f"127.0.0.1:{s.getsockname()[1]}" for s in listeners]
        entries += [f"127.0.0.1:{metrics_port}", f"127.0.0.1:{s3_port}", f"localhost:{s3_port}",
                    "1.2.3.4.5:99", "[::1]:9570", "gpu-7.cluster:9570"]
        for e in entries:
            register(redis_url, e)
        p = wait_down(a, f"127.0.0.1:{metrics_port}")
        assert p["members"] == [a.peer_addr], p
        drop_all(a)
        start = time.monotonic()
        read_everything(a, 23)
        assert time.monotonic() - start < 15
        assert a.status()["peer"]["requests"]["ok"] == 0
        log = a.log()
        assert "localhost" in log and "not a literal IP" in log
    finally:
        for s in listeners:
            s.close()


def test_a_member_with_another_token_is_bypassed_and_refused(cluster, tmp_path):
    a = cluster.node()
    other = tmp_path / "other-token"
    other.write_text("another-secret-of-enough-length")
    other.chmod(0o600)
    cluster.token_file, saved = other, cluster.token_file
    b = cluster.node()
    cluster.token_file = saved
    p = wait_down(b, a.peer_addr)
    assert p["members"] == [b.peer_addr]
    read_everything(b, 4)
    assert a.status()["peer"]["requests"]["rejected"] >= 1 and a.status()["peer"]["requests"]["served"] == 0
    assert b.status()["peer"]["requests"]["ok"] == 0
    assert "--peer-token-file" in b.log()


PORT_FUZZ = """
import random, socket, sys
rng = random.Random(7)
sent = 0
for _ in range(200):
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as s:
        s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 400))) + b"\\r\\n\\r\\n")
        sent += 1
        try:
            s.recv(100)
        except OSError:
            pass
print(sent)
"""


def test_the_peer_port_serves_block_ids_only(cluster):
    import urllib.error
    import urllib.request

    a = cluster.node()
    for path in ("/", "/d/00.bin", "/v2/block/../../etc/passwd", "/v2/block/" + "ab" * 16 + "?k=d/00.bin&e=x&i=0&n=1",
                 "/v2/hello"):
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(f"http://{a.peer_addr}{path}", timeout=5)
        assert exc.value.code in (401, 404)  # unsigned, or not a block id
    # Arbitrary bytes never end the port: sent by a local user who is not root and has no token.
    fuzz = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", PORT_FUZZ,
                           a.peer_addr.split(":")[1]], capture_output=True, text=True, timeout=180)
    assert fuzz.returncode == 0 and fuzz.stdout.strip() == "200", (fuzz.stdout, fuzz.stderr[-2000:])
    read_everything(a, 5)
    assert a.status()["peer"]["requests"]["rejected"] >= 200


@pytest.mark.page_cache
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
