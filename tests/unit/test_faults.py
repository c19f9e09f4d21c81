"""Faults without stalls, the parts that need no fabric: planning ticks on the clock (never caught up), the
per-interval migration budget, the token accounting (collector ledger by source, the driver's per run and
per agent figures, a simulated server failure), calls that give up when the agent they wait on is gone
(client abort, an agent's migration to a failed peer), and the OCS port bound."""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from agents.client import AgentClient, AgentError, AgentGone, AgentTimeout
from agents.node.collector import TokenLedger
from agents.protocol import unpack_array
from emulation.scenario import load_scenario
from emulation.spec import MAX_OCS_PORTS, FabricSpec
from emulation.validation import SpecError
from testbed.ticks import IntervalBudget, TickClock

ROOT = Path(__file__).resolve().parents[2]


# ---- ticks on the clock ------------------------------------------------------------------------------------
def test_a_late_tick_runs_once_and_the_intervals_it_overran_are_skipped():
    c = TickClock(start=10.0, interval=1.0)
    assert not c.due(10.5) and c.due(11.0)
    t = c.begin(11.0)
    c.end(t, 11.01)
    assert c.next_at == 12.0
    t = c.begin(12.0)
    c.end(t, 15.4)  # this tick was held up for 3.4 intervals: no tick at 13, 14, 15
    assert c.next_at == 16.0 and c.skipped == 3
    assert not c.due(15.99)
    t = c.begin(16.7)  # a late start: it runs once, in its own interval
    assert t["late_s"] == pytest.approx(0.7) and c.next_at == 17.0
    c.end(t, 16.8)


def test_never_two_tick_starts_in_one_interval_whatever_the_delays():
    rng = np.random.default_rng(3)
    c = TickClock(start=0.0, interval=0.5)
    now, starts = 0.0, []
    for _ in range(2000):
        now = max(now, c.next_at) + float(rng.exponential(0.2))  # woken late, by a random amount
        t = c.begin(now)
        starts.append(now)
        now += float(rng.exponential(0.3))  # the tick's own work, sometimes longer than an interval
        c.end(t, now)
    idx = np.floor(np.asarray(starts) / 0.5).astype(int)
    assert len(set(idx.tolist())) == len(idx)  # at most one start per interval
    assert c.skipped > 0 and np.all(np.diff(starts) > 0)


def test_the_migration_budget_holds_per_interval_of_time():
    b = IntervalBudget(start=0.0, interval=1.0, limit=4)
    for t in (0.1, 0.2, 0.3, 0.95):
        assert b.left(t) > 0
        b.spend(t)
    assert b.left(0.99) == 0  # this interval's 4 are spent
    assert b.left(1.0) == 4  # the next interval has its own
    b.spend(1.01)
    assert b.most() == 4 and b.left(1.5) == 3


# ---- accounting ---------------------------------------------------------------------------------------------
def test_the_ledger_counts_tokens_by_source_and_what_was_new():
    led = TokenLedger()
    assert led.add(np.array([1, 1, 2]), np.array([0, 1, 0]), 1.0, src=4) == 3
    # a re-queued request resumes on another agent: positions 1 (again, a duplicate) and 2
    assert led.add(np.array([1, 1]), np.array([1, 2]), 2.0, src=5) == 1
    s = led.summary(with_arrays=True)
    assert s["sources"] == [[4, 3, 3], [5, 2, 1]]
    assert s["duplicates"] == 1 and s["tokens_unique"] == 4
    assert dict(zip(unpack_array(s["rid"]).tolist(), unpack_array(s["count"]).tolist())) == {1: 3, 2: 1}


def test_a_request_with_a_gap_is_finished_but_not_complete():
    """A migrated request's last tokens (from its destination) can arrive before the earlier ones its source
    sent: it is finished, not complete, until they do (and never, if its source died with them queued)."""
    led = TokenLedger()
    led.add(np.array([7, 7]), np.array([0, 1]), 1.0, src=4)  # the source sent positions 0, 1 (2, 3 queued)
    led.add(np.array([7, 7]), np.array([4, 5]), 2.0, src=5)  # the destination resumed at 4 and finished
    led.finish(np.array([7]), np.array([6]))
    s = led.summary(with_arrays=False)
    assert (s["finished"], s["complete"]) == (1, 0)
    led.add(np.array([7, 7]), np.array([2, 3]), 3.0, src=4)  # the source's queued tokens arrive
    s = led.summary(with_arrays=False)
    assert (s["finished"], s["complete"]) == (1, 1)


