"""Every kind of backend: the form of its source URL, what it can do (:class:`Capabilities`), and the
class that serves it, imported only when a backend is opened (the tools that only check a source load
no client library). A kind is made known with :func:`register`: the built-in ones below, and those of
the modules named in ``EPOCHFS_BACKENDS`` (comma-separated; each calls ``register`` when imported,
taking what it needs from ``epochfs.backend.base`` and this module), so adding a backend is adding one
module. Nothing outside ``backend/`` tests a scheme: it asks the kind.
Light: loaded by every command (:mod:`epochfs` imports it, so every source form is known before a
URL is read)."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from epochfs.core.errors import ConfigError
from epochfs.core.records import FORM_PROBLEMS, Source, SourceForm, register_form

if TYPE_CHECKING:
    from epochfs.backend.base import Backend, BackendSettings


@dataclass(frozen=True)
class Capabilities:
    """What a kind of backend can do."""

    write: bool  # objects can be put, copied and deleted (--writeback, epochfs pack's destination)
    stat: bool  # an object is looked up by name (a pack's pointer, index and shard lists)
    conditional_reads: bool  # a read names the version it wants and fails if the object changed
    attribute_records: bool  # owners and modes kept beside the objects, read back by every listing
    shared: bool  # other nodes reach the same objects (a cluster tier can share its blocks)
    local_path: bool = False  # the source's prefix is a path of this node's file system (what a policy confines)


@dataclass(frozen=True)
class Kind:
    form: SourceForm
    capabilities: Capabilities
    backend: str  # "module:Class" of the Backend that serves it

    @property
    def scheme(self) -> str:
        return self.form.scheme

    def open(self, settings: BackendSettings) -> Backend:
        module, _, name = self.backend.partition(":")
        cls = getattr(importlib.import_module(module), name)
        return cls(settings)  # type: ignore[no-any-return]


_KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> None:
    """Make ``kind`` a source mounts and tools take."""
    _KINDS[kind.scheme] = kind
    register_form(kind.form)


def kind_of(source: Source) -> Kind:
    kind = _KINDS.get(source.scheme)
    if kind is None:  # (a Source is parsed through a registered form)
        raise ConfigError(f"{source.url}: no backend serves {source.scheme}:// sources")
    return kind


def open_backend(settings: BackendSettings) -> Backend:
    """The backend for ``settings.source`` (the only place that chooses one)."""
    return kind_of(settings.source).open(settings)


# -- the built-in kinds --------------------------------------------------------------------------------

def _s3(url: str) -> Source:
    parsed = urlparse(url)
    if not parsed.netloc:
        raise ConfigError(f"{url!r}: an S3 source needs a bucket: s3://BUCKET[/PREFIX]")
    prefix = parsed.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return Source("s3", parsed.netloc, prefix)


def _file(url: str) -> Source:
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ConfigError(f"{url!r}: use file:///absolute/path")
    # Existence is checked when the directory is listed: a mount with a stored snapshot keeps serving
    # cached data while the shared file system is away.
    return Source("file", "", os.path.abspath(unquote(parsed.path)))


register(Kind(SourceForm("s3", "s3://BUCKET[/PREFIX]", _s3),
              Capabilities(write=True, stat=True, conditional_reads=True, attribute_records=True, shared=True),
              "epochfs.backend.s3:S3Backend"))
register(Kind(SourceForm("file", "file:///PATH", _file),
              Capabilities(write=False, stat=True, conditional_reads=True, attribute_records=False, shared=True,
                           local_path=True),
              "epochfs.backend.local:LocalBackend"))

for _name in filter(None, (n.strip() for n in os.environ.get("EPOCHFS_BACKENDS", "").split(","))):
    try:
        importlib.import_module(_name)
    except Exception as exc:  # (said when a source of its form is asked for: the tools still start)
        FORM_PROBLEMS.append(f"EPOCHFS_BACKENDS names {_name!r}, which cannot be loaded: {exc}")
