"""Response lengths over steps: drift, jitter, mixtures, trace replay and their validation errors."""
from __future__ import annotations

import csv
import dataclasses
import json
import os

import numpy as np
import pytest
import yaml

from emulation.scenario import load_scenario
from emulation.validation import SpecError, from_dict, to_dict
from emulation.workload import (LOG_QUANTILE_LEVELS, LengthComponent, LengthSchedule, StepStats, WorkloadSpec,
                                step_stats)
from testbed import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCEN = os.path.join(ROOT, "scenarios")
TRACE = os.path.join(SCEN, "traces", "synthetic-drift.csv")


def rng(seed=0):
    return np.random.default_rng(seed)


# ---- sampled workloads --------------------------------------------------------------------------------
def test_step_zero_without_drift_is_todays_draw():
    w = WorkloadSpec(max_response_tokens=4096, cap_fraction=0.05)
    assert np.array_equal(LengthSchedule(w).lengths_for_step(0, rng(3)), w.sample_lengths(rng(3)))


def test_samples_are_grouped_by_prompt_and_ids_are_unique_over_the_run():
    w = WorkloadSpec(prompts_per_step=4, samples_per_prompt=3, steps=3, warmup_steps=2)
    s = LengthSchedule(w)
    ids = [s.prompt_ids_for_step(k) for k in range(-2, 3)]
    for a in ids:
        assert a.dtype == np.int64 and len(a) == 12
        assert (a.reshape(4, 3) == a.reshape(4, 3)[:, :1]).all()  # each prompt's samples contiguous
        assert len(np.unique(a)) == 4
    assert len(np.unique(np.concatenate(ids))) == 4 * 5
    x = s.lengths_for_step(1, rng())
    assert x.dtype == np.int64 and len(x) == 12


def test_same_seed_same_run_and_history_first():
    w = WorkloadSpec(prompts_per_step=8, samples_per_prompt=4, steps=4, warmup_steps=3,
                     median_growth_per_step=0.1, step_sigma=0.1)

    def run(seed):
        g = rng(seed)
        s = LengthSchedule(w)
        hist = s.history(g)
        return [h.mean for h in hist], [s.lengths_for_step(k, g) for k in range(w.steps)]

    (h1, r1), (h2, r2), (_, r3) = run(5), run(5), run(6)
    assert h1 == h2 and len(h1) == 3
    assert all(np.array_equal(a, b) for a, b in zip(r1, r2))
    assert not all(np.array_equal(a, b) for a, b in zip(r1, r3))


def test_drift_grows_the_median_linearly_up_to_its_ceiling():
    w = WorkloadSpec(prompts_per_step=1000, samples_per_prompt=40, response_median_tokens=400,
                     max_response_tokens=65536, median_growth_per_step=0.25, median_growth_max=2.0, steps=8)
    s = LengthSchedule(w)
    g = rng(1)
    med = [np.median(s.lengths_for_step(k, g)) for k in range(8)]
    want = [400 * min(1 + 0.25 * k, 2.0) for k in range(8)]
    assert np.allclose(med, want, rtol=0.03)
    # The documented figures: R1-Zero's 17x over 8.4k steps and DAPO's 5.9x over ~4k steps.
    assert WorkloadSpec(median_growth_per_step=0.00194).median_factor(8400) == pytest.approx(17.3, rel=0.01)
    assert WorkloadSpec(median_growth_per_step=0.00123).median_factor(4000) == pytest.approx(5.9, rel=0.01)
    assert WorkloadSpec(median_growth_per_step=0.00123, median_growth_max=5.9).median_factor(10_000) == 5.9


def test_warmup_steps_are_the_schedules_origin():
    w = WorkloadSpec(prompts_per_step=500, samples_per_prompt=40, response_median_tokens=400,
                     max_response_tokens=65536, median_growth_per_step=0.5, warmup_steps=2, steps=1)
    s = LengthSchedule(w)
    g = rng(2)
    assert np.median(s.lengths_for_step(-2, g)) == pytest.approx(400, rel=0.03)
    assert np.median(s.lengths_for_step(0, g)) == pytest.approx(800, rel=0.03)  # schedule step 2: 1 + 0.5*2
    with pytest.raises(ValueError, match="step must be in"):
        s.lengths_for_step(-3, g)


