"""The training engineer's side, against real mounts: the Python API (epochfs.Client) and the PyTorch
sampler wrapper (epochfs.torch), whose hand-over must be exactly what the DataLoader reads."""

from __future__ import annotations

import logging
import os
import warnings

import pytest

from epochfs.client import Client
from epochfs.core.errors import EpochfsError
from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import drop_all_caches, wait_idle

pytestmark = requires_fuse
KiB = 1 << 10

# Class folders as ImageFolder sees them: "sea" and "sea-lion" sort differently as directory names
# ("sea" < "sea-lion") and as path prefixes ("sea-lion/..." < "sea/..."): a sorted `find` is not
# ImageFolder's order, the dataset's own list of samples is.
CLASSES = ["cat", "sea", "sea-lion", "zebra"]


def image_folder(n_per_class: int = 6) -> list[SampleFile]:
    return [SampleFile(f"train/{c}/{i:03d}.jpg", 20 * KiB + 7 * i) for c in CLASSES for i in range(n_per_class)]


def samples_like_image_folder(root: str) -> list[tuple[str, int]]:
    """torchvision.datasets.ImageFolder's samples: classes sorted by name, files sorted within each."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    out = []
    for target, c in enumerate(classes):
        for dirpath, _, names in sorted(os.walk(os.path.join(root, c), followlinks=True)):
            for name in sorted(names):
                out.append((os.path.join(dirpath, name), target))
    return out


@pytest.fixture
def dataset_mount(s3_client, fresh_bucket, mount_factory):
    files = image_folder()
    upload(s3_client, fresh_bucket, "", files)
    m = mount_factory(f"s3://{fresh_bucket}", "--block-size", "256K")
    m.start()
    yield m, files
    m.stop()


def test_client_prefetch_takes_absolute_and_relative_paths_and_the_sampler_order(dataset_mount):
    m, files = dataset_mount
    client = Client(m.mountpoint)
    samples = samples_like_image_folder(str(m.path("train")))
    reply = client.prefetch(samples, seed=7, epoch=2, rank=1, world_size=3)  # (path, target) pairs, absolute
    assert reply["files"] == -(-len(samples) // 3) and reply["merged"] is False
    relative = [os.path.relpath(p, m.mountpoint) for p, _ in samples]
    reply = client.prefetch(relative, seed=7, epoch=2, rank=0, world_size=3)
    assert reply["merged"] is True  # two ranks of one epoch on one node: one plan, side by side
    assert client.status()["prefetch"]["files"] == 2 * reply["files"]
    with pytest.raises(EpochfsError, match="not under the mount point"):
        client.hand_over(["/etc/passwd"])
    with pytest.raises(EpochfsError, match="not in the snapshot"):
        client.hand_over(["train/cat/missing.jpg"])


def test_client_warmup_fills_and_can_be_cancelled(dataset_mount):
    m, files = dataset_mount
    client = Client(m.mountpoint)
    seen = []
    job = client.warmup([m.path("train/cat"), "train/zebra"], progress=seen.append)
    assert job["finished"] and not job["errors"] and job["files"] == 12
    assert job["done_bytes"] == sum(f.size for f in files if "/cat/" in f.key or "/zebra/" in f.key)
    job = client.warmup(["train"], wait=False)
    cancelled = client.cancel(job["id"])
    assert cancelled["cancelled"] or cancelled["finished"]
    with pytest.raises(EpochfsError, match="no warmup job"):
        client.cancel(10_000)


def needs_torch() -> None:
    pytest.importorskip("torch", reason="the sampler wrapper needs PyTorch (CI installs it)")


class Recording(Client):
    """A real client that also remembers what it handed over."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handed: list[list[str]] = []

    def hand_over(self, order, **kwargs):  # type: ignore[no-untyped-def]
        order = list(order)
        self.handed.append([p if isinstance(p, str) else p[0] for p in order])
        return super().hand_over(order, **kwargs)


class Files:
    """Reads sample i's file through the mount and returns its path, recording the order of reads."""

    def __init__(self, samples: list[tuple[str, int]]) -> None:
        self.samples = samples
        self.read: list[str] = []

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> str:
        path, _ = self.samples[i]
        with open(path, "rb") as f:
            f.read()
        self.read.append(path)
        return path


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.page_cache
def test_the_sampler_hands_over_exactly_what_the_dataloader_reads(dataset_mount, drop_last):
    needs_torch()
    from torch.utils.data import DataLoader, DistributedSampler

    from epochfs.torch import EpochfsSampler

    m, files = dataset_mount
    dataset = Files(samples_like_image_folder(str(m.path("train"))))
    world = 3
    for rank in (0, 2):
        client = Recording(m.mountpoint)
        inner = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=42, drop_last=drop_last)
        sampler = EpochfsSampler(inner, dataset.samples, m.mountpoint, client=client)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=0)
        for epoch in (0, 1):
            dataset.read.clear()
            sampler.set_epoch(epoch)
            sampler.wait()
            drop_all_caches()
            for _ in loader:
                pass
            assert client.handed[-1] == dataset.read, f"rank {rank} epoch {epoch}: the daemon prefetched another order"
            expected = len(dataset) // world if drop_last else -(-len(dataset) // world)
            assert len(dataset.read) == expected
        assert client.handed[0] != client.handed[1], "each epoch hands over its own shuffle"
    status = wait_idle(m)
    assert status["prefetch"]["fetched_blocks"] > 0


