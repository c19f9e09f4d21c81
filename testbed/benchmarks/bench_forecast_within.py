"""The forecast inside a step, request by request: what it predicts is left of each running response, against
what is really left, by what the response's prompt group has shown.

    .venv/bin/python testbed/benchmarks/bench_forecast_within.py [--cases default,heavy-tail,mixture,short-7b]
        [--seeds 1,2,3] [--at 0.5,1,2,3,5,8] [--table]

The step's forecast is checked where the policies read it (testbed/planning.py): every running request's
conditional mean (``LengthForecast.remaining``, the loads' ``rem``: the balancer's load index, the lookahead's
advance) and the stratified quantiles the planner estimates on (the k-th of n running requests, ranked by
their hashed levels as ``Estimator.stratified`` ranks them, gets the (k + 0.5) / n quantile), each with the
prompt shift the driver gives it (``prompt_shifts``: the posterior mean of its prompt's log-offset from its
group's finished and running samples), and the mean without the shift beside them.

The regime is the one where every request of a step starts at once and decodes a token a step (an engine
that admits the whole batch: the map's ``vllm-v0`` points): at ``g`` tokens into the step the requests
shorter than ``g`` have finished (their lengths known; one at the cap is censored there) and every other one
is running at ``g``. The step's forecast is the scenario's prior (``LengthForecast.from_workload``, as a
run's first step), updated online with those observations (``updated``, the scenario's ForecastSettings),
and the prompt share is the workload's own (the driver's prior before any finished step). ``--at``: the
points ``g``, as multiples of the workload's median response length.

Per case and point: ``running`` (requests still running), ``at_cap`` (share of them whose true length is the
cap), and for each class of prompt shift (``all``; ``< -0.2``, ``-0.2..0``, ``0`` (no shift), ``0..0.2``,
``> 0.2``) the ratio of the predicted remaining tokens summed over the class's requests to the true ones
(1.0: calibrated; ``mean``, ``quantiles``, ``mean_unshifted``), the median over ``--seeds`` with each seed's
value. A class with fewer than ``MIN_CLASS`` requests at a seed is left out of that seed. Prints one JSON
document (``--table``: a markdown table of the medians instead). A benchmark reports; it asserts nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from emulation.scenario import load_scenario  # noqa: E402
from testbed.benchmarks.bench_policies import CASES  # noqa: E402
from testbed.orchestrator.forecast import (LengthForecast, PromptLaw, prompt_offsets, prompt_prior,  # noqa: E402
                                           prompt_shifts)
from testbed.orchestrator.planner import request_levels  # noqa: E402

CANDIDATE = "candidate"  # the within-prompt law with the spike at the cap (see candidate_mean)
CLASSES = (("< -0.2", -np.inf, -0.2), ("-0.2..0", -0.2, -1e-12), ("0", -1e-12, 1e-12), ("0..0.2", 1e-12, 0.2),
           ("> 0.2", 0.2, np.inf))
MIN_CLASS = 10
KINDS = ("mean", "quantiles", "mean_unshifted", CANDIDATE)


def workload_of(case: str):
    """The case's workload (bench_policies' CASES: its scenario file with the case's workload overrides)
    and the scenario's forecast settings."""
    fname, wl, _ = CASES[case]
    scn = load_scenario(os.path.join(ROOT, "scenarios", fname))
    return dataclasses.replace(scn.workload, **wl), scn.orchestrator.forecast


def candidate_mean(w, share: float, pids: np.ndarray, lengths: np.ndarray, run: np.ndarray, g: float) -> np.ndarray | None:
    """The conditional mean of every running request under a candidate model of a prompt group, for a
    lognormal workload (None for a mixture or with no prompt share): log L = mu + a + e with the workload's own
    mu, a ~ N(0, share sigma^2) shared by a prompt's samples, e ~ N(0, (1 - share) sigma^2), and, independently
    of the prompt, a response at the cap with the workload's ``cap_fraction`` p (how emulation/workload.py draws
    a step): ``forecast.PromptLaw`` on those parameters. The prompt's offset is its posterior mean given its
    finished samples (a finished one at the cap says nothing: it may be the spike; ``forecast.prompt_offsets``)
    and its running ones (censored: P(L > g | a) = p + (1 - p) S(g | a)); a
    request's remaining length then mixes the spike (cap - g) and the body's conditional mean at that offset
    with the within-prompt spread. The forecast's own law of a known prompt (``forecast.PromptLaw``) has the
    same form with its parameters read from the forecast (the spike from its shape's flat top, the body from
    its quantiles, both moved by the online update); this one knows the workload's. Not used by any policy:
    the benchmark's yardstick for that law."""
    if w.mixture or share <= 0:
        return None
    law = PromptLaw(w.cap_fraction, math.log(w.response_median_tokens), w.response_sigma, math.sqrt(1.0 - share),
                    float(w.max_response_tokens))
    gen = np.full(int(run.sum()), float(g))
    post = prompt_offsets(law, share, pids[~run], lengths[~run], pids[run], gen)
    return law.remaining(gen, np.array([post[int(p)] for p in pids[run].tolist()]))


