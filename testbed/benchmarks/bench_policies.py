"""Do the speedups come from the policies or from the scenario? The default scenario's comparison, simulated
backend, on other seeds, engine settings, length distributions and models, each against its own tuned static
baseline and its own oracle bounds.

    .venv/bin/python testbed/benchmarks/bench_policies.py [--cases a,b] [--seeds 1,2,3] [--steps 2] [--out DIR]
        [--set planner.gain_margin=0.1 ...]   (orchestrator settings to change, YAML values)
        [--reinit 0.1,1,5]                    (the layout switch's fixed part, engine.switch_reinit_s, seconds)
        [--extra 'seer[dispatch=contrib.seer:SeerDispatch]' ...]   (plug-in policies run beside the built-ins)

For every case, seed and re-initialisation time: `orchestrrl compare` on the simulated backend (the tuning
grid of every layout x max_num_seqs, the tuned static configuration, static-low/high, planner, balancer,
orchestrrl, and the oracle bounds) of the case's scenario. Prints one JSON document: per run the tuned static
configuration, every adaptive policy's ``speedup_vs_best_static``, its ``oracle_fraction``, switches,
migrations and the share of migrations that paid (the simulated backend's counterfactual); per case the
median and minimum over seeds; and ``checks``: the issue's robustness properties, each true or false.
``--extra`` adds policies composed of plug-ins (``compare --policies``' definitions, docs/plugins.md), each
reported like the built-ins plus ``oracle_kind`` and ``fraction_of_both`` (its speedup over the both-oracle's,
the lane plan's); the checks stay the built-ins'. Cases
(scenarios/default.yaml unless said):

* ``default``: the scenario as shipped (Qwen2.5-14B, 128 x 8, median 1,500, cap 16k, 5% at the cap);
* ``mns-256``: vLLM's default max_num_seqs (256) for the adaptive policies (the baseline is tuned anyway);
* ``heavy-tail``: log-sigma 1.2;
* ``mixture``: 70% median 600 / 30% median 3,000 (a bimodal step);
* ``drift``: the median grows 25% per step;
* ``moe``: Qwen3-30B-A3B (128 experts, top-8) in place of the dense model;
* ``near-uniform``: log-sigma 0.05, prompt log-sigma 0, no cap spike (no tail to exploit: the orchestrator
  must not lose);
* ``short-7b``: scenarios/short-7b.yaml (Qwen2.5-7B, median 460 capped at 4,096: the longest response
  dominates a step).

A benchmark reports; it asserts nothing. Simulated runs are deterministic: the same seed gives the same figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from emulation.orchestration import OrchestratorSettings, orchestrator_settings  # noqa: E402
from emulation import signals  # noqa: E402
from emulation.scenario import load_scenario  # noqa: E402
from emulation.validation import SpecError, to_dict  # noqa: E402
from emulation.workload import LengthComponent  # noqa: E402
from testbed.commands.common import UsageError, out_folder  # noqa: E402
from testbed.orchestrator.policies import compose, parse_policy_arg  # noqa: E402
from testbed.runs.experiment import ADAPTIVE, Experiment  # noqa: E402

# case -> (scenario file, workload changes, orchestrator settings changed)
CASES = {
    "default": ("default.yaml", {}, []),
    "mns-256": ("default.yaml", {}, ["engine.max_num_seqs=256"]),
    "heavy-tail": ("default.yaml", {"response_sigma": 1.2}, []),
    "mixture": ("default.yaml", {"mixture": (LengthComponent(0.7, 600.0, 0.5), LengthComponent(0.3, 3000.0, 0.5))},
                []),
    "drift": ("default.yaml", {"median_growth_per_step": 0.25}, []),
    "moe": ("default.yaml", {"model": "Qwen3-30B-A3B"}, []),
    "near-uniform": ("default.yaml", {"response_sigma": 0.05, "prompt_sigma": 0.0, "cap_fraction": 0.0}, []),
    "short-7b": ("short-7b.yaml", {}, []),
}
LONG_TAIL = ("default", "heavy-tail", "short-7b")  # the cases whose long tail the orchestrator is for


def with_settings(orch: OrchestratorSettings, sets: list[str]) -> OrchestratorSettings:
    """``orch`` (a scenario's orchestrator settings) with ``a.b=value`` changes (values parsed as YAML),
    validated as a scenario file's would be."""
    import yaml

    out = to_dict(orch)
    for item in sets:
        key, _, val = item.partition("=")
        node = out
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = yaml.safe_load(val)
    return orchestrator_settings(out)


def case_scenario(case: str, seed: int, sets: list[str] = (), reinit: float | None = None):
    fname, wl, own = CASES[case]
    scn = load_scenario(ROOT / "scenarios" / fname)
    extra = list(own) + list(sets) + ([f"engine.switch_reinit_s={reinit}"] if reinit is not None else [])
    return dataclasses.replace(scn, seed=seed, workload=dataclasses.replace(scn.workload, **wl),
                               name=f"{case}-s{seed}" + (f"-reinit{reinit:g}" if reinit is not None else ""),
                               orchestrator=with_settings(scn.orchestrator, extra))


def run_case(case: str, seed: int, steps: int, out: Path, sets: list[str] = (), reinit: float | None = None,
             extra: list = ()) -> dict:
    scn = case_scenario(case, seed, sets, reinit)
    exp = Experiment(scn, "simulated", steps=steps)
    with exp:
        rep, _ = exp.compare([exp.policy(n) for n in [*exp.default_policies(), *extra]], steps, out / scn.name)
    pol = rep["policies"]
    both = rep["oracle"]["kinds"]["both"]["speedup"]
    plugins = {p.name: {"speedup_vs_best_static": round(pol[p.name]["speedup_vs_best_static"], 4),
                        "oracle_kind": pol[p.name]["oracle_kind"],
                        "oracle_fraction": round(pol[p.name]["oracle_fraction"], 4),
                        "fraction_of_both": round(pol[p.name]["speedup_vs_best_static"] / both, 4),
                        "layout_switches": pol[p.name]["layout_switches"], "migrations": pol[p.name]["migrations"],
                        "lost_requests": pol[p.name]["lost_requests"]} for p in extra}
    return {**({"plugins": plugins} if extra else {}), "best_static": rep["best_static"],
            "best_static_makespan_s": [round(x, 3) for x in pol[rep["best_static"]]["step_makespan_s"]],
            "oracle": {k: round(v["speedup"], 4) for k, v in rep["oracle"]["kinds"].items()},
            "floor": round(rep["oracle"]["floor_speedup"], 4),
            **{n: {"speedup_vs_best_static": round(pol[n]["speedup_vs_best_static"], 4),
                   "oracle_fraction": round(pol[n]["oracle_fraction"], 4), "layout_switches": pol[n]["layout_switches"],
                   "migrations": pol[n]["migrations"], "migrations_paid_fraction": pol[n]["migrations_paid_fraction"],
                   "migration_ticks_paid_fraction": pol[n]["migration_ticks_paid_fraction"],
                   "lost_requests": pol[n]["lost_requests"]} for n in ADAPTIVE}}


def checks(doc: dict) -> dict:
    """The robustness properties of issue 13, each true or false, with the runs that break it."""
    runs = [(c, k, r) for c, d in doc["cases"].items() for k, r in d["runs"].items()]
    sp = lambda r, n: r[n]["speedup_vs_best_static"]  # noqa: E731
    combo = [f"{c}/{k}" for c, k, r in runs if sp(r, "orchestrrl") < max(sp(r, "planner"), sp(r, "balancer")) - 1e-9]
    tail = [f"{c}/{k}: {sp(r, 'orchestrrl'):.3f} (oracle both {r['oracle']['both']:.3f})" for c, k, r in runs
            if c in LONG_TAIL and sp(r, "orchestrrl") < 1.2]
    uni = [f"{c}/{k}" for c, k, r in runs if c == "near-uniform" and min(sp(r, n) for n in ADAPTIVE) < 0.99]
    paid = [r[n]["migrations_paid_fraction"] for _, _, r in runs for n in ("balancer", "orchestrrl")
            if r[n]["migrations_paid_fraction"] is not None]
    migs = sum(r[n]["migrations"] for _, _, r in runs for n in ("balancer", "orchestrrl"))
    frac = [f"{c}/{k} {n}: {r[n]['oracle_fraction']:.3f}" for c, k, r in runs for n in ADAPTIVE
            if r[n]["oracle_fraction"] < 0.9]
    return {"orchestrrl_ge_max_planner_balancer": {"ok": not combo, "broken_by": combo},
            "orchestrrl_ge_1.2_on_long_tail_cases": {"ok": not tail, "broken_by": tail},
            "near_uniform_ge_0.99": {"ok": not uni, "broken_by": uni},
            "migrations_paid_ge_0.8": {"ok": bool(paid) and min(paid) >= 0.8,
                                       "min": min(paid) if paid else None, "migrations": migs},
            "every_policy_ge_0.9_of_its_oracle": {"ok": not frac, "broken_by": frac}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reinit", default=None, help="comma-separated switch_reinit_s values (default: the scenario's)")
    ap.add_argument("--out", default=None, help="keep the per-run reports here (default: a temporary folder, removed "
                                                "at the end)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an orchestrator setting to change, e.g. planner.gain_margin=0.1 (repeatable)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME[ROLE=REF,...]",
                    help="a plug-in policy to run beside the built-ins (compare --policies' definitions; repeatable)")
    a = ap.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    try:  # every input checked before the first run (each case runs for minutes)
        seeds = [int(s) for s in a.seeds.split(",") if s]
        reinits = [float(x) for x in a.reinit.split(",")] if a.reinit else [None]
    except ValueError as e:
        ap.error(f"--seeds takes integers and --reinit numbers, comma-separated: {e}")
    if not seeds or a.steps < 1:
        ap.error(f"--seeds must name a seed and --steps be >= 1 (got {a.seeds!r}, {a.steps})")
    try:
        for c in cases:
            for ri in reinits:
                case_scenario(c, seeds[0], a.set, ri)  # the --set changes and the reinit, validated as a scenario's
        extra = [parse_policy_arg(x) for x in a.extra]
        for p in extra:  # every plug-in resolves and its parameters are valid before anything runs
            if isinstance(p, str):
                ap.error(f"--extra {p!r}: a definition NAME[role=ref,...] (docs/plugins.md)")
            compose(p, "--extra")
    except SpecError as e:
        ap.error(str(e))
    if a.out:
        try:
            out_folder(a.out)
        except UsageError as e:
            ap.error(str(e))
    def work() -> dict:  # the default folder is temporary: removed however the run ends (SIGTERM, Ctrl-C too)
        if a.out:
            return _run_all(a, cases, seeds, reinits, extra, Path(a.out))
        with tempfile.TemporaryDirectory(prefix="bench-policies-") as tmp:
            return _run_all(a, cases, seeds, reinits, extra, Path(tmp))

    rc, doc = signals.run_torn_down(work, "bench_policies.py")
    if rc:
        return rc
    print(json.dumps(doc, indent=1))
    return 0


def _run_all(a, cases: list, seeds: list, reinits: list, extra: list, out: Path) -> dict:
    """:func:`main`'s runs, every case x seed x reinit, their reports under ``out``: the JSON document."""
    doc = {"backend": "simulated", "steps": a.steps, "seeds": seeds, "settings_changed": a.set,
           "reinit_s": reinits, **({"extra": a.extra} if a.extra else {}), "cases": {}}
    with tqdm(total=len(cases) * len(seeds) * len(reinits), file=sys.stderr, desc="compare") as bar:
        for c in cases:
            runs = {}
            for s in seeds:
                for ri in reinits:
                    key = f"seed{s}" + (f"-reinit{ri:g}" if ri is not None else "")
                    bar.set_postfix_str(f"{c} {key}")
                    runs[key] = run_case(c, s, a.steps, out, a.set, ri, extra)
                    bar.update(1)
            fname, wl, own = CASES[c]
            doc["cases"][c] = {"scenario": f"scenarios/{fname}",
                               "overrides": {k: (str(v) if k == "mixture" else v) for k, v in wl.items()},
                               "settings": own,
                               "median": {n: round(statistics.median(r[n]["speedup_vs_best_static"] for r in runs.values()), 4)
                                          for n in ADAPTIVE},
                               "min": {n: round(min(r[n]["speedup_vs_best_static"] for r in runs.values()), 4)
                                       for n in ADAPTIVE},
                               "runs": runs}
    doc["checks"] = checks(doc)
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
