import pytest

from agents.costmodel import CostModel, Efficiency, get_gpu, get_model, load_models
from emulation.validation import SpecError


@pytest.mark.parametrize("name, billions", [
    ("Qwen2.5-7B", 7.6), ("Qwen2.5-14B", 14.7), ("Qwen2.5-32B", 32.8), ("Qwen2.5-72B", 72.7),
    ("Qwen3-30B-A3B", 30.5), ("Qwen3-235B-A22B", 235.1),
])
def test_parameter_counts_match_published_sizes(name, billions):
    # Published totals (model cards): 7.61B, 14.7B, 32.5B, 72.7B, 30.5B, 235B.
    assert get_model(name).params_total / 1e9 == pytest.approx(billions, rel=0.02)


@pytest.mark.parametrize("name, billions", [("Qwen3-30B-A3B", 3.3), ("Qwen3-235B-A22B", 22.0)])
def test_moe_active_parameters(name, billions):
    assert get_model(name).params_active / 1e9 == pytest.approx(billions, rel=0.06)


def test_72b_on_two_h100_decodes_like_the_measurement():
    # REFERENCE.md: Qwen2.5-72B on 2xH100, batch 1: 30.9 ms/token, ~70% of the HBM roofline.
    cm = CostModel.for_names("Qwen2.5-72B", "H100")
    t = cm.decode_step_s(batch=1, context_tokens=128, tp=2)
    assert t * 1e3 == pytest.approx(30.9, rel=0.05)
    # and the same model at 100% HBM efficiency is the pure roofline (~70% of the measured time)
    ideal = CostModel.for_names("Qwen2.5-72B", "H100", Efficiency(decode_hbm=1.0)).decode_step_s(1, 128, 2)
    assert ideal / t == pytest.approx(0.70, rel=0.03)


def test_decode_is_memory_bound_small_batch_compute_bound_large():
    cm = CostModel.for_names("Qwen2.5-7B", "H800")
    t1 = cm.decode_step_s(1, 500)
    t64 = cm.decode_step_s(64, 64 * 500)
    assert t64 < 4 * t1  # batching is nearly free while memory bound
    t4096 = cm.decode_step_s(4096, 0)
    assert t4096 > 10 * t1  # compute bound at huge batch
    # more context, more KV bytes, slower
    assert cm.decode_step_s(64, 64 * 8000) > t64


def test_tp_splits_work():
    cm = CostModel.for_names("Qwen2.5-32B", "H100")
    assert cm.decode_step_s(8, 8000, tp=4) < cm.decode_step_s(8, 8000, tp=1) / 2


def test_sizes():
    cm = CostModel.for_names("Qwen2.5-7B", "H800")
    assert cm.weight_bytes() == 2 * cm.model.params_total
    assert cm.gradient_bytes() == 2 * cm.model.params_total
    # 2 (K,V) x 28 layers x 4 heads x 128 dims x 2 bytes
    assert cm.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2
    assert cm.kv_capacity_tokens(1) > 100_000


def test_moe_decode_reads_only_touched_experts():
    cm = CostModel.for_names("Qwen3-30B-A3B", "H100")
    assert cm.decode_step_s(1, 100) < cm.decode_step_s(256, 100) < 2 * cm.decode_step_s(1024, 100)


def test_train_and_prefill_scale_linearly():
    cm = CostModel.for_names("Qwen2.5-14B", "H800")
    a = cm.train_compute_s(1e6, 8)
    assert cm.train_compute_s(2e6, 8) == pytest.approx(2 * a)
    assert cm.train_compute_s(1e6, 16) == pytest.approx(a / 2)
    # 6 N D at 35% of 989 TFLOP/s
    assert a == pytest.approx(6 * cm.model.matmul_params_active * 1e6 / (8 * 989e12 * 0.35))
    assert cm.prefill_s(8, 1024) > cm.prefill_s(8, 512)


@pytest.mark.parametrize("call", [
    lambda cm: cm.decode_step_s(-1, 0), lambda cm: cm.decode_step_s(1, 0, tp=0),
    lambda cm: cm.train_compute_s(1, 0), lambda cm: cm.prefill_s(1, float("nan")),
])
def test_bad_arguments_raise(call):
    with pytest.raises(SpecError):
        call(CostModel.for_names("Qwen2.5-7B", "H100"))


def test_unknown_names():
    with pytest.raises(SpecError, match="model"):
        get_model("nope")
    with pytest.raises(SpecError, match="gpu"):
        get_gpu("nope")
    with pytest.raises(SpecError):
        Efficiency(train_mfu=1.5)
    assert len(load_models()) == 6


@pytest.mark.parametrize("name", ["Qwen2.5-32B", "Qwen3-30B-A3B"])
def test_vectorised_decode_equals_scalar(name):
    import numpy as np
    cm = CostModel.for_names(name, "H800")
    b = np.array([0, 1, 7, 64, 300])
    ctx = np.array([0, 100, 7000, 64000, 1e6])
    vec = cm.decode_step_s_array(b, ctx, tp=4)
    assert vec == pytest.approx([cm.decode_step_s(int(x), float(c), tp=4) for x, c in zip(b, ctx)])
    with pytest.raises(SpecError):
        cm.decode_step_s_array(np.array([-1]), np.array([0]))
