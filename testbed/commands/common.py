"""What every `orchestrrl` command shares: the usage error (exit code 2) and the argument checks.

The command modules import this; ``testbed.cli`` imports it too (to map UsageError to exit 2) and only
dispatches to the commands, so nothing imports ``testbed.cli`` back.
"""
from __future__ import annotations

from emulation.validation import SpecError
from emulation.validation import positive as _positive_rule


class UsageError(Exception):
    """Bad command-line input detected after parsing (exit code 2)."""


def positive(name: str, v: float, allow_zero: bool = False) -> None:
    """``--name`` must be a finite number > 0 (>= 0 with ``allow_zero``); UsageError naming it otherwise."""
    try:
        _positive_rule(v, f"--{name}", allow_zero)
    except SpecError as e:
        raise UsageError(f"{e.field} {e.message}") from None
