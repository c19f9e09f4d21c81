"""What each phase of an RL step sends (pure): one home for the traffic that RFabric's phase topologies are
built from (``controller.phases``) and that RLSim simulates (``rlsim.sim``), so both see the same bytes.

Collectives become server-to-server demands ``(src, dst, bytes)``. Bandwidth-bound, pipelined collectives
are modelled by their concurrent neighbour transfers with the total bytes each pair carries:

* ring all-reduce of ``S`` bytes over ``n`` members: every member sends ``2 (n-1)/n * S`` to the next one
  (reduce-scatter then all-gather). ``two_way``: the library splits ``S`` over two rings running in opposite
  directions (each member sends ``(n-1)/n * S`` to each neighbour), which uses both directions of a
  direct-connect fabric's circuits (TopoOpt's ring permutations come in pairs, stride ``p`` and ``n - p``).
  On a non-blocking fabric both take ``2 (n-1)/n * S / B`` (the same bytes leave every member);
* pipelined broadcast tree of ``S`` bytes with fan-out ``k``: every parent sends ``S`` to each child;
* all-to-all of ``S`` bytes per member: ``S / n`` to each other member;
* point-to-point: one demand.

Training, per step (``train_traffic``), in stages that run one after the other (RLSim adds them up):

* ``ep_alltoall``: MoE expert dispatch + combine, forward + backward, every layer of a pipeline stage, among
  the ``ep`` replicas of an EP group (per stage);
* ``pp_p2p``: pipeline activations forward and their gradients backward between consecutive stages of a
  replica;
* ``dp_allreduce``: the gradient all-reduce, one ring per pipeline stage over the replicas (dense
  parameters), and with EP one ring per expert shard over the ``dp/ep`` replicas holding it (``1/ep`` of the
  expert bytes each).

Placement (``TrainLayout``): replica ``r``'s stage ``j`` holds trainer GPUs ``[(r*pp + j)*tp, ... + tp)``;
EP group ``g`` is replicas ``g*ep .. g*ep+ep-1`` (member ``i`` holds expert shard ``i``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from emulation.spec import FabricSpec, JobLayout
from emulation.validation import require

Demand = tuple[int, int, float]
STAGES = ("ep_alltoall", "pp_p2p", "dp_allreduce")  # training's stages, in the order they run
GROUP_KINDS = ("all_to_all", "p2p", "ring")


# ---- collectives as demands -----------------------------------------------------------------------------
def ring_allreduce(members: Sequence[int], size: float, two_way: bool = False) -> list[Demand]:
    n = len(members)
    if n < 2 or size <= 0:
        return []
    if not two_way or n == 2:  # two members: both "directions" are the same pair
        per = 2.0 * (n - 1) / n * size
        return [(members[i], members[(i + 1) % n], per) for i in range(n)]
    per = (n - 1) / n * size
    return ([(members[i], members[(i + 1) % n], per) for i in range(n)]
            + [(members[(i + 1) % n], members[i], per) for i in range(n)])


def broadcast_tree(root: int, members: Sequence[int], size: float, fanout: int = 1) -> list[Demand]:
    """Pipelined k-ary tree from ``root`` over ``members`` (breadth-first order; root not in members)."""
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, got {fanout}")
    order = [root] + [m for m in members if m != root]
    out = []
    for i in range(1, len(order)):
        parent = order[(i - 1) // fanout]
        out.append((parent, order[i], float(size)))
    return out


def all_to_all(members: Sequence[int], size_per_member: float) -> list[Demand]:
    n = len(members)
    if n < 2 or size_per_member <= 0:
        return []
    per = size_per_member / n
    return [(a, b, per) for a in members for b in members if a != b]


def merge(demands: Sequence[Demand]) -> list[Demand]:
    """Sum the bytes of demands with the same (src, dst); drop self-demands (they stay in the server)."""
    acc: dict[tuple[int, int], float] = {}
    for s, d, b in demands:
        if s != d and b > 0:
            acc[(s, d)] = acc.get((s, d), 0.0) + b
    return [(s, d, b) for (s, d), b in acc.items()]


# ---- training's parallel layout ----------------------------------------------------------------------
@dataclass(frozen=True)
class TrainLayout:
    """Where training's replicas and stages sit on the trainer servers (see the module docstring)."""

    servers: tuple[int, ...]  # trainer servers, in order
    gpus_per_server: int
    tp: int
    pp: int
    dp: int
    ep: int

    def server_of(self, r: int, j: int) -> int:
        """The server holding stage ``j`` of replica ``r`` (its first GPU's, for a stage wider than a server)."""
        return self.servers[((r * self.pp + j) * self.tp) // self.gpus_per_server]

    def ep_groups(self) -> list[tuple[int, ...]]:
        """Servers of every EP group at every stage (sorted, deduplicated); none without EP."""
        if self.ep <= 1:
            return []
        return [tuple(sorted({self.server_of(g * self.ep + i, j) for i in range(self.ep)}))
                for g in range(self.dp // self.ep) for j in range(self.pp)]

    def pp_pairs(self) -> list[tuple[int, int]]:
        """(stage j server, stage j+1 server) of every replica."""
        return [(self.server_of(r, j), self.server_of(r, j + 1)) for r in range(self.dp) for j in range(self.pp - 1)]

    def dense_rings(self) -> list[tuple[int, ...]]:
        """One ring per stage over the servers holding it (in trainer order)."""
        return [tuple(dict.fromkeys(self.server_of(r, j) for r in range(self.dp))) for j in range(self.pp)]

    def expert_rings(self) -> list[tuple[int, ...]]:
        """With EP: one ring per (stage, shard) over the replicas holding that shard."""
        if self.ep <= 1:
            return []
        return [tuple(dict.fromkeys(self.server_of(g * self.ep + i, j) for g in range(self.dp // self.ep)))
                for j in range(self.pp) for i in range(self.ep)]


def train_layout(servers: Sequence[int], gps: int, tp: int, pp: int, dp: int, ep: int) -> TrainLayout:
    """Training's placement on the trainer ``servers`` of ``gps`` GPUs each (SpecError naming the workload
    field when it cannot be). ``dp`` 0 fills the trainer GPUs."""
    mp = tp * pp
    require(tp <= gps, "workload.train_tp",
            f"tensor parallelism stays inside a server: must be <= gpus_per_server ({gps}), got {tp}")
    n_gpus = len(servers) * gps
    require(n_gpus % mp == 0, "workload.train_pp", f"train_tp x train_pp ({mp}) must divide the {n_gpus} trainer GPUs")
    max_dp = n_gpus // mp
    dp = dp or max_dp
    require(dp <= max_dp, "workload.train_dp", f"{n_gpus} trainer GPUs hold at most {max_dp} replicas, got {dp}")
    require(ep <= dp, "workload.train_ep", f"expert parallelism spans DP replicas: must be <= {dp}")
    require(dp % ep == 0, "workload.train_ep", f"must divide the DP degree {dp}, got {ep}")
    return TrainLayout(tuple(servers), gps, tp, pp, dp, ep)


# ---- bytes per step --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainBytes:
    """What one training step sends (real bytes), from the model and the step's tokens."""

    dense_grad: float  # gradients reduced over every replica (everything, for a dense model or ep == 1)
    expert_grad: float  # routed-expert gradients, all shards (0 without EP)
    a2a_per_replica: float  # EP all-to-all bytes a replica sends in a step (dispatch+combine, fwd+bwd, its layers)
    act_per_replica: float  # PP: activation bytes per stage boundary of a replica (each way)


def train_bytes(cm, tl: TrainLayout, tokens: float) -> TrainBytes:
    """``cm``: an ``agents.costmodel.CostModel``; ``tokens``: the step's tokens (prompts + responses)."""
    m = cm.model
    dense, expert = cm.dense_gradient_bytes(), cm.expert_gradient_bytes()
    if tl.ep == 1:
        dense, expert = dense + expert, 0.0
    t_r = tokens / tl.dp
    a2a = t_r * m.experts_per_token * m.hidden * cm.dtype_bytes * 4 * (m.layers / tl.pp) if m.is_moe and tl.ep > 1 else 0.0
    return TrainBytes(float(dense), float(expert), float(a2a), float(t_r * m.hidden * cm.dtype_bytes))


# ---- training's traffic, stage by stage -----------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """One collective: ``kind`` (GROUP_KINDS), its server ``members`` and ``nbytes``: per member for an
    all-to-all, per direction for a point-to-point pair, the all-reduced size for a ring."""

    kind: str
    members: tuple[int, ...]
    nbytes: float
    label: str = ""  # e.g. "dense", "expert"

    def demands(self, two_way: bool = False) -> list[Demand]:
        if self.kind == "all_to_all":
            return all_to_all(self.members, self.nbytes)
        if self.kind == "p2p":
            a, b = self.members
            return [(a, b, self.nbytes), (b, a, self.nbytes)]
        return ring_allreduce(self.members, self.nbytes, two_way)


@dataclass(frozen=True)
class TrainStage:
    name: str  # one of STAGES
    groups: tuple[Group, ...]

    def demands(self, two_way: bool = False) -> list[Demand]:
        out: list[Demand] = []
        for g in self.groups:
            out += g.demands(two_way)
        return merge(out)


@dataclass(frozen=True)
class TrainTraffic:
    layout: TrainLayout
    bytes: TrainBytes
    stages: tuple[TrainStage, ...]  # only the stages that send anything, in STAGES order

    def stage(self, name: str) -> TrainStage | None:
        return next((s for s in self.stages if s.name == name), None)

    def named_groups(self) -> list[tuple[str, Group]]:
        """Every collective of every stage with a process-group name (``ep_alltoall-0``, ``dp_allreduce-1``,
        ...): what the emulated trainers form once and run each step."""
        return [(f"{st.name}-{i}", g) for st in self.stages for i, g in enumerate(st.groups)]


def train_traffic(tl: TrainLayout, b: TrainBytes) -> TrainTraffic:
    stages = []
    if b.a2a_per_replica > 0:
        # a replica's all-to-all bytes, spread over the group's servers (ep replicas may share a server)
        stages.append(TrainStage("ep_alltoall", tuple(
            Group("all_to_all", g, b.a2a_per_replica * tl.ep / len(g)) for g in tl.ep_groups() if len(g) > 1)))
    if tl.pp > 1:
        acc: dict[tuple[int, int], float] = {}
        for a, c in tl.pp_pairs():
            if a != c:
                key = (min(a, c), max(a, c))
                acc[key] = acc.get(key, 0.0) + b.act_per_replica
        stages.append(TrainStage("pp_p2p", tuple(Group("p2p", k, v) for k, v in sorted(acc.items()))))
    rings = [Group("ring", r, b.dense_grad / tl.pp, "dense") for r in tl.dense_rings() if len(r) > 1]
    if b.expert_grad > 0:
        rings += [Group("ring", r, b.expert_grad / tl.ep / tl.pp, "expert") for r in tl.expert_rings() if len(r) > 1]
    if rings:
        stages.append(TrainStage("dp_allreduce", tuple(rings)))
    return TrainTraffic(tl, b, tuple(s for s in stages if s.groups))


# ---- a scenario's traffic, for the phase topologies ---------------------------------------------------------
@dataclass(frozen=True)
class PhaseTraffic:
    """What the phase topologies are planned for: training's traffic at the workload's nominal tokens per step
    (the mean step: the topology is set before the step's lengths are known), and the server rate."""

    train: TrainTraffic

    @property
    def n_stages(self) -> int:
        return len(self.train.stages)


def nominal_tokens(workload) -> float:
    """Tokens of a training step at the workload's expected response lengths (step 0 of its schedule drawn
    with a fixed seed, so every caller gets the same number; a trace's own first step)."""
    from emulation.workload import LengthSchedule

    lengths = LengthSchedule(workload).lengths_for_step(0, np.random.default_rng(0))
    return float(np.sum(lengths) + len(lengths) * workload.prompt_tokens)


@lru_cache(maxsize=64)
def phase_traffic(spec: FabricSpec, layout: JobLayout, workload) -> PhaseTraffic:
    """The traffic of ``workload`` (an ``emulation.workload.WorkloadSpec``) on ``spec``/``layout``."""
    from agents.costmodel import CostModel

    cm = CostModel.for_names(workload.model, workload.gpu)
    tl = train_layout(layout.train_servers(spec), spec.gpus_per_server, workload.train_tp, workload.train_pp,
                      workload.train_dp, workload.train_ep)
    return PhaseTraffic(train_traffic(tl, train_bytes(cm, tl, nominal_tokens(workload))))


def stage_server_bound_s(spec: FabricSpec, demands: Sequence[Demand]) -> float:
    """A stage's time on a non-blocking fabric: the busiest server link (sent or received) at the server rate."""
    if not demands:
        return 0.0
    n = spec.n_servers
    out = np.zeros(n)
    inn = np.zeros(n)
    for s, d, b in demands:
        out[s] += b
        inn[d] += b
    return float(max(out.max(), inn.max()) / (spec.server_gbps * 1e9 / 8))


