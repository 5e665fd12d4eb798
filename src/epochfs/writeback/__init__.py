"""Checkpoint write-back: files written through a ``--writeback`` mount, kept on the cache disk and
uploaded in the background (:mod:`.service`), owed across crashes (:mod:`.journal`), shown over the
snapshot (:mod:`.tree`)."""
