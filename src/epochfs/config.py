"""One validated, frozen :class:`Config` for a mount, and the TOML config file reader."""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from epochfs.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "B": 1,
    "K": 1 << 10, "KB": 1000, "KIB": 1 << 10,
    "M": 1 << 20, "MB": 1000**2, "MIB": 1 << 20,
    "G": 1 << 30, "GB": 1000**3, "GIB": 1 << 30,
    "T": 1 << 40, "TB": 1000**4, "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """``'512M'`` -> bytes. Single letters are binary (K = 1024); ``KB``/``MB`` are decimal."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"not a size: {text!r} (examples: 4M, 512MiB, 50G, 1T)")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    return value


_RATE_UNITS = {
    "BIT": 1 / 8, "KBIT": 1000 / 8, "MBIT": 1000**2 / 8, "GBIT": 1000**3 / 8, "TBIT": 1000**4 / 8,
}


def parse_rate(text: str) -> float:
    """A bandwidth in bytes/second: ``'10Gbit'``, ``'400MB'`` (per second), ``'1.5G'``."""
    s = str(text).strip()
    if s.lower().endswith("/s"):
        s = s[:-2]
    m = _SIZE_RE.match(s)
    if m and m.group(2).upper() in _RATE_UNITS:
        return float(m.group(1)) * _RATE_UNITS[m.group(2).upper()]
    try:
        return float(parse_size(s))
    except ConfigError:
        raise ConfigError(f"not a rate: {text!r} (examples: 10Gbit, 1.25GB, 400M)") from None


@dataclass(frozen=True)
class Source:
    """Where the dataset lives: ``s3://bucket/prefix`` or ``file:///path``."""

    scheme: str  # "s3" or "file"
    bucket: str  # S3 bucket; "" for file
    prefix: str  # S3 key prefix ending in "/" or ""; absolute directory path for file

    @classmethod
    def parse(cls, url: str) -> Source:
        parsed = urlparse(url)
        if parsed.scheme == "s3":
            if not parsed.netloc:
                raise ConfigError(f"{url!r}: an S3 source needs a bucket: s3://BUCKET[/PREFIX]")
            prefix = parsed.path.lstrip("/")
            if prefix and not prefix.endswith("/"):
                prefix += "/"
            return cls("s3", parsed.netloc, prefix)
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise ConfigError(f"{url!r}: use file:///absolute/path")
            # Existence is checked when the directory is listed: a mount with a stored snapshot
            # keeps serving cached data while the shared file system is away.
            return cls("file", "", os.path.abspath(unquote(parsed.path)))
        raise ConfigError(f"{url!r}: the source must be s3://BUCKET[/PREFIX] or file:///PATH")

    @property
    def url(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.prefix}"
        return f"file://{self.prefix}"


DEFAULT_CACHE_DIR = "/var/cache/epochfs"


@dataclass(frozen=True)
class Config:
    """Everything a mount needs; validated on construction."""

    source: Source
    mountpoint: Path
    cache_dir: Path = Path(DEFAULT_CACHE_DIR)
    cache_size: int = 10 << 30
    block_size: int = 4 << 20
    free_space_ratio: float = 0.10
    endpoint_url: str | None = None
    region: str | None = None
    refresh: bool = False
    snapshot_ttl: float = 0.0  # seconds; 0 = keep the snapshot until --refresh
    readahead_blocks: int = 4
    kernel_readahead: int = 4 << 20  # the mount's read_ahead_kb; 0 leaves the kernel default (128 KiB)
    backend_concurrency: int = 16
    backend_timeout: float = 30.0  # overall deadline for one block fetch, retries included
    backend_attempts: int = 5
    attr_timeout: float = 3600.0
    eviction: str = "manifest"  # manifest | lru | none
    prefetch_bandwidth: float | None = None  # bytes/second; None = no cap
    prefetch_lead: float = 2.0  # seconds of reading the prefetch window aims to cover
    backend_bandwidth: float | None = None  # link capacity, bytes/second (for the utilisation metric)
    metrics_addr: str = "127.0.0.1:9567"  # HOST:PORT or "off"
    meta: str | None = None  # lmdb://PATH or redis://HOST:PORT/DB; None = LMDB in the cache directory
    meta_name: str | None = None  # dataset name in a shared store; None = the source URL
    meta_poll: float = 0.0  # seconds between checks for a newer snapshot; 0 = only on 'epochfs refresh'
    file_mode: int | None = None  # present every file with these permission bits (default: the source's, or 0444)
    dir_mode: int | None = None  # and every directory with these (default: the source's, or 0555)
    uid: int | None = None  # present every entry as owned by this user (default: the source's, or the daemon's)
    gid: int | None = None
    allow_other: bool = False
    foreground: bool = False
    debug: bool = False
    fuse_options: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.block_size < 64 << 10 or self.block_size > 64 << 20:
            raise ConfigError("--block-size must be between 64K and 64M")
        if self.block_size % (64 << 10):
            raise ConfigError("--block-size must be a multiple of 64K")
        if self.cache_size < self.block_size:
            raise ConfigError("--cache-size must hold at least one block")
        if not 0.0 <= self.free_space_ratio < 1.0:
            raise ConfigError("--free-space-ratio must be in [0, 1)")
        if self.readahead_blocks < 0:
            raise ConfigError("--readahead must be >= 0")
        if self.backend_concurrency < 1:
            raise ConfigError("--backend-concurrency must be >= 1")
        if self.backend_timeout <= 0:
            raise ConfigError("--backend-timeout must be > 0")
        if self.endpoint_url is not None:
            u = urlparse(self.endpoint_url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ConfigError(f"--endpoint-url {self.endpoint_url!r}: expected http(s)://HOST[:PORT]")
        if self.eviction not in ("manifest", "lru", "none"):
            raise ConfigError(f"--eviction {self.eviction!r}: choose manifest, lru or none")
        for name in ("prefetch_bandwidth", "backend_bandwidth"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if self.prefetch_lead <= 0:
            raise ConfigError("--prefetch-lead must be positive")
        if self.meta_poll < 0:
            raise ConfigError("--meta-poll must be >= 0")
        if self.snapshot_ttl < 0:
            raise ConfigError("--snapshot-ttl must be >= 0")
        if self.backend_attempts < 1:
            raise ConfigError("--backend-attempts must be >= 1")
        for name in ("file_mode", "dir_mode"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 0o777:
                raise ConfigError(f"--{name.replace('_', '-')} must be an octal mode from 000 to 777")
        for name in ("uid", "gid"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 0xFFFFFFFF:
                raise ConfigError(f"--{name} must be a user or group number")


def parse_mode(text: str) -> int:
    """An octal permission mode: ``'0444'``, ``'755'``."""
    try:
        mode = int(str(text), 8)
    except ValueError:
        raise ConfigError(f"not an octal mode: {text!r} (examples: 0444, 755)") from None
    if not 0 <= mode <= 0o777:
        raise ConfigError(f"not a permission mode: {text!r} (000 to 777)")
    return mode


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The table of a TOML config file, keys normalised to ``snake_case``. Errors name the file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            raise ConfigError(f"config file {path}: [{key}]: tables are not supported; put keys at the top level")
        out[key.replace("-", "_")] = value
    return out
