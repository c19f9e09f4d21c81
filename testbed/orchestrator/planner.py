"""The proactive planner (pure): every planning interval, for every generator server, the candidate layouts
(TP/DP splits; EP for MoE) are compared by predicted remaining makespan under the cost model, and the server
switches only when the predicted gain exceeds the switch cost (weight reshard plus KV moves) by a margin.

Remaining lengths come from the length forecast (testbed.orchestrator.forecast): inside every replica the
requests get stratified quantiles of their own conditional remaining length given the tokens they already have
(testbed.orchestrator.estimate.Estimator), so a server holding many requests is predicted with a realistic
long tail rather than with every request at its mean, and the comparison of two layouts carries no sampling
noise. Using each request's conditional *mean* instead would predict no tail at all for a fresh batch (every
request the same length), which is exactly the case the planner exists for.

Attention-FFN disaggregation (running attention and the FFN/experts on different GPUs) is not among the
candidates: the cost model has no term for its activation traffic between the two halves; it is documented
as an option to add (docs/orchestrator.md), not implemented.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from agents.engine import Layout, dense_layouts
from emulation.orchestration import PlannerSettings
from emulation.validation import SpecError

from .estimate import Estimator, ServerLoad
from .interfaces import LayoutPlanner, PolicyContext


def request_levels(rids: np.ndarray, draw: int = 0) -> np.ndarray:
    """A fixed level in (0, 1) per request id (splitmix64 hash): the stratified sample's quantile level.
    ``draw`` > 0: another, independent assignment of the levels to the requests (the hash of another seed)."""
    x = np.asarray(rids, dtype=np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (1 + 2 * draw)) % (1 << 64))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def candidate_layouts(settings: PlannerSettings, gpus: int, moe: bool) -> list[Layout]:
    if settings.layouts:
        return [Layout.parse(name, gpus, f"orchestrator.planner.layouts[{i}]") for i, name in enumerate(settings.layouts)]
    out = dense_layouts(gpus)
    if moe:
        out += [Layout(tp=lay.tp, ep=lay.tp) for lay in out if lay.tp > 1]
    return out


@dataclass
class ServerView:
    """One generator server at a planning tick."""

    server: int
    layout: Layout
    load: ServerLoad
    busy_until: float = 0.0  # a layout switch in progress ends then (engine time)
    last_switch_end: float = -math.inf
    stats: dict | None = None  # the engine's counters at the tick (agents.engine.Engine.stats; None: not asked)


@dataclass
class Decision:
    server: int
    current: Layout
    best: Layout
    predicted_s: dict  # layout name -> predicted remaining makespan (incl. switch cost): the timeline's record
    switch: bool
    gain_s: float
    switch_cost_s: float
    reason: str
    # a switch in progress, cooling down, or worth making but held by the lookahead (beside a balancer: unless
    # this tick's draw, judged against the current layout re-placed, does not clear the margin)
    near_switch: bool = False
    # the gain a tempting switch was judged on again (Planner._judge_again: over several draws of the long
    # requests, against the current layout re-placed); None: not judged again. ``gain_s`` stays the tick's own.
    judged_gain_s: float | None = None

    @classmethod
    def stay(cls, view: ServerView, reason: str) -> "Decision":
        """Keep ``view``'s server in its layout (a plug-in planner's answer)."""
        return cls(view.server, view.layout, view.layout, {}, False, 0.0, 0.0, reason)

    @classmethod
    def to(cls, view: ServerView, layout: Layout, reason: str, gain_s: float = 0.0, cost_s: float = 0.0) -> "Decision":
        """Switch ``view``'s server to ``layout`` now (a plug-in planner's answer; ``gain_s`` and ``cost_s``:
        what it predicted, for the timeline)."""
        return cls(view.server, view.layout, layout, {}, layout != view.layout, gain_s, cost_s, reason,
                   layout != view.layout)


@dataclass
class Planner(LayoutPlanner):
    estimator: Estimator
    switch_cost: object  # agents.engine.StepCost (its switch_s)
    settings: PlannerSettings = field(default_factory=PlannerSettings)
    moe: bool = False
    allowed: tuple = ()  # layouts that hold the model and a longest request (settings.feasible_layouts); () = all
    beside_balancer: bool = False  # a balancer runs on the same servers (PolicyContext.balanced): see _judge_again

    @classmethod
    def create(cls, ctx: PolicyContext, params=None) -> "Planner":
        """The built-in planner of a run: its settings are the scenario's ``orchestrator.planner``."""
        return cls(ctx.estimator, ctx.cost, ctx.settings.planner, ctx.moe, tuple(ctx.layouts), ctx.balanced)

    def __post_init__(self) -> None:
        self._ticks = 0
        self._pruned: dict[tuple, int] = {}  # (layout, server) -> the tick it is looked at again
        # server -> consecutive ticks its switch was held back only by the re-placement (beside a balancer)
        self._held: dict[int, int] = {}
        self.candidates = [c for c in candidate_layouts(self.settings, self.estimator.gpus, self.moe)
                           if not self.allowed or c in self.allowed]
        if not self.candidates:
            raise SpecError("orchestrator.planner.layouts", "no candidate layout holds the model and a longest response")
        for lay in self.candidates:
            lay.check(self.estimator.gpus, "orchestrator.planner.layouts")
            self.estimator.decode_floor_s(lay.tp)  # the lookahead's bound's floors made now, not in a tick (~0.5 ms each)

    def _margin(self, current: Layout) -> float:
        """The share of a server's remaining makespan a switch's gain must exceed: PlannerSettings.gain_margin, or
        beside a balancer its balanced_gain_margin where the server's ``current`` layout has several replicas
        (the balancer's levelling of them is what a switch undoes; a single replica has none to undo)."""
        bal = self.settings.balanced_gain_margin
        several = current.replicas(self.estimator.gpus) > 1
        return bal if self.beside_balancer and bal is not None and several else self.settings.gain_margin

    def _need(self, current: Layout, base: float) -> float:
        """The gain a switch from ``current`` must exceed, for a server whose remaining makespan keeping it is
        ``base``: min_gain_s, or the margin's share of ``base`` where larger (the tick, the judgement and the
        near-a-switch judgement of a held-back server all ask this)."""
        return max(self.settings.min_gain_s, self._margin(current) * base)

    def _all_times(self, views: dict, now: float, prune: bool = False, remember: bool = True,
                   fresh: bool = False, bounded: frozenset = frozenset()) -> dict:
        """For every server: {layout: predicted remaining time with that layout, its switch cost and a
        switch in progress included}, every server evaluated in one pass per layout (``prune``: but the
        candidates pruned for it, see PlannerSettings.prune_ratio; ``remember``, ``fresh``: as
        Estimator.servers_s_many's, for loads no later call asks for, and for those no call has seen either;
        ``bounded``: (layout, server) cells not estimated, a candidate left out and the current layout inf,
        as pruned ones are: the lookahead's cells that cannot beat switching now)."""
        est = self.estimator
        loads = {s: v.load for s, v in views.items()}
        currents = {s: v.layout for s, v in views.items()}
        out = {s: {} for s in views}
        lays = self.candidates + [lay for lay in {v.layout for v in views.values()} if lay not in self.candidates]
        skip = bounded | frozenset((lay, s) for (lay, s), until in self._pruned.items()
                                   if prune and until > self._ticks and s in views and lay != views[s].layout)
        times = est.servers_s_many(lays, loads, currents, skip, remember=remember, fresh=fresh)
        kv = {s: v.load.kv_held for s, v in views.items()}
        for lay in lays:
            t = times[lay]
            for s, v in views.items():
                busy = max(0.0, v.busy_until - now)
                if lay == v.layout:
                    out[s][lay] = (t[s] + busy, 0.0)
                elif lay in self.candidates and (lay, s) not in skip:
                    cost = float(self.switch_cost.switch_s(v.layout, lay, kv[s]))
                    out[s][lay] = (t[s] + cost + busy, cost)
        return out

    def evaluate_all(self, views: dict, now: float, interval: float | None = None) -> dict:
        """A decision for every server (see :meth:`evaluate`)."""
        gpus = self.estimator.gpus
        self._ticks += 1
        times = self._all_times(views, now, prune=self.settings.prune_ticks > 0)
        if self.settings.prune_ticks:
            for s, ts in times.items():
                best_t = min(t for t, _ in ts.values())
                for lay, (t, _) in ts.items():
                    if lay != views[s].layout and t > self.settings.prune_ratio * best_t:
                        self._pruned[(lay, s)] = self._ticks + self.settings.prune_ticks
        out = {}
        for s, v in views.items():
            cur = v.layout
            pred = {lay.name(gpus): t for lay, (t, _) in times[s].items()}
            base = times[s][cur][0]
            best = min(times[s], key=lambda lay: (times[s][lay][0], lay != cur, lay.tp))
            best_t, best_cost = times[s][best]
            gain = base - best_t
            need = self._need(cur, base)
            if best == cur:
                reason, switch = "current layout is predicted fastest", False
            elif v.busy_until > now:
                reason, switch = "a switch is in progress", False
            elif now - v.last_switch_end < self.settings.cooldown_s:
                reason, switch = "cooldown after the last switch", False
            elif gain <= need:
                reason, switch = f"gain {gain:.2f} s does not exceed {need:.2f} s", False
            else:
                reason, switch = f"gain {gain:.2f} s beyond the switch cost {best_cost:.2f} s", True
            near = switch or v.busy_until > now or now - v.last_switch_end < self.settings.cooldown_s
            out[s] = Decision(s, cur, best, pred, switch, gain, best_cost, reason, near)
        switching = [s for s, d in out.items() if d.switch]
        for s in [s for s in self._held if s not in switching]:  # held back on consecutive ticks only
            del self._held[s]
        waiting = {}
        if switching and self.settings.lookahead and interval:
            # would it pay to wait (one interval, or longer) and switch then (to the then-best layout)? Asked
            # before the judgement: a switch the lookahead holds back is not made this tick whatever the
            # judgement says, and the judgement is a tempting tick's largest cost (10 estimates of a server beside
            # a balancer, against the lookahead's ~2.5): on a step's first ticks every server is tempted and
            # waits, tick after tick (docs/orchestrator.md "The lookahead before the judgement")
            tempted = {s: times[s][out[s].best][0] for s in switching}
            waits, strat = self._lookahead(views, tempted, interval)
            # in two stages: one interval first, the later points only for the servers one interval did not hold
            # back. Whether a server waits is the same either way (it waits where any point beats switching now);
            # where one interval does, the reason names that plan, not a later point's that may beat it by more
            # (on the bench's states one interval held back about half the tempted servers, the later points none
            # of the rest: docs/orchestrator.md "The lookahead in two stages")
            waiting = self._waits(views, tempted, waits[:1], now, 0, strat)
            rest = {s: t for s, t in tempted.items() if s not in waiting}
            if rest and len(waits) > 1:
                waiting.update(self._waits(views, rest, waits[1:], now, 1, strat))
            for s, (t_wait, dt, l2) in waiting.items():
                d = out[s]
                out[s] = replace(d, switch=False, near_switch=True, reason=(
                    f"gain {d.gain_s:.2f} s now, but {dt:g} s later {l2.name(gpus)} is predicted "
                    f"to finish {tempted[s] - t_wait:.2f} s sooner: waiting"))
                self._held.pop(s, None)  # a tick the re-placement did not hold it back: not in a row
            self._near_of_waiting(views, out, times, list(waiting), now)
        judged = [s for s in switching if s not in waiting]
        if judged and (self.beside_balancer or self.settings.confirm_draws > 1):
            self._judge_again(views, out, times, judged, now)
        return out

    def _near_of_waiting(self, views: dict, out: dict, times: dict, servers: list, now: float) -> None:
        """Whether the servers the lookahead holds back (``servers``) are near a switch, which the balancer beside
        the planner leaves alone. Beside a balancer that the judgement credits with the current layout re-placed
        (``replace_patience`` > 0): only where this tick's draw, judged against the better of the current
        placement and the current layout re-dealt as :meth:`_judge_again` judges it, still clears the margin; a
        server whose switch the re-placement would hold back is the balancer's to level (one estimate a server,
        against the judgement's ten). Otherwise every one (the lookahead plans its switch)."""
        if not servers or not (self.beside_balancer and self.settings.replace_patience > 0):
            return
        lays = list(dict.fromkeys(views[s].layout for s in servers))
        skip = frozenset((lay, s) for lay in lays for s in servers if lay != views[s].layout)
        redealt = self.estimator.servers_s_many(lays, {s: views[s].load for s in servers}, dict.fromkeys(servers),
                                                skip, remember=False)
        for s in servers:
            v, d = views[s], out[s]
            busy = max(0.0, v.busy_until - now)
            placed, end = times[s][v.layout][0] - busy, times[s][d.best][0] - busy
            gain = min(placed, redealt[v.layout][s]) - end
            need = self._need(v.layout, times[s][v.layout][0])
            if gain <= need:
                out[s] = replace(d, near_switch=False, reason=d.reason + (
                    f" (against the current layout re-placed {gain:.2f} s, not beyond {need:.2f} s: left to the "
                    "balancer)"))

    def _lookahead(self, views: dict, tempted: dict, interval: float) -> tuple[list, bool]:
        """The lookahead's points for the servers of ``tempted`` (server -> the predicted end of switching now):
        one interval, and k/(n+1) of the longest switch's end (``lookahead_points`` n) where later than that; and
        whether every load is stratified: loads that all carry what stratifying needs are estimated on the
        forecast's quantiles, never on their rem, so it is not asked of the forecast for them (advanced without
        Estimator.advance_many's mean)."""
        n = self.settings.lookahead_points
        span = max(tempted.values())
        waits = [interval] + [span * k / (n + 1) for k in range(1, n + 1) if span * k / (n + 1) > interval]
        strat = all(views[s].load.gen is not None and views[s].load.key is not None for s in tempted)
        return waits, strat

    def _waits(self, views: dict, tempted: dict, waits: list, now: float, first: int, strat: bool) -> dict:
        """The lookahead at the points ``waits`` (seconds from now) for the servers of ``tempted`` (server -> the
        predicted end of switching now): {server: (predicted end, wait, then-best layout)} of the plan of
        keeping the layout that long and switching then that is predicted to end first, for the servers where
        one beats switching now. ``first``: the first point's index among the lookahead's; ``strat``: every load
        is stratified (the loads advanced without the forecast's mean)."""
        # every point's loads in one pass of the estimator (each server's result is the one it gets alone);
        # none is asked for again, so none is remembered
        est = self.estimator
        aheads = est.advance_many_at([(views[s].layout, views[s].load) for s in tempted], waits, mean=not strat)
        # a point no sooner than the switch's own end cannot beat it (a time is never negative): not estimated
        cells = [(s, j, ld) for j, ahead in enumerate(aheads) for s, ld in zip(tempted, ahead)
                 if ld.n and waits[j] < tempted[s]]
        # nor a layout at a point where its estimate is bounded below by one that cannot beat it: the point's
        # longest request alone, at the layout's shortest decode step (Estimator.makespan_floor_s). On the bench's
        # states that is ~2/3 of the lookahead's cells, mostly its later points' (docs/orchestrator.md "The
        # lookahead's bound"). The remaining tokens the bound reads are those the estimate uses, so the loads are
        # handed on with them (and without their keys: not stratified again); what is estimated, and so every
        # decision and reason, is the same as estimating every cell
        rems = est.estimated_rems([ld for _, _, ld in cells])
        # the bound holds where the estimate uses what it read: every load's quantiles (any subset of them is
        # stratified alike), or no load's (none can be); a mix (one server without keys) stratifies none of
        # them here, and a subset estimated without that server would be: no bound then
        sound = (all(rem is not ld.rem for (_, _, ld), rem in zip(cells, rems))
                 or not any(est.stratifiable(ld) for _, _, ld in cells))
        later, bounded = {}, set()
        for (s, j, ld), rem in zip(cells, rems):
            lays = self.candidates + ([views[s].layout] if views[s].layout not in self.candidates else [])
            out = []
            if sound:
                longest = float(rem.max())
                out = [lay for lay in lays if waits[j] + est.makespan_floor_s(lay, longest) >= tempted[s]]
            if len(out) == len(lays):
                continue  # no plan at this point can beat switching now
            later[(s, first + j)] = (ld, rem)
            bounded.update((lay, (s, first + j)) for lay in out)
        # every load placed (no arrival, whose placement reads rem: Estimator._as_placed) and stratified: all of
        # them handed on with their quantiles; else all as they are (the estimate stratifies all or none)
        swap = all(rem is not ld.rem and bool((ld.replica >= 0).all()) for ld, rem in later.values())
        later = {key: ServerView(key[0], views[key[0]].layout, replace(ld, rem=rem, key=None) if swap else ld)
                 for key, (ld, rem) in later.items()}
        t2 = self._all_times(later, now, fresh=True, bounded=frozenset(bounded)) if later else {}
        waiting = {}
        for j, dt in enumerate(waits):
            for s, best_t in tempted.items():
                if (s, first + j) not in t2:
                    continue
                t2s = t2[(s, first + j)]
                l2 = min(t2s, key=lambda lay: t2s[lay][0])
                if dt + t2s[l2][0] < best_t and (s not in waiting or dt + t2s[l2][0] < waiting[s][0]):
                    waiting[s] = (dt + t2s[l2][0], dt, l2)
        return waiting

    def step_end(self, step: int, states: dict) -> None:
        """A step's generation ended: what the ticks counted of it (the switches held back by the re-placement)
        is forgotten."""
        self._held.clear()

    def _judge_again(self, views: dict, out: dict, times: dict, servers: list, now: float) -> None:
        """The switches the tick's estimate finds worth it (``servers``), judged again before they are made;
        a switch stays only if its gain, as below and averaged over the draws, still exceeds the margin:

        * over ``confirm_draws`` draws of which requests are the long ones: the stratified levels dealt by
          other hashes of the request ids (:func:`request_levels`). One draw makes some requests the long
          ones, and the current placement and a candidate's deal co-locate them differently: a gain that is
          one draw's luck does not hold over several (a planner that switched on it flapped: 24 switches in
          a step of 4 servers under vllm-v0, each predicted to gain 16-56 s; docs/orchestrator.md);
        * beside a balancer (``beside_balancer``), against the better of the current placement and the
          current layout with its requests re-dealt as the engine deals them after a switch: the balancer
          reaches a better placement without a switch, so only the rest of the gain is the layout's (a
          switching server is out of the balancer's reach while it switches). For ``replace_patience`` ticks in
          a row: after that many ticks of a switch held back only by that re-placement, the balancer has not
          reached it (its one-request moves cannot lower a replica whose end is set by several long requests),
          and the switch is judged against the placement as it is."""
        est = self.estimator
        draws = self.settings.confirm_draws
        # the re-placement is estimated only where it can hold a switch back (patience 0: it never does alone,
        # and a switch it does not hold back is made on the gain as placed)
        replaced = self.beside_balancer and self.settings.replace_patience > 0
        loads, currents, todo = {}, {}, {}
        for s in servers:  # every server's other draws (and re-deals) in one pass of the estimator
            v = views[s]
            ks = range(1, draws) if v.load.rid is not None and v.load.key is not None else ()
            todo[s] = list(ks)
            for k in ks:
                ld = replace(v.load, key=request_levels(v.load.rid, k))
                loads[(s, k, 0)], currents[(s, k, 0)] = ld, v.layout  # as it is placed
                if replaced:
                    loads[(s, k, 1)], currents[(s, k, 1)] = ld, None  # re-dealt as after a switch
            if replaced:  # this tick's draw re-dealt (as placed, and the candidate: the tick's own)
                loads[(s, 0, 1)], currents[(s, 0, 1)] = v.load, None
        lays = list(dict.fromkeys(lay for s in servers for lay in (views[s].layout, out[s].best)))
        skip = frozenset((lay, key) for lay in lays for key in loads
                         if lay not in (views[key[0]].layout, out[key[0]].best)
                         or (key[2] == 1 and lay != views[key[0]].layout))
        t = est.servers_s_many(lays, loads, currents, skip, remember=False) if loads else {}
        for s in servers:
            v, d = views[s], out[s]
            cur, best = v.layout, d.best
            busy = max(0.0, v.busy_until - now)
            cost = times[s][best][1]
            keys = [0] + todo[s]
            ends = [times[s][best][0] - busy] + [t[best][(s, k, 0)] + cost for k in todo[s]]
            placed = [times[s][cur][0] - busy] + [t[cur][(s, k, 0)] for k in todo[s]]
            gain = as_placed = float(np.mean([b - e for b, e in zip(placed, ends)]))
            need = self._need(cur, times[s][cur][0])
            draws_s = f" over {len(ends)} draws of the lengths" if len(ends) > 1 else ""
            what = f"{gain:.2f} s{draws_s}"
            if replaced:
                gain = float(np.mean([min(b, t[cur][(s, k, 1)]) - e for b, k, e in zip(placed, keys, ends)]))
                if gain <= need < as_placed:  # only the re-placement the balancer is trusted to reach holds it back
                    self._held[s] = self._held.get(s, 0) + 1
                else:
                    self._held.pop(s, None)
                if self._held.get(s, 0) > self.settings.replace_patience:
                    what += (f" as placed (the current layout re-placed, {gain:.2f} s, held it back "
                             f"{self._held[s] - 1} ticks: the balancer has not reached it)")
                    gain = as_placed
                else:
                    what = f"{gain:.2f} s{draws_s} against the current layout re-placed"
            verdict = (f"does not exceed {need:.2f} s" if gain <= need
                       else f"beyond the switch cost {d.switch_cost_s:.2f} s")
            sep = ":" if gain <= need else ","
            # a switch the judgement holds back leaves the server steady: the balancer beside the planner may level
            # it (a server near a switch is left alone, testbed/planning.py), the very levelling the re-placement
            # credits it with
            out[s] = replace(d, switch=gain > need, near_switch=gain > need, judged_gain_s=gain,
                             reason=f"gain {d.gain_s:.2f} s on this tick's estimate, {what}{sep} {verdict}")

    def evaluate(self, view: ServerView, now: float, interval: float | None = None) -> Decision:
        """Whether ``view``'s server should switch now, and to which layout: the candidate with the smallest
        predicted remaining makespan, its switch cost included, if it gains more than the hysteresis margin
        over the current one, no switch is in progress or cooling down, and (lookahead) waiting one planning
        interval is not predicted to do better."""
        return self.evaluate_all({view.server: view}, now, interval)[view.server]

    def initial(self, view: ServerView, charged: bool = True) -> Decision:
        """At a step's start (its requests not started yet): the layout for the step. ``charged``: a change
        from the server's current layout pays the switch the cost model gives (weight reshard and the fixed
        re-initialisation; no KV to move), as any switch does, and the current layout is kept unless another is
        predicted faster, its cost included, by more than the hysteresis margin. Not charged (the run's first
        step, whose weights are loaded in whatever layout is chosen, as every static layout's are): the layout
        the server was loaded in (the policy's start: the tuned static layout; the smallest-TP candidate where
        it is not a candidate) unless another is predicted faster by the margin. The margin matters most here:
        at a full batch the layouts' predictions are close, the forecast knows nothing of this step's requests
        yet, and a wrong start is paid for the whole bulk of the step (the tail is the planner's job later)."""
        gpus = self.estimator.gpus
        default = view.layout if view.layout in self.candidates else self.candidates[0]
        cost = {lay: (float(self.switch_cost.switch_s(view.layout, lay, 0.0)) if charged and lay != view.layout
                      else 0.0) for lay in self.candidates}
        plans = self._plans(view.load, default)
        times = {lay: plans[lay][0] + cost[lay] for lay in self.candidates}
        base = times[default]
        best = min(times, key=lambda lay: (times[lay], lay != default, lay.tp))
        gain = base - times[best]
        need = max(self.settings.min_gain_s, self.settings.initial_margin * base)
        pick = best if gain > need else default
        what = "predicted fastest" if pick == best else ("the current layout" if charged else "the starting layout")
        then = plans[pick][1]
        later = "" if then is None else f", then {then[0].name(gpus)} after {then[1]:.1f} s"
        return Decision(view.server, view.layout, pick,
                        {lay.name(gpus): t for lay, t in times.items()}, pick != view.layout, gain, cost[pick],
                        f"initial layout for the step ({what}{later}; best {best.name(gpus)} gains {gain:.2f} s "
                        f"{'with' if charged else 'without'} its switch cost, margin {need:.2f} s)")

    def _plans(self, load, default: Layout) -> dict:
        """Per candidate: (its predicted time for the step with at most one later switch, (the layout switched
        to, after how long) or None), the switch tried after ``k/(n+1)`` of the default layout's predicted time
        (``initial_switch_points`` n) and paid what the cost model says for the KV then held. A layout that
        is best for the bulk of a fresh batch is often not for its tail: judged on the whole step alone, the
        throughput layout and the latency one predict within a few percent of each other and the start keeps
        whichever it has (short-7b: the tuned TP8x1@512 kept, against the switch oracle's 1.054-1.063 for
        TP1x8 then TP8x1)."""
        est = self.estimator
        plans = {lay: (est.server_s(lay, load), None) for lay in self.candidates}
        n = self.settings.initial_switch_points
        if not n or not load.n:
            return plans
        span = plans[default][0]
        for k in range(1, n + 1):
            dt = span * k / (n + 1)
            ahead = est.advance_many([(lay, load) for lay in self.candidates], dt)
            for lay, ld in zip(self.candidates, ahead):
                if not ld.n:
                    continue
                kv = ld.kv_held
                for to in self.candidates:
                    if to == lay:
                        continue
                    t = dt + float(self.switch_cost.switch_s(lay, to, kv)) + est.server_s(to, ld, current=lay)
                    if t < plans[lay][0]:
                        plans[lay] = (t, (to, dt))
        return plans


