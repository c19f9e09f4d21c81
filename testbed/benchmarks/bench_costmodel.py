"""GPU cost model: calibration against Vidur's H100 profiles, side by side with llm-analysis, capacity, switches.

    .venv/bin/python testbed/benchmarks/bench_costmodel.py profiles [--profiles DIR]   # error vs measured, per model/TP
    .venv/bin/python testbed/benchmarks/bench_costmodel.py derive [--profiles DIR]     # the figures calibration.yaml holds
    .venv/bin/python testbed/benchmarks/bench_costmodel.py llm-analysis [--llm-analysis-path DIR]
    .venv/bin/python testbed/benchmarks/bench_costmodel.py capacity | switch | speed
    .venv/bin/python testbed/benchmarks/bench_costmodel.py extract --source DIR --dest agents/data/vidur-h100

Every subcommand prints one JSON document. ``--profiles`` defaults to the reduced copy in the repo
(``agents/data/vidur-h100``); point it at the full profiles (``../shared/reference-data/vidur-h100``) for
every batch size they cover. A benchmark reports; it asserts nothing.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

from agents.costmodel import (Calibration, CollectiveFit, CostModel, GemmFit, KernelFit, ModelConfig,  # noqa: E402
                              get_gpu, get_model, load_calibration)

REPO_PROFILES = os.path.join(ROOT, "agents", "data", "vidur-h100")
VIDUR_COMMIT = "7d47513"

# The profiled models. Shapes are the CSVs' own columns (n_embd, n_expanded_embd, n_head, n_kv_head,
# vocab_size); layer counts (not in the CSVs) from each model's config.json (num_hidden_layers).
PROFILE_MODELS = {
    "Llama-2-7b-hf": 32,
    "CodeLlama-34b-Instruct-hf": 48,
    "Qwen-72B": 80,
    "Llama-2-70b-hf": 80,
}
OPS = ["input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add"]  # one layer, as Vidur sums a block (add once)
GEMMS = ["attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"]
FIT_CLASSES = {"norm": ["input_layernorm", "post_attention_layernorm"], "rope": ["attn_rope"],
               "act": ["mlp_act"], "add": ["add"], "embedding": ["emb"], "gemm": GEMMS}
SHAPE_COLS = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp",
              "num_tokens", "num_tensor_parallel_workers"]
# Rows copied into the repo: every tensor-parallel degree, these batch sizes (tokens), both repeats.
SUBSET_TOKENS = {1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 136, 192, 256, 264, 320, 384, 448, 512, 520, 640,
                 768, 1024, 1536, 2048, 3072, 4096}
AR_WINDOW = 8  # the reference all-reduce time at a size: median over the 2*8+1 nearest measured sizes


# ---- data -------------------------------------------------------------------------------------
def load_compute(profiles: str) -> list[dict]:
    rows = []
    for name, layers in PROFILE_MODELS.items():
        with open(os.path.join(profiles, "compute", f"{name}.mlp.csv"), newline="") as f:
            for r in csv.DictReader(f):
                row = {"model": name, "layers": layers, "T": int(r["num_tokens"]),
                       "tp": int(r["num_tensor_parallel_workers"]),
                       "shape": {k: r[k] for k in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size")}}
                for op in OPS + ["emb"]:
                    row[op] = float(r[f"time_stats.{op}.median"]) * 1e-3  # ms -> s
                rows.append(row)
    return rows


def load_collective(profiles: str, name: str, op: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{num_workers: (sizes, median seconds)} for the intra-node rows (devices_per_node == num_workers)."""
    out: dict[int, list] = {}
    with open(os.path.join(profiles, "network", name), newline="") as f:
        for r in csv.DictReader(f):
            n = int(r["num_workers"])
            if int(r["devices_per_node"]) != n:
                continue  # across nodes: not NVLink
            out.setdefault(n, []).append((int(r["size"]), float(r[f"time_stats.{op}.median"]) * 1e-3))
    res = {}
    for n, v in out.items():
        v.sort()
        res[n] = (np.array([a for a, _ in v], float), np.array([b for _, b in v], float))
    return res


