"""``benchmarks/peers/folios.py``: the page-cache folio sizes a file is held in (what the readpath benchmark
reports beside each hot read). Its folding of page flags into folios, and the tool on a real mount and
on the local disk: every resident byte of a file read whole is accounted for, in folios the kernel made."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
from folios import _HEAD, _TAIL, folio_kib, folio_runs, median_kib  # noqa: E402

MIB = 1 << 20


def test_page_flags_fold_into_folios():
    order0, head, tail = 0x20, 0x20 | _HEAD, 0x20 | _TAIL
    flags = [order0, head, tail, tail, tail, None, None, tail, order0, head, tail]
    # (a tail with no folio before it, the page after an absent one, starts its own)
    assert folio_runs(flags) == {1: 3, 4: 1, 0: 2, 2: 1}
    assert folio_runs([]) == {}
    assert median_kib({4: 512, 2048: 1}) == 4  # 2 MiB in single pages, 2 MiB in one folio: the smaller
    assert median_kib({4: 10, 2048: 3}) == 2048
    assert median_kib({0: 7}) == 0


@pytest.mark.page_cache
@requires_fuse
@pytest.mark.skipif(os.geteuid() != 0, reason="page frames and their flags are root's to read")
def test_a_file_read_whole_is_resident_to_the_byte_on_the_mount_and_on_disk(s3_client, fresh_bucket, mount_factory,
                                                                             tmp_path, record_property):
    """... and reports the folio sizes the kernel used for each (``pytest -s``, and the JUnit report's
    properties): 4 KiB on the mount on Linux 6.18, larger the day the kernel gives FUSE files large
    folios (docs/kernel-paths.md)."""
    f = SampleFile("d/big.bin", 6 * MIB + 12345, version=1)
    upload(s3_client, fresh_bucket, "ds/", [f])
    local = tmp_path / "local.bin"
    local.write_bytes(f.content())
    m = mount_factory(f"s3://{fresh_bucket}/ds", "--no-passthrough")  # (the mount's own pages, not a backing file's)
    with m:
        path = m.path(f.key)
        assert path.read_bytes() == f.content()
        for p in (path, local):
            sizes = folio_kib(str(p))
            pages = (f.size + 4095) // 4096
            assert sizes.get(0, 0) == 0, f"{p}: pages not resident after a whole read: {sizes}"
            assert sum(kib * n for kib, n in sizes.items()) == pages * 4, (p, sizes)
            assert median_kib(sizes) >= 4
            where = "mount" if p == path else "local disk"
            record_property(f"folio_kib_{where.replace(' ', '_')}", {str(k): int(n) for k, n in sizes.items()})
            print(f"{where}: folios of {median_kib(sizes)} KiB (median; KiB: count {sizes}), {os.uname().release}")


@pytest.mark.page_cache
@requires_fuse
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/sys/fs/fuse/max_pages_limit"),
                    reason="the node's fs.fuse.max_pages_limit is root's to raise")
def test_a_node_that_allows_2_mib_requests_gets_them_and_every_byte_right(s3_client, fresh_bucket, mount_factory):
    """With ``fs.fuse.max_pages_limit`` raised to 512 the mount asks for 2 MiB requests (the 2 MiB folio
    a kernel with large FUSE folios would then give it): reads of a large file and 4 MiB writes through
    write-back come out right with the larger read buffer."""
    limit = "/proc/sys/fs/fuse/max_pages_limit"
    with open(limit) as fh:
        old = fh.read()
    with open(limit, "w") as fh:
        fh.write("512\n")
    try:
        f = SampleFile("d/big.bin", 9 * MIB + 12345, version=1)
        upload(s3_client, fresh_bucket, "", [f])
        with mount_factory(f"s3://{fresh_bucket}", "--writeback") as m:
            assert m.path(f.key).read_bytes() == f.content()
            data = os.urandom(4 * MIB + 3)
            with open(m.path("d/written.bin"), "wb") as out:
                out.write(data)
            assert m.path("d/written.bin").read_bytes() == data
            sizes = folio_kib(str(m.path(f.key)))
            print(f"mount at 512 pages a request: folios of {median_kib(sizes)} KiB (median; {sizes})")
    finally:
        with open(limit, "w") as fh:
            fh.write(old)
