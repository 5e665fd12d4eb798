"""How a node reaches the shared store: a ``redis://`` or ``rediss://`` URL, or the sentinels of a Redis
Sentinel deployment (``redis[s]+sentinel://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]``), the
connection's errors as :class:`MetaUnavailable`, the master in use (logged when a failover changes it),
and the wait for a replica that acknowledges a publication on a Sentinel store. What the store holds is
:mod:`epochfs.meta.redis`'s. Schema and guarantees: ``docs/metadata-store.md``."""

from __future__ import annotations

import logging
import re
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import redis

from epochfs.core.errors import BackendUnavailable, ConfigError
from epochfs.meta.base import StoreAccess, StoreRefused

log = logging.getLogger(__name__)


class MetaUnavailable(BackendUnavailable):
    """The shared metadata store cannot be reached."""


def _plain(exc: Exception) -> str:
    """redis-py's message without its errno prefix ("Error 111 connecting to ...")."""
    text = str(exc).rstrip(".")
    m = re.match(r"Error \d+ connecting to \S+\.\s*(.*)", text)
    return m.group(1) if m and m.group(1) else re.sub(r"^Error \d+ ", "", text)


def _plain_url(url: str) -> tuple[urllib.parse.ParseResult, str]:
    """The URL parsed, and as logs and errors show it (no user name's password: there is none)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
        raise ConfigError(f"--meta {url!r}: expected redis[s]://[USER@]HOST[:PORT][/DB]")
    if parsed.password is not None:
        raise ConfigError("--meta: a password in the URL would show in process listings and logs; put it in "
                          "a file of mode 0600 and give --meta-password-file (or EPOCHFS_META_PASSWORD)")
    try:
        port = parsed.port or 6379
    except ValueError:
        raise ConfigError(f"--meta {url!r}: the port is not a number") from None
    user = f"{parsed.username}@" if parsed.username else ""
    return parsed, f"{parsed.scheme}://{user}{parsed.hostname}:{port}{parsed.path or '/0'}"


@dataclass(frozen=True)
class SentinelTarget:
    """Where a Sentinel-managed store is: the sentinels, the service they watch, the database."""

    tls: bool
    user: str | None
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int


def _sentinel_url(url: str) -> tuple[SentinelTarget, str]:
    """``redis[s]+sentinel://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`` parsed, and as logs show it."""
    scheme, _, rest = url.partition("://")
    netloc, _, path = rest.partition("/")
    usage = "expected redis+sentinel://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"
    user, at, hosts = netloc.rpartition("@")
    if ":" in user:
        raise ConfigError("--meta: a password in the URL would show in process listings and logs; put it in "
                          "a file of mode 0600 and give --meta-password-file (or EPOCHFS_META_PASSWORD)")
    sentinels = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--meta {url!r}: {item!r} is not HOST:PORT of a sentinel; {usage}")
        sentinels.append((host, int(port)))
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2 or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", parts[0]) or (
            len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError(f"--meta {url!r}: name the service the sentinels watch (and a database number); {usage}")
    target = SentinelTarget(scheme == "rediss+sentinel", user or None, tuple(sentinels), parts[0],
                            int(parts[1]) if len(parts) == 2 else 0)
    shown = f"{scheme}://{user + at}{','.join(f'{h}:{p}' for h, p in sentinels)}/{target.service}/{target.db}"
    return target, shown


