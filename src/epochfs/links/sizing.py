"""A cluster sized on paper (``epochfs plan --cluster``): what its links carry when its GPUs read a
dataset, before any of it is bought.

The model is the article's and MLPerf Storage's: every GPU asks for ``gpu_demand`` bytes a second while
it trains (3D U-Net about 2.8 GiB/s per H100, ResNet-50 about 0.19), data-parallel: each epoch the
cluster reads the dataset once, each node its share, in a fresh order. Three links can run out: the
object store's (the WAN, shared by the whole cluster), each GPU node's own, and the cache nodes'. A
link that carries demand ``D`` with capacity ``C`` is ``D / C`` busy (at most all of it); the GPUs'
accelerator utilisation (AU) is at most the narrowest link's capacity over the demand it carries (one
when every link keeps up), taking prefetch to hide latency, as it does with the epoch's order handed
over. Three set-ups are compared, epoch by epoch:

- ``plain``: every node reads from the object store through its own cache. The first epoch crosses
  the WAN whole; a later one finds in each node's cache only what that node read before (a fresh
  shuffle gives it another share), so most of it crosses the WAN again: ``1 - 1/N`` of the dataset
  in the second epoch for N nodes (their caches holding what they read).
- ``cold-cache-nodes``: K cache nodes, not warmed: the first epoch reads through them while they fetch
  from the object store (the WAN and their links both carry it); later epochs come from them, but for
  the share each node finds in its own cache.
- ``warm-cache-nodes``: K cache nodes warmed before the job (``epochfs cluster warmup``, which moves
  the dataset over the WAN once, at the WAN's speed): every epoch comes from them, a later one but for
  each node's own share; the WAN is idle.

In every set-up a node keeps what it read (``--peer-cache all``), so a later epoch, in a fresh order,
finds ``1/N`` of its reads in the node's own cache: neither its link nor the cache nodes' carry those
(the cluster box's warm step: its cache nodes' links 0.40 busy in the first epoch and 0.28-0.31 in the
second, against 0.40 and 0.30 here).

It says how many cache nodes keep their links under the 70% line, sized against whichever binds first
of the GPUs' demand and the GPU nodes' own links (a GPU node whose link carries less than its GPUs ask
takes in no more, however many cache nodes send), and says which; and the first epoch's AU of each
set-up. Every figure is a plain function of the inputs (tested against ``benchmarks/cluster/clusterbox.py``'s
measured steps, scaled).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GiB = 1 << 30
#: MLPerf Storage's demand per emulated H100, bytes/s (its v1/v2 workloads).
WORKLOADS = {"unet3d": 2.8 * GiB, "resnet50": 0.19 * GiB, "cosmoflow": 0.55 * GiB}
BUSY = 0.7  # the alerts' line


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_demand: float  # bytes/s per GPU while it trains
    dataset: float  # bytes
    wan: float  # bytes/s: the object store's link, shared by the cluster
    node_link: float  # bytes/s: each GPU node's
    cache_node_link: float  # bytes/s: each cache node's
    cache_nodes: int | None = None  # None: as many as keep their links under the line
    replicas: int = 1
    cache_node_cache: float | None = None  # bytes each cache node holds (None: not a bound)

    def problems(self) -> list[str]:
        """What is wrong with the inputs, in words (empty: it can be planned)."""
        out = []
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("gpu_demand", "dataset", "wan", "node_link", "cache_node_link"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                out.append(f"--{name.replace('_', '-')} must be above 0")
        if self.cache_nodes is not None and self.cache_nodes < 1:
            out.append("--cache-nodes must be at least 1")
        if self.replicas < 1:
            out.append("--replicas must be at least 1")
        return out

    @property
    def demand(self) -> float:
        """What the cluster's GPUs ask for, bytes/s."""
        return self.nodes * self.gpus_per_node * self.gpu_demand

    @property
    def node_demand(self) -> float:
        return self.gpus_per_node * self.gpu_demand


@dataclass(frozen=True)
class Epoch:
    """One epoch of one set-up: each link's utilisation, the bytes the WAN carries (in datasets), AU."""

    wan_utilisation: float
    node_link_utilisation: float
    cache_node_link_utilisation: float | None
    backend_bytes_per_dataset: float
    au: float
    bound: str  # the link that bounds it ("none" when every link keeps up)


