"""Predicted remaining makespan of a generator server under a layout (pure): what the planner compares across
layouts and what the balancer's load index is.

A replica's remaining decode time, given each request's current KV footprint ``ctx0`` (prompt + generated)
and its forecast remaining tokens ``rem``: requests run with continuous batching, at most ``slots`` at once
(``max_num_seqs``, and no more than the replica's KV cache holds: all of them if they fit at once, else as
many slots as hold a slot's time-averaged footprint, :func:`kv_slots`); when there
are more, the waiting ones take the slots as earlier ones finish (greedy list scheduling in decode-step
units, as the engine's FIFO queue does). Every decode step costs the cost model's step time for its batch and
total context. Between start/finish events the batch is constant and the total context grows linearly, so
the sum over steps is evaluated per segment (exact in the batch, context at the segment midpoint), as RLSim's
``replica_decode_s`` does; prefills of waiting requests are added once.

Requests are dealt to the replicas of a layout the way the engine deals them (running requests keep their
replica in the current layout; after a switch, the engine's own rule: :func:`engine_deal`), so a candidate
layout is never predicted with a better placement than it would get.

**Cost on the decision path** (``orchestrrl bench planner``: 1,024 requests on 4 servers, 4 layouts, a few
ms a tick on 2 cores). No approximation is made for speed: every number is the one the plain computation
gives, to the bit (tests/unit/test_orchestrator_pinned.py pins them against the implementation before these
changes). What makes it fast:

- one grouped pass (:meth:`Estimator._grouped`) for many replicas at once: every layout and server of a
  planning pass (:meth:`Estimator.servers_s_many`), the lookahead's servers (:meth:`Estimator.advance_many`),
  the balancer's candidate moves (every variant of a replica is a group). With whole token counts (the
  contexts; remaining lengths are rounded up) every key and cumulative context in the pass is an exact
  integer below 2^53, so a replica's result does not depend on what shares its pass (with fractional
  contexts it would to the last bits only);
- the decode step times through :class:`DecodeTable` (the context-free terms of the cost model tabulated per
  batch size; checked against the cost model when built, which is called directly when any number differs),
  every TP degree's in one call of a pass over several (:class:`DecodeStack`);
- memoised prefills (a pure function of few distinct arguments) and per-server results under the current
  layout (:meth:`Estimator._recall`: by the load's content, the forecast object and the settings), so the
  balancer's load indices (with the stratified lengths they were computed on) and the lookahead's progress
  reuse the planner's pass; the deals after a switch by what they read (:meth:`Estimator._blocks_of`), so
  the planner's judgement over other draws of the long requests reuses its pass's deals;
- the pass's sorts as numpy's SIMD quicksort or 16-bit radix sort with the stable sort's order
  (:func:`stable_argsort`, :func:`lexsort_by_group`), and the KV peak only for replicas whose requests do not
  all fit the cache at once (:func:`kv_slots`);
- :func:`engine_deal` by comparisons (two or four replicas) or on a heap instead of an argmin per request; the
  list scheduling of queued requests on a heap of Python floats; the lookahead's progress and the balancer's
  comparison of candidate moves vectorised;
- where numba is installed (the ``fast`` extra), the schedules and their segments, the segments' step times,
  every deal of a pass, the stratified levels and the lookahead's progress compiled
  (testbed/orchestrator/schedule_kernel.py: the same arithmetic on the same values, so the same numbers; the
  numpy forms above run without it).

What the last five gave (with the balancer's and the forecast's share of issue 33): docs/orchestrator.md,
"Decision time".
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

import numpy as np

from agents.engine import Layout
from emulation.orchestration import EngineSettings
from testbed.orchestrator import schedule_kernel


@dataclass(frozen=True)
class ServerLoad:
    """What a server holds, as the orchestrator sees it (targets unknown): per request its KV footprint now,
    its expected remaining tokens, whether it is running (has its KV) and the replica it is on; with a
    forecast, also its generated tokens and a fixed key in (0, 1) (see :meth:`Estimator.replica_times`);
    ``rid``: the request ids, the order in which the engine re-deals running requests after a layout switch
    (:func:`engine_deal`; None: the given order)."""

    ctx0: np.ndarray
    rem: np.ndarray
    running: np.ndarray
    replica: np.ndarray
    gen: np.ndarray | None = None
    key: np.ndarray | None = None
    shift: np.ndarray | None = None  # per request, the log-offset of its length its prompt group shows (None, or
    # NaN for a request: none shown, the forecast's own law)
    rid: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.rem)

    @property
    def kv_held(self) -> float:
        """Tokens of KV the running requests hold (what a layout switch moves)."""
        return float(np.sum(self.ctx0[self.running])) if self.n else 0.0

    def _pick(self, keep) -> "ServerLoad":
        pick = (lambda a: None if a is None else a[keep])
        return ServerLoad(self.ctx0[keep], self.rem[keep], self.running[keep], self.replica[keep],
                          pick(self.gen), pick(self.key), pick(self.shift), pick(self.rid))

    def without(self, i: int) -> "ServerLoad":
        keep = np.ones(self.n, bool)
        keep[i] = False
        return self._pick(keep)

    def plus_from(self, other: "ServerLoad", i: int, replica: int = -1) -> "ServerLoad":
        """This load with request ``i`` of ``other`` added (on ``replica``; -1: where the engine puts it)."""
        cat = (lambda a, b: None if a is None or b is None else np.r_[a, b[i]])
        shift = None if self.shift is None and other.shift is None else np.r_[
            self.shift if self.shift is not None else np.full(self.n, np.nan),
            other.shift[i] if other.shift is not None else np.nan]
        return ServerLoad(np.r_[self.ctx0, other.ctx0[i]], np.r_[self.rem, other.rem[i]],
                          np.r_[self.running, other.running[i]], np.r_[self.replica, replica],
                          cat(self.gen, other.gen), cat(self.key, other.key), shift, cat(self.rid, other.rid))


def engine_deal(load: ServerLoad, r: int, slots: int, kv_blocks: float = math.inf,
                block_size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(replica of every request, whether it runs) after a layout switch to ``r`` replicas, as
    agents.engine's ``_deal_after_switch`` does it: the running requests, by request id (``load.rid``; without
    ids, in the given order), each keep their KV on the replica holding the fewest KV blocks (of
    ``block_size`` tokens; ``ceil((ctx + 1) / block_size)`` a request) that has a slot left (of ``slots``)
    and room for it (of ``kv_blocks``); one that fits nowhere waits and will recompute, queued on the replica
    with the fewest requests (running and queued), as the waiting ones are after them. The engine cannot see
    remaining lengths, so neither does this deal. Ties go to the lowest replica. The replicas are alike, so
    the one holding the fewest blocks among those with a slot has the most room: if a request does not fit
    there it fits nowhere, and a heap of (blocks held, replica) gives the engine's picks. Where no replica
    can fill up (fewer running requests than ``slots``) the deal is made without the cache first (two or four
    replicas by comparisons, ~2.5x faster than the heap) and kept if no replica ends above its cache (then
    none was above it when it took a request, so none was turned away); otherwise it is made again with it.
    Where numba is installed the deal is compiled (schedule_kernel.deal_many, several deals in one call:
    :func:`engine_deal_many`; the same picks, the heap's smallest (blocks held, replica) found by a scan of the
    replicas)."""
    rep = np.zeros(load.n, np.int64)
    running = np.asarray(load.running, bool).copy()
    if load.n == 0:
        return rep, running
    run, need = _deal_order(load, block_size)
    if r == 1 and len(run) < slots and float(need.sum()) <= kv_blocks:  # whole numbers: an exact sum
        return rep, running  # one replica, not filled, its cache holding every running request: all stay
    if schedule_kernel.deal_many is not None and bool(np.isfinite(need).all()):  # compiled: the same picks
        return _deal_compiled([(load, r, slots, kv_blocks, block_size)])[0]
    count = [0] * r
    queued = [0] * r
    picks = None
    rest = run[:0]  # running requests left to wait once every replica's slots are taken
    if len(run) < slots:  # no replica can fill up: each onto the replica holding the fewest blocks
        cs = need.tolist()
        if r in (2, 4):
            picks, held = _least_held_2(cs) if r == 2 else _least_held_4(cs)
            if not all(map(math.isfinite, held)):  # a footprint not finite (it is in a sum): the heap's comparisons
                picks = None
        if picks is None:
            room = [(0.0, j) for j in range(r)]
            picks = []
            for c in cs:
                kv, j = room[0]
                heapq.heapreplace(room, (kv + c, j))
                picks.append(j)
            held = [kv for kv, _ in sorted(room, key=lambda x: x[1])]
        # every pick went to the replica holding the fewest blocks, so if no replica ends above the cache none
        # was over it when it took a request: no request was turned away, and these are the engine's picks
        # (``held``: each replica's blocks, summed in the order bincount(picks, weights=need) sums them)
        if not all(h <= kv_blocks for h in held):  # (a NaN fails too)
            picks = None
    if picks is not None:
        rep[run] = picks
        if len(run) < load.n:  # the waiting ones are dealt by the counts
            count = np.bincount(np.asarray(picks, np.int64), minlength=r).tolist()
    else:
        room = [(0.0, j) for j in range(r)]  # replicas with a slot left, by (blocks held, replica)
        order = run.tolist()
        full = len(order)  # from here on every replica's slots are taken
        for q, (i, c) in enumerate(zip(order, need.tolist())):
            if not room:
                full = q
                break
            if room[0][0] + c <= kv_blocks:
                kv, j = room[0]
                count[j] += 1
                if count[j] < slots:
                    heapq.heapreplace(room, (kv + c, j))
                else:
                    heapq.heappop(room)
            else:  # no room for its KV anywhere: it waits (its KV dropped), on the replica with the fewest
                held = [a + b for a, b in zip(count, queued)]
                j = held.index(min(held))  # (the lowest of equals)
                queued[j] += 1
                running[i] = False
            rep[i] = j
        rest = run[full:]  # no slot left anywhere: the rest all wait, before the waiting ones
        running[rest] = False
    return _deal_waiting(load, rep, running, run, rest, np.asarray(count) + np.asarray(queued))


