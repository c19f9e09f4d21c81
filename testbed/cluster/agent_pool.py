"""The emulated cluster: controller + fabric (testbed.cluster.fabric) + one long-lived agent per server.

:class:`AgentPool` starts an agent (``python -m agents.node``) inside every Mininet host once, waits until each
answers on the management network, forms the torch.distributed world over the fabric, and keeps the
bookkeeping a driver needs: where every request was placed (submissions and migrations), what the trainer-side
collectors received, which agents died. Phases never spawn processes (DESIGN.md): everything after start-up is
an RPC to a running agent.

Failure: an agent whose process exited, or that misses the deadline of a per-tick call (:meth:`AgentPool.gather`),
is *failed* at once: one that missed a deadline is also stopped (its process group SIGKILLed by the PID this
pool started), so that it cannot go on streaming what is re-queued elsewhere, and every live agent is told
(``peer_down``: a migration to or from it gives up at once). A call to a failed agent fails immediately
(:class:`AgentFailed`), and a call that waits on an agent (``watch``) gives up as soon as that agent's process
exits, instead of waiting out its deadline. :meth:`AgentPool.lost_requests` lists the requests last seen on
it that the collectors have not seen finish and no live agent holds, with the tokens already delivered, so
the caller can re-queue them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from agents.client import AgentClient, AgentError, AgentGone, AgentTimeout, call_all, call_each
from agents.engine import Layout
from agents.protocol import AgentConfig, Endpoint, unpack_array
from agents.realcompute import DecoderConfig
from controller.traffic import phase_traffic
from emulation.builder import EmulatedFabric
from emulation.orchestration import EngineSettings
from emulation.registry import proc_start_time
from emulation.scenario import Scenario
from emulation.signals import shielded
from emulation.validation import SpecError, to_dict
from testbed.cluster.fabric import Testbed, running_testbed

log = logging.getLogger(__name__)

RPC_PORT = 7000
COLLECTOR_PORT = 7100
STORE_PORT_BASE = 29400
ROOT = Path(__file__).resolve().parents[2]


class AgentFailed(AgentError):
    """A call to an agent that is known to have failed: refused at once, nothing sent."""

    def __init__(self, agent: int, method: str, why: str):
        super().__init__(f"agent {agent}", method, f"agent {agent} failed: {why}", None)
        self.server = agent
        self.why = why


@dataclass
class Collected:
    """What every collector received, merged: per request id, unique tokens, contiguous prefix, duplicates
    and the final length when the request finished."""

    rid: np.ndarray
    count: np.ndarray
    contiguous: np.ndarray
    dups: np.ndarray
    final_len: np.ndarray
    summary: dict
    sources: dict[int, dict] = field(default_factory=dict)  # agent -> {"received": n, "unique": n} tokens

    def by_rid(self) -> dict[int, int]:
        return dict(zip(self.rid.tolist(), self.count.tolist()))

    def finished(self) -> set[int]:
        """Requests whose last token arrived."""
        return set(self.rid[self.final_len >= 0].tolist())

    def gapped(self) -> dict[int, int]:
        """Requests whose last token arrived while some earlier one did not: {rid: contiguous prefix}."""
        m = (self.final_len >= 0) & (self.contiguous < self.final_len)
        return dict(zip(self.rid[m].tolist(), self.contiguous[m].tolist()))


@dataclass
class AgentPool:
    fabric: EmulatedFabric
    scenario: Scenario
    layouts: dict[int, Layout] = field(default_factory=dict)  # server -> its starting layout (default: rollout_tp)
    engine: EngineSettings = field(default_factory=EngineSettings)
    start_timeout_s: float = 120.0
    health_timeout_s: float = 3.0
    real_compute: DecoderConfig | None = None  # real-compute mode: every agent's engine times its steps on it

    def __post_init__(self) -> None:
        spec, layout = self.scenario.fabric, self.scenario.layout
        self.spec = spec
        self.trainers = layout.train_servers(spec)
        self.generators = layout.gen_servers(spec)
        self.n = spec.n_servers
        self.procs: dict[int, subprocess.Popen] = {}
        self.clients: dict[int, AgentClient] = {}
        self.placement: dict[int, int] = {}  # rid -> agent
        self.served: dict[int, set[int]] = {}  # rid -> every agent that held it (its tokens came from them)
        self.failed: dict[int, str] = {}  # agent -> why
        self.failed_at: dict[int, float] = {}  # agent -> time.monotonic() when it was marked failed
        # agent -> when it missed a gather's deadline, while that call (with its failure deadline) goes on
        self.late: dict[int, float] = {}
        self.pids: dict[int, int] = {}
        self._generation = 0
        self.group_members: dict[str, frozenset[int]] = {}
        self.group_alias: dict[str, str] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * self.n), thread_name_prefix="pool")
        self._fail_lock = threading.Lock()
        self._dir: Path | None = None
        self._started = False

    # ---- life cycle ----
    def __enter__(self) -> "AgentPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def config(self, s: int) -> AgentConfig:
        """Agent ``s``'s configuration, validated here (an impossible value is an error naming the field before
        any agent starts); the agent parses the same JSON back (agents.protocol.load_agent_config)."""
        spec, w = self.spec, self.scenario.workload
        gps = spec.gpus_per_server
        try:
            return AgentConfig(
                index=s, server=s, role="train" if s in self.trainers else "gen", gpus=gps, model=w.model, gpu=w.gpu,
                rpc=Endpoint(self.fabric.mgmt_ip(s), RPC_PORT), fabric_ip=spec.host_ip(s),
                fabric_intf=self.fabric.intf_of(s),
                layout=self.layouts.get(s, Layout(tp=w.rollout_tp)).name(gps), engine=self.engine,
                time_dilation=spec.time_dilation, scale=spec.scale,
                collector_port=COLLECTOR_PORT if s in self.trainers else None,
                collectors=tuple(Endpoint(spec.host_ip(t), COLLECTOR_PORT) for t in self.trainers),
                real_compute=self.real_compute, owner_pid=os.getpid(), owner_start=proc_start_time(os.getpid()))
        except SpecError as e:
            raise SpecError(f"agents[{s}].{e.field}", e.message) from None

    def start(self) -> "AgentPool":
        if self._started:
            return self
        self._started = True
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        t0 = time.monotonic()
        self._dir = Path(self.fabric.workdir) / "agents"
        self._dir.mkdir(exist_ok=True)
        configs = [self.config(s) for s in range(self.n)]  # every one checked before any process starts
        for s in range(self.n):
            cfg = self._dir / f"agent{s}.json"
            cfg.write_text(json.dumps(to_dict(configs[s])))
            env = dict(os.environ, GLOO_SOCKET_IFNAME=self.fabric.intf_of(s), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                       MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            self.procs[s] = self.fabric.popen(
                s, [sys.executable, "-m", "agents.node", "--config", str(cfg), "--log", str(self._dir / f"agent{s}.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(self._dir / f"agent{s}.err", "wb"),
                env=env, cwd=str(ROOT), role="agent")
            self.clients[s] = AgentClient(f"tcp://{self.fabric.mgmt_ip(s)}:{RPC_PORT}", f"agent {s}", timeout_s=10.0)
        deadline = time.monotonic() + self.start_timeout_s
        for s in range(self.n):
            while True:
                if self.procs[s].poll() is not None:
                    raise RuntimeError(f"agent {s} exited with {self.procs[s].returncode} during start:\n"
                                       f"{self.log_tail(s)}")
                try:
                    self.pids[s] = self.clients[s].call("ping", timeout_s=1.0)["pid"]
                    break
                except AgentTimeout:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"agent {s} did not answer within {self.start_timeout_s} s:\n"
                                           f"{self.log_tail(s)}") from None
        self.start_s = time.monotonic() - t0
        self.form_world(list(range(self.n)))
        log.info("%d agents up in %.1f s (world formed)", self.n, time.monotonic() - t0)

    def log_tail(self, s: int, n: int = 3000) -> str:
        out = ""
        for suffix in (".err", ".log"):
            p = (self._dir or Path("/nonexistent")) / f"agent{s}{suffix}"
            with contextlib.suppress(OSError):
                out += p.read_bytes()[-n:].decode(errors="replace")
        return out

    def form_world(self, agents: Sequence[int], timeout_s: float = 60.0) -> dict:
        """(Re-)form the torch.distributed world of ``agents`` and the groups ``trainers`` and ``generators``
        (without restarting anything)."""
        self._generation += 1
        self.group_members: dict[str, frozenset[int]] = {}  # the groups formed in this world
        self.group_alias: dict[str, str] = {}
        master = {"host": self.fabric.mgmt_ip(agents[0]), "port": STORE_PORT_BASE + self._generation % 500}
        members = {a: self.clients[a] for a in agents}
        res = call_all(members, "dist_init", lambda a: {"agents": list(agents), "master": master,
                                                         "timeout_s": timeout_s}, timeout_s + 10, self._pool)
        for name, group in (("trainers", self.trainers), ("generators", self.generators)):
            live = [a for a in group if a in agents]
            if len(live) >= 2:
                self.form_group(name, live, timeout_s)
        # training's collectives (controller.traffic): EP all-to-all groups, DP rings
        for name, g in self.train_groups():
            if g.kind != "p2p" and all(a in agents for a in g.members):
                self.form_group(name, list(g.members), timeout_s)
        return res

    def train_groups(self) -> list:
        """(process-group name, ``controller.traffic.Group``) of every collective training runs."""
        scn = self.scenario
        return phase_traffic(scn.fabric, scn.layout, scn.workload).train.named_groups()

    def form_group(self, name: str, agents: Sequence[int], timeout_s: float = 60.0) -> dict:
        """Form process group ``name``. torch names a locally synchronised group by its ranks, so a second
        group of the same agents would meet the first one's rendezvous: it becomes an alias instead
        (:meth:`group`)."""
        members = frozenset(agents)
        same = next((n for n, m in self.group_members.items() if m == members and n != name), None)
        if same is not None:
            self.group_alias[name] = same
            return {"group": name, "alias_of": same}
        self.group_members[name] = members
        self.group_alias.pop(name, None)
        return call_all({a: self.clients[a] for a in agents}, "form_group",
                        lambda a: {"name": name, "agents": list(agents), "timeout_s": timeout_s}, timeout_s + 10,
                        self._pool)

    def group(self, name: str) -> str:
        """The process group the agents know ``name`` by."""
        return self.group_alias.get(name, name)

    def stop(self) -> None:
        """Ask every agent to stop, then make sure (by PID: the fabric's records) they are gone. Idempotent; a
        teardown signal meanwhile waits until it is done."""
        if not self._started:
            return
        with shielded():
            self._stop()

    def _stop(self) -> None:
        self._started = False
        live = {s: c for s, c in self.clients.items() if self.procs.get(s) is not None and self.procs[s].poll() is None}
        if live:
            with contextlib.suppress(Exception):
                call_all(live, "shutdown", lambda s: None, 2.0, self._pool)
        for s, p in self.procs.items():
            try:
                p.wait(timeout=3.0)
            except subprocess.TimeoutExpired:
                log.warning("agent %d did not stop; killing pid %d", s, p.pid)
                p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=3.0)
        for c in self.clients.values():
            c.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._keep_crash_logs()

    def _keep_crash_logs(self) -> None:
        """An agent that exited by itself with an error (not one that was stopped or killed) has its log copied
        out of the fabric's scratch folder (removed with the fabric) into a kept folder the log names."""
        crashed = [s for s, p in self.procs.items() if p.returncode is not None and p.returncode > 0]
        if not crashed or self._dir is None:
            return
        import shutil
        import tempfile

        kept = Path(tempfile.mkdtemp(prefix="orlagents-"))
        for s in crashed:
            for suffix in (".log", ".err"):
                with contextlib.suppress(OSError):
                    shutil.copy2(self._dir / f"agent{s}{suffix}", kept / f"agent{s}{suffix}")
        log.warning("agent(s) %s exited with an error; their logs are kept in %s", crashed, kept)

    # ---- calls ----
    def exited(self, s: int) -> str | None:
        """Why agent ``s`` is gone (its process exited), or None while it runs (a non-blocking wait)."""
        p = self.procs.get(s)
        if p is not None and p.poll() is not None:
            return f"process exited with {p.returncode}"
        return None

    def watch(self, *agents: int):
        """An ``abort`` for AgentClient.call: the reason once any of ``agents`` failed or its process exited."""
        def why() -> str | None:
            for a in agents:
                if a in self.failed:
                    return f"agent {a} failed: {self.failed[a]}"
                gone = self.exited(a)
                if gone:
                    self.mark_failed(a, gone)
                    return f"agent {a} {gone}"
            return None
        return why

    def call(self, s: int, method: str, params: Any = None, timeout_s: float | None = None,
             watch: Sequence[int] = ()) -> Any:
        """``method`` on agent ``s``. Refused at once (AgentFailed) when ``s`` failed; given up (AgentGone) as
        soon as ``s`` or an agent in ``watch`` (e.g. a migration's destination) fails or exits."""
        if s in self.failed:
            raise AgentFailed(s, method, self.failed[s])
        try:
            return self.clients[s].call(method, params, timeout_s, abort=self.watch(s, *watch))
        except AgentTimeout:
            gone = self.exited(s)
            if gone:
                self.mark_failed(s, gone)
            raise

    def call_all(self, agents: Sequence[int], method: str, params_of, timeout_s: float,
                 watch: Sequence[int] | None = None) -> dict[int, Any]:
        """``method`` on every agent of ``agents`` at once; the first error after all returned. Every call gives
        up as soon as one of ``agents`` (or of ``watch``) fails or exits (a collective cannot finish then)."""
        bad = [a for a in agents if a in self.failed]
        if bad:
            raise AgentFailed(bad[0], method, self.failed[bad[0]])
        return call_all({a: self.clients[a] for a in agents}, method, params_of, timeout_s, self._pool,
                        abort=self.watch(*agents, *(watch or ())))

    def gather(self, agents: Sequence[int], method: str, params_of, deadline_s: float,
               fail_late: bool = True, fail_after_s: float | None = None) -> dict[int, Any]:
        """A per-tick call: ``method`` on every agent at once with the deadline ``deadline_s``; the answers of
        those that answered in time. One whose process exited is marked failed. One that missed the deadline:
        with ``fail_late``, failed (and stopped: see :meth:`mark_failed`) at the deadline, or, given
        ``fail_after_s`` (> ``deadline_s``), left out now while its call goes on, and failed if that call has
        no answer ``fail_after_s`` after it was made (a late answer clears it; until then the agent is left out
        of later gathers too: see :attr:`late`); without ``fail_late`` it is only left out. An error reply is
        raised."""
        grace = fail_after_s if (fail_late and fail_after_s is not None and fail_after_s > deadline_s) else None
        live = {a: self.clients[a] for a in agents if a not in self.failed and a not in self.late}
        if grace is None:
            out, errs = call_each(live, method, params_of, deadline_s, self._pool, lambda a: self.watch(a))
        else:
            futs = {a: self._pool.submit(c.call, method, params_of(a), grace, self.watch(a)) for a, c in live.items()}
            wait(list(futs.values()), timeout=deadline_s)
            out, errs = {}, {}
            for a, f in futs.items():
                if not f.done():  # late: left out of this gather; its call decides (_late_done)
                    with self._fail_lock:
                        self.late[a] = time.monotonic()
                    log.warning("agent %d missed the %.0f ms deadline of %r: left out, failed if it has not "
                                "answered within %.0f ms", a, deadline_s * 1e3, method, grace * 1e3)
                    f.add_done_callback(lambda f, a=a: self._late_done(a, f, method, grace))
                    continue
                try:
                    out[a] = f.result()
                except Exception as e:  # noqa: BLE001 - sorted below
                    errs[a] = e
        for a, e in errs.items():
            if isinstance(e, AgentGone):
                continue  # watch() marked it failed
            if isinstance(e, AgentTimeout):
                gone = self.exited(a)
                if gone or fail_late:
                    self.mark_failed(a, gone or f"missed the {(grace or deadline_s) * 1e3:.0f} ms deadline of "
                                     f"{method!r}", fence=True)
                continue
            raise e
        return out

    def _late_done(self, a: int, f, method: str, grace: float) -> None:
        """The late call of a gather ended: an answer clears the agent; none within ``grace`` fails it."""
        e = f.exception()
        with self._fail_lock:
            self.late.pop(a, None)
        if isinstance(e, AgentTimeout):
            gone = self.exited(a)
            self.mark_failed(a, gone or f"no answer to {method!r} within {grace * 1e3:.0f} ms", fence=True)
        elif e is None:
            log.info("agent %d answered %r late: it stays", a, method)

    def mark_failed(self, s: int, why: str, fence: bool = False) -> None:
        """Agent ``s`` failed (``why``). ``fence``: it may still run (it missed a deadline): stop its process
        group (SIGKILL, by the PID this pool started) so it cannot stream tokens for requests re-queued
        elsewhere. Every live agent is told, so a migration involving ``s`` gives up at once."""
        with self._fail_lock:  # watch() runs on the calls' threads: mark once
            if s in self.failed:
                return
            self.failed[s] = why
            self.failed_at[s] = time.monotonic()
        log.error("agent %d failed: %s", s, why)
        p = self.procs.get(s)
        if fence and p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # popen started it in its own session: its group is its own
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=2.0)
        live = [a for a in self.clients if a not in self.failed and self.exited(a) is None]
        for a in live:  # told in the background: the caller's tick does not wait for the answers
            self._pool.submit(self._tell_peer_down, a, s)

    def _tell_peer_down(self, a: int, dead: int) -> None:
        with contextlib.suppress(Exception):
            self.clients[a].call("peer_down", {"agent": dead}, timeout_s=2.0, abort=self.watch(a))

    def check_health(self, agents: Sequence[int] | None = None) -> dict[int, str]:
        """Mark agents failed whose process exited or that miss a ping deadline (``health_timeout_s``, all
        pinged at once); returns the newly failed."""
        todo = [s for s in (agents if agents is not None else list(self.clients)) if s not in self.failed]
        before = set(self.failed)
        for s in todo:
            gone = self.exited(s)
            if gone:
                self.mark_failed(s, gone)
        self.gather([s for s in todo if s not in self.failed], "ping", lambda s: None, self.health_timeout_s)
        return {s: why for s, why in self.failed.items() if s not in before}

    def poll_exits(self) -> dict[int, str]:
        """Mark agents failed whose process exited (no call: a non-blocking wait per agent); the newly failed."""
        new = {}
        for s in self.clients:
            if s not in self.failed:
                gone = self.exited(s)
                if gone:
                    self.mark_failed(s, gone)
                    new[s] = gone
        return new

    # ---- requests ----
    def submit(self, s: int, requests: list[dict], replica: int | None = None, chunked: bool = False) -> dict:
        res = self.call(s, "submit", {"requests": requests, "replica": replica, "chunked": chunked})
        for r in requests:
            self._place(r["rid"], s)
        return res

    def _place(self, rid: int, s: int) -> None:
        self.placement[rid] = s
        self.served.setdefault(rid, set()).add(s)

    def forget_requests(self) -> None:
        """A fresh run: no request is anywhere."""
        self.placement.clear()
        self.served.clear()

    def migrate(self, rid: int, src: int, dst: int, mode: str = "multi_stage", timeout_s: float = 30.0,
                replica: int | None = None) -> dict:
        """Move ``rid`` from ``src`` to ``dst``. Given up at once (AgentGone) when either fails meanwhile; the
        source then keeps the request, or (``dst`` gone) is told and puts it back in its own engine."""
        res = self.call(src, "migrate", {"rid": rid, "dst": dst, "mode": mode, "timeout_s": timeout_s,
                                         "dst_replica": replica,
                                         "dst_rpc": {"host": self.fabric.mgmt_ip(dst), "port": RPC_PORT}},
                        timeout_s=timeout_s + 5, watch=(dst,))
        if res.get("result") == "moved":
            self._place(rid, dst)
        return res

    def note_held(self, s: int, rids) -> None:
        """Agent ``s`` reported holding ``rids`` (a snapshot): that is where they are now (a migration whose
        answer was given up on may still have landed)."""
        for r in np.asarray(rids).tolist():
            self._place(int(r), s)

    def collected(self, timeout_s: float = 30.0) -> Collected:
        """Every trainer collector's ledger, merged by request id."""
        live = [t for t in self.trainers if t not in self.failed]
        docs = self.call_all(live, "collector_stats", lambda s: None, timeout_s)
        rid, cnt, cont, dups, fin = [], [], [], [], []
        summary: dict[str, int] = {}
        sources: dict[int, dict] = {}
        for d in docs.values():
            rid.append(unpack_array(d["rid"])); cnt.append(unpack_array(d["count"]))
            cont.append(unpack_array(d["contiguous"])); dups.append(unpack_array(d["dups"]))
            fin.append(unpack_array(d["final_len"]))
            for k, v in d.items():
                if isinstance(v, int):
                    summary[k] = summary.get(k, 0) + v
            for src, received, unique in d.get("sources", []):
                acc = sources.setdefault(int(src), {"received": 0, "unique": 0})
                acc["received"] += int(received)
                acc["unique"] += int(unique)
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
        r, c, co, du, f = cat(rid), cat(cnt), cat(cont), cat(dups), cat(fin)
        if len(r) and len(np.unique(r)) != len(r):  # a request's tokens went to one collector: never split
            raise RuntimeError("a request's tokens arrived at two collectors")
        return Collected(r, c, co, du, f, summary, sources)

    def reset_collectors(self) -> None:
        """Start counting afresh (a new RL step); requests that finished are forgotten, the rest stay placed."""
        done = self.collected().finished()
        self.placement = {r: a for r, a in self.placement.items() if r not in done}
        self.served = {r: a for r, a in self.served.items() if r in self.placement}
        self.call_all([t for t in self.trainers if t not in self.failed], "collector_reset", lambda s: None, 10.0)

    def lost_requests(self, s: int, collected: Collected | None = None,
                      held: set[int] | None = None) -> dict[int, int]:
        """Requests last seen on agent ``s`` that did not finish and that no live agent holds (``held``: the
        rids in the live agents' latest snapshots), with how many of their tokens the collectors hold from the
        start on without a gap (where a re-queued request resumes: a token past a gap that did arrive will
        come again and be counted as a duplicate, never twice)."""
        col = collected or self.collected()
        done = col.finished()
        held = held or set()
        got = dict(zip(col.rid.tolist(), col.contiguous.tolist()))
        return {rid: got.get(rid, 0) for rid, a in self.placement.items()
                if a == s and rid not in done and rid not in held}


    def stranded(self, collected: Collected | None = None, held: set[int] | None = None) -> dict[int, int]:
        """Requests that finished with a gap only a failed agent could fill: their last token arrived, some
        earlier one did not, and an agent that held them (whose tokens those were) failed; none of them held
        by a live agent now (``held``). {rid: the collectors' contiguous prefix}, where a repair resumes them
        (what arrived past the gap comes again and is counted as a duplicate)."""
        col = collected or self.collected()
        held = held or set()
        return {rid: n for rid, n in col.gapped().items()
                if rid not in held and any(a in self.failed for a in self.served.get(rid, ()))}

