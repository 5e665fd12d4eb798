"""The control protocol without a daemon: every malformed request is refused with BadRequest (never
another exception), every valid one parses to its typed request; the client refuses a socket another
user could have planted."""

from __future__ import annotations

import json
import os
import random
import re
import socket

import pytest

from epochfs.control import protocol as p
from epochfs.control.client import request
from epochfs.control.jobs import Report
from epochfs.core.errors import EpochfsError

WRONG_VALUES = [None, True, False, 0, -1, 1 << 64, 1.5, float("nan"), "", "x", "\udc80", [], [1], {}, {"a": 1},
                [[1]], [["a", "b"]], [[1, 2]], [[True, "a"]], [[-1, "a"]], [[1, "a", 3]], "a" * 70_000]


def test_valid_requests_parse_to_typed_requests():
    line = p.encode({"op": "prefetch", "entries": [[1, "a/b.jpg"], [2, "c"]], "source": "m.txt", "epoch": 3,
                     "replace": True})
    assert p.parse(line) == p.Prefetch(((1, "a/b.jpg"), (2, "c")), "m.txt", False, 3, True, None)
    assert p.parse(p.encode({"op": "warmup", "entries": []})) == p.Warmup((), "manifest")
    assert p.parse(p.encode({"op": "job", "id": 7})) == p.Job(7)
    assert p.parse(p.encode({"op": "status"})) == p.Status()
    assert p.parse(p.encode({"op": "publish_manifest", "name": "e3", "text": ""})) == p.PublishManifest("e3", "")
    assert p.parse(p.encode({"op": "report", "job": "resnet50", "rank": 3, "steps": 10, "data_wait": 1.5,
                             "compute": 4, "gpu_utilization": 55})) == Report("resnet50", 3, 10, 1.5, 4.0, 55.0)


def _is_int(v, lo, hi):
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_text(v, max_bytes, empty=False):
    try:
        return isinstance(v, str) and (empty or v) and len(v.encode()) <= max_bytes
    except UnicodeEncodeError:
        return False


def _is_number(v, lo, hi):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi


VALID = {  # what the protocol documents for each field
    "entries": lambda v: isinstance(v, list) and all(
        isinstance(e, list) and len(e) == 2 and _is_int(e[0], 0, p.MAX_INT) and _is_text(e[1], 4096, empty=True)
        and "\x00" not in e[1] for e in v),
    "source": lambda v: _is_text(v, 4096),
    "epoch": lambda v: v is None or _is_int(v, -p.MAX_INT, p.MAX_INT),
    "replace": lambda v: isinstance(v, bool),
    "skip_missing": lambda v: isinstance(v, bool),
    "rank": lambda v: v is None or _is_int(v, 0, 1 << 20),
    "id": lambda v: _is_int(v, 0, p.MAX_INT),
    "name": lambda v: _is_text(v, 255) and not any(ord(c) < 32 for c in v),
    "text": lambda v: _is_text(v, p.MAX_LINE, empty=True),
    "follow": lambda v: isinstance(v, bool),
    "shared": lambda v: isinstance(v, bool),
    "paths": lambda v: isinstance(v, list) and len(v) <= p.MAX_SYNC_PATHS and all(
        _is_text(e, 4096, empty=True) and "\x00" not in e for e in v),
    "wait": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= p.MAX_SYNC_WAIT,
    "job": lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}", v) is not None,
    "steps": lambda v: _is_int(v, 0, 10**9),
    "data_wait": lambda v: _is_number(v, 0, 86400),
    "compute": lambda v: _is_number(v, 0, 86400),
    "gpu_utilization": lambda v: v is None or _is_number(v, 0, 100),
    "saves": lambda v: _is_int(v, 0, 10**9),
    "save_seconds": lambda v: _is_number(v, 0, 86400),
}
VALID_FOR = {  # where one operation's field means something else than another's
    ("report", "epoch"): lambda v: v is None or _is_int(v, 0, 1 << 20),  # a pass over the loader
}


