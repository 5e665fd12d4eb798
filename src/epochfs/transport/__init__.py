"""Bytes over the network: HTTP answers received through libcurl (curlio) or the standard library's
client (httpio) into aligned, pooled buffers (buffers); the connection slots servers hand out (slots).
It imports nothing of epochfs outside itself: it knows no backend, cache or peer."""
