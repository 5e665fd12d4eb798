"""The control channel between the command-line tools (or the Python API) and a daemon, over its socket or
through the mount itself (:mod:`.frames`, :mod:`.inmount`), each request authorised by its caller
(:mod:`.caller`, :mod:`.access`): :mod:`.protocol` (typed, validated requests), :mod:`.server` (the
daemon's end), :mod:`.client`,
:mod:`.handlers` (requests -> component calls), and what it renders: :mod:`.collected` (every
component's statistics at one moment) and :mod:`.jobs` (what training jobs report). It may import the
components and the doctor, never the daemon's composition root or the command line. (The face hands on
the tools' end only: the command line never loads the daemon's event loop.)"""

from epochfs.control.client import CONTROL_XATTR, PID_XATTR, request

__all__ = ["CONTROL_XATTR", "PID_XATTR", "request"]