def online_replicas(replication: dict[str, Any]) -> int:
    """Replicas an ``INFO replication`` answer lists as online (past their first full copy: only those
    acknowledge a ``WAIT``)."""
    return sum(1 for key, value in replication.items()
               if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")


class Link:
    """One store's connection. ``client`` is redis-py's (a Sentinel store's follows the master)."""

    #: How long a write waits for a replica to hold it (a Sentinel store): a publication is acknowledged
    #: only once a replica has it, so a failover does not lose it.
    REPLICA_WAIT = 5.0

    def __init__(self, url: str, access: StoreAccess) -> None:
        self._sentinel: SentinelTarget | None = None
        self.master: tuple[str, int] | None = None  # (a Sentinel store) the master last in use
        self.master_since: float | None = None  # when that master was first used
        self._alone_since: float | None = None  # since when the master has had no replica to wait for
        if "+sentinel://" in url:
            self._sentinel, self.url = _sentinel_url(url)
            self._open_sentinel(access)
            return
        parsed, self.url = _plain_url(url)
        tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True,
               **({"ssl_ca_certs": access.ca_file} if access.ca_file else {})} if parsed.scheme == "rediss" else {}
        if access.ca_file and parsed.scheme != "rediss":
            raise ConfigError("--meta-ca-file is for a TLS store: use rediss://")
        self.client = redis.Redis.from_url(
            url, password=access.password.decode("utf-8", "surrogateescape") if access.password else None,
            socket_timeout=10, socket_connect_timeout=5, health_check_interval=30, **tls)

    def _open_sentinel(self, access: StoreAccess) -> None:
        import redis.sentinel

        target = self._sentinel
        assert target is not None
        if access.ca_file and not target.tls:
            raise ConfigError("--meta-ca-file is for a TLS store: use rediss+sentinel://")
        tls = {"ssl": True, "ssl_cert_reqs": "required", "ssl_check_hostname": True,
               **({"ssl_ca_certs": access.ca_file} if access.ca_file else {})} if target.tls else {}
        timeouts = {"socket_timeout": 10, "socket_connect_timeout": 5}
        # The sentinels answer without a password (bind them to the cluster's network): they only say
        # where the master is, and what a node then reads from it is signed (--meta-password-file).
        self._sentinels = redis.sentinel.Sentinel(list(target.sentinels), sentinel_kwargs={**timeouts, **tls},
                                                  **timeouts)
        self.client = self._sentinels.master_for(
            target.service, db=target.db, username=target.user,
            password=access.password.decode("utf-8", "surrogateescape") if access.password else None,
            health_check_interval=30, **timeouts, **tls)

    def _note_master(self) -> None:
        """Which master the last call went to (a Sentinel store): a change is logged and kept for status."""
        if self._sentinel is None:
            return
        address = getattr(self.client.connection_pool, "master_address", None)
        if address is None or tuple(address) == self.master:
            return
        before, self.master, self.master_since = self.master, (str(address[0]), int(address[1])), time.time()
        if before is not None:
            log.warning("metadata store %s: the master is now %s:%d (was %s:%d): a failover", self.url,
                        *self.master, *before)

    def replicated(self, what: str) -> None:
        """A Sentinel store: wait until a replica holds what was just written, or fail (not acknowledged:
        the writer publishes it again, and a publication already there is found and not repeated)."""
        if self._sentinel is None:
            return
        connected = online_replicas(self.call(self.client.info, "replication"))
        if not connected:  # (none, or one still taking its first copy: it gets this write with that copy)
            if self._alone_since is None:  # (after a failover, until a replica is online again: said once)
                self._alone_since = time.time()
                log.warning("metadata store %s: the master has no replica online; what is published now is in "
                            "one place until one is", self.url)
            return
        self._alone_since = None
        replicas = self.call(self.client.execute_command, "WAIT", 1, int(self.REPLICA_WAIT * 1000))
        if not isinstance(replicas, int) or replicas < 1:
            raise MetaUnavailable(f"metadata store {self.url}: {what} reached the master but none of its "
                                  f"{connected} replicas within {self.REPLICA_WAIT:g} s; not acknowledged (a "
                                  "failover could lose it)")

    def call(self, fn: Any, *args: Any) -> Any:
        try:
            answer = fn(*args)
            self._note_master()
            return answer
        except redis.exceptions.TimeoutError:
            raise MetaUnavailable(f"metadata store {self.url} did not answer in time") from None
        except redis.exceptions.AuthenticationError as exc:  # (the password, or the user: not the network)
            raise StoreRefused(
                f"metadata store {self.url} refused the password ({_plain(exc)}): check --meta-password-file "
                "(or EPOCHFS_META_PASSWORD); a user in the URL (redis://USER@HOST...) needs a Redis ACL user of "
                "that name, while a server with a plain requirepass takes a URL with no user "
                "(redis://HOST:6379/0)") from None
        except redis.exceptions.ConnectionError as exc:
            raise MetaUnavailable(f"metadata store {self.url} is unreachable: {_plain(exc)}") from None
        except redis.exceptions.RedisError as exc:  # an error answer (WRONGTYPE, OOM, ...)
            raise MetaUnavailable(f"metadata store {self.url}: {_plain(exc)}") from None

    def close(self) -> None:
        self.client.close()
