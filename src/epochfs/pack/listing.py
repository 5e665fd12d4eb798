"""What a mount lists: the original tree of a packed dataset (its current index), or a plain source's
objects. One entry point, :func:`dataset_listing`, for the daemon and ``epochfs import`` alike: a
packed root is recognised by its pointer object, so ``epochfs mount s3://b/packed`` needs no flag.

Blocking (a worker thread calls it, as it calls the backend)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from epochfs.backend.base import Backend, servable
from epochfs.core.errors import BackendError, ConfigError
from epochfs.core.records import MEMBER_TAG, ObjectInfo
from epochfs.pack.layout import (
    MAX_INDEX_BYTES,
    MAX_POINTER_BYTES,
    POINTER,
    Index,
    PackInvalid,
    decode_index,
    decode_pointer,
)

log = logging.getLogger(__name__)


def read_object(backend: Backend, info: ObjectInfo, limit: int) -> bytes:
    """All of a small object of the pack (pinned to the version ``info`` names)."""
    if info.size > limit:
        raise PackInvalid(f"{info.key} is {info.size} bytes (at most {limit})")
    return bytes(backend.read_range(info.key, info.etag, 0, info.size))


def current_index(backend: Backend) -> Index | None:
    """The index the pointer names, or None if the root holds no pack. :class:`PackInvalid` if the
    pointer or the index is malformed (or the index it names is missing)."""
    pointer = backend.stat(POINTER)
    if pointer is None:
        return None
    generation, key = decode_pointer(read_object(backend, pointer, MAX_POINTER_BYTES))
    info = backend.stat(key)
    if info is None:
        raise PackInvalid(f"the pack's pointer names {key}, which is missing")
    return decode_index(read_object(backend, info, MAX_INDEX_BYTES), generation)


def dataset_listing(backend: Backend, *, writable: bool = False) -> Iterator[ObjectInfo]:
    """The objects a mount of ``backend``'s root serves. A packed root is read-only: ``writable`` (a
    write-back mount) on one is a :class:`ConfigError`."""
    try:
        index = current_index(backend)
    except BackendError as exc:  # (the error names what the user asked for, not the probe)
        # (the probe's key is ours, not the user's: the URL names the endpoint and the prefix without it)
        cause = str(exc).removeprefix(f"HEAD {POINTER}: ").replace(f"/{POINTER}", "/")
        exc.args = (f"reading {backend.source_id}: the backend's first answer failed: {cause} (check the "
                    "endpoint, --endpoint-url, and the credentials)",)
        raise
    if index is None:
        for obj in backend.list_objects():
            if obj.etag.startswith(MEMBER_TAG):  # only a pack's index locates bytes in other objects
                log.warning("skipping listed object %r: its ETag looks like a packed member's", obj.key[:300])
                continue
            yield obj
        return
    if writable:
        raise ConfigError("the source is a packed dataset (epochfs pack), which is read-only: mount it "
                          "without --writeback, and write checkpoints to a plain prefix")
    log.info("packed dataset, generation %d: %d files in %d shards", index.generation, len(index.members),
             len(index.shards))
    yield from servable(index.objects())
