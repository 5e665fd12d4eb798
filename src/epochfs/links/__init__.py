"""What the node's links can carry: the link to the backend and a cache node's link, each declared,
read from its interface (speed and shaping) or measured from the transfers that crossed it.
Imports only the standard library and :mod:`epochfs.core.text`; the daemon's parts record into its meters."""
