"""Serving-engine profiles (pure): what an engine spends on a step beyond its GPU kernels.

The cost model (agents/costmodel.py) times a forward pass kernel by kernel. A serving engine also runs its
scheduler, prepares inputs, samples and processes outputs on one CPU process every step, launches each kernel
from the CPU where a step is not captured in a CUDA graph, and either overlaps that CPU work with the GPU
(SGLang's overlap scheduler, vLLM V1's asynchronous scheduling from 0.14) or not (vLLM V0, V1 before 0.14).
How much, by engine, is ``emulation/data/engines.yaml`` (every figure cited or marked assumed there); which
one a run uses is the scenario's ``orchestrator.engine.profile`` (``vllm-v1`` by default; ``kernels`` is the
kernels-only model of before, kept for side-by-side figures).

A profile is bound to the engine settings it runs with (:class:`EngineBinding`): vLLM's CUDA-graph cap follows
``max_num_seqs`` and its KV sizing counts ``max_num_seqs`` sequences' logits. The cost model applies the
binding in :meth:`agents.costmodel.CostModel.engine_step_s` (docs/costmodel.md "The engine step").
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from emulation.validation import SpecError, from_dict, require
from emulation.workload import catalogue, read_catalogue

DEFAULT_PROFILE = "vllm-v1"
KERNELS = "kernels"  # the kernels-only profile


@dataclass(frozen=True)
class EngineProfile:
    """One engine's per-step terms (engines.yaml; units in the names)."""

    engine: str
    cpu_base_ms: float
    cpu_per_seq_us: float
    cpu_per_prefill_token_us: float
    cpu_tp_ms: float
    overlap: bool
    graph_max_tokens: int  # 0: every step runs as a graph
    graph_per_seq: int  # > 0: the cap is at most this x max_num_seqs (vLLM's rule)
    graph_mixed: bool  # steps with a prefill chunk run as graphs too (below the cap)
    eager_layer_us: float  # CPU time to launch one layer's kernels eagerly (the launch-bound floor per layer)
    graph_max_tokens_tp4: int | None = None  # SGLang: a larger cap from TP 4
    graph_max_context: int | None = None  # vLLM V0: eager once a sequence's context passes it
    kv_activation_seqs: int | None = None  # logits rows the KV sizing reserves (None: max_num_seqs)
    name: str = ""

    def __post_init__(self) -> None:
        for n in ("cpu_base_ms", "cpu_per_seq_us", "cpu_per_prefill_token_us", "cpu_tp_ms", "eager_layer_us"):
            v = getattr(self, n)
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0, n,
                    f"must be a finite number >= 0, got {v!r}")
        for n in ("graph_max_tokens", "graph_per_seq"):
            v = getattr(self, n)
            require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, n, f"must be an integer >= 0, got {v!r}")
        for n in ("graph_max_tokens_tp4", "graph_max_context", "kv_activation_seqs"):
            v = getattr(self, n)
            require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), n,
                    f"must be an integer >= 1 or null, got {v!r}")


@lru_cache(maxsize=None)
def load_profiles(path: str | None = None) -> dict[str, EngineProfile]:
    """Every profile of ``emulation/data/engines.yaml`` (or the same format at ``path``)."""
    raw = catalogue("engines.yaml") if path is None else read_catalogue(path, "engines.yaml")
    out = {}
    for k, v in raw.items():
        if not isinstance(v, dict):
            raise SpecError(k, "must be a mapping")
        out[k] = from_dict(EngineProfile, {**v, "name": k}, k)
    return out


_SWEEP: dict[str, EngineProfile] = {}  # profiles replaced for a sweep (:func:`swept`)


@contextlib.contextmanager
def swept(name: str, **figures):
    """Inside the block, profile ``name`` has ``figures`` in place of its own (a benchmark's sweep of an
    assumed figure, testbed/benchmarks/bench_engine_sweep.py; results cached by scenario must not be reused)."""
    old = _SWEEP.get(name)
    _SWEEP[name] = dataclasses.replace(get_profile(name), **figures)
    try:
        yield _SWEEP[name]
    finally:
        if old is None:
            _SWEEP.pop(name, None)
        else:
            _SWEEP[name] = old


def profile_names() -> tuple[str, ...]:
    return tuple(load_profiles())


def get_profile(name: str) -> EngineProfile:
    if name in _SWEEP:
        return _SWEEP[name]
    profiles = load_profiles()
    if name not in profiles:
        raise SpecError("profile", f"unknown engine profile {name!r} (known: {', '.join(profiles)})")
    return profiles[name]


@dataclass(frozen=True)
class EngineBinding:
    """A profile with the engine settings it runs at (vLLM's names)."""

    profile: EngineProfile
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    @classmethod
    def of(cls, settings) -> "EngineBinding":
        """From an :class:`emulation.orchestration.EngineSettings` (its ``profile`` and knobs)."""
        return cls(get_profile(settings.profile), settings.max_num_seqs, settings.max_num_batched_tokens)

    @property
    def kernels_only(self) -> bool:
        return self.profile.name == KERNELS

    @property
    def activation_seqs(self) -> int:
        """The sequences whose logits the KV sizing's profiling pass reserves (vLLM: max_num_seqs)."""
        return self.profile.kv_activation_seqs or self.max_num_seqs

    def graph_cap(self, tp: int) -> float:
        """Most tokens a step may have and still run as a CUDA graph (inf: every step)."""
        p = self.profile
        if p.graph_max_tokens == 0:
            return math.inf
        cap = p.graph_max_tokens_tp4 if (p.graph_max_tokens_tp4 and tp >= 4) else p.graph_max_tokens
        if p.graph_per_seq:
            cap = min(cap, p.graph_per_seq * self.max_num_seqs)
        return float(min(cap, self.max_num_batched_tokens))

    def cpu_s(self, running, tp: int, prefill_tokens=0.0):
        """The engine's CPU time of one step with ``running`` sequences in the batch (seconds)."""
        p = self.profile
        return (p.cpu_base_ms + (p.cpu_tp_ms if tp > 1 else 0.0)) * 1e-3 + p.cpu_per_seq_us * 1e-6 * running \
            + p.cpu_per_prefill_token_us * 1e-6 * prefill_tokens
