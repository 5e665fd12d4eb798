"""The floor of our stack: a minimal daemon on epochfs's FUSE session layer (``epochfs.kernel``) that
serves a local directory read-only with a plain ``pread`` per request (lookup, getattr, readdir, open,
read; long kernel timeouts, keep_cache). What
epochfs's warm reads are compared with: no cache, no checksums, no metrics, only the session layer
+ trio. Files are opened with no request, as on epochfs's read-only mounts, unless ``--open-requests``.

    python benchmarks/peers/floor.py SOURCE_DIR MOUNTPOINT [--blksize BYTES] [--readahead-kb KIB] [--open-requests]

``--blksize`` is the ``st_blksize`` it reports (128 KiB by default, as epochfs does); ``--readahead-kb``
sets the mount's readahead window as epochfs does (default: the kernel's 128 KiB).
"""

from __future__ import annotations

import argparse
import errno
import os
import stat

import trio

from epochfs import kernel


class Floor:
    def __init__(self, root: str, blksize: int) -> None:
        self.blksize = blksize
        self.paths = {kernel.ROOT_INODE: root}
        self.inodes: dict[str, int] = {root: kernel.ROOT_INODE}
        self.fds: dict[int, int] = {}
        self.by_inode: dict[int, int] = {}
        self.zero_open = True

    def _attr(self, path: str) -> kernel.EntryAttributes:
        st = os.lstat(path)
        a = kernel.EntryAttributes()
        ino = self.inodes.get(path)
        if ino is None:
            ino = self.inodes[path] = len(self.paths) + 1
            self.paths[ino] = path
        a.st_ino, a.st_mode, a.st_size, a.st_nlink = ino, st.st_mode, st.st_size, st.st_nlink
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = st.st_mtime_ns
        a.entry_timeout = a.attr_timeout = 3600
        a.st_blksize = self.blksize
        return a

    def lookup(self, parent, name, ctx):
        try:
            return self._attr(os.path.join(self.paths[parent], os.fsdecode(name)))
        except OSError as exc:
            raise kernel.FUSEError(exc.errno) from None

    def getattr(self, inode, ctx):
        return self._attr(self.paths[inode])

    def opendir(self, inode, ctx):
        return inode

    def readdir(self, inode, start, token):
        names = sorted(os.listdir(self.paths[inode]))
        for i in range(start, len(names)):
            attr = self._attr(os.path.join(self.paths[inode], names[i]))
            if not kernel.readdir_reply(token, os.fsencode(names[i]), attr, i + 1):
                break

    def open(self, inode, flags, ctx):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise kernel.FUSEError(errno.EROFS)
        if self.zero_open:
            raise kernel.FUSEError(errno.ENOSYS)  # as epochfs's read-only mounts: no OPEN, no RELEASE
        fd = os.open(self.paths[inode], os.O_RDONLY)
        self.fds[fd] = fd
        return kernel.FileInfo(fh=fd, keep_cache=True)

    def read_now(self, fh, off, size, inode=0, pid=0, reader=None):  # answered as the request is read, as epochfs's warm reads
        if not fh:  # a zero-message open: one descriptor per inode, kept
            fh = self.by_inode.get(inode)
            if fh is None:
                fh = self.by_inode[inode] = os.open(self.paths[inode], os.O_RDONLY)
        return os.pread(fh, size, off)

    async def read(self, fh, off, size, inode=0, pid=0, reader=None):
        return self.read_now(fh, off, size, inode, pid)

    def release(self, fh):
        os.close(self.fds.pop(fh))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--blksize", type=int, default=128 << 10)
    ap.add_argument("--readahead-kb", type=int, default=0)
    ap.add_argument("--open-requests", action="store_true", help="answer OPEN and RELEASE (a handle per open)")
    args = ap.parse_args()
    assert stat.S_ISDIR(os.stat(args.source).st_mode)
    floor = Floor(args.source, args.blksize)
    floor.zero_open = not args.open_requests
    session = kernel.Session(floor, args.mountpoint,
                           {"default_permissions", "fsname=floor", "ro"})
    session.mount()
    if args.readahead_kb:  # (the mount's device from mountinfo: a stat would wait for this daemon)
        mnt = os.path.abspath(args.mountpoint)  # (not realpath: it would stat the mount)
        dev = next(line.split()[2] for line in open("/proc/self/mountinfo") if line.split()[4] == mnt)
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(args.readahead_kb))
    try:
        trio.run(session.run)
    finally:
        session.close(unmount=True)


if __name__ == "__main__":
    main()
