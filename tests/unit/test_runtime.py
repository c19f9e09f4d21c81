"""controller.runtime: recovery after a failed reconfiguration, readiness, history ids, configuration checks
(token file, ports) before any file is created; controller.process's registry bookkeeping."""
from __future__ import annotations

import json
import os
import threading

import pytest

from controller import process as ctl_process
from controller.ocs import Matching
from controller.__main__ import main
from controller.config import (ControllerOptions, build_arg_parser, check_config, config_from_options,
                               options_from_args, read_or_create_token, to_argv)
from controller.runtime import FabricController, NotReady, ReconfigFailed
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError, to_dict
from fakes_controller import FakeClock, FakeDriver

SPEC = FabricSpec()  # 2 pods x 2 ToRs, 1 OCS with 8 ports
LAYOUT = JobLayout()
OCS = SPEC.ocs_dpid(0)
TORS = [SPEC.tor_dpid(t) for t in range(SPEC.n_tors)]


def make_core(**kw):
    clock = FakeClock()
    drv = FakeDriver(clock, SPEC.ocs_count)
    kw.setdefault("delay_ms", SPEC.reconfig_delay_ms)
    core = FabricController(SPEC, LAYOUT, drv, clock, threading.Lock(), **kw)
    return core, drv, clock


def connect_all(core):
    for d in core.switches.expected:
        core.switch_connected(d)
    for d in core.switches.expected:
        core.switch_synced(d, [] if SPEC.classify_dpid(d)[0] == "ocs" else None)
    assert core.ready


def held_pairs(drv, clock, ocs=0) -> list[tuple[int, int]]:
    """What the fake OCS holds, as a read-back would see it (pending flow-mods applied first)."""
    clock.advance_to(clock.pending_until())
    return sorted((int(dict(f.match)["in_port"]), int(f.actions[0][1])) for f in drv.tables[ocs].flows.values())


def assert_holds(drv, clock, matching: Matching, ocs=0) -> None:
    want = sorted(x for a, b in matching.pairs() for x in ((a, b), (b, a)))
    assert held_pairs(drv, clock, ocs) == want


class _Failing:
    def wait(self) -> float:
        raise TimeoutError("switch did not confirm (barrier)")


# ---- 1. failed reconfiguration: stale switches are read back and reconciled ------------------------------
@pytest.mark.parametrize("fail_at", ["send", "wait"])
def test_failed_reconfiguration_marks_switches_stale_and_readback_converges(fail_at):
    stale_calls = []
    core, drv, clock = make_core(on_stale=stale_calls.append)
    connect_all(core)
    train = core.matchings[0]
    target = Matching.from_pairs(8, [[1, 2], [3, 4]])
    orig_barrier = drv.send_barrier

    def broken(ocses):
        drv.log.append(("barrier", tuple(ocses)))
        if fail_at == "send":
            raise TimeoutError("switch 0x... did not confirm")
        return _Failing()

    drv.send_barrier = broken
    with pytest.raises(ReconfigFailed, match="TimeoutError"):
        core.request_circuits({"circuits": {"0": target.to_json()}, "delay_ms": 5})
    rec = core.history()[-1]
    assert rec["status"] == "failed" and "TimeoutError" in rec["error"]
    # what the switches hold is unknown: not ready, routes forgotten, the touched OCS and every ToR re-read
    assert stale_calls == [sorted([OCS] + TORS)] and core.switches.stale == set([OCS] + TORS)
    assert not core.ready and core.routes is None
    assert core.state()["unsynced"] == sorted([OCS] + TORS)
    assert core.matchings[0] == target  # the intended circuits (persisted), reconciled on read-back
    if fail_at == "send":
        assert held_pairs(drv, clock) != sorted(x for a, b in train.pairs() for x in ((a, b), (b, a)))
    with pytest.raises(NotReady, match="not read back"):
        core.request_phase({"phase": "gen"})

    # the app reads the stale switches back (OCSes first), with the switch answering again
    drv.send_barrier = orig_barrier
    drv.log.clear()
    n_hist = len(core.history())
    core.switch_synced(OCS, held_pairs(drv, clock))
    assert not core.ready  # the ToRs are still to be read back
    for d in TORS:
        core.switch_synced(d)
    assert core.ready and core.switches.stale == set() and core.routes is not None
    assert_holds(drv, clock, target)
    pushes = [e[2] for e in drv.log if e[0] == "routes"]
    assert pushes[0] is True and pushes[-len(TORS):] == [True] * len(TORS)  # full pushes: routes were unknown
    after = core.history()[n_hist:]
    if fail_at == "send":  # the OCS lost the changed circuits: its read-back reconciles them
        assert [(h["source"], h["status"]) for h in after] == [("reconcile", "done")]
    else:  # the adds were sent, only the barrier failed: the read-back finds the target in place
        assert after == []

    # and the next reconfiguration runs from the real state
    rec = core.request_phase({"phase": "gen", "delay_ms": 5})
    assert rec["status"] == "done"
    assert_holds(drv, clock, core.matchings[0])


