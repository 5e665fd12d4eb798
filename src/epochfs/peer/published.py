"""What a member publishes of itself in the shared store at each heartbeat (its role, what it holds and
has served, its link's load), taken figure by figure. The store is written by anyone who holds its
password (or by anyone, where it has none): nothing is taken but the figures below, each only of its
type and range, so a planted value shows as unknown and never fails a reader. What is published is
advice for people and the doctor (``epochfs cluster status``, a client's view of the cache nodes'
load), never what decides who serves a block: that is proven with the token (:mod:`.members`).
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_PUBLISHED = 64 << 10  # bytes of one member's statistics decoded at most

#: Whole counts, each an integer in [0, 2**63).
COUNTS = ("held_bytes", "capacity_bytes", "cache_size", "served_bytes", "replicas", "block_size", "snapshot",
          "tier_bytes", "backend_bytes", "local_bytes")
#: Rates and times, each a finite number >= 0.
RATES = ("out_bytes_per_second", "link_capacity", "utilization", "updated")
LINK_SOURCES = ("declared", "interface", "measured")


def published_stats(raw: object) -> dict[str, Any] | None:
    """A member's published statistics (JSON), each figure of its type or None; None if they do not
    decode to an object."""
    try:
        published = json.loads(raw) if isinstance(raw, (bytes, str)) and len(raw) <= MAX_PUBLISHED else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(published, dict):
        return None
    out: dict[str, Any] = {}
    for k in COUNTS:
        v = published.get(k)
        out[k] = v if type(v) is int and 0 <= v < 1 << 63 else None
    for k in RATES:
        v = published.get(k)
        ok = type(v) is int and 0 <= v < 1 << 63 or type(v) is float and math.isfinite(v) and v >= 0
        out[k] = float(v) if ok else None  # type: ignore[arg-type]
    node, mode, down = published.get("node"), published.get("mode"), published.get("down")
    out["node"] = node if isinstance(node, str) and len(node) <= 255 and node.isprintable() else None
    mnt = published.get("mountpoint")
    out["mountpoint"] = mnt if isinstance(mnt, str) and len(mnt) <= 4096 and mnt.isprintable() else None
    out["mode"] = mode if mode in ("all", "owned") else None
    out["link_source"] = published.get("link_source") if published.get("link_source") in LINK_SOURCES else None
    out["down"] = ([d for d in down[:1000] if isinstance(d, str) and len(d) <= 64 and d.isprintable()]
                   if isinstance(down, list) else None)
    return out