@contextlib.contextmanager
def running_cluster(scn: Scenario, *, layouts: dict[int, Layout] | None = None,
                    engine: EngineSettings | None = None,
                    initial_phase: str | None = None, real_compute: DecoderConfig | None = None) -> Iterator[tuple[Testbed, AgentPool]]:
    """Controller + fabric + one agent per server, all torn down in reverse order. The controller exports
    Prometheus metrics by the scenario's ``metrics`` section (emulation.metrics.bind_port)."""
    from emulation.metrics import bind_port
    from emulation.scenario import DEFAULT_CONTROLLER_METRICS_PORT

    spec, ms = scn.fabric, scn.metrics
    mport = bind_port(ms.host, ms.controller_port, DEFAULT_CONTROLLER_METRICS_PORT, "metrics.controller_port")
    with running_testbed(spec, scn.layout, initial_phase=initial_phase or scn.controller.initial_phase,
                         delay_ms=scn.wall_delay_ms, workload=scn.workload,
                         metrics_port=mport, metrics_host=ms.host, rule=scn.controller.rule,
                         rule_params=scn.controller.rule_params) as tb:
        pool = AgentPool(tb.fabric, scn, layouts=layouts or {}, engine=engine or EngineSettings(),
                         real_compute=real_compute)
        with pool:
            yield tb, pool
