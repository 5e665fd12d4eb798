"""The cache tier where it is needed: links full. A small cluster in a box (``benchmarks/cluster/clusterbox.py``'s
machinery: network namespaces, shaped links, a real object store behind a shared WAN, Redis, one cache
node): the cache node is warmed with ``epochfs cluster warmup``, then two GPU nodes, clients of it with
the default prefetch concurrency, read an epoch with their order handed over, the cache node's link
saturated. Every block comes from the tier: nothing from the backend, no peer bypassed, no wrong byte."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from .conftest import requires_fuse
from .helpers import namespaces_work

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCH / "cluster"), str(BENCH / "shared")]
from clusterbox import Box, Scale  # noqa: E402

MiB = 1 << 20


@requires_fuse
@pytest.mark.mounts
@pytest.mark.page_cache  # (each epoch of the box begins with the page cache dropped, and it keeps two cores busy)
@pytest.mark.skipif(not namespaces_work(), reason="network namespaces cannot be made here (needs root and ip)")
def test_a_warm_cache_node_serves_every_block_with_its_link_full(tmp_path):
    # The cache node's link is the narrowest: both GPU nodes, each with its prefetcher's default fetches
    # in flight, ask it for more than it sends, for the whole epoch.
    sc = Scale(gpu_nodes=4, cache_nodes=1, dataset_mib=128, wan=14 * MiB, node_link=40 * MiB, cache_link=12 * MiB,
               gpu_demand=16 * MiB, epochs=1, latency_ms=20.0)
    with Box(tmp_path, sc) as box:
        box.serve(0)
        box.warmup()
        roots = {i: box.mount(i, client=True) for i in range(sc.gpu_nodes)}
        box.wait_members(1)
        usage0, sent0 = box.backend_usage(), box.caches[0].sent_bytes()
        (row,) = box.run_epochs(roots, 1, hand_over=True, watch=False, job="saturated")
        usage = box.usage_since(usage0)
        busy = (box.caches[0].sent_bytes() - sent0) / (sc.cache_link * row["seconds"])
        logs = {i: (tmp_path / f"gpu{i}" / "client" / "epochfs.log").read_text(errors="replace") for i in roots}
        cache_log = (Path(box.serving[0]) / "epochfs.log").read_text(errors="replace")
        tier = [box.status(root)["peer"] for root in roots.values()]
    assert row["wrong_files"] == 0 and row["files"] == len(box.files)
    bypassed = {i: re.findall(r"peer \S+ bypassed.*", text)[:3] for i, text in logs.items()}
    assert not any(bypassed.values()), (bypassed, cache_log[-3000:])
    assert row["tier"]["to_backend"] == 0 and row["tier"]["to_replica"] == 0, row["tier"]
    assert usage.bytes == 0, usage  # nothing from the backend: the tier held the whole epoch
    assert busy > 0.7, (busy, row)  # the cache node's link ran full: the epoch is bound by it
    for peer in tier:
        assert peer["requests"]["unavailable"] == 0 and peer["requests"]["bad"] == 0, peer["requests"]
