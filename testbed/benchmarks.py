"""Benchmarks of the emulated fabric. They report figures (JSON); they never assert.

* ``reconfig``: the OCS blackout a probe stream sees on changed circuits, the controller's overhead, and
  the loss on unchanged circuits, for a programmed switching delay D.
* ``fabric``: goodput of a shaped circuit against its configured rate, and this machine's aggregate
  forwarding capacity through ToR -> OCS -> ToR (saved for the builder's capacity warning).
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

import numpy as np

from emulation import capacity
from emulation.spec import FabricSpec, JobLayout
from testbed.harness import running_testbed
from testbed.traffic import ProbeStream, iperf3, iperf3_result

log = logging.getLogger(__name__)

# 4 ToRs with 2 uplinks each on one 8-port OCS. ToR t owns OCS ports 2t+1, 2t+2 (spec.py's numbering).
# M0 and M1 swap the two circuits between ToR 0 and ToR 1 (no other path: a probe h0 -> h1 sees the whole
# blackout) and keep ToR 2 <-> ToR 3 unchanged (a probe h2 -> h3 must lose nothing).
RECONFIG_SPEC = FabricSpec(pods=2, tors_per_pod=2, servers_per_tor=1, ocs_count=1, uplinks_per_tor=2,
                           server_gbps=100.0, uplink_gbps=100.0, scale=0.001)
RECONFIG_LAYOUT = JobLayout(train_pods=(0,), gen_pods=(1,))
M0 = [[1, 3], [2, 4], [5, 7], [6, 8]]
M1 = [[1, 4], [2, 3], [5, 7], [6, 8]]
CHANGED = (0, 1)  # probe src, dst servers across the changing circuits
UNCHANGED = (2, 3)


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


def bench_reconfig(delay_ms: float, samples: int = 20, pps: float = 2000.0, spacing_s: float = 0.15,
                   progress: Callable[[int], None] | None = None) -> dict:
    if samples < 1:
        raise ValueError("samples must be >= 1")
    spec, layout = RECONFIG_SPEC, RECONFIG_LAYOUT
    per_sample_s = spacing_s + delay_ms / 1000.0 + 0.05
    duration = 0.6 + samples * per_sample_s + 0.6
    interval = 1.0 / pps
    with running_testbed(spec, layout, initial_phase="train", delay_ms=delay_ms) as tb:
        tb.client.set_circuits({0: M0}, delay_ms=0)
        streams = [ProbeStream(tb.fabric, *CHANGED, pps=pps, duration_s=duration, port=47001),
                   ProbeStream(tb.fabric, *UNCHANGED, pps=pps, duration_s=duration, port=47002)]
        for s in streams:
            s.start_receiver()
        for s in streams:
            s.start_sender()
        t_end = time.monotonic() + duration
        time.sleep(0.6)  # let both streams settle before the first reconfiguration
        recs = []
        for i in range(samples):
            target = M1 if i % 2 == 0 else M0
            rec = tb.client.set_circuits({0: target}, delay_ms=delay_ms)
            if rec.get("status") != "done":
                raise RuntimeError(f"reconfiguration {i} not done: {rec}")
            recs.append(rec)
            if progress:
                progress(i + 1)
            time.sleep(spacing_s)
        if time.monotonic() > t_end - 0.3:
            log.warning("reconfigurations ran past the probe streams; later samples may be unmeasured")
        changed, unchanged = (s.summary() for s in streams)
    blackouts, overheads = [], []
    for rec in recs:
        t0 = rec["received_mono"]
        tm = rec["t_ms"]
        lo = t0 + tm.get("routes_moved", 0.0) / 1000.0 - 0.002
        hi = t0 + tm["confirmed"] / 1000.0 + 0.03
        blackouts.append(blackout_in_window(changed["gaps"], changed["records"], lo, hi, interval))
        overheads.append(rec["overhead_ms"])
    return {
        "delay_ms": float(delay_ms),
        "blackout_ms_p50": round(percentile(blackouts, 50), 3),
        "blackout_ms_p99": round(percentile(blackouts, 99), 3),
        "overhead_ms_p50": round(percentile(overheads, 50), 3),
        "overhead_ms_p99": round(percentile(overheads, 99), 3),
        "unchanged_loss": int(unchanged["lost"]),
        "samples": samples,
        "probe_pps": pps,
        "probe_pps_achieved": changed["pps_achieved"] and round(changed["pps_achieved"], 1),
        "changed_lost": int(changed["lost"]),
        "blackout_ms": [round(b, 3) for b in blackouts],
        "overhead_ms": overheads,
        "dark_ms_p50": round(statistics.median(r["dark_ms"] for r in recs if "dark_ms" in r), 3),
    }


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
