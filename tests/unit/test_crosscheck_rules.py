"""testbed/runs/crosscheck.py: what counts as the two backends disagreeing."""
from __future__ import annotations

import json

from testbed.runs.crosscheck import crosscheck


def _policy(makespan, gen, train, sync, lost=0, fidelity=None):
    return {"step_makespan_s": [makespan, makespan], "lost_requests": lost,
            "phases": [{"gen_s": gen, "train_s": train, "sync_s": sync}] * 2,
            "fidelity": fidelity or {"links": [], "distorted": False, "verdict": "faithful"}}


SLOW_SYNC = {"links": [{"phase": "sync", "efficiency": 0.3}], "distorted": True,
             "verdict": "distorted: sync at 30% of the modelled rate; run with time_dilation >= 4"}


def test_agreeing_runs_pass_and_their_figures_are_reported(tmp_path):
    emu = {"policies": {"orchestrrl": _policy(20.5, 15.2, 3.0, 1.0)}}
    sim = {"policies": {"orchestrrl": _policy(20.0, 15.0, 3.0, 1.0)}}
    figures, problems = crosscheck(emu, sim, tmp_path)
    assert problems == [] and figures["orchestrrl"]["makespan"] == [20.5, 20.0, 1.025]


def test_a_makespan_off_by_more_than_the_tolerance_is_a_problem_whatever_the_monitor_says(tmp_path):
    emu = {"policies": {"planner": _policy(23.0, 15.0, 3.0, 1.0, fidelity=SLOW_SYNC)}}
    sim = {"policies": {"planner": _policy(20.0, 15.0, 3.0, 1.0)}}
    _, problems = crosscheck(emu, sim, tmp_path)
    assert len(problems) == 1 and problems[0].startswith("planner makespan")


def test_a_slow_sync_is_let_off_only_when_the_monitor_flagged_it_and_named_the_fix(tmp_path):
    sim = {"policies": {"balancer": _policy(20.0, 15.0, 3.0, 1.0)}}
    flagged = {"policies": {"balancer": _policy(20.0, 15.0, 3.0, 2.0, fidelity=SLOW_SYNC)}}
    assert crosscheck(flagged, sim, tmp_path)[1] == []
    unflagged = {"policies": {"balancer": _policy(20.0, 15.0, 3.0, 2.0)}}
    assert [p.split(":")[0] for p in crosscheck(unflagged, sim, tmp_path)[1]] == ["balancer sync_s"]


def _train_steps(run, *steps):
    """run.json of one policy: per step (compute, modelled compute, all-reduce, modelled all-reduce, phase)."""
    run.mkdir(exist_ok=True)
    run.joinpath("run.json").write_text(json.dumps({"steps": [
        {"train": {"compute_s": c, "modelled_compute_s": mc, "allreduce_s": a, "modelled_allreduce_s": ma},
         "phases": {"train_s": t}} for c, mc, a, ma, t in steps]}))


def test_a_slow_train_is_let_off_only_if_what_its_flags_do_not_cover_is_within_the_tolerance(tmp_path):
    slow_train = {**SLOW_SYNC, "links": [{"phase": "train", "efficiency": 0.3}]}
    sim = {"policies": {"orchestrrl": _policy(20.0, 15.0, 3.0, 1.0)}}
    emu = {"policies": {"orchestrrl": _policy(20.0, 15.0, 4.0, 1.0, fidelity=slow_train)}}
    run = tmp_path / "orchestrrl"
    _train_steps(run, (2.0, 2.0, 2.0, 1.0, 4.0))  # the all-reduce, flagged, is what is off
    assert crosscheck(emu, sim, tmp_path)[1] == []
    # a compute 0.15 s late (7.5% of itself, 5% of the 3 s phase), not flagged: within the phase's tolerance
    _train_steps(run, (2.15, 2.0, 1.85, 1.0, 4.0))
    assert crosscheck(emu, sim, tmp_path)[1] == []
    # 0.5 s late in one step: the unflagged compute alone takes the phase past the 10% tolerance
    _train_steps(run, (2.0, 2.0, 2.0, 1.0, 4.0), (2.5, 2.0, 1.5, 1.0, 4.0))
    assert [p.split(":")[0] for p in crosscheck(emu, sim, tmp_path)[1]] == ["orchestrrl train_s"]
    # ... unless the monitor flagged the compute too
    flagged = {**slow_train, "compute_distorted": True}
    emu_c = {"policies": {"orchestrrl": _policy(20.0, 15.0, 4.0, 1.0, fidelity=flagged)}}
    assert crosscheck(emu_c, sim, tmp_path)[1] == []
    # time the phase took beside its parts (0.6 s: not compute, not a collective) is never let off
    _train_steps(run, (2.0, 2.0, 1.4, 1.0, 4.0))
    assert [p.split(":")[0] for p in crosscheck(emu_c, sim, tmp_path)[1]] == ["orchestrrl train_s"]


def test_a_train_phase_late_by_its_compute_alone_is_let_off_when_the_monitor_flagged_the_compute(tmp_path):
    sim = {"policies": {"orchestrrl": _policy(20.0, 15.0, 3.0, 1.0)}}
    run = tmp_path / "orchestrrl"
    _train_steps(run, (2.8, 2.0, 1.0, 1.0, 3.8))  # links on time, the compute 40% late
    for fid, problems in (({"links": [{"phase": "train", "efficiency": 1.0}], "distorted": True,
                            "compute_distorted": True, "verdict": "distorted: ...; rerun with time_dilation >= 1.1"},
                           []),
                          ({"links": [{"phase": "train", "efficiency": 1.0}], "distorted": False,
                            "compute_distorted": False, "verdict": "faithful"}, ["orchestrrl train_s"])):
        emu = {"policies": {"orchestrrl": _policy(20.0, 15.0, 3.8, 1.0, fidelity=fid)}}
        assert [p.split(":")[0] for p in crosscheck(emu, sim, tmp_path)[1]] == problems


def test_a_phase_whose_own_links_ran_within_the_tolerance_is_not_let_off(tmp_path):
    # the run is flagged (its sync at 30%); the train phase's own transfers at 0.85 of the rates are more than
    # the 10% tolerance below them, so its time is let off; at 0.95 they are not, and a slow train is a problem
    sim = {"policies": {"orchestrrl": _policy(20.0, 15.0, 3.0, 1.0)}}
    _train_steps(tmp_path / "orchestrrl", (2.0, 2.0, 1.5, 1.0, 3.5))
    for eff, problems in ((0.85, []), (0.95, ["orchestrrl train_s"])):
        fid = {**SLOW_SYNC, "links": SLOW_SYNC["links"] + [{"phase": "train", "efficiency": eff}]}
        emu = {"policies": {"orchestrrl": _policy(20.0, 15.0, 3.5, 1.0, fidelity=fid)}}
        assert [p.split(":")[0] for p in crosscheck(emu, sim, tmp_path)[1]] == problems


def test_lost_requests_and_different_policies_are_problems(tmp_path):
    sim = {"policies": {"orchestrrl": _policy(20.0, 15.0, 3.0, 1.0)}}
    lost = {"policies": {"orchestrrl": _policy(20.0, 15.0, 3.0, 1.0, lost=2)}}
    assert crosscheck(lost, sim, tmp_path)[1] == ["orchestrrl: 2 requests lost on the emulated backend"]
    other = {"policies": {"planner": _policy(20.0, 15.0, 3.0, 1.0)}}
    figures, problems = crosscheck(other, sim, tmp_path)
    assert figures == {} and problems and "policies differ" in problems[0]
