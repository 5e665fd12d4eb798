"""PyTorch's own checkpointing on a --writeback mount, for real (CPU, two ranks over gloo):
``torch.distributed.checkpoint`` ``save``, ``async_save`` and ``load``; the checkpoint durable after
``Client.sync``, read back on the node that saved it without the backend and on a fresh node from the
backend; and a daemon killed between a save and its upload loses nothing ``save`` reported written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epochfs import Client
from epochfs.dev.servers import free_ports

from .conftest import requires_fuse
from .helpers import drop_file_pages

pytest.importorskip("torch")
pytestmark = requires_fuse

RANK = Path(__file__).with_name("dcp_rank.py")
WORLD = 2


def ranks(mode: str, path: Path, step: int, timeout: float = 300) -> None:
    """Run the job's ranks; fail the test unless every rank exits 0."""
    port = free_ports(1)[0]
    procs = [subprocess.Popen([sys.executable, str(RANK), mode, str(path), str(step)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} of {mode} exited {p.returncode}: {err[-3000:]}"
        assert ("loaded" if mode == "load" else "saved") in out


def backend_read(m) -> int:  # type: ignore[no-untyped-def]
    cache = m.status()["cache"]
    return cache["demand_bytes"] + cache["prefetch_bytes"]


def wait_kept(m, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    """Until the uploaded bytes are cached blocks (the write-back data files are gone)."""
    data = m.cache_dir / "writeback" / "data"
    deadline = time.monotonic() + timeout
    while any(data.iterdir()):
        assert time.monotonic() < deadline, "uploaded data files stay behind"
        time.sleep(0.1)


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_dcp_saves_and_loads_through_a_writeback_mount(s3_client, fresh_bucket, mount_factory, tmp_path, mode):
    m = mount_factory(f"s3://{fresh_bucket}/run", "--writeback", "--block-size", "1M")
    m.start()
    ckpt = m.path("step-3")
    ranks(mode, ckpt, 3)
    ranks("load", ckpt, 3)  # at local speed, before the upload
    Client(m.mountpoint).sync()  # the checkpoint is durable from here
    keys = {o["Key"]: o["Size"] for o in s3_client.list_objects_v2(Bucket=fresh_bucket, Prefix="run/step-3/")["Contents"]}
    files = {p.name: p.stat().st_size for p in ckpt.iterdir()}
    assert ".metadata" in files and sum(1 for n in files if n.endswith(".distcp")) >= WORLD
    assert keys == {f"run/step-3/{n}": size for n, size in files.items()}
    wait_kept(m)
    for p in ckpt.iterdir():
        drop_file_pages(p)
    before = backend_read(m)
    ranks("load", ckpt, 3)  # the node that saved it: from its cache
    assert backend_read(m) - before <= 0.02 * sum(files.values())
    fresh = mount_factory(f"s3://{fresh_bucket}/run", name="fresh", cache_dir=tmp_path / "fresh-cache")
    fresh.start()
    ranks("load", fresh.path("step-3"), 3)  # another node: from the backend


def checkpoint_keys(s3_client, bucket: str, prefix: str) -> set[str]:  # type: ignore[no-untyped-def]
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"] for o in listed if "/.epochfs/" not in o["Key"]}


def test_a_daemon_killed_between_save_and_upload_loses_nothing_saved(s3_client, fresh_bucket, mount_factory,
                                                                    tmp_path):
    m = mount_factory(f"s3://{fresh_bucket}/run", "--writeback", "--upload-bandwidth", "64K")
    m.start()
    ranks("save", m.path("step-8"), 8)
    saved = {p.name for p in m.path("step-8").iterdir()}
    pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
    os.kill(pid, signal.SIGKILL)  # save returned: every file is closed and fsynced; hardly any uploaded
    subprocess.run(["fusermount3", "-uz", str(m.mountpoint)], capture_output=True)
    assert len(checkpoint_keys(s3_client, fresh_bucket, "run/step-8/")) < len(saved)
    again = mount_factory(f"s3://{fresh_bucket}/run", "--writeback", name="again", cache_dir=m.cache_dir)
    again.start()  # the same cache directory: the journal's closed files upload
    Client(again.mountpoint).sync(timeout=240)
    assert checkpoint_keys(s3_client, fresh_bucket, "run/step-8/") == {f"run/step-8/{n}" for n in saved}
    fresh = mount_factory(f"s3://{fresh_bucket}/run", name="fresh", cache_dir=tmp_path / "fresh-cache")
    fresh.start()
    ranks("load", fresh.path("step-8"), 8)