def test_failed_route_sync_of_a_tor_marks_it_stale_again():
    stale_calls = []
    core, drv, clock = make_core(on_stale=stale_calls.append)
    connect_all(core)
    tor = TORS[1]
    core.switch_disconnected(tor)
    core.switch_connected(tor)

    def broken(changes, full=False):
        raise TimeoutError("ToR did not confirm")

    drv.apply_route_changes = broken
    with pytest.raises(ReconfigFailed, match="ToR 1"):
        core.switch_synced(tor)
    assert stale_calls == [[tor]] and not core.ready and core.routes is None


def test_failure_of_a_disconnected_switch_waits_for_its_reconnect():
    stale_calls = []
    core, drv, clock = make_core(on_stale=stale_calls.append)
    connect_all(core)

    def gone(ocses):
        core.switch_disconnected(OCS)  # the switch dropped during the reconfiguration
        raise TimeoutError("switch is not connected")

    drv.send_barrier = gone
    with pytest.raises(ReconfigFailed):
        core.request_circuits({"circuits": {"0": [[1, 2]]}, "delay_ms": 0})
    assert OCS not in core.switches.stale and stale_calls == [TORS]  # the OCS is read back on reconnect


# ---- 2. ready only once every switch was read back -------------------------------------------------------
def test_ready_waits_for_readback_of_a_reconnected_switch():
    core, drv, clock = make_core()
    connect_all(core)
    tor = TORS[0]
    core.switch_disconnected(tor)
    core.switch_connected(tor)
    assert tor in core.switches.connected and not core.ready
    st = core.state()
    assert st["missing"] == [] and st["unsynced"] == [tor] and not st["ready"]
    with pytest.raises(NotReady, match="not read back"):
        core.request_phase({"phase": "gen"})
    core.switch_synced(tor)
    assert core.ready and core.state()["unsynced"] == []


# ---- 3. history ids stay unique with concurrent writers --------------------------------------------------
def test_history_ids_unique_with_concurrent_rejections_and_reconfigurations():
    core, drv, clock = make_core()
    connect_all(core)
    n_threads, per = 8, 200
    start = threading.Barrier(n_threads + 1)

    def reject():
        start.wait(timeout=10)
        for _ in range(per):
            core.record_rejected("circuits", "bad")

    def reconfigure():
        start.wait(timeout=10)
        for i in range(20):
            core.request_phase({"phase": ("gen", "train")[i % 2], "delay_ms": 0})

    threads = [threading.Thread(target=reject) for _ in range(n_threads)] + [threading.Thread(target=reconfigure)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    ids = [h["id"] for h in core.history()]
    assert len(ids) == len(set(ids)) == 1 + n_threads * per + 20
    assert ids == sorted(ids)


# ---- 4. configuration: token file errors, nothing created before the input is valid ----------------------
def args(tmp_path, **over):
    ns = dict(spec_json=json.dumps({"fabric": to_dict(SPEC)}), of_port=6653, rest_port=8080,
              token_file=str(tmp_path / "token"))
    ns.update(over)
    return ControllerOptions(**ns)


def test_token_file_created_0600_and_reread(tmp_path):
    p = tmp_path / "token"
    tok = read_or_create_token(str(p))
    assert len(tok) >= 16 and (p.stat().st_mode & 0o777) == 0o600
    assert read_or_create_token(str(p)) == tok


@pytest.mark.parametrize("case", ["directory", "no_parent", "short", "binary"])
def test_bad_token_file_is_a_spec_error(tmp_path, case):
    path = {"directory": tmp_path, "no_parent": tmp_path / "nope" / "token"}.get(case, tmp_path / "token")
    if case == "short":
        path.write_text("short\n")
    if case == "binary":
        path.write_bytes(b"\xff\xfe" * 20)
    with pytest.raises(SpecError) as ei:
        read_or_create_token(str(path))
    assert ei.value.field == "token_file"
    assert not (tmp_path / "nope").exists()


def test_unreadable_token_file_is_a_spec_error(tmp_path, monkeypatch):
    p = tmp_path / "token"
    p.write_text("x" * 30)

    def denied(self, *a):  # a mode-0 file does not stop root, who runs these tests in CI
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(p), "read_text", denied)
    with pytest.raises(SpecError) as ei:
        read_or_create_token(str(p))
    assert ei.value.field == "token_file" and "permission" in ei.value.message


