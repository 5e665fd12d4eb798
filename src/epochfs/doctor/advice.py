"""The fixes the doctor advises, as commands and flags to paste: sizes as the options take them, and
the commands of the cluster tier with every option the mount has (its store, the password and token
files, the block size, the replicas). Pure."""

from __future__ import annotations

import math
import shlex
from typing import Any

from epochfs.core.text import human
from epochfs.doctor.views import HEADROOM, number


def size_flag(nbytes: float, *, down: bool = False) -> str:
    """A size as ``--cache-size`` takes it, rounded up (``down``: rounded down) to two figures at most:
    ``320G``, ``1.5T``, ``150M`` (a size under 1 GiB in MiB: 150 MiB is not ``1G``)."""
    gib = nbytes / (1 << 30)
    rounding = math.floor if down else math.ceil
    if gib >= 1024:
        return f"{rounding(gib / 1024 * 10) / 10:g}T"
    if gib < 1:
        return f"{max(1, rounding(nbytes / (1 << 20)))}M"
    return f"{max(1, rounding(gib))}G"


def share_fix(share: float, capacity: float, cache_size: float | None = None, tier_cache: float | None = None,
              needed: float | None = None) -> str:
    """What makes a cluster tier member's ``share`` fit its cache (``capacity``: what it holds now).

    Where the members are weighted by their caches (``tier_cache``: the ``--cache-size`` of the ring's
    members together; ``cache_size``: this member's), a share follows its member's ``--cache-size``:
    raising one moves more blocks to it, so what fits is the tier's caches together against ``needed``
    (the dataset times its replicas), or a member whose disk holds less than its ``--cache-size`` told
    what it holds (it is weighed by what it says). Unweighted, this member's cache alone."""
    if tier_cache is None or cache_size is None or needed is None:
        return f"give it `--cache-size {size_flag(share * HEADROOM)}` (its share and a tenth), or add members"
    if capacity < cache_size:
        return (f"its disk holds less than its --cache-size, which is what the members weigh it by: give it "
                f"`--cache-size {size_flag(capacity, down=True)}` (what it holds) or free its disk")
    factor = max(HEADROOM, needed * HEADROOM / tier_cache) if tier_cache > 0 else HEADROOM
    return (f"each member's share follows its --cache-size, and the members' caches hold {human(tier_cache)} "
            f"together for {human(needed)} of blocks: raise every member's by {factor:.2g}x (this one's: "
            f"`--cache-size {size_flag(cache_size * factor)}`), or add members with "
            f"{human(max(needed * HEADROOM - tier_cache, share * HEADROOM))} of cache")


PEER_PORT = 9570  # the cache nodes' port where none is known (the documentation's)


def size_arg(nbytes: Any) -> str:
    """A size as the options take it, exactly: ``4M``, ``1G``, ``65536``."""
    n = int(nbytes)
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def store_flags(m: dict[str, Any]) -> str | None:
    """The options that reach the mount's shared store, as it was mounted with them (None: not known)."""
    o = m.get("options") or {}
    if not isinstance(o.get("meta"), str) or not o["meta"]:
        return None
    parts = ["--meta", o["meta"]]
    for key, flag in (("meta_name", "--meta-name"), ("meta_password_file", "--meta-password-file"),
                      ("meta_ca_file", "--meta-ca-file")):
        if isinstance(o.get(key), str) and o[key]:
            parts += [flag, o[key]]
    return " ".join(shlex.quote(p) for p in parts)


def _tier_flags(m: dict[str, Any]) -> str:
    o = m.get("options") or {}
    token = o.get("peer_token_file")
    flags = [store_flags(m) or "--meta URL", "--peer-token-file " + (shlex.quote(token) if isinstance(token, str)
                                                                    else "FILE")]
    if number(o.get("block_size")):
        flags.append(f"--block-size {size_arg(o['block_size'])}")
    if number(o.get("replicas")):
        flags.append(f"--replicas {int(o['replicas'])}")
    return " ".join(flags)


def warmup_command(m: dict[str, Any]) -> str:
    """``epochfs cluster warmup`` for the mount's dataset and tier, every option as the mount has it."""
    return f"epochfs cluster warmup {shlex.quote(str(m['source']))} {_tier_flags(m)}"


def serve_command(m: dict[str, Any]) -> str:
    """``epochfs serve`` of one more cache node for the mount's dataset and tier: its options as the mount
    and the other cache nodes have them (their port, their cache size), its address the machine's own."""
    o, tier = m.get("options") or {}, m.get("tier") or {}
    endpoint = f" --endpoint-url {shlex.quote(o['endpoint_url'])}" if isinstance(o.get("endpoint_url"), str) else ""
    size = number(tier.get("cache_size")) or number(o.get("cache_size"))
    listen = f"\"$(hostname -I | cut -d' ' -f1):{tier.get('port') or PEER_PORT}\""
    return (f"epochfs serve {shlex.quote(str(m['source']))}{endpoint} {_tier_flags(m)} --peer-listen {listen}"
            + (f" --cache-size {size_flag(size)}" if size else "") + " --rebalance")


def backend_flags(m: dict[str, Any]) -> str:
    """The options that reach the mount's backend as it was mounted with them (endpoint, region,
    profile), each with a leading space; empty where it used the defaults."""
    o = m.get("options") or {}
    return "".join(f" {flag} {shlex.quote(o[key])}" for key, flag in (
        ("endpoint_url", "--endpoint-url"), ("region", "--region"), ("profile", "--profile"))
        if isinstance(o.get(key), str) and o[key])


def packed_source(m: dict[str, Any]) -> str:
    """Where the doctor advises packing the mount's source to: beside it, ``-packed`` appended."""
    return str(m["source"]).rstrip("/") + "-packed/"


def pack_command(m: dict[str, Any]) -> str:
    """``epochfs pack`` of the mount's source beside it, reaching the backend as the mount does."""
    return f"epochfs pack {shlex.quote(str(m['source']))} {shlex.quote(packed_source(m))}{backend_flags(m)}"


def warm_fix(m: dict[str, Any], mnt: str, src: str, fits: bool) -> str:
    if m.get("peer_role") == "client":
        return f"warm the cache nodes before the job: `{warmup_command(m)}`"
    if fits:
        return f"warm the cache before the job starts: `epochfs warmup {mnt}` (the dataset fits the cache){who_warms(m)}"
    return (f"once the cache holds the dataset (cache-too-small: warming a cache that cannot hold an epoch "
            f"evicts what it warmed), warm it before the job starts: `epochfs warmup {mnt}`{who_warms(m)}")


def who_warms(m: dict[str, Any]) -> str:
    """Who may run that warmup, where the job's own user may not: a dataset larger than what one user who
    is not an operator may warm (``--user-share``) is warmed by root or a member of the control group."""
    o = m.get("options") or {}
    share, dataset = o.get("user_share_bytes"), m.get("dataset_bytes")
    if not isinstance(share, int) or not dataset or dataset <= share:
        return ""
    group = o.get("control_group_name") or o.get("control_group")
    operators = "root" + (f" or a member of group {group} (--control-group)" if group is not None else "")
    return (f", run by {operators}: a user who is not an operator may warm at most {size_flag(share)} "
            f"(--user-share), less than the dataset's {size_flag(dataset)}")
