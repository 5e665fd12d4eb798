"""The README is the front door and the reference lives in docs/: every relative link in them (and in
the benchmarks' README) reaches a file of the checkout, and every #anchor a heading of that file, so a
section that moves stays linked."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, fence, seen = set(), False, {}
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            s = slug(line.lstrip("#"))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[str]:
    text, fence, kept = path.read_text(), False, []
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return re.findall(r"\]\(([^)\s]+)\)", "\n".join(kept))


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z]+:", target):
                continue  # (a URL)
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_door():
    """What a newcomer needs (what it is, the two commands, a first mount, a first training job, where to
    read on) and links to the rest, not the reference itself."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, len(text.splitlines())
    for heading in ("## Quick start", "## A first mount", "## A first training job", "## Where to read on"):
        assert heading in text, heading
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{doc.name}" in text, f"the README does not lead to docs/{doc.name}"
