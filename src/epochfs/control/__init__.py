"""The local control channel between the command-line tools (or the Python API) and a daemon:
:mod:`.protocol` (typed, validated requests), :mod:`.server` (the daemon's end), :mod:`.client`.
(The face hands on the tools' end only: the command line never loads the daemon's event loop.)"""

from epochfs.control.client import CONTROL_XATTR, PID_XATTR, request

__all__ = ["CONTROL_XATTR", "PID_XATTR", "request"]
