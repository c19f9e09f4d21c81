"""The generation engine (pure): continuous batching per replica under a KV-cache budget, injected clock.

One GPU server runs one :class:`Engine`; its GPUs are split into replicas by a :class:`Layout` (``TP4x2``: two
replicas of tensor parallelism 4). Every replica schedules like vLLM's V1 scheduler, with the same knobs:

* ``max_num_seqs``: at most this many sequences in a replica's batch (running requests);
* ``max_num_batched_tokens``: the token budget of one step: each running request that decodes takes one
  token, prefills take the rest (chunked prefill: a long prompt is prefilled over several steps);
* a KV-cache budget in blocks of ``block_size`` tokens, from the cost model's capacity for the layout
  (weights per GPU, KV heads split over the replica's GPUs, ``gpu_memory_utilization``). A request is
  admitted only when the blocks of its whole prompt fit; a running request that needs a new block when none
  is free preempts the most recently admitted running request (*preemption by recompute*, vLLM V1's only
  mode: the victim's blocks are freed, it goes back to the front of the waiting queue and, when re-admitted,
  prefills its prompt plus everything it generated so far again).

Each step lasts what a :class:`StepCost` says (the cost model, or a real decoder's measured time). Time is
never read from a clock here: the caller passes ``now``. An agent passes the wall clock (divided by the
time-dilation factor) and sleeps until :meth:`Engine.next_event`; the simulated backend passes virtual time
and jumps, so both run exactly this scheduling code ("one engine, two clocks", DESIGN.md).

A step's tokens exist at the step's end: :meth:`Engine.advance` completes every step that ended by ``now``,
reports the tokens it produced (request id and position: one token per request per step) and starts the
next step of that replica at ``now``. :meth:`Engine.run_until` runs every event up to a horizon, each step
starting when the one before it ended, many steps at once where the batch cannot change (identical results,
a unit test checks it): the simulated backend calls it in virtual time, and an agent calls it with the wall
clock, so a late wake-up of the agent delays the tokens it streams but never shifts the schedule (the
fidelity monitor reports that delay).

Per-request target lengths (where the response ends, like an EOS token) come from the workload and stay in
the engine: what the orchestrator sees (:meth:`Engine.snapshot`) is how far each request has got, never its
target.
"""
from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

import numpy as np

from emulation.orchestration import EngineSettings
from emulation.validation import SpecError, require

_LAYOUT_RE = re.compile(r"^(TP|EP)(\d+)x(\d+)$")


@dataclass(frozen=True)
class Layout:
    """How a server's GPUs are split: replicas of ``tp`` GPUs (tensor parallel); ``ep`` > 1 (MoE only) puts
    the experts of a replica on ``ep`` = ``tp`` GPUs (expert parallelism) instead of sharding each expert."""

    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for n in ("tp", "ep"):
            v = getattr(self, n)
            require(isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0, n,
                    f"must be a power of two >= 1, got {v!r}")
        require(self.ep in (1, self.tp), "ep", f"must be 1 or equal to tp ({self.tp}), got {self.ep}")

    def replicas(self, gpus: int) -> int:
        return gpus // self.tp

    def name(self, gpus: int) -> str:
        return f"{'EP' if self.ep > 1 else 'TP'}{self.tp}x{self.replicas(gpus)}"

    def check(self, gpus: int, field_name: str = "layout") -> None:
        require(self.tp <= gpus and gpus % self.tp == 0, field_name,
                f"{self.tp} GPUs per replica must divide the server's {gpus} GPUs")

    @classmethod
    def parse(cls, text: str, gpus: int, field_name: str = "layout") -> "Layout":
        """``"TP4x2"`` (2 replicas of TP 4) or ``"EP8x1"`` (MoE: 1 replica, experts over 8 GPUs)."""
        if not isinstance(text, str):
            raise SpecError(field_name, f"must be a layout name like TP4x2, got {text!r}")
        m = _LAYOUT_RE.match(text.strip())
        if not m:
            raise SpecError(field_name, f"must look like TP<gpus per replica>x<replicas> (e.g. TP4x2) or EP8x1, "
                                        f"got {text!r}")
        kind, g, r = m.group(1), int(m.group(2)), int(m.group(3))
        try:
            lay = cls(tp=g, ep=g if kind == "EP" and g > 1 else 1)
        except SpecError as e:
            raise SpecError(field_name, e.message) from None
        require(g * r == gpus, field_name, f"{text}: {g} x {r} GPUs, the server has {gpus}")
        return lay


def dense_layouts(gpus: int) -> list[Layout]:
    """Every TP layout of a server: TP1x8, TP2x4, TP4x2, TP8x1 for 8 GPUs."""
    out, t = [], 1
    while t <= gpus:
        if gpus % t == 0:
            out.append(Layout(tp=t))
        t *= 2
    return out


class StepCost(Protocol):
    """How long things take on a replica (the cost model, or a real decoder); seconds of real GPU time."""

    def step_s(self, layout: Layout, n_decode: int, decode_ctx: float, prefill_tokens: int,
               prefill_seqs: int, prefill_pairs: float | None = None) -> float:
        """One step: ``n_decode`` sequences decode one token over ``decode_ctx`` cached tokens in total, and
        ``prefill_tokens`` prompt tokens of ``prefill_seqs`` sequences are prefilled (chunks whose attention
        covers ``prefill_pairs`` query-key pairs: each chunk attends to what its sequence computed before it)."""

    def decode_steps_s(self, layout: Layout, n_decode: int, ctx: np.ndarray) -> np.ndarray:
        """Pure decode steps of ``n_decode`` sequences at each total context of ``ctx`` (vectorised)."""

    def kv_capacity_tokens(self, layout: Layout, gpu_memory_utilization: float) -> int:
        """KV-cache tokens one replica of ``layout`` holds."""

    def switch_s(self, old: Layout, new: Layout, kv_tokens: float) -> float:
        """Time to change a server's layout (weight reshard + moving ``kv_tokens`` of KV cache)."""


