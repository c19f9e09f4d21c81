"""Re-wiring inside the train phase in the live loop (scenario ``controller.train_rewire``): the controller installs
one part of the train step's topology (``POST /phase`` with ``part``), says which it holds and keeps it across a
restart; the phase model asks for "train:mp" where RLSim's iteration takes re-wiring, and the simulated backend's
train phase re-wires to "train:dp" before the all-reduce by the same rule, as the emulated one does live."""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest

from controller import phases
from controller.runtime import FabricController, load_state
from controller.traffic import phase_traffic
from emulation.scenario import load_scenario
from emulation.validation import SpecError
from fakes_controller import FakeClock, FakeDriver

ROOT = Path(__file__).resolve().parents[2]
MOE = load_scenario(ROOT / "scenarios" / "moe-small.yaml")  # EP 4 over both trainer ToRs
REWIRED = dataclasses.replace(MOE, controller=dataclasses.replace(MOE.controller, train_rewire=True))
SPEC, LAYOUT = MOE.fabric, MOE.layout
TRAFFIC = phase_traffic(SPEC, LAYOUT, MOE.workload)
DENSE = phase_traffic(SPEC, LAYOUT, dataclasses.replace(MOE.workload, model="Qwen2.5-7B", train_ep=1,
                                                            rollout_tp=1))


def core(traffic=TRAFFIC, **kw):
    clock = FakeClock()
    c = FabricController(SPEC, LAYOUT, FakeDriver(clock, SPEC.ocs_count), clock, threading.Lock(),
                         delay_ms=SPEC.reconfig_delay_ms, traffic=traffic, **kw)
    for d in c.switches.expected:
        c.switch_connected(d)
    for d in c.switches.expected:
        c.switch_synced(d, [] if SPEC.classify_dpid(d)[0] == "ocs" else None)
    assert c.ready
    return c


def test_the_controller_installs_a_train_part_says_which_and_keeps_it_across_a_restart(tmp_path):
    state = tmp_path / "state.json"
    c = core(state_path=state)
    mp = phases.train_part_matchings(SPEC, LAYOUT, TRAFFIC, "mp")
    assert mp != phases.phase_matchings(SPEC, LAYOUT, "train", TRAFFIC)  # the part's own: not the one train topology
    rec = c.request_phase({"phase": "train", "part": "mp", "window_ms": 300.0, "gain_ms": 700.0})
    assert rec["status"] == "done" and rec["part"] == "mp" and rec["decision"] == "switched"
    assert c.circuits() == {str(o): m.to_json() for o, m in mp.items()}
    assert (c.state()["phase"], c.state()["part"], c.state()["topology"]) == ("train", "mp", "train:mp")
    assert load_state(state, SPEC) == (mp, "train", "mp")
    again = core(state_path=state)  # a restarted controller reconciles to the part it held
    assert again.state()["topology"] == "train:mp" and again.circuits() == c.circuits()
    # no idle window and no gain: the rule keeps the mp circuits, and the answer says why
    kept = c.request_phase({"phase": "train", "part": "dp", "window_ms": 0.0, "gain_ms": 0.0})
    assert kept["decision"] == "deferred" and "stay" in kept["reason"] and c.state()["topology"] == "train:mp"
    stalled = c.request_phase({"phase": "gen", "window_ms": 0.0, "gain_ms": 1e6})
    assert stalled["decision"] == "stalled" and c.state()["part"] is None and c.state()["topology"] == "gen"


@pytest.mark.parametrize("body,traffic,says", [
    ({"phase": "gen", "part": "mp"}, TRAFFIC, "only the train phase"),
    ({"phase": "train", "part": "ep"}, TRAFFIC, "must be one of mp, dp"),
    ({"phase": "train", "part": 3}, TRAFFIC, "must be a string"),
    ({"phase": "train", "part": "mp"}, None, "told no workload"),
    ({"phase": "train", "part": "mp"}, DENSE, "sends nothing in part 'mp'"),
])
def test_a_bad_part_is_refused_naming_it_and_changes_nothing(body, traffic, says):
    c = core(traffic=traffic)
    before = (c.circuits(), c.state()["topology"])
    with pytest.raises(SpecError) as ei:
        c.request_phase(body)
    assert ei.value.field == "part" and says in str(ei.value)
    assert (c.circuits(), c.state()["topology"]) == before
    assert c.history()[-1]["status"] == "rejected"


