"""The driver speaks to a cluster only through the Backend interface (testbed/backends/base.py), and what the
interface returns is typed: a run on a backend that has nothing but the interface is the very same run, and
the typed results keep the timeline's JSON as it was."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from emulation.scenario import load_scenario
from testbed import decision_priority as dp
from testbed.backends.base import (Backend, Handover, LayoutChange, MigrationResult, PhaseDecision, PhaseTiming)

ROOT = Path(__file__).resolve().parents[2]


class InterfaceOnly(Backend):
    """A backend with the interface's members and nothing else: each is handed to ``inner``. A driver that
    probed for anything outside the interface would fail here or run differently."""

    def __init__(self, inner: Backend):
        super().__init__(inner.scenario)
        self.name, self.poll_s, self._inner = inner.name, inner.poll_s, inner


def _forward(name: str):
    def call(self, *args, **kw):
        return getattr(self._inner, name)(*args, **kw)

    call.__name__ = name
    return call


for _name, _member in vars(Backend).items():
    if callable(_member) and not _name.startswith("_"):
        setattr(InterfaceOnly, _name, _forward(_name))
InterfaceOnly.__abstractmethods__ = frozenset()


@pytest.fixture(scope="module")
def small_exp():
    from testbed.runs.experiment import Experiment

    # its first step has migrations and a layout switch on the kernels-only cost model (fewer prompts, or an
    # engine profile's CPU time per step: no switch); the test is about the interface, not the model
    scn = load_scenario(ROOT / "scenarios" / "moe-small.yaml")
    orch = scn.orchestrator
    scn = dataclasses.replace(scn, orchestrator=dataclasses.replace(
        orch, engine=dataclasses.replace(orch.engine, profile="kernels")))
    return Experiment(scn, "simulated")


def _run(exp, wrap: bool):
    from testbed.driver import Driver

    p = exp.policy("orchestrrl")
    b = exp.backend(p)
    d = Driver(exp.scn, InterfaceOnly(b) if wrap else b, p, exp.settings)
    res = d.run(1)
    drop = ("decision_ms_p50", "decision_ms_p99")  # wall time of the decisions
    return {k: v for k, v in res.items() if k not in drop}, d.timeline


def test_a_backend_with_only_the_interface_runs_the_same_run(small_exp):
    res, tl = _run(small_exp, wrap=False)
    got, tl2 = _run(small_exp, wrap=True)
    kinds = {e["kind"] for e in tl.events}
    assert {"migration", "handover", "layout_switch", "fabric"} <= kinds  # every typed result is exercised
    assert json.dumps(got, default=str) == json.dumps(res, default=str)
    assert json.dumps(tl2.events) == json.dumps(tl.events) and json.dumps(tl2.samples) == json.dumps(tl.samples)


def test_simulated_results_are_typed_and_hand_overs_are_taken_once(small_exp):
    from testbed.backends.base import step_requests

    exp = small_exp
    p = exp.policy("static-TP1x8")
    b = exp.backend(p)
    src, dst = b.gen_servers[:2]
    sw = b.set_layout(dst, p.layout, free=True)
    assert isinstance(sw, LayoutChange) and sw.old == sw.new == p.layout and sw.end == sw.start
    req = step_requests(0, np.full(8, 400), np.arange(8), 256, np.zeros(8, np.int64))
    b.submit(src, req.specs(range(8)))
    b.wait_until(0.5)
    res = b.migrate(int(req.rid[0]), src, dst, "multi_stage")
    assert isinstance(res, MigrationResult) and res.result == "scheduled"
    b.wait_until(1.0)
    hs = b.take_handovers()
    assert [(h.rid, h.src, h.dst) for h in hs] == [(int(req.rid[0]), src, dst)] and b.take_handovers() == []
    h = hs[0]
    assert isinstance(h, Handover) and h.resumed >= h.stopped >= h.asked and h.downtime_s == h.resumed - h.stopped
    assert list(h.to_json()) == ["rid", "src", "dst", "mode", "asked", "stopped", "resumed", "downtime_s", "kv_bytes"]


def test_a_phase_decision_keeps_the_record_it_replaced():
    """A phase model's switch names the delay it weighed; an unchanged phase does not; the emulator's timing
    comes last (the timeline's ``fabric`` events, field by field)."""
    changed = PhaseDecision("stalled", 9.0, 0.0, 50.0, "no window", 9.0)
    assert changed.changed and list(changed.to_json()) == ["decision", "stall_ms", "window_ms", "gain_ms", "reason",
                                                           "delay_ms"]
    same = PhaseDecision("unchanged", 0.0, None, 0.0, "installed")
    assert not same.changed and list(same.to_json()) == ["decision", "stall_ms", "window_ms", "gain_ms", "reason"]
    timed = PhaseDecision("deferred", 0.0, 1.0, -math.inf, "slower", timing=PhaseTiming(None, 2.5))
    assert not timed.changed and timed.to_json()["overhead_ms"] is None and timed.to_json()["took_ms"] == 2.5
    assert list(timed.to_json())[-2:] == ["overhead_ms", "took_ms"]


def test_the_phase_model_decides_with_the_switching_rule(small_exp):
    from testbed.backends.phase_model import PhaseModel

    m = PhaseModel(small_exp.scn)
    d = m.decide("gen", "train", 0.0, 1e6)  # no window, a large gain: the rule stalls for the switch
    assert isinstance(d, PhaseDecision) and d.changed and d.delay_ms == m.delay_ms and d.stall_ms == m.delay_ms
    assert not m.decide("train", "train", 0.0, 1e6).changed


def test_a_tick_runs_at_real_time_priority_and_restores_the_threads_own():
    tid = threading.get_native_id()
    before = (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority, os.getpriority(os.PRIO_PROCESS, tid))
    with pytest.raises(RuntimeError):  # restored whatever the block raised
        with dp.raised_priority() as raised:
            inside = (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority)
            raise RuntimeError("the tick failed")
    assert (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority,
            os.getpriority(os.PRIO_PROCESS, tid)) == before
    if raised:  # root (CI): the thread ran real-time
        assert inside == (os.SCHED_RR, dp.DECISION_RT_PRIORITY)
    else:  # not permitted: the tick ran as it was
        assert inside == before[:2]


def test_a_refused_priority_leaves_the_tick_to_run(monkeypatch):
    def refuse(*a):
        raise PermissionError(1, "Operation not permitted")

    tid = threading.get_native_id()
    before = os.sched_getscheduler(tid)
    monkeypatch.setattr(dp.os, "sched_setscheduler", refuse)
    with dp.raised_priority() as raised:
        assert not raised
    assert os.sched_getscheduler(tid) == before
