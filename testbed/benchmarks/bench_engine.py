"""Engine benchmark: the wall time of the generation engine (agents.engine) per scheduled step.

    .venv/bin/python testbed/benchmarks/bench_engine.py [--scenario scenarios/default.yaml] [--reps 5]
                                                 [--requests N] [--baseline GIT_REF] [--out FILE]

One RL step of the scenario's workload (its response lengths, its prompt length, its model and GPU, its
generator servers at ``workload.rollout_tp``, the engine's default settings) is dealt over one engine per
generator server and run to the end in virtual time (``--requests N``: the step's first N responses only,
for a shorter run), two ways: ``poll`` (``run_until`` every ``--poll-ms`` of virtual time, as the simulated
backend's planning ticks and an agent's wake-ups call it) and ``sink`` (the same with a sink collecting
every StepOutput, as an agent streaming its tokens does). Prints one JSON document: per way, the steps, the
tokens, and the median over ``--reps`` runs of the wall time and of this process's CPU time (less
sensitive to other work on the machine), in total and per step (us). ``--baseline REF``
runs the engine of that git revision (``git show REF:agents/engine.py``) side by side, alternating with
this tree's in every repetition, and reports the ratio (this / baseline) of the medians and of the fastest
runs: the comparison the CPU's noise allows. ``--out``: the JSON is also written to that file.
A benchmark reports; it asserts nothing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from agents.costmodel import CostModel  # noqa: E402
from emulation.scenario import load_scenario  # noqa: E402
from emulation.validation import SpecError  # noqa: E402


def load_engine_at(ref: str):
    """The agents.engine module of git revision ``ref`` (imported under another name)."""
    got = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:agents/engine.py"], capture_output=True, text=True)
    if got.returncode != 0:
        raise ValueError(f"no agents/engine.py at git revision {ref!r}: {got.stderr.strip().splitlines()[-1:]}")
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as d:  # imported, then removed (it was left in /tmp)
        path = os.path.join(d, "engine_baseline.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(got.stdout)
        spec = importlib.util.spec_from_file_location("engine_baseline", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["engine_baseline"] = mod
        spec.loader.exec_module(mod)
    return mod


def one_run(mod, sc, lengths: np.ndarray, poll_s: float, sink: bool) -> tuple[float, float, int, int]:
    w = sc.workload
    gpus = sc.fabric.gpus_per_server
    servers = len(sc.layout.gen_servers(sc.fabric))
    cost = mod.ModelledCost(CostModel.for_names(w.model, w.gpu), gpus)
    layout = mod.Layout(tp=w.rollout_tp)
    engines = [mod.Engine(cost, gpus, layout, mod.EngineSettings()) for _ in range(servers)]
    t0, c0 = time.perf_counter(), time.process_time()
    for k, e in enumerate(engines):
        share = range(k, len(lengths), servers)
        e.add([mod.NewRequest(rid=i, prompt=w.prompt_tokens, target=int(lengths[i])) for i in share], 0.0)
    steps = tokens = 0
    t = 0.0
    out: list | None = [] if sink else None
    while not all(e.idle() for e in engines):
        t += poll_s
        for e in engines:
            s, n = e.run_until(t, out)
            steps += s
            tokens += n
        if out is not None:
            out.clear()
    return time.perf_counter() - t0, time.process_time() - c0, steps, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default=os.path.join(ROOT, "scenarios", "default.yaml"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--poll-ms", type=float, default=50.0, help="virtual time between run_until calls")
    ap.add_argument("--requests", type=int, default=None, help="only the step's first N responses")
    ap.add_argument("--baseline", default=None, help="git revision whose engine runs side by side")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    if a.reps < 1 or not (math.isfinite(a.poll_ms) and a.poll_ms > 0) or (a.requests is not None and a.requests < 1):
        ap.error("--reps and --requests must be >= 1 and --poll-ms > 0")
    if a.out and (os.path.isdir(a.out) or not os.path.isdir(os.path.dirname(os.path.abspath(a.out)))):
        ap.error(f"--out {a.out}: a file to write in an existing folder")  # not only after every run
    import agents.engine as current

    try:
        sc = load_scenario(a.scenario)
    except SpecError as e:
        ap.error(str(e))
    w = sc.workload
    lengths = w.sample_lengths(np.random.default_rng(sc.seed))
    lengths = np.minimum(lengths, w.max_response_tokens)[: a.requests]
    impls = {"this": current}
    if a.baseline:
        try:
            impls["baseline"] = load_engine_at(a.baseline)
        except ValueError as e:
            ap.error(f"--baseline: {e}")
    res: dict = {"scenario": os.path.basename(a.scenario), "requests": int(len(lengths)), "reps": a.reps,
                 "poll_ms": a.poll_ms, "baseline": a.baseline, "ways": {}}
    for way in ("poll", "sink"):
        walls: dict[str, list[float]] = {k: [] for k in impls}
        cpus: dict[str, list[float]] = {k: [] for k in impls}
        counts = {}
        for _ in range(a.reps):
            for name, mod in impls.items():  # alternate: both see the same load
                wall, cpu, steps, tokens = one_run(mod, sc, lengths, a.poll_ms / 1e3, way == "sink")
                walls[name].append(wall)
                cpus[name].append(cpu)
                counts[name] = (steps, tokens)
        entry = {}
        for name in impls:
            steps, tokens = counts[name]
            med = statistics.median(walls[name])
            cpu = statistics.median(cpus[name])
            entry[name] = {"steps": steps, "tokens": tokens, "wall_s_median": med,
                           "us_per_step_median": med / max(1, steps) * 1e6, "cpu_s_median": cpu,
                           "cpu_us_per_step_median": cpu / max(1, steps) * 1e6,
                           "wall_s": [round(x, 4) for x in walls[name]], "cpu_s": [round(x, 4) for x in cpus[name]]}
        if "baseline" in entry:
            entry["ratio_this_over_baseline"] = entry["this"]["wall_s_median"] / entry["baseline"]["wall_s_median"]
            entry["ratio_fastest"] = min(walls["this"]) / min(walls["baseline"])
            entry["cpu_ratio_this_over_baseline"] = entry["this"]["cpu_s_median"] / entry["baseline"]["cpu_s_median"]
            entry["same_schedule"] = counts["this"] == counts["baseline"]
        res["ways"][way] = entry
    text = json.dumps(res, indent=2)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
