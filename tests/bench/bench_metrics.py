"""What live metrics cost the decision path: `orchestrrl bench planner` and `orchestrrl bench reconfig` with
metrics off and on, side by side, alternating (off, on, off, on, ...), medians and on/off ratios.

    .venv/bin/python tests/bench/bench_metrics.py planner [--pairs 10] [--ticks 100]
    flock /tmp/orchestrrl-ovs.lock .venv/bin/python tests/bench/bench_metrics.py reconfig [--pairs 3] [--samples 100]

``planner``: in one process, ``pairs`` x (off, on) of testbed.bench_orchestrator.bench_planner (with
metrics on, the run's observer sees every tick's sample and plan event and a scraper reads the endpoint
every second). ``reconfig``: ``pairs`` x (off, on) of testbed.benchmarks.bench_reconfig (with metrics on,
the controller serves its metrics and the benchmark scrapes them every second); each brings its own fabric
up (root, Open vSwitch; run it under the machine-wide lock).

Prints one JSON document: per figure the values of every run, their medians off and on, and on/off. A
benchmark reports; it asserts nothing.
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


def side_by_side(runs: list[dict], keys: tuple[str, ...]) -> dict:
    out = {}
    for k in keys:
        off = [r[k] for r in runs if not r["metrics"] and r.get(k) is not None]
        on = [r[k] for r in runs if r["metrics"] and r.get(k) is not None]
        m_off, m_on = statistics.median(off), statistics.median(on)
        out[k] = {"off": off, "on": on, "median_off": round(m_off, 3), "median_on": round(m_on, 3),
                  "on_over_off": round(m_on / m_off, 3) if m_off else None}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=("planner", "reconfig"))
    p.add_argument("--pairs", type=int, default=None, help="off/on pairs (default planner 10, reconfig 3)")
    p.add_argument("--ticks", type=int, default=100, help="planner: ticks per run")
    p.add_argument("--samples", type=int, default=100, help="reconfig: reconfigurations per case per run")
    p.add_argument("--delay-ms", type=float, default=10.0, help="reconfig: D")
    a = p.parse_args()
    runs = []
    if a.bench == "planner":
        from emulation.scenario import load_scenario
        from testbed.bench_orchestrator import bench_planner

        scn = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "default.yaml")
        for _ in range(a.pairs or 10):
            for metrics in (False, True):
                runs.append(bench_planner(scn, ticks=a.ticks, metrics=metrics))
        keys = PLANNER
    else:
        from testbed.benchmarks import bench_reconfig

        for _ in range(a.pairs or 3):
            for metrics in (False, True):
                runs.append(bench_reconfig(a.delay_ms, samples=a.samples, metrics=metrics))
        keys = RECONFIG
    doc = {"bench": a.bench, "pairs": len(runs) // 2, "figures": side_by_side(runs, keys),
           "scrapes": [r.get("scrapes", r.get("metrics_scrapes")) for r in runs if r["metrics"]]}
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
