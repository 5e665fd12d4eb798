"""What an epoch costs: the backend's requests and bytes at the operator's prices, and the GPU time lost
to data wait at theirs. Pure: ``epochfs plan`` prices a simulated epoch, ``epochfs doctor`` a measured
one, and ``--compare`` the difference.

The defaults are AWS S3 Standard's list prices (us-east-1): GET and HEAD requests $0.0004 per 1,000,
LIST requests $0.005 per 1,000, transfer to compute in the same region $0 per GB (internet egress is
about $0.09 per GB: ``--price-gb 0.09`` when the GPUs are elsewhere). A GB is 2^30 bytes, as AWS bills
it. GPU time has no default: the doctor prints the hours lost, and their price once ``--gpu-hour`` (or
``gpu_hour`` in the ``[cost]`` table of a config file) says what an hour of one GPU costs.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epochfs.core.errors import ConfigError

GB = 1 << 30
DAY = 86400.0
PRICE_GET = 0.0004  # USD per 1,000 GET-class requests (GET, HEAD)
PRICE_LIST = 0.005  # USD per 1,000 LIST requests
PRICE_GB = 0.0  # USD per GB read (in-region)
MAX_PRICE = 1e6  # what any one price may be: a typo's guard
GET_CLASS = ("get", "head")  # backend operations billed as GET requests


@dataclass(frozen=True, slots=True)
class Prices:
    get_per_1000: float = PRICE_GET
    list_per_1000: float = PRICE_LIST
    per_gb: float = PRICE_GB
    gpu_hour: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"get_per_1000": self.get_per_1000, "list_per_1000": self.list_per_1000, "per_gb": self.per_gb,
                "gpu_hour": self.gpu_hour}


@dataclass(frozen=True, slots=True)
class Usage:
    """Backend requests and bytes (what a mount's counters say, or what a simulation predicts)."""

    gets: float = 0.0
    lists: float = 0.0
    bytes: float = 0.0

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.gets - other.gets, self.lists - other.lists, self.bytes - other.bytes)

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.gets + other.gets, self.lists + other.lists, self.bytes + other.bytes)

    def scaled(self, k: float) -> Usage:
        return Usage(self.gets * k, self.lists * k, self.bytes * k)


def usage_of(requests: Mapping[Any, int], nbytes: int) -> Usage:
    """The billed usage in a backend's request counters: ``{(op, outcome): n}`` or ``{"op/outcome": n}``
    (every attempt is a request; retries and errors too)."""
    gets = lists = 0
    for key, n in requests.items():
        op = key[0] if isinstance(key, tuple) else str(key).split("/", 1)[0]
        if op in GET_CLASS:
            gets += n
        elif op == "list":
            lists += n
    return Usage(gets, lists, nbytes)


@dataclass(frozen=True, slots=True)
class Cost:
    """The money of one period (an epoch, a day): the backend's part and the GPUs' part."""

    usage: Usage
    gpu_hours_lost: float | None
    prices: Prices

    @property
    def requests_usd(self) -> float:
        return self.usage.gets / 1000 * self.prices.get_per_1000 + self.usage.lists / 1000 * self.prices.list_per_1000

    @property
    def transfer_usd(self) -> float:
        return self.usage.bytes / GB * self.prices.per_gb

    @property
    def gpu_usd(self) -> float | None:
        if self.gpu_hours_lost is None or self.prices.gpu_hour is None:
            return None
        return self.gpu_hours_lost * self.prices.gpu_hour

    @property
    def total_usd(self) -> float:
        return self.requests_usd + self.transfer_usd + (self.gpu_usd or 0.0)

    def scaled(self, k: float) -> Cost:
        lost = None if self.gpu_hours_lost is None else self.gpu_hours_lost * k
        return Cost(self.usage.scaled(k), lost, self.prices)

    def as_dict(self) -> dict[str, Any]:
        return {"requests": round(self.usage.gets + self.usage.lists), "get_requests": round(self.usage.gets),
                "list_requests": round(self.usage.lists), "bytes": round(self.usage.bytes),
                "requests_usd": self.requests_usd, "transfer_usd": self.transfer_usd,
                "gpu_hours_lost": self.gpu_hours_lost, "gpu_usd": self.gpu_usd, "total_usd": self.total_usd}


def usd(value: float | None) -> str:
    """Dollars as an operator reads them: cents where they matter, four places below a cent."""
    if value is None:
        return "-"
    if 0 < value < 0.0001:
        return "<$0.0001"
    if value != 0 and abs(value) < 0.01:
        return f"${value:.4f}"
    return f"${value:,.2f}"


