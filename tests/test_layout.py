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
    assert not imports(SRC / "vfs" / "fs.py") & {"boto3", "botocore", "lmdb", "urllib3"}


def test_only_the_s3_backend_imports_boto3():
    users = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if {"boto3", "botocore"} & imports(p)}
    assert users <= {"backend/s3.py", "backend/s3_writes.py", "dev/servers.py"}  # (the S3 backend is those two)


def test_pure_cores_do_no_io():
    pure = ["blockstore/keys.py", "core/blocks.py", "meta/namespace.py", "control/protocol.py", "core/records.py", "kernel/abi.py",
            *(p.relative_to(SRC).as_posix() for p in (SRC / "cache" / "policies").glob("*.py"))]
    for name in pure:
        assert not imports(SRC / name) & {"trio", "lmdb", "boto3", "socket", "subprocess"}, name
    assert imports(SRC / "kernel" / "abi.py") <= {"__future__", "stat", "struct", "collections", "dataclasses",
                                                 "typing"}, "the protocol's bytes, nothing else"


def module_of(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def epochfs_imports(path: Path, *, typing: bool = False) -> set[str]:
    """The epochfs modules ``path`` imports (``from epochfs.x import y`` names epochfs.x, or epochfs.x.y
    where that is a module); type-checking-only imports only with ``typing``."""
    tree = ast.parse(path.read_text())
    typing_only = set()
    for node in ast.walk(tree):
        if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            typing_only |= {id(n) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("epochfs")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("epochfs") and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if (SRC.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                        or (SRC.parent / sub.replace(".", "/")).is_dir() else node.module)
    return out


def graph(*, typing: bool = False) -> dict[str, set[str]]:
    return {module_of(p): epochfs_imports(p, typing=typing) for p in SRC.rglob("*.py")}


def under(module: str, *places: str) -> bool:
    return any(module == f"epochfs.{p}" or module.startswith(f"epochfs.{p}.") for p in places)


def test_no_module_imports_itself_back_through_others():
    """No circles, not even through imports made only for type annotations."""
    g = graph(typing=True)
    for start in g:
        seen, todo = set(), [m for m in g[start] if m in g]
        while todo:
            m = todo.pop()
            assert m != start, f"{start} imports itself back through {sorted(seen)}"
            if m not in seen:
                seen.add(m)
                todo += [n for n in g.get(m, ()) if n in g]


def test_the_layers_point_down():
    """Records and helpers import nothing above them; a backend loads neither the cache's policies nor
    the config; rendering ``status`` loads no Prometheus client."""
    g = graph()
    ground = ("core", "transport", "cache.pagecache", "control.jobs", "version", "links.meter")
    for module, deps in g.items():
        if under(module, *ground):
            assert all(under(d, *ground) for d in deps), (module, deps)
        if under(module, "backend"):
            assert not [d for d in deps if not under(d, "backend", *ground)], (module, deps)
        if under(module, "cache", "meta"):
            assert not [d for d in deps if under(d, "daemon", "control", "vfs", "cli", "prefetch", "peer",
                                                 "writeback")], (module, deps)
        if under(module, "control", "vfs", "doctor"):
            assert not [d for d in deps if under(d, "daemon", "cli", "node")], (module, deps)
        if under(module, "vfs"):
            assert not [d for d in deps if under(d, "control")], (module, deps)
        if not under(module, "dev"):
            assert not [d for d in deps if under(d, "dev")], (module, deps)


def test_only_the_metrics_module_imports_prometheus_client():
    users = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if "prometheus_client" in imports(p)}
    assert users == {"daemon/metrics.py"}


def test_the_command_line_loads_no_event_loop_nor_store():
    """Every ``epochfs`` command starts fast: the tools' modules load neither trio, LMDB, boto3 nor
    prometheus_client (the daemon loads them when it mounts)."""
    import subprocess
    import sys

    code = ("import sys, epochfs.cli, epochfs.cli.status, epochfs.cli.epoch, epochfs.cli.stores, epochfs.client\n"
            "print(' '.join(m for m in ('trio', 'lmdb', 'boto3', 'prometheus_client') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == [], f"the command line loads {loaded}"


def test_the_top_holds_only_the_packages_face_and_every_room_says_what_it_holds():
    """Every module lives in a package named for its job; the top keeps what users import by name
    (``epochfs.Client``, ``epochfs.torch``, ``epochfs.watch``) and the package's own. Each package's
    ``__init__`` says what it holds."""
    top = {p.name for p in SRC.glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "version.py", "client.py", "torch.py", "watch.py"}, top
    for init in SRC.rglob("__init__.py"):
        if init.parent == SRC:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(SRC)} does not say what it holds"


def test_no_room_outgrows_the_rest():
    """No module of the package over 600 lines: a room that needs more has found a seam to split at."""
    long = {p.relative_to(SRC).as_posix(): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_the_adapter_answers_errors_one_way():
    """``vfs/fs.py`` raises domain errors (``core/errors.py``); only its ``_translated`` decorator turns
    them into an errno, through ``errno_for``: no handler builds a kernel error itself."""
    tree = ast.parse((SRC / "vfs" / "fs.py").read_text())
    builders = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "FUSEError":
                    builders.add(fn.name)
    assert builders and builders <= {"_translated", "answer"}, builders


def test_one_root_inode():
    """The root's inode number is the protocol's, defined once."""
    defined = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
               for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "ROOT_INODE" for t in node.targets)]
    assert defined == ["kernel/abi.py"], defined


def test_packing_and_the_journal_take_name_rules_from_records_not_the_namespace():
    """The rules for names (what a key may be) are records' ground rules: packing, the write-back journal
    and the index hold keys to them without depending on the namespace view."""
    g = graph()
    for module in ("epochfs.pack.writer", "epochfs.writeback.journal", "epochfs.meta.entries", "epochfs.meta.nodes"):
        assert "epochfs.meta.namespace" not in g[module], module