def model_config(row: dict) -> ModelConfig:
    s = row["shape"]
    h, heads = int(s["n_embd"]), int(s["n_head"])
    return ModelConfig(layers=row["layers"], hidden=h, ffn=int(s["n_expanded_embd"]), q_heads=heads,
                       kv_heads=int(s["n_kv_head"]), head_dim=h // heads, vocab=int(s["vocab_size"]),
                       name=row["model"])


def ar_reference(ar: dict, nbytes: float, n: int) -> float:
    """Measured all-reduce time at ``nbytes`` over ``n`` GPUs: the median of the per-size medians of the
    2*AR_WINDOW+1 measured sizes nearest (in log size) — the profile's size-to-size jitter (7 vs 40 us
    between neighbouring sizes) smoothed, not modelled."""
    sizes, t = ar[n]
    idx = np.argsort(np.abs(np.log(sizes) - math.log(max(nbytes, sizes[0]))))[:2 * AR_WINDOW + 1]
    return float(np.median(t[idx]))


# ---- derivation of calibration.yaml -------------------------------------------------------------
def derive_collectives(ar: dict, p2p: dict, nvlink_gbps: float) -> dict:
    """Latency: median over sizes <= 256 KiB of the per-size median; bus bandwidth: median over sizes >=
    16 MiB of 2(n-1)/n size / (t - latency), as a fraction of the H100's nominal one-direction NVLink."""
    out = {}
    for n, (s, t) in sorted(ar.items()):
        lat = float(np.median(t[s <= 256 * 1024]))
        big = s >= 16 * 2 ** 20
        busbw = float(np.median(2 * (n - 1) / n * s[big] / (t[big] - lat)))
        out[n] = {"latency_us": round(lat * 1e6, 2), "busbw_frac": round(busbw / (nvlink_gbps * 1e9), 3)}
    s, t = p2p[2]
    lat = float(np.median(t[s <= 256 * 1024]))
    big = s >= 16 * 2 ** 20
    bw = float(np.median(s[big] / (t[big] - lat)))
    return {"allreduce": out, "p2p": {"latency_us": round(lat * 1e6, 2), "busbw_frac": round(bw / (nvlink_gbps * 1e9), 3)}}


def _per_layer_op(cm: CostModel, row: dict, op: str) -> float:
    b = cm.decode_breakdown(row["T"], 0, tp=row["tp"])
    return b[op] / (1 if op == "emb" else cm.model.layers)


def derive_kernels(rows: list[dict], base: Calibration, h100) -> dict:
    """Least squares in log space (relative error) of each operator class over every profiled row, with
    the cost model's own formulas; efficiencies bounded to (0, 1]. Needs scipy (bench only)."""
    from scipy.optimize import least_squares

    cms = {}

    def cm_for(row, cal):
        key = (row["model"], id(cal))
        if key not in cms:
            cms[key] = CostModel(model_config(row), h100, calib=cal)
        return cms[key]

    out = {}
    for cls, ops in FIT_CLASSES.items():
        if cls == "gemm":
            names, x0 = ["floor_us", "hbm_eff", "mfu", "ramp_tokens"], [5.0, 0.85, 0.7, 64.0]
            lo, hi = [0.0, 0.05, 0.05, 0.0], [50.0, 1.0, 1.0, 4096.0]
        else:
            names, x0, lo, hi = ["floor_us", "hbm_eff"], [3.0, 0.5], [0.0, 0.01], [50.0, 1.0]

        def resid(x):
            fit = dict(zip(names, x))
            if cls == "gemm":
                cal = dataclasses.replace(base, gemm=GemmFit(tile_tokens=base.gemm.tile_tokens, **fit))
            else:
                cal = dataclasses.replace(base, **{cls: KernelFit(**fit)})
            cms.clear()
            return np.array([math.log(_per_layer_op(cm_for(r, cal), r, op) / r[op]) for r in rows for op in ops])

        res = least_squares(resid, x0, bounds=(lo, hi))
        out[cls] = {k: round(float(v), 4 if k in ("hbm_eff", "mfu") else 3) for k, v in zip(names, res.x)}
        if cls == "gemm":
            out[cls]["tile_tokens"] = base.gemm.tile_tokens
    return out


