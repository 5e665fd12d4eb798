"""The daemon's composition root: its configuration (config), the services it builds and runs in one trio
nursery (mount), what it exports to Prometheus (metrics), what it sets of the host and the mount point.
It may import every room below it; nothing but the command line and node imports it."""
