"""Collectives as server-to-server demands ``(src, dst, bytes)`` for the flow simulator.

Bandwidth-bound, pipelined collectives are modelled by their concurrent neighbour transfers with the total
bytes each neighbour pair carries over the whole collective:

* ring all-reduce of ``S`` bytes over ``n`` members: every member sends ``2 (n-1)/n * S`` to the next one
  (reduce-scatter then all-gather in ``2 (n-1)`` lock-step chunks), so on a non-blocking fabric of member
  bandwidth ``B`` it takes ``2 (n-1)/n * S / B``;
* pipelined broadcast tree of ``S`` bytes with fan-out ``k``: every parent sends ``S`` to each of its ``k``
  children at once, so it takes ``k * S / B`` (a chain, ``k = 1``: ``S / B``);
* all-to-all of ``S`` bytes per member: ``S / n`` to each other member;
* point-to-point: one demand.

Latency is added by the caller (per lock-step) since it does not load links.
"""
from __future__ import annotations

from typing import Sequence

Demand = tuple[int, int, float]


def ring_allreduce(members: Sequence[int], size: float) -> list[Demand]:
    n = len(members)
    if n < 2 or size <= 0:
        return []
    per = 2.0 * (n - 1) / n * size
    return [(members[i], members[(i + 1) % n], per) for i in range(n)]


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
