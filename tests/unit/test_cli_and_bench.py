"""CLI input checks (exit 2, nothing started) and the benchmark's pure blackout attribution."""
from __future__ import annotations

import pytest

from testbed import cli
from testbed.benchmarks import M0, M1, RECONFIG_SPEC, blackout_in_window
from controller.ocs import Matching, diff


def run(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    return rc, capsys.readouterr()


@pytest.mark.parametrize("argv, needle", [
    (["bench", "reconfig", "--delay-ms", "-1"], "--delay-ms must be >= 0"),
    (["bench", "reconfig", "--samples", "0"], "--samples must be >= 1"),
    (["bench", "reconfig", "--pps", "0"], "--pps must be > 0"),
    (["bench", "fabric", "--rate-mbps", "0"], "--rate-mbps must be > 0"),
    (["demo", "no/such/scenario.yaml"], "no/such/scenario.yaml"),
    (["fabric", "up", "no/such/scenario.yaml"], "no/such/scenario.yaml"),
    (["bench", "nope"], "invalid choice"),
    (["bench", "reconfig", "--delay-ms", "nan"], "--delay-ms must be a finite number"),
    (["bench", "reconfig", "--pps", "inf"], "--pps must be a finite number"),
    (["bench", "fabric", "--seconds", "nan"], "--seconds must be a finite number"),
])
def test_bad_input_exits_2_naming_the_problem(argv, needle, capsys):
    rc, out = run(argv, capsys)
    assert rc == 2
    assert needle in out.err


def test_demo_rejects_a_bad_scenario_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("fabric:\n  pods: 0\n")
    rc, out = run(["demo", str(bad)], capsys)
    assert rc == 2 and "fabric.pods" in out.err


def test_reconfig_bench_swaps_only_the_tor0_tor1_circuits():
    n = RECONFIG_SPEC.ports_per_ocs
    d = diff(Matching.from_pairs(n, M0), Matching.from_pairs(n, M1))
    owners = {RECONFIG_SPEC.ocs_port_owner(0, p).tor for p in d.changed_ports}
    assert owners == {0, 1}  # the probe h0 -> h1 crosses only changing circuits, h2 -> h3 none
    assert {tuple(p) for p in d.unchanged} == {(5, 7), (6, 8)}


def test_blackout_attribution_uses_the_window_and_subtracts_one_interval():
    records = [[i, 10.0 + i * 0.001] for i in range(100)]  # 1 kHz stream
    gaps = [{"first_lost": 20, "last_lost": 29, "lost": 10, "duration_s": 0.011, "truncated": False},
            {"first_lost": 70, "last_lost": 71, "lost": 2, "duration_s": 0.003, "truncated": False},
            {"first_lost": 95, "last_lost": 99, "lost": 5, "duration_s": 0.005, "truncated": True}]
    # window around the first gap only
    assert blackout_in_window(gaps, records, 10.015, 10.030, 0.001) == pytest.approx(10.0)
    # a window with no gap: no blackout
    assert blackout_in_window(gaps, records, 10.040, 10.060, 0.001) == 0.0
    # truncated runs (stream edge) are never counted
    assert blackout_in_window(gaps, records, 10.090, 10.1, 0.001) == 0.0
