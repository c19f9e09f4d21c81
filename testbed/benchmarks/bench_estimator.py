"""How well does the planner's estimator rank layouts? For one generator server and a fresh step (every
request queued at its prompt, every length known), the estimator's predicted makespan of each candidate
layout (testbed.orchestrator.estimate.Estimator.server_s) against the engine's own (agents.engine.Engine run to
the end on the cost model: what the simulated backend runs). Prints one JSON document: per case and layout the
engine's and the estimator's seconds and their ratio, the layout each picks, and the *regret* (the engine's
time of the estimator's pick over the engine's best); then the worst regret and the largest error over every
case. The cases span the models, loads, length distributions and max_num_seqs of the map (long responses
where KV capacity binds at small TP and where it does not).

    .venv/bin/python testbed/benchmarks/bench_estimator.py [--cases 0,3,7] [--profile vllm-v0]

``--profile``: the engine profile both sides run on (agents/data/engines.yaml: the engine's CPU time per step,
graph caps, chunked prefill; ``CostModel.for_engine``, as a scenario's ``orchestrator.engine.profile`` makes
them); without it, the kernels-only cost model with the engine's default settings (what this bench measured
before the engine profiles, kept so its figures stay comparable).

``--midstep``: the same cases from inside a step instead of its start, where the planner decides: the engine
runs each layout A to ``--at`` of its own makespan (default 0.3 and 0.6); from that state the estimate of every
layout B (the switch's cost, ``ModelledCost.switch_s`` for the KV then held, plus ``server_s(B, load,
current=A)`` on the true remaining lengths: no forecast error) against the engine run on from a copy of that
state, switched to B (A: kept). Per state: each layout's seconds and ratio, the estimate's pick, its regret, and
the error in the predicted gain of every switch (the stay's time minus the switch's), and the engine's
preemptions from the state on (by recompute: what the estimate does not model beyond one prefill of the
requests a switch leaves waiting); summed up over all states
and apart for switches to a smaller and to a larger TP degree (a smaller one has less KV per replica: the
regime where the engine preempts). ~4 minutes a profile for the 15 cases.

A benchmark reports; it asserts nothing. Deterministic: the same cases give the same figures.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agents.costmodel import CostModel  # noqa: E402
from agents.engine import Engine, ModelledCost, NewRequest, dense_layouts  # noqa: E402
from emulation.orchestration import EngineSettings  # noqa: E402
from emulation.validation import SpecError  # noqa: E402
from testbed.orchestrator.estimate import Estimator, ServerLoad  # noqa: E402

PROMPT = 256
# (model, requests on the server, response median, log-sigma, cap, share at the cap, max_num_seqs, seed)
CASES = [
    ("Qwen2.5-14B", 1024, 4000, 0.9, 16384, 0.05, 1024, 0),
    ("Qwen2.5-14B", 256, 1500, 0.9, 16384, 0.05, 1024, 0),
    ("Qwen2.5-14B", 1024, 1500, 0.9, 16384, 0.05, 1024, 0),
    ("Qwen2.5-32B", 1024, 4000, 0.9, 16384, 0.05, 1024, 0),
    ("Qwen2.5-7B", 1024, 3000, 0.9, 16384, 0.05, 1024, 0),
    ("Qwen2.5-14B", 512, 3000, 1.2, 20000, 0.1, 256, 0),
    ("Qwen2.5-32B", 512, 6000, 0.9, 20000, 0.1, 1024, 0),
    ("Qwen2.5-32B", 2048, 3000, 0.9, 16384, 0.05, 1024, 0),
    ("Qwen2.5-14B", 2048, 4000, 1.0, 16384, 0.05, 1024, 0),
    ("Qwen2.5-14B", 1024, 4000, 0.9, 16384, 0.05, 1024, 1),
    ("Qwen2.5-14B", 1024, 2500, 0.7, 16384, 0.02, 512, 2),
    ("Qwen2.5-32B", 1024, 2000, 0.9, 16384, 0.05, 256, 3),
    ("Qwen2.5-7B", 2048, 6000, 0.8, 20000, 0.1, 1024, 4),
    ("Qwen2.5-14B", 512, 8000, 0.6, 20000, 0.15, 1024, 5),
    ("Qwen2.5-32B", 256, 4000, 0.9, 16384, 0.05, 1024, 6),
]


def lengths(n: int, median: float, sigma: float, cap: int, cap_share: float, seed: int) -> np.ndarray:
    """Log-normal response lengths capped at ``cap``, ``cap_share`` of them at the cap."""
    rng = np.random.default_rng(seed)
    x = np.minimum(np.maximum(np.exp(np.log(median) + sigma * rng.standard_normal(n)), 1.0), cap)
    x[: int(cap_share * n)] = cap
    rng.shuffle(x)
    return x.astype(np.int64)


def _setup(model: str, mns: int, profile: str | None):
    """(cost model, engine settings) of a case: the profile's (``CostModel.for_engine``) or the kernels-only."""
    if profile is None:
        cm, st = CostModel.for_names(model, "H800"), EngineSettings(max_num_seqs=mns)
    else:
        st = EngineSettings(max_num_seqs=mns, profile=profile)
        cm = CostModel.for_engine(model, "H800", st)
    return cm, st


