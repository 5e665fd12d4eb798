"""Every benchmark's results in one table, and each benchmark's latest result named as such.

    python benchmarks/shared/history.py          # rewrite benchmarks/HISTORY.md and the latest-* links
    python benchmarks/shared/history.py --check  # exit 1 (saying what) where either is out of date

A result lies with its benchmark, in ``benchmarks/<room>/results/DATE-NAME.{md,json,...}``. Which
benchmark wrote it is told by its name (``BENCHMARKS``); within a day, results are ordered by when git
first saw them (the order they were run), so ``latest-<benchmark>.md`` links the newest report."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
HISTORY = BENCH / "HISTORY.md"
DATED = re.compile(r"^(\d{4}-\d{2}-\d{2})-?(.*?)(\.[a-z.]+)$")
CHART = re.compile(r"-?(policy|throughput|training)$")  # run.py's charts beside its report


@dataclass(frozen=True)
class Benchmark:
    name: str  # the name of its latest-<name>.md link
    room: str
    script: str
    results: str  # what a result's name (after its date) starts with


BENCHMARKS = [
    Benchmark("run", "peers", "run.py", r"(quick|$)"),
    Benchmark("readpath", "peers", "readpath.py", r"readpath"),
    Benchmark("smallfiles", "peers", "smallfiles.py", r"smallfile"),
    Benchmark("warm-large", "peers", "readpath.py", r"(warm-large|warm-advise|restructure-paired)"),
    Benchmark("hot", "peers", "hot.py", r"hot"),
    Benchmark("warmlarge", "peers", "warmlarge.py", r"warmlarge"),
    Benchmark("training", "training", "training.py", r"training"),
    Benchmark("packed", "training", "packed.py", r"packed(?!-warm-epoch-profiles)"),
    Benchmark("member-checks", "training", "member_checks.py", r"member-checks"),
    Benchmark("pause", "training", "pause.py", r"pause"),
    Benchmark("jobview", "training", "jobview.py", r"jobview"),
    Benchmark("watch-overhead", "training", "watch_overhead.py", r"watch-overhead"),
    Benchmark("dlio", "dlio", "dlio.py", r"dlio(?!-checkpoint)"),
    Benchmark("dlio-checkpoint", "dlio", "dlio_checkpoint.py", r"dlio-checkpoint"),
    Benchmark("projection", "dlio", "projection.py", r"projection"),
    Benchmark("clusterbox", "cluster", "clusterbox.py", r"clusterbox"),
    Benchmark("cluster", "cluster", "cluster.py", r"cluster(?!box)"),
    Benchmark("cache-nodes", "cluster", "cache_nodes.py", r"cache-nodes"),
    Benchmark("serve-cost", "cluster", "serve_cost.py", r"serve-cost"),
    Benchmark("checkpoint", "checkpoint", "checkpoint.py", r"checkpoint"),
    Benchmark("save-cost", "checkpoint", "save_cost.py", r"save-cost"),
    Benchmark("memory", "node", "memory.py", r"memory"),
    Benchmark("cores", "node", "cores.py", r"cores"),
    Benchmark("warm-kernel", "node", "warm_kernel.py", r"warm-kernel"),
    Benchmark("namespace", "node", "namespace.py", r"namespace"),
    Benchmark("versions", "node", "versions.py", r"versions"),
    Benchmark("profile", "profiles", "profile.py", r"(profile|cold-small|.*-profiles)"),
    Benchmark("upload-profile", "profiles", "upload_profile.py", r"upload-profile"),
    Benchmark("engines", "profiles", "engines.py", r"engines"),
]


@dataclass(frozen=True)
class Result:
    path: Path  # its report (.md) where it has one, else its one file
    date: str
    benchmark: Benchmark
    files: tuple[str, ...]  # every file of the result (its .md, .json, charts)

    @property
    def title(self) -> str:
        if self.path.suffix != ".md":
            return ""
        first = next((ln for ln in self.path.read_text().splitlines() if ln.strip()), "")
        return first.lstrip("# ").strip()


def benchmark_of(room: str, name: str) -> Benchmark:
    m = DATED.match(name)
    if m is None:
        raise ValueError(f"{room}/results/{name}: not a dated result (DATE-NAME.ext)")
    stem = m.group(2)
    for b in BENCHMARKS:
        if b.room == room and re.match(b.results, stem if stem else ""):
            return b
    raise ValueError(f"{room}/results/{name}: no benchmark of room {room} writes a result of that name")


def _first_seen(paths: list[Path]) -> dict[Path, int]:
    """When git first saw each file (seconds; a file it has not seen yet sorts last)."""
    seen: dict[Path, int] = {}
    for p in paths:
        out = subprocess.run(["git", "log", "--follow", "--format=%ct", "--", str(p)], cwd=BENCH,
                             capture_output=True, text=True).stdout.split()
        seen[p] = int(out[-1]) if out else 1 << 62
    return seen


def results(ordered: bool = True) -> list[Result]:
    """Every result, oldest first: by its date, then (``ordered``) by when git first saw its report."""
    groups: dict[Path, list[Path]] = {}
    for f in sorted(BENCH.glob("*/results/*")):
        if f.name.startswith("latest-"):
            continue
        m = DATED.match(f.name)
        if m is None:
            raise ValueError(f"{f.relative_to(BENCH)}: not a dated result (DATE-NAME.ext)")
        stem = CHART.sub("", m.group(2)) if m.group(3) == ".png" else m.group(2)  # (run.py's charts)
        groups.setdefault(f.parent / (m.group(1) + ("-" + stem if stem else "")), []).append(f)
    out = []
    for key, files in groups.items():
        report = next((f for f in files if f.suffix == ".md"), files[0])
        room = key.parent.parent.name
        out.append(Result(report, DATED.match(report.name).group(1),  # type: ignore[union-attr]
                          benchmark_of(room, report.name), tuple(sorted(f.name for f in files))))
    seen = _first_seen([r.path for r in out]) if ordered else {r.path: 0 for r in out}
    return sorted(out, key=lambda r: (r.date, seen[r.path], r.path.name))


def latest(rs: list[Result]) -> dict[Benchmark, Result]:
    """Each benchmark's newest result."""
    return {r.benchmark: r for r in rs}


