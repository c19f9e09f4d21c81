"""The cross-check of the two backends: an emulated `compare` (real agents on the emulated fabric) against the
simulated backend's on the same scenario (the same engine and orchestrator in virtual time, RLSim's flow model
for train and sync), policy by policy.

Per policy the mean step makespan and the mean generation, train and weight-sync times must agree within
``tolerance``. The train and sync phases are let off only where the emulated run's fidelity monitor flagged
that phase's own parts and named the time dilation that removes it: its transfers below the modelled link rates
(a 2-core machine cannot forward four concurrent 400 Mb/s flows across the OCS bridge at their rate while the
agents generate: docs/emulation.md "Known limits"), or a train phase's compute past its modelled time; what the
flagged parts do not account for must stay within the tolerance of the phase. Used by
tests/system/test_crosscheck.py (the small default) and by `orchestrrl bench crosscheck` (any scenario, the
default's demo included).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TOLERANCE = 0.10
PHASES = ("gen_s", "train_s", "sync_s")


def _mean_phase(policy: dict, phase: str) -> float:
    return float(np.mean([p[phase] for p in policy["phases"]]))


STAGES = ("alltoall", "allreduce")  # a train phase's collectives, as the emulated backend's step detail names them


def _unexplained_train_s(step: dict, compute_flagged: bool, links_flagged: bool) -> float:
    """The time of one step's train phase that no flag of the monitor accounts for: what the phase took beyond
    its parts (compute and collectives), plus each part's own error unless the monitor flagged that part."""
    tr = step["train"]
    parts = [(tr["compute_s"], tr["modelled_compute_s"], compute_flagged)]
    parts += [(tr[f"{k}_s"], tr[f"modelled_{k}_s"], links_flagged) for k in STAGES if f"{k}_s" in tr]
    rest = step["phases"]["train_s"] - sum(measured for measured, _, _ in parts)
    return abs(rest) + sum(abs(measured - modelled) for measured, modelled, flagged in parts if not flagged)


def _excused(emulated: dict, run_dir: Path, key: str, tolerance: float, simulated_s: float) -> bool:
    """Whether a train or sync disagreement is one the monitor flagged and named the fix for: the run is flagged
    (testbed.backends.emulated.fidelity: distorted, and the time dilation that removes it named) for this
    phase's own parts. Sync: its transfers took more than ``tolerance`` beyond their modelled time (the monitor's own
    line, LINK_SLOWDOWN_MAX: while the monitor drew it at 0.8 of the rates, syncs at 0.81-0.87 took 1.15-1.24x
    the modelled time unflagged, CI 2026-12-03 and 12-04). Train: its collectives did, or its compute (a wall-clock wait of modelled time x time dilation,
    0.5 s of wall time for 2.1 s at the small default's 0.25, which a loaded 2-core machine's scheduler
    overshoots by tens of ms) ran past the monitor's line; and in every step the time the flagged parts do not
    account for (the unflagged parts' own errors and whatever the phase took beside its parts) stays within
    the tolerance of the simulated phase (``simulated_s``)."""
    if key not in ("sync_s", "train_s"):
        return False
    fid = emulated["fidelity"]
    phase = key[:-2]
    slow = any(u["phase"] == phase and u.get("efficiency", 1) < 1 / (1 + tolerance) for u in fid["links"])
    named = fid["distorted"] and "time_dilation >=" in fid["verdict"]
    if phase == "sync":
        return named and slow
    compute = bool(fid.get("compute_distorted"))
    if not (named and (slow or compute)):
        return False
    steps = json.loads((run_dir / "run.json").read_text())["steps"]
    return all(_unexplained_train_s(st, compute, slow) <= tolerance * simulated_s for st in steps)


def crosscheck(emulated: dict, simulated: dict, out: Path, tolerance: float = TOLERANCE) -> tuple[dict, list[str]]:
    """Compare two report.json objects of the same policies; ``out`` is the emulated compare's folder (its
    per-policy run.json). Returns ({policy: {figure: [emulated, simulated, ratio]}}, the disagreements)."""
    if set(emulated["policies"]) != set(simulated["policies"]):
        return {}, [f"policies differ: emulated {sorted(emulated['policies'])}, "
                    f"simulated {sorted(simulated['policies'])}"]
    figures, problems = {}, []
    for name, e in emulated["policies"].items():
        s = simulated["policies"][name]
        for which, rec in (("emulated", e), ("simulated", s)):
            if rec["lost_requests"]:
                problems.append(f"{name}: {rec['lost_requests']} requests lost on the {which} backend")
        row = {"makespan": (float(np.mean(e["step_makespan_s"])), float(np.mean(s["step_makespan_s"])))}
        for ph in PHASES:
            row[ph] = (_mean_phase(e, ph), _mean_phase(s, ph))
        figures[name] = {k: [round(a, 3), round(b, 3), round(a / b, 3)] for k, (a, b) in row.items()}
        for k, (a, b) in row.items():
            if abs(a / b - 1) <= tolerance or _excused(e, out / name, k, tolerance, b):
                continue
            problems.append(f"{name} {k}: emulated {a:.3f} s vs simulated {b:.3f} s ({a / b:.3f}x)")
    return figures, problems
