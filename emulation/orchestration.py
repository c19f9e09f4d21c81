"""The orchestrator's settings: a scenario's ``orchestrator:`` section, typed (pure data and checks).

They live on the ground floor, beside the workload and the fabric specs, so that :func:`emulation.scenario.
load_scenario` validates the whole file at the boundary (an unknown key, a wrong type or an impossible value
is a SpecError naming its path, ``orchestrator.planner.min_gain_s: must be ...``) and every floor above
(the engine, RLSim, the orchestrator, the backends) reads one typed value:

* :class:`EngineSettings` (``orchestrator.engine``): the generation engines' vLLM-style knobs;
* :class:`ForecastSettings` (``orchestrator.forecast``): the length forecaster (testbed.orchestrator.forecast);
* :class:`PlannerSettings` (``orchestrator.planner``) and :class:`BalancerSettings` (``orchestrator.balancer``):
  the proactive planner's and the reactive balancer's rules (testbed.orchestrator.planner, .balancer);
* :class:`PolicySpec` (``orchestrator.policies``): policies a user composes of plug-ins (a dispatcher, a planner,
  a balancer, each a registered name or a path ``package.module:Class``; docs/plugins.md);
* :class:`OrchestratorSettings`: the section itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from .plugins import NAME_RE, check_ref
from .validation import SpecError, from_dict, require

STEP_MODES = ("sync", "async")
POLICY_ROLES = ("dispatch", "planner", "balancer")  # the parts a policy is composed of (testbed.orchestrator.interfaces)
MIGRATION_MODES = ("stop_copy", "multi_stage")  # how a request's KV moves (agents.migration_plan)
PAY_JUDGES = ("forecast", "truth")  # what the balancer's test that a move pays draws lengths from
PLANNER_LENGTHS = ("forecast", "truth")  # what the planner estimates on


@dataclass(frozen=True)
class EngineSettings:
    """Scheduler knobs with vLLM's names. Defaults: veRL's rollout defaults, ``max_num_seqs`` 1024 (per replica,
    vLLM semantics; vLLM's own default is 256) and ``max_num_batched_tokens`` 8192 (REFERENCE.md "Serving
    engines", "Engine settings users run"); ``gpu_memory_utilization`` 0.9 and ``block_size`` 16 (vLLM's
    defaults)."""

    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    rate_window_s: float = 2.0  # window of the recent decode tokens/s statistic
    # Not a vLLM knob: the fixed part of a layout switch (communicators, allocator, CUDA graphs), seconds;
    # None: the cost model's calibration (1 s). Published: live switches in milliseconds with pre-built
    # communicator pools (Flying Serving), 1-7 s TP/PP switches for 7B-70B (ReMP), minutes for a restart
    # (REFERENCE.md "Engine settings users run").
    switch_reinit_s: float | None = None
    # The serving engine whose per-step costs beyond its GPU kernels the cost model adds (emulation/data/
    # engines.yaml, agents/engineprofile.py): vllm-v1 (vLLM 0.8-0.13, the default), vllm-v1-async (0.14+), vllm-v0,
    # sglang; kernels: the kernels alone (the model before engine profiles, for side-by-side figures).
    profile: str = "vllm-v1"

    def __post_init__(self) -> None:
        from .workload import engine_names

        names = engine_names()
        require(self.profile in names, "profile", f"must be one of {', '.join(names)}, got {self.profile!r}")
        for n in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            v = getattr(self, n)
            require(isinstance(v, int) and v >= 1, n, f"must be an integer >= 1, got {v!r}")
        require(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                f"must be >= max_num_seqs ({self.max_num_seqs}) so every running request can decode each step")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}")
        require(math.isfinite(self.rate_window_s) and self.rate_window_s > 0, "rate_window_s",
                f"must be > 0, got {self.rate_window_s}")
        if self.switch_reinit_s is not None:
            require(isinstance(self.switch_reinit_s, (int, float)) and not isinstance(self.switch_reinit_s, bool)
                    and math.isfinite(self.switch_reinit_s) and 0 <= self.switch_reinit_s <= 600, "switch_reinit_s",
                    f"must be in [0, 600] seconds (or null: the calibration's), got {self.switch_reinit_s!r}")


@dataclass(frozen=True)
class ForecastSettings:
    """How the forecaster works (``orchestrator.forecast`` in a scenario); every field has a default.

    order, trend: the ARIMA's (p, d, q) and trend. (1, 1, 1) without a trend (``n``): the AR term on the
      step-to-step changes carries the recent growth forward and lets it fade, as DAPO's and R1's growth
      slows. With a drift (``t``) it extrapolated the window's average slope past a slowing growth: walk-forward
      MAPE 3.95% against 3.61% (``n``) on the dapo-drift case, 5.33% against 5.07% on a stationary one
      (testbed/benchmarks/bench_forecast.py cases, seeds 100-103; the benchmark's own seeds are 0-4). ``c`` / ``ct``
      suit only d = 0 (statsmodels allows trend terms of degree >= d only).
    history_steps: the fit uses at most the last 32 steps: a fit stays at tens of ms (PLATFORM.md: 20
      points, 30-40 ms) and follows a drift whose slope changes (DAPO's growth stalls and falls).
    min_arima_steps: fewer steps of history than this use ``fallback`` (8: see the module docstring).
    fallback: ``drift`` (needs >= 3 steps; fewer use ``last``) or ``last``.
    shape, shape_steps: ``empirical`` carries the shape of the last ``shape_steps`` steps (their
      log-quantiles, standardised and averaged: 8 steps average out the noise of a small step's tail and
      still follow a shape that changes over training) into the forecast, so a bimodal, heavy-tailed or
      capped step is forecast as such; ``lognormal`` assumes a lognormal (steps without log-quantiles too).
    min_sigma: floor on the forecast log-std (a near-uniform step has sigma ~0; a zero would make every
      request's remaining length a step function).
    online_update, online_max_iter, online_tol: :meth:`LengthForecast.updated`'s switch (the planner reads
      it), its EM iteration limit and its convergence tolerance on mu and sigma (log scale).
    """
    order: tuple[int, int, int] = (1, 1, 1)
    trend: Literal["n", "c", "t", "ct"] = "n"
    history_steps: int = 32
    min_arima_steps: int = 8
    fallback: Literal["drift", "last"] = "drift"
    shape: Literal["empirical", "lognormal"] = "empirical"
    shape_steps: int = 8
    min_sigma: float = 0.01
    online_update: bool = True
    online_max_iter: int = 50
    online_tol: float = 1e-4
    # prompt_groups: each running request's length is shifted by what its prompt's other samples have shown
    # (:func:`prompt_shifts`: a hard prompt's samples all run long); its share of the length's spread is
    # estimated from the run's finished steps (the workload's prompt_sigma is the prior before any).
    prompt_groups: bool = True

    def __post_init__(self) -> None:
        p, d, q = self.order
        for i, (name, v, hi) in enumerate((("p", p, 5), ("d", d, 2), ("q", q, 5))):
            require(0 <= v <= hi, f"order[{i}]", f"{name} must be in [0, {hi}], got {v}")
        lowest = {"n": None, "c": 0, "t": 1, "ct": 0}[self.trend]
        require(lowest is None or lowest >= d, "trend",
                f"{self.trend!r} has a trend term of degree {lowest}, which ARIMA does not allow with d = {d}; "
                f"use 'n'{' or t' if d <= 1 else ''}")
        params = p + q + (0 if self.trend == "n" else len(self.trend))
        require(self.min_arima_steps >= d + params + 2, "min_arima_steps",
                f"must be >= d + parameters + 2 = {d + params + 2} for order {self.order} with trend "
                f"{self.trend!r}, got {self.min_arima_steps}")
        require(self.history_steps >= self.min_arima_steps, "history_steps",
                f"must be >= min_arima_steps ({self.min_arima_steps}), got {self.history_steps}")
        require(self.history_steps <= 10_000, "history_steps", f"must be <= 10000, got {self.history_steps}")
        require(1 <= self.shape_steps <= 10_000, "shape_steps", f"must be in [1, 10000], got {self.shape_steps}")
        require(math.isfinite(self.min_sigma) and 0 < self.min_sigma <= 1, "min_sigma",
                f"must be in (0, 1], got {self.min_sigma}")
        require(1 <= self.online_max_iter <= 1000, "online_max_iter",
                f"must be in [1, 1000], got {self.online_max_iter}")
        require(math.isfinite(self.online_tol) and self.online_tol > 0, "online_tol",
                f"must be > 0, got {self.online_tol}")


@dataclass(frozen=True)
class PlannerSettings:
    """``orchestrator.planner`` in a scenario.

    layouts: candidate layout names ([] = every TP split of a server: TP1x8, TP2x4, TP4x2, TP8x1 for 8 GPUs;
      MoE models add the EP layouts).
    min_gain_s: a switch must save at least this much (seconds of remaining makespan) beyond its cost.
    gain_margin: ... and at least this fraction of the server's remaining makespan (hysteresis: a switch
      that only breaks even on a noisy forecast is not made).
    balanced_gain_margin: ``gain_margin`` where a balancer runs beside the planner (orchestrrl; None: the
      same). The planner's time for keeping a layout assumes its placement stays, and beside a balancer it
      does not: the balancer moves requests off the slow replicas, which a switch undoes (the engine re-deals
      a switched server's requests by KV, not by length) and stops while the server switches. 0.08 since
      2026-12-07: on the vllm-v0 map's 14 points orchestrrl's mean 1.124 -> 1.136 and its composition with the
      balancer alone (orchestrrl >= max(planner, balancer) - 0.5%) failing at 1 point instead of 3
      (docs/orchestrator.md "The margin beside a balancer", with the sweep and the cases it was not chosen on).
      Only where the server's current layout has several replicas (since 2026-12-07, later): on one replica
      (TP8x1) there is no levelling for a switch to undo, and the balanced margin held back a switch the
      planner alone gained 1.8% by (the default map, 16 per GPU, vllm-v0).
    cooldown_s: no second switch of a server within this time after the first one ended.
    lookahead: before switching, predict the server one planning interval later (estimate.Estimator.advance)
      and wait if switching then (to the then-best layout) is predicted to finish sooner: the best layout
      drifts towards larger TP as the batch drains, and a switch made too early pays its cost again later.
      Asked before the judgement over ``confirm_draws`` (since 2026-12-07): a switch it holds back is not
      judged, and beside a balancer its server is near a switch (left alone by the balancer) only where this
      tick's draw against the current layout re-placed clears the margin (docs/orchestrator.md "The lookahead
      before the judgement").
    lookahead_points: ... and also ``k/(n+1)`` of the switch's predicted time later, k = 1..n (0: one interval
      only): a layout kept for a while and switched later can beat switching now, which a comparison of
      each layout held to the end does not see (the start's plans of one later switch, initial_switch_points,
      do; the ticks then abandoned them: at seed 1, 64 per GPU, vllm-v0, the start's plan TP1x8 then TP8x1 was
      switched to TP4x2 two seconds in, where the switch oracle keeps TP1x8 to 63-102 s and then takes TP8x1).
    replace_patience: beside a balancer a switch is judged against the current layout re-placed (the balancer's
      to reach); after this many ticks in a row on which only that re-placement held a switch back, it is
      judged against the placement as it is (the balancer has not reached it). 0: the re-placement never holds
      a switch back on its own, and is not estimated. 20 since 2026-12-07 (was 0): a switch so held back leaves
      its server to the balancer (before, it stayed "near a switch" and the balancer left it alone, so the
      re-placement it was credited with could never be reached: the collapse at seed 4, 128 per GPU, vllm-v0,
      a server's switch held back for 260 s, that made the default 0); on the vllm-v0 map (seeds 1-9 at 64 and
      128 per GPU) orchestrrl is then within 0.5% of max(planner, balancer) at all 18 points, against 15 with 0
      (docs/orchestrator.md "The balancer reaches the server the planner leaves it").
    initial_margin: at a step's start another layout than the server's current one (at the run's first step
      the policy's start, the tuned static layout) is taken only when predicted faster by this fraction:
      nothing of the step is known yet but its forecast, so the estimates are at their least certain, and a
      wrong start is paid over the whole bulk of the step. 0.05, the ticks' gain_margin, since 2026-12-06
      (was 0.10): with the plans of one later switch, short-7b's start plan (TP1x8, then TP8x1) is predicted
      5.5% faster than the tuned TP8x1@512 and the switch oracle measures 5.4-6.3%; docs/orchestrator.md
      "Measured" has the sweep.
    confirm_draws: a switch the tick's estimate finds worth it is judged again on this many draws of which
      requests are the long ones (the stratified levels dealt by other hashes of the request ids) and made
      only if its mean gain exceeds the margin (1: this tick's draw alone). 4 since 2026-12-06: on one draw
      the planner flapped under vllm-v0 (24 switches in a step of 4 servers); docs/orchestrator.md.
    initial_switch_points: at a step's start each layout is judged by its best plan of at most one later
      switch, the switch tried after 1/(n+1), ..., n/(n+1) of the step's predicted time (the throughput
      layout for the bulk, a latency layout for the tail: the switch oracle's plan, on the forecast); 0:
      each layout for the whole step.
    lengths: what the planner estimates on: ``forecast`` (a policy: the forecast's stratified draws) or
      ``truth`` (simulated backend only): every request's true remaining length, at a step's start and at
      every tick (one draw, the truth: the judgement over other draws has none to judge). An oracle, not a
      policy: what the planner makes of its estimates when the lengths are known, so a run can tell what the
      forecast costs it from what its rule leaves (docs/orchestrator.md, "The estimator inside a step").
    """

    layouts: tuple[str, ...] = ()
    min_gain_s: float = 0.5
    gain_margin: float = 0.05
    balanced_gain_margin: float | None = 0.08
    cooldown_s: float = 2.0
    lookahead: bool = True
    lookahead_points: int = 3
    replace_patience: int = 20
    initial_margin: float = 0.05
    initial_switch_points: int = 3
    # a candidate predicted more than prune_ratio x slower than a server's best at a tick is skipped for that
    # server's next prune_ticks ticks (then looked at again): most candidates are far off most of the time, and
    # the decision path is the estimator's passes (0 ticks: every candidate every tick)
    prune_ratio: float = 1.25
    prune_ticks: int = 5
    confirm_draws: int = 4
    lengths: str = "forecast"

    def __post_init__(self) -> None:
        require(self.lengths in PLANNER_LENGTHS, "lengths",
                f"must be one of {', '.join(PLANNER_LENGTHS)}, got {self.lengths!r}")
        require(isinstance(self.confirm_draws, int) and 1 <= self.confirm_draws <= 16, "confirm_draws",
                f"must be in 1..16, got {self.confirm_draws!r}")
        for n in ("min_gain_s", "gain_margin", "cooldown_s"):
            v = getattr(self, n)
            require(math.isfinite(v) and v >= 0, n, f"must be a finite number >= 0, got {v}")
        require(self.gain_margin < 1, "gain_margin", f"must be < 1, got {self.gain_margin}")
        if self.balanced_gain_margin is not None:
            v = self.balanced_gain_margin
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1,
                    "balanced_gain_margin", f"must be a number in [0, 1) or null, got {v!r}")
        require(math.isfinite(self.initial_margin) and 0 <= self.initial_margin < 1, "initial_margin",
                f"must be in [0, 1), got {self.initial_margin}")
        require(isinstance(self.replace_patience, int) and 0 <= self.replace_patience <= 1000,
                "replace_patience", f"must be in 0..1000, got {self.replace_patience!r}")
        require(isinstance(self.lookahead_points, int) and 0 <= self.lookahead_points <= 20,
                "lookahead_points", f"must be in 0..20, got {self.lookahead_points!r}")
        require(isinstance(self.initial_switch_points, int) and 0 <= self.initial_switch_points <= 20,
                "initial_switch_points", f"must be in 0..20, got {self.initial_switch_points!r}")
        require(math.isfinite(self.prune_ratio) and self.prune_ratio > 1, "prune_ratio",
                f"must be > 1, got {self.prune_ratio}")
        require(isinstance(self.prune_ticks, int) and 0 <= self.prune_ticks <= 1000, "prune_ticks",
                f"must be in 0..1000, got {self.prune_ticks!r}")


@dataclass(frozen=True)
class BalancerSettings:
    """``orchestrator.balancer`` in a scenario (testbed/orchestrator/balancer.py's docstring gives the rule)."""

    threshold: float = 0.15
    min_gap_s: float = 1.0
    # a move must be predicted to save this much (s) of the two servers' makespan, and gain_margin of the source's
    # load index: smaller predicted gains are within the estimator's error and the move's own cost (the
    # simulated backend's counterfactual found most of them realised nothing or lost: docs/orchestrator.md)
    min_gain_s: float = 0.5
    gain_margin: float = 0.01
    max_migrations: int = 4
    candidates: int = 8
    mode: str = "multi_stage"
    # with pay_samples > 0, a move is also judged over that many draws of every request's remaining length from
    # the forecast: made only when it shortens the two servers' makespan on average and in at least
    # ``pay_probability`` of them (the quantiles cannot tell which replica holds a server's truly longest
    # request). Off by default: on MoE it raised the share of moves that paid but not the speedup, and cost
    # decision time (docs/orchestrator.md, "Moves that pay")
    pay_probability: float = 0.0
    pay_samples: int = 0
    # ``truth`` (simulated backend only): the test above judges each move on the requests' true remaining lengths
    # (one draw, the truth) instead of the forecast's draws. An oracle, not a policy: what a balancer that knew
    # which moves pay would do (docs/orchestrator.md "Moves that pay")
    pay_judge: str = "forecast"

    def __post_init__(self) -> None:
        require(math.isfinite(self.threshold) and 0 <= self.threshold < 1, "threshold",
                f"must be in [0, 1), got {self.threshold}")
        require(math.isfinite(self.min_gap_s) and self.min_gap_s >= 0, "min_gap_s", f"must be >= 0, got {self.min_gap_s}")
        require(math.isfinite(self.min_gain_s) and self.min_gain_s >= 0, "min_gain_s",
                f"must be >= 0, got {self.min_gain_s}")
        require(math.isfinite(self.gain_margin) and 0 <= self.gain_margin < 1, "gain_margin",
                f"must be in [0, 1), got {self.gain_margin}")
        require(0 <= self.max_migrations <= 1000, "max_migrations", f"must be in 0..1000, got {self.max_migrations}")
        require(1 <= self.candidates <= 1000, "candidates", f"must be in 1..1000, got {self.candidates}")
        require(math.isfinite(self.pay_probability) and 0 <= self.pay_probability <= 1, "pay_probability",
                f"must be in [0, 1], got {self.pay_probability}")
        require(0 <= self.pay_samples <= 4096, "pay_samples", f"must be in 0..4096, got {self.pay_samples}")
        require(self.pay_judge in PAY_JUDGES, "pay_judge",
                f"must be one of {', '.join(PAY_JUDGES)}, got {self.pay_judge!r}")
        require(self.mode in MIGRATION_MODES, "mode", f"must be one of {', '.join(MIGRATION_MODES)}, got {self.mode!r}")


@dataclass(frozen=True)
class PolicySpec:
    """A policy composed of plug-ins (``orchestrator.policies`` in a scenario, or ``compare --policies``):
    ``name`` (how the report names it), ``dispatch`` (None: the scenario's ``orchestrator.dispatch``),
    ``planner`` and ``balancer`` (``none``: off), each a registered name, a path ``package.module:Class`` or an
    entry point; ``params``: per part, its parameters (``{planner: {threshold: 1.05}}``), validated against the
    plug-in's own ``Params`` when the testbed resolves it (testbed.orchestrator.policies), before anything
    starts. Without a planner the servers keep one layout (the tuned static one in a comparison). ``start``: the
    layout the servers are loaded in before the first step (a name such as ``TP1x8``; None: the tuned static
    layout): a planner's first step keeps it or moves from it, a policy without a planner runs on it throughout.
    ``best``: the layout where this policy itself does best, tuned as the static baseline is (the policy run
    from every feasible layout on the simulated backend, its own steps and seed; testbed/runs/experiment.py)."""

    name: str
    dispatch: str | None = None
    planner: str = "none"
    balancer: str = "none"
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    start: str | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and bool(NAME_RE.match(self.name)), "name",
                f"must be a name of letters, digits and -_.+ (no commas or brackets), got {self.name!r}")
        require(not self.name.startswith("static-"), "name", "static-* names the static configurations")
        for role in POLICY_ROLES:
            ref = getattr(self, role)
            if ref is not None:
                check_ref(ref, role)
        for role in self.params:
            require(role in POLICY_ROLES, f"params.{role}", f"unknown part (known: {', '.join(POLICY_ROLES)})")
            if getattr(self, role) in (None, "none"):
                raise SpecError(f"params.{role}", f"the policy has no {role} to take parameters")
        if self.start is not None:
            require(isinstance(self.start, str) and bool(self.start), "start",
                    f"must be a layout name or 'best', got {self.start!r}")


def _check_policies(specs: tuple[PolicySpec, ...]) -> None:
    seen = set()
    for i, p in enumerate(specs):
        require(p.name not in seen, f"policies[{i}].name", f"{p.name!r} is defined twice")
        seen.add(p.name)


@dataclass(frozen=True)
class OrchestratorSettings:
    """planning_interval_s: how often the planner and the balancer look (backend seconds).
    step_mode: ``sync`` (generate -> train -> sync weights, one after the other: on-policy) or ``async``
      (one step off policy: generation of step k+1 overlaps training of step k; the weights of step k go
      out when its training ends, and step k+2's generation waits for them).
    engine: the generation engines' vLLM-style knobs (max_num_seqs, max_num_batched_tokens, ...).
    dispatch: the dispatcher every policy deals a step's batch with unless it names its own: ``contiguous``
      (veRL: equal consecutive chunks of the batch, whole prompt groups per server), ``random``, or a plug-in
      (testbed.orchestrator.interfaces.DISPATCHERS).
    policies: policies composed of plug-ins (:class:`PolicySpec`), compared beside the built-in ones.
    """

    planning_interval_s: float = 1.0
    step_mode: Literal[STEP_MODES] = "sync"
    engine: EngineSettings = field(default_factory=EngineSettings)
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    balancer: BalancerSettings = field(default_factory=BalancerSettings)
    forecast: ForecastSettings = field(default_factory=ForecastSettings)
    sync_bucket_mb: float = 512.0  # veRL's update_weights_bucket_megabytes (real MB; scaled on the fabric)
    dispatch: str = "contiguous"  # how a step's batch is dealt to the servers (a dispatcher's name or path)
    policies: tuple[PolicySpec, ...] = ()

    def __post_init__(self) -> None:
        require(math.isfinite(self.planning_interval_s) and 0.01 <= self.planning_interval_s <= 600,
                "planning_interval_s", f"must be in [0.01, 600], got {self.planning_interval_s}")
        require(math.isfinite(self.sync_bucket_mb) and 0 < self.sync_bucket_mb <= 65536, "sync_bucket_mb",
                f"must be in (0, 65536], got {self.sync_bucket_mb}")
        check_ref(self.dispatch, "dispatch")
        _check_policies(self.policies)


def orchestrator_settings(data: Mapping[str, Any] | None) -> OrchestratorSettings:
    return from_dict(OrchestratorSettings, dict(data or {}), "orchestrator")
