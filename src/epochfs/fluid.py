"""Fluid's ThinRuntime: a Fluid user declares a ``Dataset`` backed by epochfs (``deploy/fluid/``), and
Fluid runs this in the FUSE pod of each node that needs it::

    epochfs-fluid-mount            # reads /etc/fluid/config/config.json (or /etc/fluid/config.json)

Fluid writes the Dataset's mount (``mountPoint``: ``s3://BUCKET/PREFIX`` or ``file:///PATH``, and its
``options``) and the path the dataset is to appear at (``targetPath``) into that file. Each option is an
``epochfs mount`` option by its config-file key (``cache_size: 200G``, ``endpoint_url: ...``); they are
checked as a config file's keys are (an unknown key or a bad value is an error that names it), written
to a private config file, and ``epochfs mount --config FILE --foreground`` replaces this process: it
unmounts when Fluid stops the pod (SIGTERM). Credentials never come through options (they would be
in the Dataset for anyone who can read it): the profile passes them as the environment from a Secret.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from epochfs.errors import ConfigError

CONFIG_PATHS = ("/etc/fluid/config/config.json", "/etc/fluid/config.json")
MAX_CONFIG = 1 << 20
#: Options a Dataset may not set: where the mount is is Fluid's, and what would carry a secret.
REFUSED = {"source", "mountpoint", "foreground"}
SECRET_WORDS = ("secret", "password", "token", "access_key")


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


def config_text(config: Any) -> tuple[str, str]:
    """The epochfs config file for Fluid's ``config``, and the target path; :class:`ConfigError` naming
    what is wrong."""
    from epochfs.cli.options import mount_options

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
    options = mount.get("options") or {}
    if not isinstance(options, dict):
        raise ConfigError("the Dataset's mount options are not a mapping")
    by_key = {mo.key: mo for mo in mount_options()}
    lines = [f"source = {_toml_value('', source, 'mountPoint')}", f"mountpoint = {_toml_value('', target, 'targetPath')}"]
    if "allow_other" not in {str(k).replace("-", "_") for k in options}:
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
    ap.add_argument("--print", action="store_true", help="print the epochfs config and command, run nothing")
    args = ap.parse_args(argv)
    try:
        text, target = config_text(read_config(args.config))
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
    Path(target).mkdir(parents=True, exist_ok=True)
    os.execv(sys.executable, command)
    return 1  # (not reached)


if __name__ == "__main__":
    raise SystemExit(main())
