"""Hardware in the loop: real decode steps on this machine's GPU against the cost model's prediction.

Runs the real-compute decoder (agents/node/realmodel.py) at catalogue shapes with fewer layers, measures
each decode step with CUDA events (median of repeats after warm-up) and prints, as JSON, the measured time
beside the cost model's prediction for the same shape on this GPU's figures (gpus.yaml, picked by
torch.cuda.get_device_name()). It reports every point as JSON and asserts a coarse bound (3x either way) at
each shape's largest batch. Run it in one go with
``scripts/gpu_check.sh`` (also writes the JSON to $ORL_GPU_CHECK_JSON).
"""
import json
import math
import os
import statistics

import pytest

torch = pytest.importorskip("torch", reason="the GPU check needs torch")

from agents.costmodel import CostModel, get_gpu, get_model, load_gpus  # noqa: E402
from agents.node.realmodel import RealDecoder  # noqa: E402
from agents.realcompute import DecoderConfig  # noqa: E402

SHAPES = [("Qwen2.5-7B", 4), ("Qwen2.5-32B", 2)]  # catalogue model, layers built
BATCHES = (1, 8, 32, 128)
CONTEXT = 1024  # tokens already cached per sequence
WARMUP, REPEATS = 3, 10


def gpu_name_for_costmodel() -> tuple[str | None, str]:
    """(gpus.yaml name, reason when none): the catalogue GPU whose name appears in the device's name."""
    if not torch.cuda.is_available():
        return None, "needs CUDA: torch.cuda.is_available() is False (no GPU here, or a CPU-only torch build)"
    dev = torch.cuda.get_device_name(0)
    for name in load_gpus():
        if name.lower() in dev.lower():
            return name, ""
    return None, f"no cost-model figures for {dev!r} (emulation/data/gpus.yaml knows {', '.join(load_gpus())})"


GPU, WHY = gpu_name_for_costmodel()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPU is None, reason=WHY or "no GPU")]


def test_real_decode_on_cuda_matches_a_full_forward():
    cfg = DecoderConfig(layers=2, hidden=512, ffn=1024, q_heads=8, kv_heads=2, head_dim=64, vocab=1000,
                        max_seq_len=64, max_batch=4)
    dec = RealDecoder(cfg, device="cuda", dtype=torch.float32, seed=0)
    seq = torch.randint(0, cfg.vocab, (4, 20), device="cuda")
    full = dec.forward(seq)
    dec.prefill(seq[:, :19])
    out = dec.decode(seq[:, 19], [19] * 4)
    assert torch.allclose(out, full[:, 19], atol=1e-3, rtol=1e-3)


def test_measured_decode_steps_against_the_cost_model():
    gpu = get_gpu(GPU)
    rows = []
    for model_name, layers in SHAPES:
        cfg = DecoderConfig.like(get_model(model_name), layers=layers, max_seq_len=CONTEXT + 8, max_batch=max(BATCHES))
        dec = RealDecoder(cfg, device="cuda", seed=0)
        cm = CostModel(cfg.model_config(f"{model_name}/{layers}L"), gpu)
        for b in BATCHES:
            lens = [CONTEXT] * b
            for _ in range(WARMUP):
                dec.decode_step_s(lens)
            samples = [dec.decode_step_s(lens) for _ in range(REPEATS)]
            measured = statistics.median(samples)
            predicted = cm.decode_step_s(b, b * CONTEXT, tp=1)
            assert math.isfinite(measured) and measured > 0 and predicted > 0
            rows.append({"shape": f"{model_name} x {layers} layers", "batch": b, "context": CONTEXT,
                         "measured_ms": round(measured * 1e3, 3), "measured_min_ms": round(min(samples) * 1e3, 3),
                         "predicted_ms": round(predicted * 1e3, 3), "measured_over_predicted": round(measured / predicted, 3)})
        del dec
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(0), "costmodel_gpu": GPU, "torch": torch.__version__,
              "dtype": "bfloat16", "warmup": WARMUP, "repeats": REPEATS, "rows": rows}
    text = json.dumps(report, indent=1)
    print(text)
    out = os.environ.get("ORL_GPU_CHECK_JSON")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    # the hardware-in-the-loop check: at the largest batch of each shape (GEMM-bound: eager kernels matter
    # least) the measured step is within 3x of the prediction either way; a factor beyond that is a wrong
    # GPU figure, a unit error or a model that does not describe the decoder, not kernel overhead
    for shape in {r["shape"] for r in rows}:
        big = max((r for r in rows if r["shape"] == shape), key=lambda r: r["batch"])
        assert 1 / 3 <= big["measured_over_predicted"] <= 3, big
