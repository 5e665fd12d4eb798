"""docs/architecture.md is the house as the code has it: its floors table names exactly the rooms of
``src/epochfs`` (each package, and each module at the top), its rooms table names them all too, and
every import of every module (type-checking ones included) goes to its own room or a room on a lower
floor."""

from __future__ import annotations

import re
from pathlib import Path

from .test_layout import SRC, graph

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def rooms_of_tree() -> set[str]:
    packages = {f"{p.name}/" for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return packages | {p.name for p in SRC.glob("*.py")}


def floors_of_doc() -> dict[str, int]:
    text = DOC.read_text()
    table = text[text.index("| floor | rooms |"):].split("\n\n", 1)[0]
    floors = {}
    for line in table.splitlines()[2:]:
        number, rooms = line.strip("|").split("|")
        for room in re.findall(r"`([^`]+)`", rooms):
            assert room not in floors, f"{room} is on two floors"
            floors[room] = int(number)
    return floors


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    if (SRC / parts[1]).is_dir():
        return f"{parts[1]}/"
    return f"{parts[1]}.py"


def test_the_floors_name_every_room_of_the_tree_and_no_other():
    assert set(floors_of_doc()) == rooms_of_tree()


def test_the_rooms_table_names_every_room():
    text = DOC.read_text()
    table = text[text.index("| room | holds |"):].split("\n\n", 1)[0]
    named = {re.match(r"\| `([^`]+)` \|", line).group(1) for line in table.splitlines()[2:]}
    assert named == rooms_of_tree()


def test_every_import_goes_to_its_own_room_or_down():
    floors = floors_of_doc()
    up = []
    for module, deps in graph(typing=True).items():
        mine = room_of(module)
        for dep in deps:
            theirs = room_of(dep)
            if theirs != mine and floors[theirs] >= floors[mine]:
                up.append(f"{module} ({mine}, floor {floors[mine]}) imports {dep} ({theirs}, floor {floors[theirs]})")
    assert not up, "\n".join(up)
