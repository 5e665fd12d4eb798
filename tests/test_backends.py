"""The backend contract against a real local S3 endpoint and a real directory."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import threading
import time

import pytest

from epochfs.backend import BackendSettings, open_backend
from epochfs.backend.local import file_etag
from epochfs.core.errors import AccessDenied, ConfigError, ObjectChanged
from epochfs.daemon.config import Source
from epochfs.dev.sample import pattern
from epochfs.dev.servers import ACCESS_KEY, LocalS3

from .helpers import EPOCHFS


@pytest.fixture
def s3_env(s3, monkeypatch):
    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)


def s3_backend(s3, bucket, prefix="", **kw):
    return open_backend(BackendSettings(Source.parse(f"s3://{bucket}/{prefix}"), endpoint_url=s3.endpoint, **kw))


def test_listing_paginates_past_1000_keys(s3, s3_client, fresh_bucket, s3_env):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: s3_client.put_object(Bucket=fresh_bucket, Key=f"p/k{i:05d}", Body=b"x" * (i % 7)),
                      range(1105)))
    s3_client.put_object(Bucket=fresh_bucket, Key="other/outside", Body=b"no")
    backend = s3_backend(s3, fresh_bucket, "p")
    listed = sorted(backend.list_objects(), key=lambda o: o.key)
    assert len(listed) == 1105
    assert listed[0].key == "k00000" and listed[1].size == 1 and listed[0].etag.startswith('"')
    assert backend.statistics().requests[("list", "ok")] >= 2


def test_ranged_reads_are_pinned_to_the_etag(s3, s3_client, fresh_bucket, s3_env):
    s3_client.put_object(Bucket=fresh_bucket, Key="obj", Body=pattern("obj", 0, 0, 100_000))
    backend = s3_backend(s3, fresh_bucket)
    (info,) = list(backend.list_objects())
    assert backend.read_range("obj", info.etag, 70_000, 20_001) == pattern("obj", 0, 70_000, 20_001)
    assert backend.read_range("obj", info.etag, 0, 0) == b""
    s3_client.put_object(Bucket=fresh_bucket, Key="obj", Body=pattern("obj", 1, 0, 100_000))
    with pytest.raises(ObjectChanged):
        backend.read_range("obj", info.etag, 0, 10)
    s3_client.delete_object(Bucket=fresh_bucket, Key="obj")
    with pytest.raises(ObjectChanged):
        backend.read_range("obj", info.etag, 0, 10)
    assert backend.statistics().requests[("get", "changed")] == 2


def test_block_gets_address_keys_that_need_escaping(s3, s3_client, fresh_bucket, s3_env):
    """Block GETs are signed and addressed outside the client: keys with characters that must be
    percent-encoded (and a prefix) reach the right object."""
    keys = ["a b/c+d.bin", "100%/x?y#z", "unicode/\u00e9t\u00e9 \u6f22.bin", "tilde~/semi;colon=eq&amp",
            "dots/..x/.y"]
    for key in keys:
        s3_client.put_object(Bucket=fresh_bucket, Key="pre fix/" + key, Body=pattern(key, 0, 0, 70_001))
    backend = s3_backend(s3, fresh_bucket, "pre fix")
    listed = {o.key: o for o in backend.list_objects()}
    assert set(listed) == set(keys)
    for key in keys:
        assert backend.read_range(key, listed[key].etag, 65_535, 4_466) == pattern(key, 0, 65_535, 4_466), key


@pytest.mark.mounts
def test_block_gets_are_signed_correctly_for_an_endpoint_that_checks(tmp_path, monkeypatch):
    """Against an endpoint that verifies every signature: block GETs (signed by libcurl) of keys that
    need escaping are accepted; a wrong secret is EACCES at once, not retried."""
    server = LocalS3(tmp_path / "verifying-s3", verify_signatures=True).start()
    try:
        for k, v in server.env().items():
            if k.startswith("AWS_"):
                monkeypatch.setenv(k, v)
        keys = ["plain.bin", "a b/c+d.bin", "unicode/\u00e9t\u00e9 \u6f22.bin", "100%/x?y#z"]
        client = server.client()
        client.create_bucket(Bucket="signed")
        for key in keys:
            client.put_object(Bucket="signed", Key="p/" + key, Body=pattern(key, 0, 0, 3 << 20))
        backend = s3_backend(server, "signed", "p")
        listed = {o.key: o for o in backend.list_objects()}
        for key in keys:  # a short range (libcurl signs it) and a long one (botocore signs it; epochfs.transport.httpio)
            assert backend.read_range(key, listed[key].etag, 1, 150_000) == pattern(key, 0, 1, 150_000), key
            assert backend.read_range(key, listed[key].etag, 7, 2 << 20) == pattern(key, 0, 7, 2 << 20), key
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        wrong = s3_backend(server, "signed", "p")
        with pytest.raises(AccessDenied) as denied:
            wrong.read_range("plain.bin", listed["plain.bin"].etag, 0, 10)
        assert wrong.statistics().requests == {("get", "denied"): 1}
        with pytest.raises(AccessDenied):
            wrong.read_range("plain.bin", listed["plain.bin"].etag, 0, 2 << 20)
        assert wrong.statistics().requests == {("get", "denied"): 2}
        assert "credentials from the environment (AWS_ACCESS_KEY_ID)" in str(denied.value)
        # a mount refused: the code, what it means, which credentials were used and where to look
        (tmp_path / "mnt").mkdir()
        for key, secret, code, meaning in (
                (ACCESS_KEY, "not-the-secret", "SignatureDoesNotMatch", "the secret key does not belong"),
                ("AKIANOSUCHKEY0000XYZ", "whatever", "InvalidAccessKeyId", "does not know this access key ID")):
            env = {**server.env(), "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
            r = subprocess.run([*EPOCHFS, "mount", "s3://signed/p", str(tmp_path / "mnt"), "--endpoint-url",
                                server.endpoint, "--cache-dir", str(tmp_path / "cache"), "--metrics-addr", "off"],
                               capture_output=True, text=True, env=env, timeout=60)
            assert r.returncode != 0 and code in r.stderr and meaning in r.stderr, r.stderr
            assert "credentials from the environment (AWS_ACCESS_KEY_ID)" in r.stderr, r.stderr
            assert f"access key ID ...{key[-4:]}" in r.stderr and secret not in r.stderr
            assert f"endpoint {server.endpoint}" in r.stderr and "region us-east-1" in r.stderr
            assert "Traceback" not in r.stderr and not os.path.ismount(tmp_path / "mnt")
        # With a snapshot already stored (a mount that worked before), a refused mount still fails at
        # once, with the reason: it never mounts to fail every read with EACCES.
        mount = [*EPOCHFS, "mount", "s3://signed/p", str(tmp_path / "mnt"), "--endpoint-url", server.endpoint,
                 "--cache-dir", str(tmp_path / "kept"), "--metrics-addr", "off"]
        ok = subprocess.run(mount, capture_output=True, text=True, env=server.env(), timeout=60)
        assert ok.returncode == 0, ok.stderr
        assert sorted(os.listdir(tmp_path / "mnt")) == ["100%", "a b", "plain.bin", "unicode"]
        unmount(tmp_path / "mnt")
        env = {**server.env(), "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
        r = subprocess.run(mount, capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode != 0 and "refuses this mount" in r.stderr and "SignatureDoesNotMatch" in r.stderr, r.stderr
        assert not os.path.ismount(tmp_path / "mnt")
        # An endpoint that does not answer: the stored snapshot is served, and the mount says so.
        server.stop()
        r = subprocess.run(mount, capture_output=True, text=True, env=server.env(), timeout=120)
        assert r.returncode == 0, r.stderr
        assert "does not answer" in r.stderr and "serving the stored snapshot" in r.stderr, r.stderr
        assert "plain.bin" in os.listdir(tmp_path / "mnt")
        unmount(tmp_path / "mnt")
    finally:
        if os.path.ismount(tmp_path / "mnt"):
            unmount(tmp_path / "mnt")
        server.stop()


def unmount(path):
    """Unmount and wait for the daemon to let its cache directory go."""
    subprocess.run(["fusermount3", "-u", str(path)], check=True, timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and subprocess.run(["pgrep", "-f", f"epochfs mount .* {path} "],
                                                         capture_output=True).returncode == 0:
        time.sleep(0.1)


def test_missing_credentials_are_a_clear_error(s3, fresh_bucket, s3_env, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ConfigError, match="no AWS credentials"):
        s3_backend(s3, fresh_bucket)


def test_missing_bucket_is_a_clear_error(s3, s3_env):
    with pytest.raises(ConfigError, match="does not exist"):
        list(s3_backend(s3, "no-such-bucket-here").list_objects())
    with pytest.raises(ConfigError, match="does not exist"):
        s3_backend(s3, "no-such-bucket-here").check_access()


def test_an_endpoint_that_is_not_s3_is_named_as_such(s3_env):
    """A web server that answers 404 to everything (a wrong port, a proxy's page): the error says what
    the user did, not "listing ...: 404"."""
    import http.server
    import threading

    class NotS3(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server interface
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html>not here</html>")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        backend = open_backend(BackendSettings(Source.parse("s3://walk/train"), endpoint_url=endpoint, attempts=1))
        with pytest.raises(ConfigError, match="is it an S3 endpoint") as err:
            backend.check_access()
        assert endpoint in str(err.value)
        with pytest.raises(ConfigError, match="is it an S3 endpoint"):
            list(backend.list_objects())
    finally:
        server.shutdown()


def test_directory_backend(tmp_path):
    root = tmp_path / "data"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f.bin").write_bytes(pattern("f", 0, 0, 5000))
    (root / "top.txt").write_bytes(b"hello")
    os.symlink("/etc/passwd", root / "link")
    backend = open_backend(BackendSettings(Source.parse(f"file://{root}")))
    listed = {o.key: o for o in backend.list_objects()}
    assert set(listed) == {"a/b/f.bin", "top.txt", "", "a/", "a/b/"}  # files and directory markers
    os.chmod(root / "top.txt", 0o640)
    os.chown(root / "top.txt", 1234, 5678)
    top = {o.key: o for o in backend.list_objects()}["top.txt"]
    assert (top.mode, top.uid, top.gid) == (0o640, 1234, 5678)
    assert listed["a/"].mode == stat.S_IMODE(os.stat(root / "a").st_mode)
    f = listed["a/b/f.bin"]
    assert backend.read_range(f.key, f.etag, 100, 1000) == pattern("f", 0, 100, 1000)
    (root / "a" / "b" / "f.bin").write_bytes(pattern("f", 1, 0, 5000))
    os.utime(root / "a" / "b" / "f.bin", ns=(1, 1))
    with pytest.raises(ObjectChanged):
        backend.read_range(f.key, f.etag, 0, 10)
    (root / "top.txt").unlink()
    with pytest.raises(ObjectChanged):
        backend.read_range("top.txt", listed["top.txt"].etag, 0, 5)


def test_directory_backend_never_follows_a_symlink_anywhere_in_a_path(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"root only")
    root = tmp_path / "data"
    (root / "real").mkdir(parents=True)
    (root / "real" / "f").write_bytes(b"inside")
    os.symlink(outside, root / "link")  # an intermediate component that leaves the source
    backend = open_backend(BackendSettings(Source.parse(f"file://{root}")))
    listed = {o.key: o for o in backend.list_objects()}
    assert "link/secret" not in listed and "link/" not in listed
    etag = file_etag(os.stat(outside / "secret"))  # a snapshot entry naming it, as a shared store could hold
    for key in ("link/secret", "real/../link/secret", "./real/f", "real//f", "/etc/passwd"):
        with pytest.raises(ObjectChanged):
            backend.read_range(key, etag, 0, 4)
    os.rename(root / "real", root / "moved")
    os.symlink(root / "moved", root / "real")  # the directory swapped for a link after the listing
    with pytest.raises(ObjectChanged):
        backend.read_range("real/f", listed["real/f"].etag, 0, 6)
    fifo = root / "moved" / "pipe"
    os.mkfifo(fifo)  # a special file under a listed name must not block the read
    with pytest.raises(ObjectChanged):
        backend.read_range("moved/pipe", "x", 0, 1)


def test_directory_backend_version_changes_with_an_in_place_rewrite_that_restores_mtime(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    path = root / "f.bin"
    path.write_bytes(b"a" * 1000)
    backend = open_backend(BackendSettings(Source.parse(f"file://{root}")))
    (f,) = [o for o in backend.list_objects() if o.key == "f.bin"]
    before = os.stat(path)
    time.sleep(0.01)
    with open(path, "r+b") as out:  # same inode, same size
        out.write(b"b" * 1000)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime restored
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns
    with pytest.raises(ObjectChanged):
        backend.read_range("f.bin", f.etag, 0, 1000)


def _serving(handler_class):
    """A local HTTP/1.1 server of ``handler_class`` on a free port; stop it with .shutdown()."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler_class)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _partial_content(body: bytes, peers: list | None = None):
    """A handler answering every GET with 206 and ``body`` (recording each client's address in ``peers``)."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            if peers is not None:
                peers.append(self.client_address)
            self.send_response(206)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    return Handler


def _fetch(engine, port, limit, deadline=30.0):
    """(body, stopped) of a GET of / through ``engine`` with a body limit."""
    import pycurl

    from epochfs.transport import curlio, httpio
    from epochfs.transport.buffers import is_aligned

    if engine == "curl":
        curl = curlio.Easy()
        curl.setopt(pycurl.URL, f"http://127.0.0.1:{port}/")
        curl.setopt(pycurl.PROXY, "")
        try:
            _, body = curl.perform(limit)
        except curlio.Failed as exc:
            assert curlio.overflowed(exc), exc
            return None, True
        assert len(body) <= limit and (is_aligned(body) or len(body) % 4096)
        return bytes(body), False
    client = httpio.Client("127.0.0.1", port, None)
    try:
        status, _, body = client.get("/", {}, limit, time.monotonic() + deadline)
    except httpio.Overflow:
        return None, True
    finally:
        client.close()
    assert status == 200
    return bytes(body), False


@pytest.mark.parametrize("engine", ["curl", "stream"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("size, stopped", [(1000, False), (4096, False), (4097, True), (1 << 20, True)])
def test_an_answer_never_buffers_more_than_its_limit(size, stopped, chunked, engine):
    """Both engines of block GETs (libcurl; epochfs.transport.httpio) fill the body and stop at the limit, with a
    Content-Length or without one; what they return is aligned for O_DIRECT."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            body = pattern("x", 0, 0, size)
            self.send_response(200)
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(0, size, 1000):
                    part = body[i:i + 1000]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.send_header("Content-Length", str(size))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = _serving(Handler)
    try:
        body, was_stopped = _fetch(engine, server.server_port, 4096)
        assert was_stopped == stopped
        if not stopped:
            assert body == pattern("x", 0, 0, size)
    finally:
        server.shutdown()


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_the_stream_engine_holds_a_dripping_answer_to_its_deadline(phase):
    """One byte every 0.3 s never resets the deadline of an epochfs.transport.httpio request: it ends in a
    TimeoutError at the deadline, not when the server stops dripping."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
            body = b"x" * 100
            if phase == "body":
                self.wfile.write(head)
                self.wfile.flush()
            for byte in (head if phase == "headers" else body):
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.3)

        def log_message(self, *args):
            pass

    server = _serving(Handler)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            _fetch("stream", server.server_port, 4096, deadline=1.5)
        assert time.monotonic() - started < 2.5
    finally:
        server.shutdown()


def test_the_stream_engine_answers_with_an_aligned_body_and_reuses_its_connection():
    """A body lands in memory aligned for O_DIRECT (the cache writes it from there), and the next request
    on the thread's client goes over the same connection."""
    import ctypes

    from epochfs.transport import httpio
    peers = []
    server = _serving(_partial_content(pattern("y", 0, 0, 3 << 20), peers))
    client = httpio.Client("127.0.0.1", server.server_port, None)
    try:
        for _ in range(2):
            status, headers, body = client.get("/", {}, 4 << 20, time.monotonic() + 30)
            assert status == 206 and headers["content-length"] == str(3 << 20)
            assert body == pattern("y", 0, 0, 3 << 20)
            assert ctypes.addressof(ctypes.c_char.from_buffer(body)) % 4096 == 0
        assert len(peers) == 2 and peers[0] == peers[1]
    finally:
        client.close()
        server.shutdown()


def test_the_upload_bandwidth_cap_holds_for_concurrent_uploads_in_total(s3, fresh_bucket, s3_env, tmp_path):
    """--upload-bandwidth with --upload-concurrency 2: two uploads at once share the cap (a bound from
    below: however slow the machine, capped uploads cannot finish sooner)."""
    from concurrent.futures import ThreadPoolExecutor

    backend = s3_backend(s3, fresh_bucket, "up")
    size, cap = 3 << 20, 4 << 20  # two files of 3 MiB at 4 MiB/s in total: at least 1.5 s
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(bytes([i]) * size)
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        objs = list(pool.map(lambda i: backend.upload_file(str(paths[i]), f"f{i}", bandwidth=cap), range(2)))
    elapsed = time.monotonic() - started
    assert [o.size for o in objs] == [size, size]
    assert elapsed >= 0.8 * 2 * size / cap, f"{2 * size} bytes in {elapsed:.2f} s: over the {cap} B/s cap"
    assert backend.read_range("f1", objs[1].etag, size - 5, 5) == b"\x01" * 5


def test_an_upload_confirms_its_key_and_attribute_records_read_back(s3, s3_client, fresh_bucket, s3_env, tmp_path):
    """An endpoint that stores a name under another key (SeaweedFS: a backslash becomes '/') fails the
    upload with KeyRefused, never a success; attribute records are applied to a listing (files and
    directories, the strictest where several name one key) and the reserved prefix is never listed."""
    from epochfs.backend import attrs
    from epochfs.core.errors import KeyRefused

    backend = s3_backend(s3, fresh_bucket, "ckpt/")
    path = tmp_path / "f"
    path.write_bytes(b"data")
    with pytest.raises(KeyRefused, match="another key|does not list"):
        backend.upload_file(str(path), "back\\slash.pt")
    backend.upload_file(str(path), "d/plain.pt")
    backend.upload_file(str(path), "d/private.pt")
    backend.put_attributes("d/private.pt", 0o640, 1000, 1000)
    backend.put_attributes("d/private.pt", 0o604, 1000, 1000)  # two records: 0o600 together
    backend.put_attributes("d/", 0o750, 7, 8)
    s3_client.put_object(Bucket=fresh_bucket, Key="ckpt/.epochfs/attrs/not-a-record", Body=b"")
    listed = {o.key: o for o in backend.list_objects()}
    assert set(listed) == {"back/slash.pt", "d/plain.pt", "d/private.pt", "d/"}
    assert (listed["d/private.pt"].mode, listed["d/private.pt"].uid) == (0o600, 1000)
    assert (listed["d/"].mode, listed["d/"].uid, listed["d/"].gid) == (0o750, 7, 8)
    assert listed["d/plain.pt"].mode is None
    backend.put_attributes("d/private.pt", 0o600, 2000, 1000)  # owners that disagree: the default owner
    got = {o.key: o for o in backend.list_objects()}["d/private.pt"]
    assert (got.mode, got.uid, got.gid) == (0o600, None, 1000)
    keep = backend.put_attributes("d/private.pt", 0o644, 1000, 1000)
    backend.drop_attributes("d/private.pt", keep=keep)
    assert {o.key: o for o in backend.list_objects()}["d/private.pt"].mode == 0o644
    backend.drop_attributes("d/private.pt")
    assert {o.key: o for o in backend.list_objects()}["d/private.pt"].mode is None
    assert backend.key_problem(".epochfs/x")[1] == 1  # EPERM
    assert attrs.parse("f-" + "0" * 32 + ".77777.0.0") is None  # a mode past 0o7777


def test_an_object_listed_with_a_quoted_empty_etag_cannot_be_pinned():
    """SeaweedFS's remote storage lists an origin's objects with ETag "" until it has read them: such an
    object's version cannot be pinned, so it is skipped like one without an ETag (a directory marker may
    have none)."""
    from epochfs.backend.base import listing_problem
    from epochfs.core.records import ObjectInfo

    assert "no ETag" in listing_problem(ObjectInfo("d/a.bin", 5, 0, '""'))
    assert listing_problem(ObjectInfo("d/", 0, 0, '""')) is None
    assert listing_problem(ObjectInfo("d/a.bin", 5, 0, '"e"')) is None


def test_the_stream_engine_replaces_a_kept_connection_the_server_closed():
    """A server that closes a keep-alive connection after its answer (without saying so): the next
    request goes out again on a new connection at once, not as a failure."""
    import http.server

    peers = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            peers.append(self.client_address)
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")
            self.close_connection = True  # closed after the answer, which did not say so

        def log_message(self, *args):
            pass

    from epochfs.transport import httpio
    server = _serving(Handler)
    client = httpio.Client("127.0.0.1", server.server_port, None)
    try:
        for _ in range(3):
            time.sleep(0.05)  # (the server's close has arrived)
            assert client.get("/", {}, 100, time.monotonic() + 10)[2] == b"hello"
        assert len(peers) == 3 and len(set(peers)) == 3
    finally:
        client.close()
        server.shutdown()


def test_the_stream_engine_speaks_tls_and_checks_the_certificate(tmp_path):
    """Over https: the CA bundle the AWS client uses is trusted, an unknown certificate is refused
    (not retried as a transport failure), and verification off (as the AWS client was told) reads."""
    import ssl

    from epochfs.transport import httpio
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)

    server = _serving(_partial_content(pattern("tls", 0, 0, 2 << 20)))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    try:
        for trust in (str(cert), False):
            client = httpio.Client("127.0.0.1", server.server_port, httpio.tls_context(trust))
            try:
                status, _, body = client.get("/x", {}, 2 << 20, time.monotonic() + 30)
                assert status == 206 and body == pattern("tls", 0, 0, 2 << 20)
            finally:
                client.close()
        client = httpio.Client("127.0.0.1", server.server_port, httpio.tls_context(None))
        with pytest.raises(ssl.SSLCertVerificationError):
            client.get("/x", {}, 2 << 20, time.monotonic() + 30)
    finally:
        server.shutdown()


