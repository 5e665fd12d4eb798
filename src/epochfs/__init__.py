"""epochfs: a read-only FUSE cache for training data in object storage."""

__version__ = "0.1.0"
