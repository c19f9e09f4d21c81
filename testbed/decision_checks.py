"""Checks of a plug-in's decisions before they are carried out (pure): a decision that cannot be carried out is an
emulation.plugins.DecisionError naming the plug-in (``who``) and what is wrong, and the run stops. Used by the
planning tick (testbed/planning.py) on every deal, release, layout decision and migration, the built-ins'
alike."""
from __future__ import annotations

import numpy as np

from agents.engine import Layout
from emulation.plugins import DecisionError
from testbed.orchestrator.planner import Decision


def indices(who: str, idx, what: str) -> np.ndarray:
    """``idx`` as an array of request indices."""
    try:
        return np.asarray(idx, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        raise DecisionError(who, f"{what}: request indices must be integers") from None


def checked_deal(who: str, placed, servers: set, allowed: np.ndarray, what: str) -> dict[int, np.ndarray]:
    """``placed`` (server -> request indices) checked: live servers, indices among ``allowed``, none twice."""
    if not isinstance(placed, dict):
        raise DecisionError(who, f"{what} must map servers to request indices")
    out = {}
    for srv, idx in placed.items():
        if srv not in servers:
            raise DecisionError(who, f"{what}: server {srv!r} is not a live generator (live: {sorted(servers)})")
        a = indices(who, idx, f"{what}: server {srv}")
        bad = a[~np.isin(a, allowed)]
        if len(bad):
            raise DecisionError(who, f"{what}: server {srv}: request {int(bad[0])} is not one it may deal now "
                                     "(not of this step, or dealt already)")
        out[int(srv)] = a
    every = np.concatenate(list(out.values())) if out else np.zeros(0, np.int64)
    if len(np.unique(every)) != len(every):
        raise DecisionError(who, f"{what}: a request is dealt twice")
    return out


def check_whole_deal(who: str, placed: dict, held: np.ndarray, n: int) -> None:
    """Every one of the step's ``n`` requests placed or held exactly once."""
    got = np.concatenate([held, *placed.values()]) if placed else held
    if len(got) != n or len(np.unique(got)) != n:
        raise DecisionError(who, f"deal() must place or hold each of the step's {n} requests exactly once, got "
                                 f"{len(got)} ({len(got) - len(np.unique(got))} twice)")


def check_decision(who: str, s: int, d, servers, layouts: tuple, gpus: int) -> None:
    """A planner's decision for server ``s``: a Decision, for a server it was asked about, to a layout the
    server can hold (``layouts``)."""
    if not isinstance(d, Decision):
        raise DecisionError(who, f"server {s}: a decision must be a testbed.orchestrator.planner.Decision, got "
                                 f"{type(d).__name__}")
    if s not in servers:
        raise DecisionError(who, f"decided for server {s!r}, which it was not asked about")
    if (d.switch or d.best != d.current) and d.best not in layouts:
        name = d.best.name(gpus) if isinstance(d.best, Layout) and gpus % d.best.tp == 0 else repr(d.best)
        raise DecisionError(who, f"server {s}: layout {name} is not one the server can hold (it holds "
                                 f"{', '.join(x.name(gpus) for x in layouts)}: the model and a longest response)")


def checked_decisions(who: str, decisions, views: dict, layouts: tuple, gpus: int) -> dict:
    """A planner's ``evaluate_all`` answer: server -> Decision, each checked."""
    if not isinstance(decisions, dict):
        raise DecisionError(who, f"evaluate_all() must return server -> Decision, got {type(decisions).__name__}")
    for s, d in decisions.items():
        check_decision(who, s, d, views, layouts, gpus)
    return decisions


def checked_moves(who: str, moves, views: dict, rids: dict, gpus: int) -> list:
    """A balancer's moves, in order: between servers it was given, of a request its source holds (where the
    tick's snapshot has it, or where an earlier move of the tick put it: the built-in may move a request between
    a server's replicas and then to another server), to a replica the destination has."""
    moved: dict = {}  # request -> the server this tick's earlier moves put it on
    for m in moves:
        if not all(hasattr(m, a) for a in ("rid", "src", "dst")):
            raise DecisionError(who, f"a move must be a testbed.orchestrator.balancer.Move, got {type(m).__name__}")
        if m.src not in views or m.dst not in views:
            raise DecisionError(who, f"move of request {m.rid}: server {m.src if m.src not in views else m.dst!r} is "
                                     f"not among the servers it was given ({sorted(views)})")
        here = moved[m.rid] == m.src if m.rid in moved else bool(np.any(np.asarray(rids[m.src]) == m.rid))
        if not here:
            raise DecisionError(who, f"move of request {m.rid} from server {m.src}: the server does not hold it"
                                     + (f" (an earlier move of this tick put it on server {moved[m.rid]})"
                                        if m.rid in moved else ""))
        moved[m.rid] = m.dst
        reps = views[m.dst].layout.replicas(gpus)
        if m.dst_replica is not None and not (isinstance(m.dst_replica, (int, np.integer)) and 0 <= m.dst_replica < reps):
            raise DecisionError(who, f"move of request {m.rid}: server {m.dst} has replicas 0..{reps - 1}, got "
                                     f"dst_replica {m.dst_replica!r}")
    return list(moves)
