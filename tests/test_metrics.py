"""Metrics scraped from live mounts, the alert rules under promtool, and the Grafana dashboard."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epochfs.control import request
from epochfs.dev.sample import SampleFile, upload
from epochfs.dev.servers import LocalRedis, free_ports

from .conftest import requires_fuse
from .helpers import EPOCHFS, Mount, drop_all_caches, read_all, wait_idle

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "deploy" / "prometheus"
KiB, MiB = 1 << 10, 1 << 20

REQUIRED = {  # from the product contract: name -> type
    "epochfs_cache_hits": "counter", "epochfs_cache_misses": "counter",
    "epochfs_cache_hit_bytes": "counter", "epochfs_cache_miss_bytes": "counter",
    "epochfs_backend_requests": "counter", "epochfs_backend_bytes": "counter",
    "epochfs_backend_request_seconds": "histogram", "epochfs_backend_bandwidth_limit_bytes": "gauge",
    "epochfs_read_seconds": "histogram", "epochfs_cache_used_bytes": "gauge",
    "epochfs_cache_capacity_bytes": "gauge", "epochfs_cache_evictions": "counter",
    "epochfs_cache_corrupt_blocks": "counter", "epochfs_prefetch_queued_bytes": "gauge",
    "epochfs_prefetch_lead_seconds": "gauge", "epochfs_manifest_position": "gauge", "epochfs_errors": "counter",
    "epochfs_writeback_pending_bytes": "gauge", "epochfs_writeback_pending_files": "gauge",
    "epochfs_writeback_oldest_pending_seconds": "gauge", "epochfs_writeback_uploaded_bytes": "counter",
}


def scrape_text(m) -> str:
    addr = m.status()["metrics_addr"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def scrape(m) -> dict[str, float]:
    """Samples by name with sorted labels but the mount point's and the node's, e.g.
    'epochfs_backend_bytes_total{purpose="demand"}'; every sample carries that mount point and node."""
    out = {}
    node = m.status()["node"]
    for fam in text_string_to_metric_families(scrape_text(m)):
        for s in fam.samples:
            assert s.labels.get("mountpoint") == str(m.mountpoint) and s.labels.get("node") == node, s
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in ("mountpoint", "node"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@requires_fuse
@pytest.mark.page_cache
def test_counters_move_by_exactly_what_was_read(s3_client, fresh_bucket, mount_factory):
    files = [SampleFile(f"d/f{i:02d}.bin", 200 * KiB + 7 * i) for i in range(12)] + [SampleFile("big.bin", 3 * MiB + 5)]
    upload(s3_client, fresh_bucket, "", files)
    total = sum(f.size for f in files)
    blocks = 12 + 4
    with mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M", "--readahead", "0", "--no-learned-order",
                       "--backend-bandwidth", "10Gbit") as m:  # (nothing fetched but what is read)
        s0 = scrape(m)
        assert s0['epochfs_backend_bandwidth_limit_bytes{source="declared"}'] == 1.25e9
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        wait_idle(m)
        s1 = scrape(m)
        assert delta(s1, s0, "epochfs_cache_miss_bytes_total") == total
        assert delta(s1, s0, "epochfs_cache_hit_bytes_total") == 0
        assert delta(s1, s0, "epochfs_cache_hits_total") == 0
        assert delta(s1, s0, "epochfs_cache_misses_total") >= blocks
        assert delta(s1, s0, 'epochfs_backend_bytes_total{purpose="demand"}') == total
        assert delta(s1, s0, 'epochfs_backend_bytes_total{purpose="prefetch"}') == 0
        assert delta(s1, s0, 'epochfs_backend_requests_total{op="get",outcome="ok"}') == blocks
        assert delta(s1, s0, "epochfs_backend_request_seconds_count") == blocks
        store = m.status()["store"]
        assert store["configured_bytes"] == 10 * (1 << 30)  # the default --cache-size
        # What it can hold now: the default, or less on a disk with less room (a small CI machine's); the
        # room moves as other tests write, between the scrape and the status (by a few blocks at most).
        assert s1["epochfs_cache_used_bytes"] == total
        assert 0 < s1["epochfs_cache_capacity_bytes"] <= 10 * (1 << 30)
        assert abs(s1["epochfs_cache_capacity_bytes"] - store["capacity_bytes"]) <= 64 * MiB
        assert delta(s1, s0, "epochfs_read_seconds_count") >= blocks

        drop_all_caches()
        for f in files:
            assert read_all(m.path(f.key)) == f.content()
        s2 = scrape(m)
        assert delta(s2, s1, "epochfs_cache_hit_bytes_total") == total
        assert delta(s2, s1, "epochfs_cache_miss_bytes_total") == 0
        assert delta(s2, s1, "epochfs_cache_misses_total") == 0
        # (read by the kernel from the cache's files: one hit per open, its object's size in the hit bytes)
        assert delta(s2, s1, "epochfs_passthrough_opens_total") == len(files)
        assert delta(s2, s1, "epochfs_cache_hits_total") == len(files)
        assert delta(s2, s1, 'epochfs_backend_bytes_total{purpose="demand"}') == 0
        assert delta(s2, s1, 'epochfs_backend_requests_total{op="get",outcome="ok"}') == 0


@requires_fuse
def test_exposition_types_help_and_no_object_keys_in_labels(mount_factory, sample_bucket, sample_files):
    with mount_factory(f"s3://{sample_bucket}/data", "--backend-bandwidth", "1Gbit", "--writeback") as m:
        read_all(m.path(sample_files[9].key))
        families = {f.name: f for f in text_string_to_metric_families(scrape_text(m))}
    for name, kind in REQUIRED.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        assert families[name].documentation, name
    keys = {f.key for f in sample_files} | {part for f in sample_files for part in f.key.split("/")}
    for fam in families.values():
        assert fam.name.startswith("epochfs_")
        for s in fam.samples:
            assert not set(s.labels.values()) & keys, s
    buckets = [s.labels["le"] for s in families["epochfs_read_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets[0] == "0.0001" and "30.0" in buckets and buckets[-1] == "+Inf"


@requires_fuse
def test_exporter_binds_to_loopback_and_warns_when_exposed(mount_factory, sample_bucket, tmp_path):
    m = mount_factory(f"s3://{sample_bucket}/data", "--metrics-addr", "127.0.0.1:9567", name="default")
    with m:
        assert m.status()["metrics_addr"] == "127.0.0.1:9567"
        assert "exposed" not in m.log()
    m = mount_factory(f"s3://{sample_bucket}/data", "--metrics-addr", "0.0.0.0:0", name="exposed",
                      cache_dir=tmp_path / "c2")
    with m:
        assert "metrics are exposed on 0.0.0.0" in m.log()
    m = mount_factory(f"s3://{sample_bucket}/data", "--metrics-addr", "off", name="off", cache_dir=tmp_path / "c3")
    with m:
        assert m.status()["metrics_addr"] is None


def test_the_default_metrics_address_is_loopback():
    from epochfs.cli import build_parser
    from epochfs.cli.options import config_from
    from epochfs.daemon.metrics import DEFAULT_ADDR

    assert config_from(build_parser().parse_args(["mount", "s3://b", "/mnt/data"])).metrics_addr is None
    assert DEFAULT_ADDR == "127.0.0.1:9567"


@requires_fuse
def test_three_mounts_on_one_node_come_up_with_default_options(s3, sample_bucket, tmp_path):
    """The default metrics port taken by the first mount, the next ones take the next free ports and
    say so; an address given explicitly that is taken stays an error."""
    mounts = [Mount(f"s3://{sample_bucket}/data", tmp_path / f"m{i}", tmp_path / f"c{i}", s3.env(),
                    "--endpoint-url", s3.endpoint) for i in range(3)]
    try:
        for m in mounts:
            m.start()
        addrs = [m.status()["metrics_addr"] for m in mounts]
        ports = [int(a.rsplit(":", 1)[1]) for a in addrs]
        assert all(a.startswith("127.0.0.1:") for a in addrs) and len(set(ports)) == 3
        assert all(9567 <= p < 9667 for p in ports)
        assert sum("is taken (another mount?)" in m.log() for m in mounts) >= 2
        for m in mounts:
            assert scrape(m)  # each answers for itself, labelled with its mount point
        clash = Mount(f"s3://{sample_bucket}/data", tmp_path / "clash", tmp_path / "c-clash", s3.env(),
                      "--endpoint-url", s3.endpoint, "--metrics-addr", addrs[0])
        r = clash.start(expect_ok=False)
        assert r.returncode == 2 and "Address already in use" in r.stderr and "Traceback" not in r.stderr
    finally:
        for m in mounts:
            m.stop()


def prometheus_api(port: int, path: str, **params: str):  # type: ignore[no-untyped-def]
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}?{query}", timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


def wait_for(what: str, fn, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = fn()
        except OSError:  # not listening yet
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"Prometheus never showed {what}"
        time.sleep(0.5)


@pytest.mark.slow  # 15 s; the rules themselves are held by the promtool tests
@requires_fuse
def test_a_real_prometheus_finds_every_mount_of_a_node_and_counts_one_node(s3, sample_bucket, sample_files,
                                                                           tmp_path):
    """The shipped scrape configuration and rules under a real Prometheus: the daemons' target files
    bring in all three mounts of a node (three ports), every series says the one node, the bandwidth
    rule gives one sample for it, the dashboard's node variable lists it once, and an unmounted mount
    leaves the scrape."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: scripts/bootstrap.sh installs it (apt package prometheus)"
    targets = tmp_path / "targets"
    mounts = [Mount(f"s3://{sample_bucket}/data", tmp_path / f"m{i}", tmp_path / f"c{i}", s3.env(),
                    "--endpoint-url", s3.endpoint, "--metrics-targets", str(targets), "--node", "gpu-node-07",
                    "--backend-bandwidth", "1Gbit") for i in range(3)]
    config = (PROM / "prometheus.yml").read_text()
    assert '"/run/epochfs/prometheus/*.json"' in config and "- epochfs-rules.yml" in config
    config = (config.replace("/run/epochfs/prometheus/*.json", f"{targets}/*.json")
              .replace("- epochfs-rules.yml", f"- {PROM / 'epochfs-rules.yml'}")
              .replace("scrape_interval: 15s", "scrape_interval: 1s")
              .replace("evaluation_interval: 15s", "evaluation_interval: 1s"))
    (tmp_path / "prometheus.yml").write_text(config)
    port = free_ports(1)[0]
    prom = None
    try:
        for m in mounts:
            m.start()
        assert len(list(targets.glob("epochfs-*.json"))) == 3
        prom = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
        for i, m in enumerate(mounts):
            read_all(m.path(sample_files[i].key))  # backend traffic on every mount
        wait_for("three healthy targets", lambda: len(prometheus_api(port, "query", query='up{job="epochfs"} == 1')
                                                      ["result"]) == 3)
        nodes = prometheus_api(port, "query", query='count by (node) (up{job="epochfs"})')["result"]
        assert [(r["metric"], r["value"][1]) for r in nodes] == [({"node": "gpu-node-07"}, "3")]
        series = wait_for("the bandwidth rule", lambda: prometheus_api(
            port, "query", query="epochfs:backend_bandwidth_utilisation:rate5m")["result"])
        assert [r["metric"] for r in series] == [{"__name__": "epochfs:backend_bandwidth_utilisation:rate5m",
                                                  "job": "epochfs", "node": "gpu-node-07"}]
        assert prometheus_api(port, "label/node/values", **{"match[]": "epochfs_cache_capacity_bytes"}) \
            == ["gpu-node-07"]  # the dashboard's node variable: one node
        mounts[2].stop()
        assert len(list(targets.glob("epochfs-*.json"))) == 2  # its target went with it
        wait_for("the unmounted mount leave", lambda: len(prometheus_api(port, "targets")["activeTargets"]) == 2)
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        for m in mounts:
            m.stop()


