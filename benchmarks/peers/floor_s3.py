"""The cold floor of our stack: a minimal daemon on epochfs's FUSE session layer (``epochfs.kernel``)
that answers every read with a ranged GET of exactly the bytes asked for, through epochfs's own S3 client (libcurl, SigV4), and keeps nothing: no
cache, no checksums, no readahead of its own, no metrics. The kernel drives the parallelism (its
readahead window and background requests set as epochfs sets them: 4 MiB, 64 requests).

What a cold large stream through epochfs is compared with besides raw boto3: the rate a mount on our session layer
reaches on this machine when it only fetches and hands bytes over.

    python benchmarks/peers/floor_s3.py s3://BUCKET/PREFIX MOUNTPOINT --endpoint-url URL   # foreground
"""

from __future__ import annotations

import argparse
import errno
import os
import stat

import trio

from epochfs import kernel
from epochfs.backend.base import BackendSettings
from epochfs.backend.s3 import S3Backend
from epochfs.daemon.config import Source
from epochfs.daemon.host import set_background_requests, set_kernel_readahead


class ColdFloor:
    def __init__(self, backend: S3Backend) -> None:
        self.backend = backend
        self.children: dict[int, dict[bytes, int]] = {kernel.ROOT_INODE: {}}
        self.objects: dict[int, tuple[str, str, int]] = {}  # inode -> key, etag, size
        for obj in backend.list_objects():
            parent = kernel.ROOT_INODE
            *dirs, name = obj.key.split("/")
            for d in dirs:
                inode = self.children[parent].get(d.encode())
                if inode is None:
                    inode = self.children[parent][d.encode()] = self._new_inode()
                    self.children[inode] = {}
                parent = inode
            inode = self.children[parent][name.encode()] = self._new_inode()
            self.objects[inode] = (obj.key, obj.etag, obj.size)

    def _new_inode(self) -> int:
        return len(self.children) + len(self.objects) + kernel.ROOT_INODE

    def _attr(self, inode: int) -> kernel.EntryAttributes:
        a = kernel.EntryAttributes()
        a.st_ino = inode
        if inode in self.children:
            a.st_mode, a.st_nlink = stat.S_IFDIR | 0o555, 2
        else:
            a.st_mode, a.st_nlink, a.st_size = stat.S_IFREG | 0o444, 1, self.objects[inode][2]
        a.entry_timeout = a.attr_timeout = 3600
        return a

    def lookup(self, parent, name, ctx):
        inode = self.children.get(parent, {}).get(name)
        if inode is None:
            raise kernel.FUSEError(errno.ENOENT)
        return self._attr(inode)

    def getattr(self, inode, ctx):
        return self._attr(inode)

    def opendir(self, inode, ctx):
        return inode

    def readdir(self, inode, start, token):
        names = sorted(self.children[inode])
        for i in range(start, len(names)):
            if not kernel.readdir_reply(token, names[i], self._attr(self.children[inode][names[i]]), i + 1):
                break

    def open(self, inode, flags, ctx):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise kernel.FUSEError(errno.EROFS)
        return kernel.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size, inode=0, pid=0, reader=None):
        key, etag, length = self.objects[fh]
        size = max(0, min(size, length - off))
        return await trio.to_thread.run_sync(self.backend.read_range, key, etag, off, size)


async def serve(session: kernel.Session, mountpoint: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        st = await trio.to_thread.run_sync(os.stat, mountpoint)
        set_kernel_readahead(st.st_dev, 4 << 20)
        set_background_requests(st.st_dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--endpoint-url")
    args = ap.parse_args()
    backend = S3Backend(BackendSettings(Source.parse(args.source), endpoint_url=args.endpoint_url))
    session = kernel.Session(ColdFloor(backend), args.mountpoint, {"default_permissions", "fsname=floor-s3", "ro"})
    session.mount()
    try:
        trio.run(serve, session, args.mountpoint)
    finally:
        session.close(unmount=True)


if __name__ == "__main__":
    main()
