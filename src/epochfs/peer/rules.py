"""The rules of the cluster tier's mount options (``--peer-*``), checked when the config is built. Pure."""

from __future__ import annotations

from pathlib import Path

from epochfs.core.errors import ConfigError
from epochfs.meta.base import SHARED_FORMS, is_shared
from epochfs.peer.wire import is_wildcard, member_addr, split_addr


def check_options(*, listen_text: str | None, advertise: str | None, token_file: Path | None, meta: str | None,
                  cache: str, timeout: float, role: str = "peer", replicas: int = 1, serving: bool = False,
                  writeback: bool = False, rebalance: bool = False) -> None:
    """The rules a mount's (or a cache node's, ``serving``) peer options must keep; :class:`ConfigError`
    naming the option that breaks one."""
    if not 1 <= replicas <= 16:
        raise ConfigError("--replicas must be from 1 to 16")
    if rebalance and not serving:
        raise ConfigError("--rebalance is for a cache node (epochfs serve): a mount holds no share to fill")
    if serving:
        if role != "server":
            raise ConfigError("a cache node is a server (epochfs serve)")
        if listen_text is None:
            raise ConfigError("epochfs serve needs --peer-listen HOST:PORT: the cache node answers there")
        if writeback:
            raise ConfigError("a cache node writes nothing: --writeback is for mounts")
    elif role == "server":
        raise ConfigError("--peer-role server is a cache node's: run 'epochfs serve' instead of mounting")
    elif role == "client":
        if listen_text is not None or advertise is not None:
            raise ConfigError("--peer-role client never serves: drop --peer-listen and --peer-advertise")
        _needs_store_and_token(meta, token_file, "--peer-role client")
        _check_timeout(cache, timeout)
        return
    elif role != "peer":
        raise ConfigError(f"--peer-role {role!r}: choose peer or client")
    if listen_text is None:
        for flag, value in (("--peer-advertise", advertise), ("--peer-token-file", token_file)):
            if value is not None:
                raise ConfigError(f"{flag} needs --peer-listen (or --peer-role client)")
        return
    listen = split_addr(listen_text, any_port=True)
    if listen is None:
        raise ConfigError(f"--peer-listen {listen_text!r}: expected HOST:PORT (an address of this node)")
    if advertise is not None:
        if member_addr(advertise) is None:
            raise ConfigError(f"--peer-advertise {advertise!r}: expected the IP:PORT other nodes "
                              "reach this one at (a literal address such as 10.0.0.5:9570 or [fd00::5]:9570; "
                              "members never look up names)")
        if listen[1] == 0:
            raise ConfigError("--peer-listen with port 0 picks a port at start-up: --peer-advertise cannot "
                              "know it; give the port")
    elif is_wildcard(listen[0]):
        raise ConfigError(f"--peer-listen {listen_text}: other nodes cannot reach a wildcard address; "
                          "give --peer-advertise IP:PORT")
    elif member_addr(f"{listen[0]}:{listen[1] or 1}") is None:
        raise ConfigError(f"--peer-listen {listen_text}: other members reach this node at a literal IP "
                          "address (members never look up names): give one, or --peer-advertise IP:PORT")
    _needs_store_and_token(meta, token_file, "--peer-listen")
    _check_timeout(cache, timeout)


def _needs_store_and_token(meta: str | None, token_file: Path | None, what: str) -> None:
    if not is_shared(meta):
        raise ConfigError(f"{what} needs a shared store: --meta {SHARED_FORMS} (the members find each "
                          "other there)")
    if token_file is None:
        raise ConfigError(f"{what} needs --peer-token-file: members sign their requests with a "
                          "shared secret")


def _check_timeout(cache: str, timeout: float) -> None:
    if cache not in ("all", "owned"):
        raise ConfigError(f"--peer-cache {cache!r}: choose all or owned")
    if not 0 < timeout <= 300:
        raise ConfigError("--peer-timeout must be in (0, 300] seconds")
