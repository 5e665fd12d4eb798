"""The cluster cache tier: daemons of one dataset share their caches, so each block crosses the backend
link once per cluster. ``ring`` (pure: who owns a block), ``wire`` (pure: the peer protocol's requests,
signatures and checks), ``members`` (membership through the shared Redis store), ``server`` (the peer
port), ``client`` (asking an owner), ``tier`` (the block source the cache fetches through)."""
