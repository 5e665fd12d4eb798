"""The control protocol: one JSON object per line each way, and the typed requests it carries. Pure.

Every request is parsed here into a frozen dataclass before any component sees it: its operation must be
known, every field must have the right type and range, unknown fields are refused. A request that does
not parse gets an error reply naming the field and changes nothing. The replies are plain JSON objects
(``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``).

Operations and fields:

====================  ==========================================================================
``status``            (none)
``prefetch``          ``entries``, ``source``, ``epoch`` (int or null), ``replace`` (bool), ``rank`` (int
                      or null: the hand-overs of several ranks for one epoch are merged),
                      ``skip_missing`` (bool: hand over the rest of an order naming paths the snapshot
                      lacks, and say which, instead of refusing it)
``warmup``            ``entries``, ``source``
``resident``          ``entries``, ``source``
``locate``            ``entries``, ``source``: where each file's bytes are stored (a packed member's shard
                      and offset; null for a plain object); ``shared`` (bool): also which files another
                      mount of the node holds by content
``job``               ``id`` (int): a warmup job's progress
``cancel``            ``id`` (int): stop a warmup job
``refresh``           (none)
``publish_manifest``  ``name``, ``text``: publish a manifest to the metadata store
``get_manifest``      ``name``
``sync``              ``paths`` (list of paths relative to the mount root; empty: everything), ``wait``
                      (seconds, at most 60): wait until what was written under them is in the backend
``report``            ``job`` (a name, see :data:`epochfs.control.jobs.JOB_NAME`), ``rank`` (int; null: 0), ``steps`` (int),
                      ``data_wait`` and ``compute`` (seconds), ``gpu_utilization`` (percent or null),
                      ``saves`` and ``save_seconds`` (checkpoint saves timed): what one rank of a
                      training job measured since its previous report
====================  ==========================================================================

``entries`` is a list of ``[line, path]`` pairs (the line number in the user's manifest, for error
messages; the path relative to the mount root, "" for the root itself); ``source`` names where they
came from.

**Streamed entries.** A line is at most ``MAX_LINE`` bytes, checked before it is parsed, so no request
holds the daemon (parsing holds the interpreter) for long. A longer manifest is streamed: the request
line has ``"follow": true`` (and its own ``entries``, usually none), and chunk lines follow, each a JSON
list of at most ``CHUNK_ENTRIES`` pairs, ended by an empty list ``[]``. The daemon parses and resolves
one chunk at a time, and refuses the request as soon as it is over its limits, without reading on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from epochfs.control.jobs import JOB_NAME, MAX_EPOCH, Report
from epochfs.core.errors import EpochfsError

#: Longest line accepted, checked before it is parsed: a request, or one chunk of streamed entries.
MAX_LINE = 32 << 20
#: Entries per chunk line of a streamed request (about 4 MiB of JSON for ordinary paths).
CHUNK_ENTRIES = 100_000
#: Most JSON values one line may decode to, counted before it is parsed (its commas, lists and objects):
#: what a line costs the daemon's memory is bounded by what it may hold, whatever its bytes expand to
#: (a chunk of 100,000 entries is about 300,000).
MAX_VALUES = 1 << 20
MAX_PATH_BYTES = 4096
MAX_NAME = 255
MAX_SOURCE = 4096
MAX_INT = (1 << 63) - 1
MAX_SYNC_WAIT = 60.0
MAX_SYNC_PATHS = 4096
MAX_RANK = 1 << 20
MAX_REPORT_STEPS = 10**9
MAX_REPORT_SECONDS = 86400.0  # one report covers at most a day of waiting or computing


class BadRequest(EpochfsError):
    """A control request that does not parse; the reply names what is wrong."""


@dataclass(frozen=True, slots=True)
class Status:
    pass


@dataclass(frozen=True, slots=True)
class Refresh:
    pass


@dataclass(frozen=True, slots=True)
class Entries:
    """Paths named by a manifest or the command line: (line, path) pairs and where they came from."""

    entries: tuple[tuple[int, str], ...]
    source: str
    follow: bool = False  # more entries follow in chunk lines (a streamed request)


@dataclass(frozen=True, slots=True)
class Prefetch(Entries):
    epoch: int | None = None
    replace: bool = False
    rank: int | None = None
    skip_missing: bool = False


@dataclass(frozen=True, slots=True)
class Warmup(Entries):
    pass


@dataclass(frozen=True, slots=True)
class Resident(Entries):
    pass


@dataclass(frozen=True, slots=True)
class Locate(Entries):
    shared: bool = False  # say also which files another mount of the node holds by content


@dataclass(frozen=True, slots=True)
class Job:
    id: int


@dataclass(frozen=True, slots=True)
class Cancel:
    id: int


@dataclass(frozen=True, slots=True)
class PublishManifest:
    name: str
    text: str


@dataclass(frozen=True, slots=True)
class GetManifest:
    name: str


@dataclass(frozen=True, slots=True)
class Sync:
    paths: tuple[str, ...]
    wait: float


Request = (Status | Refresh | Prefetch | Warmup | Resident | Locate | Job | Cancel | PublishManifest | GetManifest | Sync
           | Report)


_OPS: dict[type, str] = {Status: "status", Refresh: "refresh", Prefetch: "prefetch", Warmup: "warmup",
                         Resident: "resident", Locate: "locate", Job: "job", Cancel: "cancel",
                         PublishManifest: "publish_manifest", GetManifest: "get_manifest", Sync: "sync",
                         Report: "report"}


def op_of(request: Any) -> str:
    """The operation name of a parsed request."""
    return _OPS.get(type(request), type(request).__name__.lower())


def _int(value: Any, field: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"{field!r} must be an integer in [{lo}, {hi}]")
    return value


def _text(value: Any, field: str, max_bytes: int, *, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{field!r} must be a string")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadRequest(f"{field!r} is not valid UTF-8") from None
    if size > max_bytes or (not empty and size == 0):
        raise BadRequest(f"{field!r} must be 1 to {max_bytes} bytes")
    return value


def _name(value: Any) -> str:
    name = _text(value, "name", MAX_NAME)
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        raise BadRequest("'name' contains a control character")
    return name


def _entries(value: Any) -> tuple[tuple[int, str], ...]:
    if not isinstance(value, list):
        raise BadRequest("'entries' must be a list of [line, path] pairs")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, list) or len(item) != 2:
            raise BadRequest(f"'entries'[{i}] must be a [line, path] pair")
        line = _int(item[0], f"entries[{i}] line")
        path = _text(item[1], f"entries[{i}] path", MAX_PATH_BYTES, empty=True)  # "": the mount root
        if "\x00" in path:
            raise BadRequest(f"'entries'[{i}] path contains NUL")
        out.append((line, path))
    return tuple(out)


def _paths(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_SYNC_PATHS:
        raise BadRequest(f"'paths' must be a list of at most {MAX_SYNC_PATHS} paths")
    out = []
    for i, item in enumerate(value):
        path = _text(item, f"paths[{i}]", MAX_PATH_BYTES, empty=True)
        if "\x00" in path:
            raise BadRequest(f"'paths'[{i}] contains NUL")
        out.append(path.strip("/"))
    return tuple(out)


def _seconds(value: Any, field: str, hi: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= hi:  # (NaN fails too)
        raise BadRequest(f"{field!r} must be a number of seconds in [0, {hi:g}]")
    return float(value)


# op -> (required fields, optional fields with defaults)
_FIELDS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "status": ((), {}),
    "refresh": ((), {}),
    "prefetch": (("entries",), {"source": "manifest", "epoch": None, "replace": False, "rank": None,
                                "follow": False, "skip_missing": False}),
    "warmup": (("entries",), {"source": "manifest", "follow": False}),
    "resident": (("entries",), {"source": "manifest", "follow": False}),
    "locate": (("entries",), {"source": "python", "follow": False, "shared": False}),
    "job": (("id",), {}),
    "cancel": (("id",), {}),
    "publish_manifest": (("name", "text"), {}),
    "get_manifest": (("name",), {}),
    "sync": ((), {"paths": [], "wait": 10.0}),
    "report": (("job", "rank", "steps", "data_wait", "compute"), {"gpu_utilization": None, "saves": 0,
                                                                   "save_seconds": 0.0, "epoch": None}),
}
OPERATIONS = tuple(_FIELDS)


def parse(line: bytes) -> Request:
    """The typed request in one line of the protocol; :class:`BadRequest` if it is not one."""
    if len(line) > MAX_LINE:
        raise BadRequest(f"request larger than {MAX_LINE} bytes (stream long manifests in chunks)")
    obj = _loads(line, "a request")
    if not isinstance(obj, dict):
        raise BadRequest("a request is a JSON object")
    op = obj.get("op")
    if not isinstance(op, str) or op not in _FIELDS:
        raise BadRequest(f"unknown operation {str(op)[:64]!r} (known: {', '.join(OPERATIONS)})")
    required, optional = _FIELDS[op]
    unknown = set(obj) - {"op", *required, *optional}
    if unknown:
        raise BadRequest(f"unknown field {sorted(unknown)[0][:64]!r} for {op}")
    missing = [f for f in required if f not in obj]
    if missing:
        raise BadRequest(f"{op} needs {missing[0]!r}")
    f = {**optional, **{k: v for k, v in obj.items() if k != "op"}}
    if op == "status":
        return Status()
    if op == "refresh":
        return Refresh()
    if op == "job":
        return Job(_int(f["id"], "id"))
    if op == "cancel":
        return Cancel(_int(f["id"], "id"))
    if op == "publish_manifest":
        return PublishManifest(_name(f["name"]), _text(f["text"], "text", MAX_LINE, empty=True))
    if op == "get_manifest":
        return GetManifest(_name(f["name"]))
    if op == "sync":
        return Sync(_paths(f["paths"]), _seconds(f["wait"], "wait", MAX_SYNC_WAIT))
    if op == "report":
        return _report(f)
    entries, source = _entries(f["entries"]), _text(f["source"], "source", MAX_SOURCE)
    if not isinstance(f["follow"], bool):
        raise BadRequest("'follow' must be true or false")
    if op == "prefetch":
        epoch = None if f["epoch"] is None else _int(f["epoch"], "epoch", -MAX_INT)
        for flag in ("replace", "skip_missing"):
            if not isinstance(f[flag], bool):
                raise BadRequest(f"{flag!r} must be true or false")
        rank = None if f["rank"] is None else _int(f["rank"], "rank", 0, 1 << 20)
        return Prefetch(entries, source, f["follow"], epoch, f["replace"], rank, f["skip_missing"])
    if op == "locate":
        if not isinstance(f["shared"], bool):
            raise BadRequest("'shared' must be true or false")
        return Locate(entries, source, f["follow"], f["shared"])
    return {"warmup": Warmup, "resident": Resident}[op](entries, source, f["follow"])


def _report(f: dict[str, Any]) -> Report:
    job = f["job"]
    if not isinstance(job, str) or not JOB_NAME.fullmatch(job):
        raise BadRequest("'job' must be 1 to 64 letters, digits and _.:- (starting with a letter or digit)")
    gpu = f["gpu_utilization"]
    if gpu is not None and (not isinstance(gpu, (int, float)) or isinstance(gpu, bool) or not 0 <= gpu <= 100):
        raise BadRequest("'gpu_utilization' must be a percentage in [0, 100] or null")
    rank = 0 if f["rank"] is None else _int(f["rank"], "rank", 0, MAX_RANK)
    return Report(job, rank, _int(f["steps"], "steps", 0, MAX_REPORT_STEPS),
                  _seconds(f["data_wait"], "data_wait", MAX_REPORT_SECONDS),
                  _seconds(f["compute"], "compute", MAX_REPORT_SECONDS), None if gpu is None else float(gpu),
                  _int(f["saves"], "saves", 0, MAX_REPORT_STEPS), _seconds(f["save_seconds"], "save_seconds",
                                                                           MAX_REPORT_SECONDS),
                  None if f["epoch"] is None else _int(f["epoch"], "epoch", 0, MAX_EPOCH))


def parse_chunk(line: bytes) -> tuple[tuple[int, str], ...]:
    """The entries of one chunk line of a streamed request (empty: the last); :class:`BadRequest`."""
    if len(line) > MAX_LINE:
        raise BadRequest(f"chunk larger than {MAX_LINE} bytes")
    value = _loads(line, "a chunk")
    if isinstance(value, list) and len(value) > CHUNK_ENTRIES:
        raise BadRequest(f"a chunk holds at most {CHUNK_ENTRIES} entries")
    return _entries(value)


def _loads(line: bytes, what: str) -> Any:
    """One JSON line, refused before it is parsed if it would decode to more than :data:`MAX_VALUES`."""
    values = line.count(b",") + line.count(b"[") + line.count(b"{")
    if values > MAX_VALUES:
        raise BadRequest(f"{what} of more than {MAX_VALUES} JSON values")
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"{what} is not a JSON line: {exc}"[:200]) from None


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"
