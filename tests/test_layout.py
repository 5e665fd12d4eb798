"""Module boundaries: the FUSE adapter adapts only; metrics and backends stay in their modules."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "epochfs"


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_fuse_adapter_imports_neither_boto3_nor_lmdb():
    assert not imports(SRC / "fs.py") & {"boto3", "botocore", "lmdb", "urllib3"}


def test_only_the_s3_backend_imports_boto3():
    users = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if {"boto3", "botocore"} & imports(p)}
    assert users <= {"backend/s3.py", "devserver.py"}


def test_pure_cores_do_no_io():
    pure = ["cache/keys.py", "meta/namespace.py", "control/protocol.py", "records.py",
            *(p.relative_to(SRC).as_posix() for p in (SRC / "cache" / "policies").glob("*.py"))]
    for name in pure:
        assert not imports(SRC / name) & {"trio", "lmdb", "boto3", "pyfuse3", "socket", "subprocess"}, name