@pytest.mark.parametrize("op", p.OPERATIONS)
def test_every_field_of_every_operation_refuses_every_wrong_type(op):
    required, optional = p._FIELDS[op]
    good = {"entries": [[1, "a"]], "source": "s", "epoch": 1, "replace": False, "rank": 0, "id": 1, "name": "n",
            "text": "t", "job": "resnet50", "steps": 10, "data_wait": 1.5, "compute": 3.0}
    base = {"op": op, **{f: good[f] for f in required}}
    assert p.parse(p.encode(base)) is not None
    for field in (*required, *optional):
        for value in WRONG_VALUES:
            line = json.dumps({**base, field: value}).encode() + b"\n"
            if VALID_FOR.get((op, field), VALID[field])(value):
                p.parse(line)
            else:
                with pytest.raises(p.BadRequest):
                    p.parse(line)
        if field in required:
            with pytest.raises(p.BadRequest, match="needs"):
                p.parse(p.encode({k: v for k, v in base.items() if k != field}))
    with pytest.raises(p.BadRequest, match="unknown field"):
        p.parse(p.encode({**base, "bogus": 1}))


def test_random_garbage_only_ever_raises_bad_request():
    rng = random.Random(11)
    samples = [b"", b"\n", b"{", b"[" * 100_000, b"\xff\xfe\n", b'{"op": "status"', b'"status"\n', b"1e999999\n",
               b'{"op": "job", "id": 1' + b"0" * 5000 + b"}\n", b'{"op": ["status"]}\n', b'{"op": null}\n',
               b'{"op": "prefetch", "entries": [[1, "a\\u0000b"]]}\n']
    for _ in range(3000):
        kind = rng.random()
        if kind < 0.4:
            samples.append(bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200))))
        else:
            op = rng.choice([*p.OPERATIONS, "nope", "", "STATUS"])
            obj = {"op": op}
            for field in rng.sample(["entries", "source", "epoch", "replace", "id", "name", "text", "zz", "job",
                                     "rank", "steps", "data_wait", "compute", "gpu_utilization"],
                                    rng.randrange(0, 6)):
                obj[field] = rng.choice(WRONG_VALUES + [[[rng.randrange(5), "p"]] * rng.randrange(3)])
            samples.append(json.dumps(obj).encode())
    parsed = 0
    for line in samples:
        try:
            p.parse(line)
            parsed += 1
        except p.BadRequest:
            pass
    assert parsed < len(samples)  # most are malformed; none raised anything but BadRequest


def test_client_refuses_a_socket_owned_by_another_user(tmp_path, monkeypatch):
    path = tmp_path / "planted.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    os.chown(path, 65534, 65534)
    monkeypatch.setattr(os, "getxattr", lambda *_: str(path).encode())
    with pytest.raises(EpochfsError, match="owned by root or by you"):
        request(tmp_path, "status")
    server.close()


def test_client_reports_an_empty_or_garbled_answer_in_one_line(tmp_path, monkeypatch):
    import threading

    path = tmp_path / "daemon.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(4)
    answers = [b"", b"not json at all\n", b"[1, 2]\n"]

    def serve() -> None:
        for answer in answers:
            conn, _ = server.accept()
            conn.recv(65536)
            conn.sendall(answer)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    monkeypatch.setattr(os, "getxattr", lambda *_: str(path).encode())
    for match in ("without answering", "not readable", "not readable"):
        with pytest.raises(EpochfsError, match=match):
            request(tmp_path, "status", timeout=5)
    t.join(5)
    server.close()


def test_a_line_that_would_decode_to_millions_of_values_is_refused_before_it_is_parsed():
    """What a line costs to decode is bounded by what it may hold: a report or a chunk of a few MiB of
    empty lists (tens of bytes of memory each once decoded) is refused before json.loads sees it, in
    bounded memory; an ordinary chunk of 100,000 entries is not."""
    import tracemalloc

    bombs = [b'{"op": "report", "job": "j", "rank": 0, "steps": 1, "data_wait": 0, "compute": 0, "x": ['
             + b"[]," * (2 << 20) + b"[]]}", b"[" + b"{}," * (2 << 20) + b"{}]"]
    for bomb in bombs:
        tracemalloc.start()
        try:
            with pytest.raises(p.BadRequest, match="JSON values"):
                p.parse(bomb) if bomb.startswith(b"{") else p.parse_chunk(bomb)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak
    chunk = json.dumps([[i, f"train/class{i % 1000}/img{i}.jpg"] for i in range(p.CHUNK_ENTRIES)]).encode()
    assert len(p.parse_chunk(chunk)) == p.CHUNK_ENTRIES
