"""``epochfs mount`` and ``epochfs umount``: start a daemon and wait until its mount answers (or say why
it failed), and unmount and wait until the daemon has exited."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

from epochfs.cli.common import EPILOG
from epochfs.cli.options import add_mount_options, config_from
from epochfs.core.errors import ConfigError, EpochfsError
from epochfs.core.text import human, plural
from epochfs.daemon.config import Config, read_config_file

log = logging.getLogger("epochfs")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser(
        "mount", help="mount a dataset read-only",
        description="Mount SOURCE (s3://BUCKET[/PREFIX] or file:///PATH) read-only at MOUNTPOINT. "
        "Returns once the mount answers (exit 0) or failed (non-zero, with the reason); "
        "with --foreground stays attached and unmounts on SIGINT/SIGTERM.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument("source", metavar="SOURCE", nargs="?", help="s3://BUCKET[/PREFIX] or file:///PATH")
    m.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?", help="an existing empty directory, e.g. /mnt/data")
    m.add_argument("--config", metavar="FILE",
                   help="TOML file with any of these options (keys like cache_size = \"500G\", plus source and "
                   "mountpoint); command-line flags override it")
    add_mount_options(m)
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(run=cmd_mount)

    s = sub.add_parser(
        "serve", help="run a cache node of the cluster tier (no mount)",
        description="Run a dedicated cache node of SOURCE: a member of the cluster cache tier that mounts "
        "nothing, holds the blocks it owns on its cache disk (rendezvous hashing over the cache nodes, "
        "--replicas of each), fetches a missing one once for every node that asks (from the other cache "
        "nodes if they hold it, else the backend) and answers GPU nodes mounted with --peer-role client "
        "(or --peer-listen). Needs --meta (the shared store the members meet in), --peer-listen and "
        "--peer-token-file. Returns once it serves (exit 0) or failed; with --foreground stays attached "
        "and stops on SIGINT/SIGTERM. 'epochfs status CACHE_DIR' and 'epochfs cluster status' show it.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("source", metavar="SOURCE", nargs="?", help="s3://BUCKET[/PREFIX] or file:///PATH")
    s.add_argument("--config", metavar="FILE", help="TOML file with any of these options (and source); "
                   "command-line flags override it")
    add_mount_options(s, serving=True)
    s.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    s.set_defaults(run=cmd_serve)

    u = sub.add_parser("umount", help="unmount and wait for the daemon to finish",
                       description="Unmount MOUNTPOINT and wait until its daemon has exited. "
                       "A dead mount (daemon killed) is cleared with a lazy unmount.")
    u.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?")
    u.add_argument("--config", metavar="FILE", help="take the mount point from this config file")
    u.add_argument("--lazy", action="store_true",
                   help="detach at once even if busy, and succeed if nothing is mounted (for ExecStopPost)")
    u.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long to wait for the daemon to exit (default: %(default)s)")
    u.set_defaults(run=cmd_umount)

    st = sub.add_parser("stop", help="stop a cache node (epochfs serve) and wait for it to hand its blocks over",
                        description="Stop the cache node serving from CACHE_DIR (what `epochfs serve` runs in "
                        "the background): it hands the blocks it owns over to their next owners, leaves the "
                        "member list and exits; this waits for that (a minute at most, then --timeout). A mount "
                        "is stopped with `epochfs umount MOUNTPOINT`.")
    st.add_argument("cache_dir", metavar="CACHE_DIR", nargs="?", help="the cache node's --cache-dir")
    st.add_argument("--config", metavar="FILE", help="take the cache directory from this (serve) config file")
    st.add_argument("--timeout", type=float, default=90.0, metavar="SECONDS",
                    help="how long to wait for it to exit (default: %(default)s; its hand-over takes a minute at most)")
    st.set_defaults(run=cmd_stop)


def setup_logging(config: Config) -> None:
    from epochfs.core.private import PrivateLogFile
    from epochfs.core.text import SafeFormatter

    handler: logging.Handler
    if config.log_file is not None:
        handler = PrivateLogFile(config.log_file, maxBytes=32 << 20, backupCount=3)
    else:
        handler = logging.StreamHandler()
    handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if config.debug else logging.INFO)
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.INFO if config.debug else logging.WARNING)


def cmd_serve(args: argparse.Namespace) -> int:
    return cmd_mount(args, serving=True)


def cmd_mount(args: argparse.Namespace, *, serving: bool = False) -> int:
    config = config_from(args, serving=serving)
    if not config.foreground:
        return _spawn_daemon(config, args.argv)

    from epochfs.daemon import process
    setup_logging(config)
    ready_fd = args.ready_fd
    reported = False

    def ready(error: str | None, warnings: Sequence[str]) -> None:
        nonlocal reported
        if reported:
            return
        reported = True
        if error is not None:
            log.error("%s", error)
        if ready_fd is not None:
            answer = "ok\n" + "".join(f"warning: {w}\n" for w in warnings) if error is None else error + "\n"
            os.write(ready_fd, answer.encode())
            os.close(ready_fd)

    code = process.run(config, ready)
    # Upload threads that did not stop when cancelled must not keep the process (and a second daemon
    # out of the cache directory): they die with it, the journal keeps what is owed, and a multipart
    # upload cut off is aborted at the next start.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawn_daemon(config: Config, argv: list[str]) -> int:
    """Start the daemon in its own session and wait for it to say the mount answers, or why not."""
    from epochfs.core.private import open_private, private_dir

    assert config.cache_dir is not None
    log_file = config.log_file or config.cache_dir / "epochfs.log"
    created = not config.cache_dir.exists()
    private_dir(config.cache_dir)  # checked before anything is written into it
    log_fd = open_private(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "epochfs", *argv, "--foreground", "--ready-fd", str(write_fd),
           "--log-file", str(log_file)]
    try:
        proc = subprocess.Popen(cmd, pass_fds=(write_fd,), start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=log_fd)
    finally:
        os.close(write_fd)
        os.close(log_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        lines = pipe.read().decode(errors="replace").strip().splitlines()
    if lines and lines[0] == "ok":
        for line in lines[1:]:
            print(f"epochfs: {line}", file=sys.stderr)
        what = "cache node of" if config.serving else "mounted"
        where = "" if config.serving else f" at {config.mountpoint}"
        print(f"epochfs: {what} {config.source.url}{where} (daemon pid {proc.pid}); cache {config.cache_dir}, "
              f"log {log_file}; `epochfs status {config.mountpoint if not config.serving else config.cache_dir}` "
              "shows it", file=sys.stderr)
        return 0
    code = proc.wait()
    if lines and created and config.log_file is None:
        shutil.rmtree(config.cache_dir, ignore_errors=True)  # a failed first mount leaves nothing behind
    answer = "\n".join(lines) or f"the daemon exited with status {code} before the mount was ready; see {log_file}"
    print(f"epochfs: {answer}", file=sys.stderr)
    return code or 1


def cmd_umount(args: argparse.Namespace) -> int:
    from epochfs.control import PID_XATTR
    from epochfs.daemon.mountpoint import is_dead_mount, lazy_unmount

    mountpoint = args.mountpoint
    if args.config:
        mountpoint = mountpoint or read_config_file(args.config).get("mountpoint")
    if not mountpoint:
        raise ConfigError("give MOUNTPOINT (or --config with a mountpoint key)")
    path = os.path.abspath(mountpoint)
    if is_dead_mount(path):
        lazy_unmount(path)
        print(f"epochfs: cleared a dead mount at {path}", file=sys.stderr)
        return 0
    if not os.path.ismount(path):
        if args.lazy:
            return 0
        raise ConfigError(f"{path} is not mounted")
    if args.lazy:
        lazy_unmount(path)
        return 0
    try:
        pid = int(os.getxattr(path, PID_XATTR))
    except (OSError, ValueError):
        pid = None
    pending = _pending_uploads(path)
    result = subprocess.run(["fusermount3", "-u", path], capture_output=True, text=True)
    if result.returncode != 0:
        busy = " (files are open on it: close them, or detach now with 'epochfs umount --lazy')" \
            if "busy" in result.stderr else ""
        raise EpochfsError(f"unmount failed: {result.stderr.strip()}{busy}")
    deadline = time.monotonic() + args.timeout
    while pid is not None and _alive(pid):
        if time.monotonic() > deadline:
            raise EpochfsError(f"unmounted, but daemon pid {pid} is still running after {args.timeout}s")
        time.sleep(0.05)
    if pending:
        print(f"epochfs: {plural(pending[0], 'written file')} ({human(pending[1])}) "
              f"{'was' if pending[0] == 1 else 'were'} not uploaded yet; they stay in the "
              "cache directory's journal and upload when it is mounted again ('epochfs sync' before "
              "unmounting waits for them)", file=sys.stderr)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    import signal

    from epochfs.control import request

    where = args.cache_dir or (read_config_file(args.config).get("cache_dir") if args.config else None)
    if not where:
        raise ConfigError("give CACHE_DIR (or --config with a cache_dir key)")
    path = os.path.abspath(str(where))
    if os.path.ismount(path):
        raise ConfigError(f"{path} is a mount: stop it with `epochfs umount {path}`")
    try:
        status = request(path, "status", timeout=10)
    except EpochfsError as exc:
        raise EpochfsError(f"no cache node answers in {path}: {exc}") from None
    peer = status.get("peer") if isinstance(status.get("peer"), dict) else {}
    if peer.get("role") != "server":
        raise ConfigError(f"{path} is not a cache node's directory (its daemon is a mount: `epochfs umount`)")
    pid = status.get("pid")
    if not isinstance(pid, int) or pid <= 1:
        raise EpochfsError(f"the cache node in {path} did not say its process id")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return 0
    except PermissionError:
        raise EpochfsError(f"not allowed to stop pid {pid} (run as its user, or root)") from None
    deadline = time.monotonic() + args.timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            raise EpochfsError(f"the cache node (pid {pid}) is still running after {args.timeout:g}s; its log: "
                               f"{os.path.join(path, 'epochfs.log')}")
        time.sleep(0.1)
    print(f"epochfs: stopped the cache node in {path} (pid {pid})", file=sys.stderr)
    return 0


def _pending_uploads(path: str) -> tuple[int, int] | None:
    """(files, bytes) a write-back mount has not uploaded yet, if it answers at once; None otherwise."""
    from epochfs.control import request

    try:
        wb = request(path, "status", timeout=2).get("writeback")
    except EpochfsError:
        return None
    if not isinstance(wb, dict) or not wb.get("pending_files"):
        return None
    return int(wb["pending_files"]), int(wb.get("pending_bytes", 0))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
