"""RLSim benchmark: every figure of docs/rlsim.md's Results, as one JSON document (it asserts nothing).

    PYTHONPATH=. .venv/bin/python testbed/benchmarks/bench_rlsim.py [--scenario scenarios/dapo-32b.yaml] [--runs 3]
        [--taper-scenario scenarios/dapo-32b-taper.yaml] [--sections scales,perf_cost,reconfig_delay,timing,sensitivity]

Sections (T_ocs = 10 ms unless swept; the Fat-Tree's tier count is the default, radix-derived one):

* ``scales``: at 1,024 .. 16,384 GPUs, RFabric (the scenario's own configuration) against the non-blocking
  Fat-Tree: iteration, per-phase times, slowdown, weight sync against the fabric's own bound (on the
  sync phase's own topology, and as run), and every transition's decision with its window, gain and stall;
* ``perf_cost``: at 1,024 and 2,048 GPUs the sweep over RFabric uplinks per ToR (the taper) and OCS count,
  beside the Fat-Trees, with perf/cost against the non-blocking Fat-Tree counted by radix (the default)
  and by the MixNet calculator's 3 tiers; the best configuration within 5%; the taper scenario file's figures;
* ``reconfig_delay``: at 2,048 GPUs, each transition's decision (switched / stalled / kept) from 1 us to 10 s, for
  the scenario and the taper scenario;
* ``timing``: the simulator's wall time (median of ``--runs``) and peak RSS *per fabric*: every run is a
  fresh ``orchestrrl sim --json`` process whose ``peak_rss_mib`` is its own VmHWM (``ru_maxrss`` would
  count this benchmark's memory at the fork too), so the RSS is that fabric's alone;
* ``sensitivity``: TopoOpt priced with patch-panel ports, and response-length log-sigma 0.7 vs 0.93;
* ``traffic``: issue 14's goals on the dense scenario and the MoE ones (``--moe-scenarios``) at
  ``--traffic-scales``: per fabric (Fat-Tree, TopoOpt, MixNet, RFabric) the iteration and train phase,
  RFabric's slowdown against the Fat-Tree and its train phase against TopoOpt's and MixNet's, every
  transition's decision and predicted gain; over the T_ocs sweep at 2,048 GPUs the smallest predicted gain
  of any switch made (switched or stalled: never below -1 ms); and the tapered RFabric against the
  non-blocking and the best oversubscribed Fat-Tree (``perf/cost``, the sweep's ``vs_static``), with the
  ceilings no fabric beats at these prices (``rlsim/bounds.py``: ``taper.<mode>.<gpus>.ceiling``, and
  ``ceiling_vs_best_oversubscribed_fat_tree``) and each RFabric row against its own bound. Every RFabric
  figure twice: on one train topology (``rfabric``, ``taper.one_train_topology``) and re-wired inside the
  train phase (``rfabric-rewired``, ``taper.rewired``: SimSettings.train_rewire).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from emulation.scenario import load_scenario  # noqa: E402
from emulation.validation import SpecError  # noqa: E402
from rlsim.cost import fabric_cost, load_prices  # noqa: E402
from rlsim.fabrics import FabricOptions  # noqa: E402
from rlsim.limits import scale_scenario  # noqa: E402
from rlsim.sim import SimSettings, sync_phase, simulate_iteration  # noqa: E402
from rlsim.bounds import perf_cost_ceiling  # noqa: E402
from rlsim.sweep import DEFAULT_RECONFIG_DELAYS_MS, plan, run_sweep, summarise  # noqa: E402

SECTIONS = ("scales", "perf_cost", "reconfig_delay", "timing", "sensitivity", "traffic")
TRAFFIC_FABRICS = ("fat-tree", "topoopt", "mixnet", "rfabric")


def ratio(base: dict, other: dict) -> float:
    return (base["iteration_s"] * base["cost_usd"]) / (other["iteration_s"] * other["cost_usd"])


def transitions(r: dict) -> dict:
    return {k: {"action": v["action"], "window_ms": v["window_ms"], "gain_ms": v["gain_ms"],
                "old_topology_carries": v.get("old_topology_carries"), "stall_ms": v["stall_s"] * 1e3}
            for k, v in r["detail"]["reconfig"].items()}


def own_topology_sync(scn, n: int) -> dict:
    """Weight sync on the sync phase's own topology (whatever the switching rule chose), against its bound."""
    from agents.costmodel import CostModel
    from rlsim.fabric_models import build_network

    s = scale_scenario(scn, n)
    net = build_network("rfabric", s.fabric, s.layout, "sync")
    run = sync_phase(s.workload, CostModel.for_names(s.workload.model, s.workload.gpu), s.fabric, s.layout, net,
                     s.layout.train_servers(s.fabric), s.layout.gen_servers(s.fabric), SimSettings())
    return {"sync_s": run.duration, "bound_s": run.detail["bound_s"], "vs_bound": run.detail["vs_bound"]}