def test_step_sigma_jitters_each_steps_median():
    w = WorkloadSpec(prompts_per_step=250, samples_per_prompt=16, response_median_tokens=400,
                     max_response_tokens=65536, step_sigma=0.2, steps=60)
    s = LengthSchedule(w)
    g = rng(4)
    logmed = np.log([np.median(s.lengths_for_step(k, g)) for k in range(60)])
    # sampling alone gives ~0.93*1.25/sqrt(4000) = 0.018; the jitter dominates
    assert 0.15 < np.std(logmed) < 0.26


def test_mixture_draws_each_component_in_its_share():
    comps = (LengthComponent(weight=3, median_tokens=200, sigma=0.1),
             LengthComponent(weight=1, median_tokens=8000, sigma=0.1))
    w = WorkloadSpec(mixture=comps, max_response_tokens=16384)
    x = w.sample_lengths(rng(0), 40_000)
    long = x > 1500
    assert np.mean(long) == pytest.approx(0.25, abs=0.01)
    assert np.median(x[~long]) == pytest.approx(200, rel=0.02)
    assert np.median(x[long]) == pytest.approx(8000, rel=0.02)
    assert from_dict(WorkloadSpec, to_dict(w)) == w  # YAML round trip


def test_sample_lengths_refuses_a_trace_workload():
    w = WorkloadSpec(prompts_per_step=16, trace=TRACE, steps=8, warmup_steps=4)
    with pytest.raises(ValueError, match="LengthSchedule"):
        w.sample_lengths(rng())


@pytest.mark.parametrize("data, field", [
    ({"median_growth_per_step": -0.1}, "workload.median_growth_per_step"),
    ({"median_growth_max": 0.5}, "workload.median_growth_max"),
    ({"median_growth_max": "2"}, "workload.median_growth_max"),
    ({"step_sigma": 3.0}, "workload.step_sigma"),
    ({"warmup_steps": -1}, "workload.warmup_steps"),
    ({"mixture": [{"weight": 1}, {"weight": 0}]}, "workload.mixture[1].weight"),
    ({"mixture": [{"median_tokens": 0.5}]}, "workload.mixture[0].median_tokens"),
    ({"mixture": [{"sigma": 9}]}, "workload.mixture[0].sigma"),
    ({"mixture": [{"median": 400}]}, "workload.mixture[0].median"),
    ({"mixture": [{"median_tokens": 9000}], "max_response_tokens": 8192}, "workload.mixture[0].median_tokens"),
    ({"mixture": {"weight": 1}}, "workload.mixture"),
    ({"trace": 5}, "workload.trace"),
    ({"trace": " "}, "workload.trace"),
    ({"trace": "t.csv", "median_growth_per_step": 0.1}, "workload.median_growth_per_step"),
    ({"trace": "t.csv", "mixture": [{"weight": 1}]}, "workload.mixture"),
])
def test_bad_workload_values_name_the_field(data, field):
    with pytest.raises(SpecError) as e:
        from_dict(WorkloadSpec, data, "workload")
    assert e.value.field == field


def test_step_stats():
    st = step_stats(np.array([1, 10, 100, 1000], dtype=np.int64), 3, cap=1000)
    assert isinstance(st, StepStats)
    assert (st.step, st.n, st.max, st.cap) == (3, 4, 1000, 1000)
    assert st.mean == pytest.approx(277.75)
    assert st.log_mean == pytest.approx(np.log(10) * 1.5)
    assert st.log_std == pytest.approx(np.std(np.log([1, 10, 100, 1000])))
    assert st.cap_fraction == 0.25
    assert len(st.log_quantiles) == len(LOG_QUANTILE_LEVELS)
    assert st.log_quantiles[0] == pytest.approx(np.percentile(np.log([1, 10, 100, 1000]), 0.5))
    with pytest.raises(SpecError, match="log_quantiles"):
        dataclasses.replace(st, log_quantiles=(1.0, 2.0))
    with pytest.raises(SpecError, match="non-decreasing"):
        dataclasses.replace(st, log_quantiles=tuple(reversed(st.log_quantiles)))
    assert from_dict(StepStats, to_dict(st)) == st
    with pytest.raises(ValueError):
        step_stats(np.array([0, 5]), 0, cap=10)
    with pytest.raises(ValueError):
        step_stats(np.array([], dtype=np.int64), 0, cap=10)


# ---- trace replay ----------------------------------------------------------------------------------------
def read_trace_rows(path):
    with open(path, encoding="utf-8") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return [(int(r["step"]), int(r["prompt_id"]), int(r["response_length"])) for r in rows]


