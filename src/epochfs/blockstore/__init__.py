"""The block store on disk: the cache directory, its byte budget, the index, block files and packs and
their checksums (verified on every read), whole-file copies, recovery. Imports only core, transport, eviction."""
