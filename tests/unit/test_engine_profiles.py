"""The serving engine's terms of the cost model (agents/engineprofile.py, emulation/data/engines.yaml): each term
against the figure it was fitted to, CUDA-graph caps and eager launches, chunked prefill as one forward pass, a
preempted request's recompute, max_num_seqs in the KV sizing; and every validation case's model figure pinned
(testbed/runs/validation.py; a change that moves one is seen here and explained in its commit)."""
from __future__ import annotations

import math

import pytest

from agents.costmodel import CostModel
from agents.engine import Engine, Layout, ModelledCost, NewRequest
from agents.engineprofile import EngineBinding, get_profile, profile_names
from emulation.orchestration import EngineSettings
from emulation.validation import SpecError


def cm_for(profile: str, model="Qwen2.5-14B", gpu="H800", **kw) -> CostModel:
    return CostModel.for_engine(model, gpu, EngineSettings(profile=profile, **kw))


def test_the_profiles_and_the_scenario_key():
    assert {"vllm-v1", "vllm-v1-async", "vllm-v0", "sglang", "kernels"} <= set(profile_names())
    assert EngineSettings().profile == "vllm-v1"
    with pytest.raises(SpecError) as e:
        EngineSettings(profile="tgi")
    assert e.value.field == "profile" and "vllm-v1" in str(e.value)


def test_v0_cpu_time_is_vidurs_fit_and_grows_with_the_running_batch():
    """vLLM V0: 0.97 ms + 48.7 us per running request (Vidur's A100 CPU profiles, TP 1), in series with the
    GPU; TP > 1 adds the per-step worker call fitted on vLLM issue #16300."""
    b = EngineBinding.of(EngineSettings(profile="vllm-v0"))
    assert b.cpu_s(64, tp=1) == pytest.approx(0.97e-3 + 48.7e-6 * 64)
    assert b.cpu_s(64, tp=2) - b.cpu_s(64, tp=1) == pytest.approx(get_profile("vllm-v0").cpu_tp_ms * 1e-3)
    cm = cm_for("vllm-v0")
    k = CostModel.for_names("Qwen2.5-14B", "H800")
    for batch, tp in ((8, 1), (128, 2), (512, 8)):
        ctx = batch * 1000.0
        kern = k.decode_step_s(batch, ctx, tp)
        assert cm.decode_step_s(batch, ctx, tp) == pytest.approx(kern + b.cpu_s(batch, tp))  # graphed, serial
    # one TP8 engine runs 8x the batch of each TP1 engine at the same load, on one CPU process
    assert b.cpu_s(1024, 8) > 6 * b.cpu_s(128, 1)


def test_an_overlapping_engine_hides_its_cpu_time_behind_the_gpu():
    sg, k = cm_for("sglang"), CostModel.for_names("Qwen2.5-14B", "H800")
    assert sg.decode_step_s(64, 64e3, 2) == pytest.approx(k.decode_step_s(64, 64e3, 2))  # GPU longer: hidden
    v1 = cm_for("vllm-v1")
    assert v1.decode_step_s(64, 64e3, 2) > k.decode_step_s(64, 64e3, 2)  # V1 before 0.14: in series
    a = cm_for("vllm-v1-async")
    assert a.decode_step_s(64, 64e3, 2) == pytest.approx(k.decode_step_s(64, 64e3, 2))


def test_cuda_graph_caps_follow_each_engine():
    cap = lambda prof, tp=1, **kw: EngineBinding.of(EngineSettings(profile=prof, **kw)).graph_cap(tp)  # noqa: E731
    assert cap("vllm-v1", max_num_seqs=1024) == 512  # min(2 x max_num_seqs, 512)
    assert cap("vllm-v1", max_num_seqs=64, max_num_batched_tokens=8192) == 128
    assert cap("vllm-v0", max_num_seqs=256) == 256  # up to max_num_seqs
    assert cap("sglang", tp=2) == 256 and cap("sglang", tp=4) == 512
    assert math.isinf(cap("kernels"))


def test_a_step_above_the_graph_cap_pays_its_launches():
    """Above the cap every kernel is launched from the CPU: the step lasts at least the layers' launches (a small
    model at TP 8, whose kernels are shorter than their launches)."""
    cm = cm_for("vllm-v1", model="Llama-3.2-3B", gpu="H100", max_num_seqs=1024)
    launch = cm.model.layers * get_profile("vllm-v1").eager_layer_us * 1e-6
    cpu = lambda b: cm.engine.cpu_s(b, 8)  # noqa: E731
    below = cm.decode_step_s(512, 512 * 300.0, 8)  # graphed
    above = cm.decode_step_s(520, 520 * 300.0, 8)  # eager
    kern = CostModel.for_names("Llama-3.2-3B", "H100").decode_step_s(520, 520 * 300.0, 8)
    assert kern < launch
    assert above == pytest.approx(launch + cpu(520))
    assert below < launch + cpu(512)  # graphed: its kernels and the CPU time, no launch floor
    assert cm.decode_breakdown(520, 520 * 300.0, 8)["eager_launch"] == pytest.approx(launch - kern)


