"""The write path of the S3 backend (write-back mounts, ``epochfs pack``): whole-object uploads
(multipart and parallel above a threshold, capped in bandwidth, cancellable, each multipart upload's id
told to the caller so one cut off by a crash can be aborted), the confirmation that an object landed
under the very key asked for, the names S3 cannot store, deletes, copies and attribute records
(:mod:`epochfs.backend.attrs`). A mixin of :class:`~epochfs.backend.s3.S3Backend`, whose client,
session, prefix and statistics it uses; everything here runs in worker threads.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import botocore.config
import botocore.exceptions

from epochfs.backend import attrs
from epochfs.core.errors import KeyRefused, UploadCancelled
from epochfs.core.records import ObjectInfo

_KEY_REFUSED_CODES = {"KeyTooLongError", "InvalidObjectName", "InvalidKey"}


def use_isal_crc32() -> None:
    """botocore's CRC32 of each uploaded part computed with ISA-L's (the same function of the bytes, 3.4x
    as fast as zlib's on this machine: 0.09 s of CPU a GiB against 0.29, a quarter of an upload's CPU).
    botocore picks the class by name from ``httpchecksum._CHECKSUM_CLS``; where that changes in a later
    botocore, its own class stays (slower, as correct)."""
    from botocore import httpchecksum
    from isal import isal_zlib

    table = getattr(httpchecksum, "_CHECKSUM_CLS", None)
    base = getattr(httpchecksum, "Crc32Checksum", None)
    if not isinstance(table, dict) or base is None or table.get("crc32") is not base:
        return

    class IsalCrc32(base):  # type: ignore[misc, valid-type]
        def update(self, chunk: bytes | bytearray | memoryview) -> None:
            self._int_crc32 = isal_zlib.crc32(chunk, self._int_crc32) & 0xFFFFFFFF

    table["crc32"] = IsalCrc32
#: Longest key S3 stores (UTF-8 bytes, the prefix included).
MAX_S3_KEY = 1024
#: Seconds between an upload's asks whether it may go on, while it gives way.
GIVE_WAY_POLL = 0.02


def _giving_way(give_way: Callable[[], bool], shared: Any) -> Any:
    """An s3transfer bandwidth limiter whose reads of the body wait while ``give_way()`` is true, then
    take their tokens from ``shared``'s bucket (None: no cap)."""
    from s3transfer.bandwidth import BandwidthLimiter, RequestExceededException

    bucket = getattr(shared, "_leaky_bucket", None)

    class GivingWay:
        def consume(self, amt: int, request_token: Any) -> int:
            if give_way():
                raise RequestExceededException(requested_amt=amt, retry_time=GIVE_WAY_POLL)
            return int(bucket.consume(amt, request_token)) if bucket is not None else amt

    return BandwidthLimiter(GivingWay())