def test_main_exits_2_on_a_token_file_that_is_a_directory(tmp_path, capsys):
    code = main(["--spec-json", "{}", "--of-port", "6653", "--rest-port", "8080", "--token-file", str(tmp_path)])
    assert code == 2 and "token_file" in capsys.readouterr().err


@pytest.mark.parametrize("over,field", [
    ({"rest_port": 0}, "rest_port"), ({"rest_port": 70000}, "rest_port"), ({"of_port": -1}, "of_port"),
    ({"rest_port": 6653}, "rest_port"), ({"delay_ms": -1.0}, "delay_ms"), ({"delay_ms": float("nan")}, "delay_ms"),
    ({"initial_phase": "bogus"}, "initial_phase")])
def test_bad_config_creates_no_token_file(tmp_path, over, field):
    with pytest.raises(SpecError) as ei:
        config_from_options(args(tmp_path, **over))
    assert ei.value.field == field
    assert list(tmp_path.iterdir()) == []


def test_check_config_creates_nothing_and_config_from_options_adds_the_token(tmp_path):
    cfg = check_config(args(tmp_path))
    assert cfg.token is None and cfg.token_file == str(tmp_path / "token") and list(tmp_path.iterdir()) == []
    cfg = config_from_options(args(tmp_path))
    assert cfg.token == (tmp_path / "token").read_text().strip()
    assert config_from_options(args(tmp_path, no_auth=True, token_file=None)).token is None


def test_the_controller_programs_the_wall_clock_delay_resolved_once(tmp_path):
    """--delay-ms is wall-clock ms as given; without it, the scenario's (or the spec's) delay x its time
    dilation, the same figure Scenario.wall_delay_ms gives the harness."""
    from emulation.scenario import load_scenario

    dilated = json.dumps({"fabric": to_dict(FabricSpec(reconfig_delay_ms=4.0, time_dilation=2.5))})
    assert check_config(args(tmp_path, spec_json=dilated)).delay_ms == 10.0
    assert check_config(args(tmp_path, spec_json=dilated, delay_ms=3.0)).delay_ms == 3.0
    path = tmp_path / "s.yaml"
    path.write_text("fabric:\n  reconfig_delay_ms: 4.0\n  time_dilation: 2.5\ncontroller:\n  reconfig_delay_ms: 2.0\n")
    cfg = check_config(args(tmp_path, spec_json=None, scenario=str(path)))
    assert cfg.delay_ms == load_scenario(path).wall_delay_ms == 5.0


def test_cli_bad_rest_port_leaves_no_home_and_no_token(tmp_path, monkeypatch, capsys):
    from testbed.cli import main as cli_main

    home = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRRL_HOME", str(home))
    scenario = os.path.join(os.path.dirname(__file__), "..", "..", "scenarios", "default.yaml")
    assert cli_main(["controller", scenario, "--rest-port", "0"]) == 2
    assert "rest_port" in capsys.readouterr().err
    assert not home.exists()
    assert cli_main(["controller", scenario, "--token-file", str(tmp_path), "--state-file",
                     str(tmp_path / "s.json")]) == 2
    assert "token_file" in capsys.readouterr().err and not home.exists()