def test_max_num_seqs_reaches_the_kv_capacity_as_vllms_profiling_does():
    """vLLM sizes its KV cache after a profiling pass that computes max_num_seqs sequences' logits (fp32): a
    larger max_num_seqs leaves less for the cache; the kernels profile keeps the old 256 whatever it is."""
    lo, hi = cm_for("vllm-v1", max_num_seqs=256), cm_for("vllm-v1", max_num_seqs=1024)
    m = lo.model
    for tp in (1, 2, 8):
        diff = lo.kv_capacity_tokens(tp) - hi.kv_capacity_tokens(tp)
        assert diff == pytest.approx((1024 - 256) * m.vocab / tp * 4 / lo.kv_bytes_per_token_per_gpu(tp))
    k1, k2 = cm_for("kernels", max_num_seqs=256), cm_for("kernels", max_num_seqs=1024)
    assert k1.kv_capacity_tokens(2) == k2.kv_capacity_tokens(2)


def test_a_prefill_chunk_runs_in_the_same_forward_pass_as_the_decodes():
    """Chunked prefill: one pass over the decodes' and the chunk's tokens (the weights read once, the chunk's
    activations all-reduced with the decodes'); a later chunk attends to the prompt's earlier ones."""
    cm = CostModel.for_names("Qwen2.5-14B", "H800")
    dec = cm.decode_step_s(64, 64 * 2000.0, 2)
    pf = cm.step_s(0, 0.0, 2048, 1, tp=2)
    mixed = cm.step_s(64, 64 * 2000.0, 2048, 1, tp=2)
    assert max(dec, pf) < mixed < dec + pf  # shared weights, one pass
    first = cm.step_s(0, 0.0, 4096, 1, tp=2, prefill_pairs=4096 * 2048.0)
    later = cm.step_s(0, 0.0, 4096, 1, tp=2, prefill_pairs=4096 * (12288 + 2048.0))  # after 12,288 tokens
    assert later > first
    assert cm.prefill_s(4, 512, 2) == pytest.approx(cm.step_s(0, 0.0, 2048, 4, tp=2))


class _Recording(ModelledCost):
    def __init__(self, cm):
        super().__init__(cm, 8)
        self.calls = []

    def step_s(self, layout, n_decode, decode_ctx, prefill_tokens, prefill_seqs, prefill_pairs=None):
        self.calls.append((prefill_tokens, prefill_seqs, prefill_pairs))
        return super().step_s(layout, n_decode, decode_ctx, prefill_tokens, prefill_seqs, prefill_pairs)


def test_a_preempted_request_pays_its_recompute():
    """Preemption by recompute (vLLM V1's only mode): the victim's blocks are freed and, re-admitted, it prefills
    its prompt and everything it had generated again, costed as prefill chunks whose attention covers it all."""
    cm = CostModel.for_engine("Qwen2.5-14B", "H800", EngineSettings(max_num_seqs=64))
    cost = _Recording(cm)
    st = EngineSettings(max_num_seqs=64, max_num_batched_tokens=8192, block_size=16)
    e = Engine(cost, 8, Layout(8), st)
    blocks = e.kv_blocks_per_replica
    # requests whose growth overflows the cache: preemptions must happen
    n = 48
    target = blocks * 16 // n * 2
    e.add([NewRequest(rid=i, prompt=64, target=target) for i in range(n)], 0.0)
    e.run_until(math.inf)
    pre = e.stats(e.last_end)["num_preemptions_total"]
    assert pre > 0
    prefilled = sum(t for t, _, _ in cost.calls)
    assert prefilled > n * 64  # more than the prompts: what the preempted had generated, computed again
    alone = [(t, p) for t, seqs, p in cost.calls if seqs == 1 and t > 64]  # one sequence's recompute chunk
    assert alone, "no recompute was costed"
    assert all(p >= t * t / 2.0 - 1e-6 for t, p in alone)  # it attends to all it recomputes, causally
    assert e.finished_total == n


# ---- the validation cases' model figures, pinned ----------------------------------------------------------
PINNED = {  # case id -> the model's figure (testbed/runs/validation.py), to 0.1%
    "vllm16300-b1-tp2": 27.81, "vllm16300-b1-tp4": 20.34, "vllm16300-b1-tp8": 14.63,
    "vllm16300-b16-tp2": 28.99, "vllm16300-b16-tp4": 21.41, "vllm16300-b16-tp8": 15.67,
    "vllm16300-b128-tp2": 52.23, "vllm060-cpu-share": 0.4944, "vllm-v1-gpu-step": 6.473,
    "sglang1401-eager-flashinfer": 0.8645, "sglang1401-eager-triton": 0.8645, "sglang04-overlap": 1.052,
}


def test_every_fast_validation_case_is_pinned():
    from testbed.runs.validation import load_cases, model_figure

    cases = {c.id: c for c in load_cases().cases}
    assert set(PINNED) == {i for i, c in cases.items() if c.kind != "rollout_s"}
    for cid, want in PINNED.items():
        assert model_figure(cases[cid]) == pytest.approx(want, rel=1e-3), cid
