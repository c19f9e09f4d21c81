"""Flow-level network simulation: max-min fair sharing, recomputed whenever a transfer arrives or finishes.

A *link* is a directed pipe with a capacity in bytes/s (it may stand for a bundle of parallel physical
links with ideal load balancing). A *transfer* moves ``size`` bytes from its arrival time on; it is carried
by one or more *subflows*, each a path (a list of link ids). Rates are max-min fair over subflows
(progressive filling: every unfrozen subflow grows at the same pace; subflows crossing a saturated link
freeze), and a transfer's rate is the sum of its subflows' rates (multipath, like ECMP over several paths
or MPTCP with uncoupled subflows). Between events rates are constant, so the simulation jumps from event to
event: an arrival or the earliest finish. Finishes within a relative tolerance are merged into one event,
which keeps symmetric collectives (thousands of equal flows) to a handful of events.

A transfer may carry a ``latency`` (seconds) added to its finish: its links count as in use until then, so
per-step latency of a collective is not mistaken for idle time. ``link_first_busy`` / ``link_last_busy`` give,
per link, the first and last time it was in use.

Everything is vectorised with numpy on the (subflow, link) incidence lists.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

REL_TOL = 1e-9


def max_min_rates(capacity: np.ndarray, sf_of_inc: np.ndarray, link_of_inc: np.ndarray, n_subflows: int,
                  active: np.ndarray | None = None) -> np.ndarray:
    """Max-min fair rates of ``n_subflows`` subflows on links of ``capacity``.

    The incidence lists say that subflow ``sf_of_inc[i]`` crosses link ``link_of_inc[i]``. ``active`` (bool per
    subflow) leaves the others at rate 0. A subflow that crosses no link gets rate ``inf``.
    """
    capacity = np.asarray(capacity, dtype=float)
    n_links = len(capacity)
    rate = np.zeros(n_subflows)
    unfrozen = np.ones(n_subflows, bool) if active is None else active.astype(bool).copy()
    if not unfrozen.any():
        return rate
    crosses = np.bincount(sf_of_inc, minlength=n_subflows) > 0
    rate[unfrozen & ~crosses] = np.inf
    unfrozen &= crosses
    rem = capacity.copy()
    while unfrozen.any():
        inc_on = unfrozen[sf_of_inc]
        count = np.bincount(link_of_inc[inc_on], minlength=n_links)
        used = count > 0
        share = np.full(n_links, np.inf)
        share[used] = rem[used] / count[used]
        step = share.min()
        rate[unfrozen] += step
        rem[used] -= step * count[used]
        saturated = used & (rem <= REL_TOL * np.maximum(capacity, 1.0))
        rem[saturated] = 0.0
        hit = np.zeros(n_subflows, bool)
        hit[sf_of_inc[inc_on & saturated[link_of_inc]]] = True
        if not hit.any():  # numerical corner: freeze the subflows of the tightest link
            tight = used & (share <= step * (1 + 1e-6))
            hit[sf_of_inc[inc_on & tight[link_of_inc]]] = True
        unfrozen &= ~hit
    return rate


@dataclass
class Transfer:
    size: float  # bytes
    paths: Sequence[Sequence[int]]  # one list of link ids per subflow
    arrival: float = 0.0
    tag: int = 0  # caller's label (e.g. which collective)
    latency: float = 0.0  # seconds added to the transfer's finish (per-step latency of a collective)


@dataclass
class FlowResult:
    finish: np.ndarray  # per transfer, seconds
    makespan: float  # last finish (0 with no transfers)
    link_last_busy: np.ndarray  # per link, last time it carried traffic (-inf: never)
    link_bytes: np.ndarray  # per link, bytes carried
    events: int = 0
    link_first_busy: np.ndarray | None = None  # per link, first time it carried traffic (inf: never)
    tags: dict = field(default_factory=dict)  # tag -> last finish of that tag


def simulate(capacity: np.ndarray, transfers: Sequence[Transfer], max_events: int = 1_000_000) -> FlowResult:
    """Run ``transfers`` on links of ``capacity`` (bytes/s) until every transfer is done."""
    capacity = np.asarray(capacity, dtype=float)
    if (capacity <= 0).any() or not np.isfinite(capacity).all():
        raise ValueError("link capacities must be finite and > 0")
    n_links = len(capacity)
    n = len(transfers)
    finish = np.full(n, np.nan)
    last_busy = np.full(n_links, -np.inf)
    first_busy = np.full(n_links, np.inf)
    link_bytes = np.zeros(n_links)
    if n == 0:
        return FlowResult(finish, 0.0, last_busy, link_bytes, link_first_busy=first_busy)
    sizes = np.array([t.size for t in transfers], dtype=float)
    if (sizes < 0).any() or not np.isfinite(sizes).all():
        raise ValueError("transfer sizes must be finite and >= 0")
    arrival = np.array([t.arrival for t in transfers], dtype=float)
    sf_tr, inc_sf, inc_link = [], [], []
    k = 0
    for i, t in enumerate(transfers):
        for p in t.paths:
            sf_tr.append(i)
            inc_sf.extend([k] * len(p))
            inc_link.extend(p)
            k += 1
    sf_tr = np.asarray(sf_tr, dtype=np.int64)
    inc_sf = np.asarray(inc_sf, dtype=np.int64)
    inc_link = np.asarray(inc_link, dtype=np.int64)
    if len(inc_link) and (inc_link.min() < 0 or inc_link.max() >= n_links):
        raise ValueError("a path names a link that does not exist")
    n_sf = k
    has_sf = np.bincount(sf_tr, minlength=n) > 0 if n_sf else np.zeros(n, bool)
    remaining = sizes.copy()
    done = np.zeros(n, bool)
    # transfers with no bytes or no subflow (nothing to carry) finish on arrival
    instant = (sizes == 0) | ~has_sf
    finish[instant] = arrival[instant]
    done[instant] = True
    now = float(arrival[~done].min()) if (~done).any() else 0.0
    events = 0
    while not done.all():
        events += 1
        if events > max_events:
            raise RuntimeError(f"flow simulation did not converge in {max_events} events")
        live = (~done) & (arrival <= now * (1 + REL_TOL) + 1e-15)
        if not live.any():
            now = float(arrival[~done].min())
            continue
        live_sf = live[sf_tr]
        sf_rate = np.zeros(n_sf)
        if live_sf.any():
            # compact to the live subflows: cost per event follows the live set, not every transfer
            ids = np.nonzero(live_sf)[0]
            remap = np.full(n_sf, -1, dtype=np.int64)
            remap[ids] = np.arange(len(ids))
            sel = live_sf[inc_sf]
            sf_rate[ids] = max_min_rates(capacity, remap[inc_sf[sel]], inc_link[sel], len(ids))
        tr_rate = np.bincount(sf_tr, weights=sf_rate, minlength=n) if n_sf else np.zeros(n)
        with np.errstate(divide="ignore", invalid="ignore"):
            ttf = np.where(live & (tr_rate > 0), remaining / tr_rate, np.inf)
        t_fin = ttf.min()
        pending = (~done) & ~live
        t_arr = (arrival[pending].min() - now) if pending.any() else np.inf
        dt = min(t_fin, t_arr)
        if not np.isfinite(dt):
            raise RuntimeError("live transfers make no progress (a link with no capacity?)")
        moved = np.where(live, np.minimum(tr_rate * dt, remaining), 0.0)
        remaining -= moved
        busy_sf = sf_rate > 0
        if busy_sf.any():
            inc_busy = busy_sf[inc_sf]
            lb = np.bincount(inc_link[inc_busy], weights=np.minimum(sf_rate[inc_sf[inc_busy]], 1e300) * dt,
                             minlength=n_links)
            link_bytes += lb
            busy_links = np.unique(inc_link[inc_busy])
            last_busy[busy_links] = now + dt
            first_busy[busy_links] = np.minimum(first_busy[busy_links], now)
        now += dt
        fin = live & ((remaining <= REL_TOL * np.maximum(sizes, 1.0)) | (ttf <= dt * (1 + 1e-6) + 1e-15))
        remaining[fin] = 0.0
        finish[fin] = now
        done |= fin
    # latency: a transfer's links stay in use until it finishes, latency included (not idle time)
    lat = np.array([t.latency for t in transfers], dtype=float)
    if (lat < 0).any() or not np.isfinite(lat).all():
        raise ValueError("transfer latencies must be finite and >= 0")
    if lat.any():
        finish += lat
        if len(inc_link):
            used = last_busy[inc_link] > -np.inf
            np.maximum.at(last_busy, inc_link[used], finish[sf_tr[inc_sf[used]]])
    tags: dict = {}
    for i, t in enumerate(transfers):
        tags[t.tag] = max(tags.get(t.tag, 0.0), float(finish[i]))
    return FlowResult(finish, float(np.nanmax(finish)), last_busy, link_bytes, events, link_first_busy=first_busy, tags=tags)