def test_the_phase_model_asks_for_the_mp_part_where_rlsim_takes_re_wiring():
    from rlsim.sim import simulate_iteration
    from testbed.backends.phase_model import PhaseModel

    off, on = PhaseModel(MOE), PhaseModel(REWIRED)
    assert off.topology_for("train") == "train" and not off.rewires and off.rewire_plan is None
    assert "train:mp" in off.nets  # modelled all the same: the controller installs a part on request
    it = simulate_iteration(REWIRED, "rfabric")
    assert on.rewire_plan == it["detail"]["train_rewire"] and on.rewires and on.topology_for("train") == "train:mp"
    assert on.topology_for("sync") == "sync"
    lengths = np.full(256, 460)
    t_one, one = on.train_s("train", lengths)
    t_mp, mp = on.train_s("train:mp", lengths)
    assert mp["ep_alltoall_s"] < 0.9 * one["ep_alltoall_s"] and t_mp < t_one  # every uplink to the EP partner
    # the rings run on the mp topology here (one EP cell over both trainer ToRs): nothing to gain, kept
    assert on.rewire_gain_ms(mp) == pytest.approx(0.0, abs=1e-6)
    assert mp["rewire_decision"] == "deferred" and mp["topology_end"] == "train:mp"
    assert on.gain_ms("train", "gen", lengths) == pytest.approx((t_one - t_mp) * 1e3, rel=1e-6)
    # the weights cannot go out on the mp topology (the generators' pod is cut off): the sync must switch
    assert on.gain_ms("sync", "train:mp", lengths) == float("inf")


def test_a_dense_scenario_has_nothing_to_re_wire():
    from testbed.backends.phase_model import PhaseModel

    dense = dataclasses.replace(REWIRED, workload=dataclasses.replace(MOE.workload, model="Qwen2.5-7B", train_ep=1,
                                                                      rollout_tp=1))
    m = PhaseModel(dense)
    assert m.rewire_plan is None and m.topology_for("train") == "train"


def _run(scn):
    from testbed.driver import Driver
    from testbed.runs.experiment import Experiment

    exp = Experiment(scn, "simulated")
    p = exp.policy("static-low")
    d = Driver(exp.scn, exp.backend(p), p, exp.settings)
    return d.run(1), d.timeline


def test_the_simulated_loop_trains_on_the_mp_part_and_shortens_the_train_phase_by_the_all_to_all():
    (off, _), (on, tl) = _run(MOE), _run(REWIRED)
    s_off, s_on = off["steps"][0], on["steps"][0]
    assert s_off["train"]["topology"] == "train" and s_on["train"]["topology"] == "train:mp"
    assert s_on["train"]["rewire_decision"] == "deferred" and s_on["train"]["topology_end"] == "train:mp"
    saved = s_off["train"]["ep_alltoall_s"] - s_on["train"]["ep_alltoall_s"]
    assert saved > 0.1 * s_off["train"]["ep_alltoall_s"]
    assert s_on["phases"]["train_s"] == pytest.approx(s_off["phases"]["train_s"] - saved, abs=1e-6)
    fabric = [e for e in tl.events if e["kind"] == "fabric"]
    assert [(e["phase"], e["topology"]) for e in fabric if e["phase"] in ("train", "sync")] == [
        ("train", "train:mp"), ("sync", "sync")]
    sync = next(e for e in fabric if e["phase"] == "sync")
    assert sync["decision"] == "stalled"  # from the mp topology the weights cannot reach the generators
