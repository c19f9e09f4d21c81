"""Decision-path cases pinned by test_orchestrator_pinned.py: seeded planning-tick states (the shape of
``orchestrrl bench planner``'s, plus mixed layouts, switches in progress, arrivals, a draining tail, hot
replicas and exact lengths) and everything the planner, the balancer and the estimator return for them.

``PYTHONPATH=.:tests/unit python tests/unit/orchestrator_cases.py OUT.json`` writes the results; the pinned
file (tests/unit/data/orchestrator_pinned.json) was written by the implementation of commit d7f5f6f, before
the decision path was optimised, so the test checks that the faster code decides exactly as the old one did;
it was re-written once, deliberately, when the stratified quantiles moved from per replica to per server,
and again (2026-12-06) when a candidate layout's deal became the engine's own (by request id, on KV blocks,
the running requests that find no slot or KV room waiting to recompute) and a tempting switch is judged
again over 4 draws of the long requests (12 of the file's switch decisions moved); and again (2026-12-06, a
later commit) when a tempting switch is also set against keeping the layout for k/4 of the switch's predicted
time, k = 1..3, and switching then (PlannerSettings.lookahead_points): 9 of the file's switches became waits,
and two reasons of waits already made name the longer wait; and again (2026-12-07) when the lookahead looked
one interval ahead first and at the later points only for the servers one interval did not hold back: every
decision, estimate and float the same, 7 reasons of waits name the one-interval plan instead of a later one.
"""
from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from agents.costmodel import CostModel
from agents.engine import ModelledCost
from emulation.orchestration import EngineSettings
from emulation.orchestration import BalancerSettings
from emulation.orchestration import ForecastSettings
from emulation.orchestration import PlannerSettings
from emulation.workload import WorkloadSpec
from testbed.orchestrator.balancer import Balancer
from testbed.orchestrator.estimate import Estimator, ServerLoad
from testbed.orchestrator.forecast import LengthForecast
from testbed.orchestrator.planner import Planner, ServerView, loads_from_snapshot
from testbed.orchestrator.policies import feasible_layouts

GPUS = 8
SERVERS = (4, 5, 6, 7)


def _setup(cap: int, max_num_seqs: int, median: int = 460, sigma: float = 0.93, samples: int = 8):
    w = WorkloadSpec(model="Qwen2.5-7B", gpu="H800", prompts_per_step=16, samples_per_prompt=samples,
                     prompt_tokens=256, response_median_tokens=median, response_sigma=sigma,
                     max_response_tokens=cap, steps=2)
    cm = CostModel.for_names(w.model, w.gpu)
    eng = EngineSettings(max_num_seqs=max_num_seqs)
    est = Estimator(cm, GPUS, eng)
    lays = feasible_layouts(cm, GPUS, eng, w.prompt_tokens, w.max_response_tokens)
    planner = Planner(est, ModelledCost(cm, GPUS), PlannerSettings(prune_ticks=0), False, tuple(lays))  # every candidate
    balancer = Balancer(est, BalancerSettings())
    return w, est, lays, planner, balancer


