"""What every `orchestrrl` command shares: the usage error (exit code 2) and the argument checks.

The command modules import this; ``testbed.cli`` imports it too (to map UsageError to exit 2) and only
dispatches to the commands, so nothing imports ``testbed.cli`` back.
"""
from __future__ import annotations

import math


class UsageError(Exception):
    """Bad command-line input detected after parsing (exit code 2)."""


def positive(name: str, v: float, allow_zero: bool = False) -> None:
    """``--name`` must be a finite number > 0 (>= 0 with ``allow_zero``); UsageError naming it otherwise."""
    if not math.isfinite(v):
        raise UsageError(f"--{name} must be a finite number, got {v}")
    if v < 0 or (v == 0 and not allow_zero):
        raise UsageError(f"--{name} must be {'>= 0' if allow_zero else '> 0'}, got {v:g}")
