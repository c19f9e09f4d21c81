"""`orchestrrl run` (one policy) and `orchestrrl compare` (every policy and every static layout, same seed).

    orchestrrl run SCENARIO --policy P --backend emulated|simulated --out DIR [--steps N]
    orchestrrl compare SCENARIO --out DIR [--backend emulated|simulated] [--policies a,b,...] [--steps N]
both with [--fabric KIND[,KIND...]] [--time-dilation TDF] (``_fabric_options``)
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from testbed.commands.common import UsageError, out_folder

def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="scenario YAML")
    p.add_argument("--backend", default="emulated", help="emulated (real agents and fabric; root), simulated "
                                                         "(virtual time), or a plug-in (pkg.mod:Class; docs/plugins.md)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the scenario's)")
    p.add_argument("--out", default=None, help="output folder (default runs/<command>-<time>)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-cache", action="store_true", help="tune the static baseline afresh (testbed/runs/tuning.py "
                                                           "caches the grid by the scenario's content)")
    from testbed.runs.metrics import add_flags

    add_flags(p)


def register(sub) -> None:
    from testbed.orchestrator.policies import POLICIES

    r = sub.add_parser("run", help="run a scenario's RL steps under one policy (planner/balancer in the loop)")
    _common(r)
    r.add_argument("--policy", default="orchestrrl", help=f"one of {', '.join(POLICIES)}, static-tuned, "
                                                          f"static-TP<t>x<r>, static-TP<t>x<r>@<max_num_seqs>, a policy "
                                                          f"of the scenario's orchestrator.policies, or a definition "
                                                          f"NAME[planner=pkg.mod:Class,planner.PARAM=VALUE,...] "
                                                          f"(docs/plugins.md)")
    r.set_defaults(func=_run)
    c = sub.add_parser("compare", help="run every policy and every static layout on the same seed; report + plots")
    _common(c)
    c.add_argument("--policies", default=None, help=f"comma-separated names or definitions "
                                                    f"NAME[dispatch=REF,planner=REF,balancer=REF,ROLE.PARAM=VALUE] "
                                                    f"(REF: a registered name or pkg.mod:Class; docs/plugins.md) "
                                                    f"(default: the tuned static layout, static-low/high, "
                                                    f"{', '.join(POLICIES[2:])} and the scenario's orchestrator.policies)")
    c.set_defaults(func=_compare)
    _fabric_options(r, several=False)
    _fabric_options(c, several=True)
    m = sub.add_parser("map", help="where adaptive compute pays: oracle and policy gains over the knobs (heatmaps)")
    m.add_argument("scenario", help="scenario YAML (the map's centre)")
    m.add_argument("--out", default=None, help="output folder (default runs/map-<time>)")
    m.add_argument("--panels", default=None, help="knob pairs, e.g. median:requests_per_gpu,sigma:cap_fraction "
                                                  "(default: four panels; testbed/runs/policymap.py KNOBS)")
    m.add_argument("--values", action="append", default=[], metavar="KNOB=V1,V2",
                   help="the values of one knob (repeatable; default: KNOBS' values)")
    m.add_argument("--steps", type=int, default=1, help="RL steps per point (default 1)")
    m.add_argument("--no-cache", action="store_true", help="compute every point afresh")
    m.add_argument("--ray-address", default=None, help="a Ray cluster to run the points on (default: a local one)")
    m.add_argument("--no-ray", action="store_true", help="run the points one after the other")
    m.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    m.set_defaults(func=_map)


def _fabric_options(p: argparse.ArgumentParser, several: bool) -> None:
    if several:
        p.add_argument("--fabric", default=None,
                       help="comma-separated fabric kinds (rfabric, fat-tree, fat-tree-2to1, ...): the same RL steps "
                            "on each, side by side in fabrics.json (emulated: cross-checked against RLSim per phase)")
    else:
        p.add_argument("--fabric", default=None, help="fabric kind instead of the scenario's fabric.kind (rfabric, "
                                                      "fat-tree, fat-tree-2to1, ...)")
    p.add_argument("--time-dilation", type=time_dilation_arg, default=None, metavar="TDF|auto",
                   help="the scenario's fabric.time_dilation instead (0.05..100: links / TDF, compute x TDF; below 1 "
                        "time is compressed), emulated exactly; 'auto': fit the run to this machine (fabric.fit auto: "
                        "a lower scale, or a larger dilation, until each phase's traffic fits; testbed/cluster/fit.py)")
    p.add_argument("--train-rewire", action="store_true", default=None,
                   help="set the scenario's controller.train_rewire: RFabric's train phase starts on the EP/PP "
                        "stages' own topology and may re-wire to the DP rings' before the all-reduce (taken where "
                        "RLSim's iteration is faster so; the controller installs both, docs/rlsim.md)")


def time_dilation_arg(text: str):
    """``--time-dilation``: a number, or ``auto`` (fit the run to this machine)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or 'auto', got {text!r}") from None