def test_the_example_trace_replays_step_by_step():
    scn = load_scenario(os.path.join(SCEN, "synthetic-trace.yaml"))
    w = scn.workload
    assert os.path.isabs(w.trace) and os.path.samefile(w.trace, TRACE)
    s = LengthSchedule(w)
    rows = read_trace_rows(TRACE)
    g = scn.rng()
    before = g.bit_generator.state
    for k in range(-w.warmup_steps, w.steps):
        number = s.trace_step_number(k)
        assert number == w.warmup_steps + k  # the example's steps are numbered 0..11
        want = [(p, n) for st, p, n in rows if st == number]
        assert list(zip(s.prompt_ids_for_step(k).tolist(), s.lengths_for_step(k, g).tolist())) == want
    assert g.bit_generator.state == before  # a replay draws nothing
    hist = s.history(g)
    assert [h.step for h in hist] == [-4, -3, -2, -1]
    assert hist[0].n == w.samples_per_step
    with pytest.raises(ValueError):
        s.lengths_for_step(w.steps, g)
    # the example is labelled synthetic
    with open(TRACE, encoding="utf-8") as f:
        assert "SYNTHETIC" in f.readline()


def write_trace(tmp_path, rows, kind="csv", name="t", header="step,prompt_id,response_length", extra=""):
    p = tmp_path / f"{name}.{kind}"
    if kind == "csv":
        p.write_text(extra + header + "\n" + "".join(",".join(str(v) for v in r) + "\n" for r in rows))
    else:
        p.write_text(extra + "".join(json.dumps(dict(zip(("step", "prompt_id", "response_length"), r))) + "\n"
                                     for r in rows))
    return p


def small_rows(steps=2, prompts=2, samples=2):
    return [(k, 10 * k + i, 100 + 10 * k + 2 * i + j) for k in range(steps) for i in range(prompts)
            for j in range(samples)]


def scenario_with_trace(tmp_path, trace_name, **workload):
    data = {"workload": {"prompts_per_step": 2, "samples_per_prompt": 2, "steps": 2, "trace": trace_name,
                         **workload}}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_jsonl_and_csv_replay_the_same(tmp_path):
    rows = small_rows()
    write_trace(tmp_path, rows, "csv", extra="# a comment\n\n")
    write_trace(tmp_path, rows, "jsonl")
    got = []
    for name in ("t.csv", "t.jsonl"):
        s = LengthSchedule(load_scenario(scenario_with_trace(tmp_path, name)).workload)
        got.append([s.lengths_for_step(k, rng()).tolist() for k in range(2)])
    assert got[0] == got[1] == [[100, 101, 102, 103], [110, 111, 112, 113]]


def test_columns_in_any_order_extra_columns_prompts_and_samples_ignored(tmp_path):
    rows = [(r[2], "x", r[0], r[1]) for r in small_rows(steps=3, prompts=3, samples=3)]
    write_trace(tmp_path, rows, header="response_length,reward,step,prompt_id")
    s = LengthSchedule(load_scenario(scenario_with_trace(tmp_path, "t.csv")).workload)
    assert s.lengths_for_step(1, rng()).tolist() == [110, 111, 112, 113]
    assert s.prompt_ids_for_step(1).tolist() == [10, 10, 11, 11]


def test_steps_are_taken_in_order_with_gaps(tmp_path):
    rows = [(k * 5 + 100, p, n) for k, p, n in small_rows(steps=3)]
    write_trace(tmp_path, list(reversed(rows)))
    s = LengthSchedule(load_scenario(scenario_with_trace(tmp_path, "t.csv", warmup_steps=1)).workload)
    assert [s.trace_step_number(k) for k in (-1, 0, 1)] == [100, 105, 110]
    # samples keep file order within a prompt (the reversed file reverses them)
    assert s.lengths_for_step(0, rng()).tolist() == [113, 112, 111, 110]


HEADER = "step,prompt_id,response_length\n"
ROW = '{"step": 0, "prompt_id": 0, "response_length": %s}\n'


