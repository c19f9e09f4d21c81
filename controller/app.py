"""The os-ken app: thin OpenFlow 1.3 adapter between the switches and :class:`FabricController`.

Handlers only look things up and delegate: switch connect/disconnect go to the core; flow (and group) read
back after a connect is turned into plain data; the core decides what to change and calls back through
:class:`OsKenDriver` (flow-mods, group-mods, barriers). No table-miss flow is ever installed: the bridges
are fail-mode secure, so unmatched packets drop and flows survive a dead controller.

:func:`run_controller` starts everything in one process: os-ken's OpenFlow listener, this app and the REST
API (a threading WSGI server from the standard library).

Concurrency: os-ken 4.x runs its hub on *native threads* (``OSKEN_HUB_TYPE`` defaults to ``native``;
``hub.patch`` is a no-op there), so every primitive here is a native one: ``threading.Lock`` serialises
reconfigurations, ``hub.Event`` is a ``threading.Event``, the REST server handles each request in its own
thread. (Eventlet primitives shared across native threads lose wake-ups: a REST request waiting on an
eventlet semaphore released by an os-ken thread hung forever.)

Messages to a switch are sent from REST threads, sync threads and os-ken's own thread at once. os-ken's
``Datapath.set_xid`` is a plain ``xid += 1``, so every send goes through :meth:`OrlControllerApp.send`,
which assigns the xid and queues the message under a per-switch lock: two requests never share an xid
(a shared one would hand one request's replies to the other's waiter). os-ken's own echo requests take
xids without that lock, but echo replies never reach a waiter here.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import warnings
from typing import Any, Sequence

with warnings.catch_warnings():  # eventlet 0.41 (imported by os-ken) warns that it is deprecated
    warnings.simplefilter("ignore")
    from os_ken.base import app_manager
    from os_ken.controller import ofp_event
    from os_ken.controller.handler import CONFIG_DISPATCHER, DEAD_DISPATCHER, MAIN_DISPATCHER, set_ev_cls
    from os_ken.lib import hub
    from os_ken.ofproto import ofproto_v1_3

from .config import ControllerConfig
from .datapath import FlowCache, FlowCacheError, open_flow_cache
from .fabric_rules import fabric_rule
from .ocs import COOKIE_MASK, OCS_COOKIE, OCS_PRIORITY, TOR_COOKIE, FlowSpec
from .reconfig.clock import PreciseClock
from .rest import RestApp, make_server
from .runtime import FabricController
from .traffic import phase_traffic
from .tor_sync import TorTables, tor_ops

log = logging.getLogger(__name__)

BARRIER_TIMEOUT_S = 5.0
STATS_TIMEOUT_S = 10.0
ALL_BITS = 0xFFFFFFFFFFFFFFFF

_CONFIG: ControllerConfig | None = None  # set by run_controller before the app is instantiated
_METRICS = None  # controller.metrics.ControllerMetrics when --metrics-port is given (set by run_controller)


class SwitchTimeout(Exception):
    pass


class OrlControllerApp(app_manager.OSKenApp):
    OFP_VERSIONS = [ofproto_v1_3.OFP_VERSION]

    def __init__(self, *args, **kwargs):  # os-ken's app constructor signature
        super().__init__(*args, **kwargs)
        if _CONFIG is None:
            raise RuntimeError("OrlControllerApp needs controller.app.run_controller (no config set)")
        cfg = _CONFIG
        self.spec = cfg.spec
        self.dps: dict[int, Any] = {}
        self._waiters: dict[tuple[int, int], tuple[hub.Event, list]] = {}
        self.tor_tables: dict[int, TorTables] = {}  # tor -> what it held when last read back
        self.tor_stats: dict[int, dict[tuple, Any]] = {}  # tor -> {flow key: flow stats} (to delete by)
        self.fresh_tors: set[int] = set()  # ToRs read back since their last full sync
        self._send_locks: dict[int, threading.Lock] = {}  # dpid -> lock over xid assignment + send
        self._send_locks_guard = threading.Lock()
        flow_cache = open_flow_cache(cfg.datapath_flush)
        log.info("datapath flow cache: %s", f"purged around reconfigurations ({flow_cache.path})" if flow_cache
                 else f"not flushed (datapath_flush={cfg.datapath_flush})")
        self.driver = OsKenDriver(self, flow_cache, metrics=_METRICS)
        traffic = phase_traffic(cfg.spec, cfg.layout, cfg.workload) if cfg.workload is not None else None
        self.core = FabricController(cfg.spec, cfg.layout, self.driver, PreciseClock(time.sleep),
                                     threading.Lock(), initial_phase=cfg.initial_phase,
                                     delay_ms=cfg.delay_ms, state_path=cfg.state_file,
                                     on_stale=self._resync_later, traffic=traffic,
                                     metrics=_METRICS, rule=fabric_rule(cfg.rule, cfg.rule_params, "rule"))

    # ---- connection life cycle -----------------------------------------------------------------
    @set_ev_cls(ofp_event.EventOFPSwitchFeatures, CONFIG_DISPATCHER)
    def _features(self, ev):
        dp = ev.msg.datapath
        kind = self.spec.classify_dpid(dp.id)
        log.info("switch features: dpid %#x (%s)", dp.id, kind)
        # deliberately no table-miss flow: fail-secure, unmatched packets drop

    @set_ev_cls(ofp_event.EventOFPStateChange, [MAIN_DISPATCHER, DEAD_DISPATCHER])
    def _state_change(self, ev):
        dp = ev.datapath
        if dp.id is None:
            return
        if ev.state == MAIN_DISPATCHER:
            if self.spec.classify_dpid(dp.id) is None:
                log.warning("dpid %#x is not part of this fabric: ignored", dp.id)
                return
            self.dps[dp.id] = dp
            self.core.switch_connected(dp.id)
            hub.spawn(self._sync_switch, dp)
        elif ev.state == DEAD_DISPATCHER:
            if self.dps.get(dp.id) is dp:
                del self.dps[dp.id]
                self.core.switch_disconnected(dp.id)

    def _resync_later(self, dpids: Sequence[int]) -> None:
        """Called by the core (holding its lock) after a failed reconfiguration: read ``dpids`` back."""
        hub.spawn(self._resync, list(dpids))

    def _resync(self, dpids: list[int]) -> None:
        """Read stale switches back, OCSes first (their reconcile fixes the circuits the routes run on)."""
        order = sorted(dpids, key=lambda d: (self.spec.classify_dpid(d) or ("", 0))[0] != "ocs")
        for d in order:
            dp = self.dps.get(d)
            if dp is None:
                log.info("stale switch %#x disconnected: it is read back when it reconnects", d)
                continue
            log.info("reading back stale switch %#x", d)
            self._sync_switch(dp)

    def _sync_switch(self, dp) -> None:
        """Read a newly connected switch's flows (and groups), then hand them to the core."""
        try:
            kind, idx = self.spec.classify_dpid(dp.id)
            if kind == "ocs":
                ports = self.request_ports(dp)
                stats = self.request_flows(dp, OCS_COOKIE)
                pairs = []
                for st in stats:
                    pair = ocs_flow_pair(st)
                    if pair is None:
                        log.warning("OCS %d: flow %s is not a circuit flow; deleting it", idx, st)
                        self._delete_stats_flow(dp, st)
                    else:
                        pairs.append(pair)
                self.core.switch_synced(dp.id, pairs, ocs_ports=ports)
            else:
                stats = self.request_flows(dp, TOR_COOKIE)
                self.tor_stats[idx] = {(st.priority, match_items(st.match)): st for st in stats}
                self.tor_tables[idx] = TorTables(self.request_groups(dp),
                                                 {k: _stats_actions(st) for k, st in self.tor_stats[idx].items()})
                self.fresh_tors.add(idx)
                self.core.switch_synced(dp.id)
        except Exception:  # noqa: BLE001 - a sync thread must log, not die silently
            log.exception("sync of switch %#x failed", dp.id)

    # ---- sending ---------------------------------------------------------------------------------------
    def _send_lock(self, dpid: int) -> threading.Lock:
        lock = self._send_locks.get(dpid)
        if lock is None:
            with self._send_locks_guard:
                lock = self._send_locks.setdefault(dpid, threading.Lock())
        return lock

    def send(self, dp, msg, waiter: tuple | None = None) -> int:
        """Assign ``msg`` a fresh xid and queue it, under the switch's send lock; returns the xid.

        ``waiter``: ``(event, replies)`` registered for the xid before the message leaves, so no reply can
        arrive unclaimed.
        """
        with self._send_lock(dp.id):
            xid = dp.set_xid(msg)
            if waiter is not None:
                self._waiters[(dp.id, xid)] = waiter
            try:
                dp.send_msg(msg)
            except BaseException:
                self._waiters.pop((dp.id, xid), None)
                raise
        return xid

    # ---- requests with replies --------------------------------------------------------------------
    def _request(self, dp, msg, timeout: float) -> list:
        ev = hub.Event()
        replies: list = []
        xid = self.send(dp, msg, (ev, replies))
        try:
            if not ev.wait(timeout=timeout):
                raise SwitchTimeout(f"switch {dp.id:#x} did not answer {type(msg).__name__} within {timeout} s")
            return replies
        finally:
            self._waiters.pop((dp.id, xid), None)

    def request_flows(self, dp, cookie: int) -> list:
        ofp, parser = dp.ofproto, dp.ofproto_parser
        req = parser.OFPFlowStatsRequest(dp, 0, ofp.OFPTT_ALL, ofp.OFPP_ANY, ofp.OFPG_ANY, cookie, COOKIE_MASK,
                                         parser.OFPMatch())
        return [st for msg, _ in self._request(dp, req, STATS_TIMEOUT_S) for st in msg.body]

    def request_ports(self, dp) -> list[int]:
        """The switch's port numbers (OFPMP_PORT_DESC), its reserved ports (LOCAL, ...) left out."""
        ofp = dp.ofproto
        req = dp.ofproto_parser.OFPPortDescStatsRequest(dp, 0)
        return sorted(p.port_no for msg, _ in self._request(dp, req, STATS_TIMEOUT_S) for p in msg.body
                      if p.port_no < ofp.OFPP_MAX)

    def request_groups(self, dp) -> dict[int, tuple]:
        req = dp.ofproto_parser.OFPGroupDescStatsRequest(dp, 0)
        out = {}
        for msg, _ in self._request(dp, req, STATS_TIMEOUT_S):
            for g in msg.body:
                out[g.group_id] = tuple(a.port for b in g.buckets for a in b.actions if hasattr(a, "port"))
        return out

    def _reply(self, ev, last: bool) -> None:
        msg = ev.msg
        w = self._waiters.get((msg.datapath.id, msg.xid))
        if w is None:
            return
        w[1].append((msg, time.perf_counter()))
        if last:
            w[0].set()

    @set_ev_cls(ofp_event.EventOFPBarrierReply, MAIN_DISPATCHER)
    def _barrier_reply(self, ev):
        self._reply(ev, True)

    @set_ev_cls(ofp_event.EventOFPFlowStatsReply, MAIN_DISPATCHER)
    def _flow_stats_reply(self, ev):
        self._reply(ev, not (ev.msg.flags & ev.msg.datapath.ofproto.OFPMPF_REPLY_MORE))

    @set_ev_cls(ofp_event.EventOFPGroupDescStatsReply, MAIN_DISPATCHER)
    def _group_desc_reply(self, ev):
        self._reply(ev, not (ev.msg.flags & ev.msg.datapath.ofproto.OFPMPF_REPLY_MORE))

    @set_ev_cls(ofp_event.EventOFPPortDescStatsReply, MAIN_DISPATCHER)
    def _port_desc_reply(self, ev):
        self._reply(ev, not (ev.msg.flags & ev.msg.datapath.ofproto.OFPMPF_REPLY_MORE))

    @set_ev_cls(ofp_event.EventOFPErrorMsg, [CONFIG_DISPATCHER, MAIN_DISPATCHER])
    def _error(self, ev):
        m = ev.msg
        log.error("switch %#x: OpenFlow error type %d code %d (xid %d)", m.datapath.id, m.type, m.code, m.xid)

    def _delete_stats_flow(self, dp, st) -> None:
        ofp, parser = dp.ofproto, dp.ofproto_parser
        self.send(dp, parser.OFPFlowMod(dp, cookie=st.cookie, cookie_mask=ALL_BITS, table_id=st.table_id,
                                      command=ofp.OFPFC_DELETE_STRICT, priority=st.priority,
                                      out_port=ofp.OFPP_ANY, out_group=ofp.OFPG_ANY, match=st.match))

    def send_barrier(self, dpids: Sequence[int], timeout: float = BARRIER_TIMEOUT_S) -> "AppBarrier":
        """Send a barrier to every switch now; ``wait()`` on the result collects the replies."""
        waits = []
        try:
            for d in dpids:
                dp = self.dps.get(d)
                if dp is None:
                    raise SwitchTimeout(f"switch {d:#x} is not connected")
                req = dp.ofproto_parser.OFPBarrierRequest(dp)
                ev = hub.Event()
                xid = self.send(dp, req, (ev, []))
                waits.append((d, xid, ev))
        except BaseException:
            for d, xid, _ in waits:
                self._waiters.pop((d, xid), None)
            raise
        return AppBarrier(self, waits, timeout)


