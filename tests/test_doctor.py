"""epochfs doctor: the verdict from the jobs' reports, and each cause the mount's state shows."""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epochfs.core.errors import ConfigError
from epochfs.daemon.config import parse_size, read_config_file
from epochfs.dev.sample import SampleFile, upload
from epochfs.doctor import compare, diagnose, render, share_fix, size_flag
from epochfs.doctor.cost import Prices, cost_table, prices_from
from epochfs.watch import watch

from .conftest import requires_fuse
from .helpers import EPOCHFS, epochfs_as, passable

MiB = 1 << 20


GiB = 1 << 30
DATASET = 1000 * 64 * MiB


def job(name="train", rank=0, steps=100, wait=1.0, compute=9.0, gpu=None, saves=0, save_seconds=0.0, epochs=()):
    """One rank as ``status`` lists it; ``epochs``: (epoch, steps, wait, compute) rows."""
    return {"job": name, "rank": rank, "steps": steps, "data_wait_seconds": wait, "compute_seconds": compute,
            "gpu_utilization": gpu, "last_report": 0.0,
            "window": {"seconds": 60.0, "reports": 12, "steps": steps, "data_wait": wait, "compute": compute,
                       "saves": saves, "save_seconds": save_seconds},
            "epochs": [{"epoch": n, "steps": s, "data_wait": w, "compute": c, "first_report": 100.0 * n,
                        "last_report": 100.0 * n + 90} for n, s, w, c in epochs]}


def healthy():
    """A mount in good shape: the order handed over, the dataset cached in a cache that holds it, large
    objects, a quiet backend, every read a hit, the kernel reading cached files itself."""
    return {"mountpoint": "/mnt/data", "source": "s3://bucket/train", "eviction": "manifest", "backend_concurrency": 16,
            "cache": {"hit_bytes": 100 * MiB, "miss_bytes": 0},
            "backend": {"bytes": 10 * MiB, "bandwidth_limit": 1e9, "requests": {"get/ok": 10},
                        "request_seconds": {"bounds": [0.005, 0.01, 0.05], "counts": [90, 10, 0, 0], "sum": 0.5, "count": 100}},
            "snapshot": {"bytes": DATASET, "objects": 1000, "shards": 0},
            "prefetch": {"files": 500, "plan_bytes": 10 * MiB},
            "store": {"capacity_bytes": 128 * GiB, "used_bytes": DATASET},
            "errors": {},
            "writeback": None,
            "passthrough": {"active": True, "opens": 900, "cached_opens": 100},
            "isatty_asks": 0,
            "jobs": [job()]}


def doctor(after, before=None, seconds=2.0, name=None, **kw):
    return diagnose(before or healthy(), after, seconds, name, **kw)


def test_the_verdict_follows_the_operators_rules():
    s = healthy()
    assert doctor(s)["verdict"] == "compute-bound"  # waits 10%
    s["jobs"] = [job(wait=3.0, compute=7.0)]
    assert doctor(s)["verdict"] == "balanced"
    s["jobs"] = [job(wait=6.0, compute=4.0)]
    r = doctor(s)
    assert r["verdict"] == "storage-bound" and r["data_wait_fraction"] == pytest.approx(0.6)
    s["jobs"] = [job(wait=3.0, compute=7.0, gpu=30.0)]  # a GPU idle while the job waits
    assert doctor(s)["verdict"] == "storage-bound"
    s["jobs"] = [job(wait=3.0, compute=7.0, gpu=95.0)]
    assert doctor(s)["verdict"] == "balanced"
    s["jobs"] = []
    assert doctor(s)["verdict"] == "no-job-data"
    s["jobs"] = [job(steps=0, wait=0.0, compute=0.0)]  # reported long ago: nothing in the window
    assert doctor(s)["verdict"] == "no-job-data"


def test_ranks_are_summed_and_a_job_can_be_chosen():
    s = healthy()
    s["jobs"] = [job(rank=0, wait=9.0, compute=1.0), job(rank=1, wait=1.0, compute=9.0),
                 job(name="eval", wait=0.0, compute=10.0)]
    assert doctor(s, name="train")["data_wait_fraction"] == pytest.approx(0.5)
    assert doctor(s, name="eval")["verdict"] == "compute-bound"
    assert doctor(s, name="nope")["verdict"] == "no-job-data"
    assert doctor(s)["job"]["ranks"] == 3


def test_the_first_epoch_and_the_later_ones_are_judged_apart():
    """A first epoch that waited 57% and a second that waited 12% are not "balanced 35%": the verdict is
    the later epochs', the cold read has its own line and its own finding."""
    s = healthy()
    s["store"]["used_bytes"] = DATASET // 2  # (the cache is not warm yet: a new job's first epoch waits again)
    s["jobs"] = [job(wait=69.0, compute=111.0, epochs=[(0, 100, 57.0, 43.0), (1, 100, 12.0, 88.0)])]
    r = doctor(s)
    first, later = r["job"]["phases"]["first"], r["job"]["phases"]["later"]
    assert first["data_wait_fraction"] == pytest.approx(0.57) and first["verdict"] == "storage-bound"
    assert later["data_wait_fraction"] == pytest.approx(0.12) and later["verdict"] == "compute-bound"
    assert r["verdict"] == "compute-bound" and r["data_wait_fraction"] == pytest.approx(0.12)
    assert r["judged_on"].startswith("epoch 1 (100 steps")
    assert [f["cause"] for f in r["findings"]] == ["cold-first-epoch"]
    text = render(r, "/mnt/data")
    assert "first epoch    storage-bound, waited 57%" in text and "epoch 1" in text and "12%" in text
    # Only the first epoch so far: it is what the verdict is judged on.
    s["jobs"] = [job(wait=57.0, compute=43.0, epochs=[(0, 100, 57.0, 43.0)])]
    r = doctor(s)
    assert r["verdict"] == "storage-bound" and r["judged_on"].startswith("the first epoch")


def test_a_cold_first_epoch_with_the_order_handed_over_is_not_a_missing_manifest():
    s = healthy()
    s["cache"] = {"hit_bytes": 20 * MiB, "miss_bytes": 80 * MiB}  # the cold read
    s["store"]["used_bytes"] = DATASET // 4
    s["jobs"] = [job(wait=60.0, compute=40.0, epochs=[(0, 100, 60.0, 40.0)])]
    r = doctor(s, s)
    assert [f["cause"] for f in r["findings"]] == ["cold-first-epoch"]
    f = r["findings"][0]
    assert "not a missing plan" in f["evidence"] and "`epochfs warmup /mnt/data`" in f["fix"]
    assert any("order is handed over" in x for x in r["in_place"])
    assert any("3.1x the dataset" in x or "2.0x the dataset" in x for x in r["in_place"])
    # A cache too small for the dataset: no warmup holds an epoch, so the cache's size comes first, and
    # the warmup once it holds the dataset; the advised size applied, the warmup alone is left.
    s["store"]["capacity_bytes"] = 16 * GiB
    r = doctor(s, s)
    assert [f["cause"] for f in r["findings"]] == ["cache-too-small", "cold-first-epoch"], r["findings"]
    assert "is larger than the cache (16G)" in r["findings"][0]["evidence"]
    assert "once the cache holds the dataset" in r["findings"][1]["fix"]
    _cache_size_advised(s, r)
    assert [f["cause"] for f in doctor(s, s)["findings"]] == ["cold-first-epoch"]
    # Through cache nodes: warm them.
    s["peer"] = {"role": "client", "bytes_in": 0, "requests": {"unavailable": 0, "bad": 0}}
    assert "epochfs cluster warmup s3://bucket/train" in doctor(s, s)["findings"][0]["fix"]