@pytest.mark.parametrize("kind, body, text", [
    ("csv", HEADER + "0,0,100\n0,0,abc\n", "line 3: response_length must be an integer >= 1, got 'abc'"),
    ("csv", "# c\nstep,prompt_id,response_length\n0,0,0\n", "line 3: response_length must be an integer >= 1, got '0'"),
    ("csv", "step,prompt_id,response_length\n0,0,1.5\n", "line 2: response_length must be an integer >= 1, got '1.5'"),
    ("csv", "step,prompt_id,response_length\n-1,0,5\n", "line 2: step must be an integer >= 0, got '-1'"),
    ("csv", "step,prompt_id,response_length\n0,p7,5\n", "line 2: prompt_id must be an integer >= 0, got 'p7'"),
    ("csv", "step,prompt_id,response_length\n0,0\n", "line 2: expected 3 comma-separated fields, got 2"),
    ("csv", "step,prompt,response_length\n0,0,5\n", "line 1: the header must name each of the columns"),
    ("csv", "step,step,prompt_id,response_length\n0,0,0,5\n", "line 1: the header must name each"),
    ("csv", "# nothing\nstep,prompt_id,response_length\n", "has no data rows"),
    ("jsonl", ROW % 5 + '{"step": 0,\n', "line 2: not valid JSON"),
    ("jsonl", "[0, 0, 5]\n", "line 1: must be a JSON object, got list"),
    ("jsonl", '{"step": 0, "prompt_id": 0}\n', "line 1: missing key 'response_length'"),
    ("jsonl", ROW % "5.0", "line 1: response_length must be an integer >= 1, got 5.0"),
    ("jsonl", ROW % '"5"', "line 1: response_length must be an integer >= 1, got '5'"),
    ("jsonl", ROW.replace('"step": 0', '"step": true') % 5, "line 1: step must be an integer >= 0, got True"),
    ("txt", "step,prompt_id,response_length\n", "must be a .csv or .jsonl file"),
])
def test_bad_trace_lines_name_the_field_and_line(tmp_path, kind, body, text):
    (tmp_path / f"t.{kind}").write_text(body)
    with pytest.raises(SpecError) as e:
        load_scenario(scenario_with_trace(tmp_path, f"t.{kind}"))
    assert e.value.field == "workload.trace"
    assert text in e.value.message


@pytest.mark.parametrize("rows, workload, text", [
    (small_rows(steps=1), {}, "has 1 steps; the run needs warmup_steps + steps = 0 + 2 = 2"),
    (small_rows(steps=2), {"warmup_steps": 1}, "has 2 steps; the run needs warmup_steps + steps = 1 + 2 = 3"),
    (small_rows(prompts=1), {}, "step 0 has 1 prompts; the workload needs prompts_per_step = 2"),
    (small_rows(samples=1), {}, "step 0 prompt 0 has 1 responses; the workload needs samples_per_prompt = 2"),
    (small_rows(), {"max_response_tokens": 110}, "line 7: response_length 111 exceeds max_response_tokens (110)"),
])
def test_a_trace_too_small_for_the_workload_is_an_error(tmp_path, rows, workload, text):
    write_trace(tmp_path, rows)
    with pytest.raises(SpecError) as e:
        load_scenario(scenario_with_trace(tmp_path, "t.csv", **workload))
    assert e.value.field == "workload.trace"
    assert text in e.value.message


def test_missing_trace_file(tmp_path):
    with pytest.raises(SpecError) as e:
        load_scenario(scenario_with_trace(tmp_path, "traces/none.csv"))
    assert e.value.field == "workload.trace"
    assert "no such file" in e.value.message and os.path.join(str(tmp_path), "traces", "none.csv") in e.value.message
    (tmp_path / "d.csv").mkdir()
    with pytest.raises(SpecError, match="not a file"):
        load_scenario(scenario_with_trace(tmp_path, "d.csv"))


def test_an_edited_trace_is_read_again(tmp_path):
    p = write_trace(tmp_path, small_rows())
    scn = scenario_with_trace(tmp_path, "t.csv")
    assert LengthSchedule(load_scenario(scn).workload).lengths_for_step(0, rng()).tolist()[0] == 100
    rows = small_rows()
    rows[0] = (0, 0, 7)
    write_trace(tmp_path, rows + [(5, 5, 5)])  # another size, so the cache key changes even on a coarse clock
    assert p.exists()
    assert LengthSchedule(load_scenario(scn).workload).lengths_for_step(0, rng()).tolist()[0] == 7


def test_cli_exits_2_naming_the_trace_line(tmp_path, capsys):
    (tmp_path / "t.csv").write_text("step,prompt_id,response_length\n0,0,5\n0,0,abc\n")
    rc = cli.main(["sim", str(scenario_with_trace(tmp_path, "t.csv"))])
    err = capsys.readouterr().err
    assert rc == 2
    assert "workload.trace: line 3: response_length must be an integer >= 1, got 'abc'" in err


def test_rlsim_replays_the_traces_first_run_step():
    from rlsim.sim import simulate_iteration
    scn = load_scenario(os.path.join(SCEN, "synthetic-trace.yaml"))
    r = simulate_iteration(scn, "fat-tree")
    assert r["iteration_s"] > 0
