"""Optical circuit switch logic (pure): matchings, diffs and the OpenFlow flows that realise them.

An OCS is a set of ports ``1..n_ports`` and a *matching*: each circuit joins two distinct ports and every
port is in at most one circuit. The emulated OCS forwards by ``in_port`` alone (two flows per circuit);
it never learns, floods or parses. A reconfiguration removes the flows of circuits that change (their
ports go dark), waits the switching delay, then installs the new circuits; unchanged circuits keep their
flows and keep carrying traffic.

Everything here is datapath-neutral: :class:`FlowSpec` uses os-ken ``OFPMatch`` keyword names and simple
action tuples, and the os-ken app turns them into messages (the unit tests' in-memory table is
tests/unit/fakes_controller.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from emulation.validation import SpecError

# Cookies: the top 16 bits of the low 48 tell who owns a flow, so the os-ken app can delete/read back
# exactly its own flows with (cookie, COOKIE_MASK).
COOKIE_MASK = 0xFFFF00000000
OCS_COOKIE = 0x0C5000000000  # circuit flows on OCS bridges
TOR_COOKIE = 0x070200000000  # route flows (and groups) on ToR bridges
OCS_PRIORITY = 100  # circuit flows; the OCS has no other flows (table miss drops: OpenFlow 1.3 default)

Pair = tuple[int, int]


def _is_port_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Matching:
    """The circuits of one OCS: pairs ``(a, b)`` with ``a < b``, ports ``1..n_ports``, each port used once.

    Construct with :meth:`from_pairs` (validates user data, errors name the index) or directly with
    normalised pairs (also validated, field ``circuits``).
    """

    n_ports: int
    circuits: frozenset[Pair]
    _peer: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not _is_port_int(self.n_ports) or self.n_ports < 0:
            raise SpecError("n_ports", f"must be an integer >= 0, got {self.n_ports!r}")
        if not isinstance(self.circuits, frozenset):
            raise SpecError("circuits", f"must be a frozenset of pairs, got {type(self.circuits).__name__}")
        peer: dict[int, int] = {}
        for a, b in sorted(self.circuits):
            if not (_is_port_int(a) and _is_port_int(b)) or not (1 <= a < b <= self.n_ports):
                raise SpecError("circuits", f"circuit {[a, b]} is not (a, b) with 1 <= a < b <= {self.n_ports}")
            for p in (a, b):
                if p in peer:
                    raise SpecError("circuits", f"port {p} is in two circuits")
            peer[a] = b
            peer[b] = a
        object.__setattr__(self, "_peer", peer)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_pairs(cls, n_ports: int, pairs: Iterable, field: str = "circuits") -> "Matching":
        """Validate ``pairs`` (e.g. a JSON list of 2-lists) into a Matching.

        Raises SpecError naming ``field[i]`` and the problem: not a pair, a non-integer port, a port out of
        range, a self-circuit, or a port already used by an earlier circuit. Order within a pair is free.
        """
        if not _is_port_int(n_ports) or n_ports < 0:
            raise SpecError("n_ports", f"must be an integer >= 0, got {n_ports!r}")
        if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
            raise SpecError(field, f"must be a list of [port, port] pairs, got {type(pairs).__name__}")
        owner: dict[int, Pair] = {}
        out: set[Pair] = set()
        for i, pair in enumerate(pairs):
            f = f"{field}[{i}]"
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise SpecError(f, f"must be a pair [port, port], got {pair!r}")
            a, b = pair
            for p in (a, b):
                if not _is_port_int(p):
                    raise SpecError(f, f"port must be an integer, got {type(p).__name__} {p!r}")
            for p in (a, b):
                if not 1 <= p <= n_ports:
                    raise SpecError(f, f"port {p} does not exist (ports 1..{n_ports})")
            if a == b:
                raise SpecError(f, f"a port cannot be connected to itself (port {a})")
            for p in (a, b):
                if p in owner:
                    raise SpecError(f, f"port {p} is already in circuit {list(owner[p])}")
            c = (a, b) if a < b else (b, a)
            owner[a] = owner[b] = c
            out.add(c)
        return cls(n_ports, frozenset(out))

    @classmethod
    def empty(cls, n_ports: int) -> "Matching":
        return cls(n_ports, frozenset())

    # ---- queries -----------------------------------------------------------------------------
    def peer(self, port: int) -> int | None:
        """The port connected to ``port``, or None when it is dark (also for a port out of range)."""
        return self._peer.get(port)

    def pairs(self) -> list[Pair]:
        return sorted(self.circuits)

    def to_json(self) -> list[list[int]]:
        return [[a, b] for a, b in self.pairs()]

    def ports_in_use(self) -> frozenset[int]:
        return frozenset(self._peer)

    def __len__(self) -> int:
        return len(self.circuits)


@dataclass(frozen=True)
class MatchingDiff:
    removed: frozenset[Pair]
    added: frozenset[Pair]
    unchanged: frozenset[Pair]

    @property
    def changed_ports(self) -> frozenset[int]:
        """Ports that go dark during the reconfiguration (ends of removed and added circuits)."""
        return frozenset(p for c in self.removed | self.added for p in c)

    @property
    def is_empty(self) -> bool:
        return not self.removed and not self.added


def diff(old: Matching, new: Matching) -> MatchingDiff:
    """Circuits to remove, to add and to keep when going from ``old`` to ``new`` (same OCS)."""
    if old.n_ports != new.n_ports:
        raise SpecError("n_ports", f"cannot diff matchings of {old.n_ports} and {new.n_ports} ports")
    return MatchingDiff(removed=old.circuits - new.circuits, added=new.circuits - old.circuits,
                        unchanged=old.circuits & new.circuits)


# ---- flows -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlowSpec:
    """A datapath-neutral OpenFlow 1.3 flow.

    ``match``: os-ken ``OFPMatch`` keyword arguments as sorted-by-meaning tuples, e.g. ``(("in_port", 3),)``
    or ``(("eth_type", 0x0800), ("ipv4_dst", "10.0.0.3"))``. ``actions``: ``(("output", port),)`` or
    ``(("group", group_id),)``. A flow is identified on a switch by (priority, match); ``cookie`` tells
    which app owns it.
    """

    priority: int
    match: tuple[tuple[str, object], ...]
    actions: tuple[tuple[str, object], ...]
    cookie: int

    def match_dict(self) -> dict[str, object]:
        return dict(self.match)

    @property
    def key(self) -> tuple[int, tuple[tuple[str, object], ...]]:
        """What identifies the flow in a table (OpenFlow strict match)."""
        return (self.priority, self.match)


def _circuit_flow(src: int, dst: int) -> FlowSpec:
    return FlowSpec(OCS_PRIORITY, (("in_port", src),), (("output", dst),), OCS_COOKIE)


def circuit_flows(pairs: Iterable[Pair]) -> list[FlowSpec]:
    """Two flows per circuit (a -> b and b -> a), in the order of ``sorted(pairs)``."""
    out: list[FlowSpec] = []
    for a, b in sorted(pairs):
        out.append(_circuit_flow(a, b))
        out.append(_circuit_flow(b, a))
    return out


def circuit_flow_changes(old: Matching, new: Matching) -> tuple[list[FlowSpec], list[FlowSpec]]:
    """(flows to delete, flows to add) to go from ``old`` to ``new``; unchanged circuits are untouched."""
    d = diff(old, new)
    return circuit_flows(d.removed), circuit_flows(d.added)


@dataclass(frozen=True)
class FlowReadback:
    """What :func:`split_flows` made of the flows read back from an OCS."""

    matching: Matching  # the complete, consistent circuits
    stray: tuple[tuple[int, int], ...]  # (in_port, out_port) flows that form no consistent circuit, sorted


def split_flows(n_ports: int, flows: Iterable[tuple[int, int]]) -> FlowReadback:
    """Rebuild the circuits from ``(in_port, out_port)`` flows; report the rest as stray.

    A circuit (a, b) is recognised when port a's only flow outputs to b and port b's only flow outputs to a.
    Everything else is stray: half circuits (one direction only), ports with several outputs (conflicts),
    loops to the same port and ports out of ``1..n_ports``. The os-ken app deletes stray flows when it
    reconciles after a restart.
    """
    outs: dict[int, set[int]] = {}
    all_flows: list[tuple[int, int]] = []
    for f in flows:
        src, dst = int(f[0]), int(f[1])
        all_flows.append((src, dst))
        outs.setdefault(src, set()).add(dst)
    circuits: set[Pair] = set()
    for a, dsts in outs.items():
        if len(dsts) != 1:
            continue
        (b,) = dsts
        if a < b and 1 <= a and b <= n_ports and outs.get(b) == {a}:
            circuits.add((a, b))
    good = {(a, b) for a, b in circuits} | {(b, a) for a, b in circuits}
    stray = tuple(sorted(set(f for f in all_flows if f not in good)))
    return FlowReadback(Matching(n_ports, frozenset(circuits)), stray)


def circuits_from_flows(n_ports: int, flows: Iterable[tuple[int, int]]) -> Matching:
    """Rebuild a matching from the flows read back from a switch.

    Raises SpecError (field ``flows``) listing the inconsistent flows (half circuits, conflicting outputs,
    ports out of range); use :func:`split_flows` to get the consistent part and the strays separately.
    """
    rb = split_flows(n_ports, flows)
    if rb.stray:
        shown = ", ".join(f"{a}->{b}" for a, b in rb.stray[:8])
        more = f" (+{len(rb.stray) - 8} more)" if len(rb.stray) > 8 else ""
        raise SpecError("flows", f"{len(rb.stray)} flows form no consistent circuit: {shown}{more}")
    return rb.matching
