"""Agent messages: every field's error names the field; replies and arrays round-trip; the token ledger counts
each (request, position) exactly once, in order or not."""
import json

import numpy as np
import pytest

from agents.node.collector import TokenLedger
from agents.protocol import (METHODS, ProtocolError, TokenBatch, decode_reply, decode_request, encode_error,
                             encode_ok, encode_request, load_agent_config, pack, pack_array, token_ids, unpack_array)
from emulation.validation import SpecError

EP = {"host": "10.0.1.2", "port": 7000}


@pytest.mark.parametrize("method, params, field", [
    ("dist_init", {"agents": [], "master": EP}, "params.agents"),
    ("dist_init", {"agents": [0, 0], "master": EP}, "params.agents"),
    ("dist_init", {"agents": [0], "master": {"host": "x", "port": 0}}, "params.master.port"),
    ("dist_init", {"agents": [0], "master": EP, "timeout_s": -1}, "params.timeout_s"),
    ("form_group", {"name": "a b", "agents": [0, 1]}, "params.name"),
    ("form_group", {"name": "g", "agents": [0]}, "params.agents"),
    ("all_reduce", {"group": "g", "nbytes": 2}, "params.nbytes"),
    ("all_reduce", {"group": "g", "nbytes": 64, "iters": 0}, "params.iters"),
    ("all_reduce", {"group": "g", "nbytes": 64, "timeout_s": float("inf")}, "params.timeout_s"),
    ("all_to_all", {"group": 3, "nbytes": 64}, "params.group"),
    ("broadcast", {"nbytes": 64, "bucket_bytes": 16, "tag": -1}, "params.tag"),
    ("broadcast", {"nbytes": 64, "bucket_bytes": 16, "tag": 1, "sources": [[1, 0.0]]}, "params.sources[0]"),
    ("broadcast", {"nbytes": 64, "bucket_bytes": 16, "tag": 1, "children": [{"agent": 2}, {"agent": 2}]},
     "params.children"),
    ("broadcast", {"nbytes": 64, "bucket_bytes": 16, "tag": 1, "children": [2]}, "params.children[0]"),
    ("broadcast", {"nbytes": 2**30, "bucket_bytes": 4, "tag": 1}, "params.bucket_bytes"),
    ("send", {"peer": -1, "nbytes": 8}, "params.peer"),
    ("recv", {"peer": 1, "nbytes": 0}, "params.nbytes"),
    ("submit", {"requests": [{"rid": 1, "prompt": 0, "target": 5}]}, "params.requests[0].prompt"),
    ("submit", {"requests": [{"rid": 1, "prompt": 5, "target": 5, "generated": 5}]}, "params.requests[0].generated"),
    ("submit", {"requests": [{"rid": 1, "prompt": 5, "target": 5}, {"rid": 1, "prompt": 5, "target": 5}]},
     "params.requests"),
    ("submit", {"requests": [{"rid": 1, "prompt": 5, "target": 5, "colour": 1}]}, "params.requests[0].colour"),
    ("stats", {"snapshot": "yes"}, "params.snapshot"),
    ("set_layout", {}, "params.layout"),
    ("migrate", {"rid": 1, "dst": 2, "dst_rpc": EP, "mode": "teleport"}, "params.mode"),
    ("migrate", {"rid": 1, "dst": 2, "dst_rpc": EP, "max_stages": 0}, "params.max_stages"),
    ("kv_incoming", {"rid": 1, "src": 0, "nbytes": 8, "tag": 2**21}, "params.tag"),
    ("kv_wait", {"tags": []}, "params.tags"),
    ("kv_wait", {"tags": [1], "timeout_s": 0}, "params.timeout_s"),
    ("migrate_commit", {"request": {"rid": 1, "prompt": 5, "target": 9}, "kv_tokens": -1}, "params.kv_tokens"),
    ("compute", {"seconds": -1}, "params.seconds"),
    ("ping", {"extra": 1}, "params.extra"),
])
def test_every_field_error_names_the_field(method, params, field):
    with pytest.raises(ProtocolError) as ei:
        decode_request(pack({"v": 1, "id": 42, "method": method, "params": params}))
    assert ei.value.field == field, str(ei.value)
    assert ei.value.request_id == 42  # the error reply can still be matched to the request


@pytest.mark.parametrize("msg, field", [
    (b"\xc1", "message"), (pack([1, 2]), "message"), (pack({"v": 2, "id": 1, "method": "ping"}), "v"),
    (pack({"v": 1, "method": "ping"}), "id"), (pack({"v": 1, "id": 1, "method": "fly"}), "method"),
    (pack({"v": 1, "id": 1, "method": "ping", "x": 1}), "x"), (b"\x91" * 5000 + b"\xc0", "message"),
])
def test_envelope_errors(msg, field):
    with pytest.raises(ProtocolError) as ei:
        decode_request(msg)
    assert ei.value.field == field


