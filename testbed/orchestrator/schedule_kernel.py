"""The estimator's decode schedules (testbed/orchestrator/estimate.py ``Estimator._grouped``), compiled.

``_grouped`` turns every replica's requests into a schedule: the running requests first, then the queue, the
queue taking the slots as earlier requests end (a heap of the slots' ends), and the schedule cut into segments
between consecutive distinct start or end steps, each with its batch (requests running) and its mean context.
In numpy that is ~35 passes over the requests of every replica of every block (sorts, a merge of two sorted
runs, cumulative sums) and a Python heap loop for each replica with a queue: ~0.25 us a request on 2 cores,
most of a planning tick. :func:`segments` makes the same schedule in one compiled pass per replica.

The same numbers, to the bit: every quantity here is a whole number (contexts, remaining lengths rounded up,
starts and ends that are sums of them) or a half of one, below 2^53, so every sum is exact in any order and the
segments' batches, contexts and bounds are those of the numpy pass (which sums the same values in another order,
globally across replicas, exactly for the same reason); a replica's queue takes the same slots (the smallest end
is the smallest end whatever heap holds it). The step times (the cost model's) are still evaluated by the caller,
in numpy, on these segments, so none of that arithmetic moves here. ``tests/unit/test_estimator.py`` checks the
compiled pass against the numpy one on random schedules; :func:`available` says whether numba is installed (the
numpy pass is used where it is not: ``pip install -e .[fast]``).
"""
from __future__ import annotations

import numpy as np

try:  # numba is optional: the numpy pass computes the same schedule where it is not installed
    import numba
except ImportError:  # pragma: no cover - exercised on an install without the extra
    numba = None


def available() -> bool:
    """Whether the compiled pass can be used (numba is installed)."""
    return numba is not None


SMALL_SORT = 48  # a replica of at most this many requests sorts its ends by insertion (measured: the bench's
# worst tick's schedules, 19k requests in replicas of 6-256, 1.00 -> 0.77 ms; np.argsort allocates per replica)


def _group_starts(group, n_groups):
    """(requests in each group, where each group starts in an order by group: its cumulative counts)."""
    cnt = np.zeros(n_groups, np.int64)
    for i in range(len(group)):
        cnt[group[i]] += 1
    first = np.zeros(n_groups + 1, np.int64)
    for j in range(n_groups):
        first[j + 1] = first[j] + cnt[j]
    return cnt, first


if numba is not None:  # compiled before the kernels that call it
    _group_starts = numba.njit(cache=True, nogil=True)(_group_starts)


