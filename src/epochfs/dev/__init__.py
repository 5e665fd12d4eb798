"""For trying and testing epochfs on one machine: local servers (servers: SeaweedFS as S3, redis-server,
Redis Sentinel) and sample datasets (sample). The daemon never imports it."""
