"""Who may decide what a mount presents through the shared store: records signed with the store's
password (from a private file), refused when anyone else wrote them; a store without a password not
trusted for owners and modes (the bucket's attribute records decide); TLS end to end."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from epochfs.core.errors import ConfigError
from epochfs.core.records import ObjectInfo
from epochfs.dev.servers import LocalRedis
from epochfs.meta import StoreAccess, open_meta
from epochfs.meta.base import CLOSED_DIR, CLOSED_FILE, SnapshotInvalid, decode_objects, encode_objects

from .conftest import requires_fuse
from .helpers import EPOCHFS, as_user, write_private
from .test_meta import wait_for

SECRET = b"correct-horse-battery-staple"


def owned(n: int) -> list[ObjectInfo]:
    return [ObjectInfo(f"d/{i}.bin", i, 0, f'"{i}"', 0o600, 1000 + i, 1000) for i in range(n)] + [
        ObjectInfo("d/", 0, 0, "", 0o700, 1000, 1000), ObjectInfo("plain.bin", 5, 0, '"p"')]


@pytest.fixture
def guarded(tmp_path):
    """A store whose ``epochfs`` user needs the password, beside a default user anyone may use."""
    server = LocalRedis(tmp_path / "redis", password=SECRET.decode(), open_default=True).start()
    yield server
    server.stop()


def test_an_untrusted_store_is_not_taken_for_owners_and_modes():
    raw = encode_objects(owned(3))
    assert decode_objects(raw) == owned(3)
    got = {o.key: o for o in decode_objects(raw, trusted=False)}
    assert (got["d/1.bin"].mode, got["d/1.bin"].uid, got["d/1.bin"].gid) == (CLOSED_FILE, None, None)
    assert (got["d/"].mode, got["d/"].uid) == (CLOSED_DIR, None)
    assert got["plain.bin"].mode is None  # nothing claimed: the mount's defaults, as before
    with pytest.raises(SnapshotInvalid, match="more than 2"):
        decode_objects(raw, limit=2)


def test_signed_records_are_taken_and_anything_else_is_refused(guarded):
    import redis

    signed = open_meta(guarded.url, Path("."), "ds", StoreAccess(SECRET))
    assert signed.trusted
    signed.save("s3://b/", owned(5))
    signed.update("s3://b/", {"new.bin": ObjectInfo("new.bin", 1, 0, '"n"', 0o640, 7, 7)}, {"plain.bin"})
    loaded = {o.key: o for o in signed.load("s3://b/").objects}
    assert loaded["d/2.bin"].mode == 0o600 and loaded["d/2.bin"].uid == 1002 and loaded["new.bin"].uid == 7
    assert "plain.bin" not in loaded
    # a node without the password reads it, but takes no owner or mode from it
    reader = open_meta(f"redis://127.0.0.1:{guarded.port}/0", Path("."), "ds")
    assert not reader.trusted and reader.load("s3://b/").objects
    assert {o.mode for o in reader.load("s3://b/").objects if o.key.startswith("d/")} <= {CLOSED_FILE, CLOSED_DIR}
    # whoever writes without the password: a plain value, a forged MAC, a chunk moved to another key
    anyone = guarded.client(as_default=True)
    prefix = "epochfs:ds:"
    current = anyone.get(prefix + "current")
    chunk = anyone.get(prefix + "v1:chunk:0")
    for key, value in ((prefix + "current", b"\x00" + b"1"),
                       (prefix + "current", current[:-1] + bytes([current[-1] ^ 1])),
                       (prefix + "v2:chunk:0", chunk)):
        saved = anyone.get(key)
        anyone.set(key, value)
        with pytest.raises(SnapshotInvalid, match="not signed|not a value"):
            signed.load("s3://b/")
        anyone.set(key, saved)
    assert {o.key for o in signed.load("s3://b/").objects} == set(loaded)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=guarded.port, username="epochfs", password="wrong").ping()
    with pytest.raises(ConfigError, match="password in the URL"):
        open_meta(f"redis://epochfs:{SECRET.decode()}@127.0.0.1:{guarded.port}/0", Path("."), "ds")


def test_the_password_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    from epochfs.daemon.config import store_access

    secret = tmp_path / "pw"
    secret.write_bytes(SECRET + b"\n")
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by nobody else"):
        store_access(secret, None)
    secret.chmod(0o600)
    assert store_access(secret, None).password == SECRET
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        store_access(fifo, None)
    link = tmp_path / "link"
    link.symlink_to(secret)
    with pytest.raises(ConfigError):
        store_access(link, None)
    monkeypatch.setenv("EPOCHFS_META_PASSWORD", "from-env")
    assert store_access(None, None).password == b"from-env"


def test_tls_and_a_password_work_end_to_end(s3, s3_client, fresh_bucket, tmp_path):
    """``epochfs import`` publishes over rediss:// with a password from a file; a store with a CA this
    machine does not know is refused; the records read back signed."""
    from epochfs.dev.sample import SampleFile, upload

    server = LocalRedis(tmp_path / "redis", password=SECRET.decode(), tls=True).start()
    try:
        upload(s3_client, fresh_bucket, "", [SampleFile(f"t/{i}.bin", 1000 + i) for i in range(5)])
        pw = tmp_path / "pw"
        pw.write_bytes(SECRET)
        pw.chmod(0o600)
        base = [*EPOCHFS, "import", f"s3://{fresh_bucket}", "--meta", server.url, "--endpoint-url", s3.endpoint,
                "--meta-password-file", str(pw)]
        refused = subprocess.run(base, env=s3.env(), capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "certificate" in refused.stderr.lower(), refused.stderr
        r = subprocess.run([*base, "--meta-ca-file", str(server.ca_file)], env=s3.env(), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and "5 objects" in r.stdout, r.stderr
        store = open_meta(server.url, Path("."), None, StoreAccess(SECRET, str(server.ca_file)))
        assert store.trusted and len(store.load(f"s3://{fresh_bucket}/").objects) == 5
        store.close()
    finally:
        server.stop()


# -- through mounts ---------------------------------------------------------------------------------------


@pytest.fixture
def shared_dir():
    base = Path(tempfile.mkdtemp(prefix="epochfs-store-"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _forge(client, prefix: str, key: str, obj: ObjectInfo, *, sign: bytes | None = None) -> None:
    """Publish, as someone without the password, a change set that gives ``key`` to ``obj``'s owner."""
    from epochfs.meta.redis import _encode_removed

    raw = client.get(prefix + "current")
    current = int(raw[1:] if raw[:1] == b"\x00" else raw[17:])  # a plain value, or a signed one
    version = current + 1
    info = (b'{"format": 3, "source": "s", "version": %d, "created": 1.0, "objects": -1, "chunks": 1, '
            b'"base": %d, "removed": 0}' % (version, current))
    wrap = (lambda v: b"\x00" + v) if sign is None else (lambda v: b"\x01" + sign + v)
    client.mset({f"{prefix}v{version}:info": wrap(info), f"{prefix}v{version}:removed": wrap(_encode_removed([])),
                 f"{prefix}v{version}:chunk:0": wrap(encode_objects([obj])),
                 prefix + "current": wrap(str(version).encode())})