def _fit(args, scn):
    """``scn`` fitted to this machine (testbed/cluster/fit.py) for an emulated run, every fabric kind of
    ``--fabric`` considered (the most demanding decides); the fit's line goes to stderr before anything starts."""
    import dataclasses

    from testbed.cluster.fit import fit_scenario
    from testbed.runs.fabric_compare import with_kind

    def measure():
        from testbed.benchmarks.bench_fabric import bench_fabric

        print("measuring this machine's forwarding capacity first (orchestrrl bench fabric, ~30 s)", file=sys.stderr,
              flush=True)
        bench_fabric()

    kinds = getattr(args, "kinds", None) or []
    fits = ([fit_scenario(with_kind(scn, k), measure=measure) for k in kinds] if len(kinds) > 1
            else [fit_scenario(scn, measure=measure)])
    fitted, fit = min(fits, key=lambda sf: sf[0].fabric.scale / sf[0].fabric.time_dilation)
    scn = dataclasses.replace(scn, fabric=dataclasses.replace(scn.fabric, scale=fitted.fabric.scale,
                                                             time_dilation=fitted.fabric.time_dilation))
    print(fit.line(), file=sys.stderr, flush=True)
    return scn, fit


def _with_fabric_options(args, scn):
    """``scn`` with ``--fabric`` (the first kind; SpecError naming ``fabric``) and ``--time-dilation``."""
    import dataclasses

    kinds = [k.strip() for k in (getattr(args, "fabric", None) or "").split(",") if k.strip()]
    args.kinds = kinds
    if kinds:
        from testbed.runs.fabric_compare import check_kinds, with_kind

        check_kinds(kinds, args.backend)
        if len(kinds) > 1 and args.func is _run:
            raise UsageError("run takes one --fabric (compare takes several)")
        scn = with_kind(scn, kinds[0])
    tdf = getattr(args, "time_dilation", None)
    if tdf == "auto":
        scn = dataclasses.replace(scn, fabric=dataclasses.replace(scn.fabric, fit="auto"))
    elif tdf is not None:  # a number given: emulated exactly as given
        scn = dataclasses.replace(scn, fabric=dataclasses.replace(scn.fabric, time_dilation=tdf, fit="off"))
    if getattr(args, "train_rewire", None):
        scn = dataclasses.replace(scn, controller=dataclasses.replace(scn.controller, train_rewire=True))
    return scn


def _prepare(args):
    from emulation.scenario import load_scenario
    from testbed.backends.registry import backend_kind
    from testbed.runs.experiment import Experiment

    from rlsim.limits import check_simulatable

    from testbed.runs.metrics import apply_flags

    scn = apply_flags(load_scenario(args.scenario), args)
    scn = _with_fabric_options(args, scn)
    steps = args.steps if args.steps is not None else scn.workload.steps
    if steps < 1:
        raise UsageError(f"--steps must be >= 1, got {steps}")
    fit = None
    kind = backend_kind(args.backend, "--backend")
    scn = kind.prepare(scn)  # its own checks, in 0.3 s, before anything starts
    check_simulatable(scn)  # the response-length arrays and the flow model of train/sync must fit
    if kind.needs_root:
        import os

        if os.geteuid() != 0:
            raise UsageError(f"--backend {args.backend} builds a fabric and needs root (or use --backend simulated)")
    if kind.has_controller:
        from testbed.runs.metrics import pin_controller_port

        scn = pin_controller_port(scn)  # the URL is printed before the cluster starts; a taken port: exit 2
        scn, fit = _fit(args, scn)  # the scale and dilation this machine forwards faithfully (fabric.fit)
    exp = Experiment(scn, args.backend, steps=steps, use_cache=not args.no_cache)
    exp.start_progress = _start_bar(args)
    exp.fit = fit
    return exp, steps