def test_the_stream_engine_connects_to_the_schemes_port_when_the_endpoint_names_none():
    """https://host (AWS itself) is port 443 and http://host port 80, as the signature's Host says."""
    from epochfs.transport import httpio
    assert httpio._Connection("s3.example.com", None, httpio.tls_context(None)).port == 443
    assert httpio._Connection("s3.example.com", None, None).port == 80
    assert httpio._Connection("s3.example.com", 8443, httpio.tls_context(None)).port == 8443


@pytest.mark.parametrize("size", [3 << 20, 70 << 20])  # one PUT, and a multipart upload
def test_an_upload_changed_on_the_way_is_refused_never_stored(s3, s3_client, fresh_bucket, s3_env, tmp_path, size):
    """The body of an upload is not hashed for its signature (a pass of SHA-256 over every byte saved):
    its CRC32 goes with each request and the endpoint checks it, so a byte changed between the daemon
    and the endpoint fails the upload (retried, then an error) and the key never holds wrong bytes."""
    from .faultproxy import Fault, FaultProxy

    path = tmp_path / "f"
    data = random.Random(size).randbytes(size)
    path.write_bytes(data)
    proxy = FaultProxy(s3.port).start()
    try:
        backend = open_backend(BackendSettings(Source.parse(f"s3://{fresh_bucket}/up"), endpoint_url=proxy.endpoint,
                                               attempts=2))
        proxy.set(Fault("flip_body", rate=1.0, methods=("PUT",), ranged_only=False))
        with pytest.raises(Exception):  # noqa: B017 - whichever error the endpoint's refusal maps to
            backend.upload_file(str(path), "f.pt")
        assert proxy.injected >= 1
        listed = s3_client.list_objects_v2(Bucket=fresh_bucket, Prefix="up/").get("KeyCount", 0)
        assert listed == 0, "a changed body was stored"
        proxy.set(None)
        obj = backend.upload_file(str(path), "f.pt")
        assert obj.size == size
        assert s3_client.get_object(Bucket=fresh_bucket, Key="up/f.pt")["Body"].read() == data
        from botocore import httpchecksum
        assert httpchecksum._CHECKSUM_CLS["crc32"].__name__ == "IsalCrc32"  # (the CRC the endpoint checked)
    finally:
        proxy.stop()


