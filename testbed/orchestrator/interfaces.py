"""The orchestrator's decisions as plug-in interfaces (pure), one registry each:

* :class:`Dispatcher` (:data:`DISPATCHERS`): where each request of a step's batch goes at the step's start,
  in what order, and which it keeps back in a pool to deal at later ticks (built-ins: ``contiguous``,
  ``random``);
* :class:`LayoutPlanner` (:data:`PLANNERS`): every server's layout at the step's start and, per planning tick,
  which servers switch to which layout (built-in: ``forecast``, the ARIMA-forecast planner);
* :class:`MigrationBalancer` (:data:`BALANCERS`): per planning tick, which requests move (built-in:
  ``load-index``, Llumnix's rule on the estimator's load index).

The built-ins are registered like any plug-in (``builtin`` names the planner's and the balancer's). A policy
composes one of each (``orchestrator.policies`` in a scenario, or the built-in ones: testbed.orchestrator.
policies). A plug-in is made with :meth:`create` from a :class:`PolicyContext` (what the built-ins see: the
estimator and its forecast, the cost model, the engine settings, the layouts a server may take, the clock,
a seeded generator: never the true response lengths) and its validated ``Params``. Its decisions go through
the same execution path as the built-ins' (testbed.planning, testbed.generation): switch costs charged,
migrations live on the emulator, the same timeline, report and oracle fraction; a decision that cannot be
carried out is an :class:`emulation.plugins.DecisionError` and stops the run. docs/plugins.md is the guide.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from emulation.plugins import Registry


@dataclass(frozen=True)
class PolicyContext:
    """What a plug-in sees, the same as the built-ins: ``estimator`` (testbed.orchestrator.estimate: predicted
    times under the cost model; its ``forecast`` is the current tick's length forecast), ``cost`` (the
    engines' step cost: ``switch_s``, ``step_s``, ``kv_capacity_tokens``), ``cost_model`` (agents.costmodel),
    ``gpus`` per server, ``layouts`` (those a server may take: they hold the model and a longest response),
    ``moe``, ``settings`` (the scenario's orchestrator settings, with this policy's engine settings),
    ``servers`` (the generator servers), ``prompt_tokens`` and ``max_response_tokens`` (the workload's
    prompt length and cap), ``clock()`` (backend seconds), ``rng`` (seeded from the scenario) and ``balanced``
    (whether the policy runs a balancer beside its planner: the built-in planner then leaves to it the gain
    a better placement of the current layout would bring)."""

    estimator: Any
    cost: Any
    cost_model: Any
    gpus: int
    layouts: tuple
    moe: bool
    settings: Any
    servers: tuple[int, ...]
    prompt_tokens: int
    max_response_tokens: int
    clock: Callable[[], float]
    rng: np.random.Generator = field(repr=False, default_factory=lambda: np.random.default_rng(0))
    balanced: bool = False  # a balancer runs beside the planner in this policy (on the same servers)

    def seats(self, layout) -> int:
        """Requests a server in ``layout`` runs at once at most (``max_num_seqs`` per replica)."""
        return layout.replicas(self.gpus) * self.settings.engine.max_num_seqs


class Plugin:
    """What every plug-in shares: ``Params`` (a frozen dataclass of its parameters, validated where the
    policy is defined; None: it takes none) and :meth:`create`."""

    Params = None

    @classmethod
    def create(cls, ctx: PolicyContext, params=None):
        """The plug-in for a run: ``cls(ctx, params)`` (``cls(ctx)`` without ``Params``)."""
        return cls(ctx) if cls.Params is None else cls(ctx, params)


# ---- dispatch ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """A step's batch at its start: ``n`` requests (indices 0..n-1, prompt by prompt), each one's
    ``prompt_id`` and ``prompt`` tokens; the live generator ``servers`` and their ``layouts``; the step's
    length ``forecast``; ``rng`` (the run's dealing stream: the built-in ``random`` draws from it)."""

    step: int
    n: int
    prompt_id: np.ndarray
    prompt: np.ndarray
    servers: tuple[int, ...]
    layouts: dict
    forecast: Any
    rng: np.random.Generator = field(repr=False)


@dataclass(frozen=True)
class Deal:
    """A dispatcher's answer: ``placed`` (server -> request indices, in the order they are queued), whether
    each server's share is cut in ``chunked`` consecutive chunks, one per replica (veRL), or each request goes
    to the least loaded replica; ``held``: indices kept back in the pool, dealt at later ticks
    (:meth:`Dispatcher.release`). Every index appears exactly once."""

    placed: dict
    chunked: bool = False
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass(frozen=True)
class Pool:
    """The pool at a planning tick: ``held`` (indices not dealt yet), the batch's ``prompt_id`` and ``prompt``,
    ``finished`` (index -> length of every request finished so far: what the collectors received), the
    servers' ``states`` (testbed.backends.base.ServerState: layout, snapshot, stats) and ``now``."""

    now: float
    step: int
    held: np.ndarray
    prompt_id: np.ndarray
    prompt: np.ndarray
    finished: dict
    states: dict


class Dispatcher(Plugin, abc.ABC):
    @abc.abstractmethod
    def deal(self, batch: Batch) -> Deal:
        """Where each request of ``batch`` goes at the step's start (and which are held back)."""

    def release(self, pool: Pool) -> dict:
        """At a planning tick while requests are held: server -> indices of ``pool.held`` to queue there now,
        in order (none: {}). Whatever is left stays held; a pool left with every server idle is an error."""
        return {}


# ---- planner -----------------------------------------------------------------------------------------
class LayoutPlanner(Plugin, abc.ABC):
    """Layouts of the generator servers. Views are testbed.orchestrator.planner.ServerView (layout, load:
    what the server holds with the forecast's remaining lengths, a switch in progress, the last switch's end,
    ``stats``: the engine's counters); decisions are testbed.orchestrator.planner.Decision
    (``Decision.stay`` / ``Decision.to`` make one)."""

    @abc.abstractmethod
    def initial(self, view, charged: bool = True):
        """The server's layout for a step, at its start (``charged``: a change pays the switch cost; the run's
        first step is not charged)."""

    @abc.abstractmethod
    def evaluate_all(self, views: dict, now: float, interval: float | None = None) -> dict:
        """At a planning tick: a Decision per server of ``views`` (``switch`` true: carried out now)."""

    def step_end(self, step: int, states: dict) -> None:
        """A step's generation ended; ``states``: every live server's last state (ServerState)."""


# ---- balancer ----------------------------------------------------------------------------------------
class MigrationBalancer(Plugin, abc.ABC):
    @abc.abstractmethod
    def moves(self, views: dict, rids: dict, now: float) -> list:
        """At a planning tick, on the servers not switching (``views``; ``rids``: each one's request ids, in
        its snapshot's order): the migrations to make, in order (testbed.orchestrator.balancer.Move: rid,
        src, dst, dst_replica, predicted gain)."""


DISPATCHERS = Registry("dispatch", Dispatcher, "dispatch", {
    "contiguous": "testbed.orchestrator.dispatch:Contiguous",
    "random": "testbed.orchestrator.dispatch:Random",
})
PLANNERS = Registry("planner", LayoutPlanner, "planners", {
    "forecast": "testbed.orchestrator.planner:Planner",
    "builtin": "testbed.orchestrator.planner:Planner",
})
BALANCERS = Registry("balancer", MigrationBalancer, "balancers", {
    "load-index": "testbed.orchestrator.balancer:Balancer",
    "builtin": "testbed.orchestrator.balancer:Balancer",
})
ROLES = {"dispatch": DISPATCHERS, "planner": PLANNERS, "balancer": BALANCERS}
OFF = "none"  # a policy's planner or balancer that is off


@dataclass(frozen=True)
class Component:
    """One resolved part of a policy: the reference it was named by, the class, its validated parameters."""

    ref: str
    cls: type = field(compare=False)
    params: Any = None

    def create(self, ctx: PolicyContext):
        return self.cls.create(ctx, self.params)
