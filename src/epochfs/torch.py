"""PyTorch integration: a sampler wrapper that hands each epoch's exact read order to the daemon.

Two lines change in a training script::

    sampler = EpochfsSampler(DistributedSampler(dataset, shuffle=True, seed=42), dataset.samples, "/mnt/data")
    loader = DataLoader(dataset, batch_size=256, sampler=sampler, num_workers=8)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)          # hands this epoch's order to the daemon
        for batch in loader: ...

The wrapper draws the inner sampler's order once per epoch, hands exactly that order (as the
dataset's paths) to the daemon, and yields the same indices to the DataLoader: the order the daemon
prefetches is the order the DataLoader reads, by construction, for any sampler (a ``RandomSampler``
without a seed too). The ranks of a ``DistributedSampler`` on one node are merged side by side by the
daemon. A daemon that cannot be reached never stops training: the wrapper logs a warning once and goes on;
paths the mount lacks are logged and left out, and the rest of the order is handed over.

For a packed dataset (``epochfs pack``), :func:`local_sampler` draws an order that is random enough
for training and reads the shards' blocks in runs (shards permuted, samples shuffled within a window of
a few shards), exact and partitioned like ``DistributedSampler``, and hands it over the same way::

    sampler = local_sampler(dataset.samples, "/mnt/data", seed=42, window=4)

Imported only when PyTorch is installed (``import epochfs.torch``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

from epochfs.client import Client, PathItem
from epochfs.control.client import tell_once
from epochfs.core.errors import EpochfsError
from epochfs.prefetch.manifest import local_order
from epochfs.watch import watch

__all__ = ["EpochfsSampler", "LocalOrderSampler", "local_sampler", "watch"]

log = logging.getLogger(__name__)


class EpochfsSampler(Sampler[int]):
    """Wraps ``sampler``; ``paths[i]`` is the file sample ``i`` reads (a path absolute under the mount
    point or relative to its root, or a ``(path, target)`` pair as in ``ImageFolder.samples``)."""

    def __init__(self, sampler: Sampler[int], paths: Sequence[PathItem], mountpoint: str | os.PathLike[str], *,
                 client: Client | None = None, background: bool = True) -> None:
        self.sampler = sampler
        self.paths = paths
        self.client = client or Client(mountpoint)
        self.background = background
        self.epoch = 0
        self._order: list[int] | None = None
        self._drawn: int | None = None  # the length of the order last drawn (the epoch being read)
        self._warned = False
        self._sender: threading.Thread | None = None

    def __len__(self) -> int:
        """The samples of the epoch set or being read: what is left of an epoch resumed mid-way (before
        and while it is iterated), else the inner sampler's."""
        if self._order is not None:
            return len(self._order)
        if self._drawn is not None:
            return self._drawn
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Set the inner sampler's epoch, draw that epoch's order and hand it to the daemon. ``start``: a
        job resumed from a checkpoint mid-epoch has read the first ``start`` samples of this epoch's
        order (its step times its batch size): the epoch goes on from there, and only the rest is
        handed over (the daemon prefetches what is still to be read, not what was)::

            sampler.set_epoch(ckpt["epoch"], start=ckpt["step"] * batch_size)
        """
        if start < 0:
            raise ValueError("start is the number of samples of this epoch already read")
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        self._order = list(iter(self.sampler))[start:]
        self._hand_over(self._order, epoch)

    def __iter__(self) -> Iterator[int]:
        order = self._order
        self._order = None
        if order is None:  # no set_epoch() this time: draw the order now
            order = list(iter(self.sampler))
            self._hand_over(order, self.epoch)
            self.epoch += 1
        self._drawn = len(order)
        return iter(order)

    def _rank(self) -> int | None:
        replicas = getattr(self.sampler, "num_replicas", 1)
        return getattr(self.sampler, "rank", None) if isinstance(replicas, int) and replicas > 1 else None

    def _hand_over(self, order: list[int], epoch: int) -> None:
        paths = [self.paths[i] for i in order]
        if self._sender is not None:
            self._sender.join()  # one hand-over at a time, in epoch order
        if self.background:  # the training loop does not wait for the daemon
            self._sender = threading.Thread(target=self._send, args=(paths, epoch), name="epochfs-hand-over",
                                            daemon=True)
            self._sender.start()
        else:
            self._send(paths, epoch)

    def _send(self, paths: list[Any], epoch: int) -> None:
        try:
            reply = self.client.hand_over(paths, epoch=epoch, rank=self._rank(), skip_missing=True)
        except EpochfsError as exc:
            if not self._warned:
                if log.hasHandlers():  # (one line: through the job's logging if it has any, else on stderr)
                    log.warning("epochfs: could not hand epoch %d's order to the daemon (%s); training goes on "
                                "without prefetch", epoch, exc)
                else:
                    tell_once("the sampler (no epoch order handed over, nothing fetched ahead)",
                              self.client.mountpoint, exc)
                self._warned = True
            log.debug("hand-over of epoch %d failed: %s", epoch, exc)
            return
        if reply.get("missing"):
            log.warning("epochfs: epoch %d's order names %d paths the mount does not have, handed over without "
                        "them: %s", epoch, reply["missing"], reply.get("missing_message", ""))

    def wait(self) -> None:
        """Wait until the last hand-over reached the daemon (tests, or a script that wants to know)."""
        if self._sender is not None:
            self._sender.join()


class LocalOrderSampler(Sampler[int]):
    """The indices of samples stored in ``groups`` (``groups[i]``: where sample ``i`` is, such as its
    shard) in :func:`~epochfs.prefetch.manifest.local_order`, for one rank of ``num_replicas``. With
    ``num_replicas`` or ``rank`` not given they are taken from ``torch.distributed`` when it is
    initialised (as ``DistributedSampler`` does), else one replica."""

    def __init__(self, groups: Sequence[Any], *, seed: int = 0, window: int = 4, num_replicas: int | None = None,
                 rank: int | None = None, drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            initialised = dist.is_available() and dist.is_initialized()
            num_replicas = num_replicas if num_replicas is not None else dist.get_world_size() if initialised else 1
            rank = rank if rank is not None else dist.get_rank() if initialised else 0
        self.groups = list(groups)
        self.seed, self.window, self.drop_last = seed, window, drop_last
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        local_order([0], seed=seed, epoch=0, window=window, rank=rank, world_size=num_replicas)  # checks them

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(local_order(self.groups, seed=self.seed, epoch=self.epoch, window=self.window, rank=self.rank,
                                world_size=self.num_replicas, drop_last=self.drop_last))

    def __len__(self) -> int:
        n, w = len(self.groups), self.num_replicas
        return n // w if self.drop_last else -(-n // w)


def local_sampler(paths: Sequence[PathItem], mountpoint: str | os.PathLike[str], *, seed: int = 0, window: int = 4,
                  num_replicas: int | None = None, rank: int | None = None, drop_last: bool = False,
                  client: Client | None = None, background: bool = True) -> EpochfsSampler:
    """An :class:`EpochfsSampler` over a :class:`LocalOrderSampler` grouped by where the mount stores
    each of ``paths`` (asked of the daemon once): a packed dataset's samples by shard. A plain dataset's
    files are each their own group, so its order is a plain random permutation."""
    client = client or Client(mountpoint)
    where = client.locate(paths)
    groups = [loc[0] if loc is not None else i for i, loc in enumerate(where)]
    inner = LocalOrderSampler(groups, seed=seed, window=window, num_replicas=num_replicas, rank=rank,
                              drop_last=drop_last)
    return EpochfsSampler(inner, paths, mountpoint, client=client, background=background)