def describe(c: Cost, what: str) -> str:
    """One line: ``per epoch: 1,234 requests ($0.0005), 12.0 GB ($0.00); 0.8 GPU hours waiting ($2.00)``."""
    backend = (f"{c.usage.gets + c.usage.lists:,.0f} requests ({usd(c.requests_usd)}), "
               f"{c.usage.bytes / GB:,.1f} GB from the backend ({usd(c.transfer_usd)})")
    if c.gpu_hours_lost is None:
        return f"{what}: {backend}"
    hours = f"{c.gpu_hours_lost:,.2f}" if c.gpu_hours_lost >= 0.01 or not c.gpu_hours_lost else f"{c.gpu_hours_lost:.4f}"
    gpu = f"{hours} GPU hours waiting for data"
    gpu += f" ({usd(c.gpu_usd)})" if c.gpu_usd is not None else " (--gpu-hour prices them)"
    return f"{what}: {backend}; {gpu}; total {usd(c.total_usd)}"


def describe_dict(d: Mapping[str, Any], prices: Prices, what: str) -> str:
    """:func:`describe` of a cost as :meth:`Cost.as_dict` wrote it."""
    return describe(Cost(Usage(d["get_requests"], d["list_requests"], d["bytes"]), d["gpu_hours_lost"], prices), what)


def _price(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_PRICE:
        raise ConfigError(f"{name}: a price in US dollars from 0 to {MAX_PRICE:g} (got {value!r})")
    return float(value)


def price_arg(text: str) -> float:
    """An argparse type for a price (``--price-get 0.0004``)."""
    import argparse

    try:
        return _price(float(text), "price")
    except (ValueError, ConfigError):
        raise argparse.ArgumentTypeError(f"not a price in US dollars from 0 to {MAX_PRICE:g}: {text!r}") from None


COST_KEYS = {"price_get": "get_per_1000", "price_list": "list_per_1000", "price_gb": "per_gb", "gpu_hour": "gpu_hour"}


def prices_from(table: Mapping[str, Any] | None = None, **flags: float | None) -> Prices:
    """Prices from a config file's ``[cost]`` table, then the flags that are set (they win), over the
    defaults. ``flags`` use the table's names (``price_get=...``)."""
    values: dict[str, float | None] = {}
    for key, value in (table or {}).items():
        norm = key.replace("-", "_")
        if norm not in COST_KEYS:
            raise ConfigError(f"[cost]: unknown key {key!r} (known: {', '.join(COST_KEYS)})")
        values[COST_KEYS[norm]] = _price(value, f"[cost] {key}")
    for key, value in flags.items():
        if value is not None:
            values[COST_KEYS[key]] = _price(value, f"--{key.replace('_', '-')}")
    return Prices(**values)  # type: ignore[arg-type]


def cost_table(path: str | None) -> dict[str, Any]:
    """The ``[cost]`` table of a config file (empty without one); errors name the file."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    table = data.get("cost", {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: 'cost' must be a table ([cost])")
    return table


def add_price_options(parser: Any) -> None:
    """The price flags ``plan`` and ``doctor`` share."""
    g = parser.add_argument_group("prices (US dollars; defaults: AWS S3 Standard list prices, us-east-1)")
    g.add_argument("--price-get", type=price_arg, metavar="USD",
                   help=f"per 1,000 GET/HEAD requests (default {PRICE_GET:g})")
    g.add_argument("--price-list", type=price_arg, metavar="USD",
                   help=f"per 1,000 LIST requests (default {PRICE_LIST:g})")
    g.add_argument("--price-gb", type=price_arg, metavar="USD",
                   help="per GB (2^30 bytes) read from the backend (default 0: in-region; internet egress is "
                   "about 0.09)")
    g.add_argument("--gpu-hour", type=price_arg, metavar="USD",
                   help="what one GPU costs per hour (no default: without it, GPU time is shown in hours)")
    g.add_argument("--config", metavar="FILE",
                   help="take prices from this file's [cost] table (price_get, price_list, price_gb, gpu_hour); "
                   "flags win")


def prices_of(args: Any) -> Prices:
    return prices_from(cost_table(args.config), price_get=args.price_get, price_list=args.price_list,
                       price_gb=args.price_gb, gpu_hour=args.gpu_hour)


def predicted(miss_blocks: int, miss_bytes: int, prices: Prices, *, epoch_hours: float | None = None,
              gpus: int = 1, bandwidth: float | None = None) -> dict[str, Any]:
    """What a simulated epoch (``epochfs plan``) costs: a GET per block fetched, its bytes; with the
    epoch's compute time (``epoch_hours``, the job's time without waiting) and the backend's bandwidth,
    the data wait a prefetched epoch cannot avoid (fetching what misses takes longer than computing:
    a lower bound) in GPU hours of ``gpus``, and the epochs of a day."""
    wait = None
    if epoch_hours is not None and bandwidth:
        wait = max(0.0, miss_bytes / bandwidth / 3600 - epoch_hours)
    epoch = Cost(Usage(miss_blocks, 0, miss_bytes), None if wait is None else wait * gpus, prices)
    out: dict[str, Any] = {"epoch": epoch.as_dict(), "wait_hours": wait}
    if epoch_hours:
        per_day = 24.0 / (epoch_hours + (wait or 0.0))
        out.update(epochs_per_day=per_day, day=epoch.scaled(per_day).as_dict())
    return out
