"""A cluster in a box, small: an object store behind a shaped link that two GPU nodes share, each node
a network namespace with its own shaped link, each mounting for real (``benchmarks/cluster/netbox.py``, the
machinery of ``benchmarks/cluster/clusterbox.py``). The shared link runs full; each node reads every byte
right, knows its own link from its interface (the shaping in its namespace) and measures the narrower
share of the shared one, which its utilisation is then taken against (so the 70% alarm can fire with
no flag); and nothing of the box is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from epochfs.control import request
from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import namespaces_work

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCH / "cluster"), str(BENCH / "shared")]
from netbox import NetBox  # noqa: E402

MiB = 1 << 20
WAN = 8 * MiB  # the object store's link, shared
NODE = 16 * MiB  # each node's own


@requires_fuse
@pytest.mark.mounts
@pytest.mark.skipif(not namespaces_work(), reason="network namespaces cannot be made here (needs root and ip)")
def test_nodes_behind_a_shared_link_read_exactly_and_measure_their_share(tmp_path, s3, s3_client, fresh_bucket):
    files = {i: [SampleFile(f"n{i}/{k:02d}.bin", 2 * MiB + 4099 * k) for k in range(32)] for i in range(2)}
    upload(s3_client, fresh_bucket, "", [f for group in files.values() for f in group])
    env = {**s3.env(), "PYTHONUNBUFFERED": "1"}
    env.pop("AWS_CA_BUNDLE", None)
    with NetBox("efct", tmp_path) as box:
        store = box.host("store", rate_in=WAN, rate_out=WAN)
        gpus = [box.host(f"gpu{i}", rate_in=NODE, rate_out=NODE) for i in range(2)]
        assert len(box.namespaces()) == 4  # (the switch, the store, two nodes)
        box.portal(f"{store.address}:9000", f"127.0.0.1:{s3.port}", listen_in=store)
        mounts = []
        for host in gpus:
            mnt = tmp_path / host.name / "mnt"
            mnt.mkdir(parents=True)
            r = subprocess.run(host.command(sys.executable, "-m", "epochfs", "mount", f"s3://{fresh_bucket}", str(mnt),
                                            "--endpoint-url", f"http://{store.address}:9000", "--cache-dir",
                                            str(tmp_path / host.name / "cache"), "--metrics-addr", "off",
                                            "--metrics-targets", "off"), env=env, capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, r.stderr
            mounts.append(mnt)
        wrong: list[str] = []
        sent0, started = store.sent_bytes(), time.monotonic()

        def read(i: int) -> None:
            for f in files[i]:
                with open(mounts[i] / f.key, "rb", buffering=0) as fh:
                    if fh.read() != f.content():
                        wrong.append(f.key)

        threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        seconds = time.monotonic() - started
        assert not wrong
        total = sum(f.size for group in files.values() for f in group)
        sent = store.sent_bytes() - sent0
        assert sent >= total and sent / seconds > 0.8 * WAN, (sent, seconds)  # the shared link ran full
        assert seconds > total / WAN * 0.9  # and bounded them: no faster than it
        deadline = time.monotonic() + 25  # (each node looks at its transfers every 10 s)
        while True:
            links = [request(m, "status")["backend"] for m in mounts]
            if all((b["link"] or {}).get("source") == "measured" for b in links) or time.monotonic() > deadline:
                break
            time.sleep(1)
        for b in links:
            link = b["link"]
            assert link["interface"]["bytes_per_second"] == NODE and "ingress shaped" in link["interface"]["detail"], link
            assert link["source"] == "measured", link  # the shared link, narrower than its own
            assert 0.25 * WAN < link["bytes_per_second"] < 0.8 * NODE, link
            assert b["bandwidth_limit"] == link["bytes_per_second"]
            assert "under the interface's" in link["detail"]
        text = subprocess.run([sys.executable, "-m", "epochfs", "status", str(mounts[0])], capture_output=True,
                              text=True, timeout=30).stdout
        assert "(measured " in text and "measured: measured" not in text, text  # (said once)
        for m in mounts:
            subprocess.run([sys.executable, "-m", "epochfs", "umount", str(m)], capture_output=True, timeout=60)
    assert not box.namespaces()
    assert not any(str(tmp_path) in line for line in Path("/proc/self/mounts").read_text().splitlines())
    assert all(os.path.isdir(m) for m in mounts)
    json.dumps(links)


def test_a_benchmark_clears_only_its_own_work_directory_and_fuse_mounts(tmp_path):
    """A benchmark's --work: mounts matched by whole path components (never /srv/box2 for /srv/box), FUSE
    ones only, escaped names read back; a directory that holds anything and was not made by a benchmark
    is refused (``--work /tmp`` would clear other jobs' files), one it made is cleared and made again."""
    from workloads import WORK_MARK, fresh_workdir, fuse_mounts_under

    info = "\n".join([
        "36 25 0:32 / /srv/box/m rw - fuse.epochfs epochfs rw",
        "37 25 0:33 / /srv/box2/m rw - fuse.epochfs epochfs rw",  # (a sibling whose name starts the same)
        "38 25 0:34 / /srv/box rw - ext4 /dev/sda1 rw",  # (not FUSE: never the tool's)
        "39 25 0:35 / /srv/box/with\\040space/deep rw - fuse.s3fs s3fs rw",
        "40 25 0:36 / /srv/boxes rw - fuse rclone rw",
    ])
    assert fuse_mounts_under(Path("/srv/box"), info) == ["/srv/box/with space/deep", "/srv/box/m"]
    assert fuse_mounts_under(Path("/srv/box/"), info) == ["/srv/box/with space/deep", "/srv/box/m"]
    others = tmp_path / "shared"
    others.mkdir()
    (others / "someone-elses.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a benchmark's work directory"):
        fresh_workdir(others)
    assert (others / "someone-elses.txt").read_text() == "keep me"
    work = tmp_path / "work"
    fresh_workdir(work)  # new: made, and marked
    assert (work / WORK_MARK).exists()
    (work / "left-by-a-run").write_text("x")
    fresh_workdir(work)  # its own: cleared
    assert sorted(p.name for p in work.iterdir()) == [WORK_MARK]


@pytest.mark.skipif(not namespaces_work(), reason="network namespaces cannot be made here (needs root and ip)")
def test_a_box_is_torn_down_on_sigterm_and_a_killed_ones_leftovers_go_at_the_next_start(tmp_path):
    """SIGTERM (kill, a timeout, systemd) ends a benchmark through its tear-down as Ctrl-C does; a box
    whose process was killed outright (SIGKILL) leaves namespaces and processes, and the next box of
    that tag removes them, by its own names only, leaving a live box's alone."""
    here = BENCH / "cluster"
    script = f"""
import os, signal, subprocess, sys, time
sys.path[:0] = [{str(here)!r}, {str(BENCH / "shared")!r}]
from pathlib import Path
from netbox import NetBox
from workloads import stop_on_signals
stop_on_signals()
with NetBox("efsg", Path(sys.argv[1])) as box:
    host = box.host("h0", rate_in=1 << 20, rate_out=1 << 20)
    host.popen("sleep", "600", log=Path(sys.argv[1]) / "sleep.log")
    print("up", flush=True)
    time.sleep(600)
"""
    said: list[str] = []

    def start() -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        while (line := proc.stdout.readline().strip()) != "up":
            assert line, "the box did not start"
            said.append(line)
        return proc

    def listed() -> str:
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    proc = start()
    assert f"efsg{proc.pid}-h0" in listed()
    proc.send_signal(15)
    assert proc.wait(timeout=60) != 0
    assert "efsg" not in listed()  # torn down
    killed = start()
    killed.kill()
    killed.wait()
    assert f"efsg{killed.pid}-h0" in listed()  # left behind
    live = start()  # (its box removes the killed one's before it starts, and says so)
    assert any(f"efsg{killed.pid}-h0" in line for line in said), said
    try:
        with NetBox("efsg", tmp_path):
            names = listed()
            assert f"efsg{killed.pid}-" not in names and f"efsg{live.pid}-h0" in names, names
    finally:
        live.send_signal(15)
        live.wait(timeout=60)
    assert "efsg" not in listed()


def test_the_steady_part_sets_the_links_sends_beside_the_readers_pace():
    """The plan predicts a long epoch, whose links send what the readers read; in the box's short epoch
    the prefetch lead shrinks over the steady part, so its sends fall short of the reads: both are kept,
    and the readers' pace against the links and against the accelerators' demand."""
    from clusterbox import QUICK, Mark, _steady

    dataset = 640 * MiB
    capacity = 2 * 18 * MiB
    first = Mark(100.0, 0, 1000 * MiB, 0.10, (500, 1000), (400 * MiB, 600 * MiB))
    last = Mark(116.0, 0, 1000 * MiB + 480 * MiB, 0.90, (3500, 4200), (680 * MiB, 800 * MiB))
    mid = _steady(first, last, QUICK, dataset, capacity, 18 * MiB)  # 512 MiB read, 480 MiB sent in 16 s
    assert mid["seconds"] == 16.0 and mid["wan_utilisation"] == 0.0
    assert abs(mid["cache_link_utilisation"] - 480 / (36 * 16)) < 1e-9
    assert abs(mid["cache_link_carried"] - 512 / (36 * 16)) < 1e-9
    assert mid["lead_shrunk_bytes"] == 32 * MiB
    demand = QUICK.gpu_demand * QUICK.accelerators * QUICK.gpu_nodes
    assert abs(mid["pace"] - min(1.0, 512 * MiB / 16 / demand)) < 1e-9
    assert abs(mid["host_cpu"] - 3000 / 3200) < 1e-9
    assert [round(u, 6) for u in mid["cache_link_by_node"]] == [round(280 / (18 * 16), 6), round(200 / (18 * 16), 6)]
    assert _steady(first, last, QUICK, dataset, 0)["cache_link_carried"] is None  # (no cache nodes: the WAN only)