class AppBarrier:
    def __init__(self, app: OrlControllerApp, waits: list, timeout: float):
        self.app = app
        self.waits = waits
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout

    def wait(self) -> float:
        """Block until every reply arrived; the perf_counter time of the last one."""
        try:
            last = 0.0
            for d, xid, ev in self.waits:
                if not ev.wait(timeout=max(0.0, self.deadline - time.monotonic())):
                    raise SwitchTimeout(f"switch {d:#x} did not confirm (barrier) within {self.timeout} s")
                last = max(last, self.app._waiters[(d, xid)][1][-1][1])
            return last if self.waits else time.perf_counter()
        finally:
            for d, xid, _ in self.waits:
                self.app._waiters.pop((d, xid), None)


# ---- message building (pure helpers over an os-ken datapath) ------------------------------------------
def match_items(match) -> tuple:
    return tuple(sorted((k, v) for k, v in match.items()))


def ocs_flow_pair(st) -> tuple[int, int] | None:
    """(in_port, out_port) of a circuit flow read back from an OCS; None for anything else."""
    items = dict(match_items(st.match))
    if set(items) != {"in_port"} or st.priority != OCS_PRIORITY or len(st.instructions) != 1:
        return None
    acts = getattr(st.instructions[0], "actions", [])
    if len(acts) != 1 or not hasattr(acts[0], "port"):
        return None
    return int(items["in_port"]), int(acts[0].port)


