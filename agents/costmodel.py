"""GPU cost model (pure): how long prefill, decode and training take for a model on a GPU.

A roofline: a step takes ``max(FLOPs / (peak * mfu), bytes moved / (HBM bandwidth * hbm_eff))`` per GPU,
plus the tensor-parallel all-reduces on NVLink. Model shapes come from ``agents/data/models.yaml`` (the
models' config.json, REFERENCE.md "Models") and GPU figures from ``agents/data/gpus.yaml`` (REFERENCE.md
"GPUs"). The efficiencies are parameters (:class:`Efficiency`) with documented defaults:

* ``decode_hbm = 0.70``: Qwen2.5-72B on 2xH100 at batch 1 decodes at 30.9 ms/token, about 70% of the HBM
  roofline (REFERENCE.md, tt-inference-server issue #143); a unit test checks the model reproduces it.
* ``prefill_mfu = 0.50``, ``decode_mfu = 0.50``, ``train_mfu = 0.35``: assumptions (no figure in
  REFERENCE.md); typical of large dense bf16 kernels and of Megatron-style training respectively.
  ``train_mfu`` is end to end: it includes the TP all-reduces inside a server (training adds no separate
  TP time); only inference adds TP all-reduces on NVLink explicitly.
* ``nvlink = 0.80``: achieved fraction of the nominal *one-direction* NVLink bandwidth stored in
  ``gpus.yaml`` (H800: 200 GB/s per direction, ~160 GB/s measured by DeepEP = 0.8).

Everything is in bytes, FLOPs and seconds; weights and KV cache in bf16 (2 bytes) unless told otherwise.
Used by the emulator's agents (modelled GPU compute) and by RLSim.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import yaml

from emulation.validation import SpecError, from_dict, require

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
BF16 = 2


@dataclass(frozen=True)
class ModelConfig:
    layers: int
    hidden: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qkv_bias: bool = False
    tied_embeddings: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        for n in ("layers", "hidden", "q_heads", "kv_heads", "head_dim", "vocab"):
            require(getattr(self, n) >= 1, n, f"must be >= 1, got {getattr(self, n)}")
        for n in ("ffn", "experts", "experts_per_token", "expert_ffn"):
            require(getattr(self, n) >= 0, n, f"must be >= 0, got {getattr(self, n)}")
        require(self.q_heads % self.kv_heads == 0, "kv_heads", "must divide q_heads")
        if self.experts:
            require(1 <= self.experts_per_token <= self.experts, "experts_per_token",
                    f"must be in 1..{self.experts}, got {self.experts_per_token}")
            require(self.expert_ffn >= 1, "expert_ffn", "must be >= 1 for a MoE model")
        else:
            require(self.ffn >= 1, "ffn", "must be >= 1 for a dense model")

    # ---- shapes ------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def attn_width(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attn_params_per_layer(self) -> int:
        p = self.hidden * (self.attn_width + 2 * self.kv_width) + self.attn_width * self.hidden
        if self.qkv_bias:
            p += self.attn_width + 2 * self.kv_width
        return p

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (gate, up, down)."""
        return 3 * self.hidden * self.expert_ffn

    @property
    def ffn_params_per_layer(self) -> int:
        if self.is_moe:
            return self.experts * self.expert_params + self.hidden * self.experts  # experts + router
        return 3 * self.hidden * self.ffn

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params_total(self) -> int:
        norms = self.layers * 2 * self.hidden + self.hidden
        return self.layers * (self.attn_params_per_layer + self.ffn_params_per_layer) + self.embedding_params + norms

    @property
    def params_active(self) -> int:
        """Parameters that take part in one token's forward pass (MoE: top-k experts only)."""
        if not self.is_moe:
            return self.params_total
        inactive = self.layers * (self.experts - self.experts_per_token) * self.expert_params
        return self.params_total - inactive

    @property
    def matmul_params_active(self) -> int:
        """Active parameters used in matrix multiplies (the input embedding is a lookup)."""
        return self.params_active - self.vocab * self.hidden * (0 if self.tied_embeddings else 1)