@contextlib.contextmanager
def _metrics(exp) -> Iterator[None]:
    """The run's Prometheus endpoints: this process's (the orchestrator and the engines) and, emulated, the
    controller's, their URLs printed before anything starts; the driver's stops when the command ends."""
    from emulation.metrics import url
    from testbed.runs.metrics import DriverMetrics

    ms = exp.scn.metrics
    with DriverMetrics().serve(ms.host, ms.driver_port) as dm:
        exp.metrics = dm
        ctl = ms.controller_port if exp.kind.has_controller else 0  # pinned by _prepare
        urls = [f"orchestrator and engines {dm.url}" if dm.url else None,
                f"controller {url(ms.host, ctl)}" if ctl else None]
        urls = [u for u in urls if u]
        # on stderr, beside the progress bars: stdout's first line is the fidelity verdict (issue 13)
        print("metrics: " + ("; ".join(urls) if urls else "off"), file=sys.stderr, flush=True)
        try:
            yield
        finally:
            exp.metrics = None


def _bar(args, total: int, desc: str, unit: str = "step"):
    """A progress bar on stderr (stdout carries the results), off under --quiet."""
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=args.quiet, unit=unit)


def _start_bar(args):
    """A progress bar per policy whose layout is tuned for it (``start: best``: one simulated run per layout)."""
    bars = {}

    def on(name: str, layout: str, k: int, n: int) -> None:
        if name not in bars:
            bars[name] = _bar(args, n, f"tuning {name}'s layout", "layout")
        bars[name].set_postfix_str(layout)
        bars[name].update(1)
        if k == n:
            bars.pop(name).close()
    return on


def _tune(args, exp) -> None:
    """The tuning grid first (simulated backend, seconds per configuration; cached), with a progress bar."""
    n = len(exp.layouts) * len(exp.grid_values)
    with _bar(args, n, "tuning the static baseline", "config") as bar:
        exp.tuning_grid(progress=lambda name: (bar.set_postfix_str(name), bar.update(1)))
        bar.update(bar.total - bar.n)


def _policy_args(exp, items: list[str]) -> list:
    """``--policy``/``--policies`` items: names, or definitions ``NAME[role=ref,...]``; each resolved now, its
    plug-ins imported and checked (SpecError: exit 2 before anything starts)."""
    from testbed.orchestrator.policies import parse_policy_arg

    out = [parse_policy_arg(x) for x in items]
    _check_policies(exp, out)
    return out


def _check_policies(exp, names: list) -> None:
    """Every policy of ``names`` made as it would be (SpecError: exit 2), without running anything: no tuning
    grid, and no layout tuned for a policy (``start: best`` runs it once per layout)."""
    from testbed.orchestrator.policies import make_policy

    low = make_policy("static-low", exp.layouts, exp.gpus)
    for n in names:
        make_policy(n, exp.layouts, exp.gpus, tuned=low, defined=exp.defined)