def promtool() -> str:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: scripts/bootstrap.sh installs it (apt package prometheus)"
    return tool


def test_alert_rules_pass_promtool_check_and_unit_tests():
    for args in (["check", "rules", str(PROM / "epochfs-rules.yml")],
                 ["check", "config", str(PROM / "prometheus.yml")],
                 ["test", "rules", str(PROM / "tests" / "epochfs-rules.test.yml")]):
        result = subprocess.run([promtool(), *args], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def dashboard_metric_names() -> set[str]:
    dash = json.loads((ROOT / "deploy" / "grafana" / "epochfs-dashboard.json").read_text())
    assert dash["__inputs"][0]["type"] == "datasource"
    assert any(v["name"] == "node" for v in dash["templating"]["list"])  # a node, not an instance per mount
    assert "instance" not in json.dumps(dash)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    names = {n for e in exprs for n in re.findall(r"\b(epochfs_[a-z_]+)", e)}
    assert len(names) >= 15
    return names


def test_the_errors_panel_shows_failures_not_the_answers_that_are_expected():
    """A pack pointer's HEAD answered "missing" on every plain dataset is how the probe works, not an
    error; the help says what the program does."""
    dash = json.loads((ROOT / "deploy" / "grafana" / "epochfs-dashboard.json").read_text())
    (panel,) = [p for p in dash["panels"] if p.get("title") == "Errors"]
    backend = [t["expr"] for t in panel["targets"] if "epochfs_backend_requests_total" in t["expr"]]
    assert backend and all('outcome!~"ok|missing"' in e for e in backend)
    out = subprocess.run([*EPOCHFS, "--help"], capture_output=True, text=True).stdout
    assert "Read-only FUSE" not in out and "--writeback" in out


@requires_fuse
def test_dashboard_queries_only_series_the_daemon_exports(mount_factory, sample_bucket, sample_files, s3, tmp_path):
    redis_server = LocalRedis(tmp_path / "redis").start()  # every optional part on: write-back, cluster tier
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    source = f"s3://{sample_bucket}/data"
    try:
        subprocess.run([*EPOCHFS, "import", source, "--meta", redis_server.url, "--endpoint-url", s3.endpoint],
                       check=True, capture_output=True, env=s3.env())
        with mount_factory(source, "--backend-bandwidth", "1Gbit", "--writeback", "--meta", redis_server.url,
                           "--peer-listen", "127.0.0.1:0", "--peer-token-file", str(token)) as m:
            read_all(m.path(sample_files[12].key))
            request(m.mountpoint, "report", job="train", rank=0, steps=5, data_wait=1.0, compute=2.0,
                    gpu_utilization=80)  # a training job's report (epochfs.watch): the job series exist
            exported = set()
            for fam in text_string_to_metric_families(scrape_text(m)):
                exported |= {s.name for s in fam.samples}
        # and a dedicated cache node of the same dataset, with its link's capacity
        node_dir = tmp_path / "cache-node"
        r = subprocess.run([*EPOCHFS, "serve", source, "--meta", redis_server.url, "--peer-listen", "127.0.0.1:0",
                            "--peer-token-file", str(token), "--cache-dir", str(node_dir), "--endpoint-url",
                            s3.endpoint, "--metrics-addr", "127.0.0.1:0", "--metrics-targets", "off",
                            "--link-capacity", "10Gbit"], capture_output=True, text=True, env=s3.env(), timeout=60)
        assert r.returncode == 0, r.stderr
        status = request(node_dir, "status")
        deadline = time.monotonic() + 20  # (its share of the dataset is ranked once its members are settled)
        while status["peer"]["share_bytes"] is None and time.monotonic() < deadline:
            time.sleep(0.2)
            status = request(node_dir, "status")
        try:
            with urllib.request.urlopen(f"http://{status['metrics_addr']}/metrics", timeout=10) as answer:
                for fam in text_string_to_metric_families(answer.read().decode()):
                    exported |= {s.name for s in fam.samples}
        finally:
            os.kill(status["pid"], signal.SIGTERM)
    finally:
        redis_server.stop()
    missing = dashboard_metric_names() - exported
    assert not missing, f"the dashboard queries series the daemon does not export: {missing}"


@requires_fuse
def test_status_json(mount_factory, sample_bucket):
    with mount_factory(f"s3://{sample_bucket}/data") as m:
        result = subprocess.run([*EPOCHFS, "status", str(m.mountpoint), "--json"], capture_output=True, text=True)
        status = json.loads(result.stdout)
        assert {"cache", "store", "prefetch", "backend", "snapshot", "read_seconds"} <= set(status)
        # A directory inside the mount names the same mount.
        inside = next(p for p in m.mountpoint.iterdir() if p.is_dir())
        result = subprocess.run([*EPOCHFS, "status", str(inside)], capture_output=True, text=True)
        assert result.returncode == 0 and f"mount      {m.mountpoint}" in result.stdout, result.stderr
        assert "no read answered with an error" in result.stdout
        assert "least recently used: no order handed over yet" in result.stdout



@requires_fuse
def test_stats_view_refreshes(mount_factory, sample_bucket, sample_files):
    with mount_factory(f"s3://{sample_bucket}/data") as m:
        read_all(m.path(sample_files[40].key))
        result = subprocess.run([*EPOCHFS, "stats", str(m.mountpoint), "--count", "2", "--interval", "0.3"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        for row in ("hit ratio (bytes)", "backend, on demand", "backend, prefetched", "read latency p50 / p99",
                    "prefetch"):
            assert row in result.stdout
        # Into a pipe with no --count: each refresh is written out as it comes.
        proc = subprocess.Popen([*EPOCHFS, "stats", str(m.mountpoint), "--interval", "0.2"], stdout=subprocess.PIPE,
                                text=True)
        try:
            first = proc.stdout.readline() + proc.stdout.readline()
            assert "epochfs" in first
        finally:
            proc.kill()
            proc.wait()


def test_status_lines_say_what_the_prefetch_state_is():
    from epochfs.cli.status import format_prefetch

    base = {"blocks": 10, "epoch": 2, "file_position": 3, "files": 10, "position_bytes": 3 << 20,
            "plan_bytes": 10 << 20, "lead_bytes": 7 << 20, "lead_seconds": None, "queued_bytes": 0, "inflight": 0,
            "active": True}
    assert format_prefetch(base).endswith("everything ahead is cached (7.0 MiB)")
    line = format_prefetch({**base, "queued_bytes": 1 << 20, "inflight": 2, "lead_seconds": 1.5})
    assert "cached ahead 7.0 MiB = 1.5 s of reading; queued 1.0 MiB; 2 in flight" in line
    assert "n/a" not in format_prefetch({**base, "queued_bytes": 1 << 20, "inflight": 1})
    assert format_prefetch({**base, "active": False}).endswith("done: every block of the plan fetched or read")
    unseen = format_prefetch({**base, "active": False, "file_position": 0, "position_bytes": 0})
    assert "no read of it has reached the daemon yet" in unseen and "page cache" in unseen
    assert "no manifest" in format_prefetch({**base, "blocks": 0})


def test_status_lines_name_reader_errors_and_the_policy_evictions_followed():
    from epochfs.cli.status import eviction_policy, reader_errors

    s = {"errors": {"EACCES": 906, "EIO": 0, "ESTALE": 3},
         "backend": {"requests": {"get/denied": 906, "get/ok": 10, "head/missing": 4, "list/error": 1}},
         "eviction": "manifest", "prefetch": {"blocks": 0}}
    assert reader_errors(s) == "reads answered EACCES 906, ESTALE 3; backend requests failed: get/denied 906, list/error 1"
    assert reader_errors({"errors": {}, "backend": {"requests": {"head/missing": 2}}}) == "no read answered with an error"
    assert eviction_policy(s).startswith("least recently used: no order handed over yet")
    assert eviction_policy({**s, "prefetch": {"blocks": 5}}) == "the handed-over order"


def test_quantiles_are_interpolated_within_their_bucket():
    from epochfs.core.stats import HistogramSnapshot

    h = HistogramSnapshot((0.001, 0.005, 0.025), (0, 50, 50, 0), 0.5, 100)  # 50 in (1, 5] ms, 50 in (5, 25]
    assert h.quantile(0.5) == pytest.approx(0.005)
    assert h.quantile(0.25) == pytest.approx(0.003)  # halfway through the (1, 5] ms bucket
    assert h.quantile(0.99) == pytest.approx(0.005 + 0.020 * 49 / 50)  # not the bucket's bound, 25 ms
    assert HistogramSnapshot((0.001,), (3, 0), 0.0, 3).quantile(0.5) == pytest.approx(0.0005)
    assert HistogramSnapshot((0.001,), (0, 4), 9.0, 4).quantile(0.5) == float("inf")  # beyond the last bound
    assert HistogramSnapshot((0.001,), (0, 0), 0.0, 0).quantile(0.5) is None



def test_target_files_are_written_atomically_only_where_no_other_user_can_write(tmp_path, caplog):
    from epochfs.daemon.metrics import TargetFile

    t = TargetFile(tmp_path / "targets", "/mnt/data", "gpu-07")
    t.write("127.0.0.1", 9568)
    assert json.loads(t.path.read_text()) == [{"targets": ["127.0.0.1:9568"],
                                               "labels": {"node": "gpu-07", "mountpoint": "/mnt/data"}}]
    assert oct(t.path.stat().st_mode & 0o777) == "0o644" and not list(t.path.parent.glob(".*"))
    assert TargetFile(tmp_path / "targets", "/mnt/data", "gpu-07").path == t.path  # a restart replaces it
    # two daemons of one label on one host (two cache nodes of a dataset: serve:<dataset>) write two files
    a, b = (TargetFile(tmp_path / "targets", "serve:s3://b/ds", "host", f"/var/cache/epochfs/{n}") for n in "ab")
    assert a.path != b.path and a.path == TargetFile(tmp_path / "targets", "serve:s3://b/ds", "host",
                                                     "/var/cache/epochfs/a").path
    t.remove()
    assert not t.path.exists()
    TargetFile(tmp_path / "v6", "/mnt/v", "n").write("::1", 9567)
    assert json.loads(next((tmp_path / "v6").glob("*.json")).read_text())[0]["targets"] == ["[::1]:9567"]
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # another user could swap files in there: nothing is written, the mount goes on
    u = TargetFile(shared, "/mnt/data", "gpu-07")
    u.write("127.0.0.1", 9567)
    assert not u.written and not list(shared.iterdir()) and "another user could write there" in caplog.text
    u.remove()
