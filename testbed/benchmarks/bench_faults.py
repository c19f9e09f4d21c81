"""`orchestrrl bench faults`: a generator agent killed during generation, during a migration or during a layout
switch, on the emulated cluster; what it cost. Prints figures, asserts nothing (tests/system/test_faults_live.py
checks the same goals on a small scenario).

A kill is ``SIGKILL`` to the agent's process group, found by the PID the cluster recorded when it started it:

* ``generation``: a generator, once it has produced ``KILL_AFTER_TOKENS`` tokens of the first step;
* ``migration``: the destination of the run's first migration, the moment the driver's migrate call to its
  source is sent (it dies under the call: the source is mid-copy or about to be);
* ``layout_switch``: the server of the run's first planned layout switch, as soon as the switch started;
* ``weight_sync``: the last generator of the weight broadcast, the moment the broadcast call is sent (in the
  asynchronous step mode it runs beside the next step's generation): the sync is run again without it, and
  the step generating beside it loses the generator. Two steps are run.

Per kill: how long after it the failure was acted on (``noticed_s``, the ``agent_failed`` event against the
kill time), the longest planning tick, the most migrations any planning interval held, lost requests, the token
accounting, and the generation time of the kill's step (the step generating when the kill came) against the
bound:

    bound = simulated_s x pace x (1 + BOUND_REL) + 2 planning intervals,  pace = emulated_no_kill_s / simulated_no_kill_s

``simulated_s`` is the simulated backend's generation time for the same step with the same server killed at
the same time (what the survivors need; the simulator acts on the failure when it happens); ``pace`` is how
much slower than the simulator this cluster ran the same step without a kill (the baseline run, on the same
cluster just before: a loaded 2-core machine runs the agents 0-30% behind their modelled time, which has
nothing to do with the failure); the 2 intervals are what the failure may take to be acted on. (The simulator
has no failure in a weight sync: the sync's own re-run is held to the no-kill baseline, by the system test.)
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

KILL_MODES = ("generation", "migration", "layout_switch", "weight_sync")
DEFAULT_POLICY = {"generation": "orchestrrl", "migration": "balancer", "layout_switch": "planner",
                  "weight_sync": "orchestrrl"}
STEPS = {"weight_sync": 2}  # runs of one step otherwise
KILL_AFTER_TOKENS = 3000
NOT_KILLED = {"generation": "the victim never produced the tokens the kill waits for",
              "migration": "the balancer made no migration in this run (its gain floor: docs/orchestrator.md)",
              "layout_switch": "the planner made no live layout switch in this run",
              "weight_sync": "no weight sync ran beside a generation (the async step mode runs one)"}
BOUND_REL = 0.05  # the run-to-run spread of one emulated step on this machine (a few percent)


class Killer:
    """Kills one agent, once, by the PID its pool recorded; remembers when (backend clock: CLOCK_MONOTONIC
    / TDF, the agents' and the driver's)."""

    def __init__(self, pool, tdf: float = 1.0):
        self.pool, self.tdf = pool, tdf
        self.t: float | None = None
        self.victim: int | None = None
        self._lock = threading.Lock()

    def __call__(self, victim: int) -> None:
        with self._lock:
            if self.t is not None:
                return
            self.t = time.monotonic() / self.tdf
            self.victim = victim
            os.killpg(self.pool.procs[victim].pid, signal.SIGKILL)  # popen gave it its own group


def arm(pool, mode: str, kill: Killer, victim: int | None = None, tokens: int = KILL_AFTER_TOKENS) -> None:
    """Set up ``mode``'s kill on ``pool`` (hooks on the pool's own calls, no change to what they do)."""
    if mode == "generation":
        who = victim if victim is not None else pool.generators[-1]

        def watch() -> None:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and kill.t is None:
                if who not in pool.placement.values():  # this run has not placed requests on it yet (its engine
                    time.sleep(0.02)                     # counter may still hold an earlier run's tokens)
                    continue
                try:
                    if pool.clients[who].call("stats", timeout_s=2)["generation_tokens_total"] > tokens:
                        kill(who)
                        return
                except Exception:  # noqa: BLE001 - not serving yet, or a reset between runs
                    pass
                time.sleep(0.02)

        threading.Thread(target=watch, name="killer", daemon=True).start()
    elif mode == "migration":
        real = pool.migrate

        def migrate(rid, src, dst, *a, **kw):
            threading.Thread(target=kill, args=(dst,), daemon=True).start()  # dies under the call
            return real(rid, src, dst, *a, **kw)

        pool.migrate = migrate
    elif mode == "layout_switch":
        real_call = pool.call

        def call(s, method, params=None, *a, **kw):
            out = real_call(s, method, params, *a, **kw)
            if method == "set_layout" and not (params or {}).get("free"):  # a planned switch, under way now
                kill(s)
            return out

        pool.call = call
    elif mode == "weight_sync":
        real_all = pool.call_all

        def call_all(agents, method, params_of, timeout_s, watch=None):
            if method == "broadcast":
                gens = [a for a in agents if a in pool.generators]
                if gens:
                    threading.Thread(target=kill, args=(gens[-1],), daemon=True).start()  # dies under it
            return real_all(agents, method, params_of, timeout_s, watch)

        pool.call_all = call_all
    else:
        raise ValueError(f"unknown kill mode {mode!r} (known: {', '.join(KILL_MODES)})")


def _gen_phases(events: list) -> list[tuple[float, float]]:
    """(start, end) of every generation phase, in step order."""
    starts = {e["step"]: e["t"] for e in events if e["kind"] == "phase_start" and e["phase"] == "gen"}
    ends = {e["step"]: e["t"] for e in events if e["kind"] == "phase_end" and e["phase"] == "gen"}
    return [(starts[k], ends[k]) for k in sorted(starts) if k in ends]


def measure(res: dict, events: list, kill: Killer, interval: float) -> dict:
    """The figures of one run with a kill (``res``: the driver's result, ``events``: its timeline). The kill's
    step is the one whose generation phase was running at the kill (the first step's in every mode but
    weight_sync, whose kill comes while the next step generates)."""
    failed = [e for e in events if e["kind"] == "agent_failed"]
    gens = _gen_phases(events)
    step = 0
    if kill.t is not None:
        step = max((k for k, (a, _) in enumerate(gens) if a <= kill.t), default=0)
    start, end = gens[step]
    syncs = [e for e in events if e["kind"] == "phase_end" and e["phase"] == "sync"]
    out = {"victim": kill.victim, "killed": kill.t is not None, "kill_step": step,
           "kill_after_s": None if kill.t is None else kill.t - start,
           "failed": [e["server"] for e in failed],
           "noticed_s": (failed[0]["t"] - kill.t) if failed and kill.t is not None else None,
           "noticed_intervals": (failed[0]["t"] - kill.t) / interval if failed and kill.t is not None else None,
           "tick_s_max": res["ticks"]["took_s_max"], "tick_intervals_max": (res["ticks"]["took_s_max"] or 0) / interval,
           "migrations": res["migrations"],
           "migrations_per_interval_max": res["ticks"]["migrations_per_interval_max"],
           "skipped_intervals": res["ticks"]["skipped_intervals"],
           "lost_requests": res["lost_requests"], "tokens_target": res["tokens_target"],
           "tokens_unique": res["tokens_unique"], "tokens_duplicate": res["tokens_duplicate"],
           "exactly_once": res["exactly_once"],
           "victim_tokens": res["tokens_by_agent"].get(str(kill.victim)),
           "generation_s": end - start, "step_makespan_s": res["step_makespan_s"][step],
           "step_makespans_s": res["step_makespan_s"], "gen_s": [p["gen_s"] for p in res["phases"]],
           "sync_retries": [e.get("retries", 0) for e in syncs],
           "sync_consistent": [e.get("consistent") for e in syncs]}
    mig = [e for e in events if e["kind"] in ("migration", "migration_failed") and e.get("dst") == kill.victim]
    if mig:
        out["migrate_call_s"] = mig[0]["t"] - mig[0]["start"]
        out["migrate_result"] = mig[0]["kind"]
    return out


def simulated_bound(scn, policy: str, victim: int, kill_after_s: float, interval: float,
                    emulated_no_kill_s: float | None, step: int = 0) -> dict:
    """The simulated backend's generation time of step ``step`` with ``victim`` killed ``kill_after_s`` into
    that step's generation (the survivors' work), and without the kill; the bound the emulated run is held to
    (module doc; without a baseline the pace is taken as 1). The run is ``step + 1`` steps, in the scenario's
    step mode, with the settings Experiment.run gives the policy."""
    from testbed.driver import Driver
    from testbed.runs.experiment import Experiment

    exp = Experiment(scn, "simulated")
    out = {}
    for name, fail in (("simulated_s", (victim, kill_after_s, step)), ("simulated_no_kill_s", None)):
        p = exp.policy(policy)
        b = exp.backend(p)
        if fail is not None:
            b.inject_failure(*fail)
        res = Driver(scn, b, p, exp._settings(p)).run(step + 1)
        out[name] = res["steps"][step]["generation_s"]
    out["pace"] = emulated_no_kill_s / out["simulated_no_kill_s"] if emulated_no_kill_s else 1.0
    out["bound_s"] = out["simulated_s"] * out["pace"] * (1 + BOUND_REL) + 2 * interval
    return out


def fault_run(scn, mode: str, out: Path, policy: str | None = None, victim: int | None = None,
              tokens: int = KILL_AFTER_TOKENS, baseline: bool = True) -> dict:
    """One emulated run with ``mode``'s kill, on a cluster of its own; figures. ``baseline``: first the same run
    without a kill on the same cluster (``emulated_no_kill_s``: the kill's step's generation time)."""
    from testbed.runs.experiment import Experiment

    policy = policy or DEFAULT_POLICY[mode]
    load0 = os.getloadavg()[0]  # the machine's load: a shared 2-core machine slows the driver's ticks
    exp = Experiment(scn, "emulated")
    interval = exp.settings.planning_interval_s
    r0 = None
    steps = STEPS.get(mode, 1)
    with exp:
        if baseline:
            r0, _ = exp.run(exp.policy(policy), steps, out / "no-kill")
        kill = Killer(exp.cluster[1], scn.fabric.time_dilation)
        arm(exp.cluster[1], mode, kill, victim, tokens)
        res, files = exp.run(exp.policy(policy), steps, out)
        events = json.loads(Path(files["timeline"]).read_text())["events"]
    got = {"mode": mode, "policy": policy, "interval_s": interval, **measure(res, events, kill, interval),
           "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "decision_ms_p99": res["decision_ms_p99"]}
    base = None
    if r0 is not None:
        base = r0["steps"][got["kill_step"]]["generation_s"]
        got["emulated_no_kill_s"] = base
        got["emulated_no_kill_makespans_s"] = r0["step_makespan_s"]
        got["emulated_no_kill_gen_s"] = [p["gen_s"] for p in r0["phases"]]
    if not got["killed"]:  # the run never did what the kill waits for: nothing was measured
        got["note"] = NOT_KILLED[mode]
    else:
        got.update(simulated_bound(scn, policy, kill.victim, got["kill_after_s"], interval, base, got["kill_step"]))
        got["within_bound"] = got["generation_s"] <= got["bound_s"]
    return got


def bench_faults(scenario_path: str, modes: list[str], out: Path, tokens: int = KILL_AFTER_TOKENS,
                 baseline: bool = True, progress: Callable[[int], None] | None = None) -> dict:
    from emulation.scenario import load_scenario

    scn = load_scenario(scenario_path)
    runs = []
    for i, mode in enumerate(modes):
        runs.append(fault_run(scn, mode, out / mode, tokens=tokens, baseline=baseline))
        if progress:
            progress(i + 1)
    return {"scenario": scn.name, "bound_rel": BOUND_REL, "runs": runs}
