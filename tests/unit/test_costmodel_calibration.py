"""The cost model against Vidur's measured H100 profiles (the reduced copy in agents/data/vidur-h100)."""
import importlib.util
import os

import pytest
import yaml

from agents.costmodel import Calibration, CostModel, ModelConfig, get_gpu, load_calibration
from emulation.validation import SpecError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_costmodel", os.path.join(ROOT, "testbed", "benchmarks", "bench_costmodel.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def profiles(bench):
    return (bench.load_compute(bench.REPO_PROFILES),
            bench.load_collective(bench.REPO_PROFILES, "h100_dgx.all_reduce.csv", "all_reduce"),
            bench.load_collective(bench.REPO_PROFILES, "h100_dgx.send_recv.csv", "send_recv"))


def test_decode_step_tracks_the_profiles(bench, profiles):
    rows, ar, _ = profiles
    out = bench.profile_errors(rows, ar, load_calibration())
    assert {(r["model"], r["tp"]) for r in out["rows"]} == {(m, tp) for m in bench.PROFILE_MODELS for tp in (1, 2, 4, 8)}
    o = out["overall"]
    assert o["points"] == 448
    # docs/costmodel.md: median error ~4%, 9 in 10 points within 15%; the misses sit just past GEMM tile steps
    assert o["median_abs_err"] < 0.06
    assert o["within_15pct"] > 0.9
    assert o["worst_abs_err"] < 0.3


def test_a_roofline_misses_what_the_profiles_show(bench, profiles):
    # Vidur's README: a Llama-2-7B layer at batch 1 is only ~1.5x faster at TP8 than at TP1 once the kernel
    # floors and the all-reduces are counted (a roofline says ~7x)
    rows, ar, _ = profiles
    r1 = next(r for r in rows if r["model"] == "Llama-2-7b-hf" and r["tp"] == 1 and r["T"] == 1)
    r8 = next(r for r in rows if r["model"] == "Llama-2-7b-hf" and r["tp"] == 8 and r["T"] == 1)
    measured = sum(r1[o] for o in bench.OPS) / (sum(r8[o] for o in bench.OPS) + 2 * bench.ar_reference(ar, 8192, 8))
    assert 1.3 < measured < 2.0  # 1.84 with the smoothed all-reduce reference (README: ~1.5 at 37 us)
    cm = CostModel(bench.model_config(r1), get_gpu("H100"))
    keys = bench.OPS + ["allreduce"]
    ours = sum(cm.decode_breakdown(1, 0, 1)[k] for k in keys) / sum(cm.decode_breakdown(1, 0, 8)[k] for k in keys)
    assert ours == pytest.approx(measured, rel=0.2)  # TP8 at batch 1 is one of the worst points (+19%)
    # the roofline this model replaced: weights over HBM and all-reduce bandwidth only
    m = cm.model
    w = m.layers * (m.attn_params_per_layer + m.ffn_params_per_layer) * 2

    def roofline(tp):
        return w / tp / (3.35e12 * 0.7) + (2 * m.layers * 2 * (tp - 1) / tp * m.hidden * 2 / 360e9 if tp > 1 else 0)
    assert roofline(1) / roofline(8) > 7


def test_collective_figures_are_derived_from_the_copy(bench, profiles):
    _, ar, p2p = profiles
    cal = load_calibration()
    d = bench.derive_collectives(ar, p2p, get_gpu("H100").nvlink_gbps)
    for n, f in d["allreduce"].items():
        assert cal.allreduce[n].latency_us == pytest.approx(f["latency_us"])
        assert cal.allreduce[n].busbw_frac == pytest.approx(f["busbw_frac"])
    assert cal.p2p.latency_us == pytest.approx(d["p2p"]["latency_us"])
    assert cal.p2p.busbw_frac == pytest.approx(d["p2p"]["busbw_frac"])


def test_kernel_figures_are_derived_from_the_copy(bench, profiles):
    pytest.importorskip("scipy", reason="the kernel fits use scipy's least squares (the test extras install it)")
    rows = profiles[0]
    cal = load_calibration()
    d = bench.derive_kernels(rows, cal, get_gpu("H100"))
    for cls, fit in d.items():
        for k, v in fit.items():
            assert getattr(getattr(cal, cls), k) == pytest.approx(v, rel=2e-3, abs=2e-3), f"{cls}.{k}"


def test_calibration_file_is_validated(tmp_path):
    raw = yaml.safe_load(open(os.path.join(ROOT, "agents", "data", "calibration.yaml")))
    p = tmp_path / "c.yaml"
    for path, value, field in ((("gemm", "hbm_eff"), 1.5, "calibration.gemm.hbm_eff"),
                               (("norm", "floor_us"), -1, "calibration.norm.floor_us"),
                               (("allreduce",), {}, "calibration.allreduce"),
                               (("p2p", "speed"), 1, "calibration.p2p.speed")):
        bad = yaml.safe_load(yaml.safe_dump(raw))
        node = bad
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        p.write_text(yaml.safe_dump(bad))
        with pytest.raises(SpecError) as e:
            load_calibration(str(p))
        assert e.value.field == field
    assert isinstance(load_calibration(), Calibration)


def test_a_model_built_from_a_profile_shape_runs_every_layout():
    m = ModelConfig(layers=2, hidden=256, ffn=512, q_heads=4, kv_heads=2, head_dim=64, vocab=1000)
    cm = CostModel(m, get_gpu("H200"))
    for tp in (1, 2, 4, 8):
        assert cm.decode_step_s(4, 400, tp) > 0
        assert cm.prefill_s(4, 100, tp) > cm.decode_step_s(4, 400, tp)