def _actions(dp, fs: FlowSpec) -> list:
    parser = dp.ofproto_parser
    out = []
    for kind, arg in fs.actions:
        if kind == "output":
            out.append(parser.OFPActionOutput(int(arg)))
        elif kind == "group":
            out.append(parser.OFPActionGroup(int(arg)))
        else:
            raise ValueError(f"unsupported action {kind!r} in {fs}")
    return out


def flow_add(dp, fs: FlowSpec):
    ofp, parser = dp.ofproto, dp.ofproto_parser
    inst = [parser.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, _actions(dp, fs))]
    return parser.OFPFlowMod(dp, cookie=fs.cookie, command=ofp.OFPFC_ADD, priority=fs.priority,
                             match=parser.OFPMatch(**fs.match_dict()), instructions=inst)


def flow_delete(dp, fs: FlowSpec):
    ofp, parser = dp.ofproto, dp.ofproto_parser
    return parser.OFPFlowMod(dp, cookie=fs.cookie, cookie_mask=COOKIE_MASK, command=ofp.OFPFC_DELETE_STRICT,
                             priority=fs.priority, out_port=ofp.OFPP_ANY, out_group=ofp.OFPG_ANY,
                             match=parser.OFPMatch(**fs.match_dict()))


def group_mod(dp, group_id: int, ports: Sequence[int], command: str):
    ofp, parser = dp.ofproto, dp.ofproto_parser
    cmd = {"add": ofp.OFPGC_ADD, "modify": ofp.OFPGC_MODIFY, "delete": ofp.OFPGC_DELETE}[command]
    buckets = [] if command == "delete" else [
        parser.OFPBucket(weight=1, watch_port=ofp.OFPP_ANY, watch_group=ofp.OFPG_ANY,
                         actions=[parser.OFPActionOutput(int(p))]) for p in ports]
    return parser.OFPGroupMod(dp, command=cmd, type_=ofp.OFPGT_SELECT, group_id=int(group_id), buckets=buckets)


