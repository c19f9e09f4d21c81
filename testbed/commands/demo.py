"""`orchestrrl demo [SCENARIO]`: the scenario's RL phase cycle on a real emulated RFabric (see testbed/demo.py)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from testbed.cli import UsageError


def _run(args: argparse.Namespace) -> int:
    from emulation.scenario import load_scenario
    from testbed.demo import run_demo

    from rlsim.limits import check_simulatable

    scn = load_scenario(args.scenario)
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    scn.fabric.check_emulatable()  # in 0.3 s, before RLSim spends a minute on a cluster too large to build
    check_simulatable(scn)
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    steps = args.steps if args.steps is not None else scn.workload.steps
    with tqdm(total=3 * steps, desc="demo", file=sys.stderr, disable=args.quiet) as bar:
        res = run_demo(scn, out, steps=steps, progress=lambda msg: (bar.set_postfix_str(msg), bar.update(1)))
    print(f"scenario {res['scenario']}: {res['servers']} servers ({res['gpus']} modelled GPUs), "
          f"links {res['link_mbps']:g} Mb/s (scale {res['scale']:g}), OCS delay {res['switching_delay_ms']:g} ms")
    print(f"{'step':>4} {'phase':>5} {'reconfig':>9} {'total ms':>9}  traffic")
    for e in res["events"]:
        r = e["reconfig"]
        if "token_streams" in e:
            t = e["token_streams"]
            what = f"{t['streams']} token streams, {t['received']}/{t['sent']} packets delivered"
        elif "broadcast" in e:
            b = e["broadcast"]
            what = f"Gloo broadcast {b['bytes'] / 2**20:.1f} MiB to {b['ranks'] - 1} generators: {b['time_s']:.3f} s"
        elif e["all_reduce"].get("skipped"):
            what = e["all_reduce"]["skipped"]
        else:
            a = e["all_reduce"]
            what = f"Gloo all-reduce {a['bytes'] / 2**20:.1f} MiB over {a['ranks']} trainers: {a['time_s']:.3f} s"
        print(f"{e['step']:>4} {e['phase']:>5} {r['status']:>9} {r['total_ms'] or 0:>9.2f}  {what}")
    s = res["rlsim_rfabric"]
    ar = s["train_dp_allreduce_s"]
    print(f"RLSim (RFabric, same scenario): iteration {s['iteration_s']:.2f} s = gen {s['phases']['gen_s']:.2f} + "
          f"sync {s['phases']['sync_s']:.3f} + train {s['phases']['train_s']:.3f} s"
          + (f" (train all-reduce {ar:.3f} s)" if ar is not None else ""))
    print(f"results: {out / 'demo.json'}  plot: {out / 'demo.png'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a scenario's RL phase cycle on the emulated fabric")
    p.add_argument("scenario", nargs="?", default="scenarios/default.yaml", help="scenario YAML")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the scenario's)")
    p.add_argument("--out", default=None, help="output folder (default runs/demo-<time>)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
