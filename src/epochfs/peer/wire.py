"""The peer protocol, pure: HTTP/1.1 requests for one block by id, authenticated both ways with the
cluster's shared token, and the checks both ends make.

Keys: the token never crosses the network; a 32-byte key is derived from it (BLAKE3 ``derive_key``) and
every MAC below is keyed BLAKE3 over length-prefixed fields.

Request: ``GET /v2/block/<block id hex>?k=<key>&e=<etag>&i=<index>&n=<length>[&w=1]`` (or
``GET /v2/hello[?size=1]``, the proof a member gives before it is asked for anything) with headers
``X-Epochfs-Time`` (Unix seconds), ``X-Epochfs-Nonce`` (16 random bytes, hex) and ``X-Epochfs-Auth``
(the request MAC over ``to``, time, nonce and target). ``to`` is the member address the request is sent
to, as the member list has it: a request is good only at the member it was made for, only within
``CLOCK_SKEW`` seconds of its time, and only once (the owner remembers the nonces it has seen).

Answer: ``200`` with the block's bytes, ``204`` to a warm request (``w=1``: make sure you have it, send
nothing), ``200`` to a hello with the second the member started (and, to ``?size=1``, after a space
the size of its cache in bytes: its weight in the ring, :mod:`epochfs.peer.ring`; a member of an older
version answers that 404, and is asked the plain hello), ``404`` to a stored-only request
(``s=1``: only if you hold it, never fetch it: how a cache node fills its share from the others before
the backend) for a block it does not hold, or an error status with a one-line reason; every answer carries
``X-Epochfs-Answer``, the answer MAC over the request's MAC, the status and the body. Only a member that
holds the token can make it, and only for that request: a recorded answer does not fit another request,
and a body changed on the way does not fit its MAC. Nothing that fails these checks is used.

A request with ``X-Epochfs-Bind: digest`` may have its block answered bound by digest instead: the answer
carries ``X-Epochfs-Digest`` (the block's BLAKE3 hash, hex) and its MAC is over the request's MAC, the
status, the digest and the length; the receiver checks the body against the digest. So the owner sends
a cached block from its file (``sendfile``) without reading or hashing it, with the hash it took when it
fetched the block. The header is not signed, and needs not be: it chooses between two bindings that
each authenticate the body (a member of an older version ignores it, and MACs the body).

The key, ETag and index let the owner fetch a block it does not have; it serves only objects of its own
snapshot, and only if the block id it derives from them is the one asked for: the port hands out blocks
of the dataset by id, never paths or listings.
"""

from __future__ import annotations

import heapq
import hmac
import ipaddress
import math
import os
import re
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import blake3

from epochfs.core.errors import ConfigError
from epochfs.core.private import read_secret
from epochfs.core.records import MAX_ETAG_BYTES, MAX_KEY_BYTES, MAX_OBJECT_SIZE, text_problem

PREFIX = "/v2/block/"
HELLO = "/v2/hello"
HELLO_SIZED = HELLO + "?size=1"  # a hello whose answer also states the member's cache size
CLOCK_SKEW = 300  # seconds a signature stays good (the nodes' clocks must agree this well)
MAX_TARGET = 16 << 10  # longest request target accepted (a 4096-byte key, percent-encoded)
MAX_BLOCK = 1 << 30
TIME_HEADER, NONCE_HEADER, AUTH_HEADER = "x-epochfs-time", "x-epochfs-nonce", "x-epochfs-auth"
ANSWER_HEADER = "x-epochfs-answer"
BIND_HEADER, DIGEST_HEADER = "x-epochfs-bind", "x-epochfs-digest"  # (an answer bound by its block's digest)
DIGEST_BYTES = 32  # a block's BLAKE3 hash
MIN_TOKEN, MAX_TOKEN = 16, 4096
_KEY_CONTEXT = "epochfs 2026-12-01 peer protocol v2 MAC key"
_HOSTNAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # (fullmatch)
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
_HEX = frozenset("0123456789abcdef")


