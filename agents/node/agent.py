"""The GPU-node agent: one long-lived process per emulated server, inside its Mininet host.

    python -m agents.node --config FILE.json [--log FILE]

Threads:

* RPC (main thread): a ZeroMQ ROUTER on the management address; every message is validated by
  agents.protocol; quick methods are answered inline, slow ones (collectives, migration, modelled compute) run
  on workers and are answered when done. A malformed message gets an error reply naming the field; nothing
  a client sends can stop this loop.
* engine: the generation engine (agents.engine) in real time, and its token streams
  (agents.node.runner.EngineRunner).
* collector (trainer agents with a ``collector_port``): counts every token exactly once (agents.node.collector).
* comm: torch.distributed (agents.node.comm) on a single worker, so collectives keep one order on every rank.
* p2p / migration workers: KV transfers (point to point on the fabric) and the migration protocol
  (agents.node.migration).

Fidelity: for every step, the lateness of its completion beyond its modelled end (engine time) is recorded;
``fidelity`` reports it (p50/p99, as a fraction of the step) with the TDF that would remove it
(agents.node.fidelity).

This module is the RPC server: it answers each method by delegating to the part that does the job.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import zmq

from agents.costmodel import CostModel
from agents.engine import Layout, ModelledCost, NewRequest
from agents.protocol import (AgentConfig, ProtocolError, decode_request, encode_error, encode_ok, load_agent_config,
                             pack_array)
from emulation.orchestration import EngineSettings
from emulation.registry import process_alive
from emulation.validation import SpecError

from .migration import Migrations
from .runner import EngineRunner

log = logging.getLogger("agents.node")

COMM_METHODS = ("dist_init", "form_group", "all_reduce", "all_to_all", "broadcast", "send", "recv")
WORKER_METHODS = ("migrate", "migrate_commit", "kv_wait", "compute")  # slow: answered by a worker when done


TERM_DEADLINE_S = 1.5  # the most an agent waits at exit for its last answers to go out


class WorkerReplies:
    """Slow methods run on worker threads; each answer goes back to the RPC loop over an in-process socket
    (one per worker thread: ZeroMQ sockets are not thread-safe), and the loop sends it to the caller."""

    def __init__(self, ctx: zmq.Context):
        self.ctx = ctx
        self.url = f"inproc://replies-{os.getpid()}"
        self._local = threading.local()

    def _sock(self) -> zmq.Socket:
        s = getattr(self._local, "reply", None)
        if s is None:
            s = self.ctx.socket(zmq.PUSH)
            s.connect(self.url)
            self._local.reply = s
        return s

    def run(self, pool: ThreadPoolExecutor, ident: bytes, req_id: int, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on ``pool``; its result (or its error, naming the field) answers request ``req_id``."""
        def run() -> None:
            try:
                out = encode_ok(req_id, fn())
            except SpecError as e:
                out = encode_error(req_id, str(e), e.field)
            except Exception as e:  # noqa: BLE001 - an operation's failure is the caller's answer
                log.exception("%s failed", getattr(fn, "__name__", "operation"))
                out = encode_error(req_id, f"{type(e).__name__}: {e}", None)
            self._sock().send_multipart([ident, out])

        pool.submit(run)


