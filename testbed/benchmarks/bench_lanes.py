"""How much of the lane oracle can a policy keep that finds the long requests by their progress alone?

    .venv/bin/python testbed/benchmarks/bench_lanes.py [--scenarios short-7b,default] [--steps 1] [--top 5]
        [--knowledge progress,prompt,predictor:0.25] [--seed N] [--known-seeds 32,64,128,256,512] [--plot FILE.png]
    .venv/bin/python testbed/benchmarks/bench_lanes.py --from-json A.json [B.json ...] [--plot FILE.png]

Per scenario (scenarios/NAME.yaml) and step, on the engine (virtual time, the engine the simulated backend
and the oracle run): the best static configuration (every feasible layout x the tuning grid's max_num_seqs,
the tuned baseline's search), the lane oracle (testbed.runs.oracle ``both``: every response length known at
time 0), the floor (the longest response alone at the fastest layout), and the search of
testbed/runs/lanes.py: every progress-informed lane plan, free layouts and free instant migrations, so that
its best is an upper estimate for online lane policies of that family. ``--knowledge`` searches again with
more known at time 0 than an online policy knows (testbed/runs/lanes.py ``scores``: each prompt's difficulty,
or a per-request length predictor of a given log error), the lanes seeded with the top-scored requests
(``KNOWN_GRID``): what it would take to keep the oracle's gain. Prints one JSON document: per scenario the
generation time summed over the steps of each, and per knowledge the speedups over the best static, the share
of the oracle's speedup the best lane plan keeps, and the ``--top`` plans. A benchmark reports; it asserts
nothing. Deterministic: the same scenario and seed give the same figures (a predictor's noise is drawn from
the scenario's seed). ``--plot`` draws, per scenario, the speedup against the predictor's log error beside the
other knowledge's and the oracle's (:func:`plot`). ``--from-json`` merges and re-plots the JSON of earlier runs
instead of searching (the full table is two processes of ~17 minutes, ``--knowledge`` split between them):
runs of one scenario must agree on its steps, seed, tuned static and oracle, and a knowledge searched twice
on its figure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from emulation.scenario import load_scenario  # noqa: E402
from emulation.workload import LengthSchedule  # noqa: E402
from testbed.runs.lanes import GRID, KNOWN_GRID, as_json, parse_knowledge, plans, scores, search  # noqa: E402
from testbed.runs.oracle import Oracle, ServerPlan  # noqa: E402


def bench_scenario(path: Path, steps: int, top: int, grid: dict = GRID, quiet: bool = False,
                   knowledge: tuple = ("progress",), known_grid: dict = KNOWN_GRID, seed: int | None = None) -> dict:
    scn = load_scenario(path)
    if seed is not None:  # the scenario's seed replaced (its lengths, deal and a predictor's noise)
        scn = dataclasses.replace(scn, seed=seed)
    probe = Oracle(scn, ("TP1x8", scn.orchestrator.engine.max_num_seqs), steps=steps)
    cases = probe.step_cases()
    # the tuned static: the configuration with the least generation time summed over the steps
    static = {f"{c.layout.name(probe.gpus)}@{c.max_num_seqs}": sum(probe.static(l, p, c) for _, l, p in cases)
              for c in probe.configs}
    tuned = min(static, key=lambda k: (static[k], k))
    lay, mns = tuned.split("@")
    orc = Oracle(scn, (lay, int(mns)), steps=steps)
    grids = {kind: grid if kind == "progress" else known_grid for kind in knowledge}
    n_plans = {kind: len(plans(orc, len(orc.servers), g)) for kind, g in grids.items()}
    out = {"scenario": scn.name, "steps": steps, "seed": scn.seed, "tuned_static": tuned, "plans_searched": n_plans,
           "grid": {kind: {k: list(v) for k, v in g.items()} for kind, g in grids.items()},
           "static_gen_s": 0.0, "oracle_gen_s": 0.0, "floor_s": 0.0,
           "knowledge": {kind: {"lanes_gen_s": 0.0} for kind in knowledge}, "per_step": []}
    sched = LengthSchedule(orc.w)
    with tqdm(total=sum(n_plans.values()) * len(cases), desc=f"lanes {scn.name}", file=sys.stderr,
              disable=quiet) as bar:
        for k, lengths, placed in cases:
            st = orc.static(lengths, placed, orc.tuned)
            sw, pl = orc.switch_only(lengths, placed), orc.placement_only(lengths, placed)
            both = orc.both(lengths, placed, [sw, pl, (st, [ServerPlan(orc.tuned, i) for i in placed.values()])])[0]
            step = {"step": k, "static_gen_s": st, "oracle_gen_s": both, "floor_s": orc.floor(lengths), "top": {}}
            pid = np.asarray(sched.prompt_ids_for_step(k))
            for kind in knowledge:
                # a predictor's noise: the scenario's seed and the step's, the same draws for every sd (a sweep
                # of the sd scales one draw) and whatever else is asked beside it
                rng = np.random.default_rng([scn.seed, 7, k])
                runs = search(orc, lengths, placed, grids[kind], progress=bar.update,
                              score=scores(kind, lengths, pid, rng))
                step["top"][kind] = [as_json(r) for r in runs[:top]]
                out["knowledge"][kind]["lanes_gen_s"] += runs[0].makespan_s
            out["per_step"].append(step)
            out["static_gen_s"] += st
            out["oracle_gen_s"] += both
            out["floor_s"] += step["floor_s"]
    s = out["static_gen_s"]
    out["speedup"] = {"oracle": s / out["oracle_gen_s"], "floor": s / out["floor_s"]}
    gain = out["speedup"]["oracle"] - 1
    for res in out["knowledge"].values():
        res["speedup"] = s / res["lanes_gen_s"]
        res["oracle_gain_kept"] = (res["speedup"] - 1) / gain if gain > 0 else None
    return out


DEFAULT_SCENARIOS = "short-7b,default"
# what a scenario's runs must agree on to be merged (none of it depends on the knowledge searched), and what a
# result must hold besides
SAME = ("steps", "seed", "tuned_static", "static_gen_s", "oracle_gen_s", "floor_s")
NEEDED = ("knowledge", "per_step", "speedup", "steps", "tuned_static", "static_gen_s", "oracle_gen_s", "floor_s")


class MergeError(ValueError):
    """Results of :func:`bench_scenario` that do not describe the same scenario, step and seed."""


def merge(runs: list) -> dict:
    """The results of several runs (each {scenario: :func:`bench_scenario`'s result}, e.g. one JSON per process
    with ``--knowledge`` split between them) as one: per scenario the union of their knowledge, each step's top
    plans included. A scenario's runs must agree on what does not depend on the knowledge (:data:`SAME`: steps,
    seed, tuned static, and the static, oracle and floor times summed over the steps), and a knowledge found in
    two runs on its figure; a :class:`MergeError` names what differs (a run's JSON without a seed, older than
    the field, has None)."""
    out: dict = {}
    for i, run in enumerate(runs):
        if not isinstance(run, dict) or not run:
            raise MergeError(f"run {i + 1}: not a bench_lanes result (a JSON object of scenarios)")
        for name, res in run.items():
            missing = [k for k in NEEDED if not isinstance(res, dict) or k not in res]
            if missing:
                raise MergeError(f"run {i + 1}, scenario {name!r}: not a bench_lanes result (missing "
                                 f"{', '.join(missing)})")
            if name not in out:
                out[name] = json.loads(json.dumps(res))  # a copy the later runs are merged into
                continue
            base = out[name]
            for k in SAME:
                if base.get(k) != res.get(k):
                    raise MergeError(f"scenario {name!r}: run {i + 1} has {k} {res.get(k)!r}, an earlier run "
                                     f"{base.get(k)!r}: not the same scenario, seed and steps")
            for kind, fig in res["knowledge"].items():
                have = base["knowledge"].get(kind)
                if have is not None and have.get("lanes_gen_s") != fig.get("lanes_gen_s"):
                    raise MergeError(f"scenario {name!r}: knowledge {kind!r} is {fig.get('lanes_gen_s')} s in run "
                                     f"{i + 1} and {have.get('lanes_gen_s')} s in an earlier run")
                base["knowledge"][kind] = fig
            for key in ("plans_searched", "grid"):
                base.setdefault(key, {}).update(res.get(key, {}))
            steps = {st["step"]: st for st in base["per_step"]}
            for st in res["per_step"]:
                if st["step"] in steps:
                    steps[st["step"]]["top"].update(st.get("top", {}))
                else:
                    base["per_step"].append(st)
    return out


def plot(results: dict, path: Path) -> str:
    """One panel per scenario of ``results`` ({scenario: :func:`bench_scenario`'s result}): the best lane plan's
    speedup over the tuned static against the predictor's log-error sd (``predictor:S``), with the lane
    oracle, 0.9 of its speedup (issue 33's goal for a policy against its own oracle), each prompt's difficulty and
    progress alone as horizontal lines where they were searched. Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from emulation import plots

    names = list(results)
    fig, axes = plt.subplots(len(names), 1, figsize=(9.0, 3.9 * len(names)), squeeze=False, layout="constrained")
    for ax, name in zip(axes[:, 0], names):
        res = results[name]
        oracle = res["speedup"]["oracle"]
        kinds = {k: parse_knowledge(k) for k in res["knowledge"]}
        pred = sorted((sd, res["knowledge"][k]["speedup"]) for k, (kind, sd) in kinds.items() if kind == "predictor")
        if pred:
            ax.plot([x for x, _ in pred], [y for _, y in pred], "o-", color="#1f77b4",
                    label="per-request length predictor")
        lines = [(oracle, "lane oracle (every length known)", "#2ca02c", "-"),
                 (0.9 * oracle, "0.9 of the oracle's speedup", "#2ca02c", ":"),
                 (1.0, f"tuned static {res['tuned_static']}", "black", "-")]
        for kind, colour in (("prompt", "#ff7f0e"), ("progress", "#d62728")):
            if kind in res["knowledge"]:
                what = "each prompt's difficulty" if kind == "prompt" else "progress alone"
                lines.append((res["knowledge"][kind]["speedup"], what, colour, "--"))
        for y, label, colour, ls in lines:
            ax.axhline(y, color=colour, ls=ls, lw=1.1, label=f"{label}: {y:.3f}")
        ax.set_xlim(-0.03, max([1.0] + [x for x, _ in pred]) + 0.03)
        ax.set_xlabel("the predictor's log-error sd (0: every length known)")
        ax.set_ylabel("speedup over the tuned static")
        seed = f", seed {res['seed']}" if res.get("seed") is not None else ""  # older runs' JSON lacks it
        plots.title(ax, f"{name} ({res['steps']} step{'s' if res['steps'] > 1 else ''}{seed}): the best lane "
                        "plan given what is known at time 0")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return plots.save(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=None,
                    help=f"names under scenarios/ (comma-separated; default {DEFAULT_SCENARIOS})")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--knowledge", default="progress",
                    help="what is known at time 0, comma-separated: progress (nothing), prompt (each prompt's "
                         "difficulty), predictor:S (a length predictor of log-error sd S)")
    ap.add_argument("--seed", type=int, default=None, help="the scenario's seed replaced by this one")
    ap.add_argument("--known-seeds", default=None,
                    help="top-scored requests per lane replica searched with --knowledge other than progress "
                         "(comma-separated; default: KNOWN_GRID's 1-512)")
    ap.add_argument("--plot", type=Path, default=None, help="a PNG of the speedup against what is known (plot())")
    ap.add_argument("--from-json", type=Path, nargs="+", default=None, metavar="JSON",
                    help="merge and re-plot earlier runs' output instead of searching")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.plot is not None and (args.plot.suffix.lower() != ".png" or not args.plot.parent.is_dir()):
        ap.error(f"--plot: a .png file in an existing folder, got {str(args.plot)!r}")
    if args.from_json is not None:
        searched = [f"--{k.replace('_', '-')}" for k in ("scenarios", "steps", "top", "knowledge", "seed", "known_seeds")
                    if getattr(args, k) != ap.get_default(k)]
        if searched:
            ap.error(f"--from-json re-plots earlier runs: {', '.join(searched)} would not be searched")
        runs = []
        for f in args.from_json:
            try:
                runs.append(json.loads(f.read_text()))
            except (OSError, ValueError) as e:
                ap.error(f"--from-json: cannot read {str(f)!r}: {e}")
        try:
            res = merge(runs)
        except MergeError as e:
            ap.error(f"--from-json: {e}")
        for name, r in res.items():  # a knowledge name the search would refuse is refused here too
            for kind in r["knowledge"]:
                try:
                    parse_knowledge(kind)
                except ValueError as e:
                    ap.error(f"--from-json: scenario {name!r}: {e}")
        if args.plot is not None:
            plot(res, args.plot)
        print(json.dumps(res, indent=1))
        return 0
    args.scenarios = DEFAULT_SCENARIOS if args.scenarios is None else args.scenarios
    if args.seed is not None and args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")
    known_grid = KNOWN_GRID
    if args.known_seeds is not None:
        try:
            seeds = tuple(int(x) for x in args.known_seeds.split(","))
        except ValueError:
            seeds = ()
        if not seeds or min(seeds) < 1:
            ap.error(f"--known-seeds: whole numbers >= 1, comma-separated, got {args.known_seeds!r}")
        known_grid = dict(KNOWN_GRID, seed=seeds)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    missing = [n for n in names if not (ROOT / "scenarios" / f"{n}.yaml").is_file()]
    if missing or not names:
        ap.error(f"--scenarios: no scenarios/NAME.yaml for {missing or 'an empty list'}")
    if args.steps < 1 or args.top < 1:
        ap.error(f"--steps and --top must be >= 1, got {args.steps} and {args.top}")
    knowledge = tuple(dict.fromkeys(k.strip() for k in args.knowledge.split(",") if k.strip()))
    for kind in knowledge or ("",):  # a bad name is refused before any engine runs
        try:
            parse_knowledge(kind)
        except ValueError as e:
            ap.error(f"--knowledge: {e}")
    res = {n: bench_scenario(ROOT / "scenarios" / f"{n}.yaml", args.steps, args.top, quiet=args.quiet,
                             knowledge=knowledge, known_grid=known_grid, seed=args.seed) for n in names}
    if args.plot is not None:
        plot(res, args.plot)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