def table(rs: list[Result]) -> str:
    lines = ["# Every benchmark's results", "",
             "Generated by `python benchmarks/shared/history.py` (run it after adding a result; the test "
             "suite checks it is current). Oldest first; each benchmark's newest report is also "
             "`benchmarks/<room>/results/latest-<benchmark>.md` (.txt where the report is text).", "",
             "| date | benchmark | result | files | title |", "|---|---|---|---|---|"]
    for r in rs:
        rel = r.path.relative_to(BENCH)
        stem = r.path.stem
        others = ", ".join(f[len(stem):].lstrip("-") if f.startswith(stem) else f for f in r.files if f != r.path.name)
        title = r.title.replace("|", "\\|")
        lines.append(f"| {r.date} | {r.benchmark.room}/{r.benchmark.script} | [{r.path.name}]({rel}) | "
                     f"{others or '-'} | {title} |")
    return "\n".join(lines) + "\n"


def links(rs: list[Result]) -> dict[Path, str]:
    """latest-<benchmark>.md (or .txt: the report's own kind) -> the report it names, one per benchmark."""
    return {BENCH / b.room / "results" / f"latest-{b.name}{r.path.suffix}": r.path.name for b, r in latest(rs).items()}


def check() -> list[str]:
    """What is stale, without git (a fresh clone's history may be shallow): every result listed in the
    table and nothing else, and each benchmark's latest link naming one of its reports of the latest
    date."""
    rs = results(ordered=False)
    wrong = []
    listed = set(re.findall(r"\]\(([^)]+)\)", HISTORY.read_text())) if HISTORY.exists() else set()
    have = {str(r.path.relative_to(BENCH)) for r in rs}
    wrong += [f"{HISTORY.name} does not list {p}" for p in sorted(have - listed)]
    wrong += [f"{HISTORY.name} lists {p}, which is not there" for p in sorted(listed - have)]
    newest: dict[Benchmark, str] = {}
    for r in rs:
        newest[r.benchmark] = max(newest.get(r.benchmark, ""), r.date)
    for b, date in newest.items():
        found = sorted(BENCH.glob(f"{b.room}/results/latest-{b.name}.*"))
        link = found[0] if found else BENCH / b.room / "results" / f"latest-{b.name}.md"
        target = os.readlink(link) if link.is_symlink() else None
        if target is None or not (link.parent / target).is_file() or not target.startswith(date):
            wrong.append(f"{link.relative_to(BENCH.parent)} should link a report of {date} (it links {target})")
    for link in BENCH.glob("*/results/latest-*"):
        if not any(link.name.startswith(f"latest-{b.name}.") for b in newest):
            wrong.append(f"{link.relative_to(BENCH.parent)} names no benchmark's latest result")
    return wrong


def write() -> None:
    rs = results()
    HISTORY.write_text(table(rs))
    want = links(rs)
    for link in BENCH.glob("*/results/latest-*"):
        if link not in want:
            link.unlink()
    for link, target in want.items():
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where the table or a link is stale")
    args = ap.parse_args()
    if args.check:
        wrong = check()
        for w in wrong:
            print(w, file=sys.stderr)
        return 1 if wrong else 0
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
