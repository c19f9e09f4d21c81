"""How the orchestrator's figures depend on an engine profile's assumed figures (docs/costmodel.md "Engine
profiles": no public measurement gives vLLM V1's CPU time per running request or its per-step TP cost, so they
are swept here).

    .venv/bin/python testbed/benchmarks/bench_engine_sweep.py --field cpu_per_seq_us --values 1,2,4,8,16
        [--profile vllm-v1] [--scenario scenarios/default.yaml] [--steps 2] [--rollpacker]

For every value: the scenario's comparison on the simulated backend with the profile's figure replaced (the
tuning grid, the tuned static configuration, the oracle bounds, planner / balancer / orchestrrl against it),
or with ``--rollpacker`` RollPacker's rounds (testbed/runs/validation.py) at TP 1 and TP 2. Caches are not
used (they are keyed by the scenario, not by the profile's figures). Prints one JSON document; asserts nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agents.engineprofile import EngineProfile, get_profile, swept  # noqa: E402
from emulation import signals  # noqa: E402
from emulation.scenario import load_scenario  # noqa: E402
from emulation.validation import SpecError  # noqa: E402


def compare_point(scn, steps: int) -> dict:
    from testbed.runs.experiment import ADAPTIVE, Experiment

    exp = Experiment(scn, "simulated", steps=steps, use_cache=False)
    with exp, tempfile.TemporaryDirectory(prefix="orl-sweep-") as tmp:
        rep, _ = exp.compare([exp.policy(n) for n in ADAPTIVE], steps, Path(tmp))
    out = {"best_static": rep["best_static"], **{f"oracle_{k}": round(v["speedup"], 4)
                                                 for k, v in rep["oracle"]["kinds"].items()}}
    for n in ADAPTIVE:
        p = rep["policies"][n]
        out[n] = round(p["speedup_vs_best_static"], 4)
        out[f"{n}_oracle_fraction"] = round(p["oracle_fraction"], 4)
    return out


def rollpacker_point(scn) -> dict:
    from testbed.runs.validation import rollpacker_rounds

    r = rollpacker_rounds(scn)
    a, b = r["TP1x8"], r["TP2x4"]
    return {rnd: {"tp1_s": round(a[rnd]["time_s"], 1), "tp2_s": round(b[rnd]["time_s"], 1),
                  "tp2_over_tp1": round(b[rnd]["time_s"] / a[rnd]["time_s"], 4),
                  "preemptions": [a[rnd]["preemptions"], b[rnd]["preemptions"]]} for rnd in ("short", "long")}


def _value(text: str):
    """A swept value: an integer, else a number (1e-3 included), else YAML's reading (true, false, null)."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return yaml.safe_load(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="vllm-v1")
    ap.add_argument("--field", required=True, help="a figure of the profile (emulation/data/engines.yaml)")
    ap.add_argument("--values", required=True, help="comma-separated values")
    ap.add_argument("--scenario", default=None, help="default: scenarios/default.yaml (rollpacker-qwen3-8b.yaml "
                                                     "with --rollpacker)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rollpacker", action="store_true", help="RollPacker's rounds instead of a comparison")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    try:  # every input checked before the first point runs (each runs for minutes)
        scn = load_scenario(args.scenario or str(ROOT / "scenarios" / (
            "rollpacker-qwen3-8b.yaml" if args.rollpacker else "default.yaml")))
        base = get_profile(args.profile)
    except SpecError as e:
        ap.error(str(e))
    if scn.orchestrator.engine.profile != args.profile:
        ap.error(f"the scenario's engine profile is {scn.orchestrator.engine.profile}, not --profile {args.profile}")
    figures = [f.name for f in dataclasses.fields(EngineProfile) if f.name not in ("engine", "name")]
    if args.field not in figures:
        ap.error(f"--field {args.field!r}: not a figure of an engine profile (known: {', '.join(figures)})")
    values = []
    for v in args.values.split(","):
        try:
            value = _value(v)
            if isinstance(getattr(base, args.field), bool) and not isinstance(value, bool):
                raise SpecError(args.field, f"must be true or false, got {v!r}")
            dataclasses.replace(base, **{args.field: value})  # the profile's own checks (type, range)
        except (yaml.YAMLError, SpecError) as e:
            ap.error(f"--values {v!r}: {e}")
        values.append(value)
    out = {"scenario": scn.name, "profile": args.profile, "field": args.field, "points": []}
    def work() -> None:
        for value in values:
            with swept(args.profile, **{args.field: value}):
                res = rollpacker_point(scn) if args.rollpacker else compare_point(scn, args.steps)
            out["points"].append({"value": value, **res})
            print(json.dumps(out["points"][-1]), file=sys.stderr, flush=True)

    rc, _ = signals.run_torn_down(work, "bench_engine_sweep.py")  # a point's temporary run folder removed too
    if rc:
        return rc
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
