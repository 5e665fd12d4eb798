"""epochfs doctor: the verdict from the jobs' reports, and each cause the mount's state shows."""

from __future__ import annotations

import copy
import json
import subprocess
import time

import pytest

from epochfs.doctor import compare, diagnose
from epochfs.sample import SampleFile, upload
from epochfs.watch import watch

from .conftest import requires_fuse
from .helpers import EPOCHFS

MiB = 1 << 20


def job(name="train", rank=0, steps=100, wait=1.0, compute=9.0, gpu=None, saves=0, save_seconds=0.0):
    return {"job": name, "rank": rank, "steps": steps, "data_wait_seconds": wait, "compute_seconds": compute,
            "gpu_utilization": gpu, "last_report": 0.0,
            "window": {"seconds": 60.0, "reports": 12, "steps": steps, "data_wait": wait, "compute": compute,
                       "saves": saves, "save_seconds": save_seconds}}


def healthy():
    """A mount in good shape: a manifest handed over, everything hit, large objects, a quiet backend."""
    return {"cache": {"hit_bytes": 100 * MiB, "miss_bytes": 0},
            "backend": {"bytes": 10 * MiB, "bandwidth_limit": 1e9,
                        "request_seconds": {"bounds": [0.005, 0.01, 0.05], "counts": [90, 10, 0, 0], "sum": 0.5, "count": 100}},
            "snapshot": {"bytes": 1000 * 64 * MiB, "objects": 1000},
            "prefetch": {"files": 500, "plan_bytes": 10 * MiB},
            "store": {"capacity_bytes": 100 * MiB},
            "writeback": None,
            "jobs": [job()]}


def doctor(after, before=None, seconds=2.0, name=None):
    return diagnose(before or healthy(), after, seconds, name)


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


def starving():
    s = healthy()
    s["jobs"] = [job(wait=8.0, compute=2.0)]
    return s


def test_a_healthy_mount_has_no_findings_even_for_a_starving_job():
    r = doctor(starving())
    assert r["verdict"] == "storage-bound" and r["findings"] == []


CASES = {
    "no-manifest": lambda s: s["prefetch"].update(files=0, plan_bytes=0),
    "low-hit-ratio": lambda s: s["cache"].update(hit_bytes=150 * MiB, miss_bytes=50 * MiB),
    "cache-too-small": lambda s: s["prefetch"].update(plan_bytes=500 * MiB),
    "backend-saturated": lambda s: s["backend"].update(bytes=10 * MiB + int(1.8e9)),  # 0.9 GB/s of 1 GB/s
    "backend-latency": lambda s: s["backend"].update(
        request_seconds={"bounds": [0.005, 0.01, 0.05], "counts": [0, 10, 90, 0], "sum": 3.0, "count": 100}),
    "small-files": lambda s: s["snapshot"].update(bytes=1000 * 100 * 1024),
    "writeback-backlog": lambda s: s.update(writeback={"pending_bytes": 4 << 30, "oldest_pending_seconds": 300.0}),
    "slow-checkpoints": lambda s: s["jobs"][0]["window"].update(saves=2, save_seconds=150.0),
    "cache-tier": lambda s: s.update(peer={"role": "client", "bytes_in": 80 * MiB,
                                           "requests": {"unavailable": 0, "bad": 0}}),
    "cache-tier-failing": lambda s: s.update(peer={"role": "client", "bytes_in": 10 * MiB,
                                                   "requests": {"unavailable": 3, "bad": 1}}),
}


@pytest.mark.parametrize("cause", CASES)
def test_each_cause_is_named_with_its_fix_only_when_the_state_shows_it(cause):
    after = starving()
    CASES[cause](after)
    r = doctor(after)
    assert [f["cause"] for f in r["findings"]] == [cause]
    assert r["findings"][0]["fix"] and r["findings"][0]["evidence"]
    # The same state on a job that does not wait is not a finding: the doctor answers the job's question.
    after["jobs"] = [job(wait=0.5, compute=9.5, saves=2, save_seconds=150.0)]
    assert doctor(after)["findings"] == []


def test_the_hit_ratio_is_the_windows_and_falls_back_to_the_totals():
    before, after = starving(), copy.deepcopy(starving())
    before["cache"] = {"hit_bytes": 100 * MiB, "miss_bytes": 0}
    after["cache"] = {"hit_bytes": 110 * MiB, "miss_bytes": 10 * MiB}  # half of what was read lately missed
    assert [f["cause"] for f in doctor(after, before)["findings"]] == ["low-hit-ratio"]


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


@requires_fuse
def test_doctor_on_a_mount_names_a_starving_job(tmp_path, s3_client, fresh_bucket, mount_factory):
    files = [SampleFile(f"d/{i}.bin", 2048) for i in range(30)]
    upload(s3_client, fresh_bucket, "", files)
    m = mount_factory(f"s3://{fresh_bucket}")
    with m:
        def run(*args):
            out = subprocess.run([*EPOCHFS, "doctor", str(m.mountpoint), "--interval", "0.1", *args],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return out.stdout

        assert json.loads(run("--json"))["verdict"] == "no-job-data"
        assert "no-job-data" in run()

        def slow():  # a loader that keeps the loop waiting: 20 ms per sample, no compute
            for f in files:
                time.sleep(0.02)
                yield m.path(f.key).read_bytes()

        list(watch(slow(), m.mountpoint, job="starving", interval=0.05))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(j["window"]["steps"] == 30 for j in m.status()["jobs"]):
            time.sleep(0.05)
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
