"""The peer protocol, pure: HTTP/1.1 requests for one block by id, signed with the cluster's shared
token, and the checks both ends make.

Request: ``GET /v1/block/<block id hex>?k=<key>&e=<etag>&i=<index>&n=<length>[&w=1]`` with headers
``X-Epochfs-Time`` (Unix seconds) and ``X-Epochfs-Auth`` (HMAC-SHA256 of ``"<time>\\n<target>"`` under the
token, hex): the token itself never crosses the network, and a signature is good for
``CLOCK_SKEW`` seconds. The owner answers ``200`` with the block's bytes and ``X-Epochfs-Checksum``
(XXH3-128 of the body, hex), or ``204`` to a warm request (``w=1``: make sure you have it, send nothing),
or an error status with a one-line reason. The key, ETag and index let the owner fetch a block it does
not have; it serves only objects of its own snapshot, and only if the block id it derives from them is
the one asked for: the port hands out blocks of the dataset by id, never paths or listings.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import stat
import urllib.parse
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

import xxhash

from epochfs.errors import ConfigError
from epochfs.records import MAX_ETAG_BYTES, MAX_KEY_BYTES, MAX_OBJECT_SIZE

PREFIX = "/v1/block/"
CLOCK_SKEW = 300  # seconds a signature stays good (the nodes' clocks must agree this well)
MAX_TARGET = 16 << 10  # longest request target accepted (a 4096-byte key, percent-encoded)
MAX_BLOCK = 1 << 30
TIME_HEADER, AUTH_HEADER, SUM_HEADER = "x-epochfs-time", "x-epochfs-auth", "x-epochfs-checksum"
MIN_TOKEN, MAX_TOKEN = 16, 4096
_HOSTNAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # (fullmatch)
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


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

    def target(self) -> str:
        query = urllib.parse.urlencode({"k": self.key, "e": self.etag, "i": self.index, "n": self.length,
                                        **({"w": 1} if self.warm else {})}, quote_via=urllib.parse.quote)
        return f"{PREFIX}{self.bid.hex()}?{query}"


def sign(token: bytes, target: str, now: int) -> str:
    return hmac.new(token, f"{now}\n{target}".encode(), sha256).hexdigest()


def headers(token: bytes, target: str, now: float) -> dict[str, str]:
    t = int(now)
    return {TIME_HEADER: str(t), AUTH_HEADER: sign(token, target, t)}


def verify(token: bytes, target: str, sent_time: str | None, sent_auth: str | None, now: float) -> None:
    """Raise :class:`Rejected` (401) unless the request was signed with ``token`` within the skew."""
    if sent_time is None or sent_auth is None:
        raise Rejected(401, "unsigned request")
    if not (sent_time.isascii() and sent_time.isdigit() and len(sent_time) <= 12):
        raise Rejected(401, "malformed time")
    if abs(int(sent_time) - now) > CLOCK_SKEW:
        raise Rejected(401, f"signature time is more than {CLOCK_SKEW}s off this node's clock")
    if not hmac.compare_digest(sign(token, target, int(sent_time)).encode(), sent_auth.encode("ascii", "replace")):
        raise Rejected(401, "bad signature")


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
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise Rejected(400, f"'{name}' is not UTF-8") from None
    if not 0 < size <= max_bytes or "\x00" in value:
        raise Rejected(400, f"'{name}' must be 1 to {max_bytes} bytes without NUL")
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
    if set(query) - {"k", "e", "i", "n", "w"}:
        raise Rejected(400, "unknown query field")
    warm = "w" in query
    if warm and query["w"] != ["1"]:
        raise Rejected(400, "'w' must be 1")
    return BlockRequest(bytes.fromhex(hexid), _text(query, "k", MAX_KEY_BYTES), _text(query, "e", MAX_ETAG_BYTES),
                        _int(query, "i", MAX_OBJECT_SIZE), _int(query, "n", MAX_BLOCK), warm)


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def load_token(path: Path) -> bytes:
    """The shared token from ``path``: a regular file of this user that nobody else can read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"--peer-token-file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"--peer-token-file {path} is not a regular file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(f"--peer-token-file {path} must belong to this user and be readable by nobody "
                              f"else (chmod 600): it is mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}")
        raw = os.read(fd, MAX_TOKEN + 1)
    finally:
        os.close(fd)
    token = raw.strip()
    if not MIN_TOKEN <= len(token) <= MAX_TOKEN:
        raise ConfigError(f"--peer-token-file {path}: the token must be {MIN_TOKEN} to {MAX_TOKEN} bytes "
                          "(e.g. from: openssl rand -hex 32)")
    return token


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


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")
