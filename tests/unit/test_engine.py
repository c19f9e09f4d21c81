"""The generation engine under a fake clock: hand-built cases whose finish times are computed by hand,
KV admission and preemption by recompute, chunked prefill, hand-over (migration), layout switches, and the
equivalence of single steps (real time) and fast-forward (virtual time)."""
import numpy as np
import pytest

from agents.costmodel import CostModel
from agents.engine import Engine, Layout, ModelledCost, NewRequest, dense_layouts
from emulation.orchestration import EngineSettings
from emulation.validation import SpecError


class FakeCost:
    """Every step takes ``step`` seconds; ``kv_tokens`` per replica; a layout switch takes ``switch``."""

    def __init__(self, step=1.0, kv_tokens=10_000, switch=2.0):
        self.step, self.kv, self.switch = step, kv_tokens, switch
        self.calls = []

    def step_s(self, layout, n_decode, decode_ctx, prefill_tokens, prefill_seqs, prefill_pairs=None):
        self.calls.append((n_decode, decode_ctx, prefill_tokens, prefill_seqs))
        return self.step

    def decode_steps_s(self, layout, n_decode, ctx):
        return np.full(len(ctx), self.step)

    def kv_capacity_tokens(self, layout, util):
        return self.kv

    def switch_s(self, old, new, kv_tokens):
        return self.switch


def run_to_idle(e, t=0.0, limit=10_000):
    """Single steps in virtual time; returns {rid: finish time} and every (rid, pos) token."""
    fin, toks = {}, []
    for _ in range(limit):
        nxt = e.next_event()
        if nxt is None:
            break
        for o in e.advance(nxt):
            toks += list(zip(o.ids.tolist(), o.pos.tolist()))
            fin.update({int(r): o.t_end for r in o.finished})
    assert e.idle()
    return fin, toks


def req(rid, prompt, target, **kw):
    return NewRequest(rid=rid, prompt=prompt, target=target, **kw)


def test_continuous_batching_respects_max_num_seqs():
    # max 2 sequences: r0 (3 tokens) and r1 (5) start at 0; r2 (2) takes r0's slot when r0 ends at t=3.
    e = Engine(FakeCost(), gpus=1, layout=Layout(1), settings=EngineSettings(max_num_seqs=2))
    e.add([req(0, 4, 3), req(1, 4, 5), req(2, 4, 2)], now=0.0)
    fin, toks = run_to_idle(e)
    assert fin == {0: 3.0, 1: 5.0, 2: 5.0}
    assert sorted(toks) == sorted([(0, i) for i in range(3)] + [(1, i) for i in range(5)] + [(2, i) for i in range(2)])


def test_chunked_prefill_uses_the_token_budget():
    # a 20-token prompt with an 8-token budget: prefill chunks 8, 8, 4 (steps ending 1, 2, 3); the last chunk's
    # step samples token 0, token 1 comes at t=4
    cost = FakeCost()
    e = Engine(cost, 1, Layout(1), EngineSettings(max_num_seqs=4, max_num_batched_tokens=8))
    e.add([req(7, 20, 2)], 0.0)
    fin, _ = run_to_idle(e)
    assert fin == {7: 4.0}
    assert [c[2] for c in cost.calls] == [8, 8, 4, 0]  # prefill tokens per step
    assert [c[0] for c in cost.calls] == [0, 0, 0, 1]  # decoding sequences per step


def test_kv_exhaustion_preempts_the_newest_request_by_recompute():
    # block size 1 and 10 KV tokens: A and B (prompt 2, 6 tokens each) fit until t=3, when both need a 6th block:
    # B (admitted last) is preempted, A finishes at 6, B re-prefills its 5 tokens and finishes at 9.
    e = Engine(FakeCost(kv_tokens=10), 1, Layout(1), EngineSettings(max_num_seqs=2, block_size=1))
    e.add([req(1, 2, 6), req(2, 2, 6)], 0.0)
    fin, toks = run_to_idle(e)
    assert fin == {1: 6.0, 2: 9.0}
    assert e.stats(9.0)["num_preemptions_total"] == 1
    # every token of B exactly once, in order, across the preemption
    assert [p for r, p in toks if r == 2] == list(range(6))