def scales_section(scn, scales) -> list:
    out = []
    st = SimSettings(reconfig_delay_ms=10.0)
    for n in scales:
        ft = simulate_iteration(scn, "fat-tree", n, st)
        rf = simulate_iteration(scn, "rfabric", n, st)
        out.append({"gpus": n, "fat_tree_iteration_s": ft["iteration_s"], "rfabric_iteration_s": rf["iteration_s"],
                    "rfabric_slowdown": rf["iteration_s"] / ft["iteration_s"] - 1,
                    "fat_tree_phases": ft["phases"], "rfabric_phases": rf["phases"],
                    "rfabric_sync_as_run": {k: rf["detail"]["sync"][k] for k in ("bound_s", "vs_bound", "chains")},
                    "rfabric_sync_own_topology": own_topology_sync(scn, n),
                    "rfabric_transitions": transitions(rf),
                    "fat_tree_cost_usd": ft["cost_usd"], "rfabric_cost_usd": rf["cost_usd"],
                    "fat_tree_packet_tiers": ft["detail"]["cost"]["counts"]["packet_tiers"],
                    "rfabric_perf_per_cost_vs_fat_tree": ratio(ft, rf)})
    return out


def perf_cost_section(scn, taper, scales, uplinks) -> dict:
    out: dict = {}
    for tiers in ("auto", "3"):
        settings = SimSettings(fabric=FabricOptions(fat_tree_tiers=tiers))
        pts = plan(scn, ["fat-tree", "fat-tree-2to1", "fat-tree-4to1", "rfabric"], scales, [10.0],
                   uplinks=uplinks, ocs=None)
        res = run_sweep(scn, pts, settings, use_ray=False, progress=False)
        summ = summarise(res)
        out[f"fat_tree_tiers_{tiers}"] = {
            str(n): {"rows": [{k: row[k] for k in ("label", "iteration_s", "slowdown_vs_fat_tree", "cost_vs_fat_tree",
                                                    "perf_per_cost_vs_fat_tree")} for row in summ[str(n)]["rows"]],
                     "best_within_5pct": summ[str(n)]["best_within_slowdown"]} for n in scales}
    if taper is not None:
        rows = []
        for n in scales:
            ft = simulate_iteration(taper, "fat-tree", n, SimSettings(reconfig_delay_ms=10.0))
            rf = simulate_iteration(taper, "rfabric", n, SimSettings(reconfig_delay_ms=10.0))
            spec = scale_scenario(taper, n).fabric
            rows.append({"gpus": n, "uplinks_per_tor": spec.uplinks_per_tor, "ocs_count": spec.ocs_count,
                         "ocs_ports_each": spec.ports_per_ocs, "rfabric_iteration_s": rf["iteration_s"],
                         "fat_tree_iteration_s": ft["iteration_s"],
                         "rfabric_slowdown": rf["iteration_s"] / ft["iteration_s"] - 1,
                         "rfabric_cost_usd": rf["cost_usd"], "fat_tree_cost_usd": ft["cost_usd"],
                         "rfabric_perf_per_cost_vs_fat_tree": ratio(ft, rf), "rfabric_phases": rf["phases"],
                         "rfabric_transitions": transitions(rf)})
        out["taper_scenario"] = {"file": taper.name, "rows": rows}
    return out


def reconfig_delay_section(scn, n: int) -> dict:
    ft = simulate_iteration(scn, "fat-tree", n, SimSettings(reconfig_delay_ms=10.0))
    rows = []
    for t in DEFAULT_RECONFIG_DELAYS_MS:
        rf = simulate_iteration(scn, "rfabric", n, SimSettings(reconfig_delay_ms=t))
        rows.append({"reconfig_delay_ms": t, "iteration_s": rf["iteration_s"],
                     "slowdown_vs_fat_tree": rf["iteration_s"] / ft["iteration_s"] - 1,
                     "decisions": {k: v["action"] for k, v in rf["detail"]["reconfig"].items()},
                     "stall_ms": sum(v["stall_s"] for v in rf["detail"]["reconfig"].values()) * 1e3})
    changes = []
    for a, b in zip(rows, rows[1:]):
        for k, v in b["decisions"].items():
            if a["decisions"].get(k) != v:
                changes.append({"transition": k, "from": a["decisions"].get(k), "to": v,
                                "between_ms": [a["reconfig_delay_ms"], b["reconfig_delay_ms"]]})
    return {"gpus": n, "rows": rows, "changes": changes}