def test_stranded_requests_are_the_gapped_ones_a_failed_agent_served():
    from testbed.cluster.agent_pool import AgentPool, Collected

    col = Collected(rid=np.array([1, 2, 3, 4]), count=np.array([6, 4, 3, 2]), contiguous=np.array([6, 2, 1, 2]),
                    dups=np.zeros(4, np.int64), final_len=np.array([6, 6, 5, -1]), summary={})
    assert col.gapped() == {2: 2, 3: 1}  # 1 is complete, 4 still running
    pool = AgentPool.__new__(AgentPool)  # the bookkeeping only: no fabric, no agents
    pool.failed = {4: "process exited with -9"}
    pool.served = {1: {4, 5}, 2: {4, 5}, 3: {6, 5}, 4: {4}}
    assert pool.stranded(col) == {2: 2}  # 3's gap will fill: its sources are alive
    assert pool.stranded(col, held={2}) == {}  # a live agent holds it: not finished there


@pytest.fixture(scope="module")
def default_exp():
    """The default scenario with a quarter of its responses (512 a step): seconds, not tens."""
    import dataclasses

    from testbed.runs.experiment import Experiment

    scn = load_scenario(ROOT / "scenarios" / "default.yaml")
    scn = dataclasses.replace(scn, workload=dataclasses.replace(scn.workload, prompts_per_step=64))
    return Experiment(scn, "simulated")


def _run(exp, policy: str, fail=None, steps: int = 1, backend_cls=None):
    from testbed.driver import Driver

    p = exp.policy(policy)
    b = exp.backend(p) if backend_cls is None else backend_cls(exp.scn, {s: p.layout or exp.layouts[0] for s in
                                                                         exp.scn.layout.gen_servers(exp.scn.fabric)},
                                                               exp.settings.engine)
    if fail is not None:
        b.inject_failure(*fail)
    d = Driver(exp.scn, b, p, exp.settings)
    return d.run(steps), d


def test_every_token_is_accounted_for_per_run_and_per_server(default_exp):
    res, _ = _run(default_exp, "static-TP1x8")
    assert res["exactly_once"] and res["tokens_unique"] == res["tokens_target"] and res["tokens_duplicate"] == 0
    assert sum(v["unique"] for v in res["tokens_by_agent"].values()) == res["tokens_unique"]
    assert set(res["tokens_by_agent"]) == {"4", "5", "6", "7"}
    acc = res["steps"][0]["accounting"]
    assert acc["tokens_target"] == res["steps"][0]["tokens"] and acc["failed_during_step"] == []


def test_a_simulated_server_failure_is_requeued_and_accounted_for(default_exp):
    res, drv = _run(default_exp, "orchestrrl", fail=(6, 2.0))
    assert res["failures"] and 6 in res["failures"] and res["lost_requests"] == 0
    assert res["exactly_once"] and res["tokens_unique"] == res["tokens_target"]
    dead = res["tokens_by_agent"]["6"]
    assert 0 < dead["received"] < res["tokens_by_agent"]["7"]["received"]  # its tokens up to its death
    ev = {e["kind"]: e for e in drv.timeline.events if e["kind"] in ("agent_failed", "requeued")}
    start = next(e["t"] for e in drv.timeline.events if e["kind"] == "phase_start" and e["phase"] == "gen")
    assert ev["agent_failed"]["t"] == pytest.approx(start + 2.0)  # acted on when it happened
    assert ev["requeued"]["requests"] > 0 and 6 not in ev["requeued"]["to"]
    assert res["steps"][0]["accounting"]["failed_during_step"] == [6]
    assert res["ticks"]["migrations_per_interval_max"] <= default_exp.settings.balancer.max_migrations
    # the other servers finish the step later than without the failure, and nothing is run twice
    base, _ = _run(default_exp, "orchestrrl")
    assert res["steps"][0]["generation_s"] > base["steps"][0]["generation_s"]


