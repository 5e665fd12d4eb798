"""Renames on a write-back mount (a part of :class:`~epochfs.writeback.service.WriteBack`): a file or a
directory made here and not yet uploaded moves under its new name (the upload uses the final one); an
object already in the backend cannot (EXDEV: S3 has no rename, ``mv`` then copies). And the names a
change may make: keys the backend can store, checked when they are made.
"""

from __future__ import annotations

import errno
import logging

from epochfs.backend.base import Backend
from epochfs.core.errors import NotFound, Refused
from epochfs.core.records import NAME_MAX, unsafe_reason
from epochfs.writeback.journal import Journal
from epochfs.writeback.owed import Owed
from epochfs.writeback.tree import LocalDir, LocalFile, Node, Overlay, Tree

log = logging.getLogger(__name__)


def path_in(parent: Node, name: bytes) -> str:
    """The key of ``name`` in the directory ``parent``; Refused (EINVAL, ENAMETOOLONG) if it cannot be one."""
    try:
        text = name.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused("names must be UTF-8", errno.EINVAL) from None
    if len(name) > NAME_MAX:
        raise Refused("name too long", errno.ENAMETOOLONG)
    path = f"{parent.path}/{text}" if parent.path else text
    if unsafe_reason(path):
        raise Refused(f"{path!r} cannot be an object key ({unsafe_reason(path)})", errno.EINVAL)
    return path


def check_key(backend: Backend, key: str) -> None:
    """Refuse a name the backend could never store (ENAMETOOLONG, EINVAL, EPERM), when it is made."""
    problem = backend.key_problem(key)
    if problem is not None:
        raise Refused(f"{key[:300]!r}: {problem[0]}", problem[1])


class Renames:
    tree: Tree
    overlay: Overlay
    backend: Backend
    journal: Journal
    owed: Owed

    def _drop_local(self, f: LocalFile) -> None: ...  # (WriteBack's)

    def _save(self, f: LocalFile, *, closed: bool) -> None: ...

    def _save_dir(self, d: LocalDir) -> None: ...

    def _add_parents(self, key: str) -> None: ...

    def _cancel_delete(self, path: str) -> None: ...

    def _in_backend(self, path: str) -> bool: ...

    def _delete_key(self, path: str) -> None: ...

    def rename(self, old_parent: Node, old_name: bytes, new_parent: Node, new_name: bytes, flags: int) -> None:
        src_path, dst_path = path_in(old_parent, old_name), path_in(new_parent, new_name)
        src = self.tree.resolve(src_path)
        if src is None:
            raise NotFound(src_path)
        if flags & ~1:  # RENAME_NOREPLACE (1) is supported; RENAME_EXCHANGE is not
            raise Refused("rename flags not supported", errno.EINVAL)
        if src_path == dst_path:
            return
        if dst_path.startswith(src_path + "/"):
            raise Refused("cannot move a directory into itself", errno.EINVAL)
        check_key(self.backend, dst_path + ("/" if src.is_dir else ""))
        if src.is_dir:  # every name it holds gets longer or shorter with it
            for p, e in list(self.overlay.entries.items()):
                if p.startswith(src_path + "/"):
                    check_key(self.backend, dst_path + p[len(src_path):] + ("/" if e.is_dir else ""))
        dst = self.tree.resolve(dst_path)
        if dst is not None and flags & 1:
            raise Refused(f"{dst_path} exists", errno.EEXIST)
        if src.written_here:
            if dst is not None and dst.is_dir:
                raise Refused(f"{dst_path} is a directory", errno.EISDIR)
            if dst is not None:
                self._replaced_by_rename(dst_path, dst)
            self._move(src, dst_path)
        elif src.made_here and src.is_dir:
            moved = [e for p, e in self.overlay.entries.items() if p.startswith(src_path + "/")]
            if any(not e.made_here for e in moved):
                raise Refused(f"{src_path} holds objects already in the backend", errno.EXDEV)
            if dst is not None:
                if not dst.is_dir or not self.tree.is_empty_dir(dst):
                    raise Refused(f"{dst_path} exists", errno.ENOTEMPTY if dst.is_dir
                                  else errno.ENOTDIR)
                self.overlay.remove(dst_path)
                self.journal.drop_dir(dst_path)
            for e in sorted([src, *moved], key=lambda e: e.path.count("/")):
                self._move(e, dst_path + e.path[len(src_path):])
        else:
            raise Refused(f"{src_path} is already in the backend: it cannot be renamed there", errno.EXDEV)
        self.owed.touch()

    def _replaced_by_rename(self, path: str, dst: Node) -> None:
        if dst.written_here:
            self.overlay.remove(path)
            self._drop_local(dst)
        # an object in the backend under that key is overwritten by the upload of the renamed file

    def _move(self, e: LocalDir | LocalFile, path: str) -> None:
        self.overlay.remove(e.path)
        old = e.path
        e.path = path
        self._add_parents(path)
        self.overlay.put(e)
        self.overlay.hidden.discard(path)
        if e.is_dir:
            self.journal.drop_dir(old)
            self._save_dir(e)
        if e.written_here:
            self._cancel_delete(path)
            if self._in_backend(old):  # it had replaced an object: that one goes with the old name
                self._delete_key(old)
            e.generation += 1
            self.owed.cancel_upload(e)
            self._save(e, closed=e.closed)
            self.owed.kick()
        log.debug("renamed %s to %s", old, path)
