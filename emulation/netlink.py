"""Links and htb classes through netlink, in-process (pyroute2): no ``ip`` or ``tc`` process is spawned.

A spawned ``tc``/``ip`` costs 10-70 ms per call on this machine; a netlink request on an open socket costs
well under a millisecond, so live rate changes (time dilation, degraded links) cost milliseconds
(``testbed/benchmarks/bench_rate_change.py`` measures both side by side). A :class:`Netlink` is a socket in the
root network namespace or in the namespace of a process (a Mininet host's shell): open one and reuse it
for many requests (entering a namespace costs ~10 ms once).

Errors are typed: :class:`NoSuchLink` when an interface does not exist, :class:`NetlinkFailed` (with the
kernel's ``errno``) for anything else the kernel refuses. pyroute2 is imported only when a socket opens.
"""
from __future__ import annotations

import ctypes
import errno as _errno
import logging
import os
import socket
import threading
from typing import Any

from .validation import SpecError

log = logging.getLogger(__name__)

ROOT_HANDLE = 0x10000  # htb qdisc "1:"
CLASS_HANDLE = 0x10001  # its link class "1:1" (the interface's rate)
SMALL_HANDLE = 0x10010  # "1:10" under 1:1: small packets (TCP's pure ACKs, small UDP), served first
BULK_HANDLE = 0x10020  # "1:20" under 1:1: everything else (the qdisc's default)
ETH_P_IP = 0x0800
# u32 keys ("value/mask+offset" into the IPv4 header) of a TCP segment that carries data: a 20-byte header
# (Linux sends no IP options), protocol 6, PSH set in the TCP flags (byte 33 behind such a header)
TCP_DATA_KEYS = ("0x05000000/0x0f000000+0", "0x00060000/0x00ff0000+8", "0x00080000/0x00080000+32")


class NetlinkFailed(RuntimeError):
    """The kernel refused a netlink request (``errno``: its error number, e.g. errno.EPERM)."""

    def __init__(self, what: str, errno: int, message: str):
        super().__init__(f"{what}: {message} (errno {errno})")
        self.errno = errno


class NoSuchLink(NetlinkFailed):
    """The interface does not exist (in that namespace)."""

    def __init__(self, name: str, where: str):
        super().__init__(f"interface {name!r} in {where}", _errno.ENODEV, "no such device")
        self.name = name


CLONE_NEWNET = 0x40000000


def _check_pid(netns_pid: int | None) -> int | None:
    if netns_pid is not None and (isinstance(netns_pid, bool) or not isinstance(netns_pid, int) or netns_pid <= 0):
        raise SpecError("netns_pid", f"must be a positive integer, got {netns_pid!r}")
    return netns_pid


def _socket_in_namespace(netns_pid: int) -> socket.socket:
    """An rtnetlink socket created inside process ``netns_pid``'s network namespace.

    A socket stays in the namespace it was created in. setns(2) moves only the calling thread, so a
    short-lived thread enters the namespace and makes the socket (~0.2 ms); the process never moves.
    (pyroute2's own ``IPRoute(netns=...)`` forks a helper process instead: ~10 ms, and it hung in a process
    with threads and signal handlers, such as ``orchestrrl fabric up``.)
    """
    out: dict[str, Any] = {}

    def enter_and_make() -> None:
        try:
            fd = os.open(f"/proc/{netns_pid}/ns/net", os.O_RDONLY)
        except OSError as e:
            out["error"] = (e.errno or 0, f"cannot open its namespace: {e.strerror}")
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                out["error"] = (err, f"setns: {os.strerror(err)}")
                return
        finally:
            os.close(fd)
        # SOCK_DGRAM: pyroute2 hands the socket to asyncio as a datagram endpoint (netlink takes either type)
        out["sock"] = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 0)  # NETLINK_ROUTE

    t = threading.Thread(target=enter_and_make, name=f"netns-{netns_pid}", daemon=True)
    t.start()
    t.join(timeout=10.0)
    if "sock" not in out:
        errno, msg = out.get("error", (_errno.ETIMEDOUT, "timed out entering the namespace"))
        raise NetlinkFailed(f"netlink socket in the namespace of pid {netns_pid}", errno, msg)
    return out["sock"]


