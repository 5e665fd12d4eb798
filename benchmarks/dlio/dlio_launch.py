"""One DLIO rank (``mpiexec -n N python dlio_launch.py <DLIO's hydra arguments>``), as ``dlio_benchmark``
runs it, with two fixes for a small machine that change nothing DLIO measures:

- DLIO imports TensorFlow's profiler whatever the framework; its PyTorch workloads never use it, and
  TensorFlow is not installed: a stub module stands in for the import.
- MPI's barrier busy-polls: with more ranks than cores, ranks waiting at DLIO's barriers (between
  epochs, before the end) take the CPU from the ranks still reading and from the file system's
  daemon. The barrier here polls a non-blocking one with short sleeps instead.

The tracer is off (``DFTRACER_ENABLE=0``, set by benchmarks/dlio/dlio.py).
"""

from __future__ import annotations

import sys
import time
import types


class _SleepingBarrier:
    """MPI.COMM_WORLD, its ``barrier`` waiting with sleeps instead of spinning."""

    def __init__(self, comm: object) -> None:
        self._comm = comm

    def barrier(self) -> None:
        request = self._comm.Ibarrier()  # type: ignore[attr-defined]
        while not request.Test():
            time.sleep(0.002)

    Barrier = barrier

    def __getattr__(self, name: str) -> object:
        return getattr(self._comm, name)


def main() -> None:
    sys.modules.setdefault("tensorflow", types.ModuleType("tensorflow"))  # (its profiler: never used here)
    from dlio_benchmark.utils import utility

    original = utility.DLIOMPI.comm

    def comm(self):  # type: ignore[no-untyped-def]
        return _SleepingBarrier(original(self))

    utility.DLIOMPI.comm = comm
    from dlio_benchmark.main import main as dlio_main

    dlio_main()


if __name__ == "__main__":
    main()