class OsKenDriver:
    """:class:`controller.reconfig.executor.Driver` over the app's connected datapaths; ``flow_cache``: the
    ovs-vswitchd flow cache to flush around reconfigurations (controller/datapath.py), or None."""

    def __init__(self, app: OrlControllerApp, flow_cache: FlowCache | None = None, metrics: Any = None):
        self.app = app
        self.flow_cache = flow_cache
        self.flush_failures = 0
        self.metrics = metrics  # controller.metrics.ControllerMetrics, or None

    @property
    def flushes_flow_cache(self) -> bool:
        return self.flow_cache is not None

    def flush_flow_cache(self) -> None:
        try:
            ms = self.flow_cache.purge()
            log.debug("datapath flow cache purged in %.2f ms", ms)
        except FlowCacheError as e:  # fidelity, not correctness: the cache still catches up by itself
            self.flush_failures += 1
            log.warning("datapath flow cache not purged (%d so far): %s", self.flush_failures, e)
            if self.metrics is not None:
                self.metrics.flush(False)
            return
        if self.metrics is not None:
            self.metrics.flush(True, ms / 1000.0)

    def _dp(self, dpid: int):
        dp = self.app.dps.get(dpid)
        if dp is None:
            raise SwitchTimeout(f"switch {dpid:#x} is not connected")
        return dp

    def send_ocs_flows(self, ocs: int, deletes: Sequence[FlowSpec], adds: Sequence[FlowSpec]) -> None:
        dp = self._dp(self.app.spec.ocs_dpid(ocs))
        for fs in deletes:
            self.app.send(dp, flow_delete(dp, fs))
        for fs in adds:
            self.app.send(dp, flow_add(dp, fs))

    def send_barrier(self, ocses: Sequence[int]) -> AppBarrier:
        return self.app.send_barrier([self.app.spec.ocs_dpid(o) for o in ocses])

    def apply_route_changes(self, changes: Any, full: bool = False) -> None:
        touched = send_route_changes(self.app, changes, full)
        if touched:
            self.app.send_barrier(touched).wait()


