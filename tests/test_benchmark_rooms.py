"""``benchmarks/`` as rooms: every benchmark in the README's table, every result in a room and in the
history table, each benchmark's latest report linked as such, and every script runnable from its room."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH / "shared"))
import history  # noqa: E402


def _scripts() -> list[Path]:
    """The rooms' runnable benchmarks (a ``__main__`` and an argument parser of their own)."""
    return sorted(p for p in BENCH.glob("*/*.py") if p.parent.name != "shared"
                  and 'if __name__ == "__main__"' in p.read_text() and "argparse" in p.read_text())


def test_every_result_lies_in_its_benchmarks_room_and_the_history_is_current():
    assert not (BENCH / "results").exists(), "results lie in their benchmark's room: benchmarks/<room>/results/"
    assert history.check() == [], "run: python benchmarks/shared/history.py"


def test_a_result_no_benchmark_writes_is_refused_by_name():
    with pytest.raises(ValueError, match="no benchmark of room dlio"):
        history.benchmark_of("dlio", "2026-12-06-readpath-2core.md")
    with pytest.raises(ValueError, match="not a dated result"):
        history.benchmark_of("peers", "notes.md")
    assert history.benchmark_of("peers", "2026-12-04-quick.md").script == "run.py"
    assert history.benchmark_of("cluster", "2026-12-06-clusterbox-quick-5.md").name == "clusterbox"


def test_every_benchmark_is_in_the_readmes_table_and_its_history():
    readme = (BENCH / "README.md").read_text()
    table = readme[readme.index("## The rooms"):]
    table = table[:table.index("\n\n", table.index("| room |"))]
    for script in _scripts():
        if script.name in ("floor.py", "floor_s3.py", "folios.py", "nodetrain.py"):  # (parts of others)
            continue
        assert f"`{script.parent.name}/{script.name}" in table, f"{script.relative_to(BENCH)} is not in the table"
    named = {(b.room, b.script) for b in history.BENCHMARKS}
    for room, script in named:
        assert (BENCH / room / script).is_file(), f"history names {room}/{script}, which is not there"


@pytest.mark.mounts  # (a Python start and epochfs's imports per script: seconds, no mounts)
def test_every_benchmark_explains_itself_from_its_room():
    """``--help`` from any directory: each finds the shared tools and its room's siblings, and runs
    nothing."""
    scripts = [str(p) for p in _scripts()]
    code = ("import runpy, sys\n"
            "for path in sys.argv[1:]:\n"
            "    sys.argv = [path, '--help']\n"
            "    try:\n"
            "        runpy.run_path(path, run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        assert e.code in (0, None), (path, e.code)\n"
            "    print('HELP-OK', path)\n")
    r = subprocess.run([sys.executable, "-c", code, *scripts], cwd="/", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("HELP-OK ") == len(scripts)
