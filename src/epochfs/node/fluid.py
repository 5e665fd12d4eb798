"""Fluid's ThinRuntime: a Fluid user declares a ``Dataset`` backed by epochfs (``deploy/fluid/``), and
Fluid runs this in the FUSE pod of each node that needs it::

    epochfs-fluid-mount            # reads /etc/fluid/config/config.json (or /etc/fluid/config.json)

Fluid writes the Dataset's mount (``mountPoint``: ``s3://BUCKET/PREFIX`` or ``file:///PATH``, and its
``options``) and the path the dataset is to appear at (``targetPath``) into that file. The Dataset is a
namespace user's, and the daemon runs as root on the node: what a Dataset may set is an allow-list,
checked here, where it arrives, against the administrator's policy (:data:`POLICY_PATH`, a file of the
node that only root may write; without one, the defaults below):

- ``mountPoint``: an ``s3://`` source (any, or those under the policy's ``sources``); a ``file://``
  source only under a ``file://`` prefix of the policy's ``sources``, never with ``.`` or ``..``
  components or a symbolic link anywhere in its path, and never the node's cache directory or a system
  directory, whatever the policy says. Its directory is opened here, walking from ``/`` without
  following a link, and that descriptor is handed to the daemon (:func:`hand_down_root`), which reads
  it and never resolves the path again: what was checked is what is served, whatever the Dataset's
  author swaps under the path afterwards;
- ``options``: only the keys of the policy's ``tenant_options`` (default :data:`TENANT_OPTIONS`: how the
  cache behaves, never how the mount presents its files, where it writes, what it exposes or which
  credentials it uses); ``endpoint_url`` only one of the policy's ``endpoints``; ``cache_size`` at most
  its ``max_cache_size``;
- the policy's ``options`` are set for every Dataset and no Dataset changes them.

Each value is checked as a config file's is (an unknown key or a bad value is an error that names it),
written to a private config file, and ``epochfs mount --config FILE --foreground`` replaces this process:
it unmounts when Fluid stops the pod (SIGTERM). Credentials never come through options (they would be
in the Dataset for anyone who can read it): the profile passes them as the environment from a Secret.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochfs.core.errors import ConfigError
from epochfs.core.text import human

if TYPE_CHECKING:
    from epochfs.core.records import Source

CONFIG_PATHS = ("/etc/fluid/config/config.json", "/etc/fluid/config.json")
POLICY_PATH = "/etc/epochfs/fluid-policy.toml"
MAX_CONFIG = 1 << 20
#: Options a Dataset may not set: where the mount is is Fluid's, and what would carry a secret.
REFUSED = {"source", "mountpoint", "foreground"}
SECRET_WORDS = ("secret", "password", "token", "access_key")
#: What a Dataset may set where the policy does not say: how the cache fetches, keeps and evicts.
TENANT_OPTIONS = ("attr_timeout", "backend_attempts", "backend_timeout", "block_size", "cache_size", "eviction",
                  "meta_poll", "prefetch_bandwidth", "prefetch_lead", "readahead", "refresh", "region", "snapshot_ttl")
#: Directories no Dataset's file:// source may be or be under, whatever the policy lists.
NEVER = ("/var/cache/epochfs", "/etc", "/proc", "/sys", "/dev", "/run", "/root", "/boot", "/var/lib/kubelet")
POLICY_KEYS = {"sources", "endpoints", "tenant_options", "max_cache_size", "options"}


class Policy:
    """The administrator's rules for Datasets (:data:`POLICY_PATH`)."""

    def __init__(self, sources: list[str] | None = None, endpoints: list[str] | None = None,
                 tenant_options: list[str] | None = None, max_cache_size: int | None = None,
                 options: dict[str, Any] | None = None) -> None:
        self.sources = sources
        self.endpoints = endpoints or []
        self.tenant_options = set(TENANT_OPTIONS if tenant_options is None else tenant_options)
        self.max_cache_size = max_cache_size
        self.options = options or {}

    @classmethod
    def load(cls, path: str | None) -> Policy:
        """The policy at ``path`` (default :data:`POLICY_PATH`; none there: the defaults). One that
        anyone but root could have written is refused: it decides what a root daemon presents."""
        import stat as st
        import tomllib

        from epochfs.daemon.config import parse_size

        where = path or POLICY_PATH
        try:
            fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if path:
                raise ConfigError(f"{where}: no such policy file") from None
            return cls()
        except OSError as exc:
            raise ConfigError(f"{where}: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not st.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
                raise ConfigError(f"{where}: the policy must be a regular file of root's that no one else may write")
            raw = f.read(MAX_CONFIG + 1)
        if len(raw) > MAX_CONFIG:
            raise ConfigError(f"{where}: larger than {MAX_CONFIG} bytes")
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{where}: not TOML ({exc})") from None
        unknown = set(data) - POLICY_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(POLICY_KEYS))})")
        lists = {}
        for key in ("sources", "endpoints", "tenant_options"):
            value = data.get(key)
            if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
                raise ConfigError(f"{where}: {key} must be a list of strings")
            lists[key] = value
        size = data.get("max_cache_size")
        options = data.get("options", {})
        if not isinstance(options, dict):
            raise ConfigError(f"{where}: options must be a table of mount options")
        return cls(**lists, max_cache_size=parse_size(str(size)) if size is not None else None, options=options)

    def check_source(self, source: str) -> None:
        """Refuse a mountPoint the Dataset may not name (:class:`ConfigError` saying why)."""
        from urllib.parse import urlparse

        from epochfs.core.records import Source

        parsed = Source.parse(source)
        if any(part in (".", "..") for part in urlparse(source).path.split("/")):
            raise ConfigError(f"mountPoint {source!r}: a source is a path without . or .. components")
        if _local(parsed):
            clean = os.path.normpath(parsed.prefix)  # (no link anywhere in it, checked below: where it is)
            for never in NEVER:
                if clean == never or clean.startswith(never + "/") or never.startswith(clean.rstrip("/") + "/") \
                        or clean == "/":
                    raise ConfigError(f"mountPoint {source!r}: a node's own directory ({never}) is never a "
                                      "Dataset's source")
            allowed = [p for p in self.sources or [] if _local(Source.parse(p))]
            if not any(_under(clean, Source.parse(p).prefix) for p in allowed):
                raise ConfigError(f"mountPoint {source!r}: file:// sources are allowed only under the node's policy "
                                  f"({POLICY_PATH}: sources = [\"file:///...\"]); it lists "
                                  + (", ".join(allowed) or "none"))
            os.close(open_source_root(clean))
        elif self.sources is not None and not any(_within(parsed.url, p) for p in self.sources if p.startswith("s3://")):
            raise ConfigError(f"mountPoint {source!r}: not one of the sources the node's policy allows "
                              f"({', '.join(self.sources) or 'none'})")


