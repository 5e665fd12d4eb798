"""Text from outside reaches logs and terminals escaped: one record per line, no terminal control."""

from __future__ import annotations

import io
import logging
import random
import unicodedata

from epochfs.core.text import SafeFormatter, printable

BIDI = ("LRE", "RLE", "PDF", "LRO", "RLO", "LRI", "RLI", "FSI", "PDI")


def test_controls_separators_and_direction_marks_are_escaped():
    assert printable("train/ü/日本/a b.jpg") == "train/ü/日本/a b.jpg"
    assert printable("a\nb\rc\x1b[31md\x7f") == "a\\x0ab\\x0dc\\x1b[31md\\x7f"
    assert printable("x\u0085y\u009b2Jz\u2028w\u2029\u202eevil\u2066") == \
        "x\\x85y\\x9b2Jz\\u2028w\\u2029\\u202eevil\\u2066"
    rng = random.Random(1)
    for _ in range(2000):
        text = "".join(chr(rng.choice([rng.randrange(0, 0x250), rng.randrange(0x2000, 0x2070)]))
                       for _ in range(rng.randrange(0, 30)))
        out = printable(text)
        assert not any(unicodedata.category(c) in ("Cc", "Zl", "Zp") or unicodedata.bidirectional(c) in BIDI
                       for c in out), out
        assert printable(out) == out


def test_a_log_record_is_one_line_whatever_its_message_holds():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(SafeFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger("epochfs.test-text")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("peer said %s for %r", "ok\n2026-12-01 INFO epochfs.daemon.mount: forged", "k\u0085\u009b")
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "\\x0a2026-12-01 INFO" in lines[0]