@requires_fuse
@pytest.mark.parametrize("password", [False, True], ids=["open store", "password"])
def test_a_store_writer_cannot_give_anyone_a_private_checkpoint(s3, s3_client, fresh_bucket, mount_factory,
                                                               shared_dir, tmp_path, password):
    """Node A saves a private checkpoint through a write-back mount and publishes it to the shared store;
    someone who can write the store but does not hold its password rewrites the record to say the file
    is theirs and world-readable. Node B, mounted for other users, never presents it so: with a
    password the forged change set is refused (B keeps serving); without one the store is not trusted
    for owners and modes and the bucket's attribute record decides."""
    server = LocalRedis(tmp_path / "redis", password=SECRET.decode() if password else None,
                        open_default=True).start()
    try:
        extra: tuple[str, ...] = ()
        if password:
            pw = shared_dir / "pw"
            pw.write_bytes(SECRET)
            pw.chmod(0o600)
            extra = ("--meta-password-file", str(pw))
        source = f"s3://{fresh_bucket}/ckpt"
        s3_client.put_object(Bucket=fresh_bucket, Key="ckpt/before.txt", Body=b"x")
        imported = subprocess.run([*EPOCHFS, "import", source, "--meta", server.url, *extra, "--endpoint-url",
                                   s3.endpoint], capture_output=True, text=True, timeout=60, env=s3.env())
        assert imported.returncode == 0, imported.stderr
        a = mount_factory(source, "--writeback", "--meta", server.url, *extra, cache_dir=shared_dir / "ca",
                          name="unused-a")
        a.start()
        write_private(a.path("secret.pt"), b"weights\n")
        a.path("public.pt").write_bytes(b"for all\n")
        assert subprocess.run([*EPOCHFS, "sync", str(a.mountpoint)], capture_output=True, timeout=120).returncode == 0
        b = mount_factory(source, "--allow-other", "--meta", server.url, "--meta-poll", "0.3", *extra,
                          cache_dir=shared_dir / "cb", name="unused-b")
        b.mountpoint = shared_dir / "b"
        b.mountpoint.mkdir()
        with b:
            st = os.stat(b.path("secret.pt"))
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, 0)
            assert as_user("nobody", "cat", str(b.path("public.pt"))).stdout == "for all\n"
            version = b.status()["snapshot"]["version"]
            _forge(server.client(as_default=True), f"epochfs:{source}/:",
                   "secret.pt", ObjectInfo("secret.pt", 8, 0, s3_client.head_object(
                       Bucket=fresh_bucket, Key="ckpt/secret.pt")["ETag"], 0o644, 65534, 65534),
                   sign=b"\x00" * 16 if password else None)
            if password:
                wait_for(lambda: "not signed with this store's password" in b.log(), timeout=10)
                assert b.status()["snapshot"]["version"] == version  # refused; still serving
            else:
                wait_for(lambda: b.status()["snapshot"]["version"] > version, timeout=10)
            time.sleep(0.5)
            st = os.stat(b.path("secret.pt"))
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, 0), "the forged owner was taken"
            denied = as_user("nobody", "cat", str(b.path("secret.pt")))
            assert denied.returncode != 0 and "Permission denied" in denied.stderr
            assert b.path("secret.pt").read_bytes() == b"weights\n"
            if not password:
                assert "is not authenticated" in b.log()
        a.stop()
    finally:
        server.stop()


