"""The block cache service: single-flight fetches from a backend or the cluster tier, readahead, reads of
cached blocks, pushes into the page cache, passthrough. Invariants are written down in ``docs/block-cache.md``."""