# ---- comparisons --------------------------------------------------------------------------------
def profile_errors(rows: list[dict], ar: dict, cal: Calibration, gpu_name: str = "H100") -> dict:
    """Decode step (all layers' profiled operators + both TP all-reduces + embedding; no context, so no
    attention, which the profiles lack and both sides would add identically) against the measurement."""
    gpu = get_gpu(gpu_name)
    keys = OPS + ["emb", "allreduce"]
    cms, per = {}, {}
    for r in rows:
        cm = cms.setdefault(r["model"], CostModel(model_config(r), gpu, calib=cal))
        b = cm.decode_breakdown(r["T"], 0, tp=r["tp"])
        model = sum(b[k] for k in keys)
        h = int(r["shape"]["n_embd"])
        ar_ref = 2 * ar_reference(ar, r["T"] * h * 2, r["tp"]) if r["tp"] > 1 else 0.0
        ref = r["layers"] * (sum(r[op] for op in OPS) + ar_ref) + r["emb"]
        per.setdefault((r["model"], r["tp"]), []).append((r["T"], model / ref - 1, ref, model))
    table, allerr = [], []
    for (name, tp), v in sorted(per.items()):
        e = np.array([x[1] for x in v])
        allerr.extend(e.tolist())
        worst = max(v, key=lambda x: abs(x[1]))
        small = [x for x in v if x[0] <= 256]
        ws = max(small, key=lambda x: abs(x[1]))
        table.append({"model": name, "tp": tp, "points": len(v), "median_abs_err": round(float(np.median(np.abs(e))), 3),
                      "p95_abs_err": round(float(np.percentile(np.abs(e), 95)), 3),
                      "worst_err": round(worst[1], 3), "worst_at_tokens": worst[0],
                      "worst_err_batch_le_256": round(ws[1], 3), "worst_at_tokens_le_256": ws[0],
                      "within_15pct": round(float(np.mean(np.abs(e) <= 0.15)), 3)})
    a = np.abs(np.array(allerr))
    return {"rows": table, "overall": {"points": len(a), "median_abs_err": round(float(np.median(a)), 3),
                                       "p95_abs_err": round(float(np.percentile(a, 95)), 3),
                                       "worst_abs_err": round(float(a.max()), 3),
                                       "within_15pct": round(float(np.mean(a <= 0.15)), 3)}}


def cmd_profiles(args) -> dict:
    rows = load_compute(args.profiles)
    ar = load_collective(args.profiles, "h100_dgx.all_reduce.csv", "all_reduce")
    out = profile_errors(rows, ar, load_calibration())
    out["profiles"] = os.path.relpath(args.profiles, ROOT)
    out["roofline_before"] = roofline_errors(rows, ar)
    return out


def roofline_errors(rows: list[dict], ar: dict) -> list[dict]:
    """The same comparison for the roofline this cost model replaced (before the calibration):
    max(FLOPs / (peak x 0.5), weight bytes / (HBM x 0.7)) + both all-reduces at 0.8 x 450 GB/s, no floors,
    no latency; the layers' weights only, like the profiled operators."""
    per = {}
    for r in rows:
        m, T, tp = model_config(r), r["T"], r["tp"]
        w = m.layers * (m.attn_params_per_layer + m.ffn_params_per_layer)
        step = max(2 * w * T / tp / (989e12 * 0.5), 2 * w / tp / (3.35e12 * 0.7))
        if tp > 1:
            step += 2 * m.layers * 2 * (tp - 1) / tp * T * m.hidden * 2 / (450e9 * 0.8)
        ar_ref = 2 * ar_reference(ar, T * m.hidden * 2, tp) if tp > 1 else 0.0
        ref = r["layers"] * (sum(r[op] for op in OPS) + ar_ref) + r["emb"]
        per.setdefault((r["model"], tp), []).append((T, step / ref - 1))
    out = []
    for (name, tp), v in sorted(per.items()):
        e = np.abs([x[1] for x in v])
        worst = max(v, key=lambda x: abs(x[1]))
        out.append({"model": name, "tp": tp, "median_abs_err": round(float(np.median(e)), 3),
                    "worst_err": round(worst[1], 3), "worst_at_tokens": worst[0],
                    "within_15pct": round(float(np.mean(e <= 0.15)), 3)})
    return out


