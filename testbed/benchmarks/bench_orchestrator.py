"""Benchmark of the orchestrator's decision path (JSON figures; never asserts).

``planner``: one planning tick's decision, as the driver makes it: the step's forecast updated with what the
step has shown so far (online), then the planner's evaluation of every generator server (every candidate
layout, with its one-interval lookahead) and the balancer's moves, for ``requests`` in-flight requests spread
over the scenario's generator servers at a mid-step state (a seeded mix of progress, some waiting).
Each tick runs under the priority the driver gives its ticks (testbed/decision_priority.py: ``SCHED_RR`` for
the tick's thread where allowed; ``tick_priority`` says which), so the figures are a tick's own time and not
the run queue's on a machine shared with other work.

The ticks start from the heap the driver's decision path starts from (testbed.driver.settle_heap: collected
and frozen after the imports and the set-up): the process's first full collection after its imports takes
~12 ms on the 2-core machine (~45k objects) and would otherwise land in one of the 50 ticks and be their p99. ``gc_full_collections`` counts the full collections that still
ran during the ticks (their time is in the figures).

The tick takes the prompt groups' shifts as the driver's does (testbed/planning.py ``_prompt_shifts``, with the
scenario's ``forecast.prompt_groups``): every request gets its prompt's log-offset from what the prompt's samples
have shown (consecutive requests are a prompt's ``samples_per_prompt`` samples; the finished ones belong to the
same prompts), the prompt share the workload's before any step has measured one. Their time is in the decision
time, and apart as ``prompt_shifts_ms_p50``.

``metrics``: the tick also records what the driver's timeline records at a tick (the planner's ``plan`` event,
inside the decision time as in the driver; the tick's sample of every replica, timed apart as ``sample_ms``),
and with ``metrics`` on, the run's metrics observer (testbed/runs/metrics.py) turns them into metrics while an
endpoint serves them to a scraper every ``scrape_interval_s`` (Prometheus' load). Off, the same events and
samples are recorded with no observer: the difference is what metrics cost the decision path.
"""
from __future__ import annotations

import gc
import time

import numpy as np

from agents.costmodel import CostModel
from agents.engine import ModelledCost
from emulation.metrics import Scraper, serve_free
from emulation.scenario import Scenario
from testbed.decision_priority import raised_priority
from testbed.driver import Timeline, settle_heap
from testbed.orchestrator.balancer import Balancer
from testbed.orchestrator.estimate import Estimator
from testbed.orchestrator.forecast import LengthForecast, prompt_prior, shifted_forecast
from testbed.orchestrator.planner import Planner, ServerView, loads_from_snapshots
from testbed.orchestrator.policies import feasible_layouts
from testbed.runs.metrics import DriverMetrics


def _tick_sample(now: float, views: dict, lay, gpus: int) -> dict:
    """The tick's sample as the driver takes it (testbed.generation.GenerationPhase.sample), from the synthetic state."""
    srv, load = {}, {}
    r = lay.replicas(gpus)
    for s, v in views.items():
        rep = v.load.replica % r
        running = np.bincount(rep[v.load.running], minlength=r)
        waiting = np.bincount(rep[~v.load.running], minlength=r)
        srv[s] = {"layout": lay.name(gpus), "running": running.tolist(), "waiting": waiting.tolist(),
                  "kv": [round(float(x) / max(1, v.load.n), 4) for x in running],  # a stand-in share
                  "tokens": int(v.load.ctx0.sum()), "preemptions": 0, "freeness": None, "switching": False}
        load[s] = float(v.load.rem.sum())
    return {"t": round(now, 4), "servers": srv, "load": load}


