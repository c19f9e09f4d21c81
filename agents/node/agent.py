"""The GPU-node agent: one long-lived process per emulated server, inside its Mininet host.

    python -m agents.node --config FILE.json [--log FILE]

Threads:

* RPC (main thread): a ZeroMQ ROUTER on the management address; every message is validated by
  agents.protocol; quick methods are answered inline, slow ones (collectives, migration, modelled compute) run
  on workers and are answered when done. A malformed message gets an error reply naming the field; nothing
  a client sends can stop this loop.
* engine: the generation engine (agents.engine) in real time. Engine time is ``CLOCK_MONOTONIC / TDF`` (the
  time-dilation factor), so every modelled step lasts ``modelled x TDF`` of wall time and every reported
  time is real-time equivalent. After each wake-up it streams the tokens of the steps that ended, one
  message per collector, over the fabric (ZeroMQ PUSH to the collectors' fabric addresses).
* collector (trainer agents with a ``collector_port``): counts every token exactly once (agents.node.collector).
* comm: torch.distributed (agents.node.comm) on a single worker, so collectives keep one order on every rank.
* p2p / migration workers: KV transfers (point to point on the fabric) and the migration protocol.

Fidelity: for every step, the lateness of its completion beyond its modelled end (engine time) is recorded;
``fidelity`` reports it (p50/p99, as a fraction of the step) with the TDF that would remove it.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import zmq

from agents.costmodel import CostModel
from agents.engine import Engine, Layout, ModelledCost, NewRequest
from agents.protocol import (AgentConfig, ProtocolError, TokenBatch, decode_request, encode_error, encode_ok,
                             load_agent_config, pack_array, token_ids)
from emulation.registry import process_alive
from emulation.validation import SpecError

log = logging.getLogger("agents.node")

LAG_BOUND_S = 0.05  # tokens streamed more than 50 ms (engine time) after their step ended, p99: distorted


def _tight_timer_slack() -> None:
    """1 us timer slack (default 50 us) so waits for the next step end wake on time; best effort."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Fidelity:
    """How late each step's tokens left the agent after the step's modelled end (engine time = real-time
    equivalent seconds). The engine's schedule never slips (Agent.engine_loop): lateness delays the tokens on
    their way to the collectors, whose arrival times are what a step's makespan is measured on."""

    def __init__(self, keep: int = 200_000):
        self.modelled: deque[float] = deque(maxlen=keep)
        self.late: deque[float] = deque(maxlen=keep)
        self.batch: deque[int] = deque(maxlen=keep)
        self.steps = 0

    def record(self, modelled_s: float, late_s: float, batch: int) -> None:
        self.modelled.append(modelled_s)
        self.late.append(max(0.0, late_s))
        self.batch.append(batch)
        self.steps += 1

    def clear(self) -> None:
        self.modelled.clear(); self.late.clear(); self.batch.clear()
        self.steps = 0

    def report(self, tdf: float) -> dict:
        if not self.modelled:
            return {"steps": 0, "tdf": tdf, "distorted": False}
        m = np.asarray(self.modelled)
        late = np.asarray(self.late)
        p50, p99 = (float(x) for x in np.percentile(late, [50, 99]))
        distorted = bool(p99 > LAG_BOUND_S)
        # the agents' CPU did not keep up: a larger dilation gives every step more wall time
        need = tdf * min(10.0, max(1.5, p99 / LAG_BOUND_S)) if distorted else tdf
        return {"steps": int(self.steps), "tdf": tdf, "modelled_step_ms_p50": float(np.percentile(m, 50)) * 1e3,
                "lag_ms_p50": p50 * 1e3, "lag_ms_p99": p99 * 1e3, "lag_bound_ms": LAG_BOUND_S * 1e3,
                "batch_p50": float(np.percentile(np.asarray(self.batch), 50)), "distorted": distorted,
                "tdf_needed": float(math.ceil(need * 10) / 10.0)}


