"""The Python API: training code talks to the daemon serving a mount point, without a subprocess.

    from epochfs import Client

    client = Client("/mnt/data")
    client.prefetch(paths, seed=42, epoch=3, rank=1, world_size=8)   # DistributedSampler's order
    client.hand_over(order, epoch=3)                                  # or any exact order
    client.warmup(["/mnt/data/val"])                                   # fill the cache now
    client.status()
    Client("/mnt/ckpt").sync()          # returns once what was written there is in the backend

Paths may be absolute (under the mount point: what a dataset's list of samples holds) or relative to
the mount root; an item may also be a ``(path, target)`` pair as in ``ImageFolder.samples``. Errors
are :class:`~epochfs.core.errors.EpochfsError` with the daemon's message.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from epochfs.control.client import request
from epochfs.core.errors import NotDurable
from epochfs.core.text import human
from epochfs.prefetch.manifest import epoch_order, mount_relative

PathItem = str | os.PathLike[str] | Sequence[Any]  # a path, or a (path, target) sample
SYNC_ROUND = 10.0  # seconds one sync request waits in the daemon before asking again


class Location(NamedTuple):
    """Where a packed member's bytes are: the shard's key (relative to the mount's source), the offset
    in it, and the shard's size."""

    store: str
    offset: int
    store_size: int


def _path(item: PathItem) -> str:
    if isinstance(item, (str, os.PathLike)):
        return os.fspath(item)
    return os.fspath(item[0])


def merge_rank(rank: int | None, world_size: int) -> int | None:
    """The rank a hand-over is merged under: the one named, else 0 of several; None (queued after the
    plan, not merged) only for a single unnamed rank."""
    if rank is not None:
        return rank
    return 0 if world_size > 1 else None


class Client:
    def __init__(self, mountpoint: str | os.PathLike[str], *, timeout: float = 60.0) -> None:
        self.mountpoint = os.path.abspath(mountpoint)
        self.timeout = timeout

    def _request(self, op: str, **args: Any) -> dict[str, Any]:
        return request(self.mountpoint, op, timeout=self.timeout, **args)

    def _entries(self, paths: Iterable[PathItem]) -> list[list[Any]]:
        return [[i, mount_relative(self.mountpoint, _path(p))] for i, p in enumerate(paths, 1)]

    def status(self) -> dict[str, Any]:
        """The daemon's state (what ``epochfs status --json`` prints)."""
        return self._request("status")

    def prefetch(self, paths: Sequence[PathItem], *, seed: int | None = None, epoch: int = 0,
                 rank: int | None = None, world_size: int = 1, drop_last: bool = False,
                 replace: bool = False, start: int = 0) -> dict[str, Any]:
        """Hand over the order in which this rank reads ``paths`` in ``epoch``: the dataset in index order,
        shuffled as ``DistributedSampler(shuffle=True, seed=seed, drop_last=drop_last)`` does when a
        seed is given (else read as given), and partitioned for ``rank`` of ``world_size``. A rank named
        (or more than one rank) is merged with the other ranks of this epoch on the node. ``start``: a
        job resumed mid-epoch has read the first ``start`` entries of this rank's order (its step times
        its batch size): only the rest is handed over."""
        if start < 0:
            raise ValueError("start is the number of entries of this rank's order already read")
        order = epoch_order(list(paths), seed=seed, epoch=epoch, rank=rank or 0, world_size=world_size,
                            drop_last=drop_last)
        return self.hand_over(order[start:], epoch=epoch, rank=merge_rank(rank, world_size), replace=replace)

    def hand_over(self, order: Iterable[PathItem], *, epoch: int | None = None, rank: int | None = None,
                  replace: bool = False, skip_missing: bool = False) -> dict[str, Any]:
        """Hand over an exact read order. It is queued after the plan being read (``replace``: instead
        of it); the orders of several ranks of one epoch (``rank`` given) are merged side by side. A
        path the mount does not have is an error, or with ``skip_missing`` left out of the hand-over
        (the reply's ``missing`` counts them, ``missing_message`` names the first)."""
        return self._request("prefetch", entries=self._entries(order), source="python", epoch=epoch,
                             replace=replace, rank=rank, skip_missing=skip_missing)

    def warmup(self, paths: Iterable[PathItem], *, wait: bool = True,
               progress: Callable[[dict[str, Any]], None] | None = None, poll: float = 0.2) -> dict[str, Any]:
        """Fill the cache with ``paths`` (files or directories) now, without evicting anything; with
        ``wait``, return when done (``progress`` is called with the job's state as it goes)."""
        job = self._request("warmup", entries=self._entries(paths), source="python")
        while wait and not job["finished"]:
            time.sleep(poll)
            job = self._request("job", id=job["id"])
            if progress is not None:
                progress(job)
        return job

    def locate(self, paths: Iterable[PathItem]) -> list[Location | None]:
        """Where each file's bytes are stored, in order: a :class:`Location` in its shard for a member of
        a packed dataset (``epochfs pack``), None for a plain object. What a locality order groups by
        (:func:`epochfs.prefetch.manifest.local_order`)."""
        reply = self._request("locate", entries=self._entries(paths), source="python")
        stores, sizes = reply["stores"], reply["sizes"]
        return [None if at is None else Location(stores[at[0]], at[1], sizes[at[0]]) for at in reply["locations"]]

    def shared(self, paths: Iterable[PathItem]) -> list[bool]:
        """Whether another mount of this node holds each file by content now (a first read copies it from
        there instead of fetching it: :mod:`epochfs.cache.shared`), in order."""
        items = self._entries(paths)
        held = set(self._request("locate", entries=items, source="python", shared=True).get("shared") or ())
        return [i in held for i in range(len(items))]

    def sync(self, paths: Iterable[PathItem] = (), *, timeout: float | None = None,
             progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Return once everything written through this --writeback mount (or ``paths``: files and
        directories under it) is in the backend: the point where a checkpoint is durable (what ``epochfs
        sync`` does); the daemon's last answer. A user waits for their own files only; an operator (root,
        the mount's user) for everyone's, other users' files still open for writing included. :class:`~epochfs.core.errors.NotDurable` when a file will never
        upload as it is (a write of it failed) or ``timeout`` seconds pass first, naming what is pending;
        the uploads go on. ``progress`` sees each answer that still lists uploads pending."""
        rel = [mount_relative(self.mountpoint, _path(p)) for p in paths]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = SYNC_ROUND if deadline is None else max(0.0, min(SYNC_ROUND, deadline - time.monotonic()))
            reply = request(self.mountpoint, "sync", timeout=wait + 30, paths=rel, wait=wait)
            if not reply["pending_total"]:
                return reply
            failed = reply.get("failed_total", 0)
            if failed and failed == reply["pending_total"]:
                raise NotDurable(f"{failed} files will not be uploaded: a write of each failed, so none is a "
                                 "finished file (write it again from the start, or remove it)", reply)
            if deadline is not None and time.monotonic() >= deadline:
                from epochfs.writeback.owed import pending_summary

                store = f"; {reply['publish_error']}" if reply.get("publish_error") else ""
                raise NotDurable(f"{reply['pending_total']} still pending ({human(reply['pending_bytes'])}) after "
                                 f"{timeout:g}s: {pending_summary(reply['pending'], reply['pending_total'])}{store}; "
                                 "they are kept and uploaded (and published) as the backend and the store allow",
                                 reply)
            if progress is not None:
                progress(reply)

    def cancel(self, job_id: int) -> dict[str, Any]:
        """Stop a warmup job (what is in flight finishes; nothing more is fetched)."""
        return self._request("cancel", id=job_id)