def _segments(c, r, f, g, n_groups, slots):
    """Every replica's schedule: (start and end step of every request, in the arrays' order; per segment, in
    replica then step order: its replica, first and last step, requests running and their mean context)."""
    n = len(r)
    # the requests of each replica, running ones first, then the queue, each in the arrays' order
    # (``stable_argsort(g * 2 + ~f)`` of the numpy pass)
    cnt, first = _group_starts(g, n_groups)
    fill = first[:-1].copy()
    order = np.empty(n, np.int64)
    for i in range(n):
        if f[i]:
            order[fill[g[i]]] = i
            fill[g[i]] += 1
    for i in range(n):
        if not f[i]:
            order[fill[g[i]]] = i
            fill[g[i]] += 1
    start = np.zeros(n)
    end = np.zeros(n)
    seg_g = np.empty(2 * n, np.int64)
    k0 = np.empty(2 * n)
    k1 = np.empty(2 * n)
    batch = np.empty(2 * n)
    ctx = np.empty(2 * n)
    m = 0
    heap = np.empty(max(1, n))
    ends = np.empty(max(1, n))
    eidx = np.empty(max(1, n), np.int64)
    for j in range(n_groups):
        lo, hi = first[j], first[j + 1]
        if hi == lo:
            continue
        k = slots[j]
        # the first ``k`` start at once; each later one when the slot that frees first frees (a min-heap of ends)
        for q in range(lo, hi):
            start[order[q]] = 0.0
        if hi - lo > k:
            h = 0
            for q in range(lo, lo + k):
                x = r[order[q]]
                heap[h] = x  # sift up
                p = h
                while p > 0:
                    up = (p - 1) // 2
                    if heap[up] > heap[p]:
                        heap[up], heap[p] = heap[p], heap[up]
                        p = up
                    else:
                        break
                h += 1
            for q in range(lo + k, hi):
                s0 = heap[0]
                start[order[q]] = s0
                heap[0] = s0 + r[order[q]]  # replace the smallest, sift down
                p = 0
                while True:
                    a = 2 * p + 1
                    if a >= h:
                        break
                    b = a + 1
                    if b < h and heap[b] < heap[a]:
                        a = b
                    if heap[a] < heap[p]:
                        heap[a], heap[p] = heap[p], heap[a]
                        p = a
                    else:
                        break
        for q in range(lo, hi):
            i = order[q]
            end[i] = start[i] + r[i]
        # the ends in step order (the starts are in it already: 0 for the running, then non-decreasing)
        w = hi - lo
        for q in range(w):
            ends[q] = end[order[lo + q]]
        if w <= SMALL_SORT:  # a replica's few requests: insertion sort into a kept buffer (no allocation;
            e_ord = eidx[:w]  # the order of equal ends does not matter: they are walked past together)
            for q in range(w):
                v = ends[q]
                p = q
                while p > 0 and ends[e_ord[p - 1]] > v:
                    e_ord[p] = e_ord[p - 1]
                    p -= 1
                e_ord[p] = q
        else:
            e_ord = np.argsort(ends[:w])
        # walk the distinct steps: the requests started and ended at or before each, and their contexts' sums
        ps = lo  # next start (in ``order``)
        pe = 0  # next end (in ``e_ord``)
        started = 0
        ended = 0
        sum_s = 0.0
        sum_e = 0.0
        prev = -1.0
        have = False
        while ps < hi or pe < w:
            if ps < hi:
                t = start[order[ps]]
                if pe < w and ends[e_ord[pe]] < t:
                    t = ends[e_ord[pe]]
            else:
                t = ends[e_ord[pe]]
            if have:
                active = started - ended
                if active > 0:
                    seg_g[m] = j
                    k0[m] = prev
                    k1[m] = t
                    batch[m] = active
                    ctx[m] = (sum_s - sum_e) + active * ((prev + t) / 2.0)
                    m += 1
            while ps < hi and start[order[ps]] == t:
                i = order[ps]
                sum_s += c[i] - start[i]
                started += 1
                ps += 1
            while pe < w and ends[e_ord[pe]] == t:
                i = order[lo + e_ord[pe]]
                sum_e += c[i] - start[i]
                ended += 1
                pe += 1
            prev = t
            have = True
    return start, end, seg_g[:m], k0[:m], k1[:m], batch[:m], ctx[:m]


