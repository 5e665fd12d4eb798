"""Eviction policies: pure bookkeeping over block ids, no I/O. One policy per module of this package.

The store tells a policy what it holds (``inserted``/``removed``) and what the reader used
(``accessed``). When it needs room it asks for a ``victim`` and whether a new block should replace it
(``prefer``); a policy that prefers the victim makes the store read through instead of caching. A
policy that wants to know the future implements the optional hooks ``plan`` (the block sequence of
the epochs handed over) and ``advance`` (the reader's position in it); the others inherit no-ops.

Adding a policy is adding a module here with a subclass of :class:`EvictionPolicy` decorated with
:func:`register`: ``--eviction``, ``epochfs plan`` and the simulator find it by its name.

The reader's position is the block it is reading: that block's use counts as future until the reader
moves on, so it is never the victim while it is being read; whether a demand miss is worth caching is
judged by its use after the current one.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from typing import TypeVar

P = TypeVar("P", bound="type[EvictionPolicy]")
_REGISTRY: dict[str, type[EvictionPolicy]] = {}


class EvictionPolicy:
    """The interface every policy implements (the two future hooks are optional)."""

    name: str
    help: str  # one line for --help

    def inserted(self, bid: bytes, size: int) -> None:
        """A block is now resident."""
        raise NotImplementedError

    def accessed(self, bid: bytes) -> None:
        """The reader used a resident block."""
        raise NotImplementedError

    def removed(self, bid: bytes) -> None:
        """A block is no longer resident (evicted, corrupt or dropped)."""
        raise NotImplementedError

    def victim(self) -> bytes | None:
        """The block to evict next, or None if nothing may be evicted. Does not remove it."""
        raise NotImplementedError

    def prefer(self, candidate: bytes, victim: bytes, in_use: bool = False) -> bool:
        """Whether caching ``candidate`` is worth evicting ``victim``. ``in_use``: the reader is using
        ``candidate`` right now (a demand miss), so what counts is its use after this one."""
        raise NotImplementedError

    def plan(self, sequence: Sequence[bytes], uses: dict[bytes, list[int]] | None = None) -> None:
        """Optional: the blocks the reader will use, in order (the reader is at position 0), and each
        block's positions in it if already computed."""

    def advance(self, position: int) -> None:
        """Optional: the reader has reached ``position`` of the planned sequence."""


def register(name: str, help: str) -> Callable[[P], P]:
    """Class decorator: make a policy available under ``name``."""

    def decorate(cls: P) -> P:
        cls.name, cls.help = name, help
        _REGISTRY[name] = cls
        return cls

    return decorate


_discovered = False


def _discover() -> dict[str, type[EvictionPolicy]]:
    """Every policy module imported once (one imported on its own before registers only itself)."""
    global _discovered
    if not _discovered:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
        _discovered = True
    return _REGISTRY


def names() -> list[str]:
    """Every registered policy name, the default first."""
    return sorted(_discover(), key=lambda n: (n != DEFAULT, n))


def describe() -> str:
    return "; ".join(f"{n}: {_discover()[n].help}" for n in names())


def make_policy(name: str) -> EvictionPolicy:
    try:
        return _discover()[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (choose from {', '.join(names())})") from None


def make_room(policy: EvictionPolicy, candidate: bytes, fits: Callable[[], bool], evict: Callable[[bytes], None],
              in_use: bool = False) -> bool:
    """The one admission rule (the store and the simulator both use it): while ``candidate`` does not
    fit, evict the policy's victim if the policy prefers the candidate to it. False, with only what the
    policy gave up evicted, when the candidate should be read through instead."""
    while not fits():
        victim = policy.victim()
        if victim is None or not policy.prefer(candidate, victim, in_use):
            return False
        evict(victim)
    return True


DEFAULT = "manifest"
