"""The decision path's shortcuts give what the plain computations give, to the bit (the speed of
``orchestrrl bench planner``, issue 33): the batched within-replica quantiles against one load at a time,
and the balancer's load indices from the planner's remembered pass against a fresh estimator's on the frozen
loads. test_orchestrator_pinned.py checks the decisions themselves."""
import dataclasses

import numpy as np
import pytest

from orchestrator_cases import _bench_state, _setup
from testbed.orchestrator.estimate import Estimator, ServerLoad
from testbed.orchestrator.planner import ServerView


def test_within_quantiles_of_many_loads_are_those_of_each_load():
    w, est, lays = _setup(16384, 256)[:3]
    views, _ = _bench_state(w, est, lays, np.random.default_rng(4), 600, [lays[0]] * 4)
    lds = [v.load for v in views.values()]
    rng = np.random.default_rng(5)
    lds[1] = dataclasses.replace(lds[1], shift=rng.normal(0, 0.3, lds[1].n))  # a prompt shift on two of them
    lds[2] = dataclasses.replace(lds[2], shift=rng.normal(0, 0.3, lds[2].n))
    lds[3] = ServerLoad(lds[3].ctx0, lds[3].rem, lds[3].running, lds[3].replica)  # nothing to stratify on
    groups = [rng.integers(0, k, ld.n) for k, ld in zip((8, 4, 2, 8), lds)]
    many = est.stratified_within_many(list(zip(lds, groups)))
    for ld, g, got in zip(lds, groups, many):
        assert np.array_equal(got, est.stratified_within(ld, g))


@pytest.mark.parametrize("arrivals", [0.0, 0.05])
def test_balancer_load_indices_from_the_planners_pass_are_the_frozen_loads(arrivals):
    """The balancer takes its load indices from the estimator's memory of the planner's pass (the servers'
    own loads, stratified as the frozen loads hold them); a fresh estimator on the frozen loads gives the same."""
    w, est, lays, planner, balancer = _setup(16384, 256)
    views, rids = _bench_state(w, est, lays, np.random.default_rng(6), 1024, [lays[j % len(lays)] for j in range(4)],
                               arrivals=arrivals)
    planner.evaluate_all(views, now=10.0, interval=1.0)
    _, loads = balancer.decide(views, rids, now=10.0)
    fresh = Estimator(est.cm, est.gpus, est.settings)
    fresh.use_forecast(est.forecast)
    for s, v in views.items():
        frozen = ServerLoad(v.load.ctx0, fresh.stratified(v.load), v.load.running, v.load.replica)
        _, times = fresh.replica_times(v.layout, frozen, current=v.layout)
        assert loads[s] == float(times.max()) + max(0.0, ServerView(s, v.layout, frozen).busy_until - 10.0)
