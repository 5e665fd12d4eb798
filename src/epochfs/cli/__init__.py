"""Command line: arguments -> calls, errors -> one line and an exit code. One module per command family:
:mod:`.mount` (mount, serve, umount, stop), :mod:`.status` (status, stats), :mod:`.epoch` (prefetch, warmup, manifest,
plan), :mod:`.stores` (import, refresh, fsck), :mod:`.pack` (pack), :mod:`.cluster` (cluster status, warmup); :mod:`.options` derives the mount options from
:class:`~epochfs.daemon.config.Config`.

Exit codes: 0 success, 1 runtime failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from epochfs.cli import cluster, epoch, mount, pack, status, stores
from epochfs.cli.common import EPILOG
from epochfs.core.errors import ConfigError, EpochfsError
from epochfs.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epochfs",
        description="FUSE mount of an S3 prefix or a slow shared directory for training data: read "
        "through a persistent, checksummed local block cache, prefetched in the epoch's order, shared with "
        "the cluster's cache nodes; read-only by default, or written back (--writeback) for checkpoints.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"epochfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for family in (mount, epoch, stores, pack, status, cluster):
        family.add_parsers(sub)
    parser.set_defaults(commands=sub.choices)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments; an unknown one is an error of the command it was given to (its usage, and the
    option it most likely meant), not of the top level."""
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "paths", None), list) and not any(w.startswith("-") for w in extra):
        args.paths += extra  # PATHs given after options (argparse leaves them over when options come between)
        extra = []
    if extra:
        command: argparse.ArgumentParser = args.commands[args.command]
        known = [o for a in command._actions for o in a.option_strings]
        hints = []
        for word in extra:
            if word.startswith("-"):
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6)
                if close:
                    hints.append(f"{word.split('=', 1)[0]}: did you mean {close[0]}?")
        command.error(f"unrecognized arguments: {' '.join(extra)}" + ("; " + "; ".join(hints) if hints else ""))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(build_parser(), argv)
    args.argv = argv
    from epochfs.meta.base import StoreRefused

    try:
        return args.run(args)
    except (ConfigError, StoreRefused) as exc:  # (a refused password is this node's configuration)
        print(f"epochfs: {exc}", file=sys.stderr)
        return 2
    except EpochfsError as exc:
        print(f"epochfs: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] in ("epochfs", "torch"):
            raise
        # The job's client (installed with --no-deps: Python's standard library alone) has what the
        # job's commands need; the daemon's commands need the node's packages.
        print(f"epochfs: `epochfs {argv[0] if argv else ''}` needs the node's packages ({exc.name} is not "
              "installed): this is the job's client, which talks to a daemon already running; install epochfs "
              "on the node with deploy/install.sh (or `pip install` it with its dependencies)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `epochfs status | head`: the reader went away, which is fine
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