def bench_planner(scn: Scenario, requests: int = 1024, ticks: int = 50, seed: int = 0,
                  progress=None, metrics: bool = False, scrape_interval_s: float = 1.0) -> dict:
    st = scn.orchestrator
    w = scn.workload
    cm = CostModel.for_engine(w.model, w.gpu, st.engine)  # the scenario's engine profile, as the driver's ticks
    gpus = scn.fabric.gpus_per_server
    servers = scn.layout.gen_servers(scn.fabric)
    est = Estimator(cm, gpus, st.engine)
    lays = feasible_layouts(cm, gpus, st.engine, w.prompt_tokens, w.max_response_tokens)
    # composed as the orchestrrl policy composes them: the planner knows a balancer runs beside it (its
    # judgement of a tempting switch then also re-deals the current layout: Planner._judge_again)
    planner = Planner(est, ModelledCost(cm, gpus), st.planner, cm.model.is_moe, tuple(lays), beside_balancer=True)
    balancer = Balancer(est, st.balancer)
    fc0 = LengthForecast.from_workload(w, 0)
    rng = np.random.default_rng(seed)
    times, plan_ms, bal_ms, online_ms, sample_ms, shift_ms, raised = [], [], [], [], [], [], []
    shapes = []  # per tick: what the planner did (tempted servers, held back by the lookahead, judged, switched)
    # prompt groups (the scenario's samples_per_prompt, consecutive requests, as veRL batches them): the driver's
    # tick gives every request its prompt's shift from what the prompt's samples have shown (the finished ones
    # below belong to the same prompts); its share before any finished step has measured one is the workload's
    share = prompt_prior(w) if st.forecast.prompt_groups else 0.0
    pid = np.arange(requests) // max(1, w.samples_per_prompt)
    n_prompts = int(pid[-1]) + 1 if requests else 1
    done_pid = np.arange(requests // 2) % n_prompts
    timeline = Timeline()
    dm = scraper = None
    if metrics:  # on a free port: a benchmark takes no default one
        dm = DriverMetrics()
        dm.server = serve_free(dm.registry)
        dm.observe(timeline, "bench", w.model, "bench", scn.name)
        scraper = Scraper(dm.url, scrape_interval_s).__enter__()
    lay = lays[0]
    r = lay.replicas(gpus)
    full = []
    watch = lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None  # noqa: E731
    settle_heap()
    gc.callbacks.append(watch)
    for k in range(ticks):
        # a mid-step state: every request has made some progress, a fifth still wait, the rest run
        n = requests
        gen = np.minimum(rng.lognormal(np.log(300), 0.9, n).astype(np.int64), w.max_response_tokens - 1)
        running = rng.random(n) > 0.2
        gen[~running] = 0
        server = np.arange(n) % len(servers)
        done = rng.lognormal(np.log(w.response_median_tokens), w.response_sigma, n // 2).astype(np.int64) + 1
        # under the priority the driver gives a tick (testbed/planning.py): first on a shared CPU
        with raised_priority() as up:
            t0 = time.perf_counter()
            fc = fc0.updated(np.minimum(done, w.max_response_tokens).astype(float), gen[running].astype(float),
                             st.forecast) if st.forecast.online_update else fc0
            t1 = time.perf_counter()
            snaps = {}
            for j, s in enumerate(servers):
                m = server == j
                snaps[s] = {"rid": np.nonzero(m)[0].astype(np.int64) + 1000 * k, "generated": gen[m],
                            "prompt": np.full(int(m.sum()), w.prompt_tokens), "running": running[m].astype(np.int8),
                            "replica": np.arange(int(m.sum())) % r}
            tp0 = time.perf_counter()
            shifts = {}
            if share > 0:  # the prompt groups' shifts, as the driver's tick takes them (testbed/planning.py)
                fc, per = shifted_forecast(fc, share, done_pid, np.minimum(done, w.max_response_tokens).astype(float),
                                           pid, gen, [pid[server == j] for j in range(len(servers))])
                shifts = {} if per is None else dict(zip(servers, per))
            shift_ms.append((time.perf_counter() - tp0) * 1e3)
            est.use_forecast(fc)
            views = {s: ServerView(s, lay, ld) for s, ld in loads_from_snapshots(snaps, fc, shifts).items()}  # as the driver
            rids = {s: snap["rid"] for s, snap in snaps.items()}
            ts = time.perf_counter()
            timeline.sample(_tick_sample(10.0, views, lay, gpus))  # the driver samples a tick before deciding
            sample_s = time.perf_counter() - ts  # timed apart: not part of the decision (as in the driver)
            decisions = planner.evaluate_all(views, now=10.0, interval=st.planning_interval_s)
            timeline.event(10.0, "plan", step=0, gain_s={s: round(d.gain_s, 3) for s, d in decisions.items()},
                           switch=[s for s, d in decisions.items() if d.switch])
            t2 = time.perf_counter()
            balancer.decide(views, rids, now=10.0)
            t3 = time.perf_counter()
        raised.append(up)
        ds = decisions.values()
        held = sum("waiting" in d.reason for d in ds)  # a held-back server is neither judged nor switched
        shapes.append({"held_by_lookahead": held, "judged": sum(d.judged_gain_s is not None for d in ds),
                       "switched": sum(d.switch for d in ds),
                       "tempted": held + sum(d.judged_gain_s is not None or d.switch for d in ds)})
        times.append((t3 - t0 - sample_s) * 1e3)
        online_ms.append((t1 - t0) * 1e3)
        plan_ms.append((t2 - t1 - sample_s) * 1e3 - shift_ms[-1])
        sample_ms.append(sample_s * 1e3)
        bal_ms.append((t3 - t2) * 1e3)
        if progress:
            progress(k + 1)
    gc.callbacks.remove(watch)
    if dm is not None:
        scraper.stop()
        dm.stop()
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 3)  # noqa: E731
    return {"scenario": scn.name, "policy": "orchestrrl", "engine_profile": st.engine.profile, "requests": requests, "servers": len(servers), "layouts": [x.name(gpus) for x in lays],
            "ticks": ticks, "decision_ms_p50": pct(times, 50), "decision_ms_p99": pct(times, 99),
            # of 50 ticks the p99 is about their slowest, which is mostly the first: it fills the estimator's memos
            # (the cost model's prefills of the queue sizes it meets, ~30 us each) that later ticks find
            "first_tick_ms": round(times[0], 3),
            "decision_ms_p99_after_first": pct(times[1:], 99) if ticks > 1 else None,
            "online_forecast_ms_p50": pct(online_ms, 50), "prompt_shifts_ms_p50": pct(shift_ms, 50),
            "prompt_share": round(share, 4), "planner_ms_p50": pct(plan_ms, 50),
            "planner_ms_p99": pct(plan_ms, 99), "balancer_ms_p50": pct(bal_ms, 50), "balancer_ms_p99": pct(bal_ms, 99),
            "gc_full_collections": len(full), "tick_priority": "SCHED_RR" if all(raised) else "fair",
            # the p99 is its slowest ticks': what the planner did in each (docs/orchestrator.md "The tick's time")
            "slowest_ticks": [{"tick": k, "decision_ms": round(times[k], 3), "planner_ms": round(plan_ms[k], 3),
                               **shapes[k]} for k in sorted(range(len(times)), key=lambda k: -times[k])[:3]],
            "median_tick": {key: float(np.median([x[key] for x in shapes])) for key in shapes[0]} if shapes else None,
            "metrics": bool(metrics), "sample_ms_p50": pct(sample_ms, 50),
            "sample_ms_p99": pct(sample_ms, 99), "scrapes": scraper.scrapes if metrics else None}
