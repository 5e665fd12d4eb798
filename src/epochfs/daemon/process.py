"""The daemon's process: open its parts, mount, run the event loop until told to stop, close what it
opened, and the exit code. The services themselves are built in :mod:`epochfs.daemon.mount`.

Stop signals: before the mount, SIGINT and SIGTERM stop the daemon the default way (nothing is mounted
yet; the cache survives a kill). From the mount on they are noted until the event loop listens, which
acts on one noted as it starts (:class:`~epochfs.daemon.host.StopSignals`): a signal in between
unmounts, never leaves a dead mount (``Transport endpoint is not connected``) behind.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

import trio

from epochfs import kernel
from epochfs.core import memory
from epochfs.core.errors import ConfigError, EpochfsError, error_inside
from epochfs.daemon import host as node_host
from epochfs.daemon.config import Config
from epochfs.daemon.host import StopSignals
from epochfs.daemon.mount import Daemon, Ready
from epochfs.daemon.mountpoint import check_mountpoint

log = logging.getLogger(__name__)


def run(config: Config, ready: Ready) -> int:
    """Mount and serve until unmounted (a cache node: serve until SIGTERM). Calls ``ready`` exactly once.
    Returns the exit code."""
    memory.few_arenas()  # (before any thread: what the memory limit counts is what the daemon holds)
    if config.serving:
        return _serve(config, ready)
    mountpoint = str(config.mountpoint)
    daemon = _start(config, ready, lambda: check_mountpoint(mountpoint, config.allow_non_empty))
    if not isinstance(daemon, Daemon):
        return daemon

    def closed() -> None:
        session.close(unmount=True)
        daemon.close()

    with StopSignals() as early:  # from the mount on, a stop signal unmounts: it never leaves a dead mount
        try:
            session = daemon.ops.session = kernel.Session(daemon.ops, mountpoint, daemon.fuse_options(),
                                                              io_uring=config.io_uring)
            session.mount()
        except kernel.MountError as exc:
            daemon.close()
            ready(f"cannot mount {mountpoint}: {exc}", [])
            return 1
        code = _until_stopped(daemon, ready, "daemon", closed, early)
    if code == 0:
        log.info("unmounted %s", mountpoint)
    return code


def _serve(config: Config, ready: Ready) -> int:
    """A cache node: the daemon's services without a mount, until SIGINT or SIGTERM."""
    daemon = _start(config, ready)
    if not isinstance(daemon, Daemon):
        return daemon
    with StopSignals() as early:  # (its peers hear it leave, and what it holds is handed over)
        code = _until_stopped(daemon, ready, "cache node", daemon.close, early)
    if code == 0:
        log.info("cache node of %s stopped", config.source.url)
    return code


#: What a start-up that failed with one of these errors says to do: the fault is the node's set-up.
_NODE_ERRNOS = {
    errno.ENOSPC: "the cache directory's file system is full: free some of it, or give a --cache-dir on another",
    errno.EDQUOT: "the cache directory's owner is over its disk quota: free some, or give another --cache-dir",
    errno.EROFS: "the cache directory's file system is read-only: give a --cache-dir on a writable one",
    errno.EACCES: "the daemon's user may not write there: give a --cache-dir it owns",
}


def _start(config: Config, ready: Ready, check: Callable[[], None] | None = None) -> Daemon | int:
    """The daemon's parts opened, or the exit code of why not (``ready`` told)."""
    try:
        if check is not None:
            check()
        node_host.raise_descriptor_limit()
        return Daemon(config)
    except EpochfsError as exc:
        ready(str(exc), [])
        return 2 if isinstance(exc, ConfigError) else 1
    except OSError as exc:
        if exc.errno not in _NODE_ERRNOS:
            log.exception("start-up failed")
            ready(f"start-up failed: {type(exc).__name__}: {exc}", [])
            return 1
        # The node's disks and rights, not a fault of the daemon: said with the path and what to do.
        where = exc.filename or config.cache_dir
        why = _NODE_ERRNOS[exc.errno]
        log.error("start-up failed: %s: %s", where, exc.strerror)
        ready(f"{where}: {exc.strerror} ({why})", [])
        return 2
    except Exception as exc:
        log.exception("start-up failed")
        ready(f"start-up failed: {type(exc).__name__}: {exc}", [])
        return 1


def _until_stopped(daemon: Daemon, ready: Ready, what: str, closed: Callable[[], None],
                   early: StopSignals) -> int:
    """Run the daemon's services until they stop; ``closed`` closes what runs. The exit code."""
    try:
        trio.run(daemon.run, ready, early)
    except BaseException as exc:
        known = error_inside(exc)
        if known is None:
            log.exception("%s failed", what)
        closed()
        ready(str(known) if known else f"{what} failed: {exc!r}; see the log", [])
        return 2 if isinstance(known, ConfigError) else 1
    closed()
    return 0