def test_a_request_that_can_never_fit_is_refused():
    e = Engine(FakeCost(kv_tokens=100), 1, Layout(1), EngineSettings(max_num_seqs=2, block_size=16))
    with pytest.raises(SpecError) as ei:
        e.add([req(1, 50, 100)], 0.0)
    assert ei.value.field == "requests[0].target" and "KV blocks" in str(ei.value)
    assert e.idle()  # nothing queued


def test_single_steps_and_fast_forward_agree_on_a_real_cost_model():
    cm = CostModel.for_names("Qwen2.5-7B", "H800")
    rng = np.random.default_rng(5)
    lengths = np.clip(rng.lognormal(np.log(300), 0.9, 300), 1, 4000).astype(int)
    reqs = [req(i, 128, int(n)) for i, n in enumerate(lengths)]
    settings = EngineSettings(max_num_seqs=64)
    a = Engine(ModelledCost(cm), 8, Layout(2), settings)
    a.add(reqs, 0.0)
    fin_a, toks = run_to_idle(a, limit=10**6)
    b = Engine(ModelledCost(cm), 8, Layout(2), settings)
    b.add(reqs, 0.0)
    t = 0.0
    while not b.idle():  # planning ticks every 0.37 s, as the simulated backend does
        t += 0.37
        b.run_until(t)
    fin_b = dict(b.finished_log)
    assert fin_a.keys() == fin_b.keys() == set(range(300))
    assert max(abs(fin_a[r] - fin_b[r]) for r in fin_a) < 1e-9 * max(fin_a.values())
    assert len(toks) == int(lengths.sum())


def test_detach_and_import_carry_a_request_with_its_kv_and_its_position():
    cost = FakeCost()
    src = Engine(cost, 1, Layout(1))
    dst = Engine(cost, 1, Layout(1))
    src.add([req(5, 8, 10)], 0.0)
    toks = []
    for t in (1.0, 2.0, 3.0):
        for o in src.advance(t):
            toks += o.pos.tolist()
    assert src.detach(5, 3.0) is None  # a step is in flight: handed over when it ends
    for o in src.advance(4.0):
        toks += o.pos.tolist()
        assert o.detached == (5,)
    moved = src.detached.pop(5)
    assert moved.generated == 4 and moved.kv_tokens == 12 and not src.holds(5)
    dst.add([moved], 4.0)
    fin, more = run_to_idle(dst)
    toks += [p for _, p in more]
    assert toks == list(range(10))  # every position once, none repeated across the hand-over
    assert fin == {5: 10.0}  # with its KV it decodes at once: 6 more steps from t=4
    assert [c[2] for c in cost.calls[-6:]] == [0] * 6  # no prefill (recompute) on the destination


def test_layout_switch_pauses_then_running_requests_continue():
    cost = FakeCost(switch=2.5)
    e = Engine(cost, 8, Layout(1))
    e.add([req(i, 4, 6) for i in range(8)], 0.0)
    e.advance(1.0)
    e.advance(2.0)  # every replica has produced 2 tokens; steps to t=3 in flight
    sw = e.set_layout(Layout(4), now=2.4)
    assert sw.start == 3.0 and sw.end == 5.5  # after the steps in flight
    assert len(e.advance(3.0)) == 8  # the steps in flight complete
    assert e.next_event() == 5.5 and all(r.step is None for r in e.replicas)
    assert e.layout == Layout(4) and len(e.replicas) == 2
    fin, toks = run_to_idle(e)
    assert len(toks) == 8 * 3  # 3 tokens each after the switch, none lost
    assert set(fin.values()) == {8.5}
    assert e.switches[0]["from"] == "TP1x8" and e.switches[0]["to"] == "TP4x2"