def _run(args) -> int:
    exp, steps = _prepare(args)
    from testbed.orchestrator.policies import needs_tuning

    name, = _policy_args(exp, [args.policy])
    out_folder(args.out, "runs")  # exit 2 before the tuning, not at the first write
    if needs_tuning(name, exp.defined):
        _tune(args, exp)
    policy = exp.policy(name)
    out = Path(args.out or f"runs/run-{policy.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    with _metrics(exp), _bar(args, steps, policy.name) as bar, exp:
        res, files = exp.run(policy, steps, out, progress=lambda msg, frac: (bar.set_postfix_str(msg), bar.update(
            round(frac * steps) - bar.n)))
        bar.update(steps - bar.n)
    _remember(exp, {policy.name: res.get("fidelity")})
    print(f"{policy.name} on {exp.backend_name}: step makespans " + ", ".join(f"{x:.2f}" for x in res["step_makespan_s"])
          + f" s; {res['throughput_tokens_per_s']:.0f} tokens/s; {res['layout_switches']} layout switches, "
          f"{res['migrations']} migrations, {res['lost_requests']} lost")
    print(tokens_line(res))
    if res.get("failures"):
        print(f"agents failed mid-run {res['failures']}; their requests were re-queued")
    if res.get("fidelity", {}).get("verdict"):
        print(f"fidelity: {res['fidelity']['verdict']}")
    if res.get("fit"):
        print(f"emulation fit ({res['fit']['mode']}): {res['fit']['message']}")
    for k, v in files.items():
        print(f"{k}: {v}")
    return 0


def _compare(args) -> int:
    if len([k for k in (getattr(args, "fabric", None) or "").split(",") if k.strip()]) > 1:  # several fabrics: testbed/runs/fabric_compare.py
        return _compare_fabrics(args)
    exp, steps = _prepare(args)
    from testbed.orchestrator.policies import split_policies

    names = _policy_args(exp, split_policies(args.policies)) if args.policies else None  # exit 2 before the tuning
    out = out_folder(args.out, f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    _tune(args, exp)
    policies = list({p.name: p for p in (exp.policy(n) for n in (names or exp.default_policies()))}.values())
    if steps == exp.steps:  # the oracle bounds (testbed/runs/oracle.py; cached like the grid)
        with _bar(args, steps, "oracle bounds") as bar:
            exp.oracle(progress=lambda msg: bar.update(1))
            bar.update(bar.total - bar.n)
    if exp.tuned().name not in {p.name for p in policies}:
        policies.insert(0, exp.tuned())
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
    _remember(exp, {n: p.get("fidelity") for n, p in report["policies"].items()})
    print(format_table(report))
    print(f"report: {files['report']}  plot: {files['makespan_png']}  (per policy: {out}/<policy>/: run.json, "
          f"timeline.json, trace-<policy>.json for chrome://tracing or ui.perfetto.dev, timeline and load plots)")
    return 0


def _remember(exp, fidelities: dict) -> None:
    """An emulated run's fidelity verdicts, remembered for the next run of its scenario to say before it starts
    (testbed/cluster/fit.py ``remember_outcome``)."""
    if exp.fit is not None:
        from testbed.cluster.fit import remember_outcome

        remember_outcome(exp.fit, fidelities)


def tokens_line(res: dict) -> str:
    """The run's token accounting in one line (run.json has it per step and per agent)."""
    return (f"tokens: {res['tokens_unique']} unique of {res['tokens_target']} targeted, {res['tokens_duplicate']} "
            f"duplicate(s) dropped: {'exactly once' if res['exactly_once'] else 'NOT exactly once'}")


def _map(args) -> int:
    import yaml

    from emulation.scenario import load_scenario
    from emulation.validation import SpecError
    from testbed.runs import policymap
    from testbed.runs.report import write_json

    scn = load_scenario(args.scenario)
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    panels = policymap.DEFAULT_PANELS
    if args.panels:
        panels = []
        for item in args.panels.split(","):
            a, _, b = item.partition(":")
            for k in (a, b):
                if k not in policymap.KNOBS:
                    raise UsageError(f"--panels: unknown knob {k!r} (known: {', '.join(policymap.KNOBS)})")
            panels.append((a, b))
    values = {}
    for item in args.values:
        k, _, v = item.partition("=")
        if k not in policymap.KNOBS or not v:
            raise UsageError(f"--values: expected KNOB=V1,V2 with a known knob ({', '.join(policymap.KNOBS)}), got {item!r}")
        values[k] = [yaml.safe_load(x) for x in v.split(",")]
    for a, b in panels:  # every point must be a valid scenario before anything runs
        for va in values.get(a, policymap.KNOBS[a][1]):
            for vb in values.get(b, policymap.KNOBS[b][1]):
                try:
                    policymap.apply(policymap.apply(scn, a, va), b, vb)
                except (SpecError, TypeError, ValueError) as e:
                    raise UsageError(f"{a}={va}, {b}={vb}: {e}") from None
    out = out_folder(args.out, f"runs/map-{time.strftime('%Y%m%d-%H%M%S')}")  # before the points run
    n = sum(len(values.get(a, policymap.KNOBS[a][1])) * len(values.get(b, policymap.KNOBS[b][1])) for a, b in panels)
    with _bar(args, n, "map", "point") as bar:
        doc = policymap.build(scn, panels, values, args.steps, use_ray=False if args.no_ray else None,
                              ray_address=args.ray_address, use_cache=not args.no_cache,
                              progress=lambda c: (bar.set_postfix_str(f"{c[1]}={c[2]} {c[3]}={c[4]}"), bar.update(1)))
    write_json(out / "map.json", doc)
    files = policymap.plot(doc, out)
    print(f"map: {out / 'map.json'}")
    for f in files:
        print(f"plot: {f}")
    return 0


def _compare_fabrics(args) -> int:
    from testbed.runs.fabric_compare import compare_fabrics, format_fabrics

    exp, steps = _prepare(args)
    from testbed.orchestrator.policies import split_policies

    names = _policy_args(exp, split_policies(args.policies)) if args.policies else exp.default_policies()
    _check_policies(exp, names)  # SpecError (exit 2) before anything starts
    out = out_folder(args.out, f"runs/fabrics-{time.strftime('%Y%m%d-%H%M%S')}")
    with _bar(args, steps * len(names) * len(args.kinds), "compare fabrics") as bar:
        done = {"n": -steps}

        def on_policy(label):
            done["n"] += steps
            bar.set_description(f"compare: {label}")

        def progress(msg, frac):
            bar.set_postfix_str(msg)
            bar.update(max(0, done["n"] + round(frac * steps) - bar.n))

        report, files = compare_fabrics(exp.scn, args.kinds, args.backend, names, steps, out, progress=progress,
                                        on_policy=on_policy)
        bar.update(bar.total - bar.n)
    print(format_fabrics(report))
    print(f"report: {files['fabrics']}  plot: {files['fabrics_png']}  (per fabric: {out}/<fabric>/report.json)")
    return 0


def format_table(report: dict) -> str:
    pols = report["policies"]
    idle = any(p.get("idle_s") for p in pols.values())
    rows = [f"{'policy':<20} {'makespan s (per step)':<28} {'tokens/s':>10} {'speedup':>8} {'switches':>8} "
            f"{'migr.':>6} {'lost':>5} {'MAPE':>6} {'oracle':>7}" + (f" {'idle s gen/train':>17}" if idle else "")]
    for name, p in pols.items():
        ms = ", ".join(f"{x:.1f}" for x in p["step_makespan_s"])
        mape = "-" if p.get("forecast_mape") is None else f"{p['forecast_mape']:.1f}%"
        frac = "-" if p.get("oracle_fraction") is None else f"{p['oracle_fraction']:.0%}"
        row = (f"{name:<20} {ms:<28} {p['throughput_tokens_per_s']:>10.0f} {p['speedup_vs_best_static']:>7.3f}x "
               f"{p['layout_switches']:>8} {p['migrations']:>6} {p['lost_requests']:>5} {mape:>6} {frac:>7}")
        if idle and p.get("idle_s"):
            row += f" {p['idle_s']['generators']:>8.1f}/{p['idle_s']['trainers']:<8.1f}"
        rows.append(row)
    grid = report.get("baseline_grid") or []
    rows.append(f"best static configuration: {report['best_static']} (tuned over {len(grid)} layout x max_num_seqs "
                f"configurations on the simulated backend; {report['backend']} backend, scenario {report['scenario']})")
    orc = report.get("oracle")
    if orc:
        rows.append("oracle bounds (every length known; testbed/runs/oracle.py): " + ", ".join(
            f"{k} {v['speedup']:.3f}x" for k, v in orc["kinds"].items()) + f", floor {orc['floor_speedup']:.3f}x; "
            "the 'oracle' column is each policy's speedup as a share of its kind's (report.json oracle_kind: a planner "
            "alone switch, a balancer or dispatcher alone placement, a planner with either both)")
    al = report.get("aliases") or {}
    if al:
        rows.append("aliases: " + ", ".join(f"{a} = {n}" for a, n in al.items()))
    for a, b in (report.get("same_runs") or {}).items():
        rows.append(f"{a}: not run, the same run as {b} step for step (max_num_seqs never bound in the tuning grid)")
    for n, p in pols.items():
        tried = p.get("start_tuning")
        if tried:  # start: best
            pick = min(tried, key=tried.get)
            rows.append(f"{n}: started in {pick}, the fastest for it of " + ", ".join(
                f"{lay} {t:.1f} s" for lay, t in tried.items()) + " (mean step makespan, simulated; start: best)")
    fids = {n: p.get("fidelity") or {} for n, p in pols.items()}
    judged = {n: f for n, f in fids.items() if "distorted" in f}
    if judged:  # the first line: a reader must know before the figures whether the emulation was faithful
        bad = {n: f for n, f in judged.items() if f["distorted"]}
        fit = report.get("fit")
        rows.insert(0, f"fidelity: {len(judged) - len(bad)} of {len(judged)} runs faithful"
                    + (f" (emulation fit {fit['mode']}: {fit['message']})" if fit else "")
                    + (f"; e.g. {next(iter(bad))}: {next(iter(bad.values()))['verdict']}" if bad else ""))
    failed = {n: p["failures"] for n, p in pols.items() if p.get("failures")}
    for n, f in failed.items():
        rows.append(f"{n}: agents failed mid-run {f}; their requests were re-queued ({pols[n]['lost_requests']} lost; "
                    f"{tokens_line(pols[n])})")
    return "\n".join(rows)
