"""Namespace snapshots: the pure tree (:mod:`.namespace`) and where snapshots are kept (:mod:`.lmdb`)."""