class Agent:
    """The RPC server of one agent: validates every message, answers quick methods inline and slow ones on
    workers; the engine runner, the collectives, the collector and the migrations do the work."""

    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.tdf = cfg.time_dilation
        self.started = time.monotonic()
        self.ctx = zmq.Context()
        self.stopping = threading.Event()
        self.runner = EngineRunner(cfg, self.ctx, self._cost(cfg.engine), self.stopping, cost_for=self._cost)
        from agents.node.comm import Comm

        self.comm = Comm(cfg.index)
        self.collector = None
        if cfg.collector_port is not None:
            from agents.node.collector import Collector

            self.collector = Collector(self.ctx, cfg.fabric_ip, cfg.collector_port, self.runner.now)
        self.migrations = Migrations(cfg, self.ctx, self.runner, self.comm, CostModel.for_names(cfg.model, cfg.gpu))
        self.comm_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comm")
        self.work_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="work")
        self.owner_checks = 0  # periodic checks of the starter made so far (ping says: a test polls on it)
        self.replies = WorkerReplies(self.ctx)

    def _cost(self, settings: EngineSettings, prev=None):
        """The step cost of an engine with ``settings``: the cost model bound to its profile and knobs (its KV
        sizing and CUDA-graph cap follow max_num_seqs), or the real decoder's measured steps (``prev``'s
        decoder kept: only the modelled part follows the settings)."""
        cfg = self.cfg
        cm = CostModel.for_engine(cfg.model, cfg.gpu, settings)
        if cfg.real_compute is not None:
            from agents.node.realmodel import RealStepCost

            if isinstance(prev, RealStepCost):
                return prev.rebound(cm, cfg.gpus, settings.switch_reinit_s)
            return RealStepCost(cfg.real_compute, cm, cfg.gpus, reinit_s=settings.switch_reinit_s)
        return ModelledCost(cm, cfg.gpus, settings.switch_reinit_s)

    def stop(self) -> None:
        self.stopping.set()
        self.runner.wake.set()

    # ---- RPC ----
    def serve(self) -> int:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        router.bind(self.cfg.rpc.url)
        replies = self.ctx.socket(zmq.PULL)
        replies.bind(self.replies.url)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(replies, zmq.POLLIN)
        eng = threading.Thread(target=self.runner.loop, name="engine", daemon=True)
        eng.start()
        log.info("agent %d (server %d, %s) serving on %s", self.cfg.index, self.cfg.server, self.cfg.role,
                 self.cfg.rpc.url)
        next_owner_check = time.monotonic() + 1.0
        while not self.stopping.is_set():
            if time.monotonic() >= next_owner_check:
                next_owner_check = time.monotonic() + 1.0
                if self._owner_gone():
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
        # the process leaves by os._exit (agents/node/__main__.py), which would drop what zmq's I/O thread has
        # not sent yet: terminating the context waits for the router's linger; a socket a stuck worker thread
        # still holds would make it wait forever, so the wait has a deadline
        term = threading.Thread(target=self.ctx.term, name="zmq-term", daemon=True)
        term.start()
        term.join(timeout=TERM_DEADLINE_S)
        return 0

    def _owner_gone(self) -> bool:
        """Whether the process that started this agent exited (then this agent stops)."""
        self.owner_checks += 1
        if self.cfg.owner_pid is None or process_alive(self.cfg.owner_pid, self.cfg.owner_start):
            return False
        log.warning("agent %d: the process that started it (PID %d) is gone: shutting down", self.cfg.index,
                    self.cfg.owner_pid)
        self.stopping.set()
        return True

    def handle(self, ident: bytes, payload: bytes) -> bytes | None:
        """Answer one message (None: a worker answers later). Never raises."""
        req_id = None
        try:
            req = decode_request(payload)
            req_id = req.id
            fn = getattr(self, f"rpc_{req.method}")
            if req.method in COMM_METHODS:
                self.replies.run(self.comm_pool, ident, req.id, lambda: fn(req.params))
                return None
            if req.method in WORKER_METHODS:
                self.replies.run(self.work_pool, ident, req.id, lambda: fn(req.params))
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
                "uptime_s": time.monotonic() - self.started,
                "layout": self.runner.engine.layout.name(self.cfg.gpus), "now": self.runner.now(),
                "mono": time.monotonic(), "tdf": self.tdf, "backend": self.comm.backend,
                "collector": self.collector is not None, "owner_checks": self.owner_checks}

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
        try:
            where = self.runner.add(reqs, p.replica, p.chunked)
        except SpecError as e:
            raise SpecError(f"params.{e.field}", e.message) from None
        return {"accepted": len(reqs), "replicas": where}

    def rpc_stats(self, p) -> dict:
        r = self.runner
        with r.lock:
            now = r.at_now()
            st = r.engine.stats(now)
            if p.snapshot:
                snap = r.engine.snapshot()
                st["snapshot"] = {k: pack_array(v) for k, v in snap.items()}
            st["switches"] = list(r.engine.switches)
        st.update(agent=self.cfg.index, now=now, tokens_sent=r.tokens_sent, token_messages=r.token_messages)
        return st

    def rpc_set_layout(self, p) -> dict:
        layout = Layout.parse(p.layout, self.cfg.gpus, "params.layout")
        r = self.runner
        with r.lock:
            sw = r.engine.set_layout(layout, r.at_now(), 0.0 if p.free else None)
        r.wake.set()
        return {"from": sw.old.name(self.cfg.gpus), "to": sw.new.name(self.cfg.gpus), "requested": sw.requested,
                "start": sw.start, "end": sw.end, "switch_s": sw.switch_s, "kv_tokens": sw.kv_tokens}

    def rpc_reset(self, p) -> dict:
        """Drop every request (the driver's recovery and end-of-run); the layout stays, and the engine settings
        unless ``p.engine`` gives new ones (a run of another configuration on the same agents)."""
        return {"dropped": self.runner.reset(p.engine)}

    def _collector(self):
        if self.collector is None:
            raise SpecError("method", f"agent {self.cfg.index} hosts no token collector")
        return self.collector

    def rpc_collector_stats(self, p) -> dict:
        return self._collector().stats(p.arrays)

    def rpc_collector_reset(self, p) -> dict:
        self._collector().reset()
        return {"reset": True}

    def rpc_fidelity(self, p) -> dict:
        r = self.runner
        with r.lock:
            rep = r.fidelity.report(self.tdf)
            if p.clear:
                r.fidelity.clear()
        rep.update(tokens_sent=r.tokens_sent, token_messages=r.token_messages, token_send_s=r.send_wait_s)
        return rep

    def rpc_compute(self, p) -> dict:
        t0 = time.monotonic()
        self.stopping.wait(p.seconds * self.tdf)
        return {"seconds": p.seconds, "wall_s": time.monotonic() - t0}

    def rpc_peer_down(self, p) -> dict:
        """Agent ``p.agent`` failed: calls to it (a migration's) give up at once instead of at their deadline."""
        self.migrations.dead_peers.add(p.agent)
        self.comm.dead.add(p.agent)  # a transfer with it is refused too
        return {"dead_peers": sorted(self.migrations.dead_peers)}

    def rpc_shutdown(self, p) -> dict:
        self.stop()
        return {"stopping": True}

    def rpc_migrate(self, p) -> dict:
        return self.migrations.migrate(p)

    def rpc_kv_incoming(self, p) -> dict:
        return self.migrations.kv_incoming(p)

    def rpc_kv_wait(self, p) -> dict:
        return self.migrations.kv_wait(p)

    def rpc_migrate_commit(self, p) -> dict:
        return self.migrations.commit(p)

    # ---- life cycle ----
    def close(self) -> None:
        for pool in (self.work_pool, self.comm_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self.migrations.close()
        if self.collector is not None:
            self.collector.close()
        self.runner.close()
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
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    return agent.serve()