def open_source_root(path: str) -> int:
    """The directory a Dataset's ``file://`` source names, opened without following any link (no
    component of its path may be one: a Dataset author could swap a link between this check and the
    daemon's use); :class:`ConfigError` saying why not."""
    import errno

    from epochfs.backend.local import open_root

    try:
        return open_root(path)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ConfigError(f"mountPoint file://{path}: a component of it is a symbolic link or not a directory "
                              "(a Dataset's file:// source is a path of directories, no links)") from None
        raise ConfigError(f"mountPoint file://{path}: {exc.strerror or exc}") from None


def _local(source: Source) -> bool:
    """Whether ``source`` names a directory of this node (its kind says so)."""
    from epochfs.backend.kinds import kind_of

    return kind_of(source).capabilities.local_path


def _within(url: str, prefix: str) -> bool:
    """Whether the source ``url`` is ``prefix`` or under it, whole path components only."""
    from epochfs.core.records import Source

    try:
        root = Source.parse(prefix).url.rstrip("/")
    except ConfigError:
        return False
    return url.rstrip("/") == root or url.startswith(root + "/")


def _under(path: str, root: str) -> bool:
    root = os.path.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def _toml_value(default: Any, value: Any, key: str) -> str:
    if isinstance(default, bool):
        text = str(value).strip().lower()
        if text not in ("true", "false"):
            raise ConfigError(f"Fluid option {key}: expected true or false, got {value!r}")
        return text
    if isinstance(default, tuple):
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
        return "[" + ", ".join(_toml_value("", v.strip() if isinstance(v, str) else v, key) for v in items) + "]"
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"Fluid option {key}: expected a string or a number, got {type(value).__name__}")
    text = str(value)
    if any(ord(c) < 0x20 or c == "\x7f" for c in text):
        raise ConfigError(f"Fluid option {key}: contains a control character")
    return json.dumps(text, ensure_ascii=False)  # (a JSON string is a TOML basic string)


