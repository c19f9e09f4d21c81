"""The built-in dispatchers (pure), registered in testbed.orchestrator.interfaces.DISPATCHERS like any plug-in:

* ``contiguous``: veRL's dispatch: the batch (prompt by prompt, each prompt's samples together) cut in equal
  consecutive chunks, one per server, and each server's share in consecutive chunks, one per replica;
* ``random``: every request to a random server (balanced counts), each on the least loaded replica.
"""
from __future__ import annotations

import numpy as np

from .interfaces import Batch, Deal, Dispatcher


def contiguous(n: int, servers: list[int]) -> dict[int, np.ndarray]:
    """veRL's deal: the batch (prompt by prompt, each prompt's samples together) cut in equal consecutive
    chunks, one per server, so a server gets whole prompt groups: server -> request indices."""
    bounds = np.linspace(0, n, len(servers) + 1).round().astype(int)
    return {s: np.arange(bounds[k], bounds[k + 1]) for k, s in enumerate(servers)}


def random_deal(n: int, servers: list[int], rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Every request to a random server, balanced counts: server -> request indices (in index order)."""
    order = rng.permutation(n)
    return {s: np.sort(order[k::len(servers)]) for k, s in enumerate(servers)}


class Contiguous(Dispatcher):
    def __init__(self, ctx):
        self.ctx = ctx

    def deal(self, batch: Batch) -> Deal:
        return Deal(contiguous(batch.n, list(batch.servers)), chunked=True)


class Random(Dispatcher):
    def __init__(self, ctx):
        self.ctx = ctx

    def deal(self, batch: Batch) -> Deal:
        return Deal(random_deal(batch.n, list(batch.servers), batch.rng), chunked=False)