def _deal_many(need, run, run_off, n_off, running, rs, slots, kv_blocks):
    """estimate.engine_deal of many loads at once: load ``i``'s requests are rows ``n_off[i]:n_off[i + 1]`` of
    ``running`` (whether each runs), its running ones in the order the engine deals them are ``run`` (indices
    into the load) rows ``run_off[i]:run_off[i + 1]``, with their KV blocks ``need``; it goes onto ``rs[i]``
    replicas of ``slots[i]`` slots and ``kv_blocks[i]`` blocks each. Returns (every request's replica, whether
    it runs), rows as ``running``'s.

    Each running request keeps its KV on the replica with a slot left that holds the fewest blocks (the lowest
    of equals) if it fits there (the smallest (blocks held, replica) of engine_deal's heap, found by a scan of
    the replicas; each replica's blocks summed in the same order), else waits, queued on the replica with the
    fewest requests (running and queued; the lowest of equals); once every replica's slots are taken the rest
    wait. Then the rest, and after them the requests that were waiting, in order, each onto the replica with
    the fewest requests (engine_deal's ``_fewest_first``: the same picks one at a time)."""
    rep = np.zeros(len(running), np.int64)
    out = running.copy()
    for i in range(len(rs)):
        r, k, kv = rs[i], slots[i], kv_blocks[i]
        base = n_off[i]
        held = np.zeros(r)
        count = np.zeros(r, np.int64)
        queued = np.zeros(r, np.int64)
        lo, hi = run_off[i], run_off[i + 1]
        full = hi
        for q in range(lo, hi):
            j = -1
            for a in range(r):
                if count[a] < k and (j < 0 or held[a] < held[j]):
                    j = a
            if j < 0:  # every replica's slots are taken
                full = q
                break
            c = need[q]
            if held[j] + c <= kv:
                count[j] += 1
                held[j] = held[j] + c
            else:  # no room for its KV anywhere: it waits, on the replica with the fewest requests
                j = 0
                for a in range(1, r):
                    if count[a] + queued[a] < count[j] + queued[j]:
                        j = a
                queued[j] += 1
                out[base + run[q]] = False
            rep[base + run[q]] = j
        tot = count + queued
        n_wait = hi - full
        for q in range(full, hi):  # the rest wait, before the waiting ones
            out[base + run[q]] = False
        if hi - lo < n_off[i + 1] - base:  # the requests that were waiting
            n_wait += n_off[i + 1] - base - (hi - lo)
        placed = 0
        p_rest = full
        p_wait = base
        while placed < n_wait:
            if p_rest < hi:
                x = base + run[p_rest]
                p_rest += 1
            else:
                while running[p_wait]:
                    p_wait += 1
                x = p_wait
                p_wait += 1
            j = 0
            for a in range(1, r):
                if tot[a] < tot[j]:
                    j = a
            tot[j] += 1
            rep[x] = j
            placed += 1
    return rep, out


def _stack_steps(ti, batch, ctx, steps, width, pre, read_b, kv_write_s, post, kv_gpu, qr, hd, hbm, peak, floor,
                 layers, engine, cpu, eager, any_eager, ctx_limit, launch, overlap):
    """estimate.DecodeStack's call times ``steps``: each segment's decode step (its TP degree's table ``ti``,
    its batch and context) times its steps, with the same operations in the same order on the same values
    (the kernels' terms, the tabulated ones added row by row, then the engine's: the eager launches where the
    step runs past the graphs, its CPU time in series or overlapped); ``ctx_limit`` < 0: none."""
    n = len(batch)
    out = np.empty(n)
    rows = post.shape[0]
    for i in range(n):
        t = ti[i]
        at = t * width + np.int64(batch[i])
        read = ctx[i] * kv_gpu[t] + read_b[at]
        flops = 4.0 * ctx[i] * qr[t] * hd[t]
        a = read / hbm
        b = flops / peak
        x = pre[at] + layers * (floor + (a if a >= b else b) + kv_write_s[at])
        for k in range(rows):
            x = x + post[k, at]
        if engine:
            if any_eager:
                e = eager[at]
                if ctx_limit >= 0.0 and ctx[i] > ctx_limit * batch[i]:
                    e = True
                if e and launch > x:
                    x = launch
            c = cpu[at]
            if overlap:
                x = x if x >= c else c
            else:
                x = x + c
        out[i] = x * steps[i]
    return out


def _levels(key, group, n_groups):
    """Each request's stratified level in its group: ``(rank + 0.5) / count``, ranked by key within the group
    (ties by position: ``np.lexsort((key, group))``'s order), as Estimator._stratified computes it in numpy."""
    n = len(key)
    cnt, first = _group_starts(group, n_groups)
    fill = first[:-1].copy()
    members = np.empty(n, np.int64)
    for i in range(n):  # each group's requests, in position order
        members[fill[group[i]]] = i
        fill[group[i]] += 1
    levels = np.empty(n)
    for j in range(n_groups):
        lo, hi = first[j], first[j + 1]
        if hi == lo:
            continue
        ks = np.empty(hi - lo)
        for q in range(lo, hi):
            ks[q - lo] = key[members[q]]
        by = np.argsort(ks, kind="mergesort")  # stable: equal keys in position order
        for rank in range(hi - lo):
            levels[members[lo + by[rank]]] = (rank + 0.5) / cnt[j]
    return levels


