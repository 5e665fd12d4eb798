"""The shared store through Redis Sentinel: real processes (a master, a replica, three sentinels), the
master killed while nodes publish. Every publication acknowledged to a writer is in the store after the
failover and none is taken twice; publications resume within 30 s; readers of a mount never see an
error; status and a metric name the master in use and when it changed; a node keeps serving when
every sentinel is gone."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request

import pytest

from epochfs.core.errors import ConfigError, EpochfsError
from epochfs.core.records import ObjectInfo
from epochfs.dev.sample import SampleFile, upload
from epochfs.dev.servers import LocalRedis, LocalSentinels
from epochfs.meta import StoreAccess, open_meta
from epochfs.meta.redis_link import _sentinel_url, online_replicas

from .conftest import requires_fuse
from .helpers import EPOCHFS

PASSWORD = "sentinel-test-password"
SOURCE = "s3://b/p/"


@pytest.mark.parametrize("url,sentinels,service,db", [
    ("redis+sentinel://10.0.0.1:26379/mymaster", [("10.0.0.1", 26379)], "mymaster", 0),
    ("redis+sentinel://epochfs@a:1,b:2,[::1]:3/svc/4", [("a", 1), ("b", 2), ("::1", 3)], "svc", 4),
    ("rediss+sentinel://h:26379/svc/0", [("h", 26379)], "svc", 0),
])
def test_sentinel_urls(url, sentinels, service, db):
    target, shown = _sentinel_url(url)
    assert list(target.sentinels) == sentinels and (target.service, target.db) == (service, db)
    assert target.tls == url.startswith("rediss")
    assert shown.endswith(f"/{service}/{db}")


@pytest.mark.parametrize("url,message", [
    ("redis+sentinel://u:secret@h:1/svc", "password in the URL"),
    ("redis+sentinel://h/svc", "not HOST:PORT"),
    ("redis+sentinel://h:99999/svc", "not HOST:PORT"),
    ("redis+sentinel://h:1/", "name the service"),
    ("redis+sentinel://h:1/svc/x", "name the service"),
    ("redis+sentinel://h:1/s v c", "name the service"),
])
def test_sentinel_urls_that_are_not_are_refused(url, message):
    with pytest.raises(ConfigError, match=message):
        _sentinel_url(url)


class Cluster:
    def __init__(self, tmp_path):
        self.master = LocalRedis(tmp_path / "master", password=PASSWORD).start()
        self.replica = LocalRedis(tmp_path / "replica", password=PASSWORD, replica_of=self.master).start()
        self.sentinels = LocalSentinels(tmp_path / "sentinels", self.master).start()
        self.wait_replicated()

    def wait_replicated(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while online_replicas(self.master.client().info("replication")) < 1:
            assert time.monotonic() < deadline, "the replica did not come online"
            time.sleep(0.05)

    def store(self):
        return open_meta(self.sentinels.url, None, None, StoreAccess(password=PASSWORD.encode()))

    def stop(self):
        for s in (self.sentinels, self.replica, self.master):
            s.stop()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


def test_only_replicas_online_are_waited_for():
    """A replica still taking its first copy acknowledges no WAIT: the store does not wait on it (it gets
    what is written with its copy); one online is waited for."""
    info = {"role": "master", "connected_slaves": 1,
            "slave0": {"ip": "127.0.0.1", "port": 6380, "state": "wait_bgsave", "offset": 0, "lag": 0}}
    assert online_replicas(info) == 0
    info["slave0"]["state"] = "online"
    info["slave1"] = {"ip": "127.0.0.1", "port": 6381, "state": "send_bulk", "offset": 0, "lag": 0}
    assert online_replicas(info) == 1


def obj(key: str) -> ObjectInfo:
    return ObjectInfo(key, len(key), 1_700_000_000_000_000_000, f'"{key}"')


def test_publications_acknowledged_before_a_failover_survive_it_and_none_is_taken_twice(cluster):
    first = cluster.store()
    first.save(SOURCE, [obj("base")])
    acked: dict[str, float] = {}  # key -> when its publication was acknowledged
    lock = threading.Lock()
    stop = threading.Event()
    killed: list[float] = []

    def writer(n: int) -> None:
        store = cluster.store()  # a node of its own
        for i in range(200):
            if stop.is_set():
                return
            key, name = f"w{n}/{i:04d}", f"node{n}-batch{i}"
            while not stop.is_set():  # as the publisher does: the same batch, under its name, until it is taken
                try:
                    store.update(SOURCE, {key: obj(key)}, set(), publication=name)
                    with lock:
                        acked[key] = time.monotonic()
                    break
                except EpochfsError:
                    time.sleep(0.2)
            time.sleep(0.05)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    old = cluster.sentinels.master_address()
    cluster.master.stop()  # SIGKILL: what it had not sent to the replica is gone
    killed.append(time.monotonic())
    deadline = time.monotonic() + 60
    promoted = None  # when the Sentinels first named another master (their election: not ours to time)
    while not any(t > killed[0] for t in acked.values()):
        assert time.monotonic() < deadline, "no publication was acknowledged after the failover"
        if promoted is None and cluster.sentinels.master_address() != old:
            promoted = time.monotonic()
        time.sleep(0.1)
    first = min(t for t in acked.values() if t > killed[0])
    time.sleep(2)  # publications go on after the failover
    stop.set()
    for t in threads:
        t.join(60)
    assert cluster.sentinels.master_address() != old
    # The stores follow the new master at once: a publication is acknowledged within a few seconds of
    # the Sentinels naming it (their election itself takes 1 s to notice and, on a loaded machine, a
    # retry after twice the failover timeout).
    since = first - (promoted if promoted is not None else first)
    assert since < 10, f"publications resumed {since:.1f} s after the Sentinels named the new master"
    assert first - killed[0] < 45, f"publications resumed {first - killed[0]:.1f} s after the master died"

    store = cluster.store()
    current = store.head(SOURCE).version
    seen: dict[str, int] = {}  # the change sets from the first version to the current one: the store's state
    for change in store.changes(SOURCE, 1, current) or []:
        for key in change.added:
            seen[key] = seen.get(key, 0) + 1
    assert set(acked) <= set(seen), f"acknowledged, then lost: {sorted(set(acked) - set(seen))[:5]}"
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1][:5]
    assert store.master is not None and f"{store.master[0]}:{store.master[1]}" != f"{old[0]}:{old[1]}"


def test_a_publication_tried_again_after_its_answer_was_lost_is_not_taken_twice(cluster):
    store = cluster.store()
    store.save(SOURCE, [obj("base")])
    a = store.update(SOURCE, {"k": obj("k")}, set(), publication="batch-1")
    b = store.update(SOURCE, {"k": obj("k")}, set(), publication="batch-1")  # the writer never heard the first
    assert a.version == b.version == store.head(SOURCE).version
    c = store.update(SOURCE, {"k2": obj("k2")}, set(), publication="batch-2")
    assert c.version == a.version + 1


@requires_fuse
def test_nodes_publish_through_a_failover_and_keep_serving_without_sentinels(cluster, tmp_path, s3, s3_client,
                                                                           fresh_bucket, mount_factory):
    files = [SampleFile(f"d/{i}.bin", 4000 + i) for i in range(10)]
    upload(s3_client, fresh_bucket, "ds/", files)
    pw = tmp_path / "redis-password"
    pw.write_text(PASSWORD)
    pw.chmod(0o600)
    meta = ["--meta", cluster.sentinels.url, "--meta-password-file", str(pw)]
    r = subprocess.run([*EPOCHFS, "import", f"s3://{fresh_bucket}/ds", *meta, "--endpoint-url", s3.endpoint],
                       capture_output=True, text=True, env={**os.environ, **s3.env()}, timeout=120)
    assert r.returncode == 0, r.stderr
    writer = mount_factory(f"s3://{fresh_bucket}/ds", "--writeback", *meta, "--meta-poll", "1", name="writer",
                           cache_dir=tmp_path / "c-writer")
    reader = mount_factory(f"s3://{fresh_bucket}/ds", *meta, "--meta-poll", "1", name="reader",
                           cache_dir=tmp_path / "c-reader")
    with writer, reader:
        st = writer.status()
        before = st["meta"]["master"]
        assert before and st["meta"]["master_since"]
        (writer.mountpoint / "ckpt").mkdir()
        (writer.mountpoint / "ckpt" / "a.pt").write_bytes(b"a" * 5000)
        assert subprocess.run([*EPOCHFS, "sync", str(writer.mountpoint)], timeout=120).returncode == 0
        errors: list[BaseException] = []
        reading = threading.Event()
        reading.set()

        def read_loop() -> None:  # a training job reading through the failover
            while reading.is_set():
                for f in files:
                    try:
                        assert (reader.mountpoint / f.key).read_bytes() == f.content()
                    except BaseException as exc:  # noqa: BLE001
                        errors.append(exc)
                time.sleep(0.01)

        t = threading.Thread(target=read_loop)
        t.start()
        cluster.master.stop()
        (writer.mountpoint / "ckpt" / "b.pt").write_bytes(b"b" * 6000)
        r = subprocess.run([*EPOCHFS, "sync", str(writer.mountpoint), "--timeout", "60"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        deadline = time.monotonic() + 30
        while not (reader.mountpoint / "ckpt" / "b.pt").exists():
            assert time.monotonic() < deadline, "the other node never saw the publication made after the failover"
            time.sleep(0.2)
        reading.clear()
        t.join(30)
        assert not errors, errors[:3]
        assert (reader.mountpoint / "ckpt" / "a.pt").read_bytes() == b"a" * 5000
        st = writer.status()
        assert st["meta"]["master"] != before and st["meta"]["master_since"] > time.time() - 120
        text = subprocess.run([*EPOCHFS, "status", str(writer.mountpoint)], capture_output=True, text=True).stdout
        assert f"master {st['meta']['master']} since" in text
        metrics = urllib.request.urlopen(f"http://{st['metrics_addr']}/metrics", timeout=10).read().decode()
        assert f'epochfs_meta_master_since_timestamp_seconds{{address="{st["meta"]["master"]}"' in metrics
        # Every sentinel gone (and the store with them): both nodes keep serving what they hold.
        cluster.sentinels.stop()
        cluster.replica.stop()
        for f in files:
            assert (reader.mountpoint / f.key).read_bytes() == f.content()
        assert (reader.mountpoint / "ckpt" / "b.pt").read_bytes() == b"b" * 6000
        assert json.loads(subprocess.run([*EPOCHFS, "status", str(reader.mountpoint), "--json"],
                                         capture_output=True, text=True).stdout)["pid"]
