"""A benchmark's report says how busy work outside the run kept the machine, and flags a busy run as no
result; its page-cache drops hold the lock the test suite's page-cache tests hold."""

from __future__ import annotations

import contextlib
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
    detached) are the run's own; a process of somebody else's is outside it, and its CPU is what the
    samples add up. (Judged per process: the suite's other workers are outside this run too.)"""
    import os

    watch = OutsideLoad(tmp_path, interval=0.5)
    child = subprocess.Popen(["sleep", "30"])
    mark = tmp_path / "daemon.pid"
    subprocess.run(["setsid", "-f", "sh", "-c", f"echo $$ > {mark}; exec {sys.executable} -c 'import time; "
                    f"time.sleep(30)' --cache-dir {tmp_path}/cache"], check=True)
    other = tmp_path / "other.pid"
    subprocess.run(["setsid", "-f", "sh", "-c", f"echo $$ > {other}; exec sleep 30"], check=True)
    deadline = time.monotonic() + 10
    while not (mark.exists() and other.exists() and mark.read_text().strip() and other.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    daemon, outsider = int(mark.read_text()), int(other.read_text())
    try:
        outside = watch._ticks()
        assert child.pid not in outside and os.getpid() not in outside  # (the run and its children)
        assert daemon not in outside  # (detached, but its command line names the run's work directory)
        assert outsider in outside
    finally:
        for pid in (daemon, outsider):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        child.kill()
        child.wait()
    # The samples are that CPU as a share of the machine: one core busy outside is 1/cores of it.
    busy = subprocess.Popen(["setsid", "-f", "timeout", "2", "sh", "-c", "while :; do :; done"])
    busy.wait()
    watch.start()
    time.sleep(2.2)
    watch.stop()
    m = watch.summary()
    assert m["samples"] >= 3 and m["max"] >= 0.5 / (os.cpu_count() or 1), m  # (a core, shared with the suite)
    busy_run = {**m, "median": 0.4, "busy": True}
    assert load_text_of(busy_run).startswith("**BUSY MACHINE: these figures are not a result**")
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
