"""What the daemon sets of the host it runs on: systemd's notifications, the mount's kernel tunables (its
readahead window and background requests), the open-file limit. Each is best effort: a host that
refuses one gets a log line, and the mount works with the kernel's defaults. And what the host tells
the daemon: its stop signals, noted while the event loop does not listen yet (:class:`StopSignals`)."""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
import subprocess
from typing import Any

log = logging.getLogger(__name__)


def sd_notify(message: str) -> bool:
    """Send a systemd notification (READY=1, STOPPING=1, STATUS=...) if started with NOTIFY_SOCKET."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", addr, exc)
        return False
    return True


def set_kernel_readahead(dev: int, nbytes: int) -> None:
    """Raise the mount's readahead window (FUSE defaults to 128 KiB, which caps each read request)."""
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(max(4, nbytes >> 10)))
    except OSError as exc:
        log.info("could not set the kernel readahead (%s): %s", path, exc)


FUSECTL = "/sys/fs/fuse/connections"
BACKGROUND_REQUESTS = 64  # the kernel's default is 12, congested from 9


def set_background_requests(dev: int, requests: int = BACKGROUND_REQUESTS) -> None:
    """Let the kernel keep ``requests`` read requests of the mount in flight in the background before
    it counts the mount as congested (three quarters of that). A congested FUSE mount drops readahead
    that lies wholly ahead of the reader, and with a large readahead window that is all of a small
    file's: the kernel then asks for its first page alone and the rest after it (16 readers of 100 KiB
    files: 1.7 requests per file at the default, 1.0 at 64). Needs root and the fusectl file system
    (mounted here if it is not)."""
    conn = f"{FUSECTL}/{os.minor(dev)}"
    if not os.path.isdir(conn) and os.geteuid() == 0 and os.path.isdir(FUSECTL) and not os.path.ismount(FUSECTL):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], capture_output=True, check=False)
    try:
        for name, value in (("max_background", requests), ("congestion_threshold", requests * 3 // 4)):
            with open(f"{conn}/{name}", "w") as f:
                f.write(str(value))
    except OSError as exc:
        log.info("could not raise the mount's background requests (%s): %s", conn, exc)


def raise_descriptor_limit() -> None:
    """Use the hard limit of open files: clients of the metrics and control sockets, readers and
    backend connections all take descriptors, and running out of them fails reads."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.info("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)


class StopSignals:
    """SIGINT and SIGTERM noted, not acted on, while installed: from the moment the daemon has something
    to undo (a mount made, a cache node's services about to start) until its event loop listens for
    them (:meth:`Daemon.run` acts on the one noted). Their defaults would kill it there and leave a
    dead mount (``Transport endpoint is not connected``) behind. Before, a signal stops the daemon the
    default way: nothing is mounted yet, and the cache survives a kill."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._before: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for signum in self.SIGNALS:
            self._before[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._before.items():
            signal.signal(signum, handler)

    def _note(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
