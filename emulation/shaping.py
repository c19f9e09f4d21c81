"""htb rate shaping of one interface at any rate (Mininet's TCLink ignores bw > 1000 Mb/s).

Layout on an interface: ``root handle 1: htb default 1`` with one class ``1:1`` at the rate. Every packet
leaving the interface goes through that class. ``change_rate`` changes the class in place (no packet is
dropped by the change itself).

burst / cburst: one maximal GSO packet plus a little (68 KiB) at every rate. userspace TSO hands the veths
64 KiB segments, so the burst holds at least one of them; more (we tried ~1 ms of traffic: 187 KB at 1.5 Gb/s)
sends bigger bursts into the next userspace bridge, which drops them when the cores are busy. Measured
iperf3 goodput / configured rate (one TCP stream, 2-pod fabric, ToR->OCS->ToR path, 2 busy cores):
0.955 at 100 Mb/s, 0.946 at 1000, 0.948 at 2000 (same-ToR path: 0.953-0.954). Mininet's own 15 kB
burst gave ~0.83 at 1000 Mb/s. quantum: a few MTUs (one class: it only silences the kernel's warning).

Commands run through ``tc`` (in the root namespace, or in a host's namespace through ``nsenter -t PID -n``);
``shape_many`` batches many interfaces into one ``tc -batch`` call.
"""
from __future__ import annotations

import logging
import math
import subprocess
from typing import Sequence

from .validation import SpecError

log = logging.getLogger(__name__)

HANDLE = "1:"
CLASSID = "1:1"
BURST_BYTES = 64 * 1024 + 4096
QUANTUM_BYTES = 60000
MAX_RATE_MBPS = 400_000.0


class ShapingError(RuntimeError):
    pass


def _check_rate(rate_mbps: float) -> float:
    if isinstance(rate_mbps, bool) or not isinstance(rate_mbps, (int, float)) or not math.isfinite(rate_mbps):
        raise SpecError("rate_mbps", f"must be a number, got {rate_mbps!r}")
    if not 0 < rate_mbps <= MAX_RATE_MBPS:
        raise SpecError("rate_mbps", f"must be in (0, {MAX_RATE_MBPS:g}], got {rate_mbps}")
    return float(rate_mbps)


def _check_intf(intf: str) -> str:
    if not isinstance(intf, str) or not intf or len(intf) > 15 or any(c.isspace() or c == "/" for c in intf):
        raise SpecError("intf_name", f"not a valid interface name: {intf!r}")
    return intf


def burst_bytes(rate_mbps: float) -> int:
    """htb burst (and cburst) for ``rate_mbps``."""
    _check_rate(rate_mbps)
    return BURST_BYTES


def _rate_arg(rate_mbps: float) -> str:
    # kbit keeps fractional Mb/s (scaled rates such as 0.4 Mb/s) exact enough
    return f"{max(1, round(rate_mbps * 1000))}kbit"


def class_args(verb: str, intf: str, rate_mbps: float) -> list[str]:
    """tc arguments (without the leading ``tc``) for ``class add|change`` of the shaping class."""
    b = burst_bytes(rate_mbps)
    return ["class", verb, "dev", intf, "parent", HANDLE, "classid", CLASSID, "htb",
            "rate", _rate_arg(rate_mbps), "ceil", _rate_arg(rate_mbps),
            "burst", str(b), "cburst", str(b), "quantum", str(QUANTUM_BYTES)]


def shape_commands(intf: str, rate_mbps: float) -> list[list[str]]:
    """tc argument lists that (re)install shaping on ``intf`` (replace: safe on an already shaped link)."""
    _check_intf(intf)
    _check_rate(rate_mbps)
    return [["qdisc", "replace", "dev", intf, "root", "handle", HANDLE, "htb", "default", "1"],
            class_args("replace", intf, rate_mbps)]


def _ns_prefix(netns_pid: int | None) -> list[str]:
    if netns_pid is None:
        return []
    if isinstance(netns_pid, bool) or not isinstance(netns_pid, int) or netns_pid <= 0:
        raise SpecError("netns_pid", f"must be a positive integer, got {netns_pid!r}")
    return ["nsenter", "-t", str(netns_pid), "-n"]


def _tc(args: list[str], netns_pid: int | None, ok_errors: tuple[str, ...] = ()) -> str:
    argv = _ns_prefix(netns_pid) + ["tc"] + args
    r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    if r.returncode != 0 and not any(e in r.stderr for e in ok_errors):
        raise ShapingError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r.stdout


def shape_many(items: Sequence[tuple[str, float]], netns_pid: int | None = None) -> None:
    """Shape several interfaces of one namespace with a single ``tc -batch`` call."""
    lines = []
    for intf, rate in items:
        for args in shape_commands(intf, rate):
            lines.append(" ".join(args))
    if not lines:
        return
    argv = _ns_prefix(netns_pid) + ["tc", "-batch", "-"]
    r = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise ShapingError(f"{' '.join(argv)}: {r.stderr.strip()}")


def change_rate(intf_name: str, rate_mbps: float, netns_pid: int | None = None) -> None:
    """Change the rate of an already shaped interface, live."""
    _check_intf(intf_name)
    _tc(class_args("change", intf_name, _check_rate(rate_mbps)), netns_pid)


_UNITS = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "tbit": 1e6}


def parse_tc_rate(text: str) -> float | None:
    """'1500Mbit' -> 1500.0 (Mb/s); tc prints rates in bit, Kbit, Mbit, Gbit."""
    t = text.strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            try:
                return float(t[: -len(unit)]) * _UNITS[unit]
            except ValueError:
                return None
    return None


def read_rate_mbps(intf_name: str, netns_pid: int | None = None) -> float | None:
    """The rate of the shaping class on ``intf_name`` in Mb/s, None when it is not shaped."""
    _check_intf(intf_name)
    out = _tc(["class", "show", "dev", intf_name], netns_pid)
    for line in out.splitlines():
        words = line.split()
        if words[:3] == ["class", "htb", CLASSID] and "rate" in words:
            i = words.index("rate")
            if i + 1 < len(words):
                return parse_tc_rate(words[i + 1])
    return None