def engine_deal_many(items: list) -> list:
    """:func:`engine_deal` of every (load, replicas, slots, kv_blocks, block_size) of ``items``: the deals the
    compiled kernel can make (numba installed, finite footprints) in one call of it (schedule_kernel.deal_many:
    the same picks), the others one by one."""
    if schedule_kernel.deal_many is None:
        return [engine_deal(*it) for it in items]
    needs = [_deal_order(ld, bs)[1] for ld, _, _, _, bs in items]
    if not needs or bool(np.isfinite(np.concatenate(needs)).all()):
        return _deal_compiled(items) if items else []
    ok = [bool(np.isfinite(x).all()) for x in needs]
    out = [None if k else engine_deal(*it) for it, k in zip(items, ok)]
    batch = [k for k, fine in enumerate(ok) if fine]
    for k, res in zip(batch, _deal_compiled([items[k] for k in batch]) if batch else ()):
        out[k] = res
    return out


def _deal_compiled(items: list) -> list:
    """engine_deal of ``items`` (as :func:`engine_deal_many`'s, every footprint finite) by the compiled kernel."""
    runs, needs, flags, n_off, run_off = [], [], [], [0], [0]
    for load, r, slots, kv, bs in items:
        run, need = _deal_order(load, bs)
        runs.append(run)
        needs.append(need)
        flags.append(np.asarray(load.running, bool))
        n_off.append(n_off[-1] + load.n)
        run_off.append(run_off[-1] + len(run))
    cat = (lambda xs: xs[0] if len(xs) == 1 else np.concatenate(xs))  # noqa: E731
    rep, running = schedule_kernel.deal_many(
        np.asarray(cat(needs), np.float64), np.asarray(cat(runs), np.int64), np.array(run_off, np.int64),
        np.array(n_off, np.int64), cat(flags), np.array([it[1] for it in items], np.int64),
        np.array([it[2] for it in items], np.int64), np.array([float(it[3]) for it in items]))
    return [(rep[a:b], running[a:b]) for a, b in zip(n_off[:-1], n_off[1:])]