def loads_from_snapshot(snap: dict, forecast, shift: np.ndarray | None = None) -> ServerLoad:
    """A server's :class:`ServerLoad` from an engine snapshot (agents.engine.Engine.snapshot) and a forecast:
    expected remaining tokens (conditional mean), plus what the estimator's stratified quantiles need;
    ``shift``: each request's log-offset from its prompt group (forecast.prompt_shifts; None: none).
    :func:`loads_from_snapshots` of the one server."""
    return loads_from_snapshots({0: snap}, forecast, {0: shift})[0]


def loads_from_snapshots(snaps: dict, forecast, shifts: dict | None = None) -> dict:
    """:func:`loads_from_snapshot` of every server of ``snaps`` (server -> snapshot; ``shifts``: server -> its
    requests' prompt shifts, a server not in it has none): {server: ServerLoad}, in ``snaps``' order. The
    forecast's remaining lengths and the requests' levels of all servers come from one call each (both are
    elementwise: the same numbers as server by server, ~0.1 ms a server less on 2 cores); the servers with a
    prompt shift and those without are asked apart (a zero shift's arithmetic differs in the last bits)."""
    shifts = shifts or {}
    out = {}
    for shifted in (False, True):
        ss = [s for s in snaps if (shifts.get(s) is not None) == shifted]
        if not ss:
            continue
        gens = [snaps[s]["generated"].astype(np.float64) for s in ss]
        g = np.concatenate(gens)
        rem = np.maximum(forecast.remaining(g, np.concatenate([shifts[s] for s in ss]) if shifted else None), 1.0)
        key = request_levels(np.concatenate([snaps[s]["rid"] for s in ss]))
        ends = np.cumsum([0] + [len(x) for x in gens]).tolist()
        for q, s in enumerate(ss):
            snap, lo, hi = snaps[s], ends[q], ends[q + 1]
            out[s] = ServerLoad(ctx0=(snap["prompt"] + snap["generated"]).astype(np.float64), rem=rem[lo:hi],
                                running=snap["running"].astype(bool), replica=snap["replica"].astype(np.int64),
                                gen=gens[q], key=key[lo:hi], shift=shifts.get(s), rid=snap["rid"].astype(np.int64))
    return {s: out[s] for s in snaps}
