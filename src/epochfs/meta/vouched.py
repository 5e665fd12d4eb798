"""A shared store that cannot vouch for owners and modes (no password: anyone who reaches it can write
it), with them taken from a source that can: the bucket's attribute records
(:mod:`epochfs.backend.attrs`), listed again at each load and change set read from the store.

The store's records that claim an owner and mode arrive closed to the mount's owner
(:func:`~epochfs.meta.base.decode_objects`); here each object the bucket has a record for is given that
record's attributes, and a directory with a record gets its marker. So a private checkpoint written
through a write-back mount stays private on every node, whatever the store says, and an entry whose
attributes only the store holds (a ``file://`` source, a pack of one) stays closed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, Protocol

from epochfs.core.records import ObjectInfo
from epochfs.meta.base import Change, MetaStore, Snapshot


class AttributeRecords(Protocol):
    """What this needs of :class:`epochfs.backend.attrs.Records`."""

    def __len__(self) -> int: ...

    def apply(self, objects: Iterable[ObjectInfo]) -> Iterator[ObjectInfo]: ...


class Vouched:
    """``store`` with every object's owner and mode as ``records()`` gives them."""

    def __init__(self, store: MetaStore, records: Callable[[], AttributeRecords]) -> None:
        self.store = store
        self.records = records
        self.url = store.url
        self.shared = store.shared
        self.trusted = False  # (the store itself; what this returns is vouched for by the bucket)

    def __getattr__(self, name: str) -> Any:  # everything else is the store's (membership included)
        return getattr(self.store, name)

    def _vouched(self, objects: Iterable[ObjectInfo]) -> list[ObjectInfo]:
        records = self.records()
        return list(records.apply(objects)) if len(records) else list(objects)

    def load(self, source: str) -> Snapshot | None:
        snapshot = self.store.load(source)
        return None if snapshot is None else replace(snapshot, objects=self._vouched(snapshot.objects))

    def changes(self, source: str, after: int, upto: int) -> list[Change] | None:
        changes = self.store.changes(source, after, upto)
        if not changes:
            return changes
        records = self.records()
        if not len(records):
            return changes
        return [replace(c, added={o.key: o for o in records.apply(c.added.values())}) for c in changes]
