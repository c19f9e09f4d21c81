"""Real-compute mode on CPU: the tiny torch decoder computes what a full causal forward computes."""
import pytest

torch = pytest.importorskip("torch")

from agents.costmodel import get_model  # noqa: E402
from agents.node.realmodel import RealDecoder  # noqa: E402
from agents.realcompute import DecoderConfig  # noqa: E402
from emulation.validation import SpecError  # noqa: E402

TINY = DecoderConfig(layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, head_dim=16, vocab=97, max_seq_len=32,
                     max_batch=4)


def test_cached_decode_equals_full_forward():
    dec = RealDecoder(TINY, seed=1)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, TINY.vocab, (3, 9), generator=g)
    full = dec.forward(seq)  # logits at every position, no cache
    dec.prefill(seq[:, :6])  # cache positions 0..5
    for pos in range(6, 9):  # then decode one token at a time
        out = dec.decode(seq[:, pos], [pos] * 3)
        assert torch.allclose(out, full[:, pos], atol=1e-5)


def test_unequal_context_lengths_are_masked_per_sequence():
    dec = RealDecoder(TINY, seed=2)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, TINY.vocab, (1, 7), generator=g), torch.randint(0, TINY.vocab, (1, 4), generator=g)
    ref_a, ref_b = dec.forward(a)[0, -1], dec.forward(b)[0, -1]
    # one prefill of length 6: slot 0 holds a[:6]; slot 1 holds b[:3] then three junk tokens
    dec.prefill(torch.cat([a[:, :6], b[:, :3].repeat(1, 2)]))
    out = dec.decode(torch.tensor([a[0, 6], b[0, 3]]), [6, 3])  # slot 1's new token overwrites position 3
    assert torch.allclose(out[0], ref_a, atol=1e-5)
    assert torch.allclose(out[1], ref_b, atol=1e-5)  # positions 4.. of slot 1 were junk: masked


def test_decode_step_is_timed_and_seeded():
    dec = RealDecoder(TINY, seed=4)
    t = dec.decode_step_s([5, 0, 31])
    assert 0 < t < 10
    w1 = RealDecoder(TINY, seed=4).layers[0]["wqkv"]
    assert torch.equal(w1, dec.layers[0]["wqkv"]) and not torch.equal(w1, RealDecoder(TINY, seed=5).layers[0]["wqkv"])


def test_shapes_come_from_the_catalogue_and_go_to_the_cost_model():
    m = get_model("Qwen2.5-7B")
    cfg = DecoderConfig.like(m, layers=1, max_seq_len=8, max_batch=1)
    assert (cfg.hidden, cfg.ffn, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.vocab) == (3584, 18944, 28, 4, 128, 152064)
    back = cfg.model_config()
    assert back.layers == 1 and back.attn_params_per_layer == m.attn_params_per_layer
    with pytest.raises(SpecError) as e:
        DecoderConfig.like(get_model("Qwen3-30B-A3B"), layers=1)
    assert e.value.field == "model"


@pytest.mark.parametrize("kwargs, field", [({"head_dim": 15}, "head_dim"), ({"kv_heads": 3}, "kv_heads"),
                                           ({"layers": 0}, "layers"), ({"max_batch": True}, "max_batch")])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(SpecError) as e:
        DecoderConfig(**{**TINY.__dict__, **kwargs})
    assert e.value.field == field


@pytest.mark.parametrize("lens, field", [([], "context_lens"), ([1] * 5, "context_lens"), ([32], "context_lens[0]"),
                                         ([0, -1], "context_lens[1]")])
def test_bad_context_lengths_name_the_field(lens, field):
    with pytest.raises(SpecError) as e:
        RealDecoder(TINY).decode_step_s(lens)
    assert e.value.field == field


def test_the_engine_runs_on_real_decode_steps():
    # real-compute mode: the agent's engine times every decode step on the torch decoder (tiny, CPU)
    from agents.costmodel import CostModel
    from agents.engine import Engine, Layout, NewRequest
    from emulation.orchestration import EngineSettings
    from agents.node.realmodel import RealStepCost

    cost = RealStepCost(DecoderConfig(layers=1, hidden=64, ffn=128, q_heads=2, kv_heads=1, vocab=128,
                                      max_seq_len=256, max_batch=8), CostModel.for_names("Qwen2.5-7B", "H800"))
    e = Engine(cost, 8, Layout(8), EngineSettings(max_num_seqs=8, max_num_batched_tokens=64))
    e.add([NewRequest(i, 16, 5 + i) for i in range(4)], 0.0)
    t, steps = 0.0, 0
    while not e.idle():
        t = e.next_event()
        steps += len(e.advance(t))
    # the longest request has 8 tokens: a prefill step (its first token) then 7 decode steps, each real
    assert steps == 8 and cost.steps == 7
    assert 0 < t < 10  # and took its measured (CPU) time


def test_an_engine_reset_with_new_settings_keeps_the_real_decoder():
    from agents.costmodel import CostModel
    from agents.node.realmodel import RealStepCost

    cost = RealStepCost(DecoderConfig(layers=1, hidden=64, ffn=128, q_heads=2, kv_heads=1, vocab=128,
                                      max_seq_len=256, max_batch=8), CostModel.for_names("Qwen2.5-7B", "H800"))
    other = CostModel.for_names("Qwen2.5-14B", "H800")
    again = cost.rebound(other, 8, 2.0)
    assert again.decoder is cost.decoder and again.modelled.cm is other and cost.modelled.cm is not other
