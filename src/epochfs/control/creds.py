"""Who is at the other end of a Unix socket (``SO_PEERCRED``): the daemon checks its clients, the tools
check that the daemon is who it should be. Imports no event loop, so the tools start fast."""

from __future__ import annotations

import socket
import struct
from typing import Any


def peer_uid(sock: socket.socket | Any) -> int:
    """The uid of the process at the other end of the connected Unix socket ``sock``."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
