"""The article's loop, in a cluster whose links can run out: network namespaces on one machine, each
node's link shaped in both directions, a real Prometheus with the shipped rules, and the training
simulation on every GPU node.

The box (``benchmarks/cluster/netbox.py``): an object store (SeaweedFS behind a proxy that adds latency, in
the ``store`` namespace) on a WAN link the whole cluster shares; a Redis store with a password
(``redis``); GPU nodes (``gpu0``...), each mounting the dataset and running its share of a
data-parallel training simulation (``benchmarks/cluster/nodetrain.py``, every byte checked); cache nodes
(``epochfs serve``, ``cache0``...); Prometheus (``mon``) scraping every daemon through the file_sd
targets they write, with the shipped rules (only their time constants scaled, see below). Every daemon
runs with its defaults for link capacities: what the 70% alarms compare with is what each knows of
its own link (its interface's shaping, or what its transfers measured). Nothing but the box's own
addresses is ever a target; every namespace, link, qdisc, mount and process is torn down at the end,
also when a step fails.

The loop, step by step (``--out FILE.json`` writes ``steps``):

- ``local-disk``: the dataset on the local disk: the reference AU;
- ``before``: plain mounts; the WAN saturates; the backend alarm fires; the doctor names the link;
- ``warm-cache-nodes``: two cache nodes warmed (``epochfs cluster warmup``), GPU nodes as clients;
- ``cache-node-lost``: a cache node killed mid-epoch: no wrong byte, the AU it costs;
- ``scaled-out``: the cache nodes' links narrowed until they are busy past 70% (EpochfsCacheNodesBusy),
  a third node joins with ``--rebalance``, the alarm clears; what moved is its share alone.

Each step reports the AU of its two epochs, the WAN's utilisation (from the store's own link counter),
the bytes the backend sent per dataset, the alerts Prometheus fired, the doctor's verdict and findings
on a GPU node after the first epoch, the wrong bytes, and what an epoch costs (``epochfs.doctor.cost``: GETs,
transfer and the GPU time spent waiting, at AWS list prices and $2.50 a GPU hour). ``epochfs plan
--cluster`` is run with the box's figures and its predictions are set beside what was measured.

Time: a real cluster's epochs take hours and its alerts look at 5-minute rates for 30 minutes; the
box's take seconds. The rules run unchanged but for their durations, all divided by ``--rule-scale``
(windows and ``for:``); the scale is written in the results. ``--rule-scale 1`` runs them as shipped
(steps then last minutes).

    sudo .venv/bin/python benchmarks/cluster/clusterbox.py --quick --out /tmp/box.json
    sudo .venv/bin/python benchmarks/cluster/clusterbox.py            # results kept in benchmarks/results/
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import xxhash
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (the tools every room shares)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from netbox import Host, NetBox  # noqa: E402
from workloads import drop_page_cache, host_cpu, log, save_results, start_run  # noqa: E402

from epochfs.dev.sample import SampleFile, upload  # noqa: E402
from epochfs.dev.servers import LocalRedis, LocalS3, free_ports  # noqa: E402
from epochfs.doctor.cost import Cost, Prices, Usage  # noqa: E402
from epochfs.links.sizing import Cluster, plan  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PROM = ROOT / "deploy" / "prometheus"
MiB = 1 << 20
PEER_PORT = 9570
METRICS_PORT = 9567
BUCKET, PREFIX, SOURCE = "bench", "ds/", "s3://bench/ds"
REAL_NODE_LINK = 100e9 / 8  # bytes/s: the article's 100 Gbit NIC, what a box node link stands for
STEADY = (0.1, 0.9)  # an epoch's steady part: from this fraction of its reads to that one
PROBE_EVERY = 1.0  # seconds between samples of the GPU nodes' side in the steady part


@dataclass(frozen=True)
class Scale:
    """The box's size. Rates in bytes/s."""

    wan: float = 14 * MiB
    node_link: float = 40 * MiB
    cache_link: float = 40 * MiB
    busy_cache_link: float = 18 * MiB  # scaled-out: two nodes past 70% of these, three under
    gpu_nodes: int = 4
    accelerators: int = 2
    cache_nodes: int = 2
    dataset_mib: int = 640
    file_kib: int = 512
    batch: int = 4
    gpu_demand: float = 4 * MiB  # per accelerator: sets the compute time per batch
    latency_ms: float = 20.0
    rule_scale: float = 20.0
    epochs: int = 2
    busy_epochs: int = 1  # scaled-out: epochs read through the busy cache nodes before the third joins

    @property
    def compute(self) -> float:
        return self.batch * self.file_kib * 1024 / self.gpu_demand

    @property
    def factor(self) -> float:
        """A box byte/s stands for this many of the real cluster's (its node link a 100 Gbit NIC)."""
        return REAL_NODE_LINK / self.node_link


QUICK = Scale()
FULL = Scale(dataset_mib=2560, rule_scale=6.0, busy_epochs=2)


def scaled_rules(text: str, scale: float, alert_for: float) -> str:
    """The shipped rules with every duration divided by ``scale``: the range of each selector and each
    alert's ``for:`` (at least ``alert_for`` seconds' worth: the box's epochs are short)."""
    def seconds(n: str, unit: str) -> float:
        return float(n) * {"s": 1, "m": 60, "h": 3600}[unit]

    text = re.sub(r"\[(\d+)([smh])\]", lambda m: f"[{max(2, round(seconds(m[1], m[2]) / scale))}s]", text)
    rules = yaml.safe_load(text)
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                m = re.fullmatch(r"(\d+)([smh])", str(rule["for"]))
                rule["for"] = f"{int(max(alert_for, seconds(m[1], m[2]) / scale / 10))}s" if m else rule["for"]
    return yaml.safe_dump(rules, sort_keys=False, width=1000)


