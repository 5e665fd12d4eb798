"""A benchmark's report says how busy work outside the run kept the machine, and flags a busy run as no
result; its page-cache drops hold the lock the test suite's page-cache tests hold."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "shared"))

from workloads import OutsideLoad, load_text_of  # noqa: E402

from epochfs.dev import pagecache  # noqa: E402


def test_work_outside_the_run_is_counted_and_the_runs_own_is_not(tmp_path):
    """A child of the run (its servers) and a process naming its work directory (a mount's daemon,
    detached) are the run's own; a process of somebody else's, busy the whole time, is outside it and
    makes the run a busy one."""
    watch = OutsideLoad(tmp_path, interval=0.5).start()
    try:
        child = subprocess.Popen(["timeout", "2.5", "sh", "-c", "while :; do :; done"])
        subprocess.run(["setsid", "-f", "timeout", "2.5", "sh", "-c", f"while :; do :; done # {tmp_path}"],
                       check=True)
        time.sleep(2.6)
        child.wait()
        ours = watch.summary()
        assert ours["samples"] >= 3 and ours["max"] < 0.2, ours
        subprocess.run(["setsid", "-f", "timeout", "2.5", "sh", "-c", "while :; do :; done"], check=True)
        time.sleep(2.6)
    finally:
        watch.stop()
    m = watch.summary()
    assert m["max"] > 0.3, m  # (one core of the machine's, busy outside)
    busy = {**m, "median": 0.4, "busy": True}
    assert load_text_of(busy).startswith("**BUSY MACHINE: these figures are not a result**")
    quiet = {**m, "median": 0.0, "max": 0.01, "busy": False, "unsettled": 0}
    assert "BUSY" not in load_text_of(quiet) and "median 0%" in load_text_of(quiet)


@pytest.mark.skipif(not Path("/proc/sys/vm/drop_caches").exists(), reason="no drop_caches")
def test_a_benchmarks_page_cache_drop_waits_for_the_suites_lock():
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root")
    done = threading.Event()
    with open(pagecache.LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (what a page-cache test holds, from another process of the suite)
        t = threading.Thread(target=lambda: (pagecache.drop(), done.set()))
        t.start()
        time.sleep(0.5)
        assert not done.is_set()
        fcntl.flock(lock, fcntl.LOCK_UN)
    t.join(timeout=30)
    assert done.is_set()
