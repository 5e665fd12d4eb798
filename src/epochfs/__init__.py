"""epochfs: a FUSE cache for training data in object storage (read-only, or written back for checkpoints).

``epochfs.Client(mountpoint)`` is the Python API (:mod:`epochfs.client`); ``epochfs.torch.EpochfsSampler``
hands each epoch's order to the daemon from a PyTorch sampler (:mod:`epochfs.torch`).
"""

from typing import Any

from epochfs.backend import kinds as _kinds  # noqa: F401 - every source form known before a URL is read
from epochfs.version import __version__


def __getattr__(name: str) -> Any:  # imported on first use: the command line does not pay for it
    if name == "Client":
        from epochfs.client import Client

        return Client
    raise AttributeError(f"module 'epochfs' has no attribute {name!r}")


__all__ = ["Client", "__version__"]
