"""What a mount tells its user when it starts (warnings that do not stop it), and the cache directory's
record of the sources it served."""

from __future__ import annotations

import os
from pathlib import Path

from epochfs.core.errors import EpochfsError
from epochfs.core.text import human
from epochfs.daemon.config import Config


def startup_warnings(config: Config, snapshot_objects: int) -> list[str]:
    """What the user should hear about a mount that is otherwise fine."""
    warnings = []
    if config.kernel_reads and os.geteuid() != 0:
        warnings.append("the kernel reads cached files itself only for a root daemon (it registers backing files "
                        "only for CAP_SYS_ADMIN): files are read through the daemon")
    if config.passthrough_size is not None:
        warnings.append("--passthrough-size is no longer used: the kernel reads the cache's own files, there are "
                        "no whole copies to bound")
    if not snapshot_objects and not config.writeback:  # a write-back mount often starts empty
        warnings.append(f"{config.source.url} lists no objects: the mount is empty. Check the bucket and prefix; "
                        "the empty listing is not kept (the next mount lists again)")
    others = other_sources(config.cache_dir, config.source.url)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        warnings.append(f"the cache directory {config.cache_dir} served {shown} before: what is left of their "
                        "blocks counts against --cache-size until evicted (those read least recently go first); "
                        "to free it at once, remove the directory while nothing uses it")
    try:
        st = os.statvfs(config.cache_dir)
    except OSError:
        return warnings
    usable = int(st.f_blocks * st.f_frsize * (1 - config.free_space_ratio))
    if config.cache_size > usable:
        warnings.append(f"--cache-size {human(config.cache_size)} is more than the cache file system can hold "
                        f"({human(usable)}, keeping {config.free_space_ratio:.0%} free): the disk bounds the cache")
    return warnings


#: The sources a cache directory served, the latest last (``sources`` in it; at most this many kept).
SOURCES_KEPT = 16


def other_sources(cache_dir: Path, url: str) -> list[str]:
    """The sources other than ``url`` this cache directory served before (its ``sources`` file, written
    by the daemon into its private directory), and ``url`` recorded as the latest. Bounded: the file is
    read up to 64 KiB and keeps :data:`SOURCES_KEPT` lines; one that cannot be read or written is left
    as it is (it only informs)."""
    from epochfs.core.private import open_private

    path = cache_dir / "sources"
    try:
        fd = open_private(path, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(64 << 10)
        seen = [ln for ln in raw.decode("utf-8", "replace").splitlines() if ln and ln.isprintable()]
    except (OSError, EpochfsError):  # (none yet: a new cache directory, or one from before it was kept)
        seen = []
    kept = [u for u in seen if u != url][-(SOURCES_KEPT - 1):]
    try:
        fd = open_private(path.with_name("sources.tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{u}\n" for u in (*kept, url)))
        os.replace(path.with_name("sources.tmp"), path)
    except (OSError, EpochfsError):
        pass
    return list(reversed(kept))