def _stats_actions(st) -> tuple:
    out = []
    for inst in st.instructions:
        for a in getattr(inst, "actions", []):
            if hasattr(a, "group_id"):
                out.append(("group", int(a.group_id)))
            elif hasattr(a, "port"):
                out.append(("output", int(a.port)))
            else:
                out.append((type(a).__name__, None))
    return tuple(out)


def send_route_changes(app: OrlControllerApp, changes: Any, full: bool) -> list[int]:
    """Send the ToR operations of a ``routing.RouteChanges`` (see controller.tor_sync); the dpids touched.

    ``full``: ``changes`` is the complete route state; the ToRs read back since their last full sync are
    synced against what they held (tor_sync.tor_ops decides what to send).
    """
    held = {t: app.tor_tables.get(t, TorTables()) for t in app.fresh_tors} if full else {}
    plan = tor_ops(changes, full, held)
    for ops in plan:  # every ToR to touch is connected, or nothing is sent
        if app.spec.tor_dpid(ops.tor) not in app.dps:
            raise SwitchTimeout(f"ToR {ops.tor} (switch {app.spec.tor_dpid(ops.tor):#x}) is not connected")
    touched = []
    for ops in plan:
        dpid = app.spec.tor_dpid(ops.tor)
        dp = app.dps[dpid]
        if full:
            app.fresh_tors.discard(ops.tor)
        for key in ops.delete_held:
            app._delete_stats_flow(dp, app.tor_stats[ops.tor][key])
        for g in ops.changes.add_groups:
            app.send(dp, group_mod(dp, g.group_id, g.ports, "add"))
        for g in ops.changes.modify_groups:
            app.send(dp, group_mod(dp, g.group_id, g.ports, "modify"))
        for f in ops.changes.add_flows:
            app.send(dp, flow_add(dp, f))
        for f in ops.changes.delete_flows:
            app.send(dp, flow_delete(dp, f))
        for gid in ops.changes.delete_groups:
            app.send(dp, group_mod(dp, gid, (), "delete"))
        touched.append(dpid)
    return touched