def timing_section(scenario_path: str, scales, fabrics, runs: int) -> list:
    """Each run a fresh process, so ``peak_rss_mib`` (ru_maxrss of that process) is the fabric's own."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = []
    for n in scales:
        for f in fabrics:
            walls, rss = [], []
            for _ in range(runs):
                p = subprocess.run([sys.executable, "-m", "testbed.cli", "sim", scenario_path, "--fabric", f,
                                    "--gpus", str(n), "--json"], capture_output=True, text=True, env=env,
                                   cwd=ROOT, timeout=900, check=True)
                r = json.loads(p.stdout)
                walls.append(r["wall_s"])
                rss.append(r["peak_rss_mib"])
            out.append({"fabric": f, "gpus": n, "wall_s_median": statistics.median(walls), "wall_s_all": walls,
                        "peak_rss_mib_median": statistics.median(rss), "peak_rss_mib_all": rss})
    return out


def sensitivity_section(scn, n: int) -> dict:
    sens = {}
    settings = SimSettings(reconfig_delay_ms=10.0)
    ft = simulate_iteration(scn, "fat-tree", n, settings)
    to = simulate_iteration(scn, "topoopt", n, settings)
    pp = dataclasses.replace(load_prices(), ocs_port=load_prices().patch_panel_port)
    gbps = to["detail"]["cost"]["counts"]["nic_gbps"]
    to_pp = dict(to, cost_usd=fabric_cost("topoopt", scale_scenario(scn, n).fabric, gbps, pp)["total_usd"])
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
    return sens


def traffic_section(paths: list[str], scales, uplinks) -> dict:
    from rlsim.fabrics import OVERSUB

    out: dict = {}
    for path in paths:
        scn = load_scenario(path)
        rows = []
        for n in scales:
            rs = {f: simulate_iteration(scn, f, n, SimSettings(reconfig_delay_ms=10.0)) for f in TRAFFIC_FABRICS}
            rs["rfabric-rewired"] = simulate_iteration(scn, "rfabric", n,
                                                       SimSettings(reconfig_delay_ms=10.0, train_rewire=True))
            ft, rf = rs["fat-tree"], rs["rfabric"]
            rows.append({"gpus": n,
                         "fabrics": {f: {"iteration_s": r["iteration_s"], "train_s": r["phases"]["train_s"],
                                         "sync_s": r["phases"]["sync_s"], "cost_usd": r["cost_usd"],
                                         "train_stages_s": {k: v for k, v in r["detail"]["train"].items()
                                                            if k.endswith("_s") and k != "compute_s"},
                                         "dp_rings": r["detail"]["train"].get("dp_rings")} for f, r in rs.items()},
                         "rfabric_slowdown_vs_fat_tree": rf["iteration_s"] / ft["iteration_s"] - 1,
                         "rfabric_train_vs_topoopt": rf["phases"]["train_s"] / rs["topoopt"]["phases"]["train_s"],
                         "rfabric_train_vs_mixnet": rf["phases"]["train_s"] / rs["mixnet"]["phases"]["train_s"],
                         "rfabric_rewired_slowdown_vs_fat_tree": rs["rfabric-rewired"]["iteration_s"] / ft["iteration_s"] - 1,
                         "rfabric_rewired_train_vs_topoopt": rs["rfabric-rewired"]["phases"]["train_s"]
                         / rs["topoopt"]["phases"]["train_s"],
                         "rfabric_transitions": transitions(rf), "rfabric_rewired_transitions": transitions(rs["rfabric-rewired"]),
                         "wall_s": {f: r["wall_s"] for f, r in rs.items()}})
        made = []
        for t in DEFAULT_RECONFIG_DELAYS_MS:
            for rw in (False, True):
                rf = simulate_iteration(scn, "rfabric", 2048, SimSettings(reconfig_delay_ms=t, train_rewire=rw))
                for k, v in rf["detail"]["reconfig"].items():
                    if v["action"] in ("switched", "stalled") and v["gain_ms"] is not None:
                        made.append({"reconfig_delay_ms": t, "train_rewire": rw, "transition": k,
                                     "action": v["action"], "gain_ms": v["gain_ms"]})
        pts = plan(scn, ["fat-tree"] + [f for f in OVERSUB if f != "fat-tree"] + ["rfabric"], [1024, 2048], [10.0],
                   uplinks=uplinks)
        taper = {}
        static = None
        for rw in (False, True):
            st = SimSettings(train_rewire=rw)
            ceilings = {n: perf_cost_ceiling(scn, n, uplinks, settings=dataclasses.replace(st, reconfig_delay_ms=10.0))
                        for n in (1024, 2048)}
            # the static fabrics do not re-wire: their results from the first pass serve the second
            res = run_sweep(scn, [p for p in pts if static is None or p.fabric == "rfabric"], st, use_ray=False,
                            progress=False)
            if static is None:
                static = [r for r in res if r["fabric"] != "rfabric"]
            else:
                res = static + res
            summ = summarise(res, ceilings)
            tp = taper.setdefault("rewired" if rw else "one_train_topology", {})
            for n, v in summ.items():
                for rad, e in v["vs_static"].items():
                    tp[n] = {k: ({kk: x[kk] for kk in ("label", "slowdown_vs_fat_tree", "cost_vs_fat_tree",
                                                       "perf_per_cost_vs_fat_tree")} if isinstance(x, dict) else x)
                             for k, x in e.items()}
                c = ceilings[int(n)]
                tp[n]["ceiling"] = {**v["ceiling"], "rfabric_vs_its_bound": [
                    {k: r.get(k) for k in ("uplinks_per_tor", "slowdown_vs_fat_tree", "perf_per_cost_vs_fat_tree",
                                           "ceiling_at_its_cost_vs_fat_tree", "vs_bound", "error")} for r in c["rfabric"]]}
        out[scn.name] = {"rows": rows, "switches_made_min_gain_ms": min((m["gain_ms"] for m in made), default=None),
                         "switches_made": len(made), "taper": taper}
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=os.path.join(ROOT, "scenarios", "dapo-32b.yaml"))
    ap.add_argument("--taper-scenario", default=os.path.join(ROOT, "scenarios", "dapo-32b-taper.yaml"))
    ap.add_argument("--runs", type=int, default=3, help="timing: runs per fabric and scale (median)")
    ap.add_argument("--scales", type=_ints, default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--goal-scales", type=_ints, default=[1024, 2048], help="perf_cost: scales")
    ap.add_argument("--uplinks", type=_ints, default=[2, 4, 8, 16, 32], help="perf_cost: uplinks per ToR")
    ap.add_argument("--timing-scales", type=_ints, default=[2048, 16384])
    ap.add_argument("--fabrics", default="fat-tree,rfabric,mixnet,topoopt", help="timing: fabrics")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--moe-scenarios", default="scenarios/moe-30b.yaml,scenarios/moe-235b.yaml",
                    help="traffic: the MoE scenarios (beside --scenario)")
    ap.add_argument("--traffic-scales", type=_ints, default=[1024, 2048, 16384])
    args = ap.parse_args(argv)
    # absolute: the timing section runs `orchestrrl sim` in child processes whose folder is the checkout
    args.scenario, args.taper_scenario = os.path.abspath(args.scenario), os.path.abspath(args.taper_scenario)
    logging.basicConfig(level=logging.ERROR)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:  # an unknown section was skipped without a word (exit 0, nothing measured)
        ap.error(f"--sections: unknown {unknown or 'empty'} (known: {', '.join(SECTIONS)})")
    if args.runs < 1 or any(n < 1 for n in args.scales + args.goal_scales + args.uplinks + args.timing_scales
                            + args.traffic_scales):
        ap.error("--runs, every scale and every uplink count must be >= 1")
    try:
        scn = load_scenario(args.scenario)
        taper = load_scenario(args.taper_scenario) if os.path.exists(args.taper_scenario) else None
    except SpecError as e:
        ap.error(str(e))
    out: dict = {"scenario": args.scenario, "taper_scenario": args.taper_scenario if taper else None}
    if "scales" in sections:
        out["scales"] = scales_section(scn, args.scales)
    if "perf_cost" in sections:
        out["perf_cost"] = perf_cost_section(scn, taper, args.goal_scales, args.uplinks)
    if "reconfig_delay" in sections:
        out["reconfig_delay"] = {scn.name: reconfig_delay_section(scn, 2048)}
        if taper is not None:
            out["reconfig_delay"][taper.name] = reconfig_delay_section(taper, 2048)
    if "timing" in sections:
        out["timing"] = timing_section(args.scenario, args.timing_scales, args.fabrics.split(","), args.runs)
    if "sensitivity" in sections:
        out["sensitivity_2048"] = sensitivity_section(scn, 2048)
    if "traffic" in sections:
        paths = [args.scenario] + [os.path.join(ROOT, p) for p in args.moe_scenarios.split(",") if p]
        out["traffic"] = traffic_section(paths, args.traffic_scales, args.uplinks)
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
