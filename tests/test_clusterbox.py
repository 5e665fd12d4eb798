"""A cluster in a box, small: an object store behind a shaped link that two GPU nodes share, each node
a network namespace with its own shaped link, each mounting for real (``benchmarks/netbox.py``, the
machinery of ``benchmarks/clusterbox.py``). The shared link runs full; each node reads every byte
right, knows its own link from its interface (the shaping in its namespace) and measures the narrower
share of the shared one, which its utilisation is then taken against (so the 70% alarm can fire with
no flag); and nothing of the box is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from epochfs.control import request
from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import namespaces_work

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from netbox import NetBox  # noqa: E402

MiB = 1 << 20
WAN = 8 * MiB  # the object store's link, shared
NODE = 16 * MiB  # each node's own


@requires_fuse
@pytest.mark.mounts
@pytest.mark.skipif(not namespaces_work(), reason="network namespaces cannot be made here (needs root and ip)")
def test_nodes_behind_a_shared_link_read_exactly_and_measure_their_share(tmp_path, s3, s3_client, fresh_bucket):
    files = {i: [SampleFile(f"n{i}/{k:02d}.bin", 2 * MiB + 4099 * k) for k in range(32)] for i in range(2)}
    upload(s3_client, fresh_bucket, "", [f for group in files.values() for f in group])
    env = {**s3.env(), "PYTHONUNBUFFERED": "1"}
    env.pop("AWS_CA_BUNDLE", None)
    with NetBox("efct", tmp_path) as box:
        store = box.host("store", rate_in=WAN, rate_out=WAN)
        gpus = [box.host(f"gpu{i}", rate_in=NODE, rate_out=NODE) for i in range(2)]
        assert len(box.namespaces()) == 4  # (the switch, the store, two nodes)
        box.portal(f"{store.address}:9000", f"127.0.0.1:{s3.port}", listen_in=store)
        mounts = []
        for host in gpus:
            mnt = tmp_path / host.name / "mnt"
            mnt.mkdir(parents=True)
            r = subprocess.run(host.command(sys.executable, "-m", "epochfs", "mount", f"s3://{fresh_bucket}", str(mnt),
                                            "--endpoint-url", f"http://{store.address}:9000", "--cache-dir",
                                            str(tmp_path / host.name / "cache"), "--metrics-addr", "off",
                                            "--metrics-targets", "off"), env=env, capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, r.stderr
            mounts.append(mnt)
        wrong: list[str] = []
        sent0, started = store.sent_bytes(), time.monotonic()

        def read(i: int) -> None:
            for f in files[i]:
                with open(mounts[i] / f.key, "rb", buffering=0) as fh:
                    if fh.read() != f.content():
                        wrong.append(f.key)

        threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        seconds = time.monotonic() - started
        assert not wrong
        total = sum(f.size for group in files.values() for f in group)
        sent = store.sent_bytes() - sent0
        assert sent >= total and sent / seconds > 0.8 * WAN, (sent, seconds)  # the shared link ran full
        assert seconds > total / WAN * 0.9  # and bounded them: no faster than it
        deadline = time.monotonic() + 25  # (each node looks at its transfers every 10 s)
        while True:
            links = [request(m, "status")["backend"] for m in mounts]
            if all((b["link"] or {}).get("source") == "measured" for b in links) or time.monotonic() > deadline:
                break
            time.sleep(1)
        for b in links:
            link = b["link"]
            assert link["interface"]["bytes_per_second"] == NODE and "ingress shaped" in link["interface"]["detail"], link
            assert link["source"] == "measured", link  # the shared link, narrower than its own
            assert 0.25 * WAN < link["bytes_per_second"] < 0.8 * NODE, link
            assert b["bandwidth_limit"] == link["bytes_per_second"]
            assert "under the interface's" in link["detail"]
        text = subprocess.run([sys.executable, "-m", "epochfs", "status", str(mounts[0])], capture_output=True,
                              text=True, timeout=30).stdout
        assert "(measured: measured" in text, text
        for m in mounts:
            subprocess.run([sys.executable, "-m", "epochfs", "umount", str(m)], capture_output=True, timeout=60)
    assert not box.namespaces()
    assert not any(str(tmp_path) in line for line in Path("/proc/self/mounts").read_text().splitlines())
    assert all(os.path.isdir(m) for m in mounts)
    json.dumps(links)
