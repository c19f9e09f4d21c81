"""RLSim benchmark: wall time and peak memory of one simulated iteration, and the fabric goal ratios.

    .venv/bin/python tests/bench/bench_rlsim.py [--scenario scenarios/dapo-32b.yaml] [--runs 3]

Prints one JSON document: per (fabric, GPUs) the median ``wall_s`` over ``--runs`` runs, the process's peak
RSS, and at T_ocs = 10 ms for 1,024 and 2,048 GPUs RFabric's perf/cost and slowdown against the
non-blocking Fat-Tree. A benchmark reports; it asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from emulation.scenario import load_scenario  # noqa: E402
from rlsim.sim import SimSettings, simulate_iteration  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=os.path.join(ROOT, "scenarios", "dapo-32b.yaml"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scales", default="2048,16384")
    ap.add_argument("--fabrics", default="fat-tree,rfabric,mixnet,topoopt")
    args = ap.parse_args(argv)
    scn = load_scenario(args.scenario)
    out = {"scenario": args.scenario, "runs": args.runs, "timing": [], "goal": []}
    settings = SimSettings(t_ocs_ms=10.0)
    for n in [int(x) for x in args.scales.split(",")]:
        for f in args.fabrics.split(","):
            walls = [simulate_iteration(scn, f, n, settings)["wall_s"] for _ in range(args.runs)]
            out["timing"].append({"fabric": f, "gpus": n, "wall_s_median": statistics.median(walls),
                                  "wall_s_all": walls,
                                  "peak_rss_mib_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    for n in (1024, 2048):
        ft = simulate_iteration(scn, "fat-tree", n, settings)
        rf = simulate_iteration(scn, "rfabric", n, settings)
        out["goal"].append({
            "gpus": n, "fat_tree_iteration_s": ft["iteration_s"], "rfabric_iteration_s": rf["iteration_s"],
            "rfabric_slowdown": rf["iteration_s"] / ft["iteration_s"] - 1,
            "fat_tree_cost_usd": ft["cost_usd"], "rfabric_cost_usd": rf["cost_usd"],
            "rfabric_perf_per_cost_vs_fat_tree": (ft["iteration_s"] * ft["cost_usd"]) / (rf["iteration_s"] * rf["cost_usd"]),
        })
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
