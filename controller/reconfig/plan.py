"""Reconfiguration plans (pure): the ordered flow and route changes from the current circuits to a target.

See :mod:`controller.reconfig` for the four steps; :func:`plan_reconfig` computes them and checks that no
mixed state of a step loops on the circuits lit meanwhile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from emulation.spec import FabricSpec
from emulation.validation import SpecError

from .. import phases, routing
from ..ocs import OCS_COOKIE, OCS_PRIORITY, FlowSpec, Matching, MatchingDiff, circuit_flow_changes, diff


@dataclass(frozen=True)
class OcsStep:
    """The flow changes of one OCS whose matching changes."""

    ocs: int
    diff: MatchingDiff
    deletes: tuple[FlowSpec, ...]
    adds: tuple[FlowSpec, ...]


@dataclass(frozen=True)
class ReconfigPlan:
    """What a reconfiguration sends, in order: ``move_steps`` (route changes before anything goes dark), the
    deletes of ``ocs_steps``, ``dark_steps`` (while the changed circuits are dark), the adds, ``final_steps``.

    Each step is a ``routing.RouteChanges`` confirmed (ToR barrier) before the next; the planner checked
    that no mixed state of a step loops on the circuits lit meanwhile. ``dark_wait``: the dark steps from
    that index on wait until the deletes are confirmed (only when they would loop on the old circuits).
    """

    current: Mapping[int, Matching]
    target: Mapping[int, Matching]  # complete: every OCS
    ocs_steps: tuple[OcsStep, ...]  # only OCSes whose matching changes, by OCS index
    transition_routes: Any = None  # routing.Routes before the changed circuits go dark
    final_routes: Any = None  # routing.Routes on the new circuit graph
    move_steps: tuple = ()  # routing.RouteChanges: current -> transition
    final_steps: tuple = ()  # routing.RouteChanges: dark routes -> final (or the full state when unknown)
    routes_full: bool = False  # final_steps is the complete route state (routes were unknown)
    dark_routes: Any = None  # routing.Routes while dark: final where no stable path exists (see routing)
    dark_steps: tuple = ()  # routing.RouteChanges: transition -> dark routes, sent after the deletes
    dark_wait: int | None = None  # dark_steps[i:] wait until the deletes are confirmed (None: none waits)

    @property
    def is_noop(self) -> bool:
        return not self.ocs_steps

    @property
    def touched_ocses(self) -> list[int]:
        return [s.ocs for s in self.ocs_steps]

    def summary(self) -> dict:
        return {
            "ocs": {str(s.ocs): {"removed": [list(c) for c in sorted(s.diff.removed)],
                                  "added": [list(c) for c in sorted(s.diff.added)],
                                  "unchanged": len(s.diff.unchanged),
                                  "dark_ports": sorted(s.diff.changed_ports)}
                    for s in self.ocs_steps},
        }


def complete_target(current: Mapping[int, Matching], target: Mapping[int, Matching]) -> dict[int, Matching]:
    """``current`` with the OCSes listed in ``target`` replaced."""
    out = dict(current)
    for o, m in target.items():
        if o not in current:
            raise SpecError(f"circuits.{o}", f"unknown OCS {o}")
        out[o] = m
    return out


def stray_flow(in_port: int, out_port: int) -> FlowSpec:
    """The circuit-flow shape of a stray ``in_port -> out_port`` flow read back from an OCS (to delete it)."""
    return FlowSpec(OCS_PRIORITY, (("in_port", int(in_port)),), (("output", int(out_port)),), OCS_COOKIE)


def plan_reconfig(spec: FabricSpec, current: Mapping[int, Matching], current_routes: Any,
                  target: Mapping[int, Matching], with_routes: bool = True,
                  stray: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> ReconfigPlan:
    """The ordered steps from ``current`` to ``target`` (OCSes not in ``target`` keep their circuits).

    ``current_routes`` None means the ToRs' routes are unknown (first install): the transition step then
    moves nothing. ``with_routes=False`` plans circuits only (used by tests of the OCS side). ``stray``:
    flows read back from an OCS that form no circuit (after a restart); they are deleted with the changes.
    """
    full = complete_target(current, target)
    stray = stray or {}
    steps = []
    for o in sorted(full):
        d = diff(current[o], full[o])
        extra = tuple(stray_flow(a, b) for a, b in sorted(stray.get(o, ())))
        if d.is_empty and not extra:
            continue
        dels, adds = circuit_flow_changes(current[o], full[o])
        steps.append(OcsStep(o, d, tuple(dels) + extra, tuple(adds)))
    if not with_routes:
        return ReconfigPlan(dict(current), full, tuple(steps))
    g_new = phases.circuit_graph(spec, full)
    final_routes = routing.compute_routes(spec, g_new)
    if not steps and current_routes is not None:
        return ReconfigPlan(dict(current), full, (), current_routes, current_routes)
    if current_routes is None:  # first install: the complete state once the circuits are in place
        return ReconfigPlan(dict(current), full, tuple(steps), None, final_routes,
                            final_steps=(routing.route_flow_changes(spec, None, final_routes),), routes_full=True)
    g_cur = phases.circuit_graph(spec, current)
    g_stable = phases.circuit_graph(spec, {o: Matching(m.n_ports, diff(m, full[o]).unchanged)
                                           for o, m in current.items()})
    transition = routing.transition_routes(spec, current_routes, g_stable)
    # installed while every current circuit is lit, then while the changed ones are dark (a subset)
    routing.check_loop_free(transition, g_cur, "the transition routes")
    dark = routing.dark_routes(transition, final_routes, g_stable)
    # held while the new circuits light up (the lit circuits grow from the stable ones to the new graph)
    routing.check_loop_free(dark, g_new, "the routes held while the new circuits light up")
    move = routing.safe_steps(current_routes, transition, g_cur, g_stable, "moving routes off changing circuits")
    # The dark routes go out right after the deletes, which may still be in flight (old circuits lit). One
    # step when no mixed state loops on the old circuits; otherwise break before make (these entries' traffic
    # is dark anyway): empty them at once (a subset of the transition routes: loop-free), then fill them in,
    # after the deletes' barrier if the dark routes would loop on the old circuits.
    darks, dark_wait = [], None
    changed = routing.changed_entries(transition, dark)
    if changed:
        on_old, dsts = routing.port_peers(g_cur), {d for _, d in changed}
        if routing.find_loop(routing.merge(transition, dark), on_old, spec.n_tors, dsts) is None:
            darks = [dark]
        else:
            darks = [routing.blanked(transition, changed), dark]
            if routing.find_loop(dark, on_old, spec.n_tors) is not None:
                routing.check_loop_free(dark, g_stable, "the routes toward the new circuits")
                dark_wait = 1
    final = routing.safe_steps(dark, final_routes, g_new, g_new, "final routes")

    def changes(states: list, start: Any) -> tuple:
        out, prev = [], start
        for st in states:
            out.append(routing.route_flow_changes(spec, prev, st))
            prev = st
        return tuple(out)

    return ReconfigPlan(dict(current), full, tuple(steps), transition, final_routes,
                        move_steps=changes(move, current_routes), final_steps=changes(final, dark),
                        dark_routes=dark, dark_steps=changes(darks, transition), dark_wait=dark_wait)
