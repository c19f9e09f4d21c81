"""What every `orchestrrl` command shares: the usage error (exit code 2) and the argument checks.

The command modules import this; ``testbed.cli`` imports it too (to map UsageError to exit 2) and only
dispatches to the commands, so nothing imports ``testbed.cli`` back.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from emulation.validation import SpecError
from emulation.validation import positive as _positive_rule


CHECKOUT = Path(__file__).resolve().parents[2]  # the folder holding scenarios/ (an editable install's checkout)


def shipped_scenario(name: str) -> str:
    """A command's default scenario, ``scenarios/<name>``: as written where the current folder holds it (the
    checkout, as the README runs every command), else the checkout's own, so ``orchestrrl demo`` from another
    folder finds it (it was 'no such file')."""
    rel = os.path.join("scenarios", name)
    return rel if os.path.isfile(rel) else str(CHECKOUT / rel)


class UsageError(Exception):
    """Bad command-line input detected after parsing (exit code 2)."""


def positive(name: str, v: float, allow_zero: bool = False) -> None:
    """``--name`` must be a finite number > 0 (>= 0 with ``allow_zero``); UsageError naming it otherwise."""
    try:
        _positive_rule(v, f"--{name}", allow_zero)
    except SpecError as e:
        raise UsageError(f"{e.field} {e.message}") from None


def out_folder(value: str | None, default: str | None = None, flag: str = "--out") -> Path:
    """The output folder ``value`` (``default`` where not given), checked before anything runs: a folder, or a path
    that can be made one. UsageError naming what is wrong otherwise (a file in its place, an ancestor that is
    not a folder, an ancestor nothing can be created in), so a command does not run for minutes and then fail
    at its first write. Nothing is left behind: the nearest existing ancestor is tried with a folder made and
    removed at once (as root, permission bits say little: /proc, /sys or a read-only mount refuse the folder)."""
    path = Path(value) if value else Path(default)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a folder")
    anc = path
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise UsageError(f"{flag} {path}: {anc} is not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=".orl-out-check-", dir=anc)
    except OSError as e:
        raise UsageError(f"{flag} {path}: nothing can be created in {anc} ({e.strerror})") from None
    os.rmdir(probe)
    return path