def at_point(w, settings, lengths: np.ndarray, pids: np.ndarray, g: float) -> dict | None:
    """The forecast's view ``g`` tokens into the all-at-once step of ``lengths`` (prompt ids ``pids``)."""
    run = lengths > g
    if run.sum() < MIN_CLASS:
        return None
    done = ~run
    fc0 = LengthForecast.from_workload(w, 0)
    gen = np.full(int(run.sum()), float(g))
    fc = fc0.updated(lengths[done].astype(float), gen, settings) if settings.online_update else fc0
    share = prompt_prior(w)
    post = prompt_shifts(fc, share, pids[done], lengths[done], pids[run], gen) if (
        share > 0 and settings.prompt_groups) else {}
    shift = np.array([post.get(int(p), np.nan) for p in pids[run].tolist()], dtype=np.float64)
    fc = fc.with_prompt_share(share) if post else fc  # as the driver gives the tick's forecast its share
    truth = np.minimum(lengths[run], w.max_response_tokens).astype(float) - g
    rid = np.flatnonzero(run).astype(np.int64)
    order = np.argsort(request_levels(rid), kind="stable")
    levels = np.empty(len(rid))
    levels[order] = (np.arange(len(rid)) + 0.5) / len(rid)
    pred = {"mean": fc.remaining(gen, shift if post else None),
            "quantiles": fc.remaining_quantile(gen, levels, shift if post else None),
            "mean_unshifted": fc.remaining(gen)}
    cand = candidate_mean(w, share, pids, lengths, run, g) if settings.prompt_groups else None
    if cand is not None:
        pred[CANDIDATE] = cand
    out = {"running": int(run.sum()), "at_cap": round(float(np.mean(lengths[run] >= w.max_response_tokens)), 4)}
    for name, lo, hi in (("all", -np.inf, np.inf),) + CLASSES:
        m = (np.nan_to_num(shift) > lo) & (np.nan_to_num(shift) <= hi) if name != "all" else np.ones(len(shift), bool)
        if m.sum() < MIN_CLASS:
            continue
        out[name] = {"n": int(m.sum()), **{k: round(float(pred[k][m].sum() / truth[m].sum()), 4) for k in KINDS
                                           if k in pred}}
    return out


def run_case(case: str, seeds: list, at: list) -> dict:
    w, settings = workload_of(case)
    res = {"workload": {"median": w.response_median_tokens, "sigma": w.response_sigma,
                        "prompt_sigma": w.prompt_sigma, "cap": w.max_response_tokens, "cap_fraction": w.cap_fraction,
                        "mixture": bool(w.mixture), "responses": w.samples_per_step}, "points": []}
    per_seed = {}
    for seed in seeds:
        rng = np.random.default_rng(seed)
        lengths = w.sample_lengths(rng)
        pids = np.arange(len(lengths)) // w.samples_per_prompt
        for x in at:
            per_seed[(x, seed)] = at_point(w, settings, lengths, pids, x * w.response_median_tokens)
    for x in at:
        rows = {s: per_seed[(x, s)] for s in seeds if per_seed[(x, s)] is not None}
        if not rows:
            continue
        pt = {"at_median_x": x, "g": round(x * w.response_median_tokens),
              "running": int(np.median([r["running"] for r in rows.values()])),
              "at_cap": round(float(np.median([r["at_cap"] for r in rows.values()])), 4)}
        for name in ("all",) + tuple(c[0] for c in CLASSES):
            have = {s: r[name] for s, r in rows.items() if name in r}
            if not have:
                continue
            pt[name] = {"n": int(np.median([h["n"] for h in have.values()])), "seeds": len(have),
                        **{k: round(float(np.median([h[k] for h in have.values()])), 3) for k in KINDS
                           if all(k in h for h in have.values())},
                        "per_seed": {str(s): {k: h[k] for k in KINDS if k in h} for s, h in have.items()}}
        res["points"].append(pt)
    return res


def table(doc: dict) -> str:
    names = ("all",) + tuple(c[0] for c in CLASSES)
    lines = ["| case | g (x median) | running | at cap | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for case, res in doc["cases"].items():
        for pt in res["points"]:
            cells = []
            for n in names:
                c = pt.get(n)
                cells.append("-" if c is None else " / ".join(f"{c[k]:.2f}" for k in KINDS if k in c))
            lines.append(f"| {case} | {pt['g']} ({pt['at_median_x']:g}) | {pt['running']} | {pt['at_cap']:.2f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="default,heavy-tail,mixture,short-7b",
                    help="bench_policies cases whose workloads are checked (default: %(default)s)")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (default: %(default)s)")
    ap.add_argument("--at", default="0.5,1,2,3,5,8",
                    help="points of the step, as multiples of the median response length (default: %(default)s)")
    ap.add_argument("--table", action="store_true", help="a markdown table of the medians (per class: mean / quantiles / "
                                                         "mean unshifted / candidate) instead of JSON")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        at = [float(x) for x in args.at.split(",") if x.strip()]
    except ValueError as e:
        ap.error(f"--seeds takes integers and --at numbers: {e}")
    if not seeds or not at or min(at) <= 0:
        ap.error("--seeds and --at need at least one value, and every --at must be > 0")
    doc = {"regime": "every request starts at once, one token a step", "min_class": MIN_CLASS, "seeds": seeds,
           "cases": {c: run_case(c, seeds, at) for c in cases}}
    print(table(doc) if args.table else json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