def test_stats_use_vllm_names_and_snapshot_hides_targets():
    e = Engine(FakeCost(kv_tokens=1000), 2, Layout(1), EngineSettings(max_num_seqs=2))
    e.add([req(i, 10, 50) for i in range(5)], 0.0)
    e.advance(1.0)
    st = e.stats(1.0)
    assert st["num_requests_running"] == 4 and st["num_requests_waiting"] == 1
    assert 0 < st["kv_cache_usage_perc"] <= 1
    assert {"num_preemptions_total", "decode_tokens_per_s", "generation_tokens_total"} <= set(st)
    assert [r["num_requests_running"] for r in st["replicas"]] == [2, 2]
    snap = e.snapshot()
    assert set(snap) == {"rid", "replica", "generated", "prompt", "running"}
    assert sorted(snap["rid"].tolist()) == list(range(5))
    assert int(snap["running"].sum()) == 4


@pytest.mark.parametrize("text, msg", [("TP3x2", "power of two"), ("TP4x4", "the server has 8"),
                                       ("XX", "must look like"), ("EP4x2", None)])
def test_layout_names(text, msg):
    if msg is None:
        assert Layout.parse(text, 8) == Layout(4, 4)
        return
    with pytest.raises(SpecError) as ei:
        Layout.parse(text, 8, "servers.3.layout")
    assert ei.value.field == "servers.3.layout" and msg in str(ei.value)


def test_dense_layouts_and_settings_validation():
    assert [lay.name(8) for lay in dense_layouts(8)] == ["TP1x8", "TP2x4", "TP4x2", "TP8x1"]
    with pytest.raises(SpecError) as ei:
        EngineSettings(max_num_seqs=512, max_num_batched_tokens=256)
    assert ei.value.field == "max_num_batched_tokens"
    with pytest.raises(SpecError) as ei:
        NewRequest(rid=1, prompt=10, target=5, generated=5)
    assert ei.value.field == "generated"


def test_footprint_and_detaching_say_where_a_request_stands():
    # FakeCost's KV holds 625 blocks of 16 tokens: two requests run, the third (9,990 + 1 tokens) waits for room
    e = Engine(FakeCost(), gpus=1, layout=Layout(1))
    e.add([req(0, 4, 10), req(1, 8, 10), req(2, 9990, 10)], now=0.0)
    assert e.footprint(0) == (4, False) and e.footprint(1) == (8, False)  # in a slot, prefilling: no KV yet
    assert e.footprint(2) == (0, False) and e.footprint(99) is None  # waiting; not on this server
    e.advance(1.0)
    assert e.footprint(0) == (5, True)  # prefilled, its first token out: decoding with its KV
    assert e.detach(0, 1.5) is None and e.detaching(0) and not e.detaching(1)  # mid-step: leaves at its end
    e.advance(2.0)
    assert not e.detaching(0) and e.footprint(0) is None and e.detached[0].generated == 2
    assert e.footprint(1) == (10, True)


def test_stage_plan_stops_at_stop_bytes_or_after_max_stages_minus_one_copies():
    from agents.migration_plan import StagePlan
    from agents.protocol import Endpoint, MigrateParams

    plan = StagePlan(max_stages=4, stop_bytes=1000, bytes_per_token=10.0)
    assert plan.another_live_copy(0, 5, 0)  # the first copy is made however small
    assert plan.another_live_copy(1, 101, 500) and not plan.another_live_copy(1, 100, 500)  # 1,010 B > 1,000
    assert not plan.another_live_copy(3, 10_000, 500)  # 3 live copies: the 4th stage is the stop
    assert not StagePlan(1, 0, 1.0).another_live_copy(0, 10, 0)  # max_stages 1: stop-and-copy only
    p = MigrateParams(rid=1, dst=2, dst_rpc=Endpoint("10.0.0.1", 5000), max_stages=2, stop_bytes=7)
    assert StagePlan.of(p, 3.0) == StagePlan(2, 7, 3.0)
    d = MigrateParams(rid=1, dst=2, dst_rpc=Endpoint("10.0.0.1", 5000))
    assert StagePlan.protocol_default(3.0) == StagePlan.of(d, 3.0)
    with pytest.raises(SpecError, match="bytes_per_token"):
        StagePlan(4, 0, 0.0)