class Rejected(Exception):
    """A request the owner refuses: ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class BlockRequest:
    bid: bytes
    key: str
    etag: str
    index: int
    length: int
    warm: bool = False
    stored: bool = False  # only from the asked member's own cache: never fetched there

    def target(self) -> str:
        query = urllib.parse.urlencode({"k": self.key, "e": self.etag, "i": self.index, "n": self.length,
                                        **({"w": 1} if self.warm else {}), **({"s": 1} if self.stored else {})},
                                       quote_via=urllib.parse.quote)
        return f"{PREFIX}{self.bid.hex()}?{query}"


def _field(mac: blake3.blake3, data: bytes) -> None:
    mac.update(len(data).to_bytes(8, "little"))
    mac.update(data)


class Keys:
    """The MACs of one cluster token. Immutable; safe to share between threads."""

    __slots__ = ("_key",)

    def __init__(self, token: bytes) -> None:
        self._key = blake3.blake3(token, derive_key_context=_KEY_CONTEXT).digest()

    def _mac(self, kind: bytes, *fields: bytes) -> blake3.blake3:
        mac = blake3.blake3(key=self._key, max_threads=1)
        _field(mac, kind)
        for data in fields:
            _field(mac, data)
        return mac

    def request_mac(self, to: str, sent: int, nonce: str, target: str) -> str:
        return self._mac(b"request", to.encode(), str(sent).encode(), nonce.encode(), target.encode()).hexdigest(16)

    def answer_mac(self, request_mac: str, status: int, body: bytes | bytearray | memoryview) -> str:
        mac = self._mac(b"answer", request_mac.encode(), str(status).encode())
        mac.update(len(body).to_bytes(8, "little"))
        mac.update(body)  # (releases the GIL for large bodies)
        return mac.hexdigest(16)

    def digest_mac(self, request_mac: str, status: int, digest: bytes, length: int) -> str:
        """The MAC of an answer bound by its body's digest (see the module's docstring)."""
        return self._mac(b"answer by digest", request_mac.encode(), str(status).encode(), digest,
                         length.to_bytes(8, "little")).hexdigest(16)

    def headers(self, to: str, target: str, now: float) -> tuple[dict[str, str], str]:
        """The headers of a request to member ``to`` and its MAC (which its answer must be bound to)."""
        sent, nonce = int(now), os.urandom(16).hex()
        auth = self.request_mac(to, sent, nonce, target)
        return {TIME_HEADER: str(sent), NONCE_HEADER: nonce, AUTH_HEADER: auth}, auth

    def verify(self, to: str, target: str, sent_time: str | None, nonce: str | None, sent_auth: str | None,
               now: float) -> tuple[str, str, int]:
        """(MAC, nonce, time) of a request made for member ``to`` with these keys within the skew;
        :class:`Rejected` (401) otherwise. Whether the nonce is fresh is the caller's (:class:`Replays`)."""
        if sent_time is None or nonce is None or sent_auth is None:
            raise Rejected(401, "unsigned request")
        if not (sent_time.isascii() and sent_time.isdigit() and len(sent_time) <= 12):
            raise Rejected(401, "malformed time")
        if len(nonce) != 32 or not _HEX.issuperset(nonce):
            raise Rejected(401, "malformed nonce")
        sent = int(sent_time)
        if abs(sent - now) > CLOCK_SKEW:
            raise Rejected(401, f"signature time is more than {CLOCK_SKEW}s off this node's clock")
        expected = self.request_mac(to, sent, nonce, target)
        if not hmac_equal(expected, sent_auth):
            raise Rejected(401, "bad signature (another token, or a request made for another member)")
        return expected, nonce, sent

    def answer_ok(self, request_mac: str, status: int, body: bytes | bytearray | memoryview,
                  sent_mac: str | None, sent_digest: str | None = None) -> bool:
        """Whether an answer is the member's to this request: its MAC over the body, or (``sent_digest``
        given) over the digest, which the body's BLAKE3 hash must then be."""
        if sent_mac is None:
            return False
        if sent_digest is None:
            return hmac_equal(self.answer_mac(request_mac, status, body), sent_mac)
        if len(sent_digest) != 2 * DIGEST_BYTES or not _HEX.issuperset(sent_digest):
            return False
        digest = bytes.fromhex(sent_digest)
        if not hmac_equal(self.digest_mac(request_mac, status, digest, len(body)), sent_mac):
            return False
        return hmac.compare_digest(blake3.blake3(body, max_threads=1).digest(), digest)  # (releases the GIL)


def hello_body(since: int, capacity: int) -> bytes:
    """A hello's answer: the second the member started (its :attr:`Replays.since`) and its cache's size."""
    return f"{since} {capacity}".encode()


def parse_hello(body: bytes) -> tuple[int, int | None] | None:
    """A hello's answer as (the second the member started, its cache's size in bytes or None where the
    member does not say it), or None if it is not one."""
    since, space, capacity = body.partition(b" ")
    if not (since.isdigit() and len(since) <= 12):
        return None
    if not space:
        return int(since), None
    return (int(since), int(capacity)) if capacity.isdigit() and len(capacity) <= 24 else None


def hmac_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("ascii", "replace"), b.encode("ascii", "replace"))


class Replays:
    """The nonces of the requests an owner accepted, kept until their signatures expire: a request
    seen once is refused again. The memory is this process's, so a request signed before it began
    (:attr:`since`: ``started`` rounded up to a whole second, the signatures' unit) is refused too: one
    captured before a restart is not good after it. A hello is exempt (it gives nothing but proof and
    :attr:`since`, which its answer carries, so the asker signs its next requests no earlier). Bounded:
    past ``capacity`` live nonces new requests are refused (503) until old ones expire. Not
    thread-safe (the peer port's trio thread owns it)."""

    def __init__(self, capacity: int = 500_000, started: float | None = None) -> None:
        self.capacity = capacity
        self.since = math.ceil(time.time() if started is None else started)
        self._seen: set[str] = set()
        self._expiry: list[tuple[int, str]] = []

    def admit(self, nonce: str, sent: int, now: float, *, hello: bool = False) -> None:
        if sent < self.since and not hello:
            raise Rejected(401, "signed before this member started (its memory of used requests begins then)")
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])
        if nonce in self._seen:
            raise Rejected(401, "a request already seen (replayed)")
        if len(self._seen) >= self.capacity:
            raise Rejected(503, "too many requests inside the signature window; try again")
        self._seen.add(nonce)
        heapq.heappush(self._expiry, (sent + CLOCK_SKEW + 1, nonce))

    def __len__(self) -> int:
        return len(self._seen)


