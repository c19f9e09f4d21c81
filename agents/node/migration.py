"""The agents' migration protocol: a request and its KV cache move from this agent to another (or to another
replica of this server) while the rest of the batch keeps decoding.

Source side (:meth:`Migrations.migrate`, see agents.protocol.MigrateParams): live copies while the request
decodes (how many: agents.migration_plan.StagePlan, the rule the simulated backend shares), the stop at the
end of its step in flight, the last copy, and the hand-over (``migrate_commit`` on the destination). A
failure after the stop puts the request back on this engine. Destination side: ``kv_incoming`` posts a
receive for each copy, ``kv_wait`` answers once copies arrived, ``migrate_commit`` takes the request over.
Every KV byte crosses the fabric (agents.node.comm point to point); every control message the management
network (agents.client).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

import zmq

from agents.costmodel import CostModel
from agents.engine import NewRequest
from agents.migration_plan import StagePlan
from agents.protocol import AgentConfig, P2PParams
from emulation.validation import SpecError

from .runner import EngineRunner

if TYPE_CHECKING:  # torch is imported when the agent starts its Comm, not by importing this module
    from .comm import Comm

log = logging.getLogger("agents.node")


class Migrations:
    """Both sides of this agent's migrations, and the record of those it made."""

    def __init__(self, cfg: AgentConfig, ctx: zmq.Context, runner: EngineRunner, comm: Comm, cm: CostModel):
        self.cfg = cfg
        self.ctx = ctx
        self.runner = runner
        self.comm = comm
        self.cm = cm
        self.kv_bytes_per_token = cm.kv_bytes_per_token() * cfg.scale  # emulated bytes
        self.p2p_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="p2p")
        self.kv_recvs: dict[int, Future] = {}
        self.dead_peers: set[int] = set()  # agents the driver said failed (peer_down)
        self.done: list[dict] = []  # completed migrations from here
        self._tag = 0
        self._tag_lock = threading.Lock()

    def next_tag(self) -> int:
        with self._tag_lock:
            self._tag += 1
            return (self.cfg.index % 256) << 12 | (self._tag % 4096)  # unique per source, < 2^20

    def peer_gone(self, peer: int) -> Callable[[], str | None]:
        return lambda: f"agent {peer} failed" if peer in self.dead_peers else None

    # ---- source side ----
    def migrate(self, p) -> dict:
        """Source side of a migration (see MigrateParams): copy stages, stop, last copy, hand over."""
        if p.dst == self.cfg.index:
            return self._move_local(p)
        if p.dst in self.dead_peers:
            raise SpecError("params.dst", f"agent {p.dst} failed")
        out = _Outgoing(self, p)
        detached = None  # the request's state once it left this engine: put back if the hand-over fails
        try:
            t_begin = self.runner.now()
            fp = self.runner.footprint(p.rid)
            if fp is None:
                raise SpecError("params.rid", f"request {p.rid} is not on agent {self.cfg.index}")
            if p.mode == "multi_stage" and fp[1]:
                out.live_copies(StagePlan.of(p, self.kv_bytes_per_token))
            if out.gone():
                raise SpecError("params.dst", f"agent {p.dst} failed")
            # stop: the request leaves this engine at the end of its step in flight
            got = self.runner.detach(p.rid, p.timeout_s)
            if got is None:
                return {"rid": p.rid, "result": "finished", "stages": out.stages}
            st, t_stop = got
            detached = st
            if st.kv_tokens > out.copied:
                out.copy(st.kv_tokens - out.copied, "stop")
            res = out.commit(st)
            detached = None  # the destination holds it now
            rec = {"rid": p.rid, "result": "moved", "mode": p.mode, "stages": out.stages,
                   "kv_bytes": sum(s["bytes"] for s in out.stages), "generated_at_stop": st.generated,
                   "stopped": t_stop, "resumed": res["resumed"], "downtime_s": res["resumed"] - t_stop,
                   "total_s": res["resumed"] - t_begin, "dst": p.dst, "dst_replica": res.get("replica")}
            self.done.append(rec)
            return rec
        finally:
            if detached is not None:
                # stopped here but not handed over (the destination failed, or a copy did): keep serving it here
                # (its KV is kept; if it was lost, the engine recomputes)
                self.runner.resume(detached, None)
                log.warning("migration of %d to agent %d failed after the stop: resumed here", p.rid, p.dst)
            out.close()

    def _move_local(self, p) -> dict:
        """A migration between two replicas of this server: its KV crosses NVLink (modelled: the cost
        model's achieved NVLink rate, slept x TDF), not the fabric."""
        t_begin = self.runner.now()
        got = self.runner.detach(p.rid, p.timeout_s)
        if got is None:
            return {"rid": p.rid, "result": "finished", "stages": []}
        st, t_stop = got
        real_bytes = st.kv_tokens * self.cm.kv_bytes_per_token()
        copy_s = real_bytes / (self.cm.gpu.nvlink_bytes_per_s * self.cm.eff.nvlink)
        self.runner.stopping.wait(copy_s * self.runner.tdf)
        resumed, replica = self.runner.resume(st, p.dst_replica)
        out = {"rid": p.rid, "result": "moved", "mode": "local", "stages": [{"stage": "stop", "tokens": st.kv_tokens,
               "bytes": 0, "s": copy_s}], "kv_bytes": 0, "generated_at_stop": st.generated, "stopped": t_stop,
               "resumed": resumed, "downtime_s": resumed - t_stop, "total_s": resumed - t_begin, "dst": p.dst,
               "dst_replica": replica}
        self.done.append(out)
        return out

    # ---- destination side ----
    def kv_incoming(self, p) -> dict:
        q = P2PParams(peer=p.src, nbytes=p.nbytes, tag=p.tag, timeout_s=p.timeout_s)
        self.kv_recvs[p.tag] = self.p2p_pool.submit(self.comm.p2p, q, False)
        return {"posted": p.tag}

    def kv_wait(self, p) -> dict:
        for tag in p.tags:
            f = self.kv_recvs.get(tag)
            if f is None:
                raise SpecError("params.tags", f"no KV transfer {tag} was announced")
            if not f.result(timeout=p.timeout_s).get("correct"):
                raise SpecError("params.tags", f"KV transfer {tag} arrived corrupted")
        return {"arrived": list(p.tags)}

    def commit(self, p) -> dict:
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
        resumed, replica = self.runner.resume(req, p.replica)
        return {"resumed": resumed, "replica": replica}

    def close(self) -> None:
        self.p2p_pool.shutdown(wait=False, cancel_futures=True)