def test_a_sampler_without_an_epoch_and_an_unreachable_daemon(dataset_mount, tmp_path, caplog):
    needs_torch()
    from torch.utils.data import DataLoader, RandomSampler

    from epochfs.torch import EpochfsSampler

    m, files = dataset_mount
    dataset = Files(samples_like_image_folder(str(m.path("train"))))
    client = Recording(m.mountpoint)
    sampler = EpochfsSampler(RandomSampler(dataset), [p for p, _ in dataset.samples], m.mountpoint, client=client,
                             background=False)
    for _ in range(2):  # a RandomSampler draws a new order every time: the wrapper draws it once
        dataset.read.clear()
        list(DataLoader(dataset, batch_size=5, sampler=sampler))
        assert client.handed[-1] == dataset.read
    gone = EpochfsSampler(RandomSampler(dataset), dataset.samples, tmp_path, background=False)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="epochfs.torch"):
        warnings.simplefilter("ignore")  # what is said goes through logging: -W ignore hides nothing
        for _ in range(2):
            dataset.read.clear()
            list(DataLoader(dataset, batch_size=5, sampler=gone))
            assert len(dataset.read) == len(dataset)  # training goes on
    assert len([r for r in caplog.records if "could not hand" in r.getMessage()]) == 1  # said once


def test_a_path_the_mount_lacks_leaves_the_rest_of_the_order_handed_over(dataset_mount, caplog):
    needs_torch()
    from torch.utils.data import DataLoader, SequentialSampler

    from epochfs.torch import EpochfsSampler

    m, files = dataset_mount
    samples = samples_like_image_folder(str(m.path("train")))
    paths = [p for p, _ in samples]
    paths[3] = str(m.path("train/cat/gone.jpg"))  # deleted since the sample list was made
    dataset = Files(samples)
    sampler = EpochfsSampler(SequentialSampler(dataset), paths, m.mountpoint, background=True)
    with caplog.at_level(logging.WARNING, logger="epochfs.torch"):
        sampler.set_epoch(0)
        sampler.wait()
    said = [r.getMessage() for r in caplog.records]
    assert any("1 paths the mount does not have" in t and "gone.jpg" in t for t in said), said
    assert m.status()["prefetch"]["files"] == len(paths) - 1  # the rest of the epoch is still prefetched
    list(DataLoader(dataset, batch_size=4, sampler=sampler))
    with pytest.raises(EpochfsError, match="not in the snapshot"):  # asked for, a missing path still fails
        Client(m.mountpoint).hand_over(paths)


TRAIN_LOOP = r"""
import json, os, sys, time
from epochfs.client import Client
from epochfs.prefetch.manifest import epoch_order
mnt, ckpt, batch = sys.argv[1], sys.argv[2], 4
paths = sorted(os.path.relpath(os.path.join(d, f), mnt) for d, _, fs in os.walk(mnt) for f in fs)
state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"epoch": 0, "step": 0}
client = Client(mnt)
reply = client.prefetch(paths, seed=42, epoch=state["epoch"], start=state["step"] * batch, replace=True)
print(json.dumps({"handed": reply["files"]}), flush=True)
order = epoch_order(paths, seed=42, epoch=state["epoch"])
for step in range(state["step"], -(-len(order) // batch)):
    for p in order[step * batch:(step + 1) * batch]:
        with open(os.path.join(mnt, p), "rb", buffering=0) as f:
            f.read()
    with open(ckpt + ".tmp", "w") as f:  # the checkpoint after each step: where a resumed job goes on
        json.dump({"epoch": state["epoch"], "step": step + 1}, f)
    os.replace(ckpt + ".tmp", ckpt)
    time.sleep(0.05)
print(json.dumps({"done": True}), flush=True)
"""


