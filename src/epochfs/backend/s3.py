"""S3 (and S3-compatible: MinIO, SeaweedFS, Ceph RGW) backend on boto3.

Listing goes through the boto3 client, with botocore's "standard" retry mode and a hook that makes it
wait at least as long as a ``Retry-After`` header asks.

Block GETs are the hot path, and a full client call costs about twice the CPU of the request itself
(parameter validation, event hooks, response parsing). So a block GET is built here and signed with
botocore's own SigV4 signer and credentials, then sent on the client's own HTTP session (its connection
pool, TLS verification, proxies and timeouts). The answer is checked completely (status, ETag,
Content-Range, length); throttling, 5xx and transport failures are retried by
:func:`~epochfs.backend.base.retry` within one overall deadline, honouring ``Retry-After``. Every ranged
GET carries ``If-Match`` with the snapshot's ETag, so a block of a different version can never be
returned.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.auth
import botocore.awsrequest
import botocore.config
import botocore.exceptions
import urllib3.exceptions

from epochfs.backend.base import (
    Backend,
    BackendSettings,
    BackendStats,
    StatsRecorder,
    TemporaryFailure,
    retry,
)
from epochfs.errors import AccessDenied, BackendUnavailable, ConfigError, ObjectChanged
from epochfs.records import ObjectInfo

log = logging.getLogger(__name__)

_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}
_CHANGED_STATUS = {404, 412, 416}  # gone, another version, or shorter than the snapshot says
_RETRY_STATUS = {429, 500, 502, 503, 504}
_RETRY_CODES = {"RequestTimeout", "ExpiredToken", "TokenRefreshRequired", "RequestTimeTooSkewed", "SlowDown",
                "InternalError", "ServiceUnavailable"}
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_ERROR_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_PROBE_KEY = "epochfs-probe"
_NO_CREDENTIALS = "no AWS credentials found (environment, ~/.aws/credentials or an instance role)"


class Watchdog:
    """One thread that shuts down the sockets of requests whose deadline has passed; the blocked reader
    then fails at once (and the request is not retried: its deadline is gone)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, socket.socket]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, deadline: float, sock: socket.socket) -> int:
        token = next(self._ids)
        with self._cond:
            self._live.add(token)
            heapq.heappush(self._heap, (deadline, token, sock))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="epochfs-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][1] == token:
                self._cond.notify()
        return token

    def release(self, token: int) -> None:
        with self._cond:
            self._live.discard(token)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, token, sock = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                self._live.discard(token)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed


_WATCHDOG = Watchdog()


