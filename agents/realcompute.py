"""Real-compute mode's configuration (pure): the shape of the small Qwen2-like torch decoder
(agents/node/realmodel.py) whose decode steps run for real, and where it runs.

One concept, one set of defaults and checks: the agent's config carries it (``AgentConfig.real_compute``,
validated where the pool builds the config and again where the agent parses it), the decoder is built from
it, and the GPU check of the cost model builds catalogue shapes with :meth:`DecoderConfig.like`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from agents.costmodel import ModelConfig
from emulation.validation import SpecError, require

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class DecoderConfig:
    """A real decoder: its layer shape (Qwen2's layer), its KV cache, and the device and dtype it runs on."""

    layers: int = 2
    hidden: int = 256
    ffn: int = 512
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: Optional[int] = None  # None: hidden / q_heads
    vocab: int = 1024
    max_seq_len: int = 4096  # KV cache positions per sequence (longer contexts are timed at this length)
    max_batch: int = 64  # KV cache slots: sequences per real pass (a larger batch runs in several passes)
    rope_theta: float = 1_000_000.0  # Qwen2's
    rms_eps: float = 1e-6
    qkv_bias: bool = True  # Qwen2 has biases on q, k, v
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for n in ("layers", "hidden", "ffn", "q_heads", "kv_heads", "vocab", "max_seq_len", "max_batch"):
            v = getattr(self, n)
            require(not isinstance(v, bool) and isinstance(v, int) and v >= 1, n, f"must be an integer >= 1, got {v!r}")
        require(self.q_heads % self.kv_heads == 0, "kv_heads", "must divide q_heads")
        if self.head_dim is None:
            require(self.hidden % self.q_heads == 0, "q_heads", "must divide hidden (or give head_dim)")
            object.__setattr__(self, "head_dim", self.hidden // self.q_heads)
        v = self.head_dim
        require(not isinstance(v, bool) and isinstance(v, int) and v >= 1, "head_dim",
                f"must be an integer >= 1, got {v!r}")
        require(self.head_dim % 2 == 0, "head_dim", f"must be even (RoPE rotates pairs), got {self.head_dim}")
        require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        require(self.rms_eps > 0, "rms_eps", f"must be > 0, got {self.rms_eps}")
        require(self.dtype in DTYPES, "dtype", f"must be {', '.join(DTYPES)}, got {self.dtype!r}")
        require(isinstance(self.device, str) and bool(self.device), "device", f"must be a torch device name, got "
                                                                              f"{self.device!r}")

    @classmethod
    def like(cls, model: ModelConfig, layers: int, max_seq_len: int = 4096, max_batch: int = 64) -> "DecoderConfig":
        """The shape of a catalogue model (``emulation/data/models.yaml``, dense) with ``layers`` layers."""
        if model.is_moe:
            raise SpecError("model", f"real-compute mode builds dense decoders; {model.name} is MoE")
        return cls(layers=layers, hidden=model.hidden, ffn=model.ffn, q_heads=model.q_heads, kv_heads=model.kv_heads,
                   head_dim=model.head_dim, vocab=model.vocab, max_seq_len=max_seq_len, max_batch=max_batch,
                   qkv_bias=model.qkv_bias)

    def model_config(self, name: str = "real-decoder") -> ModelConfig:
        """The same shape for the cost model, to compare its prediction with the measured step."""
        return ModelConfig(layers=self.layers, hidden=self.hidden, ffn=self.ffn, q_heads=self.q_heads,
                           kv_heads=self.kv_heads, head_dim=self.head_dim, vocab=self.vocab,
                           qkv_bias=self.qkv_bias, name=name)