def cmd_derive(args) -> dict:
    rows = load_compute(args.profiles)
    ar = load_collective(args.profiles, "h100_dgx.all_reduce.csv", "all_reduce")
    p2p = load_collective(args.profiles, "h100_dgx.send_recv.csv", "send_recv")
    h100 = get_gpu("H100")
    out = derive_collectives(ar, p2p, h100.nvlink_gbps)
    out.update(derive_kernels(rows, load_calibration(), h100))
    out["profiles"] = os.path.relpath(args.profiles, ROOT)
    return out


# ---- llm-analysis side by side ---------------------------------------------------------------------
LLMA_POINTS = [(m, tp, b) for m in ("Qwen2.5-7B", "Qwen2.5-14B", "Qwen2.5-32B", "Qwen2.5-72B")
               for tp in (1, 2, 4, 8) for b in (1, 32, 256)]
LLMA_CONTEXT = 8192


def llm_analysis_decode(m: ModelConfig, tp: int, batch: int, context: int, hbm_eff: float | None = None,
                        flops_eff: float | None = None) -> dict:
    """One decode step by llm-analysis 0.2.2 (imported from wherever it was unpacked; not a dependency).

    Its MLP counts two matrices of ``ffn_embed_dim`` (no gate): we pass 1.5 x the gated FFN width so its
    weight bytes match a SwiGLU MLP. Efficiencies: its defaults (1.0) unless given; its H100 file (8 us
    NVLink latency floor per all-reduce, 450 GB/s)."""
    import logging

    from llm_analysis.analysis import LLMAnalysis
    from llm_analysis.config import ModelConfig as LMC, ParallelismConfig, get_dtype_config_by_name, get_gpu_config_by_name
    from llm_analysis.logger import logger as llma_logger
    llma_logger.setLevel(logging.ERROR)
    cfg = LMC(name=m.name, num_layers=m.layers, n_head=m.q_heads, hidden_dim=m.hidden, vocab_size=m.vocab,
              num_key_value_heads=m.kv_heads, ffn_embed_dim=int(1.5 * m.ffn), expansion_ratio=1.5 * m.ffn / m.hidden,
              max_seq_len=context + 1)
    a = LLMAnalysis(cfg, get_gpu_config_by_name("h100-sxm-80gb"), get_dtype_config_by_name("w16a16e16"),
                    ParallelismConfig(tp_size=tp), hbm_memory_efficiency=hbm_eff, flops_efficiency=flops_eff)
    try:
        s = a.inference(batch_size_per_gpu=batch, seq_len=context, num_tokens_to_generate=1)
    except AssertionError as e:
        return {"fits": False, "why": str(e).split("(")[0].strip()}
    return {"fits": True, "decode_s": s["decode_latency"], "tp_comm_s": s["decode_latency_fwd_tp_comm"]}


