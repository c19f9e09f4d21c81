"""What the RL step driver needs from a cluster, behind one interface, so the planner and the balancer run
unchanged against real agents on the emulated fabric (``emulated``) or the same engine in virtual time with
RLSim's network (``simulated``).

Times are real-time-equivalent seconds on the backend's own clock (:meth:`Backend.now`): wall time divided by
the time-dilation factor on the emulator, virtual time in the simulator.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field, fields

import numpy as np

from agents.engine import Layout


@dataclass(frozen=True)
class StepRequests:
    """One RL step's responses: ids, prompt lengths, target lengths (the workload's; hidden from policies),
    prompt ids, and the trainer collector each streams to."""

    step: int
    rid: np.ndarray
    prompt: np.ndarray
    target: np.ndarray
    prompt_id: np.ndarray
    dest: np.ndarray

    @property
    def n(self) -> int:
        return len(self.rid)

    def specs(self, idx) -> list[dict]:
        return [{"rid": int(self.rid[i]), "prompt": int(self.prompt[i]), "target": int(self.target[i]),
                 "dest": int(self.dest[i])} for i in idx]


RID_STRIDE = 1 << 24  # request id = step * RID_STRIDE + sample index


def step_requests(step: int, lengths: np.ndarray, prompt_ids: np.ndarray, prompt_tokens: int,
                  dest: np.ndarray) -> StepRequests:
    """``dest``: the collector of every request (the driver gives each generator server one collector, so a
    decode step's tokens leave a server in one message)."""
    n = len(lengths)
    idx = np.arange(n, dtype=np.int64)
    return StepRequests(step, step * RID_STRIDE + idx, np.full(n, prompt_tokens, np.int64),
                        np.asarray(lengths, np.int64), np.asarray(prompt_ids, np.int64), np.asarray(dest, np.int64))


@dataclass
class ServerState:
    """A generator server at a planning tick, as every backend reports it."""

    server: int
    layout: Layout
    snapshot: dict  # agents.engine.Engine.snapshot() arrays
    stats: dict  # agents.engine.Engine.stats()
    busy_until: float = 0.0  # end of a layout switch in progress (0: none)


@dataclass(frozen=True)
class LayoutChange:
    """A layout switch a backend started (:meth:`Backend.set_layout`): from ``old`` to ``new``, asked at
    ``requested``, the server not decoding from ``start`` to ``end`` (``switch_s`` long)."""

    old: Layout
    new: Layout
    requested: float
    start: float
    end: float
    switch_s: float


@dataclass(frozen=True)
class MigrationResult:
    """A migration a backend carried out or scheduled (:meth:`Backend.migrate`). ``result``: ``moved`` (the
    emulator: handed over), ``finished`` (it ended before it could stop), ``scheduled`` (the simulator: the
    hand-over happens in virtual time, reported by :meth:`Backend.take_handovers`); ``downtime_s`` and
    ``kv_bytes`` where known now (what a move realised: :meth:`Backend.tick_gains`)."""

    rid: int
    result: str
    downtime_s: float | None = None
    kv_bytes: float | None = None


@dataclass(frozen=True)
class Handover:
    """A migration's hand-over once it happened in virtual time (the simulated backend): asked at ``asked``,
    the request stopped on ``src`` at ``stopped`` and resumed on ``dst`` at ``resumed``."""

    rid: int
    src: int
    dst: int
    mode: str
    asked: float
    stopped: float
    resumed: float
    downtime_s: float
    kv_bytes: float

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class PhaseTiming:
    """What a phase change cost the emulator's driver: the controller's own overhead (None: not reported or no
    controller) and the REST round trip, in milliseconds."""

    overhead_ms: float | None
    took_ms: float


@dataclass(frozen=True)
class PhaseDecision:
    """The fabric's answer to a phase change (:meth:`Backend.set_phase`): the rule's decision (``switched``,
    ``stalled``, ``deferred``, ``unchanged``, ``static``...), the stall it cost, the window and gain it was
    given, why; ``delay_ms``: the switching delay the rule weighed (where the phase model decided a change);
    ``timing``: the emulator's controller round trip."""

    decision: str | None
    stall_ms: float
    window_ms: float | None
    gain_ms: float | None
    reason: str | None
    delay_ms: float | None = None
    timing: PhaseTiming | None = None

    @property
    def changed(self) -> bool:
        """The phase's circuits are installed now (switched, or stalled until they were)."""
        return self.decision in ("switched", "stalled")

    def to_json(self) -> dict:
        """The record's fields in their order (the timeline's ``fabric`` events): ``delay_ms`` only where the
        rule weighed one, the timing only where there is one."""
        out = {"decision": self.decision, "stall_ms": self.stall_ms, "window_ms": self.window_ms,
               "gain_ms": self.gain_ms, "reason": self.reason}
        if self.delay_ms is not None:
            out["delay_ms"] = self.delay_ms
        if self.timing is not None:
            out.update(overhead_ms=self.timing.overhead_ms, took_ms=self.timing.took_ms)
        return out


@dataclass
class PhaseResult:
    phase: str
    start: float
    end: float
    detail: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


class Job:
    """A phase running beside generation (the asynchronous mode): ``done()`` never blocks; ``wait()`` returns
    its PhaseResult once it is over."""

    def done(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def wait(self) -> PhaseResult:  # pragma: no cover - interface
        raise NotImplementedError

    def end_hint(self) -> float | None:
        """When the job ends, if the backend knows it in advance (virtual time); None otherwise."""
        return None


class ThreadJob(Job):
    """A phase run on a thread (the emulated backend: its RPCs wait on real agents)."""

    def __init__(self, fn, *args):
        import threading

        self._res = None
        self._err = None
        self._t = threading.Thread(target=self._run, args=(fn, args), daemon=True, name="phase-job")
        self._t.start()

    def _run(self, fn, args) -> None:
        try:
            self._res = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in wait()
            self._err = e

    def done(self) -> bool:
        return not self._t.is_alive()

    def wait(self) -> PhaseResult:
        self._t.join()
        if self._err is not None:
            raise self._err
        return self._res


class Backend(abc.ABC):
    name = "backend"
    poll_s: float | None = 0.05  # how often the driver looks for the end of generation between planning ticks
                                 # (backend seconds); None: the backend's wait_until(until_idle=True) stops there

    def __init__(self, scenario):
        self.scenario = scenario
        spec, layout = scenario.fabric, scenario.layout
        self.gen_servers = layout.gen_servers(spec)
        self.train_servers = layout.train_servers(spec)
        self.gpus = spec.gpus_per_server

    # ---- time ----
    @abc.abstractmethod
    def now(self) -> float: ...

    @abc.abstractmethod
    def wait_until(self, t: float, until_idle: bool = False) -> None:
        """Let generation run until backend time ``t`` (``until_idle``: or until it has no work left, where
        the backend can tell: the simulated one stops its clock at the last step's end, and at a server's
        failure, which the generation loop acts on when it happens)."""

    # ---- generation ----
    @abc.abstractmethod
    def layouts(self) -> dict[int, Layout]: ...

    @abc.abstractmethod
    def set_layout(self, server: int, layout: Layout, free: bool = False) -> LayoutChange:
        """Start a layout switch. ``free``: no switch cost (a step
        boundary: the new weights are loaded in the new layout anyway)."""

    @abc.abstractmethod
    def submit(self, server: int, requests: list[dict], chunked: bool = False) -> None:
        """Queue requests on a server (``chunked``: consecutive chunks per replica, veRL's dispatch)."""

    @abc.abstractmethod
    def states(self, deadline_s: float | None = None, fail_after_s: float | None = None) -> dict[int, ServerState]:
        """Every live generator server's state, asked of all at once. ``deadline_s`` (a planning tick's): a
        server that does not answer within it is left out; it is failed (failures() names it) at once, or,
        given ``fail_after_s``, if it has not answered that long after the call (left out until it does)."""

    @abc.abstractmethod
    def migrate(self, rid: int, src: int, dst: int, mode: str, replica: int | None = None,
                predicted_gain_s: float | None = None) -> MigrationResult:
        """Move request ``rid`` from server ``src`` to ``dst`` (onto its replica ``replica``)."""

    def tick_gains(self, rids: list[int]) -> tuple[dict[int, float], float | None]:
        """A tick's moves (``rids``), where the backend can tell (the simulated one, with its counterfactual
        on): each one's realised gain held against the same tick without it, and the tick's moves together
        against none of them. ({}, None) where it cannot."""
        return {}, None

    true_remaining = None  # the simulated backend's: request ids -> their true remaining tokens (an oracle's input)

    @abc.abstractmethod
    def finished_count(self, deadline_s: float | None = None) -> int:
        """Requests of the current step that produced their last token (-1: unknown within ``deadline_s``)."""

    @abc.abstractmethod
    def end_generation(self, req: StepRequests) -> dict:
        """After the last request finished: what was delivered ({rid: tokens}), per-request finish times,
        ``ended_at`` (when the last token was produced: the backend's clock resumes from there) and the token
        accounting of the step: ``tokens_unique`` (distinct (request, position) tokens that reached a
        collector), ``duplicates`` (tokens that arrived again) and ``tokens_by_agent`` ({server: {"received",
        "unique"}}: what reached the collectors from each server, a failed one's up to its death)."""

    def in_flight(self) -> int:
        """Migrations under way (their request is on no server for a moment)."""
        return 0

    def take_handovers(self) -> list[Handover]:
        """The hand-overs that happened since the last call, taken (a backend whose migrations complete in its
        own time, the simulated one; the emulator's :meth:`migrate` answers once its hand-over is done)."""
        return []

    # ---- fabric and the other phases ----
    @abc.abstractmethod
    def set_phase(self, phase: str, window_ms: float | None, gain_ms: float | None) -> PhaseDecision:
        """Ask for the phase's circuits; the controller's decision (switched/stalled/deferred) and timing."""

    @abc.abstractmethod
    def sync_weights(self, step: int) -> PhaseResult: ...

    @abc.abstractmethod
    def train(self, step: int, lengths: np.ndarray) -> PhaseResult: ...

    def start_train(self, step: int, lengths: np.ndarray) -> Job:
        """Training beside generation (asynchronous mode)."""
        return ThreadJob(self.train, step, lengths)

    def start_sync(self, step: int) -> Job:
        """Weight sync beside generation (asynchronous mode)."""
        return ThreadJob(self.sync_weights, step)

    # ---- health and fidelity ----
    def failures(self) -> dict[int, str]:
        """Every server known to have failed, with why (cheap: no call to anyone)."""
        return {}

    def lost_requests(self, server: int, held: set[int] | None = None) -> dict[int, int]:
        """Unfinished requests last seen on the failed ``server`` and held by no live one (``held``), with the
        tokens already delivered of each (where a re-queue resumes)."""
        return {}

    def stranded(self, held: set[int] | None = None, deadline_s: float | None = None) -> dict[int, int]:
        """Requests that finished but whose tokens a failed server sent never all arrived (it died with them
        queued), held by no live server (``held``): {rid: tokens delivered from the start without a gap},
        where a repair resumes them; asked within ``deadline_s`` (nothing when that passes). None where tokens
        cannot be lost (the simulated backend)."""
        return {}

    def fidelity(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
