"""The local control channel between the command-line tools (or the Python API) and a daemon:
:mod:`.protocol` (typed, validated requests), :mod:`.server` (the daemon's end), :mod:`.client`."""

from epochfs.control.client import CONTROL_XATTR, PID_XATTR, request
from epochfs.control.server import ControlServer, socket_path

__all__ = ["CONTROL_XATTR", "PID_XATTR", "ControlServer", "request", "socket_path"]
