"""The short lock that numbers a shared store's change sets (:meth:`epochfs.meta.redis.RedisMetaStore.update`),
held for the change's own size and expiring if its holder dies, and the tokens of calls that may hold it
without knowing: a failover or a dropped connection can take the answer to an acquire or a release and
leave the lock on the promoted replica, where every writer would wait out its timeout. Each acquire
uses a token of its own; a call whose answer was lost keeps its token, and before the next acquire the
lock is released if it still holds one of them (compared and deleted in one script, as any release is:
a lock that expired and another node took is left alone). Schema: ``docs/metadata-store.md``."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from epochfs.meta.redis_link import MetaUnavailable

log = logging.getLogger(__name__)

LOCK_TIMEOUT = 30  # seconds an update lock outlives a holder that died (held for milliseconds)
_WAIT = 60  # seconds an update waits for another node's lock
_UNRELEASED_MAX = 256  # tokens of locks a store may hold unknowingly, kept to release
#: Delete KEYS[1] if it holds any of ARGV (the tokens of this store's calls whose answers were lost).
_RELEASE_ANY = """local held = redis.call('get', KEYS[1])
for i = 1, #ARGV do if held == ARGV[i] then return redis.call('del', KEYS[1]) end end
return 0"""


class UpdateLocks:
    """Update locks taken through ``client`` (calls made through ``call``, which turns the connection's
    errors into :class:`MetaUnavailable`), and the tokens of those this store may hold unknowingly:
    name -> {token: when taken}."""

    def __init__(self, client: redis.Redis, call: Callable[..., Any], url: str) -> None:
        self._redis = client
        self._call = call
        self._url = url
        self._unreleased: dict[str, dict[bytes, float]] = {}
        self._guard = threading.Lock()

    @contextmanager
    def held(self, name: str, what: str) -> Iterator[None]:
        """Hold the lock ``name`` (of ``what``, for errors) for the body. :class:`MetaUnavailable` when
        the store cannot be reached or another node held it for a minute."""
        self._release_unreleased(name)
        lock = self._redis.lock(name, timeout=LOCK_TIMEOUT, blocking_timeout=_WAIT)
        token = uuid.uuid4().hex.encode()  # ours, known even when the answer to the acquire is lost
        try:
            acquired = self._call(lambda: lock.acquire(token=token))
        except MetaUnavailable:
            self._keep(name, token)
            raise
        if not acquired:
            raise MetaUnavailable(f"metadata store {self._url}: another node held the update lock of {what} "
                                  "for a minute")
        try:
            yield
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                pass  # expired (its timeout bounds any hold)
            except redis.exceptions.RedisError:  # not reached: released before the next acquire, or expires
                self._keep(name, token)

    def _keep(self, name: str, token: bytes, taken: float | None = None) -> None:
        """``token`` may hold the lock ``name``: a call that took it (or asked to; at ``taken``, by
        default now) lost its answer."""
        now = time.monotonic()
        with self._guard:
            tokens = self._unreleased.setdefault(name, {})
            for old in [t for t, at in tokens.items() if now - at > LOCK_TIMEOUT]:
                del tokens[old]  # expired in the store by now
            if len(tokens) >= _UNRELEASED_MAX:
                del tokens[min(tokens, key=tokens.__getitem__)]
            tokens[token] = now if taken is None else taken

    def _release_unreleased(self, name: str) -> None:
        """Release the lock ``name`` if one of this store's calls took it and could not release it, and
        it is still that call's. Unreachable: kept for the next try."""
        with self._guard:
            tokens = self._unreleased.pop(name, None)
        if not tokens:
            return
        try:
            if self._redis.eval(_RELEASE_ANY, 1, name, *tokens):
                log.info("metadata store %s: released the update lock a failed call left behind", self._url)
        except redis.exceptions.RedisError:
            for token, taken in tokens.items():  # (when each was taken: they expire in the store from then)
                self._keep(name, token, taken)