@requires_fuse
def test_a_version_never_goes_back(s3, s3_client, fresh_bucket, mount_factory, guarded, tmp_path):
    """Someone who can write the store without its password keeps a signed value (the pointer to version
    1) and puts it back once version 2 is out: a node with the password refuses to go back, while it
    runs and when it starts again, and a file deleted in version 2 does not come back."""
    pw = tmp_path / "pw"
    pw.write_bytes(SECRET)
    pw.chmod(0o600)
    source = f"s3://{fresh_bucket}/ds"
    for key in ("a.bin", "b.bin"):
        s3_client.put_object(Bucket=fresh_bucket, Key=f"ds/{key}", Body=key.encode())

    def publish() -> None:
        r = subprocess.run([*EPOCHFS, "import", source, "--meta", guarded.url, "--meta-password-file", str(pw),
                            "--endpoint-url", s3.endpoint], capture_output=True, text=True, timeout=60, env=s3.env())
        assert r.returncode == 0, r.stderr

    publish()
    anyone = guarded.client(as_default=True)
    pointer = f"epochfs:{source}/:current"
    kept = anyone.get(pointer)  # a signed value, kept for later
    m = mount_factory(source, "--meta", guarded.url, "--meta-password-file", str(pw), "--meta-poll", "0.3")
    with m:
        assert sorted(os.listdir(m.mountpoint)) == ["a.bin", "b.bin"]
        s3_client.delete_object(Bucket=fresh_bucket, Key="ds/b.bin")
        publish()  # version 2: b.bin deleted
        wait_for(lambda: m.status()["snapshot"]["version"] == 2, timeout=15)
        assert sorted(os.listdir(m.mountpoint)) == ["a.bin"]
        anyone.set(pointer, kept)  # the store says version 1 again, signed
        wait_for(lambda: "older than the version 2 served" in m.log(), timeout=15)
        time.sleep(1.0)
        assert m.status()["snapshot"]["version"] == 2 and sorted(os.listdir(m.mountpoint)) == ["a.bin"]
    m.start()  # a restart, the store still saying version 1
    try:
        assert m.status()["snapshot"]["version"] == 2 and sorted(os.listdir(m.mountpoint)) == ["a.bin"]
        assert "older than the version 2 this node served" in m.log()
    finally:
        m.stop()


