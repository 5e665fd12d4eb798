"""The mount's options, derived from :class:`~epochfs.daemon.config.Config`'s fields: the argparse flags, the
config-file keys and the example config all come from the one definition there.

A flag the user did not give stays unset (``argparse.SUPPRESS``), so the value comes from the config
file if it has the key, else from the dataclass default: flags override the file, the file overrides
the defaults. ``deploy/epochfs.example.toml`` is :func:`example_config`'s output (a test keeps it
current; regenerate it with ``scripts/example-config.sh``).
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from epochfs.core.errors import ConfigError
from epochfs.daemon.config import Config, Option, Source, read_config_file

GROUPS = ("object store", "cache", "prefetch", "write-back", "namespace", "cluster cache", "metrics", "mount")
NOT_IN_FILES = {"foreground"}  # the unit passes --foreground itself


@dataclasses.dataclass(frozen=True)
class MountOption:
    name: str  # the Config field
    key: str  # its config-file key
    flag: str
    option: Option
    default: Any

    @property
    def is_list(self) -> bool:
        return isinstance(self.default, tuple)

    def convert(self, text: str) -> Any:
        assert self.option.parse is not None
        try:
            return self.option.parse(text)
        except ValueError:  # int() or float(): ConfigError carries its own message
            kind = "a whole number" if self.option.parse is int else "a number"
            raise ConfigError(f"{self.flag}: {text!r} is not {kind}") from None

    def shown(self) -> str:
        if self.option.shown is not None:
            return self.option.shown
        return "" if self.default is None else str(self.default)


def mount_options() -> Iterator[MountOption]:
    for f in dataclasses.fields(Config):
        opt = f.metadata.get("option")
        if opt is not None:
            flag = opt.flag or "--" + f.name.replace("_", "-")
            key = f.name if not flag.startswith("--") else flag[2:].replace("-", "_")
            yield MountOption(f.name, key, flag, opt, f.default)


#: What a cache node (``epochfs serve``) takes: no mount, no prefetcher of its own, no write-back.
SERVE_GROUPS = ("object store", "cache", "namespace", "cluster cache", "metrics")
SERVE_EXTRA = {"foreground", "log_file", "debug"}
NOT_SERVED = {"peer_role", "peer_cache"}  # a cache node is a server and keeps its share


def add_mount_options(parser: argparse.ArgumentParser, *, serving: bool = False) -> None:
    wanted = SERVE_GROUPS if serving else GROUPS
    groups = {name: parser.add_argument_group(name) for name in GROUPS if name in wanted or serving and name == "mount"}
    for mo in mount_options():
        if serving and (mo.option.group not in SERVE_GROUPS and mo.name not in SERVE_EXTRA or mo.name in NOT_SERVED):
            continue
        help_text = mo.option.help
        if mo.shown() and not isinstance(mo.default, bool):
            help_text += f" (default: {mo.shown()})"
        help_text = help_text.replace("%", "%%")  # (argparse formats help with %: "70%" is text here)
        group = groups[mo.option.group]
        if isinstance(mo.default, bool):
            group.add_argument(mo.flag, dest=mo.name, action="store_true", default=argparse.SUPPRESS, help=help_text)
        elif mo.is_list:
            group.add_argument(mo.flag, dest=mo.name, action="append", default=argparse.SUPPRESS,
                               metavar=mo.option.metavar, help=help_text)
        else:
            group.add_argument(mo.flag, dest=mo.name, type=_argparse_type(mo), default=argparse.SUPPRESS,
                               metavar=mo.option.metavar, help=help_text)


def _argparse_type(mo: MountOption) -> Any:
    def convert(text: str) -> Any:
        try:
            return mo.convert(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{mo.flag}: ")) from None

    convert.__name__ = mo.option.metavar or mo.name  # argparse names the type in its messages
    return convert


def file_values(path: str | Path) -> dict[str, Any]:
    """The mount options a config file sets, by field name, converted and checked; errors name the key.
    ``source`` and ``mountpoint`` are returned as given."""
    by_key = {mo.key: mo for mo in mount_options() if mo.key not in NOT_IN_FILES}
    values: dict[str, Any] = {}
    for key, value in read_config_file(path).items():
        where = f"config file {path}: {key}"
        if key in ("source", "mountpoint"):
            if not isinstance(value, str):
                raise ConfigError(f"{where}: expected a string")
            values[key] = value
            continue
        mo = by_key.get(key)
        if mo is None:
            import difflib

            near = difflib.get_close_matches(key, ["source", "mountpoint", *by_key], n=1, cutoff=0.6)
            hint = (f"did you mean {near[0]!r}?" if near else
                    "the keys are the mount options' long names with _ for - (`epochfs mount --help`; "
                    "deploy/epochfs.example.toml lists each)")
            raise ConfigError(f"config file {path}: unknown key {key!r}: {hint}")
        values[mo.name] = _file_value(mo, value, where)
    return values


def _file_value(mo: MountOption, value: Any, where: str) -> Any:
    if isinstance(mo.default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false")
        return value
    if mo.is_list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings")
        return tuple(value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: expected a string or a number")
    try:
        return mo.convert(str(value))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {str(exc).removeprefix(mo.flag + ': ')}") from None


def config_from(args: argparse.Namespace, *, serving: bool = False) -> Config:
    """The Config of ``epochfs mount`` (``serving``: of ``epochfs serve``, a cache node): its config file
    (``--config``), overridden by the flags given."""
    values: dict[str, Any] = file_values(args.config) if getattr(args, "config", None) else {}
    for mo in mount_options():
        if hasattr(args, mo.name):
            values[mo.name] = getattr(args, mo.name)
    source = args.source or values.pop("source", None)
    mountpoint = None if serving else getattr(args, "mountpoint", None) or values.pop("mountpoint", None)
    values.pop("source", None)
    values.pop("mountpoint", None)
    if serving:
        values["peer_role"] = "server"
    if not source or not (mountpoint or serving):
        raise ConfigError("give SOURCE and MOUNTPOINT (on the command line or as source/mountpoint in --config)"
                          if not serving else "give SOURCE (on the command line or as source in --config)")
    try:
        return Config(source=Source.parse(source), mountpoint=Path(mountpoint) if mountpoint else None, **values)
    except ConfigError as exc:
        if getattr(args, "config", None):
            raise ConfigError(f"{exc} (set in config file {args.config} or on the command line)") from None
        raise


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def example_config() -> str:
    """The example config file: every key with its default (commented out) and its help."""
    lines = [
        "# /etc/epochfs/data.toml -- configuration of the epochfs@data.service instance.",
        "# Every key is an `epochfs mount` option; flags given on the command line override this file, and",
        "# unknown keys are an error. Sizes: 512M, 50G, 2T (binary); rates: 10Gbit, 400MB. The commented",
        "# keys show the defaults. (Generated by scripts/example-config.sh from epochfs's options.)",
        "",
        "# What to mount, and where.",
        'source = "s3://training-data/imagenet/"   # or "file:///lustre/datasets/imagenet"',
        'mountpoint = "/mnt/data"',
        'cache_dir = "/var/cache/epochfs/data"    # local NVMe; it must belong to root and be private',
        "allow_other = true                       # training jobs of other users read the mount (with the",
        "                                         # permissions the source gives them)",
        "# Credentials come from the AWS chain (instance role, /root/.aws/credentials, or the unit's",
        "# EnvironmentFile), never from this file.",
    ]
    for group in GROUPS:
        lines += ["", f"# -- {group}"]
        for mo in mount_options():
            if mo.option.group != group or mo.key in NOT_IN_FILES or mo.key in ("cache_dir", "allow_other"):
                continue
            value = mo.option.example if mo.option.example is not None else (
                _toml(mo.shown()) if mo.option.shown else _toml(mo.default))
            lines += textwrap.wrap(mo.option.help, 100, initial_indent="# ", subsequent_indent="#   ")
            lines.append(f"# {mo.key} = {value}")
    from epochfs.doctor.cost import PRICE_GB, PRICE_GET, PRICE_LIST

    lines += ["", "# -- prices (US dollars): what `epochfs doctor --config` and `epochfs plan --config` read; the",
              "# mount itself ignores this table. Defaults: AWS S3 Standard list prices (us-east-1); GPU time has",
              "# none (the doctor then shows hours).",
              "# [cost]", f"#  price_get = {PRICE_GET:g}     # per 1,000 GET/HEAD requests",
              f"#  price_list = {PRICE_LIST:g}     # per 1,000 LIST requests",
              f"#  price_gb = {PRICE_GB:g}          # per GB read (2^30 bytes; internet egress: about 0.09)",
              "#  gpu_hour = 2.5        # one GPU for one hour"]
    return "\n".join(lines) + "\n"

