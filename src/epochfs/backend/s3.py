"""S3 (and S3-compatible: MinIO, SeaweedFS, Ceph RGW) backend on boto3.

Request-level retries (throttling, 5xx, connection errors) are botocore's "standard" retry mode, with a
hook that makes it wait at least as long as a ``Retry-After`` header asks.
Failures while streaming a body (a reset or cut-short body, a read timeout mid-body) happen after
botocore has handed the response over, so :func:`~epochfs.backend.base.retry` covers those, inside the
same overall deadline. Every ranged GET carries ``If-Match`` with the snapshot's ETag, so a block of a
different version can never be returned.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
import urllib3.exceptions

from epochfs.backend.base import Backend, BackendStats, ObjectInfo, StatsRecorder, TemporaryFailure, retry
from epochfs.config import Config
from epochfs.errors import AccessDenied, BackendUnavailable, ConfigError, ObjectChanged

log = logging.getLogger(__name__)

_CHANGED_CODES = {"PreconditionFailed", "412", "NoSuchKey", "404", "NotFound", "InvalidRange", "416"}
_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}
_BODY_ERRORS = (
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.ReadTimeoutError,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    TimeoutError,
)
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class S3Backend(Backend):
    def __init__(self, config: Config) -> None:
        self.bucket = config.source.bucket
        self.prefix = config.source.prefix
        self.source_id = config.source.url
        self._timeout = config.backend_timeout
        self._attempts = config.backend_attempts
        self._stats = StatsRecorder()
        boto_config = botocore.config.Config(
            retries={"mode": "standard", "max_attempts": config.backend_attempts},
            max_pool_connections=2 * config.backend_concurrency + 4,  # demand and prefetch each have theirs
            connect_timeout=5,
            read_timeout=max(2.0, config.backend_timeout / config.backend_attempts),
            s3={"addressing_style": "path" if config.endpoint_url else "auto"},
            user_agent_extra="epochfs",
        )
        session = boto3.session.Session()
        self._client = session.client(
            "s3", endpoint_url=config.endpoint_url, region_name=config.region or None, config=boto_config
        )
        self._client.meta.events.register_first("needs-retry.s3", self._honour_retry_after)

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
        try:
            delay = float(http.headers.get("Retry-After", ""))
        except ValueError:
            return None
        log.debug("server asked to retry after %.1fs", delay)
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
            raise ConfigError(
                "no AWS credentials found (environment, ~/.aws/credentials or an instance role)"
            ) from None
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
        return retry(
            lambda: self._get_once(key, etag, start, length),
            what=what,
            deadline=time.monotonic() + self._timeout,
            attempts=self._attempts,
        )

    def _get_once(self, key: str, etag: str, start: int, length: int) -> bytes:
        end = start + length - 1
        started = time.monotonic()
        try:
            resp = self._client.get_object(
                Bucket=self.bucket, Key=self.prefix + key, Range=f"bytes={start}-{end}", IfMatch=etag
            )
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _CHANGED_CODES or status in _CHANGED_CODES:
                self._stats.record("get", "changed")
                raise ObjectChanged(f"{key}: no longer version {etag} ({code or status})") from None
            if code in _DENIED_CODES or status == "403":
                self._stats.record("get", "denied")
                raise AccessDenied(f"{key}: {code or status}") from None
            self._stats.record("get", "error")
            raise BackendUnavailable(f"{key}: {code or status} after retries") from None
        except botocore.exceptions.BotoCoreError as exc:
            self._stats.record("get", "error")
            raise BackendUnavailable(f"{key}: {exc}") from None

        body = resp["Body"]
        try:
            data = body.read()
        except _BODY_ERRORS as exc:
            self._stats.record("get", "retry")
            raise TemporaryFailure(f"body: {type(exc).__name__}: {exc}") from None
        finally:
            body.close()

        if resp.get("ETag") and resp["ETag"] != etag:
            self._stats.record("get", "changed")
            raise ObjectChanged(f"{key}: server sent version {resp['ETag']}, expected {etag}")
        content_range = resp.get("ContentRange")
        if content_range:
            m = _CONTENT_RANGE.match(content_range)
            if not m or int(m.group(1)) != start or int(m.group(2)) != end:
                self._stats.record("get", "retry")
                raise TemporaryFailure(f"wrong Content-Range {content_range!r} for bytes {start}-{end}")
        elif start != 0 or len(data) != length:
            # A full 200 answer to a ranged request is only usable when it is exactly the range.
            self._stats.record("get", "retry")
            raise TemporaryFailure("server ignored the Range header")
        if len(data) != length:
            self._stats.record("get", "retry")
            raise TemporaryFailure(f"short body: {len(data)} of {length} bytes")
        self._stats.record("get", "ok", len(data), time.monotonic() - started)
        return data