def _int(query: dict[str, list[str]], name: str, hi: int) -> int:
    values = query.get(name)
    if not values or len(values) != 1 or not values[0].isascii() or not values[0].isdigit() or len(values[0]) > 19:
        raise Rejected(400, f"'{name}' must be one non-negative integer")
    value = int(values[0])
    if value > hi:
        raise Rejected(400, f"'{name}' out of range")
    return value


def _text(query: dict[str, list[str]], name: str, max_bytes: int) -> str:
    values = query.get(name)
    if not values or len(values) != 1:
        raise Rejected(400, f"'{name}' must be given once")
    value = values[0]
    if text_problem(value, name, max_bytes) is not None:  # the bounds every boundary holds a record to
        raise Rejected(400, f"'{name}' must be 1 to {max_bytes} bytes of UTF-8 without NUL")
    return value


def parse_target(raw: bytes) -> BlockRequest:
    """The request a target names; :class:`Rejected` (400/404) for anything else."""
    if len(raw) > MAX_TARGET:
        raise Rejected(414, "request target too long")
    try:
        target = raw.decode("ascii")
    except UnicodeDecodeError:
        raise Rejected(400, "request target is not ASCII") from None
    path, _, query_text = target.partition("?")
    if not path.startswith(PREFIX):
        raise Rejected(404, "this port serves blocks by id only")
    hexid = path[len(PREFIX):]
    if len(hexid) != 32 or any(c not in "0123456789abcdef" for c in hexid):
        raise Rejected(404, "not a block id")
    try:
        query = urllib.parse.parse_qs(query_text, keep_blank_values=True, strict_parsing=bool(query_text),
                                      errors="strict", max_num_fields=8)
    except (ValueError, UnicodeDecodeError):
        raise Rejected(400, "malformed query") from None
    if set(query) - {"k", "e", "i", "n", "w", "s"}:
        raise Rejected(400, "unknown query field")
    warm, stored = "w" in query, "s" in query
    for flag, given in (("w", warm), ("s", stored)):
        if given and query[flag] != ["1"]:
            raise Rejected(400, f"'{flag}' must be 1")
    if warm and stored:
        raise Rejected(400, "a request is warm or stored-only, not both")
    return BlockRequest(bytes.fromhex(hexid), _text(query, "k", MAX_KEY_BYTES), _text(query, "e", MAX_ETAG_BYTES),
                        _int(query, "i", MAX_OBJECT_SIZE), _int(query, "n", MAX_BLOCK), warm, stored)


def load_token(path: Path) -> bytes:
    """The shared token from ``path``: a regular file of this user that nobody else can read."""
    try:
        return read_secret(path, "--peer-token-file", low=MIN_TOKEN, high=MAX_TOKEN)
    except ConfigError as exc:
        if "the secret must be" in str(exc):
            raise ConfigError(f"--peer-token-file {path}: the token must be {MIN_TOKEN} to {MAX_TOKEN} bytes "
                              "(e.g. from: openssl rand -hex 32)") from None
        raise


def split_addr(text: str, *, any_port: bool = False) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` or ``[IPV6]:PORT``; None if it is not one. ``any_port``: port 0 too."""
    host, sep, port = text.rpartition(":")
    if (not sep or not port.isascii() or not port.isdigit() or len(port) > 5
            or not (0 if any_port else 1) <= int(port) < 65536):
        return None
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return None
        return host, int(port)
    if not host.isascii() or not _HOSTNAME.fullmatch(host):
        return None
    return host, int(port)


def member_addr(text: str) -> str | None:
    """``text`` if it is a member address as the member list holds them: a literal IP address and a
    port (``10.0.0.1:9570``, ``[fd00::1]:9570``), written the one canonical way; None otherwise. Host
    names are never taken from the shared store (nothing there is resolved or connected to by name)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or len(port) > 5 or not 1 <= int(port) < 65536:
        return None
    try:
        if host.startswith("[") and host.endswith("]"):
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv6Address(host[1:-1])
            canonical = f"[{ip}]:{int(port)}"
        else:
            ip = ipaddress.IPv4Address(host)
            canonical = f"{ip}:{int(port)}"
    except ValueError:
        return None
    if ip.is_unspecified or ip.is_multicast or canonical != text:
        return None
    return text


def same_family(a: str, b: str) -> bool:
    return a.startswith("[") == b.startswith("[")


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")
