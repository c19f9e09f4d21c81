"""Do the speedups come from the policies or from the scenario? The default scenario's comparison, simulated
backend, on other seeds and on other response-length distributions.

    .venv/bin/python tests/bench/bench_policies.py [--cases a,b] [--seeds 1,2,3] [--steps 2] [--out DIR]
        [--set planner.gain_margin=0.1 ...]   (orchestrator settings to change, YAML values)

For every case and seed: `orchestrrl compare` on the simulated backend (every static layout, planner,
balancer, orchestrrl) of scenarios/default.yaml with the case's workload changes. Prints one JSON document:
per case, per seed the best static layout and every adaptive policy's ``speedup_vs_best_static``,
layout switches and migrations; per case the median over seeds. Cases:

* ``default``: the scenario as shipped (lognormal, median 460, log-sigma 0.93, cap 4,096);
* ``heavy-tail``: log-sigma 1.2 (a longer tail at the same median);
* ``light-tail``: log-sigma 0.5 (prompt difficulty 0.3 of it);
* ``independent``: prompt difficulty 0 (a prompt's samples independent: servers get more even loads);
* ``short``: median 230 (half the default; the same cap);
* ``mixture``: 85% median 350 / 15% median 1,800 (a bimodal reasoning workload);
* ``drift``: the median grows 25% per step (DAPO/R1-like growth, compressed);
* ``near-uniform``: log-sigma 0.05, prompt log-sigma 0 (every response nearly the same length: there is
  no tail to exploit, and the orchestrator must not lose to the best static layout).

A benchmark reports; it asserts nothing. Simulated runs are deterministic: the same seed gives the same figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from emulation.scenario import load_scenario  # noqa: E402
from emulation.workload import LengthComponent  # noqa: E402
from testbed.experiment import Experiment  # noqa: E402

CASES = {
    "default": {},
    "heavy-tail": {"response_sigma": 1.2},
    "light-tail": {"response_sigma": 0.5, "prompt_sigma": 0.3},
    "independent": {"prompt_sigma": 0.0},
    "short": {"response_median_tokens": 230.0},
    "mixture": {"mixture": (LengthComponent(0.85, 350.0, 0.7), LengthComponent(0.15, 1800.0, 0.5))},
    "drift": {"median_growth_per_step": 0.25},
    "near-uniform": {"response_sigma": 0.05, "prompt_sigma": 0.0},
}
ADAPTIVE = ("planner", "balancer", "orchestrrl")


def with_settings(orch: dict, sets: list[str]) -> dict:
    """``orch`` (a scenario's orchestrator mapping) with ``a.b=value`` changes (values parsed as YAML)."""
    import copy

    import yaml

    out = copy.deepcopy(dict(orch or {}))
    for item in sets:
        key, _, val = item.partition("=")
        node = out
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = yaml.safe_load(val)
    return out


def run_case(case: str, seed: int, steps: int, out: Path, sets: list[str] = ()) -> dict:
    scn = load_scenario(ROOT / "scenarios" / "default.yaml")
    w = dataclasses.replace(scn.workload, **CASES[case])
    scn = dataclasses.replace(scn, seed=seed, workload=w, name=f"default-{case}-s{seed}",
                              orchestrator=with_settings(scn.orchestrator, sets))
    exp = Experiment(scn, "simulated")
    with exp:
        rep, _ = exp.compare([exp.policy(n) for n in exp.default_policies()], steps, out / f"{case}-s{seed}")
    pol = rep["policies"]
    return {"best_static": rep["best_static"],
            "best_static_makespan_s": [round(x, 3) for x in pol[rep["best_static"]]["step_makespan_s"]],
            **{n: {"speedup_vs_best_static": round(pol[n]["speedup_vs_best_static"], 4),
                   "layout_switches": pol[n]["layout_switches"], "migrations": pol[n]["migrations"],
                   "lost_requests": pol[n]["lost_requests"]} for n in ADAPTIVE}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None, help="keep the per-run reports here (default: a temporary folder)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an orchestrator setting to change, e.g. planner.gain_margin=0.1 (repeatable)")
    a = ap.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    seeds = [int(s) for s in a.seeds.split(",") if s]
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench-policies-"))
    doc = {"scenario": "scenarios/default.yaml", "backend": "simulated", "steps": a.steps, "seeds": seeds,
           "settings_changed": a.set, "cases": {}}
    with tqdm(total=len(cases) * len(seeds), file=sys.stderr, desc="compare") as bar:
        for c in cases:
            runs = {}
            for s in seeds:
                bar.set_postfix_str(f"{c} seed {s}")
                runs[str(s)] = run_case(c, s, a.steps, out, a.set)
                bar.update(1)
            doc["cases"][c] = {"overrides": {k: (str(v) if k == "mixture" else v) for k, v in CASES[c].items()},
                               "median": {n: round(statistics.median(r[n]["speedup_vs_best_static"] for r in runs.values()), 4)
                                          for n in ADAPTIVE},
                               "min": {n: round(min(r[n]["speedup_vs_best_static"] for r in runs.values()), 4)
                                       for n in ADAPTIVE},
                               "runs": runs}
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