# ---- process entry --------------------------------------------------------------------------------
def run_controller(cfg: ControllerConfig) -> int:
    """Run the controller in this process until it is killed (SIGTERM/SIGINT end it)."""
    global _CONFIG, _METRICS
    from os_ken import cfg as oscfg

    if cfg.token is None and cfg.token_file is not None:  # check_config's result without with_token
        raise ValueError("ControllerConfig has a token_file but no token: build it with config_from_options")
    oscfg.CONF(args=["--ofp-tcp-listen-port", str(cfg.of_port), "--ofp-listen-host", cfg.of_host],
               project="os_ken")
    try:
        server = make_server(cfg.rest_host, cfg.rest_port)
    except OSError as e:
        log.error("cannot listen for REST on %s:%d: %s", cfg.rest_host, cfg.rest_port, e)
        return 1
    metrics_server = None
    if cfg.metrics_port:
        from emulation.metrics import MetricsServer

        from .metrics import ControllerMetrics

        _METRICS = ControllerMetrics()
        try:
            metrics_server = MetricsServer(_METRICS.registry, cfg.metrics_host, cfg.metrics_port).start()
        except OSError as e:
            log.error("cannot serve metrics on %s:%d: %s", cfg.metrics_host, cfg.metrics_port, e)
            server.server_close()
            return 1
    _CONFIG = cfg
    mgr = app_manager.AppManager.get_instance()
    mgr.load_apps([__name__])
    contexts = mgr.create_contexts()
    services = mgr.instantiate_apps(**contexts)
    app = app_manager.lookup_service_brick(OrlControllerApp.__name__)
    server.set_app(RestApp(app.core, cfg.token, on_answer=_METRICS.rest if _METRICS is not None else None))
    services.append(hub.spawn(server.serve_forever, 0.2))
    log.info("OpenFlow on %s:%d; REST API on http://%s:%d/api/v1/ (%s); metrics %s", cfg.of_host, cfg.of_port,
             cfg.rest_host, cfg.rest_port, "no auth" if cfg.token is None else f"token in {cfg.token_file}",
             metrics_server.url if metrics_server is not None else "off")
    # SIGTERM / SIGHUP / Ctrl-C: leave at once. Nothing answered is lost: the state file is written atomically
    # before a change is reported done, and the fail-secure switches keep their flows (a restart reconciles).
    for sig in EXIT_SIGNALS:
        signal.signal(sig, _exit_on_signal)
    signal.signal(signal.SIGUSR1, _dump_stacks)  # `kill -USR1 PID`: every thread's stack to the log
    if cfg.owner_pid is not None:
        threading.Thread(target=_watch_owner, args=(cfg.owner_pid, cfg.owner_start), name="owner-watch",
                         daemon=True).start()
    try:
        hub.joinall(services)
    finally:
        mgr.close()
    return 0


def _dump_stacks(signum, frame) -> None:
    """Log the stack of every thread, native and green (diagnosing a stuck controller without stopping it)."""
    import gc
    import sys
    import traceback

    stacks = []
    try:  # eventlet's (os-ken imports it); without it there are only native threads
        import greenlet
    except ImportError:
        greenlet = None
    for obj in gc.get_objects() if greenlet is not None else ():
        if isinstance(obj, greenlet.greenlet) and obj.gr_frame is not None:
            stacks.append("green:\n" + "".join(traceback.format_stack(obj.gr_frame)))
    for tid, f in sys._current_frames().items():
        stacks.append(f"thread {tid}:\n" + "".join(traceback.format_stack(f)))
    log.warning("SIGUSR1: %d stacks (green threads, then native threads)\n%s", len(stacks),
                "\n----\n".join(stacks))


EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
OWNER_POLL_S = 0.5


def _exit_on_signal(signum, frame) -> None:
    log.info("signal %d: controller exiting", signum)
    logging.shutdown()
    os._exit(128 + signum)  # the shell's convention: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP


def _watch_owner(pid: int, start: int | None) -> None:
    """Exit once the process that started the controller is gone (it died without stopping it: SIGKILL)."""
    from emulation.registry import process_alive

    while process_alive(pid, start):
        time.sleep(OWNER_POLL_S)
    log.warning("the process that started the controller (PID %d) is gone: controller exiting", pid)
    logging.shutdown()
    os._exit(0)
