"""Which entries of the snapshot a caller may read, decided as the kernel decides it for a read through
the mount (``default_permissions``): search on every directory from the root down, read on the entry,
from the modes and owners the mount presents (``presented``: the FUSE adapter's own attributes, so a
request and an ``open`` agree). Pure over the namespace; used in worker threads, one object per
request (directory answers are remembered for the request only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from epochfs.control.caller import Caller, allowed

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
