"""Epoch manifests: parsing, rank partitions and seeded shuffles (:mod:`.manifest`, pure), the plan of
blocks they imply (:mod:`.plan`, pure), and the scheduler that fetches ahead of the reader
(:mod:`.scheduler`)."""