class Agent:
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.tdf = cfg.time_dilation
        self.started = time.monotonic()
        self.ctx = zmq.Context()
        self.cm = CostModel.for_names(cfg.model, cfg.gpu)
        self.kv_bytes_per_token = self.cm.kv_bytes_per_token() * cfg.scale  # emulated bytes
        cost = ModelledCost(self.cm, cfg.gpus, cfg.engine.switch_reinit_s)
        if cfg.real_compute is not None:
            from agents.node.realmodel import RealStepCost

            cost = RealStepCost(cfg.real_compute, self.cm, cfg.gpus, reinit_s=cfg.engine.switch_reinit_s)
        self.engine = Engine(cost, cfg.gpus, Layout.parse(cfg.layout, cfg.gpus, "config.layout"), cfg.engine)
        self.lock = threading.Lock()  # the engine, the fidelity record, the detach waiters
        self.detach_cv = threading.Condition(self.lock)
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.fidelity = Fidelity()
        self.pending: list = []  # step outputs completed by an RPC's catch-up, streamed by the engine loop
        self.tokens_sent = 0
        self.token_messages = 0
        self.send_wait_s = 0.0
        self._seq = 0
        from agents.node.comm import Comm

        self.comm = Comm(cfg.index)
        self.collector = None
        if cfg.collector_port is not None:
            from agents.node.collector import Collector

            self.collector = Collector(self.ctx, cfg.fabric_ip, cfg.collector_port, self.now)
        self.push: list[zmq.Socket] = []
        for ep in cfg.collectors:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.setsockopt(zmq.LINGER, 2000)
            s.connect(ep.url)
            self.push.append(s)
        self.comm_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comm")
        self.p2p_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="p2p")
        self.work_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="work")
        self.kv_recvs: dict[int, Future] = {}
        self.dead_peers: set[int] = set()  # agents the driver said failed (peer_down)
        self._tag = 0
        self.migrations: list[dict] = []
        self._reply_url = f"inproc://replies-{os.getpid()}"
        self._local = threading.local()

    # ---- time ----
    def now(self) -> float:
        return time.monotonic() / self.tdf

    # ---- engine loop ----
    def _at_now(self) -> float:
        """Bring the engine up to the present (every step that ended by now completed, each next step started
        when the one before it ended) and return the present; the caller holds ``self.lock``. Every RPC that
        reads or changes the engine calls this first, so it acts on the engine as of its own arrival."""
        now = self.now()
        outs: list = []
        self.engine.run_until(now, outs)
        self.engine.finished_log.clear()  # the collectors count finishes; the agent keeps no log of them
        if outs:
            for o in outs:
                self.fidelity.record(o.modelled_s, now - o.t_end, len(o.ids))
            if any(o.detached or len(o.finished) for o in outs):
                # a request asked to stop may instead finish in its last step: its waiter must hear that too
                # (it slept out its whole timeout otherwise: a 30 s planning tick)
                self.detach_cv.notify_all()
            self.pending.extend(outs)
        return now

    def engine_loop(self) -> None:
        """Pace the engine by the wall clock: wake when the next step ends (at most every ``tick_s`` of wall
        time), complete what ended, stream its tokens. A late wake delays tokens, never the schedule: the
        engine starts each step when the one before it ended (Engine.run_until), so the modelled timeline is
        the simulator's; the lateness (delivery lag) is what the fidelity monitor reports."""
        _tight_timer_slack()
        tick = self.cfg.tick_s
        while not self.stopping.is_set():
            self.wake.clear()
            woke = time.monotonic()
            with self.lock:
                now = self._at_now()
                outs, self.pending = self.pending, []
                nxt = self.engine.next_event()
            if outs:
                self._emit(outs, now)
            if nxt is None:
                self.wake.wait(0.5)
            else:
                delay = max((nxt - self.now()) * self.tdf, woke + tick - time.monotonic())
                if delay > 0:
                    self.wake.wait(delay)

    def _emit(self, outs, now: float) -> None:
        if not self.push:
            return
        ids = np.concatenate([o.ids for o in outs])
        if not len(ids):
            return
        pos = np.concatenate([o.pos for o in outs])
        dest = np.concatenate([o.dest for o in outs])
        fin = np.concatenate([o.finished for o in outs])
        tok = token_ids(ids, pos)
        t0 = time.perf_counter()
        for d in np.unique(dest):
            m = dest == d
            f = fin[np.isin(fin, ids[m])] if len(fin) else fin
            self._seq += 1
            msg = TokenBatch(self.cfg.index, self._seq, now, ids[m], pos[m], tok[m], f).encode()
            self.push[int(d)].send(msg)
            self.token_messages += 1
        self.send_wait_s += time.perf_counter() - t0
        self.tokens_sent += len(ids)

    # ---- replies from workers ----
    def _reply_sock(self) -> zmq.Socket:
        s = getattr(self._local, "reply", None)
        if s is None:
            s = self.ctx.socket(zmq.PUSH)
            s.connect(self._reply_url)
            self._local.reply = s
        return s

    def _async(self, pool: ThreadPoolExecutor, ident: bytes, req_id: int, fn: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                out = encode_ok(req_id, fn())
            except SpecError as e:
                out = encode_error(req_id, str(e), e.field)
            except Exception as e:  # noqa: BLE001 - an operation's failure is the caller's answer
                log.exception("%s failed", getattr(fn, "__name__", "operation"))
                out = encode_error(req_id, f"{type(e).__name__}: {e}", None)
            self._reply_sock().send_multipart([ident, out])

        pool.submit(run)

    # ---- RPC ----
    def serve(self) -> int:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        router.bind(self.cfg.rpc.url)
        replies = self.ctx.socket(zmq.PULL)
        replies.bind(self._reply_url)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(replies, zmq.POLLIN)
        eng = threading.Thread(target=self.engine_loop, name="engine", daemon=True)
        eng.start()
        log.info("agent %d (server %d, %s) serving on %s", self.cfg.index, self.cfg.server, self.cfg.role,
                 self.cfg.rpc.url)
        next_owner_check = time.monotonic() + 1.0
        while not self.stopping.is_set():
            if self.cfg.owner_pid is not None and time.monotonic() >= next_owner_check:
                next_owner_check = time.monotonic() + 1.0
                if not process_alive(self.cfg.owner_pid, self.cfg.owner_start):
                    log.warning("agent %d: the process that started it (PID %d) is gone: shutting down",
                                self.cfg.index, self.cfg.owner_pid)
                    self.stopping.set()
                    break
            for sock, _ in poller.poll(200):
                if sock is replies:
                    router.send_multipart(replies.recv_multipart())
                    continue
                frames = router.recv_multipart()
                if len(frames) < 2:
                    continue
                ident, payload = frames[0], frames[-1]
                out = self.handle(ident, payload)
                if out is not None:
                    router.send_multipart([ident, out])
        eng.join(timeout=2.0)
        self.close()
        router.close(1000)  # the last answers (shutdown's own) still go out: LINGER 0 dropped them
        replies.close(0)
        return 0

    def handle(self, ident: bytes, payload: bytes) -> bytes | None:
        """Answer one message (None: a worker answers later). Never raises."""
        req_id = None
        try:
            req = decode_request(payload)
            req_id = req.id
            fn = getattr(self, f"rpc_{req.method}")
            if req.method in ("dist_init", "form_group", "all_reduce", "all_to_all", "broadcast", "send", "recv"):
                self._async(self.comm_pool, ident, req.id, lambda: fn(req.params))
                return None
            if req.method in ("migrate", "migrate_commit", "kv_wait", "compute"):
                self._async(self.work_pool, ident, req.id, lambda: fn(req.params))
                return None
            return encode_ok(req.id, fn(req.params))
        except ProtocolError as e:
            return encode_error(e.request_id, str(e), e.field)
        except SpecError as e:
            return encode_error(req_id, str(e), e.field)
        except Exception as e:  # noqa: BLE001 - the loop must survive whatever a handler does
            log.exception("request failed")
            return encode_error(req_id, f"{type(e).__name__}: {e}", None)

    # ---- methods ----
    def rpc_ping(self, p) -> dict:
        return {"agent": self.cfg.index, "server": self.cfg.server, "role": self.cfg.role, "pid": os.getpid(),
                "uptime_s": time.monotonic() - self.started, "layout": self.engine.layout.name(self.cfg.gpus),
                "now": self.now(), "mono": time.monotonic(), "tdf": self.tdf, "backend": self.comm.backend,
                "collector": self.collector is not None}

    def rpc_dist_init(self, p) -> dict:
        return self.comm.init_world(p)

    def rpc_form_group(self, p) -> dict:
        return self.comm.form_group(p)

    def rpc_all_reduce(self, p) -> dict:
        return self.comm.all_reduce(p)

    def rpc_all_to_all(self, p) -> dict:
        return self.comm.all_to_all(p)

    def rpc_broadcast(self, p) -> dict:
        return self.comm.broadcast(p)

    def rpc_send(self, p) -> dict:
        return self.comm.p2p(p, send=True)

    def rpc_recv(self, p) -> dict:
        return self.comm.p2p(p, send=False)

    def rpc_submit(self, p) -> dict:
        for j, r in enumerate(p.requests):
            if r.dest >= len(self.cfg.collectors):
                raise SpecError(f"params.requests[{j}].dest",
                                f"collector {r.dest} does not exist (this agent streams to {len(self.cfg.collectors)})")
        reqs = [NewRequest(rid=r.rid, prompt=r.prompt, target=r.target, dest=r.dest, generated=r.generated)
                for r in p.requests]
        with self.lock:
            try:
                where = self.engine.add(reqs, self._at_now(), p.replica, p.chunked)
            except SpecError as e:
                raise SpecError(f"params.{e.field}", e.message) from None
        self.wake.set()
        return {"accepted": len(reqs), "replicas": where}

    def rpc_stats(self, p) -> dict:
        with self.lock:
            now = self._at_now()
            st = self.engine.stats(now)
            if p.snapshot:
                snap = self.engine.snapshot()
                st["snapshot"] = {k: pack_array(v) for k, v in snap.items()}
            st["switches"] = list(self.engine.switches)
        st.update(agent=self.cfg.index, now=now, tokens_sent=self.tokens_sent, token_messages=self.token_messages)
        return st

    def rpc_set_layout(self, p) -> dict:
        layout = Layout.parse(p.layout, self.cfg.gpus, "params.layout")
        with self.lock:
            sw = self.engine.set_layout(layout, self._at_now(), 0.0 if p.free else None)
        self.wake.set()
        return {"from": sw.old.name(self.cfg.gpus), "to": sw.new.name(self.cfg.gpus), "requested": sw.requested,
                "start": sw.start, "end": sw.end, "switch_s": sw.switch_s, "kv_tokens": sw.kv_tokens}

    def rpc_reset(self, p) -> dict:
        """Drop every request (the driver's recovery and end-of-run); the layout stays, and the engine settings
        unless ``p.engine`` gives new ones (a run of another configuration on the same agents)."""
        with self.lock:
            dropped = len(self.engine.held)
            settings = p.engine if p.engine is not None else self.engine.settings
            self.engine = Engine(self.engine.cost, self.cfg.gpus, self.engine.layout, settings)
            self.fidelity.clear()
            self.pending = []
        self.wake.set()
        return {"dropped": dropped}

    def rpc_collector_stats(self, p) -> dict:
        if self.collector is None:
            raise SpecError("method", f"agent {self.cfg.index} hosts no token collector")
        return self.collector.stats(p.arrays)

    def rpc_collector_reset(self, p) -> dict:
        if self.collector is None:
            raise SpecError("method", f"agent {self.cfg.index} hosts no token collector")
        self.collector.reset()
        return {"reset": True}

    def rpc_fidelity(self, p) -> dict:
        with self.lock:
            rep = self.fidelity.report(self.tdf)
            if p.clear:
                self.fidelity.clear()
        rep.update(tokens_sent=self.tokens_sent, token_messages=self.token_messages,
                   token_send_s=self.send_wait_s)
        return rep

    def rpc_compute(self, p) -> dict:
        t0 = time.monotonic()
        self.stopping.wait(p.seconds * self.tdf)
        return {"seconds": p.seconds, "wall_s": time.monotonic() - t0}

    def rpc_peer_down(self, p) -> dict:
        """Agent ``p.agent`` failed: calls to it (a migration's) give up at once instead of at their deadline."""
        self.dead_peers.add(p.agent)
        self.comm.dead.add(p.agent)  # a transfer with it is refused too
        return {"dead_peers": sorted(self.dead_peers)}

    def _peer_gone(self, peer: int):
        return lambda: f"agent {peer} failed" if peer in self.dead_peers else None

    def rpc_shutdown(self, p) -> dict:
        self.stopping.set()
        self.wake.set()
        return {"stopping": True}

    # ---- migration ----
    def _next_tag(self) -> int:
        with self.lock:
            self._tag += 1
            return (self.cfg.index % 256) << 12 | (self._tag % 4096)  # unique per source, < 2^20

    def _footprint(self, rid: int) -> tuple[int, bool] | None:
        """(KV tokens, decoding with its KV) of request ``rid`` here, None when it is not here."""
        for rep in self.engine.replicas:
            i = rep.slot_of(rid)
            if i is not None:
                return int(rep.prompt[i] + rep.gen[i]), bool(rep.pre[i] == 0)
        return (0, False) if self.engine.holds(rid) else None

    def _detach(self, rid: int, timeout_s: float):
        """Stop ``rid`` here (at the end of its step in flight); (state, stop time), or None if it finished."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            if not self.engine.holds(rid):
                return None
            st = self.engine.detach(rid, self._at_now())
            while st is None:
                st = self.engine.detached.get(rid)
                if st is not None:
                    break
                if not self.engine.holds(rid) and rid not in self.engine._detach_pending:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"request {rid} did not stop within {timeout_s} s")
                self.detach_cv.wait(left)
            self.engine.detached.pop(rid, None)
            return st, self.now()

    def _move_local(self, p) -> dict:
        """A migration between two replicas of this server: its KV crosses NVLink (modelled: the cost
        model's achieved NVLink rate, slept x TDF), not the fabric."""
        t_begin = self.now()
        got = self._detach(p.rid, p.timeout_s)
        if got is None:
            return {"rid": p.rid, "result": "finished", "stages": []}
        st, t_stop = got
        real_bytes = st.kv_tokens * self.cm.kv_bytes_per_token()
        copy_s = real_bytes / (self.cm.gpu.nvlink_bytes_per_s * self.cm.eff.nvlink)
        self.stopping.wait(copy_s * self.tdf)
        with self.lock:
            rep = p.dst_replica if p.dst_replica is not None and p.dst_replica < len(self.engine.replicas) else None
            resumed = self._at_now()
            where = self.engine.add([st], resumed, rep)
        self.wake.set()
        out = {"rid": p.rid, "result": "moved", "mode": "local", "stages": [{"stage": "stop", "tokens": st.kv_tokens,
               "bytes": 0, "s": copy_s}], "kv_bytes": 0, "generated_at_stop": st.generated, "stopped": t_stop,
               "resumed": resumed, "downtime_s": resumed - t_stop, "total_s": resumed - t_begin, "dst": p.dst,
               "dst_replica": where[0]}
        self.migrations.append(out)
        return out

    def rpc_migrate(self, p) -> dict:
        """Source side of a migration (see MigrateParams): copy stages, stop, last copy, hand over."""
        from agents.client import AgentClient
        from agents.protocol import P2PParams

        if p.dst == self.cfg.index:
            return self._move_local(p)
        if p.dst in self.dead_peers:
            raise SpecError("params.dst", f"agent {p.dst} failed")
        peer = AgentClient(p.dst_rpc.url, f"agent {p.dst}", timeout_s=p.timeout_s, ctx=self.ctx)
        gone = self._peer_gone(p.dst)
        detached = None  # the request's state once it left this engine: put back if the hand-over fails
        try:
            t_begin = self.now()
            with self.lock:
                self._at_now()
                fp = self._footprint(p.rid)
            if fp is None:
                raise SpecError("params.rid", f"request {p.rid} is not on agent {self.cfg.index}")
            stages, copied, tags = [], 0, []

            def copy(tokens: int, stage: str) -> None:
                nbytes = max(1, int(round(tokens * self.kv_bytes_per_token)))
                tag = self._next_tag()
                peer.call("kv_incoming", {"rid": p.rid, "src": self.cfg.index, "nbytes": nbytes, "tag": tag,
                                          "timeout_s": p.timeout_s}, abort=gone)
                t0 = self.now()
                self.comm.p2p(P2PParams(peer=p.dst, nbytes=nbytes, tag=tag, timeout_s=p.timeout_s), send=True)
                if stage == "live":  # the send returns once the bytes are in the socket: wait for their arrival,
                    # or the stop would wait for the rest of this stage's bytes (downtime growing with the KV)
                    peer.call("kv_wait", {"tags": [tag], "timeout_s": p.timeout_s}, timeout_s=p.timeout_s + 5,
                              abort=gone)
                tags.append(tag)
                stages.append({"stage": stage, "tokens": tokens, "bytes": nbytes, "s": self.now() - t0})

            if p.mode == "multi_stage" and fp[1]:
                for _ in range(p.max_stages - 1):
                    with self.lock:
                        self._at_now()
                        fp = self._footprint(p.rid)
                    if fp is None or not fp[1]:
                        break  # finished, or preempted (no KV to copy) meanwhile
                    delta = fp[0] - copied
                    if delta * self.kv_bytes_per_token <= p.stop_bytes and copied:
                        break
                    copy(delta, "live")
                    copied = fp[0]
            if gone():
                raise SpecError("params.dst", f"agent {p.dst} failed")
            # stop: the request leaves this engine at the end of its step in flight
            got = self._detach(p.rid, p.timeout_s)
            if got is None:
                return {"rid": p.rid, "result": "finished", "stages": stages}
            st, t_stop = got
            detached = st
            has_kv = st.kv_tokens > 0
            if has_kv and st.kv_tokens > copied:
                copy(st.kv_tokens - copied if copied else st.kv_tokens, "stop")
            spec = {"rid": st.rid, "prompt": st.prompt, "target": st.target, "dest": st.dest,
                    "generated": st.generated}
            res = peer.call("migrate_commit", {"request": spec, "kv_tokens": st.kv_tokens if has_kv else 0,
                                               "preemptions": st.preemptions, "tags": tags,
                                               "replica": p.dst_replica},
                            timeout_s=p.timeout_s, abort=gone)
            detached = None  # the destination holds it now
            out = {"rid": p.rid, "result": "moved", "mode": p.mode, "stages": stages,
                   "kv_bytes": sum(s["bytes"] for s in stages), "generated_at_stop": st.generated,
                   "stopped": t_stop, "resumed": res["resumed"], "downtime_s": res["resumed"] - t_stop,
                   "total_s": res["resumed"] - t_begin, "dst": p.dst, "dst_replica": res.get("replica")}
            self.migrations.append(out)
            return out
        finally:
            if detached is not None:
                # stopped here but not handed over (the destination failed, or a copy did): keep serving it here
                # (its KV is kept; if it was lost, the engine recomputes)
                with self.lock:
                    self.engine.add([detached], self._at_now())
                self.wake.set()
                log.warning("migration of %d to agent %d failed after the stop: resumed here", p.rid, p.dst)
            peer.close()

    def rpc_kv_incoming(self, p) -> dict:
        from agents.protocol import P2PParams

        q = P2PParams(peer=p.src, nbytes=p.nbytes, tag=p.tag, timeout_s=p.timeout_s)
        self.kv_recvs[p.tag] = self.p2p_pool.submit(self.comm.p2p, q, False)
        return {"posted": p.tag}

    def rpc_kv_wait(self, p) -> dict:
        for tag in p.tags:
            f = self.kv_recvs.get(tag)
            if f is None:
                raise SpecError("params.tags", f"no KV transfer {tag} was announced")
            if not f.result(timeout=p.timeout_s).get("correct"):
                raise SpecError("params.tags", f"KV transfer {tag} arrived corrupted")
        return {"arrived": list(p.tags)}

    def rpc_migrate_commit(self, p) -> dict:
        for tag in p.tags:
            f = self.kv_recvs.pop(tag, None)
            if f is None:
                raise SpecError("params.tags", f"no KV transfer {tag} was announced")
            got = f.result(timeout=60)
            if not got.get("correct"):
                raise SpecError("params.tags", f"KV transfer {tag} arrived corrupted")
        r = p.request
        req = NewRequest(rid=r.rid, prompt=r.prompt, target=r.target, dest=r.dest, generated=r.generated,
                         kv_tokens=p.kv_tokens, preemptions=p.preemptions)
        if r.dest >= len(self.cfg.collectors):
            raise SpecError("params.request.dest", f"collector {r.dest} does not exist here")
        with self.lock:
            rep = p.replica if p.replica is not None and p.replica < len(self.engine.replicas) else None
            resumed = self._at_now()
            where = self.engine.add([req], resumed, rep)
        self.wake.set()
        return {"resumed": resumed, "replica": where[0]}

    # ---- life cycle ----
    def close(self) -> None:
        for pool in (self.work_pool, self.p2p_pool, self.comm_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        if self.collector is not None:
            self.collector.close()
        for s in self.push:
            s.close(2000)
        self.comm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.node", description="OrchestrRL GPU-node agent")
    ap.add_argument("--config", required=True, help="agent config (JSON, agents.protocol.AgentConfig)")
    ap.add_argument("--log", default=None, help="log file (default: stderr)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO, filename=a.log,
                        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    try:
        with open(a.config, encoding="utf-8") as f:
            cfg = load_agent_config(json.load(f))
    except (OSError, ValueError) as e:
        print(f"agents.node: error: {e}", file=sys.stderr)
        return 2
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to stderr

    if cfg.nice:
        try:
            os.nice(cfg.nice)
        except OSError as e:  # best effort: the run's fidelity monitor still measures what the agent got
            log.warning("could not lower the agent's priority by %d: %s", cfg.nice, e)
    agent = Agent(cfg)
    signal.signal(signal.SIGTERM, lambda *_: (agent.stopping.set(), agent.wake.set()))
    signal.signal(signal.SIGINT, lambda *_: (agent.stopping.set(), agent.wake.set()))
    return agent.serve()
