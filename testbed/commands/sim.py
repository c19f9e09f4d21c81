"""`orchestrrl sim`: RLSim from the command line.

    orchestrrl sim SCENARIO --fabric F [--gpus N] [--reconfig-delay-ms T] [--fat-tree-tiers auto|2|3] [--train-rewire] [--json]
    orchestrrl sim sweep SCENARIO --out DIR [--fabrics a,b] [--scales 256,512] [--reconfig-delay-list 0.001,10]
                                            [--uplinks-list 4,8,32] [--ocs-list 4,8] [--radix-list 32,64]
                                            [--ray-address ADDR | --no-ray]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from emulation.scenario import load_scenario


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def register(subparsers) -> None:
    from rlsim.fabric_models import fabric_names
    from rlsim.fabrics import FAT_TREE_TIERS

    p = subparsers.add_parser("sim", help="simulate RL iterations at scale (RLSim)",
                              description="Simulate one RL iteration (or a sweep) on a fabric with RLSim. "
                                          "`orchestrrl sim sweep SCENARIO --out DIR` runs a sweep.")
    p.add_argument("target", metavar="SCENARIO", help="scenario YAML, or 'sweep' followed by the scenario")
    p.add_argument("scenario", nargs="?", metavar="SWEEP_SCENARIO", help=argparse.SUPPRESS)
    p.add_argument("--fabric", default="rfabric", help=f"fabric: {', '.join(fabric_names())}, or a plug-in "
                                                         f"pkg.mod:Class (rlsim/fabric_models.py; default rfabric)")
    p.add_argument("--gpus", type=int, default=None, help="re-size the scenario to N GPUs (whole pods)")
    p.add_argument("--reconfig-delay-ms", "--t-ocs-ms", dest="reconfig_delay_ms", type=float, default=None,
                   help="OCS switching time, ms (the reference's T_ocs; default: the scenario's reconfig_delay_ms)")
    p.add_argument("--fat-tree-tiers", choices=FAT_TREE_TIERS, default="auto",
                   help="packet tiers counted in the cost: auto (default: the fewest tiers of prices.yaml's "
                        "switch_radix-port switches that cover the NICs), 2 (ToR + spine), or 3 (the MixNet "
                        "calculator's method: ToR, aggregation and core from the uplink ratio)")
    p.add_argument("--train-rewire", action="store_true", default=None,
                   help="RFabric: re-wire inside the train phase, from the EP/PP stages' own topology to the DP "
                        "rings', when the switching rule says the rings gain more than T_ocs (a synchronous "
                        "iteration; default: the scenario's controller.train_rewire, which the live loop's "
                        "controller follows too)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--out", help="sweep: output directory (sweep.json and plots)")
    p.add_argument("--fabrics", type=_names, default=None, help="sweep: fabrics (default all)")
    p.add_argument("--scales", type=_ints, default=None, help="sweep: GPU counts (default: 2, 4 and 8 pods and the scenario's size)")
    p.add_argument("--reconfig-delay-list", "--t-ocs-list", dest="reconfig_delay_list", type=_floats, default=None,
                   help="sweep: T_ocs values in ms (default 0.001 .. 10000: 1 us to 10 s)")
    p.add_argument("--uplinks-list", type=_ints, default=None,
                   help="sweep: RFabric uplinks per ToR (the taper against its server ports; default: the scenario's)")
    p.add_argument("--ocs-list", type=_ints, default=None,
                   help="sweep: RFabric OCS counts (each must divide the uplinks; default: the scenario's ratio)")
    p.add_argument("--radix-list", type=_ints, default=None,
                   help="sweep: packet switch radix for the Fat-Tree tier count (default: prices.yaml's)")
    p.add_argument("--ray-address", default=None, help="sweep: Ray cluster address (default: local Ray)")
    p.add_argument("--no-ray", action="store_true", help="sweep: run serially even if Ray is installed")
    p.set_defaults(func=run)


def run(args) -> int:
    from testbed.commands.common import UsageError

    if args.target == "sweep":
        if not args.scenario:
            raise UsageError("sim sweep: give the scenario: orchestrrl sim sweep SCENARIO --out DIR")
        if not args.out:
            raise UsageError("sim sweep: --out DIR is required")
        return _sweep(args)
    if args.scenario:
        raise UsageError(f"unexpected argument {args.scenario!r} (did you mean 'sim sweep {args.target}'?)")
    if args.out:  # one iteration prints its figures; only a sweep writes a folder
        raise UsageError(f"--out is for 'sim sweep' (one iteration writes nothing; did you mean 'sim sweep "
                         f"{args.target} --out {args.out}'?)")
    from rlsim.fabrics import FabricOptions
    from rlsim.sim import SimSettings, resolved, simulate_iteration

    from rlsim.limits import check_simulatable

    scn = load_scenario(args.target)
    check_simulatable(scn, args.gpus)  # a size that cannot fit is an error naming the field, not a MemoryError
    settings = SimSettings(reconfig_delay_ms=args.reconfig_delay_ms, train_rewire=args.train_rewire,
                           fabric=FabricOptions(fat_tree_tiers=args.fat_tree_tiers))
    r = simulate_iteration(scn, args.fabric, args.gpus, settings)
    if args.json:
        json.dump(r, sys.stdout, indent=1)
        print()
    else:
        ph = r["phases"]
        print(f"{r['scenario']} on {r['fabric']} at {r['gpus']} GPUs (OCS switching {r['reconfig_delay_ms']:g} ms): "
              f"iteration {r['iteration_s']:.3f} s = gen {ph['gen_s']:.3f} + train {ph['train_s']:.3f} + "
              f"sync {ph['sync_s']:.3f}; network cost ${r['cost_usd'] / 1e6:.2f}M; simulated in {r['wall_s']:.2f} s")
        for name, d in r["detail"]["reconfig"].items():
            gain = "inf (the old topology cannot carry it)" if d.get("old_topology_carries") is False else (
                f"{d['gain_ms']:.3f} ms" if d.get("gain_ms") is not None else "-")
            window = f"{d['window_ms']:.3f} ms" if d.get("window_ms") is not None else "-"
            print(f"  {name}: {d['action']} (window {window}, predicted gain {gain}, stall {d['stall_s'] * 1e3:g} ms)")
        rw = r["detail"].get("train_rewire")
        if rw:
            print(f"  train re-wiring {'taken' if rw['taken'] else 'not taken'}: iteration "
                  f"{rw['rewired_iteration_s']:.3f} s re-wired against {rw['one_topology_iteration_s']:.3f} s "
                  "on one train topology")
        elif resolved(settings, scn).train_rewire:
            print("  train re-wiring: nothing to re-wire (RFabric only, and a train step with model-parallel "
                  "traffic beside the rings)")
    return 0


def _sweep(args) -> int:
    from rlsim.fabric_models import fabric_names
    from rlsim.sweep import DEFAULT_RECONFIG_DELAYS_MS, plan, ray_available, run_sweep, write_outputs

    scn = load_scenario(args.scenario)
    fabrics = args.fabrics or list(fabric_names())
    from rlsim.limits import pod_gpus

    from rlsim.limits import check_simulatable

    scales = args.scales or sorted({pod_gpus(scn.fabric) * k for k in (2, 4, 8)} | {scn.fabric.n_gpus})
    for g in scales:
        check_simulatable(scn, g)
    t_list = args.reconfig_delay_list or list(DEFAULT_RECONFIG_DELAYS_MS)
    points = plan(scn, fabrics, scales, t_list, uplinks=args.uplinks_list, ocs=args.ocs_list, radix=args.radix_list)
    use_ray = False if args.no_ray else ray_available()
    from rlsim.fabrics import FabricOptions
    from rlsim.sim import SimSettings

    from testbed.commands.common import out_folder

    out_folder(args.out)  # exit 2 before the sweep runs, not at its first write
    settings = SimSettings(train_rewire=args.train_rewire, fabric=FabricOptions(fat_tree_tiers=args.fat_tree_tiers))
    results = run_sweep(scn, points, settings, use_ray=use_ray, ray_address=args.ray_address)
    ceilings = {}
    if "fat-tree" in fabrics:  # what no fabric beats at these prices (rlsim/bounds.py), against the Fat-Tree
        from rlsim.bounds import perf_cost_ceiling

        ceilings = {n: perf_cost_ceiling(scn, n, settings=dataclasses.replace(settings, reconfig_delay_ms=10.0))
                    for n in scales}
    files = write_outputs(results, args.out, {"scenario": args.scenario, "fabrics": fabrics, "scales": scales,
                                              "reconfig_delay_ms": t_list, "ray": use_ray,
                                              "uplinks": args.uplinks_list, "ocs": args.ocs_list,
                                              "radix": args.radix_list, "fat_tree_tiers": args.fat_tree_tiers,
                                              "train_rewire": scn.controller.train_rewire
                                              if args.train_rewire is None else args.train_rewire},
                          ceilings)
    for k, v in files.items():
        print(f"{k}: {v}")
    summary = json.load(open(files["json"]))["summary"]
    for n, v in summary.items():
        for rad, e in v.get("vs_static", {}).items():
            if "best_rfabric" in e and "best_static" in e:
                print(f"{n} GPUs (radix {rad}): best RFabric within {v['slowdown_goal']:.0%} "
                      f"{e['best_rfabric']['label']} {e['best_rfabric']['perf_per_cost_vs_fat_tree']:.3f}x perf/cost "
                      f"vs the Fat-Tree; best static {e['best_static']['label']} "
                      f"{e['best_static']['perf_per_cost_vs_fat_tree']:.3f}x: RFabric {e['rfabric_vs_best_static']:.3f}x it")
        c = v.get("ceiling")
        if c and c["best_within_goal"]:
            b = c["best_within_goal"]
            print(f"{n} GPUs: ceiling (any fabric, these prices): {b['perf_per_cost_ceiling_vs_fat_tree']:.3f}x "
                  f"within {v['slowdown_goal']:.0%} ({b['uplinks_per_tor']} uplinks per ToR), "
                  f"{c['free_network_perf_per_cost_vs_fat_tree']:.3f}x with a free network at the cost floor")
    return 0
