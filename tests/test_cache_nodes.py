"""Dedicated cache nodes (``epochfs serve``): GPU nodes mounted as clients read through them, each block
crosses the backend link once for the cluster, replicas survive a node's death, a node that joins fills
its share from the others, and nothing a client does moves a block."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epochfs.dev.servers import free_ports

from .conftest import requires_fuse
from .helpers import EPOCHFS, drop_all_caches, read_all
from .test_peer import FILES, TOTAL, backend_bytes, dataset, read_everything, redis_url, token_file  # noqa: F401

pytestmark = requires_fuse
MiB = 1 << 20


class CacheNode:
    """An ``epochfs serve`` daemon on 127.0.0.1."""

    def __init__(self, tier: Tier, n: int, *args: str) -> None:
        self.tier = tier
        self.port = free_ports(1)[0]
        self.addr = f"127.0.0.1:{self.port}"
        self.cache_dir = tier.tmp / f"server{n}"
        self.args = ["serve", tier.dataset, "--meta", tier.redis_url, "--peer-listen", self.addr,
                     "--peer-token-file", str(tier.token_file), "--block-size", "1M", "--cache-dir",
                     str(self.cache_dir), "--endpoint-url", tier.s3.endpoint, "--metrics-addr", "127.0.0.1:0",
                     "--metrics-targets", "off", *args]

    def start(self) -> CacheNode:
        r = subprocess.run([*EPOCHFS, *self.args], env=self.tier.s3.env(), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, f"serve failed: {r.stderr}\n{self.log()}"
        return self

    def status(self) -> dict:
        from epochfs.control import request

        return request(self.cache_dir, "status")

    def pid(self) -> int:
        return int(self.status()["pid"])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        try:
            pid = self.pid()
        except Exception:  # noqa: BLE001 - already gone
            return
        os.kill(pid, sig)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def log(self) -> str:
        path = self.cache_dir / "epochfs.log"
        return path.read_text(errors="replace") if path.exists() else ""


class Tier:
    def __init__(self, mount_factory, s3, source: str, store_url: str, token: Path, tmp_path: Path):
        self.make, self.s3, self.dataset = mount_factory, s3, source
        self.redis_url, self.token_file, self.tmp = store_url, token, tmp_path
        subprocess.run([*EPOCHFS, "import", source, "--meta", store_url, "--endpoint-url", s3.endpoint],
                       check=True, capture_output=True, env=s3.env())
        self.servers: list[CacheNode] = []
        self.clients = []

    def server(self, *args: str) -> CacheNode:
        node = CacheNode(self, len(self.servers), *args).start()
        self.servers.append(node)
        return node

    def client(self, *args: str):
        n = len(self.clients)
        m = self.make(self.dataset, "--meta", self.redis_url, "--peer-role", "client", "--peer-token-file",
                      str(self.token_file), "--block-size", "1M", *args, name=f"client{n}",
                      cache_dir=self.tmp / f"client-cache{n}")
        m.start()
        self.clients.append(m)
        return m

    def wait_servers(self, count: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        for m in [*self.clients, *self.servers]:
            while len(m.status()["peer"]["members"]) != count:
                assert time.monotonic() < deadline, m.status()["peer"]
                time.sleep(0.2)

    def close(self) -> None:
        for s in self.servers:
            s.stop(signal.SIGKILL)


@pytest.fixture
def tier(mount_factory, s3, dataset, redis_url, token_file, tmp_path):  # noqa: F811
    t = Tier(mount_factory, s3, dataset, redis_url, token_file, tmp_path)
    yield t
    t.close()


def held(node: CacheNode) -> int:
    return node.status()["store"]["used_bytes"]


def test_clients_read_through_cache_nodes_and_each_block_crosses_the_backend_once(tier):
    """Two cache nodes, two GPU nodes mounted as clients: byte-exact reads; the cluster fetches the
    dataset from the backend once (the cache nodes, once each block); each cache node holds only its
    share; the clients are listed nowhere (they own nothing)."""
    servers = [tier.server(), tier.server()]
    clients = [tier.client(), tier.client()]
    tier.wait_servers(2)
    threads = [threading.Thread(target=read_everything, args=(c, i)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for c in clients:
        read_everything(c, 9)
    fetched = sum(backend_bytes(n) for n in [*servers, *clients])
    assert TOTAL <= fetched <= 1.05 * TOTAL, (fetched, TOTAL)
    assert sum(backend_bytes(c) for c in clients) == 0  # every block came through a cache node
    shares = [held(s) for s in servers]
    assert sum(shares) <= 1.05 * TOTAL and all(0 < s < 0.9 * TOTAL for s in shares), shares
    for c in clients:
        p = c.status()["peer"]
        assert p["role"] == "client" and p["requests"]["ok"] > 0
        assert p["requests"]["unavailable"] == p["requests"]["bad"] == 0
        assert sorted(p["members"]) == sorted(s.addr for s in servers)
    for s in servers:
        assert s.status()["peer"]["role"] == "server" and s.status()["peer"]["bytes_out"] > 0
    # A client that comes later is served what the cache nodes hold from their files, by the kernel.
    def sent() -> tuple[int, int]:
        peers = [s.status()["peer"] for s in servers]
        return sum(p["bytes_out"] for p in peers), sum(p["bytes_out_from_files"] for p in peers)

    out, by_kernel = sent()
    read_everything(tier.client(), 10)
    out, by_kernel = (a - b for a, b in zip(sent(), (out, by_kernel), strict=True))
    assert by_kernel == out and by_kernel >= TOTAL, (by_kernel, out, TOTAL)  # (every byte served: from a file)
    text = subprocess.run([*EPOCHFS, "status", str(servers[0].cache_dir)], capture_output=True, text=True)
    assert text.returncode == 0 and "cache node" in text.stdout, text.stdout + text.stderr


@pytest.mark.page_cache
def test_a_replica_survives_a_cache_node_killed_mid_epoch(tier):
    """With --replicas 2 both cache nodes hold every block; one killed mid-epoch costs the readers at
    most --peer-timeout, never a wrong byte, and nothing more from the backend."""
    args = ("--replicas", "2")
    servers = [tier.server(*args), tier.server(*args)]
    c = tier.client(*args, "--peer-timeout", "2")
    tier.wait_servers(2)
    read_everything(c, 0)
    first = sum(backend_bytes(n) for n in [*servers, c])
    assert first <= 1.05 * TOTAL
    assert all(held(s) >= 0.95 * TOTAL for s in servers)  # each holds the whole dataset

    drop_all_caches()
    errors, halfway, killed = [], threading.Event(), threading.Event()

    def reader():
        try:
            for n, f in enumerate(FILES):
                if n == len(FILES) // 2:
                    halfway.set()
                    killed.wait(10)
                assert read_all(c.path(f.key), 70_001) == f.content(), f.key
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    survivor_before = backend_bytes(servers[1])
    t = threading.Thread(target=reader)
    t.start()
    assert halfway.wait(60)
    servers[0].stop(signal.SIGKILL)
    started = time.monotonic()
    killed.set()
    t.join(60)
    assert not t.is_alive() and not errors, errors
    assert time.monotonic() - started < 20
    assert backend_bytes(servers[1]) == survivor_before and backend_bytes(c) == 0  # the survivor held them all


def test_a_cache_node_that_joins_fills_its_share_from_the_others(tier):
    """Two cache nodes hold the dataset; a third joins: the blocks it now owns come from the other two
    (stored-only requests), not from the backend."""
    servers = [tier.server(), tier.server()]
    c = tier.client()
    tier.wait_servers(2)
    read_everything(c, 0)
    assert sum(held(s) for s in servers) >= 0.95 * TOTAL
    third = tier.server()
    fresh = tier.client()  # a GPU node arriving with an empty cache
    tier.wait_servers(3)
    read_everything(fresh, 1)
    p = third.status()["peer"]
    assert held(third) > 0.15 * TOTAL and p["bytes_in"] >= held(third) * 0.9, (held(third), p)
    assert backend_bytes(third) == 0  # its share came from the cache nodes that held it before
    assert backend_bytes(c) == backend_bytes(fresh) == 0


def test_cluster_warmup_fills_the_owners_before_the_gpus_arrive_and_status_lists_them(tier):
    """`epochfs cluster warmup` (resumable, exit 0 once every block is held by its owners) fills the two
    cache nodes with one read of the dataset from the backend; a client that arrives after reads it all
    with nothing more from the backend; `epochfs cluster status` lists the members, roles, what they hold."""
    args = ("--replicas", "2")
    servers = [tier.server(*args), tier.server(*args)]
    tier.wait_servers(2)
    base = [*EPOCHFS, "cluster", "warmup", tier.dataset, "--meta", tier.redis_url, "--peer-token-file",
            str(tier.token_file), "--block-size", "1M", "--replicas", "2"]
    half = [f.key for f in FILES[: len(FILES) // 2]]
    r = subprocess.run([*base, *half], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first = sum(backend_bytes(s) for s in servers)
    r = subprocess.run(base, capture_output=True, text=True, timeout=120)  # the rest: resumed, not repeated
    assert r.returncode == 0 and "held by their owners (2 each, 2 cache nodes)" in r.stdout, r.stderr
    warmed = sum(backend_bytes(s) for s in servers)
    assert first < warmed <= 1.05 * TOTAL, (first, warmed, TOTAL)
    assert all(held(s) >= 0.95 * TOTAL for s in servers)
    c = tier.client(*args)
    tier.wait_servers(2)
    read_everything(c, 3)
    assert backend_bytes(c) == 0 and sum(backend_bytes(s) for s in servers) == warmed
    deadline = time.monotonic() + 15  # (what a member holds is published at its heartbeat, every 2 s)
    while True:
        st = subprocess.run([*EPOCHFS, "cluster", "status", tier.dataset, "--meta", tier.redis_url, "--json",
                             "--peer-token-file", str(tier.token_file)], capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        rows = {r["member"]: r for r in json.loads(st.stdout)["members"]}
        sessions = json.loads(st.stdout)["clients"]
        if (all(r["held_bytes"] >= 0.95 * TOTAL for r in rows.values())
                and all((c.get("tier_bytes") or 0) >= 0.95 * TOTAL for c in sessions)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(rows) == {s.addr for s in servers}  # the client is no member...
    (session,) = json.loads(st.stdout)["clients"]  # ...but its session is listed: who reads through the tier
    assert session["member"].endswith(f":{c.mountpoint}") and session["role"] == "client"
    assert session["tier_bytes"] >= 0.95 * TOTAL and session["backend_bytes"] == 0, session
    for s in servers:
        row = rows[s.addr]
        assert row["role"] == "server" and row["health"] == "up" and row["held_bytes"] >= 0.95 * TOTAL
        assert row["share_bytes"] == TOTAL  # (two holders of each block, two cache nodes: all of it)
    assert json.loads(st.stdout)["warnings"] == []
    text = subprocess.run([*EPOCHFS, "cluster", "status", tier.dataset, "--meta", tier.redis_url],
                          capture_output=True, text=True, timeout=60).stdout
    assert "2 cache nodes" in text and servers[0].addr in text
    assert "1 client mount read through it" in text and str(c.mountpoint) in text
    servers[1].stop(signal.SIGKILL)  # its entry stays in the store until it expires: left out, and named
    r = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "did not prove" in r.stderr and servers[1].addr in r.stderr, r.stderr


def cluster_status(tier: Tier, until) -> tuple[dict, str]:
    """`epochfs cluster status` (JSON) once ``until(rows)`` holds of its members (they publish what they
    hold at their heartbeat, every 2 s), and its text."""
    base = [*EPOCHFS, "cluster", "status", tier.dataset, "--meta", tier.redis_url]
    deadline = time.monotonic() + 15
    while True:
        st = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        out = json.loads(st.stdout)
        if until(out["members"]) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return out, subprocess.run(base, capture_output=True, text=True, timeout=60).stdout


def test_cluster_status_names_a_cache_node_whose_share_outgrows_its_cache(tier):
    """Each cache node's share of the dataset (the snapshot's blocks ranked as the members rank them,
    weighted by the cache sizes they state), against its cache: a tier whose caches add up to less than
    the dataset has a node whose share outgrows its cache, named with the fix; the others are not;
    the command and the nodes rank alike; members cut at another block size are named too (they never
    serve each other a block)."""
    large, small = tier.server("--cache-size", "4M"), tier.server("--cache-size", "2M")
    tier.wait_servers(2)
    out, text = cluster_status(tier, lambda rows: all("capacity_bytes" in r for r in rows))
    rows = {r["member"]: r for r in out["members"]}
    assert sum(r["share_bytes"] for r in rows.values()) == TOTAL == out["shares"]["total_bytes"]
    assert out["shares"]["block_size"] == MiB and not out["shares"]["sampled"]
    over = {m for m, r in rows.items() if r["share_bytes"] > r["capacity_bytes"]}
    assert over, rows  # (6 MiB of caches for 28 MiB: one at least)
    assert len(out["warnings"]) == len(over)
    for node in (large, small):
        named = [w for w in out["warnings"] if node.addr in w]
        assert bool(named) == (node.addr in over), (node.addr, out["warnings"])
        assert not named or "`--cache-size " in named[0] and f"! {node.addr} owns" in text
    # each node knows its share as the command ranked it (they weigh the members alike; the node started
    # first, which ranked itself alone, ranks again as the other joins): its status, its metric (the
    # alert rule's input) and its log say so
    for node in (large, small):
        deadline = time.monotonic() + 15
        while node.status()["peer"]["share_bytes"] != rows[node.addr]["share_bytes"] and time.monotonic() < deadline:
            time.sleep(0.2)
        p = node.status()["peer"]
        assert p["share_bytes"] == rows[node.addr]["share_bytes"] and p["dataset_bytes"] == TOTAL, p
        assert "this node owns" in node.log()
        with urllib.request.urlopen(f"http://{node.status()['metrics_addr']}/metrics", timeout=10) as answer:
            shares = [s.value for fam in text_string_to_metric_families(answer.read().decode())
                      for s in fam.samples if s.name == "epochfs_peer_share_bytes"]
        assert shares == [p["share_bytes"]], shares
    assert ("evicts blocks it owns" in small.log()) == (small.addr in over)
    warmup = subprocess.run([*EPOCHFS, "cluster", "warmup", tier.dataset, "--meta", tier.redis_url,
                             "--peer-token-file", str(tier.token_file), "--block-size", "1M"],
                            capture_output=True, text=True, timeout=120)
    warned = [line for line in warmup.stderr.splitlines() if "warning:" in line]  # (said before it warms)
    assert {n.addr for n in (large, small) if any(f"warning: {n.addr} is asked to hold" in w for w in warned)} \
        == over, warmup.stderr
    # every block was answered, yet not all are held: the warmup says which node cannot hold what, exit 1
    assert warmup.returncode == 1 and "the warmup is not complete" in warmup.stderr, warmup.stderr
    assert all(f"{node} holds at most" in warmup.stderr for node in over), warmup.stderr
    other = tier.server("--block-size", "2M")
    tier.wait_servers(3)
    out, text = cluster_status(tier, lambda rows: len(rows) == 3 and all("capacity_bytes" in r for r in rows))
    assert "different sizes" in out["warnings"][0], out["warnings"]
    assert sum(r["share_bytes"] for r in out["members"]) == TOTAL and other.addr in text


def test_cache_nodes_share_the_dataset_in_proportion_to_their_caches(tier):
    """Cache nodes of different sizes each hold about their cache's part of the dataset: a node with
    eight times the cache of another is asked for most of it, and warming the tier fills each with the
    share the command and the nodes rank alike."""
    large, small = tier.server("--cache-size", "256M"), tier.server("--cache-size", "32M")
    tier.wait_servers(2)
    out, _ = cluster_status(tier, lambda rows: all("capacity_bytes" in r for r in rows))
    rows = {r["member"]: r for r in out["members"]}
    assert rows[large.addr]["share_bytes"] > rows[small.addr]["share_bytes"], rows  # (8:1 of 28 blocks)
    assert not out["warnings"], out["warnings"]
    p = small.status()["peer"]  # the node says what it is weighed by
    assert (p["cache_size_bytes"], p["tier_cache_bytes"]) == (32 * MiB, 288 * MiB), p
    text = subprocess.run([*EPOCHFS, "status", str(small.cache_dir)], capture_output=True, text=True).stdout
    assert "(its 32.0 MiB of the members' 288.0 MiB of cache)" in text, text
    # a cache node's status: no mount, no reader of its own, so none of a mount's advice
    assert text.startswith(f"cache node of {tier.dataset}") and "mount " not in text.splitlines()[0], text
    assert "EpochfsSampler" not in text and "--eviction manifest" not in text and "hand one over" not in text, text
    # warmed as a Job warms them: from a member's own config file (the source, store, token and block size)
    config = tier.tmp / "cache.toml"
    config.write_text(f'source = "{tier.dataset}"\nmeta = "{tier.redis_url}"\npeer_token_file = "{tier.token_file}"\n'
                      'block_size = "1M"\ncache_size = "32M"\n')
    r = subprocess.run([*EPOCHFS, "cluster", "warmup", "--config", str(config)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for node in (large, small):
        deadline = time.monotonic() + 15
        while held(node) < rows[node.addr]["share_bytes"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert held(node) == rows[node.addr]["share_bytes"], (node.addr, held(node), rows)


def test_a_node_that_joins_with_rebalance_fills_its_share_and_one_that_leaves_hands_it_over(tier):
    """A third cache node started with --rebalance takes its whole share at once, from the two that hold
    the dataset (nothing from the backend); a cache node stopped (SIGTERM) hands its share to the next
    owners before it leaves: the others then hold the whole dataset, and a client reads it all with
    nothing more from the backend."""
    servers = [tier.server(), tier.server()]
    tier.wait_servers(2)
    r = subprocess.run([*EPOCHFS, "cluster", "warmup", tier.dataset, "--meta", tier.redis_url, "--peer-token-file",
                        str(tier.token_file), "--block-size", "1M"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    warmed = sum(backend_bytes(s) for s in servers)
    third = tier.server("--rebalance")
    tier.wait_servers(3)
    deadline = time.monotonic() + 30
    while "rebalance: done" not in third.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "rebalance: done" in third.log(), third.log()[-2000:]
    # its whole share, as the tier ranks it (a third of the blocks on average; the blocks' names, and so
    # the share, differ from run to run), and none of it from the backend
    out, _ = cluster_status(tier, lambda rows: len(rows) == 3 and all("share_bytes" in r for r in rows))
    share = {r["member"]: r["share_bytes"] for r in out["members"]}[third.addr]
    assert share > 0 and held(third) == share and backend_bytes(third) == 0, (held(third), share, TOTAL)
    rest = [servers[1], third]
    before = [backend_bytes(s) for s in rest]
    leaving = servers[0]
    leaving.stop(signal.SIGTERM)
    assert "blocks over to their next owners" in leaving.log(), leaving.log()[-2000:]
    assert sum(held(s) for s in rest) >= 0.95 * TOTAL  # its share went to the others ...
    assert [backend_bytes(s) for s in rest] == before  # ... from it, not from the backend
    c = tier.client()
    deadline = time.monotonic() + 20
    while len(c.status()["peer"]["members"]) != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    read_everything(c, 5)
    assert backend_bytes(c) == 0 and [backend_bytes(s) for s in rest] == before
    assert warmed <= 1.05 * TOTAL  # the dataset crossed the backend link once, all told


def test_cache_nodes_that_lie_fill_up_or_restart_empty_never_cost_a_wrong_byte(tier, tmp_path):
    """A planted 'cache node' in the store answering junk, and a real one with another token, are never
    asked for a block; a cache node whose disk holds a tenth of its share reads through and still
    serves; one restarted with an empty cache on the same address is asked again and serves right
    bytes. Every read byte-exact throughout."""
    import redis

    from .test_peer import FakePeer, junk_answer

    fake = FakePeer(junk_answer)
    other_token = tmp_path / "other-token"
    other_token.write_text(os.urandom(16).hex())
    other_token.chmod(0o600)
    try:
        r = redis.Redis.from_url(tier.redis_url)
        r.zadd(f"epochfs:{tier.dataset}/:servers", {fake.addr: float(r.time()[0]) + 3600})
        small = tier.server("--cache-size", str(TOTAL // 10 // MiB * MiB or MiB))
        stranger = CacheNode(tier, 9, "--peer-token-file", str(other_token))
        stranger.start()
        c = tier.client("--peer-timeout", "2")
        deadline = time.monotonic() + 20
        while len(c.status()["peer"]["members"]) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        p = c.status()["peer"]
        assert p["members"] == [small.addr] and {fake.addr, stranger.addr} <= set(p["down"]), p
        read_everything(c, 0)
        assert fake.block_requests() == [] and stranger.status()["peer"]["requests"]["served"] == 0
        assert held(small) <= TOTAL // 10 + MiB and small.status()["peer"]["bytes_out"] > 0  # read through
        stranger.stop()
        # restarted empty on the same address
        small.stop(signal.SIGKILL)
        import shutil

        shutil.rmtree(small.cache_dir)
        small.start()
        fresh = tier.client("--peer-timeout", "2")
        read_everything(fresh, 1)
        assert fresh.status()["peer"]["requests"]["ok"] > 0
    finally:
        fake.close()


def test_a_shared_cache_the_user_already_runs_in_front_of_the_origin(tmp_path, s3, s3_client, fresh_bucket,
                                                                      mount_factory):
    """The recipe of docs/cluster-cache.md: a SeaweedFS server that mounts the origin bucket as remote
    storage (read through, kept) is the endpoint the GPU nodes mount; epochfs adds its verified local
    tier on top. Byte-exact; a second GPU node reads the dataset without the origin being asked again."""
    from epochfs.dev.sample import upload
    from epochfs.dev.servers import LocalS3

    upload(s3_client, fresh_bucket, "ds/", FILES)
    near = LocalS3(tmp_path / "near", remote_origins=True).start()
    try:
        gets = s3.request_count(fresh_bucket)
        near.mount_remote(s3.endpoint, fresh_bucket, "near")  # and warmed: remote.cache
        warmed = s3.request_count(fresh_bucket) - gets
        assert warmed > 0
        for n in range(2):  # two GPU nodes: the origin is not asked again
            m = mount_factory("s3://near/ds", "--endpoint-url", near.endpoint, name=f"m{n}", cache_dir=tmp_path / f"c{n}")
            with m:
                read_everything(m, n)
                assert backend_bytes(m) >= TOTAL * 0.95  # every block through the near cluster
        # no file was read from the origin again: what it saw after the warmup is the near cluster passing
        # each mount's listing on (one each)
        assert s3.request_count(fresh_bucket) - gets <= warmed + 2
    finally:
        near.stop()


def test_planted_members_cannot_hang_cluster_status_nor_warmup(tier):
    """Whoever writes the store lists 10,000 cache nodes (closed loopback ports): `cluster status` and
    `cluster warmup` take at most MAX_LISTED of them, prove them in bounded time, rank the shares within a
    budget, say so, and still report the real node and warm the dataset at it."""
    import redis

    from epochfs.cli.cluster import MAX_LISTED

    real = tier.server()
    tier.wait_servers(1)
    port = int(tier.redis_url.rsplit(":", 1)[1].split("/")[0])
    r = redis.Redis(port=port)
    key = next(k for k in r.keys("*servers") if b"epochfs" in k)
    r.zadd(key, {f"127.0.0.{2 + i // 60000}:{1024 + i % 60000}": time.time() + 3600 for i in range(10_000)})
    # Bounded by counts, not by how fast this machine is: at most MAX_LISTED members taken and proved
    # (a hang, or all 10,000 proved one by one, runs into the subprocesses' timeouts and fails).
    st = subprocess.run([*EPOCHFS, "cluster", "status", tier.dataset, "--meta", tier.redis_url, "--json",
                         "--peer-token-file", str(tier.token_file)], capture_output=True, text=True, timeout=180)
    assert st.returncode == 0, st.stderr
    assert f"more than {MAX_LISTED} members" in st.stderr
    rows = json.loads(st.stdout)["members"]
    assert len(rows) <= MAX_LISTED and real.addr in {r["member"] for r in rows}, len(rows)
    base = [*EPOCHFS, "cluster", "warmup", tier.dataset, "--meta", tier.redis_url, "--peer-token-file",
            str(tier.token_file), "--block-size", "1M"]
    w = subprocess.run(base, capture_output=True, text=True, timeout=240)
    (left_out,) = [line for line in w.stderr.splitlines() if "did not prove" in line]  # (the planted ones)
    named = int(re.search(r"epochfs: (\d+) cache nodes listed in the store did not prove", left_out)[1])
    assert 0 < named <= MAX_LISTED, left_out[:300]
    assert held(real) > 0


def test_a_node_whose_token_the_cache_nodes_refuse_says_so_in_status_and_metrics(tier):
    """A GPU node installed with a token of its own (not the cluster's): the cache node refuses its
    proofs, so it reads from the backend. It says why where an operator looks: `epochfs status` names the
    members refusing its token with the fix, the metric epochfs_peer_refusing_members (the alert's input)
    counts them, and its log says it once. A node with the cluster's token shows none of it."""
    server = tier.server()
    other = tier.tmp / "another-token"
    other.write_text(os.urandom(16).hex() + "\n")
    other.chmod(0o600)
    good, bad = tier.client(), tier.client("--peer-token-file", str(other))
    deadline = time.monotonic() + 30
    while not bad.status()["peer"].get("refusing") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert bad.status()["peer"]["refusing"] == [server.addr], bad.status()["peer"]
    text = subprocess.run([*EPOCHFS, "status", str(bad.mountpoint)], capture_output=True, text=True, timeout=60).stdout
    assert f"1 member refusing this node's token ({server.addr})" in text and "peer_token_file" in text, text
    for node, expected in ((bad, 1.0), (good, 0.0)):
        with urllib.request.urlopen(f"http://{node.status()['metrics_addr']}/metrics", timeout=10) as answer:
            values = [s.value for fam in text_string_to_metric_families(answer.read().decode())
                      for s in fam.samples if s.name == "epochfs_peer_refusing_members"]
        assert values == [expected], (node.mountpoint, values)
    assert not good.status()["peer"].get("refusing")
    log = (tier.tmp / "client-cache1" / "epochfs.log").read_text(errors="replace")
    assert log.count("refuses this node's token") == 1, log[-2000:]


def test_epochfs_stop_stops_a_backgrounded_cache_node_after_its_hand_over(tier):
    """`epochfs stop CACHE_DIR` (as `umount` does for a mount): the cache node started in the background
    hands its blocks over, leaves, exits, and the command returns once it has; a mount or a directory
    no cache node serves is refused with what to do instead."""
    node = tier.server()
    client = tier.client()
    pid = node.pid()
    r = subprocess.run([*EPOCHFS, "stop", str(client.mountpoint)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "epochfs umount" in r.stderr, r.stderr
    r = subprocess.run([*EPOCHFS, "stop", str(tier.tmp / "nothing-here")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no cache node answers" in r.stderr, r.stderr
    r = subprocess.run([*EPOCHFS, "stop", str(node.cache_dir)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # (gone, or a zombie of ours)
    assert "stopped the cache node" in r.stderr
    assert "cache node of" in node.log() and "stopped" in node.log()


def test_the_warmup_command_the_doctor_advises_runs_as_pasted(tier):
    """The doctor's advice to warm the cache nodes is a command built from the GPU node's own options (its
    store, token file, block size, replicas): pasted into a shell on that node, it warms the tier."""
    from epochfs.doctor.advice import warmup_command

    servers = [tier.server(), tier.server()]
    client = tier.client()
    tier.wait_servers(2)
    status = client.status()
    command = warmup_command({"source": status["source"], "options": status["options"]})
    assert "--peer-token-file" in command and "--meta " in command, command
    r = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert r.returncode == 0 and "held by their owners" in r.stdout, (command, r.stderr)
    assert sum(held(s) for s in servers) >= 0.95 * TOTAL
