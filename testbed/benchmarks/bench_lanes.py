"""How much of the lane oracle can a policy keep that finds the long requests by their progress alone?

    .venv/bin/python testbed/benchmarks/bench_lanes.py [--scenarios short-7b,default] [--steps 1] [--top 5]

Per scenario (scenarios/NAME.yaml) and step, on the engine (virtual time, the engine the simulated backend
and the oracle run): the best static configuration (every feasible layout x the tuning grid's max_num_seqs,
the tuned baseline's search), the lane oracle (testbed.runs.oracle ``both``: every response length known at
time 0), the floor (the longest response alone at the fastest layout), and the search of
testbed/runs/lanes.py: every progress-informed lane plan, free layouts and free instant migrations, so that
its best is an upper estimate for online lane policies of that family. Prints one JSON document: per
scenario the generation time summed over the steps of each, the speedups over the best static, the share of
the oracle's speedup the best lane plan keeps, and the ``--top`` plans. A benchmark reports; it asserts
nothing. Deterministic: the same scenario and seed give the same figures.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from emulation.scenario import load_scenario  # noqa: E402
from testbed.runs.lanes import GRID, as_json, plans, search  # noqa: E402
from testbed.runs.oracle import Oracle, ServerPlan  # noqa: E402


def bench_scenario(path: Path, steps: int, top: int, grid: dict = GRID, quiet: bool = False) -> dict:
    scn = load_scenario(path)
    probe = Oracle(scn, ("TP1x8", scn.orchestrator.engine.max_num_seqs), steps=steps)
    cases = probe.step_cases()
    # the tuned static: the configuration with the least generation time summed over the steps
    static = {f"{c.layout.name(probe.gpus)}@{c.max_num_seqs}": sum(probe.static(l, p, c) for _, l, p in cases)
              for c in probe.configs}
    tuned = min(static, key=lambda k: (static[k], k))
    lay, mns = tuned.split("@")
    orc = Oracle(scn, (lay, int(mns)), steps=steps)
    n_plans = len(plans(orc, len(orc.servers), grid))
    out = {"scenario": scn.name, "steps": steps, "tuned_static": tuned, "plans_searched": n_plans,
           "grid": {k: list(v) for k, v in grid.items()}, "static_gen_s": 0.0, "oracle_gen_s": 0.0, "floor_s": 0.0,
           "lanes_gen_s": 0.0, "per_step": []}
    with tqdm(total=n_plans * len(cases), desc=f"lanes {scn.name}", file=sys.stderr, disable=quiet) as bar:
        for k, lengths, placed in cases:
            st = orc.static(lengths, placed, orc.tuned)
            sw, pl = orc.switch_only(lengths, placed), orc.placement_only(lengths, placed)
            both = orc.both(lengths, placed, [sw, pl, (st, [ServerPlan(orc.tuned, i) for i in placed.values()])])[0]
            runs = search(orc, lengths, placed, grid, progress=bar.update)
            out["per_step"].append({"step": k, "static_gen_s": st, "oracle_gen_s": both, "floor_s": orc.floor(lengths),
                                    "top": [as_json(r) for r in runs[:top]]})
            out["static_gen_s"] += st
            out["oracle_gen_s"] += both
            out["floor_s"] += out["per_step"][-1]["floor_s"]
            out["lanes_gen_s"] += runs[0].makespan_s
    s = out["static_gen_s"]
    out["speedup"] = {"lanes": s / out["lanes_gen_s"], "oracle": s / out["oracle_gen_s"], "floor": s / out["floor_s"]}
    gain = out["speedup"]["oracle"] - 1
    out["oracle_gain_kept"] = (out["speedup"]["lanes"] - 1) / gain if gain > 0 else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="short-7b,default", help="names under scenarios/ (comma-separated)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    missing = [n for n in names if not (ROOT / "scenarios" / f"{n}.yaml").is_file()]
    if missing or not names:
        ap.error(f"--scenarios: no scenarios/NAME.yaml for {missing or 'an empty list'}")
    if args.steps < 1 or args.top < 1:
        ap.error(f"--steps and --top must be >= 1, got {args.steps} and {args.top}")
    res = {n: bench_scenario(ROOT / "scenarios" / f"{n}.yaml", args.steps, args.top, quiet=args.quiet)
           for n in names}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
