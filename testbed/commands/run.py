"""`orchestrrl run` (one policy) and `orchestrrl compare` (every policy and every static layout, same seed).

    orchestrrl run SCENARIO --policy P --backend emulated|simulated --out DIR [--steps N]
    orchestrrl compare SCENARIO --out DIR [--backend emulated|simulated] [--policies a,b,...] [--steps N]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from testbed.cli import UsageError

BACKENDS = ("emulated", "simulated")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="scenario YAML")
    p.add_argument("--backend", choices=BACKENDS, default="emulated", help="emulated (real agents and fabric; root) "
                                                                           "or simulated (virtual time)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the scenario's)")
    p.add_argument("--out", default=None, help="output folder (default runs/<command>-<time>)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    from testbed.metrics import add_flags

    add_flags(p)


def register(sub) -> None:
    from testbed.orchestrator.settings import POLICIES

    r = sub.add_parser("run", help="run a scenario's RL steps under one policy (planner/balancer in the loop)")
    _common(r)
    r.add_argument("--policy", default="orchestrrl", help=f"one of {', '.join(POLICIES)} or static-TP<t>x<r>")
    r.set_defaults(func=_run)
    c = sub.add_parser("compare", help="run every policy and every static layout on the same seed; report + plots")
    _common(c)
    c.add_argument("--policies", default=None, help=f"comma-separated (default: every static layout and {', '.join(POLICIES[2:])})")
    c.set_defaults(func=_compare)


def _prepare(args):
    from emulation.scenario import load_scenario
    from testbed.experiment import Experiment

    from rlsim.limits import check_simulatable

    from testbed.metrics import apply_flags

    scn = apply_flags(load_scenario(args.scenario), args)
    steps = args.steps if args.steps is not None else scn.workload.steps
    if steps < 1:
        raise UsageError(f"--steps must be >= 1, got {steps}")
    if args.backend == "emulated":
        scn.fabric.check_emulatable()  # in 0.3 s, before anything starts
    check_simulatable(scn)  # the response-length arrays and the flow model of train/sync must fit
    if args.backend == "emulated":
        import os

        if os.geteuid() != 0:
            raise UsageError("--backend emulated builds a fabric and needs root (or use --backend simulated)")
        from testbed.metrics import pin_controller_port

        scn = pin_controller_port(scn)  # the URL is printed before the cluster starts; a taken port: exit 2
    return Experiment(scn, args.backend), steps


@contextlib.contextmanager
def _metrics(exp) -> Iterator[None]:
    """The run's Prometheus endpoints: this process's (the orchestrator and the engines) and, emulated, the
    controller's, their URLs printed before anything starts; the driver's stops when the command ends."""
    from emulation.metrics import url
    from testbed.metrics import DriverMetrics

    ms = exp.scn.metrics
    with DriverMetrics().serve(ms.host, ms.driver_port) as dm:
        exp.metrics = dm
        ctl = ms.controller_port if exp.backend_name == "emulated" else 0  # pinned by _prepare
        urls = [f"orchestrator and engines {dm.url}" if dm.url else None,
                f"controller {url(ms.host, ctl)}" if ctl else None]
        urls = [u for u in urls if u]
        print("metrics: " + ("; ".join(urls) if urls else "off"), flush=True)
        try:
            yield
        finally:
            exp.metrics = None


def _bar(args, total: int, desc: str):
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=args.quiet, unit="step")


def _run(args) -> int:
    exp, steps = _prepare(args)
    policy = exp.policy(args.policy)  # SpecError (exit 2) before anything starts
    out = Path(args.out or f"runs/run-{policy.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    with _metrics(exp), _bar(args, steps, policy.name) as bar, exp:
        res, files = exp.run(policy, steps, out, progress=lambda msg, frac: (bar.set_postfix_str(msg), bar.update(
            round(frac * steps) - bar.n)))
        bar.update(steps - bar.n)
    print(f"{policy.name} on {exp.backend_name}: step makespans " + ", ".join(f"{x:.2f}" for x in res["step_makespan_s"])
          + f" s; {res['throughput_tokens_per_s']:.0f} tokens/s; {res['layout_switches']} layout switches, "
          f"{res['migrations']} migrations, {res['lost_requests']} lost")
    if res.get("fidelity", {}).get("verdict"):
        print(f"fidelity: {res['fidelity']['verdict']}")
    for k, v in files.items():
        print(f"{k}: {v}")
    return 0


def _compare(args) -> int:
    exp, steps = _prepare(args)
    names = [n.strip() for n in args.policies.split(",") if n.strip()] if args.policies else exp.default_policies()
    policies = [exp.policy(n) for n in names]
    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    with _metrics(exp), _bar(args, steps * len(policies), "compare") as bar, exp:
        done = {"n": 0}

        def progress(msg, frac, name=None):
            bar.set_postfix_str(msg)
            bar.update(done["n"] + round(frac * steps) - bar.n)

        def next_policy(name):
            done["n"] = policies.index(next(p for p in policies if p.name == name)) * steps
            bar.set_description(f"compare: {name}")

        report, files = exp.compare(policies, steps, out, progress=progress, on_policy=next_policy)
        bar.update(bar.total - bar.n)
    print(format_table(report))
    print(f"report: {files['report']}  plot: {files['makespan_png']}  (per policy: {out}/<policy>/: run.json, "
          f"timeline.json, trace-<policy>.json for chrome://tracing or ui.perfetto.dev, timeline and load plots)")
    return 0


def format_table(report: dict) -> str:
    pols = report["policies"]
    idle = any(p.get("idle_s") for p in pols.values())
    rows = [f"{'policy':<16} {'makespan s (per step)':<28} {'tokens/s':>10} {'speedup':>8} {'switches':>8} "
            f"{'migr.':>6} {'lost':>5} {'MAPE':>6}" + (f" {'idle s gen/train':>17}" if idle else "")]
    for name, p in pols.items():
        ms = ", ".join(f"{x:.1f}" for x in p["step_makespan_s"])
        mape = "-" if p.get("forecast_mape") is None else f"{p['forecast_mape']:.1f}%"
        row = (f"{name:<16} {ms:<28} {p['throughput_tokens_per_s']:>10.0f} {p['speedup_vs_best_static']:>7.3f}x "
               f"{p['layout_switches']:>8} {p['migrations']:>6} {p['lost_requests']:>5} {mape:>6}")
        if idle and p.get("idle_s"):
            row += f" {p['idle_s']['generators']:>8.1f}/{p['idle_s']['trainers']:<8.1f}"
        rows.append(row)
    rows.append(f"best static layout: {report['best_static']} ({report['backend']} backend, scenario {report['scenario']})")
    fids = {n: p.get("fidelity") or {} for n, p in pols.items()}
    judged = {n: f for n, f in fids.items() if "distorted" in f}
    if judged:
        bad = {n: f for n, f in judged.items() if f["distorted"]}
        rows.append(f"fidelity: {len(judged) - len(bad)} of {len(judged)} runs faithful"
                    + (f"; e.g. {next(iter(bad))}: {next(iter(bad.values()))['verdict']}" if bad else ""))
    failed = {n: p["failures"] for n, p in pols.items() if p.get("failures")}
    for n, f in failed.items():
        rows.append(f"{n}: agents failed mid-run {f}; their requests were re-queued ({pols[n]['lost_requests']} lost)")
    return "\n".join(rows)
