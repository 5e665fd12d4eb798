"""A link's capacity as the node's own interface states it: the interface the kernel routes a peer's
address through (or the one holding a local address), its speed (``/sys/class/net/DEV/speed``), and
any rate it is shaped to (a ``tbf`` qdisc, or the root classes of an ``htb`` one, read with ``tc``;
what arrives through an ``ifb`` device an ingress filter redirects to is shaped there). Received
traffic (a node's reads from the backend) is bounded by the speed and the ingress shaping, sent
traffic (what a cache node serves) by the speed and the root qdisc.

The parsers are pure (tested on ``tc -j`` output); the probes read the system and never raise: what
cannot be known is None. A loopback interface, or one whose speed the driver does not know (many
virtual ones), states no speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epochfs.core.text import human

SYS_NET = Path("/sys/class/net")
SIOCGIFADDR = 0x8915
SIOCETHTOOL = 0x8946
ETHTOOL_GSET = 0x1
TC_TIMEOUT = 2.0


@dataclass(frozen=True)
class InterfaceCapacity:
    name: str  # the interface
    bytes_per_second: float
    detail: str  # how it is known, for status and the log


def routed_address(host: str, port: int) -> str | None:
    """The local address the kernel would send to ``host`` from (a UDP socket is connected, which
    sends nothing), or None if it has no route or the name does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, addr in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    return None


def default_route_interface(route_table: str) -> str | None:
    """The interface of the IPv4 default route in ``/proc/net/route``'s text."""
    for line in route_table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
            return fields[0]
    return None


def interface_holding(address: str) -> str | None:
    """The interface that holds the local ``address`` (IPv4 or IPv6), or None."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if ip.is_unspecified:  # (a wildcard listener: the interface of the default route)
        with contextlib.suppress(OSError):
            return default_route_interface(Path("/proc/net/route").read_text())
        return None
    if ip.version == 6:
        with contextlib.suppress(OSError):
            for line in Path("/proc/net/if_inet6").read_text().splitlines():
                fields = line.split()
                if len(fields) == 6 and ipaddress.ip_address(int(fields[0], 16)) == ip:
                    return fields[5]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(got[20:24]) == str(ip):
                return name
    return None


def speed_of(name: str) -> float | None:
    """The interface's speed in bytes/s, where its driver states one. Asked with the ethtool ioctl on
    a socket, so it is this process's network namespace's interface (``/sys/class/net`` shows the
    namespace that mounted it); sysfs where the ioctl is refused."""
    mbit = _ethtool_speed(name)
    if mbit is None:
        try:
            mbit = int((SYS_NET / name / "speed").read_text().strip())
        except (OSError, ValueError):  # (EINVAL: loopback and drivers that do not know)
            return None
    return mbit * 125_000.0 if 0 < mbit < 0xFFFFFFFF else None


def _ethtool_speed(name: str) -> int | None:
    """ETHTOOL_GSET's speed in Mbit/s (None: refused, or not stated)."""
    cmd = ctypes.create_string_buffer(struct.pack("I", ETHTOOL_GSET) + bytes(40))
    request = struct.pack("16sP", name.encode()[:15], ctypes.addressof(cmd))
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            fcntl.ioctl(s.fileno(), SIOCETHTOOL, request)
    except OSError:
        return None
    low, high = struct.unpack_from("H", cmd.raw, 12)[0], struct.unpack_from("H", cmd.raw, 28)[0]
    speed = high << 16 | low
    return None if speed in (0, 0xFFFF, 0xFFFFFFFF) else speed


def qdisc_rate(qdiscs: Any, classes: Any = None) -> float | None:
    """The rate a device's root qdisc shapes to (``tc -j qdisc show`` and ``tc -j class show`` output):
    a ``tbf``'s rate, or the highest ceiling of an ``htb``'s root classes; None if it is not shaped."""
    for q in qdiscs if isinstance(qdiscs, list) else []:
        if not isinstance(q, dict) or not q.get("root"):
            continue
        opts = q.get("options") if isinstance(q.get("options"), dict) else {}
        if q.get("kind") == "tbf" and _positive(opts.get("rate")):
            return float(opts["rate"])
        if q.get("kind") == "htb":
            tops = [c for c in (classes if isinstance(classes, list) else [])
                    if isinstance(c, dict) and c.get("class") == "htb" and c.get("root")]
            rates = [float(r) for c in tops for r in (c.get("ceil"), c.get("rate")) if _positive(r)]
            return max(rates) if rates else None
    return None