def _started(cost, lay, st, target) -> Engine:
    """An engine on ``lay`` with every request of ``target`` queued at its prompt at time 0."""
    e = Engine(cost, 8, lay, st)
    e.add([NewRequest(i, PROMPT, int(t)) for i, t in enumerate(target)], 0.0, chunked=True)
    return e


def _makespans(cost, st, target) -> dict:
    """{layout: the engine's makespan of ``target`` from a fresh step} for every dense layout that holds the
    model and a longest request."""
    out = {}
    for lay in dense_layouts(8):
        try:
            e = _started(cost, lay, st, target)
        except SpecError:  # the layout does not hold the model or a longest request
            continue
        e.run_until(1e12)
        out[lay] = e.last_end
    return out


def run_case(model: str, n: int, median: float, sigma: float, cap: int, cap_share: float, mns: int,
             seed: int, profile: str | None = None) -> dict:
    target = lengths(n, median, sigma, cap, cap_share, seed)
    cm, st = _setup(model, mns, profile)
    cost = ModelledCost(cm, 8)
    est = Estimator(cm, 8, st)
    load = ServerLoad(np.full(n, float(PROMPT)), target.astype(float), np.zeros(n, bool), np.full(n, -1),
                      np.zeros(n), np.linspace(0.0, 1.0, n))
    rows = {}
    for lay, engine_s in _makespans(cost, st, target).items():
        est_s = est.server_s(lay, load)
        rows[lay.name(8)] = {"engine_s": round(engine_s, 3), "estimate_s": round(est_s, 3),
                             "ratio": round(est_s / engine_s, 4)}
    best = min(rows, key=lambda k: rows[k]["engine_s"])
    pick = min(rows, key=lambda k: rows[k]["estimate_s"])
    return {"model": model, "requests": n, "median": median, "sigma": sigma, "cap": cap, "cap_share": cap_share,
            "max_num_seqs": mns, "seed": seed, "layouts": rows, "engine_best": best, "estimator_pick": pick,
            "regret": round(rows[pick]["engine_s"] / rows[best]["engine_s"], 4),
            "max_error": round(max(abs(r["ratio"] - 1.0) for r in rows.values()), 4)}


def run_midstep_case(model: str, n: int, median: float, sigma: float, cap: int, cap_share: float, mns: int,
                     seed: int, profile: str | None = None, at: tuple = (0.3, 0.6)) -> dict:
    """One case of ``--midstep``: every layout A at every share ``at`` of A's own makespan (see the module's
    docstring)."""
    target = lengths(n, median, sigma, cap, cap_share, seed)
    cm, st = _setup(model, mns, profile)
    cost = ModelledCost(cm, 8)
    est = Estimator(cm, 8, st)
    full = _makespans(cost, st, target)
    states = []
    for a in full:
        for f in at:
            t0 = f * full[a]
            e = _started(cost, a, st, target)
            e.run_until(t0)
            snap = e.snapshot()
            rid = snap["rid"].astype(np.int64)
            ctx = (snap["prompt"] + snap["generated"]).astype(float)
            running = snap["running"].astype(bool)
            load = ServerLoad(ctx, np.maximum(target[rid] - snap["generated"], 0).astype(float), running,
                              snap["replica"].astype(np.int64), rid=rid)
            kv = float(ctx[running].sum())
            before = e.stats(t0)["num_preemptions_total"]
            rows = {}
            for b in full:
                e2 = copy.deepcopy(e)
                if b != a:
                    e2.set_layout(b, t0)
                e2.run_until(1e12)
                pred = (0.0 if b == a else float(cost.switch_s(a, b, kv))) + est.server_s(b, load, current=a)
                act = e2.last_end - t0
                rows[b.name(8)] = {"engine_s": round(act, 3), "estimate_s": round(pred, 3), "ratio": round(pred / act, 4),
                                   "tp": b.tp, "preemptions": e2.stats(e2.last_end)["num_preemptions_total"] - before}
            stay = rows[a.name(8)]
            for r in rows.values():
                r["gain_engine_s"] = round(stay["engine_s"] - r["engine_s"], 3)
                r["gain_estimate_s"] = round(stay["estimate_s"] - r["estimate_s"], 3)
            best = min(rows, key=lambda k: rows[k]["engine_s"])
            pick = min(rows, key=lambda k: rows[k]["estimate_s"])
            states.append({"from": a.name(8), "tp": a.tp, "at": f, "t0_s": round(t0, 3), "layouts": rows,
                           "engine_best": best, "estimator_pick": pick,
                           "regret": round(rows[pick]["engine_s"] / rows[best]["engine_s"], 4)})
    return {"model": model, "requests": n, "median": median, "sigma": sigma, "cap": cap, "cap_share": cap_share,
            "max_num_seqs": mns, "seed": seed, "states": states}


