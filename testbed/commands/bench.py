"""`orchestrrl bench reconfig|fabric|faults|crosscheck|...`: benchmarks that print JSON figures (they never assert)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tqdm import tqdm

from controller.datapath import FLUSH_MODES
from emulation.spec import HOST_TCP_CCS, FabricSpec
from testbed.commands.common import UsageError, out_folder, positive, shipped_scenario


def _reconfig(args: argparse.Namespace) -> int:
    from testbed.benchmarks.bench_fabric import CASES, bench_reconfig

    positive("delay-ms", args.delay_ms, allow_zero=True)
    if args.delay_ms > 1000:
        raise UsageError(f"--delay-ms must be <= 1000 for this benchmark, got {args.delay_ms:g}")
    if args.samples < 1:
        raise UsageError(f"--samples must be >= 1, got {args.samples}")
    positive("pps", args.pps)
    with tqdm(total=len(CASES) * args.samples, desc=f"reconfig D={args.delay_ms:g} ms", file=sys.stderr,
              disable=args.quiet) as bar:
        res = bench_reconfig(args.delay_ms, samples=args.samples, pps=args.pps,
                             progress=lambda n: bar.update(n - bar.n), datapath_flush=args.datapath_flush,
                             metrics=args.metrics == "on")
    _emit(res, args.json)
    return 0


def _fabric(args: argparse.Namespace) -> int:
    from testbed.benchmarks.bench_fabric import bench_fabric

    positive("rate-mbps", args.rate_mbps)
    positive("seconds", args.seconds)
    with tqdm(total=3, desc="fabric", file=sys.stderr, disable=args.quiet) as bar:
        res = bench_fabric(rate_mbps=args.rate_mbps, seconds=args.seconds, save=not args.no_save,
                           progress=lambda n: bar.update(n - bar.n))
    _emit(res, args.json)
    return 0


def _faults(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from testbed.benchmarks.bench_faults import KILL_MODES, bench_faults

    modes = [m.strip() for m in args.kill.split(",") if m.strip()]
    bad = [m for m in modes if m not in KILL_MODES]
    if bad or not modes:
        raise UsageError(f"--kill: unknown {bad or 'empty'} (known: {', '.join(KILL_MODES)})")
    if not Path(args.scenario).is_file():
        raise UsageError(f"scenario: no such file {args.scenario!r}")
    if args.after_tokens < 1:
        raise UsageError(f"--after-tokens must be >= 1, got {args.after_tokens}")
    out = out_folder(args.out, f"runs/bench-faults-{time.strftime('%Y%m%d-%H%M%S')}")
    with tqdm(total=len(modes), desc="faults", file=sys.stderr, disable=args.quiet) as bar:
        res = bench_faults(args.scenario, modes, out, tokens=args.after_tokens, baseline=not args.no_baseline,
                           progress=lambda n: bar.update(n - bar.n))
    _emit(res, args.json)
    return 0


def _crosscheck(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from testbed.benchmarks.bench_crosscheck import bench_crosscheck

    if not Path(args.scenario).is_file():
        raise UsageError(f"scenario: no such file {args.scenario!r}")
    positive("timeout-s", args.timeout_s)
    out = out_folder(args.out, f"runs/bench-crosscheck-{time.strftime('%Y%m%d-%H%M%S')}")
    with tqdm(total=1, desc="crosscheck (demo, then simulated)", file=sys.stderr, disable=args.quiet) as bar:
        # absolute: the demo runs in a child process whose folder is the checkout (bench_crosscheck.run_demo)
        res = bench_crosscheck(Path(args.scenario).resolve(), out.resolve(), timeout_s=args.timeout_s)
        bar.update(1)
    _emit(res, args.json)
    return 0 if res["demo_exit"] == 0 else 1


def _emit(res: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>22}: {v}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks of the emulated fabric (JSON figures)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    r = bsub.add_parser("reconfig", help="blackout seen by a probe (same uplinks re-paired; re-routed to other "
                                         "uplinks) and the controller overhead, stage by stage")
    r.add_argument("--delay-ms", type=float, default=10.0, help="programmed switching delay D (default 10)")
    r.add_argument("--samples", type=int, default=20, help="reconfigurations measured per case (default 20)")
    r.add_argument("--pps", type=float, default=2000.0,
                   help="probe packets per second (default 2000: 0.5 ms resolution; faster probes load the "
                        "2 cores and widen the tail they measure)")
    r.add_argument("--datapath-flush", choices=FLUSH_MODES, default="auto",
                   help="the controller's datapath_flush (default auto: purge Open vSwitch's cached flows when "
                        "deletes and adds are confirmed; off: leave the cache to the revalidators)")
    r.add_argument("--metrics", choices=("on", "off"), default="off",
                   help="on: the controller serves its Prometheus metrics (a free loopback port), scraped every "
                        "second by the benchmark, as in a run with metrics (default off)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=_reconfig)
    k = bsub.add_parser("faults", help="a generator agent killed during generation, a migration, a layout "
                                       "switch or a weight sync: noticed when, longest tick, migrations per "
                                       "interval, lost, duplicates, generation time against the simulated "
                                       "survivors' (root)")
    k.add_argument("scenario", nargs="?", default=shipped_scenario("default.yaml"), help="scenario YAML")
    k.add_argument("--kill", default="generation,migration,layout_switch,weight_sync",
                   help="comma-separated kill modes (a fresh cluster for each)")
    from testbed.benchmarks.bench_faults import KILL_AFTER_TOKENS

    k.add_argument("--after-tokens", type=int, default=KILL_AFTER_TOKENS,
                   help=f"generation kill: once the victim has produced this many tokens (default {KILL_AFTER_TOKENS})")
    k.add_argument("--no-baseline", action="store_true",
                   help="skip the run without a kill on each cluster (emulated_no_kill_s)")
    k.add_argument("--out", default=None, help="run folders (default runs/bench-faults-<time>)")
    k.add_argument("--json", action="store_true", help="print one JSON object")
    k.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    k.set_defaults(func=_faults)
    f = bsub.add_parser("fabric", help="shaped-circuit goodput ratio and forwarding capacity")
    f.add_argument("--rate-mbps", type=float, default=1000.0, help="emulated rate of the shaped circuit")
    f.add_argument("--seconds", type=float, default=4.0, help="length of each iperf3 run")
    f.add_argument("--no-save", action="store_true", help="do not save the capacity for the builder's warning")
    f.add_argument("--json", action="store_true", help="print one JSON object")
    f.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    f.set_defaults(func=_fabric)
    x = bsub.add_parser("crosscheck", help="`orchestrrl demo SCENARIO`, then the simulated backend on the same "
                                           "policies: per-policy makespan and phase times side by side (root)")
    x.add_argument("scenario", nargs="?", default=shipped_scenario("default.yaml"), help="scenario YAML")
    x.add_argument("--out", default=None, help="run folders (default runs/bench-crosscheck-<time>)")
    x.add_argument("--timeout-s", type=float, default=1800.0, help="the demo's time limit (default 1800)")
    x.add_argument("--json", action="store_true", help="print one JSON object")
    x.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    x.set_defaults(func=_crosscheck)
    register_agents(bsub)
    register_orchestrator(bsub)


def _collectives(args: argparse.Namespace) -> int:
    from testbed.benchmarks.bench_agents import bench_collectives

    positive("rate-mbps", args.rate_mbps)
    positive("bucket-mib", args.bucket_mib)
    if not args.sizes_mib or any(not (0 < s <= 1024) for s in args.sizes_mib):
        raise UsageError(f"--sizes-mib must be sizes in (0, 1024], got {args.sizes_mib}")
    with tqdm(total=len(args.sizes_mib), desc="collectives", file=sys.stderr, disable=args.quiet) as bar:
        res = bench_collectives(tuple(args.sizes_mib), rate_mbps=args.rate_mbps, bucket_mib=args.bucket_mib,
                                progress=lambda n: bar.update(n - bar.n), host_tcp_cc=args.host_tcp_cc)
    _emit(res, args.json)
    return 0


def _generation(args: argparse.Namespace) -> int:
    from testbed.benchmarks.bench_agents import bench_generation

    positive("rate-mbps", args.rate_mbps)
    positive("seconds", args.seconds)
    if not 1 <= args.batch <= 1024:
        raise UsageError(f"--batch must be in 1..1024, got {args.batch}")
    with tqdm(total=5, desc="generation", file=sys.stderr, disable=args.quiet) as bar:
        res = bench_generation(rate_mbps=args.rate_mbps, batch=args.batch, measure_s=args.seconds,
                               progress=lambda n: bar.update(n))
    _emit(res, args.json)
    return 0


def _alltoall(args: argparse.Namespace) -> int:
    from pathlib import Path

    from emulation.scenario import load_scenario
    from testbed.benchmarks.bench_agents import A2A_TOPOLOGIES, bench_alltoall

    if not Path(args.scenario).is_file():
        raise UsageError(f"scenario: no such file {args.scenario!r}")
    if not 1 <= args.repeats <= 100:
        raise UsageError(f"--repeats must be in 1..100, got {args.repeats}")
    topos = [t.strip() for t in args.topologies.split(",") if t.strip()]
    bad = [t for t in topos if t not in A2A_TOPOLOGIES]
    if bad or not topos:
        raise UsageError(f"--topologies: unknown {bad or 'empty'} (known: {', '.join(A2A_TOPOLOGIES)})")
    scn = load_scenario(args.scenario)
    if args.host_tcp_cc:
        scn = dataclasses.replace(scn, fabric=dataclasses.replace(scn.fabric, host_tcp_cc=args.host_tcp_cc))
    if scn.fabric.is_static:
        raise UsageError(f"scenario {args.scenario!r} builds a static {scn.fabric.kind}: the topologies are RFabric's")
    if scn.workload.train_ep <= 1:
        raise UsageError(f"scenario {args.scenario!r} trains without expert parallelism (train_ep): no all-to-all")
    with tqdm(total=len(topos) * args.repeats, desc="all-to-all", file=sys.stderr, disable=args.quiet) as bar:
        res = bench_alltoall(scn, args.repeats, tuple(topos), progress=lambda n: bar.update(n - bar.n))
    _emit(res, args.json)
    return 0


def _sizes(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated MiB sizes, got {text!r}") from None


def register_agents(bsub) -> None:
    c = bsub.add_parser("collectives", help="Gloo all-reduce and pipelined broadcast between agents (JSON)")
    c.add_argument("--sizes-mib", type=_sizes, default=[1, 4, 16, 64, 256], help="payload sizes (MiB)")
    c.add_argument("--rate-mbps", type=float, default=400.0, help="emulated rate of every link (default 400)")
    c.add_argument("--bucket-mib", type=float, default=0.5,
                   help="broadcast bucket (MiB; default 0.5 = veRL's 512 MB buckets at the default scale 0.001)")
    c.add_argument("--host-tcp-cc", choices=HOST_TCP_CCS, default=FabricSpec.host_tcp_cc,
                   help=f"TCP congestion control in the hosts (default {FabricSpec.host_tcp_cc}; fabric.host_tcp_cc)")
    c.add_argument("--json", action="store_true")
    c.add_argument("-q", "--quiet", action="store_true")
    c.set_defaults(func=_collectives)
    a = bsub.add_parser("alltoall", help="the live loop's MoE all-to-all against RLSim's model of it, per train "
                                         "topology (JSON)")
    a.add_argument("scenario", nargs="?", default=shipped_scenario("moe-small.yaml"), help="an MoE scenario (default moe-small)")
    a.add_argument("--repeats", type=int, default=3, help="train phases per topology (default 3)")
    a.add_argument("--topologies", default="train,train:mp", help="comma-separated: train, train:mp")
    a.add_argument("--host-tcp-cc", choices=HOST_TCP_CCS, default=None,
                   help="TCP congestion control in the hosts (default: the scenario's fabric.host_tcp_cc)")
    a.add_argument("--json", action="store_true")
    a.add_argument("-q", "--quiet", action="store_true")
    a.set_defaults(func=_alltoall)
    g = bsub.add_parser("generation", help="token streaming, token lag, migration downtime (JSON)")
    g.add_argument("--batch", type=int, default=64, help="decode batch per replica (default 64)")
    g.add_argument("--seconds", type=float, default=8.0, help="measurement window (default 8)")
    g.add_argument("--rate-mbps", type=float, default=400.0)
    g.add_argument("--json", action="store_true")
    g.add_argument("-q", "--quiet", action="store_true")
    g.set_defaults(func=_generation)


def _planner(args: argparse.Namespace) -> int:
    from emulation.scenario import load_scenario
    from testbed.benchmarks.bench_orchestrator import bench_planner

    scn = load_scenario(args.scenario)
    if args.set:  # the planner's or balancer's settings changed for the bench, validated as a scenario's are
        import dataclasses

        from testbed.benchmarks.bench_policies import with_settings

        bad = [x for x in args.set if "=" not in x or not x.partition("=")[0].strip()]
        if bad:
            raise UsageError(f"--set takes KEY=VALUE (e.g. planner.confirm_draws=2), got {bad[0]!r}")
        scn = dataclasses.replace(scn, orchestrator=with_settings(scn.orchestrator, args.set))
    if scn.workload.trace:
        raise UsageError(f"scenario {scn.name!r} replays a trace (workload.trace): the bench draws its in-flight "
                         "requests and its forecast from a configured length distribution (response_median_tokens, "
                         "response_sigma, or a mixture); give a scenario with one")
    if scn.orchestrator.planner.lengths != "forecast":
        raise UsageError(f"planner.lengths={scn.orchestrator.planner.lengths}: the bench has no true lengths to "
                         "give the planner (an oracle of the simulated backend's runs); it times the forecast's planner")
    if not 1 <= args.requests <= 1_000_000:
        raise UsageError(f"--requests must be in 1..1000000, got {args.requests}")
    if not 1 <= args.ticks <= 100_000:
        raise UsageError(f"--ticks must be in 1..100000, got {args.ticks}")
    with tqdm(total=args.ticks, desc="planner", file=sys.stderr, disable=args.quiet) as bar:
        res = bench_planner(scn, args.requests, args.ticks, progress=lambda n: bar.update(n - bar.n),
                            metrics=args.metrics == "on")
    res["settings_changed"] = list(args.set)
    _emit(res, args.json)
    return 0


def _engine(args: argparse.Namespace) -> int:
    """The cost model against every published engine measurement (agents/data/engine_cases.yaml)."""
    from testbed.runs.validation import CASES_FILE, load_cases, markdown_table, run_cases

    cases = load_cases(args.cases or CASES_FILE)
    only = tuple(x.strip() for x in (args.only or "").split(",") if x.strip())
    known = {c.id for c in cases.cases} | {c.kind for c in cases.cases}
    bad = [x for x in only if x not in known]
    if bad:
        raise UsageError(f"--only: unknown case or kind {', '.join(bad)} (known kinds: "
                         f"{', '.join(sorted({c.kind for c in cases.cases}))})")
    doc = run_cases(cases, only)
    if args.table:
        print(markdown_table(doc))
        return 0
    _emit(doc, args.json)
    return 0


def register_orchestrator(bsub) -> None:
    e = bsub.add_parser("engine", help="the cost model against published engine measurements, case by case (JSON)")
    e.add_argument("--cases", default=None, help="a case file (default agents/data/engine_cases.yaml)")
    e.add_argument("--only", default=None, help="comma-separated case ids or kinds (step_ms, cpu_share, "
                                                "overlap_speedup, eager_ms, rollout_s)")
    e.add_argument("--table", action="store_true", help="print the docs' markdown table instead")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_engine)
    p = bsub.add_parser("planner", help="the planner's and balancer's decision time for N in-flight requests (JSON)")
    p.add_argument("scenario", nargs="?", default=shipped_scenario("default.yaml"), help="scenario YAML (default: the default)")
    p.add_argument("--requests", type=int, default=1024, help="in-flight requests (default 1024)")
    p.add_argument("--ticks", type=int, default=50, help="planning ticks measured (default 50)")
    p.add_argument("--metrics", choices=("on", "off"), default="off",
                   help="on: the run's metrics observer sees every tick's sample and plan event, served to a "
                        "scraper every second, as in a run with metrics (default off)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an orchestrator setting changed for the bench, e.g. planner.confirm_draws=2 or "
                        "planner.lookahead=false (YAML values, as in the scenario's orchestrator section; repeatable)")
    p.add_argument("--json", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=_planner)
