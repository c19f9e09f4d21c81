"""The fabric's switches as the controller sees them (pure, no os-ken): which are expected, connected, read
back (synced) or stale, what each OCS was read back holding, and whether an OCS's ports match the spec.

:class:`controller.runtime.FabricController` owns one :class:`SwitchSet` and feeds it the os-ken app's events.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from emulation.spec import FabricSpec

from .ocs import split_flows

log = logging.getLogger(__name__)


class SwitchSet:
    """The switches of ``spec`` and what is known of each.

    ``on_stale(dpids)`` asks the app to read back switches whose contents became unknown (:meth:`mark_stale`).
    Not thread-safe: the controller calls it under its lock.
    """

    def __init__(self, spec: FabricSpec, on_stale: Callable[[list[int]], None] | None = None):
        self.spec = spec
        self.expected = sorted([spec.tor_dpid(t) for t in range(spec.n_tors)] +
                               [spec.ocs_dpid(o) for o in range(spec.ocs_count)])
        self.connected: set[int] = set()
        self.synced: set[int] = set()
        self.stale: set[int] = set()  # dpids to read back after a failed reconfiguration
        self.mismatch: dict[int, str] = {}  # ocs -> how its switch's ports differ from the spec (never ready)
        self.ocs_readback: dict[int, Any] = {}  # ocs -> FlowReadback from the switch
        self._on_stale = on_stale

    @property
    def all_synced(self) -> bool:
        """Every expected switch read back since it (re)connected or went stale."""
        return set(self.expected) <= self.synced

    def not_ready_reason(self, initialised: bool) -> str:
        if self.mismatch:
            return "fabric does not match its spec: " + "; ".join(self.mismatch.values())
        missing = sorted(set(self.expected) - self.connected)
        if missing:
            return f"fabric not ready (missing dpids {missing})"
        if not initialised:
            return "fabric not ready (initial circuits not installed yet)"
        unsynced = sorted(set(self.expected) - self.synced)
        return f"fabric not ready (switches not read back yet: dpids {unsynced})"

    def state(self) -> dict:
        """The switch part of the controller's ``GET /state``."""
        return {"connected": sorted(self.connected), "expected": self.expected,
                "missing": sorted(set(self.expected) - self.connected),
                "unsynced": sorted(set(self.expected) - self.synced), "stale": sorted(self.stale)}

    def connect(self, dpid: int) -> None:
        if self.spec.classify_dpid(dpid) is None:
            log.warning("switch %#x is not part of this fabric; ignored", dpid)
            return
        self.connected.add(dpid)
        log.info("switch %#x connected (%d/%d)", dpid, len(self.connected), len(self.expected))

    def disconnect(self, dpid: int) -> None:
        self.connected.discard(dpid)
        self.synced.discard(dpid)
        self.stale.discard(dpid)  # its reconnect reads it back anyway
        log.warning("switch %#x disconnected", dpid)

    def sync(self, dpid: int, kind: tuple[str, int], ocs_flows: Sequence[tuple[int, int]] | None,
             ocs_ports: Sequence[int] | None) -> bool:
        """Record that switch ``dpid`` (``kind``: ``spec.classify_dpid``) was read back; False when it is gone
        again or is an OCS whose ports are not exactly the spec's 1..ports_per_ocs (never synced then: the
        fabric is not what the spec says, so it never gets ready, and no circuit can name a missing port)."""
        if dpid not in self.connected:
            return False  # gone again
        if kind[0] == "ocs" and ocs_ports is not None:
            want = set(range(1, self.spec.ports_per_ocs + 1))
            have = set(int(p) for p in ocs_ports)
            if have != want:
                lo, hi = (min(have), max(have)) if have else (0, 0)
                self.mismatch[kind[1]] = (
                    f"OCS {kind[1]} (switch {dpid:#x}) has {len(have)} ports ({lo}..{hi}), the spec says "
                    f"{len(want)} (1..{len(want)}: fabric.ocs_ports {self.spec.ocs_ports or 'derived'})")
                log.error("%s", self.mismatch[kind[1]])
                return False
            self.mismatch.pop(kind[1], None)
        self.synced.add(dpid)
        self.stale.discard(dpid)
        if kind[0] == "ocs":
            self.ocs_readback[kind[1]] = split_flows(self.spec.ports_per_ocs, ocs_flows or ())
        return True

    def mark_stale(self, dpids: Sequence[int]) -> None:
        """What ``dpids`` hold is unknown: not synced until read back (a connected one is asked for now, a
        disconnected one is read back when it reconnects)."""
        dpids = sorted(set(dpids))
        for d in dpids:
            self.synced.discard(d)
            if d in self.connected:
                self.stale.add(d)
        todo = [d for d in dpids if d in self.stale]
        log.warning("switches %s are stale: reading them back", [hex(d) for d in todo])
        if todo and self._on_stale is not None:
            try:
                self._on_stale(todo)
            except Exception:  # noqa: BLE001 - the failure being reported must not be masked
                log.exception("could not schedule the read-back of %s", todo)
