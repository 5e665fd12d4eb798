"""Which figure a link's utilisation is measured against.

A declared capacity (``--backend-bandwidth``, ``--link-capacity``) wins. Otherwise what the interface
states, unless the transfers measured clearly less (under :data:`NARROWER` of it): the interface knows
its own speed and shaping, not a narrower link further on (an object store's uplink the whole cluster
shares, a WAN), which the transfers measure; and a measurement of a shared link falls when the others
read too. A measurement a little under the interface's figure is the interface's own link, full, less
what the protocols carry besides the bodies: the interface's figure stands. Where neither is known
there is no capacity, and the utilisation alarms cannot fire for that link (an alert of its own says so);
the view says why (an interface that states no speed: a virtual one) and the option that declares it.

A measured capacity is never below a rate observed on the link: it is at least the busiest single
window seen (:meth:`~epochfs.links.meter.TransferMeter.measured`), so the utilisation read against it
stays at most 1. (A measurement above the interface's figure is bodies timed from buffers already
filled: the interface's figure stands.)
"""

from __future__ import annotations

from dataclasses import dataclass

from epochfs.links.interface import InterfaceCapacity, rate_text
from epochfs.links.meter import WINDOW, Measurement

SOURCES = ("declared", "interface", "measured")
NARROWER = 0.8  # a measurement under this share of the interface's figure is of a narrower link beyond it


@dataclass(frozen=True)
class LinkCapacity:
    bytes_per_second: float
    source: str  # one of SOURCES
    detail: str  # how it is known, in words


@dataclass(frozen=True)
class LinkView:
    """One link: the capacity its utilisation is measured against, and each figure known of it."""

    capacity: LinkCapacity | None
    declared: float | None
    interface: InterfaceCapacity | None
    measured: Measurement | None
    busy_seconds: float = 0.0  # seconds bytes were moving on it, so far
    unknown: str | None = None  # where no capacity is known: why, and how to declare it

    def as_dict(self) -> dict[str, object]:
        c, i, m = self.capacity, self.interface, self.measured
        return {"bytes_per_second": c.bytes_per_second if c else None, "source": c.source if c else None,
                "detail": c.detail if c else None, "declared": self.declared,
                "interface": {"name": i.name, "bytes_per_second": i.bytes_per_second, "detail": i.detail} if i else None,
                "measured": {"bytes_per_second": m.bytes_per_second, "busy": m.busy} if m else None,
                "busy_seconds": self.busy_seconds, "unknown": self.unknown}


def choose(declared: float | None, interface: InterfaceCapacity | None, measured: Measurement | None,
           flag: str, busy_seconds: float = 0.0) -> LinkView:
    """The view of a link from its figures (``flag``: the option that declares it, named in the detail)."""
    capacity: LinkCapacity | None = None
    stated = interface if interface is not None and interface.bytes_per_second > 0 else None
    if declared:
        capacity = LinkCapacity(declared, "declared", f"{flag} {rate_text(declared)}")
    elif measured is not None and (stated is None or measured.bytes_per_second < NARROWER * stated.bytes_per_second):
        busy = f"bytes moving {measured.busy:.0%} of its busiest {WINDOW:g} s windows"
        beyond = f", under the interface's {rate_text(stated.bytes_per_second)}" if stated is not None else ""
        capacity = LinkCapacity(measured.bytes_per_second, "measured",
                                f"measured {rate_text(measured.bytes_per_second)} ({busy}){beyond}")
    elif stated is not None:
        capacity = LinkCapacity(stated.bytes_per_second, "interface", stated.detail)
    unknown = None
    if capacity is None:
        why = interface.detail if interface is not None else "the interface it crosses is not known"
        unknown = (f"{why}; declare it with {flag} RATE (e.g. {flag} 25Gbit), or it is measured once "
                   "transfers keep the link busy")
    return LinkView(capacity, declared, interface, measured, busy_seconds, unknown)