class _Outgoing:
    """One migration to another agent, seen from the source: its copies over the fabric and the hand-over."""

    def __init__(self, mig: Migrations, p):
        from agents.client import AgentClient

        self.m = mig
        self.p = p
        self.peer = AgentClient(p.dst_rpc.url, f"agent {p.dst}", timeout_s=p.timeout_s, ctx=mig.ctx)
        self.gone = mig.peer_gone(p.dst)
        self.stages: list[dict] = []
        self.tags: list[int] = []
        self.copied = 0  # KV tokens copied so far

    def live_copies(self, plan: StagePlan) -> None:
        """Copy the KV while the request keeps decoding, each time what it grew since, as ``plan`` says."""
        while True:
            fp = self.m.runner.footprint(self.p.rid)
            if fp is None or not fp[1]:
                break  # finished, or preempted (no KV to copy) meanwhile
            delta = fp[0] - self.copied
            if not plan.another_live_copy(len(self.stages), delta, self.copied):
                break
            self.copy(delta, "live")
            self.copied = fp[0]

    def copy(self, tokens: int, stage: str) -> None:
        p, m = self.p, self.m
        nbytes = max(1, int(round(tokens * m.kv_bytes_per_token)))
        tag = m.next_tag()
        self.peer.call("kv_incoming", {"rid": p.rid, "src": m.cfg.index, "nbytes": nbytes, "tag": tag,
                                       "timeout_s": p.timeout_s}, abort=self.gone)
        t0 = m.runner.now()
        m.comm.p2p(P2PParams(peer=p.dst, nbytes=nbytes, tag=tag, timeout_s=p.timeout_s), send=True)
        if stage == "live":  # the send returns once the bytes are in the socket: wait for their arrival,
            # or the stop would wait for the rest of this stage's bytes (downtime growing with the KV)
            self.peer.call("kv_wait", {"tags": [tag], "timeout_s": p.timeout_s}, timeout_s=p.timeout_s + 5,
                           abort=self.gone)
        self.tags.append(tag)
        self.stages.append({"stage": stage, "tokens": tokens, "bytes": nbytes, "s": m.runner.now() - t0})

    def commit(self, st: NewRequest) -> dict:
        """Hand the stopped request over: the destination takes it with the copies it received."""
        spec = {"rid": st.rid, "prompt": st.prompt, "target": st.target, "dest": st.dest, "generated": st.generated}
        return self.peer.call("migrate_commit", {"request": spec, "kv_tokens": st.kv_tokens,
                                                 "preemptions": st.preemptions, "tags": self.tags,
                                                 "replica": self.p.dst_replica},
                              timeout_s=self.p.timeout_s, abort=self.gone)

    def close(self) -> None:
        self.peer.close()
