"""Progress-informed lanes: how much of the lane oracle a policy could keep that finds the long requests by
their progress alone, as an online policy must (no response length known in advance).

The ``both`` oracle (testbed.runs.oracle) wins on tail-dominated steps with a *lane plan*: ``k`` servers at a
large-TP layout hold the longest requests from time 0, the rest run at a small-TP layout. An online policy
cannot place by length at time 0; the most it can do is start with heterogeneous layouts and move the
requests that have generated the most tokens so far onto the lanes as the step runs. This module searches
that family generously, so that its best is an upper estimate for online lane policies of this kind:

* layouts are set at the step's start for free (no switch charged);
* every migration is free and instant (its KV arrives with it; no transfer, no re-prefill);
* every planning tick (``tick_s``) each bulk server hands up to ``per_tick`` of its requests with the most
  tokens generated (at least ``min_generated``) to the lane server holding the fewest requests;
* the step's requests are dealt as the driver deals them, to every server (``deal="all"``) or, the lanes
  starting empty, only to the bulk servers (``deal="bulk"``);
* searched: the number of lane servers, lane x bulk layout pairs (lane TP larger), ``min_generated``,
  ``per_tick`` (:data:`GRID`), at the scenario's ``max_num_seqs`` for the bulk (the tuning grid's largest
  for the lanes, which are never capped). Not searched: moves back from a lane, more than one lane layout
  per plan.

What knowledge would an online policy need to keep the oracle's gain? ``knowledge`` other than
``"progress"`` gives the search something no online policy has at time 0, so that the answer is an upper
estimate for it: a score per request (:func:`scores`), and ``seed`` (:class:`LanePlan`) requests per lane
replica, those of the highest scores, placed on the lanes at the step's start (the rest dealt as ``deal``
says), before the progress hand-over above:

* ``"prompt"``: every request knows its prompt's difficulty as well as it can be known, the mean log length
  of the prompt's own samples (what a perfect prompt-difficulty predictor, or the prompt-group evidence of
  the forecast at its best, could give; a prompt's samples still spread around it by the within-prompt
  sigma);
* ``"predictor:S"``: a per-request length predictor whose log error is normal with sd ``S`` (its log length
  plus that noise, seeded by the scenario); ``S`` = 0 is the lane oracle's own knowledge.

Every makespan is an engine schedule (agents.engine, virtual time), the same engine the simulated backend
and the oracle run. ``bench_lanes.py`` prints the search per scenario against the tuned static and the lane
oracle.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np

from agents.engine import Engine, Layout, NewRequest

GRID = {"min_generated": (200, 400, 800, 1600), "per_tick": (4, 16, 64), "deal": ("bulk", "all"), "seed": (0,)}
# with a score known at time 0: how many of the top-scored requests each lane replica starts with (the lane
# oracle's testbed.runs.oracle.LANE_SHARES and beyond: a noisier score does best with more of them, on short-7b
# up to 256 of its 512 requests a server), the progress hand-over on or off
KNOWN_GRID = {"min_generated": (400, 10 ** 9), "per_tick": (16,), "deal": ("bulk",),
              "seed": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)}
KNOWLEDGE = ("progress", "prompt", "predictor:S")  # what :func:`scores` accepts (S: the predictor's log-error sd)
TICK_S = 1.0  # the orchestrator's default planning interval
HANDOVER_S = 0.05  # how often a request that left at the end of a step in flight is collected


@dataclass(frozen=True)
class LanePlan:
    lanes: int  # servers at the lane layout (the last ``lanes`` of the generator servers)
    lane_layout: str
    bulk_layout: str
    min_generated: int
    per_tick: int
    deal: str  # "all" | "bulk"
    seed: int = 0  # requests per lane replica placed on the lanes at time 0 by a known score (0: none)


@dataclass
class LaneRun:
    plan: LanePlan
    makespan_s: float
    moved: int
    finished: int


def run_plan(oracle, plan: LanePlan, lengths: np.ndarray, placed: dict, tick_s: float = TICK_S,
             bulk_mns: int | None = None, score: np.ndarray | None = None) -> LaneRun:
    """One step under ``plan`` on the engine (see the module docstring). ``oracle``: a
    testbed.runs.oracle.Oracle of the scenario (its cost model, GPUs per server, engine settings); ``score``:
    per request (indexed as ``lengths``) what is known of its length at time 0, for a plan that seeds the
    lanes (:func:`scores`)."""
    if plan.deal not in ("all", "bulk"):
        raise ValueError(f"deal: must be 'all' or 'bulk', got {plan.deal!r}")
    servers = list(placed)
    if not 1 <= plan.lanes < len(servers):
        raise ValueError(f"lanes: must be in 1..{len(servers) - 1}, got {plan.lanes}")
    if plan.seed < 0:
        raise ValueError(f"seed: must be >= 0, got {plan.seed}")
    if plan.seed and (score is None or len(score) != len(lengths)):
        raise ValueError(f"seed: {plan.seed} requests per lane replica need a score per request "
                         f"(got {'none' if score is None else len(score)} for {len(lengths)} requests)")
    bulk, lanes = _split(plan, servers)
    mns = bulk_mns or oracle.settings.engine.max_num_seqs
    lane_layout = Layout.parse(plan.lane_layout, oracle.gpus)
    eng = {s: Engine(oracle.cost, oracle.gpus, Layout.parse(plan.bulk_layout, oracle.gpus), oracle._settings(mns))
           for s in bulk}
    eng.update({s: Engine(oracle.cost, oracle.gpus, lane_layout, oracle._settings(max(oracle.grid))) for s in lanes})
    parts = start_deal(plan, placed, score, lane_layout.replicas(oracle.gpus))
    P = oracle.w.prompt_tokens
    for s in servers:
        if len(parts[s]):
            eng[s].add([NewRequest(rid=int(i), prompt=P, target=int(lengths[i])) for i in parts[s]], 0.0,
                       chunked=True)
    def hand_over(now: float) -> None:  # what the bulk servers let go of goes to the emptiest lane
        for s in bulk:
            for rid in list(eng[s].detached):
                r = eng[s].detached.pop(rid)
                eng[min(lanes, key=lambda x: (len(eng[x].held), x))].add([r], now)

    t, moved, n_sub = 0.0, 0, max(1, round(tick_s / HANDOVER_S))
    while True:
        for i in range(1, n_sub + 1):  # a request asked to leave during a step goes at that step's end: collected
            now = t + tick_s * i / n_sub  # every HANDOVER_S
            for e in eng.values():
                e.run_until(now)
            hand_over(now)
        t += tick_s
        if all(e.idle() for e in eng.values()):
            break
        for s in bulk:
            snap = eng[s].snapshot()
            order = np.argsort(-snap["generated"], kind="stable")
            asked = 0
            for j in order:
                if snap["generated"][j] < plan.min_generated or asked >= plan.per_tick:
                    break
                rid = int(snap["rid"][j])
                if not eng[s].detaching(rid):
                    eng[s].detach(rid, t)
                    asked += 1
                    moved += 1
        hand_over(t)
    finished = sum(e.finished_total for e in eng.values())
    return LaneRun(plan, max(e.last_end for e in eng.values() if e.last_end > -math.inf), moved, finished)


def _split(plan: LanePlan, servers: list) -> tuple[list, list]:
    """(bulk servers, lane servers) of ``plan``: the last ``plan.lanes`` are the lanes."""
    return servers[:len(servers) - plan.lanes], servers[len(servers) - plan.lanes:]


def start_deal(plan: LanePlan, placed: dict, score: np.ndarray | None, lane_replicas: int) -> dict:
    """The requests each server starts the step with under ``plan`` (``placed``: the dispatcher's deal, server ->
    request indices; the last ``plan.lanes`` servers are the lanes): with ``plan.seed``, the ``seed`` x
    ``lane_replicas`` x lanes requests of the highest ``score`` on the lanes, dealt round robin in score order
    (ties by index); the rest, in index order, in equal consecutive chunks over every server (``deal="all"``)
    or over the bulk servers only (``"bulk"``)."""
    servers = list(placed)
    bulk, lanes = _split(plan, servers)
    idx = np.concatenate([np.asarray(placed[s], np.int64) for s in servers])
    out = dict.fromkeys(servers, idx[:0])
    if plan.seed:
        n_top = min(len(idx), plan.seed * plan.lanes * lane_replicas)
        ranked = idx[np.argsort(-np.asarray(score, float)[idx], kind="stable")]
        for j, s in enumerate(lanes):
            out[s] = ranked[:n_top][j::len(lanes)]
        idx = np.sort(ranked[n_top:])
    to = servers if plan.deal == "all" else bulk
    for s, part in zip(to, np.array_split(idx, len(to))):
        out[s] = np.concatenate([out[s], part])
    return out


def plans(oracle, n_servers: int, grid: dict = GRID) -> list[LanePlan]:
    """Every plan of the search: lane counts 1..n-1 x (lane, bulk) layout pairs with the lane's TP larger x
    the grid (``seed`` (0,) where the grid does not name it)."""
    lays = [lay.name(oracle.gpus) for lay in oracle.layouts]
    tp = {lay.name(oracle.gpus): lay.tp for lay in oracle.layouts}
    pairs = [(a, b) for a in lays for b in lays if tp[a] > tp[b]]
    return [LanePlan(k, a, b, g, m, d, e) for k in range(1, n_servers) for a, b in pairs
            for g, m, d, e in itertools.product(grid["min_generated"], grid["per_tick"], grid["deal"],
                                                grid.get("seed", (0,)))]


def parse_knowledge(knowledge: str) -> tuple[str, float | None]:
    """(kind, the predictor's log-error sd or None) of a name of :data:`KNOWLEDGE`; a ValueError naming it
    otherwise (a CLI checks its names with this before any engine runs)."""
    if knowledge in ("progress", "prompt"):
        return knowledge, None
    if knowledge.startswith("predictor:"):
        try:
            sd = float(knowledge.split(":", 1)[1])
        except ValueError:
            sd = math.nan
        if not (math.isfinite(sd) and sd >= 0):
            raise ValueError(f"knowledge {knowledge!r}: the predictor's log-error sd must be a number >= 0")
        return "predictor", sd
    raise ValueError(f"knowledge {knowledge!r}: must be one of {', '.join(KNOWLEDGE)}")


def scores(knowledge: str, lengths: np.ndarray, pid: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    """What is known at time 0 of every request's length under ``knowledge`` (see the module docstring):
    None for ``"progress"`` (nothing), the mean log length of its prompt's samples for ``"prompt"``, its log
    length plus normal noise of sd ``S`` for ``"predictor:S"``. A name not of :data:`KNOWLEDGE` is a
    ValueError naming it (:func:`parse_knowledge`)."""
    kind, sd = parse_knowledge(knowledge)
    if kind == "progress":
        return None
    log_len = np.log(np.maximum(np.asarray(lengths, np.int64), 1).astype(float))
    if kind == "prompt":
        if len(pid) != len(lengths):
            raise ValueError(f"knowledge 'prompt': {len(pid)} prompt ids for {len(lengths)} requests")
        _, inv = np.unique(np.asarray(pid), return_inverse=True)
        return (np.bincount(inv, weights=log_len) / np.bincount(inv))[inv]
    return log_len + rng.normal(0.0, sd, len(lengths)) if sd > 0 else log_len


def search(oracle, lengths: np.ndarray, placed: dict, grid: dict = GRID, progress=None,
           score: np.ndarray | None = None) -> list[LaneRun]:
    """Every plan of :func:`plans` run on the engine, fastest first (a run that did not finish every request
    is an error: the search must conserve requests); ``score``: as :func:`run_plan`'s."""
    out = []
    for plan in plans(oracle, len(placed), grid):
        r = run_plan(oracle, plan, lengths, placed, score=score)
        if r.finished != len(lengths):
            raise RuntimeError(f"{plan}: {r.finished} of {len(lengths)} requests finished")
        out.append(r)
        if progress:
            progress()
    return sorted(out, key=lambda r: r.makespan_s)


def as_json(r: LaneRun) -> dict:
    return {**asdict(r.plan), "makespan_s": r.makespan_s, "moved": r.moved}