def ingress_redirect(filters: Any) -> str | None:
    """The device an ingress filter redirects every packet to (``tc -j filter show dev D ingress``):
    an ``ifb`` that shapes what the interface receives."""
    for f in filters if isinstance(filters, list) else []:
        opts = f.get("options") if isinstance(f, dict) else None
        actions = opts.get("actions") if isinstance(opts, dict) else None
        for action in actions if isinstance(actions, list) else []:
            if (isinstance(action, dict) and action.get("kind") == "mirred"
                    and action.get("mirred_action") == "redirect" and isinstance(action.get("to_dev"), str)):
                return str(action["to_dev"])
    return None


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _tc(*args: str) -> Any:
    """``tc -j ARGS`` parsed, or None (no tc, an error, a time-out)."""
    tc = shutil.which("tc") or next((p for p in ("/usr/sbin/tc", "/sbin/tc") if os.path.exists(p)), None)
    if tc is None:
        return None
    try:
        out = subprocess.run([tc, "-j", *args], capture_output=True, timeout=TC_TIMEOUT, check=False)
        return json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def shaped_rate(name: str, receive: bool) -> tuple[float, str] | None:
    """The rate ``name`` is shaped to in one direction and where (the device), or None."""
    device = name
    if receive:
        device = ingress_redirect(_tc("filter", "show", "dev", name, "ingress")) or ""
        if not device:
            return None
    qdiscs = _tc("qdisc", "show", "dev", device)
    classes = _tc("class", "show", "dev", device) if any(
        isinstance(q, dict) and q.get("kind") == "htb" for q in qdiscs or []) else None
    rate = qdisc_rate(qdiscs, classes)
    return (rate, device) if rate else None


def capacity_of(name: str, receive: bool) -> InterfaceCapacity | None:
    """What ``name`` carries in one direction (``receive``: towards this node): the lower of its speed
    and its shaping; where neither is stated, a figure of 0 (not known) saying why."""
    speed = speed_of(name)
    shaped = shaped_rate(name, receive)
    if shaped is not None and (speed is None or shaped[0] < speed):
        how = "ingress" if receive else "egress"
        return InterfaceCapacity(name, shaped[0], f"{name}, {how} shaped to {rate_text(shaped[0])} "
                                                  f"({shaped[1]})" + (f", speed {rate_text(speed)}" if speed else ""))
    if speed is not None:
        return InterfaceCapacity(name, speed, f"{name}, speed {rate_text(speed)}")
    return InterfaceCapacity(name, 0.0, f"{name} states no speed and is not shaped (a virtual interface, such as "
                                       "veth or virtio, reports none)")


def towards(host: str, port: int) -> InterfaceCapacity | None:
    """The capacity of the link this node receives from ``host`` over."""
    local = routed_address(host, port)
    name = interface_holding(local) if local else None
    return capacity_of(name, receive=True) if name else None


def holding(address: str) -> InterfaceCapacity | None:
    """The capacity of the link this node sends from its local ``address`` (or host name) over."""
    try:
        ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:  # a name: the address it has here
        try:
            address = str(socket.getaddrinfo(address, None)[0][4][0])
        except (OSError, UnicodeError, IndexError):
            return None
    name = interface_holding(address)
    return capacity_of(name, receive=False) if name else None


def rate_text(bytes_per_second: float) -> str:
    """A rate as links are named: ``10 Gbit/s``, with the bytes beside small ones (``40 MiB/s``)."""
    bits = bytes_per_second * 8
    if bits >= 1e12:
        return f"{bits / 1e12:.3g} Tbit/s"
    if bits >= 1e9:
        return f"{bits / 1e9:.3g} Gbit/s"
    return f"{human(bytes_per_second)}/s"


