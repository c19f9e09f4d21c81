"""`orchestrrl bench crosscheck [SCENARIO]`: `orchestrrl demo SCENARIO` as a user runs it (the emulated compare
of the tuned static configuration, static-low, static-high and every policy), then the simulated backend's
compare of the same policies, and the two side by side (testbed/runs/crosscheck.py): per policy the mean step
makespan and the mean generation, train and sync times, emulated / simulated / ratio, and what disagrees by more
than 10% without the fidelity monitor's excuse. Prints figures, asserts nothing: tests/system/test_crosscheck.py
holds the small default to the same check; on the default scenario this is the ~10-minute `make demo` plus
seconds of simulation (docs/orchestrator.md "Measured").
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_demo(scenario: Path, out: Path, timeout_s: float) -> tuple[int, str, str]:
    """`orchestrrl demo SCENARIO --out OUT -q` in a child process: (exit code, stdout, stderr). On a timeout,
    or if the caller is interrupted, the demo gets SIGINT (it takes its cluster down) and, if that does not end
    it within a minute, is killed and this installation's records cleaned."""
    p = subprocess.Popen([sys.executable, "-m", "testbed.cli", "demo", str(scenario), "--out", str(out), "-q"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        so, se = p.communicate(timeout=timeout_s)
        return p.returncode, so, se
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                from emulation import registry

                registry.clean()


def simulated_compare(scenario: Path, policies: list[str], out: Path, fit: dict | None = None) -> dict:
    """The simulated backend's report.json of ``policies`` on ``scenario``, at the scale the emulated run was
    fitted to (``fit``: its report's; the agents' migration rule counts scaled bytes, so the simulated backend
    mirrors the scale)."""
    from emulation.scenario import load_scenario
    from testbed.cluster.fit import with_fit
    from testbed.runs.experiment import Experiment

    scn = load_scenario(scenario)
    if fit and fit.get("changed"):
        scn = with_fit(scn, fit["fitted_scale"], fit["fitted_time_dilation"])
    exp = Experiment(scn, "simulated")
    with exp:
        rep, _ = exp.compare([exp.policy(n) for n in policies], scn.workload.steps, out)
    return rep


def bench_crosscheck(scenario: Path, out: Path, timeout_s: float = 1800.0) -> dict:
    from testbed.runs.crosscheck import TOLERANCE, crosscheck

    t0 = time.monotonic()
    rc, stdout, stderr = run_demo(scenario, out / "emulated", timeout_s)
    demo_s = time.monotonic() - t0
    if rc != 0:
        return {"scenario": str(scenario), "demo_exit": rc, "demo_s": round(demo_s, 1), "stderr": stderr[-3000:]}
    emu = json.loads((out / "emulated" / "report.json").read_text())
    t1 = time.monotonic()
    sim = simulated_compare(scenario, list(emu["policies"]), out / "simulated", emu.get("fit"))
    figures, problems = crosscheck(emu, sim, out / "emulated")
    return {"scenario": str(scenario), "demo_exit": rc, "demo_s": round(demo_s, 1),
            "simulated_s": round(time.monotonic() - t1, 1), "first_line": stdout.splitlines()[0] if stdout else "",
            "fidelity_flagged_runs": emu["fidelity_flagged_runs"], "fit": emu.get("fit"), "tolerance": TOLERANCE,
            "figures": figures, "problems": problems}