def _reached(seg_g, seg, k0, k1, prefill, dt, n_groups):
    """estimate.Estimator._progress's step reached by every replica ``dt`` seconds on (its prefill first): the
    segments' running sum of times (``seg``, replica ``seg_g``, in order; the same sums as numpy's cumsum along
    a replica's row), the segments whose sum is within the time counted, and the step interpolated inside the
    segment that holds it (the last one's end past them all); 0 where no time is left after the prefill."""
    out = np.zeros(n_groups)
    m = len(seg_g)
    cum = np.empty(max(1, m))
    a = 0
    for j in range(n_groups):
        b = a
        while b < m and seg_g[b] == j:
            b += 1
        t = dt - prefill[j]
        if b > a and t > 0:
            s = 0.0
            i = 0
            for q in range(a, b):
                s = seg[q] if q == a else s + seg[q]
                cum[q] = s
                if s <= t:
                    i += 1
            if i >= b - a:
                out[j] = k1[b - 1]
            else:
                at = a + i
                before = cum[at - 1] if i > 0 else 0.0
                if seg[at] > 0:
                    out[j] = k0[at] + (t - before) / seg[at] * (k1[at] - k0[at])
                else:
                    out[j] = k1[at]
        a = b
    return out


def _sum_rows(n_rows, at, table, src):
    """``np.add.at(out, at, table[src])`` into ``n_rows`` zero rows: row ``src[i]`` of ``table`` added to row
    ``at[i]``, for i in order (each row's terms summed in the same order, so the same sums)."""
    out = np.zeros((n_rows, table.shape[1]))
    for i in range(len(at)):
        a, b = at[i], src[i]
        for j in range(table.shape[1]):
            out[a, j] = out[a, j] + table[b, j]
    return out


if numba is not None:
    segments = numba.njit(cache=True, nogil=True)(_segments)
    deal_many = numba.njit(cache=True, nogil=True)(_deal_many)
    stack_steps = numba.njit(cache=True, nogil=True)(_stack_steps)
    levels = numba.njit(cache=True, nogil=True)(_levels)
    reached = numba.njit(cache=True, nogil=True)(_reached)
    sum_rows = numba.njit(cache=True, nogil=True)(_sum_rows)
else:  # pragma: no cover
    segments = deal_many = stack_steps = levels = reached = sum_rows = None


def warm() -> None:
    """Compile (or load the cached compilation of) the kernels now, not inside a planning tick (after the first
    time in a process each call is microseconds: every estimator's construction asks)."""
    if segments is not None:  # (each looked up here: a caller may have set one aside)
        segments(np.array([100.0, 120.0]), np.array([5.0, 3.0]), np.array([True, False]), np.array([0, 0], np.int64),
                 1, np.array([1], np.int64))
    if deal_many is not None:
        deal_many(np.array([7.0, 8.0]), np.array([0, 1], np.int64), np.array([0, 2], np.int64),
                  np.array([0, 3], np.int64), np.array([True, True, False]), np.array([2], np.int64),
                  np.array([1], np.int64), np.array([10.0]))
    if levels is not None:
        levels(np.array([0.3, 0.1]), np.array([0, 0], np.int64), 1)
    if stack_steps is not None:
        one, f1, i1, b1 = np.ones(1), np.ones(1), np.zeros(1, np.int64), np.zeros(1, np.bool_)
        stack_steps(i1, one, one, one, 1, f1, f1, f1, np.ones((1, 1)), f1, f1, f1, 1.0, 1.0, 0.0, 1, True, f1, b1,
                    True, -1.0, 0.0, False)
    if sum_rows is not None:
        sum_rows(2, np.array([1, 0], np.int64), np.ones((2, 3)), np.array([0, 1], np.int64))
    if reached is not None:
        reached(np.array([0], np.int64), np.array([1.0]), np.array([0.0]), np.array([3.0]), np.zeros(1), 0.5, 1)
