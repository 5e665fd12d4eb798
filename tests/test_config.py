import pytest

from epochfs.core.errors import ConfigError
from epochfs.daemon.config import Config, Source, parse_rate, parse_size


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
    assert Config(src, tmp_path).prefetch_concurrency == 96  # a far backend's plan needs many in flight
    assert Config(src, tmp_path, prefetch_concurrency=1024).prefetch_concurrency == 1024
    for bad in (0, -3, 1025):
        with pytest.raises(ConfigError, match="prefetch-concurrency"):
            Config(src, tmp_path, prefetch_concurrency=bad)


def test_node_name_and_prometheus_targets(tmp_path, monkeypatch):
    import socket
    from pathlib import Path

    from epochfs.daemon.config import DEFAULT_TARGETS_DIR

    src = Source.parse("s3://b/p")
    plain = Config(src, tmp_path / "m", cache_dir=tmp_path / "c")
    assert plain.node_name() == socket.gethostname()  # every mount of the host says the same node
    assert Config(src, tmp_path / "m", cache_dir=tmp_path / "c", node="gpu-07").node_name() == "gpu-07"
    for bad in ("", "a b", "x" * 254, "-lead", 'q"uote', "new\nline"):
        with pytest.raises(ConfigError, match="--node"):
            Config(src, tmp_path / "m", cache_dir=tmp_path / "c", node=bad)
    monkeypatch.setattr("os.geteuid", lambda: 0)
    assert plain.targets_dir() == Path(DEFAULT_TARGETS_DIR)
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert plain.targets_dir() is None  # a user's daemon writes no targets unless asked
    assert Config(src, tmp_path / "m", cache_dir=tmp_path / "c", metrics_targets="off").targets_dir() is None
    assert Config(src, tmp_path / "m", cache_dir=tmp_path / "c",
                  metrics_targets=str(tmp_path / "t")).targets_dir() == tmp_path / "t"