class Netlink:
    """An rtnetlink socket in the root namespace (``netns_pid`` None) or in process ``netns_pid``'s."""

    def __init__(self, netns_pid: int | None = None):
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        self._NetlinkError = NetlinkError
        _check_pid(netns_pid)
        self.where = "the root namespace" if netns_pid is None else f"the namespace of pid {netns_pid}"
        try:
            if netns_pid is None:
                self._ipr = IPRoute()
            else:  # IPRoute owns (and closes) the descriptor
                self._ipr = IPRoute(fileno=_socket_in_namespace(netns_pid).detach())
        except NetlinkError as e:
            raise NetlinkFailed(f"netlink socket in {self.where}", e.code, str(e)) from None
        except OSError as e:
            raise NetlinkFailed(f"netlink socket in {self.where}", e.errno or 0, e.strerror or str(e)) from None
        self._index: dict[str, int] = {}

    def __enter__(self) -> "Netlink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._ipr.close()

    def _call(self, what: str, fn, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._NetlinkError as e:
            if e.code == _errno.ENODEV:
                raise NoSuchLink(what, self.where) from None
            raise NetlinkFailed(f"{what} in {self.where}", e.code, str(e)) from None

    # ---- links ---------------------------------------------------------------------------------------
    def index(self, name: str) -> int:
        """The ifindex of ``name`` (cached); NoSuchLink when it does not exist."""
        if name not in self._index:
            found = self._call(name, self._ipr.link_lookup, ifname=name)
            if not found:
                raise NoSuchLink(name, self.where)
            self._index[name] = int(found[0])
        return self._index[name]

    def link_names(self) -> list[str]:
        """Every interface in this namespace."""
        return sorted(str(link.get_attr("IFLA_IFNAME")) for link in self._call("links", self._ipr.get_links))

    def delete_link(self, name: str) -> bool:
        """Delete interface ``name`` (a veth goes with its peer); False when it did not exist."""
        try:
            idx = self.index(name)
            self._call(name, self._ipr.link, "del", index=idx)
        except NoSuchLink:
            return False
        finally:
            self._index.pop(name, None)
        return True

    # ---- htb -----------------------------------------------------------------------------------------
    def replace_htb(self, name: str, params: dict, children: dict, small_below: int) -> None:
        """Root ``htb`` qdisc with the link class 1:1 of ``params`` on an interface not shaped yet (the kernel
        refuses to change an htb root in place: EINVAL; a rate is changed with :meth:`change_htb`), ``children``
        (handle -> (params, htb prio)) under it, the qdisc's default the last of them, and IPv4 packets whose
        total length is below ``small_below`` (a power of two) filtered into the first, except TCP segments
        with PSH set (they carry data: the last one)."""
        idx = self.index(name)
        handles = list(children)
        self._call(name, self._ipr.tc, "replace", "htb", idx, ROOT_HANDLE, default=handles[-1] & 0xFFFF)
        self._call(name, self._ipr.tc, "replace-class", "htb", idx, CLASS_HANDLE, parent=ROOT_HANDLE, **params)
        for h, (cp, prio) in children.items():
            self._call(name, self._ipr.tc, "replace-class", "htb", idx, h, parent=CLASS_HANDLE, prio=prio, **cp)
        # IPv4 total length (bytes 2-3 of the header) below small_below: its high bits clear
        mask = (0xFFFF & ~(small_below - 1)) << 16
        small = f"0x0/0x{mask:08x}+2"
        # ...except a TCP segment that carries data (PSH set: the last segment of a write; pure ACKs never
        # have it): put ahead of its own connection's queued data it arrives out of order, and the sender
        # takes the reordering for a loss (a spurious fast retransmit and a window cut)
        self._call(name, self._ipr.tc, "add-filter", "u32", idx, ":1", parent=ROOT_HANDLE, prio=1,
                   protocol=ETH_P_IP, target=handles[-1], keys=[small, *TCP_DATA_KEYS])
        self._call(name, self._ipr.tc, "add-filter", "u32", idx, ":2", parent=ROOT_HANDLE, prio=2,
                   protocol=ETH_P_IP, target=handles[0], keys=[small])

    def change_htb(self, name: str, params: dict, children: dict) -> None:
        """Change class 1:1 and ``children`` (as :meth:`replace_htb` takes them) in place (no packet is dropped
        by the change itself); NetlinkFailed when the interface is not shaped."""
        idx = self.index(name)
        self._call(name, self._ipr.tc, "change-class", "htb", idx, CLASS_HANDLE, parent=ROOT_HANDLE, **params)
        for h, (cp, prio) in children.items():
            self._call(name, self._ipr.tc, "change-class", "htb", idx, h, parent=CLASS_HANDLE, prio=prio, **cp)

    def htb_rate_bps(self, name: str) -> float | None:
        """The rate of class 1:1 in bits/s, None when ``name`` has no such class."""
        idx = self.index(name)
        for c in self._call(name, self._ipr.get_classes, index=idx):
            if c["handle"] != CLASS_HANDLE or c.get_attr("TCA_KIND") != "htb":
                continue
            opts = c.get_attr("TCA_OPTIONS")
            rate64 = opts.get_attr("TCA_HTB_RATE64") if opts else None
            parms = opts.get_attr("TCA_HTB_PARMS") if opts else None
            if rate64:
                return float(rate64) * 8.0
            if parms:
                return float(parms["rate"]) * 8.0
        return None
