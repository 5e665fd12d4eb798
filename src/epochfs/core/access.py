"""Who may read what, decided as the kernel decides it for a read through the mount
(``default_permissions``): a caller (:class:`Caller`: its uid, gid and groups as the kernel names them),
the rule of one entry's mode (:func:`allowed`), and which entries of a snapshot a caller may reach and
read (:class:`PathAccess`: search on every directory from the root down, read on the entry, from the
modes and owners the mount presents: ``presented``, the FUSE adapter's own attributes, so a request, an
``open`` and a guess of the learned order agree). Pure; used in worker threads and on the trio thread,
one :class:`PathAccess` per request or walk (directory answers are remembered for it only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Caller:
    """A request's caller: its uid, gid, supplementary groups and pid (0 where unknown), and whether
    it is an operator of the mount (root, the daemon's user, a member of the control group)."""

    uid: int
    gid: int
    groups: frozenset[int] = frozenset()
    pid: int = 0
    operator: bool = False

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups

    def describe(self) -> str:
        return f"uid {self.uid}" + (f" (pid {self.pid})" if self.pid else "")


def allowed(mode: int, owner: int, group: int, caller: Caller, want: int) -> bool:
    """Whether ``caller`` has the ``want`` bits (4 read, 2 write, 1 search) of an entry presented with
    ``mode``, ``owner`` and ``group``, as the kernel's ``generic_permission`` decides (root may read and
    search anything)."""
    if caller.uid == 0:
        return True
    if caller.uid == owner:
        bits = (mode >> 6) & 7
    elif caller.in_group(group):
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


Presented = Callable[[Any], tuple[int, int, int]]  # node -> (mode, uid, gid)
_R, _X = 4, 1


class PathAccess:
    def __init__(self, resolve: Callable[[str], Any], presented: Presented, caller: Caller) -> None:
        self.resolve = resolve
        self.presented = presented
        self.caller = caller
        self._searchable: dict[str, bool] = {}

    def _allows(self, node: Any, want: int) -> bool:
        mode, uid, gid = self.presented(node)
        return allowed(mode, uid, gid, self.caller, want)

    def searchable(self, path: str) -> bool:
        """Whether the caller may pass through every directory from the root down to ``path``
        (``""``: the root) inclusive."""
        chain = []  # the directories not yet answered, from ``path`` up
        here = path
        while here not in self._searchable:
            chain.append(here)
            if not here:
                break
            here = here.rpartition("/")[0]
        ok = self._searchable.get(here, True)  # (above the root: nothing to pass)
        for step in reversed(chain):
            node = self.resolve(step) if ok else None
            ok = node is not None and getattr(node, "is_dir", False) and self._allows(node, _X)
            self._searchable[step] = ok
        return self._searchable[path]

    def readable(self, node: Any) -> bool:
        """Whether the caller may read the file ``node`` (or list the directory ``node``)."""
        parent = node.path.rpartition("/")[0] if node.path else ""
        if node.path and not self.searchable(parent):
            return False
        if getattr(node, "is_dir", False):
            return self.searchable(node.path) and self._allows(node, _R)
        return self._allows(node, _R)