class S3Writes:
    """What an S3 backend writes. Expects of the class it is mixed into: ``bucket``, ``prefix``,
    ``_settings``, ``_session``, ``_region``, ``_stats``, ``_upload_client``, ``_watch_lock``,
    ``_multipart_watchers``, ``_limiters`` and ``_denied_or_unavailable``."""

    bucket: str
    prefix: str
    _settings: Any
    _session: Any
    _region: str
    _stats: Any
    _upload_client: Any
    _watch_lock: threading.Lock
    _multipart_watchers: dict[str, list[Callable[[str], None]]]
    _limiters: dict[int, Any]
    _denied_or_unavailable: Callable[[str, Exception], Exception]

    writable = True
    PART_SIZE = 16 << 20
    MULTIPART_THRESHOLD = 64 << 20

    def _uploader(self) -> Any:
        if self._upload_client is None:
            use_isal_crc32()
            s = self._settings
            self._upload_client = self._session.client(
                "s3", endpoint_url=s.endpoint_url, region_name=self._region, config=botocore.config.Config(
                    retries={"mode": "standard", "max_attempts": s.attempts}, max_pool_connections=32,
                    connect_timeout=5, read_timeout=60, request_checksum_calculation="when_supported",
                    # The body is not hashed for the signature (a pass of SHA-256 over every byte: 0.8 s of
                    # CPU per GiB): its CRC32, which botocore sends with every part and the endpoint checks,
                    # keeps it whole on the way; TLS (https) keeps it from others.
                    s3={"addressing_style": "path" if s.endpoint_url else "auto", "payload_signing_enabled": False},
                    user_agent_extra="epochfs"))
            self._upload_client.meta.events.register("after-call.s3.CreateMultipartUpload", self._multipart_started)
        return self._upload_client

    def _multipart_started(self, parsed: Any = None, **_: Any) -> None:
        """A multipart upload was created (an s3transfer thread): tell the upload of that key its id."""
        if not isinstance(parsed, dict) or not isinstance(parsed.get("UploadId"), str):
            return
        with self._watch_lock:
            watchers = list(self._multipart_watchers.get(str(parsed.get("Key")), ()))
        for started in watchers:
            started(parsed["UploadId"])

    def _head(self, key: str) -> ObjectInfo:
        head = self._uploader().head_object(Bucket=self.bucket, Key=self.prefix + key)
        return ObjectInfo(key=key, size=int(head["ContentLength"]), etag=head["ETag"],
                          mtime_ns=int(head["LastModified"].timestamp() * 1_000_000_000))

    def upload_file(self, path: str, key: str, *, bandwidth: float | None = None,
                    cancelled: threading.Event | None = None, metadata: dict[str, str] | None = None,
                    multipart_started: Callable[[str], None] | None = None,
                    give_way: Callable[[], bool] | None = None) -> ObjectInfo:
        if multipart_started is None:
            return self._upload(path, key, bandwidth, cancelled, metadata, give_way)
        full = self.prefix + key
        with self._watch_lock:
            self._multipart_watchers.setdefault(full, []).append(multipart_started)
        try:
            return self._upload(path, key, bandwidth, cancelled, metadata, give_way)
        finally:
            with self._watch_lock:
                watchers = self._multipart_watchers[full]
                watchers.remove(multipart_started)
                if not watchers:
                    del self._multipart_watchers[full]

    def _upload(self, path: str, key: str, bandwidth: float | None, cancelled: threading.Event | None,
                metadata: dict[str, str] | None, give_way: Callable[[], bool] | None) -> ObjectInfo:
        import boto3.s3.transfer

        size = os.path.getsize(path)
        config = boto3.s3.transfer.TransferConfig(
            multipart_threshold=self.MULTIPART_THRESHOLD, max_concurrency=4,
            multipart_chunksize=max(self.PART_SIZE, -(-size // 9000)),  # S3 allows 10,000 parts
            max_bandwidth=int(bandwidth) if bandwidth else None)
        try:
            with boto3.s3.transfer.create_transfer_manager(self._uploader(), config) as manager:
                if (bandwidth or give_way) and hasattr(manager, "_bandwidth_limiter"):
                    # One bucket of tokens for every upload of this backend: --upload-bandwidth caps them
                    # in total, not each of the --upload-concurrency uploads. The body's every 256 KiB
                    # goes through it, so that is also where an upload waits while ``give_way`` says so.
                    shared = self._limiter(bandwidth) if bandwidth else None
                    manager._bandwidth_limiter = shared if give_way is None else _giving_way(give_way, shared)
                future = manager.upload(path, self.bucket, self.prefix + key,
                                        extra_args={"Metadata": metadata} if metadata else None)
                while not future.done():
                    if cancelled is None:
                        time.sleep(0.05)
                    elif cancelled.wait(0.05):
                        future.cancel()  # a multipart upload is aborted: no partial object stays
                        break
                if cancelled is not None and cancelled.is_set():
                    raise UploadCancelled(f"upload of {key} cancelled")
                future.result()
            info = self._head(key)
            self._confirm(key)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError,
                boto3.exceptions.S3UploadFailedError) as exc:
            self._stats.record("put", "error")
            code = _code(exc)
            if code in _KEY_REFUSED_CODES:
                raise KeyRefused(f"upload of {key}: the endpoint refuses the key ({code})") from None
            raise self._denied_or_unavailable(f"upload of {key}", exc) from None
        self._stats.record("put", "ok")
        return info

    def _confirm(self, key: str) -> None:
        """That the object just written is listed under exactly ``key``: an endpoint that stores a name
        under another key (SeaweedFS turns a backslash into a ``/``) must not be taken at its word."""
        full = self.prefix + key
        listed = self._uploader().list_objects_v2(Bucket=self.bucket, Prefix=full, MaxKeys=1).get("Contents", ())
        if not listed or listed[0].get("Key") != full:
            raise KeyRefused(f"upload of {key}: the endpoint did not store it under that key (it lists "
                             f"{listed[0].get('Key')[:300]!r} there)" if listed else
                             f"upload of {key}: the endpoint does not list the object under that key")

    def key_problem(self, key: str) -> tuple[str, int] | None:
        """Why a writer may not make ``key`` here, with the errno it gets (None if it may): S3's 1,024
        bytes a key (the prefix included), a backslash (which some endpoints store under another key),
        and the reserved ``.epochfs/``."""
        if attrs.reserved(key):
            return f"{key[:300]!r} is reserved for epochfs's own records", errno.EPERM
        if "\\" in key:
            return "a backslash in a name is stored as another key by some S3 endpoints", errno.EINVAL
        size = len((self.prefix + key).encode("utf-8"))
        if size > MAX_S3_KEY:
            return f"its key would be {size} bytes; S3 stores at most {MAX_S3_KEY}", errno.ENAMETOOLONG
        return None

    # -- attribute records (owners and modes in the bucket: epochfs.backend.attrs) ---------------------------

    def put_attributes(self, key: str, mode: int, uid: int, gid: int) -> str:
        """Record ``key``'s owner and mode (before its object is written); the record's key."""
        record = attrs.record_key(key, mode, uid, gid)
        try:
            self._uploader().put_object(Bucket=self.bucket, Key=self.prefix + record, Body=b"")
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            self._stats.record("put", "error")
            raise self._denied_or_unavailable(f"attribute record of {key}", exc) from None
        self._stats.record("put", "ok")
        return record

    def drop_attributes(self, key: str, keep: str | None = None) -> None:
        """Delete ``key``'s attribute records but ``keep`` (after its object is replaced or deleted)."""
        where = self.prefix + attrs.record_prefix(key)
        try:
            listed = self._uploader().list_objects_v2(Bucket=self.bucket, Prefix=where).get("Contents", ())
            for obj in listed:
                if obj.get("Key") != (None if keep is None else self.prefix + keep):
                    self._uploader().delete_object(Bucket=self.bucket, Key=obj["Key"])
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            self._stats.record("delete", "error")
            raise self._denied_or_unavailable(f"attribute records of {key}", exc) from None

    def _limiter(self, bandwidth: float) -> Any:
        """The bandwidth limiter shared by the uploads capped at ``bandwidth`` bytes/s."""
        from s3transfer.bandwidth import BandwidthLimiter, LeakyBucket

        with self._watch_lock:
            limiter = self._limiters.get(int(bandwidth))
            if limiter is None:
                limiter = self._limiters[int(bandwidth)] = BandwidthLimiter(LeakyBucket(int(bandwidth)))
            return limiter

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            self._uploader().abort_multipart_upload(Bucket=self.bucket, Key=self.prefix + key, UploadId=upload_id)
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchUpload", "404"):
                return  # completed or aborted already
            self._stats.record("abort", "error")
            raise self._denied_or_unavailable(f"abort of an upload of {key}", exc) from None
        except botocore.exceptions.BotoCoreError as exc:
            self._stats.record("abort", "error")
            raise self._denied_or_unavailable(f"abort of an upload of {key}", exc) from None
        self._stats.record("abort", "ok")

    def delete(self, key: str) -> None:
        try:
            self._uploader().delete_object(Bucket=self.bucket, Key=self.prefix + key)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            self._stats.record("delete", "error")
            raise self._denied_or_unavailable(f"delete of {key}", exc) from None
        self._stats.record("delete", "ok")

    def copy(self, src: str, dst: str) -> ObjectInfo:
        try:
            self._uploader().copy({"Bucket": self.bucket, "Key": self.prefix + src}, self.bucket, self.prefix + dst)
            info = self._head(dst)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            self._stats.record("copy", "error")
            raise self._denied_or_unavailable(f"copy of {src} to {dst}", exc) from None
        self._stats.record("copy", "ok")
        return info


def _code(exc: Exception) -> str:
    """The S3 error code of a failed call (nested in an upload's failure), or ""."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    m = re.search(r"\(([A-Za-z]+)\)", str(exc))  # S3UploadFailedError: "... (KeyTooLongError) ..."
    return m.group(1) if m else ""
