"""GPU cost model (pure): how long prefill, decode, training and layout switches take for a model on a GPU.

Inference is costed **operator by operator**, the way the GPU runs it (vLLM's kernels, one layer after the
other), with figures calibrated against measured H100 profiles (Vidur's, ``agents/data/calibration.yaml``;
derivation and error tables in ``docs/costmodel.md``):

* a GEMM (QKV, O, gate/up, down, router, experts, LM head) takes
  ``floor + max(bytes / (HBM x hbm_eff), 2 (ceil(T / tile) tile + ramp) K N / (peak x mfu))``: a launch floor,
  then either streaming its weights (small batches) or its tensor-core work, with the token count ``T``
  rounded up to whole tiles and a per-kernel ramp (the staircase the profiles show);
* an element-wise kernel (RMSNorm, RoPE, SiLU-and-mul, residual add, embedding) takes
  ``floor + bytes / (HBM x hbm_eff)``;
* each tensor-parallel all-reduce (two per layer, Megatron style) takes
  ``latency(n) + 2 (n-1)/n x bytes / (busbw_frac(n) x NVLink)``, measured by NCCL on an 8xH100 DGX; on
  another GPU the latency stays and the bandwidth term scales with its NVLink (``docs/costmodel.md``);
* attention (not in the profiles) reads the KV cache at ``Efficiency.decode_hbm`` of HBM bandwidth;
* MoE: the router, then grouped expert GEMMs over the experts the batch touches (uniform routing); with
  expert parallelism ``ep`` the experts are sharded over ``ep`` GPUs and dispatch/combine are all-to-alls on
  NVLink with a latency floor.

Training stays a roofline (``6 N D`` at ``Efficiency.train_mfu``, end to end). Model shapes come from
``emulation/data/models.yaml`` and GPU figures from ``emulation/data/gpus.yaml`` (REFERENCE.md). KV capacity
follows the layout (weights per GPU, KV heads split or replicated across TP ranks, a reserve like vLLM's
``gpu_memory_utilization``); a layout switch costs the weight reshard and KV relocation over NVLink plus a
fixed part. Everything is in bytes, FLOPs and seconds; weights and KV cache in bf16 unless told otherwise.
Used by the emulator's agents (modelled GPU compute), the generation engine and RLSim.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import yaml

from emulation.validation import SpecError, from_dict, require
from emulation.workload import catalogue, read_catalogue

from .engineprofile import KERNELS, EngineBinding

# the calibration (the model and GPU catalogues: emulation/data)
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


def _require_nonneg(obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        require(math.isfinite(v) and v >= 0, n, f"must be a finite number >= 0, got {v}")


def _require_fraction(obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        require(0 < v <= 1, n, f"must be in (0, 1], got {v}")


@dataclass(frozen=True)
class GpuSpec:
    bf16_tflops: float
    hbm_gb: float
    hbm_gbps: float  # GB/s
    nvlink_gbps: float  # GB/s per GPU, one direction, nominal (efficiencies are applied on top)
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
    """What the calibration does not cover: assumptions, with documented defaults (docs/costmodel.md).

    The operators the H100 profiles measured (GEMMs, norms, RoPE, activation, add, all-reduces) take their
    figures from :class:`Calibration`; these fractions cover the rest.
    """

    decode_hbm: float = 0.70  # attention's KV-cache reads in decode (no attention profile: assumption)
    prefill_hbm: float = 0.70  # attention's KV reads/writes in prefill (assumption)
    decode_mfu: float = 0.50  # attention FLOPs in decode (assumption; negligible next to its KV reads)
    prefill_mfu: float = 0.50  # attention FLOPs in prefill (FlashAttention-class kernels; assumption)
    train_mfu: float = 0.35  # training end to end, TP all-reduces included (Megatron-style; assumption)
    nvlink: float = 0.80  # point-to-point / all-to-all on NVLink: H800 ~160 of 200 GB/s (DeepEP); H100
    #                       send/recv 358 of 450 GB/s (Vidur's profile, calibration.yaml p2p)

    def __post_init__(self) -> None:
        _require_fraction(self, "decode_hbm", "prefill_hbm", "decode_mfu", "prefill_mfu", "train_mfu", "nvlink")


@dataclass(frozen=True)
class KernelFit:
    """An element-wise kernel: ``floor_us + bytes / (HBM x hbm_eff)``."""

    floor_us: float
    hbm_eff: float

    def __post_init__(self) -> None:
        _require_nonneg(self, "floor_us")
        _require_fraction(self, "hbm_eff")


@dataclass(frozen=True)
class GemmFit:
    """A GEMM: ``floor + max(bytes / (HBM x hbm_eff), 2 (ceil(T/tile) tile + ramp) K N / (peak x mfu))``."""

    floor_us: float
    hbm_eff: float
    mfu: float
    tile_tokens: int
    ramp_tokens: float

    def __post_init__(self) -> None:
        _require_nonneg(self, "floor_us", "ramp_tokens")
        _require_fraction(self, "hbm_eff", "mfu")
        require(self.tile_tokens >= 1, "tile_tokens", f"must be >= 1, got {self.tile_tokens}")


@dataclass(frozen=True)
class CollectiveFit:
    """A collective on NVLink: ``latency_us`` plus bus bytes over ``busbw_frac`` x nominal NVLink."""

    latency_us: float
    busbw_frac: float

    def __post_init__(self) -> None:
        _require_nonneg(self, "latency_us")
        _require_fraction(self, "busbw_frac")


@dataclass(frozen=True)
class Calibration:
    """Measured kernel and collective figures (``agents/data/calibration.yaml``, each one cited there)."""

    source: str
    gemm: GemmFit
    norm: KernelFit
    rope: KernelFit
    act: KernelFit
    add: KernelFit
    embedding: KernelFit
    allreduce: dict[int, CollectiveFit]
    p2p: CollectiveFit
    layout_switch_fixed_s: float
    kv_reserve: float = 0.1

    def __post_init__(self) -> None:
        require(bool(self.allreduce), "allreduce", "needs at least one group size")
        for n in self.allreduce:
            require(n >= 2, f"allreduce.{n}", "group sizes must be >= 2")
        _require_nonneg(self, "layout_switch_fixed_s")
        require(0 <= self.kv_reserve < 1, "kv_reserve", f"must be in [0, 1), got {self.kv_reserve}")

    def allreduce_fit(self, n: int) -> CollectiveFit:
        """The fit for a group of ``n`` GPUs: the smallest measured group >= n, else the largest measured."""
        sizes = sorted(self.allreduce)
        for s in sizes:
            if s >= n:
                return self.allreduce[s]
        return self.allreduce[sizes[-1]]


def _load_table(filename: str, cls: type, path: str | None):
    """A catalogue (emulation.workload.catalogue: the files the workload's names come from) as ``cls``
    entries, or the same format from ``path``."""
    raw = catalogue(filename) if path is None else read_catalogue(path, filename)
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


@lru_cache(maxsize=None)
def load_calibration(path: str | None = None) -> Calibration:
    p = path or os.path.join(DATA_DIR, "calibration.yaml")
    try:
        with open(p, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise SpecError("calibration", f"no such file: {p}") from None
    return from_dict(Calibration, raw, "calibration")


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


def _check_int(value: int, name: str, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpecError(name, f"must be an integer >= {low}, got {value!r}")


def _check_tp(tp: int) -> None:
    _check_int(tp, "tp")


def _check_nonneg(value: float, name: str) -> None:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise SpecError(name, f"must be a finite number >= 0, got {value!r}")


class _Ops:
    """Scalar (math) or array (numpy) versions of the few functions the formulas use: one formula, two types."""

    def __init__(self, maximum, ceil):
        self.maximum = maximum
        self.ceil = ceil


_SCALAR = _Ops(max, math.ceil)
_ARRAY = _Ops(np.maximum, np.ceil)


@dataclass(frozen=True)
class _Layout:
    """Per-GPU shapes of one (tp, ep) layout, computed once per CostModel and layout."""

    tp: int
    ep: int
    qr: float  # query heads per GPU
    kvr: float  # KV heads per GPU (replicated beyond kv_heads ranks)
    ffn_r: float  # dense FFN width per GPU
    experts_gpu: float  # routed experts held per GPU
    expert_ffn_r: float  # expert FFN width per GPU (split by TP when ep == 1)
    moe_tokens_mult: float  # tokens the MoE layer sees per replica token (attention-DP replicas sharing EP)


@dataclass(frozen=True)
class LayoutSwitch:
    """What a layout switch moves and costs, per GPU (every GPU of the server moves in parallel)."""

    weight_bytes: float  # weights each GPU receives over NVLink
    kv_bytes: float  # KV cache each GPU receives over NVLink
    relayout_bytes: float  # bytes each GPU rewrites locally (its new shards, read + write)
    transfer_s: float  # NVLink time of weight_bytes + kv_bytes (+ one point-to-point latency)
    relayout_s: float  # HBM time of relayout_bytes
    fixed_s: float  # the fixed part (communicators, allocator, CUDA graphs; calibration.yaml)
    total_s: float


@dataclass(frozen=True)
class SwitchPlan:
    """The parts of a layout switch that do not depend on the KV it keeps (:meth:`CostModel.switch_plan`):
    the weights each GPU receives, the KV shares, the NVLink and HBM rates. :meth:`at` is the rest of
    :meth:`CostModel.layout_switch`'s arithmetic, the same operations in the same order, so a planner that
    prices the same switch for many KV sizes does the layout part once."""

    w_recv: float  # weight bytes each GPU receives
    kv_bytes_per_token: float
    fa: float  # KV head fraction per GPU before / after
    fb: float
    ra: float  # replicas before / after
    rb: float
    weight_bytes_per_gpu: float  # after
    nv: float  # NVLink bytes/s at its efficiency
    latency_s: float  # one point-to-point latency
    hbm: float  # HBM bytes/s at the GEMMs' efficiency
    fixed_s: float

    def at(self, kv_tokens: float) -> LayoutSwitch:
        """The switch keeping ``kv_tokens`` tokens of running requests' KV cache."""
        return LayoutSwitch(*self._parts(kv_tokens))

    def total_s(self, kv_tokens: float) -> float:
        """``at(kv_tokens).total_s``."""
        return self._parts(kv_tokens)[-1]

    def _parts(self, kv_tokens: float) -> tuple:
        _check_nonneg(kv_tokens, "kv_tokens")
        kv = kv_tokens * self.kv_bytes_per_token
        kv_recv = max(0.0, self.fb * kv / self.rb - min(self.fa, self.fb) * kv / max(self.ra, self.rb))
        relayout = 2.0 * (self.weight_bytes_per_gpu + self.fb * kv / self.rb)
        w_recv = self.w_recv
        transfer = (self.latency_s + (w_recv + kv_recv) / self.nv) if (w_recv + kv_recv) > 0 else 0.0
        relayout_s = relayout / self.hbm
        return w_recv, kv_recv, relayout, transfer, relayout_s, self.fixed_s, transfer + relayout_s + self.fixed_s


class CostModel:
    """Timings of ``model`` on ``gpu``; all methods are pure functions of their arguments."""

    def __init__(self, model: ModelConfig, gpu: GpuSpec, eff: Efficiency = Efficiency(),
                 dtype_bytes: int = BF16, grad_dtype_bytes: int = BF16, calib: Calibration | None = None,
                 engine: EngineBinding | None = None):
        self.model = model
        self.gpu = gpu
        self.eff = eff
        self.dtype_bytes = dtype_bytes
        self.grad_dtype_bytes = grad_dtype_bytes
        self.calib = calib if calib is not None else load_calibration()
        # the serving engine's per-step terms (agents/engineprofile.py); None or the kernels profile: the
        # kernels alone (what the GPU runs back to back)
        self.engine = engine if engine is not None and not engine.kernels_only else None
        self._binding = engine
        self._layouts: dict[tuple[int, int], _Layout] = {}

    @classmethod
    def for_names(cls, model: str, gpu: str, eff: Efficiency = Efficiency(),
                  calib: Calibration | None = None, engine: EngineBinding | None = None) -> "CostModel":
        return cls(get_model(model), get_gpu(gpu), eff, calib=calib, engine=engine)

    @classmethod
    def for_engine(cls, model: str, gpu: str, settings) -> "CostModel":
        """The cost model a generation engine with ``settings`` (emulation.orchestration.EngineSettings: its
        ``profile`` and knobs) runs on."""
        return cls.for_names(model, gpu, engine=EngineBinding.of(settings))

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
        """K and V of one token over all layers (all heads: the bytes a migration moves)."""
        return float(2 * self.model.layers * self.model.kv_width * self.dtype_bytes)

    def _layout(self, tp: int, ep: int = 1) -> _Layout:
        key = (tp, ep)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        _check_tp(tp)
        _check_int(ep, "ep")
        m = self.model
        if ep > 1:
            if not m.is_moe:
                raise SpecError("ep", f"expert parallelism needs a MoE model; {m.name or 'this model'} is dense")
            if ep % tp:
                raise SpecError("ep", f"must be 1 or a multiple of tp ({tp}), got {ep}")
            if m.experts % ep:
                raise SpecError("ep", f"must divide the {m.experts} experts, got {ep}")
        lay = _Layout(
            tp=tp, ep=ep, qr=m.q_heads / tp, kvr=max(m.kv_heads / tp, 1.0), ffn_r=m.ffn / tp,
            experts_gpu=(m.experts / ep) if ep > 1 else float(m.experts),
            expert_ffn_r=float(m.expert_ffn) if ep > 1 else m.expert_ffn / tp,
            moe_tokens_mult=ep / tp if ep > 1 else 1.0)
        self._layouts[key] = lay
        return lay

    def kv_bytes_per_token_per_gpu(self, tp: int) -> float:
        """KV bytes one token occupies on each GPU of a ``tp`` replica: the KV heads are split across TP
        ranks; beyond ``kv_heads`` ranks each rank holds one head (replicated)."""
        lay = self._layout(tp)
        return 2.0 * self.model.layers * lay.kvr * self.model.head_dim * self.dtype_bytes

    def weight_bytes_per_gpu(self, tp: int, ep: int = 1) -> float:
        """Weights one GPU holds in a ``tp`` replica (``ep`` > 1: routed experts sharded over ``ep`` GPUs).

        Q and O are split by TP, K and V by the KV heads (replicated beyond ``kv_heads`` ranks), the dense
        FFN, the vocabulary-parallel embedding and LM head by TP; norms and the router are replicated."""
        lay = self._layout(tp, ep)
        m = self.model
        d = m.head_dim
        attn = m.hidden * (2 * lay.qr * d + 2 * lay.kvr * d)
        if m.qkv_bias:
            attn += (lay.qr + 2 * lay.kvr) * d
        if m.is_moe:
            ffn = lay.experts_gpu * 3 * m.hidden * lay.expert_ffn_r + m.hidden * m.experts
        else:
            ffn = 3 * m.hidden * lay.ffn_r
        per_layer = attn + ffn + 2 * m.hidden
        emb = m.embedding_params / tp + m.hidden
        return (m.layers * per_layer + emb) * self.dtype_bytes

    def activation_bytes_per_gpu(self, tp: int, max_num_batched_tokens: int | None = None,
                                 max_num_seqs: int | None = None, ep: int = 1) -> float:
        """Peak activation workspace of a forward pass over ``max_num_batched_tokens`` tokens (what vLLM
        profiles before sizing its KV cache): one layer's live tensors (hidden states, QKV, FFN input and
        output, bf16) plus fp32 logits for ``max_num_seqs`` tokens (engines compute logits only for the
        tokens they sample). Left out, the engine's: ``max_num_seqs`` sequences' logits (vLLM's profiling pass;
        the kernels profile keeps 256), ``max_num_batched_tokens`` (8192 without an engine)."""
        lay = self._layout(tp, ep)
        b = self._binding
        if max_num_batched_tokens is None:
            max_num_batched_tokens = b.max_num_batched_tokens if b is not None else 8192
        if max_num_seqs is None:
            max_num_seqs = b.activation_seqs if b is not None else 256
        _check_int(max_num_batched_tokens, "max_num_batched_tokens")
        _check_int(max_num_seqs, "max_num_seqs")
        m = self.model
        width = m.experts_per_token * lay.expert_ffn_r if m.is_moe else lay.ffn_r
        per_token = 4 * m.hidden + (lay.qr + 2 * lay.kvr) * m.head_dim + 3 * width
        return max_num_batched_tokens * per_token * self.dtype_bytes + max_num_seqs * m.vocab / tp * 4

    def kv_capacity_tokens(self, tp: int, reserve: float | None = None, *, ep: int = 1,
                           max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None) -> float:
        """Tokens of KV cache a ``tp`` replica can hold: HBM x (1 - ``reserve``) minus the weights and the
        activation workspace per GPU, over the KV bytes per token per GPU. ``reserve`` is
        ``1 - gpu_memory_utilization`` (vLLM's default 0.9: reserve 0.1, calibration.yaml ``kv_reserve``).
        The workspace follows the engine's ``max_num_seqs`` and ``max_num_batched_tokens`` unless given
        (:meth:`activation_bytes_per_gpu`). 0 when the weights alone do not fit."""
        if reserve is None:
            reserve = self.calib.kv_reserve
        if isinstance(reserve, bool) or not (isinstance(reserve, (int, float)) and 0 <= reserve < 1):
            raise SpecError("reserve", f"must be in [0, 1), got {reserve!r}")
        free = (self.gpu.hbm_gb * 1e9 * (1 - reserve) - self.weight_bytes_per_gpu(tp, ep)
                - self.activation_bytes_per_gpu(tp, max_num_batched_tokens, max_num_seqs, ep))
        return max(0.0, free) / self.kv_bytes_per_token_per_gpu(tp)

    # ---- kernels ----------------------------------------------------------------------------
    def _gemm(self, tokens, k: float, n: float, xp: _Ops, count: float = 1.0):
        """``count`` GEMMs of ``tokens`` x ``k`` by ``k`` x ``n`` (one grouped kernel when count > 1)."""
        g = self.calib.gemm
        dt = self.dtype_bytes
        mem = count * (k * n + tokens * (k + n)) * dt / (self.gpu.hbm_bytes_per_s * g.hbm_eff)
        # tokens padded to whole tiles where the batch spans tiles (the profiles' staircase above 128 tokens);
        # a batch within one tile runs a small-M kernel (no padding: on H100 such a GEMM is bound by its
        # weights either way, on A100's 3x lower FLOP/byte a padded 128-row tile would make decode look
        # compute-bound)
        padded = xp.maximum(tokens, xp.ceil(tokens / g.tile_tokens) * g.tile_tokens * (tokens > g.tile_tokens))
        comp = 2.0 * count * (padded + g.ramp_tokens) * k * n / (self.gpu.peak_flops * g.mfu)
        return g.floor_us * 1e-6 + xp.maximum(mem, comp)

    def _elementwise(self, nbytes, fit: KernelFit):
        return fit.floor_us * 1e-6 + nbytes / (self.gpu.hbm_bytes_per_s * fit.hbm_eff)

    def allreduce_s(self, nbytes, n: int):
        """A ring all-reduce of ``nbytes`` over ``n`` GPUs on NVLink (0 for n = 1)."""
        if n <= 1:
            return 0.0 * nbytes
        f = self.calib.allreduce_fit(n)
        return f.latency_us * 1e-6 + 2.0 * (n - 1) / n * nbytes / (f.busbw_frac * self.gpu.nvlink_bytes_per_s)

    def _allgather_s(self, nbytes, n: int):
        if n <= 1:
            return 0.0 * nbytes
        f = self.calib.allreduce_fit(n)
        return f.latency_us * 1e-6 + (n - 1) / n * nbytes / (f.busbw_frac * self.gpu.nvlink_bytes_per_s)

    def _alltoall_s(self, nbytes_out, n: int):
        """An all-to-all in which each GPU sends ``nbytes_out`` to the others: the NCCL latency floor of an
        ``n``-GPU collective plus the bytes at ``Efficiency.nvlink`` of nominal NVLink."""
        f = self.calib.allreduce_fit(n)
        return f.latency_us * 1e-6 + nbytes_out / (self.gpu.nvlink_bytes_per_s * self.eff.nvlink)

    # ---- one forward pass, operator by operator -------------------------------------------------
    def _terms(self, tokens, attn_s, kv_write, lm_tokens, lay: _Layout, xp: _Ops) -> dict:
        """Seconds per operator for one forward pass of ``tokens`` tokens (all layers), per GPU.

        ``attn_s`` is one layer's attention kernel time beyond its launch floor, ``kv_write`` the KV bytes
        it writes (per GPU); ``lm_tokens`` the tokens that get logits. Keys follow Vidur's operator names."""
        m = self.model
        c = self.calib
        dt = self.dtype_bytes
        h = m.hidden
        d = m.head_dim
        L = m.layers
        tp = lay.tp
        t = {}
        t["emb"] = self._elementwise(2.0 * tokens * h * dt, c.embedding)
        t["input_layernorm"] = L * self._elementwise(2.0 * tokens * h * dt, c.norm)
        t["attn_pre_proj"] = L * self._gemm(tokens, h, (lay.qr + 2 * lay.kvr) * d, xp)
        t["attn_rope"] = L * self._elementwise(2.0 * tokens * (lay.qr + lay.kvr) * d * dt, c.rope)
        t["attention"] = L * (c.gemm.floor_us * 1e-6 + attn_s + self._elementwise(kv_write, c.rope))
        t["attn_post_proj"] = L * self._gemm(tokens, lay.qr * d, h, xp)
        t["post_attention_layernorm"] = L * self._elementwise(2.0 * tokens * h * dt, c.norm)
        act_bytes = tokens * h * dt
        if m.is_moe:
            E, k = m.experts, m.experts_per_token
            fe = lay.expert_ffn_r
            moe_tokens = tokens * lay.moe_tokens_mult  # tokens the expert group serves
            touched = lay.experts_gpu * (1.0 - (1.0 - k / E) ** moe_tokens)
            pairs = moe_tokens * k / (lay.ep if lay.ep > 1 else 1)  # (token, expert) pairs on this GPU
            per_expert = pairs / xp.maximum(touched, 1e-12)
            t["moe_router"] = L * (self._gemm(tokens, h, E, xp) + self._elementwise(tokens * E * 4.0, c.act))
            t["mlp_up_proj"] = L * self._gemm(per_expert, h, 2 * fe, xp, count=touched)
            t["mlp_act"] = L * self._elementwise(3.0 * pairs * fe * dt, c.act)
            t["mlp_down_proj"] = L * self._gemm(per_expert, fe, h, xp, count=touched)
            if lay.ep > 1:
                out = tokens / tp * k * h * dt * (lay.ep - 1) / lay.ep  # each GPU dispatches 1/tp of its tokens
                t["moe_dispatch_combine"] = L * 2 * self._alltoall_s(out, lay.ep)
                t["allreduce"] = L * (self.allreduce_s(act_bytes, tp) + self._allgather_s(act_bytes, tp))
            else:
                t["allreduce"] = L * 2 * self.allreduce_s(act_bytes, tp)
        else:
            t["mlp_up_proj"] = L * self._gemm(tokens, h, 2 * lay.ffn_r, xp)
            t["mlp_act"] = L * self._elementwise(3.0 * tokens * lay.ffn_r * dt, c.act)
            t["mlp_down_proj"] = L * self._gemm(tokens, lay.ffn_r, h, xp)
            t["allreduce"] = L * 2 * self.allreduce_s(act_bytes, tp)
        t["add"] = L * self._elementwise(3.0 * tokens * h * dt, c.add)
        t["final_norm"] = self._elementwise(2.0 * tokens * h * dt, c.norm)
        t["lm_head"] = self._gemm(lm_tokens, h, m.vocab / tp, xp)
        t["logits_gather"] = self._allgather_s(lm_tokens * m.vocab * dt, tp)
        return t

    def _decode_terms(self, batch, context_tokens, lay: _Layout, xp: _Ops) -> dict:
        m = self.model
        dt = self.dtype_bytes
        kv_gpu = 2.0 * lay.kvr * m.head_dim * dt  # one token, one layer, this GPU
        read = context_tokens * kv_gpu + 2.0 * batch * lay.qr * m.head_dim * dt
        flops = 4.0 * context_tokens * lay.qr * m.head_dim
        attn_s = xp.maximum(read / (self.gpu.hbm_bytes_per_s * self.eff.decode_hbm),
                            flops / (self.gpu.peak_flops * self.eff.decode_mfu))
        return self._terms(batch, attn_s, batch * kv_gpu, batch, lay, xp)

    def decode_breakdown(self, batch: float, context_tokens: float, tp: int = 1, ep: int = 1) -> dict[str, float]:
        """:meth:`decode_step_s` split by operator (seconds per step, all layers): Vidur's operator names
        plus ``attention``, ``allreduce`` (both TP all-reduces), ``moe_*``, ``lm_head``, ``logits_gather``,
        and with an engine profile ``eager_launch`` (what a step launched kernel by kernel waits beyond its
        kernels) and ``engine_cpu`` (the engine's CPU time the GPU does not hide)."""
        _check_nonneg(batch, "batch")
        _check_nonneg(context_tokens, "context_tokens")
        lay = self._layout(tp, ep)
        if batch == 0:
            return {}
        out = {k: float(v) for k, v in self._decode_terms(float(batch), float(context_tokens), lay, _SCALAR).items()}
        if self.engine is not None:
            gpu = sum(out.values())
            side = self._gpu_side(gpu, float(batch), float(context_tokens), float(batch), 0.0, tp, _SCALAR)
            out["eager_launch"] = side - gpu
            out["engine_cpu"] = self.engine_step_s(gpu, float(batch), float(context_tokens), float(batch), 0.0, tp) - side
        return out

    # ---- the serving engine's terms (agents/engineprofile.py) -------------------------------------
    def _gpu_side(self, gpu, batch, ctx, tokens, prefill_tokens, tp: int, xp: _Ops):
        """The step's GPU side: its kernels, or, launched eagerly (above the engine's CUDA-graph cap, a prefill
        where graphs do not cover one, a context past the capture limit), no less than launching them."""
        e = self.engine
        p = e.profile
        eager = tokens > e.graph_cap(tp)
        if not p.graph_mixed:
            eager = eager | (prefill_tokens > 0)
        if p.graph_max_context:  # vLLM V0: any sequence past max_seq_len_to_capture (here: the batch's mean)
            eager = eager | (ctx > p.graph_max_context * batch)
        launch = self.model.layers * p.eager_layer_us * 1e-6
        if xp is _SCALAR:
            return max(gpu, launch) if eager else gpu
        return np.where(eager, np.maximum(gpu, launch), gpu)

    def engine_step_s(self, gpu, batch, ctx, tokens, prefill_tokens, tp: int, xp: _Ops = _SCALAR):
        """A step of the engine whose kernels take ``gpu`` seconds: ``batch`` running sequences over ``ctx``
        cached tokens in all, ``tokens`` computed in the step, ``prefill_tokens`` of them a prefill chunk. Its GPU
        side (:meth:`_gpu_side`) and the engine's CPU time, overlapped (``max``) or in series (``+``) as the
        engine runs them. Without an engine profile: ``gpu``."""
        e = self.engine
        if e is None:
            return gpu
        side = self._gpu_side(gpu, batch, ctx, tokens, prefill_tokens, tp, xp)
        cpu = e.cpu_s(batch, tp, prefill_tokens)
        if e.profile.overlap:
            return xp.maximum(side, cpu)
        return side + cpu

    # ---- inference ---------------------------------------------------------------------------
    def kernel_decode_step_s(self, batch: float, context_tokens: float, tp: int = 1, ep: int = 1) -> float:
        """The kernels of one decode step alone (what the H100 profiles calibrate; no engine terms)."""
        _check_nonneg(batch, "batch")
        _check_nonneg(context_tokens, "context_tokens")
        lay = self._layout(tp, ep)
        if batch == 0:
            return 0.0
        return float(sum(self._decode_terms(float(batch), float(context_tokens), lay, _SCALAR).values()))

    def decode_step_s(self, batch: float, context_tokens: float, tp: int = 1, ep: int = 1) -> float:
        """One decode step (one new token for each of ``batch`` sequences) of one replica of ``tp`` GPUs, as the
        engine runs it (its kernels, then :meth:`engine_step_s`).

        ``context_tokens`` is the total KV length over the batch (sum of each sequence's tokens so far).
        ``ep`` > 1 (MoE only, a multiple of ``tp``): routed experts sharded over ``ep`` GPUs, shared by
        ``ep / tp`` equally loaded replicas (attention data-parallel), dispatch/combine on NVLink.
        """
        gpu = self.kernel_decode_step_s(batch, context_tokens, tp, ep)
        if batch == 0 or self.engine is None:
            return gpu
        return float(self.engine_step_s(gpu, float(batch), float(context_tokens), float(batch), 0.0, tp))

    def decode_step_s_array(self, batch: np.ndarray, context_tokens: np.ndarray, tp: int = 1,
                            ep: int = 1) -> np.ndarray:
        """Vectorised :meth:`decode_step_s` over arrays of batch sizes and total KV lengths."""
        lay = self._layout(tp, ep)
        b = np.asarray(batch, dtype=float)
        ctx = np.asarray(context_tokens, dtype=float)
        if not (np.isfinite(b).all() and np.isfinite(ctx).all()) or (b < 0).any() or (ctx < 0).any():
            raise SpecError("batch", "batch sizes and context lengths must be finite and >= 0")
        b, ctx = np.broadcast_arrays(b, ctx)
        safe = np.where(b > 0, b, 1.0)
        out = sum(self._decode_terms(safe, ctx, lay, _ARRAY).values())
        if self.engine is not None:
            out = self.engine_step_s(out, safe, ctx, safe, 0.0, tp, _ARRAY)
        return np.where(b > 0, out, 0.0)

    def step_s(self, n_decode: float, decode_ctx: float, prefill_tokens: float, prefill_seqs: float,
               tp: int = 1, ep: int = 1, prefill_pairs: float | None = None) -> float:
        """One engine step as vLLM and SGLang run chunked prefill: ``n_decode`` sequences decode one token over
        ``decode_ctx`` cached tokens in all, and ``prefill_tokens`` prompt tokens of ``prefill_seqs`` sequences
        are prefilled, in ONE forward pass: every GEMM, norm and TP all-reduce runs over all the step's tokens
        (the chunk's activations are all-reduced with the decodes'), attention reads the decodes' caches and
        computes the chunks' causal scores, and the engine's terms apply to the whole step.

        ``prefill_pairs``: the chunks' attention (query, key) pairs, ``sum(chunk x (offset + chunk / 2))`` over
        the sequences, where ``offset`` is what a sequence had computed before the chunk (a later chunk of a
        long prompt, or a preempted request's recompute, attends to everything before it); None: each chunk
        starts its prompt (``prefill_tokens x per-sequence chunk / 2``)."""
        for name, v in (("n_decode", n_decode), ("decode_ctx", decode_ctx), ("prefill_tokens", prefill_tokens),
                        ("prefill_seqs", prefill_seqs)):
            _check_nonneg(v, name)
        lay = self._layout(tp, ep)
        tokens = float(n_decode) + float(prefill_tokens)
        if tokens == 0:
            return 0.0
        m = self.model
        dt = self.dtype_bytes
        kv_gpu = 2.0 * lay.kvr * m.head_dim * dt
        attn = 0.0
        if n_decode:
            read = decode_ctx * kv_gpu + 2.0 * n_decode * lay.qr * m.head_dim * dt
            attn += max(read / (self.gpu.hbm_bytes_per_s * self.eff.decode_hbm),
                        4.0 * decode_ctx * lay.qr * m.head_dim / (self.gpu.peak_flops * self.eff.decode_mfu))
        if prefill_tokens:
            seqs = max(1.0, float(prefill_seqs))
            pairs = prefill_tokens * (prefill_tokens / seqs) / 2.0 if prefill_pairs is None else float(prefill_pairs)
            prefix = max(0.0, pairs / prefill_tokens - prefill_tokens / seqs / 2.0) * prefill_tokens  # keys read
            read = (prefill_tokens + prefix) * kv_gpu + 2.0 * prefill_tokens * lay.qr * m.head_dim * dt
            attn += max(read / (self.gpu.hbm_bytes_per_s * self.eff.prefill_hbm),
                        4.0 * pairs * lay.qr * m.head_dim / (self.gpu.peak_flops * self.eff.prefill_mfu))
        lm = float(n_decode) + float(prefill_seqs)
        gpu = float(sum(self._terms(tokens, attn, tokens * kv_gpu, lm, lay, _SCALAR).values()))
        if self.engine is None:
            return gpu
        return float(self.engine_step_s(gpu, float(n_decode) + float(prefill_seqs), float(decode_ctx), tokens,
                                        float(prefill_tokens), tp))

    def prefill_s(self, batch: float, prompt_tokens: float, tp: int = 1, ep: int = 1) -> float:
        """Prefill of ``batch`` prompts of ``prompt_tokens`` tokens each in one step (causal attention; logits
        only for each prompt's last token, as serving engines compute them): :meth:`step_s` with no decodes."""
        _check_nonneg(batch, "batch")
        _check_nonneg(prompt_tokens, "prompt_tokens")
        return self.step_s(0.0, 0.0, float(batch) * float(prompt_tokens), float(batch), tp, ep)

    # ---- layout switch ------------------------------------------------------------------------
    def layout_switch(self, from_tp: int, to_tp: int, kv_tokens: float, *, from_ep: int = 1, to_ep: int = 1,
                      gpus: int = 8, fixed_s: float | None = None) -> LayoutSwitch:
        """A server of ``gpus`` GPUs going from ``gpus/from_tp`` replicas of TP ``from_tp`` to ``gpus/to_tp``
        replicas of TP ``to_tp`` (MoE: experts over ``from_ep`` -> ``to_ep`` GPUs), keeping ``kv_tokens``
        tokens of running requests' KV cache.

        GPUs are placed so that shards nest (GPU g holds shard ``g // replicas``; TP sizes are powers of two):
        a GPU receives only what its new shards add to what it holds. Weights: the dense part by TP, the
        routed experts as (expert subset x FFN slice) rectangles. KV: each GPU keeps the heads it had of the
        requests that stay on its replica. All GPUs receive in parallel over NVLink at ``Efficiency.nvlink``;
        each then rewrites its new shards locally (HBM), and the fixed part (calibration.yaml) is added."""
        plan = self.switch_plan(from_tp, to_tp, from_ep=from_ep, to_ep=to_ep, gpus=gpus, fixed_s=fixed_s,
                                kv_tokens=kv_tokens)
        return LayoutSwitch(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0) if plan is None else plan.at(kv_tokens)

    def switch_plan(self, from_tp: int, to_tp: int, *, from_ep: int = 1, to_ep: int = 1, gpus: int = 8,
                    fixed_s: float | None = None, kv_tokens: float = 0.0) -> SwitchPlan | None:
        """:meth:`layout_switch`'s arguments checked and its parts that do not depend on the KV (None: the same
        layout, no switch); ``kv_tokens`` is only checked (in :meth:`layout_switch`'s order)."""
        for name, v in (("from_tp", from_tp), ("to_tp", to_tp), ("from_ep", from_ep), ("to_ep", to_ep),
                        ("gpus", gpus)):
            _check_int(v, name)
        _check_nonneg(kv_tokens, "kv_tokens")
        for name, v in (("from_tp", from_tp), ("to_tp", to_tp), ("from_ep", from_ep), ("to_ep", to_ep)):
            if v & (v - 1) or gpus % v:
                raise SpecError(name, f"must be a power of two dividing gpus ({gpus}), got {v}")
        if fixed_s is None:
            fixed_s = self.calib.layout_switch_fixed_s
        _check_nonneg(fixed_s, "fixed_s")
        self._layout(from_tp, from_ep)
        self._layout(to_tp, to_ep)
        if (from_tp, from_ep) == (to_tp, to_ep):
            return None
        m = self.model
        experts_bytes = m.layers * m.experts * m.expert_params * self.dtype_bytes
        dense_bytes = self.weight_bytes() - experts_bytes

        def expert_rect(tp, ep):  # (fraction of the experts, fraction of each expert's FFN) per GPU
            return (1.0 / ep, 1.0) if ep > 1 else (1.0, 1.0 / tp)

        (ea, sa), (eb, sb) = expert_rect(from_tp, from_ep), expert_rect(to_tp, to_ep)
        w_recv = dense_bytes * max(0.0, 1.0 / to_tp - 1.0 / from_tp) + experts_bytes * (eb * sb - min(ea, eb) * min(sa, sb))
        # the KV part (SwitchPlan.at): each GPU keeps the heads it had of the requests that stay on its replica
        return SwitchPlan(w_recv, self.kv_bytes_per_token(),
                          1.0 / min(from_tp, m.kv_heads), 1.0 / min(to_tp, m.kv_heads),  # head fraction per GPU
                          gpus / from_tp, gpus / to_tp,  # replicas
                          self.weight_bytes_per_gpu(to_tp, to_ep), self.gpu.nvlink_bytes_per_s * self.eff.nvlink,
                          self.calib.p2p.latency_us * 1e-6, self.gpu.hbm_bytes_per_s * self.calib.gemm.hbm_eff,
                          float(fixed_s))

    def layout_switch_s(self, from_tp: int, to_tp: int, kv_tokens: float, *, from_ep: int = 1, to_ep: int = 1,
                        gpus: int = 8, fixed_s: float | None = None) -> float:
        """Seconds a layout switch takes (:meth:`layout_switch`'s ``total_s``)."""
        return self.layout_switch(from_tp, to_tp, kv_tokens, from_ep=from_ep, to_ep=to_ep, gpus=gpus,
                                  fixed_s=fixed_s).total_s

    # ---- training ----------------------------------------------------------------------------
    def train_flops(self, tokens: float, seq_len: float) -> float:
        """Forward + backward FLOPs for ``tokens`` tokens in sequences of ``seq_len`` (6N per token + attention)."""
        _check_nonneg(tokens, "tokens")
        _check_nonneg(seq_len, "seq_len")
        m = self.model
        return 6.0 * m.matmul_params_active * tokens + 6.0 * m.layers * m.attn_width * tokens * seq_len

    def train_compute_s(self, tokens: float, n_gpus: int, seq_len: float = 0.0) -> float:
        """Compute time of one training step over ``tokens`` tokens spread evenly on ``n_gpus`` GPUs."""
        _check_int(n_gpus, "n_gpus")
        return self.train_flops(tokens, seq_len) / (n_gpus * self.gpu.peak_flops * self.eff.train_mfu)