# ---- 6. ControllerProcess keeps the registry record of a process that survived SIGKILL ---------------------
class _Proc:
    def __init__(self, alive: bool):
        self.pid = 424242
        self.alive = alive

    def poll(self):
        return None if self.alive else -9


@pytest.mark.parametrize("alive", [True, False])
def test_forget_keeps_the_record_of_a_process_still_running(monkeypatch, alive):
    forgotten = []
    monkeypatch.setattr(ctl_process._registry, "forget_process", forgotten.append)
    cp = ctl_process.ControllerProcess.__new__(ctl_process.ControllerProcess)
    cp._proc, cp._log_file = _Proc(alive), None
    cp._forget()
    assert forgotten == ([] if alive else [424242])


# ---- benefit-aware switching: the client carries gain_ms; internal requests are validated alike ----------
def test_client_sends_gain_ms_in_both_posts(monkeypatch):
    from controller.client import ControllerClient

    sent = []
    c = ControllerClient("http://127.0.0.1:1", token="t")
    monkeypatch.setattr(c, "request", lambda method, path, body=None, **kw: sent.append((method, path, body)) or {})
    c.set_phase("sync", delay_ms=10, window_ms=0, gain_ms=540.5)
    c.set_circuits({0: [(1, 2)]}, delay_ms=10, gain_ms=3)
    c.set_phase("gen")
    assert sent[0] == ("POST", "phase", {"phase": "sync", "delay_ms": 10, "window_ms": 0, "gain_ms": 540.5})
    assert sent[1] == ("POST", "circuits", {"circuits": {"0": [[1, 2]]}, "delay_ms": 10, "window_ms": None,
                                            "gain_ms": 3})
    assert sent[2][2]["gain_ms"] is None


@pytest.mark.parametrize("gain", [-3600_000.5, float("nan"), float("inf"), 3600_000.5])
def test_internal_request_validates_gain_ms(gain):
    from controller.reconfig.request import ReconfigRequest

    with pytest.raises(SpecError) as ei:
        ReconfigRequest(target={0: Matching.empty(SPEC.ports_per_ocs)}, gain_ms=gain)
    assert ei.value.field == "gain_ms"


def test_deferred_record_keeps_status_and_adds_decision():
    core, drv, clock = make_core()
    connect_all(core)
    n = len(drv.log)
    rec = core.request_phase({"phase": "gen", "delay_ms": 10, "window_ms": 1, "gain_ms": 9})
    assert (rec["status"], rec["decision"], rec["stall_ms"]) == ("deferred", "deferred", 0.0)
    assert rec["gain_ms"] == 9 and len(drv.log) == n and core.phase == "train"
    rec = core.request_phase({"phase": "gen", "delay_ms": 10, "window_ms": 1, "gain_ms": 9.5})
    assert (rec["status"], rec["decision"], rec["stall_ms"]) == ("done", "stalled", 9.0) and core.phase == "gen"


# ---- 5. one place for a controller option: parser, CLI command and ControllerProcess argv agree ---------------
def test_options_round_trip_through_argv(tmp_path):
    import dataclasses

    opts = ControllerOptions(spec_json='{"fabric": {}}', of_port=1234, of_host="127.0.0.2", rest_port=4321,
                             rest_host="127.0.0.3", token_file=str(tmp_path / "t"), state_file=str(tmp_path / "s"),
                             initial_phase="gen", delay_ms=2.5, datapath_flush="off", metrics_port=9999,
                             metrics_host="127.0.0.4", verbose=2, owner_pid=4242, owner_start=99)
    assert all(getattr(opts, f.name) != f.default for f in dataclasses.fields(ControllerOptions)
               if f.name not in ("scenario", "no_auth"))  # every option is exercised
    assert options_from_args(build_arg_parser().parse_args(to_argv(opts))) == opts
    no_auth = ControllerOptions(scenario="x.yaml", of_port=1, rest_port=2, no_auth=True)
    assert options_from_args(build_arg_parser().parse_args(to_argv(no_auth))) == no_auth


