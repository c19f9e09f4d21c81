"""This machine's measured forwarding capacity (written by ``orchestrrl bench fabric``, read by the builder).

Stored as JSON at ``$ORCHESTRRL_CAPACITY_FILE`` (default /var/lib/orchestrrl/capacity.json).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from .files import write_json_atomic
from .registry import read_json
from .validation import SpecError, positive

log = logging.getLogger(__name__)

DEFAULT_CAPACITY_FILE = "/var/lib/orchestrrl/capacity.json"


def capacity_file() -> Path:
    return Path(os.environ.get("ORCHESTRRL_CAPACITY_FILE", DEFAULT_CAPACITY_FILE))


def save_capacity(capacity_gbps: float, goodput_ratio: float, source_command: str) -> dict:
    """Store a measurement: aggregate Gb/s the emulated fabric forwarded, goodput/configured ratio, and
    the command that measured it. Returns the stored record."""
    cap = positive(capacity_gbps, "capacity_gbps")
    ratio = positive(goodput_ratio, "goodput_ratio")
    if ratio > 1.5:
        raise SpecError("goodput_ratio", f"must be a ratio (about 0..1), got {goodput_ratio}")
    if not isinstance(source_command, str) or not source_command.strip():
        raise SpecError("source_command", "must be a non-empty string")
    rec = {"capacity_gbps": cap, "goodput_ratio": ratio, "source_command": source_command,
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hostname": socket.gethostname(),
           "cpus": os.cpu_count()}
    write_json_atomic(capacity_file(), rec, indent=1, mkdir=True)
    return rec


def load_capacity() -> dict | None:
    """The stored measurement, or None when there is none (or it is unreadable: logged)."""
    path = capacity_file()
    data = read_json(path)
    if data is None:
        return None
    try:
        positive(data["capacity_gbps"], "capacity_gbps")
        positive(data["goodput_ratio"], "goodput_ratio")
    except (KeyError, TypeError, SpecError) as e:
        log.warning("malformed capacity file %s: %s", path, e)
        return None
    return data


def check_capacity(aggregate_gbps: float, measured: dict | None) -> dict:
    """Compare what a fabric can inject at once with the measured capacity (pure)."""
    if measured is None:
        return {"aggregate_emulated_gbps": aggregate_gbps, "capacity_gbps": None, "measured": False,
                "ok": None, "utilisation": None,
                "message": "no capacity measurement yet (run `orchestrrl bench fabric`)"}
    cap = float(measured["capacity_gbps"])
    util = aggregate_gbps / cap
    ok = aggregate_gbps <= cap
    msg = (f"fabric can inject {aggregate_gbps:.3g} Gb/s, {util:.0%} of the measured {cap:.3g} Gb/s"
           + ("" if ok else ": links will run below their configured rates (lower FabricSpec.scale)"))
    return {"aggregate_emulated_gbps": aggregate_gbps, "capacity_gbps": cap, "measured": True, "ok": ok,
            "utilisation": util, "message": msg, "measured_at": measured.get("measured_at"),
            "source_command": measured.get("source_command")}