def cmd_llm_analysis(args) -> dict:
    if args.llm_analysis_path:
        sys.path.insert(0, args.llm_analysis_path)
    try:
        import llm_analysis  # noqa: F401
    except ImportError as e:
        return {"error": f"llm-analysis not importable ({e}); pip download llm-analysis==0.2.2 fire==0.5.0 "
                         "termcolor six into a folder, unpack, and pass --llm-analysis-path"}
    gpu = get_gpu("H100")
    rows = []
    for name, tp, b in LLMA_POINTS:
        cm = CostModel(get_model(name), gpu)
        m = cm.model
        ours_fits = b * (LLMA_CONTEXT + 1) <= cm.kv_capacity_tokens(tp)
        ours = cm.decode_step_s(b, b * LLMA_CONTEXT, tp)
        br = cm.decode_breakdown(b, b * LLMA_CONTEXT, tp)
        la = llm_analysis_decode(m, tp, b, LLMA_CONTEXT)
        g = cm.calib.gemm
        matched = llm_analysis_decode(m, tp, b, LLMA_CONTEXT, hbm_eff=g.hbm_eff, flops_eff=g.mfu)
        row = {"model": name, "tp": tp, "batch": b, "context": LLMA_CONTEXT,
               "ours_ms": round(ours * 1e3, 3), "ours_allreduce_ms": round(br["allreduce"] * 1e3, 3),
               "ours_fits": ours_fits, "ours_kv_capacity_tokens": int(cm.kv_capacity_tokens(tp)),
               "llm_analysis_fits": la["fits"]}
        if la["fits"]:
            row.update({"llm_analysis_ms": round(la["decode_s"] * 1e3, 3),
                        "llm_analysis_tp_comm_ms": round(la["tp_comm_s"] * 1e3, 3),
                        "ratio_ours_over_llm_analysis": round(ours / la["decode_s"], 3),
                        "llm_analysis_matched_eff_ms": round(matched["decode_s"] * 1e3, 3),
                        "ratio_ours_over_matched": round(ours / matched["decode_s"], 3)})
        else:
            row["llm_analysis_why"] = la["why"]
        rows.append(row)
    both = [r["ratio_ours_over_llm_analysis"] for r in rows if "ratio_ours_over_llm_analysis" in r]
    matched = [r["ratio_ours_over_matched"] for r in rows if "ratio_ours_over_matched" in r]
    return {"gpu": "H100", "rows": rows,
            "ratio_range": [min(both), max(both)] if both else None,
            "ratio_median": statistics.median(both) if both else None,
            "matched_ratio_range": [min(matched), max(matched)] if matched else None,
            "matched_ratio_median": statistics.median(matched) if matched else None,
            "points_fitting": {"ours": sum(r["ours_fits"] for r in rows),
                               "llm_analysis": sum(r["llm_analysis_fits"] for r in rows), "of": len(rows)},
            "fit_disagreements": [(r["model"], r["tp"], r["batch"]) for r in rows if r["ours_fits"] != r["llm_analysis_fits"]]}


# ---- capacity, switches, speed ------------------------------------------------------------------
def cmd_capacity(args) -> dict:
    rows = []
    for gpu in ("H800", "H200"):
        for name in ("Qwen2.5-7B", "Qwen2.5-32B", "Qwen2.5-72B", "Qwen3-30B-A3B", "Qwen3-235B-A22B"):
            cm = CostModel.for_names(name, gpu)
            for tp, ep in ((1, 1), (2, 1), (4, 1), (8, 1), (8, 8), (1, 8)):
                if ep > 1 and not cm.model.is_moe:
                    continue
                cap = cm.kv_capacity_tokens(tp, ep=ep)
                rows.append({"gpu": gpu, "model": name, "tp": tp, "ep": ep,
                             "weights_gb_per_gpu": round(cm.weight_bytes_per_gpu(tp, ep) / 1e9, 2),
                             "kv_kb_per_token_per_gpu": round(cm.kv_bytes_per_token_per_gpu(tp) / 1e3, 2),
                             "kv_capacity_tokens": int(cap),
                             "fits_256_x_8k": 256 * 8192 <= cap, "fits_64_x_8k": 64 * 8192 <= cap})
    return {"reserve": load_calibration().kv_reserve, "max_num_batched_tokens": 8192, "rows": rows}


