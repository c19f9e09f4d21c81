"""Open vSwitch's datapath flow cache, as the controller flushes it around a reconfiguration.

The userspace datapath forwards from a cache of flows (megaflows) that ovs-vswitchd's revalidator threads
bring in line with the OpenFlow tables some time after a flow-mod: on this 2-core machine up to ~6 ms. So
a circuit deleted at t keeps forwarding for a while after t (a probe saw paths dark for 4-6 ms with
D = 10 ms), and the drop flows cached while it was dark keep dropping after the new circuit is installed
(dark for up to D + 6 ms): neither is what a real optical switch does. The controller therefore asks
ovs-vswitchd to purge its cached flows right after the deletes are confirmed and right after the adds
are confirmed (``revalidator/purge``: the revalidators delete every cached flow, pushing its statistics
to the OpenFlow counters first, so flow counters stay exact). Packets that follow take the slow path
once and re-populate the cache from the current tables; nothing is dropped that the tables forward.

The purge covers every bridge of this ovs-vswitchd, other fabrics' too: for them it costs one slow-path
lookup per flow, not a packet. The call is JSON-RPC over ovs-vswitchd's unixctl socket (what
``ovs-appctl`` speaks), in-process: ~0.5 ms, no ``ovs-appctl`` spawned.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from emulation.validation import SpecError, require

FLUSH_MODES = ("auto", "on", "off")
PURGE = "revalidator/purge"
DEFAULT_RUNDIR = "/var/run/openvswitch"


class FlowCacheError(RuntimeError):
    """ovs-vswitchd could not be reached or refused the request."""


def check_flush_mode(mode: str) -> str:
    """``mode`` if it is a ``datapath_flush`` mode, else SpecError naming the field."""
    require(mode in FLUSH_MODES, "datapath_flush", f"must be one of {', '.join(FLUSH_MODES)}, got {mode!r}")
    return mode


def _rundir(rundir: str | None) -> Path:
    return Path(rundir or os.environ.get("OVS_RUNDIR") or DEFAULT_RUNDIR)


def vswitchd_socket(rundir: str | None = None) -> Path | None:
    """ovs-vswitchd's unixctl socket (``<rundir>/ovs-vswitchd.<pid>.ctl``, the pid from its pidfile), or
    None when no ovs-vswitchd runs there. ``rundir``: default $OVS_RUNDIR, else /var/run/openvswitch."""
    d = _rundir(rundir)
    try:
        pid = int((d / "ovs-vswitchd.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    sock = d / f"ovs-vswitchd.{pid}.ctl"
    return sock if sock.is_socket() else None


class FlowCache:
    """The cached flows of the ovs-vswitchd listening on ``path`` (a unixctl socket)."""

    def __init__(self, path: Path, timeout_s: float = 1.0):
        self.path = Path(path)
        self.timeout_s = timeout_s

    def call(self, method: str, *params: str) -> str:
        """One unixctl command; its reply text. Raises FlowCacheError (unreachable, timeout, error reply)."""
        req = json.dumps({"id": 0, "method": method, "params": list(params)}).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout_s)
                s.connect(str(self.path))
                s.sendall(req)
                buf = b""
                dec = json.JSONDecoder()
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        raise FlowCacheError(f"{self.path}: connection closed before the reply to {method}")
                    buf += chunk
                    try:
                        reply, _ = dec.raw_decode(buf.decode("utf-8", "replace"))
                        break
                    except ValueError:
                        continue
        except OSError as e:
            raise FlowCacheError(f"{self.path}: {method}: {e.strerror or e}") from None
        if not isinstance(reply, dict) or reply.get("error") is not None:
            raise FlowCacheError(f"{self.path}: {method}: {reply.get('error') if isinstance(reply, dict) else reply!r}")
        return str(reply.get("result") or "")

    def purge(self) -> float:
        """Drop every cached datapath flow now (statistics pushed first); the milliseconds it took."""
        t0 = time.perf_counter()
        self.call(PURGE)
        return (time.perf_counter() - t0) * 1000.0


def open_flow_cache(mode: str, rundir: str | None = None) -> FlowCache | None:
    """The flow cache to flush for ``mode`` (``datapath_flush``): ``off`` None; ``auto`` the local
    ovs-vswitchd's when one runs (else None); ``on`` it, or SpecError naming ``datapath_flush``."""
    if check_flush_mode(mode) == "off":
        return None
    sock = vswitchd_socket(rundir)
    if sock is None:
        if mode == "on":
            raise SpecError("datapath_flush",
                            f"'on' needs a running ovs-vswitchd: no pidfile and socket in {_rundir(rundir)}")
        return None
    return FlowCache(sock)