def test_a_request_stranded_by_a_failure_is_repaired_from_its_prefix(default_exp):
    """The emulator's case, on the simulated backend: a request finished on a live server while tokens the
    failed one had sent never arrived. The driver resumes it from the delivered prefix on a live generator,
    once per failure, and the step ends with it delivered."""
    from testbed.backends.simulated import SimulatedBackend

    class Stranding(SimulatedBackend):
        told = 0
        rid = None
        submitted: list = []

        def stranded(self, held=None, deadline_s=None):
            done = [r for e in self.engines.values() for r, _ in e.finished_log]
            if self.failures() and done:
                cls = type(self)
                cls.told += 1
                cls.rid = done[0] if cls.rid is None else cls.rid
                return {cls.rid: 5}  # its tokens 5.. never arrived
            return {}

        def submit(self, server, requests, chunked=False):
            type(self).submitted.extend((server, r) for r in requests)
            super().submit(server, requests, chunked)

    res, drv = _run(default_exp, "orchestrrl", fail=(6, 2.0), backend_cls=Stranding)
    rep = [e for e in drv.timeline.events if e["kind"] == "repaired"]
    assert Stranding.told >= 2 and len(rep) == 1 and rep[0]["requests"] == 1  # asked at every tick, repaired once
    again = [(s, r) for s, r in Stranding.submitted if r.get("generated") == 5]
    assert len(again) == 1 and again[0][0] != 6 and again[0][0] in rep[0]["to"]
    assert res["lost_requests"] == 0


def test_a_driver_held_up_for_several_intervals_does_not_replay_its_ticks(default_exp):
    """The backend's clock jumps 3.3 intervals once (a driver blocked in something): the missed ticks are
    skipped, not run back to back, and no interval holds more than max_migrations migrations."""
    from testbed.backends.simulated import SimulatedBackend

    class HeldUp(SimulatedBackend):
        jumped = False

        def wait_until(self, t, until_idle=False):
            if not self.jumped and self.finished_count() > 50:
                type(self).jumped = True
                t += 3.3 * default_exp.settings.planning_interval_s
            super().wait_until(t, until_idle)

    res, drv = _run(default_exp, "orchestrrl", backend_cls=HeldUp)
    assert HeldUp.jumped and res["lost_requests"] == 0
    ticks = drv.tick_log
    interval = default_exp.settings.planning_interval_s
    gen0 = next(e["t"] for e in drv.timeline.events if e["kind"] == "phase_start" and e["phase"] == "gen")
    dues = [r["due"] for r in ticks]
    assert len(dues) == len(set(dues))  # never two ticks in one interval...
    assert all(r["due"] - 1e-9 <= r["t"] < r["due"] + interval for r in ticks)  # ...each in its own
    assert max(r["late_s"] for r in ticks) > 0  # the held-up one ran late, once
    assert res["ticks"]["skipped_intervals"] >= 2  # the jump from ~1.35 to ~4.65 passed the ticks due at 2 and 3
    migs = [e["t"] for e in drv.timeline.events if e["kind"] == "migration"]
    per = np.bincount(np.floor((np.asarray(migs) - gen0) / interval + 1e-9).astype(int))
    assert per.max() <= default_exp.settings.balancer.max_migrations


# ---- calls that give up ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_call_gives_up_as_soon_as_its_abort_says_so():
    c = AgentClient(f"tcp://127.0.0.1:{_free_port()}", "nobody", timeout_s=10.0)  # nothing listens there
    try:
        t0 = time.monotonic()
        gone_at = t0 + 0.1
        with pytest.raises(AgentGone, match="process exited"):
            c.call("ping", abort=lambda: "process exited with -9" if time.monotonic() >= gone_at else None)
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(AgentTimeout):
            c.call("ping", timeout_s=0.1)
    finally:
        c.close()


