"""Fitting an emulated run to this machine before it starts (testbed/cluster/fit.py): the planned traffic per
phase from RLSim's model, the budget from the measured capacity, a lower scale first, a larger dilation where
the smallest messages would get too small, and a clear word when a run is not fitted and will not fit."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from emulation.scenario import load_scenario
from emulation.validation import SpecError
from testbed.cluster import fit
from testbed.commands.run import time_dilation_arg

PLANNED = {"train": 500e9, "sync": 600e9}  # real bytes/s of link traffic: 4.8 Gb/s at scale 0.00025, TDF 0.25


def test_a_run_inside_the_budget_keeps_its_numbers():
    f = fit.plan_fit("auto", 0.00025, 0.25, PLANNED, 512e6, {"capacity_gbps": 20.0})
    assert f.fits and not f.changed and (f.fitted_scale, f.fitted_time_dilation) == (0.00025, 0.25)
    assert f.planned_gbps["sync"] == pytest.approx(4.8)


def test_auto_lowers_the_scale_to_the_budget():
    f = fit.plan_fit("auto", 0.00025, 0.25, PLANNED, 512e6, {"capacity_gbps": 4.0})
    budget = fit.HEADROOM * fit.LINKS_PER_MEASURED_STREAM * 4.0
    assert f.fits and f.changed and f.fitted_time_dilation == 0.25
    assert f.fitted_scale < 0.00025 and 4.8 * f.fitted_scale / 0.00025 <= budget + 1e-9
    assert f.fitted_scale in {fit.ladder_floor(f.fitted_scale)}  # a rung of the ladder: caches stay hit
    assert "scale 0.00025 ->" in f.line()


def test_the_message_floor_stops_the_scale_and_the_rest_is_dilation():
    f = fit.plan_fit("auto", 0.00025, 0.25, PLANNED, 512e6, {"capacity_gbps": 0.5})
    assert f.fitted_scale * 512e6 >= fit.MIN_MESSAGE_BYTES  # the smallest message stays >= 64 KiB
    assert f.fitted_time_dilation > 0.25
    budget = fit.HEADROOM * fit.LINKS_PER_MEASURED_STREAM * 0.5
    assert 4.8 * (f.fitted_scale / 0.00025) * (0.25 / f.fitted_time_dilation) <= budget * 1.01
    assert "time dilation 0.25 ->" in f.message


def test_off_says_before_the_run_that_it_will_not_be_faithful():
    f = fit.plan_fit("off", 0.00025, 0.25, PLANNED, 512e6, {"capacity_gbps": 1.0})
    assert f.fits is False and not f.changed and "NOT faithful" in f.message and "fit: auto" in f.message
    unknown = fit.plan_fit("auto", 0.00025, 0.25, PLANNED, 512e6, None)
    assert unknown.fits is None and "bench fabric" in unknown.message and not unknown.changed


def test_ladder():
    assert [fit.ladder_floor(x) for x in (0.000132, 0.00025, 0.0001, 3.3e-5, 0.99)] == [
        0.000125, 0.00025, 0.0001, 3.2e-05, 0.8]


def test_planned_traffic_of_the_default_and_fit_scenario(monkeypatch, tmp_path):
    monkeypatch.setenv("ORCHESTRRL_CAPACITY_FILE", str(tmp_path / "cap.json"))
    scn = load_scenario("scenarios/default-small.yaml")
    planned, smallest = fit.planned_traffic(scn)
    # four trainers' ring and four sync chains across ToR -> OCS -> ToR at 400 Gb/s
    assert planned["sync"] * 8 / 1e9 == pytest.approx(4800, rel=0.01) and planned["train"] > 0
    assert smallest == scn.orchestrator.sync_bucket_mb * 1e6
    measured = []
    auto = dataclasses.replace(scn, fabric=dataclasses.replace(scn.fabric, fit="auto"))
    from emulation import capacity

    out, f = fit.fit_scenario(auto, measure=lambda: (measured.append(1), capacity.save_capacity(2.0, 0.95, "test")))
    assert measured == [1] and f.capacity_gbps == 2.0 and f.changed and out.fabric.scale == f.fitted_scale
    assert f.to_json()["changed"] is True


def test_time_dilation_flag_takes_auto_or_a_number():
    assert time_dilation_arg("auto") == "auto" and time_dilation_arg("0.5") == 0.5
    with pytest.raises(argparse.ArgumentTypeError):
        time_dilation_arg("fast")
    with pytest.raises(SpecError) as e:
        dataclasses.replace(load_scenario("scenarios/default.yaml").fabric, fit="sometimes")
    assert e.value.field == "fit"


def _verdict(distorted: bool, tdf_needed: float = 0.25) -> dict:
    return {"distorted": distorted, "tdf_needed": tdf_needed,
            "verdict": "distorted: a phase's transfers ran at 40% ..." if distorted else "faithful: ..."}


def test_the_next_run_of_a_scenario_says_before_it_starts_what_the_last_one_found(monkeypatch, tmp_path):
    monkeypatch.setenv("ORCHESTRRL_CAPACITY_FILE", str(tmp_path / "cap.json"))
    monkeypatch.setenv("ORCHESTRRL_CACHE_DIR", str(tmp_path / "cache"))
    from emulation import capacity

    capacity.save_capacity(6.0, 0.95, "test")
    scn = load_scenario("scenarios/default-small.yaml")
    auto = dataclasses.replace(scn, fabric=dataclasses.replace(scn.fabric, fit="auto"))
    _, first = fit.fit_scenario(auto)
    assert first.last_run is None and first.expectation is None and first.outcome_key  # nothing on record yet
    # a comparison of three runs, two flagged (one naming TDF 0.6, one 0.5)
    rec = fit.remember_outcome(first, {"a": _verdict(False), "b": _verdict(True, 0.6), "c": _verdict(True, 0.5),
                                       "simulated": {}})
    assert rec["runs"] == 3 and rec["flagged"] == 2 and rec["tdf_needed"] == 0.6
    _, again = fit.fit_scenario(auto)
    assert again.last_run == rec and "NOT faithful" in again.line() and "2 of 3 runs flagged" in again.line()
    assert f"time dilation >= 0.6 would remove it (~{0.6 / again.fitted_time_dilation:.1f}x" in again.expectation
    assert again.to_json()["last_run"] == rec
    # the same scenario at other numbers (or on another capacity measurement): the record says nothing of it
    other = dataclasses.replace(auto, fabric=dataclasses.replace(auto.fabric, time_dilation=2.0))
    _, f2 = fit.fit_scenario(other)
    assert f2.outcome_key != again.outcome_key and f2.expectation is None
    capacity.save_capacity(3.0, 0.95, "test")
    _, f3 = fit.fit_scenario(auto)
    assert f3.last_run == rec and f3.expectation is None
    # a faithful run is remembered as one
    fit.remember_outcome(f3, {"a": _verdict(False)})
    _, f4 = fit.fit_scenario(auto)
    assert "was faithful in 1 of 1 runs" in f4.expectation
    # a run the monitor did not judge (no fidelity) changes nothing; an unreadable record is ignored
    assert fit.remember_outcome(f4, {"a": None}) is None
    fit.outcome_path(f4.outcome_key).write_text("{not json")
    assert fit.last_outcome(f4.outcome_key) is None
