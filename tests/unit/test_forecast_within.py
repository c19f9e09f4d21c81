"""testbed/benchmarks/bench_forecast_within.py: the forecast's remaining lengths inside a step against the truth."""
from __future__ import annotations

import json

import pytest

from testbed.benchmarks import bench_forecast_within as bench


@pytest.fixture
def plain_case(monkeypatch):
    """A lognormal step with no prompt spread and no cap spike: the forecast's prior is the law it is drawn from."""
    cases = dict(bench.CASES, plain=("default.yaml", {"prompt_sigma": 0.0, "cap_fraction": 0.0}, []))
    monkeypatch.setattr(bench, "CASES", cases)
    return "plain"


def test_where_the_law_is_the_forecasts_own_its_conditional_means_add_up_to_the_truth(plain_case):
    """Drawn from the forecast's own law, the running requests' conditional means sum to what is really left
    (each seed's step: 500-800 requests), and with no prompt spread nothing is shifted."""
    res = bench.run_case(plain_case, [1, 2, 3], [0.5, 1, 2])
    assert [p["at_median_x"] for p in res["points"]] == [0.5, 1, 2]
    for p in res["points"]:
        assert abs(p["all"]["mean"] - 1.0) < 0.1, p["all"]
        assert p["all"]["mean"] == p["all"]["mean_unshifted"]  # share 0: no request shifted
        assert bench.CANDIDATE not in p["all"]  # nor a prompt model to compare
        assert set(p) - {"at_median_x", "g", "running", "at_cap", "all"} == {"0"}


def test_the_forecasts_prompt_law_adds_up_to_what_is_left_as_the_yardstick_does():
    """The yardstick (the within-prompt law with the spike at the cap, on the workload's own parameters: how
    emulation/workload.py draws the default step) and the forecast's own PromptLaw (its parameters from the
    forecast) both add up to the truth at every point where ~150-550 requests still run; the law scaled by
    e^s before it gave 1.13 / 1.00 / 0.88 of the truth there, and 0.42-0.67 to the short prompts."""
    res = bench.run_case("default", [1, 2, 3], [1, 2, 3])
    for p in res["points"]:
        assert abs(p["all"][bench.CANDIDATE] - 1.0) < 0.1, p["all"]
        assert abs(p["all"]["mean"] - 1.0) < 0.1 and abs(p["all"]["quantiles"] - 1.0) < 0.1, p["all"]
        assert abs(p["< -0.2"]["mean"] - 1.0) < 0.2, p["< -0.2"]
        assert p["all"]["n"] == p["running"] and p["all"]["seeds"] == 3
    assert bench.candidate_mean(*_mixture_args()) is None


def _mixture_args():
    import numpy as np

    w, _ = bench.workload_of("mixture")
    lengths = np.array([10, 2000, 30, 4000])
    return w, 0.0, np.array([0, 0, 1, 1]), lengths, lengths > 100, 100.0


def test_the_cli_prints_a_table_or_json_and_rejects_bad_input(capsys, plain_case):
    assert bench.main(["--cases", plain_case, "--seeds", "1", "--at", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc["cases"]) == [plain_case] and doc["seeds"] == [1]
    assert bench.main(["--cases", plain_case, "--seeds", "1", "--at", "1", "--table"]) == 0
    assert capsys.readouterr().out.startswith("| case |")
    for argv, needle in ((["--cases", "nope"], "nope"), (["--at", "0"], "--at"), (["--seeds", "x"], "--seeds")):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err
