"""Open vSwitch's shared send buffer (the userspace datapath's one blind spot that drops packets silently).

ovs-vswitchd with the userspace datapath sends every packet, of every port on every bridge, through one
AF_PACKET socket (netdev-linux), created the first time it sends and sized then from
``net.core.wmem_default`` (212,992 bytes on Debian 12). A packet handed to a veth counts against that one
buffer until it leaves the port's qdisc, so the bytes queued in the htb classes of every link on the fabric
share 208 KiB. Where flows converge on a shaped port (a 2:1 ToR's uplink: two server links into one) the
queues fill it, further sends fail with EAGAIN and OVS drops the packet; the only trace is a rate-limited
``netdev_linux|WARN|error sending Ethernet packet on ...: Resource temporarily unavailable`` in its log. TCP
sees ~10% loss and stalls on timeouts: the 2:1 tree's weight sync took 1.75-3.15x its modelled time at
time dilation 2 and 1.86x at 5 (50 and 20 Mb/s links): a fixed number of bytes, not CPU time. At 8 MiB the
same sync ran at 1.05x with no retransmissions (the peak queued on the socket was 0.9 MB).
``scripts/provision.sh`` sets it before Open vSwitch starts and restarts vswitchd when its socket was made
smaller (``python3 -m emulation.machine want-send-buffer`` the size wanted, ``python3 -m emulation.sendbuf socket``
the size vswitchd's socket has);
``orchestrrl doctor`` and the builder check it.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .machine import OVS_SEND_BUFFER

WANT_BYTES = OVS_SEND_BUFFER  # net.core.wmem_default the fabric needs (emulation/machine.py; provision.sh sets it)
WMEM_DEFAULT = Path("/proc/sys/net/core/wmem_default")


def wmem_default() -> int | None:
    try:
        return int(WMEM_DEFAULT.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def vswitchd_send_buffer(ss_output: str) -> int | None:
    """The send buffer (bytes, ``skmem`` ``tb``) of ovs-vswitchd's unbound packet socket in ``ss -0 -a -m -p``
    output (pure), or None when it has none yet (it makes it when it first sends)."""
    records: list[str] = []
    for line in ss_output.splitlines():
        if line[:1].isspace() and records:
            records[-1] += " " + line.strip()  # ss puts skmem on a continuation line when the line is long
        else:
            records.append(line)
    for rec in records:
        f = rec.split()
        if len(f) >= 5 and f[0] == "p_raw" and f[4] == "[0]:*" and '"ovs-vswitchd"' in rec:
            m = re.search(r"\btb(\d+)", rec)
            if m:
                return int(m.group(1))
    return None


def read_send_buffer() -> int | None:
    """ovs-vswitchd's send socket's buffer now (:func:`vswitchd_send_buffer` of ``ss``), None if it has none
    yet; OSError / SubprocessError when ``ss`` cannot be run."""
    out = subprocess.run(["ss", "-0", "-a", "-m", "-p"], capture_output=True, text=True, timeout=10).stdout
    return vswitchd_send_buffer(out)


def check() -> tuple[bool, str]:
    """(ok, what was found): ``net.core.wmem_default`` at least WANT_BYTES, and ovs-vswitchd's send socket, if
    it has one, made at that size (it keeps the size it was made with until vswitchd restarts)."""
    want = WANT_BYTES
    cur = wmem_default()
    if cur is None:
        return False, f"cannot read {WMEM_DEFAULT}"
    if cur < want:
        return False, (f"net.core.wmem_default is {cur} bytes, under {want}: Open vSwitch drops packets where "
                       "flows converge on a shaped port (emulation/sendbuf.py)")
    try:
        tb = read_send_buffer()
    except (OSError, subprocess.SubprocessError) as e:
        return True, f"net.core.wmem_default={cur} (ovs-vswitchd's socket not read: {e})"
    if tb is not None and tb < want:
        return False, (f"ovs-vswitchd's send socket has {tb} bytes (made before net.core.wmem_default was "
                       f"raised to {cur}): restart ovs-vswitchd")
    return True, (f"net.core.wmem_default={cur}" + ("" if tb is None else f", ovs-vswitchd's send socket {tb} bytes"))


if __name__ == "__main__":  # scripts/provision.sh (Debian's python3, before the venv): stdlib only
    if sys.argv[1:] == ["socket"]:  # empty when vswitchd has no send socket yet
        tb = read_send_buffer()
        print("" if tb is None else tb)
    else:
        sys.exit("usage: python3 -m emulation.sendbuf socket")