def test_every_option_reaches_the_cli_command_and_the_process_argv(tmp_path):
    import dataclasses

    from testbed.cli import build_parser

    ns = build_parser().parse_args(["controller", "x.yaml", "--delay-ms", "3", "--initial-phase", "sync",
                                    "--of-host", "127.0.0.9"])
    opts = options_from_args(ns, scenario=ns.scenario)
    assert (opts.delay_ms, opts.initial_phase, opts.of_host, opts.of_port, opts.rest_port, opts.metrics_port) == \
        (3.0, "sync", "127.0.0.9", 6653, 8080, 9480)
    # the CLI command got every option from add_arguments, but the owner's (a foreground controller has none)
    names = {f.name for f in dataclasses.fields(ControllerOptions)} - {"scenario", "spec_json", "verbose",
                                                                       "owner_pid", "owner_start"}
    assert names <= set(vars(ns)) and "owner_pid" not in vars(ns)
    proc = ctl_process.ControllerProcess(SPEC, LAYOUT, of_port=7001, rest_port=7002, initial_phase="gen",
                                         delay_ms=4.0, state_file=tmp_path / "state.json", token="x" * 20,
                                         metrics_port=7003)
    try:
        assert proc.metrics_url == "http://127.0.0.1:7003/metrics"
        argv = proc.argv()
        assert argv[1:3] == ["-m", "controller"]
        back = options_from_args(build_arg_parser().parse_args(argv[3:]))
        assert back == proc.options()
        cfg = check_config(back)
        assert (cfg.of_port, cfg.rest_port, cfg.initial_phase, cfg.delay_ms, cfg.spec, cfg.metrics_port) == \
            (7001, 7002, "gen", 4.0, SPEC, 7003)
    finally:
        import shutil

        proc.stop()
        shutil.rmtree(proc._dir, ignore_errors=True)


# ---- 7. not ready, and no half-installed circuits reported, while the initial state is being installed ------
def test_not_ready_until_the_initial_reconcile_is_done(tmp_path):
    from controller.runtime import save_state

    state = tmp_path / "state.json"
    gen = {0: Matching.from_pairs(8, [[1, 3], [2, 4], [5, 7], [6, 8]])}
    save_state(state, gen, "gen")
    core, drv, clock = make_core(state_path=state)
    seen = []
    orig = drv.send_ocs_flows

    def spy(ocs, deletes, adds):
        seen.append((core.ready, core.circuits()))
        orig(ocs, deletes, adds)

    drv.send_ocs_flows = spy
    for d in core.switches.expected:
        core.switch_connected(d)
    for d in core.switches.expected:  # the OCS holds other circuits (e.g. the train mesh) after a restart
        core.switch_synced(d, [(1, 7), (7, 1), (2, 6), (6, 2)] if d == OCS else None)
    assert seen and all(ready is False and circ == {} for ready, circ in seen)
    assert core.ready and core.circuits() == {"0": gen[0].to_json()} and core.phase == "gen"


# ---- 8. the state file is written beside the reconfiguration, and holds the new intent when it answers ---------
def test_state_file_holds_the_new_intent_when_the_request_answers(tmp_path):
    from controller import phases
    from controller.runtime import load_state

    state = tmp_path / "state.json"
    core, drv, clock = make_core(state_path=state)
    connect_all(core)
    rec = core.request_phase({"phase": "gen", "delay_ms": 5})
    assert rec["status"] == "done" and "persist_error" not in rec and rec["persist_wait_ms"] >= 0
    assert load_state(state, SPEC) == (phases.phase_matchings(SPEC, LAYOUT, "gen"), "gen", None)
    assert "persist" not in rec["overhead_stages_ms"]  # not on the overhead's path any more
    assert sum(rec["overhead_stages_ms"].values()) == pytest.approx(rec["overhead_ms"], abs=0.01)


def test_a_state_file_that_cannot_be_written_is_reported(tmp_path):
    core, drv, clock = make_core(state_path=tmp_path / "state.json")
    connect_all(core)
    core.state_path = tmp_path / "gone" / "state.json"  # its folder vanished meanwhile
    rec = core.request_phase({"phase": "gen", "delay_ms": 5})
    assert rec["status"] == "done" and "FileNotFoundError" in rec["persist_error"]
