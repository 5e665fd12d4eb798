"""The local block cache: pure key and block arithmetic, eviction policies, the on-disk store and the
async service that ties them to a backend. Invariants are written down in ``docs/block-cache.md``."""
