"""A multi-stage migration's stage planning (pure): how many live copies, and when to stop.

Llumnix-style live migration (agents.protocol.MigrateParams): the KV cache of a decoding request is copied
while it keeps decoding, then the increment it grew meanwhile, and so on, until an increment is at most
``stop_bytes`` or ``max_stages - 1`` live copies were made; then the request stops and the last increment is
copied during its downtime. The agents' migration protocol (agents.node.migration) applies this rule to the
footprints it measures; the simulated backend applies it to the increments it models, so both stop at the
same stage for the same increments.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from agents.protocol import MigrateParams
from emulation.validation import require

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MigrateParams)}


@dataclass(frozen=True)
class StagePlan:
    """The live-copy rule of one migration: ``max_stages`` and ``stop_bytes`` as in :class:`MigrateParams`,
    ``bytes_per_token`` the (emulated) KV bytes of one token, the unit ``stop_bytes`` is counted in."""

    max_stages: int
    stop_bytes: int
    bytes_per_token: float

    def __post_init__(self) -> None:
        require(self.bytes_per_token > 0, "bytes_per_token", f"must be > 0, got {self.bytes_per_token}")

    @classmethod
    def of(cls, params: MigrateParams, bytes_per_token: float) -> "StagePlan":
        """The rule a migration request asks for."""
        return cls(params.max_stages, params.stop_bytes, bytes_per_token)

    @classmethod
    def protocol_default(cls, bytes_per_token: float) -> "StagePlan":
        """The rule of a migration request that leaves both knobs at the protocol's defaults."""
        return cls(_DEFAULTS["max_stages"], _DEFAULTS["stop_bytes"], bytes_per_token)

    def another_live_copy(self, copies_made: int, increment_tokens: int, copied_tokens: int) -> bool:
        """Whether to make one more live copy, of ``increment_tokens`` (what the request holds beyond the
        ``copied_tokens`` already copied), after ``copies_made`` live copies: the first copy is always made;
        later ones while the increment is larger than ``stop_bytes`` and fewer than ``max_stages - 1`` copies
        were made (the last stage is the stop-and-copy)."""
        if copies_made >= self.max_stages - 1:
            return False
        return not (copied_tokens and increment_tokens * self.bytes_per_token <= self.stop_bytes)