@contextlib.contextmanager
def _loopback_agent(tmp_path, layout: str, **extra):
    """A generator agent process on loopback (server 0, ``layout``, the config's ``extra`` keys); yields
    (its RPC port, a client, the process) and kills it if the test did not shut it down."""
    port = _free_port()
    cfg = {"index": 0, "server": 0, "role": "gen", "gpus": 8, "model": "Qwen2.5-7B", "gpu": "H800",
           "rpc": {"host": "127.0.0.1", "port": port}, "fabric_ip": "127.0.0.1", "fabric_intf": "lo",
           "layout": layout, "collectors": [{"host": "127.0.0.1", "port": _free_port()}], **extra}
    p = tmp_path / "agent.json"
    p.write_text(json.dumps(cfg))
    agent = subprocess.Popen([sys.executable, "-m", "agents.node", "--config", str(p), "--log",
                              str(tmp_path / "agent.log")], cwd=ROOT)
    c = AgentClient(f"tcp://127.0.0.1:{port}", "agent0", timeout_s=30.0)
    try:
        yield port, c, agent
    finally:
        c.close()
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_a_migration_to_a_failed_peer_gives_up_at_once_and_the_request_stays(tmp_path):
    """An agent on loopback migrates a request (stop and copy) to a peer that never answers; told that the
    peer failed (peer_down), its call gives up at once and it serves the request itself again."""
    with _loopback_agent(tmp_path, "TP1x8") as (port, c, agent):
        assert c.call("ping")["pid"] == agent.pid
        c.call("submit", {"requests": [{"rid": 11, "prompt": 64, "target": 100_000, "dest": 0}]})
        import threading

        out: dict = {}

        def migrate():
            t0 = time.monotonic()
            try:
                c.call("migrate", {"rid": 11, "dst": 1, "mode": "stop_copy", "timeout_s": 20.0,
                                   "dst_rpc": {"host": "127.0.0.1", "port": _free_port()}}, timeout_s=25.0)
            except Exception as e:  # noqa: BLE001 - the answer under test
                out["error"] = e
            out["took"] = time.monotonic() - t0

        t = threading.Thread(target=migrate)
        t.start()
        deadline = time.monotonic() + 10
        while c.call("stats")["num_requests_running"] + c.call("stats")["num_requests_waiting"] > 0:
            assert time.monotonic() < deadline, "the request never left the engine"
            time.sleep(0.01)  # polled: it is stopped (detached) while its KV goes to the dead peer
        c.call("peer_down", {"agent": 1})
        t.join(timeout=10)
        assert "failed" in str(out["error"]) and out["took"] < 5.0  # not the 20 s deadline
        st = c.call("stats", {"snapshot": True})
        assert 11 in unpack_array(st["snapshot"]["rid"]).tolist()  # back on this agent, not lost
        with pytest.raises(Exception, match="failed"):  # a new migration to it is refused at once
            c.call("migrate", {"rid": 11, "dst": 1, "dst_rpc": {"host": "127.0.0.1", "port": 9}})
        c.call("shutdown")
        assert agent.wait(timeout=10) == 0


def test_a_stop_asked_of_a_request_in_its_last_step_answers_at_once(tmp_path):
    """A migration's stop waits for the step in flight; if the request finishes in that step, the waiter is told
    then (it used to sleep out its whole timeout: a 30 s planning tick on the default scenario). Time dilated
    x5, so the request's one step (its prefill) is still in flight when the migrate call arrives."""
    with _loopback_agent(tmp_path, "TP1x8", time_dilation=5.0) as (port, c, agent):
        c.call("ping")
        results = []
        for k in range(3):
            # one token left: its (re)prefill step produces it and finishes it, with the stop pending
            c.call("submit", {"requests": [{"rid": 100 + k, "prompt": 4000, "target": 50, "dest": 0,
                                            "generated": 49}]})
            t0 = time.monotonic()
            res = c.call("migrate", {"rid": 100 + k, "dst": 0, "timeout_s": 20.0,
                                     "dst_rpc": {"host": "127.0.0.1", "port": port}}, timeout_s=25.0)
            results.append((res["result"], time.monotonic() - t0))
        assert all(took < 5.0 for _, took in results), results
        assert any(r == "finished" for r, _ in results), results  # the case under test did happen
        c.call("shutdown")
        agent.wait(timeout=10)