def test_every_method_has_a_parameter_schema_and_round_trips():
    for method, cls in METHODS.items():
        assert isinstance(cls, type)
    req = decode_request(encode_request(9, "all_reduce", {"group": "trainers", "nbytes": 4096, "iters": 3}))
    assert (req.id, req.method, req.params.nbytes, req.params.iters) == (9, "all_reduce", 4096, 3)
    assert decode_reply(encode_ok(9, {"a": 1})).result == {"a": 1}
    r = decode_reply(encode_error(9, "params.x: bad", "params.x"))
    assert not r.ok and r.field == "params.x"


def test_arrays_and_token_batches_round_trip_and_reject_garbage():
    a = np.arange(10, dtype=np.int64)
    assert (unpack_array(pack_array(a)) == a).all()
    with pytest.raises(ProtocolError):
        unpack_array({"dtype": "<i8", "shape": [3], "data": b"12"})
    with pytest.raises(ProtocolError):
        unpack_array({"dtype": "object", "shape": [1], "data": b"x"})
    ids, pos = np.array([5, 6], np.int64), np.array([0, 3], np.int32)
    b = TokenBatch(1, 2, 3.5, ids, pos, token_ids(ids, pos), np.array([6], np.int64))
    c = TokenBatch.decode(b.encode())
    assert (c.ids == ids).all() and (c.pos == pos).all() and (c.fin == [6]).all() and c.t == 3.5
    with pytest.raises(ProtocolError):
        TokenBatch.decode(pack({"v": 1, "src": 1, "seq": 1, "t": 1.0, "ids": b"\0" * 8, "pos": b"", "tok": b"",
                                "fin": b""}))


def test_agent_config_validation_names_the_field():
    good = {"index": 0, "server": 0, "role": "gen", "gpus": 8, "model": "Qwen2.5-7B", "gpu": "H800",
            "rpc": EP, "fabric_ip": "10.0.0.1", "fabric_intf": "orlh0-eth0"}
    assert load_agent_config(good).engine.max_num_seqs == 1024  # veRL's rollout default
    for k, v, field in (("role", "boss", "config.role"), ("time_dilation", 0, "config.time_dilation"),
                        ("engine", {"max_num_seqs": 0}, "config.engine.max_num_seqs"),
                        ("layout", "TP3x3", "config.layout")):
        with pytest.raises(SpecError) as ei:
            load_agent_config({**good, k: v})
        assert ei.value.field == field
    # an optional section's error names the section (emulation.validation's unions) and says what is wrong
    for v, words in (({"dtype": "int8"}, "float32"), ({"hidden": 250, "q_heads": 4}, "must divide hidden")):
        with pytest.raises(SpecError, match=words) as ei:
            load_agent_config({**good, "real_compute": v})
        assert ei.value.field == "config.real_compute"


def test_agent_config_travels_as_json_and_comes_back_equal():
    # what the pool builds and checks, written as JSON, is what the agent parses back (real-compute decoder too)
    from agents.protocol import AgentConfig, Endpoint
    from agents.realcompute import DecoderConfig
    from emulation.validation import to_dict

    cfg = AgentConfig(index=1, server=1, role="gen", gpus=8, model="Qwen2.5-7B", gpu="H800",
                      rpc=Endpoint("10.0.0.2", 5000), fabric_ip="10.0.0.2", fabric_intf="orlh1-eth0", layout="TP2x4",
                      collectors=(Endpoint("10.0.0.3", 6000),), real_compute=DecoderConfig(hidden=64, q_heads=2))
    assert cfg.real_compute.head_dim == 32  # hidden / q_heads when not given
    assert load_agent_config(json.loads(json.dumps(to_dict(cfg)))) == cfg
    with pytest.raises(SpecError) as ei:
        AgentConfig(**{**cfg.__dict__, "layout": "TP4x4"})  # 16 GPUs on an 8-GPU server: refused before a start
    assert ei.value.field == "layout"


def test_ledger_counts_in_order_out_of_order_and_duplicates():
    led = TokenLedger()
    # two steps of two requests in one message (a wake-up that completed two steps)
    led.add(np.array([7, 8, 7, 8]), np.array([0, 0, 1, 1]), 1.0)
    led.add(np.array([7]), np.array([3]), 2.0)  # position 2 is late (migration race)
    led.add(np.array([7]), np.array([2]), 2.1)
    led.add(np.array([8, 8]), np.array([1, 2]), 2.2)  # position 1 again: a duplicate
    s = led.summary()
    got = dict(zip(unpack_array(s["rid"]).tolist(), unpack_array(s["count"]).tolist()))
    assert got == {7: 4, 8: 3}
    assert dict(zip(unpack_array(s["rid"]).tolist(), unpack_array(s["contiguous"]).tolist())) == {7: 4, 8: 3}
    assert s["duplicates"] == 1 and s["out_of_order"] == 1 and s["held_aside"] == 0


def test_ledger_scales_to_thousands_of_requests_vectorised():
    led = TokenLedger()
    rng = np.random.default_rng(1)
    ids = rng.permutation(5000).astype(np.int64) * 7 + 11
    for step in range(20):
        led.add(ids, np.full(len(ids), step), float(step))
    s = led.summary()
    assert s["tokens_unique"] == 100_000 and s["duplicates"] == 0 and s["out_of_order"] == 0