def config_text(config: Any, policy: Policy | None = None) -> tuple[str, str]:
    """The epochfs config file for Fluid's ``config`` under the administrator's ``policy``, and the
    target path; :class:`ConfigError` naming what is wrong."""
    from epochfs.cli.options import mount_options
    from epochfs.daemon.config import parse_size

    policy = policy or Policy()

    if not isinstance(config, dict):
        raise ConfigError("Fluid's config is not a JSON object")
    mounts = config.get("mounts")
    if not isinstance(mounts, list) or len(mounts) != 1 or not isinstance(mounts[0], dict):
        raise ConfigError("an epochfs Dataset has exactly one mount (one source per mount; declare another "
                          "Dataset for another source)")
    mount, target = mounts[0], config.get("targetPath")
    source = mount.get("mountPoint")
    if not isinstance(source, str) or not source:
        raise ConfigError("the Dataset's mount has no mountPoint (s3://BUCKET/PREFIX or file:///PATH)")
    if not isinstance(target, str) or not os.path.isabs(target):
        raise ConfigError("Fluid's config has no absolute targetPath")
    if any(ord(c) < 0x20 or c == "\x7f" for c in source):
        raise ConfigError("mountPoint: contains a control character")
    policy.check_source(source)
    from epochfs.core.records import Source

    source = Source.parse(source).url  # (as the checks read it: S3:// and s3:// are one)
    options = mount.get("options") or {}
    if not isinstance(options, dict):
        raise ConfigError("the Dataset's mount options are not a mapping")
    by_key = {mo.key: mo for mo in mount_options()}
    lines = [f"source = {_toml_value('', source, 'mountPoint')}", f"mountpoint = {_toml_value('', target, 'targetPath')}"]
    forced = {str(k).replace("-", "_"): v for k, v in policy.options.items()}
    for key, value in forced.items():
        mo = by_key.get(key)
        if mo is None or key in REFUSED:
            raise ConfigError(f"{POLICY_PATH}: options.{key} is not an epochfs mount option")
        lines.append(f"{key} = {_toml_value(mo.default, value, key)}  # (the node's policy)")
    if "allow_other" not in forced:
        lines.append("allow_other = true  # (the application pods run as other users)")
    for raw, value in options.items():
        key = str(raw).replace("-", "_")
        if key in REFUSED:
            raise ConfigError(f"Fluid option {raw}: set by Fluid (mountPoint and targetPath), not an option")
        if any(word in key for word in SECRET_WORDS) and not key.endswith("_file"):
            raise ConfigError(f"Fluid option {raw}: credentials go in the environment from a Secret (the "
                              "profile's fuse.env), never in the Dataset")
        mo = by_key.get(key)
        if mo is None:
            raise ConfigError(f"Fluid option {raw}: not an epochfs mount option (known: {', '.join(sorted(by_key))})")
        if key in forced:
            raise ConfigError(f"Fluid option {raw}: set for every Dataset by the node's policy ({POLICY_PATH})")
        if key == "endpoint_url" and value in policy.endpoints:
            pass  # (one the policy lists)
        elif key not in policy.tenant_options:
            allowed = sorted(policy.tenant_options | ({"endpoint_url"} if policy.endpoints else set()))
            raise ConfigError(f"Fluid option {raw}: not one a Dataset may set (the daemon runs as root on the node; "
                              f"a Dataset may set {', '.join(allowed)}; the rest is the node's policy, {POLICY_PATH})")
        if key == "cache_size" and policy.max_cache_size is not None and parse_size(str(value)) > policy.max_cache_size:
            raise ConfigError(f"Fluid option {raw}: {value} is more than the node's policy allows "
                              f"(max_cache_size {human(policy.max_cache_size)})")
        lines.append(f"{key} = {_toml_value(mo.default, value, raw)}")
    return "\n".join(lines) + "\n", target


def read_config(path: str | None) -> Any:
    paths = [path] if path else [p for p in CONFIG_PATHS if os.path.exists(p)]
    if not paths:
        raise ConfigError(f"no Fluid config at {' or '.join(CONFIG_PATHS)} (run in a ThinRuntime FUSE pod, or "
                          "give --config)")
    try:
        with open(paths[0], "rb") as f:
            raw = f.read(MAX_CONFIG + 1)
    except OSError as exc:
        raise ConfigError(f"{paths[0]}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG:
        raise ConfigError(f"{paths[0]}: larger than {MAX_CONFIG} bytes")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{paths[0]}: not JSON ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epochfs-fluid-mount", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", metavar="FILE", help="Fluid's config (default: where Fluid puts it)")
    ap.add_argument("--policy", metavar="FILE", help=f"the node's policy for Datasets (default: {POLICY_PATH}, "
                    "if it is there)")
    ap.add_argument("--print", action="store_true", help="print the epochfs config and command, run nothing")
    args = ap.parse_args(argv)
    try:
        text, target = config_text(read_config(args.config), Policy.load(args.policy))
        fd, path = tempfile.mkstemp(prefix="epochfs-fluid-", suffix=".toml")  # (0600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        from epochfs.cli.options import file_values

        file_values(path)  # every value checked before anything is mounted
    except ConfigError as exc:
        print(f"epochfs-fluid-mount: {exc}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "epochfs", "mount", "--config", path, "--foreground"]
    if args.print:
        os.unlink(path)
        print(text + "\n# epochfs mount --config FILE --foreground")
        return 0
    try:
        hand_down_root(text)
    except ConfigError as exc:
        os.unlink(path)
        print(f"epochfs-fluid-mount: {exc}", file=sys.stderr)
        return 2
    Path(target).mkdir(parents=True, exist_ok=True)
    os.execv(sys.executable, command)
    return 1  # (not reached)


def hand_down_root(text: str) -> int | None:
    """For a ``file://`` source (the config ``text``'s, which :func:`config_text` checked against the
    policy as a literal path with no link in it), that directory opened now, again without following a
    link (so the descriptor is the path that was checked), and handed to the daemon this process becomes
    (:data:`~epochfs.backend.local.ROOT_FD_ENV`): it reads that directory and never resolves the path
    again. Its descriptor (None for another kind of source)."""
    import tomllib

    from epochfs.backend.local import ROOT_FD_ENV
    from epochfs.core.records import Source

    source = Source.parse(tomllib.loads(text)["source"])
    if not _local(source):
        return None
    fd = open_source_root(source.prefix)
    os.set_inheritable(fd, True)
    os.environ[ROOT_FD_ENV] = f"{fd}:{source.prefix}"
    return fd


if __name__ == "__main__":
    raise SystemExit(main())
