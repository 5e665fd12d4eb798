"""Receive buffers (epochfs.transport.buffers): aligned for O_DIRECT, and a pooled one never handed out while any
view of it is alive."""

from __future__ import annotations

import ctypes
import random
import threading

from epochfs.transport import buffers
from epochfs.transport.buffers import ALIGN, POOLED_MIN, aligned_buffer, is_aligned


def address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_every_buffer_is_aligned_small_or_pooled():
    for size in (1, 4095, 4096, 65536, POOLED_MIN - 1, POOLED_MIN, 3 * POOLED_MIN):
        view = aligned_buffer(size)
        assert len(view) == size and address(view) % ALIGN == 0 and not view.readonly
        assert is_aligned(view[:size - size % ALIGN]) == (size >= ALIGN)  # (an empty one is not)
    assert not is_aligned(aligned_buffer(8192)[1:4097])  # the address
    assert not is_aligned(aligned_buffer(8192)[:4000])  # the length
    assert not is_aligned(b"x" * 4096) and not is_aligned(memoryview(b"x" * 4096))  # read-only


def test_a_pooled_buffer_is_reused_only_once_no_view_of_it_is_alive():
    pool = buffers._Pool(8 * POOLED_MIN)
    first = pool.take(POOLED_MIN)
    where = address(first)
    first[:5] = b"hello"
    part = first[1:3][0:1]  # a view of a view keeps it too
    del first
    second = pool.take(POOLED_MIN)
    assert address(second) != where, "handed out while a view of it was alive"
    assert bytes(part) == b"e"
    del part
    third = pool.take(POOLED_MIN)
    assert address(third) == where, "a free buffer was not reused"
    assert pool.statistics() == (2, 2 * POOLED_MIN)


def test_the_pool_keeps_at_most_its_limit_and_hands_out_more_unkept():
    pool = buffers._Pool(2 * POOLED_MIN)
    held = [pool.take(POOLED_MIN) for _ in range(5)]
    assert len({address(v) for v in held}) == 5
    assert pool.statistics() == (2, 2 * POOLED_MIN)


def test_concurrent_takers_never_share_a_buffer():
    """Threads take, fill with their own pattern, check and drop buffers: none sees another's bytes."""
    pool = buffers._Pool(6 * POOLED_MIN)
    wrong: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(200):
            view = pool.take(POOLED_MIN)
            mark = bytes([seed]) * 4096
            offset = rng.randrange(0, POOLED_MIN - 4096)
            view[offset:offset + 4096] = mark
            if bytes(view[offset:offset + 4096]) != mark:
                wrong.append(f"thread {seed}")
            del view

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    assert pool.statistics()[1] <= 6 * POOLED_MIN