def test_the_isal_crc32_of_an_upload_is_zlibs_whatever_the_chunks():
    """The CRC32 botocore sends with each part, computed with ISA-L, is zlib's CRC32 of the same bytes,
    fed in chunks of any size (seeded odd sizes, empty ones among them)."""
    import zlib

    from botocore import httpchecksum

    from epochfs.backend.s3_writes import use_isal_crc32

    use_isal_crc32()
    use_isal_crc32()  # (twice: installed once)
    cls = httpchecksum._CHECKSUM_CLS["crc32"]
    assert cls.__name__ == "IsalCrc32" and cls.__mro__[1] is httpchecksum.Crc32Checksum
    rng = random.Random(77)
    for _ in range(20):
        data = rng.randbytes(rng.randrange(0, 3 << 20))
        c, at = cls(), 0
        while at < len(data):
            n = rng.choice([0, 1, 7, 4095, 65536, 1 << 20, rng.randrange(1, 1 << 21)])
            c.update(memoryview(data)[at:at + n])
            at += n
        assert c.digest() == (zlib.crc32(data) & 0xFFFFFFFF).to_bytes(4, "big")
        assert c.b64digest() == httpchecksum.Crc32Checksum().handle(data)


@pytest.mark.parametrize("bandwidth", [None, 2e9])  # alone, and beside an --upload-bandwidth cap
def test_an_upload_waits_while_it_gives_way_then_stores_every_byte(s3, s3_client, fresh_bucket, s3_env, tmp_path,
                                                                  bandwidth):
    """While ``give_way()`` is true the body's bytes wait (a multipart upload, asked between its reads
    from its own threads); then it goes on and the object is whole."""
    path = tmp_path / "f"
    data = random.Random(5).randbytes(70 << 20)
    path.write_bytes(data)
    backend = open_backend(BackendSettings(Source.parse(f"s3://{fresh_bucket}/gw"), endpoint_url=s3.endpoint))
    asked = []
    until = time.monotonic() + 1.5

    def give_way() -> bool:
        asked.append(threading.current_thread().name)
        return time.monotonic() < until

    started = time.monotonic()
    obj = backend.upload_file(str(path), "f.pt", give_way=give_way, bandwidth=bandwidth)
    assert time.monotonic() - started >= 1.5
    assert obj.size == len(data)
    assert s3_client.get_object(Bucket=fresh_bucket, Key="gw/f.pt")["Body"].read() == data
    assert len(asked) > 70 and threading.current_thread().name not in asked  # (the transfer's threads ask)
