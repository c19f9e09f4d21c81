"""Cost model: expert-parallel decode and layout switches (weight reshard + KV relocation over NVLink)."""
import numpy as np
import pytest

from agents.costmodel import CostModel
from emulation.validation import SpecError


def test_ep_shards_the_experts_and_pays_dispatch_and_combine():
    cm = CostModel.for_names("Qwen3-30B-A3B", "H800")
    ctx = 64 * 2000
    plain, ep = cm.decode_breakdown(64, ctx, tp=1), cm.decode_breakdown(64, ctx, tp=1, ep=8)
    assert "moe_dispatch_combine" not in plain
    # with 64 sequences nearly every expert is touched: one GPU reading all of them is slower than eight
    # GPUs reading 16 each, even with two all-to-alls per layer
    assert ep["mlp_up_proj"] < plain["mlp_up_proj"] / 4
    assert cm.decode_step_s(64, ctx, tp=1, ep=8) < cm.decode_step_s(64, ctx, tp=1)
    # the all-to-alls cost at least their latency floor (the 8-GPU NCCL latency), twice per layer
    floor = 2 * cm.model.layers * cm.calib.allreduce[8].latency_us * 1e-6
    assert ep["moe_dispatch_combine"] >= floor
    assert cm.decode_breakdown(1, 100, tp=1, ep=8)["moe_dispatch_combine"] == pytest.approx(floor, rel=0.01)
    # TP8 + EP8 in one replica: attention all-reduce (+ TP all-gather) kept, the MLP all-reduce replaced
    both = cm.decode_breakdown(8, 8000, tp=8, ep=8)
    assert both["allreduce"] < cm.decode_breakdown(8, 8000, tp=8)["allreduce"]
    assert both["moe_dispatch_combine"] > 0


def test_ep_array_equals_scalar():
    cm = CostModel.for_names("Qwen3-30B-A3B", "H100")
    b, ctx = np.array([0, 1, 9, 200]), np.array([0, 50, 9000, 4e5])
    assert cm.decode_step_s_array(b, ctx, tp=2, ep=8) == pytest.approx(
        [cm.decode_step_s(int(x), float(c), tp=2, ep=8) for x, c in zip(b, ctx)])


@pytest.mark.parametrize("tp, ep", [(2, 3), (4, 2), (1, 256), (1, 0)])
def test_bad_ep_layouts(tp, ep):
    with pytest.raises(SpecError) as e:
        CostModel.for_names("Qwen3-30B-A3B", "H100").decode_step_s(1, 0, tp=tp, ep=ep)
    assert e.value.field == "ep"


def test_layout_switch_bytes_follow_the_shards():
    cm = CostModel.for_names("Qwen2.5-72B", "H100")
    m = cm.model
    W, K = cm.weight_bytes(), 1_000_000 * cm.kv_bytes_per_token()
    # TP8x1 -> TP4x2: each GPU keeps its eighth and receives the eighth that makes its quarter; the KV of the
    # requests that stay on its replica (half of them) grows from 1/8 to 1/4 of the heads
    s = cm.layout_switch(8, 4, 1_000_000)
    assert s.weight_bytes == pytest.approx(W / 8)
    assert s.kv_bytes == pytest.approx(K / 2 * (1 / 4 - 1 / 8))
    # TP4x2 -> TP8x1: the eighth is already there; the other replica's requests arrive (1/8 of their heads)
    s = cm.layout_switch(4, 8, 1_000_000)
    assert s.weight_bytes == 0.0
    assert s.kv_bytes == pytest.approx(K / 8 * (1 - 1 / 2))
    assert s.transfer_s == pytest.approx(cm.calib.p2p.latency_us * 1e-6 + s.kv_bytes / (450e9 * 0.8))
    assert s.total_s == pytest.approx(s.transfer_s + s.relayout_s + cm.calib.layout_switch_fixed_s)
    assert cm.layout_switch_s(8, 8, 1e6) == 0.0
    assert m.kv_heads == 8


def test_layout_switch_of_experts_between_tp_and_ep():
    cm = CostModel.for_names("Qwen3-30B-A3B", "H800")
    m = cm.model
    experts = m.layers * m.experts * m.expert_params * 2
    # TP8 (1/8 of every expert) -> TP8/EP8 (16 whole experts): 1/8 of each of those 16 is already local
    s = cm.layout_switch(8, 8, 0, to_ep=8)
    assert s.weight_bytes == pytest.approx(experts / 8 * (1 - 1 / 8))
    assert cm.layout_switch(8, 8, 0, from_ep=8, to_ep=8).total_s == 0.0


def test_layout_switch_times_compare_with_remp():
    # ReMP (REFERENCE.md): runtime TP switches of 7B-70B models take 1-7 s. Here: the 1 s fixed part plus the
    # bytes over NVLink, with a million tokens of KV moving along
    for gpu in ("H100", "H800"):
        for name in ("Qwen2.5-7B", "Qwen2.5-32B", "Qwen2.5-72B"):
            cm = CostModel.for_names(name, gpu)
            for a, b in ((8, 4), (4, 8), (8, 2), (2, 8)):
                assert 1.0 <= cm.layout_switch_s(a, b, 1_000_000) <= 7.0
    h100, h800 = CostModel.for_names("Qwen2.5-72B", "H100"), CostModel.for_names("Qwen2.5-72B", "H800")
    assert h800.layout_switch(8, 4, 1e6).transfer_s == pytest.approx(h100.layout_switch(8, 4, 1e6).transfer_s * 450 / 200,
                                                                       rel=0.01)


@pytest.mark.parametrize("kwargs, field", [
    ({"from_tp": 3, "to_tp": 4, "kv_tokens": 0}, "from_tp"),
    ({"from_tp": 8, "to_tp": 16, "kv_tokens": 0}, "to_tp"),
    ({"from_tp": 8, "to_tp": 4, "kv_tokens": -1}, "kv_tokens"),
    ({"from_tp": 8, "to_tp": 4, "kv_tokens": 0, "fixed_s": -1.0}, "fixed_s"),
    ({"from_tp": 8, "to_tp": 4, "kv_tokens": 0, "to_ep": 8}, "ep"),  # dense model
])
def test_layout_switch_bad_arguments(kwargs, field):
    with pytest.raises(SpecError) as e:
        CostModel.for_names("Qwen2.5-32B", "H100").layout_switch_s(**kwargs)
    assert e.value.field == field
