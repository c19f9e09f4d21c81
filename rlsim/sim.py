"""One RL iteration (generate -> train -> sync weights) of a scenario on a fabric, simulated.

Compute comes from the GPU cost model (``agents.costmodel``); every network transfer runs through the
flow-level simulator (``rlsim.flowsim``) on the fabric's links (``rlsim.fabrics``).

* Generation: the step's responses (lengths drawn from the workload's distribution with the scenario's
  seed) are dealt at random to the rollout replicas (``rollout_tp`` GPUs each). A replica prefills its
  prompts, then decodes with continuous batching (at most the scenario's ``max_num_seqs``, the engines' own
  setting, sequences at a time; a finished sequence's slot takes the next waiting one); every decode step costs the roofline time of its batch and
  KV length. The phase ends when the slowest replica (the long tail) is done and its tokens have streamed to
  the trainers (each replica streams its responses, 8 bytes per token, when it finishes).
* Training: compute ``6 N D`` (plus attention) at the cost model's MFU, times the pipeline bubble
  ``1 + (pp - 1) / microbatches``; then the exposed communication: MoE expert all-to-all (EP), pipeline
  point-to-point activations (PP), and the data-parallel gradient ring all-reduce (DP, one ring per pipeline
  stage over the servers that hold that stage; TP stays inside a server on NVLink).
* Weight sync: on RFabric the plan of ``controller.phases.sync_chains`` on the installed circuits (chain heads
  pull stripes from trainer servers over circuits, chains relay down generator servers; every hop rides a
  circuit or stays under one ToR). Elsewhere every trainer DP replica holds a copy and the generator
  servers are split into as many pipelined chains (fan-out ``sync_fanout``) as there are replicas. Either
  way the weights go in buckets (``sync_bucket_mb``) that a relay forwards once whole: the deepest member
  gets its last bucket ``depth - 1`` bucket times after the flow model's end.
* RFabric re-wires its OCSes between phases with the controller's phase topologies. A circuit that changes
  must be dark for ``T_ocs``. Its idle window runs from the last use of the removed circuits in the previous
  phase to the first use of the added circuits in the next one (so it includes the next phase's lead-in:
  training compute before the all-reduce, prefill/decode before the token streams); per-step latency is
  inside the transfers, so it is not idle time. The controller's rule decides
  (``controller.switching.decide_switch``): switch when the window fits; otherwise switch anyway and stall
  the next phase for ``T_ocs - window`` when the predicted gain (the next phase's time on the old topology
  minus on the new one; infinite when the old one cannot carry it) exceeds that stall; otherwise keep the
  old topology for the next phase. Each transition reports ``switched`` / ``stalled`` / ``kept`` (the
  rule's ``deferred``) or ``unchanged``, with its window, gain and stall.
  MixNet and TopoOpt are static for the job (MixNet's regional OCS keeps one ring per pod).
* ``SimSettings.train_rewire`` (the scenario's ``controller.train_rewire`` by default, off unless set): RFabric may
  also re-wire inside the train phase, from the model-parallel stages' own topology (every uplink of an EP
  group's ToRs to its partner ToRs; ``controller.phases.train_part_matchings``) to the rings' own before
  the gradient all-reduce, a stall of ``T_ocs`` weighed by the same rule (reconfig key TRAIN_REWIRE); the
  iteration takes it only when it is faster so than on the one train topology (``detail.train_rewire``).
  The model-parallel topology leaves the cells unjoined, so it models a synchronous iteration. The live
  loop's controller installs the same parts (``POST /phase`` with ``part``; testbed/backends/phase_model.py).
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import resource
import time
from dataclasses import dataclass

import numpy as np

from agents.costmodel import CostModel
from controller.ocs import diff
from controller.phases import TRAIN_PARTS, stripe_plan, sync_chains, topology_name, train_plan
from controller.fabric_rules import BUILTIN, FabricRule, scenario_rule
from controller.traffic import (Group, TrainLayout, broadcast_tree, merge, phase_traffic, train_bytes, train_layout,
                                train_traffic)
from emulation.orchestration import EngineSettings
from emulation.scenario import Scenario
from emulation.spec import FabricSpec, JobLayout, check_delay_ms
from emulation.validation import SpecError, require
from emulation.workload import LengthSchedule

from .cost import fabric_cost
from .fabric_models import fabric_model
from .fabrics import GBPS, CircuitNetwork, FabricOptions, Network, Unreachable
from .flowsim import Transfer, simulate
from .limits import scale_scenario

log = logging.getLogger(__name__)

TOKEN_STREAM_BYTES = 8  # per generated token: token id + log-prob (4 + 4 bytes)


@dataclass(frozen=True)
class SimSettings:
    # the OCS switching time (the reference's T_ocs), ms; None: the scenario's (Scenario.reconfig_delay_ms)
    reconfig_delay_ms: float | None = None
    latency_us: float = 5.0  # per lock-step of a collective (assumption: NIC + switch latency)
    sync_fanout: int = 1  # broadcast tree fan-out for weight sync (1: pipelined chains)
    sync_stripes: int = 0  # replicas a chain head pulls from (0: one per trainer ToR)
    engine: EngineSettings | None = None  # the rollout engines' settings; None: the scenario's (orchestrator.engine)
    # weight-sync bucket (real MB): a relay forwards a bucket once it is whole; None: the scenario's
    # (orchestrator.sync_bucket_mb, veRL's update_weights_bucket_megabytes)
    sync_bucket_mb: float | None = None
    fabric: FabricOptions = FabricOptions()
    # RFabric: re-wire inside the train phase, from the topology of the model-parallel stages (EP
    # all-to-all, PP) to one built for the DP rings alone (controller.phases.train_part_matchings), when the
    # rings gain more than the switching time. Off: one train topology for every stage. None: the
    # scenario's (controller.train_rewire, which the live loop's controller follows too).
    train_rewire: bool | None = None

    def __post_init__(self) -> None:
        check_delay_ms(self.reconfig_delay_ms, "reconfig_delay_ms")  # the controller's rule: finite, 0..MAX_DELAY_MS
        require(self.latency_us >= 0, "latency_us", f"must be >= 0, got {self.latency_us}")
        require(self.sync_stripes >= 0, "sync_stripes", f"must be >= 0, got {self.sync_stripes}")
        require(self.sync_fanout >= 1, "sync_fanout", f"must be >= 1, got {self.sync_fanout}")
        require(self.sync_bucket_mb is None or (math.isfinite(self.sync_bucket_mb) and self.sync_bucket_mb > 0),
                "sync_bucket_mb", f"must be > 0, got {self.sync_bucket_mb}")


def resolved(settings: SimSettings, scn: Scenario) -> SimSettings:
    """``settings`` with what it leaves to the scenario (None) filled in from ``scn.orchestrator``."""
    if settings.engine is None:
        settings = dataclasses.replace(settings, engine=scn.orchestrator.engine)
    if settings.sync_bucket_mb is None:
        settings = dataclasses.replace(settings, sync_bucket_mb=scn.orchestrator.sync_bucket_mb)
    if settings.train_rewire is None:
        settings = dataclasses.replace(settings, train_rewire=scn.controller.train_rewire)
    return settings


def tree_depth(index: int, fanout: int) -> int:
    """Edges from the root to node ``index`` of a breadth-first ``fanout``-ary tree (controller.traffic's
    broadcast_tree: node i's parent is (i - 1) // fanout; 1: a chain)."""
    d = 0
    while index > 0:
        index = (index - 1) // fanout
        d += 1
    return d


# ---- generation ----------------------------------------------------------------------------------
def replica_decode_s(cm: CostModel, lengths: np.ndarray, prompt: int, tp: int, slots: int) -> float:
    """Decode time of one replica serving responses of ``lengths`` with continuous batching."""
    n = len(lengths)
    if n == 0:
        return 0.0
    lengths = np.asarray(lengths, dtype=np.int64)
    if n <= slots:
        start = np.zeros(n, dtype=np.int64)
    else:  # greedy list scheduling in decode-step units (every active sequence advances one token a step)
        start = np.zeros(n, dtype=np.int64)
        free = [0] * slots
        for i, L in enumerate(lengths):
            s = heapq.heappop(free)
            start[i] = s
            heapq.heappush(free, s + int(L))
    end = start + lengths
    pts = np.unique(np.concatenate([start, end]))
    k0, k1 = pts[:-1], pts[1:]
    # active sequences and their total context on each segment [k0, k1)
    st_sorted, en_sorted = np.sort(start), np.sort(end)
    n_started = np.searchsorted(st_sorted, k0, side="right")
    n_ended = np.searchsorted(en_sorted, k0, side="right")
    active = n_started - n_ended
    cs_start = np.concatenate([[0], np.cumsum(st_sorted)])
    cs_end_start = np.concatenate([[0], np.cumsum(start[np.argsort(end, kind="stable")])])
    sum_start_active = cs_start[n_started] - cs_end_start[n_ended]
    mid = (k0 + k1) / 2.0
    ctx = active * (prompt + mid) - sum_start_active
    step = cm.decode_step_s_array(active, np.maximum(ctx, 0.0), tp)
    return float(np.sum(step * (k1 - k0)))


def generation_compute(cm: CostModel, lengths: np.ndarray, n_replicas: int, prompt: int, tp: int,
                       slots: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(finish time, generated tokens) of each replica (prefill + decode); responses dealt at random."""
    order = rng.permutation(len(lengths))
    fin = np.zeros(n_replicas)
    toks = np.zeros(n_replicas)
    for r in range(n_replicas):
        mine = lengths[order[r::n_replicas]]
        if len(mine) == 0:
            continue
        pre = 0.0
        for b0 in range(0, len(mine), slots):
            pre += cm.prefill_s(min(slots, len(mine) - b0), prompt, tp)
        fin[r] = pre + replica_decode_s(cm, mine, prompt, tp, slots)
        toks[r] = float(np.sum(mine))
    return fin, toks


# ---- network helpers -----------------------------------------------------------------------------
def run_demands(net: Network, demands, arrivals=None, latency=0.0, planned: bool = False):
    """Flow-simulate ``demands`` ``(src, dst, bytes)`` on ``net``. ``latency`` (seconds; a scalar or one per
    demand) is the collective's per-step latency: it lengthens each transfer, so its links stay in use.
    ``planned``: the demands are hops of a plan on circuits (``CircuitNetwork.direct_paths``), not routed."""
    paths = net.direct_paths if planned else net.paths
    transfers = []
    for i, (s, d, b) in enumerate(demands):
        lat = latency[i] if isinstance(latency, (list, tuple, np.ndarray)) else latency
        transfers.append(Transfer(float(b), paths(s, d), 0.0 if arrivals is None else float(arrivals[i]),
                                  latency=float(lat)))
    return simulate(net.capacity, transfers)


def merge_with_latency(groups) -> tuple[list, list]:
    """Merge ``[(demands, latency_s), ...]``: bytes of the same (src, dst) add up, the latency is the largest."""
    acc: dict[tuple[int, int], list[float]] = {}
    for dem, lat in groups:
        for s, d, b in merge(dem):
            e = acc.setdefault((s, d), [0.0, 0.0])
            e[0] += b
            e[1] = max(e[1], lat)
    return [(s, d, v[0]) for (s, d), v in acc.items()], [v[1] for v in acc.values()]


@dataclass
class PhaseRun:
    duration: float
    detail: dict
    busy: dict  # label -> (network, FlowResult, offset in the phase)


def ring_order(net: Network, servers: list[int]) -> list[int]:
    """Servers in ring order: ToR by ToR; on a direct-connect fabric the ToRs are chained greedily along
    the widest circuit bundles (what a topology-aware collective library does), else in index order."""
    spt = net.spec.servers_per_tor
    by_tor: dict[int, list[int]] = {}
    for s in servers:
        by_tor.setdefault(s // spt, []).append(s)
    tors = list(by_tor)
    if isinstance(net, CircuitNetwork) and net.matchings is None and len(tors) > 2:
        c = net.counts[np.ix_(tors, tors)]
        adj = (net.counts[tors] > 0).astype(np.int64)
        width = c + np.minimum(adj @ adj.T, net.max_two_hop)  # direct circuits + two-hop paths used
        idx = {t: i for i, t in enumerate(tors)}
        left = set(tors[1:])
        order = [tors[0]]
        while left:
            cur = idx[order[-1]]
            nxt = max(left, key=lambda t: (width[cur, idx[t]], -t))
            order.append(nxt)
            left.remove(nxt)
        tors = order
    return [s for t in tors for s in by_tor[t]]


def _train_layout(w, spec: FabricSpec, train_servers: list[int]) -> TrainLayout:
    return train_layout(train_servers, spec.gpus_per_server, w.train_tp, w.train_pp, w.train_dp, w.train_ep)


def train_phase(w, cm: CostModel, spec: FabricSpec, net: Network, train_servers: list[int],
                lengths: np.ndarray, settings: SimSettings, dp_net: Network | None = None,
                delay_s: float = 0.0, rule: FabricRule = BUILTIN) -> PhaseRun:
    """Training: compute ``6 N D`` (plus attention) times the pipeline bubble, then the stages of
    ``controller.traffic.train_traffic`` one after the other (EP all-to-all, PP point-to-point, the DP
    rings). The rings are ordered for the network (:func:`ring_order`); on a direct-connect network they run
    one-way and two-way (the library's choice; the same bytes leave every member) and the faster is kept.

    ``dp_net`` (RFabric with ``train_rewire``): the topology built for the DP rings alone. The model-parallel
    stages run on ``net``; before the rings the fabric may re-wire to ``dp_net``, by the switching rule
    (``decide_switch``) with no idle window (the rings start when the last backward pass ends): a switch
    costs a stall of ``delay_s`` and is made only when the rings gain more on ``dp_net`` than that.
    ``detail["train_rewire"]`` says what was decided and ``detail["end_topology"]`` which part's topology
    the phase ends on ("mp" or "dp")."""
    tl = _train_layout(w, spec, train_servers)
    dp, tp, pp, ep = tl.dp, tl.tp, tl.pp, tl.ep
    tokens = float(np.sum(lengths) + len(lengths) * w.prompt_tokens)
    seq = tokens / len(lengths)
    micro = max(1, len(lengths) // dp)
    compute = cm.train_compute_s(tokens, dp * tp * pp, seq_len=seq) * (1 + (pp - 1) / micro)
    lat = settings.latency_us * 1e-6
    b = train_bytes(cm, tl, tokens)
    tt = train_traffic(tl, b)
    busy = {}
    t = compute
    stages: dict = {}
    info = {"dp_dense_bytes": b.dense_grad, "dp_expert_bytes_per_shard": b.expert_grad / ep if b.expert_grad else 0.0,
            "dp_ring_members": 0, "dp_expert_ring_members": 0}
    for st in tt.stages:
        key = {"ep_alltoall": "ep", "pp_p2p": "pp", "dp_allreduce": "dp"}[st.name]
        if st.name != "dp_allreduce":
            latency = lat * ep * micro if st.name == "ep_alltoall" else lat * 2 * micro * (pp - 1)
            res = run_demands(net, st.demands(), latency=latency)
        else:
            for g in st.groups:
                k = "dp_ring_members" if g.label == "dense" else "dp_expert_ring_members"
                info[k] = max(info[k], len(g.members))
            on = net
            if dp_net is None:
                res, mode = _rings(net, st.groups, lat)
            else:
                info["end_topology"] = "mp"
                # re-wire from the model-parallel stages' topology (which need not reach every ring hop) to
                # the rings' own, if that gains more than the stall
                try:
                    res, mode = _rings(net, st.groups, lat)
                except Unreachable:
                    res, mode = None, None
                res_dp, mode_dp = _rings(dp_net, st.groups, lat)
                gain = math.inf if res is None else res.makespan - res_dp.makespan
                d = rule.decide(0.0, delay_s * 1e3, gain * 1e3)
                rewire = {"action": "kept" if d.action == "deferred" else d.action, "decision": d.action,
                          "gain_ms": gain * 1e3 if math.isfinite(gain) else None, "old_topology_carries": res is not None,
                          "stall_s": d.stall_ms / 1e3, "reason": d.reason,
                          "dp_on_mp_s": None if res is None else res.makespan, "dp_on_dp_s": res_dp.makespan}
                info["train_rewire"] = rewire
                if d.action != "deferred":
                    res, mode, on = res_dp, mode_dp, dp_net
                    t += rewire["stall_s"]
                    info["end_topology"] = "dp"
            info["dp_rings"] = mode
        stages[f"{st.name}_s"] = res.makespan
        busy[key] = (on if st.name == "dp_allreduce" else net, res, t)
        t += res.makespan
    detail = {"compute_s": compute, "dp": dp, "tp": tp, "pp": pp, "ep": ep, "tokens": tokens, **stages, **info}
    return PhaseRun(t, detail, busy)


def _rings(net: Network, groups, lat: float):
    """The DP rings ``groups`` on ``net``, ordered for it (:func:`ring_order`): one-way, and on a
    direct-connect network two-way too; the faster (result, mode)."""
    rings = [Group(g.kind, tuple(ring_order(net, list(g.members))), g.nbytes, g.label) for g in groups]
    res, mode = None, None
    for two_way in ((False, True) if isinstance(net, CircuitNetwork) else (False,)):
        dem, lats = merge_with_latency([(g.demands(two_way), lat * 2 * (len(g.members) - 1)) for g in rings])
        r = run_demands(net, dem, latency=lats)
        if res is None or r.makespan < res.makespan:
            res, mode = r, "two-way" if two_way else "one-way"
    return res, mode


def _stripe_sources(net: Network, head: int, groups: list[list[int]], tor_keys: list[int], d: int,
                    k_stripes: int) -> list[tuple[int, float]]:
    """(replica, share of the weights) a chain head pulls on a direct-connect fabric without a phase plan
    (TopoOpt, MixNet): the trainer ToRs linked to the head's ToR in proportion to their circuits; without
    such circuits ``controller.phases.stripe_plan``'s stripes. One replica per ToR, round robin."""
    def pick(g: int) -> int:
        grp = groups[g]
        return grp[(d // len(groups)) % len(grp)]

    if isinstance(net, CircuitNetwork):
        tor = head // net.spec.servers_per_tor
        w = np.array([net.counts[t, tor] for t in tor_keys], dtype=float)
        if w.sum() > 0:
            return [(pick(g), w[g] / w.sum()) for g in np.nonzero(w)[0]]
    return [(pick((d + k) % len(groups)), 1.0 / k_stripes) for k in range(k_stripes)]


def sync_bound_s(spec: FabricSpec, net: Network, gen_servers: list[int], weight_bytes: float) -> float:
    """The fabric's own lower bound on a weight broadcast: every generator server receives the weights on
    its link, and (direct-connect) every generator ToR over its circuits."""
    bound = weight_bytes / (spec.server_gbps * GBPS)
    if isinstance(net, CircuitNetwork):
        for t in sorted({s // spec.servers_per_tor for s in gen_servers}):
            circuits = float(net.counts[:, t].sum())
            bound = max(bound, weight_bytes / (circuits * spec.uplink_gbps * GBPS) if circuits else math.inf)
    return bound


def sync_phase(w, cm: CostModel, spec: FabricSpec, layout: JobLayout, net: Network, train_servers: list[int],
               gen_servers: list[int], settings: SimSettings) -> PhaseRun:
    """Weight sync. On RFabric the plan is ``controller.phases.sync_chains`` on the installed circuits (the
    sync phase's, or another phase's when that topology was kept): heads pull stripes from trainer servers
    over circuits, chains relay down their members. Elsewhere every trainer DP replica holds a copy, the
    generator servers are split into as many chains as replicas, and a head pulls stripes from replicas
    (one per trainer ToR, or in proportion to a direct-connect fabric's circuits)."""
    tl = _train_layout(w, spec, train_servers)
    dp, server_of = tl.dp, tl.server_of
    W = cm.weight_bytes()
    pp = w.train_pp
    dem = []
    depth = 0
    if getattr(net, "matchings", None) is not None:
        replica_at: dict[int, int] = {}  # trainer server holding stage 0 of a replica -> that replica
        for r in range(dp):
            replica_at.setdefault(server_of(r, 0), r)
        try:
            chains = sync_chains(spec, layout, net.matchings, holders=list(replica_at))
        except SpecError as e:
            raise Unreachable("fabric", f"{net.name}: no weight-sync plan on these circuits ({e})") from None
        hops: dict[int, int] = {}  # generator server -> relay hops from the trainers
        for ch in chains:
            head = ch.members[0]
            lead = 0
            for src, share in ch.sources:
                if src in replica_at:  # a replica's servers each send their stage's part of the share
                    for j in range(pp):
                        dem.append((server_of(replica_at[src], j), head, W * share / pp))
                else:  # relayed by a generator server of an earlier chain
                    dem.append((src, head, W * share))
                    lead = max(lead, hops[src])
            dem += broadcast_tree(head, ch.members[1:], W, settings.sync_fanout)
            for k, m in enumerate(ch.members):
                hops[m] = lead + 1 + tree_depth(k, settings.sync_fanout)
        detail = {"plan": "sync_chains", "chains": len(chains),
                  "longest_chain": max(len(c.members) for c in chains),
                  "sources_per_head_max": max(len(c.sources) for c in chains)}
        depth = max(hops.values())
    else:
        chains_n = min(dp, len(gen_servers))
        # stripes: a chain head pulls W / K from K replicas, one under each of K trainer ToRs (round robin),
        # so the first hop spreads over the trainer pool; the chain relays the whole W down its members
        spt = spec.servers_per_tor
        by_tor: dict[int, list[int]] = {}
        for r in range(dp):
            by_tor.setdefault(server_of(r, 0) // spt, []).append(r)
        groups = list(by_tor.values())
        tor_keys = list(by_tor)
        k_stripes = max(1, min(settings.sync_stripes or len(groups), dp))
        for d, (sources, members) in enumerate(stripe_plan(gen_servers, groups, chains_n, k_stripes)):
            if isinstance(net, CircuitNetwork):  # direct-connect: the head's circuits say where it pulls from
                sources = _stripe_sources(net, members[0], groups, tor_keys, d, k_stripes)
            for r, share in sources:
                for j in range(pp):  # the replica's servers each hold their stages' shards
                    dem.append((server_of(r, j), members[0], W * share / pp))
            dem += broadcast_tree(members[0], members[1:], W, settings.sync_fanout)
            depth = max(depth, 1 + tree_depth(len(members) - 1, settings.sync_fanout))
        detail = {"plan": "stripes", "chains": chains_n, "stripes": k_stripes}
    dem = merge(dem)
    planned = detail["plan"] == "sync_chains" and pp == 1 and settings.sync_fanout == 1
    res = run_demands(net, dem, latency=settings.latency_us * 1e-6 * depth, planned=planned) if dem else None
    dur = res.makespan if res else 0.0
    # the pipeline's fill: every relay forwards a bucket once the whole bucket is in (the agents' broadcast,
    # veRL's bucketed update), so the deepest member's last bucket comes (depth - 1) bucket times after the
    # flow model's end, a bucket time being a bucket at the rate the chain ran (W in ``dur``)
    bucket = min(W, (settings.sync_bucket_mb or 512.0) * 1e6)
    fill = max(0, depth - 1) * bucket / W * dur if W > 0 else 0.0
    dur += fill
    bound = sync_bound_s(spec, net, gen_servers, W)
    detail.update(weight_bytes=W, fanout=settings.sync_fanout, bound_s=bound, depth=depth, relay_fill_s=fill,
                  bucket_bytes=bucket,
                  vs_bound=dur / bound if bound > 0 and math.isfinite(bound) else None)
    return PhaseRun(dur, detail, {"sync": (net, res, 0.0)} if res else {})


@dataclass
class GenCompute:
    fin: np.ndarray  # per replica: when it finishes decoding (s)
    toks: np.ndarray  # per replica: tokens it generated
    per_server: int  # replicas per server


def gen_compute(w, cm: CostModel, spec: FabricSpec, gen_servers: list[int], lengths: np.ndarray,
                rng: np.random.Generator, settings: SimSettings) -> GenCompute:
    """The network-independent part of generation (prefill + decode of every replica), at
    ``settings.engine``'s max_num_seqs (resolved by simulate_iteration)."""
    tp = w.rollout_tp
    gps = spec.gpus_per_server
    require(tp <= gps, "workload.rollout_tp", f"must be <= gpus_per_server ({gps}), got {tp}")
    per_server = gps // tp
    n_rep = len(gen_servers) * per_server
    fin, toks = generation_compute(cm, lengths, n_rep, w.prompt_tokens, tp, settings.engine.max_num_seqs, rng)
    return GenCompute(fin, toks, per_server)


def gen_phase(w, gc: GenCompute, net: Network, gen_servers: list[int], train_servers: list[int],
              lengths: np.ndarray, settings: SimSettings) -> PhaseRun:
    """Generation on ``net``: each replica streams its responses to a trainer server when it finishes."""
    dem, arr = [], []
    for r in range(len(gc.fin)):
        if gc.toks[r] > 0:
            dem.append((gen_servers[r // gc.per_server], train_servers[r % len(train_servers)],
                        gc.toks[r] * TOKEN_STREAM_BYTES))
            arr.append(gc.fin[r])
    res = run_demands(net, dem, arr, latency=settings.latency_us * 1e-6)
    compute = float(gc.fin.max())
    dur = max(compute, res.makespan)
    detail = {"compute_s": compute, "replicas": len(gc.fin), "rollout_tp": w.rollout_tp,
              "longest_response": int(lengths.max()), "median_response": float(np.median(lengths)),
              "replica_p50_s": float(np.median(gc.fin)), "stream_tail_s": dur - compute}
    return PhaseRun(dur, detail, {"streams": (net, res, 0.0)})


# ---- reconfiguration ------------------------------------------------------------------------------
def bundle_use_s(run: PhaseRun, bundles: set[tuple[int, int]], last: bool) -> float | None:
    """Last (``last``) or first time in ``run`` that any of the circuit bundles ``bundles`` (ToR pairs,
    either direction) was in use; None: never."""
    best = -math.inf if last else math.inf
    for net, res, offset in run.busy.values():
        if res is None or not isinstance(net, CircuitNetwork):
            continue
        arr = res.link_last_busy if last else res.link_first_busy
        for a, b in bundles:
            for key in ((a, b), (b, a)):
                lid = net.bundle.get(key)
                if lid is None or not math.isfinite(arr[lid]):
                    continue
                v = offset + float(arr[lid])
                best = max(best, v) if last else min(best, v)
    return best if math.isfinite(best) else None


def idle_window_s(prev: PhaseRun, nxt: PhaseRun, removed: set, added: set) -> float:
    """Idle window of a reconfiguration between ``prev`` and ``nxt``: from the end of the last use of the
    circuits it removes (in ``prev``) to the first use of the circuits it adds (in ``nxt``), i.e. the
    removed circuits' idle tail of ``prev`` plus the added circuits' lead-in of ``nxt`` (e.g. training
    compute before the all-reduce; prefill and decode before the token streams). A bundle set never used
    counts its whole phase."""
    last = bundle_use_s(prev, removed, last=True)
    first = bundle_use_s(nxt, added, last=False)
    tail = prev.duration if last is None else max(0.0, prev.duration - last)
    lead = nxt.duration if first is None else max(0.0, first)
    return tail + lead


def changed_bundles(spec: FabricSpec, old: dict, new: dict) -> tuple[set, set]:
    """(removed, added) ToR-pair bundles whose circuits change from matchings ``old`` to ``new``."""
    out: tuple[set, set] = (set(), set())
    for o in old:
        d = diff(old[o], new[o])
        for k, circuits in enumerate((d.removed, d.added)):
            for a, b in circuits:
                ua, ub = spec.ocs_port_owner(o, a), spec.ocs_port_owner(o, b)
                if ua is not None and ub is not None and ua.tor != ub.tor:
                    out[k].add((min(ua.tor, ub.tor), max(ua.tor, ub.tor)))
    return out


TRAIN_REWIRE = "train:mp->train:dp"  # the reconfig key of re-wiring inside the train phase
UNCHANGED = {"action": "unchanged", "decision": None, "changed_bundles": 0, "window_ms": None, "gain_ms": None,
             "stall_s": 0.0}


def decide(prev: PhaseRun, nxt: PhaseRun, old: PhaseRun | None, removed: set, added: set, delay_s: float,
           rule: FabricRule = BUILTIN) -> dict:
    """One transition, by the fabric's phase ``rule`` (controller.fabric_rules; the built-in's is
    ``controller.switching.decide_switch``, the controller's own): the window is the
    changed circuits' idle window, the gain what the next phase saves on the new topology (``nxt``) against
    the old one (``old``; None: the old topology cannot carry that phase, an infinite gain). The report calls
    a deferred transition ``kept`` (the phase runs on the old topology); ``decision`` is the rule's word."""
    if not removed and not added:
        return dict(UNCHANGED)
    window = idle_window_s(prev, nxt, removed, added)
    gain = math.inf if old is None else old.duration - nxt.duration
    d = rule.decide(window * 1e3, delay_s * 1e3, gain * 1e3)
    return {"action": "kept" if d.action == "deferred" else d.action, "decision": d.action,
            "changed_bundles": len(removed | added), "window_ms": window * 1e3,
            "gain_ms": gain * 1e3 if math.isfinite(gain) else None, "old_topology_carries": old is not None,
            "next_phase_new_s": nxt.duration, "next_phase_old_s": None if old is None else old.duration,
            "stall_s": d.stall_ms / 1e3, "reason": d.reason}


def _rfabric_cycle(start: str, runners: dict, nets: dict, matchings: dict, spec: FabricSpec,
                   delay_s: float, rule: FabricRule = BUILTIN) -> tuple[dict, dict, str]:
    """One steady-state iteration gen -> train -> sync -> (next) gen on RFabric, starting with topology
    ``start`` installed for generation. Returns the phase runs, the decisions, and the topology installed
    at the next generation."""
    def attempt(ph: str, topo: str) -> PhaseRun | None:
        try:
            return runners[ph](nets[topo])
        except Unreachable:
            return None

    gen = attempt("gen", start)
    if gen is None:  # the generation topology itself cannot carry it (too few uplinks): say which demand
        runners["gen"](nets[start])
    runs, decisions = {"gen": gen}, {}
    installed, prev = start, gen
    for ph in ("train", "sync"):
        target = runners[ph](nets[ph])
        if installed == ph:
            runs[ph], prev = target, target
            decisions[f"{_prev_name(ph)}->{ph}"] = dict(UNCHANGED, topology=ph)
            installed = _ends_on(ph, target)
            continue
        removed, added = changed_bundles(spec, matchings[installed], matchings[ph])
        old = attempt(ph, installed)
        d = decide(prev, target, old, removed, added, delay_s, rule)
        d["topology"] = installed if d["action"] == "kept" else ph
        decisions[f"{_prev_name(ph)}->{ph}"] = d
        if d["action"] == "kept":
            runs[ph] = old
        else:
            runs[ph], installed = target, _ends_on(ph, target)
        prev = runs[ph]
    # closing transition: towards the generation topology ``start`` of the next iteration
    if installed == start:
        d = dict(UNCHANGED, topology=start)
        end = start
    else:
        removed, added = changed_bundles(spec, matchings[installed], matchings[start])
        d = decide(prev, gen, attempt("gen", installed), removed, added, delay_s, rule)
        end = installed if d["action"] == "kept" else start
        d["topology"] = end
    decisions["sync->gen"] = d
    rw = runs["train"].detail.get("train_rewire")
    if rw is not None:  # re-wiring inside the train phase (train_rewire); its stall is inside the train phase
        decisions[TRAIN_REWIRE] = {**rw, "changed_bundles": len(set().union(*changed_bundles(
            spec, matchings["train"], matchings["train:dp"]))), "window_ms": 0.0, "stall_in_phase": True,
            "topology": "train:dp" if rw["action"] != "kept" else "train"}
    return runs, decisions, end


def _ends_on(ph: str, run: PhaseRun) -> str:
    """The topology installed at the end of ``run`` on phase ``ph``'s own: ``train:dp`` where the train phase
    re-wired inside (train_rewire), else ``ph``."""
    return "train:dp" if run.detail.get("end_topology") == "dp" else ph


def _phases(runs: dict, reconfig: dict) -> dict:
    """Each phase's time: its run plus the stalls of the transitions into it (a stall inside the train
    phase, TRAIN_REWIRE's, is in its run already)."""
    stall = {q: sum(v["stall_s"] for k, v in reconfig.items() if k.endswith("->" + q)) for q in ("gen", "train", "sync")}
    return {"gen_s": runs["gen"].duration + stall["gen"], "sync_s": runs["sync"].duration + stall["sync"],
            "train_s": runs["train"].duration + stall["train"]}


def _prev_name(ph: str) -> str:
    return {"train": "gen", "sync": "train", "gen": "sync"}[ph]


# ---- one iteration --------------------------------------------------------------------------------
def peak_rss_mib() -> float:
    """This process's peak resident memory (MiB): Linux's VmHWM, the high-water mark of this program's own
    memory; elsewhere ``ru_maxrss``, which on Linux also counts what the parent held when it forked."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0



def simulate_iteration(scn: Scenario, fabric: str, gpus: int | None = None,
                       settings: SimSettings = SimSettings()) -> dict:
    """Simulate one RL iteration of ``scn`` on ``fabric`` at ``gpus`` GPUs; a JSON-able result."""
    t0 = time.perf_counter()
    model = fabric_model(fabric)  # rlsim.fabric_models: SpecError naming ``fabric`` for an unknown one
    rule = scenario_rule(scn)  # the fabric's phase rule (controller.fabric_rules), the controller's own
    scn = scale_scenario(scn, gpus)
    settings = resolved(settings, scn)
    spec, layout, w = scn.fabric, scn.layout, scn.workload
    reconfig_delay_ms = scn.reconfig_delay_ms if settings.reconfig_delay_ms is None else settings.reconfig_delay_ms
    delay_s = reconfig_delay_ms / 1e3
    cm = CostModel.for_engine(w.model, w.gpu, settings.engine)  # generation as the scenario's engine runs it
    rng = scn.rng()
    lengths = LengthSchedule(w).lengths_for_step(0, rng)  # the run's first step (a trace's too)
    train_servers, gen_servers = layout.train_servers(spec), layout.gen_servers(spec)

    nets: dict = {}
    matchings: dict = {}
    traffic = phase_traffic(spec, layout, w) if model.reconfigures else None
    for ph in ("gen", "train", "sync"):
        if model.reconfigures:
            nets[ph], matchings[ph] = model.topology(spec, layout, ph, settings.fabric, traffic, rule)
        else:
            nets[ph] = nets.get("gen") or model.network(spec, layout, ph, settings.fabric)
    gc = gen_compute(w, cm, spec, gen_servers, lengths, rng, settings)
    parts: dict = {}
    if model.reconfigures and settings.train_rewire and traffic.n_stages > 1:
        # the train phase may start on the model-parallel stages' own topology and re-wire to the rings' own
        # (train_phase); taken when the iteration is faster so, its stalls included, than on one train topology
        for part in TRAIN_PARTS:
            net, m = model.topology(spec, layout, topology_name("train", part), settings.fabric, traffic, rule)
            parts[part] = (m, net)

    def runners_for(ns: dict, rewired: bool) -> dict:
        return {
            "gen": lambda net: gen_phase(w, gc, net, gen_servers, train_servers, lengths, settings),
            "train": lambda net: train_phase(w, cm, spec, net, train_servers, lengths, settings,
                                             dp_net=ns["train:dp"] if rewired and net is ns["train"] else None,
                                             delay_s=delay_s, rule=rule),
            "sync": lambda net: sync_phase(w, cm, spec, layout, net, train_servers, gen_servers, settings),
        }

    def cycle(rewired: bool) -> tuple[dict, dict, str]:
        # steady state: start with the generation topology; if the iteration ends keeping another topology
        # for the next generation, run once more starting from that one (and report where it started)
        ns, ms = dict(nets), dict(matchings)
        if rewired:
            (ms["train"], ns["train"]), (ms["train:dp"], ns["train:dp"]) = parts["mp"], parts["dp"]
        runners = runners_for(ns, rewired)
        runs, reconfig, end = _rfabric_cycle("gen", runners, ns, ms, spec, delay_s, rule)
        start = "gen"
        if end != "gen":
            start = end
            runs, reconfig, end = _rfabric_cycle(start, runners, ns, ms, spec, delay_s, rule)
        return runs, reconfig, start

    reconfig: dict = {}
    steady_start = rewire_plan = None
    if model.reconfigures:
        runs, reconfig, steady_start = cycle(False)
        if parts:
            alt = cycle(True)
            one_s, rw_s = sum(_phases(runs, reconfig).values()), sum(_phases(alt[0], alt[1]).values())
            rewire_plan = {"taken": rw_s < one_s, "one_topology_iteration_s": one_s, "rewired_iteration_s": rw_s}
            if rw_s < one_s:
                runs, reconfig, steady_start = alt
        gen, train, sync = runs["gen"], runs["train"], runs["sync"]
    else:  # static for the job (MixNet's regional OCSes included: see the module docstring)
        runners = runners_for(nets, False)
        runs = {ph: runners[ph](nets[ph]) for ph in ("gen", "train", "sync")}
        gen, train, sync = runs["gen"], runs["train"], runs["sync"]
    phases = _phases(runs, reconfig)
    iteration = sum(phases.values())
    cost = fabric_cost(fabric, spec, cm.gpu.nic_gbps, opts=settings.fabric)
    wall = time.perf_counter() - t0
    return {
        "scenario": scn.name, "fabric": fabric, "gpus": spec.n_gpus, "reconfig_delay_ms": reconfig_delay_ms,
        "iteration_s": iteration, "phases": phases, "cost_usd": cost["total_usd"],
        "perf_per_musd": (1.0 / iteration) / (cost["total_usd"] / 1e6) if iteration > 0 else None,
        "wall_s": wall,
        "detail": {"gen": gen.detail, "train": train.detail, "sync": sync.detail, "reconfig": reconfig,
                   "steady_state_gen_topology": steady_start, "train_rewire": rewire_plan,
                   "train_plan": train_plan(spec, traffic.train).summary() if traffic is not None else None,
                   "cost": cost, "model": w.model, "gpu": w.gpu,
                   "train_servers": len(train_servers), "gen_servers": len(gen_servers),
                   "mixnet_split": None, **model.detail(spec, settings.fabric)},
        "peak_rss_mib": peak_rss_mib(),
    }
