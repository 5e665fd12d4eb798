"""The training job's view: epochfs.watch measures the loop and reports in the background; the daemon
keeps bounded, validated reports and exports them."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from epochfs.control import request
from epochfs.control.jobs import MAX_ENTRIES, MAX_EPOCHS, WINDOW, Jobs, Report
from epochfs.core.errors import EpochfsError
from epochfs.dev.sample import SampleFile, upload
from epochfs.watch import Meter, Reporter, _reporters, job_name, job_rank, saving, watch

from .conftest import requires_fuse


class Recorder:
    def __init__(self, fail: Exception | None = None, delay: float = 0.0) -> None:
        self.sent: list[dict] = []
        self.fail = fail
        self.delay = delay

    def __call__(self, fields: dict) -> None:
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        self.sent.append(fields)


def slow_loader(n: int, wait: float):
    for i in range(n):
        time.sleep(wait)
        yield i


def test_watch_yields_the_items_unchanged_and_splits_each_step_into_data_wait_and_compute(tmp_path):
    rec = Recorder()
    reporter = Reporter(tmp_path, "j", 0, Meter(), interval=3600, send=rec)
    got = []
    for item in watch(slow_loader(10, 0.02), tmp_path, reporter=reporter):
        got.append(item)
        time.sleep(0.01)  # "compute"
    reporter.report()
    reporter.close()
    assert got == list(range(10))
    m = reporter.meter
    assert m.steps == 10
    assert 0.18 <= m.data_wait < 0.6 and 0.09 <= m.compute < 0.4
    assert sum(r["steps"] for r in rec.sent) == 10
    assert abs(sum(r["data_wait"] for r in rec.sent) - m.data_wait) < 1e-9


def test_reports_carry_what_happened_since_the_last_one_that_arrived(tmp_path):
    rec = Recorder(fail=OSError("daemon gone"))
    meter = Meter()
    reporter = Reporter(tmp_path, "j", 2, meter, interval=3600, send=rec)
    meter.steps, meter.data_wait, meter.compute = 5, 1.0, 2.0
    reporter.report()  # lost: the daemon is away
    rec.fail = None
    meter.steps, meter.data_wait, meter.compute = 8, 1.5, 3.0
    reporter.report()
    reporter.report()  # nothing new: nothing sent
    reporter.close()
    assert rec.sent == [{"job": "j", "rank": 2, "steps": 8, "data_wait": 1.5, "compute": 3.0, "gpu_utilization": None}]


def test_a_daemon_that_is_absent_slow_or_refusing_never_stops_or_slows_the_loop(tmp_path, caplog):
    # (the client's refusal of a socket another user planted, or of a mount not ours, is an EpochfsError)
    refused = EpochfsError("control socket /run/x.sock is not a socket owned by root or by you; refusing to use it")
    for rec in (Recorder(fail=OSError("refused")), Recorder(fail=refused), Recorder(delay=5.0)):
        reporter = Reporter(tmp_path, "j", 0, Meter(), interval=0.01, send=rec)
        start = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="epochfs.watch"):
            assert list(watch(range(2000), tmp_path, reporter=reporter)) == list(range(2000))
            time.sleep(0.1)
        assert time.perf_counter() - start < 2.0  # the slow report waits in its own thread
        reporter.close()
    assert sum("cannot report" in r.message for r in caplog.records) == 2  # once per reporter, not per report
    # And the real thing: a directory with no daemon behind it.
    assert list(watch(iter(range(50)), tmp_path / "nowhere", job="nodaemon")) == list(range(50))


def test_an_unreachable_daemon_is_said_in_one_line_with_or_without_the_jobs_logging(tmp_path):
    """A job that configured no logging hears it once on stderr; one that did, once through its logging:
    one line either way, never the same news twice."""
    import subprocess
    import sys

    for setup in ("", "import logging; logging.basicConfig()\n"):
        script = (setup + "import sys, epochfs.watch as w\n"
                  "assert list(w.watch(iter(range(20)), sys.argv[1], interval=0.01)) == list(range(20))\n")
        r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "not an epochfs mount" in lines[0], (setup, r.stderr)


def test_a_loader_that_raises_raises_through_watch_and_the_measurements_stay(tmp_path):
    def broken():
        yield 1
        raise ValueError("bad sample")

    reporter = Reporter(tmp_path, "j", 0, Meter(), interval=3600, send=Recorder())
    with pytest.raises(ValueError, match="bad sample"):
        for _ in watch(broken(), tmp_path, reporter=reporter):
            pass
    reporter.close()
    assert reporter.meter.steps == 1


def test_each_epoch_ends_with_one_log_line(tmp_path, caplog):
    reporter = Reporter(tmp_path, "resnet", 1, Meter(), interval=3600, send=Recorder())
    with caplog.at_level(logging.INFO, logger="epochfs.watch"):
        for _ in range(2):
            list(watch(slow_loader(3, 0.01), tmp_path, reporter=reporter, job="resnet", rank=1))
    reporter.close()
    lines = [r.getMessage() for r in caplog.records if "waited for data" in r.getMessage()]
    assert len(lines) == 2 and "(resnet rank 1)" in lines[0] and "3 steps" in lines[1]
    assert lines[0].startswith("epoch 0") and lines[1].startswith("epoch 1")


def test_checkpoint_saves_are_timed_as_the_job_sees_them_and_reported(tmp_path, monkeypatch):
    rec = Recorder()
    mount = tmp_path / "ckpt"
    mount.mkdir()
    reporter = Reporter(mount, "saver", 0, Meter(), interval=3600, send=rec)
    monkeypatch.setitem(_reporters._by_key, (str(mount), "saver", 0), reporter)
    with saving(mount, job="saver", rank=0):
        time.sleep(0.05)
    with pytest.raises(OSError), saving(mount, job="saver", rank=0):  # a failed save is timed too, and raises
        raise OSError("disk full")
    reporter.report()
    reporter.close()
    (sent,) = rec.sent
    assert sent["saves"] == 2 and 0.05 <= sent["save_seconds"] < 1.0 and sent["steps"] == 0


def test_a_save_is_reported_to_the_data_mount_the_job_watches_too(tmp_path, monkeypatch):
    data_rec, ckpt_rec = Recorder(), Recorder()
    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    data_reporter = Reporter(data, "both", 0, Meter(), interval=3600, send=data_rec)
    ckpt_reporter = Reporter(ckpt, "both", 0, Meter(), interval=3600, send=ckpt_rec)
    other = Reporter(data, "someone-else", 0, Meter(), interval=3600, send=Recorder())
    monkeypatch.setattr(_reporters, "_by_key", {})  # (this process's other reporters are not this test's)
    for r in (data_reporter, ckpt_reporter, other):
        monkeypatch.setitem(_reporters._by_key, (r.mountpoint, r.job, r.rank), r)
    list(watch(range(4), data, reporter=data_reporter))
    with saving(ckpt, job="both", rank=0):
        pass
    _reporters.flush_all(budget=5.0)  # (what runs at exit)
    assert [r.get("saves", 0) for r in ckpt_rec.sent] == [1]
    assert sum(r.get("saves", 0) for r in data_rec.sent) == 1 and sum(r["steps"] for r in data_rec.sent) == 4
    assert other.meter.saves == 0


def test_job_names_and_ranks(monkeypatch):
    assert job_name("resnet50") == "resnet50"
    assert job_name("my job/../x\n") == "my_job_.._x_"
    assert job_name("\n\n") == "job"
    assert len(job_name("a" * 500)) == 64
    monkeypatch.setenv("EPOCHFS_JOB", "from-env")
    assert job_name(None) == "from-env"
    monkeypatch.setenv("RANK", "3")
    assert job_rank(None) == 3 and job_rank(5) == 5
    monkeypatch.setenv("RANK", "nonsense")
    assert job_rank(None) == 0


def test_jobs_keep_totals_a_window_and_a_bounded_number_of_entries():
    jobs = Jobs()
    jobs.report(Report("a", 0, 10, 1.0, 2.0), now=1000.0)
    jobs.report(Report("a", 0, 5, 0.5, 1.0, 40.0), now=1000.0 + WINDOW + 1)
    (a,) = jobs.statistics()
    assert (a.steps, a.data_wait_seconds, a.compute_seconds, a.gpu_utilization) == (15, 1.5, 3.0, 40.0)
    assert len(a.recent) == 1  # the first report left the window
    for i in range(MAX_ENTRIES + 10):
        jobs.report(Report("many", i, 1, 0.0, 0.0), now=2000.0 + i)
    stats = jobs.statistics()
    assert len(stats) == MAX_ENTRIES
    assert ("a", 0) not in {(s.job, s.rank) for s in stats}  # the least recently reported went first
    assert ("many", MAX_ENTRIES + 9) in {(s.job, s.rank) for s in stats}


def test_each_report_names_the_pass_its_steps_belong_to(tmp_path):
    """Two passes between two reports still reach the daemon as two reports, one per epoch, and what a
    report that failed carried is sent again, split the same way."""
    rec = Recorder(fail=OSError("daemon gone"))
    reporter = Reporter(tmp_path, "j", 0, Meter(), interval=3600, send=rec)
    list(watch(range(3), tmp_path, reporter=reporter))
    list(watch(range(5), tmp_path, reporter=reporter))
    reporter.report()  # lost
    rec.fail = None
    it = watch(range(7), tmp_path, reporter=reporter)
    next(it), next(it)  # the third pass, two steps in
    reporter.report()
    assert [(r["epoch"], r["steps"]) for r in rec.sent] == [(0, 3), (1, 5), (2, 2)]
    list(it)
    reporter.report()
    reporter.close()
    assert [(r["epoch"], r["steps"]) for r in rec.sent][3:] == [(2, 5)]
    assert sum(r["data_wait"] + r["compute"] for r in rec.sent) == pytest.approx(
        reporter.meter.data_wait + reporter.meter.compute)


def test_a_job_resumed_mid_epoch_says_which_epoch_it_is(tmp_path, caplog):
    """A job restarted from a checkpoint in the middle of epoch 5 passes ``epoch=5``: its reports and its
    log line name epoch 5, and its next pass counts on from there (6)."""
    rec = Recorder()
    reporter = Reporter(tmp_path, "j", 0, Meter(), interval=3600, send=rec)
    with caplog.at_level(logging.INFO, logger="epochfs.watch"):
        list(watch(range(3), tmp_path, reporter=reporter, epoch=5))
        list(watch(range(4), tmp_path, reporter=reporter))
    reporter.report()
    reporter.close()
    assert [(r["epoch"], r["steps"]) for r in rec.sent] == [(5, 3), (6, 4)]
    lines = [r.getMessage() for r in caplog.records if "waited for data" in r.getMessage()]
    assert lines[0].startswith("epoch 5") and lines[1].startswith("epoch 6")
    with pytest.raises(ValueError):
        next(watch(range(1), tmp_path, reporter=reporter, epoch=-1))


def test_jobs_keep_each_epoch_and_where_it_began_in_the_backend():
    jobs = Jobs()
    usage = [0, 0, 0]

    def report(rank, epoch, steps, now, wait=1.0, compute=3.0):
        r = Report("train", rank, steps, wait, compute, epoch=epoch)
        jobs.report(r, now, tuple(usage) if jobs.new_epoch(r) else None)

    report(0, 0, 10, 100.0)
    report(1, 0, 10, 101.0)
    usage[:] = [500, 2, 1 << 30]
    report(0, 1, 4, 200.0)
    usage[:] = [510, 2, (1 << 30) + 5]
    report(1, 1, 4, 201.0)  # (the job's mark for epoch 1 was set by rank 0)
    report(0, 1, 6, 250.0)
    marks = jobs.marks("train")
    assert [(m.epoch, m.usage) for m in marks] == [(0, (0, 0, 0)), (1, (500, 2, 1 << 30))]
    by_rank = {s.rank: s for s in jobs.statistics()}
    assert [(e.epoch, e.steps, e.first_report, e.last_report) for e in by_rank[0].epochs] == [
        (0, 10, 100.0, 100.0), (1, 10, 200.0, 250.0)]
    # The job runs again: its epochs begin afresh, and so do its marks.
    usage[:] = [900, 3, 2 << 30]
    report(0, 0, 2, 400.0)
    assert [(m.epoch, m.usage) for m in jobs.marks("train")] == [(0, (900, 3, 2 << 30))]
    assert [(e.epoch, e.steps) for e in {s.rank: s for s in jobs.statistics()}[0].epochs] == [(0, 2)]
    report(1, 0, 2, 401.0)  # its other rank restarts after the new mark was set: the mark stays
    assert [m.usage for m in jobs.marks("train")] == [(900, 3, 2 << 30)]
    # Bounded: the last MAX_EPOCHS epochs of a rank, and marks of a job.
    for n in range(1, MAX_EPOCHS + 20):
        report(0, n, 1, 500.0 + n)
    rank0 = {s.rank: s for s in jobs.statistics()}[0]
    assert len(rank0.epochs) == MAX_EPOCHS and rank0.epochs[-1].epoch == MAX_EPOCHS + 19
    assert len(jobs.marks("train")) == MAX_EPOCHS


def test_watch_costs_microseconds_per_step(tmp_path):
    """Not a timing assertion on the machine's speed: the loop's own cost, against a bare loop over the
    same iterable, must stay within a bound that a lock, a syscall or a report per step would exceed."""
    reporter = Reporter(tmp_path, "j", 0, Meter(), interval=3600, send=Recorder())
    n = 200_000
    start = time.perf_counter()
    for _ in range(n):
        pass
    bare = time.perf_counter() - start
    start = time.perf_counter()
    for _ in watch(range(n), tmp_path, reporter=reporter):
        pass
    watched = time.perf_counter() - start
    reporter.close()
    assert (watched - bare) / n < 20e-6


@requires_fuse
def test_a_watched_loop_shows_up_in_status_and_metrics(tmp_path, s3_client, fresh_bucket, mount_factory):
    files = [SampleFile(f"d/{i}.bin", 4096) for i in range(20)]
    upload(s3_client, fresh_bucket, "", files)
    m = mount_factory(f"s3://{fresh_bucket}")
    with m:
        def loader():
            for f in files:
                yield m.path(f.key).read_bytes()

        got = list(watch(loader(), m.mountpoint, job="unit-test", rank=2, interval=0.05))
        assert got == [f.content() for f in files]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            jobs = m.status()["jobs"]
            if jobs and jobs[0]["steps"] == 20:
                break
            time.sleep(0.05)
        (job,) = jobs
        assert (job["job"], job["rank"], job["steps"]) == ("unit-test", 2, 20)
        assert job["data_wait_seconds"] > 0
        # Hostile reports change nothing.
        for bad in ({"job": "x\ny", "rank": 0, "steps": 1, "data_wait": 0, "compute": 0},
                    {"job": "x", "rank": -1, "steps": 1, "data_wait": 0, "compute": 0},
                    {"job": "x", "rank": 0, "steps": 1, "data_wait": float("inf"), "compute": 0},
                    {"job": "x", "rank": 0, "steps": 1, "data_wait": 0, "compute": 0, "gpu_utilization": 101}):
            with pytest.raises(Exception, match="must"):
                request(m.mountpoint, "report", **bad)
        assert len(m.status()["jobs"]) == 1
        addr = m.status()["metrics_addr"]
        page = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
        steps = [line for line in page.splitlines() if line.startswith("epochfs_job_steps_total{")]
        assert len(steps) == 1 and 'training_job="unit-test"' in steps[0] and 'rank="2"' in steps[0]
        assert steps[0].endswith(" 20.0")
        assert "epochfs_job_data_wait_seconds_total" in page


def test_reports_racing_the_loop_lose_and_double_count_no_step(tmp_path):
    rec = Recorder()
    reporter = Reporter(tmp_path, "j", 0, Meter(), interval=0.01, send=rec)
    done = threading.Event()

    def loop():
        for _ in watch(range(50_000), tmp_path, reporter=reporter):
            pass
        done.set()

    t = threading.Thread(target=loop)
    t.start()
    t.join(30)
    reporter.report()
    reporter.close()
    assert done.is_set()
    assert sum(r["steps"] for r in rec.sent) == 50_000  # reports raced the loop; none lost or counted twice


@requires_fuse
def test_a_daemon_killed_mid_epoch_does_not_stop_the_loop(tmp_path, s3_client, fresh_bucket, mount_factory, caplog):
    upload(s3_client, fresh_bucket, "", [SampleFile("a.bin", 1000)])
    m = mount_factory(f"s3://{fresh_bucket}")
    with m:
        pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))

        def loader():
            for i in range(60):
                if i == 20:
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.01)
                yield i

        start = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="epochfs.watch"):
            assert list(watch(loader(), m.mountpoint, job="killed", interval=0.02)) == list(range(60))
            time.sleep(0.2)
        assert time.perf_counter() - start < 5
        assert any("cannot report" in r.message for r in caplog.records)


def test_a_jobs_name_never_takes_prometheus_job_label():
    """A training job's name is its user's choice: it is exported as `training_job`, and neither the
    bare-metal scrape config nor the PodMonitor lets an exported label replace the target's `job`."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    config = yaml.safe_load((root / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert not any(job.get("honor_labels") for job in config["scrape_configs"])
    rules = (root / "deploy" / "prometheus" / "epochfs-rules.yml").read_text()
    assert "by (training_job, rank, node, mountpoint)" in rules and "$labels.job " not in rules
