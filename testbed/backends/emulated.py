"""The emulated backend: real agents in Mininet hosts on the real fabric with the real controller.

Generation runs in the agents (their engines in real time, tokens streamed to the trainer-side collectors);
the driver's planner and balancer act through agent RPCs (layout switches, migrations with their KV over the
fabric). Weight sync is the agents' chunked pipelined broadcast along ``controller.phases.sync_chains`` of the
installed circuits (modelled weight bytes x the fabric's scale, in buckets of veRL's 512 MB x scale);
training is the modelled compute (the cost model's time x TDF, slept in every trainer agent) and a real Gloo
all-reduce of the scaled gradients among the trainer agents. Phase changes go to the controller's REST API
with the slack window and predicted gain (benefit-aware switching).

Clock: ``CLOCK_MONOTONIC / time_dilation`` (the agents' engine clock); every duration reported is real-time
equivalent. The fidelity section gathers every agent's token lag (how late tokens left after their step's modelled end) and the link utilisation of the
sync and train phases against their shaped rates, and says when the run was distorted and which TDF would fix it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import subprocess
import time

import numpy as np

from agents.client import AgentError, AgentGone, AgentTimeout
from agents.costmodel import CostModel
from agents.engine import Layout
from agents.protocol import unpack_array
from controller.ocs import Matching
from controller.phases import SyncChain, split_topology, stripe_plan, sync_chains
from controller.reconfig.request import MAX_WINDOW_MS
from controller.traffic import train_bytes, train_traffic
from emulation.builder import port_bytes
from emulation.capacity import load_capacity
from emulation.orchestration import EngineSettings
from emulation.validation import to_dict

from .base import (Backend, LayoutChange, MigrationResult, PhaseDecision, PhaseResult, PhaseTiming, ServerState,
                   StepRequests)
from .phase_model import PhaseModel

log = logging.getLogger(__name__)

A2A_CHUNKS = 4  # an EP all-to-all runs as this many layer groups (a few layers' dispatch and combine each)
# a phase whose transfers took more than this share beyond their modelled time: the fabric distorted the run. The
# cross-check of the backends (testbed/runs/crosscheck.py TOLERANCE) calls a phase 10% off a disagreement, so the
# line is the same: at 0.8 (until 2026-12-04) a weight sync at 0.87 of the rates passed the monitor as faithful
# and failed the cross-check at 1.19-1.24x (CI)
LINK_SLOWDOWN_MAX = 0.10
LINK_EFFICIENCY_MIN = 1 / (1 + LINK_SLOWDOWN_MAX)
# a train phase's modelled compute (a wall-clock wait in every trainer) that took longer than this share beyond its
# modelled time: the machine's scheduler (and the RPCs to the trainers) distorted the run
COMPUTE_OVERSHOOT_MAX = 0.05
SYNC_TIMEOUT_MIN_S, SYNC_TIMEOUT_FACTOR = 30.0, 20.0  # a weight sync's deadline: max(30 s, 20 x its modelled time)
SYNC_RETRIES = 3  # a weight sync run again without the generators that failed under it, at most this often
STATS_TIMEOUT_S = 10.0  # wall seconds: a state query outside a planning tick (which brings its own deadline)
MIN_FAIL_WALL_S = 2.0  # the least wall time a per-tick call waits before its silent server is failed


class EmulatedBackend(Backend):
    name = "emulated"

    def __init__(self, scenario, layouts: dict[int, Layout], engine: EngineSettings = EngineSettings(),
                 bucket_mb: float = 512.0, cluster=None):
        super().__init__(scenario)
        from testbed.cluster.agent_pool import running_cluster

        self.tdf = scenario.fabric.time_dilation
        self.engine_settings = engine  # what prepare() gives the agents' engines (a shared cluster's too)
        self.bucket_bytes = max(4096, int(bucket_mb * 1e6 * scenario.fabric.scale))
        self._stack = contextlib.ExitStack()
        if cluster is None:
            self.tb, self.pool = self._stack.enter_context(running_cluster(
                scenario, layouts=layouts, engine=engine))
        else:
            self.tb, self.pool = cluster
        self.cm = CostModel.for_names(scenario.workload.model, scenario.workload.gpu)
        self.model = PhaseModel(scenario)
        self._layouts = dict(layouts)
        self._tag = 0
        self.phase_util: list[dict] = []
        self.compute_log: list[tuple[float, float]] = []  # (modelled, measured) of every train phase's compute

    def close(self) -> None:
        self._stack.close()

    # ---- time ----
    def now(self) -> float:
        return time.monotonic() / self.tdf

    def wait_until(self, t: float, until_idle: bool = False) -> None:
        delay = (t - self.now()) * self.tdf
        if delay > 0:
            time.sleep(delay)

    # ---- generation ----
    def layouts(self) -> dict[int, Layout]:
        return dict(self._layouts)

    def prepare(self, layouts: dict[int, Layout]) -> None:
        """A fresh run on a running cluster: no request anywhere, collectors and fidelity records afresh, every
        generator in its starting layout (free of charge) with this run's engine settings (a tuned
        configuration's max_num_seqs: the cluster was started with the scenario's)."""
        live = [s for s in self.gen_servers if s not in self.pool.failed]
        eng = to_dict(self.engine_settings)
        self.pool.call_all(live, "reset", lambda s: {"engine": eng}, 30.0)
        self.pool.call_all(live, "fidelity", lambda s: {"clear": True}, 10.0)
        for s in live:
            st = self.pool.call(s, "stats")
            if Layout.parse(st["layout"], self.gpus, "stats.layout") != layouts[s]:
                self.set_layout(s, layouts[s], free=True)
        self.pool.forget_requests()
        self.pool.reset_collectors()

    def set_layout(self, server: int, layout: Layout, free: bool = False) -> LayoutChange:
        res = self.pool.call(server, "set_layout", {"layout": layout.name(self.gpus), "free": free})
        self._layouts[server] = layout
        return LayoutChange(Layout.parse(res["from"], self.gpus, "set_layout.from"),
                            Layout.parse(res["to"], self.gpus, "set_layout.to"), res["requested"], res["start"],
                            res["end"], res["switch_s"])

    def submit(self, server: int, requests: list[dict], chunked: bool = False) -> None:
        self.pool.submit(server, requests, chunked=chunked)

    def states(self, deadline_s: float | None = None, fail_after_s: float | None = None) -> dict[int, ServerState]:
        """Every live generator's state, asked of all at once; with ``deadline_s`` (backend seconds: a planning
        tick's), one that misses it is left out, and failed (see failures()) at once or, given ``fail_after_s``,
        if its call has no answer by then (AgentPool.gather); one whose process exited is failed at once."""
        live = [s for s in self.gen_servers if s not in self.pool.failed]
        wall = (STATS_TIMEOUT_S if deadline_s is None else deadline_s * self.tdf)
        # a silent agent is failed no sooner than MIN_FAIL_WALL_S of wall time after the call: in a compressed
        # scenario an interval is a fraction of a second, and a healthy agent whose engine held its GIL for
        # that long under a heavy layout was failed (static-TP1x8@1024 on the default, TDF 0.25: 0.5 s), which
        # left every later run of a shared cluster one generator short. A process exit is seen at once anyway.
        fail_wall = None if fail_after_s is None else max(fail_after_s * self.tdf, MIN_FAIL_WALL_S)
        docs = self.pool.gather(live, "stats", lambda s: {"snapshot": True}, wall, fail_after_s=fail_wall)
        out = {}
        for s, st in docs.items():
            snap = {k: unpack_array(v, f"snapshot.{k}") for k, v in st.pop("snapshot").items()}
            self.pool.note_held(s, snap["rid"])
            pu = st.get("paused_until")
            busy = pu if (pu is not None and pu > st["now"]) else 0.0
            out[s] = ServerState(s, Layout.parse(st["layout"], self.gpus), snap, st, busy)
        return out

    def migrate(self, rid: int, src: int, dst: int, mode: str, replica: int | None = None,
                predicted_gain_s: float | None = None) -> MigrationResult:
        res = self.pool.migrate(rid, src, dst, mode=mode, replica=replica)
        return MigrationResult(rid, res["result"], res.get("downtime_s"), res.get("kv_bytes"))

    def finished_count(self, deadline_s: float | None = None) -> int:
        """Requests whose every token reached a collector this step (the trainers' ground truth: it survives a
        generator's death, and a request whose last tokens are still in flight, or whose earlier ones a
        migration's source has not delivered yet, is not done yet); -1 when a collector did not answer within
        ``deadline_s`` (backend seconds)."""
        live = [t for t in self.train_servers if t not in self.pool.failed]
        wall = STATS_TIMEOUT_S if deadline_s is None else deadline_s * self.tdf
        # a trainer late to answer is not failed for it (it may be in a collective): the count is unknown now
        docs = self.pool.gather(live, "collector_stats", lambda s: {"arrays": False}, wall, fail_late=False)
        if len(docs) < len(live):
            return -1
        return sum(d["complete"] for d in docs.values())

    def end_generation(self, req: StepRequests) -> dict:
        want = set(req.rid.tolist())
        deadline = time.monotonic() + 30.0
        col = self.pool.collected()
        while not want <= col.finished() and time.monotonic() < deadline:
            time.sleep(0.05)
            col = self.pool.collected()
        delivered = col.by_rid()
        finish = {}
        # arrival time of each request's last token at its collector (collector clock = engine clock)
        for d in self.pool.call_all([t for t in self.train_servers if t not in self.pool.failed], "collector_stats",
                                    lambda s: None, 30.0).values():
            rid, last, fl = unpack_array(d["rid"]), unpack_array(d["last_t"]), unpack_array(d["final_len"])
            finish.update({int(r): float(t) for r, t, f in zip(rid, last, fl) if f >= 0})
        mine = np.isin(col.rid, req.rid)
        dup = int(col.dups[mine].sum())
        unique = int(col.count[mine].sum())
        self.pool.reset_collectors()
        ended = max(finish.values()) if finish else self.now()
        return {"delivered": {r: n for r, n in delivered.items() if r in want}, "finish": finish, "duplicates": dup,
                "tokens_unique": unique, "tokens_by_agent": {a: dict(v) for a, v in sorted(col.sources.items())},
                "ended_at": min(ended, self.now())}

    # ---- fabric and phases ----
    def set_phase(self, phase: str, window_ms: float | None, gain_ms: float | None) -> PhaseDecision:
        """``phase``: a topology name (``controller.phases.topology_name``: "train:mp" asks for that part of the
        train step's topology)."""
        if self.tb.controller is None:  # a static tree: nothing to re-wire (the phase model says so)
            return dataclasses.replace(self.model.decide(phase, phase, window_ms, gain_ms),
                                       timing=PhaseTiming(None, 0.0))
        # the controller works in wall time: windows and gains are stretched by the time dilation
        cap = MAX_WINDOW_MS  # the REST body's bound (controller.reconfig)
        gain = None if gain_ms is None else (cap if math.isinf(gain_ms) else max(-cap, min(cap, gain_ms * self.tdf)))
        window = None if window_ms is None else min(cap, window_ms * self.tdf)
        t0 = self.now()
        name, part = split_topology(phase)
        rec = self.tb.client.set_phase(name, window_ms=window, gain_ms=gain, part=part)
        ov = rec.get("overhead_ms")
        return PhaseDecision(rec.get("decision", rec.get("status")), rec.get("stall_ms", 0.0) / self.tdf, window_ms,
                             gain_ms, rec.get("reason"),
                             timing=PhaseTiming(None if ov is None else ov / self.tdf, (self.now() - t0) * 1e3))

    def _installed_phase(self) -> str | None:
        if self.tb.controller is None:
            return None
        st = self.tb.client.state()
        return st.get("topology") or st.get("phase") or "train"

    def _installed_matchings(self) -> dict[int, Matching]:
        spec = self.scenario.fabric
        return {int(o): Matching.from_pairs(spec.ports_per_ocs, pairs) for o, pairs in self.tb.client.circuits().items()}

    def _sync_plan(self) -> tuple[dict[int, dict], int]:
        spec, layout = self.scenario.fabric, self.scenario.layout
        holders = [t for t in self.train_servers if t not in self.pool.failed]
        if spec.is_static:  # no circuits: RLSim's stripes plan for a packet tree (one holder per trainer ToR)
            by_tor: dict[int, list[int]] = {}
            for t in holders:
                by_tor.setdefault(t // spec.servers_per_tor, []).append(t)
            n_chains = min(self.model.train_layout.dp, len(self.gen_servers))
            chains = [SyncChain(tuple(src), tuple(mem)) for src, mem in
                      stripe_plan(list(self.gen_servers), list(by_tor.values()), n_chains, len(by_tor))]
        else:
            chains = sync_chains(spec, layout, self._installed_matchings(), holders=holders)
        # a failed generator drops out of its chain: its predecessor feeds its successor directly
        chains = [c for c in (SyncChain(ch.sources, tuple(m for m in ch.members if m not in self.pool.failed))
                              for ch in chains) if c.members]
        plan: dict[int, dict] = {}
        for ch in chains:
            head = ch.members[0]
            plan.setdefault(head, {"sources": [], "children": []})["sources"] = [[s, float(sh)] for s, sh in ch.sources]
            for src, _ in ch.sources:
                plan.setdefault(src, {"sources": [], "children": []})["children"].append(
                    {"agent": head, "sources": [[s, float(sh)] for s, sh in ch.sources]})
            for a, b in zip(ch.members, ch.members[1:]):
                plan.setdefault(b, {"sources": [], "children": []})["sources"] = [[a, 1.0]]
                plan.setdefault(a, {"sources": [], "children": []})["children"].append({"agent": b, "sources": []})
        return plan, len(chains)

    def sync_weights(self, step: int) -> PhaseResult:
        """The pipelined broadcast along the sync chains. A generator that fails under it (the asynchronous mode
        runs it beside generation) breaks its chain: the broadcast is run again without it (``retries``)."""
        spec = self.scenario.fabric
        nbytes = max(4, int(self.cm.weight_bytes() * spec.scale))
        # a deadline in proportion to the modelled broadcast: a Gloo send posted to a generator before it died is
        # not always failed by Gloo, and the agent's next collective waits behind it until this deadline
        timeout = max(SYNC_TIMEOUT_MIN_S, SYNC_TIMEOUT_FACTOR * self.model.sync_s(self._installed_phase())[0]) * self.tdf
        before = self._port_bytes()
        # the chains follow the circuits installed for the phase (a REST read of the controller, a few ms of wall
        # time, 4x that at a dilation of 0.25): planned before the phase's clock starts, as the switch was
        plan, n_chains = self._sync_plan()
        t0 = self.now()
        retries = 0
        while True:
            if retries:
                plan, n_chains = self._sync_plan()
            self._tag = (self._tag + 1) % 4096
            try:
                res = self.pool.call_all(list(plan), "broadcast",
                                         lambda s: {"nbytes": nbytes, "bucket_bytes": self.bucket_bytes,
                                                    "tag": self._tag, "version": step, "timeout_s": timeout,
                                                    **plan[s]},
                                         timeout + 60)
                break
            except (AgentError, AgentGone) as e:
                self.pool.poll_exits()
                gone = sorted(a for a in plan if a in self.pool.failed and a in self.gen_servers)
                if not gone or retries >= SYNC_RETRIES:
                    raise
                retries += 1
                log.warning("weight sync of step %d: generator(s) %s failed under it (%s); again without them",
                            step, gone, e)
        t1 = self.now()
        crcs = {r["crc32"] for r in res.values()}
        roots = [r for r in res.values() if not r["sources"]]
        span = (max(r["end_mono"] for r in res.values()) - min(r["start_mono"] for r in roots)) / self.tdf
        detail = {"bytes_emulated": nbytes, "chains": n_chains, "consistent": len(crcs) == 1,
                  "broadcast_s": span, "bucket_bytes": self.bucket_bytes, "retries": retries}
        # the phase as reported (the broadcast and the RPCs around it, 0.02-0.05 s here) against the modelled
        # broadcast, which is all the simulated backend's sync is: the monitor judges what the cross-check compares
        self._utilisation("sync", before, t1 - t0, self.model.sync_s(self._installed_phase())[0])
        return PhaseResult("sync", t0, t1, detail)

    def train(self, step: int, lengths: np.ndarray) -> PhaseResult:
        """The modelled compute slept in every trainer, then training's collectives for real
        (``controller.traffic.train_traffic`` at this step's tokens, bytes scaled by the fabric's scale):
        the EP all-to-all of each group in A2A_CHUNKS layer groups, then the DP rings as Gloo all-reduces. The
        collectives of one stage run together, one per trainer at a time (a trainer in two rings of a stage,
        dense and expert, runs them one after the other). Pipeline point-to-point is not emulated.

        On the "train:mp" topology (the scenario re-wires inside the train phase, ``controller.train_rewire``)
        the controller is asked for "train:dp" before the rings, with no idle window and the phase model's
        gain (:meth:`PhaseModel.rewire_gain_ms` of the modelled step): its rule switches (the rings wait the switching time) or
        keeps the circuits; ``detail["rewire"]`` holds its answer and ``detail["topology_end"]`` where the phase
        ended."""
        spec = self.scenario.fabric
        topology = self._installed_phase()
        _, model = self.model.train_s(topology, lengths)
        compute = float(model.get("compute_s", 0.0))
        trainers = [t for t in self.train_servers if t not in self.pool.failed]
        t0 = self.now()
        self.pool.call_all(trainers, "compute", lambda s: {"seconds": compute}, compute * self.tdf + 60)
        t_c = self.now()
        detail = {"compute_s": t_c - t0, "modelled_compute_s": compute, "topology": topology,
                  "topology_end": topology}
        self.compute_log.append((compute, t_c - t0))
        tl = self.model.train_layout
        tokens = float(np.sum(lengths) + len(lengths) * self.scenario.workload.prompt_tokens)
        tt = train_traffic(tl, train_bytes(self.cm, tl, tokens))
        # end: of the phase's last part so far; reads: how long each of the monitor's port-counter reads took
        ok, end, reads, before = True, t_c, [], None
        for st in tt.stages:
            if st.name == "pp_p2p":
                detail["pp_p2p"] = "not emulated"
                continue
            groups = [(name, g) for name, g in tt.named_groups() if name.startswith(st.name + "-")
                      and not any(m in self.pool.failed for m in g.members)]
            waves: list[dict[int, tuple[str, object]]] = []  # one collective per trainer per wave
            for name, g in groups:
                wave = next((w for w in waves if not set(g.members) & set(w)), None)
                if wave is None:
                    wave = {}
                    waves.append(wave)
                for m in g.members:
                    wave[m] = (name, g)
            if not waves:
                continue
            if st.name == "dp_allreduce" and topology == "train:mp":
                t_r = self.now()
                d = self.set_phase("train:dp", 0.0, self.model.rewire_gain_ms(model))
                detail.update(rewire=d.to_json(), rewire_s=self.now() - t_r, rewire_decision=d.decision)
                if d.changed:
                    detail["topology_end"] = "train:dp"
            if before is None:  # after the compute: no other phase's traffic counted in, beside generation's
                t_r = self.now()
                before = self._port_bytes()
                reads.append(self.now() - t_r)
            ts = self.now()
            nbytes = 0
            for wave in waves:
                def params(s: int, wave=wave) -> dict:
                    name, g = wave[s]
                    iters = A2A_CHUNKS if g.kind == "all_to_all" else 1
                    return {"group": self.pool.group(name), "nbytes": max(4, int(g.nbytes * spec.scale / iters)), "iters": iters,
                            "warmup": 0, "timeout_s": 600}
                kind = next(iter(wave.values()))[1].kind
                op = "all_to_all" if kind == "all_to_all" else "all_reduce"
                res = self.pool.call_all(list(wave), op, params, 900)
                ok = ok and all(r["correct"] for r in res.values())
                nbytes += sum(params(s)["nbytes"] * params(s)["iters"] for s in wave)
            end = self.now()
            span = end - ts
            key = {"ep_alltoall": "alltoall", "dp_allreduce": "allreduce"}[st.name]
            detail.update({f"{key}_s": span, f"modelled_{key}_s": model.get(f"{st.name}_s"),
                           f"{key}_bytes": nbytes // len({m for w in waves for m in w}), f"{key}_waves": len(waves)})
            before = self._utilisation("train", before, span, model.get(f"{st.name}_s"), stage=st.name)
            reads.append(self.now() - end)
        detail["correct"] = ok
        # the port counters' reads (~40-150 ms of wall time each here, 4x that at the small default's time
        # dilation of 0.25, more on a loaded machine) are left out of the phase: it ends when its last stage does
        # (the last read comes after), less the reads before
        detail["monitor_s"] = sum(reads)
        return PhaseResult("train", t0, end - sum(reads[:-1]), detail)

    # ---- health and fidelity ----
    def failures(self) -> dict[int, str]:
        """Every failed generator (a process exit is seen here at once: a non-blocking wait per agent)."""
        self.pool.poll_exits()
        return {s: why for s, why in self.pool.failed.items() if s in self.gen_servers}

    def lost_requests(self, server: int, held: set[int] | None = None) -> dict[int, int]:
        return self.pool.lost_requests(server, held=held)

    def stranded(self, held: set[int] | None = None, deadline_s: float | None = None) -> dict[int, int]:
        wall = STATS_TIMEOUT_S if deadline_s is None else deadline_s * self.tdf
        try:
            col = self.pool.collected(timeout_s=wall)
        except AgentTimeout:  # a collector late to answer: looked at again at the next tick
            return {}
        return self.pool.stranded(col, held=held)

    def _port_bytes(self) -> dict[str, int]:
        """Bytes sent by every port of every bridge, ``{"bridge:port": tx bytes}``; a bridge that cannot be read
        (it is being torn down) counts as none."""
        out = {}
        for br in self.tb.fabric.bridge_names():
            try:
                out.update({f"{br}:{port}": c["tx"] for port, c in port_bytes(br).items()})
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        return out

    def _utilisation(self, phase: str, before: dict[str, int], wall_equiv_s: float, modelled_s: float | None = None,
                     stage: str | None = None) -> dict[str, int]:
        after = self._port_bytes()
        spec = self.scenario.fabric
        secs = wall_equiv_s * self.tdf  # wall seconds
        if secs <= 0:
            return
        rate = min(spec.server_link_mbps, spec.uplink_mbps) * 1e6 / 8  # bytes/s of the slowest link kind (dilated)
        tx = {p: after.get(p, 0) - before.get(p, 0) for p in after}
        busiest = max(tx.values()) if tx else 0
        total = sum(tx.values())
        cap = load_capacity()
        rate = spec.server_link_mbps * 1e6 / 8 if spec.is_static else rate  # a tree's pipes: its server links
        rec = {"phase": phase, "stage": stage, "busiest_port_utilisation": busiest / (rate * secs),
               "aggregate_gbps": total * 8 / secs / 1e9,
               "capacity_gbps": cap["capacity_gbps"] if cap else None}
        if cap:
            rec["aggregate_vs_capacity"] = rec["aggregate_gbps"] / cap["capacity_gbps"]
        if modelled_s:  # what the links delivered against RLSim's flow model of the same transfer
            rec["modelled_s"] = modelled_s
            rec["measured_s"] = wall_equiv_s
            rec["efficiency"] = modelled_s / wall_equiv_s
        self.phase_util.append(rec)
        return after

    def fidelity(self) -> dict:
        live = [s for s in self.gen_servers if s not in self.pool.failed]
        reps = self.pool.call_all(live, "fidelity", lambda s: None, 10.0)
        worst = max((r.get("lag_ms_p99", 0.0) for r in reps.values()), default=0.0)
        distorted_cpu = any(r.get("distorted") for r in reps.values())
        agg = max((u.get("aggregate_vs_capacity") or 0.0 for u in self.phase_util), default=0.0)
        effs = [u["efficiency"] for u in self.phase_util if u.get("efficiency")]
        eff = min(effs) if effs else 1.0
        distorted_net = agg > 1.0 or eff < LINK_EFFICIENCY_MIN
        over = max(((measured - modelled) / modelled for modelled, measured in self.compute_log if modelled > 0),
                   default=0.0)
        distorted_compute = over > COMPUTE_OVERSHOOT_MAX
        # the overshoot is wall time the scheduler adds whatever the dilation: a larger one shrinks it in modelled time
        need = max([self.tdf] + [r.get("tdf_needed", self.tdf) for r in reps.values()] +
                   [self.tdf * agg if agg > 1.0 else self.tdf] +
                   [self.tdf / eff if eff < LINK_EFFICIENCY_MIN else self.tdf] +
                   [self.tdf * over / COMPUTE_OVERSHOOT_MAX if distorted_compute else self.tdf])
        need = self.tdf if need <= self.tdf else math.ceil(need * 10) / 10  # up to a tenth (0.25 stays 0.25)
        msg = []
        if distorted_cpu:
            msg.append(f"the agents streamed tokens up to {worst:.0f} ms (p99) after their steps ended: their CPU "
                       f"did not keep up")
        if agg > 1.0:
            msg.append(f"the fabric carried {agg:.0%} of this machine's measured forwarding capacity")
        if eff < LINK_EFFICIENCY_MIN:
            msg.append(f"a phase's transfers ran at {eff:.0%} of the modelled link rates (concurrent flows this "
                       f"machine's userspace datapath could not forward at their shaped rates)")
        if distorted_compute:
            msg.append(f"the trainers' modelled compute ran up to {over:.0%} past its modelled time (wall-clock waits "
                       f"this machine's scheduler overshot)")
        return {"time_dilation": self.tdf, "agents": {str(k): v for k, v in reps.items()}, "links": self.phase_util,
                "link_efficiency_min": eff, "compute_overshoot_max": over, "compute_distorted": distorted_compute,
                "distorted": bool(distorted_cpu or distorted_net or distorted_compute),
                "verdict": ("distorted: " + "; ".join(msg) + f"; rerun with time_dilation >= {need:g}")
                if msg else "faithful: token lag, compute waits and link load within bounds",
                "tdf_needed": need}
