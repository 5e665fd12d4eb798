"""How the namespace index (:mod:`epochfs.meta.index`) stores a node: its record (kind, owner and mode,
size, mtime, key and ETag) and the keys of its three tables (by inode, by parent and name, by path).
Pure; :mod:`epochfs.meta.namespace` reads through it."""

from __future__ import annotations

import struct

import xxhash

from epochfs.core.records import ObjectInfo
from epochfs.meta.nodes import Dir, File

#: A node's record in the index: kind, whether a directory has a marker, size, mtime_ns, mode, uid, gid
#: (0xFFFFFFFF: not given), len(key), len(etag); then the key (a directory's path) and the ETag.
RECORD = struct.Struct("<BBQqIIIHH")
KIND_DIR, KIND_FILE = 0, 1
_NONE = 0xFFFFFFFF


def _opt(value: int | None) -> int:
    return _NONE if value is None else value


def encode_file(obj: ObjectInfo) -> bytes:
    key, etag = obj.key.encode("utf-8"), obj.etag.encode("utf-8")
    return RECORD.pack(KIND_FILE, 1, obj.size, obj.mtime_ns, _opt(obj.mode), _opt(obj.uid), _opt(obj.gid),
                       len(key), len(etag)) + key + etag


def encode_dir(path: str, info: ObjectInfo | None) -> bytes:
    key = path.encode("utf-8")
    if info is None:
        return RECORD.pack(KIND_DIR, 0, 0, 0, _NONE, _NONE, _NONE, len(key), 0) + key
    etag = info.etag.encode("utf-8")
    return RECORD.pack(KIND_DIR, 1, 0, info.mtime_ns, _opt(info.mode), _opt(info.uid), _opt(info.gid),
                       len(key), len(etag)) + key + etag


_new = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (decode is on every lookup)
_HEAD = RECORD.size


def decode(inode: int, raw: bytes) -> Dir | File:
    kind, has, size, mtime, mode, uid, gid, klen, elen = RECORD.unpack_from(raw)
    key = raw[_HEAD:_HEAD + klen].decode()
    if kind == KIND_DIR and not has:
        return _new(Dir, (inode, key, None))
    etag = raw[_HEAD + klen:_HEAD + klen + elen].decode()
    owner = (None if mode == _NONE else mode, None if uid == _NONE else uid, None if gid == _NONE else gid)
    if kind == KIND_FILE:
        return _new(File, (inode, key, _new(ObjectInfo, (key, size, mtime, etag, *owner))))
    return _new(Dir, (inode, key, _new(ObjectInfo, (key + "/" if key else "", 0, mtime, etag, *owner))))


def inode_key(inode: int) -> bytes:
    return inode.to_bytes(8, "big")


COOKIE_MAX = (1 << 62) - 1  # (a cookie is 62 bits)


def name_cookie(name: bytes) -> int:
    """Where ``name`` stands in its directory's listing: a 62-bit hash of it (never 0, which is the
    listing's start). A listing goes in cookie order, so the kernel's offset of an entry is its cookie
    and a listing continues from any offset with one lookup, whatever the directory's size."""
    return xxhash.xxh3_64_intdigest(name) & COOKIE_MAX or 1


def kid_key(parent: bytes, name: bytes) -> bytes:
    """A directory entry's key in the index: the parent's inode, the name's cookie, the name."""
    return parent + name_cookie(name).to_bytes(8, "big") + name


def path_key(path: str) -> bytes:
    """A path's key in the index: its hash (LMDB keys are at most 511 bytes; a path may be 4000). The
    node found under it is checked to have the path."""
    return xxhash.xxh3_128_digest(path.encode("utf-8"))


def record_path(record: bytes) -> bytes:
    """The path (a file's key) a node's record holds, undecoded."""
    return record[RECORD.size:RECORD.size + RECORD.unpack_from(record)[7]]


def checked_entry(raw: bytes | None, path: bytes) -> bytes | None:
    """A path table's value (inode + record) if it is ``path``'s (the table is keyed by a hash)."""
    return raw if raw is not None and record_path(raw[8:]) == path else None
