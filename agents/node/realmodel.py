"""Real-compute mode: a small Qwen2-like decoder in torch whose decode steps run for real.

Random weights (seeded), the Qwen2 layer: RMSNorm, grouped-query attention with rotary position embeddings
(RoPE) and a KV cache, a gated (SwiGLU) MLP, residual adds, a final norm and an LM head. Any size: tiny on
CPU in the unit tests; on a CUDA GPU it is the hardware-in-the-loop check of the cost model
(``tests/gpu/test_costmodel_gpu.py``), and the generation engine can use :meth:`RealDecoder.decode_step_s`
as its step timer instead of the cost model.

Timing: on CUDA the step is bracketed by CUDA events after a synchronise (device time of the step's kernels
and their launch gaps); on CPU by ``time.perf_counter``. Kernels run eagerly (no CUDA graphs, no fused
serving kernels), so at small shapes launch overhead weighs more than in vLLM (docs/costmodel.md).
The KV cache is a dense ``[layers, max_batch, kv_heads, max_seq_len, head_dim]`` tensor per K and V;
attention reads each batch slot up to the batch's longest context (shorter ones are masked), so a batch of
unequal lengths costs what its longest sequence costs.
"""
from __future__ import annotations

import copy

import time
from typing import Sequence

import torch
import torch.nn.functional as F