def _deal_waiting(load: ServerLoad, rep: np.ndarray, running: np.ndarray, run: np.ndarray, rest: np.ndarray,
                  held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`engine_deal`'s end: the running requests left once every slot was taken (``rest``), then the
    waiting ones, each onto the replica with the fewest requests (``held`` each after the running ones' deal)."""
    wait = np.nonzero(~np.asarray(load.running, bool))[0] if len(run) < load.n else rest[:0]
    wait = np.concatenate([rest, wait]) if len(rest) else wait
    if len(wait):
        rep[wait] = _fewest_first(held, len(wait))
    return rep, running


def _fewest_first(held: np.ndarray, w: int) -> np.ndarray:
    """The replicas of ``w`` requests dealt one by one onto the replica with the fewest requests (``held``
    each, the lowest of equals): the ``w`` smallest (level, replica) pairs above each replica's count, in
    that order."""
    r = len(held)
    levels = held[:, None] + np.arange(w)[None, :]
    keys = np.sort((levels * r + np.arange(r)[:, None]).ravel())[:w]
    return keys % r


def _deal_order(load: ServerLoad, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(the running requests in the order :func:`engine_deal` deals them, their KV blocks): the same for every
    layout a load is dealt onto, so made once per load (kept on it: a ServerLoad's arrays are not changed)."""
    hit = load.__dict__.get("_deal_order")
    if hit is not None and hit[0] == block_size:
        return hit[1], hit[2]
    run = np.nonzero(np.asarray(load.running, bool))[0]
    if load.rid is not None and len(run) > 1:
        run = run[np.argsort(load.rid[run], kind="stable")]
    need = np.ceil((np.asarray(load.ctx0, float)[run] + 1.0) / block_size)
    object.__setattr__(load, "_deal_order", (block_size, run, need))
    return run, need


def _least_held_2(ctx: list) -> tuple[list, list]:
    """Each of ``ctx`` (in order) onto the replica of two holding the least (the first of equals), as
    engine_deal's heap of (KV held, replica) picks: (the picks, what each replica holds at the end)."""
    a = b = 0.0
    picks = []
    for c in ctx:
        if a <= b:
            a += c
            picks.append(0)
        else:
            b += c
            picks.append(1)
    return picks, [a, b]


def _least_held_4(ctx: list) -> tuple[list, list]:
    """:func:`_least_held_2` for four replicas: the lesser of each pair (the first of equals), then the
    lesser of the two (the lower replica of equals)."""
    k0 = k1 = k2 = k3 = 0.0
    picks = []
    for c in ctx:
        if k0 <= k1:
            if k2 <= k3:
                if k0 <= k2:
                    k0 += c
                    picks.append(0)
                else:
                    k2 += c
                    picks.append(2)
            elif k0 <= k3:
                k0 += c
                picks.append(0)
            else:
                k3 += c
                picks.append(3)
        elif k2 <= k3:
            if k1 <= k2:
                k1 += c
                picks.append(1)
            else:
                k2 += c
                picks.append(2)
        elif k1 <= k3:
            k1 += c
            picks.append(1)
        else:
            k3 += c
            picks.append(3)
    return picks, [k0, k1, k2, k3]


class DecodeTable:
    """``cm.decode_step_s_array(batch, ctx, tp)`` for whole batch sizes up to ``max_batch`` at a quarter of its
    cost: a decode step is a sum of per-operator terms (agents.costmodel: ``_decode_terms``) of which only the
    attention's depends on the context, so every other term is tabulated per batch size once, and a call
    evaluates the attention term and adds the tabulated ones in the cost model's own order (the same
    floating-point operations on the same values: the same numbers, to the bit). :meth:`build` checks that
    against the cost model on a grid of batch sizes and contexts (both sides of the memory/compute bound) and
    returns None (the cost model is then called directly) when any number differs or the cost model is not
    agents.costmodel.CostModel's kind.

    With an engine profile (``cm.engine``) the step is the kernels' sum with the engine's terms on it
    (``cm.engine_step_s``: the GPU side, no less than the eager launches where the step runs eagerly, and the
    engine's CPU time, overlapped or in series). Of a decode step, the CPU time (``cpu_s`` of the batch) and
    whether it runs eagerly by its tokens (the batch against the graph cap) depend on the batch alone, so they
    are tabulated per batch size as well (:class:`_EngineRows`; a context limit on graphs, vLLM V0's, is the
    one term evaluated per call): the same operations as ``engine_step_s`` on the same values. That makes the
    tables of several TP degrees stackable (:class:`DecodeStack`) as the kernels-only ones are. The grid check
    covers these terms too; a profile whose terms it does not reproduce keeps ``cm.engine_step_s`` itself on
    the kernels' sum (``engine_step``: not stacked), and if that fails too the cost model is called directly."""

    def __init__(self, pre, post, read_b, kv_write_s, kv_gpu, flops_per_ctx, hbm, peak, floor, layers,
                 engine_step=None, engine_rows=None):
        self.pre, self.post, self.read_b, self.kv_write_s = pre, post, read_b, kv_write_s
        self.kv_gpu, self.flops_per_ctx, self.hbm, self.peak, self.floor, self.layers = \
            kv_gpu, flops_per_ctx, hbm, peak, floor, layers
        self.engine_step = engine_step  # the engine's terms on the kernels' sum (cm.engine_step_s), or None
        self.engine_rows = engine_rows  # the same terms tabulated per batch size (_EngineRows), or None

    @classmethod
    def build(cls, cm, tp: int, max_batch: int) -> "DecodeTable | None":
        try:
            from agents.costmodel import _ARRAY

            lay = cm._layout(tp, 1)
            m, dt = cm.model, cm.dtype_bytes
            b = np.arange(1, max_batch + 1, dtype=float)
            terms = cm._decode_terms(b, np.zeros(max_batch), lay, _ARRAY)
            names = list(terms)
            at = names.index("attention")
            rows = np.zeros((len(names), max_batch + 1))
            for k, name in enumerate(names):
                rows[k, 1:] = terms[name]
            pre = rows[0]
            for k in range(1, at):  # the terms before the attention's, summed as sum() does
                pre = pre + rows[k]
            kv_gpu = 2.0 * lay.kvr * m.head_dim * dt
            read_b = np.zeros(max_batch + 1)
            read_b[1:] = 2.0 * b * lay.qr * m.head_dim * dt
            kv_write_s = np.zeros(max_batch + 1)
            kv_write_s[1:] = cm._elementwise(b * kv_gpu, cm.calib.rope)
            kernels = (pre, np.ascontiguousarray(rows[at + 1:]), read_b, kv_write_s, kv_gpu, (lay.qr, m.head_dim),
                       cm.gpu.hbm_bytes_per_s * cm.eff.decode_hbm, cm.gpu.peak_flops * cm.eff.decode_mfu,
                       cm.calib.gemm.floor_us * 1e-6, m.layers)
            tries = [cls(*kernels)]
            if cm.engine is not None:
                def engine_step(gpu, batch, ctx):
                    return cm.engine_step_s(gpu, batch, ctx, batch, 0.0, tp, _ARRAY)
                # the tabulated terms first (stackable), else the cost model's own engine step on the table
                tries = [cls(*kernels, engine_rows=_EngineRows.build(cm, tp, b)), cls(*kernels, engine_step)]
            # the check: every batch size, contexts from empty to far past the memory/compute crossover (and
            # past a graph context limit's: a batch's mean context from 0 to 131,072)
            bb = np.repeat(b, 8)
            ctx = bb * np.tile([0.0, 1.0, 37.0, 256.0, 1500.0, 4096.0, 20000.0, 131072.0], max_batch)
            ctx[1::5] += 3.0
            want = cm.decode_step_s_array(bb, ctx, tp)
            for tab in tries:
                if np.array_equal(tab(bb, ctx), want):
                    return tab
            return None
        except Exception:  # noqa: BLE001 - another kind of cost model: it is called directly
            return None

    def covers(self, batch: np.ndarray, ctx: np.ndarray) -> bool:
        return bool(batch.max() < len(self.pre) and batch.min() >= 1 and np.isfinite(ctx).all()
                    and (batch == np.floor(batch)).all())

    def __call__(self, batch: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        bi = batch.astype(np.int64)
        qr, hd = self.flops_per_ctx
        read = ctx * self.kv_gpu + self.read_b[bi]
        flops = 4.0 * ctx * qr * hd
        out = self.pre[bi] + self.layers * (self.floor + np.maximum(read / self.hbm, flops / self.peak)
                                           + self.kv_write_s[bi])
        for row in np.take(self.post, bi, axis=1):  # (take: twice as fast as the fancy index post[:, bi])
            out = out + row
        if self.engine_rows is not None:
            out = self.engine_rows(out, bi, batch, ctx)
        elif self.engine_step is not None:
            out = self.engine_step(out, batch, ctx)
        return out


class _EngineRows:
    """The engine's terms of a decode step (``cm.engine_step_s(gpu, batch, ctx, batch, 0.0, tp)``) tabulated per
    batch size for one TP degree: its CPU time ``cpu[b]`` (``cpu_s(b, tp)``, elementwise: the same number as
    asked of the segment's batch) and whether its tokens (its batch) take it past the CUDA-graph cap
    (``eager[b]``); the context limit on graphs (vLLM V0's ``graph_max_context``) is evaluated per call, as the
    cost model does. Applied as ``engine_step_s`` applies them: ``max(gpu, launch)`` where eager, then ``+ cpu``
    (or ``max`` with it where the engine overlaps). :class:`DecodeTable`'s grid check is what vouches for it."""

    def __init__(self, cpu, eager, launch, ctx_limit, overlap):
        self.cpu, self.eager, self.launch, self.ctx_limit, self.overlap = cpu, eager, launch, ctx_limit, overlap
        self.any_eager = bool(eager.any()) or ctx_limit is not None  # else the GPU side is the kernels' sum

    @classmethod
    def build(cls, cm, tp: int, b: np.ndarray) -> "_EngineRows":
        e = cm.engine
        p = e.profile
        cpu = np.zeros(len(b) + 1)
        cpu[1:] = e.cpu_s(b, tp, 0.0)
        eager = np.zeros(len(b) + 1, bool)
        eager[1:] = b > e.graph_cap(tp)  # a decode step's tokens are its batch; it has no prefill chunk
        return cls(cpu, eager, cm.model.layers * p.eager_layer_us * 1e-6, p.graph_max_context or None, p.overlap)

    def key(self) -> tuple:
        """What every TP degree's rows must share to be stacked (their rows aside)."""
        return self.launch, self.ctx_limit, self.overlap

    def apply(self, gpu, cpu, eager, batch, ctx, any_eager: bool):
        """The step from the kernels' sum ``gpu`` and the batch's gathered ``cpu`` and ``eager`` rows."""
        if any_eager:
            if self.ctx_limit is not None:
                eager = eager | (ctx > self.ctx_limit * batch)
            gpu = np.where(eager, np.maximum(gpu, self.launch), gpu)
        return np.maximum(gpu, cpu) if self.overlap else gpu + cpu

    def __call__(self, gpu, bi, batch, ctx):
        return self.apply(gpu, self.cpu[bi], self.eager[bi] if self.any_eager else None, batch, ctx,
                          self.any_eager)


class DecodeStack:
    """Every TP degree's :class:`DecodeTable` in one, so a pass over several layouts (the planner's: every
    candidate of every server) evaluates all its segments in one call rather than one per TP degree (~0.1 ms
    less a pass on 2 cores): per segment the same operations on the same values as its own table's call,
    its table's rows and constants gathered by its TP degree. Built only where the tables differ in nothing
    but their rows and per-TP constants (the same shape, GPU and model constants, and the same engine terms
    but their rows: :class:`_EngineRows`, the CPU time differs with the TP degree; with an engine profile whose
    terms are not tabulated, not built)."""

    def __init__(self, tabs: dict):
        tps = sorted(tabs)
        first = tabs[tps[0]]
        self.width = len(first.pre)  # batch sizes 0..max_batch of every table
        self.ti = np.full(max(tps) + 1, -1, np.int64)  # TP degree -> its table's index
        self.ti[tps] = np.arange(len(tps))
        self.pre = np.concatenate([tabs[tp].pre for tp in tps])
        self.read_b = np.concatenate([tabs[tp].read_b for tp in tps])
        self.kv_write_s = np.concatenate([tabs[tp].kv_write_s for tp in tps])
        self.post = np.ascontiguousarray(np.concatenate([tabs[tp].post for tp in tps], axis=1))
        self.kv_gpu = np.array([tabs[tp].kv_gpu for tp in tps])
        # as floats (whole numbers: the same values in every product; one signature of the compiled call for
        # every model)
        self.qr = np.array([tabs[tp].flops_per_ctx[0] for tp in tps], np.float64)
        self.hd = np.array([tabs[tp].flops_per_ctx[1] for tp in tps], np.float64)
        self.hbm, self.peak, self.floor, self.layers = first.hbm, first.peak, first.floor, first.layers
        self.engine = first.engine_rows  # the engine's terms (its shared constants; the rows gathered below)
        if self.engine is not None:
            self.cpu = np.concatenate([tabs[tp].engine_rows.cpu for tp in tps])
            self.eager = np.concatenate([tabs[tp].engine_rows.eager for tp in tps])
            self.any_eager = any(tabs[tp].engine_rows.any_eager for tp in tps)

    @classmethod
    def build(cls, tabs: dict) -> "DecodeStack | None":
        tabs = {tp: t for tp, t in tabs.items() if t}
        if len(tabs) < 2:
            return None
        ts = list(tabs.values())
        rows = ts[0].engine_rows
        same = all(t.engine_step is None and t.post.shape == ts[0].post.shape and len(t.pre) == len(ts[0].pre)
                   and (t.hbm, t.peak, t.floor, t.layers) == (ts[0].hbm, ts[0].peak, ts[0].floor, ts[0].layers)
                   and (t.engine_rows is None) == (rows is None)
                   and (rows is None or t.engine_rows.key() == rows.key())
                   for t in ts)
        return cls(tabs) if same else None

    def covers(self, tp: np.ndarray, batch: np.ndarray, ctx: np.ndarray) -> bool:
        """Whether every segment's TP degree has a table and each table covers it (:meth:`DecodeTable.covers`)."""
        return bool(len(tp) and tp.max() < len(self.ti) and tp.min() >= 0 and (self.ti[tp] >= 0).all()
                    and batch.max() < self.width and batch.min() >= 1 and np.isfinite(ctx).all()
                    and (batch == np.floor(batch)).all())

    def times(self, tp: np.ndarray, batch: np.ndarray, ctx: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """``self(tp, batch, ctx) * steps``: each segment's time (compiled where numba is installed:
        schedule_kernel.stack_steps, the same operations on the same values)."""
        kernel = schedule_kernel.stack_steps
        if kernel is None:
            return self(tp, batch, ctx) * steps
        e = self.engine
        rows, eager = (np.zeros(1), np.zeros(1, bool)) if e is None else (self.cpu, self.eager)
        return kernel(self.ti[tp], batch, ctx, steps, self.width, self.pre, self.read_b, self.kv_write_s, self.post,
                      self.kv_gpu, self.qr, self.hd, float(self.hbm), float(self.peak), float(self.floor),
                      int(self.layers), e is not None, rows, eager, bool(e is not None and self.any_eager),
                      -1.0 if e is None or e.ctx_limit is None else float(e.ctx_limit),
                      0.0 if e is None else float(e.launch), bool(e is not None and e.overlap))

    def __call__(self, tp: np.ndarray, batch: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """:class:`DecodeTable`'s call of each segment's TP degree ``tp``, all segments at once."""
        ti = self.ti[tp]
        at = ti * self.width + batch.astype(np.int64)
        read = ctx * self.kv_gpu[ti] + self.read_b[at]
        flops = 4.0 * ctx * self.qr[ti] * self.hd[ti]
        out = self.pre[at] + self.layers * (self.floor + np.maximum(read / self.hbm, flops / self.peak)
                                            + self.kv_write_s[at])
        for row in np.take(self.post, at, axis=1):
            out = out + row
        if self.engine is not None:  # where a table has no eager step, where() changes none of its numbers
            out = self.engine.apply(out, self.cpu[at], self.eager[at] if self.any_eager else None, batch, ctx,
                                    self.any_eager)
        return out


def kv_slots(g: np.ndarray, c: np.ndarray, r: np.ndarray, cnt: np.ndarray, n_groups: int, kv) -> np.ndarray:
    """How many requests each replica runs at once as far as its KV cache (``kv`` tokens) allows, for
    requests of footprint ``c`` now and ``r`` tokens still to generate on replica ``g``. The engine admits a
    request while its *current* footprint fits and preempts the newest when the batch outgrows the cache
    (agents.engine.Replica), so two regimes bound it:

    * every request of the replica running at once never holds more than the cache (their peak,
      :func:`peak_kv`, at most ``kv``): none waits for KV, all ``cnt`` run (``max_num_seqs`` still caps them);
    * far beyond that, the slots turn over, each holding one request after another, and a slot's footprint
      averaged over time is ``sum(c r + r^2 / 2) / sum(r)`` (a request of ``r`` tokens occupies it ``r``
      steps, growing from ``c`` to ``c + r``): the cache holds ``kv`` over that many slots.

    Between them (peaks of 1 to ``1 + KV_BAND`` times the cache: a few requests preempted near the peak) the
    batch is interpolated linearly, so a prediction never jumps when a request's growth takes the peak past
    the cache (a jump of that kind made the planner switch a server mid-step on a 2x swing of one replica's
    predicted time). ``KV_BAND`` (0.25) is where ``testbed/benchmarks/bench_estimator.py`` (the estimate
    against the engine, 15 one-server cases, every layout) ranks the layouts best: worst regret 1.002, every
    error within 13%; 0.1 does as well on those cases, 0.5 errs by up to 19%.

    Bounding the batch by the cache over the requests' mean *final* footprint instead (what this did before)
    queued requests that all fit at once: the same benchmark's worst regret was 1.050 and its errors up to
    30%; on the default scenario at a median of 4,000 tokens and 128 requests per GPU the planner ranked TP8x1
    above TP4x2, which the engine runs ~4% faster, and lost 3.8% to the tuned static layout.

    The peak needs a sort; a replica whose requests' final footprints fit the cache all at once
    (``sum(c + r) <= kv``, no less than the peak) has its peak within the cache, so its ``a`` is 0 whatever the
    peak is, and only the other replicas' peaks are computed (with whole, non-negative token counts, as the
    estimator's are, every sum is exact, so a replica's peak is the one it gets alone)."""
    a = np.clip((_peak_beyond(g, c, r, n_groups, kv) / kv - 1.0) / KV_BAND, 0.0, 1.0)
    if not a.any():  # every replica runs all its requests (cnt x 1 + turnover x 0; a NaN ``a`` takes the formula)
        return cnt.astype(float)
    tavg = np.bincount(g, weights=c * r + r * r / 2.0, minlength=n_groups) / np.maximum(
        np.bincount(g, weights=r, minlength=n_groups), 1.0)
    turnover = np.minimum(cnt, np.floor(kv / np.maximum(1.0, tavg)))
    return np.floor(cnt * (1.0 - a) + turnover * a)


def _peak_beyond(g: np.ndarray, c: np.ndarray, r: np.ndarray, n_groups: int, kv) -> np.ndarray:
    """:func:`peak_kv` where it may exceed ``kv``; 0 for the replicas whose requests' final footprints all fit
    at once (their peak is within ``kv`` too: :func:`kv_slots` gives them the same batch either way)."""
    whole = (len(c) and float(c.min()) >= 0.0 and float(r.min()) >= 0.0
             and float(c.sum()) + float(r.sum()) + float(r.max()) * len(r) < 2.0 ** 52
             and np.array_equal(c, np.floor(c)) and np.array_equal(r, np.floor(r)))
    if not whole:
        return peak_kv(g, c, r, n_groups)
    beyond = np.bincount(g, weights=c + r, minlength=n_groups) > kv
    peak = np.zeros(n_groups)
    if beyond.any():
        m = beyond[g]
        peak[beyond] = peak_kv(g[m], c[m], r[m], n_groups)[beyond]
    return peak


KV_BAND = 0.25  # kv_slots: the peaks (as a share beyond the cache) over which the batch goes from all to turnover


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for whole-number keys, at a fraction of its cost: numpy's stable sort
    of 64-bit numbers is a merge sort, of 16-bit ones a radix sort, and its default sort a SIMD quicksort. Keys
    within 2^16 of each other are sorted as 16-bit numbers; others are made distinct by their position
    (``key x n + position``, exact in int64), so the default sort gives the stable order. Keys that are not
    whole numbers, or too far apart for that product, take the stable sort itself."""
    n = len(keys)
    if n < 2:
        return np.argsort(keys, kind="stable")
    lo, hi = keys.min(), keys.max()
    if not (math.isfinite(lo) and math.isfinite(hi) and (float(hi) - float(lo) + 1.0) * n < 2.0 ** 52):
        return np.argsort(keys, kind="stable")
    k = (keys - lo).astype(np.int64)
    if not np.array_equal(k, keys - lo):  # not whole numbers
        return np.argsort(keys, kind="stable")
    if hi - lo < 1 << 16:
        return np.argsort(k.astype(np.uint16), kind="stable")
    return np.argsort(k * n + np.arange(n))


def group_end_order(go: np.ndarray, end: np.ndarray, big: float, n_groups: int) -> np.ndarray:
    """``stable_argsort(go x big + end)`` for the estimator's schedules (replicas ``go`` below ``n_groups``; ends
    ``end``: whole numbers in [0, big), remaining lengths being rounded up): by replica, then end, then position.
    Where both fit 16 bits, two stable radix sorts give it (the ends', then the replicas' in that order: ~25 us
    less on a bench pass of 4,000 requests than the 64-bit keys' sort); otherwise :func:`stable_argsort`."""
    if big <= 1 << 16 and n_groups <= 1 << 16:
        by_end = np.argsort(end.astype(np.uint16), kind="stable")
        return by_end[np.argsort(go[by_end].astype(np.uint16), kind="stable")]
    return stable_argsort(go * big + end)


def lexsort_by_group(key: np.ndarray, group: np.ndarray) -> np.ndarray:
    """``np.lexsort((key, group))`` (by group, then key, then position) of distinct keys, at a fraction of its
    cost: the keys' SIMD quicksort (distinct keys: no ties to order), then :func:`stable_argsort` of the
    groups in that order (a radix sort for few groups). Equal or NaN keys take the lexsort itself."""
    by_key = np.argsort(key)
    ks = key[by_key]
    if len(ks) < 2 or np.isnan(ks[-1]) or bool((ks[1:] == ks[:-1]).any()):
        return np.lexsort((key, group))
    return by_key[stable_argsort(group[by_key])]


def peak_kv(g: np.ndarray, c: np.ndarray, r: np.ndarray, n_groups: int) -> np.ndarray:
    """Per replica: the most KV its requests would hold at once if every one of them ran from now on (the
    sum of the current footprints of those still running, at its largest: just before a request ends; with
    the requests by remaining length, longest first, that is ``sum(c) + r x count`` over each prefix).
    The order (``np.lexsort((-r, g))``) is one sort of ``g x (span + 1) - r`` when that is exact (whole
    remaining lengths, as the estimator's are: rounded up; :func:`stable_argsort`), and the maximum over each
    replica's run a ``reduceat``."""
    span = float(r.max() - r.min()) if len(r) else 0.0
    if (len(r) and float(np.abs(r).max()) < 2.0 ** 40 and n_groups * (span + 1.0) < 2.0 ** 52
            and np.array_equal(r, np.floor(r))):
        order = stable_argsort(g * (span + 1.0) - r)
    else:
        order = np.lexsort((-r, g))
    go, ro, co = g[order], r[order], c[order]
    start = np.searchsorted(go, np.arange(n_groups))
    cs_c = np.cumsum(co)
    pos = np.arange(len(ro))
    base_c = np.concatenate([[0.0], cs_c])[start[go]]
    u = (cs_c - base_c) + ro * (pos - start[go] + 1)
    peak = np.zeros(n_groups)
    held = np.nonzero(np.bincount(go, minlength=n_groups))[0]  # replicas with requests: one run each in ``go``
    if len(held):
        peak[held] = np.maximum(peak[held], np.maximum.reduceat(u, start[held]))
    return peak


class Estimator:
    """Makespan estimates on one model/GPU (``cm``: agents.costmodel.CostModel).

    ``forecast`` (a testbed.orchestrator.forecast.LengthForecast, given by the caller for each planning tick
    through :meth:`use_forecast`):
    a server's requests are then given remaining lengths stratified *within the server*: ranked by their
    fixed keys, the k-th of n gets the ((k + 0.5) / n)-quantile of its own conditional remaining length
    given what it has generated. Two layouts of a server are so compared on the same lengths, without the
    noise (and the optimism of taking the minimum of noisy estimates) a single random draw would bring.
    The levels are ranked per server, not per replica: ranked inside each of R replicas, a server's longest
    request would sit at the 1 - 0.5 / (n / R) quantile, so a many-replica layout was predicted with a
    shorter tail than a one-replica layout of the same requests (its tail spread over R short strata), and
    the planner switched large-TP servers to small TP on that bias (scenarios/dapo-32b.yaml: 729 switches
    and 0.93x the best static layout; ranked per server: no switch, 1.00x; bench_policies: see
    docs/orchestrator.md). Without a forecast, ``rem`` is used as given (exact lengths).
    """

    def __init__(self, cm, gpus: int, settings: EngineSettings = EngineSettings()):
        self.cm = cm
        self.gpus = gpus
        self.settings = settings
        self._kv: dict[Layout, float] = {}
        self._prefill: dict[tuple, float] = {}
        self._memo: dict[tuple, tuple] = {}
        self._deals: dict[tuple, tuple] = {}  # engine_deal's results by what they read (:meth:`_blocks_of`)
        self._dec: dict[int, object] = {}
        self._per_group: dict[tuple, tuple] = {}  # (layout, replicas) per block -> (KV, TP degree) per replica
        tp = 1
        while tp <= gpus:  # the decode tables and KV capacities of every TP degree, once here rather than in a tick
            if gpus % tp == 0:
                self._decode_table(tp)
                self.kv_tokens(Layout(tp))
            tp *= 2
        self._stack = DecodeStack.build(self._dec)  # all of them in one, for passes over several TP degrees
        self._floor: dict[int, float] = {}  # TP degree -> decode_floor_s (the planner makes its candidates' at start)
        # a load's stratified quantiles under the forecast in use (:meth:`_stratified_loads`), by the arrays they
        # read: (gen, key, shift, quantiles) by their ids, the arrays kept so an id is not reused while it is here;
        # emptied by every use_forecast (a tick's), and beyond 256 loads (a bench tick keeps ~30)
        self._strat: dict[tuple, tuple] = {}
        schedule_kernel.warm()  # the compiled passes where numba is installed, compiled now rather than in a tick
        self.calls = 0
        self._forecast = None

    @property
    def forecast(self):
        """The length forecast the estimates stratify on (None: ``rem`` as given)."""
        return self._forecast

    def use_forecast(self, forecast) -> None:
        """Estimate on ``forecast`` from now on (a LengthForecast; None: exact lengths, ``rem`` as given)."""
        self._strat.clear()  # what a tick kept (the quantiles of its loads) goes with it, whatever the forecast
        self._forecast = forecast

    def _prefill_s(self, n: int, mean_ctx: float, tp: int) -> float:
        """The cost model's prefill of ``n`` prompts of ``mean_ctx`` tokens (memoised: a pure function of its
        arguments, asked for the same few values by every replica with a queue)."""
        key = (n, mean_ctx, tp)
        t = self._prefill.get(key)
        if t is None:
            if len(self._prefill) >= 65536:
                self._prefill.clear()
            t = self._prefill[key] = self.cm.prefill_s(n, mean_ctx, tp)
        return t

    def _decode_s(self, batch: np.ndarray, ctx: np.ndarray, tp: int) -> np.ndarray:
        """The cost model's decode step times (``cm.decode_step_s_array``) for whole batch sizes, through a
        :class:`DecodeTable` when the cost model admits one (the same numbers, to the bit)."""
        tab = self._decode_table(tp)
        if tab and len(batch) and tab.covers(batch, ctx):
            return tab(batch, ctx)
        return self.cm.decode_step_s_array(batch, ctx, tp)

    def _decode_table(self, tp: int):
        tab = self._dec.get(tp)
        if tab is None:
            tab = self._dec[tp] = DecodeTable.build(self.cm, tp, self.settings.max_num_seqs) or False
        return tab

    def decode_floor_s(self, tp: int) -> float:
        """No decode step the estimates cost at ``tp`` is shorter than this: the least step time over the batches
        a replica runs (1..max_num_seqs) with no context. A step's time does not fall as its context grows (the
        attention's reads and flops grow with it, the eager launch of vLLM V0 past its capture limit only adds,
        the engine's CPU time does not read it); checked on contexts up to 10^7 tokens, and 0 (no bound) where a
        step there is shorter. Made once per TP degree (~1 ms)."""
        f = self._floor.get(tp)
        if f is None:
            b = np.arange(1, max(1, self.settings.max_num_seqs) + 1, dtype=float)
            f = float(self._decode_s(b, np.zeros(len(b)), tp).min())
            for c in (1e2, 1e4, 1e5, 1e6, 1e7):
                if not float(self._decode_s(b, np.full(len(b), c), tp).min()) >= f:
                    f = 0.0
            f = self._floor[tp] = max(f, 0.0) if math.isfinite(f) else 0.0
        return f

    def makespan_floor_s(self, layout: Layout, longest: float) -> float:
        """A lower bound of :meth:`servers_s_many`'s time for ``layout`` of a load whose longest request the estimate
        gives ``longest`` remaining tokens (the maximum of :meth:`estimated_rems`'s): that request's replica runs at
        least that many decode steps, none shorter than :meth:`decode_floor_s` (the other requests, the queue's
        prefills, a switch's cost and one in progress only add). Shaved by 1e-9 of itself, far beyond the
        rounding of the estimate's sums of a few thousand segment times."""
        return math.ceil(max(longest, 0.0)) * self.decode_floor_s(layout.tp) * (1.0 - 1e-9)

    def stratifiable(self, load: ServerLoad) -> bool:
        """Whether ``load`` is estimated on its stratified quantiles (a forecast, and its generated tokens and keys)
        rather than its ``rem``; a pass of several loads stratifies all of them or none (:meth:`_blocks`)."""
        return load.gen is not None and load.key is not None and self.forecast is not None

    def estimated_rems(self, loads: list) -> list:
        """The remaining tokens :meth:`servers_s_many` estimates each load of ``loads`` on when they are estimated
        together: every load's stratified quantiles where every one carries what stratifying needs (and there
        is a forecast), else each load's ``rem`` (as :meth:`_blocks` decides jointly), in one call of the
        forecast."""
        live = [ld for ld in loads if ld.n]
        if not live or not all(map(self.stratifiable, live)):
            return [ld.rem for ld in loads]
        flat = self._stratified_loads(live)
        out, e0 = [], 0
        for ld in loads:
            out.append(flat[e0:e0 + ld.n] if ld.n else ld.rem)
            e0 += ld.n
        return out

    def kv_tokens(self, layout: Layout) -> float:
        """KV-cache tokens one replica of ``layout`` holds (as the engine sizes it: agents.engine.ModelledCost)."""
        if layout not in self._kv:
            self._kv[layout] = self.cm.kv_capacity_tokens(layout.tp, reserve=1.0 - self.settings.gpu_memory_utilization,
                                                          ep=layout.ep)
        return self._kv[layout]

    def kv_blocks(self, layout: Layout) -> int:
        """KV blocks one replica of ``layout`` holds, as agents.engine.Engine counts them."""
        return int(self.kv_tokens(layout)) // self.settings.block_size

    def _grouped(self, layout, ctx0: np.ndarray, rem: np.ndarray, first: np.ndarray | None,
                 group: np.ndarray, n_groups: int) -> dict:
        """The predicted decode schedules of ``n_groups`` replicas at once (request i runs on replica
        ``group[i]``; ``layout``: the replicas' Layout, or (layout, replicas) per block of consecutive groups,
        in order): per request its start
        and end (decode steps), per segment its replica, steps and time, per replica its prefill time and
        total time. Every replica is computed as in :meth:`replica_s`; the replicas share the numpy passes
        (keys ``group x BIG + step`` keep them apart: in every cumulative count the requests of lower replicas
        appear on both sides and cancel). With whole token counts (contexts, and remaining lengths, which are
        rounded up) every key and every cumulative context is an exact integer below 2^53, so each replica's
        result is the one it gets alone, to the bit, whatever else shares the pass. Where numba is installed
        the schedules and their segments are made by one compiled pass per replica instead
        (schedule_kernel.segments, for the same reason the same numbers; None without numba: the numpy pass
        below), and the segments' times by DecodeStack.times."""
        self.calls += 1
        rem = np.ceil(np.maximum(np.asarray(rem, dtype=float), 0.0))
        ctx0 = np.asarray(ctx0, dtype=float)
        first = np.ones(len(rem), bool) if first is None else np.asarray(first, bool)
        group = np.asarray(group, dtype=np.int64)
        total = np.zeros(n_groups)
        out = {"start": np.full(len(rem), np.inf), "end": np.full(len(rem), -np.inf), "total": total,
               "prefill": np.zeros(n_groups), "seg_g": np.zeros(0, np.int64), "k0": np.zeros(0), "k1": np.zeros(0),
               "seg": np.zeros(0)}
        live = rem > 0
        if not live.any():
            return out
        idx = np.nonzero(live)[0]
        c, r, f, g = ctx0[idx], rem[idx], first[idx], group[idx]
        # per replica: slots (max_num_seqs, and what its KV cache holds: see :func:`kv_slots`)
        cnt = np.bincount(g, minlength=n_groups)
        if isinstance(layout, Layout):
            kv, tp_g = self.kv_tokens(layout), None
        else:  # (layout, replicas) per block: a pass's blocks recur tick after tick, their arrays made once
            key = tuple(layout)
            hit = self._per_group.get(key)
            if hit is None:
                if len(self._per_group) >= 256:
                    self._per_group.clear()
                hit = self._per_group[key] = (np.repeat([self.kv_tokens(lay) for lay, _ in layout], [n for _, n in layout]),
                                              np.repeat([lay.tp for lay, _ in layout], [n for _, n in layout]))
            kv, tp_g = hit
        bound = kv_slots(g, c, r, cnt, n_groups, kv)
        slots = np.maximum(1, np.minimum(self.settings.max_num_seqs, bound)).astype(np.int64)
        kernel = schedule_kernel.segments
        if kernel is not None:  # the compiled pass (schedule_kernel): the same schedule, to the bit
            start_o, end_o, g0k, k0r, k1r, b_ok, ctx_ok = kernel(c, r, f, g, n_groups, slots)
            c_ok, steps = np.maximum(ctx_ok, 0.0), k1r - k0r
        else:
            # order inside a replica: running requests first, then the queue, each in the given order
            order = stable_argsort(g * 2 + ~f)
            go = g[order]
            grp_start = np.searchsorted(go, np.arange(n_groups))
            ro = r[order]
            start_o = np.zeros(len(ro))
            for j in np.nonzero(cnt > slots)[0].tolist():  # queued requests take the slots as earlier ones end
                lo, hi, k = int(grp_start[j]), int(grp_start[j] + cnt[j]), int(slots[j])
                rs = ro[lo:hi].tolist()
                free = rs[:k]
                heapq.heapify(free)
                starts = []
                for x in rs[k:]:
                    s0 = free[0]
                    heapq.heapreplace(free, s0 + x)
                    starts.append(s0)
                start_o[lo + k:hi] = starts
            end_o = start_o + ro
            big = float(np.max(end_o)) + 1.0
            # in every replica the starts are non-decreasing in this order (running ones at 0, then the queue as
            # the slots free up), so ``skey`` is sorted already
            skey = go * big + start_o
            ekey = go * big + end_o
            e_order = group_end_order(go, end_o, big, n_groups)  # ``stable_argsort(ekey)``
            # the segments' bounds: every distinct start or end key, each with the number of starts and of ends at
            # or before it (what ``np.searchsorted(skey, k0, side="right")`` and the same in the sorted ends give),
            # from one merge of the two sorted runs
            both = np.concatenate([skey, ekey[e_order]])
            merged = np.argsort(both, kind="stable")  # two sorted runs: timsort merges them
            at = both[merged]
            last = np.flatnonzero(np.append(at[1:] != at[:-1], True))  # each distinct key's last entry
            n_le = np.cumsum(merged < len(skey))[last]  # the starts at or before each distinct key
            pts = at[last]
            k0, k1 = pts[:-1], pts[1:]
            g0 = np.floor(k0 / big).astype(np.int64)
            same = g0 == np.floor(k1 / big).astype(np.int64)
            n_started = n_le[:-1]
            n_ended = (last + 1 - n_le)[:-1]
            active = n_started - n_ended
            base = c[order] - start_o  # a request's context at step k is base + k while it runs
            cs_start = np.concatenate(([0.0], np.cumsum(base)))
            cs_end = np.concatenate(([0.0], np.cumsum(base[e_order])))
            mid = (k0 + k1) / 2.0 - g0 * big
            ctx = (cs_start[n_started] - cs_end[n_ended]) + active * mid
            okk = np.flatnonzero(same & (active > 0))  # the segments inside a replica with requests running
            g0k = g0[okk]
            b_ok, c_ok, steps = active[okk].astype(float), np.maximum(ctx[okk], 0.0), (k1 - k0)[okk]
        if tp_g is None:
            seg = self._decode_s(b_ok, c_ok, layout.tp) * steps
        else:  # one cost-model pass over every TP degree's segments, or one per TP degree
            seg_tp = tp_g[g0k]
            if self._stack is not None and self._stack.covers(seg_tp, b_ok, c_ok):
                seg = self._stack.times(seg_tp, b_ok, c_ok, steps)
            else:
                seg = np.zeros(len(b_ok))
                for tp in sorted({lay.tp for lay, _ in layout}):
                    sel = seg_tp == tp
                    if sel.any():
                        seg[sel] = self._decode_s(b_ok[sel], c_ok[sel], tp) * steps[sel]
        total += np.bincount(g0k, weights=seg, minlength=n_groups)
        waiting = ~f
        if waiting.any():  # the queue's prefills (recompute for preempted ones), once per replica
            nw = np.bincount(g[waiting], minlength=n_groups)
            sw = np.bincount(g[waiting], weights=c[waiting], minlength=n_groups)
            pre = out["prefill"]
            js = np.nonzero(nw)[0]
            tps = [layout.tp] * len(js) if tp_g is None else tp_g[js].tolist()
            keys = list(zip(nw[js].tolist(), (sw[js] / nw[js]).tolist(), tps))
            got = list(map(self._prefill.get, keys))  # _prefill_s's memo read directly (~1 us a replica less)
            if None in got:
                got = [self._prefill_s(*k) if t is None else t for k, t in zip(keys, got)]
            pre[js] = got
            total += pre
        if kernel is not None:
            out["start"][idx] = start_o
            out["end"][idx] = end_o
            out.update(seg_g=g0k, k0=k0r, k1=k1r, seg=seg)
        else:
            out["start"][idx[order]] = start_o
            out["end"][idx[order]] = end_o
            out.update(seg_g=g0k, k0=k0[okk] - g0k * big, k1=k1[okk] - g0k * big, seg=seg)
        return out

    def replica_s(self, layout: Layout, ctx0: np.ndarray, rem: np.ndarray, first: np.ndarray | None = None) -> float:
        """Remaining decode time of one replica. ``first``: requests that hold a slot now (running), which
        start at once; the others queue in the given order."""
        return float(self._grouped(layout, ctx0, rem, first, np.zeros(len(rem), np.int64), 1)["total"][0])

    def groups_s(self, layout, ctx0: np.ndarray, rem: np.ndarray, first: np.ndarray | None,
                 group: np.ndarray, n_groups: int) -> np.ndarray:
        """:meth:`replica_s` of many replicas (or variants of one) at once (``layout``: as :meth:`_grouped`)."""
        return self._grouped(layout, ctx0, rem, first, group, n_groups)["total"]

    def progress(self, layout: Layout, ctx0: np.ndarray, rem: np.ndarray, first: np.ndarray | None,
                 dt: float, group: np.ndarray | None = None, n_groups: int = 1) -> np.ndarray:
        """Tokens each request is predicted to produce in the next ``dt`` seconds on its replica."""
        group = np.zeros(len(rem), np.int64) if group is None else np.asarray(group, np.int64)
        return self._progress(self._grouped(layout, ctx0, rem, first, group, n_groups), rem, dt, group, n_groups)

    @staticmethod
    def _progress(sch: dict, rem: np.ndarray, dt: float, group: np.ndarray, n_groups: int) -> np.ndarray:
        """:meth:`progress` from a schedule: in every replica the step reached after ``dt`` (its prefill first),
        interpolated inside the segment that holds it; all replicas at once (each replica's running sum of
        segment times in a row of its own, so every sum is the one it has alone)."""
        k_at = Estimator._reached(sch, dt, n_groups)
        done = np.clip(np.floor(k_at[group]) - sch["start"], 0.0, None)
        return np.where(np.isfinite(sch["start"]), np.minimum(done, np.ceil(np.maximum(rem, 0.0))), 0.0)

    @staticmethod
    def _reached(sch: dict, dt: float, n_groups: int) -> np.ndarray:
        """The step every replica of schedule ``sch`` reaches after ``dt`` (:meth:`_progress`'s; compiled where
        numba is installed: schedule_kernel.reached, the same steps)."""
        sg = sch["seg_g"]
        if schedule_kernel.reached is not None:
            return schedule_kernel.reached(np.asarray(sg, np.int64), np.asarray(sch["seg"], np.float64),
                                           np.asarray(sch["k0"], np.float64), np.asarray(sch["k1"], np.float64),
                                           np.asarray(sch["prefill"], np.float64), float(dt), n_groups)
        k_at = np.zeros(n_groups)
        t = dt - sch["prefill"]
        nseg = np.bincount(sg, minlength=n_groups)
        live = (t > 0) & (nseg > 0)
        if live.any():
            first = np.searchsorted(sg, np.arange(n_groups))
            col = np.arange(len(sg)) - first[sg]
            cum = np.zeros((n_groups, int(nseg.max())))
            cum[sg, col] = sch["seg"]
            np.cumsum(cum, axis=1, out=cum)
            valid = np.arange(cum.shape[1])[None, :] < nseg[:, None]
            i = ((cum <= t[:, None]) & valid).sum(axis=1)  # searchsorted(cum, t, side="right") per replica
            rows = np.nonzero(live)[0]
            i, tr = i[rows], t[rows]
            last = i >= nseg[rows]
            at = first[rows] + np.minimum(i, nseg[rows] - 1)
            seg, k0, k1 = sch["seg"][at], sch["k0"][at], sch["k1"][at]
            before = np.where(i > 0, cum[rows, np.maximum(i - 1, 0)], 0.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                inside = np.where(seg > 0, k0 + (tr - before) / seg * (k1 - k0), k1)
            k_at[rows] = np.where(last, k1, inside)
        return k_at

    def placement(self, layout: Layout, load: ServerLoad, current: Layout | None = None) -> np.ndarray:
        """Replica of every request under ``layout``: where it is (current layout; an arrival, replica -1,
        goes to the replica with the least remaining work) or where the engine would put it after a switch
        (:meth:`dealt`)."""
        return self.dealt(layout, load, current)[0]

    def dealt(self, layout: Layout, load: ServerLoad, current: Layout | None = None, fresh: bool = False) -> tuple:
        """(:meth:`placement`, the load as the server would hold it there): under the current layout the load
        itself; after a switch, the running requests that find no slot or no room for their KV on the new
        replicas wait and recompute (:func:`engine_deal`), so a candidate layout is predicted on what the
        engine would run, not on more running requests than it has slots for. ``fresh``: ``load`` is new to the
        estimator and no later call deals it again (the planner's lookahead): its deal is neither looked up nor
        remembered (:meth:`_blocks_of`)."""
        _, dealt, rep = self._blocks_of([(layout, load, current)], fresh)[0]
        return rep, dealt

    def _as_placed(self, layout: Layout, load: ServerLoad, current: Layout | None) -> np.ndarray | None:
        """The placement of ``load`` under its current layout (:meth:`dealt`'s first case), or None where it is
        dealt (another layout, or a replica the layout does not have)."""
        if current is None or layout != current:
            return None
        r = layout.replicas(self.gpus)
        new = load.replica < 0
        if not bool((load.replica[~new] < r).all()):
            return None
        rep = load.replica.copy()
        if new.any():
            tot = np.bincount(rep[~new], weights=load.rem[~new], minlength=r)
            for i in np.nonzero(new)[0]:
                j = int(np.argmin(tot))
                rep[i] = j
                tot[j] += load.rem[i]
        return rep

    @staticmethod
    def _with_running(load: ServerLoad, running: np.ndarray) -> ServerLoad:
        """``load`` with the running flags a deal left it (itself where they are its own; else a copy whose other
        arrays are the load's: stratified once)."""
        if np.array_equal(running, load.running):
            return load
        return dataclasses.replace(load, running=running)

    def _blocks_of(self, items: list, fresh: bool = False) -> list:
        """The blocks of :meth:`_blocks` for every (layout, load, current) of ``items``: (layout, the load as dealt,
        its placement), as :meth:`dealt` gives them, the engine's deals that are not remembered made in one call
        (:func:`engine_deal_many`). Deals are remembered: a deal reads the requests' footprints, running flags
        and ids only, not their lengths, so a tick's re-estimates of one server under other draws of its long
        requests (the planner's judgement) find the planner's pass's deal. Remembered by content (those arrays
        byte for byte), layout and settings, as :meth:`_recall` does; a hit is returned as copies (a caller may
        change its placement). ``fresh``: dealt without the memo (loads no call has dealt and none will, the
        planner's lookahead: keying them, ~6 us a deal, and keeping them, which pushes the tick's own deals out,
        buy nothing)."""
        out = [None] * len(items)
        todo, keys = [], []
        for k, (layout, load, current) in enumerate(items):
            placed = self._as_placed(layout, load, current)
            if placed is not None:
                out[k] = (layout, load, placed)
                continue
            key = None if fresh else (layout, _content_key(load.ctx0, load.running, load.rid))
            hit = None if key is None else self._deals.get(key)
            if hit is not None and hit[0] is self.settings:
                out[k] = (layout, self._with_running(load, hit[2].copy()), hit[1].copy())
                continue
            todo.append(k)
            keys.append(key)
        if todo:
            deals = engine_deal_many([(items[k][1], items[k][0].replicas(self.gpus), self.settings.max_num_seqs,
                                       self.kv_blocks(items[k][0]), self.settings.block_size) for k in todo])
            for k, key, (rep, running) in zip(todo, keys, deals):
                if key is not None:
                    _put_bounded(self._deals, key, (self.settings, rep, running))
                    rep, running = rep.copy(), running.copy()
                out[k] = (items[k][0], self._with_running(items[k][1], running), rep)
        return out

    def replica_times(self, layout: Layout, load: ServerLoad, current: Layout | None = None,
                      rep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(replica of every request, remaining time of every replica) under ``layout``."""
        if rep is not None:
            return rep, self._blocks([(layout, load, rep)], joint=False)[0].times.copy()
        return self.replica_times_many([(layout, load, current)])[0]

    def replica_times_many(self, items: list, rem: bool = False) -> list:
        """:meth:`replica_times` of many (layout, load, current) at once: remembered results (see
        :meth:`_recall`) where there are, one grouped pass for the rest. ``rem``: each result also holds the
        remaining tokens its requests were given (with a forecast their :meth:`stratified` quantiles, else
        ``load.rem``), so a caller that needs both takes them from the same pass."""
        done = [self._recall(lay, load, cur) for lay, load, cur in items]
        todo = [k for k, (d, _) in enumerate(done) if d is None]
        if todo:
            blocks = self._blocks_of([items[k] for k in todo])
            for k, d in zip(todo, self._blocks(blocks, joint=False)):
                self._remember(done[k][1], d)
                done[k] = (d, None)
        return [(d.rep.copy(), d.times.copy()) + ((d.rem.copy(),) if rem else ()) for d, _ in done]

    def stratified(self, load: ServerLoad) -> np.ndarray:
        """Remaining tokens of every request of the server: with a forecast, the k-th of n (by key) gets the
        ((k + 0.5) / n)-quantile of its conditional remaining length; without one, ``load.rem``."""
        if not self.stratifiable(load):
            return load.rem
        return self._stratified_loads([load])

    def stratified_within(self, load: ServerLoad, group: np.ndarray) -> np.ndarray:
        """:meth:`stratified` with the quantiles dealt inside each group of ``group`` (e.g. a server's
        replicas) instead of across the server: groups of equal counts and equal knowledge get equal levels."""
        if not self.stratifiable(load):
            return load.rem
        group = np.asarray(group, np.int64)
        return self._stratified(load.gen, load.key, group, int(group.max()) + 1 if len(group) else 1, load.shift)

    def stratified_within_many(self, items: list) -> list:
        """:meth:`stratified_within` of every (load, group) of ``items``, the loads with a prompt shift in one call
        of the forecast and those without in another (the forecast is elementwise and every group is ranked on
        its own: the same numbers as load by load; a missing shift is not made a zero one, whose arithmetic
        differs in the last bits)."""
        out = [ld.rem for ld, _ in items]
        for shifted in (False, True):
            ks = [k for k, (ld, _) in enumerate(items) if self.stratifiable(ld) and (ld.shift is not None) == shifted]
            if not ks:
                continue
            groups, off = [], 0
            for k in ks:
                g = np.asarray(items[k][1], np.int64)
                groups.append(g + off)
                off += int(g.max()) + 1 if len(g) else 1
            lds = [items[k][0] for k in ks]
            flat = self._stratified(np.concatenate([ld.gen for ld in lds]), np.concatenate([ld.key for ld in lds]),
                                    np.concatenate(groups), off,
                                    np.concatenate([ld.shift for ld in lds]) if shifted else None)
            ends = np.cumsum([0] + [ld.n for ld in lds]).tolist()
            for q, k in enumerate(ks):
                out[k] = flat[ends[q]:ends[q + 1]]
        return out

    def _stratified(self, gen: np.ndarray, key: np.ndarray, group: np.ndarray, n_groups: int,
                    shift: np.ndarray | None = None) -> np.ndarray:
        kernel = schedule_kernel.levels
        if kernel is not None and not np.isnan(key).any():  # compiled: the same levels
            levels = kernel(np.asarray(key, np.float64), np.asarray(group, np.int64), n_groups)
        else:
            order = lexsort_by_group(key, group)
            g = group[order]
            first = np.searchsorted(g, np.arange(n_groups))
            cnt = np.bincount(g, minlength=n_groups)
            levels = np.empty(len(gen))
            levels[order] = (np.arange(len(gen)) - first[g] + 0.5) / cnt[g]
        return np.clip(np.ceil(self.forecast.remaining_quantile(gen, levels, shift)), 1.0, None)

    def _stratified_loads(self, loads: list) -> np.ndarray:
        """:meth:`stratified` of every load of ``loads``, concatenated: a load that stands in several blocks (one
        server under every candidate layout) is stratified once, all in one call of the forecast (which is
        elementwise: the same numbers as load by load). A load stratified before under the same forecast (the
        tick's own pass, then the judgement's and the held-back servers' re-deals of it, the balancer's load
        indices) is not stratified again (:attr:`_strat`: the values computed then). Always a new array."""
        ident = (lambda ld: (id(ld.gen), id(ld.key), id(ld.shift)))  # noqa: E731 - a load re-dealt shares them
        memo = self._strat
        part: dict[tuple, np.ndarray] = {}  # the arrays it reads -> the load's quantiles
        todo: list = []
        for ld in loads:
            k = ident(ld)
            if k in part:
                continue
            hit = memo.get(k)
            if hit is not None and hit[0] is ld.gen and hit[1] is ld.key and hit[2] is ld.shift:
                part[k] = hit[3]
            else:
                part[k] = None
                todo.append(ld)
        if todo:
            block = np.concatenate([np.full(ld.n, k, np.int64) for k, ld in enumerate(todo)])
            shifts = None if all(ld.shift is None for ld in todo) else np.concatenate(
                [ld.shift if ld.shift is not None else np.full(ld.n, np.nan) for ld in todo])
            flat = self._stratified(np.concatenate([ld.gen for ld in todo]),
                                    np.concatenate([ld.key for ld in todo]), block, len(todo), shifts)
            if len(memo) + len(todo) > 256:
                memo.clear()
            e0 = 0
            for ld in todo:
                part[ident(ld)] = q = flat[e0:e0 + ld.n]
                memo[ident(ld)] = (ld.gen, ld.key, ld.shift, q)
                e0 += ld.n
        return np.concatenate([part[ident(ld)] for ld in loads])

    def _blocks(self, blocks: list, joint: bool, store: tuple = ()) -> list:
        """Every (layout, load, rep) of ``blocks`` in one grouped pass: a :class:`_Done` per block (the remaining
        time of each of its replicas, the remaining tokens used, stratified as :meth:`stratified` does, and
        where its schedule lies in the pass's). The stratified quantiles are taken inside each server's load,
        so sharing the pass changes none of them. ``joint``: a forecast is used for all blocks or (when one
        load lacks what it needs) for none, as :meth:`servers_s` does; otherwise block by block, as
        :meth:`replica_times` does. ``store``: (block index, memo key) of the results to remember (those
        computed block by block's way only)."""
        reps = [lay.replicas(self.gpus) for lay, _, _ in blocks]
        offs = np.cumsum([0] + reps).tolist()
        n_groups = offs[-1]
        live = [(k, ld, rep) for k, (_, ld, rep) in enumerate(blocks) if ld.n]
        if not live:
            return [_Done(rep, np.zeros(r), np.zeros(0), None, 0, 0) for (_, _, rep), r in zip(blocks, reps)]
        loads = [ld for _, ld, _ in live]
        cat = lambda f: np.concatenate([f(ld) for ld in loads]) if len(loads) > 1 else f(loads[0])  # noqa: E731
        group = np.concatenate([np.asarray(rep, np.int64) for _, _, rep in live]) + np.repeat(
            [offs[k] for k, _, _ in live], [ld.n for _, ld, _ in live])
        ctx0, rem, running = cat(lambda ld: ld.ctx0), cat(lambda ld: ld.rem), cat(lambda ld: ld.running)
        able = [self.stratifiable(ld) for ld in loads]
        if all(able):
            rem = self._stratified_loads(loads)
            used = able
        elif any(able) and not joint:
            rem = rem.astype(float, copy=True)
            m = np.concatenate([np.full(ld.n, ok) for ld, ok in zip(loads, able)])
            rem[m] = self._stratified_loads([ld for ld, ok in zip(loads, able) if ok])
            used = able
        else:
            used = [False] * len(loads)
        lays = [lay for lay, _, _ in blocks]
        layout = lays[0] if all(lay == lays[0] for lay in lays) else list(zip(lays, reps))
        sch = self._grouped(layout, ctx0, rem, running, group, n_groups)
        tot = sch["total"]
        out = [_Done(rep, tot[offs[k]:offs[k + 1]], np.zeros(0), None, offs[k], 0)
               for k, (_, _, rep) in enumerate(blocks)]
        e0 = 0
        for (k, ld, _), u, ok in zip(live, used, able):
            d = out[k]
            d.rem, d.sch, d.e0 = rem[e0:e0 + ld.n], sch, e0
            d.exact = u == ok  # stratified as it would be alone
            e0 += ld.n
        for k, key in store:
            if out[k].exact:
                self._remember(key, out[k])
        return out

    # ---- remembered results -------------------------------------------------------------------------------
    @staticmethod
    def _fingerprint(load: ServerLoad) -> tuple:
        return _content_key(load.ctx0, load.rem, load.running, load.replica, load.gen, load.key, load.shift,
                            load.rid)

    def _recall(self, layout: Layout, load: ServerLoad, current: Layout | None) -> tuple:
        """(the remembered :class:`_Done` of ``load`` under ``layout``, or None; its memo key). Results are
        remembered by content (every array of the load, byte for byte), layout, whether ``layout`` is the
        current one (the placement depends on nothing else) and forecast (the object itself): a planning
        tick's servers under their current layouts are so computed once, by the planner's pass, and the
        lookahead and the balancer find them. A pure function's values: a hit is the result itself."""
        key = (layout, current is not None and layout == current, self._fingerprint(load))
        hit = self._memo.get(key)
        if hit is not None and hit[0] is self.forecast and hit[1] is self.settings:
            return hit[2], key
        return None, key

    def _remember(self, key: tuple, done: "_Done") -> None:
        if key is None:
            return
        _put_bounded(self._memo, key, (self.forecast, self.settings, done))

    def servers_s(self, layout: Layout, loads: dict, currents: dict) -> dict:
        """:meth:`server_s` of many servers under one ``layout`` at once (``loads[s]``, its ``currents[s]``)."""
        return self.servers_s_many([layout], loads, currents)[layout]

    def servers_s_many(self, layouts: list, loads: dict, currents: dict, skip: frozenset = frozenset(),
                       remember: bool = True, fresh: bool = False) -> dict:
        """:meth:`servers_s` under every layout of ``layouts`` at once: {layout: {server: time}}, in one grouped
        pass (one cost-model evaluation per TP degree). ``skip``: (layout, server) cells not to compute (their
        time is inf). ``remember``: the loads under their current layouts are remembered for later calls
        (:meth:`_recall`); False for loads no later call asks for (the planner's other draws), which are then
        not fingerprinted either. ``fresh``: the loads are new and none is asked for again (the planner's
        lookahead): nothing of them is looked up or remembered, their deals included (:meth:`dealt`)."""
        remember = remember and not fresh
        keys = [s for s in loads if loads[s].n]
        out = {lay: {s: (math.inf if (lay, s) in skip else 0.0) for s in loads} for lay in layouts}
        if not keys:
            return out
        cells = [(lay, s) for lay in layouts for s in keys if (lay, s) not in skip]
        store = tuple((k, self._recall(lay, loads[s], currents[s])[1]) for k, (lay, s) in enumerate(cells)
                      if remember and lay == currents[s])
        done = self._blocks(self._blocks_of([(lay, loads[s], currents[s]) for lay, s in cells], fresh), joint=True,
                            store=store)
        for (lay, s), d in zip(cells, done):
            out[lay][s] = float(d.times.max())
        return out

    def server_s(self, layout: Layout, load: ServerLoad, current: Layout | None = None) -> float:
        """Remaining makespan of a server holding ``load`` if it runs ``layout`` (max over its replicas)."""
        if load.n == 0:
            return 0.0
        return float(self.replica_times(layout, load, current)[1].max())

    def advance(self, layout: Layout, load: ServerLoad, dt: float) -> ServerLoad:
        """The load predicted ``dt`` seconds from now if the server keeps ``layout`` (its current one): every
        request's generated tokens move on, those predicted to finish leave. Used to ask "would it pay to
        wait before switching?"."""
        return self.advance_many([(layout, load)], dt)[0]

    def advance_many(self, items: list, dt: float, mean: bool = True) -> list:
        """:meth:`advance` of many (layout, load) at once: the remembered schedules of the loads under their
        current layouts where there are (the planner's pass made them), one grouped pass for the rest.
        ``mean``: every kept request's ``rem`` is its conditional mean under the forecast, as
        :func:`loads_from_snapshot` gives it; False: its ``rem`` less its progress, as without a forecast, the
        forecast not asked (~0.3 ms a bench tick) -- for a caller that estimates the loads with the forecast,
        whose stratified quantiles replace ``rem`` (the planner's lookahead)."""
        return self.advance_many_at(items, [dt], mean)[0]

    def advance_many_at(self, items: list, dts: list, mean: bool = True) -> list:
        """:meth:`advance_many` at every time of ``dts``: [the loads ``dt`` later, for each ``dt``], the
        schedules found or made once for all of them (the planner's lookahead at its several points)."""
        todo = [k for k, (_, ld) in enumerate(items) if ld.n and ld.gen is not None]
        if not todo:
            return [list(ld for _, ld in items) for _ in dts]
        done = [self._recall(items[k][0], items[k][1], items[k][0]) for k in todo]
        miss = [q for q, (d, _) in enumerate(done) if d is None]
        if miss:
            blocks = self._blocks_of([(items[todo[q]][0], items[todo[q]][1], items[todo[q]][0]) for q in miss])
            for q, d in zip(miss, self._blocks(blocks, joint=False)):
                self._remember(done[q][1], d)
                done[q] = (d, None)
        done = [d for d, _ in done]
        at = np.cumsum([0] + [len(d.rem) for d in done]).tolist()
        cond = mean and self.forecast is not None
        result = []
        for dt in dts:
            out = list(ld for _, ld in items)
            gained_all = self._progress_of(done, dt)
            keeps, gens = [], []
            for k, d in zip(todo, done):
                q = len(keeps)
                gained = gained_all[at[q]:at[q + 1]]
                keeps.append(gained < np.ceil(d.rem))
                gens.append((items[k][1].gen + gained)[keeps[-1]])
            if cond:
                sh = [None if items[k][1].shift is None else items[k][1].shift[kp] for k, kp in zip(todo, keeps)]
                shift = None if all(x is None for x in sh) else np.concatenate(
                    [x if x is not None else np.full(len(g), np.nan) for x, g in zip(sh, gens)])
                left = np.maximum(self.forecast.remaining(np.concatenate(gens), shift), 1.0)
                cut = np.cumsum([0] + [len(x) for x in gens]).tolist()
            for q, (k, d) in enumerate(zip(todo, done)):
                load = items[k][1]
                gained, keep = gained_all[at[q]:at[q + 1]], keeps[q]
                new_rem = left[cut[q]:cut[q + 1]] if cond else np.maximum(load.rem - gained, 1.0)[keep]
                out[k] = ServerLoad(ctx0=(load.ctx0 + gained)[keep], rem=new_rem,
                                    running=(load.running | (gained > 0))[keep], replica=d.rep[keep], gen=gens[q],
                                    key=load.key[keep], shift=None if load.shift is None else load.shift[keep],
                                    rid=None if load.rid is None else load.rid[keep])
            result.append(out)
        return result

    def _progress_of(self, done: list, dt: float) -> np.ndarray:
        """:meth:`progress` of the blocks ``done`` (each from its own pass's schedule), in one vectorised pass."""
        parts = {k: [] for k in ("seg_g", "seg", "k0", "k1", "prefill", "start")}
        rem, group, off = [], [], 0
        for d in done:
            r, n, sch = len(d.times), len(d.rem), d.sch
            sg = sch["seg_g"]
            lo, hi = np.searchsorted(sg, [d.g0, d.g0 + r]).tolist()
            parts["seg_g"].append(sg[lo:hi] - d.g0 + off)
            for f in ("seg", "k0", "k1"):
                parts[f].append(sch[f][lo:hi])
            parts["prefill"].append(sch["prefill"][d.g0:d.g0 + r])
            parts["start"].append(sch["start"][d.e0:d.e0 + n])
            rem.append(d.rem)
            group.append(np.asarray(d.rep, np.int64) + off)
            off += r
        sch = {k: np.concatenate(v) for k, v in parts.items()}
        return self._progress(sch, np.concatenate(rem), dt, np.concatenate(group), off)


MEMO_SIZE = 64  # remembered results (a tick's servers under their current layouts, and their lookahead)


def _content_key(*arrays) -> tuple:
    """What a remembered result is keyed by: each array's dtype, shape and bytes (None stays None)."""
    return tuple(None if a is None else (a.dtype.str, a.shape, a.tobytes()) for a in arrays)


def _put_bounded(store: dict, key, value):
    """``store[key] = value`` as the newest entry, the oldest dropped beyond MEMO_SIZE; returns ``value``."""
    store.pop(key, None)
    while len(store) >= MEMO_SIZE:
        store.pop(next(iter(store)))
    store[key] = value
    return value


@dataclass
class _Done:
    """One block of a grouped pass: its placement, the remaining time of each replica, the remaining tokens
    used per request, and the pass's schedule with the block's first replica and first request in it."""

    rep: np.ndarray
    times: np.ndarray
    rem: np.ndarray
    sch: dict | None
    g0: int
    e0: int
    exact: bool = True