def cmd_switch(args) -> dict:
    rows = []
    for gpu in ("H100", "H800"):
        for name in ("Qwen2.5-7B", "Qwen2.5-32B", "Qwen2.5-72B", "Qwen3-30B-A3B"):
            cm = CostModel.for_names(name, gpu)
            cases = [(8, 4, 1, 1), (4, 8, 1, 1), (8, 1, 1, 1), (1, 8, 1, 1), (4, 2, 1, 1)]
            if cm.model.is_moe:
                cases += [(8, 8, 1, 8), (8, 1, 1, 8)]
            for a, b, ea, eb in cases:
                # a server full of KV: what the tighter of the two layouts holds (8 GPUs, all replicas)
                full = min(8 // a * cm.kv_capacity_tokens(a, ep=ea), 8 // b * cm.kv_capacity_tokens(b, ep=eb))
                if full <= 0:
                    continue  # the weights alone do not fit one of the layouts
                for kv in (0, int(full)):
                    s = cm.layout_switch(a, b, kv, from_ep=ea, to_ep=eb)
                    rows.append({"gpu": gpu, "model": name, "from": f"TP{a}" + (f"/EP{ea}" if ea > 1 else ""),
                                 "to": f"TP{b}" + (f"/EP{eb}" if eb > 1 else ""), "kv_tokens": kv,
                                 "weight_gb_per_gpu": round(s.weight_bytes / 1e9, 2),
                                 "kv_gb_per_gpu": round(s.kv_bytes / 1e9, 2),
                                 "transfer_s": round(s.transfer_s, 3), "relayout_s": round(s.relayout_s, 3),
                                 "fixed_s": s.fixed_s, "total_s": round(s.total_s, 3)})
    return {"remp_reference_s": [1, 7], "gpus": 8, "rows": rows}


def cmd_speed(args) -> dict:
    """Per-call cost of the cost model's hot paths (median of --repeats timings of --calls calls)."""
    out = {}
    for name in ("Qwen2.5-7B", "Qwen3-30B-A3B"):
        cm = CostModel.for_names(name, "H800")
        cm.decode_step_s(64, 64000, 4)
        for label, fn in (("decode_step_s", lambda: cm.decode_step_s(64, 64000.0, 4)),
                          ("kv_capacity_tokens", lambda: cm.kv_capacity_tokens(4))):
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                runs.append((time.perf_counter() - t0) / args.calls)
            out[f"{name}.{label}_us"] = round(statistics.median(runs) * 1e6, 2)
        b = np.arange(1, 1001, dtype=float)
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            cm.decode_step_s_array(b, b * 1000, 4)
            runs.append(time.perf_counter() - t0)
        out[f"{name}.decode_step_s_array_1000_us"] = round(statistics.median(runs) * 1e6, 1)
    out["calls"] = args.calls
    out["repeats"] = args.repeats
    return out


def _copy_rows(src: str, dst: str, cols: list[str], keep) -> int:
    """Copy the rows of CSV ``src`` that ``keep`` accepts to ``dst``, values unchanged, only ``cols``."""
    with open(src, newline="") as f:
        rows = [r for r in csv.DictReader(f) if keep(r)]
    with open(dst, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(cols)
        for r in rows:
            w.writerow([r[c] for c in cols])
    return len(rows)


def cmd_extract(args) -> dict:
    """Copy the reduced subset (rows unchanged, median and shape columns only) into the repo."""
    written = {}
    os.makedirs(os.path.join(args.dest, "compute"), exist_ok=True)
    os.makedirs(os.path.join(args.dest, "network"), exist_ok=True)
    cols = [f"time_stats.{op}.median" for op in OPS + ["emb"]] + SHAPE_COLS
    for name in PROFILE_MODELS:
        rel = os.path.join("compute", f"{name}.mlp.csv")
        written[rel] = _copy_rows(os.path.join(args.source, rel), os.path.join(args.dest, rel), cols,
                                  lambda r: int(r["num_tokens"]) in SUBSET_TOKENS)
    for name, op in (("h100_dgx.all_reduce.csv", "all_reduce"), ("h100_dgx.send_recv.csv", "send_recv")):
        rel = os.path.join("network", name)
        written[rel] = _copy_rows(os.path.join(args.source, rel), os.path.join(args.dest, rel),
                                  [f"time_stats.{op}.median", "num_workers", "size", "devices_per_node"],
                                  lambda r: int(r["devices_per_node"]) == int(r["num_workers"]))
    return {"source": args.source, "dest": os.path.relpath(args.dest, ROOT), "rows": written}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("profiles", "derive"):
        p = sub.add_parser(name)
        p.add_argument("--profiles", default=REPO_PROFILES)
    p = sub.add_parser("llm-analysis")
    p.add_argument("--llm-analysis-path", default=None)
    sub.add_parser("capacity")
    sub.add_parser("switch")
    p = sub.add_parser("speed")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p = sub.add_parser("extract")
    p.add_argument("--source", required=True)
    p.add_argument("--dest", default=REPO_PROFILES)
    args = ap.parse_args(argv)
    fn = {"profiles": cmd_profiles, "derive": cmd_derive, "llm-analysis": cmd_llm_analysis, "capacity": cmd_capacity,
          "switch": cmd_switch, "speed": cmd_speed, "extract": cmd_extract}[args.cmd]
    print(json.dumps(fn(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
