"""The reactive balancer (pure): a per-agent load index, and migrations from the most to the least loaded
agents when the gap is large, bounded per interval, made only where the gap shrinks after the move.

Load index of an agent = its predicted remaining makespan in seconds (testbed.orchestrator.estimate): the
forecast remaining tokens of its queue and of its running requests, drained by continuous batching at the
decode speed the cost model gives its layout and batch, with concurrency capped by ``max_num_seqs`` and by
its KV headroom (a replica runs at most as many requests as its KV cache holds, estimate.kv_slots; the
rest wait). So queue length, KV headroom and decode speed all enter through one number with a unit, and
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

With ``pay_samples`` > 0 (off by default) a move the rule admits must also pay over the forecast's draws
(:meth:`Balancer._pays`): over that many draws of every request's remaining length on the two servers, the
later of their ends must come sooner with the move on average and in at least ``pay_probability`` of the
draws (the quantiles say nothing of which replica holds a server's truly longest request, the one that sets
its end).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from emulation.orchestration import BalancerSettings

from .estimate import Estimator, ServerLoad
from .interfaces import MigrationBalancer, PolicyContext
from .planner import ServerView

PAID_S = 1e-3  # a move pays when the two servers it touches finish at least this much sooner with it


@dataclass
class Move:
    rid: int
    src: int
    dst: int
    dst_replica: int | None = None  # the destination replica (the least loaded one of ``dst``; None: the engine's)
    before: tuple[float, float] = (0.0, 0.0)  # (L_src, L_dst); a move inside one server: its two replicas' times
    after: tuple[float, float] = (0.0, 0.0)
    gain_s: float = 0.0  # predicted: the larger of the two servers' load indices before the move minus after it
    pays: float | None = None  # the share of the forecast's draws in which it shortens the pair's makespan


@dataclass
class _Agent:
    view: ServerView
    rids: np.ndarray
    rep: np.ndarray  # replica of every request
    times: np.ndarray  # remaining time of every replica
    mean: np.ndarray  # every request's expected remaining tokens (a moved request's, before and after the move)

    def load(self, now: float) -> float:
        busy = max(0.0, self.view.busy_until - now)
        return (float(self.times.max()) if len(self.times) and self.view.load.n else 0.0) + busy


@dataclass
class Balancer(MigrationBalancer):
    estimator: Estimator
    settings: BalancerSettings = field(default_factory=BalancerSettings)
    views_after: dict = field(default_factory=dict, repr=False)  # decide(): each agent's view after its moves
    # settings.pay_judge "truth": request ids -> their true remaining tokens (the simulated backend's), judged on
    # in place of the forecast's draws: an oracle of which moves pay, not a policy
    truth: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)

    @classmethod
    def create(cls, ctx: PolicyContext, params=None) -> "Balancer":
        """The built-in balancer of a run: its settings are the scenario's ``orchestrator.balancer``."""
        return cls(ctx.estimator, ctx.settings.balancer)

    def moves(self, views: dict[int, ServerView], rids: dict[int, np.ndarray], now: float) -> list[Move]:
        """The interface's answer (interfaces.MigrationBalancer): :meth:`decide`'s moves."""
        return self.decide(views, rids, now)[0]

    def frozen(self, load: ServerLoad, strat: np.ndarray | None = None) -> ServerLoad:
        """``load`` with every request's remaining tokens fixed at the estimator's stratified value for it now
        (no forecast fields left: nothing is re-stratified when requests move between servers). ``strat``:
        those values when already known (:meth:`Estimator.replica_times_many` gives them with the times)."""
        if load.gen is None or load.key is None or self.estimator.forecast is None:
            return load
        return ServerLoad(load.ctx0, self.estimator.stratified(load) if strat is None else strat, load.running,
                          load.replica)

    def load_index(self, view: ServerView, now: float) -> float:
        return self.estimator.server_s(view.layout, view.load, current=view.layout) + max(0.0, view.busy_until - now)

    def _variant_times(self, A: _Agent, ja: int, on: np.ndarray, cands: np.ndarray, targets: list,
                       la: ServerLoad) -> tuple[np.ndarray, list, np.ndarray]:
        """Remaining times of the replicas a move changes, for every candidate ``cands[k]`` (a request on
        ``A``'s replica ``ja``, whose requests are ``on``): ``off[k]``, replica ``ja`` without it; ``on_t[t][k]``,
        target ``t``'s replica (agent, replica) with it appended (as the engine appends an arrival); and
        ``base[k]``, replica ``ja`` as it is. The candidate's own remaining length is its expected one
        (``A.mean``) in ``base`` and in ``on_t``, every other request's its stratified quantile (the load
        indices'): a request chosen because its quantile is high would otherwise take an imaginary tail with it
        (the quantiles are dealt to a server's requests by a fixed key, not by what is known of them). Every
        variant is one group of one grouped estimator pass per layout, each computed as
        :meth:`Estimator.replica_s` computes it alone (running requests first)."""
        m = len(cands)
        # variant k of replica ja: its requests in their order, candidate k left out
        keep = np.broadcast_to(on, (m, len(on)))[on[None, :] != cands[:, None]].reshape(m, len(on) - 1)
        parts = {}  # layout -> list of (ctx0, rem, running) per variant group, and where each result goes

        def add(layout, ctx0, rem, run, n_groups, slot):
            parts.setdefault(layout, []).append((ctx0, rem, run, n_groups, slot))

        add(A.view.layout, la.ctx0[keep].ravel(), la.rem[keep].ravel(), la.running[keep].ravel(), m, ("off", 0))
        base_rem = np.broadcast_to(la.rem[on], (m, len(on))).copy()
        base_rem[on[None, :] == cands[:, None]] = A.mean[cands]
        add(A.view.layout, np.broadcast_to(la.ctx0[on], (m, len(on))).ravel(), base_rem.ravel(),
            np.broadcast_to(la.running[on], (m, len(on))).ravel(), m, ("base", 0))
        for t, (B, jb) in enumerate(targets):
            lb = B.view.load
            base = np.nonzero(B.rep == jb)[0]
            nb = len(base)
            # variant k of target t: the target replica's requests, then candidate k of ``la``
            ctx0 = np.empty((m, nb + 1))
            rem = np.empty((m, nb + 1))
            run = np.empty((m, nb + 1), bool)
            ctx0[:, :nb], rem[:, :nb], run[:, :nb] = lb.ctx0[base], lb.rem[base], lb.running[base]
            ctx0[:, nb], rem[:, nb], run[:, nb] = la.ctx0[cands], A.mean[cands], la.running[cands]
            add(B.view.layout, ctx0.ravel(), rem.ravel(), run.ravel(), m, ("on", t))
        res: dict = {"on": [None] * len(targets)}
        for layout, ps in parts.items():
            offsets = np.cumsum([0] + [p[3] for p in ps])
            group = np.concatenate([o + np.repeat(np.arange(n), len(c) // n)
                                    for (c, _, _, n, _), o in zip(ps, offsets)])
            tot = self.estimator.groups_s(layout, np.concatenate([p[0] for p in ps]),
                                          np.concatenate([p[1] for p in ps]), np.concatenate([p[2] for p in ps]),
                                          group, int(offsets[-1]))
            for (_, _, _, n, (kind, t)), o in zip(ps, offsets):
                if kind == "on":
                    res["on"][t] = tot[o:o + n]
                else:
                    res[kind] = tot[o:o + n]
        return res["off"], res["on"], res["base"]

    @staticmethod
    def _best_move(A: _Agent, a: int, ja: int, cands: np.ndarray, targets: list, ags: dict, loads: dict,
                   t_off: np.ndarray, t_on: list, t_base: np.ndarray, busy_a: float, now: float, need: float = 0.0,
                   judge=None):
        """The best admissible move (key: the larger of the two loads after it, then their gap; the first in
        (target, candidate) order among equals), as (key, request, dst, dst replica, times after, L_a', L_b',
        the pair's loads before, the predicted gain, the probability it pays), or None. ``judge(dst, dst replica,
        admissible candidates in key order)``: (the position of the one to make, its probability of paying) or
        (None, None); without it the first in key order is made (probability None). Every candidate at once: a
        replica-time maximum with two entries replaced is the maximum of the others' and the two new ones, so
        every number is the one a copy with the entries replaced gives. Before and after are both with the candidate at its expected length
        (``t_base``: its replica before the move; see :meth:`_variant_times`)."""
        def others_max(t, skip):  # the largest entry of ``t`` outside ``skip`` (-inf: none)
            return float(np.max(np.delete(t, skip))) if len(t) > len(set(skip)) else -np.inf

        la_base = np.maximum(t_base, others_max(A.times, [ja])) + busy_a  # agent a's index, candidate k expected
        best = None
        for t, (b, jb) in enumerate(targets):
            on = t_on[t]
            if b == a:
                rest = others_max(A.times, [ja, jb])
                na = np.maximum(np.maximum(t_off, on), rest) + busy_a
                nb = na
                ok = (np.maximum(t_off, on) < t_base - 1e-9) & (np.abs(t_off - on) < t_base - A.times[jb])
                before = (t_base, np.full(len(cands), A.times[jb]))
            else:
                B = ags[b]
                na = (np.maximum(t_off, others_max(A.times, [ja])) if A.view.load.n > 1
                      else np.zeros(len(cands))) + busy_a
                nb = np.maximum(on, others_max(B.times, [jb])) + max(0.0, B.view.busy_until - now)
                ok = (np.abs(na - nb) < la_base - loads[b]) & (np.maximum(na, nb) < la_base - 1e-9)
                before = (la_base, np.full(len(cands), loads[b]))
            gain = la_base - np.maximum(na, nb)
            ok &= gain > need  # it must save enough of the pair's makespan
            if not ok.any():
                continue
            k1, k2 = np.maximum(na, nb), np.abs(na - nb)
            idx = np.nonzero(ok)[0]
            idx = idx[np.lexsort((idx, k2[idx], k1[idx]))]  # by key; the first of equal keys, as a "<" scan keeps
            p = None
            if judge is not None:  # the first in key order that pays often enough
                k, p = judge(b, jb, cands[idx])
                if k is None:
                    continue
                k = int(idx[k])
            else:
                k = int(idx[0])
            key = (float(k1[k]), float(k2[k]))
            if best is None or key < best[0]:
                if b == a:
                    t2 = A.times.copy()
                    t2[ja], t2[jb] = t_off[k], on[k]
                    times = (t2,)
                else:
                    ta, tb = A.times.copy(), ags[b].times.copy()
                    ta[ja], tb[jb] = t_off[k], on[k]
                    times = (ta, tb)
                best = (key, int(cands[k]), b, jb, times, float(na[k]), float(nb[k]),
                        (float(before[0][k]), float(before[1][k])), float(gain[k]), p)
        return best

    def _agent_like(self, g: "_Agent", load: ServerLoad, moved: tuple | None = None) -> "_Agent":
        """``g`` with ``load`` (same requests; ``moved``: request i moved to replica j, appended last) and its
        replicas' times computed from it."""
        return self._agents_like([(g, load, moved)])[0]

    def _agents_like(self, items: list) -> list:
        """:meth:`_agent_like` of every (agent, load, moved) of ``items``, in one grouped estimator pass."""
        many = self.estimator.replica_times_many([(g.view.layout, load, g.view.layout) for g, load, _ in items])
        out = []
        for (g, load, moved), (rep, times) in zip(items, many):
            rids, mean = g.rids, g.mean
            if moved is not None:
                i, _ = moved
                rids, mean = np.r_[np.delete(rids, i), rids[i]], np.r_[np.delete(mean, i), mean[i]]
            out.append(_Agent(ServerView(g.view.server, g.view.layout, load, g.view.busy_until,
                                         g.view.last_switch_end), rids, rep, times, mean))
        return out

    def _try(self, A: "_Agent", a: int, ja: int, targets: list, ags: dict, loads: dict, busy_a: float, now: float,
             need: float, judge=None):
        """The best admissible move off ``A``'s replica ``ja`` onto one of ``targets`` (see :meth:`_best_move`)."""
        s = self.settings
        la = A.view.load
        on = np.nonzero(A.rep == ja)[0]
        order = on[np.argsort(-A.mean[on], kind="stable")]  # the longest expected remaining first
        cands = list(order[: s.candidates]) + [int(i) for i in on[~la.running[on]][: s.candidates]]
        uniq = np.array(list(dict.fromkeys(int(c) for c in cands)), np.int64)
        if not len(uniq):
            return None
        t_off, t_on, t_base = self._variant_times(A, ja, on, uniq, [(ags[b], jb) for b, jb in targets], la)
        return self._best_move(A, a, ja, uniq, targets, ags, loads, t_off, t_on, t_base, busy_a, now, need, judge)

    def _pays(self, ags: dict, law: tuple, a: int, ja: int, b: int, jb: int, cands: np.ndarray,
              now: float) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate ``cands[k]`` (a request of agent ``a``'s replica ``ja``) moved to agent ``b``'s replica
        ``jb``: (its expected gain, the probability the gain is positive) over ``pay_samples`` draws of every
        request's remaining length on the two servers from its forecast law (``law``: every request's id, sorted,
        and its generated tokens and prompt shift in that order). Per draw the gain is the later of the two servers' ends without the move minus with it, the
        same draw on both sides (the moved request keeps its length): the quantity the simulated backend's
        counterfactual measures with the true lengths in place of the draws. Every replica under every draw,
        and the two changed replicas under every draw and candidate, in one grouped estimator pass per server."""
        S, m = (1 if self.truth is not None else self.settings.pay_samples), len(cands)
        servers = [a] if b == a else [a, b]
        # the same draws for every candidate of this (source replica, target) at this tick, however they are split
        rng = np.random.default_rng([a, ja, b, jb, int(round(now * 1e3)) & 0xFFFFFFFF])
        ids, gens, shifts = law
        draws = {}  # server -> (S, n): its requests' remaining lengths, one row per draw
        for x in servers:
            g = ags[x]
            if self.truth is not None:
                draws[x] = np.clip(np.asarray(self.truth(g.rids), float), 1.0, None)[None, :]
                continue
            at = np.searchsorted(ids, g.rids)
            gen, sh = gens[at], shifts[at]
            u = np.clip(rng.random((S, len(gen))), 1e-9, 1 - 1e-9)
            rem = self.estimator.forecast.remaining_quantile(np.tile(gen, S), u.ravel(), np.tile(sh, S))
            draws[x] = np.clip(np.ceil(rem), 1.0, None).reshape(S, len(gen))
        src = ags[a].view.load
        ends_before, ends_after = [], []
        for x in servers:
            g = ags[x]
            ld, R, n = g.view.load, len(g.times), len(g.rids)
            # groups: draw d's replica j as it is is d * R + j; then per candidate k and draw d, replica ja without
            # it (on a) and replica jb with it appended last (on b), as the engine appends an arrival
            ctx0, rem, run = [np.tile(ld.ctx0, S)], [draws[x].ravel()], [np.tile(ld.running, S)]
            grp = [np.repeat(np.arange(S) * R, n) + np.tile(g.rep, S)]
            changed = []  # (replica, first group of its m x S variants)
            nxt = S * R

            def variants(cols: np.ndarray, extra: bool):
                nonlocal nxt
                # cols: (m, c) request positions per candidate; extra: candidate k appended after them
                c = cols.shape[1]
                cx = np.broadcast_to(ld.ctx0[cols][:, None, :], (m, S, c))
                rx = draws[x][:, cols].transpose(1, 0, 2)  # (m, S, c)
                ux = np.broadcast_to(ld.running[cols][:, None, :], (m, S, c))
                if extra:
                    cx = np.concatenate([cx, np.broadcast_to(src.ctx0[cands][:, None, None], (m, S, 1))], axis=2)
                    rx = np.concatenate([rx, draws[a][:, cands].T[:, :, None]], axis=2)
                    ux = np.concatenate([ux, np.broadcast_to(src.running[cands][:, None, None], (m, S, 1))], axis=2)
                w = cx.shape[2]
                ctx0.append(cx.ravel())
                rem.append(rx.ravel())
                run.append(ux.ravel())
                grp.append(np.repeat(nxt + np.arange(m * S), w))
                nxt += m * S
                return nxt - m * S

            if x == a:
                on = np.nonzero(g.rep == ja)[0]
                cols = np.broadcast_to(on, (m, len(on)))[on[None, :] != cands[:, None]].reshape(m, len(on) - 1)
                changed.append((ja, variants(cols, False)))
            if x == b:
                on = np.nonzero(g.rep == jb)[0]
                changed.append((jb, variants(np.broadcast_to(on, (m, len(on))), True)))
            tot = self.estimator.groups_s(g.view.layout, np.concatenate(ctx0), np.concatenate(rem),
                                          np.concatenate(run), np.concatenate(grp), nxt)
            before = tot[:S * R].reshape(S, R)
            after = np.broadcast_to(before, (m, S, R)).copy()
            for j, k in changed:
                after[:, :, j] = tot[k:k + m * S].reshape(m, S)
            busy = max(0.0, g.view.busy_until - now)
            ends_before.append(before.max(axis=1) + busy)
            ends_after.append((after.max(axis=2) if n > 1 or x != a else np.zeros((m, S))) + busy)
        gain = np.max(ends_before, axis=0)[None, :] - np.max(ends_after, axis=0)
        return gain.mean(axis=1), (gain > PAID_S).mean(axis=1)

    def decide(self, views: dict[int, ServerView], rids: dict[int, np.ndarray], now: float) -> tuple[list[Move], dict]:
        """Moves for this interval; ``rids[s]``: the request ids in ``views[s].load`` (same order). Returns the
        moves and the load index of every agent before them.

        An agent's load index is its slowest replica's predicted remaining time (plus a layout switch in
        progress); a move takes a request off the slowest replica of the most loaded agent and puts it on the
        least loaded replica of the least loaded agent."""
        s = self.settings
        # one estimate of every request's remaining length, before and after any move: its stratified
        # quantile in its own server now (a request's length does not change with the server it runs on), so
        # the load indices and every candidate move are computed from the very same numbers
        means = {a: np.asarray(v.load.rem, dtype=float) for a, v in views.items()}  # expected remaining tokens
        raw = views
        # the load indices from the servers' own loads where that gives the frozen loads' numbers (the frozen
        # load holds the stratified quantiles the estimator gives the load itself): the planner's pass of this
        # tick computed them (in its larger pass: the same numbers with whole token counts, as snapshots hold),
        # and the estimator remembers them by the load's content. Not with arrivals (replica -1): they are
        # placed by the remaining tokens the load holds, which freezing changes
        many = self.estimator.replica_times_many(
            [(v.layout, v.load if bool((v.load.replica >= 0).all()) else self.frozen(v.load), v.layout)
             for v in raw.values()], rem=True)
        views = {a: ServerView(a, v.layout, self.frozen(v.load, strat), v.busy_until, v.last_switch_end)
                 for (a, v), (_, _, strat) in zip(raw.items(), many)}
        ags = {a: _Agent(v, np.asarray(rids[a]), rep, times, means[a])
               for (a, v), (rep, times, _) in zip(views.items(), many)}
        # a move inside a server is judged by the quantiles dealt inside each replica (its own view of the same
        # forecast, before and after alike): dealt across the server, the replica that happens to draw the top
        # levels looks slowest, and moves made on that alone mostly changed nothing (MoE default: 36 of 99
        # intra-server moves realised no gain and 19 lost)
        # the test that a move pays needs every request's forecast law: what it has generated, its prompt's shift
        judged = ((s.pay_samples > 0 or self.truth is not None) and self.estimator.forecast is not None and len(raw) > 1
                  and all(v.load.gen is not None for v in raw.values()))
        if judged:
            ids = np.concatenate([np.asarray(rids[a]) for a in raw])
            order = np.argsort(ids, kind="stable")
            law = (ids[order], np.concatenate([v.load.gen for v in raw.values()]).astype(float)[order],
                   np.concatenate([v.load.shift if v.load.shift is not None else np.full(v.load.n, np.nan)
                                   for v in raw.values()])[order])

        def judge_from(a: int, ja: int):
            def judge(b, jb, cands):
                # the first candidate in key order that pays: the first alone (it usually does), then the rest
                cands = cands[: s.candidates]
                for lo, hi in ((0, 1), (1, len(cands))):
                    if lo >= hi:
                        break
                    mean, p = self._pays(ags, law, a, ja, b, jb, cands[lo:hi], now)
                    ok = np.nonzero((p >= s.pay_probability) & (mean > PAID_S))[0]
                    if len(ok):
                        return lo + int(ok[0]), float(p[ok[0]])
                return None, None
            return judge if judged else None

        multi = [a for a, g in ags.items() if len(g.times) > 1]
        within: dict = {}  # server -> its within view, made from the tick's agents when first needed

        def make_within(servers: list) -> None:
            """The within views of ``servers`` not made yet, in one grouped estimator pass. A server's view is
            needed only when no move between servers is found from it (most ticks: one server's, often none),
            so each is made when first asked for, and every one before the first move changes the agents they
            are made from; a replica's times are the same in a pass of its own as in one with others (the
            estimator's passes are exact per replica with whole token counts, as snapshots hold), so this
            changes no number."""
            todo = [a for a in multi if a in servers and a not in within]
            if not todo:
                return
            strat = self.estimator.stratified_within_many([(raw[a].load, ags[a].rep) for a in todo])
            lws = [ServerLoad(ags[a].view.load.ctx0, st, ags[a].view.load.running, ags[a].view.load.replica)
                   for a, st in zip(todo, strat)]
            within.update(zip(todo, self._agents_like([(ags[a], lw, None) for a, lw in zip(todo, lws)])))

        loads = {a: g.load(now) for a, g in ags.items()}
        first = dict(loads)
        moves: list[Move] = []
        self.views_after = {a: g.view for a, g in ags.items()}
        if len(ags) < 2:
            return moves, first
        for _ in range(s.max_migrations):
            a = max(loads, key=lambda k: (loads[k], -k))
            A = ags[a]
            if A.view.load.n == 0:
                break
            need = max(s.min_gain_s, s.gain_margin * loads[a])
            busy_a = max(0.0, A.view.busy_until - now)
            best = None
            # between servers: the slowest replica of the most loaded agent to the least loaded replica of the
            # least loaded other agent
            others = [k for k in loads if k != a]
            b = min(others, key=lambda k: (loads[k], k))
            if loads[a] - loads[b] > max(s.min_gap_s, s.threshold * loads[a]):
                ja = int(np.argmax(A.times))
                targets = [(b, int(np.argmin(ags[b].times)) if len(ags[b].times) else 0)]
                best = self._try(A, a, ja, targets, ags, loads, busy_a, now, need, judge_from(a, ja))
            # inside the server (its KV crosses NVLink, not the fabric), when no move between servers pays
            if best is None:
                make_within([a])
            W = within.get(a)
            if best is None and W is not None:
                ja = int(np.argmax(W.times))
                jo = int(np.argmin(np.where(np.arange(len(W.times)) == ja, np.inf, W.times)))
                if W.times[ja] - W.times[jo] > max(s.min_gap_s, s.threshold * W.times[ja]):
                    best = self._try(W, a, ja, [(a, jo)], {a: W}, loads, busy_a, now, need, judge_from(a, ja))
            if best is None:
                break
            make_within(multi)  # before the agents change (a no-op after the first move)
            _, i, b, jb, times, na, nb, before, gain, p_pay = best
            # the moved request carries its expected length from now on (the numbers its move was judged by)
            la = A.view.load
            lm = ServerLoad(la.ctx0, A.mean, la.running, la.replica)
            if b == a:  # a move inside the server: its before/after are the two replicas' times (within view)
                (t2,) = times
                moves.append(Move(int(A.rids[i]), a, b, jb, before, (float(t2[ja]), float(t2[jb])), gain, p_pay))
                ags[a] = self._agent_like(A, la.without(i).plus_from(lm, i, jb), moved=(i, jb))
                lw = W.view.load
                within[a] = self._agent_like(W, lw.without(i).plus_from(
                    ServerLoad(lw.ctx0, W.mean, lw.running, lw.replica), i, jb), moved=(i, jb))
                loads[a] = ags[a].load(now)
            else:
                B = ags[b]
                ta, tb = times
                moves.append(Move(int(A.rids[i]), a, b, jb, before, (na, nb), gain, p_pay))
                ags[b] = _Agent(ServerView(b, B.view.layout, B.view.load.plus_from(lm, i, jb), B.view.busy_until,
                                           B.view.last_switch_end), np.r_[B.rids, A.rids[i]], np.r_[B.rep, jb], tb,
                                np.r_[B.mean, A.mean[i]])
                ags[a] = _Agent(ServerView(a, A.view.layout, la.without(i), A.view.busy_until, A.view.last_switch_end),
                                np.delete(A.rids, i), np.delete(A.rep, i), ta, np.delete(A.mean, i))
                if a in within:  # the within views follow: the request leaves a's, joins b's at its mean
                    within[a] = self._agent_like(ags[a], within[a].view.load.without(i))
                if b in within:
                    within[b] = self._agent_like(ags[b], within[b].view.load.plus_from(lm, i, jb))
                loads[a], loads[b] = na, nb
        self.views_after = {a: g.view for a, g in ags.items()}  # every agent's load once the moves are made
        return moves, first


def freeness(stats: dict) -> float:
    """Llumnix's freeness of an agent: free KV blocks per request it holds (inf when it holds none)."""
    n = stats["num_requests_running"] + stats["num_requests_waiting"]
    free = sum(r["kv_blocks_free"] for r in stats["replicas"])
    return free / n if n else math.inf
