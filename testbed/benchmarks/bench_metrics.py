"""What live metrics cost the decision path: `orchestrrl bench planner` and `orchestrrl bench reconfig` with
metrics off and on, side by side, alternating (off, on, off, on, ...), medians and on/off ratios.

    .venv/bin/python testbed/benchmarks/bench_metrics.py planner [--pairs 10] [--ticks 100]
    flock /tmp/orchestrrl-ovs.lock .venv/bin/python testbed/benchmarks/bench_metrics.py reconfig [--pairs 3] [--samples 100]

``planner``: in one process, ``pairs`` x (off, on) of testbed.benchmarks.bench_orchestrator.bench_planner (with
metrics on, the run's observer sees every tick's sample and plan event and a scraper reads the endpoint
every second). ``reconfig``: ``pairs`` x (off, on, served) of testbed.benchmarks.bench_reconfig (on: the
controller serves its metrics and the benchmark scrapes them every second; served: it serves them and
nobody scrapes, which parts the hooks' cost from the scrapes'); each brings its own fabric up (root, Open
vSwitch; run it under the machine-wide lock).

Prints one JSON document: per figure the values of every run, their medians per mode and each mode's
median over off's; for reconfig also the median of each overhead stage per mode. A benchmark reports; it
asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PLANNER = ("decision_ms_p50", "decision_ms_p99", "planner_ms_p50", "balancer_ms_p50", "sample_ms_p50", "sample_ms_p99")
RECONFIG = ("blackout_ms_p50", "blackout_ms_p99", "overhead_ms_p50", "overhead_ms_p99", "blackout_ms_p50_rerouted",
            "blackout_ms_p99_rerouted", "overhead_ms_p50_rerouted", "overhead_ms_p99_rerouted")


def side_by_side(runs: list[tuple[str, dict]], keys: tuple[str, ...]) -> dict:
    """Per figure: every run's value by mode, the medians, and each mode's median over off's."""
    out = {}
    modes = list(dict.fromkeys(m for m, _ in runs))
    for k in keys:
        vals = {m: [r[k] for mm, r in runs if mm == m and r.get(k) is not None] for m in modes}
        med = {m: statistics.median(v) for m, v in vals.items() if v}
        out[k] = {"runs": vals, "median": {m: round(v, 3) for m, v in med.items()},
                  "over_off": {m: round(v / med["off"], 3) for m, v in med.items() if m != "off" and med.get("off")}}
    return out


def stages(runs: list[tuple[str, dict]]) -> dict:
    """The median over runs of each overhead stage's p50, per case and mode (which stage moved)."""
    out: dict = {}
    for sfx in ("", "_rerouted"):
        key = f"overhead_stages_ms_p50{sfx}"
        for m in dict.fromkeys(mm for mm, _ in runs):
            per = [r[key] for mm, r in runs if mm == m and r.get(key)]
            out.setdefault(key, {})[m] = {n: round(statistics.median(p[n] for p in per), 3) for n in per[0]} if per else {}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=("planner", "reconfig"))
    p.add_argument("--pairs", type=int, default=None, help="rounds of every mode (default planner 10, reconfig 3)")
    p.add_argument("--ticks", type=int, default=100, help="planner: ticks per run")
    p.add_argument("--samples", type=int, default=100, help="reconfig: reconfigurations per case per run")
    p.add_argument("--delay-ms", type=float, default=10.0, help="reconfig: D")
    a = p.parse_args()
    runs = []
    if a.bench == "planner":
        from emulation.scenario import load_scenario
        from testbed.benchmarks.bench_orchestrator import bench_planner

        scn = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "default.yaml")
        for _ in range(a.pairs or 10):
            for mode in ("off", "on"):
                runs.append((mode, bench_planner(scn, ticks=a.ticks, metrics=mode == "on")))
        keys = PLANNER
    else:
        from testbed.benchmarks.bench_fabric import bench_reconfig

        for _ in range(a.pairs or 3):
            for mode in ("off", "on", "served"):
                runs.append((mode, bench_reconfig(a.delay_ms, samples=a.samples, metrics=mode != "off",
                                                  scrape_interval_s=1.0 if mode == "on" else None)))
                print(f"{mode}: overhead p50 {runs[-1][1]['overhead_ms_p50']}", file=sys.stderr, flush=True)
        keys = RECONFIG
    doc = {"bench": a.bench, "rounds": a.pairs or (10 if a.bench == "planner" else 3),
           "figures": side_by_side(runs, keys),
           "scrapes": [r.get("scrapes", r.get("metrics_scrapes")) for m, r in runs if m == "on"]}
    if a.bench == "reconfig":
        doc["overhead_stages_ms_p50"] = stages(runs)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
