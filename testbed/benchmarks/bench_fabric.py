"""Benchmarks of the emulated fabric. They report figures (JSON); they never assert.

* ``reconfig``: the OCS blackout a probe stream sees on changed circuits, the controller's overhead, and
  the loss on unchanged circuits, for a programmed switching delay D.
* ``fabric``: goodput of a shaped circuit against its configured rate, and this machine's aggregate
  forwarding capacity through ToR -> OCS -> ToR (saved for the builder's capacity warning).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import numpy as np

from emulation import capacity
from emulation.spec import FabricSpec, JobLayout
from testbed.cluster.fabric import running_testbed
from testbed.cluster.probes import ProbeStream, iperf3, iperf3_result

log = logging.getLogger(__name__)

# The default scenario's fabric size: 2 pods x 2 ToRs x 2 servers, one 8-port OCS, 2 uplinks per ToR. ToR t owns
# OCS ports 2t+1 (uplink 0) and 2t+2 (uplink 1) (spec.py's numbering). Two cases, each alternating between two
# matchings; both keep ToR 2 <-> ToR 3 on circuit (5, 7), so the probe h4 -> h6 must lose nothing, and
# neither leaves ToR 0 another path to ToR 1, so the probe h0 -> h2 sees the whole blackout:
# * repaired: the two circuits between ToR 0 and ToR 1 swap ports; the same uplinks stay paired, so no ToR
#   route changes (what this benchmark measured before);
# * rerouted: the only circuit between ToR 0 and ToR 1 moves from their uplinks 0 to their uplinks 1, so
#   both ToRs' egress uplink toward the other changes (their routes must move with the circuit).
RECONFIG_SPEC = FabricSpec(pods=2, tors_per_pod=2, servers_per_tor=2, ocs_count=1, uplinks_per_tor=2,
                           server_gbps=100.0, uplink_gbps=100.0, scale=0.001)
RECONFIG_LAYOUT = JobLayout(train_pods=(0,), gen_pods=(1,))
CASES = {
    "repaired": ([[1, 3], [2, 4], [5, 7], [6, 8]], [[1, 4], [2, 3], [5, 7], [6, 8]]),
    "rerouted": ([[1, 3], [2, 6], [4, 8], [5, 7]], [[2, 4], [1, 6], [3, 8], [5, 7]]),
}
CHANGED = (0, 2)  # probe src, dst servers: ToR 0 -> ToR 1, across the changing circuits
UNCHANGED = (4, 6)  # ToR 2 -> ToR 3, on the circuit both cases keep


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else None


def blackout_in_window(gaps: list[dict], records: list, t_lo: float, t_hi: float, interval_s: float) -> float:
    """Blackout (ms) of the gaps whose first lost packet was sent within [t_lo, t_hi].

    A gap's span on the sender's clock (last received before -> first received after) overstates the dark
    time by one sending interval on average, so one interval is subtracted (a gap of one lost packet at
    10 us pacing error still reads ~one interval).
    """
    send_time = {int(r[0]): float(r[1]) for r in records}
    total = 0.0
    for g in gaps:
        t = send_time.get(int(g["first_lost"]))
        if t is not None and t_lo <= t <= t_hi and not g["truncated"]:
            total += max(0.0, g["duration_s"] - interval_s)
    return total * 1000.0


def _p(xs: list[float], q: float) -> float | None:
    v = percentile(xs, q)
    return None if v is None else round(v, 3)


def _stage_p50(recs: list[dict]) -> dict[str, float]:
    """Median of each overhead stage (controller/reconfig/executor.py STAGES) over ``recs``."""
    names = [n for n in (recs[0].get("overhead_stages_ms") or {})] if recs else []
    return {n: _p([r["overhead_stages_ms"][n] for r in recs if n in r.get("overhead_stages_ms", {})], 50)
            for n in names}


def bench_reconfig(delay_ms: float, samples: int = 20, pps: float = 2000.0, spacing_s: float = 0.15,
                   progress: Callable[[int], None] | None = None, datapath_flush: str = "auto",
                   metrics: bool = False, scrape_interval_s: float | None = 1.0) -> dict:
    """Both cases (CASES), ``samples`` reconfigurations each, under one pair of probe streams.
    ``datapath_flush``: the controller's option (controller/datapath.py). ``metrics``: the controller serves
    its Prometheus metrics on a free loopback port and the benchmark scrapes them every ``scrape_interval_s``
    (what a Prometheus server does; None: never); ``metrics_scrapes`` says how many scrapes the run saw."""
    if samples < 1:
        raise ValueError("samples must be >= 1")
    spec, layout = RECONFIG_SPEC, RECONFIG_LAYOUT
    per_sample_s = spacing_s + delay_ms / 1000.0 + 0.05
    duration = 0.6 + len(CASES) * (samples * per_sample_s + 0.5) + 0.6
    interval = 1.0 / pps
    recs: dict[str, list[dict]] = {case: [] for case in CASES}
    from emulation.metrics import bind_port

    from controller.process import free_port
    from emulation.metrics import Scraper

    mport = free_port() if metrics else 0  # a free port: a benchmark takes no default one
    with running_testbed(spec, layout, initial_phase="train", delay_ms=delay_ms,
                         datapath_flush=datapath_flush, metrics_port=mport) as tb, \
            (Scraper(tb.controller.metrics_url, scrape_interval_s) if metrics and scrape_interval_s
             else contextlib.nullcontext()) as scraper:
        tb.client.set_circuits({0: CASES["repaired"][0]}, delay_ms=0)
        streams = [ProbeStream(tb.fabric, *CHANGED, pps=pps, duration_s=duration, port=47001),
                   ProbeStream(tb.fabric, *UNCHANGED, pps=pps, duration_s=duration, port=47002)]
        for s in streams:
            s.start_receiver()
        for s in streams:
            s.start_sender()
        t_end = time.monotonic() + duration
        time.sleep(0.6)  # let both streams settle before the first reconfiguration
        done = 0
        for case, (a, b) in CASES.items():
            tb.client.set_circuits({0: a}, delay_ms=0)  # the case's first matching (not measured)
            time.sleep(0.3)
            for i in range(samples):
                rec = tb.client.set_circuits({0: b if i % 2 == 0 else a}, delay_ms=delay_ms)
                if rec.get("status") != "done":
                    raise RuntimeError(f"{case} reconfiguration {i} not done: {rec}")
                recs[case].append(rec)
                done += 1
                if progress:
                    progress(done)
                time.sleep(spacing_s)
        if time.monotonic() > t_end - 0.3:
            log.warning("reconfigurations ran past the probe streams; later samples may be unmeasured")
        changed, unchanged = (s.summary() for s in streams)
        unchanged_sent_at = {int(r[0]): float(r[1]) for r in unchanged["records"]}
    out: dict = {"delay_ms": float(delay_ms), "datapath_flush": datapath_flush, "metrics": bool(metrics),
                 "metrics_scrapes": scraper.scrapes if scraper is not None else None}
    for case, rs in recs.items():
        blackouts, losses = [], 0
        for rec in rs:
            t0 = rec["received_mono"]
            tm = rec["t_ms"]
            lo = t0 + tm.get("routes_moved", 0.0) / 1000.0 - 0.002
            hi = t0 + max(tm["confirmed"], tm.get("final_routes", 0.0)) / 1000.0 + 0.03
            blackouts.append(blackout_in_window(changed["gaps"], changed["records"], lo, hi, interval))
            losses += sum(g["lost"] for g in unchanged["gaps"] if not g["truncated"]
                          and lo <= unchanged_sent_at.get(int(g["first_lost"]), float("nan")) <= hi)
        overheads = [r["overhead_ms"] for r in rs]
        sfx = "" if case == "repaired" else f"_{case}"
        out.update({
            f"blackout_ms_p50{sfx}": _p(blackouts, 50), f"blackout_ms_p99{sfx}": _p(blackouts, 99),
            f"overhead_ms_p50{sfx}": _p(overheads, 50), f"overhead_ms_p99{sfx}": _p(overheads, 99),
            f"unchanged_loss{sfx}": int(losses),
            f"dark_ms_p50{sfx}": _p([r["dark_ms"] for r in rs if "dark_ms" in r], 50),
            f"overhead_stages_ms_p50{sfx}": _stage_p50(rs),
            f"final_routes_after_confirmed_ms_p50{sfx}": _p(
                [r["t_ms"]["final_routes"] - r["t_ms"]["confirmed"] for r in rs], 50),
            f"blackout_ms{sfx}": [round(b, 3) for b in blackouts],
            f"overhead_ms{sfx}": overheads,
        })
    out.update({
        "unchanged_loss_total": int(unchanged["lost"]),  # over the whole run, set-up moves included
        "samples": samples,
        "fabric": "2 pods x 2 ToRs x 2 servers, 1 OCS, 2 uplinks per ToR (scenarios/default.yaml's size)",
        "probe_pps": pps,
        "probe_pps_achieved": changed["pps_achieved"] and round(changed["pps_achieved"], 1),
        "changed_lost": int(changed["lost"]),
    })
    return out


# ---- fabric: shaped goodput and forwarding capacity ------------------------------------------------------
def _fabric_spec(rate_mbps: float) -> FabricSpec:
    # 2 pods x 1 ToR x 2 servers; both ToR uplinks form circuits between the two ToRs in the train phase
    return FabricSpec(pods=2, tors_per_pod=1, servers_per_tor=2, ocs_count=1, uplinks_per_tor=2,
                      server_gbps=rate_mbps / 1000.0 / 0.001, uplink_gbps=rate_mbps / 1000.0 / 0.001, scale=0.001)


def bench_fabric(rate_mbps: float = 1000.0, seconds: float = 4.0, capacity_rate_mbps: float = 40000.0,
                 save: bool = True, progress: Callable[[int], None] | None = None) -> dict:
    layout = JobLayout(train_pods=(0,), gen_pods=(1,))
    # 1) shaped circuit: one TCP stream h0 (pod 0) -> h2 (pod 1), ToR -> OCS -> ToR, every link at rate_mbps
    with running_testbed(_fabric_spec(rate_mbps), layout) as tb:
        r = iperf3_result(iperf3(tb.fabric, 0, 2, seconds, port=5301), seconds + 20)
    goodput_ratio = r["bps"] / (rate_mbps * 1e6)
    if progress:
        progress(1)
    # 2) capacity: links shaped far above what the machine forwards; 1 then 2 concurrent cross-pod streams
    runs = []
    with running_testbed(_fabric_spec(capacity_rate_mbps), layout) as tb:
        for pairs in ([(0, 2)], [(0, 2), (1, 3)]):
            clis = [iperf3(tb.fabric, s, d, seconds, port=5400 + i) for i, (s, d) in enumerate(pairs)]
            total = sum(iperf3_result(c, seconds + 20)["bps"] for c in clis)
            runs.append({"streams": len(pairs), "gbps": round(total / 1e9, 3)})
            if progress:
                progress(1 + len(runs))
    cap = max(x["gbps"] for x in runs)
    out = {"goodput_ratio": round(goodput_ratio, 4), "rate_mbps": rate_mbps,
           "goodput_mbps": round(r["bps"] / 1e6, 1), "retransmits": r["retransmits"],
           "capacity_gbps": cap, "capacity_runs": runs, "seconds": seconds}
    if save:
        saved = capacity.save_capacity(cap, goodput_ratio, "orchestrrl bench fabric")
        out["saved_to"] = str(capacity.capacity_file())
        log.info("saved capacity %s", saved)
    return out