def test_a_balanced_job_hears_what_would_move_it():
    s = healthy()
    s["prefetch"].update(files=0, plan_bytes=0)
    s["jobs"] = [job(wait=3.0, compute=7.0)]
    r = doctor(s)
    assert r["verdict"] == "balanced" and [f["cause"] for f in r["findings"]] == ["no-manifest"]
    assert "what would move it" in render(r, "/mnt/data")


def starving():
    s = healthy()
    s["jobs"] = [job(wait=8.0, compute=2.0)]
    return s


def test_a_healthy_mount_has_no_findings_even_for_a_starving_job():
    r = doctor(starving())
    assert r["verdict"] == "storage-bound" and r["findings"] == []
    assert "the mount's own state shows no cause" in render(r, "/mnt/data")


def _cache_size_advised(s, r):
    flag = re.search(r"--cache-size (\S+?)`", r["findings"][0]["fix"])[1]
    s["store"]["capacity_bytes"] = parse_size(flag)


def _first_epoch(s):
    s["jobs"] = [job(wait=8.0, compute=2.0, epochs=[(0, 100, 8.0, 2.0)])]
    s["store"]["used_bytes"] = DATASET // 10


# cause -> (the state that shows it, the state once its fix is applied)
CASES = {
    "read-errors": (lambda s: s.update(errors={"EACCES": 453, "EIO": 2}), lambda s, r: s.update(errors={})),
    "cold-first-epoch": (_first_epoch, lambda s, r: s["store"].update(used_bytes=DATASET)),  # epochfs warmup
    "no-manifest": (lambda s: s["prefetch"].update(files=0, plan_bytes=0),
                    lambda s, r: s["prefetch"].update(files=500, plan_bytes=DATASET)),
    "cache-too-small": (lambda s: (s["store"].update(capacity_bytes=10 * GiB),
                                   s["cache"].update(hit_bytes=150 * MiB, miss_bytes=50 * MiB)),
                        _cache_size_advised),
    "low-hit-ratio": (lambda s: (s.update(eviction="lru"), s["cache"].update(hit_bytes=150 * MiB, miss_bytes=50 * MiB)),
                      lambda s, r: s.update(eviction="manifest", cache={"hit_bytes": 100 * MiB, "miss_bytes": 0})),
    "small-files": (lambda s: s["snapshot"].update(bytes=1000 * 100 * 1024),
                    lambda s, r: s["snapshot"].update(shards=4)),  # epochfs pack, and the packed prefix mounted
    "warm-read-path": (lambda s: s.update(passthrough=None),  # every read a hit, the daemon reading them
                       lambda s, r: s.update(passthrough={"active": True, "opens": 1, "cached_opens": 0})),
    "buffered-opens": (lambda s: s.update(isatty_asks=4000),  # 2000 a second: every open of a loader asking
                       lambda s, r: s.update(isatty_asks=0)),  # (files opened with buffering=0: none asked)
    "backend-saturated": (lambda s: s["backend"].update(bytes=10 * MiB + int(1.8e9)),  # 0.9 GB/s of 1 GB/s
                          lambda s, r: s["backend"].update(bytes=10 * MiB + int(0.4e9))),  # (fetched once by peers)
    "cache-tier": (lambda s: s.update(peer={"role": "client", "bytes_in": 80 * MiB,
                                            "requests": {"unavailable": 0, "bad": 0}}),
                   lambda s, r: s.update(jobs=[job(wait=1.0, compute=9.0)])),  # (a cache node added: no wait)
    "cache-tier-failing": (lambda s: s.update(peer={"role": "client", "bytes_in": 10 * MiB,
                                                    "requests": {"unavailable": 3, "bad": 1}}),
                           lambda s, r: s["peer"].update(requests={"unavailable": 0, "bad": 0})),
    "cluster-share-too-large": (lambda s: s.update(peer={"role": "peer", "mode": "owned", "share_bytes": 3 * DATASET,
                                                        "bytes_in": 0, "requests": {"unavailable": 0, "bad": 0}}),
                                _cache_size_advised),
    "backend-latency": (lambda s: (s["backend"].update(request_seconds={"bounds": [0.005, 0.01, 0.05],
                                                                        "counts": [0, 10, 90, 0], "sum": 3.0, "count": 100}),
                                   s["cache"].update(hit_bytes=280 * MiB, miss_bytes=20 * MiB)),
                        lambda s, r: s["cache"].update(hit_bytes=300 * MiB, miss_bytes=0)),  # fetched ahead in time
    "memory-bound": (lambda s: s.update(memory={"limit": 160 * MiB, "resident": 150 * MiB, "throttled_seconds": 9.0}),
                     lambda s, r: s.update(memory={"limit": 320 * MiB, "resident": 200 * MiB,
                                                   "throttled_seconds": 0.0})),  # (a larger --memory-limit)
    "slow-checkpoints": (lambda s: s["jobs"][0]["window"].update(saves=2, save_seconds=150.0),
                         lambda s, r: s["jobs"][0]["window"].update(saves=2, save_seconds=3.0)),  # (--writeback)
    "writeback-backlog": (lambda s: s.update(writeback={"pending_bytes": 4 << 30, "oldest_pending_seconds": 300.0}),
                          lambda s, r: s.update(writeback={"pending_bytes": 1 << 20, "oldest_pending_seconds": 2.0})),
}


@pytest.mark.parametrize("cause", CASES)
def test_each_cause_is_named_with_its_fix_only_when_the_state_shows_it(cause):
    show, fix = CASES[cause]
    after = starving()
    show(after)
    r = doctor(after, copy.deepcopy(healthy()) if cause != "read-errors" else None)
    assert [f["cause"] for f in r["findings"]] == [cause]
    assert r["findings"][0]["fix"] and r["findings"][0]["evidence"]
    assert f"{cause}:" in render(r, "/mnt/data")
    # The fix applied, the finding is gone.
    fix(after, r)
    assert cause not in [f["cause"] for f in doctor(after)["findings"]]
    # The same state on a job that does not wait is not a finding: the doctor answers the job's question.
    show(after)
    if cause != "read-errors":
        after["jobs"] = [job(wait=0.5, compute=9.5, saves=2, save_seconds=150.0)]
        assert doctor(after)["findings"] == []


def test_fixes_in_place_are_never_advised():
    s = starving()
    s["snapshot"].update(bytes=1000 * 100 * 1024, shards=3)  # small files, packed already
    s["backend"]["request_seconds"] = {"bounds": [0.005, 0.01, 0.05], "counts": [0, 10, 90, 0], "sum": 3.0, "count": 100}
    s["cache"].update(hit_bytes=180 * MiB, miss_bytes=20 * MiB)
    fixes = " ".join(f["fix"] for f in doctor(s)["findings"])
    assert "pack" not in fixes and "hand over" not in fixes and "EpochfsSampler" not in fixes
    assert "--backend-concurrency 32" in fixes  # (twice the 16 in use)
    r = doctor(s)
    assert any("packed (3 shards)" in x for x in r["in_place"])


def test_slow_requests_with_the_order_handed_over_name_the_plans_cap_when_it_binds():
    """With the order handed over, what keeps the prefetcher ahead at the backend's latency is the plan's
    fetches in flight: when Little's law asks for more than --prefetch-concurrency lets it start, that
    is the flag advised (the value the prefetcher reports); when the cap does not bind, the readers'
    own slots are, as before."""
    s = starving()
    s["backend"]["request_seconds"] = {"bounds": [0.005, 0.01, 0.05], "counts": [0, 10, 90, 0], "sum": 3.0, "count": 100}
    s["cache"].update(hit_bytes=180 * MiB, miss_bytes=20 * MiB)
    s["prefetch"].update(wanted_inflight=300, max_inflight=96, advised_inflight=300)
    [f] = [f for f in doctor(s)["findings"] if f["cause"] == "backend-latency"]
    assert "`--prefetch-concurrency 300`" in f["fix"] and "wants 300 fetches in flight where it may start 96" in f["evidence"]
    s["prefetch"].update(wanted_inflight=40, advised_inflight=None)  # the cap leaves room: not it
    [f] = [f for f in doctor(s)["findings"] if f["cause"] == "backend-latency"]
    assert "--prefetch-concurrency" not in f["fix"] and "--backend-concurrency 32" in f["fix"]
    s["prefetch"].update(files=0, plan_bytes=0, wanted_inflight=300, advised_inflight=300)  # no order
    [f] = [f for f in doctor(s)["findings"] if f["cause"] == "backend-latency"]
    assert "--prefetch-concurrency" not in f["fix"] and "hand over the order" in f["fix"]


