"""Backends: where the bytes come from. See :mod:`epochfs.backend.base` for the contract."""

from epochfs.backend.base import Backend, BackendSettings, BackendStats
from epochfs.backend.kinds import Capabilities, Kind, kind_of, open_backend, register

__all__ = ["Backend", "BackendSettings", "BackendStats", "Capabilities", "Kind", "kind_of", "open_backend", "register"]
