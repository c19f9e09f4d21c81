"""Forecast benchmark: ARIMA fit time, remaining-length call cost, and MAPE on drifting workloads.

    .venv/bin/python testbed/benchmarks/bench_forecast.py [--fits 30] [--seeds 5] [--steps 40]

Prints one JSON document:

* ``import_s``: the statsmodels ARIMA import in this process; ``fit``: p50/p99 wall time of one
  ``forecast_next`` on 20 steps of history (two ARIMA fits: log-mean and log-std) over ``--fits`` calls,
  side by side with OpenBLAS limited to one thread (``OPENBLAS_NUM_THREADS=1``, as this process runs) and
  with its default thread count (a child process without the limit): on a busy 2-core machine BLAS
  threads spinning against other work are what makes a fit take seconds;
* ``remaining``: per-call p50/p99 (us) of ``remaining`` and ``remaining_quantile(q=0.9)`` for 1,024 and
  8,192 in-flight requests (token counts spread over 0 .. 4x the median), with the forecast's empirical
  shape and as a plain lognormal (``*_lognormal``), and of ``updated`` (the online update) on a step of that
  many requests half finished, the rest running at spread token counts;
* ``mape``: walk-forward one-step-ahead MAPE (%) of the step's mean response length, per workload case and
  method, median over ``--seeds`` seeds, with each seed's value: ``arima`` (the forecaster, default
  ForecastSettings), ``drift`` and ``last`` (its fallbacks alone), ``last_value`` (the previous step's
  realised mean: the naive baseline) and ``configured`` (the workload's own distribution at that step:
  the sampling-noise floor a forecaster cannot beat without knowing the draws).

Cases (``warmup_steps`` 8 warm-start every method; each run step k is forecast from the steps before it):
``dapo-drift``: scenarios/dapo-32b.yaml's workload (512 x 16 responses, 20k cap) with DAPO's 5.9x growth
compressed into 40 steps (0.123 per step, max 5.9) and 3% step jitter; ``emulator-drift``: the same drift at
the default scenario's 16 x 8 responses; ``mixture-drift``: a bimodal mixture (90% median 400, 10% median
5,000) at 128 x 8, same drift; ``stationary``: 128 x 8, no drift, 5% step jitter.
A benchmark reports; it asserts nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
BLAS_VARS = ("OPENBLAS_NUM_THREADS",)
if "--fit-only" not in sys.argv:  # before numpy loads OpenBLAS; the --fit-only child keeps the default
    for var in BLAS_VARS:
        os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from emulation.orchestration import ForecastSettings
from emulation.scenario import load_scenario  # noqa: E402
from emulation.workload import LengthComponent, LengthSchedule, WorkloadSpec, step_stats  # noqa: E402
from testbed.orchestrator.forecast import LengthForecast, forecast_next# noqa: E402


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def timed(fn, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def cases(steps: int) -> dict[str, WorkloadSpec]:
    dapo = load_scenario(os.path.join(ROOT, "scenarios", "dapo-32b.yaml")).workload
    drift = dict(median_growth_per_step=0.123, median_growth_max=5.9, step_sigma=0.03, warmup_steps=8, steps=steps)
    small = dict(prompts_per_step=16, samples_per_prompt=8)
    return {
        "dapo-drift": dataclasses.replace(dapo, **drift),
        "emulator-drift": WorkloadSpec(**small, **drift),
        "mixture-drift": WorkloadSpec(prompts_per_step=128, samples_per_prompt=8, max_response_tokens=16384,
                                      mixture=(LengthComponent(weight=0.9, median_tokens=400, sigma=0.6),
                                               LengthComponent(weight=0.1, median_tokens=5000, sigma=0.5)), **drift),
        "stationary": WorkloadSpec(prompts_per_step=128, samples_per_prompt=8, step_sigma=0.05, warmup_steps=8,
                                   steps=steps),
    }


def walk_forward(w: WorkloadSpec, seed: int, settings: ForecastSettings, bar) -> dict[str, float]:
    sched = LengthSchedule(w)
    rng = np.random.default_rng(seed)
    hist = sched.history(rng)
    fallback_only = {"drift": settings, "last": dataclasses.replace(settings, fallback="last")}
    ape: dict[str, list[float]] = {k: [] for k in ("arima", "drift", "last", "last_value", "configured")}
    for k in range(w.steps):
        real = step_stats(sched.lengths_for_step(k, rng), k, sched.cap)
        guesses = {"arima": forecast_next(hist, settings).mean(),
                   "last_value": hist[-1].mean,
                   "configured": LengthForecast.from_workload(w, k).mean()}
        for name, st in fallback_only.items():
            guesses[name] = forecast_next(hist, st, use_arima=False).mean()
        for name, f in guesses.items():
            ape[name].append(abs(f - real.mean) / real.mean)
        hist.append(real)
        bar.update(1)
    return {name: 100 * float(np.mean(v)) for name, v in ape.items()}


def fit_history(steps: int):
    w = cases(steps)["dapo-drift"]
    return LengthSchedule(dataclasses.replace(w, warmup_steps=20)).history(np.random.default_rng(0))


def fit_times(calls: int, settings: ForecastSettings) -> dict:
    hist = fit_history(40)
    forecast_next(hist, settings)  # the first fit pays one-off set-up
    fits = timed(lambda: forecast_next(hist, settings), calls)
    return {"history_steps": len(hist), "calls": calls, "arima_fits_per_call": 2,
            "p50_ms": round(1e3 * pct(fits, 50), 1), "p99_ms": round(1e3 * pct(fits, 99), 1),
            "max_ms": round(1e3 * max(fits), 1), "method": forecast_next(hist, settings).method,
            "blas_threads_env": {v: os.environ.get(v) for v in BLAS_VARS}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fits", type=int, default=30, help="forecast_next calls timed (default 30)")
    ap.add_argument("--seeds", type=int, default=5, help="seeds per MAPE case (default 5)")
    ap.add_argument("--steps", type=int, default=40, help="run steps per MAPE case (default 40)")
    ap.add_argument("--fit-only", action="store_true", help=argparse.SUPPRESS)  # the default-threads child
    args = ap.parse_args(argv)
    for name in ("fits", "seeds", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    settings = ForecastSettings()
    if args.fit_only:
        json.dump(fit_times(args.fits, settings), sys.stdout)
        return 0
    out: dict = {"settings": dataclasses.asdict(settings)}

    t0 = time.perf_counter()
    import statsmodels.tsa.arima.model  # noqa: F401,E402
    out["import_s"] = round(time.perf_counter() - t0, 3)

    # ---- fit time, one BLAS thread here and the default in a child process, one after the other
    out["fit"] = {"one_blas_thread": fit_times(args.fits, settings)}
    env = {k: v for k, v in os.environ.items() if k not in BLAS_VARS}
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--fit-only", "--fits", str(args.fits)],
                           env=env, capture_output=True, text=True, timeout=1800)
    out["fit"]["default_blas_threads"] = json.loads(child.stdout) if child.returncode == 0 else \
        {"error": child.stderr.strip().splitlines()[-1:]}

    # ---- remaining-length calls
    hist = fit_history(args.steps)
    f = forecast_next(hist, settings)
    rng = np.random.default_rng(1)
    out["remaining"] = {}
    for m in (1024, 8192):
        # m requests in flight at spread token counts (0 .. 4x the median: some not started, some in the tail)
        g = rng.uniform(0, 4 * math.exp(f.mu), m).round()
        # the online update mid-step: m requests of which those shorter than the median finished
        L = np.minimum(np.rint(rng.lognormal(f.mu, f.sigma, m)), f.cap)
        t = float(np.median(L))
        done, running = L[L <= t], rng.uniform(0, t, int((L > t).sum())).round()
        reps = 2000 if m <= 1024 else 500
        row = {}
        plain = dataclasses.replace(f, shape=None)  # the same forecast as a lognormal (closed forms only)
        for name, fn in (("remaining", lambda: f.remaining(g)),
                         ("remaining_quantile", lambda: f.remaining_quantile(g, 0.9)),
                         ("updated", lambda: f.updated(done, running)),
                         ("remaining_lognormal", lambda: plain.remaining(g)),
                         ("remaining_quantile_lognormal", lambda: plain.remaining_quantile(g, 0.9))):
            fn()
            ts = timed(fn, reps if name != "updated" else reps // 10)
            row[name] = {"p50_us": round(1e6 * pct(ts, 50), 1), "p99_us": round(1e6 * pct(ts, 99), 1)}
        row["updated_inputs"] = {"completed": int(len(done)), "running": int(len(running))}
        out["remaining"][str(m)] = row

    # ---- MAPE
    cs = cases(args.steps)
    out["mape"] = {}
    with tqdm(total=len(cs) * args.seeds * args.steps, desc="walk-forward", file=sys.stderr) as bar:
        for name, wl in cs.items():
            per_seed = [walk_forward(wl, seed, settings, bar) for seed in range(args.seeds)]
            methods = per_seed[0].keys()
            out["mape"][name] = {
                "samples_per_step": wl.samples_per_step,
                "median_pct": {m: round(statistics.median(r[m] for r in per_seed), 2) for m in methods},
                "per_seed_pct": {m: [round(r[m], 2) for r in per_seed] for m in methods},
                "arima_over_last_value": round(statistics.median(r["arima"] / r["last_value"] for r in per_seed), 3),
            }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