def test_a_wrong_password_or_user_says_so_and_how_to_name_the_user(s3, s3_client, fresh_bucket, guarded, tmp_path):
    """A refused password is not an unreachable store: `epochfs import` (and a mount) say the store
    refused it, and how a user in the URL relates to requirepass and ACL users; --meta-name names the
    dataset in the store as mount, serve and cluster do."""
    s3_client.put_object(Bucket=fresh_bucket, Key="ds/a.bin", Body=b"a")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")
    wrong.chmod(0o600)
    base = [*EPOCHFS, "import", f"s3://{fresh_bucket}/ds", "--endpoint-url", s3.endpoint, "--meta-password-file"]
    r = subprocess.run([*base, str(wrong), "--meta", guarded.url], capture_output=True, text=True, timeout=60,
                       env=s3.env())
    assert r.returncode == 2 and "refused the password" in r.stderr and "unreachable" not in r.stderr, r.stderr
    assert "requirepass" in r.stderr and "ACL user" in r.stderr
    right = tmp_path / "right"
    right.write_bytes(SECRET)
    right.chmod(0o600)
    r = subprocess.run([*base, str(right), "--meta", guarded.url, "--meta-name", "imagenet"], capture_output=True,
                       text=True, timeout=60, env=s3.env())
    assert r.returncode == 0, r.stderr
    keys = guarded.client().keys("epochfs:imagenet:*")
    assert keys, "published under the name given"


@requires_fuse
def test_a_password_refused_under_a_running_node_is_said_not_fatal(s3, s3_client, fresh_bucket, guarded, tmp_path,
                                                                    mount_factory):
    """The store's password rotated under a running client of the cluster tier (its connections dropped):
    the node keeps serving what it has (never dies of it), and its status says the store refuses its
    password, as a gauge does (epochfs_peer_store_reachable 0); the right password back, it recovers."""
    import os as _os

    s3_client.put_object(Bucket=fresh_bucket, Key="ds/a.bin", Body=b"a" * 1000)
    right = tmp_path / "right"
    right.write_bytes(SECRET)
    right.chmod(0o600)
    token = tmp_path / "token"
    token.write_text(_os.urandom(16).hex())
    token.chmod(0o600)
    r = subprocess.run([*EPOCHFS, "import", f"s3://{fresh_bucket}/ds", "--endpoint-url", s3.endpoint,
                        "--meta-password-file", str(right), "--meta", guarded.url], capture_output=True, text=True,
                       timeout=60, env=s3.env())
    assert r.returncode == 0, r.stderr
    m = mount_factory(f"s3://{fresh_bucket}/ds", "--meta", guarded.url, "--meta-password-file", str(right),
                      "--peer-role", "client", "--peer-token-file", str(token))
    m.start()
    try:
        admin = guarded.client()
        admin.execute_command("ACL", "SETUSER", "epochfs", "resetpass", ">another-password")
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal")  # (its connections authenticated before)
        wait_for(lambda: m.status()["peer"]["store_reachable"] is False, 30)
        peer = m.status()["peer"]
        assert "refused the password" in (peer.get("store_error") or ""), peer
        text = subprocess.run([*EPOCHFS, "status", str(m.mountpoint)], capture_output=True, text=True,
                              timeout=30).stdout
        assert "store unreachable" in text and "refused the password" in text, text
        assert m.path("a.bin").read_bytes() == b"a" * 1000  # still serving
        admin = guarded.client(as_default=True)
        admin.execute_command("ACL", "SETUSER", "epochfs", "resetpass", f">{SECRET.decode()}")
        wait_for(lambda: m.status()["peer"]["store_reachable"] is True, 30)
    finally:
        m.stop()