def test_reset_gives_the_engine_a_runs_settings_and_refuses_bad_ones(tmp_path):
    """A run of another configuration on the same agents (the tuned baseline's max_num_seqs on a cluster
    started with the scenario's): reset gives the fresh engine its settings, which bound the running batch;
    a bad one is refused naming the field and changes nothing."""
    reqs = [{"rid": k, "prompt": 64, "target": 100_000, "dest": 0} for k in range(10)]
    with _loopback_agent(tmp_path, "TP8x1", engine={"max_num_seqs": 64}) as (port, c, agent):
        c.call("ping")

        def batch() -> tuple[int, int]:
            st = c.call("stats")
            return st["num_requests_running"], st["num_requests_waiting"]

        c.call("submit", {"requests": reqs})
        assert batch() == (10, 0)  # the configured 64 seats
        with pytest.raises(AgentError) as ei:
            c.call("reset", {"engine": {"max_num_seqs": 0}})
        assert ei.value.field == "params.engine" and batch() == (10, 0)  # refused: nothing changed
        assert c.call("reset", {"engine": {"max_num_seqs": 3, "max_num_batched_tokens": 8192}})["dropped"] == 10
        c.call("submit", {"requests": reqs})
        assert batch() == (3, 7)  # the run's settings
        c.call("reset")  # no settings: the engine keeps the last ones
        c.call("submit", {"requests": reqs})
        assert batch() == (3, 7)
        c.call("shutdown")
        agent.wait(timeout=10)


# ---- the OCS's ports ----------------------------------------------------------------------------------------
def test_ocs_ports_are_bounded_by_the_largest_commercial_ocs():
    assert FabricSpec(ocs_ports=MAX_OCS_PORTS).ports_per_ocs == MAX_OCS_PORTS
    with pytest.raises(SpecError) as ei:
        FabricSpec(ocs_ports=100000)
    assert ei.value.field == "ocs_ports" and str(MAX_OCS_PORTS) in str(ei.value)


def test_the_emulator_refuses_an_ocs_it_would_not_build():
    FabricSpec().check_emulatable()
    FabricSpec(ocs_ports=8).check_emulatable()  # exactly the wired ports
    with pytest.raises(SpecError) as ei:
        FabricSpec(ocs_ports=16).check_emulatable()
    assert ei.value.field == "ocs_ports" and "builds only the 8" in str(ei.value)


def test_an_ocs_whose_switch_has_other_ports_never_gets_ready(connected_core):
    import io

    from controller.rest import RestApp
    from emulation.spec import JobLayout

    spec = FabricSpec()
    core, drv, _ = connected_core(spec, JobLayout())
    ocs = spec.ocs_dpid(0)
    core.switch_disconnected(ocs)
    core.switch_connected(ocs)
    core.switch_synced(ocs, [], ocs_ports=list(range(1, 17)))  # the switch has 16 ports, the spec says 8
    st = core.state()
    assert not st["ready"] and "has 16 ports" in st["mismatch"][0]
    app = RestApp(core, None)
    body = b'{"circuits": {"0": [[1, 3]]}}'
    env = {"REQUEST_METHOD": "POST", "PATH_INFO": "/api/v1/circuits", "CONTENT_LENGTH": str(len(body)),
           "wsgi.input": io.BytesIO(body)}
    out = {}
    body = b"".join(app(env, lambda status, h: out.update(status=int(status.split()[0]))))
    assert out["status"] == 503 and b"does not match its spec" in body
    core.switch_synced(ocs, [], ocs_ports=list(range(1, 9)))  # the right switch: ready again
    assert core.ready and core.state()["mismatch"] == []


# ---- one teardown for every signal ------------------------------------------------------------------------
def test_a_teardown_signal_unwinds_and_one_during_a_teardown_waits_for_it():
    import os
    import signal

    from emulation.signals import Interrupted, exit_code, shielded, teardown_on_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    steps = []
    with pytest.raises(Interrupted) as ei:
        with teardown_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGHUP)
                for _ in range(10_000):  # the handler runs at the next bytecode boundary
                    pass
                steps.append("not reached")
            finally:
                with shielded():  # the teardown: a second signal is ignored, not raised in the middle of it
                    os.kill(os.getpid(), signal.SIGTERM)
                    for _ in range(10_000):
                        pass
                    steps.append("teardown done")
    assert steps == ["teardown done"] and exit_code(ei.value) == 129
    with pytest.raises(Interrupted) as ei:
        with teardown_on_signals():
            with shielded():  # a teardown under way when the first signal comes: it finishes, then unwinds
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(10_000):
                    pass
                steps.append("finished")
            steps.append("not reached")
    assert steps[-1] == "finished" and ei.value.exit_code == 143
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are restored


