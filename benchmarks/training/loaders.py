"""The shard loaders of ``packed.py``, run in their own virtualenv (``benchmarks/training/loaders-setup.sh``: Mosaic
Streaming pins xxhash<4, epochfs pins 4.1): convert the same files into MDS or WebDataset shards, or run
one epoch of the training loop over them. One JSON object of arguments in, one of results out.

    benchmarks/work/.venv-loaders/bin/python benchmarks/training/loaders.py read-mds '{"endpoint": ..., ...}'
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# Not this directory on the path: its profile.py would stand in for the standard library's (transformers
# imports it), and it imports epochfs, which this virtualenv has not.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def _trainloop() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("trainloop", HERE / "trainloop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


one_epoch = _trainloop().one_epoch


def _without_torchvision() -> None:
    """Mosaic Streaming imports torchvision at import time for its image datasets only (not used here),
    and this machine has no CPU build of torchvision for torch 2.13: stand in the two names it imports."""
    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        pass
    import types

    tv, datasets, transforms, functional = (types.ModuleType(n) for n in (
        "torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional"))
    datasets.VisionDataset = type("VisionDataset", (), {})  # type: ignore[attr-defined]
    datasets.CIFAR10 = type("CIFAR10", (), {})  # type: ignore[attr-defined]
    functional.to_tensor = None  # type: ignore[attr-defined]
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional  # type: ignore[attr-defined]
    import importlib.machinery

    for m in (tv, datasets, transforms, functional):
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
        sys.modules[m.__name__] = m


def _client(endpoint: str) -> Any:
    import boto3
    import botocore.config

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        config=botocore.config.Config(max_pool_connections=32, s3={"addressing_style": "path"}))


def _read_all(a: dict[str, Any]) -> list[tuple[str, bytes]]:
    client = _client(a["endpoint"])
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda k: (k, client.get_object(Bucket=a["bucket"], Key=a["raw"] + k)["Body"].read()),
                             a["keys"]))


def _upload_dir(a: dict[str, Any], local: Path, prefix: str) -> int:
    client = _client(a["endpoint"])
    files = [p for p in local.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), a["bucket"], prefix + str(p.relative_to(local))), files))
    return len(files)


def convert_mds(a: dict[str, Any]) -> dict[str, Any]:
    from streaming import MDSWriter

    started = time.perf_counter()
    local = Path(a["work"]) / "mds-out"
    shutil.rmtree(local, ignore_errors=True)
    with MDSWriter(out=str(local), columns={"key": "str", "data": "bytes"}, size_limit=a["shard_size"]) as w:
        for key, data in _read_all(a):
            w.write({"key": key, "data": data})
    shards = _upload_dir(a, local, a["prefix"])
    return {"seconds": time.perf_counter() - started, "objects": shards}


def convert_wds(a: dict[str, Any]) -> dict[str, Any]:
    import webdataset as wds

    started = time.perf_counter()
    local = Path(a["work"]) / "wds-out"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    with wds.ShardWriter(str(local / "shard-%06d.tar"), maxsize=a["shard_size"], verbose=0) as w:
        for key, data in _read_all(a):
            stem, ext = key.rsplit(".", 1)
            w.write({"__key__": stem, ext: data})
    shards = _upload_dir(a, local, a["prefix"])
    return {"seconds": time.perf_counter() - started, "objects": shards}


def read_mds(a: dict[str, Any]) -> dict[str, Any]:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    os.environ["S3_ENDPOINT_URL"] = a["proxy"]
    clean_stale_shared_memory()
    dataset = StreamingDataset(remote=f"s3://{a['bucket']}/{a['prefix']}", local=a["cache"], shuffle=True,
                               shuffle_seed=a["seed"], batch_size=a["batch"])
    # Streaming 0.13 keeps the S3 client each stream made to read the index (in this process); forked
    # workers would share its connection (a 60 s stall, and in some runs a shard saved under another's
    # name). Drop it before the workers fork: each makes its own.
    for stream in dataset.streams:
        stream._downloader.clean_up()
    loader = DataLoader(dataset, batch_size=a["batch"], num_workers=a["workers"])
    batches = ([k for k in b["key"]] for b in loader)
    return one_epoch(batches, a["compute"])


def read_wds(a: dict[str, Any]) -> dict[str, Any]:
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = [f"pipe:curl -s -f {a['proxy']}/{a['bucket']}/{a['prefix']}{name}" for name in a["shards"]]
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=a["seed"] + a["epoch"], empty_check=False,
                              workersplitter=wds.split_by_worker)
               .shuffle(a["buffer"]).map(lambda s: s["__key__"] + "." + next(k for k in s if not k.startswith("_"))))
    loader = DataLoader(dataset, batch_size=a["batch"], num_workers=a["workers"])
    return one_epoch(loader, a["compute"])


def check(a: dict[str, Any]) -> dict[str, Any]:
    import streaming
    import webdataset

    return {"streaming": streaming.__version__, "webdataset": webdataset.__version__}


def main() -> int:
    _without_torchvision()
    op, args = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    result = {"check": check, "convert-mds": convert_mds, "convert-wds": convert_wds, "read-mds": read_mds,
              "read-wds": read_wds}[op](args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