def midstep_summary(cases: list) -> dict:
    """Worst and mean regret, misranked states, and for staying, switching to a smaller TP degree and to a
    larger one: the ratio's range and median error (all, and apart where the engine preempted from the state on
    and where it did not), the gain's largest error (as a share of the engine's time for the stay) and the
    switches whose gain the estimate gets the sign of wrong."""
    states = [s for c in cases for s in c["states"]]
    out = {"states": len(states), "worst_regret": max(s["regret"] for s in states),
           "mean_regret": round(float(np.mean([s["regret"] for s in states])), 4),
           "misranked": sum(s["regret"] > 1.0 for s in states)}
    stay = {id(s): s["layouts"][s["from"]]["engine_s"] for s in states}
    for kind, keep in (("stay", lambda s, r: r["tp"] == s["tp"]), ("to_smaller_tp", lambda s, r: r["tp"] < s["tp"]),
                       ("to_larger_tp", lambda s, r: r["tp"] > s["tp"])):
        rs = [(s, r) for s in states for r in s["layouts"].values() if keep(s, r)]
        if not rs:
            continue
        out[kind] = {"n": len(rs), **_ratios([r for _, r in rs]),
                     "max_gain_error": round(max(abs(r["gain_estimate_s"] - r["gain_engine_s"]) / stay[id(s)]
                                                 for s, r in rs), 4),
                     "gain_sign_wrong": sum((r["gain_estimate_s"] > 0) != (r["gain_engine_s"] > 0) for st, r in rs
                                            if r["tp"] != st["tp"]),
                     "engine_preempting": _ratios([r for _, r in rs if r["preemptions"] > 0]),
                     "engine_not_preempting": _ratios([r for _, r in rs if r["preemptions"] == 0])}
    return out


def _ratios(rows: list) -> dict:
    if not rows:
        return {"n": 0}
    return {"n": len(rows), "min_ratio": min(r["ratio"] for r in rows), "max_ratio": max(r["ratio"] for r in rows),
            "median_abs_error": round(float(np.median([abs(r["ratio"] - 1.0) for r in rows])), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help="comma-separated case indices (default: all)")
    ap.add_argument("--profile", default=None, help="an engine profile both sides run on (vllm-v1, vllm-v0, sglang, "
                                                     "...; default: the kernels-only cost model)")
    ap.add_argument("--midstep", action="store_true", help="from states inside a step (every layout, switched "
                                                               "or kept) instead of a fresh step")
    ap.add_argument("--at", default=None, help="--midstep: the shares of each layout's makespan to start "
                                                    "from (default 0.3,0.6)")
    a = ap.parse_args(argv)
    if a.profile is not None:
        try:
            EngineSettings(profile=a.profile)
        except SpecError as e:
            print(f"--profile: {e}", file=sys.stderr)
            return 2
    try:
        idx = list(range(len(CASES))) if a.cases is None else [int(x) for x in a.cases.split(",") if x]
        bad = [i for i in idx if not 0 <= i < len(CASES)]
    except ValueError:
        bad, idx = [a.cases], []
    if bad or not idx:
        print(f"--cases: unknown {bad or 'empty'} (0..{len(CASES) - 1})", file=sys.stderr)
        return 2
    if a.at is not None and not a.midstep:
        print("--at: only with --midstep", file=sys.stderr)
        return 2
    if a.midstep:
        try:
            at = tuple(float(x) for x in (a.at or "0.3,0.6").split(",") if x.strip())
        except ValueError:
            at = ()
        if not at or not all(0.0 < x < 1.0 for x in at):
            print(f"--at: {a.at!r} is not a comma-separated list of shares in (0, 1)", file=sys.stderr)
            return 2
        out = [run_midstep_case(*CASES[i], profile=a.profile, at=at)
               for i in tqdm(idx, desc="estimator vs engine, mid-step", file=sys.stderr)]
        print(json.dumps({"profile": a.profile or "kernels-only", "midstep": True, "at": list(at), "cases": out,
                          **midstep_summary(out)}, indent=1))
        return 0
    out = [run_case(*CASES[i], profile=a.profile) for i in tqdm(idx, desc="estimator vs engine", file=sys.stderr)]
    doc = {"profile": a.profile or "kernels-only", "cases": out, "worst_regret": max(c["regret"] for c in out),
           "median_max_error": float(np.median([c["max_error"] for c in out])),
           "max_error": max(c["max_error"] for c in out)}
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
