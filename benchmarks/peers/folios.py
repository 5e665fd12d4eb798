"""The sizes of the page-cache folios a file is held in: what a hot read of it costs the kernel.

A read served from the page cache copies folio by folio, and the first read after the pages were filled
also moves each folio to the active list, so a file held in 4 KiB folios reads slower from memory than
one held in 2 MiB folios. Which sizes a file system gets is the kernel's choice per file system (ext4 and
XFS large folios; FUSE on Linux 6.18 single pages): this tool shows it. It maps the file (read-only,
shared: nothing is read that is not in the page cache already, pages not resident are counted absent)
and reads each page's frame from ``/proc/self/pagemap`` and its flags from ``/proc/kpageflags``
(compound head and tail), so it needs root.

    sudo .venv/bin/python benchmarks/peers/folios.py FILE [FILE ...]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import struct
from collections import Counter

PAGE = mmap.PAGESIZE
_PRESENT = 1 << 63
_PFN = (1 << 55) - 1
_HEAD, _TAIL = 1 << 15, 1 << 16  # KPF_COMPOUND_HEAD, KPF_COMPOUND_TAIL


def folio_runs(flags: list[int | None]) -> Counter[int]:
    """Folio sizes in pages from each page's kpageflags in file order (None: not resident), as
    {pages: count}; absent pages are counted under 0. A tail page continues the folio before it."""
    sizes: Counter[int] = Counter()
    run = 0
    for f in flags:
        if f is None:
            if run:
                sizes[run] += 1
            run = 0
            sizes[0] += 1
        elif f & _TAIL and run:
            run += 1
        else:
            if run:
                sizes[run] += 1
            run = 1
    if run:
        sizes[run] += 1
    return sizes


def page_flags(path: str) -> list[int | None]:
    """kpageflags of each page of ``path`` that is resident in the page cache (None where not)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return []
        base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
    finally:
        os.close(fd)
    try:
        n = (size + PAGE - 1) // PAGE
        resident = (ctypes.c_ubyte * n)()
        if libc.mincore(base, size, resident) != 0:
            raise OSError(ctypes.get_errno(), f"mincore {path}")
        view = (ctypes.c_ubyte * size).from_address(base)
        for i in range(n):  # map the resident pages (a fault on a resident page reads nothing)
            if resident[i] & 1:
                _ = view[i * PAGE]
        pm = os.open("/proc/self/pagemap", os.O_RDONLY)
        kf = os.open("/proc/kpageflags", os.O_RDONLY)
        try:
            entries = os.pread(pm, 8 * n, (base // PAGE) * 8)
            out: list[int | None] = []
            for i in range(n):
                e = struct.unpack_from("<Q", entries, 8 * i)[0]
                if not resident[i] & 1 or not e & _PRESENT or not e & _PFN:
                    out.append(None)
                    continue
                out.append(struct.unpack("<Q", os.pread(kf, 8, (e & _PFN) * 8))[0])
            return out
        finally:
            os.close(pm)
            os.close(kf)
    finally:
        libc.munmap(base, size)


def folio_kib(path: str) -> Counter[int]:
    """{folio size in KiB: count} of ``path``'s resident pages (0: pages not resident)."""
    return Counter({pages * PAGE // 1024: n for pages, n in folio_runs(page_flags(path)).items()})


def median_kib(sizes: Counter[int]) -> float:
    """The folio size (KiB) that the median resident byte is held in; 0 if nothing is resident."""
    weighted = sorted((kib, kib * n) for kib, n in sizes.items() if kib)
    total = sum(w for _, w in weighted)
    seen = 0
    for kib, w in weighted:
        seen += w
        if seen * 2 >= total:
            return float(kib)
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    for path in args.files:
        sizes = folio_kib(path)
        held = ", ".join(f"{n} x {kib} KiB" for kib, n in sorted(sizes.items()) if kib)
        absent = f"; {sizes[0]} pages not resident" if sizes[0] else ""
        print(f"{path}: {held or 'nothing resident'}{absent} (median byte in {median_kib(sizes):g} KiB folios)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