# ---- requests ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NewRequest:
    """A request handed to an engine. ``target`` is where the response ends (the workload's length).
    ``generated`` > 0: it arrives with that many tokens already produced (migrated, re-queued)."""

    rid: int
    prompt: int
    target: int
    dest: int = 0  # which token collector receives its tokens
    generated: int = 0
    kv_tokens: int = 0  # KV it brings (migration): > 0 means no recompute needed when it fits
    preemptions: int = 0

    def __post_init__(self) -> None:
        require(self.prompt >= 1, "prompt", f"must be >= 1, got {self.prompt}")
        require(self.target >= 1, "target", f"must be >= 1, got {self.target}")
        require(0 <= self.generated < self.target, "generated",
                f"must be in 0..target-1 ({self.target - 1}), got {self.generated}")
        require(self.kv_tokens in (0, self.prompt + self.generated), "kv_tokens",
                f"must be 0 or prompt + generated ({self.prompt + self.generated}), got {self.kv_tokens}")


@dataclass
class StepOutput:
    """What one finished step produced."""

    replica: int
    t_start: float
    t_end: float
    modelled_s: float  # what the cost said the step takes (t_end - t_start in virtual time)
    ids: np.ndarray  # request id of every token produced (one per request)
    pos: np.ndarray  # position of that token in its response (0-based)
    dest: np.ndarray  # collector of each token
    finished: np.ndarray  # requests that produced their last token
    preempted: tuple[int, ...] = ()  # requests preempted when this step was planned
    detached: tuple[int, ...] = ()  # requests handed over (see Engine.detach) at the end of this step


@dataclass(slots=True)
class Queued:
    """A request outside the running batch (waiting, or just taken out of its slot), with what it carries."""

    rid: int
    prompt: int
    generated: int
    target: int
    dest: int
    kv_tokens: int  # KV it holds: > 0 means no recompute when it is admitted (0: it recomputes)
    preemptions: int

    @classmethod
    def of(cls, r: NewRequest) -> "Queued":
        return cls(r.rid, r.prompt, r.generated, r.target, r.dest, r.kv_tokens, r.preemptions)

    def request(self) -> NewRequest:
        return NewRequest(rid=self.rid, prompt=self.prompt, target=self.target, dest=self.dest,
                          generated=self.generated, kv_tokens=self.kv_tokens, preemptions=self.preemptions)


@dataclass(slots=True)
class Step:
    """A replica's step in flight: it runs from ``t0`` to ``t1`` (``dur`` seconds, the cost's)."""

    t0: float
    t1: float
    dur: float
    chunk: np.ndarray | None = None  # prefill tokens each slot computes in this step (None: no prefill)
    emit: np.ndarray | None = None  # slots that emit a token at its end (None: every running request)
    preempted: tuple[int, ...] = ()  # requests preempted when it was planned


_EMPTY = np.zeros(0, dtype=np.int64)


def _ff_output(replica: int, before: tuple, ff: tuple) -> "StepOutput":
    """The tokens of ``ff[0]`` fast-forwarded pure-decode steps of one batch as one StepOutput: step by step,
    every request of the batch one token (positions from where each stood)."""
    t0, rid, gen, dest = before
    k = ff[0]
    pos = (gen[None, :] + np.arange(k, dtype=np.int64)[:, None]).ravel()
    return StepOutput(replica, float(t0), float(ff[1]), float(ff[1] - t0) / k, np.tile(rid, k), pos,
                      np.tile(dest, k), _EMPTY)