def test_a_warmup_larger_than_one_users_share_is_advised_to_who_may_run_it():
    s = first_epoch_read(healthy(), 2700 * MiB, backend=2700 * MiB)
    s["store"]["used_bytes"] = DATASET // 3
    s["options"] = {"user_share_bytes": 1 << 30, "control_group": 1234, "control_group_name": "ml-ops"}
    (fix,) = [f["fix"] for f in doctor(s, s)["findings"] if f["cause"] == "cold-first-epoch"]
    assert "run by root or a member of group ml-ops (--control-group)" in fix and "--user-share" in fix, fix
    s["options"] = {"user_share_bytes": 2 * DATASET}  # (the job's user may warm it all: no one else named)
    (fix,) = [f["fix"] for f in doctor(s, s)["findings"] if f["cause"] == "cold-first-epoch"]
    assert "run by" not in fix, fix


def test_a_saturated_link_is_not_advised_more_requests_in_flight():
    """Requests that wait in a full link's queue are slow because it is full: more of them in flight
    lengthens the queue. The link is named, not --backend-concurrency."""
    s = starving()
    s["backend"]["request_seconds"] = {"bounds": [0.005, 0.01, 0.05], "counts": [0, 10, 90, 0], "sum": 3.0, "count": 100}
    s["cache"].update(hit_bytes=180 * MiB, miss_bytes=20 * MiB)
    assert "backend-latency" in [f["cause"] for f in doctor(s)["findings"]]  # (a free link: slow requests)
    s["backend"].update(bytes=10 * MiB + int(1.9e9))  # 0.95 GB/s of 1 GB/s
    causes = [f["cause"] for f in doctor(s)["findings"]]
    assert "backend-saturated" in causes and "backend-latency" not in causes, causes
    assert "--backend-concurrency" not in " ".join(f["fix"] for f in doctor(s)["findings"])


def test_a_share_too_large_for_its_cache_is_fixed_where_the_weights_say():
    """Members weighted by their caches own in proportion to them: raising one member's --cache-size only
    moves more blocks to it. The advice is the tier's caches together against the dataset (every member
    raised by one factor, which keeps the proportions: each share then fits its cache with a tenth to
    spare), or, where a disk holds less than its --cache-size, that disk's size; unweighted members
    are fixed one by one, as before."""
    members = {"a": 2 * GiB, "b": 4 * GiB}
    needed = 28 * GiB  # the dataset times its replicas
    tier = sum(members.values())
    for name, size in members.items():
        share = needed * size / tier
        fix = share_fix(share, size, size, tier, needed)
        factor = float(re.search(r"by ([\d.]+)x", fix)[1])
        assert factor >= needed * 1.1 / tier * 0.99
        advised = parse_size(re.search(r"--cache-size (\S+?)`", fix)[1])
        grown = {m: c * factor for m, c in members.items()}  # every member raised alike: the same proportions
        assert needed * grown[name] / sum(grown.values()) <= advised and advised >= share * 1.1 * 0.99, fix
        assert "add members with 24.8 GiB of cache" in fix  # (28 GiB and a tenth, less the 6 GiB there)
    fix = share_fix(9 * GiB, 3 * GiB, 8 * GiB, 40 * GiB, 28 * GiB)  # its disk holds 3 of its 8
    assert "`--cache-size 3G`" in fix and "disk" in fix
    assert share_fix(9 * GiB, 3 * GiB) == share_fix(9 * GiB, 3 * GiB, None, None, 28 * GiB)
    assert "`--cache-size 10G`" in share_fix(9 * GiB, 3 * GiB)  # (unweighted: its share and a tenth)
    s = starving()  # the doctor says the same from a weighted node's status
    s.update(peer={"role": "server", "mode": "owned", "share_bytes": 9 * GiB, "dataset_bytes": 28 * GiB,
                   "replicas": 1, "cache_size_bytes": 2 * GiB, "tier_cache_bytes": 6 * GiB, "bytes_in": 0,
                   "requests": {"unavailable": 0, "bad": 0}})
    s["store"]["capacity_bytes"] = 2 * GiB
    [finding] = [f for f in doctor(s)["findings"] if f["cause"] == "cluster-share-too-large"]
    assert share_fix(9 * GiB, 2 * GiB, 2 * GiB, 6 * GiB, 28 * GiB) in finding["fix"]


def test_sizes_in_advice_are_flags_to_paste():
    assert size_flag(332346060) == "317M" and size_flag(150 * MiB) == "150M"  # (not 1G: a size under 1 GiB in MiB)
    assert parse_size(size_flag(150 * MiB + 1)) >= 150 * MiB + 1 and size_flag(GiB - 1) == "1024M"
    assert size_flag(300 * GiB) == "300G"
    assert size_flag(300.5 * GiB) == "301G"
    assert size_flag(1536 * GiB) == "1.5T"
    assert parse_size(size_flag(7 * 1024 * GiB + 1)) >= 7 * 1024 * GiB + 1
    assert size_flag(300.5 * GiB, down=True) == "300G" and size_flag(1536.9 * GiB, down=True) == "1.5T"
    assert size_flag(3 * MiB + 5, down=True) == "3M" and parse_size(size_flag(2 * GiB - 1, down=True)) <= 2 * GiB - 1


def test_the_hit_ratio_is_the_windows_and_falls_back_to_the_totals():
    before, after = starving(), copy.deepcopy(starving())
    after["eviction"] = "lru"
    before["cache"] = {"hit_bytes": 100 * MiB, "miss_bytes": 0}
    after["cache"] = {"hit_bytes": 110 * MiB, "miss_bytes": 10 * MiB}  # half of what was read lately missed
    assert [f["cause"] for f in doctor(after, before)["findings"]] == ["low-hit-ratio"]
    after["cache"] = {"hit_bytes": 100 * MiB, "miss_bytes": 0}  # nothing read since: the totals
    assert doctor(after, before)["findings"] == []


def test_compare_lines_up_before_and_after():
    slow_saves = starving()
    slow_saves["jobs"] = [job(wait=8.0, compute=2.0, saves=2, save_seconds=90.0)]
    quick = healthy()
    quick["jobs"] = [job(saves=1, save_seconds=4.0, gpu=90.0)]
    before, after = doctor(slow_saves), doctor(quick)
    rows = {w: (b, a) for w, b, a in compare(before, after)}
    assert rows["verdict"] == ("storage-bound", "compute-bound")
    assert rows["data wait share"] == ("80%", "10%")
    assert rows["GPU utilisation, %"] == ("-", "90")
    assert rows["checkpoint save, s"] == ("45.00", "4.00")
    assert rows["step time, s"] == ("0.1000", "0.1000")


def _two_ranks_three_epochs(wait_later):
    """2 ranks; epoch 0 cold, epochs 1-2 each 180 s x wait_later waiting a rank, the rest computing."""
    s = healthy()
    later = [(n, 1000, 1800 * wait_later, 1800 * (1 - wait_later)) for n in (1, 2)]
    s["jobs"] = [job(rank=r, epochs=[(0, 1000, 900.0, 900.0), *later]) for r in (0, 1)]
    s["job_epochs"] = {"train": [{"epoch": 0, "time": 0, "gets": 0, "lists": 0, "bytes": 0},
                                 {"epoch": 1, "time": 1, "gets": 16_000, "lists": 4, "bytes": 64 * GiB},
                                 {"epoch": 2, "time": 2, "gets": 17_000, "lists": 14, "bytes": 68 * GiB}]}
    s["backend"]["usage"] = {"gets": 17_500, "lists": 14, "bytes": 70 * GiB}
    return s


