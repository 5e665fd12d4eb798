"""The backend contract against a real local S3 endpoint and a real directory."""

from __future__ import annotations

import os

import pytest

from epochfs.backend import open_backend
from epochfs.config import Config, Source
from epochfs.errors import ConfigError, ObjectChanged
from epochfs.sample import pattern


@pytest.fixture
def s3_env(s3, monkeypatch):
    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)


def s3_backend(s3, bucket, prefix="", **kw):
    return open_backend(Config(Source.parse(f"s3://{bucket}/{prefix}"), "/nonexistent", endpoint_url=s3.endpoint,
                               **kw))


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


def test_directory_backend(tmp_path):
    root = tmp_path / "data"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f.bin").write_bytes(pattern("f", 0, 0, 5000))
    (root / "top.txt").write_bytes(b"hello")
    os.symlink("/etc/passwd", root / "link")
    backend = open_backend(Config(Source.parse(f"file://{root}"), "/nonexistent"))
    listed = {o.key: o for o in backend.list_objects()}
    assert set(listed) == {"a/b/f.bin", "top.txt"}
    f = listed["a/b/f.bin"]
    assert backend.read_range(f.key, f.etag, 100, 1000) == pattern("f", 0, 100, 1000)
    (root / "a" / "b" / "f.bin").write_bytes(pattern("f", 1, 0, 5000))
    os.utime(root / "a" / "b" / "f.bin", ns=(1, 1))
    with pytest.raises(ObjectChanged):
        backend.read_range(f.key, f.etag, 0, 10)
    (root / "top.txt").unlink()
    with pytest.raises(ObjectChanged):
        backend.read_range("top.txt", listed["top.txt"].etag, 0, 5)
