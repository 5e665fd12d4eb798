from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from epochfs.dev.sample import SampleFile, sample_layout, upload
from epochfs.dev.servers import LocalS3

from .helpers import Mount, page_cache_to_myself

_bucket_ids = itertools.count()
#: The buckets made by ``fresh_bucket`` in the running test, deleted when it ends (:func:`_no_stale_buckets`).
_made_buckets: list[tuple[object, str]] = []


def _fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


requires_fuse = pytest.mark.skipif(not _fuse_available(), reason="needs /dev/fuse and fusermount3")


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """One SeaweedFS S3 endpoint on 127.0.0.1 for the whole session."""
    server = LocalS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture
def private_s3(tmp_path: Path):
    """An S3 endpoint of this test's own, which the test may stop (the endpoint going away)."""
    server = LocalS3(tmp_path / "own-s3").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_client(s3: LocalS3):
    return s3.client()


@pytest.fixture(scope="session")
def sample_files() -> list[SampleFile]:
    return sample_layout(small=160, large=2, large_mib=9, seed=7)


@pytest.fixture(scope="session")
def sample_bucket(s3: LocalS3, s3_client, sample_files: list[SampleFile]) -> str:
    """A bucket holding the sample dataset under ``data/`` (read-only: tests must not change it)."""
    upload(s3_client, "sample", "data/", sample_files)
    return "sample"


@pytest.fixture
def fresh_bucket(s3_client) -> str:
    """An empty bucket of this test's own, so endpoint request counts are this test's."""
    name = f"t{next(_bucket_ids):04d}-{os.getpid()}"
    try:
        s3_client.create_bucket(Bucket=name)
    except s3_client.exceptions.BucketAlreadyOwnedByYou:
        pass  # (a create the client retried after a slow answer: the first one made it, the name is ours)
    _made_buckets.append((s3_client, name))
    return name


@pytest.fixture(autouse=True)
def _no_stale_buckets() -> Iterator[None]:
    """A test's fresh bucket is deleted when the test ends, after its mounts stopped (an autouse fixture is
    set up before the test's own, so it ends after them): SeaweedFS frees a deleted bucket's volumes,
    and the suite's buckets would otherwise hold GiBs to the end of the run. Best effort: a test that
    stopped the endpoint or broke the bucket leaves it to the run's directory."""
    yield
    while _made_buckets:
        client, name = _made_buckets.pop()
        try:
            client.delete_bucket(Bucket=name)  # (SeaweedFS deletes a bucket with its objects)
        except Exception as exc:  # noqa: BLE001 (cleanup: what is left stays in the run's directory)
            logging.getLogger(__name__).info("bucket %s left: %s", name, exc)


@pytest.fixture
def mount_factory(tmp_path: Path, s3: LocalS3):
    mounts: list[Mount] = []

    def make(source: str, *args: str, cache_dir: Path | None = None, name: str = "mnt", env=None) -> Mount:
        extra = list(args)
        if source.startswith("s3://") and "--endpoint-url" not in extra:
            extra += ["--endpoint-url", s3.endpoint]
        if "--metrics-addr" not in extra:
            extra += ["--metrics-addr", "127.0.0.1:0"]  # tests mount many daemons at once
        m = Mount(source, tmp_path / name, cache_dir or tmp_path / "cache", env or s3.env(), *extra)
        mounts.append(m)
        return m

    yield make
    for m in mounts:
        m.stop()


@pytest.fixture(autouse=True)
def _no_stale_mounts(tmp_path: Path):
    yield
    # A test that failed half-way must not leave a mount behind under its tmp_path.
    with open("/proc/self/mounts") as f:
        for line in f:
            target = line.split()[1]
            if target.startswith(str(tmp_path)):
                subprocess.run(["fusermount3", "-uz", target], capture_output=True)


#: Fixtures that start a server or mount: a test that uses one (or is marked ``mounts``) is left out of
#: the quick tier, unless it is marked ``quick`` (the tier's real mount).
HEAVY_FIXTURES = {"s3", "private_s3", "mount_factory", "redis_server", "redis_url", "cluster", "tier"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true",
                     help="the quick tier: every module's unit tests and one real mount (scripts/test.sh --quick)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--quick"):
        return
    keep, drop = [], []
    for item in items:
        heavy = bool(HEAVY_FIXTURES & set(getattr(item, "fixturenames", ()))) or item.get_closest_marker("mounts")
        (drop if heavy and not item.get_closest_marker("quick") else keep).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)


@pytest.fixture(autouse=True)
def _page_cache(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``page_cache`` runs alone among the tests that drop or count on the page cache."""
    if request.node.get_closest_marker("page_cache") is None:
        yield
        return
    with page_cache_to_myself():
        yield


def pytest_configure(config: pytest.Config) -> None:
    logging.getLogger("botocore").setLevel(logging.WARNING)