def test_the_cost_of_an_epoch_and_of_a_day_by_hand():
    prices = prices_from({"price_gb": 0.09}, price_get=0.0004, gpu_hour=2.0)
    r = doctor(_two_ranks_three_epochs(0.1), prices=prices)
    later = r["cost"]["later"]
    assert later["measured_on"] == "epoch 1"  # the last whole epoch of the phase (2 is being read)
    e = later["epoch"]
    # epoch 1: 1,000 GETs and 10 LISTs (0.0004 + 0.00005 $), 4 GiB at $0.09 (0.36 $); 2 ranks waited
    # 180 s each: 0.1 GPU hours, $0.20.
    assert e["get_requests"] == 1000 and e["list_requests"] == 10 and e["bytes"] == 4 * GiB
    assert e["requests_usd"] == pytest.approx(0.00045)
    assert e["transfer_usd"] == pytest.approx(0.36)
    assert e["gpu_hours_lost"] == pytest.approx(0.1) and e["gpu_usd"] == pytest.approx(0.20)
    assert e["total_usd"] == pytest.approx(0.56045)
    # an epoch is 1,800 s of one rank: 48 a day
    assert later["epochs_per_day"] == pytest.approx(48.0)
    assert later["day"]["gpu_hours_lost"] == pytest.approx(4.8) and later["day"]["total_usd"] == pytest.approx(26.9016)
    first = r["cost"]["first"]  # epoch 0: 16,000 GETs, 64 GiB, 2 x 900 s waited
    assert first["epoch"]["bytes"] == 64 * GiB and first["epoch"]["gpu_hours_lost"] == pytest.approx(0.5)
    text = render(r, "/mnt/data")
    assert "per epoch: 1,010 requests ($0.0005), 4.0 GB from the backend ($0.36); 0.10 GPU hours" in text
    assert "per day (48.0 epochs like it)" in text and "total $26.90" in text
    assert text.count("per day") == 1  # (the first epoch is read once a run)
    # Without --gpu-hour: the hours, no money for them.
    r = doctor(_two_ranks_three_epochs(0.1))
    assert r["cost"]["later"]["epoch"]["gpu_usd"] is None and "--gpu-hour prices them" in render(r, "/mnt/data")


def test_compare_shows_what_a_change_saves_per_day():
    prices = prices_from({}, gpu_hour=3.0)
    before = doctor(_two_ranks_three_epochs(0.3), prices=prices)
    after = doctor(_two_ranks_three_epochs(0.05), prices=prices)
    rows = {w: (b, a) for w, b, a in compare(before, after)}
    # 2 ranks x 540 s vs 90 s a 1,800 s epoch, 48 a day: 14.4 vs 2.4 GPU hours
    assert rows["GPU hours waiting per day"] == ("14.40", "2.40")
    assert rows["GPU time waiting per day, $"] == ("$43.20", "$7.20")
    assert rows["first epoch: data wait share"] == ("50%", "50%")  # (the same cold read in both)
    saved = float(rows["saved per day, $"][1].lstrip("$").replace(",", ""))
    assert saved == pytest.approx(36.0, abs=0.01)


def test_prices_come_from_flags_over_the_config_file_over_the_defaults(tmp_path):
    assert prices_from() == Prices(0.0004, 0.005, 0.0, None)
    cfg = tmp_path / "data.toml"
    cfg.write_text('source = "s3://b/p"\n[cost]\nprice_gb = 0.09\ngpu_hour = 2.5\n')
    assert prices_from(cost_table(str(cfg)), gpu_hour=4.0) == Prices(0.0004, 0.005, 0.09, 4.0)
    for bad in ('[cost]\nprice_gb = -1\n', '[cost]\nprice_gb = "cheap"\n', '[cost]\nbogus = 1\n',
                'cost = 3\n', '[cost]\nprice_get = 1e300\n'):
        cfg.write_text(bad)
        with pytest.raises(ConfigError):
            prices_from(cost_table(str(cfg)))
    # The example config's table, uncommented, is what it says.
    example = (Path(__file__).resolve().parents[1] / "deploy" / "epochfs.example.toml").read_text()
    table = example[example.index("# [cost]"):]
    cfg.write_text("\n".join(line.removeprefix("# ") for line in table.splitlines()) + "\n")
    assert prices_from(cost_table(str(cfg))) == Prices(0.0004, 0.005, 0.0, 2.5)
    # The mount reads the same file and leaves the [cost] table to the doctor.
    cfg.write_text('source = "s3://b/p"\n[cost]\ngpu_hour = 2.5\n')
    assert read_config_file(cfg) == {"source": "s3://b/p"}


