import pytest

from epochfs.config import Config, Source, parse_rate, parse_size
from epochfs.errors import ConfigError


@pytest.mark.parametrize("text,value", [
    ("0", 0), ("512", 512), ("4M", 4 << 20), ("4MiB", 4 << 20), ("4MB", 4_000_000), ("2G", 2 << 30),
    ("1.5G", int(1.5 * (1 << 30))), ("1T", 1 << 40), ("64k", 64 << 10), (" 10 G ", 10 << 30),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "-1G", "1X", "ten", "1.2.3M"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="not a size"):
        parse_size(text)


def test_parse_rate():
    assert parse_rate("10Gbit") == 1.25e9
    assert parse_rate("800Mbit/s") == 1e8
    assert parse_rate("1G") == 1 << 30
    with pytest.raises(ConfigError):
        parse_rate("fast")


def test_source_parse(tmp_path):
    s = Source.parse("s3://bucket/some/prefix")
    assert (s.scheme, s.bucket, s.prefix) == ("s3", "bucket", "some/prefix/")
    assert Source.parse("s3://bucket").prefix == ""
    assert Source.parse("s3://bucket/p/").url == "s3://bucket/p/"
    f = Source.parse(f"file://{tmp_path}")
    assert (f.scheme, f.prefix) == ("file", str(tmp_path))
    for bad in ("s3://", "http://x/y", "/plain/path", "file://host/x"):
        with pytest.raises(ConfigError):
            Source.parse(bad)


def test_config_validation(tmp_path):
    src = Source.parse("s3://b/p")
    Config(src, tmp_path)
    with pytest.raises(ConfigError, match="block-size"):
        Config(src, tmp_path, block_size=1000)
    with pytest.raises(ConfigError, match="cache-size"):
        Config(src, tmp_path, cache_size=1 << 20, block_size=4 << 20)
    with pytest.raises(ConfigError, match="endpoint-url"):
        Config(src, tmp_path, endpoint_url="127.0.0.1:9000")
    with pytest.raises(ConfigError, match="free-space-ratio"):
        Config(src, tmp_path, free_space_ratio=1.5)
