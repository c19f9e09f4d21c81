"""RLSim benchmark: wall time and peak memory of one simulated iteration, and the fabric goal ratios.

    .venv/bin/python tests/bench/bench_rlsim.py [--scenario scenarios/dapo-32b.yaml] [--runs 3]

Prints one JSON document: per (fabric, GPUs) the median ``wall_s`` over ``--runs`` runs, the process's peak
RSS, and at T_ocs = 10 ms for 1,024 and 2,048 GPUs RFabric's perf/cost and slowdown against the
non-blocking Fat-Tree under both Fat-Tree tier counts (3: REFERENCE.md / MixNet calculator, the default;
auto: fewest tiers of 64-port switches), with the reconfiguration decisions; then sensitivities: TopoOpt
priced with patch-panel ports instead of OCS ports, and response-length log-sigma 0.7 instead of 0.93.
A benchmark reports; it asserts nothing.
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

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

from emulation.scenario import load_scenario  # noqa: E402
from rlsim.cost import fabric_cost, load_prices  # noqa: E402
from rlsim.fabrics import FabricOptions  # noqa: E402
from rlsim.sim import SimSettings, scale_scenario, simulate_iteration  # noqa: E402


def ratio(base: dict, other: dict) -> float:
    return (base["iteration_s"] * base["cost_usd"]) / (other["iteration_s"] * other["cost_usd"])


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
        rf = simulate_iteration(scn, "rfabric", n, settings)
        for tiers in ("3", "auto"):
            st = SimSettings(t_ocs_ms=10.0, fabric=FabricOptions(fat_tree_tiers=tiers))
            ft = simulate_iteration(scn, "fat-tree", n, st)
            out["goal"].append({
                "gpus": n, "fat_tree_tiers": tiers, "fat_tree_packet_tiers": ft["detail"]["cost"]["counts"]["packet_tiers"],
                "fat_tree_iteration_s": ft["iteration_s"], "rfabric_iteration_s": rf["iteration_s"],
                "rfabric_slowdown": rf["iteration_s"] / ft["iteration_s"] - 1,
                "fat_tree_cost_usd": ft["cost_usd"], "rfabric_cost_usd": rf["cost_usd"],
                "rfabric_perf_per_cost_vs_fat_tree": ratio(ft, rf),
                "rfabric_phases": rf["phases"], "fat_tree_phases": ft["phases"],
                "rfabric_reconfig": {k: (v["action"], v["window_ms"], v["stall_s"]) for k, v in rf["detail"]["reconfig"].items()},
            })
    # sensitivities at 2,048 GPUs (default 3-tier counting)
    n = 2048
    sens = {}
    ft = simulate_iteration(scn, "fat-tree", n, settings)
    to = simulate_iteration(scn, "topoopt", n, settings)
    pp = dataclasses.replace(load_prices(), ocs_port=load_prices().patch_panel_port)
    to_pp = dict(to, cost_usd=fabric_cost("topoopt", scale_scenario(scn, n).fabric, 400, pp)["total_usd"])
    sens["topoopt_ocs_ports"] = {"cost_usd": to["cost_usd"], "perf_per_cost_vs_fat_tree": ratio(ft, to)}
    sens["topoopt_patch_panel"] = {"cost_usd": to_pp["cost_usd"], "perf_per_cost_vs_fat_tree": ratio(ft, to_pp)}
    for sigma in (0.93, 0.7):
        s2 = dataclasses.replace(scn, workload=dataclasses.replace(scn.workload, response_sigma=sigma))
        lengths = s2.workload.sample_lengths(np.random.default_rng(0), 200_000)
        f2 = simulate_iteration(s2, "fat-tree", n, settings)
        r2 = simulate_iteration(s2, "rfabric", n, settings)
        sens[f"sigma_{sigma}"] = {
            "length_p50_p90_p99": [float(np.percentile(lengths, q)) for q in (50, 90, 99)],
            "fat_tree_iteration_s": f2["iteration_s"], "rfabric_iteration_s": r2["iteration_s"],
            "rfabric_slowdown": r2["iteration_s"] / f2["iteration_s"] - 1,
            "rfabric_perf_per_cost_vs_fat_tree": ratio(f2, r2)}
    out["sensitivity_2048"] = sens
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