@pytest.mark.page_cache
def test_a_job_resumed_mid_epoch_prefetches_the_rest_and_reads_it_as_an_uninterrupted_one(s3_client, fresh_bucket,
                                                                                          mount_factory, tmp_path):
    """A training loop killed (SIGKILL) mid-epoch and resumed from its checkpoint hands over the rest of
    its epoch only (Client.prefetch(start=step * batch)): the plan is the rest, and the rest is read from
    the cache at the hit ratio of an uninterrupted epoch."""
    import json
    import signal
    import subprocess
    import sys
    import time

    files = [SampleFile(f"train/{i:03d}.bin", 48 * KiB + i) for i in range(96)]
    upload(s3_client, fresh_bucket, "", files)

    def hit_ratio(before: dict, after: dict) -> float:
        c0, c1 = before["cache"], after["cache"]
        hit, miss = c1["hit_bytes"] - c0["hit_bytes"], c1["miss_bytes"] - c0["miss_bytes"]
        return hit / (hit + miss)

    ratios = {}
    for run in ("uninterrupted", "resumed"):
        m = mount_factory(f"s3://{fresh_bucket}", "--block-size", "64K", name=run, cache_dir=tmp_path / f"c-{run}")
        m.start()
        ckpt = tmp_path / f"{run}.json"
        client = Client(m.mountpoint)
        proc = subprocess.Popen([sys.executable, "-c", TRAIN_LOOP, str(m.mountpoint), str(ckpt)],
                                stdout=subprocess.PIPE, text=True)
        first = json.loads(proc.stdout.readline())
        assert first["handed"] == len(files)
        if run == "resumed":
            deadline = time.monotonic() + 60
            while not ckpt.exists() or json.loads(ckpt.read_text())["step"] < 10:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)  # killed mid-epoch
            proc.wait()
            done = json.loads(ckpt.read_text())["step"]
            drop_all_caches()
            before = client.status()
            proc = subprocess.Popen([sys.executable, "-c", TRAIN_LOOP, str(m.mountpoint), str(ckpt)],
                                    stdout=subprocess.PIPE, text=True)
            handed = json.loads(proc.stdout.readline())["handed"]
            assert handed == len(files) - 4 * done  # the rest of the epoch, not what it had read
            assert client.status()["prefetch"]["files"] == handed
        else:
            before = client.status()
        assert json.loads(proc.stdout.readline()) == {"done": True}
        proc.wait(timeout=60)
        ratios[run] = hit_ratio(before, wait_idle(m))
        m.stop()
    assert ratios["resumed"] >= ratios["uninterrupted"] - 0.05, ratios


@pytest.mark.page_cache
def test_the_sampler_resumes_an_epoch_where_the_checkpoint_left_it(dataset_mount):
    """`set_epoch(epoch, start=step * batch)`: the DataLoader reads the rest of the epoch's order, exactly
    what an uninterrupted epoch reads from that sample on, and that rest is what is handed over."""
    needs_torch()
    from torch.utils.data import DataLoader, DistributedSampler

    from epochfs.torch import EpochfsSampler

    m, files = dataset_mount
    dataset = Files(samples_like_image_folder(str(m.path("train"))))
    inner = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=42)
    client = Recording(m.mountpoint)
    sampler = EpochfsSampler(inner, dataset.samples, m.mountpoint, client=client)
    sampler.set_epoch(3)
    sampler.wait()
    full = list(DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=0))
    whole = list(dataset.read)
    dataset.read.clear()
    sampler.set_epoch(3, start=2 * 4)  # resumed after two steps of four
    sampler.wait()
    assert len(sampler) == len(whole) - 8
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=0)
    rest, lengths = [], []
    for batch in loader:  # while the resumed epoch is read, its length is what is left of it (progress bars)
        rest.append(batch)
        lengths.append((len(sampler), len(loader)))
    assert set(lengths) == {(len(whole) - 8, len(full) - 2)}, lengths
    assert dataset.read == whole[8:] and client.handed[-1] == whole[8:] and len(rest) == len(full) - 2
    with pytest.raises(ValueError):
        sampler.set_epoch(3, start=-1)


def test_the_readme_names_the_pytorch_version_the_integration_is_tested_with():
    """The PyTorch the README says the integration is tested with is the one the ``torch`` extra pins
    and these tests run with (scripts/bootstrap.sh installs the same extra)."""
    import importlib.metadata
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    pins = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["torch"]
    torch_pin = next(p for p in pins if p.startswith("torch=="))
    (named,) = set(re.findall(r"tested with `(torch==[\w.]+)`", readme))
    assert named == torch_pin, (named, torch_pin)
    assert 'extras=test,torch' in (root / "scripts" / "bootstrap.sh").read_text()
    try:
        installed = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("PyTorch is not installed here (EPOCHFS_TORCH=1 bash scripts/bootstrap.sh)")
    assert installed.split("+")[0] == torch_pin.split("==")[1], (installed, torch_pin)


def test_every_shown_call_of_the_sampler_wrapper_passes_what_it_requires():
    """Each ``EpochfsSampler(...)`` the README, the docs and the deploy kits show (comments included)
    passes the wrapper's required arguments: the sampler, the dataset's paths and the mount (a comment
    showing two was a TypeError when pasted)."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "src" / "epochfs" / "torch.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EpochfsSampler")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    required = len(init.args.args) - 1 - len(init.args.defaults)
    shown = 0
    for path in [root / "README.md", *(root / "docs").glob("*.md"), *(p for p in (root / "deploy").rglob("*")
                                                                       if p.is_file())]:
        text = re.sub(r"\n#\s*", " ", path.read_text(errors="replace"))  # (a call a comment wraps)
        for m in re.finditer(r"EpochfsSampler\(", text):
            depth, i = 1, m.end()
            while depth and i < len(text):
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            call = "f" + text[m.end() - 1:i]
            try:
                node = ast.parse(call.strip(), mode="eval").body
            except SyntaxError:
                continue  # (prose naming the class, not a call)
            assert isinstance(node, ast.Call)
            shown += 1
            assert len(node.args) + sum(1 for k in node.keywords if k.arg in ("paths", "mountpoint")) >= required, (
                path, call)
    assert shown >= 3
