import math

import numpy as np
import pytest

from emulation.validation import SpecError, from_dict, to_dict
from emulation.workload import WorkloadSpec, gpu_names, model_names


def test_defaults_are_valid_and_round_trip():
    w = WorkloadSpec()
    assert w.samples_per_step == w.prompts_per_step * w.samples_per_prompt
    assert from_dict(WorkloadSpec, to_dict(w)) == w


@pytest.mark.parametrize("data, field", [
    ({"model": "GPT-5"}, "model"),
    ({"gpu": "TPU-v5"}, "gpu"),
    ({"prompts_per_step": 0}, "prompts_per_step"),
    ({"response_sigma": -0.1}, "response_sigma"),
    ({"cap_fraction": 1.5}, "cap_fraction"),
    ({"gen_fraction": 1.0}, "gen_fraction"),
    ({"rollout_tp": 3}, "rollout_tp"),
    ({"train_dp": -1}, "train_dp"),
    ({"response_median_tokens": 5000, "max_response_tokens": 4096}, "response_median_tokens"),
    ({"samples_per_prompt": "8"}, "samples_per_prompt"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_values_name_the_field(data, field):
    with pytest.raises(SpecError) as e:
        from_dict(WorkloadSpec, data, "workload")
    assert e.value.field == f"workload.{field}"


def test_sample_lengths_reproducible_and_in_range():
    w = WorkloadSpec(max_response_tokens=4096)
    a = w.sample_lengths(np.random.default_rng(3), 5000)
    b = w.sample_lengths(np.random.default_rng(3), 5000)
    c = w.sample_lengths(np.random.default_rng(4), 5000)
    assert a.dtype == np.int64 and len(a) == 5000
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() >= 1 and a.max() <= 4096


def test_sample_lengths_follow_median_and_sigma():
    w = WorkloadSpec(response_median_tokens=460, response_sigma=0.93)
    x = w.sample_lengths(np.random.default_rng(0), 200_000)
    assert abs(np.median(x) / 460 - 1) < 0.02
    assert abs(np.std(np.log(x)) - 0.93) < 0.02
    # Heavy right tail like the PolyTrace figures (p99 well above 5x the median).
    assert np.percentile(x, 99) > 5 * np.median(x)


def test_cap_spike():
    w = WorkloadSpec(max_response_tokens=16384, cap_fraction=0.2)
    x = w.sample_lengths(np.random.default_rng(1), 50_000)
    frac = np.mean(x == 16384)
    assert 0.19 < frac < 0.21
    none = WorkloadSpec(max_response_tokens=16384).sample_lengths(np.random.default_rng(1), 50_000)
    assert np.mean(none == 16384) < 0.001


def test_sample_lengths_rejects_bad_arguments():
    w = WorkloadSpec()
    with pytest.raises(TypeError):
        w.sample_lengths(np.random.RandomState(0), 3)
    with pytest.raises(ValueError):
        w.sample_lengths(np.random.default_rng(0), -1)
    assert len(w.sample_lengths(np.random.default_rng(0))) == w.samples_per_step


def test_every_catalogue_entry_is_a_workload_the_cost_model_builds():
    # one catalogue: a name the workload accepts is one the cost model has figures for, and no other is accepted
    from agents.costmodel import CostModel

    for m in model_names():
        for g in gpu_names():
            w = WorkloadSpec(model=m, gpu=g)
            assert CostModel.for_names(w.model, w.gpu).model.name == m
    with pytest.raises(SpecError, match="Qwen2.5-7B"):
        WorkloadSpec(model="Qwen2.5-8B")