class ReplicaRequests:
    """The requests of one replica. Running requests live in fixed-size numpy arrays, one per field, indexed by
    slot (slot order is arbitrary; ``order`` keeps admission order for preemption); waiting requests are
    :class:`Queued` records in a deque."""

    def __init__(self, settings: EngineSettings, kv_blocks: int):
        self.settings = settings
        self.kv_blocks = int(kv_blocks)
        cap = settings.max_num_seqs
        self.rid = np.zeros(cap, np.int64)
        self.prompt = np.zeros(cap, np.int64)
        self.gen = np.zeros(cap, np.int64)
        self.target = np.zeros(cap, np.int64)
        self.dest = np.zeros(cap, np.int64)
        self.prefill_left = np.zeros(cap, np.int64)  # prefill tokens still to compute (0: decoding)
        self.blocks = np.zeros(cap, np.int64)
        self.order = np.zeros(cap, np.int64)
        self.times_preempted = np.zeros(cap, np.int64)  # preemptions of each running request so far
        self.n = 0
        self.waiting: deque[Queued] = deque()
        self._seq = 0
        self.preemptions = 0
        self.seq_bound = False  # max_num_seqs ever kept a waiting request out (else any larger value runs the same)
        self.kv_bound = False  # the KV cache ever kept a request out or preempted one
        self.kv_peak = 0  # the most KV blocks held at once: a cache of at least this many, never bound, runs the same

    @property
    def used_blocks(self) -> int:
        return int(self.blocks[: self.n].sum())

    def _blocks_for(self, tokens: np.ndarray | int):
        return -(-np.asarray(tokens) // self.settings.block_size)

    def has_work(self) -> bool:
        return self.n > 0 or bool(self.waiting)

    def slot_of(self, rid: int) -> int | None:
        hits = np.nonzero(self.rid[: self.n] == rid)[0]
        return int(hits[0]) if len(hits) else None

    def _remove_slot(self, i: int) -> Queued:
        """Remove running slot ``i`` (swap with the last); return its record (KV kept in the record)."""
        rec = Queued(int(self.rid[i]), int(self.prompt[i]), int(self.gen[i]), int(self.target[i]), int(self.dest[i]),
                     int(self.prompt[i] + self.gen[i]) if self.prefill_left[i] == 0 else 0,
                     int(self.times_preempted[i]))
        last = self.n - 1
        if i != last:
            for a in (self.rid, self.prompt, self.gen, self.target, self.dest, self.prefill_left, self.blocks,
                      self.order, self.times_preempted):
                a[i] = a[last]
        self.n -= 1
        return rec

    def _prefill_pairs(self, chunk: np.ndarray) -> float:
        """The attention (query, key) pairs of this step's prefill chunks (``chunk``: tokens per running slot):
        each chunk attends to what its sequence computed before it (a recompute: its prompt and all it had
        generated) and causally to itself."""
        n = self.n
        on = chunk[:n] > 0
        done = (self.prompt[:n] + self.gen[:n] - self.prefill_left[:n])[on]
        c = chunk[:n][on].astype(float)
        return float(np.sum(c * (done + c / 2.0)))

    def add_waiting(self, rec: Queued, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(rec)

    def _admit(self, rec: Queued, kv_tokens: int) -> int:
        i = self.n
        self.rid[i], self.prompt[i], self.gen[i] = rec.rid, rec.prompt, rec.generated
        self.target[i], self.dest[i] = rec.target, rec.dest
        ctx = rec.prompt + rec.generated
        self.prefill_left[i] = 0 if kv_tokens else ctx
        self.blocks[i] = int(self._blocks_for(ctx + 1))  # footprint after its next token (see plan())
        self.times_preempted[i] = rec.preemptions
        self._seq += 1
        self.order[i] = self._seq
        self.n += 1
        return i

    def _preempt_for_growth(self) -> list[int]:
        """Preempt (by recompute) the most recently admitted running request until every decoding request
        has room for its next token; the ids preempted."""
        preempted: list[int] = []
        while self.n:
            n = self.n
            dec = self.prefill_left[:n] == 0
            ctx_after = self.prompt[:n] + self.gen[:n] + 1
            need = int(np.sum(dec & (self._blocks_for(ctx_after) > self.blocks[:n])))
            if need <= self.kv_blocks - self.used_blocks:
                break
            self.kv_bound = True
            rec = self._remove_slot(int(np.argmax(self.order[:n])))
            rec.kv_tokens = 0  # its KV is gone: recompute
            rec.preemptions += 1
            self.add_waiting(rec, front=True)
            self.preemptions += 1
            preempted.append(rec.rid)
        return preempted

    def _continue_prefills(self, chunk: np.ndarray, decoding: np.ndarray, budget: int) -> int:
        """Give the running prefills (admission order) their chunks of the step's token budget; what is left."""
        n = self.n
        if n > int(decoding.sum()):
            idx = np.nonzero(~decoding)[0]
            for i in idx[np.argsort(self.order[idx])]:
                if budget <= 0:
                    break
                c = int(min(self.prefill_left[i], budget))
                chunk[i] = c
                budget -= c
        return budget

    def _admit_waiting(self, chunk: np.ndarray, budget: int) -> None:
        """Admit waiting requests (FIFO) while a slot, the token budget and the KV blocks of each allow."""
        free = self.kv_blocks - self.used_blocks
        while self.waiting and budget > 0:
            if self.n >= self.settings.max_num_seqs:
                self.seq_bound = True
                break
            rec = self.waiting[0]
            need = int(self._blocks_for(rec.prompt + rec.generated + 1))
            if need > free:
                self.kv_bound = True
                if self.n == 0 and need > self.kv_blocks:  # add() and set_layout() keep this from happening
                    raise RuntimeError(f"request {rec.rid} needs {need} KV blocks, the replica has {self.kv_blocks}")
                break
            self.waiting.popleft()
            i = self._admit(rec, rec.kv_tokens)
            free -= need
            if self.prefill_left[i] > 0:
                c = int(min(self.prefill_left[i], budget))
                chunk[i] = c
                budget -= c
            else:
                budget -= 1  # it arrived with its KV: it decodes in this step


class _Lookahead:
    """Durations of a pure-decode batch's next steps, costed in chunks and kept for the next call."""

    def __init__(self, cost: StepCost, layout: Layout):
        self.cost = cost
        self.layout = layout
        self._ahead: tuple[int, float, np.ndarray] | None = None  # (batch, first total context, step times)

    def durations(self, n: int, c0: float, total: int, span: float) -> np.ndarray:
        """Durations of the next pure-decode steps of a batch of ``n`` (total contexts ``c0 + n*j``), at most
        ``total`` of them, stopping after the first chunk whose steps reach past ``span`` seconds: elementwise
        the same numbers as costing all ``total`` steps at once, and their running sum the same prefix.

        The steps costed are kept: the next call for the same batch further on (the next poll of the
        simulated backend, a few steps later) takes them from there instead of costing them again."""
        have = np.zeros(0)
        if self._ahead is not None:
            bn, bc, bd = self._ahead
            j = (c0 - bc) / n if bn == n else -1.0
            if 0 <= j < len(bd) and j == int(j):
                have = bd[int(j):int(j) + total]
        parts = [have] if len(have) else []
        acc, j, size = float(have.sum()), len(have), 64
        while j < total and not acc > span + 1e-9 * (abs(span) + acc):  # past it beyond any rounding
            c = min(size, total - j)
            d = np.asarray(self.cost.decode_steps_s(self.layout, n, c0 + n * np.arange(j, j + c, dtype=float)),
                           dtype=float)
            parts.append(d)
            acc += float(d.sum())
            j += c
            size *= 2
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self._ahead = (n, c0, out)
        return out


class Replica(ReplicaRequests):
    """One replica's scheduler: plans each step (vLLM V1's rules, see the module's docstring) over its
    requests, completes it, and runs many pure-decode steps at once where the batch cannot change."""

    def __init__(self, index: int, layout: Layout, settings: EngineSettings, cost: StepCost, kv_blocks: int):
        super().__init__(settings, kv_blocks)
        self.index = index
        self.layout = layout
        self.cost = cost
        self.step: Step | None = None  # the step in flight
        self.busy_until: float | None = None
        self.tokens_total = 0
        self.recent: deque[tuple[float, int]] = deque()
        self._ahead = _Lookahead(cost, layout)
        self._ff_stuck: Step | None = None  # the step in flight fast_forward already found it cannot skip past

    # ---- planning ----
    def plan(self, now: float) -> bool:
        """Plan the next step starting at ``now``; False when there is nothing to run.

        KV accounting: a running request's footprint is ``prompt + generated`` tokens (the last sampled
        token's slot is taken eagerly), so a step that gives it one more token needs room for one more; a
        request is admitted with the blocks of ``prompt + generated + 1`` (its prefill, or recompute, emits a
        token), so no step ever needs more than one new block per request.
        """
        if not self.has_work():
            return False
        n = self.n
        if self.waiting and n >= self.settings.max_num_seqs:
            self.seq_bound = True
        if n and (not self.waiting or n >= self.settings.max_num_seqs) and not self.prefill_left[:n].any() \
                and self._plan_all_decoding(now):
            return True
        # 1. every decoding request needs room for one more token; preempt (recompute) the newest until it fits
        preempted = self._preempt_for_growth()
        n = self.n
        dec = self.prefill_left[:n] == 0
        ctx_after = self.prompt[:n] + self.gen[:n] + 1
        grow = dec & (self._blocks_for(ctx_after) > self.blocks[:n])
        self.blocks[:n][grow] += 1
        # 2. prefills already running continue (admission order), then new admissions
        chunk = np.zeros(self.settings.max_num_seqs, np.int64)
        budget = self._continue_prefills(chunk, dec, self.settings.max_num_batched_tokens - int(dec.sum()))
        self._admit_waiting(chunk, budget)
        n = self.n
        if n == 0:
            self.step = None
            self.busy_until = None
            return False
        dec = self.prefill_left[:n] == 0
        ctx_dec = float(np.sum((self.prompt[:n] + self.gen[:n])[dec]))
        pf = chunk[:n]
        pf_tokens = int(pf.sum())
        pairs = self._prefill_pairs(pf) if pf_tokens else None
        dur = self._step_s(int(dec.sum()), ctx_dec, pf_tokens, int(np.count_nonzero(pf)), pairs)
        # who emits a token at the end: decoders, and prefills that finish in this step (slots do not move
        # during a step, so the mask stays valid; None: every running request decodes)
        emit = dec | ((pf > 0) & (pf == self.prefill_left[:n]))
        self.step = Step(now, now + dur, dur, pf.copy() if pf_tokens else None, None if emit.all() else emit,
                         tuple(preempted))
        self.kv_peak = max(self.kv_peak, self.used_blocks)
        self.busy_until = now + dur
        return True

    def _step_s(self, n_decode: int, decode_ctx: float, prefill_tokens: int, prefill_seqs: int,
                prefill_pairs: float | None = None) -> float:
        dur = float(self.cost.step_s(self.layout, n_decode, decode_ctx, prefill_tokens, prefill_seqs, prefill_pairs))
        if not (math.isfinite(dur) and dur > 0):
            raise ValueError(f"step cost must be a finite time > 0, got {dur!r}")
        return dur

    def _plan_all_decoding(self, now: float) -> bool:
        """The common case, every request decoding and nothing to admit: one pass; False when the batch's
        next tokens do not fit the KV cache (then plan() preempts)."""
        n, bs = self.n, self.settings.block_size
        ctx = self.prompt[:n] + self.gen[:n]
        grow = (ctx + bs) // bs > self.blocks[:n]
        if int(grow.sum()) > self.kv_blocks - int(self.blocks[:n].sum()):
            return False
        self.blocks[:n] += grow
        self.kv_peak = max(self.kv_peak, self.used_blocks)
        dur = self._step_s(n, float(ctx.sum()), 0, 0)
        self.step = Step(now, now + dur, dur)
        self.busy_until = now + dur
        return True

    def complete(self) -> StepOutput:
        """Apply the step in flight (its tokens exist now)."""
        st = self.step
        assert st is not None, "no step in flight"
        n = self.n
        if st.chunk is not None:
            self.prefill_left[:n] -= st.chunk[:n]
        emit = st.emit
        if emit is None:  # every running request decoded
            ids, pos, dest = self.rid[:n].copy(), self.gen[:n].copy(), self.dest[:n].copy()
            self.gen[:n] += 1
            done = self.gen[:n] >= self.target[:n]
        else:
            ids = self.rid[:n][emit]
            pos = self.gen[:n][emit]
            dest = self.dest[:n][emit]
            self.gen[:n][emit] += 1
            done = emit & (self.gen[:n] >= self.target[:n])
        finished = self.rid[:n][done].copy()
        if done.any():
            for i in np.nonzero(done)[0][::-1]:
                self._remove_slot(int(i))
        self.tokens_total += len(ids)
        self.recent.append((st.t1, len(ids)))
        self.step = None
        self.busy_until = None
        return StepOutput(self.index, st.t0, st.t1, st.dur, ids, pos, dest, finished, st.preempted)

    def recent_rate(self, now: float) -> float:
        w = self.settings.rate_window_s
        while self.recent and self.recent[0][0] < now - w:
            self.recent.popleft()
        return sum(c for _, c in self.recent) / w

    # ---- many steps at once (virtual time) ----
    def fast_forward(self, horizon: float) -> tuple[int, float, int] | None:
        """When the batch cannot change before its next finish (all decoding, nothing admissible, KV enough),
        run the pure-decode steps that end by ``horizon`` in one go; returns (steps, end time, tokens) or None
        when the next step must be planned normally. Exactly the steps :meth:`plan`/:meth:`complete` would run."""
        st = self.step
        if st is None or self.n == 0 or st is self._ff_stuck:
            return None
        n = self.n
        if st.chunk is not None or st.emit is not None or self.prefill_left[:n].any() or self._admissible():
            self._ff_stuck = st  # the batch may change at the next step: plan it normally
            return None
        # the step in flight ends at t1; the following k-1 steps are pure decode with the same batch
        remaining = self.target[:n] - self.gen[:n]  # tokens left incl. the in-flight one
        k = int(remaining.min())  # steps until the first finish (the k-th step finishes someone)
        if k <= 1:
            self._ff_stuck = st
            return None
        # KV: blocks needed over the next k-1 planned steps must fit (else preemption: plan normally)
        ctx_now = self.prompt[:n] + self.gen[:n] + 1  # after the in-flight step
        free = self.kv_blocks - self.used_blocks

        def fits(j: int) -> bool:
            return int(np.sum(self._blocks_for(ctx_now + j) - self.blocks[:n])) <= free

        if not fits(k - 1):
            lo, hi = 0, k - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid - 1
            k = lo + 1
            if k <= 1:
                self._ff_stuck = st
                return None
        if st.t1 > horizon:
            return None
        # steps after the in-flight one: planned at ctx sums c0 + n*j, j = 0..k-2. Only as many as can end by
        # the horizon are costed: chunks of doubling size until one ends past it (a poll every few ms of a
        # 16k-token response would otherwise cost all of its remaining steps each time)
        c0 = float(np.sum(self.prompt[:n] + self.gen[:n])) + n
        durs = self._ahead.durations(n, c0, k - 1, horizon - st.t1)
        ends = st.t1 + np.cumsum(durs)
        # follow-up steps ending by the horizon, but never the k-th step (it finishes a request: plan normally)
        m = min(int(np.searchsorted(ends, horizon, side="right")), k - 2)
        # complete the in-flight step plus m follow-ups; the (m+1)-th follow-up is left in flight
        steps = 1 + m
        self.gen[:n] += steps
        self.blocks[:n] = np.maximum(self.blocks[:n], self._blocks_for(self.prompt[:n] + self.gen[:n]))
        tokens = n * steps
        self.tokens_total += tokens
        t_end = float(ends[m - 1]) if m else st.t1
        self.recent.append((t_end, tokens))
        # the next follow-up step is in flight, same batch (its blocks were checked above, grown like plan())
        nxt = float(durs[m])
        ctx_after = self.prompt[:n] + self.gen[:n] + 1
        self.blocks[:n] = np.maximum(self.blocks[:n], self._blocks_for(ctx_after))
        self.kv_peak = max(self.kv_peak, self.used_blocks)
        self.step = Step(t_end, t_end + nxt, nxt)
        self.busy_until = t_end + nxt
        return steps, t_end, tokens

    def _admissible(self) -> bool:
        """Whether the head of the queue could be admitted at the next step: a slot is free, the step's token
        budget has room, and its blocks fit what the KV cache has free now. Blocks only grow while the batch
        decodes, so a head that does not fit now does not fit before a request finishes (or is preempted,
        which ``fits`` below rules out): such a queue does not stop a fast-forward."""
        if not self.waiting or self.n >= self.settings.max_num_seqs or self.n >= self.settings.max_num_batched_tokens:
            return False
        rec = self.waiting[0]
        return int(self._blocks_for(rec.prompt + rec.generated + 1)) <= self.kv_blocks - self.used_blocks


@dataclass
class LayoutSwitch:
    """A layout change in progress: it starts when the steps in flight end and lasts ``switch_s``."""

    old: Layout
    new: Layout
    requested: float
    start: float
    switch_s: float
    kv_tokens: float
    applied: bool = False

    @property
    def end(self) -> float:
        return self.start + self.switch_s


class ServerRequests:
    """Which requests a server holds, across its replicas, and their hand-over to another server (migration's
    final stop): a request leaves at once when no step of its replica is in flight, else at that step's end."""

    def __init__(self) -> None:
        self.replicas: list[Replica] = []
        self.held: set[int] = set()  # ids of every request on this server (running or waiting)
        self.detached: dict[int, NewRequest] = {}  # handed-over requests (migration), by id
        self._detach_pending: set[int] = set()

    def holds(self, rid: int) -> bool:
        return rid in self.held

    def detaching(self, rid: int) -> bool:
        """Whether ``rid`` was asked to stop (:meth:`detach`) and leaves at the end of its step in flight."""
        return rid in self._detach_pending

    def footprint(self, rid: int) -> tuple[int, bool] | None:
        """(KV tokens, decoding with its KV) of request ``rid`` here: a running request's ``prompt + generated``
        and whether its prefill is done; (0, False) while it waits; None when it is not on this server."""
        for rep in self.replicas:
            i = rep.slot_of(rid)
            if i is not None:
                return int(rep.prompt[i] + rep.gen[i]), bool(rep.prefill_left[i] == 0)
        return (0, False) if self.holds(rid) else None

    def detach(self, rid: int, now: float) -> NewRequest | None:
        """Hand a request over: removed now if it is not in a step in flight (the result is returned), else at
        the end of that step (it then appears in ``detached``). None: pending."""
        if rid not in self.held:
            raise SpecError("rid", f"request {rid} is not on this server")
        for rep in self.replicas:
            for j, rec in enumerate(rep.waiting):
                if rec.rid == rid:
                    del rep.waiting[j]
                    return self._record_detached(rec)
            i = rep.slot_of(rid)
            if i is not None:
                if rep.step is not None:  # slots must not move during a step: hand over at its end
                    self._detach_pending.add(rid)
                    return None
                return self._record_detached(rep._remove_slot(i))
        raise SpecError("rid", f"request {rid} is not on this server")

    def _record_detached(self, rec: Queued) -> NewRequest:
        self.held.discard(rec.rid)
        r = rec.request()
        self.detached[r.rid] = r
        return r

    def _finish_detaches(self, rep: Replica, out: StepOutput) -> None:
        """After ``rep``'s step: hand over the requests asked to stop during it (``out.detached``)."""
        if not self._detach_pending:
            return
        got = []
        for rid in list(self._detach_pending):
            i = rep.slot_of(rid)
            if i is not None:
                self._record_detached(rep._remove_slot(i))
                self._detach_pending.discard(rid)
                got.append(rid)
            elif rid in out.finished:  # it finished in its last step here: nothing to hand over
                self._detach_pending.discard(rid)
        out.detached = tuple(got)


def kv_blocks_needed(prompt: int, target: int, block_size: int) -> int:
    """KV blocks one request of ``prompt`` + ``target`` tokens holds at its longest (whole blocks): a replica
    whose cache has fewer refuses it (:meth:`Engine._check_fits`)."""
    return -(-(int(prompt) + int(target)) // int(block_size))


class Engine(ServerRequests):
    """One server's replicas. Not thread-safe: the caller serialises calls (the agent holds a lock)."""

    def __init__(self, cost: StepCost, gpus: int, layout: Layout, settings: EngineSettings = EngineSettings()):
        layout.check(gpus)
        super().__init__()
        self.cost = cost
        self.gpus = gpus
        self.settings = settings
        self.layout = layout
        self.paused_until = -math.inf
        self.switch: LayoutSwitch | None = None
        self.switches: list[dict] = []
        self.finished_total = 0
        self.finished_log: list[tuple[int, float]] = []  # (request id, finish time) seen by run_until
        self.last_end = -math.inf  # end of the last step completed (run_until: when the engine went idle)
        self._base_preemptions = 0  # counters of replicas replaced by a layout switch
        self._base_seq_bound = False
        self._base_kv_bound = False
        self._base_kv_peak = 0
        self._base_tokens = 0
        self._build(layout)

    def _build(self, layout: Layout) -> None:
        tokens = int(self.cost.kv_capacity_tokens(layout, self.settings.gpu_memory_utilization))
        blocks = tokens // self.settings.block_size
        if blocks < 1:
            raise SpecError("layout", f"{layout.name(self.gpus)}: no room for the KV cache (the weights fill the GPUs)")
        self.replicas = [Replica(i, layout, self.settings, self.cost, blocks) for i in range(layout.replicas(self.gpus))]
        self.layout = layout

    @property
    def kv_blocks_per_replica(self) -> int:
        return self.replicas[0].kv_blocks

    # ---- requests ----
    def add(self, reqs: Iterable[NewRequest], now: float, replica: int | None = None,
            chunked: bool = False) -> list[int]:
        """Queue requests: each on the least loaded replica (by requests held), or all on ``replica``, or
        (``chunked``) cut in equal consecutive chunks, one per replica, in the order given (veRL's dispatch of a
        worker's share to its DP ranks). Returns the replica of each. Idle replicas start a step at ``now``."""
        reqs = list(reqs)
        if replica is not None and not (isinstance(replica, int) and 0 <= replica < len(self.replicas)):
            raise SpecError("replica", f"must be in 0..{len(self.replicas) - 1}, got {replica!r}")
        for j, r in enumerate(reqs):  # check everything first: a bad request queues none of them
            try:
                self._check_fits(r.prompt, r.target, self.kv_blocks_per_replica, self.layout)
            except SpecError as e:
                raise SpecError(f"requests[{j}].{e.field}", e.message) from None
            if self.holds(r.rid):
                raise SpecError(f"requests[{j}].rid", f"request {r.rid} is already on this server")
        out = []
        nr = len(self.replicas)
        for j, r in enumerate(reqs):
            if replica is not None:
                k = replica
            elif chunked:
                k = j * nr // len(reqs)
            else:
                k = min(range(nr), key=lambda i: (self.replicas[i].n + len(self.replicas[i].waiting), i))
            self.replicas[k].add_waiting(Queued.of(r))
            self.held.add(r.rid)
            out.append(k)
        self._kick(now)
        return out

    def _check_fits(self, prompt: int, target: int, kv_blocks: int, layout: Layout) -> None:
        need = kv_blocks_needed(prompt, target, self.settings.block_size)
        if need > kv_blocks:
            raise SpecError("target", f"a request of {prompt} + {target} tokens needs {need} KV blocks; a replica of "
                                      f"{layout.name(self.gpus)} holds {kv_blocks}")

    def _kick(self, now: float) -> None:
        if now < self.paused_until or (self.switch is not None and not self.switch.applied):
            return
        for rep in self.replicas:
            if rep.step is None and rep.has_work():
                rep.plan(now)

    # ---- time ----
    def next_event(self) -> float | None:
        """When something happens next without new input (a step ends, a layout switch starts or ends)."""
        ts = [r.busy_until for r in self.replicas if r.busy_until is not None]
        if self.switch is not None and not self.switch.applied:
            ts.append(self.switch.start)
        elif self.paused_until > -math.inf and any(r.has_work() and r.step is None for r in self.replicas):
            ts.append(self.paused_until)
        return min(ts) if ts else None

    def advance(self, now: float) -> list[StepOutput]:
        """Complete every step that ended by ``now`` (in end-time order), apply a due layout switch, start the
        next steps at ``now``."""
        outs: list[StepOutput] = []
        while True:
            due = [r for r in self.replicas if r.busy_until is not None and r.busy_until <= now]
            if not due:
                break
            rep = min(due, key=lambda r: (r.busy_until, r.index))
            out = rep.complete()
            self.held.difference_update(out.finished.tolist())
            self._finish_detaches(rep, out)
            self.finished_total += len(out.finished)
            outs.append(out)
        self._maybe_switch(now)
        if now >= self.paused_until and (self.switch is None or self.switch.applied):
            for rep in self.replicas:
                if rep.step is None and rep.has_work():
                    rep.plan(now)
        return outs

    def run_until(self, horizon: float, sink: list | None = None) -> tuple[int, int]:
        """Run every event up to ``horizon`` (steps back to back, many at once where the batch cannot change):
        each step starts when the one before it ended, whatever time the caller calls at. Returns (steps,
        tokens). Finished request ids accumulate in ``finished_log``. ``sink``: a list that receives every
        step's :class:`StepOutput` (a fast-forwarded run of steps as one output of all their tokens, in step
        order): what an agent pacing this engine by the wall clock streams (its lateness then delays tokens,
        never the schedule)."""
        steps = tokens = 0
        while True:
            t = self.next_event()
            if t is None or t > horizon:
                break
            progressed = False
            for rep in self.replicas:
                if rep.busy_until is not None and rep.busy_until <= horizon and not self._detach_pending \
                        and (self.switch is None or self.switch.applied):
                    before = None
                    if sink is not None and rep.n:
                        n = rep.n
                        before = (rep.step.t0, rep.rid[:n].copy(), rep.gen[:n].copy(), rep.dest[:n].copy())
                    ff = rep.fast_forward(horizon)
                    if ff is not None:
                        steps += ff[0]
                        tokens += ff[2]
                        self.last_end = max(self.last_end, ff[1])
                        progressed = True
                        if before is not None:
                            sink.append(_ff_output(rep.index, before, ff))
            if progressed:
                continue
            outs = self.advance(t)
            for o in outs:
                steps += 1
                tokens += len(o.ids)
                self.last_end = max(self.last_end, o.t_end)
                if len(o.finished):
                    self.finished_log.extend((int(x), o.t_end) for x in o.finished)
            if sink is not None:
                sink.extend(outs)
        return steps, tokens

    # ---- layout ----
    def set_layout(self, layout: Layout, now: float, switch_s: float | None = None) -> LayoutSwitch:
        """Change the layout: no new step starts; when the steps in flight end the server re-shards for
        ``switch_s`` (default: the cost's :meth:`StepCost.switch_s`), then its running requests resume on the
        new replicas with their KV cache (those that do not fit wait and recompute)."""
        layout.check(self.gpus)
        if self.switch is not None and not self.switch.applied:
            raise SpecError("layout", "a layout switch is already in progress")
        new_blocks = int(self.cost.kv_capacity_tokens(layout, self.settings.gpu_memory_utilization)) \
            // self.settings.block_size
        for rep in self.replicas:
            recs = [(int(rep.prompt[i]), int(rep.target[i])) for i in range(rep.n)]
            recs += [(w.prompt, w.target) for w in rep.waiting]
            for prompt, target in recs:
                self._check_fits(prompt, target, new_blocks, layout)
        ends = [r.busy_until for r in self.replicas if r.busy_until is not None]
        start = max([now] + ends)
        kv = float(sum(int(np.sum(r.prompt[: r.n] + r.gen[: r.n])) for r in self.replicas))
        dur = float(self.cost.switch_s(self.layout, layout, kv)) if switch_s is None else float(switch_s)
        self.switch = LayoutSwitch(self.layout, layout, now, start, dur, kv)
        self._maybe_switch(now)
        return self.switch

    def _maybe_switch(self, now: float) -> None:
        sw = self.switch
        if sw is None or sw.applied or now < sw.start or any(r.step is not None for r in self.replicas):
            return
        running: list[Queued] = []
        waiting: list[Queued] = []
        for rep in self.replicas:
            while rep.n:
                running.append(rep._remove_slot(rep.n - 1))
            waiting.extend(rep.waiting)
        self._base_preemptions += sum(r.preemptions for r in self.replicas)
        self._base_seq_bound = self.seq_bound
        self._base_kv_bound = self.kv_bound
        self._base_kv_peak = self.kv_peak
        self._base_tokens += sum(r.tokens_total for r in self.replicas)
        self._build(sw.new)
        _deal_after_switch(running, waiting, self.replicas, self.settings.max_num_seqs)
        sw.applied = True
        self.paused_until = sw.end
        self.switches.append({"from": sw.old.name(self.gpus), "to": sw.new.name(self.gpus), "requested": sw.requested,
                              "start": sw.start, "end": sw.end, "switch_s": sw.switch_s, "kv_tokens": sw.kv_tokens})

    @property
    def kv_bound(self) -> bool:
        """Whether the KV cache ever kept a waiting request out or preempted one on this server."""
        return self._base_kv_bound or any(r.kv_bound for r in self.replicas)

    @property
    def kv_peak(self) -> int:
        """The most KV blocks one replica of this server held at once: with a cache of at least this many that
        never bound, a run schedules the same steps whatever the cache's size."""
        return max([self._base_kv_peak] + [r.kv_peak for r in self.replicas])

    @property
    def seq_bound(self) -> bool:
        """Whether ``max_num_seqs`` ever kept a waiting request out of a batch on this server: if not, every
        larger ``max_num_seqs`` schedules exactly the same steps (a tuning grid skips those runs)."""
        return self._base_seq_bound or any(r.seq_bound for r in self.replicas)

    # ---- what the orchestrator sees ----
    def stats(self, now: float) -> dict:
        """vLLM-named load statistics per replica and for the server (:func:`_server_stats`)."""
        return _server_stats(self, now)

    def snapshot(self) -> dict[str, np.ndarray]:
        """Every request on this server: id, replica, tokens generated, prompt, running (1) or waiting (0).
        The target lengths stay hidden (the orchestrator must forecast them)."""
        return _server_snapshot(self.replicas)

    def idle(self) -> bool:
        return not any(r.has_work() or r.step is not None for r in self.replicas) and \
            (self.switch is None or self.switch.applied)


def _deal_after_switch(running: list[Queued], waiting: list[Queued], reps: list[Replica], max_num_seqs: int) -> None:
    """Where a server's requests go on its new replicas after a layout switch: running requests keep their KV
    (relocated) on the replica with the least KV held that has room; what fits nowhere waits (and recomputes),
    queued on the replica with the fewest requests, as do the waiting."""
    running.sort(key=lambda rec: rec.rid)
    for rec in running:
        need = int(reps[0]._blocks_for(rec.prompt + rec.generated + 1))
        room = [i for i, r in enumerate(reps) if r.n < max_num_seqs and need <= r.kv_blocks - r.used_blocks]
        if room:
            reps[min(room, key=lambda i: (reps[i].used_blocks, i))]._admit(rec, rec.kv_tokens)  # mid-prefill: again
        else:
            rec.kv_tokens = 0
            reps[min(range(len(reps)), key=lambda i: (reps[i].n + len(reps[i].waiting), i))].add_waiting(rec)
    for rec in waiting:
        reps[min(range(len(reps)), key=lambda i: (reps[i].n + len(reps[i].waiting), i))].add_waiting(rec)


def _server_stats(engine: Engine, now: float) -> dict:
    """Engine.stats: vLLM-named load statistics per replica and for the server."""
    reps = []
    for r in engine.replicas:
        reps.append({"replica": r.index, "num_requests_running": int(r.n),
                     "num_requests_waiting": len(r.waiting),
                     "kv_cache_usage_perc": r.used_blocks / r.kv_blocks,
                     "kv_blocks_free": r.kv_blocks - r.used_blocks, "kv_blocks_total": r.kv_blocks,
                     "decode_tokens_per_s": r.recent_rate(now)})
    return {"layout": engine.layout.name(engine.gpus), "replicas": reps,
            "num_requests_running": sum(x["num_requests_running"] for x in reps),
            "num_requests_waiting": sum(x["num_requests_waiting"] for x in reps),
            "kv_cache_usage_perc": sum(r.used_blocks for r in engine.replicas) / sum(r.kv_blocks for r in engine.replicas),
            "num_preemptions_total": engine._base_preemptions + sum(r.preemptions for r in engine.replicas),
            "generation_tokens_total": engine._base_tokens + sum(r.tokens_total for r in engine.replicas),
            "decode_tokens_per_s": sum(x["decode_tokens_per_s"] for x in reps),
            "num_requests_finished": engine.finished_total,
            "paused_until": engine.paused_until if engine.paused_until > -math.inf else None,
            "switching": engine.switch is not None and (not engine.switch.applied or now < engine.paused_until)}


def _server_snapshot(replicas: Sequence[Replica]) -> dict[str, np.ndarray]:
    """Engine.snapshot: every request's id, replica, tokens generated, prompt, running (1) or waiting (0)."""
    rid, rep, gen, prompt, run = [], [], [], [], []
    for r in replicas:
        n = r.n
        rid.append(r.rid[:n]); gen.append(r.gen[:n]); prompt.append(r.prompt[:n])
        rep.append(np.full(n, r.index)); run.append(np.ones(n, np.int8))
        if r.waiting:
            w = np.array([[x.rid, x.generated, x.prompt] for x in r.waiting], dtype=np.int64)
            rid.append(w[:, 0]); gen.append(w[:, 1]); prompt.append(w[:, 2])
            rep.append(np.full(len(w), r.index)); run.append(np.zeros(len(w), np.int8))
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))
    return {"rid": cat(rid, np.int64), "replica": cat(rep, np.int64), "generated": cat(gen, np.int64),
            "prompt": cat(prompt, np.int64), "running": cat(run, np.int8)}


# ---- the cost model as a step cost ------------------------------------------------------------------
class ModelledCost:
    """:class:`StepCost` from the calibrated cost model (``agents.costmodel.CostModel``), built for the engine it
    serves (``CostModel.for_engine``: the engine profile's CPU time, CUDA graphs and KV sizing).

    A step with a prefill chunk is one forward pass over the decodes' and the chunk's tokens together
    (``CostModel.step_s``: chunked prefill as vLLM and SGLang run it, the chunk's activations all-reduced with
    the decodes'; a chunk attends to what its sequence computed before it).
    """

    def __init__(self, cm, gpus: int = 8, reinit_s: float | None = None):
        self.cm = cm
        self.gpus = gpus
        self.reinit_s = reinit_s  # the fixed part of a layout switch (None: the calibration's)
        self._plans: dict = {}  # (old, new) -> the switch's KV-independent parts (cm.switch_plan)

    def step_s(self, layout: Layout, n_decode: int, decode_ctx: float, prefill_tokens: int,
               prefill_seqs: int, prefill_pairs: float | None = None) -> float:
        if not prefill_tokens:
            return self.cm.decode_step_s(n_decode, decode_ctx, layout.tp, layout.ep)
        return self.cm.step_s(n_decode, decode_ctx, prefill_tokens, prefill_seqs, layout.tp, layout.ep,
                              prefill_pairs)

    def decode_steps_s(self, layout: Layout, n_decode: int, ctx: np.ndarray) -> np.ndarray:
        return self.cm.decode_step_s_array(np.full(len(ctx), float(n_decode)), np.asarray(ctx, float), layout.tp,
                                           layout.ep)

    def kv_capacity_tokens(self, layout: Layout, gpu_memory_utilization: float) -> int:
        return int(self.cm.kv_capacity_tokens(layout.tp, reserve=1.0 - gpu_memory_utilization, ep=layout.ep))

    def switch_s(self, old: Layout, new: Layout, kv_tokens: float) -> float:
        """The cost model's layout switch: weight reshard plus KV relocation over NVLink plus a fixed part
        (docs/costmodel.md; ReMP reports 1-7 s for 7B-70B)."""
        if old == new:
            return 0.0
        # the planner prices every candidate switch of every server at every tick, for the server's KV of the
        # moment: the layout part of the cost model's arithmetic is done once per pair (the same numbers)
        plan = self._plans.get((old, new))
        if plan is None:
            plan = self._plans[(old, new)] = self.cm.switch_plan(old.tp, new.tp, from_ep=old.ep, to_ep=new.ep,
                                                                 gpus=self.gpus, fixed_s=self.reinit_s)
        return float(plan.total_s(kv_tokens))
