"""Hosts in network namespaces on one bridge, each with a link shaped in both directions, for measuring
a cluster on one machine where links can run out.

Every host is a namespace with one veth link (``eth0``) to a bridge that lives in a namespace of its own
(the switch), so nothing is added to the machine's own namespace. What a host sends is shaped by a
``tbf`` on its ``eth0``; what it receives by a ``tbf`` on an ``ifb`` device its ingress is redirected to
(this kernel has tbf, htb, ifb, u32 and mirred, not netem: delay comes from a userspace proxy). The
shaping lives in the host's own namespace, so a daemon there reads its link's capacity as it would on
a real node. Addresses are from the benchmarking range 198.18.0.0/24 inside the box's own bridge: no
other address is ever a target.

Commands run in a host's namespace through ``nsenter --net``: a FUSE mount made there is seen by the
machine's readers (``ip netns exec`` would give it a mount namespace of its own). Tear-down (on exit,
also after a failure or an interrupt) kills every process in the box's namespaces, lazily unmounts
what was mounted under its work directory, and deletes the namespaces, which takes their links and
qdiscs with them; it checks that none is left.

    with NetBox("efcb") as box:
        store = box.host("store", rate_out=25 << 20)
        node = box.host("gpu0", rate_in=40 << 20, rate_out=40 << 20)
        subprocess.run(node.command("curl", f"http://{store.address}:9000/"))
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # (whoever imports this module)
import latency_proxy  # noqa: E402

SUBNET = "198.18.0"
NETNS_DIR = Path("/var/run/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tc(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, check=True, timeout=30)


def burst_for(rate: float) -> int:
    """A tbf bucket for ``rate`` bytes/s: at least 10 ms of it (the timer's granularity) and 64 KiB."""
    return max(64 << 10, int(rate / 100))


@dataclass
class Host:
    box: NetBox
    name: str
    ns: str
    address: str
    rate_in: float | None = None
    rate_out: float | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def command(self, *argv: str) -> list[str]:
        """``argv`` run in this host's network namespace (the machine's mount namespace)."""
        return ["nsenter", f"--net={NETNS_DIR / self.ns}", *argv]

    def popen(self, *argv: str, log: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A long-running process here, its output to ``log``; killed at tear-down."""
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(self.command(*argv), stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def shape(self, rate_in: float | None = None, rate_out: float | None = None) -> None:
        """Shape this host's link anew: ``rate_out`` what it sends, ``rate_in`` what it receives
        (bytes/s; None: unshaped)."""
        self.rate_in, self.rate_out = rate_in, rate_out
        with contextlib.suppress(subprocess.CalledProcessError):
            _tc(self.ns, "qdisc", "del", "dev", "eth0", "root")
        with contextlib.suppress(subprocess.CalledProcessError):
            _tc(self.ns, "qdisc", "del", "dev", "ifb0", "root")
        if rate_out:
            _tc(self.ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", f"{int(rate_out * 8)}bit",
                "burst", str(burst_for(rate_out)), "latency", "100ms")
        if rate_in:
            _tc(self.ns, "qdisc", "add", "dev", "ifb0", "root", "tbf", "rate", f"{int(rate_in * 8)}bit",
                "burst", str(burst_for(rate_in)), "latency", "100ms")

    def sent_bytes(self) -> int:
        """Bytes this host has sent over its link (its eth0's counter)."""
        return self._counter("tx_bytes")

    def received_bytes(self) -> int:
        return self._counter("rx_bytes")

    def _counter(self, which: str) -> int:
        out = subprocess.run(self.command("cat", "/proc/net/dev"), capture_output=True, text=True, timeout=10)
        for line in out.stdout.splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                fields = rest.split()
                return int(fields[0] if which == "rx_bytes" else fields[8])
        raise RuntimeError(f"{self.name}: no eth0 in its namespace")


class NetBox:
    """A bridge and hosts on it, each in a namespace named ``<tag><pid>-<name>``."""

    def __init__(self, tag: str, work: Path | None = None) -> None:
        self.tag = tag
        self.name_prefix = f"{tag}{os.getpid()}-"
        self.switch = f"{self.name_prefix}sw"
        self.work = work
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen[Any]] = []  # started here in the machine's namespace

    def __enter__(self) -> NetBox:
        for prefix in self.stale_prefixes():  # (boxes of this tag whose process is gone: killed before tear-down)
            old = NetBox.__new__(NetBox)
            old.tag, old.name_prefix, old.switch, old.work, old.hosts, old.procs = self.tag, prefix, f"{prefix}sw", None, {}, []
            print(f"netbox: removing what an earlier run left: {' '.join(old.namespaces())}", flush=True)
            old.close()
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str, *, rate_in: float | None = None, rate_out: float | None = None) -> Host:
        """A new host on the bridge, its link shaped to ``rate_in`` / ``rate_out`` bytes/s."""
        ns = f"{self.name_prefix}{name}"
        address = f"{SUBNET}.{len(self.hosts) + 2}"
        port = f"p{len(self.hosts)}"
        _ip("netns", "add", ns)
        host = Host(self, name, ns, address)
        self.hosts[name] = host
        _ip("link", "add", f"{ns[:10]}x{len(self.hosts)}", "netns", ns, "type", "veth", "peer", "name", port,
            "netns", self.switch)
        _ip("-n", ns, "link", "set", f"{ns[:10]}x{len(self.hosts)}", "name", "eth0")
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "add", "ifb0", "type", "ifb")
        _ip("-n", ns, "link", "set", "ifb0", "up")
        _tc(ns, "qdisc", "add", "dev", "eth0", "handle", "ffff:", "ingress")
        _tc(ns, "filter", "add", "dev", "eth0", "parent", "ffff:", "protocol", "all", "u32", "match", "u32", "0", "0",
            "action", "mirred", "egress", "redirect", "dev", "ifb0")
        host.shape(rate_in, rate_out)
        return host

    def portal(self, listen: str, upstream: str, *, listen_in: Host | None = None, upstream_in: Host | None = None,
               delay_ms: float = 0.0, log: Path | None = None) -> subprocess.Popen[str]:
        """A TCP forwarder (``latency_proxy.py``) listening at ``listen`` in ``listen_in``'s namespace
        (None: the machine's) and connecting to ``upstream`` in ``upstream_in``'s, adding ``delay_ms`` to
        every answer: a server on the machine's loopback reached from the box, or the other way round.
        Returns once it listens; stopped at tear-down."""
        args = ["--listen", listen, "--upstream", upstream, "--delay-ms", str(delay_ms)]
        if listen_in is not None:
            args += ["--listen-ns", str(NETNS_DIR / listen_in.ns)]
        if upstream_in is not None:
            args += ["--upstream-ns", str(NETNS_DIR / upstream_in.ns)]
        err = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
        try:
            proc, _ = latency_proxy.spawn(args, stderr=err, start_new_session=True)
        except RuntimeError:
            raise RuntimeError(f"the portal from {listen} to {upstream} did not start") from None
        self.procs.append(proc)
        return proc

    def stale_prefixes(self) -> list[str]:
        """The name prefixes of this tag's boxes whose process is gone (``<tag><pid>-``): what a run killed
        before its tear-down left. A box whose process lives (another run) is never one."""
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        found = set()
        for line in listed:
            m = re.match(rf"{re.escape(self.tag)}(\d+)-", line)
            if m and m[0] != self.name_prefix and not Path(f"/proc/{m[1]}").exists():
                found.add(m[0])
        return sorted(found)

    def namespaces(self) -> list[str]:
        """The box's namespaces that exist now."""
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        return [line.split()[0] for line in listed if line.startswith(self.name_prefix)]

    def close(self) -> None:
        """Kill every process in the box's namespaces, unmount what it mounted, delete the namespaces."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for host in self.hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for ns in self.namespaces():
            while True:
                pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
                if not pids:
                    break
                sig = signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                time.sleep(0.2)
        if self.work is not None:
            for line in Path("/proc/self/mounts").read_text().splitlines():
                point = line.split()[1]
                if point.startswith(str(self.work) + "/"):
                    subprocess.run(["fusermount3", "-uz", point], capture_output=True)
        for ns in self.namespaces():
            _ip("netns", "del", ns, check=False)
        left = self.namespaces()
        if left:
            raise RuntimeError(f"namespaces left behind: {left}")