def test_a_library_that_replaces_the_handlers_or_the_interrupt_keeps_the_teardown_and_its_exit_status():
    """ray.init installs its own SIGTERM handler (it ends the process without unwinding anything), and ray.wait
    turns the Interrupted it sees into a plain KeyboardInterrupt: handlers_kept puts the teardown's handlers
    back, and the exit status is still the signal's (143, not Ctrl-C's 130)."""
    import os
    import signal

    from emulation.signals import exit_code, handlers_kept, signal_of, teardown_on_signals

    def foreign(signum, frame):  # what a library installs
        raise AssertionError("the library's handler ran")

    with pytest.raises(KeyboardInterrupt) as ei:
        with teardown_on_signals():
            ours = signal.getsignal(signal.SIGTERM)
            with handlers_kept():
                signal.signal(signal.SIGTERM, foreign)
            assert signal.getsignal(signal.SIGTERM) is ours
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(10_000):  # the handler runs at the next bytecode boundary
                    pass
            except KeyboardInterrupt:
                raise KeyboardInterrupt() from None  # as Ray's ray.wait does
    assert type(ei.value) is KeyboardInterrupt
    assert signal_of(ei.value) == signal.SIGTERM and exit_code(ei.value) == 143
    with pytest.raises(KeyboardInterrupt) as ei:  # a new command forgets the last one's signal: Ctrl-C's own
        with teardown_on_signals():
            raise KeyboardInterrupt()
    assert exit_code(ei.value) == 130


def test_a_map_removes_its_points_folders_however_it_ends(tmp_path, monkeypatch):
    """The map's points make their run folders inside one folder of the map's own, removed when the map ends
    (here by an interrupt in its second point); a point whose map folder is gone makes nothing."""
    import os
    import socket

    from emulation.scenario import load_scenario
    from testbed.runs import policymap

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(policymap.tempfile, "tempdir", None)  # TMPDIR read again
    seen = []

    def fake_point(scenario, steps, use_cache, tmp_root):
        host, root = tmp_root
        assert host == socket.gethostname() and os.path.isdir(root)
        os.mkdir(os.path.join(root, f"point-{len(seen)}"))  # what a worker killed mid-point leaves
        seen.append(root)
        if len(seen) == 2:
            raise KeyboardInterrupt()
        return {}

    monkeypatch.setattr(policymap, "point", fake_point)
    scn = load_scenario(os.path.join(os.path.dirname(__file__), "..", "..", "scenarios", "default.yaml"))
    with pytest.raises(KeyboardInterrupt):
        policymap.build(scn, panels=[("median", "requests_per_gpu")], use_ray=False)
    assert len(seen) == 2 and os.listdir(tmp_path) == []
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="gone"):
        policymap.point(scn, 1, True, (socket.gethostname(), str(tmp_path / "gone")))
    assert os.listdir(tmp_path) == []


def test_a_controller_whose_owner_is_killed_exits_and_clean_removes_its_folder(tmp_path, monkeypatch):
    """The process that started the controller dies by SIGKILL (no teardown at all): the controller notices
    its owner is gone and exits; its scratch folder was recorded, so `clean` removes it. (No switch needed.)"""
    import os
    import signal

    from emulation import registry

    monkeypatch.setenv("ORCHESTRRL_STATE_DIR", str(tmp_path / "state"))
    owner = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from controller.process import ControllerProcess\n"
        "from emulation.spec import FabricSpec, JobLayout\n"
        "c = ControllerProcess(FabricSpec(), JobLayout()).start()\n"
        "print(c.pid, c._dir, flush=True)\n"
        "time.sleep(300)\n")], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    ctl_pid = None
    try:
        line = owner.stdout.readline().split()
        ctl_pid, folder = int(line[0]), Path(line[1])
        assert registry.process_alive(ctl_pid) and folder.is_dir()
        assert folder in registry.list_tmpdirs()
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 5
        while registry.process_alive(ctl_pid):
            assert time.monotonic() < deadline, "the controller outlived its owner"
            time.sleep(0.05)
        rep = registry.clean()
        assert str(folder) in rep.tmpdirs and not folder.exists() and registry.list_tmpdirs() == []
    finally:
        if owner.poll() is None:
            owner.kill()
        if ctl_pid and registry.process_alive(ctl_pid):
            os.kill(ctl_pid, signal.SIGKILL)
