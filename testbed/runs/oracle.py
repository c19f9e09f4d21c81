"""Oracle bounds: what a policy that knows every response length in advance could do on a scenario.

Every policy is reported as a fraction of its own oracle (``oracle_fraction`` in report.json): the gain it
made over the tuned static baseline divided by the gain the oracle of its kind makes over the same baseline.
Each step is searched separately, on the very engine the backends run (agents.engine, virtual time: exact
schedules, not estimates), with the step's real lengths and the driver's own deal of requests to servers
(the same seeded streams). What each oracle searches, and what it does not:

``switch`` (layout switches only; the planner's kind): per server, a start configuration (any feasible layout
  x any max_num_seqs of the tuning grid) and at most one switch to any other layout at a time on a grid
  (:data:`SWITCH_FRACTIONS` of that server's static makespan, refined around the best), its cost charged as the cost model gives it.
  Requests stay where the deal put them. Not searched: two or more switches (the estimator finds that a
  second one gains nothing measurable on these workloads), switches at other times.
``placement`` (placement and migrations only; the balancer's kind): one static configuration for every
  server (any of the grid), every request placed on a replica of any server before it starts (a migration at
  time 0, which moves no KV and costs nothing): longest first onto the replica with the least work, in
  tokens (LPT), and a variant that gives each long request a replica of its own first. Not searched: later
  migrations (with every length known, a good start placement needs none).
``both`` (the orchestrator's kind): per-server layouts that may differ (a "lane": ``k`` servers at a large-TP
  layout hold the ``m`` longest requests, the others run the rest at a small-TP layout, each group placed by
  LPT), then the ``switch`` search on every server of the best lane plan; the best of that, ``switch`` and
  ``placement``. Not searched: layouts that mix TP degrees inside one server (the engine has none), other
  partitions than longest-first.

``floor``: the longest response generated alone at the fastest layout (prefill plus its decode steps at
batch 1): no policy of any kind finishes a step sooner.

Searching uses the estimator (testbed.orchestrator.estimate) with the true lengths to rank candidates
(within 0.5% of the engine on the scenarios measured: docs/orchestrator.md), and the engine to evaluate the
best few of each kind: every reported makespan is an engine schedule, something a policy could realise.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from agents.costmodel import CostModel
from agents.engine import Engine, Layout, ModelledCost, NewRequest, kv_blocks_needed
from emulation.orchestration import EngineSettings
from emulation.workload import LengthSchedule
from testbed.orchestrator.estimate import Estimator, ServerLoad
from testbed.orchestrator.interfaces import Batch, PolicyContext
from testbed.orchestrator.policies import feasible_layouts, scenario_dispatch
from testbed.runs.tuning import GRID

SWITCH_STEP = 0.1
SWITCH_FRACTIONS = tuple(np.round(np.arange(0.1, 0.95, SWITCH_STEP), 2))  # switch times, fractions of the static
# makespan (then refined halfway to the neighbours of the best)
LANE_SHARES = (1, 2, 4, 8, 16, 32, 64, 128)  # longest requests per lane replica tried by the lane search
VERIFY = 3  # candidates of each search evaluated on the engine


@dataclass(frozen=True)
class Config:
    layout: Layout
    max_num_seqs: int


@dataclass
class ServerPlan:
    """One server's part of a plan: its configuration, its requests (indices into the step's lengths) and
    their replicas (None: the engine's chunked deal, as veRL dispatches), and an optional switch."""

    config: Config
    requests: np.ndarray
    replica: np.ndarray | None = None
    switch: tuple[float, Layout] | None = None  # (time, new layout)


@dataclass
class OracleStep:
    step: int
    static_s: float  # the tuned static configuration's generation makespan (engine)
    results: dict = field(default_factory=dict)  # kind -> {"makespan_s", "plan"}
    floor_s: float = 0.0


class Oracle:
    """Oracle bounds of one scenario (see the module docstring). ``grid``: the max_num_seqs values searched
    (the tuning grid's); ``tuned``: (layout name, max_num_seqs) of the tuned static configuration."""

    def __init__(self, scenario, tuned: tuple[str, int], grid: tuple[int, ...] = GRID, steps: int | None = None):
        self.scn = scenario
        w = scenario.workload
        self.w = w
        self.settings = scenario.orchestrator
        self.cm = CostModel.for_engine(w.model, w.gpu, self.settings.engine)
        self.gpus = scenario.fabric.gpus_per_server
        self.cost = ModelledCost(self.cm, self.gpus, self.settings.engine.switch_reinit_s)
        self._costs: dict[int, ModelledCost] = {}
        self.layouts = feasible_layouts(self.cm, self.gpus, self.settings.engine, w.prompt_tokens,
                                        w.max_response_tokens)
        self.grid = tuple(sorted(set(grid)))
        self.configs = [Config(lay, m) for lay in self.layouts for m in self.grid]
        self.tuned = Config(Layout.parse(tuned[0], self.gpus), int(tuned[1]))
        self.steps = steps if steps is not None else w.steps
        self.servers = scenario.layout.gen_servers(scenario.fabric)
        self._est: dict[int, Estimator] = {}

    # ---- the step's requests, as the driver makes them ----
    def step_cases(self) -> list[tuple[int, np.ndarray, dict[int, np.ndarray]]]:
        sch = LengthSchedule(self.w)
        rng_lengths = np.random.default_rng([self.scn.seed, 0])
        rng_deal = np.random.default_rng([self.scn.seed, 2])
        dispatcher = scenario_dispatch(self.settings).create(PolicyContext(
            Estimator(self.cm, self.gpus, self.settings.engine), self.cost, self.cm, self.gpus, tuple(self.layouts),
            self.cm.model.is_moe, self.settings, tuple(self.servers), self.w.prompt_tokens, self.w.max_response_tokens,
            lambda: 0.0, np.random.default_rng([self.scn.seed, 3])))
        out = []
        for k in range(self.steps):
            lengths = sch.lengths_for_step(k, rng_lengths)
            out.append((k, np.asarray(lengths, np.int64),
                        self._deal(dispatcher, k, sch.prompt_ids_for_step(k), len(lengths), rng_deal)))
        return out

    def _deal(self, dispatcher, step: int, pid: np.ndarray, n: int, rng: np.random.Generator) -> dict[int, np.ndarray]:
        """The scenario's dispatcher's deal of the step's ``n`` requests of prompts ``pid`` (what it holds back is
        dealt round robin: the bounds place every request anyway)."""
        d = dispatcher.deal(Batch(step, n, pid, np.full(n, self.w.prompt_tokens, np.int64), tuple(self.servers),
                                  {s: self.tuned.layout for s in self.servers}, None, rng))
        placed = {s: np.asarray(d.placed.get(s, ()), np.int64) for s in self.servers}
        for j, i in enumerate(np.sort(np.asarray(d.held, np.int64))):
            s = self.servers[j % len(self.servers)]
            placed[s] = np.append(placed[s], i)
        return placed

    # ---- engine runs ----
    def _settings(self, mns: int) -> EngineSettings:
        e = self.settings.engine
        return dataclasses.replace(e, max_num_seqs=mns, max_num_batched_tokens=max(e.max_num_batched_tokens, mns))

    def _cost(self, mns: int) -> ModelledCost:
        """The engine's cost at ``max_num_seqs`` ``mns`` (its CUDA-graph cap and KV sizing follow it)."""
        if mns not in self._costs:
            self._costs[mns] = ModelledCost(CostModel.for_engine(self.w.model, self.w.gpu, self._settings(mns)),
                                            self.gpus, self.settings.engine.switch_reinit_s)
        return self._costs[mns]

    def _engine(self, plan: ServerPlan, lengths: np.ndarray) -> Engine | None:
        try:
            mns = plan.config.max_num_seqs
            e = Engine(self._cost(mns), self.gpus, plan.config.layout, self._settings(mns))
        except Exception:  # noqa: BLE001 - the layout holds no KV for this model
            return None
        reqs = [NewRequest(rid=int(i), prompt=self.w.prompt_tokens, target=int(lengths[i])) for i in plan.requests]
        if plan.replica is None:
            e.add(reqs, 0.0, chunked=True)
        else:
            for j in range(plan.config.layout.replicas(self.gpus)):
                sel = [r for r, k in zip(reqs, plan.replica) if k == j]
                if sel:
                    e.add(sel, 0.0, replica=j)
        return e

    def run(self, plan: ServerPlan, lengths: np.ndarray) -> float:
        """The server's generation makespan under ``plan`` on the engine (inf: the plan does not fit)."""
        if not len(plan.requests):
            return 0.0
        e = self._engine(plan, lengths)
        if e is None:
            return math.inf
        if plan.switch is not None:
            t, lay = plan.switch
            e.run_until(t)
            if e.idle():
                return e.last_end
            try:
                e.set_layout(lay, t)
            except Exception:  # noqa: BLE001 - a request does not fit the new layout's KV
                return math.inf
        e.run_until(math.inf)
        return e.last_end

    # ---- estimates (ranking only) ----
    def _estimator(self, mns: int) -> Estimator:
        if mns not in self._est:
            self._est[mns] = Estimator(self._cost(mns).cm, self.gpus, self._settings(mns))
        return self._est[mns]

    def estimate(self, plan: ServerPlan, lengths: np.ndarray) -> float:
        n = len(plan.requests)
        if not n:
            return 0.0
        lay = plan.config.layout
        r = lay.replicas(self.gpus)
        rep = plan.replica if plan.replica is not None else np.arange(n) * r // n
        load = ServerLoad(np.full(n, float(self.w.prompt_tokens)), lengths[plan.requests].astype(float),
                          np.zeros(n, bool), np.asarray(rep, np.int64))
        try:
            return float(self._estimator(plan.config.max_num_seqs).server_s(lay, load, current=lay))
        except Exception:  # noqa: BLE001
            return math.inf

    def _fits(self, cfg: Config, lengths: np.ndarray) -> bool:
        kv = self._cost(cfg.max_num_seqs).kv_capacity_tokens(cfg.layout, self.settings.engine.gpu_memory_utilization)
        bs = self.settings.engine.block_size
        return bool(len(lengths) == 0 or kv_blocks_needed(self.w.prompt_tokens, int(lengths.max()), bs) * bs <= kv)

    # ---- the searches ----
    def static(self, lengths, placed, cfg: Config) -> float:
        return max(self.run(ServerPlan(cfg, idx), lengths) for idx in placed.values())

    def switch_only(self, lengths, placed) -> tuple[float, list[ServerPlan]]:
        plans = []
        for s, idx in placed.items():
            plans.append(self._best_switch(lengths, idx, None))
        return max(self.run(p, lengths) for p in plans), plans

    def _best_switch(self, lengths, idx, replica, configs=None) -> ServerPlan:
        """The best start configuration and single switch of one server: every candidate ranked by the
        estimator (the state at the switch time from its schedule's progress), the best few run on the engine.
        Switch times: the coarse grid first, then halfway to the neighbours of each configuration's best one."""
        cands = []
        n = len(idx)
        for cfg in configs or self.configs:
            if not self._fits(cfg, lengths[idx]):
                continue
            base = ServerPlan(cfg, idx, replica)
            lay, mns = cfg.layout, cfg.max_num_seqs
            est = self._estimator(mns)
            r = lay.replicas(self.gpus)
            rep = np.asarray(replica if replica is not None else np.arange(n) * r // n, np.int64)
            L = lengths[idx].astype(float)
            ctx0 = np.full(n, float(self.w.prompt_tokens))
            t_static = self.estimate(base, lengths)
            if not math.isfinite(t_static):
                continue
            cands.append((t_static, base))
            mine = []
            for fracs in (SWITCH_FRACTIONS, None):
                if fracs is None:
                    if not mine:
                        break
                    f0 = min(mine, key=lambda c: c[0])[2]
                    fracs = (f0 - SWITCH_STEP / 2, f0 + SWITCH_STEP / 2)
                for f in fracs:
                    t = float(f) * t_static
                    if t <= 0:
                        continue
                    got = est.progress(lay, ctx0, L, np.zeros(n, bool), t, rep, r)
                    left = L - got
                    live = left > 0
                    if not live.any():
                        continue
                    load = ServerLoad(ctx0[live] + got[live], left[live], got[live] > 0, np.full(int(live.sum()), -1))
                    kv = load.kv_held
                    for lay2 in self.layouts:
                        if lay2 == lay:
                            continue
                        try:
                            v = t + float(self.cost.switch_s(lay, lay2, kv)) + est.server_s(lay2, load)
                        except Exception:  # noqa: BLE001 - a request does not fit the new layout's KV
                            continue
                        mine.append((v, dataclasses.replace(base, switch=(t, lay2)), f))
            cands += [(c[0], c[1]) for c in mine]
        cands.sort(key=lambda c: c[0])
        best = None
        keep = [c for c in cands if c[1].switch is None and c[1].config == self.tuned][:1]  # never worse than it
        for _, plan in cands[:VERIFY] + [c for c in cands if c[1].switch is None][:1] + keep:
            ms = self.run(plan, lengths)
            if best is None or ms < best[0]:
                best = (ms, plan)
        return best[1]

    def _lpt(self, lengths, idx: np.ndarray, slots: list[tuple[int, int]], isolate: bool) -> dict:
        """Requests ``idx`` onto ``slots`` ((server, replica) pairs), longest first onto the slot with the least
        tokens (a heap of (tokens, slot): the lowest slot among equals); ``isolate``: the len(slots) longest
        first get a slot each."""
        order = idx[np.argsort(-lengths[idx], kind="stable")].tolist()
        load = [0] * len(slots)
        pick = []
        head = min(len(slots), len(order)) if isolate else 0
        for q in range(head):
            load[q] = int(lengths[order[q]])
            pick.append(q)
        heap = [(t, j) for j, t in enumerate(load)]
        heapq.heapify(heap)
        for i in order[head:]:
            tok, j = heap[0]
            heapq.heapreplace(heap, (tok + int(lengths[i]), j))
            pick.append(j)
        out: dict[int, list] = {}
        for i, j in zip(order, pick):
            s, r = slots[j]
            out.setdefault(s, []).append((int(i), r))
        return out

    def _plans_from(self, assign: dict, cfgs: dict[int, Config]) -> list[ServerPlan]:
        plans = []
        for s, cfg in cfgs.items():
            got = assign.get(s, [])
            plans.append(ServerPlan(cfg, np.array([i for i, _ in got], np.int64), np.array([r for _, r in got], np.int64)))
        return plans

    def placement_only(self, lengths, placed) -> tuple[float, list[ServerPlan]]:
        """The best LPT placement over every configuration (the best few by estimate run on the engine), or
        the deal as it is on the tuned configuration when no placement beats it."""
        idx = np.concatenate(list(placed.values()))
        cands = []
        for cfg in self.configs:
            if not self._fits(cfg, lengths):
                continue
            slots = [(s, r) for s in placed for r in range(cfg.layout.replicas(self.gpus))]
            for iso in (False, True):
                plans = self._plans_from(self._lpt(lengths, idx, slots, iso), {s: cfg for s in placed})
                cands.append((max(self.estimate(p, lengths) for p in plans), plans))
        cands.sort(key=lambda c: c[0])
        best = (self.static(lengths, placed, self.tuned), [ServerPlan(self.tuned, i) for i in placed.values()])
        for _, plans in cands[:VERIFY]:
            ms = max(self.run(p, lengths) for p in plans)
            if ms < best[0]:
                best = (ms, plans)
        return best

    def lane(self, lengths, placed) -> tuple[float, list[ServerPlan]]:
        """Heterogeneous layouts: ``k`` lane servers at a larger-TP configuration take the ``m`` longest
        requests, the rest run on the other servers at a smaller-TP one; each group placed by LPT."""
        servers = list(placed)
        idx = np.concatenate(list(placed.values()))
        order = idx[np.argsort(-lengths[idx], kind="stable")]
        cands = []
        for k in range(1, len(servers)):
            lane, bulk = servers[:k], servers[k:]
            for ca in [c for c in self.configs if c.max_num_seqs == self.grid[-1]]:  # a lane is never capped
                for cb in self.configs:
                    if ca.layout.tp <= cb.layout.tp or not self._fits(cb, lengths[order[-1:]]):
                        continue
                    ra = ca.layout.replicas(self.gpus) * k
                    for share in LANE_SHARES:
                        m = min(len(order) - 1, share * ra)
                        if m < 1 or not self._fits(ca, lengths[order[:m]]) or not self._fits(cb, lengths[order[m:]]):
                            continue
                        slots_a = [(s, r) for s in lane for r in range(ca.layout.replicas(self.gpus))]
                        slots_b = [(s, r) for s in bulk for r in range(cb.layout.replicas(self.gpus))]
                        assign = self._lpt(lengths, order[:m], slots_a, True)
                        assign.update(self._lpt(lengths, order[m:], slots_b, False))
                        plans = self._plans_from(assign, {**{s: ca for s in lane}, **{s: cb for s in bulk}})
                        cands.append((max(self.estimate(p, lengths) for p in plans), plans))
        if not cands:
            return math.inf, []
        cands.sort(key=lambda c: c[0])
        best = None
        for _, plans in cands[:VERIFY]:
            ms = max(self.run(p, lengths) for p in plans)
            if best is None or ms < best[0]:
                best = (ms, plans)
        return best

    def both(self, lengths, placed, others: list[tuple[float, list[ServerPlan]]]) -> tuple[float, list[ServerPlan]]:
        ms, plans = self.lane(lengths, placed)
        if plans:  # then the best single switch of every lane plan's server, on its placement
            plans = [self._best_switch(lengths, p.requests, p.replica, [p.config]) for p in plans]
            ms = max(self.run(p, lengths) for p in plans)
        best = (ms, plans)
        for o in others:
            if o[0] < best[0]:
                best = o
        return best

    def floor(self, lengths) -> float:
        """The longest response alone at the fastest layout, as the engine runs it: the prefill step emits its
        first token, then one decode step at batch 1 per further token (context prompt + generated)."""
        L = int(lengths.max())
        ctx = self.w.prompt_tokens + np.arange(1, L, dtype=float)
        best = math.inf
        for lay in self.layouts:
            t = self.cost.step_s(lay, 0, 0.0, self.w.prompt_tokens, 1) + float(
                np.sum(self.cost.decode_steps_s(lay, 1, ctx)))
            best = min(best, t)
        return best

    # ---- everything ----
    def compute(self, progress=None) -> dict:
        steps = []
        for k, lengths, placed in self.step_cases():
            if progress:
                progress(f"step {k}")
            st = OracleStep(k, self.static(lengths, placed, self.tuned), floor_s=self.floor(lengths))
            sw = self.switch_only(lengths, placed)
            pl = self.placement_only(lengths, placed)
            bo = self.both(lengths, placed, [sw, pl, (st.static_s, [ServerPlan(self.tuned, i) for i in placed.values()])])
            for kind, (ms, plans) in (("switch", sw), ("placement", pl), ("both", bo)):
                st.results[kind] = {"makespan_s": ms, "plan": [_plan_json(p, self.gpus) for p in plans]}
            steps.append(st)
        base = sum(s.static_s for s in steps)
        out = {"scenario": self.scn.name, "tuned_static": {"layout": self.tuned.layout.name(self.gpus),
                                                           "max_num_seqs": self.tuned.max_num_seqs},
               "static_gen_s": [s.static_s for s in steps], "floor_s": [s.floor_s for s in steps],
               "floor_speedup": base / sum(s.floor_s for s in steps), "kinds": {},
               "searched": {"configs": [f"{c.layout.name(self.gpus)}@{c.max_num_seqs}" for c in self.configs],
                            "switch_fractions": list(map(float, SWITCH_FRACTIONS)), "lane_shares": list(LANE_SHARES),
                            "verified_per_search": VERIFY}}
        for kind in ("switch", "placement", "both"):
            tot = sum(s.results[kind]["makespan_s"] for s in steps)
            out["kinds"][kind] = {"gen_s": [s.results[kind]["makespan_s"] for s in steps], "speedup": base / tot,
                                  "plans": [s.results[kind]["plan"] for s in steps]}
        return out


def _plan_json(p: ServerPlan, gpus: int) -> dict:
    d = {"config": f"{p.config.layout.name(gpus)}@{p.config.max_num_seqs}", "requests": int(len(p.requests)),
         "placed": p.replica is not None}
    if p.switch is not None:
        d["switch"] = {"t": round(p.switch[0], 3), "to": p.switch[1].name(gpus)}
    return d