class S3Backend(Backend):
    def __init__(self, settings: BackendSettings) -> None:
        self.bucket = settings.source.bucket
        self.prefix = settings.source.prefix
        self.source_id = settings.source.url
        self._timeout = settings.timeout
        self._attempts = settings.attempts
        self._stats = StatsRecorder()
        boto_config = botocore.config.Config(
            retries={"mode": "standard", "max_attempts": settings.attempts},
            max_pool_connections=2 * settings.concurrency + 4,  # demand and prefetch each have theirs
            connect_timeout=5,
            read_timeout=max(2.0, settings.timeout / settings.attempts),
            s3={"addressing_style": "path" if settings.endpoint_url else "auto"},
            user_agent_extra="epochfs",
        )
        session = boto3.session.Session()
        self._client = session.client(
            "s3", endpoint_url=settings.endpoint_url, region_name=settings.region or None, config=boto_config
        )
        self._client.meta.events.register_first("needs-retry.s3", self._honour_retry_after)
        self._session = session
        self._http = self._client._endpoint.http_session  # the client's pool, TLS and proxy settings
        self._region = self._client.meta.region_name or "us-east-1"
        self._credentials: Any = None
        # Where objects live, as the client addresses them (path or virtual-host style, custom endpoints).
        try:
            probe = urllib.parse.urlsplit(self._client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": _PROBE_KEY}, ExpiresIn=60))
        except botocore.exceptions.NoCredentialsError:
            raise ConfigError(_NO_CREDENTIALS) from None
        if not probe.path.endswith("/" + _PROBE_KEY):
            raise ConfigError(f"cannot address objects of bucket {self.bucket!r} at {probe.netloc}")
        self._base_url = f"{probe.scheme}://{probe.netloc}{probe.path[:-len(_PROBE_KEY)]}"

    def _honour_retry_after(self, response: Any = None, attempts: int = 0, **kwargs: Any) -> float | None:
        """botocore hook: wait at least what a throttling server asks for (``Retry-After``).

        Returns None (leaving the decision to botocore's standard retry mode) unless the answer was a
        429/503 with a Retry-After header and attempts remain; the wait is capped at half the deadline.
        """
        if response is None or attempts >= self._attempts:
            return None
        http = response[0]
        if http.status_code not in (429, 503):
            return None
        delay = self._retry_after(http.headers)
        if delay is not None:
            log.debug("server asked to retry after %.1fs", delay)
        return delay

    def _retry_after(self, headers: Any) -> float | None:
        """The wait a ``Retry-After`` header (in seconds) asks for, capped at half the deadline."""
        try:
            delay = float(headers.get("Retry-After", ""))
        except ValueError:
            return None
        if delay != delay:  # NaN
            return None
        return min(max(delay, 0.0), self._timeout / 2)

    def statistics(self) -> BackendStats:
        return self._stats.snapshot()

    def close(self) -> None:
        self._client.close()

    def list_objects(self) -> Iterator[ObjectInfo]:
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                self._stats.record("list", "ok")
                for obj in page.get("Contents", ()):
                    yield ObjectInfo(
                        key=obj["Key"][len(self.prefix):],
                        size=int(obj["Size"]),
                        mtime_ns=int(obj["LastModified"].timestamp() * 1_000_000_000),
                        etag=obj["ETag"],
                    )
        except botocore.exceptions.NoCredentialsError:
            raise ConfigError(_NO_CREDENTIALS) from None
        except botocore.exceptions.ClientError as exc:
            self._stats.record("list", "error")
            code = exc.response.get("Error", {}).get("Code", "")
            if code == "NoSuchBucket":
                raise ConfigError(f"bucket {self.bucket!r} does not exist") from None
            if code in _DENIED_CODES:
                raise AccessDenied(f"listing s3://{self.bucket}/{self.prefix}: {code}") from None
            raise BackendUnavailable(f"listing s3://{self.bucket}/{self.prefix}: {code}") from None
        except botocore.exceptions.BotoCoreError as exc:
            self._stats.record("list", "error")
            raise BackendUnavailable(f"listing s3://{self.bucket}/{self.prefix}: {exc}") from None

    def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        what = f"GET {key} [{start}, {start + length})"
        deadline = time.monotonic() + self._timeout
        return retry(
            lambda: self._get_once(key, etag, start, length, deadline),
            what=what,
            deadline=deadline,
            attempts=self._attempts,
        )

    def _url(self, key: str) -> str:
        return self._base_url + urllib.parse.quote((self.prefix + key).encode("utf-8", "surrogateescape"),
                                                   safe="/~")

    def _signed(self, key: str, headers: dict[str, str]) -> botocore.awsrequest.AWSPreparedRequest:
        if self._credentials is None:
            self._credentials = self._session.get_credentials()
            if self._credentials is None:
                raise AccessDenied(_NO_CREDENTIALS)
        request = botocore.awsrequest.AWSRequest("GET", self._url(key), headers=headers)
        botocore.auth.S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self._region).add_auth(request)
        return request.prepare()

    def _get_once(self, key: str, etag: str, start: int, length: int, deadline: float) -> bytes:
        started = time.monotonic()
        request = self._signed(key, {"Range": f"bytes={start}-{start + length - 1}", "If-Match": etag})
        request.stream_output = True  # the body is read below, in one call rather than 64 KiB pieces
        try:
            resp = self._http.send(request)
        except botocore.exceptions.BotoCoreError as exc:  # connection refused/reset, timeouts
            self._stats.record("get", "retry")
            raise TemporaryFailure(f"{type(exc).__name__}: {exc}") from None
        raw = resp.raw
        reusable = False
        conn = getattr(raw, "connection", None)
        # The deadline covers the body too: a server that drips bytes has its connection shut down
        # when the deadline passes (a per-read timeout alone would let it hold the read forever).
        watch = _WATCHDOG.watch(deadline, conn.sock) if conn is not None and conn.sock is not None else None
        try:
            data = self._checked_body(resp, key, etag, start, length)
            reusable = True
        finally:
            if watch is not None:
                _WATCHDOG.release(watch)
            # A connection goes back to the pool only after a complete, correct answer: anything else
            # (an error, a body cut short or longer than asked for) may leave bytes unread on it.
            if reusable:
                raw.release_conn()
            else:
                raw.close()
        self._stats.record("get", "ok", len(data), time.monotonic() - started)
        return data

    def _checked_body(self, resp: Any, key: str, etag: str, start: int, length: int) -> bytes:
        """The body of an answer to a ranged GET, if it is exactly the asked-for bytes of the version."""
        status, headers = resp.status_code, resp.headers
        end = start + length - 1
        limit = length if status in (200, 206) else 1 << 16  # never buffer more than was asked for
        declared = headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > limit:
            if status not in (200, 206):
                raise self._failure(key, etag, status, headers, b"")
            self._stats.record("get", "retry")
            raise TemporaryFailure(f"{declared}-byte answer to a {length}-byte range (Range ignored?)")
        try:
            data = resp.raw.read(limit + 1)
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # reset, cut short, read timeout mid-body
            self._stats.record("get", "retry")
            raise TemporaryFailure(f"body: {type(exc).__name__}: {exc}") from None
        if status not in (200, 206):
            raise self._failure(key, etag, status, headers, data)
        sent = headers.get("ETag")
        if sent is None:  # the version of these bytes cannot be checked: never cache them
            self._stats.record("get", "retry")
            raise TemporaryFailure("answer without an ETag")
        if sent != etag:
            self._stats.record("get", "changed")
            raise ObjectChanged(f"{key}: server sent version {sent}, expected {etag}")
        content_range = headers.get("Content-Range")
        if status == 206:
            m = _CONTENT_RANGE.match(content_range or "")
            if not m or int(m.group(1)) != start or int(m.group(2)) != end:
                self._stats.record("get", "retry")
                raise TemporaryFailure(f"wrong Content-Range {content_range!r} for bytes {start}-{end}")
        elif start != 0 or len(data) != length:
            # A full 200 answer to a ranged request is only usable when it is exactly the range.
            self._stats.record("get", "retry")
            raise TemporaryFailure("server ignored the Range header")
        if len(data) != length:
            self._stats.record("get", "retry")
            raise TemporaryFailure(f"body of {len(data)} bytes for a range of {length}")
        return data

    def _failure(self, key: str, etag: str, status: int, headers: Any, body: bytes) -> Exception:
        """The error for a non-2xx answer: retry, changed object, denied, or a permanent failure."""
        m = _ERROR_CODE.search(body[:4096])
        code = m.group(1).decode("utf-8", "replace") if m else ""
        if status in _RETRY_STATUS or code in _RETRY_CODES:
            self._stats.record("get", "retry")
            after = self._retry_after(headers)
            if code in ("ExpiredToken", "TokenRefreshRequired"):
                self._credentials = None  # resolve them again
            return TemporaryFailure(f"HTTP {status} {code}".strip(), retry_after=after)
        if status in _CHANGED_STATUS:
            self._stats.record("get", "changed")
            return ObjectChanged(f"{key}: no longer version {etag} ({code or status})")
        if status == 403 or code in _DENIED_CODES:
            self._stats.record("get", "denied")
            return AccessDenied(f"{key}: {code or status}")
        self._stats.record("get", "error")
        region = headers.get("x-amz-bucket-region")
        hint = f"; the bucket is in region {region}: set --region {region}" if region else ""
        return BackendUnavailable(f"{key}: HTTP {status} {code}{hint}".strip())
