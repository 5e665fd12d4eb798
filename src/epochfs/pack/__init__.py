"""Packed datasets: ``epochfs pack`` writes a dataset as tar shards with an index (:mod:`.writer`, the
parts and codecs in :mod:`.layout`), and a mount of a packed root lists the original tree from it
(:mod:`.listing`). See ``docs/packed-datasets.md``."""