def test_plan_prices_a_simulated_epoch_by_hand(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    for i in range(10):
        (root / f"{i}.bin").write_bytes(b"x" * MiB)
    manifest = tmp_path / "order.txt"
    manifest.write_text("".join(f"{i}.bin\n" for i in range(10)))
    out = subprocess.run([*EPOCHFS, "plan", "--manifest", str(manifest), "--root", str(root), "--cache-size", "64M",
                          "--block-size", "1M", "--json", "--price-get", "1", "--price-gb", "1024",
                          "--epoch-hours", "0.001", "--backend-bandwidth", "1MB", "--gpus", "8", "--gpu-hour", "3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cost = json.loads(out.stdout)["policies"]["lru"]["cost"]
    e = cost["epoch"]  # a cold epoch: 10 blocks of 1 MiB fetched, a GET each
    assert e["get_requests"] == 10 and e["bytes"] == 10 * MiB
    assert e["requests_usd"] == pytest.approx(0.01) and e["transfer_usd"] == pytest.approx(10.0)
    # fetching 10 MiB at 1 MB/s takes 10.49 s; computing takes 3.6 s: 6.89 s of waiting on 8 GPUs
    wait_h = (10 * MiB / 1e6 - 3.6) / 3600
    assert cost["wait_hours"] == pytest.approx(wait_h)
    assert e["gpu_hours_lost"] == pytest.approx(8 * wait_h) and e["gpu_usd"] == pytest.approx(24 * wait_h)
    assert cost["epochs_per_day"] == pytest.approx(24 / (0.001 + wait_h))
    assert cost["day"]["total_usd"] == pytest.approx(e["total_usd"] * cost["epochs_per_day"])
    text = subprocess.run([*EPOCHFS, "plan", "--manifest", str(manifest), "--root", str(root), "--cache-size", "64M",
                           "--block-size", "1M"], capture_output=True, text=True, timeout=60).stdout
    assert "per epoch: 10 requests (<$0.0001), 0.0 GB from the backend ($0.00)" in text
    bad = subprocess.run([*EPOCHFS, "plan", "--manifest", str(manifest), "--root", str(root), "--cache-size", "64M",
                          "--price-get", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not a price" in bad.stderr


def _random_status(rng):
    """A status reply in any state a mount can be in: fields at their edges, jobs with and without
    epochs, saves only, no GPU, peers and write-back or not."""
    def num(lo=0.0, hi=1e6):
        return rng.choice([0, 0.0, lo, hi, rng.uniform(lo, hi), 1e-9])

    s = healthy()
    s["cache"] = {"hit_bytes": rng.choice([0, rng.randrange(1 << 40)]), "miss_bytes": rng.choice([0, rng.randrange(1 << 40)])}
    s["snapshot"] = {"bytes": rng.choice([0, rng.randrange(1 << 50)]), "objects": rng.choice([0, rng.randrange(10**7)]),
                     "shards": rng.choice([0, 5])}
    s["store"] = {"capacity_bytes": rng.randrange(1, 1 << 45), "used_bytes": rng.randrange(0, 1 << 45)}
    s["prefetch"] = {"files": rng.choice([0, 7]), "plan_bytes": rng.randrange(0, 1 << 45)}
    s["eviction"] = rng.choice(["manifest", "lru", "none"])
    s["backend"]["bandwidth_limit"] = rng.choice([None, 0, 1e3, 1e9])
    s["backend"]["bytes"] = rng.randrange(0, 1 << 40)
    s["backend"]["request_seconds"] = rng.choice([None, s["backend"]["request_seconds"]])
    s["errors"] = rng.choice([{}, {"EIO": 3}, {"EACCES": 0}])
    choice = rng.choice(["absent", 0, rng.randrange(1 << 40), None, -5, "x"])
    if choice == "absent":
        del s["isatty_asks"]
    else:
        s["isatty_asks"] = choice
    s["writeback"] = rng.choice([None, {"pending_bytes": 0, "oldest_pending_seconds": 0.0},
                                 {"pending_bytes": 5, "oldest_pending_seconds": 999.0}])
    if rng.random() < 0.3:
        s["peer"] = {"role": rng.choice(["client", "peer", "server"]), "bytes_in": rng.randrange(0, 1 << 30),
                     "requests": {"unavailable": rng.randrange(3), "bad": 0}}
    jobs = []
    for rank in range(rng.randrange(0, 4)):
        epochs = [(n, rng.choice([0, 1, 100]), num(), num()) for n in sorted(rng.sample(range(5), rng.randrange(0, 4)))]
        j = job(rank=rank, steps=rng.choice([0, 10]), wait=num(), compute=num(), gpu=rng.choice([None, 0.0, 55.0]),
                saves=rng.choice([0, 2]), save_seconds=num(), epochs=epochs)
        if j["window"]["steps"] == 0:
            j["window"].update(data_wait=0.0, compute=0.0)
        jobs.append(j)
    s["jobs"] = jobs
    junk = [None, -1, 0, 1.5, float("inf"), float("nan"), 1 << 70, "x", [], {}, True]

    def counters():  # type: ignore[no-untyped-def]
        keys = ["hit_bytes", "miss_bytes", "demand_bytes", "prefetch_bytes", "peer_bytes", "replica_bytes",
                "cpu_busy", "cpu_all"]
        return {k: rng.choice([rng.randrange(1 << 40), rng.choice(junk)]) for k in keys if rng.random() < 0.9}

    if rng.random() < 0.7:  # (the reads' own counters stay numbers: the rates are taken of them)
        s["cache"].update({k: v for k, v in counters().items() if not k.startswith("cpu")
                           and k not in ("hit_bytes", "miss_bytes")})
    if rng.random() < 0.5:
        s["job_epochs"] = {"train": [{"epoch": n, "time": n, "gets": n * rng.randrange(1000), "lists": n,
                                      "bytes": n * rng.randrange(1 << 30),
                                      **({"counters": rng.choice([counters(), rng.choice(junk)])}
                                         if rng.random() < 0.7 else {})} for n in range(rng.randrange(0, 4))]}
        s["backend"]["usage"] = {"gets": rng.randrange(10**6), "lists": 3, "bytes": rng.randrange(1 << 40)}
    s["host_cpu"] = rng.choice([None, [rng.randrange(10**6), rng.randrange(10**6), 2], [1], "x",
                                [rng.choice(junk), rng.choice(junk)]])
    s["backend"]["link"] = rng.choice([None, {}, {"detail": "eth0, speed 10 Gbit/s", "source": "interface"},
                                       {"detail": rng.choice(junk), "source": rng.choice(junk)}])
    s["options"] = rng.choice([{}, None, "x", {"meta": "redis://10.0.0.1:6379/0", "meta_password_file": "/etc/p",
                                              "peer_token_file": "/etc/t", "block_size": rng.choice([4 << 20, 0, -3]),
                                              "replicas": rng.choice([1, 2, "x"]), "endpoint_url": rng.choice(junk),
                                              "cache_size": rng.choice(junk)}])
    if "peer" in s and rng.random() < 0.8:
        s["peer"]["fallbacks"] = rng.choice([None, {"replica": 3, "backend": 1}, "x"])
        s["peer"]["replicas"] = rng.choice([1, 2, rng.choice(junk)])
        s["peer"]["load"] = rng.choice([None, "x", [rng.choice(junk)], [
            {"member": rng.choice(["198.18.0.5:9570", "x", rng.choice(junk)]), "held_bytes": rng.choice(junk + [5 << 30]),
             "capacity_bytes": rng.choice(junk + [8 << 30]), "utilization": rng.choice(junk + [0.9]),
             "link_capacity": rng.choice(junk + [40e6]), "link_source": rng.choice(junk + ["interface"]),
             "out_bytes_per_second": rng.choice(junk), "age_seconds": rng.choice(junk + [2.0])}
            for _ in range(rng.randrange(4))]])
    return s


def test_doctor_never_fails_on_any_state_a_mount_can_be_in():
    rng = random.Random(40)
    for _ in range(3000):
        before, after = _random_status(rng), _random_status(rng)
        if rng.random() < 0.5:  # (usually the same mount a moment later)
            before = copy.deepcopy(after)
        prices = rng.choice([Prices(), prices_from(gpu_hour=2.0, price_gb=0.09)])
        r = doctor(after, before, seconds=rng.choice([0.0, 2.0]), name=rng.choice([None, "train", "eval"]),
                   prices=prices, checkpoints=rng.choice([None, _random_status(rng)]))
        json.dumps(r)
        text = render(r, "/mnt/data", None, rng.choice([None, r]))
        assert text.split(":", 1)[0] in ("storage-bound", "compute-bound", "balanced", "no-job-data")


def test_a_checkpoint_mount_that_only_saw_saves_reads_as_such():
    s = healthy()
    s["jobs"] = [job(steps=0, wait=0.0, compute=0.0, saves=3, save_seconds=12.0)]
    r = doctor(s)
    assert r["verdict"] == "no-job-data" and r["job"]["checkpoint_save_seconds"] == pytest.approx(4.0)
    assert "checkpoint saves only" in render(r, "/mnt/ckpt")
    # The data mount's doctor reads the checkpoint mount's saves (--checkpoints).
    data = starving()
    r = doctor(data, checkpoints=s)
    assert r["job"]["checkpoint_save_seconds"] == pytest.approx(4.0)
    s["jobs"] = [job(steps=0, wait=0.0, compute=0.0, saves=2, save_seconds=90.0)]
    r = doctor(data, checkpoints=s)
    assert [f["cause"] for f in r["findings"]] == ["slow-checkpoints"] and "--writeback" in r["findings"][0]["fix"]
    s["writeback"] = {"pending_bytes": 0, "oldest_pending_seconds": 0.0}
    assert "writes back already" in doctor(data, checkpoints=s)["findings"][0]["fix"]


def test_the_text_shows_checkpoint_saves_and_what_is_not_yet_durable():
    ckpt = healthy()
    ckpt["jobs"] = [job(steps=0, wait=0.0, compute=0.0, saves=2, save_seconds=3.0)]
    ckpt["writeback"] = {"pending_files": 2, "pending_bytes": 3 * GiB, "oldest_pending_seconds": 41.0,
                         "uploaded_files": 10, "uploaded_bytes": 15 * GiB, "upload_errors": 0}
    text = render(doctor(ckpt), "/mnt/ckpt")
    assert ("checkpoints: a save holds the job 1.5 s; 2 files (3.0 GiB) not yet in the backend, the oldest "
            "waiting 41 s (`epochfs sync` returns once they are); 10 files (15.0 GiB) uploaded") in text
    ckpt["writeback"].update(pending_files=0, pending_bytes=0)
    r = doctor(starving(), checkpoints=ckpt)  # (the data mount's doctor, the checkpoint mount named)
    assert r["checkpoints"]["pending_bytes"] == 0
    assert "checkpoints: a save holds the job 1.5 s; everything saved is in the backend" in render(r, "/mnt/data")
    data = starving()
    data["jobs"][0]["window"].update(saves=1, save_seconds=2.0)
    assert "the mount they go to is not known (`--checkpoints MOUNT` names it)" in render(doctor(data), "/mnt/data")
    assert doctor(starving())["checkpoints"] is None  # (no saves, no write-back: no line)
    assert "checkpoints:" not in render(doctor(starving()), "/mnt/data")


def doctor_of(m, *args: str) -> str:
    """``epochfs doctor`` of mount ``m`` as a person runs it (a short interval); its output."""
    out = subprocess.run([*EPOCHFS, "doctor", str(m.mountpoint), "--interval", "0.1", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def read_slowly(m, files):
    """A loader that keeps the loop waiting: 20 ms per sample, no compute."""
    for f in files:
        time.sleep(0.02)
        yield m.path(f.key).read_bytes()


def starve(m, files, job: str) -> None:
    """Job ``job`` reads ``files`` through ``read_slowly`` under watch; returns once the daemon holds
    every step of it."""
    list(watch(read_slowly(m, files), m.mountpoint, job=job, interval=0.05))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(j["job"] == job and j["window"]["steps"] == len(files)
                                                  for j in m.status()["jobs"]):
        time.sleep(0.05)


@requires_fuse
def test_doctor_on_a_mount_names_a_starving_job(tmp_path, s3_client, fresh_bucket, mount_factory):
    files = [SampleFile(f"d/{i}.bin", 2048) for i in range(30)]
    fresh = [SampleFile(f"e/{i}.bin", 3000) for i in range(30)]  # (read first by the job with epochs)
    upload(s3_client, fresh_bucket, "", files + fresh)
    m = mount_factory(f"s3://{fresh_bucket}")
    with m:
        def run(*args):
            return doctor_of(m, *args)

        assert json.loads(run("--json"))["verdict"] == "no-job-data"
        assert "no-job-data" in run()
        starve(m, files, "starving")
        saved = tmp_path / "before.json"
        r = json.loads(run("--json", "--job", "starving", "--save", str(saved)))
        assert r["verdict"] == "storage-bound" and r["data_wait_fraction"] > 0.9
        causes = {f["cause"] for f in r["findings"]}
        assert {"no-manifest", "small-files"} <= causes
        text = run("--job", "starving", "--compare", str(saved))
        assert text.startswith("storage-bound: starving") and "fix:" in text and "before" in text
        bad = subprocess.run([*EPOCHFS, "doctor", str(m.mountpoint), "--compare", str(tmp_path / "nope.json")],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "--compare" in bad.stderr
        bad = subprocess.run([*EPOCHFS, "doctor", str(m.mountpoint), "--save", str(tmp_path / "no-dir" / "d.json")],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "--save" in bad.stderr and "No such file or directory" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr

        # Two passes: the daemon keeps them apart, with the backend's usage where each began.
        list(watch(read_slowly(m, fresh), m.mountpoint, job="epochs", interval=0.05))
        list(watch(read_slowly(m, fresh), m.mountpoint, job="epochs", interval=0.05))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and [(e["epoch"], e["steps"]) for j in m.status()["jobs"]
                                               if j["job"] == "epochs" for e in j["epochs"]] != [(0, 30), (1, 30)]:
            time.sleep(0.05)  # (the last report of a pass is sent in the background)
        st = m.status()
        (ranks,) = [j for j in st["jobs"] if j["job"] == "epochs"]
        assert [e["steps"] for e in ranks["epochs"]] == [30, 30]
        marks = st["job_epochs"]["epochs"]
        assert [mk["epoch"] for mk in marks] == [0, 1] and marks[1]["gets"] >= marks[0]["gets"]
        r = json.loads(run("--json", "--job", "epochs", "--gpu-hour", "2.5"))
        assert r["job"]["phases"]["first"]["steps"] == 30 and r["job"]["phases"]["later"]["steps"] == 30
        assert r["cost"]["first"]["measured_on"] == "epoch 0" and r["cost"]["prices"]["gpu_hour"] == 2.5
        # (the first pass read the files from the backend; the second, from the cache)
        # (where a pass began is where the daemon heard of it, a moment after: most of the first pass's)
        assert r["cost"]["first"]["epoch"]["get_requests"] >= 20 and r["cost"]["later"]["epoch"]["get_requests"] <= 2
        text = run("--job", "epochs")
        assert "first epoch" in text and "cost of the first epoch (epoch 0)" in text

        # A process that saves a checkpoint and exits at once still reports the save; the doctor of a
        # mount that saw only saves says so.
        script = ("import time, epochfs.watch as w\n"
                  f"with w.saving({str(m.mountpoint)!r}, job='saver'):\n    time.sleep(0.2)\n")
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
        saved = [j for j in m.status()["jobs"] if j["job"] == "saver"]
        assert saved and saved[0]["saves"] == 1 and saved[0]["save_seconds"] >= 0.2
        text = run("--job", "saver")
        assert text.startswith("no-job-data: saver reported checkpoint saves only")


def test_a_warm_job_that_waits_hears_of_passthrough_only_where_it_would_help():
    s = starving()
    s["passthrough"] = None
    r = doctor(s)
    assert [f["cause"] for f in r["findings"]] == ["warm-read-path"]  # (a mount with --no-passthrough)
    assert "without `--no-passthrough`" in r["findings"][0]["fix"]
    s["passthrough"] = {"active": False, "opens": 0, "cached_opens": 10}  # asked for, refused by the kernel
    f = doctor(s)["findings"][0]
    assert f["cause"] == "warm-read-path" and "as root on Linux 6.9" in f["fix"]
    s["passthrough"] = {"active": True, "opens": 10, "cached_opens": 0}
    r = doctor(s)
    assert r["findings"] == [] and any("the kernel reads cached files itself" in x for x in r["in_place"])
    s["passthrough"] = None
    for change in (lambda t: t["snapshot"].update(shards=4),  # packed: members are read through the daemon
                   lambda t: t["cache"].update(hit_bytes=90 * MiB, miss_bytes=10 * MiB),  # not warm: misses first
                   lambda t: t.update(jobs=[job(wait=1.0, compute=9.0)])):  # not waiting
        t = copy.deepcopy(s)
        change(t)
        assert "warm-read-path" not in [f["cause"] for f in doctor(t)["findings"]]


# -- the topology: where the reads came from --------------------------------------------------------

OPTIONS = {"meta": "redis://epochfs@10.1.0.5:6379/0", "meta_name": None,
           "meta_password_file": "/etc/epochfs/meta-password", "meta_ca_file": None,
           "peer_token_file": "/etc/epochfs/peer-token", "block_size": 4 << 20, "replicas": 2,
           "endpoint_url": "http://s3.example:9000", "cache_size": 50 << 30, "peer_role": "client"}


def counters(read, backend=0, owner=0, replica=0, cpu=(0, 0)):
    """The counters a mark keeps: ``read`` bytes read so far, of which ``backend``, ``owner`` and
    ``replica`` were fetched from there; the host's CPU ticks (busy, all)."""
    return {"hit_bytes": read, "miss_bytes": 0, "demand_bytes": backend, "prefetch_bytes": 0,
            "peer_bytes": owner + replica, "replica_bytes": replica, "cpu_busy": cpu[0], "cpu_all": cpu[1]}


def first_epoch_read(s, read, backend=0, owner=0, replica=0, cpu_busy=0.3):
    """``s``'s job in its first epoch (storage-bound), which read ``read`` bytes so far, from where."""
    s["jobs"] = [job(wait=8.0, compute=2.0, epochs=[(0, 100, 8.0, 2.0)])]
    s["job_epochs"] = {"train": [{"epoch": 0, "time": 0.0, "gets": 0, "lists": 0, "bytes": 0,
                                  "counters": counters(0, cpu=(1000, 2000))}]}
    now = counters(read, backend, owner, replica, cpu=(1000 + int(cpu_busy * 10000), 12000))
    s["cache"] = {k: v for k, v in now.items() if not k.startswith("cpu")}
    s["host_cpu"] = [now["cpu_busy"], now["cpu_all"], 2]
    s["backend"]["bytes"] = backend
    return s


def client_of(held, utilization=0.3, capacity=40e6):
    """A GPU node reading through two cache nodes that hold ``held`` bytes together."""
    s = healthy()
    s["passthrough"] = None
    s["store"]["used_bytes"] = 0  # its own cache holds nothing: everything came through the tier
    s["options"] = dict(OPTIONS)
    s["peer"] = {"role": "client", "bytes_in": 0, "requests": {"ok": 10, "unavailable": 0, "bad": 0, "declined": 0},
                 "fallbacks": {"replica": 0, "backend": 0}, "replicas": 2, "dataset_bytes": DATASET, "mode": "owned",
                 "load": [{"member": f"198.18.0.{i}:9570", "held_bytes": held // 2, "capacity_bytes": 60 << 30,
                           "utilization": utilization if i == 5 else 0.1, "link_capacity": capacity,
                           "link_source": "interface", "out_bytes_per_second": utilization * capacity,
                           "age_seconds": 3.0} for i in (5, 6)]}
    return s


def complete(command: str) -> None:
    """A command to paste: every option with its value, no placeholder."""
    for placeholder in (" URL", " FILE", "SOURCE", " ADDR", "HOST:PORT", "..."):
        assert placeholder not in command, (placeholder, command)


def test_a_warm_tier_is_never_advised_a_warmup():
    """A GPU node whose first epoch read everything through warmed cache nodes (none of it from the
    backend, none of it from its own cache) is not told to warm them, nor its own cache."""
    s = first_epoch_read(client_of(2 * DATASET), 10 * GiB, owner=10 * GiB)
    r = doctor(s, s)
    fixes = " ".join(f["fix"] for f in r["findings"])
    assert "cold-first-epoch" not in [f["cause"] for f in r["findings"]] and "warmup" not in fixes, r["findings"]


def test_a_busy_cache_node_link_is_named_with_a_complete_command():
    s = first_epoch_read(client_of(2 * DATASET, utilization=0.86), 10 * GiB, owner=10 * GiB)
    r = doctor(s, s)
    assert [f["cause"] for f in r["findings"]] == ["cache-nodes-busy"], r["findings"]
    f = r["findings"][0]
    assert "198.18.0.5:9570's link is 86% busy" in f["evidence"] and "interface" in f["evidence"]
    command = re.search(r"`(epochfs serve [^`]+)`", f["fix"])[1]
    complete(command)
    for part in ("s3://bucket/train", "--endpoint-url http://s3.example:9000", "--meta redis://epochfs@10.1.0.5:6379/0",
                 "--meta-password-file /etc/epochfs/meta-password", "--peer-token-file /etc/epochfs/peer-token",
                 "--block-size 4M", "--replicas 2", "--peer-listen \"$(hostname -I | cut -d' ' -f1):9570\"",
                 "--cache-size 60G", "--rebalance"):
        assert part in command, (part, command)


def test_a_node_whose_peer_token_is_refused_hears_it_first():
    """A GPU node whose cache nodes refuse its token (it made its own) reads everything from the backend;
    the doctor says why first, not only that the first epoch was cold."""
    s = first_epoch_read(client_of(2 * DATASET), 10 * GiB)
    s["peer"]["refusing"] = ["198.18.0.5:9570", "198.18.0.6:9570"]
    r = doctor(s, s)
    causes = [f["cause"] for f in r["findings"]]
    assert causes[0] == "peer-token-refused", causes
    f = r["findings"][0]
    assert "2 members" in f["evidence"] and "198.18.0.5:9570" in f["evidence"] and "peer_token_file" in f["fix"]
    s["peer"]["refusing"] = []
    assert "peer-token-refused" not in [f["cause"] for f in doctor(s, s)["findings"]]


def test_a_node_whose_store_password_is_refused_hears_it():
    """A node whose store password was rotated under it keeps its last member list; the doctor says why."""
    s = first_epoch_read(client_of(2 * DATASET), 10 * GiB)
    s["peer"].update(store_reachable=False, store_error="metadata store redis://epochfs@10.1.0.5:6379/0 refused the "
                     "password (WRONGPASS invalid username-password pair)")
    (f,) = [f for f in doctor(s, s)["findings"] if f["cause"] == "store-password-refused"]
    assert "WRONGPASS" in f["evidence"] and "meta_password_file" in f["fix"]


def test_a_node_whose_cpu_is_the_bound_hears_so():
    s = first_epoch_read(client_of(2 * DATASET), 10 * GiB, owner=10 * GiB, cpu_busy=0.97)
    r = doctor(s, s)
    assert [f["cause"] for f in r["findings"]] == ["node-cpu"] and "97% busy" in r["findings"][0]["evidence"]


def test_a_cold_tier_is_advised_its_warmup_with_every_option():
    s = first_epoch_read(client_of(DATASET // 5), 10 * GiB, owner=10 * GiB)
    r = doctor(s, s)
    assert [f["cause"] for f in r["findings"]] == ["cold-first-epoch"]
    command = re.search(r"`(epochfs cluster warmup [^`]+)`", r["findings"][0]["fix"])[1]
    complete(command)
    assert command == ("epochfs cluster warmup s3://bucket/train --meta redis://epochfs@10.1.0.5:6379/0 "
                       "--meta-password-file /etc/epochfs/meta-password --peer-token-file /etc/epochfs/peer-token "
                       "--block-size 4M --replicas 2")


def test_a_first_epoch_read_from_its_own_cache_is_not_cold():
    """A mount whose files were all in its own cache (read again after a restart, say) is not told to
    warm it, whatever the cache's use says."""
    s = healthy()
    s["store"]["used_bytes"] = DATASET // 3  # (the cache is not full of the dataset: that is no evidence)
    s = first_epoch_read(s, 10 * GiB)  # nothing fetched: every byte from this node's cache
    r = doctor(s, s)
    assert "cold-first-epoch" not in [f["cause"] for f in r["findings"]]
    # the same first epoch reading from the backend is
    s = first_epoch_read(healthy(), 10 * GiB, backend=9 * GiB)
    s["store"]["used_bytes"] = DATASET // 3
    r = doctor(s, s)
    assert "cold-first-epoch" in [f["cause"] for f in r["findings"]] and "90% of what it read came from the backend" \
        in r["findings"][0]["evidence"]


def test_a_saturated_link_in_the_first_epoch_is_named_with_where_its_capacity_comes_from():
    s = first_epoch_read(healthy(), 2700 * MiB, backend=2700 * MiB)
    s["store"]["used_bytes"] = DATASET // 3
    s["backend"]["bandwidth_limit"] = 30 * MiB
    s["backend"]["link"] = {"source": "measured", "detail": "measured 30.0 MiB/s (bytes moving 96% of 10 s)"}
    # the job's first epoch took 90 s (its reports' span): 30 MiB/s, all of the link
    r = doctor(s, s)
    causes = [f["cause"] for f in r["findings"]]
    assert causes[:2] == ["cold-first-epoch", "backend-saturated"], causes
    f = r["findings"][1]
    assert "100% busy" in f["evidence"] and "measured 30.0 MiB/s" in f["evidence"]
    assert "cache nodes" in f["fix"] and "--peer-role client" in f["fix"]


def test_a_link_that_carried_bytes_all_the_time_is_the_bound_whatever_its_capacity():
    """No capacity known (none declared, none stated, none measured yet): a first epoch during which
    bytes arrived on the backend link 95% of the time still names the link."""
    s = first_epoch_read(healthy(), 2700 * MiB, backend=2700 * MiB)
    s["store"]["used_bytes"] = DATASET // 3
    s["backend"]["bandwidth_limit"] = None
    s["job_epochs"]["train"][0]["counters"].update(backend_busy_seconds=10.0, time=1000.0)
    s["backend"]["link"] = {"source": None, "busy_seconds": 10.0 + 0.95 * 90, "bytes_per_second": None}
    s["now"] = 1090.0
    r = doctor(s, s)
    f = next(f for f in r["findings"] if f["cause"] == "backend-saturated")
    assert "its capacity not known" in f["evidence"] and "arriving 95% of the time" in f["evidence"]
    s["backend"]["link"]["busy_seconds"] = 10.0 + 0.3 * 90  # a link that was mostly idle: not the bound
    assert "backend-saturated" not in [f["cause"] for f in doctor(s, s)["findings"]]


def test_the_headline_names_a_first_epoch_that_waited_and_compare_tells_noise_from_savings():
    """A job whose later epochs are fine but whose first waited says both in its first line; --compare
    sets the first epochs' verdicts beside each other, and a per-day difference within 5% is not a saving
    one run can show."""
    s = healthy()
    s["store"]["used_bytes"] = DATASET // 2
    s["jobs"] = [job(wait=69.0, compute=111.0, epochs=[(0, 100, 56.0, 44.0), (1, 100, 12.0, 88.0)])]
    before = doctor(s)
    head = render(before, "/mnt/data").splitlines()[0]
    assert head.startswith("compute-bound:") and "the first epoch storage-bound: waited 56%" in head
    s["jobs"] = [job(wait=29.0, compute=151.0, epochs=[(0, 100, 17.0, 83.0), (1, 100, 12.0, 88.0)])]
    after = doctor(s)
    rows = {what: (b, a) for what, b, a in compare(before, after)}
    assert rows["first epoch: verdict"] == ("storage-bound", "compute-bound")
    def costing(usd: float) -> dict:
        return {"verdict": "compute-bound", "cost": {"later": {"day": {"total_usd": usd}}}}

    assert compare(costing(100.0), costing(97.0))[-1] == ("saved per day, $", "", "none to tell: within 5% ($3.00)")
    assert compare(costing(100.0), costing(60.0))[-1] == ("saved per day, $", "", "$40.00")


def test_a_job_whose_user_handed_over_no_order_is_told_so_though_another_users_plan_is_there():
    """The plan holds an order (another user's), but the job's own user handed over none (the daemon's
    job view says so per job): the job read without prefetch, and the doctor says it and the fix."""
    s = healthy()
    s["jobs"] = [{**job(wait=6.0, compute=4.0), "uid": 1001, "handed_over": False}]
    r = doctor(s)
    assert r["verdict"] == "storage-bound" and r["job"]["handed_over"] is False
    (finding,) = [f for f in r["findings"] if f["cause"] == "no-manifest"]
    assert "by this job's user" in finding["evidence"] and "EpochfsSampler" in finding["fix"]
    assert "without handing over its epoch order" in render(r, "/mnt/data")
    s["jobs"] = [{**job(wait=6.0, compute=4.0), "uid": 1001, "handed_over": True}]
    r = doctor(s)
    assert "no-manifest" not in [f["cause"] for f in r["findings"]]
    assert "without handing over" not in render(r, "/mnt/data")


def test_the_sampler_line_the_doctor_advises_runs_as_pasted():
    """The no-manifest finding's fix is a line of Python: pasted into a training script (a sampler, a
    dataset with its samples), it builds the wrapper against its real signature."""
    torch = pytest.importorskip("torch")
    import epochfs.torch  # noqa: F401 - (the name the line uses)

    s = healthy()
    s["prefetch"]["files"] = 0
    s["jobs"] = [job(wait=6.0, compute=4.0)]
    (finding,) = [f for f in doctor(s)["findings"] if f["cause"] == "no-manifest"]
    line = finding["fix"].split("`")[1]

    class Dataset:
        samples = [("/mnt/data/a.jpg", 0), ("/mnt/data/b.jpg", 1)]

    scope = {"epochfs": __import__("epochfs"), "dataset": Dataset(),
             "sampler": torch.utils.data.SequentialSampler(range(2))}
    exec(line, scope)  # noqa: S102 - the advice, run as a user would paste it
    wrapped = scope["sampler"]
    assert type(wrapped).__name__ == "EpochfsSampler" and wrapped.client.mountpoint == "/mnt/data"
    assert list(wrapped.sampler) == [0, 1] and wrapped.paths == Dataset.samples


def test_the_pack_command_the_doctor_advises_runs_as_pasted(s3, s3_client, fresh_bucket):
    """A mount of small files on an endpoint of its own (--endpoint-url): the small-files finding's
    command, pasted into a shell as it is, packs the dataset beside it, reaching the backend as the
    mount does (without the mount's endpoint it would ask AWS)."""
    files = [SampleFile(f"train/{i:03d}.jpg", 100 * 1024 + i) for i in range(12)]
    upload(s3_client, fresh_bucket, "ds/", files)
    s = starving()
    s["source"] = f"s3://{fresh_bucket}/ds/"
    s["options"] = {"endpoint_url": s3.endpoint}
    s["snapshot"].update(bytes=sum(f.size for f in files), objects=len(files))
    (finding,) = [f for f in doctor(s)["findings"] if f["cause"] == "small-files"]
    command = finding["fix"].split("`")[1]
    assert f"--endpoint-url {s3.endpoint}" in command, command
    env = dict(s3.env(), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # (where `epochfs` is installed)
    r = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, (command, r.stderr)
    listed = s3_client.list_objects_v2(Bucket=fresh_bucket, Prefix="ds-packed/")
    assert listed.get("KeyCount", 0) >= 2, listed  # (its shards, its index and the pointer written last)


@requires_fuse
def test_doctor_with_no_job_names_a_cold_mounts_hit_ratio_and_advises_a_warmup_its_reader_may_run(
        s3_client, fresh_bucket, mount_factory):
    """Reads with no job reporting: the doctor still reads the mount's counters (the hit ratio the
    EpochfsHitRatioLow alert fires on). A cold first epoch of a dataset larger than one user may warm
    (--user-share) is advised a warmup by root, and that command runs as pasted; as the job's user it is
    the refusal the advice foretold."""
    files = [SampleFile(f"d/{i}.bin", 256 * 1024 + i) for i in range(40)]  # 10 MiB
    upload(s3_client, fresh_bucket, "", files)
    with passable(mount_factory(f"s3://{fresh_bucket}", "--cache-size", "64M", "--user-share", "0.05",
                                "--allow-other")) as m:
        def run(*args):
            return doctor_of(m, *args)

        for f in files[:10]:
            m.path(f.key).read_bytes()
        text = run()
        assert text.startswith("no-job-data")
        assert "the mount's own counters: hit ratio 0.0% by bytes, under the 85%" in text, text
        assert "EpochfsHitRatioLow" in text and "fix:" in text, text

        starve(m, files[10:], "cold")
        r = json.loads(run("--json", "--job", "cold"))
        (fix,) = [f["fix"] for f in r["findings"] if f["cause"] == "cold-first-epoch"]
        assert "run by root" in fix and "--user-share" in fix, fix
        command = re.search(r"`(epochfs warmup [^`]+)`", fix)[1]
        args = shlex.split(command)[1:]
        as_job = epochfs_as("nobody", *args)
        assert as_job.returncode != 0 and "--user-share" in as_job.stderr, as_job
        as_root = subprocess.run([*EPOCHFS, *args], capture_output=True, text=True, timeout=120)
        assert as_root.returncode == 0, as_root.stderr
        assert m.status()["store"]["used_bytes"] >= sum(f.size for f in files)