@dataclass(frozen=True)
class Setup:
    name: str
    cache_nodes: int
    epoch1: Epoch
    epoch2: Epoch
    warmup_seconds: float | None = None  # warm-cache-nodes: filling them over the WAN first


def carried(c: Cluster) -> float:
    """What the cluster's GPU nodes can take in, bytes/s: their GPUs' demand, or all their links carry
    where those bind first (a cache node past that sends nothing more)."""
    return min(c.demand, c.nodes * c.node_link)


def binds_first(c: Cluster) -> str:
    """Which of the GPUs' demand and the GPU nodes' own links bounds what the cache nodes must send."""
    return "the GPU nodes' links" if carried(c) < c.demand else "the GPUs' demand"


def cache_nodes_needed(c: Cluster, busy: float = BUSY) -> int:
    """Cache nodes whose links together carry what the GPU nodes take in (their demand, or their own
    links where those bind first: :func:`carried`) at no more than ``busy`` of them, and whose caches
    hold the dataset ``replicas`` times."""
    by_link = math.ceil(carried(c) / (busy * c.cache_node_link))
    by_space = math.ceil(c.dataset * c.replicas / c.cache_node_cache) if c.cache_node_cache else 1
    return max(1, by_link, by_space, c.replicas)


def _epoch(c: Cluster, *, wan_bytes: float, through_cache_nodes: int | None, local: float = 0.0) -> Epoch:
    """An epoch in which the WAN carries ``wan_bytes`` datasets' worth of the cluster's reads (their
    demand in proportion), ``local`` of them are found in each node's own cache and, with
    ``through_cache_nodes`` K, the rest comes through K cache nodes."""
    remote = 1.0 - local
    loads = {"the object store's link": (c.demand * wan_bytes, c.wan),
             "the GPU nodes' links": (c.node_demand * remote, c.node_link)}
    if through_cache_nodes:
        loads["the cache nodes' links"] = (c.demand * remote, through_cache_nodes * c.cache_node_link)
    ratios = {name: load / capacity for name, (load, capacity) in loads.items() if load > 0}
    bound, worst = max(ratios.items(), key=lambda kv: kv[1]) if ratios else ("none", 0.0)
    au = min(1.0, 1.0 / worst) if worst > 0 else 1.0
    # A link slowed by another carries its demand at the pace the bound allows.
    def busy(name: str) -> float:
        load, capacity = loads[name]
        return min(1.0, load * au / capacity)

    return Epoch(wan_utilisation=busy("the object store's link"), node_link_utilisation=busy("the GPU nodes' links"),
                 cache_node_link_utilisation=busy("the cache nodes' links") if through_cache_nodes else None,
                 backend_bytes_per_dataset=wan_bytes, au=au, bound=bound if worst > 1 else "none")


def plan(c: Cluster) -> dict[str, object]:
    """Each set-up's epochs, the cache nodes needed, and the inputs."""
    k = c.cache_nodes or cache_nodes_needed(c)
    own = 1.0 / c.nodes  # (each node's cache holds the share it read before: a later epoch finds it there)
    setups = [
        Setup("plain", 0, _epoch(c, wan_bytes=1.0, through_cache_nodes=None),
              _epoch(c, wan_bytes=1.0 - own, through_cache_nodes=None, local=own)),
        Setup("cold-cache-nodes", k, _epoch(c, wan_bytes=1.0, through_cache_nodes=k),
              _epoch(c, wan_bytes=0.0, through_cache_nodes=k, local=own)),
        Setup("warm-cache-nodes", k, _epoch(c, wan_bytes=0.0, through_cache_nodes=k),
              _epoch(c, wan_bytes=0.0, through_cache_nodes=k, local=own), warmup_seconds=c.dataset / c.wan),
    ]
    return {"inputs": {**asdict(c), "demand": c.demand, "node_demand": c.node_demand},
            "cache_nodes_needed": cache_nodes_needed(c), "cache_nodes": k,
            "sized_for": {"bytes_per_second": carried(c), "bound": binds_first(c)},
            "setups": {s.name: {"cache_nodes": s.cache_nodes, "epoch1": asdict(s.epoch1), "epoch2": asdict(s.epoch2),
                                "warmup_seconds": s.warmup_seconds} for s in setups}}
