"""S3 (and S3-compatible: MinIO, SeaweedFS, Ceph RGW) backend.

Listing goes through the boto3 client, with botocore's "standard" retry mode and a hook that makes it
wait at least as long as a ``Retry-After`` header asks.

Block GETs are the hot path. A range shorter than :data:`STREAM_MIN` goes through libcurl (pycurl),
which signs it itself (AWS SigV4 with the credentials of boto3's chain, re-read on every request so
refreshed ones are used) and sends it with the GIL released: a cold small file costs a fraction of the
CPU of a botocore request. A longer one (a block of a large file) is signed by botocore and received by
:mod:`epochfs.transport.httpio` straight into an aligned buffer, which costs far less CPU per byte (unless a proxy
is configured for the endpoint: then libcurl, which honours it, takes every range). Either way the
whole request, headers and body included, is bounded by one deadline (a server that drips its answer
cannot hold a read), and each worker thread keeps its own connections. The answer is checked completely
(status, ETag, Content-Range, length; never more than the range is buffered); throttling, 5xx and
transport failures are retried by :func:`~epochfs.backend.base.retry` within one overall deadline,
honouring ``Retry-After``. Every ranged GET carries ``If-Match`` with the snapshot's
ETag, so a block of a different version can never be returned.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import boto3
import boto3.exceptions
import botocore.auth
import botocore.awsrequest
import botocore.config
import botocore.exceptions
import botocore.httpsession
import pycurl

from epochfs.backend import attrs
from epochfs.backend.base import (
    Backend,
    BackendSettings,
    BackendStats,
    StatsRecorder,
    TemporaryFailure,
    retry,
    servable,
)
from epochfs.backend.s3_writes import S3Writes
from epochfs.core.blocks import scope_id
from epochfs.core.errors import (
    AccessDenied,
    BackendUnavailable,
    ConfigError,
    ObjectChanged,
)
from epochfs.core.records import ObjectInfo
from epochfs.links.meter import TransferMeter
from epochfs.transport import curlio, httpio

log = logging.getLogger(__name__)
T = TypeVar("T")

_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}
_CHANGED_STATUS = {404, 412, 416}  # gone, another version, or shorter than the snapshot says
_RETRY_STATUS = {429, 500, 502, 503, 504}
_RETRY_CODES = {"RequestTimeout", "ExpiredToken", "TokenRefreshRequired", "RequestTimeTooSkewed", "SlowDown",
                "InternalError", "ServiceUnavailable"}
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_ERROR_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_REGION_NAME = re.compile(r"[a-z0-9-]{2,40}")  # what a region named in an answer must look like
_REGION = re.compile(rb"<Region>(" + _REGION_NAME.pattern.encode() + rb")</Region>")
_PROBE_KEY = "epochfs-probe"
_NO_CREDENTIALS = "no AWS credentials found (environment, ~/.aws/credentials or an instance role)"
#: What each refusal means, to say beside the code.
_DENIED_MEANING = {
    "InvalidAccessKeyId": "the endpoint does not know this access key ID",
    "SignatureDoesNotMatch": "the secret key does not belong to this access key ID (or the request was signed "
                             "for another region, or this machine's clock is off)",
    "AccessDenied": "the credentials are valid but not allowed this (check the bucket's and the user's policies)",
    "AllAccessDisabled": "all access to this bucket is disabled",
    "403": "refused (check the credentials and the policies)",
}
#: Where botocore found the credentials, in words (``Credentials.method``).
_CREDENTIAL_SOURCES = {
    "env": "the environment (AWS_ACCESS_KEY_ID)", "shared-credentials-file": "~/.aws/credentials",
    "config-file": "~/.aws/config", "iam-role": "the instance role", "container-role": "the container role",
    "assume-role": "an assumed role", "assume-role-with-web-identity": "a web identity role", "sso": "AWS SSO",
    "custom-process": "a credential_process", "explicit": "explicit settings",
}


#: Most attribute records one listing takes (a name each; far more than any checkpoint area holds).
MAX_ATTRIBUTE_RECORDS = 10_000_000

#: Ranges at least this long are received through :mod:`epochfs.transport.httpio` (see the module's text).
STREAM_MIN = 1 << 20

_TLS_FAILURES = {35, 51, 53, 54, 58, 59, 60, 64, 66, 77, 80, 82, 83, 90, 91}  # certificate, TLS setup


class S3Backend(S3Writes, Backend):
    def __init__(self, settings: BackendSettings) -> None:
        self.bucket = settings.source.bucket
        self.prefix = settings.source.prefix
        self.source_id = settings.source.url
        self._timeout = settings.timeout
        self._attempts = settings.attempts
        self._stats = StatsRecorder()
        self._settings = settings
        try:
            self._session = boto3.session.Session(profile_name=settings.profile)
        except botocore.exceptions.ProfileNotFound:
            raise ConfigError(f"--profile {settings.profile!r}: no such profile in the AWS configuration") from None
        self._client = self._make_client(settings.region)
        self._upload_client: Any = None
        self._watch_lock = threading.Lock()
        self._multipart_watchers: dict[str, list[Callable[[str], None]]] = {}  # full key -> callbacks
        self._limiters: dict[int, Any] = {}  # bytes/s -> the upload bandwidth limiter shared at that cap
        verify = self._client._endpoint.http_session._verify  # the client's TLS setting (AWS_CA_BUNDLE, ...)
        self._cainfo = botocore.httpsession.get_cert_path(True) if verify is True else verify
        self._local = threading.local()  # each worker thread's curl handle (and so its connection)
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
        self._stream_to = self._stream_endpoint(probe)

    def _stream_endpoint(self, url: urllib.parse.SplitResult) -> tuple[str, int | None, ssl.SSLContext | None] | None:
        """Where :mod:`epochfs.transport.httpio` sends long ranges: host, port and TLS context; None where a
        proxy is configured for the endpoint (libcurl then takes every range, through it)."""
        host = url.hostname or ""
        if urllib.request.getproxies().get(url.scheme) and not urllib.request.proxy_bypass(host):
            log.info("a proxy is configured for %s: every block GET goes through libcurl", url.netloc)
            return None
        context = httpio.tls_context(self._cainfo) if url.scheme == "https" else None
        return host, url.port, context

    def _make_client(self, region: str | None) -> Any:
        s = self._settings
        client = self._session.client("s3", endpoint_url=s.endpoint_url, region_name=region or None,
                                      config=botocore.config.Config(
            retries={"mode": "standard", "max_attempts": s.attempts},
            max_pool_connections=4,  # listing only: block GETs go through libcurl
            connect_timeout=5,
            read_timeout=max(2.0, s.timeout / s.attempts),
            s3={"addressing_style": "path" if s.endpoint_url else "auto"},
            user_agent_extra="epochfs",
        ))
        client.meta.events.register_first("needs-retry.s3", self._honour_retry_after)
        return client

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
            delay = float(headers.get("Retry-After", headers.get("retry-after", "")))
        except ValueError:
            return None
        if delay != delay:  # NaN
            return None
        return min(max(delay, 0.0), self._timeout / 2)

    def statistics(self) -> BackendStats:
        return self._stats.snapshot()

    def transfers(self) -> TransferMeter:
        return self._stats.transfers

    def link_peer(self) -> tuple[str, int] | None:
        url = urllib.parse.urlsplit(self._base_url)
        try:
            port = url.port or (443 if url.scheme == "https" else 80)
        except ValueError:
            return None
        return (url.hostname, port) if url.hostname else None

    def _denied_or_unavailable(self, what: str, exc: Exception) -> Exception:
        response = getattr(exc, "response", None)  # None on connection errors, even on a ClientError
        code = response.get("Error", {}).get("Code", "") if isinstance(response, dict) else ""
        if code in _DENIED_CODES or "AccessDenied" in str(exc):
            return self._denied(what, code or "AccessDenied")
        return BackendUnavailable(f"{what}: {code or exc}")

    def _denied(self, what: str, code: str) -> AccessDenied:
        """A refusal that says what it means and which credentials were refused, where to check."""
        return AccessDenied(f"{what}: {code}: {_DENIED_MEANING.get(code, 'refused')}; {self._whose()}",
                            policy=code not in ("InvalidAccessKeyId", "SignatureDoesNotMatch"))

    def _whose(self) -> str:
        try:
            creds = self._credentials or self._session.get_credentials()
        except (botocore.exceptions.BotoCoreError, OSError, ValueError):
            creds = None
        where = f"region {self._region}, endpoint {self._settings.endpoint_url or self._base_url}"
        if creds is None:
            return f"no credentials found; {where}"
        method = getattr(creds, "method", "") or ""
        source = _CREDENTIAL_SOURCES.get(method, method or "an unknown source")
        if method in ("shared-credentials-file", "config-file"):
            source += f" (profile {self._settings.profile or os.environ.get('AWS_PROFILE') or 'default'})"
        key = str(getattr(creds, "access_key", "") or "")
        return f"credentials from {source}, access key ID ...{key[-4:]}; {where}"

    def content_scope(self) -> bytes | None:
        """The endpoint, the bucket and the access key ID: two mounts share bytes only where both
        listed them from one bucket with one identity."""
        try:
            creds = self._credentials or self._session.get_credentials()
        except (botocore.exceptions.BotoCoreError, OSError, ValueError):
            creds = None
        key = str(getattr(creds, "access_key", "") or "") if creds is not None else ""
        return scope_id("s3", self._settings.endpoint_url or self._base_url, self.bucket, key)

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self.prefix + key)
            info = ObjectInfo(key=key, size=int(head["ContentLength"]), etag=head["ETag"],
                              mtime_ns=int(head["LastModified"].timestamp() * 1_000_000_000))
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound"):
                self._stats.record("head", "missing")
                return None
            self._stats.record("head", "error")
            if code == "403":  # a HEAD's answer has no body: ask again to learn why (a bad signature, a policy)
                try:
                    self._client.get_object(Bucket=self.bucket, Key=self.prefix + key, Range="bytes=0-0")
                except botocore.exceptions.ClientError as again:
                    exc = again
                except botocore.exceptions.BotoCoreError:
                    pass
            raise self._denied_or_unavailable(f"HEAD {key}", exc) from None
        except botocore.exceptions.NoCredentialsError:
            raise ConfigError(_NO_CREDENTIALS) from None
        except botocore.exceptions.BotoCoreError as exc:
            self._stats.record("head", "error")
            raise BackendUnavailable(f"HEAD {key}: {exc}") from None
        except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
            self._stats.record("head", "error")
            raise BackendUnavailable(f"HEAD {key}: malformed answer ({type(exc).__name__})") from None
        self._stats.record("head", "ok")
        return info

    def attribute_records(self) -> attrs.Records:
        """The source's attribute records: one listing of the reserved prefix."""
        records = attrs.Records()
        where = self.prefix + attrs.ATTR_DIR
        for name in self._list(where, lambda key, _: key[len(where):]):
            records.add(name)
            if len(records) + records.malformed > MAX_ATTRIBUTE_RECORDS:
                raise BackendUnavailable(f"listing s3://{self.bucket}/{where}: more than {MAX_ATTRIBUTE_RECORDS} "
                                         "attribute records")
        if records.malformed:
            log.warning("%d keys under %s are not attribute records: ignored", records.malformed, where)
        return records

    def close(self) -> None:
        self._client.close()
        if self._upload_client is not None:
            self._upload_client.close()

    def list_objects(self) -> Iterator[ObjectInfo]:
        """The objects under the prefix, each with the owner and mode its attribute record gives, and
        nothing of the reserved ``.epochfs/`` prefix."""
        return servable(self.attribute_records().apply(self._listing()))

    def _listing(self) -> Iterator[ObjectInfo]:
        return self._list(self.prefix, lambda key, obj: ObjectInfo(
            key=key[len(self.prefix):], size=int(obj["Size"]),
            mtime_ns=int(obj["LastModified"].timestamp() * 1_000_000_000), etag=obj.get("ETag", "")))

    def _list(self, where: str, convert: Callable[[str, Any], T]) -> Iterator[T]:
        """``convert(key, entry)`` of every object listed under ``where`` (a key not under it is skipped
        with a warning). Whatever the answer is, what fails is an epochfs error, an entry that is not
        one (a field missing, a size that is no number) included."""
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=where):
                self._stats.record("list", "ok")
                for obj in page.get("Contents", ()):
                    key = obj["Key"]
                    if not key.startswith(where):
                        log.warning("skipping listed object %r: not under the prefix %r", key[:300], where)
                        continue
                    yield convert(key, obj)
        except botocore.exceptions.NoCredentialsError:
            raise ConfigError(_NO_CREDENTIALS) from None
        except botocore.exceptions.ClientError as exc:
            self._stats.record("list", "error")
            raise self._listing_error(exc, where) from None
        except botocore.exceptions.BotoCoreError as exc:
            self._stats.record("list", "error")
            raise BackendUnavailable(f"listing s3://{self.bucket}/{where}: {exc}") from None
        except (KeyError, ValueError, TypeError, AttributeError, OverflowError, RuntimeError) as exc:
            self._stats.record("list", "error")
            raise BackendUnavailable(f"listing s3://{self.bucket}/{where}: malformed answer "
                                     f"({type(exc).__name__}: {str(exc)[:200]})") from None

    def check_access(self) -> None:
        """One LIST of at most one key under the prefix."""
        try:
            self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
            self._stats.record("list", "ok")
        except botocore.exceptions.NoCredentialsError:
            raise ConfigError(_NO_CREDENTIALS) from None
        except botocore.exceptions.ClientError as exc:
            self._stats.record("list", "error")
            raise self._listing_error(exc, self.prefix) from None
        except botocore.exceptions.BotoCoreError as exc:
            self._stats.record("list", "error")
            raise BackendUnavailable(f"{self._settings.endpoint_url or self._base_url}: {exc}") from None

    def _listing_error(self, exc: botocore.exceptions.ClientError, where: str) -> Exception:
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            return ConfigError(f"bucket {self.bucket!r} does not exist at {self._settings.endpoint_url or self._base_url}")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if not code and status:
            code = str(status)
        if code in ("404", "NotFound", "405", "MethodNotAllowed", "400"):  # an answer with no S3 error in it
            return ConfigError(f"the endpoint {self._settings.endpoint_url or self._base_url} answered {code} to a "
                               f"listing of s3://{self.bucket}/{where}: is it an S3 endpoint (--endpoint-url, with "
                               "the S3 API's port)?")
        if code in _DENIED_CODES:
            return self._denied(f"listing s3://{self.bucket}/{where}", code)
        return BackendUnavailable(f"listing s3://{self.bucket}/{where}: {code}")

    def read_range(self, key: str, etag: str, start: int, length: int) -> bytes | memoryview:
        if length == 0:
            return b""
        what = f"GET {key} [{start}, {start + length})"
        deadline = time.monotonic() + self._timeout
        get = self._stream_once if length >= STREAM_MIN and self._stream_to is not None else self._get_once
        return retry(
            lambda: get(key, etag, start, length, deadline),
            what=what,
            deadline=deadline,
            attempts=self._attempts,
        )

    def _url(self, key: str) -> str:
        return self._base_url + urllib.parse.quote((self.prefix + key).encode("utf-8", "surrogateescape"),
                                                   safe="/~")

    def _curl(self) -> curlio.Easy:
        curl = getattr(self._local, "curl", None)
        if curl is None:
            curl = self._local.curl = curlio.Easy()
            if self._cainfo is False:
                curl.setopt(pycurl.SSL_VERIFYPEER, 0)
                curl.setopt(pycurl.SSL_VERIFYHOST, 0)
            elif self._cainfo:
                curl.setopt(pycurl.CAINFO, str(self._cainfo))
        return curl

    def _frozen_credentials(self) -> Any:
        if self._credentials is None:
            self._credentials = self._session.get_credentials()
            if self._credentials is None:
                raise AccessDenied(_NO_CREDENTIALS)
        return self._credentials.get_frozen_credentials()  # refreshed by botocore when they expire

    def _get_once(self, key: str, etag: str, start: int, length: int, deadline: float) -> memoryview:
        started = time.monotonic()
        remaining_ms = int((deadline - started) * 1000)
        if remaining_ms <= 0:
            raise TemporaryFailure("deadline passed")
        creds = self._frozen_credentials()
        headers = [f"Range: bytes={start}-{start + length - 1}", f"If-Match: {etag}",
                   "x-amz-content-sha256: UNSIGNED-PAYLOAD"]
        if creds.token:
            headers.append(f"x-amz-security-token: {creds.token}")
        curl = self._curl()
        curl.setopt(pycurl.AWS_SIGV4, f"aws:amz:{self._region}:s3")
        curl.setopt(pycurl.URL, self._url(key))
        curl.setopt(pycurl.HTTPHEADER, headers)
        curl.setopt(pycurl.USERNAME, creds.access_key)
        curl.setopt(pycurl.PASSWORD, creds.secret_key)
        curl.setopt(pycurl.TIMEOUT_MS, remaining_ms)  # the whole request, headers and body
        curl.setopt(pycurl.CONNECTTIMEOUT_MS, min(5000, remaining_ms))
        try:  # (never more than was asked for, or an error page)
            answer_headers, body = curl.perform(max(length, 1 << 16))
        except curlio.Failed as exc:
            kind = "overflow" if curlio.overflowed(exc) else "tls" if exc.code in _TLS_FAILURES else "transport"
            raise self._transfer_failed(key, length, kind, f"curl error {exc.code}: {exc.message}") from None
        data = self._checked(int(curl.getinfo(pycurl.RESPONSE_CODE)), answer_headers, body, key, etag, start,
                             length)
        end = time.monotonic()
        body_seconds = max(0.0, curl.getinfo(pycurl.TOTAL_TIME) - curl.getinfo(pycurl.STARTTRANSFER_TIME))
        self._stats.record("get", "ok", len(data), end - started, moving=(end - body_seconds, end))
        return data

    def _stream_once(self, key: str, etag: str, start: int, length: int, deadline: float) -> memoryview:
        """:meth:`_get_once` through :mod:`epochfs.transport.httpio` (a long range)."""
        started = time.monotonic()
        if deadline <= started:
            raise TemporaryFailure("deadline passed")
        url = self._url(key)
        request = botocore.awsrequest.AWSRequest(method="GET", url=url, headers={
            "Range": f"bytes={start}-{start + length - 1}", "If-Match": etag})
        botocore.auth.S3SigV4Auth(self._frozen_credentials(), "s3", self._region).add_auth(request)
        client = getattr(self._local, "http", None)
        if client is None:
            assert self._stream_to is not None
            client = self._local.http = httpio.Client(*self._stream_to)
        try:
            status, headers, body = client.get(urllib.parse.urlsplit(url).path, dict(request.headers.items()),
                                               length, deadline)
        except httpio.Overflow as exc:
            raise self._transfer_failed(key, length, "overflow", str(exc)) from None
        except (OSError, http.client.HTTPException) as exc:
            closed = isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError))  # (not the certificate)
            kind = "tls" if isinstance(exc, ssl.SSLError) and not closed else "transport"
            raise self._transfer_failed(key, length, kind, f"{type(exc).__name__}: {exc}") from None
        data = self._checked(status, headers, body, key, etag, start, length)
        end = time.monotonic()
        self._stats.record("get", "ok", len(data), end - started, moving=(max(started, client.answered), end))
        return data

    def _transfer_failed(self, key: str, length: int, kind: str, message: str) -> Exception:
        """The error for a GET that got no complete answer, counted, whichever engine sent it: ``kind``
        ``overflow`` (a body longer than the range) and ``transport`` are retried, ``tls`` (a
        certificate or TLS setup refused) is not."""
        if kind == "tls":
            self._stats.record("get", "error")
            return BackendUnavailable(f"{key}: TLS: {message}")
        self._stats.record("get", "retry")
        if kind == "overflow":
            return TemporaryFailure(f"answer longer than the {length}-byte range (Range ignored?)")
        return TemporaryFailure(message)

    def _checked(self, status: int, headers: dict[str, str], data: memoryview, key: str, etag: str, start: int,
                 length: int) -> memoryview:
        """The body of an answer to a ranged GET, if it is exactly the asked-for bytes of the version."""
        end = start + length - 1
        if status not in (200, 206):
            raise self._failure(key, etag, status, headers, bytes(data))
        sent = headers.get("etag")
        if sent is None:  # the version of these bytes cannot be checked: never cache them
            self._stats.record("get", "retry")
            raise TemporaryFailure("answer without an ETag")
        if sent != etag:
            self._stats.record("get", "changed")
            raise ObjectChanged(f"{key}: server sent version {sent}, expected {etag}")
        content_range = headers.get("content-range")
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
        return data  # not copied into a bytes object: nothing writes to it from here on

    def _failure(self, key: str, etag: str, status: int, headers: Any, body: bytes) -> Exception:
        """The error for a non-2xx answer: retry, changed object, denied, or a permanent failure."""
        m = _ERROR_CODE.search(body[:4096])
        code = m.group(1).decode("utf-8", "replace") if m else ""
        m = _REGION.search(body[:4096])
        region = headers.get("x-amz-bucket-region")
        if region is not None and not _REGION_NAME.fullmatch(region):
            region = None  # not a region name: never sign for it (every later request would fail)
        region = region or (m.group(1).decode("ascii") if m else None)
        if region and region != self._region and status in (301, 307, 400, 403):
            # Signed for another region than the bucket's (a wrong or missing --region): the answer says
            # which; sign for that one from now on, and retry at once.
            log.warning("bucket %s is in region %s, not %s: signing for %s", self.bucket, region, self._region,
                        region)
            self._region = region
            self._stats.record("get", "retry")
            return TemporaryFailure(f"HTTP {status}: the bucket is in region {region}", retry_after=0.0)
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
            return self._denied(key, code or str(status))
        self._stats.record("get", "error")
        return BackendUnavailable(f"{key}: HTTP {status} {code}".strip())

