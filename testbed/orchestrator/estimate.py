"""Predicted remaining makespan of a generator server under a layout (pure): what the planner compares across
layouts and what the balancer's load index is.

A replica's remaining decode time, given each request's current KV footprint ``ctx0`` (prompt + generated)
and its forecast remaining tokens ``rem``: requests run with continuous batching, at most ``slots`` at once
(``max_num_seqs``, and no more than the replica's KV cache holds at their mean final footprint); when there
are more, the waiting ones take the slots as earlier ones finish (greedy list scheduling in decode-step
units, as the engine's FIFO queue does). Every decode step costs the cost model's step time for its batch and
total context. Between start/finish events the batch is constant and the total context grows linearly, so
the sum over steps is evaluated per segment (exact in the batch, context at the segment midpoint), as RLSim's
``replica_decode_s`` does; prefills of waiting requests are added once.

Requests are dealt to the replicas of a layout the way the engine deals them (running requests keep their
replica in the current layout; after a switch, the engine's own rule: :func:`engine_deal`), so a candidate
layout is never predicted with a better placement than it would get.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from agents.engine import EngineSettings, Layout


@dataclass(frozen=True)
class ServerLoad:
    """What a server holds, as the orchestrator sees it (targets unknown): per request its KV footprint now,
    its expected remaining tokens, whether it is running (has its KV) and the replica it is on; with a
    forecast, also its generated tokens and a fixed key in (0, 1) (see :meth:`Estimator.replica_times`)."""

    ctx0: np.ndarray
    rem: np.ndarray
    running: np.ndarray
    replica: np.ndarray
    gen: np.ndarray | None = None
    key: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.rem)

    def _pick(self, keep) -> "ServerLoad":
        return ServerLoad(self.ctx0[keep], self.rem[keep], self.running[keep], self.replica[keep],
                          None if self.gen is None else self.gen[keep], None if self.key is None else self.key[keep])

    def without(self, i: int) -> "ServerLoad":
        keep = np.ones(self.n, bool)
        keep[i] = False
        return self._pick(keep)

    def plus_from(self, other: "ServerLoad", i: int, replica: int = -1) -> "ServerLoad":
        """This load with request ``i`` of ``other`` added (on ``replica``; -1: where the engine puts it)."""
        cat = (lambda a, b: None if a is None or b is None else np.r_[a, b[i]])
        return ServerLoad(np.r_[self.ctx0, other.ctx0[i]], np.r_[self.rem, other.rem[i]],
                          np.r_[self.running, other.running[i]], np.r_[self.replica, replica],
                          cat(self.gen, other.gen), cat(self.key, other.key))


def engine_deal(load: ServerLoad, r: int, slots: int) -> np.ndarray:
    """Replicas of a server's requests after a layout switch, as agents.engine.Engine does it: running
    requests (in their given order) each onto the replica with the least KV held that has a slot left (of
    ``slots``); the rest, and the waiting ones, onto the replica with the fewest requests. The engine cannot
    see remaining lengths, so neither does this deal."""
    rep = np.empty(load.n, np.int64)
    kv = np.zeros(r)
    count = np.zeros(r, np.int64)
    run = np.nonzero(load.running)[0]
    for i in run:
        room = count < slots
        j = int(np.argmin(np.where(room, kv, np.inf))) if room.any() else int(np.argmin(count))
        rep[i] = j
        kv[j] += load.ctx0[i]
        count[j] += 1
    for i in np.nonzero(~load.running)[0]:
        j = int(np.argmin(count))
        rep[i] = j
        count[j] += 1
    return rep


class Estimator:
    """Makespan estimates on one model/GPU (``cm``: agents.costmodel.CostModel).

    ``forecast`` (a testbed.orchestrator.forecast.LengthForecast, set by the caller for each planning tick):
    a replica's requests are then given remaining lengths stratified *within the replica*: ranked by their
    fixed keys, the k-th of n gets the ((k + 0.5) / n)-quantile of its own conditional remaining length
    given what it has generated. Each replica so holds its fair share of the tail, whatever the grouping, and
    two layouts are compared without the noise (and the optimism of taking the minimum of noisy estimates) a
    single random draw of lengths would bring. Without a forecast, ``rem`` is used as given (exact lengths).
    """

    def __init__(self, cm, gpus: int, settings: EngineSettings = EngineSettings()):
        self.cm = cm
        self.gpus = gpus
        self.settings = settings
        self._kv: dict[Layout, float] = {}
        self.calls = 0
        self.forecast = None

    def kv_tokens(self, layout: Layout) -> float:
        if layout not in self._kv:
            self._kv[layout] = self.cm.kv_capacity_tokens(layout.tp, reserve=1.0 - self.settings.gpu_memory_utilization)
        return self._kv[layout]

    def _schedule(self, layout: Layout, ctx0: np.ndarray, rem: np.ndarray, first: np.ndarray | None):
        """The replica's predicted decode schedule: per request its start and end (in decode steps, in the
        given order), segment boundaries ``k`` (steps), the time of every segment and the prefill time.
        None when nothing is left to run."""
        self.calls += 1
        rem = np.ceil(np.maximum(np.asarray(rem, dtype=float), 0.0))
        live = rem > 0
        if not live.any():
            return None
        ctx0 = np.asarray(ctx0, dtype=float)
        first = np.ones(len(rem), bool) if first is None else np.asarray(first, bool)
        idx = np.nonzero(live)[0]
        c, r, f = ctx0[idx], rem[idx], first[idx]
        n = len(r)
        mean_final = float(np.mean(c + r))
        slots = int(max(1, min(self.settings.max_num_seqs, self.kv_tokens(layout) // max(1.0, mean_final))))
        order = np.r_[np.nonzero(f)[0], np.nonzero(~f)[0]]
        rem_o, ctx_o = r[order], c[order]
        start_o = np.zeros(n)
        if n > slots:
            free = list(rem_o[:slots])  # end steps of the requests holding the slots
            heapq.heapify(free)
            for i in range(slots, n):
                s0 = heapq.heappop(free)
                start_o[i] = s0
                heapq.heappush(free, s0 + rem_o[i])
        end_o = start_o + rem_o
        pts = np.unique(np.concatenate([start_o, end_o]))
        k0, k1 = pts[:-1], pts[1:]
        st_sorted = np.sort(start_o)
        en_order = np.argsort(end_o, kind="stable")
        en_sorted = end_o[en_order]
        n_started = np.searchsorted(st_sorted, k0, side="right")
        n_ended = np.searchsorted(en_sorted, k0, side="right")
        active = n_started - n_ended
        base = ctx_o - start_o  # a request's context at step k is base + k while it runs
        cs_start = np.r_[0.0, np.cumsum(base[np.argsort(start_o, kind="stable")])]
        cs_end = np.r_[0.0, np.cumsum(base[en_order])]
        mid = (k0 + k1) / 2.0
        ctx = (cs_start[n_started] - cs_end[n_ended]) + active * mid
        seg = np.zeros(len(k0))
        ok = active > 0
        seg[ok] = self.cm.decode_step_s_array(active[ok].astype(float), np.maximum(ctx[ok], 0.0), layout.tp) * (k1 - k0)[ok]
        waiting = ~f
        pre = self.cm.prefill_s(int(waiting.sum()), float(np.mean(c[waiting])), layout.tp) if waiting.any() else 0.0
        start = np.full(len(rem), np.inf)
        end = np.full(len(rem), -np.inf)
        start[idx[order]] = start_o
        end[idx[order]] = end_o
        return {"start": start, "end": end, "k0": k0, "k1": k1, "seg": seg, "prefill": pre}

    def replica_s(self, layout: Layout, ctx0: np.ndarray, rem: np.ndarray, first: np.ndarray | None = None) -> float:
        """Remaining decode time of one replica. ``first``: requests that hold a slot now (running), which
        start at once; the others queue in the given order."""
        sch = self._schedule(layout, ctx0, rem, first)
        return 0.0 if sch is None else float(sch["seg"].sum() + sch["prefill"])

    def progress(self, layout: Layout, ctx0: np.ndarray, rem: np.ndarray, first: np.ndarray | None,
                 dt: float) -> np.ndarray:
        """Tokens each request is predicted to produce in the next ``dt`` seconds on this replica."""
        sch = self._schedule(layout, ctx0, rem, first)
        if sch is None:
            return np.zeros(len(rem))
        t = dt - sch["prefill"]
        if t <= 0:
            return np.zeros(len(rem))
        cum = np.cumsum(sch["seg"])
        j = int(np.searchsorted(cum, t, side="right"))
        if j >= len(cum):
            k = float(sch["k1"][-1])
        else:
            before = cum[j - 1] if j else 0.0
            width = sch["k1"][j] - sch["k0"][j]
            k = float(sch["k0"][j] + (t - before) / sch["seg"][j] * width) if sch["seg"][j] > 0 else float(sch["k1"][j])
        done = np.clip(np.floor(k) - sch["start"], 0.0, None)
        return np.where(np.isfinite(sch["start"]), np.minimum(done, np.ceil(np.maximum(rem, 0.0))), 0.0)

    def placement(self, layout: Layout, load: ServerLoad, current: Layout | None = None) -> np.ndarray:
        """Replica of every request under ``layout``: where it is (current layout; an arrival, replica -1,
        goes to the replica with the least remaining work) or where the engine would put it after a switch."""
        r = layout.replicas(self.gpus)
        new = load.replica < 0
        if current is not None and layout == current and bool((load.replica[~new] < r).all()):
            rep = load.replica.copy()
            tot = np.bincount(rep[~new], weights=load.rem[~new], minlength=r)
            for i in np.nonzero(new)[0]:
                j = int(np.argmin(tot))
                rep[i] = j
                tot[j] += load.rem[i]
            return rep
        return engine_deal(load, r, self.settings.max_num_seqs)

    def replica_times(self, layout: Layout, load: ServerLoad, current: Layout | None = None,
                      rep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(replica of every request, remaining time of every replica) under ``layout``."""
        r = layout.replicas(self.gpus)
        if rep is None:
            rep = self.placement(layout, load, current)
        times = np.zeros(r)
        for j in range(r):
            m = rep == j
            if m.any():
                times[j] = self.replica_s(layout, load.ctx0[m], self._rem(load, m), load.running[m])
        return rep, times

    def _rem(self, load: ServerLoad, m: np.ndarray) -> np.ndarray:
        if self.forecast is None or load.gen is None or load.key is None:
            return load.rem[m]
        n = int(m.sum())
        levels = np.empty(n)
        levels[np.argsort(load.key[m], kind="stable")] = (np.arange(n) + 0.5) / n
        return np.clip(np.ceil(self.forecast.remaining_quantile(load.gen[m], levels)), 1.0, None)

    def server_s(self, layout: Layout, load: ServerLoad, current: Layout | None = None) -> float:
        """Remaining makespan of a server holding ``load`` if it runs ``layout`` (max over its replicas)."""
        if load.n == 0:
            return 0.0
        return float(self.replica_times(layout, load, current)[1].max())

    def advance(self, layout: Layout, load: ServerLoad, dt: float) -> ServerLoad:
        """The load predicted ``dt`` seconds from now if the server keeps ``layout`` (its current one): every
        request's generated tokens move on, those predicted to finish leave. Used to ask "would it pay to
        wait before switching?"."""
        if load.n == 0 or load.gen is None:
            return load
        rep = self.placement(layout, load, layout)
        gained = np.zeros(load.n)
        finished = np.zeros(load.n, bool)
        for j in range(layout.replicas(self.gpus)):
            m = rep == j
            if not m.any():
                continue
            rem = self._rem(load, m)
            got = self.progress(layout, load.ctx0[m], rem, load.running[m], dt)
            gained[m] = got
            finished[m] = got >= np.ceil(rem)
        keep = ~finished
        new_gen = load.gen + gained
        started = gained > 0
        return ServerLoad(ctx0=(load.ctx0 + gained)[keep], rem=np.maximum(self.forecast.remaining(new_gen[keep]), 1.0)
                          if self.forecast is not None else np.maximum(load.rem - gained, 1.0)[keep],
                          running=(load.running | started)[keep], replica=rep[keep], gen=new_gen[keep],
                          key=load.key[keep])
