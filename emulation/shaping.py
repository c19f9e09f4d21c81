"""htb rate shaping of one interface at any rate (Mininet's TCLink ignores bw > 1000 Mb/s), through netlink.

Layout on an interface: ``root handle 1: htb default 20`` with the link class ``1:1`` at the rate, and under
it ``1:10`` (htb prio 0: served first) for IPv4 packets under ``SMALL_BYTES`` (TCP's pure ACKs, small UDP
datagrams; not TCP data: see below), filtered by u32 on the header's total length, guaranteed ``SMALL_SHARE``
of the rate and free to borrow the rest, and ``1:20`` (prio 1, the default) for everything else at the link's rate (it never
borrows: a borrowing bulk class made the 400 Mb/s collectives bench worse). Why the small packets go first:
in a ring all-reduce (or a relayed broadcast chain) every link carries one flow's data and another flow's
ACKs; in one FIFO the ACKs waited behind the queued data, the flows' round trip went from 0.5 ms to 90-150 ms
and BBR's window (~2 x bandwidth x min RTT) held them at 0.1-0.5 of the link for long stretches. Measured
2026-12-03 (A/B, one after the other): `orchestrrl bench collectives --rate-mbps 50 --sizes-mib 4,16`, 3
runs each: all-reduce efficiency 0.897-0.908 (4 MiB) and 0.846-0.875 (16 MiB) in one FIFO, 0.999-1.001 and
0.979-0.996 with the small class; at the default 400 Mb/s (``--sizes-mib 16,64``, 4 runs each) the medians
were the same (all-reduce 0.986 / 0.893 vs 0.988 / 0.882, broadcast 0.923 / 0.903 vs 0.926 / 0.851) and the
worst rows lower (0.707 and 0.699 against 0.881 and 0.814): there the userspace datapath, not TCP, is the
limit. The small class may add up to its share on top of the bulk's rate while both are busy (ACKs are ~2% of
a data flow's bytes). A small TCP segment that carries data (PSH set: the last one of a write, e.g. Gloo's
message headers and tails) stays in the bulk class: put ahead of its own connection's queued data it arrived
out of order, and the sender took the reordering for a loss (a spurious fast retransmit and a window cut; in
the 64 MiB all-reduce every retransmitted segment came back as a DSACK, 30-54 reorderings per host in 9
all-reduces; with the rule 0-1, and the bench's worst row >= 16 MiB went from 0.80-0.94 to 0.92-0.94). ``change_rate`` changes the classes in place (no packet is dropped by the change itself).

burst / cburst: one maximal GSO packet plus a little (68 KiB) at every rate. userspace TSO hands the veths
64 KiB segments, so the burst holds at least one of them; more (we tried ~1 ms of traffic: 187 KB at 1.5 Gb/s)
sends bigger bursts into the next userspace bridge, which drops them when the cores are busy. Measured
iperf3 goodput / configured rate (one TCP stream, 2-pod fabric, ToR->OCS->ToR path, 2 busy cores):
0.955 at 100 Mb/s, 0.946 at 1000, 0.948 at 2000 (same-ToR path: 0.953-0.954). Mininet's own 15 kB
burst gave ~0.83 at 1000 Mb/s. quantum: a few MTUs (one class: it only silences the kernel's warning).

Requests go through :class:`emulation.netlink.Netlink` (pyroute2, in-process: no ``tc`` is spawned), in the
root namespace or in a host's namespace (``netns_pid``: the PID of a process inside it). ``shape_many`` and
:class:`Shaper` reuse one socket for many interfaces; a live change on an open socket costs well under a
millisecond (``testbed/benchmarks/bench_rate_change.py``). Errors: ``netlink.NoSuchLink``, ``netlink.NetlinkFailed``.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

from .netlink import BULK_HANDLE, SMALL_HANDLE, Netlink
from .validation import SpecError

log = logging.getLogger(__name__)

# The rates the testbed asks for are payload rates (RLSim's links carry a transfer's bytes at the nominal rate; a
# 400 Gb/s RDMA link at a 4 KiB MTU loses ~1% to headers). htb counts whole Ethernet frames: a full TCP segment
# is 1,448 bytes of payload (MSS with timestamps) in a 1,514-byte frame, so a class at the nominal rate gave
# 0.955 of it as goodput (iperf3, this module's measurements below) and every emulated transfer 4.6% longer
# than modelled. The classes run at the frame rate of the asked payload rate.
WIRE_PER_PAYLOAD = 1514 / 1448
BURST_BYTES = 64 * 1024 + 4096
QUANTUM_BYTES = 60000
SMALL_BYTES = 128  # IPv4 packets shorter than this go first (a power of two: the u32 match is on its high bits)
SMALL_SHARE = 0.02  # the small packets' guaranteed share of the link (they may borrow the rest)
MAX_RATE_MBPS = 400_000.0


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


def _wire_kbit(rate_mbps: float) -> int:
    """The frame rate (:data:`WIRE_PER_PAYLOAD`) of a payload rate, in kbit/s (kbit keeps scaled rates such as
    0.4 Mb/s exact enough)."""
    return round(_check_rate(rate_mbps) * WIRE_PER_PAYLOAD * 1000)


def class_params(rate_mbps: float) -> dict:
    """The htb class parameters for a payload rate of ``rate_mbps`` (at its frame rate)."""
    rate = f"{max(1, _wire_kbit(rate_mbps))}kbit"
    b = burst_bytes(rate_mbps)
    return {"rate": rate, "ceil": rate, "burst": b, "cburst": b, "quantum": QUANTUM_BYTES}


def child_params(rate_mbps: float) -> dict:
    """The classes under the link class at ``rate_mbps``: handle -> (htb parameters, htb prio), the small
    packets' first (a guaranteed ``SMALL_SHARE``, ceil the link's rate), the rest's last (the link's rate)."""
    kbit = max(2, _wire_kbit(rate_mbps))
    small = max(1, round(kbit * SMALL_SHARE))
    link = class_params(rate_mbps)
    return {SMALL_HANDLE: (dict(link, rate=f"{small}kbit", quantum=1514), 0),
            BULK_HANDLE: (dict(link), 1)}


class Shaper(Netlink):
    """A netlink socket (root namespace or ``netns_pid``'s) for many shaping requests; a context manager."""

    def shape(self, intf: str, rate_mbps: float) -> None:
        """Install shaping on ``intf`` at ``rate_mbps`` (an interface not shaped yet: see Netlink.replace_htb)."""
        self.replace_htb(_check_intf(intf), class_params(rate_mbps), child_params(rate_mbps), SMALL_BYTES)

    def change_rate(self, intf: str, rate_mbps: float) -> None:
        """Change the rate of an already shaped interface, live."""
        self.change_htb(_check_intf(intf), class_params(rate_mbps), child_params(rate_mbps))

    def rate_mbps(self, intf: str) -> float | None:
        """The payload rate of the shaping class on ``intf`` in Mb/s, None when it is not shaped."""
        bps = self.htb_rate_bps(_check_intf(intf))
        return None if bps is None else bps / 1e6 / WIRE_PER_PAYLOAD


def shape_many(items: Sequence[tuple[str, float]], netns_pid: int | None = None) -> None:
    """Shape several interfaces of one namespace over one netlink socket."""
    for intf, rate in items:  # validate everything before touching any interface
        _check_intf(intf)
        _check_rate(rate)
    if not items:
        return
    with Shaper(netns_pid) as sh:
        for intf, rate in items:
            sh.shape(intf, rate)


def change_rate(intf_name: str, rate_mbps: float, netns_pid: int | None = None) -> None:
    """Change the rate of an already shaped interface, live (a :class:`Shaper` saves the socket set-up)."""
    _check_intf(intf_name)
    _check_rate(rate_mbps)
    with Shaper(netns_pid) as sh:
        sh.change_rate(intf_name, rate_mbps)


def read_rate_mbps(intf_name: str, netns_pid: int | None = None) -> float | None:
    """The payload rate of the shaping class on ``intf_name`` in Mb/s, None when it is not shaped."""
    _check_intf(intf_name)
    with Shaper(netns_pid) as sh:
        return sh.rate_mbps(intf_name)
