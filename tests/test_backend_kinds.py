"""Backends declare what they can and register themselves: the built-in kinds agree with their
classes, a source of no registered form is refused with the forms there are, nothing outside
``backend/`` tests a scheme, and a backend of one module of the suite's own (``plugin_backend.py``)
is parsed, checked and mounted for real when ``EPOCHFS_BACKENDS`` names it."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

from epochfs.backend import BackendSettings, kind_of, open_backend
from epochfs.core.errors import ConfigError
from epochfs.core.records import Source
from epochfs.daemon.config import Config
from epochfs.dev.sample import pattern

from .conftest import requires_fuse
from .helpers import EPOCHFS

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "epochfs"


def test_the_built_in_kinds_say_what_their_backends_do():
    from epochfs.backend.local import LocalBackend
    from epochfs.backend.s3 import S3Backend

    s3, local = kind_of(Source.parse("s3://b/p")), kind_of(Source.parse("file:///tmp"))
    assert s3.capabilities.write and S3Backend.writable
    assert not local.capabilities.write and not LocalBackend.writable
    assert s3.backend == "epochfs.backend.s3:S3Backend" and local.backend == "epochfs.backend.local:LocalBackend"
    with pytest.raises(ConfigError, match=r"s3://BUCKET\[/PREFIX\] or file:///PATH"):
        Source.parse("ftp://host/x")
    with pytest.raises(ConfigError, match="read-only"):
        Config(source=Source.parse("file:///tmp"), mountpoint=Path("/mnt/x"), writeback=True)


def test_nothing_outside_the_backends_tests_a_scheme():
    """A source's kind is asked what it can do; no module outside ``backend/`` compares a scheme."""
    found = []
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] == "backend":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "scheme":
                if any(isinstance(c, ast.Constant) and c.value in ("s3", "file") for c in node.comparators):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not found, found


def test_a_backend_of_one_module_is_parsed_checked_and_opened():
    from tests import plugin_backend

    source = Source.parse("gen://demo/4")
    kind = kind_of(source)
    assert source.url == "gen://demo/4/" and not kind.capabilities.write
    backend = open_backend(BackendSettings(source))
    assert isinstance(backend, plugin_backend.GeneratedBackend)
    assert [o.size for o in backend.list_objects()] == [plugin_backend.size_of(i) for i in range(4)]
    with pytest.raises(ConfigError, match="gen://NAME/COUNT"):
        Source.parse("gen://demo/many")
    with pytest.raises(ConfigError, match="read-only"):
        Config(source=source, mountpoint=Path("/mnt/x"), writeback=True)


@requires_fuse
def test_a_backend_of_one_module_mounts(tmp_path):
    from tests import plugin_backend

    env = {**os.environ, "EPOCHFS_BACKENDS": "tests.plugin_backend",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    base = [*EPOCHFS, "mount", "gen://demo/12", str(mnt), "--cache-dir", str(tmp_path / "cache"),
            "--metrics-targets", "off", "--metrics-addr", "127.0.0.1:0"]
    r = subprocess.run([*base, "--writeback"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "read-only" in r.stderr, r.stderr
    r = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    try:
        names = sorted(os.listdir(mnt / "g"))
        assert names == [f"{i:03d}.bin" for i in range(12)]
        for i, name in enumerate(names):
            assert (mnt / "g" / name).read_bytes() == pattern(f"g/{name}", 0, 0, plugin_backend.size_of(i))
    finally:
        subprocess.run([*EPOCHFS, "umount", str(mnt)], capture_output=True, timeout=60)
    r = subprocess.run(base, env={**env, "EPOCHFS_BACKENDS": "tests.no_such_backend"}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "no_such_backend" in r.stderr, r.stderr
