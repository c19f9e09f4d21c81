"""The reactive balancer (pure): a per-agent load index, and migrations from the most to the least loaded
agents when the gap is large, bounded per interval, made only where the gap shrinks after the move.

Load index of an agent = its predicted remaining makespan in seconds (testbed.orchestrator.estimate): the
forecast remaining tokens of its queue and of its running requests, drained by continuous batching at the
decode speed the cost model gives its layout and batch, with concurrency capped by ``max_num_seqs`` and by
its KV headroom (a replica runs at most as many requests as its KV cache holds at their final footprint;
the rest wait). So queue length, KV headroom and decode speed all enter through one number with a unit, and
two agents' indices can be compared and subtracted. The published anchor is Llumnix's *freeness* (free KV
blocks per running request, OSDI'24): it measures KV headroom alone; the stats report it next to this index.

An agent's index is the predicted remaining time of its slowest replica (a server finishes when its last
replica does); a move takes a request off that replica and puts it on the least loaded replica of the least
loaded agent (the engine is told which).

Rule (Llumnix's): a move of request r from agent a (index L_a, the largest) to agent b (L_b, the smallest) is
made only when the gap ``L_a - L_b`` exceeds ``max(min_gap_s, threshold x L_a)`` and, recomputed with r
moved, ``|L_a' - L_b'| < L_a - L_b`` and ``max(L_a', L_b') < L_a``: a move that does not narrow the gap is
never made, so a request cannot be sent back and forth. At most ``max_migrations`` moves per interval; the
candidates are the ``candidates`` requests of ``a`` with the longest forecast remaining, plus its queue.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from agents.protocol import MIGRATION_MODES
from emulation.validation import require

from .estimate import Estimator, ServerLoad
from .planner import ServerView


@dataclass(frozen=True)
class BalancerSettings:
    """``orchestrator.balancer`` in a scenario (see the module docstring for the rule)."""

    threshold: float = 0.15
    min_gap_s: float = 1.0
    max_migrations: int = 4
    candidates: int = 8
    mode: str = "multi_stage"

    def __post_init__(self) -> None:
        require(math.isfinite(self.threshold) and 0 <= self.threshold < 1, "threshold",
                f"must be in [0, 1), got {self.threshold}")
        require(math.isfinite(self.min_gap_s) and self.min_gap_s >= 0, "min_gap_s", f"must be >= 0, got {self.min_gap_s}")
        require(0 <= self.max_migrations <= 1000, "max_migrations", f"must be in 0..1000, got {self.max_migrations}")
        require(1 <= self.candidates <= 1000, "candidates", f"must be in 1..1000, got {self.candidates}")
        require(self.mode in MIGRATION_MODES, "mode", f"must be one of {', '.join(MIGRATION_MODES)}, got {self.mode!r}")


@dataclass
class Move:
    rid: int
    src: int
    dst: int
    dst_replica: int | None  # the destination replica (the least loaded one of ``dst``)
    before: tuple[float, float]  # (L_src, L_dst); a move inside one server: its two replicas' times
    after: tuple[float, float]


@dataclass
class _Agent:
    view: ServerView
    rids: np.ndarray
    rep: np.ndarray  # replica of every request
    times: np.ndarray  # remaining time of every replica

    def load(self, now: float) -> float:
        busy = max(0.0, self.view.busy_until - now)
        return (float(self.times.max()) if len(self.times) and self.view.load.n else 0.0) + busy


@dataclass
class Balancer:
    estimator: Estimator
    settings: BalancerSettings = field(default_factory=BalancerSettings)

    def load_index(self, view: ServerView, now: float) -> float:
        return self.estimator.server_s(view.layout, view.load, current=view.layout) + max(0.0, view.busy_until - now)

    def _agent(self, view: ServerView, rids: np.ndarray) -> _Agent:
        rep, times = self.estimator.replica_times(view.layout, view.load, current=view.layout)
        return _Agent(view, np.asarray(rids), rep, times)

    def _times_of(self, ag: _Agent, j: int, load: ServerLoad, rep: np.ndarray) -> np.ndarray:
        t = ag.times.copy()
        m = rep == j
        t[j] = self.estimator.replica_s(ag.view.layout, load.ctx0[m], load.rem[m], load.running[m]) if m.any() else 0.0
        return t

    def decide(self, views: dict[int, ServerView], rids: dict[int, np.ndarray], now: float) -> tuple[list[Move], dict]:
        """Moves for this interval; ``rids[s]``: the request ids in ``views[s].load`` (same order). Returns the
        moves and the load index of every agent before them.

        An agent's load index is its slowest replica's predicted remaining time (plus a layout switch in
        progress); a move takes a request off the slowest replica of the most loaded agent and puts it on the
        least loaded replica of the least loaded agent."""
        s = self.settings
        ags = {a: self._agent(v, rids[a]) for a, v in views.items()}
        loads = {a: g.load(now) for a, g in ags.items()}
        first = dict(loads)
        moves: list[Move] = []
        if len(ags) < 2:
            return moves, first
        for _ in range(s.max_migrations):
            a = max(loads, key=lambda k: (loads[k], -k))
            A = ags[a]
            la = A.view.load
            if la.n == 0:
                break
            ja = int(np.argmax(A.times))
            # targets: the least loaded replica of the least loaded other agent, and this agent's own least
            # loaded replica (a move inside a server: its KV crosses NVLink, not the fabric)
            others = [k for k in loads if k != a]
            targets = []
            if others:
                b = min(others, key=lambda k: (loads[k], k))
                if loads[a] - loads[b] > max(s.min_gap_s, s.threshold * loads[a]):
                    targets.append((b, int(np.argmin(ags[b].times)) if len(ags[b].times) else 0))
            if len(A.times) > 1:
                jo = int(np.argmin(np.where(np.arange(len(A.times)) == ja, np.inf, A.times)))
                if A.times[ja] - A.times[jo] > max(s.min_gap_s, s.threshold * A.times[ja]):
                    targets.append((a, jo))
            if not targets:
                break
            on = np.nonzero(A.rep == ja)[0]
            order = on[np.argsort(-la.rem[on], kind="stable")]
            cands = list(order[: s.candidates]) + [int(i) for i in on[~la.running[on]][: s.candidates]]
            best = None
            for b, jb in targets:
                B = ags[b]
                for i in dict.fromkeys(int(c) for c in cands):
                    na_load = la.without(i)
                    na_rep = np.delete(A.rep, i)
                    if b == a:
                        nl = na_load.plus_from(la, i, jb)
                        nrep = np.r_[na_rep, jb]
                        t2 = self._times_of(A, ja, nl, nrep)
                        t2[jb] = self._times_of(A, jb, nl, nrep)[jb]
                        na = nb = float(t2.max()) + max(0.0, A.view.busy_until - now)
                        gap_before = A.times[ja] - A.times[jb]
                        ok = max(t2[ja], t2[jb]) < A.times[ja] - 1e-9 and abs(t2[ja] - t2[jb]) < gap_before
                        cand = (nl, nrep, t2, (A.times[ja], A.times[jb]), (t2[ja], t2[jb]), None)
                    else:
                        ta = self._times_of(A, ja, na_load, na_rep)
                        nb_load = B.view.load.plus_from(la, i, jb)
                        nb_rep = np.r_[B.rep, jb]
                        tb = self._times_of(B, jb, nb_load, nb_rep)
                        na = (float(ta.max()) if na_load.n else 0.0) + max(0.0, A.view.busy_until - now)
                        nb = float(tb.max()) + max(0.0, B.view.busy_until - now)
                        ok = abs(na - nb) < loads[a] - loads[b] and max(na, nb) < loads[a] - 1e-9
                        cand = (na_load, na_rep, ta, nb_load, nb_rep, tb)
                    if ok:
                        key = (max(na, nb), abs(na - nb))
                        if best is None or key < best[0]:
                            best = (key, i, b, jb, cand, na, nb)
            if best is None:
                break
            _, i, b, jb, cand, na, nb = best
            B = ags[b]
            if b == a:  # a move inside the server: its before/after are the two replicas' times
                moves.append(Move(int(A.rids[i]), a, b, jb, tuple(map(float, cand[3])), tuple(map(float, cand[4]))))
            else:
                moves.append(Move(int(A.rids[i]), a, b, jb, (loads[a], loads[b]), (na, nb)))
            if b == a:
                nl, nrep, t2, _, _, _ = cand
                rid_new = np.r_[np.delete(A.rids, i), A.rids[i]]
                ags[a] = _Agent(ServerView(a, A.view.layout, nl, A.view.busy_until, A.view.last_switch_end),
                                rid_new, nrep, t2)
                loads[a] = na
            else:
                na_load, na_rep, ta, nb_load, nb_rep, tb = cand
                ags[b] = _Agent(ServerView(b, B.view.layout, nb_load, B.view.busy_until, B.view.last_switch_end),
                                np.r_[B.rids, A.rids[i]], nb_rep, tb)
                ags[a] = _Agent(ServerView(a, A.view.layout, na_load, A.view.busy_until, A.view.last_switch_end),
                                np.delete(A.rids, i), na_rep, ta)
                loads[a], loads[b] = na, nb
        return moves, first


def freeness(stats: dict) -> float:
    """Llumnix's freeness of an agent: free KV blocks per request it holds (inf when it holds none)."""
    n = stats["num_requests_running"] + stats["num_requests_waiting"]
    free = sum(r["kv_blocks_free"] for r in stats["replicas"])
    return free / n if n else math.inf
