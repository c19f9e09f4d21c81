"""WorkloadSpec: the RL post-training workload, shared by the emulator, the orchestrator and RLSim.

One spec drives every backend: which model (a key of ``agents/data/models.yaml``), which GPU (a key of
``agents/data/gpus.yaml``), how big a step is (prompts x samples), how long responses are, and how the
model is parallelised for rollout and for training. Defaults and their sources are in REFERENCE.md
(/work/shared/REFERENCE.md, "RL workloads"); each default below says where it comes from.

Response lengths are drawn from a lognormal (median, sigma) clipped to ``[1, max_response_tokens]``, with
an optional spike of ``cap_fraction`` of the responses exactly at the cap (truncated responses). The
lognormal is an *assumption*: REFERENCE.md reports a heavy right tail everywhere, not a demonstrated fit.

This module is pure (numpy only) and validated at the boundary with :func:`emulation.validation.from_dict`.
The model and GPU names are checked against the data files by the cost model (``agents.costmodel``), which
sits beside this package; here they are checked against the known names listed below so that a typo in
a scenario fails with the field name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .validation import require

# Names of the entries of agents/data/models.yaml and agents/data/gpus.yaml (kept in sync by a unit test).
MODEL_NAMES = ("Qwen2.5-7B", "Qwen2.5-14B", "Qwen2.5-32B", "Qwen2.5-72B", "Qwen3-30B-A3B", "Qwen3-235B-A22B")
GPU_NAMES = ("H100", "H800", "H200")


@dataclass(frozen=True)
class WorkloadSpec:
    # Model and GPU. Qwen2.5-7B: the smallest model of the RollPacker/veRL set-ups (REFERENCE.md "Batches").
    model: str = "Qwen2.5-7B"
    # H800: the GPU of DAPO, RollPacker and the OrchestrRL evaluation (REFERENCE.md "GPUs", "Batches").
    gpu: str = "H800"

    # Batch per RL step. 128 prompts x 8 samples: RollPacker (REFERENCE.md "Long tail").
    prompts_per_step: int = 128
    samples_per_prompt: int = 8
    # Prompt length in tokens: an assumption (REFERENCE.md gives no prompt-length figure; math/code
    # prompts are a few hundred tokens).
    prompt_tokens: int = 256

    # Response lengths. Median 460 tokens and log-sigma 0.93: the PolyTrace DAPO Qwen2.5-32B trace
    # (p50 439-486 per step, pooled log-sigma ~0.93; REFERENCE.md "RL workloads", derived figures).
    response_median_tokens: float = 460.0
    response_sigma: float = 0.93
    # Cap 16,384 tokens: RollPacker's and DeepCoder's 16k cap (DAPO uses 20,480).
    max_response_tokens: int = 16384
    # Fraction of responses truncated at the cap (a spike at max_response_tokens). 0 by default: PolyTrace
    # (20k cap) shows no spike; DeepCoder-14B with a 16k cap had 6-27% at the cap - set it for such runs.
    cap_fraction: float = 0.0

    # Rollout (generation) tensor parallelism: RollPacker uses TP 1/2/2 for 7B/14B/32B; DAPO/ORZ TP 4.
    rollout_tp: int = 1
    # Training parallelism. TP inside a server (NVLink), PP across servers, EP for MoE experts.
    # train_dp = 0: data parallelism fills the trainer GPUs (trainer GPUs / (tp * pp)).
    train_tp: int = 8
    train_pp: int = 1
    train_dp: int = 0
    train_ep: int = 1
    # Share of GPUs that generate, used when a backend re-sizes the cluster (RLSim --gpus); at the
    # scenario's own size the layout's pods decide. 0.5: veRL's rollout:train 16:16 .. 64:64.
    gen_fraction: float = 0.5

    # RL steps to run.
    steps: int = 1

    def __post_init__(self) -> None:
        require(self.model in MODEL_NAMES, "model", f"must be one of {', '.join(MODEL_NAMES)}, got {self.model!r}")
        require(self.gpu in GPU_NAMES, "gpu", f"must be one of {', '.join(GPU_NAMES)}, got {self.gpu!r}")
        for name in ("prompts_per_step", "samples_per_prompt", "prompt_tokens", "max_response_tokens",
                     "rollout_tp", "train_tp", "train_pp", "train_ep", "steps"):
            v = getattr(self, name)
            require(v >= 1, name, f"must be >= 1, got {v}")
        require(self.train_dp >= 0, "train_dp", f"must be >= 0 (0: fill the trainer GPUs), got {self.train_dp}")
        require(math.isfinite(self.response_median_tokens) and self.response_median_tokens >= 1,
                "response_median_tokens", f"must be >= 1, got {self.response_median_tokens}")
        require(self.response_median_tokens <= self.max_response_tokens, "response_median_tokens",
                f"must be <= max_response_tokens ({self.max_response_tokens}), got {self.response_median_tokens}")
        require(math.isfinite(self.response_sigma) and 0 <= self.response_sigma <= 5, "response_sigma",
                f"must be in [0, 5], got {self.response_sigma}")
        require(0 <= self.cap_fraction <= 1, "cap_fraction", f"must be in [0, 1], got {self.cap_fraction}")
        require(0 < self.gen_fraction < 1, "gen_fraction", f"must be in (0, 1), got {self.gen_fraction}")
        for name in ("rollout_tp", "train_tp"):
            v = getattr(self, name)
            require(v & (v - 1) == 0, name, f"must be a power of two, got {v}")

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def sample_lengths(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray:
        """``n`` response lengths (int64 tokens, default one step's samples) drawn with ``rng``.

        Lognormal(log(median), sigma), rounded, clipped to [1, max_response_tokens]; then each response
        independently hits the cap with probability ``cap_fraction``.
        """
        if n is None:
            n = self.samples_per_step
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        raw = rng.lognormal(mean=math.log(self.response_median_tokens), sigma=self.response_sigma, size=n)
        lengths = np.clip(np.rint(raw), 1, self.max_response_tokens).astype(np.int64)
        if self.cap_fraction > 0:
            lengths[rng.random(n) < self.cap_fraction] = self.max_response_tokens
        return lengths
