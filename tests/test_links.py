"""The links' capacities (:mod:`epochfs.links`): the meter's windows, the interface's speed and shaping
read from ``tc``'s own output, which figure wins, and, in a network namespace of the test's own with a
shaped link, what a process there reads of the link it sends and receives over."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pytest

from epochfs.cli.status import format_link
from epochfs.links import capacity, interface, meter
from epochfs.links.meter import BUSY, HOLD, MIN_BYTES, WINDOW, Measurement, Transfer, TransferMeter

from .helpers import namespaces_work

MiB = 1 << 20
GiB = 1 << 30


def test_union_length_counts_overlaps_once():
    assert meter.union_length([]) == 0
    assert meter.union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert meter.union_length([(0, 10), (1, 2), (3, 4)]) == pytest.approx(10.0)
    rng = random.Random(7)
    for _ in range(200):  # against a fine grid
        spans = [(a, a + rng.random() * 3) for a in (rng.random() * 10 for _ in range(rng.randrange(1, 8)))]
        grid = sum(1 for i in range(13000) if any(lo <= i / 1000 < hi for lo, hi in spans)) / 1000
        assert meter.union_length(spans) == pytest.approx(grid, abs=0.02)


def test_a_busy_window_measures_the_rate_while_bytes_moved():
    # four transfers side by side, bytes moving 8 s of 10: the link carried 64 MiB in 8 s
    ts = [Transfer(1 + 2 * i, 3 + 2 * i, 16 * MiB) for i in range(4)]
    got = meter.window_rate(ts, 0, 10)
    assert got is not None and got.bytes_per_second == pytest.approx(8 * MiB) and got.busy == pytest.approx(0.8)


def test_a_mostly_idle_window_measures_nothing():
    # a reader whose demand is low: quick transfers, the link idle most of the window
    ts = [Transfer(i, i + 0.01, 4 * MiB) for i in range(10)]
    assert meter.window_rate(ts, 0, 10) is None
    # busy enough, but too few bytes to say anything
    assert meter.window_rate([Transfer(0, 9, MIN_BYTES - 1)], 0, 10) is None
    assert meter.window_rate([Transfer(0, BUSY * 10 - 0.01, 64 * MiB)], 0, 10) is None


def test_transfers_across_the_edges_count_their_part_inside():
    got = meter.window_rate([Transfer(-5, 5, 20 * MiB), Transfer(5, 15, 20 * MiB)], 0, 10)
    assert got is not None and got.bytes_per_second == pytest.approx(2 * MiB) and got.busy == pytest.approx(1.0)


def test_waiting_for_the_first_byte_is_not_link_time():
    """A far endpoint (the time before the first byte) is not a narrow link: only body time counts."""
    m = TransferMeter(clock=lambda: 0.0)
    for i in range(100):  # 100 requests each waiting 95 ms, then 1 MiB in 5 ms: 200 MiB/s while moving
        start = i * 0.1 + 0.095
        m.record(start, start + 0.005, MiB)
    assert m.sample(10.0) is None  # bytes moved 5% of the window: the link is idle, whatever the latency


def test_the_capacity_is_the_best_recent_window_else_the_last():
    now = [0.0]
    m = TransferMeter(clock=lambda: now[0])
    assert m.measured() is None

    def busy_window(rate: float) -> None:
        start = now[0]
        m.record(start, start + WINDOW, int(rate * WINDOW))
        now[0] += WINDOW
        assert m.sample() is not None

    busy_window(40 * MiB)
    busy_window(10 * MiB)  # the link is shared now: a window gives less
    assert m.measured().bytes_per_second == pytest.approx(40 * MiB)  # (the best of the last HOLD seconds)
    busy_window(10 * MiB)
    busy_window(10 * MiB)  # windows in a row are averaged, RUN at a time: (40 + 10 + 10) / 3, then 10
    assert [round(x.bytes_per_second / MiB) for x in m._measurements] == [40, 25, 20, 10]
    assert m.busy_seconds == pytest.approx(4 * WINDOW)
    now[0] += HOLD  # idle since
    assert m.sample() is None
    assert m.measured().bytes_per_second == pytest.approx(10 * MiB)  # nothing newer: the last one measured
    busy_window(6 * MiB)  # (after the idle gap, a run of its own)
    assert m.measured().bytes_per_second == pytest.approx(6 * MiB)
    assert m.busy_seconds == pytest.approx(5 * WINDOW)


def test_a_meter_keeps_a_bounded_record_from_many_threads():
    import threading

    m = TransferMeter(clock=lambda: 0.0)

    def worker() -> None:
        for i in range(30000):
            m.record(i * 1e-4, i * 1e-4 + 1e-4, 1000)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(m._transfers) == meter.KEPT


# -- tc's output, as this kernel's tc prints it (tc -j) -------------------------------------------

TBF = [{"kind": "tbf", "handle": "8001:", "root": True, "refcnt": 3,
        "options": {"rate": 26214400, "burst": 262144, "lat": 50000}}]
HTB = [{"kind": "htb", "handle": "1:", "root": True, "options": {"r2q": 10, "default": "0x10"}}]
HTB_CLASSES = [{"class": "htb", "handle": "1:1", "root": True, "rate": 12500000, "ceil": 25000000},
               {"class": "htb", "handle": "1:10", "parent": "1:1", "rate": 1000, "ceil": 99999999999}]
INGRESS = [{"parent": "ffff:", "protocol": "all", "pref": 49152, "kind": "u32", "chain": 0},
           {"parent": "ffff:", "protocol": "all", "pref": 49152, "kind": "u32", "chain": 0,
            "options": {"fh": "800::800", "actions": [{"order": 1, "kind": "mirred", "mirred_action": "redirect",
                                                      "direction": "egress", "to_dev": "ifb0"}]}}]


def test_shaping_is_read_from_tc_output():
    assert interface.qdisc_rate(TBF) == 26214400
    assert interface.qdisc_rate(HTB, HTB_CLASSES) == 25000000  # the root class's ceiling, not a leaf's
    assert interface.qdisc_rate([{"kind": "noqueue", "root": True, "options": {}}]) is None
    assert interface.qdisc_rate([{"kind": "tbf", "root": False, "options": {"rate": 5}}]) is None
    assert interface.ingress_redirect(INGRESS) == "ifb0"
    assert interface.ingress_redirect([{"kind": "u32", "options": {"actions": [{"kind": "gact"}]}}]) is None


def test_odd_tc_output_is_not_a_capacity():
    rng = random.Random(3)
    atoms = [None, True, 0, -5, 1.5, "x", [], {}, {"root": True}, {"kind": "tbf", "root": True, "options": []}]
    for _ in range(2000):
        def junk(depth: int = 0):  # type: ignore[no-untyped-def]
            if depth > 3 or rng.random() < 0.4:
                return rng.choice(atoms)
            if rng.random() < 0.5:
                return [junk(depth + 1) for _ in range(rng.randrange(3))]
            keys = ["kind", "root", "options", "rate", "ceil", "class", "actions", "to_dev", "mirred_action"]
            return {rng.choice(keys): junk(depth + 1) for _ in range(rng.randrange(4))}
        rate = interface.qdisc_rate(junk(), junk())
        assert rate is None or rate > 0
        dev = interface.ingress_redirect(junk())
        assert dev is None or isinstance(dev, str)


def test_the_default_route_and_network_mounts_are_found():
    from epochfs.backend.local import mount_server

    table = ("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
             "eth1\t0012A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
             "eth0\t00000000\t0102A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")
    assert interface.default_route_interface(table) == "eth0"
    assert interface.default_route_interface(table.splitlines()[0]) is None
    info = "\n".join([
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
        "40 22 0:40 / /data rw,relatime shared:2 - nfs4 filer.example:/export/data rw,vers=4.2",
        "41 40 0:41 / /data/local rw shared:3 - tmpfs tmpfs rw",
        "42 22 0:42 / /mnt/smb rw shared:4 - cifs //nas/share rw",
        "43 22 0:43 / /lustre rw shared:5 - lustre 10.0.0.9@tcp:/fs rw",
        "44 22 0:44 / /v6 rw shared:6 - nfs [fd00::5]:/x rw",
    ])
    assert mount_server(info, "/data/train/000.jpg") == ("filer.example", 2049)
    assert mount_server(info, "/data/local/x") is None  # the deeper mount is local
    assert mount_server(info, "/mnt/smb/a") == ("nas", 445)
    assert mount_server(info, "/lustre/ds") == ("10.0.0.9", 988)
    assert mount_server(info, "/v6/ds") == ("fd00::5", 2049)
    assert mount_server(info, "/home") is None
    assert mount_server("garbage\n - \n", "/x") is None


def test_an_interface_that_states_no_speed_says_so_and_how_to_declare_the_link():
    lo = interface.towards("127.0.0.1", 9000)  # no speed, no shaping: measured or nothing
    assert lo is not None and lo.bytes_per_second == 0 and "states no speed" in lo.detail
    assert interface.towards("no-such-host.invalid", 9000) is None
    view = capacity.choose(None, lo, None, "--backend-bandwidth")
    assert view.capacity is None
    assert "lo states no speed" in view.unknown and "--backend-bandwidth 25Gbit" in view.unknown
    text = format_link(view.as_dict(), "--backend-bandwidth")
    assert text.startswith("link capacity not known (lo states no speed") and "--backend-bandwidth RATE" in text
    assert len(text) < 160, text  # (read at every status: the cause at length is in --json)
    declared = capacity.choose(25e9 / 8, lo, None, "--backend-bandwidth")  # declared: it is the capacity
    assert declared.capacity.source == "declared" and declared.unknown is None


def test_a_measured_capacity_is_never_below_a_window_it_measured():
    """The capacity measured is a mean of busy windows in a row; a single busier window raises it, so a
    rate seen on the link never reads as more than all of it (a link shaped to 160 Mbit/s once read
    15.5 MiB/s against 18.7 measured)."""
    clock = [0.0]
    meter = TransferMeter(clock=lambda: clock[0])
    for k, rate in enumerate((12e6, 12e6, 19.5e6)):  # three busy windows: the mean 14.5 MB/s, the last 19.5
        lo = k * WINDOW
        meter.record(lo, lo + WINDOW, int(rate * WINDOW))
        clock[0] = lo + WINDOW
        meter.sample()
    got = meter.measured()
    assert got is not None and got.bytes_per_second == pytest.approx(19.5e6)


def test_a_declared_capacity_wins_else_the_lower_of_interface_and_measured():
    nic = interface.InterfaceCapacity("eth0", 1.25e9, "eth0, speed 10 Gbit/s")
    shared = Measurement(0.0, 30e6, 0.9)
    view = capacity.choose(5e9, nic, shared, "--backend-bandwidth")
    assert (view.capacity.source, view.capacity.bytes_per_second) == ("declared", 5e9)
    view = capacity.choose(None, nic, shared, "--backend-bandwidth")  # a shared uplink: the transfers show it
    assert (view.capacity.source, view.capacity.bytes_per_second) == ("measured", 30e6)
    assert "under the interface's 10 Gbit/s" in view.capacity.detail
    view = capacity.choose(None, nic, Measurement(0.0, 2e9, 0.9), "--backend-bandwidth")
    assert (view.capacity.source, view.capacity.bytes_per_second) == ("interface", 1.25e9)
    # its own link full, less the protocols' bytes: the interface's figure stands
    view = capacity.choose(None, nic, Measurement(0.0, 0.9 * 1.25e9, 0.99), "--backend-bandwidth")
    assert (view.capacity.source, view.capacity.bytes_per_second) == ("interface", 1.25e9)
    assert capacity.choose(None, None, None, "--backend-bandwidth").capacity is None
    assert capacity.choose(None, None, shared, "x").as_dict()["source"] == "measured"
    text = format_link(capacity.choose(None, None, shared, "x").as_dict(), "x")
    assert text.startswith("link 28.6 MiB/s (measured 28.6 MiB/s") and "measured: measured" not in text, text


# -- a shaped link in a network namespace of the test's own ------------------------------------------

@pytest.mark.skipif(not namespaces_work(), reason="network namespaces cannot be made here (needs root and ip)")
def test_a_process_in_a_namespace_reads_its_shaped_link(tmp_path):
    """Received traffic shaped through an ifb, sent traffic by a tbf: each direction is read as shaped."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" / "cluster"))
    from netbox import NetBox

    with NetBox("eflk") as box:
        node = box.host("node", rate_in=40 * MiB, rate_out=25 * MiB)
        other = box.host("other")
        probe = textwrap.dedent(f"""
            import json
            from epochfs.links import interface
            rx = interface.towards({other.address!r}, 9000)
            tx = interface.holding({node.address!r})
            print(json.dumps([rx.bytes_per_second, rx.detail, tx.bytes_per_second, tx.detail]))
        """)
        out = subprocess.run(node.command(sys.executable, "-c", probe), capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        rx, rx_detail, tx, tx_detail = json.loads(out.stdout)
        assert rx == 40 * MiB and "ingress shaped" in rx_detail, rx_detail
        assert tx == 25 * MiB and "egress shaped" in tx_detail, tx_detail
    assert box.name_prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


# -- a cluster sized on paper (epochfs plan --cluster) --------------------------------------------

def test_a_cluster_on_paper_follows_its_links():
    from epochfs.links.sizing import Cluster, cache_nodes_needed, plan

    c = Cluster(nodes=4, gpus_per_node=2, gpu_demand=4 * MiB, dataset=512 * MiB, wan=25 * MiB, node_link=40 * MiB,
                cache_node_link=40 * MiB)
    assert c.demand == 32 * MiB and c.node_demand == 8 * MiB
    assert cache_nodes_needed(c) == 2  # 32 MiB/s over links of 40: two keep them at 40%, one would be at 80%
    p = plan(c)
    plain, cold, warm = (p["setups"][k] for k in ("plain", "cold-cache-nodes", "warm-cache-nodes"))
    # plain: the object store's link carries the whole first epoch: 32 of 25 MiB/s asked, AU 25/32
    assert plain["epoch1"]["au"] == pytest.approx(25 / 32) and plain["epoch1"]["wan_utilisation"] == 1.0
    assert plain["epoch1"]["bound"] == "the object store's link"
    assert plain["epoch2"]["backend_bytes_per_dataset"] == pytest.approx(0.75)  # each node held a quarter
    # warmed cache nodes: nothing over the WAN; their links 40% busy; every GPU fed; in a later epoch
    # each node finds the quarter it read before in its own cache: the cache nodes' links carry the rest
    assert warm["epoch1"]["wan_utilisation"] == 0 and warm["epoch1"]["cache_node_link_utilisation"] == pytest.approx(0.4)
    assert warm["epoch2"]["cache_node_link_utilisation"] == pytest.approx(0.3)
    assert warm["epoch2"]["node_link_utilisation"] == pytest.approx(0.75 * 8 / 40) and warm["epoch2"]["au"] == 1.0
    assert plain["epoch2"]["node_link_utilisation"] == pytest.approx(0.75 * 8 / 40)  # (24 of the WAN's 25 MiB/s: AU 1)
    assert warm["epoch1"]["au"] == 1.0 and warm["epoch1"]["bound"] == "none"
    assert warm["warmup_seconds"] == pytest.approx(512 / 25)
    assert cold["epoch1"]["au"] == pytest.approx(25 / 32) and cold["epoch2"]["au"] == 1.0
    # links too narrow for the cache nodes given: they bound the epoch, busy all the time
    narrow = plan(Cluster(4, 2, 4 * MiB, 512 * MiB, 25 * MiB, 40 * MiB, 12 * MiB, cache_nodes=2))
    e = narrow["setups"]["warm-cache-nodes"]["epoch1"]
    assert e["cache_node_link_utilisation"] == 1.0 and e["au"] == pytest.approx(24 / 32)
    assert e["bound"] == "the cache nodes' links" and narrow["cache_nodes_needed"] == 4  # 32 / (0.7 * 12)
    # space: cache nodes enough to hold the dataset twice
    assert cache_nodes_needed(Cluster(4, 2, 1, 10 * GiB, 1, 1, 1e12, replicas=2, cache_node_cache=3 * GiB)) == 7


def test_cache_nodes_are_sized_against_the_link_that_binds_first():
    """GPU nodes whose own links carry less than their GPUs ask (4 x 8 GPUs of 3D U-Net, 192 Gbit/s a node on
    100 Gbit/s links) take in 400 Gbit/s whatever the cache nodes send: the cache nodes are sized for
    that (6 at 70% of 100 Gbit/s), not for the 770 asked (11), and the plan says which bound it."""
    from epochfs.links.sizing import WORKLOADS, Cluster, cache_nodes_needed, plan

    gbit = 1e9 / 8
    c = Cluster(4, 8, WORKLOADS["unet3d"], 10 * 2**40, 100 * gbit, 100 * gbit, 100 * gbit)
    assert cache_nodes_needed(c) == 6
    p = plan(c)
    assert p["sized_for"] == {"bytes_per_second": 400 * gbit, "bound": "the GPU nodes' links"}
    warm = p["setups"]["warm-cache-nodes"]["epoch1"]
    assert warm["bound"] == "the GPU nodes' links" and warm["cache_node_link_utilisation"] <= 0.7
    light = Cluster(4, 2, WORKLOADS["resnet50"], 2**40, 10 * gbit, 100 * gbit, 100 * gbit)
    assert plan(light)["sized_for"]["bound"] == "the GPUs' demand"
    text = subprocess.run([sys.executable, "-m", "epochfs", "plan", "--cluster", "--nodes", "4", "--gpus-per-node", "8",
                           "--workload", "unet3d", "--dataset", "10T", "--wan", "100Gbit", "--node-link", "100Gbit"],
                          capture_output=True, text=True, timeout=60).stdout
    assert "under 70%: 6, sized for 400 Gbit/s (bound first by the GPU nodes' links" in text, text
    assert "assumptions:" in text


def test_plan_cluster_options_are_bounded_where_they_are_parsed():
    """Numbers beyond a float (a --nodes of 400 digits, a --dataset of 10^400 bytes), infinities, NaNs and
    negatives: each is the tool's one-line error (exit 2), never a traceback; a fuzz loop over every
    numeric option of plan --cluster holds to that, and what it accepts plans."""
    import random

    from epochfs.cli import build_parser
    from epochfs.cli.epoch import cmd_plan_cluster
    from epochfs.core.errors import ConfigError

    base = ["plan", "--cluster", "--workload", "unet3d", "--nodes", "4", "--dataset", "1T", "--wan", "1Gbit",
            "--node-link", "1Gbit"]
    for flag, value, message in (("--nodes", "9" * 400, "not a whole number"), ("--dataset", "1" + "0" * 400, "8 EiB"),
                                 ("--wan", "1" + "0" * 400 + "Gbit", "not a rate"), ("--wan", "1" + "0" * 30 + "Gbit", "8 EiB"), ("--nodes", "0", "is not from 1"),
                                 ("--replicas", "-3", "is not from 1"), ("--wan", "nan", "not a rate"),
                                 ("--cache-node-cache", "inf", "not a size")):
        r = subprocess.run([sys.executable, "-m", "epochfs", *base, flag, value], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (flag, r.stderr[-500:])
    rng = random.Random(7)
    numbers = ["0", "1", "-1", "8", "1e3", "1.5", "9" * 30, "9" * 400, "nan", "inf", "1e999", "0.0001", "+2", " 3 ",
               "1" + "0" * 19, "18446744073709551616"]
    units = ["", "G", "T", "Gbit", "Tbit", "EiB", "K", "%", "Mbit/s"]
    flags = {"--nodes": "", "--gpus-per-node": "", "--cache-nodes": "", "--replicas": "", "--dataset": "u",
             "--wan": "u", "--node-link": "u", "--cache-node-link": "u", "--cache-node-cache": "u", "--gpu-demand": "u"}
    parser = build_parser()
    for _ in range(400):
        argv = [a for a in base if a not in ("--workload", "unet3d")]
        for flag, kind in rng.sample(sorted(flags.items()), rng.randrange(1, 4)):
            argv += [flag, rng.choice(numbers) + (rng.choice(units) if kind else "")]
        argv += ["--workload", "unet3d"] if "--gpu-demand" not in argv else []
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 2
            continue
        try:
            cmd_plan_cluster(args)
        except ConfigError:
            pass  # (said in one line by the CLI)


def test_a_cluster_that_cannot_be_planned_says_why():
    from epochfs.links.sizing import Cluster

    assert Cluster(0, 8, 1.0, 1.0, 1.0, 1.0, 1.0).problems() == ["--nodes must be at least 1"]
    assert "--wan must be above 0" in Cluster(1, 8, 1.0, 1.0, float("nan"), 1.0, 1.0).problems()
    assert "--cache-nodes must be at least 1" in Cluster(1, 8, 1.0, 1.0, 1.0, 1.0, 1.0, cache_nodes=0).problems()


def test_plan_cluster_on_the_command_line():
    base = [sys.executable, "-m", "epochfs", "plan", "--cluster", "--nodes", "125", "--workload", "resnet50",
            "--dataset", "20T", "--wan", "100Gbit", "--node-link", "100Gbit"]
    out = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["inputs"]["gpu_demand"] == pytest.approx(0.19 * GiB) and got["cache_nodes_needed"] == 24
    text = subprocess.run(base, capture_output=True, text=True, timeout=60).stdout
    assert "cache nodes that keep their links under 70%: 24" in text and "1000" in text
    bad = subprocess.run([*base[:7], "--dataset", "20T"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "plan --cluster needs --gpu-demand or --workload, --wan, --node-link" in bad.stderr
    bad = subprocess.run([*base[:4]], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--manifest and --cache-size" in bad.stderr
