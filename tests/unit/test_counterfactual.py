"""What a migration really gained (the simulated backend's counterfactual, SimulatedBackend.tick_gains) is the
difference between two whole runs: the same run with the tick's moves and without that one (or without any of
them), each carried to the end of the step with no later decision."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from emulation.scenario import load_scenario
from testbed.backends.base import step_requests
from testbed.backends.simulated import SimulatedBackend
from testbed.orchestrator.balancer import PAID_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exp():
    from testbed.runs.experiment import Experiment

    return Experiment(load_scenario(ROOT / "scenarios" / "moe-small.yaml"), "simulated")


# 16 requests dealt two per replica (chunked) on the first server's eight TP1 replicas: replica 0 holds the
# longest request; the second server starts empty
TARGETS = np.array([3000, 200, 900, 250, 300, 220, 260, 240, 800, 210, 230, 700, 650, 240, 270, 205])


def _backend(exp, counterfactual: bool = True):
    p = exp.policy("static-TP1x8")
    gen = exp.scn.layout.gen_servers(exp.scn.fabric)
    b = SimulatedBackend(exp.scn, {s: p.layout for s in gen}, p.engine(exp.settings.engine),
                         counterfactual=counterfactual)
    req = step_requests(0, TARGETS, np.arange(len(TARGETS)), 256, np.zeros(len(TARGETS), np.int64))
    b.submit(gen[0], req.specs(range(len(TARGETS))), chunked=True)
    b.wait_until(0.5)
    return b, gen[0], gen[1]


def _end(exp, moves) -> float:
    """The step's end, a whole run, when only ``moves`` ((request, to the other server?, replica)) are made at
    0.5 s."""
    b, src, other = _backend(exp, counterfactual=False)
    for rid, to_other, rep in moves:
        b.migrate(rid, src, other if to_other else src, "multi_stage", rep)
    b.wait_until(math.inf, until_idle=True)
    return max(e.last_end for e in b.engines.values())


def _tick(exp, moves):
    b, src, other = _backend(exp)
    for rid, to_other, rep in moves:
        b.migrate(rid, src, other if to_other else src, "multi_stage", rep)
    return b.tick_gains([m[0] for m in moves])


def test_each_moves_gain_is_the_whole_run_without_it(exp):
    # request 1 off the longest request's replica (it then decodes alone), request 2 onto that replica (it
    # slows it), request 8 between replicas that do not end the step
    moves = [(1, True, 0), (2, False, 0), (8, True, 0)]
    each, together = _tick(exp, moves)
    full = _end(exp, moves)
    for k, (rid, _, _) in enumerate(moves):
        assert each[rid] == pytest.approx(_end(exp, moves[:k] + moves[k + 1:]) - full, abs=1e-9)
    assert together == pytest.approx(_end(exp, []) - full, abs=1e-9)
    assert each[1] > PAID_S and each[2] < -PAID_S and together < -PAID_S
    # replicas run apart: a move between two replicas that do not hold the step's longest request changes
    # nothing of its end
    assert abs(each[8]) < 1e-9


def test_moves_that_pay_only_together_show_in_the_ticks_gain(exp):
    # the longest request and its neighbour both off replica 0: either alone parts them, so without either
    # one the other still does (each gains nothing), together they pay
    each, together = _tick(exp, [(1, True, 0), (0, True, 1)])
    assert max(each.values()) < PAID_S < together
    assert together == pytest.approx(_end(exp, []) - _end(exp, [(1, True, 0), (0, True, 1)]), abs=1e-9)
    assert _tick(exp, []) == ({}, None)


def test_no_counterfactual_no_gains(exp):
    b, src, other = _backend(exp, counterfactual=False)
    b.migrate(8, src, other, "multi_stage", 0)
    assert b.tick_gains([8]) == ({}, None)
