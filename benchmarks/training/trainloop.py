"""The training loop every contender of ``packed.py`` runs: a PyTorch DataLoader's batches, then a fixed
compute time per batch. Imports nothing of epochfs (the shard loaders run it in their own virtualenv)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


def keys_of(batch: Any) -> list[str]:
    """The sample keys of one collated batch (a list of keys, or a dict/tuple holding them first)."""
    if isinstance(batch, dict):
        batch = batch.get("key", batch.get("__key__"))
    elif isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], (list, tuple)):
        batch = batch[0]
    return [k.decode() if isinstance(k, bytes) else str(k) for k in batch]


def one_epoch(batches: Iterable[Any], compute: float) -> dict[str, Any]:
    """AU of one epoch: compute time over wall time from the end of the first batch (its start-up is
    excluded, as MLPerf Storage does), and which samples it saw."""
    seen: list[str] = []
    first_done = None
    steps = 0
    started = time.perf_counter()
    for batch in batches:
        seen += keys_of(batch)
        time.sleep(compute)
        steps += 1
        if first_done is None:
            first_done = time.perf_counter()
    end = time.perf_counter()
    wall = end - (first_done or end)
    au = min(1.0, (steps - 1) * compute / wall) if steps > 1 and wall > 0 else 1.0
    return {"au": au, "seconds": end - started, "samples": len(seen), "distinct": len(set(seen)),
            "steps": steps}
