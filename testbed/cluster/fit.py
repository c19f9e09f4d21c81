"""Fit an emulated run to this machine before it starts (``fabric.fit``, ``--time-dilation auto``).

The emulator shapes every link to ``real rate x scale / time_dilation`` and sends ``real bytes x scale``, so a
transfer lasts its real time at any scale. What a scale cannot change is the work the userspace datapath does
per byte: on 2 cores, ovs-vswitchd forwarding a phase's concurrent flows competes with the agents that keep
generating beside it (the asynchronous step mode), and when the flows' shaped rates add up to more than it can
forward they run below their rates and the run is not faithful (the default demo's train and sync transfers
ran at 36-79% of their rates at 400 Mb/s links).

So, before anything starts: RLSim's flow model of the run's train and sync phases (the same code the simulated
backend and the cross-check use; ``testbed.backends.phase_model``) gives each phase's planned link traffic,
the bytes all its flows put on all the links they cross over the time they take; at the run's scale and
dilation that is the emulated Gb/s the datapath must forward. This machine's forwarding capacity is what
``orchestrrl bench fabric`` measured (one or two streams through ToR -> OCS -> ToR, i.e. three links each),
of which :data:`HEADROOM` is what a phase may plan to use while the agents run (measured: docs/emulation.md
"Fitting a run to this machine"). A fitted run lowers ``scale`` by the factor that brings the busiest phase
inside that budget, as far as the smallest message a phase sends stays at least :data:`MIN_MESSAGE_BYTES`
(below it a message is a packet or two, the clamps in the agents' collectives bind, and its time is no longer
its bytes over the rate); what is left is taken by a larger ``time_dilation`` (slower, not smaller). An
unfitted run that will not fit says so before it starts.

What the planned traffic cannot see (docs/emulation.md "Known limits"): a phase that overlaps generation (the
asynchronous step mode's train and sync beside the next step's streams) runs below its rate on a 2-core machine
even inside the budget. So every emulated run's verdict is remembered per scenario (:func:`remember_outcome`,
under the cache folder), and the next run of the same scenario at the same fitted numbers on the same
capacity measurement says before it starts what the last one found (:attr:`Fit.expectation`): faithful, or
how many runs the monitor flagged and the time dilation it named.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emulation import capacity

log = logging.getLogger(__name__)

# Share of the measured forwarding capacity (three links' worth per measured stream) that a phase may plan to
# use while the agents run beside it (measured on this machine: docs/emulation.md "Fitting a run to this
# machine").
HEADROOM = 0.25
LINKS_PER_MEASURED_STREAM = 3  # bench fabric's streams cross server up, the circuit, server down (RLSim's links)
MIN_MESSAGE_BYTES = 64 * 1024  # the smallest scaled message a fitted run keeps (one TSO segment)
# fitted scales are rounded down to this ladder (x 10^k, Renard's R10 series): a capacity measured a little
# differently gives the same scale, so the tuning grid's cache (keyed by the scenario, scale included: the agents'
# migration rule counts scaled bytes) is not missed for nothing
LADDER = (1.0, 1.25, 1.6, 2.0, 2.5, 3.2, 4.0, 5.0, 6.4, 8.0)


def ladder_floor(x: float) -> float:
    """The largest value of :data:`LADDER` x 10^k not above ``x`` (> 0)."""
    e = math.floor(math.log10(x))
    m = x / 10 ** e
    rung = max((r for r in LADDER if r <= m * (1 + 1e-9)), default=1.0)
    return float(f"{rung * 10 ** e:.6g}")


@dataclass(frozen=True)
class Fit:
    """What a run was fitted to (report.json's ``fit``): the planned traffic per phase at the scenario's numbers,
    the budget, and the scale and time dilation it runs at."""

    mode: str  # "auto" | "off"
    capacity_gbps: float | None  # measured stream capacity (bench fabric); None: never measured
    budget_gbps: float | None  # link traffic a phase may plan: HEADROOM x LINKS_PER_MEASURED_STREAM x capacity
    planned_gbps: dict  # phase -> emulated link traffic (Gb/s) at the scenario's scale and dilation
    smallest_message_bytes: float  # the smallest message a phase sends, at the scenario's scale
    scale: float  # the scenario's
    time_dilation: float  # the scenario's
    fitted_scale: float
    fitted_time_dilation: float
    fits: bool  # the busiest phase inside the budget at the numbers the run uses (None budget: unknown)
    message: str
    # what the last emulated run of this scenario found (None: none on record), and the key this run's own
    # verdict is remembered under
    last_run: dict | None = None
    outcome_key: str | None = None

    @property
    def expectation(self) -> str | None:
        """What the last run of this scenario says of this one (:func:`expectation`), for the first line."""
        return expectation(self, self.last_run)

    @property
    def changed(self) -> bool:
        return (self.fitted_scale, self.fitted_time_dilation) != (self.scale, self.time_dilation)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "changed": self.changed, "expectation": self.expectation,
                "headroom": HEADROOM, "min_message_bytes": MIN_MESSAGE_BYTES}

    def line(self) -> str:
        """One line for the top of a run's output."""
        return f"emulation fit ({self.mode}): {self.message}" + (f"; {self.expectation}" if self.expectation else "")


def planned_traffic(scn) -> tuple[dict, float]:
    """(phase -> real bytes/s of link traffic, smallest real message bytes) of ``scn``'s train and sync phases:
    RLSim's flow model of each transfer stage, its bytes over all links it crosses / its duration, the busiest
    stage of the phase. Generation's traffic (tokens, KV moves) is small beside them and left out."""
    from controller.traffic import train_bytes, train_traffic
    from rlsim.sim import sync_phase, train_phase
    from testbed.backends.phase_model import PhaseModel

    pm = PhaseModel(scn)
    w = scn.workload
    lengths = np.full(w.samples_per_step, max(1, int(w.response_median_tokens)))
    out = {}
    runs = {"train": train_phase(w, pm.cm, pm.spec, pm._net(pm.topology_for("train")), pm.train_servers, lengths,
                                 pm.settings, dp_net=pm.nets.get("train:dp") if pm.rewires else None,
                                 delay_s=pm.delay_ms / 1e3),
            "sync": sync_phase(w, pm.cm, pm.spec, pm.layout, pm._net("sync"), pm.train_servers, pm.gen_servers,
                               pm.settings)}
    for phase, run in runs.items():
        rates = [float(np.sum(res.link_bytes)) / res.makespan for _, res, _ in run.busy.values() if res.makespan > 0]
        out[phase] = max(rates, default=0.0)
    # the smallest message: a weight-sync bucket, an all-to-all's share per peer and layer group
    from testbed.backends.emulated import A2A_CHUNKS

    msgs = [scn.orchestrator.sync_bucket_mb * 1e6]
    tl = pm.train_layout
    tokens = float(np.sum(lengths) + len(lengths) * w.prompt_tokens)
    for st in train_traffic(tl, train_bytes(pm.cm, tl, tokens)).stages:
        for g in st.groups:
            if g.kind == "all_to_all" and len(g.members) > 1:
                msgs.append(g.nbytes / A2A_CHUNKS / (len(g.members) - 1))
    return out, min(msgs)


def plan_fit(mode: str, scale: float, tdf: float, planned_bytes_s: dict, smallest_message: float,
             measured: dict | None) -> Fit:
    """The fit (pure): ``planned_bytes_s`` real bytes/s of link traffic per phase, ``measured`` the stored
    capacity record (emulation.capacity) or None."""
    planned = {ph: b * 8 / 1e9 * scale / tdf for ph, b in planned_bytes_s.items()}  # emulated Gb/s
    busiest = max(planned.values(), default=0.0)
    cap = float(measured["capacity_gbps"]) if measured else None
    budget = HEADROOM * LINKS_PER_MEASURED_STREAM * cap if cap else None
    new_scale, new_tdf = scale, tdf
    if budget is None:
        fits = None
        msg = ("this machine's forwarding capacity was never measured (`orchestrrl bench fabric`): whether the "
               f"phases' {busiest:.2g} Gb/s of planned link traffic fit is unknown")
    elif busiest <= budget:
        fits = True
        msg = (f"the busiest phase plans {busiest:.2g} Gb/s of link traffic, inside the {budget:.2g} Gb/s this "
               f"machine forwards beside the agents ({HEADROOM:.0%} of 3 x {cap:.3g} Gb/s measured): "
               f"scale {scale:g}, time dilation {tdf:g} as the scenario says")
    elif mode == "off":
        fits = False
        msg = (f"NOT faithful expected: the busiest phase plans {busiest:.2g} Gb/s of link traffic, {busiest / budget:.1f}x "
               f"the {budget:.2g} Gb/s this machine forwards beside the agents; fit it with `fabric.fit: auto` "
               "(or --time-dilation auto)")
    else:
        k = budget / busiest  # the traffic must shrink by this factor
        floor = MIN_MESSAGE_BYTES / smallest_message if smallest_message > 0 else 0.0
        want = scale * k
        if want >= floor:
            new_scale = ladder_floor(want)
        else:  # the message floor binds: the least rung at or above it
            new_scale = ladder_floor(floor)
            if new_scale < floor:
                new_scale = ladder_floor(floor * 1.3)
        new_scale = min(scale, new_scale)
        rest = (scale * k) / new_scale  # < 1 where the message floor stopped the scale
        if rest < 1:
            new_tdf = float(np.ceil(tdf / rest * 100) / 100)
        fits = True
        parts = [f"scale {scale:g} -> {new_scale:g}" if new_scale != scale else None,
                 f"time dilation {tdf:g} -> {new_tdf:g}" if new_tdf != tdf else None]
        msg = (f"{', '.join(p for p in parts if p)}: the busiest phase planned {busiest:.2g} Gb/s of link traffic "
               f"against the {budget:.2g} Gb/s this machine forwards beside the agents ({HEADROOM:.0%} of 3 x "
               f"{cap:.3g} Gb/s measured)"
               + (f"; the scale stops where the smallest message is {MIN_MESSAGE_BYTES // 1024} KiB, the rest is "
                  "time dilation" if new_tdf != tdf else ""))
    return Fit(mode, cap, budget, {k: round(v, 4) for k, v in planned.items()}, smallest_message * scale, scale, tdf,
               float(new_scale), float(new_tdf), bool(fits) if fits is not None else None, msg)


def fit_scenario(scn, mode: str | None = None, measure=None):
    """``(scenario to run, Fit)``: ``scn`` fitted to this machine by ``mode`` (default: its ``fabric.fit``).
    ``measure()``, when given, is called to measure the capacity where none was stored (auto mode only)."""
    mode = mode or scn.fabric.fit
    measured = capacity.load_capacity()
    if measured is None and mode == "auto" and measure is not None:
        log.info("no forwarding capacity stored for this machine: measuring it (orchestrrl bench fabric)")
        measure()
        measured = capacity.load_capacity()
    planned, smallest = planned_traffic(scn)
    f = scn.fabric
    fit = plan_fit(mode, f.scale, f.time_dilation, planned, smallest, measured)
    key = outcome_key(scn)
    last = last_outcome(key)
    fit = dataclasses.replace(fit, last_run=last, outcome_key=key)
    if fit.changed:
        scn = with_fit(scn, fit.fitted_scale, fit.fitted_time_dilation)
    return scn, fit


def outcome_key(scn) -> str:
    """The key a scenario's emulated verdicts are remembered under: its content as given (before the fit), less
    its metrics endpoints (a port taken by another process moves them, not the emulation)."""
    from testbed.runs.tuning import cache_key

    return cache_key(dataclasses.replace(scn, metrics=type(scn.metrics)()), 0, ())


def outcome_path(key: str) -> Path:
    """Where the verdict of the scenario ``key`` names is remembered (beside the tuning cache)."""
    from testbed.runs.tuning import cache_dir

    return cache_dir().parent / "fidelity" / f"{key}.json"


def last_outcome(key: str) -> dict | None:
    """The remembered verdict of the last emulated run of the scenario ``key`` names (None: none, or unreadable)."""
    from emulation.registry import read_json

    doc = read_json(outcome_path(key))
    need = ("scale", "time_dilation", "capacity_gbps", "runs", "flagged", "tdf_needed", "verdict", "at")
    if doc is None or any(k not in doc for k in need):
        return None
    return doc


def remember_outcome(fit: Fit | None, fidelities: dict) -> dict | None:
    """Remember the fidelity verdicts of a finished emulated run or comparison (``fidelities``: run name -> its
    ``fidelity`` dict) under ``fit.outcome_key``, with the numbers it ran at. Returns the record (None: nothing
    judged, no fit, or the cache folder not writable: logged)."""
    from emulation.files import write_json_atomic

    judged = {n: f for n, f in fidelities.items() if isinstance(f, dict) and "distorted" in f}
    if fit is None or fit.outcome_key is None or not judged:
        return None
    bad = {n: f for n, f in judged.items() if f["distorted"]}
    need = [float(f["tdf_needed"]) for f in bad.values() if f.get("tdf_needed") is not None]
    rec = {"scale": fit.fitted_scale, "time_dilation": fit.fitted_time_dilation, "capacity_gbps": fit.capacity_gbps,
           "runs": len(judged), "flagged": len(bad), "tdf_needed": max(need) if need else None,
           "verdict": next(iter(bad.values()))["verdict"] if bad else "faithful",
           "at": time.strftime("%Y-%m-%d %H:%M")}
    try:
        write_json_atomic(outcome_path(fit.outcome_key), rec, indent=1, fsync=False, mkdir=True)
    except OSError as e:
        log.warning("could not remember this run's fidelity verdict: %s", e)
        return None
    return rec


def expectation(fit: Fit, last: dict | None) -> str | None:
    """What the last run of the same scenario says of this one, when it ran at the same fitted scale and
    dilation on the same capacity measurement (None otherwise: nothing to go by)."""
    if last is None or (last["scale"], last["time_dilation"], last["capacity_gbps"]) != (
            fit.fitted_scale, fit.fitted_time_dilation, fit.capacity_gbps):
        return None
    if not last["flagged"]:
        return (f"the last emulated run of this scenario here ({last['at']}, the same numbers) was faithful in "
                f"{last['runs']} of {last['runs']} runs")
    tdf = fit.fitted_time_dilation
    more = (f"; time dilation >= {last['tdf_needed']:g} would remove it (~{last['tdf_needed'] / tdf:.1f}x the "
            f"emulated steps' wall time)" if last["tdf_needed"] and last["tdf_needed"] > tdf else "")
    return (f"expect it NOT faithful: the last emulated run of this scenario here ({last['at']}, the same numbers) "
            f"had {last['flagged']} of {last['runs']} runs flagged by the fidelity monitor{more}")


def with_fit(scn, scale: float, time_dilation: float):
    """``scn`` at a fitted ``scale`` and ``time_dilation``."""
    return dataclasses.replace(scn, fabric=dataclasses.replace(scn.fabric, scale=scale, time_dilation=time_dilation))