from agents.realcompute import DecoderConfig
from emulation.validation import SpecError


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RealDecoder:
    """A Qwen2-like decoder with random weights on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``...)."""

    def __init__(self, config: DecoderConfig, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 seed: int = 0):
        self.config = c = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise SpecError("device", "CUDA is not available on this machine")
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def w(*shape):
            return (torch.randn(*shape, generator=gen, device=self.device, dtype=torch.float32) * 0.02).to(self.dtype)

        qkv_out = (c.q_heads + 2 * c.kv_heads) * c.head_dim
        self.layers = []
        for _ in range(c.layers):
            self.layers.append({
                "ln1": torch.ones(c.hidden, device=self.device, dtype=self.dtype),
                "wqkv": w(qkv_out, c.hidden), "bqkv": w(qkv_out) if c.qkv_bias else None,
                "wo": w(c.hidden, c.q_heads * c.head_dim),
                "ln2": torch.ones(c.hidden, device=self.device, dtype=self.dtype),
                "w_gate_up": w(2 * c.ffn, c.hidden), "w_down": w(c.hidden, c.ffn)})
        self.embed = w(c.vocab, c.hidden)
        self.norm = torch.ones(c.hidden, device=self.device, dtype=self.dtype)
        self.lm_head = w(c.vocab, c.hidden)
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=self.device,
                                                              dtype=torch.float32) / c.head_dim))
        shape = (c.layers, c.max_batch, c.kv_heads, c.max_seq_len, c.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self._gen = gen

    # ---- pieces ---------------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [B, heads, S, d] by ``positions`` [B, S]."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [B, S, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, d]
        return (x * emb.cos().to(x.dtype) + _rotate_half(x) * emb.sin().to(x.dtype))

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_eps)

    def _qkv(self, layer: dict, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        B, S, _ = x.shape
        qkv = F.linear(self._rms(x, layer["ln1"]), layer["wqkv"], layer["bqkv"])
        q, k, v = qkv.split([c.q_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], dim=-1)
        q = q.view(B, S, c.q_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, S, c.kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, S, c.kv_heads, c.head_dim).transpose(1, 2)
        return self._rope(q, positions), self._rope(k, positions), v

    def _finish_layer(self, layer: dict, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        B, S = x.shape[:2]
        x = x + F.linear(attn.transpose(1, 2).reshape(B, S, -1), layer["wo"])
        gate, up = F.linear(self._rms(x, layer["ln2"]), layer["w_gate_up"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer["w_down"])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms(x, self.norm), self.lm_head)

    # ---- passes ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Causal forward over whole sequences ``tokens`` [B, S] without the cache: logits [B, S, vocab]."""
        return self._full(tokens, write_cache=False)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`forward`, also writing K and V of positions 0..S-1 into cache slots 0..B-1."""
        return self._full(tokens, write_cache=True)

    def _full(self, tokens: torch.Tensor, write_cache: bool) -> torch.Tensor:
        c = self.config
        tokens = tokens.to(self.device)
        if tokens.dim() != 2 or not 1 <= tokens.shape[0] <= c.max_batch or not 1 <= tokens.shape[1] <= c.max_seq_len:
            raise SpecError("tokens", f"must be [batch <= {c.max_batch}, length <= {c.max_seq_len}], got {list(tokens.shape)}")
        B, S = tokens.shape
        positions = torch.arange(S, device=self.device).expand(B, S)
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            if write_cache:
                self.k_cache[i, :B, :, :S] = k
                self.v_cache[i, :B, :, :S] = v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = self._finish_layer(layer, x, attn)
        return self._logits(x)

    def _check_lens(self, context_lens: Sequence[int]) -> list[int]:
        c = self.config
        lens = list(context_lens)
        if not 1 <= len(lens) <= c.max_batch:
            raise SpecError("context_lens", f"needs 1..{c.max_batch} sequences, got {len(lens)}")
        for i, n in enumerate(lens):
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < c.max_seq_len:
                raise SpecError(f"context_lens[{i}]", f"must be an integer in 0..{c.max_seq_len - 1}, got {n!r}")
        return lens

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, context_lens: Sequence[int]) -> torch.Tensor:
        """One decode step: sequence ``i`` (cache slot ``i``) has ``context_lens[i]`` tokens cached; its new
        token ``tokens[i]`` goes to position ``context_lens[i]`` and attends to positions 0..that one.
        Returns logits [B, vocab]."""
        lens = self._check_lens(context_lens)
        B = len(lens)
        tokens = tokens.to(self.device).reshape(-1)
        if tokens.shape[0] != B:
            raise SpecError("tokens", f"needs one token per sequence ({B}), got {tokens.shape[0]}")
        pos = torch.tensor(lens, device=self.device)
        span = max(lens) + 1
        mask = (torch.arange(span, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]  # [B,1,1,span]
        slots = torch.arange(B, device=self.device)
        x = self.embed[tokens][:, None, :]  # [B, 1, h]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, pos[:, None])
            self.k_cache[i, slots, :, pos] = k[:, :, 0]
            self.v_cache[i, slots, :, pos] = v[:, :, 0]
            attn = F.scaled_dot_product_attention(q, self.k_cache[i, :B, :, :span], self.v_cache[i, :B, :, :span],
                                                  attn_mask=mask, enable_gqa=True)
            x = self._finish_layer(layer, x, attn)
        return self._logits(x)[:, 0]

    def decode_step_s(self, context_lens: Sequence[int]) -> float:
        """Run one real decode step for ``len(context_lens)`` sequences with those cached lengths (random
        next tokens; the cache's content is whatever it holds) and return the measured seconds."""
        lens = self._check_lens(context_lens)
        tokens = torch.randint(0, self.config.vocab, (len(lens),), generator=self._gen, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.decode(tokens, lens)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        self.decode(tokens, lens)
        return time.perf_counter() - t0


class RealStepCost:
    """The generation engine's step timer in real-compute mode (agents.engine.StepCost): every decode step
    runs on a :class:`RealDecoder` and lasts what it measured. A batch larger than the decoder's slots runs in
    several real passes; contexts are the batch's mean length (capped at the decoder's cache). Prefill chunks,
    KV capacity and layout switches stay the cost model's (``cm``): the small decoder stands in for the
    serving kernels of one replica, whatever its layout."""

    def __init__(self, cfg: DecoderConfig, cm, gpus: int = 8, seed: int = 0, reinit_s: float | None = None):
        from agents.engine import ModelledCost

        self.config = cfg
        self.decoder = RealDecoder(cfg, cfg.device, getattr(torch, cfg.dtype), seed=seed)
        self.modelled = ModelledCost(cm, gpus, reinit_s)
        self.steps = 0

    def rebound(self, cm, gpus: int = 8, reinit_s: float | None = None) -> "RealStepCost":
        """The same decoder (its weights and caches stay on the device) with another cost model for what it
        does not run (an engine reset with new settings)."""
        from agents.engine import ModelledCost

        out = copy.copy(self)
        out.modelled = ModelledCost(cm, gpus, reinit_s)
        out.steps = 0
        return out

    def step_s(self, layout, n_decode: int, decode_ctx: float, prefill_tokens: int, prefill_seqs: int,
               prefill_pairs: float | None = None) -> float:
        t = 0.0
        if n_decode:
            c = self.config
            ctx = int(min(max(decode_ctx / n_decode, 0), c.max_seq_len - 1))
            left = int(n_decode)
            while left > 0:
                b = min(left, c.max_batch)
                t += self.decoder.decode_step_s([ctx] * b)
                left -= b
            self.steps += 1
        if prefill_tokens:
            t += self.modelled.step_s(layout, 0, 0.0, prefill_tokens, prefill_seqs, prefill_pairs)
        return max(t, 1e-6)

    def decode_steps_s(self, layout, n_decode: int, ctx) -> "list[float]":
        return [self.step_s(layout, n_decode, float(c), 0, 0) for c in ctx]

    def kv_capacity_tokens(self, layout, gpu_memory_utilization: float) -> int:
        return self.modelled.kv_capacity_tokens(layout, gpu_memory_utilization)

    def switch_s(self, old, new, kv_tokens: float) -> float:
        return self.modelled.switch_s(old, new, kv_tokens)