@dataclass(frozen=True)
class GpuSpec:
    bf16_tflops: float
    hbm_gb: float
    hbm_gbps: float  # GB/s
    nvlink_gbps: float  # GB/s per GPU, one direction, nominal (Efficiency.nvlink is applied once on top)
    nic_gbps: float  # Gb/s per GPU
    name: str = ""

    def __post_init__(self) -> None:
        for n in ("bf16_tflops", "hbm_gb", "hbm_gbps", "nvlink_gbps", "nic_gbps"):
            require(getattr(self, n) > 0, n, f"must be > 0, got {getattr(self, n)}")

    @property
    def peak_flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbps * 1e9

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gbps * 1e9


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the roofline reached (see the module docstring for the sources and assumptions)."""

    decode_hbm: float = 0.70
    prefill_hbm: float = 0.70
    decode_mfu: float = 0.50
    prefill_mfu: float = 0.50
    train_mfu: float = 0.35
    nvlink: float = 0.80  # achieved fraction of nominal one-direction NVLink bandwidth (H800: ~160 of 200 GB/s, DeepEP)

    def __post_init__(self) -> None:
        for n in ("decode_hbm", "prefill_hbm", "decode_mfu", "prefill_mfu", "train_mfu", "nvlink"):
            v = getattr(self, n)
            require(0 < v <= 1, n, f"must be in (0, 1], got {v}")


def _load_table(filename: str, cls: type, path: str | None):
    p = path or os.path.join(DATA_DIR, filename)
    try:
        with open(p, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise SpecError(filename, f"no such file: {p}") from None
    if not isinstance(raw, dict) or not raw:
        raise SpecError(filename, f"{p} must map names to entries")
    out = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            raise SpecError(str(name), "must be a mapping")
        out[str(name)] = from_dict(cls, {**entry, "name": str(name)}, str(name))
    return out


@lru_cache(maxsize=None)
def load_models(path: str | None = None) -> dict[str, ModelConfig]:
    return _load_table("models.yaml", ModelConfig, path)


@lru_cache(maxsize=None)
def load_gpus(path: str | None = None) -> dict[str, GpuSpec]:
    return _load_table("gpus.yaml", GpuSpec, path)


def get_model(name: str) -> ModelConfig:
    models = load_models()
    if name not in models:
        raise SpecError("model", f"unknown model {name!r} (known: {', '.join(models)})")
    return models[name]


def get_gpu(name: str) -> GpuSpec:
    gpus = load_gpus()
    if name not in gpus:
        raise SpecError("gpu", f"unknown GPU {name!r} (known: {', '.join(gpus)})")
    return gpus[name]


def _check_tp(tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise SpecError("tp", f"must be an integer >= 1, got {tp!r}")


def _check_nonneg(value: float, name: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise SpecError(name, f"must be a finite number >= 0, got {value!r}")


class CostModel:
    """Roofline timings of ``model`` on ``gpu``; all methods are pure functions of their arguments."""

    def __init__(self, model: ModelConfig, gpu: GpuSpec, eff: Efficiency = Efficiency(),
                 dtype_bytes: int = BF16, grad_dtype_bytes: int = BF16):
        self.model = model
        self.gpu = gpu
        self.eff = eff
        self.dtype_bytes = dtype_bytes
        self.grad_dtype_bytes = grad_dtype_bytes

    @classmethod
    def for_names(cls, model: str, gpu: str, eff: Efficiency = Efficiency()) -> "CostModel":
        return cls(get_model(model), get_gpu(gpu), eff)

    # ---- sizes -------------------------------------------------------------------------------
    def weight_bytes(self) -> float:
        """All weights (bf16): what a generator needs after each training step."""
        return float(self.model.params_total * self.dtype_bytes)

    def gradient_bytes(self) -> float:
        """Gradients of all parameters (all-reduced across data-parallel replicas)."""
        return float(self.model.params_total * self.grad_dtype_bytes)

    def expert_gradient_bytes(self) -> float:
        """Gradients of the routed experts (0 for a dense model). With expert parallelism ``ep`` a replica
        holds ``1/ep`` of them, all-reduced only with the replicas that hold the same shard."""
        m = self.model
        return float(m.layers * m.experts * m.expert_params * self.grad_dtype_bytes)

    def dense_gradient_bytes(self) -> float:
        """Gradients of everything but the routed experts (attention, router, embeddings, norms)."""
        return self.gradient_bytes() - self.expert_gradient_bytes()

    def kv_bytes_per_token(self) -> float:
        """K and V of one token over all layers."""
        return float(2 * self.model.layers * self.model.kv_width * self.dtype_bytes)

    def _kv_shards(self, tp: int) -> int:
        # KV heads are split across TP ranks; beyond kv_heads ranks they are replicated.
        return min(tp, self.model.kv_heads)

    def kv_capacity_tokens(self, tp: int, reserve: float = 0.1) -> float:
        """Tokens of KV cache that fit in the HBM left after the weights (``reserve`` kept free)."""
        _check_tp(tp)
        free = self.gpu.hbm_gb * 1e9 * (1 - reserve) - self.weight_bytes() / tp
        return max(0.0, free) * self._kv_shards(tp) / self.kv_bytes_per_token()

    def _decode_weight_bytes(self, batch: float) -> float:
        """Weight bytes read by one decode step of ``batch`` sequences (MoE: only the experts touched)."""
        m = self.model
        read = m.params_total - m.vocab * m.hidden * (0 if m.tied_embeddings else 1)
        if m.is_moe:
            # Expected distinct experts hit per layer by batch*k uniform picks.
            touched = m.experts * (1.0 - (1.0 - m.experts_per_token / m.experts) ** max(batch, 0.0))
            read -= m.layers * (m.experts - touched) * m.expert_params
        return read * self.dtype_bytes

    def _tp_comm_s(self, tokens: float, tp: int) -> float:
        """Two ring all-reduces of the activations per layer on NVLink (Megatron TP)."""
        if tp == 1:
            return 0.0
        size = tokens * self.model.hidden * self.dtype_bytes
        per = 2 * (tp - 1) / tp * size / (self.gpu.nvlink_bytes_per_s * self.eff.nvlink)
        return 2 * self.model.layers * per

    # ---- inference ---------------------------------------------------------------------------
    def decode_step_s(self, batch: float, context_tokens: float, tp: int = 1) -> float:
        """One decode step (one new token for each of ``batch`` sequences).

        ``context_tokens`` is the total KV length over the batch (sum of each sequence's tokens so far).
        """
        _check_tp(tp)
        _check_nonneg(batch, "batch")
        _check_nonneg(context_tokens, "context_tokens")
        if batch == 0:
            return 0.0
        m = self.model
        flops = 2.0 * m.matmul_params_active * batch + 4.0 * m.layers * m.attn_width * context_tokens
        compute = flops / tp / (self.gpu.peak_flops * self.eff.decode_mfu)
        bytes_ = self._decode_weight_bytes(batch) / tp + self.kv_bytes_per_token() * context_tokens / self._kv_shards(tp)
        memory = bytes_ / (self.gpu.hbm_bytes_per_s * self.eff.decode_hbm)
        return max(compute, memory) + self._tp_comm_s(batch, tp)

    def decode_step_s_array(self, batch: np.ndarray, context_tokens: np.ndarray, tp: int = 1) -> np.ndarray:
        """Vectorised :meth:`decode_step_s` over arrays of batch sizes and total KV lengths."""
        _check_tp(tp)
        b = np.asarray(batch, dtype=float)
        ctx = np.asarray(context_tokens, dtype=float)
        if (b < 0).any() or (ctx < 0).any() or not (np.isfinite(b).all() and np.isfinite(ctx).all()):
            raise SpecError("batch", "batch sizes and context lengths must be finite and >= 0")
        m = self.model
        flops = 2.0 * m.matmul_params_active * b + 4.0 * m.layers * m.attn_width * ctx
        compute = flops / tp / (self.gpu.peak_flops * self.eff.decode_mfu)
        wb = np.vectorize(self._decode_weight_bytes, otypes=[float])(b) if m.is_moe else \
            np.full(b.shape, self._decode_weight_bytes(1.0))
        bytes_ = wb / tp + self.kv_bytes_per_token() * ctx / self._kv_shards(tp)
        memory = bytes_ / (self.gpu.hbm_bytes_per_s * self.eff.decode_hbm)
        out = np.maximum(compute, memory) + self._tp_comm_s(1.0, tp) * b
        return np.where(b > 0, out, 0.0)

    def prefill_s(self, batch: float, prompt_tokens: float, tp: int = 1) -> float:
        """Prefill of ``batch`` prompts of ``prompt_tokens`` tokens each (causal attention)."""
        _check_tp(tp)
        _check_nonneg(batch, "batch")
        _check_nonneg(prompt_tokens, "prompt_tokens")
        tokens = batch * prompt_tokens
        if tokens == 0:
            return 0.0
        m = self.model
        flops = 2.0 * m.matmul_params_active * tokens + 2.0 * m.layers * m.attn_width * batch * prompt_tokens ** 2
        compute = flops / tp / (self.gpu.peak_flops * self.eff.prefill_mfu)
        bytes_ = self._decode_weight_bytes(tokens) / tp + self.kv_bytes_per_token() * tokens / self._kv_shards(tp)
        memory = bytes_ / (self.gpu.hbm_bytes_per_s * self.eff.prefill_hbm)
        return max(compute, memory) + self._tp_comm_s(tokens, tp)

    # ---- training ----------------------------------------------------------------------------
    def train_flops(self, tokens: float, seq_len: float) -> float:
        """Forward + backward FLOPs for ``tokens`` tokens in sequences of ``seq_len`` (6N per token + attention)."""
        _check_nonneg(tokens, "tokens")
        _check_nonneg(seq_len, "seq_len")
        m = self.model
        return 6.0 * m.matmul_params_active * tokens + 6.0 * m.layers * m.attn_width * tokens * seq_len

    def train_compute_s(self, tokens: float, n_gpus: int, seq_len: float = 0.0) -> float:
        """Compute time of one training step over ``tokens`` tokens spread evenly on ``n_gpus`` GPUs."""
        if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
            raise SpecError("n_gpus", f"must be an integer >= 1, got {n_gpus!r}")
        return self.train_flops(tokens, seq_len) / (n_gpus * self.gpu.peak_flops * self.eff.train_mfu)
