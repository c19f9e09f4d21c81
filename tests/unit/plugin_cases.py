"""Plug-ins the plug-in tests name by dotted path (``plugin_cases:Name``): well-formed ones, malformed ones (each
refused naming the field) and ones whose decisions cannot be carried out (each stops the run)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agents.engine import Layout
from emulation.validation import require
from testbed.orchestrator.balancer import Move
from testbed.orchestrator.interfaces import Deal, Dispatcher, LayoutPlanner, MigrationBalancer
from testbed.orchestrator.planner import Decision


class KeepPlanner(LayoutPlanner):
    """Every server in its layout; what it saw recorded (what a plug-in may see)."""

    seen: list = []

    @dataclass(frozen=True)
    class Params:
        layout: str = "TP1x8"
        margin: float = 0.5

        def __post_init__(self) -> None:
            require(0 <= self.margin < 1, "margin", f"must be in [0, 1), got {self.margin}")

    def __init__(self, ctx, params):
        self.ctx, self.p = ctx, params

    def initial(self, view, charged=True):
        return Decision.to(view, Layout.parse(self.p.layout, self.ctx.gpus), "fixed")

    def evaluate_all(self, views, now, interval=None):
        KeepPlanner.seen.append({s: (v.load.n, v.stats is not None) for s, v in views.items()})
        return {s: Decision.stay(v, "keep") for s, v in views.items()}


class HugeTP(KeepPlanner):
    """Asks for 16 GPUs per replica on an 8-GPU server: a layout no server can hold."""

    def evaluate_all(self, views, now, interval=None):
        return {s: Decision.to(v, Layout(tp=16), "too big") for s, v in views.items()}


class GhostMove(MigrationBalancer):
    """Moves a request no server holds."""

    def __init__(self, ctx):
        self.ctx = ctx

    def moves(self, views, rids, now):
        s = sorted(views)
        return [Move(rid=123456789, src=s[0], dst=s[-1])]


class Twice(Dispatcher):
    """Deals request 0 to two servers."""

    def __init__(self, ctx):
        self.ctx = ctx

    def deal(self, batch):
        placed = {s: np.arange(k, batch.n, len(batch.servers)) for k, s in enumerate(batch.servers)}
        first = batch.servers[0]
        placed[batch.servers[-1]] = np.r_[0, placed[batch.servers[-1]]] if first != batch.servers[-1] else placed[first]
        return Deal(placed)


class Hoarder(Dispatcher):
    """Holds every request and never releases any."""

    def __init__(self, ctx):
        self.ctx = ctx

    def deal(self, batch):
        return Deal({}, held=np.arange(batch.n))


class Trickle(Dispatcher):
    """Half the batch at the start, the rest one server's worth per tick; records what each tick showed."""

    pools: list = []

    def __init__(self, ctx):
        self.ctx = ctx

    def deal(self, batch):
        half = np.arange(batch.n // 2)
        return Deal({s: half[k::len(batch.servers)] for k, s in enumerate(batch.servers)},
                    held=np.arange(batch.n // 2, batch.n))

    def release(self, pool):
        held = {int(r) for st in pool.states.values() for r in st.snapshot["rid"]}
        Trickle.pools.append((set(pool.finished), set(pool.held.tolist()), held, pool.step))
        s = sorted(pool.states)[0]
        return {s: pool.held[:4]}


class NotAClass:  # an instance is not a plug-in class
    pass


NOT_A_CLASS = NotAClass()


class NoMethods:
    """Implements nothing of any interface."""


class BadParams(LayoutPlanner):
    Params = 42  # not a dataclass

    def initial(self, view, charged=True):
        return Decision.stay(view, "")

    def evaluate_all(self, views, now, interval=None):
        return {}