def _bench_state(w, est, lays, rng, n, layouts, gen_scale=300.0, waiting=0.2, k=0, arrivals=0.0,
                 online=True, weights=None):
    """The bench's mid-step state: a seeded mix of progress, a share still waiting; ``layouts[j]`` is
    server j's layout; ``arrivals``: share of requests with replica -1 (just moved in)."""
    gen = np.minimum(rng.lognormal(np.log(gen_scale), 0.9, n).astype(np.int64), w.max_response_tokens - 1)
    running = rng.random(n) > waiting
    gen[~running] = 0
    server = np.arange(n) % len(SERVERS) if weights is None else rng.choice(len(SERVERS), n, p=weights)
    done = rng.lognormal(np.log(w.response_median_tokens), w.response_sigma, n // 2).astype(np.int64) + 1
    fc0 = LengthForecast.from_workload(w, 0)
    fc = fc0.updated(np.minimum(done, w.max_response_tokens).astype(float), gen[running].astype(float),
                     ForecastSettings()) if online else fc0
    est.use_forecast(fc)
    views, rids = {}, {}
    for j, s in enumerate(SERVERS):
        m = server == j
        cnt = int(m.sum())
        lay = layouts[j]
        rep = np.arange(cnt) % lay.replicas(GPUS)
        rep[rng.random(cnt) < arrivals] = -1
        snap = {"rid": np.nonzero(m)[0].astype(np.int64) + 1000 * k, "generated": gen[m],
                "prompt": np.full(cnt, w.prompt_tokens), "running": running[m].astype(np.int8), "replica": rep}
        views[s] = ServerView(s, lay, loads_from_snapshot(snap, fc))
        rids[s] = snap["rid"]
    return views, rids


def _f(x) -> float:
    return float(x)


def _decision_json(d) -> dict:
    """Every field of a planner Decision, its layouts by name (the pinned file's JSON)."""
    return {**dataclasses.asdict(d), "current": d.current.name(GPUS), "best": d.best.name(GPUS)}


def _decisions(ds: dict) -> dict:
    return {str(s): {"current": d.current.name(GPUS), "best": d.best.name(GPUS), "predicted_s": {k: _f(v) for k, v in d.predicted_s.items()},
                     "switch": bool(d.switch), "gain_s": _f(d.gain_s), "switch_cost_s": _f(d.switch_cost_s),
                     "reason": d.reason} for s, d in ds.items()}


def _moves(moves, loads) -> dict:
    return {"moves": [{"rid": m.rid, "src": m.src, "dst": m.dst, "dst_replica": m.dst_replica,
                       "before": [_f(x) for x in m.before], "after": [_f(x) for x in m.after]} for m in moves],
            "loads": {str(a): _f(v) for a, v in loads.items()}}


def _arr(a) -> list:
    return np.asarray(a, dtype=float).tolist()


def _load_dict(ld: ServerLoad) -> dict:
    return {"ctx0": _arr(ld.ctx0), "rem": _arr(ld.rem), "running": _arr(ld.running), "replica": _arr(ld.replica),
            "gen": None if ld.gen is None else _arr(ld.gen)}


def _estimator_outputs(est: Estimator, lays, views: dict, interval: float) -> dict:
    out = {}
    loads = {s: v.load for s, v in views.items()}
    currents = {s: v.layout for s, v in views.items()}
    for lay in lays:
        out[f"servers_s/{lay.name(GPUS)}"] = {str(s): _f(t) for s, t in est.servers_s(lay, loads, currents).items()}
    s0 = next(iter(views))
    v = views[s0]
    for lay in lays:
        rep, times = est.replica_times(lay, v.load, current=v.layout)
        out[f"replica_times/{s0}/{lay.name(GPUS)}"] = {"rep": _arr(rep), "times": _arr(times)}
    adv = est.advance(v.layout, v.load, interval)
    out[f"advance/{s0}"] = _load_dict(adv)
    r = v.layout.replicas(GPUS)
    rep = est.placement(v.layout, v.load, v.layout)
    rem = est.stratified(v.load)
    out[f"stratified/{s0}"] = _arr(rem)
    out[f"progress/{s0}"] = _arr(est.progress(v.layout, v.load.ctx0, rem, v.load.running, interval, rep, r))
    return out


def _run(name, setup, views, rids, now=10.0, interval=1.0, extra=True) -> dict:
    w, est, lays, planner, balancer = setup
    res = {"decisions": _decisions(planner.evaluate_all(views, now=now, interval=interval))}
    res["balancer"] = _moves(*balancer.decide(views, rids, now=now))
    if extra:
        res["estimator"] = _estimator_outputs(est, lays, views, interval)
        res["initial"] = {str(s): _decision_json(planner.initial(v)) for s, v in views.items()}
    return res


def cases():
    """(name, thunk) of every case; a thunk builds its state and returns the results (JSON-able)."""
    def bench(seed, cap, seqs, ticks=2):
        def go():
            setup = _setup(cap, seqs)
            w, est, lays = setup[:3]
            rng = np.random.default_rng(seed)
            out = {}
            for k in range(ticks):
                views, rids = _bench_state(w, est, lays, rng, 1024, [lays[0]] * 4, k=k)
                out[f"tick{k}"] = _run("bench", setup, views, rids, extra=(k == 0))
            return out
        return go

    def seeded(name, seed, cap, seqs, n, pick, adjust=None, **state):
        """A case of one seeded tick state: ``pick(lays)`` the servers' layouts, ``state`` passed on to
        _bench_state, ``adjust(views)`` any change to the views before the run."""
        def go():
            setup = _setup(cap, seqs)
            w, est, lays = setup[:3]
            rng = np.random.default_rng(seed)
            views, rids = _bench_state(w, est, lays, rng, n, pick(lays), **state)
            if adjust is not None:
                adjust(views)
            return _run(name, setup, views, rids)
        return go

    def mixed_views(views):
        views[5] = dataclasses.replace(views[5], busy_until=10.4)
        views[6] = dataclasses.replace(views[6], last_switch_end=9.0)

    def mixed(seed, cap, seqs):
        return seeded("mixed", seed, cap, seqs, 600, lambda lays: [lays[j % len(lays)] for j in range(4)],
                      mixed_views, arrivals=0.05)

    def tail(seed, cap, seqs, n, gen_scale, layout_index=0):
        return seeded("tail", seed, cap, seqs, n, lambda lays: [lays[layout_index]] * 4, gen_scale=gen_scale,
                      waiting=0.0)

    def imbalanced(seed, cap, seqs, n, weights, layout_index=0):
        return seeded("imbalanced", seed, cap, seqs, n, lambda lays: [lays[layout_index]] * 4, weights=weights)

    def offline(seed, cap, seqs):
        return seeded("offline", seed, cap, seqs, 400, lambda lays: [lays[0]] * 4, online=False, waiting=0.5)

    def exact(seed, seqs):
        def go():
            setup = _setup(16384, seqs)
            w, est, lays = setup[:3]
            est.use_forecast(None)
            rng = np.random.default_rng(seed)
            views, rids = {}, {}
            for j, s in enumerate(SERVERS):
                n = [40, 300, 5, 120][j]
                lay = lays[[0, 0, 1, 2][j] % len(lays)]
                ctx = 256 + rng.integers(0, 3000, n).astype(float)
                rem = rng.lognormal(np.log(400), 1.0, n).round() + 1
                running = rng.random(n) > 0.3
                rep = (np.arange(n) % lay.replicas(GPUS)).astype(np.int64)
                if j == 1:
                    rep[:] = 0  # a hot replica
                views[s] = ServerView(s, lay, ServerLoad(ctx, rem, running, rep))
                rids[s] = np.arange(n) + 1000 * j
            return _run("exact", setup, views, rids)
        return go

    out = []
    for seed in (0, 1):
        out.append((f"bench-default-{seed}", bench(seed, 16384, 256)))
        out.append((f"bench-big-{seed}", bench(seed, 4096, 64)))
    out += [("mixed-default", mixed(2, 16384, 256)), ("mixed-big", mixed(3, 4096, 64)),
            ("tail-default", tail(4, 16384, 256, 48, 3000.0)), ("tail-big", tail(5, 4096, 64, 64, 1500.0)),
            ("tail-small", tail(6, 16384, 256, 16, 6000.0)), ("tail-mid", tail(7, 16384, 64, 160, 1200.0)),
            ("tail-tp2", tail(8, 16384, 256, 64, 2500.0, 1)),
            ("imbalanced-default", imbalanced(12, 16384, 256, 800, [0.55, 0.05, 0.2, 0.2])),
            ("imbalanced-big", imbalanced(13, 4096, 64, 1024, [0.4, 0.1, 0.25, 0.25])),
            ("imbalanced-tp8", imbalanced(14, 16384, 256, 200, [0.6, 0.02, 0.18, 0.2], 3)),
            ("offline", offline(9, 16384, 256)), ("exact-256", exact(10, 256)), ("exact-16", exact(11, 16))]
    return out


def compute() -> dict:
    return {name: go() for name, go in cases()}


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(compute(), f, indent=None, sort_keys=True)