class Box:
    """The cluster: its hosts, servers, daemons and Prometheus."""

    def __init__(self, work: Path, scale: Scale) -> None:
        self.work, self.scale = work, scale
        self.net = NetBox("efcb", work)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.gpus: list[Host] = []
        self.caches: list[Host] = []
        self.files: list[SampleFile] = []
        self.mounted: dict[int, Path] = {}
        self.serving: dict[int, str] = {}  # cache node index -> its cache dir

    # -- building it ------------------------------------------------------------------------------------

    def __enter__(self) -> Box:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        sc, w = self.scale, self.work
        self.net.__enter__()
        self.store = self.net.host("store", rate_in=sc.wan, rate_out=sc.wan)
        self.redis_host = self.net.host("redis")
        self.mon = self.net.host("mon")
        self.gpus = [self.net.host(f"gpu{i}", rate_in=sc.node_link, rate_out=sc.node_link)
                     for i in range(sc.gpu_nodes)]
        self.caches = [self.net.host(f"cache{i}", rate_in=sc.cache_link, rate_out=sc.cache_link)
                       for i in range(sc.cache_nodes + 1)]
        self.s3 = LocalS3(w / "s3").start()
        self.password = os.urandom(12).hex()
        self.redis = LocalRedis(w / "redis", password=self.password).start()
        (w / "secrets").mkdir(mode=0o700)
        self.password_file = w / "secrets" / "meta-password"
        self.token_file = w / "secrets" / "peer-token"
        for path, text in ((self.password_file, self.password), (self.token_file, os.urandom(16).hex())):
            path.write_text(text)
            path.chmod(0o600)
        # the object store behind the WAN (with its latency), and the store reachable in its namespace
        self.endpoint = f"http://{self.store.address}:9000"
        self.net.portal(f"{self.store.address}:9000", f"127.0.0.1:{self.s3.port}", listen_in=self.store,
                        delay_ms=sc.latency_ms, log=w / "portals.log")
        self.meta = f"redis://{LocalRedis.USER}@{self.redis_host.address}:6379/0"
        self.net.portal(f"{self.redis_host.address}:6379", f"127.0.0.1:{self.redis.port}", listen_in=self.redis_host,
                        log=w / "portals.log")
        self.env = {**self.s3.env(), "PYTHONUNBUFFERED": "1"}
        self.env.pop("AWS_CA_BUNDLE", None)
        self.targets = w / "targets"
        self.targets.mkdir()
        self._prometheus()
        self._dataset()

    def _prometheus(self) -> None:
        binary = shutil.which("prometheus")
        if not binary:
            raise RuntimeError("prometheus is missing: scripts/bootstrap.sh installs it (apt package prometheus)")
        sc = self.scale
        rules = self.work / "rules.yml"
        rules.write_text(scaled_rules((PROM / "epochfs-rules.yml").read_text(), sc.rule_scale, 3.0))
        config = (PROM / "prometheus.yml").read_text()
        config = (config.replace("/run/epochfs/prometheus/*.json", f"{self.targets}/*.json")
                  .replace("- epochfs-rules.yml", f"- {rules}")
                  .replace("scrape_interval: 15s", "scrape_interval: 1s")
                  .replace("evaluation_interval: 15s", "evaluation_interval: 1s"))
        (self.work / "prometheus.yml").write_text(config)
        self.mon.popen(binary, f"--config.file={self.work / 'prometheus.yml'}",
                       f"--storage.tsdb.path={self.work / 'tsdb'}", f"--web.listen-address={self.mon.address}:9090",
                       log=self.work / "prometheus.log")
        self.prom_port = free_ports(1)[0]
        self.net.portal(f"127.0.0.1:{self.prom_port}", f"{self.mon.address}:9090", upstream_in=self.mon,
                        log=self.work / "portals.log")
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError, ValueError):
                if self.prometheus("query", query="vector(1)") is not None:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus did not start; see {self.work / 'prometheus.log'}")
            time.sleep(0.5)

    def _dataset(self) -> None:
        sc = self.scale
        size = sc.file_kib * 1024
        self.files = [SampleFile(f"train/{i % 16:02d}/{i:05d}.jpg", size) for i in range(sc.dataset_mib * MiB // size)]
        self.dataset_bytes = sum(f.size for f in self.files)
        local = self.work / "local"
        lines = []
        for f in self.files:
            data = f.content()
            lines.append(f"{f.key} {xxhash.xxh3_64_hexdigest(data)}")
            path = local / f.key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        self.digests = self.work / "digests.txt"
        self.digests.write_text("\n".join(lines) + "\n")
        upload(self.s3.client(), BUCKET, PREFIX, self.files)
        # The snapshot in the shared store, listed once (as `epochfs import` on an operator's machine).
        subprocess.run([*self._epochfs(), "import", SOURCE, "--meta", self.redis.url, "--meta-password-file",
                        str(self.password_file), "--endpoint-url", self.s3.endpoint], env=self.env, check=True,
                       capture_output=True, timeout=120)

    # -- daemons ------------------------------------------------------------------------------------------

    @staticmethod
    def _epochfs() -> list[str]:
        return [sys.executable, "-m", "epochfs"]

    def _common(self, host: Host, cache: Path) -> list[str]:
        return ["--endpoint-url", self.endpoint, "--cache-dir", str(cache), "--node", host.name,
                "--metrics-addr", f"{host.address}:{METRICS_PORT}", "--metrics-targets", str(self.targets)]

    def _cache_size(self) -> str:
        """Every node's cache: the whole dataset and a quarter (a cache node alone may own all of it)."""
        return f"{max(1024, int(self.dataset_bytes * 1.25) >> 20)}M"

    def mount(self, i: int, *, client: bool, fresh: bool = True) -> Path:
        """GPU node ``i``'s mount: plain (its own snapshot, listed through the WAN) or a client of the
        cache nodes (the store's snapshot)."""
        host = self.gpus[i]
        self.unmount(i)
        mnt, cache = self.work / host.name / "mnt", self.work / host.name / ("client" if client else "plain")
        if fresh:
            shutil.rmtree(cache, ignore_errors=True)
        mnt.mkdir(parents=True, exist_ok=True)
        extra = (["--meta", self.meta, "--meta-password-file", str(self.password_file), "--peer-role", "client",
                  "--peer-token-file", str(self.token_file)] if client else [])
        r = subprocess.run(host.command(*self._epochfs(), "mount", SOURCE, str(mnt), *self._common(host, cache),
                                        "--cache-size", self._cache_size(), *extra), env=self.env, capture_output=True,
                                        text=True,
                           timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"mount on {host.name} failed: {r.stderr}")
        self.mounted[i] = mnt
        return mnt

    def unmount(self, i: int) -> None:
        mnt = self.mounted.pop(i, None)
        if mnt is not None and os.path.ismount(mnt):
            subprocess.run([*self._epochfs(), "umount", str(mnt)], capture_output=True, timeout=60)

    def serve(self, k: int, *extra: str, fresh: bool = True) -> None:
        host = self.caches[k]
        cache = self.work / host.name / "cache"
        if fresh:
            shutil.rmtree(cache, ignore_errors=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(host.command(*self._epochfs(), "serve", SOURCE, *self._common(host, cache), "--meta",
                                        self.meta, "--meta-password-file", str(self.password_file),
                                        "--peer-token-file", str(self.token_file),
                                        "--peer-listen", f"{host.address}:{PEER_PORT}", "--cache-size",
                                        self._cache_size(), *extra),
                           env=self.env, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"serve on {host.name} failed: {r.stderr}")
        self.serving[k] = str(cache)

    def stop_serving(self, k: int, sig: int = signal.SIGTERM) -> None:
        cache = self.serving.pop(k, None)
        if cache is None:
            return
        with contextlib.suppress(Exception):
            pid = self.status(Path(cache))["pid"]
            os.kill(pid, sig)
            deadline = time.monotonic() + 90
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)

    def status(self, where: Path) -> dict[str, Any]:
        from epochfs.control import request

        return request(where, "status")

    def wait_members(self, count: int) -> None:
        deadline = time.monotonic() + 60
        for i in self.mounted:
            while len(self.status(self.mounted[i])["peer"]["members"]) != count:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gpu{i} does not see {count} cache nodes")
                time.sleep(0.2)

    def wait_cache_nodes(self) -> None:
        """Until every cache node serving sees all of them (a warmup ranks the blocks over those it sees)."""
        deadline = time.monotonic() + 60
        for cache in self.serving.values():
            while len(self.status(Path(cache))["peer"]["members"]) != len(self.serving):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cache} does not see the {len(self.serving)} cache nodes")
                time.sleep(0.2)

    def warmup(self) -> float:
        self.wait_cache_nodes()
        started = time.monotonic()
        r = subprocess.run(self.gpus[0].command(*self._epochfs(), "cluster", "warmup", SOURCE, "--meta", self.meta,
                                                "--meta-password-file", str(self.password_file), "--peer-token-file",
                                                str(self.token_file), "--quiet"),
                           env=self.env, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"cluster warmup failed: {r.stderr}")
        return time.monotonic() - started

    # -- Prometheus ---------------------------------------------------------------------------------------

    def prometheus(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        return body.get("data") if body.get("status") == "success" else None

    def firing(self) -> set[str]:
        data = self.prometheus("alerts") or {}
        return {a["labels"]["alertname"] for a in data.get("alerts", []) if a.get("state") == "firing"}

    # -- running epochs -----------------------------------------------------------------------------------

    def run_epochs(self, roots: dict[int, Path], epochs: int, *, first: int = 0, hand_over: bool, watch: bool,
                   job: str, at_epoch: Any = None, between: Any = None) -> list[dict[str, Any]]:
        """``epochs`` epochs of the training simulation on the nodes of ``roots`` (node -> directory),
        each node's epochs beginning together with the page cache dropped; per epoch: AU (mean over the
        nodes), wrong files, seconds, and the WAN's bytes. ``at_epoch(epoch, progress)`` is called every
        0.2 s during an epoch (``progress``: the fraction read); ``between(epoch)`` after each epoch."""
        sync = self.work / f"sync-{job}-{first}"
        shutil.rmtree(sync, ignore_errors=True)
        sync.mkdir()
        sc = self.scale
        procs = {}
        for i, root in roots.items():
            cmd = [sys.executable, str(HERE / "nodetrain.py"), "--root", str(root), "--digests", str(self.digests),
                   "--node", str(i), "--nodes", str(sc.gpu_nodes), "--accelerators", str(sc.accelerators),
                   "--batch", str(sc.batch), "--compute", str(sc.compute), "--epochs", str(epochs),
                   "--first-epoch", str(first), "--job", job, "--sync", str(sync)]
            cmd += ["--hand-over"] * hand_over + ["--watch"] * watch
            procs[i] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(sync / f"progress-{i}", "w"),
                                        env=self.env, text=True)
            self.procs.append(procs[i])
        out = []
        for epoch in range(first, first + epochs):
            deadline = time.monotonic() + 300
            while not all((sync / f"ready-{epoch}-{i}").exists() for i in roots):
                if any(p.poll() is not None for p in procs.values()) or time.monotonic() > deadline:
                    raise RuntimeError(f"a trainer stopped before epoch {epoch}; see {sync}")
                time.sleep(0.05)
            drop_page_cache()
            serving = list(self.serving)  # (a cache node killed in the epoch: its link's counter still counts)
            usage0 = self.backend_usage()
            sent0 = self.store.sent_bytes()
            started = time.monotonic()
            (sync / f"go-{epoch}").touch()
            rows = {}
            steady: dict[float, Mark] = {}
            probes: list[dict[str, float]] = []  # the GPU nodes' side, sampled in the steady part
            probed = 0.0
            for i, p in procs.items():
                while True:  # (a line per epoch; progress goes to the progress file)
                    progress = self._progress(sync, roots, epoch)
                    for mark in STEADY:
                        if progress >= mark and mark not in steady:
                            steady[mark] = Mark(time.monotonic(), self.store.sent_bytes(), self._cache_sends(),
                                                progress, host_cpu(), tuple(h.sent_bytes() for h in self.caches))
                    if STEADY[0] in steady and STEADY[1] not in steady and time.monotonic() - probed >= PROBE_EVERY:
                        probed = time.monotonic()
                        probes += self._probe(roots)
                    if at_epoch is not None:
                        at_epoch(epoch, progress)
                    line = _readline(p, 0.2)
                    if line:
                        rows[i] = json.loads(line)
                        break
                    if p.poll() is not None:
                        raise RuntimeError(f"the trainer of gpu{i} ended in epoch {epoch}; see {sync}")
            seconds = time.monotonic() - started
            sent = self.store.sent_bytes() - sent0
            usage = self.usage_since(usage0)
            mid = None
            if len(steady) == len(STEADY):  # the epoch's middle, its start-up and its tail left out
                mid = _steady(steady[STEADY[0]], steady[STEADY[1]], sc, self.dataset_bytes,
                              sum(self.caches[k].rate_out or 0 for k in serving),
                              max((self.caches[k].rate_out or 0 for k in serving), default=None))
            if mid is not None and probes:
                mid["gpu_side"] = {k: statistics.median(pr[k] for pr in probes) for k in probes[0]}
            tier = self._tier_counts()
            out.append({"epoch": epoch, "au": sum(r["au"] for r in rows.values()) / len(rows), "tier": tier,
                        "usage": {"gets": usage.gets, "lists": usage.lists, "bytes": usage.bytes}, "steady": mid,
                        "au_by_node": {i: r["au"] for i, r in rows.items()},
                        "wrong_files": sum(r["wrong_files"] for r in rows.values()),
                        "files": sum(r["files"] for r in rows.values()), "seconds": seconds,
                        "wan_bytes": sent, "wan_utilisation": sent / (sc.wan * seconds),
                        "rank_seconds": {i: r["seconds"] for i, r in rows.items()}})
            log(f"  epoch {epoch}: AU {out[-1]['au']:.0%}, {seconds:.1f} s, WAN {out[-1]['wan_utilisation']:.0%} "
                f"busy, {out[-1]['wrong_files']} wrong files")
            if between is not None:
                between(epoch)
        for p in procs.values():
            p.wait(timeout=60)
        return out

    def _probe(self, roots: dict[int, Path]) -> list[dict[str, float]]:
        """Each GPU node's side of the tier now: the prefetcher's fetches in flight (and what Little's law
        wants), its lead in seconds of reading, and its gates to the cache nodes (requests in flight,
        their limits, fetches waiting for a handle), summed over the members."""
        out = []
        for i in roots:
            with contextlib.suppress(Exception):
                s = self.status(self.mounted[i])
                pf, gates = s["prefetch"], ((s.get("peer") or {}).get("gates") or {}).values()
                out.append({"inflight": pf["inflight"], "wanted_inflight": pf.get("wanted_inflight") or 0,
                            "lead_seconds": pf.get("lead_seconds") or 0.0, "lead_mib": pf["lead_bytes"] / MiB,
                            "gate_in_flight": sum(g["in_flight"] for g in gates),
                            "gate_limit": sum(g["limit"] for g in gates),
                            "gate_waiting": sum(g["waiting"] for g in gates)})
        return out

    def _tier_counts(self) -> dict[str, int]:
        """So far: the clients' asks that failed and went to another replica or the backend, and what the
        cache nodes up fetched from the backend."""
        out = {"to_replica": 0, "to_backend": 0, "cache_nodes_backend_bytes": 0}
        for mnt in self.mounted.values():
            with contextlib.suppress(Exception):
                went = self.status(mnt)["peer"]["fallbacks"] or {}
                out["to_replica"] += went.get("replica", 0)
                out["to_backend"] += went.get("backend", 0)
        for cache in self.serving.values():
            with contextlib.suppress(Exception):
                out["cache_nodes_backend_bytes"] += _backend_bytes(self.status(Path(cache)))
        return out

    def _cache_sends(self) -> int:
        return sum(h.sent_bytes() for h in self.caches)

    @staticmethod
    def _progress(sync: Path, roots: dict[int, Path], epoch: int) -> float:
        done = total = 0
        for i in roots:
            lines = (sync / f"progress-{i}").read_text().split("\n")
            last = next((ln.split() for ln in reversed(lines) if ln.startswith(f"progress {epoch} ")), None)
            if last:
                done, total = done + int(last[2]), total + int(last[3])
        return done / total if total else 0.0

    def doctor(self, i: int, job: str) -> dict[str, Any]:
        r = subprocess.run([*self._epochfs(), "doctor", str(self.mounted[i]), "--job", job, "--interval", "2",
                            "--json"], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return {"verdict": None, "findings": [], "error": r.stderr[-500:]}
        return json.loads(r.stdout)

    def backend_usage(self) -> dict[str, Usage]:
        """What the backend has been asked so far by each daemon up (GETs, LISTs, bytes)."""
        out = {}
        for where in [*self.mounted.values(), *map(Path, self.serving.values())]:
            with contextlib.suppress(Exception):
                u = self.status(where)["backend"]["usage"]
                out[str(where)] = Usage(float(u["gets"]), float(u["lists"]), float(u["bytes"]))
        return out

    def usage_since(self, before: dict[str, Usage]) -> Usage:
        """What the backend was asked since ``before`` by the daemons up now (one stopped meanwhile is
        not counted)."""
        now = self.backend_usage()
        total = Usage()
        for where, u in now.items():
            total = total + (u - before.get(where, Usage()))
        return total

    # -- tearing it down ----------------------------------------------------------------------------------

    def close(self) -> None:
        for i in list(self.mounted):
            with contextlib.suppress(Exception):
                self.unmount(i)
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        try:
            self.net.close()
        finally:
            for server in ("redis", "s3"):
                with contextlib.suppress(Exception):
                    getattr(self, server).stop()


def _readline(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """A line of ``proc``'s output if one comes within ``timeout`` seconds."""
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else None


# -- the steps -----------------------------------------------------------------------------------------

class Alerts:
    """The alerts seen firing while it watches (polled every second)."""

    def __init__(self, box: Box) -> None:
        self.box, self.seen, self._stop = box, set(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Alerts:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(OSError, ValueError):
            self.seen |= self.box.firing()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(OSError, ValueError):
                self.seen |= self.box.firing()


def settle_rates(box: Box) -> None:
    """Wait until the rules' rate windows no longer hold the last step's traffic."""
    time.sleep(300 / box.scale.rule_scale + 3)


def step_row(box: Box, name: str, epochs: list[dict[str, Any]], alerts: set[str], doctor: dict[str, Any] | None,
             **extra: Any) -> dict[str, Any]:
    sc = box.scale
    e1 = epochs[0]
    gpu_hours = sum((1 - au) * e1["rank_seconds"][i] for i, au in e1["au_by_node"].items()) * sc.accelerators / 3600
    cost = Cost(Usage(**e1["usage"]), gpu_hours, Prices(gpu_hour=2.5))
    seen = (doctor or {}).get("mount") or {}
    return {"name": name, "au_epoch1": e1["au"], "au_epoch2": epochs[1]["au"] if len(epochs) > 1 else None,
            "backend_link_utilisation": e1["wan_utilisation"],
            "backend_link_utilisation_epoch2": epochs[1]["wan_utilisation"] if len(epochs) > 1 else None,
            "backend_bytes_per_dataset": e1["wan_bytes"] / box.dataset_bytes,
            "backend_bytes_per_dataset_epoch2": epochs[1]["wan_bytes"] / box.dataset_bytes if len(epochs) > 1 else None,
            "alerts_firing": sorted(alerts),
            "doctor_verdict": doctor.get("verdict") if doctor else None,
            "doctor_findings": [f["cause"] for f in (doctor or {}).get("findings", [])],
            "doctor_fixes": [f["fix"] for f in (doctor or {}).get("findings", [])],
            "wrong_bytes": sum(e["wrong_files"] for e in epochs), "wrong_files": sum(e["wrong_files"] for e in epochs),
            "dollars_per_epoch": cost.as_dict()["total_usd"], "cost": cost.as_dict(),
            "backend_link_steady": (e1.get("steady") or {}).get("wan_utilisation"),
            "gpu0_backend_link": {"bytes_per_second": seen.get("backend_bandwidth_limit"),
                                  "source": seen.get("backend_link_source"), "detail": seen.get("backend_link")},
            "epochs": epochs, **extra}


def run_loop(box: Box) -> list[dict[str, Any]]:
    sc = box.scale
    gpus = range(sc.gpu_nodes)
    steps = []
    job = "box"

    def doctor_after_first(name: str, job: str) -> Any:
        """The doctor on gpu0 once the first epoch is over (its verdict is the first epoch's)."""
        def between(epoch: int) -> None:
            if epoch == 0:
                time.sleep(1.5)  # (the last reports land)
                holder[name] = box.doctor(0, job)
        return between

    holder: dict[str, Any] = {}

    def through_cache_nodes(job: str, epochs: int, members: int, **kw: Any) -> tuple[list[dict[str, Any]], set[str]]:
        """``epochs`` epochs of fresh client mounts (every block through the cache nodes), the alerts
        seen meanwhile; the doctor's answer after the first kept under ``job``."""
        roots = {i: box.mount(i, client=True) for i in gpus}
        box.wait_members(members)
        with Alerts(box) as alerts:
            out = box.run_epochs(roots, epochs, hand_over=True, watch=True, job=job,
                                 between=doctor_after_first(job, job), **kw)
        return out, alerts.seen

    log("local-disk")
    local = box.run_epochs({i: box.work / "local" for i in gpus}, sc.epochs, hand_over=False, watch=False,
                           job="local")
    steps.append(step_row(box, "local-disk", local, set(), None))

    log("before: plain mounts on the WAN")
    roots = {i: box.mount(i, client=False) for i in gpus}
    with Alerts(box) as alerts:
        before = box.run_epochs(roots, sc.epochs, hand_over=True, watch=True, job=job,
                                between=doctor_after_first("before", job))
    steps.append(step_row(box, "before", before, alerts.seen, holder.get("before")))
    for i in gpus:
        box.unmount(i)
    settle_rates(box)

    log("warm-cache-nodes: two cache nodes, cluster warmup, the GPU nodes their clients")
    for k in range(sc.cache_nodes):
        box.serve(k)
    sent0 = box.store.sent_bytes()
    with Alerts(box) as during_warmup:
        warmup_seconds = box.warmup()
    warmup_bytes = box.store.sent_bytes() - sent0
    settle_rates(box)
    warm, seen = through_cache_nodes("warm", sc.epochs, sc.cache_nodes)
    steps.append(step_row(box, "warm-cache-nodes", warm, seen, holder.get("warm"),
                          warmup_seconds=warmup_seconds, warmup_backend_bytes_per_dataset=warmup_bytes / box.dataset_bytes,
                          alerts_during_warmup=sorted(during_warmup.seen)))

    log("cache-node-lost: cache1 killed mid-epoch")
    killed: dict[str, float] = {}

    def kill_midway(epoch: int, progress: float) -> None:
        if not killed and progress >= 0.4:
            killed["at"] = progress
            box.stop_serving(1, signal.SIGKILL)
            log(f"  killed cache1 at {progress:.0%} of the epoch")

    lost, seen = through_cache_nodes("lost", 1, sc.cache_nodes, at_epoch=kill_midway)
    steps.append(step_row(box, "cache-node-lost", lost, seen, holder.get("lost"),
                          killed_at_progress=killed.get("at"), au_drop=warm[0]["au"] - lost[0]["au"]))
    for i in gpus:
        box.unmount(i)
    box.stop_serving(0)
    settle_rates(box)

    log("scaled-out: the cache nodes' links narrowed; a third joins with --rebalance")
    for k in range(sc.cache_nodes + 1):
        box.caches[k].shape(sc.cache_link, sc.busy_cache_link)
    for k in range(sc.cache_nodes):
        box.serve(k)
    box.warmup()
    settle_rates(box)
    busy, busy_alerts = through_cache_nodes("busy", sc.busy_epochs, sc.cache_nodes)
    held_before = {k: box.status(Path(box.serving[k]))["store"]["used_bytes"] for k in range(sc.cache_nodes)}
    backend_before = {k: _backend_bytes(box.status(Path(box.serving[k]))) for k in range(sc.cache_nodes)}
    new = sc.cache_nodes
    box.serve(new, "--rebalance")
    log_file = Path(box.serving[new]) / "epochfs.log"
    deadline = time.monotonic() + 600
    while "rebalance: done" not in log_file.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise RuntimeError("the third cache node did not finish its rebalance")
        time.sleep(0.5)
    joined = box.status(Path(box.serving[new]))
    filled = re.search(r"rebalance: filling (\d+) blocks", log_file.read_text(errors="replace"))
    moved = {"blocks_owned": int(filled[1]) if filled else None, "held_blocks": joined["store"]["blocks"],
             "held_bytes": joined["store"]["used_bytes"], "share_of_dataset": joined["store"]["used_bytes"] /
             box.dataset_bytes, "from_backend_bytes": _backend_bytes(joined),
             "from_other_nodes_bytes": joined["peer"]["bytes_in"],
             "others_backend_bytes_meanwhile": sum(_backend_bytes(box.status(Path(box.serving[k]))) - backend_before[k]
                                                   for k in range(sc.cache_nodes)),
             "others_held_before": held_before,
             "others_held_after": {k: box.status(Path(box.serving[k]))["store"]["used_bytes"]
                                   for k in range(sc.cache_nodes)}}
    settle_rates(box)
    scaled, after_alerts = through_cache_nodes("scaled", 1, sc.cache_nodes + 1)
    still = box.firing()  # (the busy epoch's windows long gone: what fires now is this epoch's)
    after = holder.get("scaled") or {}
    steps.append(step_row(box, "scaled-out", [busy[-1], scaled[0]], busy_alerts, holder.get("busy"),
                          doctor_after_join={"verdict": after.get("verdict"),
                                             "findings": [f["cause"] for f in after.get("findings", [])]},
                          alerts_after_join=sorted(after_alerts),
                          alerts_firing_at_end=sorted(still), joined=moved,
                          cache_link_utilisation_busy=_cache_util(busy[-1], sc, sc.cache_nodes), busy_epochs=busy,
                          cache_link_utilisation_scaled=_cache_util(scaled[0], sc, sc.cache_nodes + 1)))
    return steps


class Mark(NamedTuple):
    """What the box's counters say at one point of an epoch."""
    when: float
    wan: int  # bytes the object store sent
    cache: int  # bytes the cache nodes sent, all of them
    progress: float  # the share of the epoch's reads done
    cpu: tuple[int, int] = (0, 0)  # the host's busy and total CPU ticks (/proc/stat)
    by_node: tuple[int, ...] = ()  # bytes each cache node sent


def _steady(first: Mark, last: Mark, sc: Scale, dataset: int, capacity: float,
            link: float | None = None) -> dict[str, Any]:
    """An epoch's steady part: what the WAN and the cache nodes' links sent in it, and what the readers
    read. Over a long epoch the links send what the readers read; in the box's 20-second epoch the
    prefetch lead (blocks sent ahead of the readers) is a large share of the dataset and shrinks towards
    the epoch's end, so the links' sends in the window fall short of what the readers' pace asks of them.
    ``cache_link_carried`` is that pace over the links' capacity (the long-epoch figure the plan
    predicts), ``lead_shrunk_bytes`` the difference, and ``pace`` the readers' rate against the
    accelerators' demand. ``cache_link_by_node`` is each serving node's link (``link`` bytes/s: the
    plan assumes the blocks spread evenly) and ``host_cpu`` the share of the host's cores busy (every
    node of the box runs on them: a step at 1.0 is bound by the box, not by its links)."""
    seconds = last.when - first.when
    read = (last.progress - first.progress) * dataset
    busy, total = (b - a for a, b in zip(first.cpu, last.cpu, strict=True))
    sent = [b - a for a, b in zip(first.by_node, last.by_node, strict=True)]
    return {"seconds": seconds, "wan_utilisation": (last.wan - first.wan) / (sc.wan * seconds),
            "cache_link_utilisation": (last.cache - first.cache) / (capacity * seconds) if capacity else None,
            "cache_link_carried": read / (capacity * seconds) if capacity else None,
            "lead_shrunk_bytes": read - (last.cache - first.cache) if capacity else None,
            "cache_link_by_node": [b / (link * seconds) for b in sent if b > 0] if link else None,
            "host_cpu": busy / total if total else None,
            "pace": min(1.0, read / seconds / (sc.gpu_demand * sc.accelerators * sc.gpu_nodes))}


def _backend_bytes(status: dict[str, Any]) -> int:
    c = status["cache"]
    return int(c["demand_bytes"] + c["prefetch_bytes"])


def _cache_util(epoch: dict[str, Any], sc: Scale, nodes: int) -> float | None:
    """The cache nodes' links' utilisation in the steady part of an epoch (their sends' counters)."""
    return (epoch.get("steady") or {}).get("cache_link_utilisation")


def _carried(step: dict[str, Any], epoch: int) -> dict[str, Any]:
    """The steady part of one of a step's epochs (see ``_steady``)."""
    return step["epochs"][epoch].get("steady") or {}


# -- the plan beside it ------------------------------------------------------------------------------

def predictions(sc: Scale, dataset: float) -> dict[str, Any]:
    """``epochfs plan --cluster`` with the box's figures scaled to the real cluster (its node links
    100 Gbit): utilisations and AU are ratios, so a scaled box and a real cluster predict alike."""
    f = sc.factor
    base = Cluster(nodes=sc.gpu_nodes, gpus_per_node=sc.accelerators, gpu_demand=sc.gpu_demand * f, dataset=dataset * f,
                   wan=sc.wan * f, node_link=sc.node_link * f, cache_node_link=sc.cache_link * f,
                   cache_nodes=sc.cache_nodes)
    busy = replace(base, cache_node_link=sc.busy_cache_link * f)
    return {"inputs_real": asdict(base), "plain": plan(base)["setups"]["plain"],
            "warm": plan(base)["setups"]["warm-cache-nodes"],
            "busy": plan(busy)["setups"]["warm-cache-nodes"],
            "scaled": plan(replace(busy, cache_nodes=sc.cache_nodes + 1))["setups"]["warm-cache-nodes"],
            "cache_nodes_needed_busy": plan(busy)["cache_nodes_needed"]}


def compare(steps: list[dict[str, Any]], pred: dict[str, Any], sc: Scale) -> list[dict[str, Any]]:
    """The plan's figures beside the box's. The plan predicts a long epoch; the box's epoch 1 AU leaves
    its start-up out (as MLPerf Storage does) while the order's prefetch already fills the cache, so in
    a WAN-bound step the AU a long epoch sustains (the WAN's sends over the demand) stands beside it."""
    by = {s["name"]: s for s in steps}
    rows = []

    def row(what: str, predicted: float | None, measured: float | None) -> None:
        rows.append({"what": what, "predicted": predicted, "measured": measured,
                     "error": None if predicted is None or measured is None else measured - predicted})

    row("before: WAN utilisation, epoch 1 (steady part)", pred["plain"]["epoch1"]["wan_utilisation"],
        by["before"]["backend_link_steady"])
    row("before: AU, epoch 1", pred["plain"]["epoch1"]["au"], by["before"]["au_epoch1"])
    wan = _carried(by["before"], 0).get("wan_utilisation")
    demand = sc.gpu_demand * sc.accelerators * sc.gpu_nodes
    row("before: AU the WAN's steady sends sustain, epoch 1", pred["plain"]["epoch1"]["au"],
        None if wan is None else min(1.0, wan * sc.wan / demand))
    row("before: WAN bytes per dataset, epoch 2", pred["plain"]["epoch2"]["backend_bytes_per_dataset"],
        by["before"]["backend_bytes_per_dataset_epoch2"])
    row("warm: WAN utilisation, epoch 1 (steady part)", pred["warm"]["epoch1"]["wan_utilisation"],
        by["warm-cache-nodes"]["backend_link_steady"])
    row("warm: AU, epoch 1", pred["warm"]["epoch1"]["au"], by["warm-cache-nodes"]["au_epoch1"])
    for n in (1, 2):  # (a later epoch finds each node's own share in its cache: the links carry the rest)
        if len(by["warm-cache-nodes"]["epochs"]) >= n:
            row(f"warm: cache links, epoch {n} (steady part)", pred["warm"][f"epoch{n}"]["cache_node_link_utilisation"],
                _carried(by["warm-cache-nodes"], n - 1).get("cache_link_utilisation"))
    busy, scaled = _carried(by["scaled-out"], 0), _carried(by["scaled-out"], 1)
    last = min(2, len(by["scaled-out"].get("busy_epochs") or [None]))  # (the busy epoch measured: the last)
    row(f"scaled-out: cache links, two nodes (sent, epoch {last})",
        pred["busy"][f"epoch{last}"]["cache_node_link_utilisation"], by["scaled-out"]["cache_link_utilisation_busy"])
    row("scaled-out: cache links, two nodes (the readers' pace)", pred["busy"]["epoch1"]["cache_node_link_utilisation"],
        busy.get("cache_link_carried"))
    row("scaled-out: cache links, three nodes (sent)", pred["scaled"]["epoch1"]["cache_node_link_utilisation"],
        by["scaled-out"]["cache_link_utilisation_scaled"])
    row("scaled-out: cache links, three nodes (the readers' pace)",
        pred["scaled"]["epoch1"]["cache_node_link_utilisation"], scaled.get("cache_link_carried"))
    row("scaled-out: AU, two busy nodes", pred["busy"]["epoch1"]["au"], by["scaled-out"]["au_epoch1"])
    row("scaled-out: the readers' pace in the steady part, two busy nodes", pred["busy"]["epoch1"]["au"],
        busy.get("pace"))
    return rows


def report(out: dict[str, Any]) -> str:
    sc = out["scale"]
    lines = [f"# The article's loop in a cluster box, {out['date']}", "",
             f"{sc['gpu_nodes']} GPU nodes x {sc['accelerators']} simulated accelerators, each asking "
             f"{sc['gpu_demand'] / MiB:g} MiB/s; a dataset of {out['dataset_bytes'] / MiB:.0f} MiB in "
             f"{sc['file_kib']} KiB files; the object store's WAN {sc['wan'] / MiB:g} MiB/s shared with "
             f"{sc['latency_ms']:g} ms added, GPU node links {sc['node_link'] / MiB:g} MiB/s, cache node links "
             f"{sc['cache_link'] / MiB:g} MiB/s (scaled-out: {sc['busy_cache_link'] / MiB:g}); every link shaped in "
             "both directions (tbf, ingress through ifb) in network namespaces on one 2-core machine.", "",
             f"Scale: a box node link stands for a 100 Gbit NIC, so a box byte/s is {out['factor']:.0f} of the "
             f"real cluster's: the WAN is {sc['wan'] * out['factor'] * 8 / 1e9:.0f} Gbit/s, each accelerator asks "
             f"{sc['gpu_demand'] * out['factor'] / (1 << 30):.2f} GiB/s (MLPerf Storage: ResNet-50 0.19, 3D U-Net "
             "2.8 GiB/s per H100), the dataset "
             f"{out['dataset_bytes'] * out['factor'] / (1 << 40):.1f} TiB. The rules' durations are divided by "
             f"{sc['rule_scale']:g} (windows and for:).", "",
             "| step | AU epoch 1 | AU epoch 2 | WAN busy | WAN bytes / dataset | alerts | doctor | wrong bytes | $ / epoch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in out["steps"]:
        au2 = f"{s['au_epoch2']:.0%}" if s["au_epoch2"] is not None else "-"
        lines.append(f"| {s['name']} | {s['au_epoch1']:.0%} | {au2} | {s['backend_link_utilisation']:.0%} | "
                     f"{s['backend_bytes_per_dataset']:.2f} | {', '.join(s['alerts_firing']) or '-'} | "
                     f"{s['doctor_verdict'] or '-'}: {', '.join(s['doctor_findings']) or '-'} | {s['wrong_bytes']} | "
                     f"{s['dollars_per_epoch']:.4f} |")
    by = {s["name"]: s for s in out["steps"]}
    w, lost, sc_ = by["warm-cache-nodes"], by["cache-node-lost"], by["scaled-out"]
    lines += ["", f"- warm-cache-nodes: first-epoch AU {w['au_epoch1'] / by['local-disk']['au_epoch1']:.2f}x local "
              f"disk's; the warmup took {w['warmup_seconds']:.0f} s and moved {w['warmup_backend_bytes_per_dataset']:.2f} "
              f"datasets over the WAN (alerts meanwhile: {', '.join(w['alerts_during_warmup']) or 'none'}).",
              f"- cache-node-lost: killed at {lost['killed_at_progress']:.0%} of the epoch; its AU {lost['au_epoch1']:.0%} "
              f"against the warm epoch's {w['au_epoch1']:.0%}; {lost['wrong_bytes']} wrong bytes.",
              f"- scaled-out: two cache nodes' links {sc_['cache_link_utilisation_busy']:.0%} busy "
              f"(the readers' pace asked {_carried(sc_, 0).get('cache_link_carried') or 0:.0%} of them: over the "
              f"steady part the prefetch lead shrank by {(_carried(sc_, 0).get('lead_shrunk_bytes') or 0) / MiB:.0f} "
              "MiB) "
              f"(alerts: {', '.join(sc_['alerts_firing']) or 'none'}); the third took "
              f"{sc_['joined']['held_bytes'] / MiB:.0f} MiB ({sc_['joined']['share_of_dataset']:.0%} of the dataset; "
              f"{sc_['joined']['held_blocks']} blocks held of the {sc_['joined']['blocks_owned']} it owns), "
              f"{sc_['joined']['from_backend_bytes'] / MiB:.1f} MiB of it from the backend; then "
              f"{sc_['cache_link_utilisation_scaled']:.0%} busy, alerts at the end: "
              f"{', '.join(sc_['alerts_firing_at_end']) or 'none'}.", "",
              "`epochfs plan --cluster` with the box's figures scaled to the real cluster, against the box:", "",
              "| figure | predicted | measured | error |", "|---|---|---|---|"]
    fmt = (lambda v: "-" if v is None else f"{v:.2f}")  # noqa: E731
    for r in out["plan_vs_box"]:
        lines.append(f"| {r['what']} | {fmt(r['predicted'])} | {fmt(r['measured'])} | {fmt(r['error'])} |")
    lines += ["", "Each step's epochs in their steady part (the host's CPU is every node's: at 1.00 the box, not "
              "its links, binds):", "", "| step | epoch | WAN | cache node links | host CPU | readers' pace |",
              "|---|---|---|---|---|---|"]
    for s in out["steps"]:
        for n, e in enumerate(s.get("epochs") or [], 1):
            mid = e.get("steady") or {}
            if mid:
                links = " / ".join(f"{u:.2f}" for u in mid.get("cache_link_by_node") or []) or "-"
                lines.append(f"| {s['name']} | {n} | {fmt(mid['wan_utilisation'])} | {links} | "
                             f"{fmt(mid.get('host_cpu'))} | {fmt(mid['pace'])} |")
    lines += ["", "The GPU nodes' side in the steady part (medians of a sample a second of each node): the "
              "prefetcher's fetches in flight and what Little's law wants of it, its lead, and its gates to the "
              "cache nodes (requests in flight, their limits and fetches waiting, over the members):", "",
              "| step | epoch | fetches in flight | wanted | lead s | lead MiB | gates in flight / limit | waiting |",
              "|---|---|---|---|---|---|---|---|"]
    for s in out["steps"]:
        for n, e in enumerate(s.get("epochs") or [], 1):
            g = (e.get("steady") or {}).get("gpu_side")
            if g:
                lines.append(f"| {s['name']} | {n} | {g['inflight']:.0f} | {g['wanted_inflight']:.0f} | "
                             f"{g['lead_seconds']:.1f} | {g['lead_mib']:.0f} | {g['gate_in_flight']:.0f} / "
                             f"{g['gate_limit']:.0f} | {g['gate_waiting']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the small box (minutes); results not kept unless --out")
    ap.add_argument("--out", type=Path, help="write the results here (JSON; a .md beside it)")
    ap.add_argument("--rule-scale", type=float, help="divide the rules' durations by this (default: by size)")
    ap.add_argument("--work", type=Path, default=HERE.parent / "work" / "clusterbox")
    args = ap.parse_args()
    if not start_run(args.work):
        return 2
    sc = QUICK if args.quick else FULL
    if args.rule_scale:
        sc = replace(sc, rule_scale=args.rule_scale)
    date = datetime.date.today().isoformat()
    out: dict[str, Any] = {"date": date, "scale": {**asdict(sc), "compute": sc.compute}, "factor": sc.factor}
    with Box(args.work, sc) as box:
        out["dataset_bytes"] = box.dataset_bytes
        out["steps"] = run_loop(box)
    out["plan"] = predictions(sc, out["dataset_bytes"])
    out["plan_vs_box"] = compare(out["steps"], out["plan"], sc)
    text = report(out)
    print(text)
    target = args.out or (None if args.quick else HERE / "results" / f"{date}-clusterbox.json")
    if target is not None:
        save_results(target, out, text)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "efcb" not in left, left
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
