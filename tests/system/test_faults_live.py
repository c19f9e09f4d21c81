"""A generator agent killed (SIGKILL of its process group, by the PID the testbed recorded when it started it)
during generation, during a migration and during a layout switch, on the emulated cluster of a small
scenario: the failure is acted on within 2 planning intervals of the kill, no planning tick lasts longer than
2 intervals, no interval holds more than ``max_migrations`` migrations, nothing is lost, every token is
accounted for (``tokens_unique == tokens_target``, duplicates reported, the victim's tokens up to its death),
and the step's generation takes no longer than the simulated backend's run of the same step with the same
server killed at the same time, at the pace this cluster ran the step without a kill, x (1 + BOUND_REL) + 2
intervals (testbed/benchmarks/bench_faults.py: the same runs as `orchestrrl bench faults`, which reports them on the
default scenario).
"""
from __future__ import annotations

import dataclasses
import time

import pytest

from emulation.orchestration import orchestrator_settings
from emulation.validation import to_dict
from testbed.benchmarks.bench_faults import fault_run
from small_scenario import small_scenario

pytestmark = pytest.mark.system

INTERVAL = 0.5
MAX_MIGRATIONS = 4
# tests/small_scenario.py with responses of up to 1,500 tokens, one step, and an eager balancer (no floor on a
# move's predicted gain): it moves at every tick, up to the limit
SCN = small_scenario("faults-small", max_response_tokens=1500, orchestrator={
    "planning_interval_s": INTERVAL,
    "balancer": {"threshold": 0.05, "min_gap_s": 0.2, "max_migrations": MAX_MIGRATIONS, "min_gain_s": 0.0,
                 "gain_margin": 0.0}})


def _check(got: dict) -> None:
    print(got)  # the figures, for -s
    assert got["killed"] and got["failed"] == [got["victim"]]
    assert 0 <= got["noticed_s"] <= 2 * INTERVAL
    assert got["tick_s_max"] <= 2 * INTERVAL
    assert got["migrations_per_interval_max"] <= MAX_MIGRATIONS
    assert got["lost_requests"] == 0
    assert got["exactly_once"] and got["tokens_unique"] == got["tokens_target"]
    assert isinstance(got["tokens_duplicate"], int)  # reported
    mine = got["victim_tokens"]
    assert mine["received"] > 0 and mine["unique"] <= mine["received"]  # its tokens up to its death
    assert got["generation_s"] <= got["bound_s"], got


def test_kill_during_a_migration(tmp_path):
    """The destination of the first migration dies while the driver's migrate call to the source is out:
    the call gives up at once (not after 35 s), the source keeps the request, the victim's are re-queued."""
    got = fault_run(SCN, "migration", tmp_path)
    _check(got)
    assert got["migrate_call_s"] <= 2 * INTERVAL


def test_kill_during_generation(tmp_path):
    _check(fault_run(SCN, "generation", tmp_path, victim=3))


# a longer tail and an eager planner loaded in TP1x8 (the tuned static is TP8x1@64, where no switch pays) and
# kept there at the step's start (a wide initial margin): both generators switch to TP8x1 live in the first
# second (simulated: at 1.0 s)
SCN_SWITCH = dataclasses.replace(
    SCN, workload=dataclasses.replace(SCN.workload, max_response_tokens=3000, response_sigma=1.0),
    orchestrator=orchestrator_settings({
        **to_dict(SCN.orchestrator),
        "planner": {"min_gain_s": 0.2, "gain_margin": 0.02, "cooldown_s": 0.5, "initial_margin": 0.9},
        "policies": [{"name": "planner-from-tp1", "planner": "forecast", "start": "TP1x8"}]}))


def test_kill_during_a_layout_switch(tmp_path):
    got = fault_run(SCN_SWITCH, "layout_switch", tmp_path, policy="planner-from-tp1")
    _check(got)


def test_a_call_to_a_failed_agent_fails_at_once(tmp_path):
    import os
    import signal

    from testbed.cluster.agent_pool import AgentFailed, running_cluster

    with running_cluster(SCN) as (tb, pool):
        os.killpg(pool.procs[3].pid, signal.SIGKILL)
        pool.procs[3].wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="exited"):  # seen at once: its process exit, not a deadline
            pool.call(3, "stats", timeout_s=10)
        with pytest.raises(AgentFailed):
            pool.call(3, "stats", timeout_s=10)
        assert time.monotonic() - t0 < 0.5
        assert pool.call(2, "ping")["agent"] == 2  # the others keep serving


def test_a_late_agent_is_left_out_and_a_silent_one_failed():
    """A generator stopped (SIGSTOP) through a per-tick gather's deadline is left out of it, not failed: it
    answers once it runs again and stays. One that stays silent past the failure deadline is failed and fenced
    (its process group killed), and only then."""
    import os
    import signal

    from testbed.cluster.agent_pool import running_cluster

    with running_cluster(SCN) as (tb, pool):
        pid = pool.procs[2].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            got = pool.gather([2, 3], "stats", lambda s: None, 0.2, fail_after_s=1.5)
            assert set(got) == {3} and 2 in pool.late and 2 not in pool.failed
            assert set(pool.gather([2, 3], "stats", lambda s: None, 0.2, fail_after_s=1.5)) == {3}  # still out
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while 2 in pool.late:  # its late answer comes
            assert time.monotonic() < deadline, "the late answer never came"
            time.sleep(0.02)
        assert 2 not in pool.failed and set(pool.gather([2, 3], "stats", lambda s: None, 0.2, fail_after_s=1.5)) == {2, 3}
        os.kill(pid, signal.SIGSTOP)  # silent for good
        t0 = time.monotonic()
        assert set(pool.gather([2, 3], "stats", lambda s: None, 0.2, fail_after_s=1.5)) == {3}
        while 2 not in pool.failed:
            assert time.monotonic() - t0 < 5, "the silent agent was never failed"
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert 1.4 <= took <= 3.0 and "no answer to 'stats' within 1500 ms" in pool.failed[2], (took, pool.failed)
        pool.procs[2].wait(timeout=5)  # fenced: its group SIGKILLed (a stopped process dies of it)
        assert pool.procs[2].returncode == -signal.SIGKILL
        assert pool.call(3, "ping")["agent"] == 3


# the asynchronous step mode: step 0's weight sync runs beside step 1's generation
SCN_ASYNC = dataclasses.replace(SCN, orchestrator=orchestrator_settings({**to_dict(SCN.orchestrator), "step_mode": "async"}))


def test_kill_during_a_weight_sync_beside_generation(tmp_path):
    """A generator dies under the weight broadcast that runs beside the next step's generation: the sync is run
    again without it and the generation re-queues its requests. That step's generation is held to the
    simulated survivors' bound like the other kills; the sync's re-run must not hold any step up (the time each
    step spends outside its generation is what it is without the kill; the simulator has no sync failure to
    bound it with)."""
    got = fault_run(SCN_ASYNC, "weight_sync", tmp_path, baseline=True)
    _check(got)
    assert got["kill_step"] == 1  # the kill came while step 1 generated
    assert got["sync_retries"][0] >= 1 and all(got["sync_consistent"])  # run again, the same weights everywhere
    for ms, gen, base_ms, base_gen in zip(got["step_makespans_s"], got["gen_s"], got["emulated_no_kill_makespans_s"],
                                          got["emulated_no_kill_gen_s"]):
        assert ms - gen <= (base_ms - base_gen) + 2 * INTERVAL, got
