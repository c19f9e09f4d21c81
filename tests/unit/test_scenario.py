import os

import pytest
import yaml

from emulation.scenario import ControllerSettings, Scenario, load_scenario
from emulation.spec import FabricSpec
from emulation.validation import SpecError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCEN = os.path.join(ROOT, "scenarios")


def write(tmp_path, data):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_default_scenario_is_emulatable():
    s = load_scenario(os.path.join(SCEN, "default.yaml"))
    f = s.fabric
    assert (f.pods, f.tors_per_pod, f.servers_per_tor, f.ocs_count, f.uplinks_per_tor) == (2, 2, 2, 1, 2)
    assert f.server_link_mbps == pytest.approx(400.0)
    f.check_emulatable()
    assert s.reconfig_delay_ms == f.reconfig_delay_ms and s.wall_delay_ms == f.reconfig_delay_ms * f.time_dilation


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(SCEN) if n.endswith(".yaml")))
def test_every_shipped_scenario_loads(name):
    """A shipped scenario is runnable as shipped: its orchestrator section loads as the typed settings, RLSim can
    size it, its layout splits every server into trainers and generators, and loading it twice gives one
    scenario."""
    from rlsim.limits import check_simulatable

    s = load_scenario(os.path.join(SCEN, name))  # the orchestrator section too: SpecError naming its field
    check_simulatable(s)
    train, gen = s.layout.train_servers(s.fabric), s.layout.gen_servers(s.fabric)
    assert train and gen and not set(train) & set(gen) and len(train) + len(gen) == s.fabric.n_servers
    assert load_scenario(os.path.join(SCEN, name)) == s  # loading is deterministic (a seed reproduces a run)


def test_empty_mapping_gives_defaults(tmp_path):
    s = load_scenario(write(tmp_path, {"name": "x"}))
    assert s == Scenario(name="x")
    assert s.orchestrator.engine.max_num_seqs == 1024  # veRL's rollout default, typed at load


@pytest.mark.parametrize("data, field, text", [
    ({"fabric": {"pods": 0}}, "fabric.pods", "must be >= 1, got 0"),
    ({"fabric": {"podz": 2}}, "fabric.podz", "unknown key"),
    ({"workload": {"model": "x"}}, "workload.model", "must be one of"),
    ({"workload": {"steps": 1.5}}, "workload.steps", "must be an integer"),
    ({"controller": {"delay_ms": -1}}, "controller.delay_ms", "must be in 0..60000 ms"),
    ({"controller": {"initial_phase": "idle"}}, "controller.initial_phase", "must be one of"),
    ({"layout": {"train_pods": [0], "gen_pods": [2]}}, "layout", "do not exist"),
    ({"fabric": {"pods": 3}}, "layout", "have no role"),
    ({"seed": -1}, "seed", ">= 0"),
    ({"fabric": {"host_tcp_cc": "vegas"}}, "fabric.host_tcp_cc", "must be one of cubic, bbr, reno"),
    ({"extra": 1}, "extra", "unknown key"),
    # the orchestrator's section is checked at load too, not first when a run builds its settings
    ({"orchestrator": {"planner": {"min_gain_s": -1}}}, "orchestrator.planner.min_gain_s", "must be a finite"),
    ({"orchestrator": {"balancer": {"tresh": 0.1}}}, "orchestrator.balancer.tresh", "unknown key"),
    ({"orchestrator": {"engine": {"max_num_seqs": 0}}}, "orchestrator.engine.max_num_seqs", "must be an integer"),
    ({"orchestrator": {"dispatch": "round robin"}}, "orchestrator.dispatch", "neither a plug-in name"),
])
def test_errors_name_the_dotted_field(tmp_path, data, field, text):
    with pytest.raises(SpecError) as e:
        load_scenario(write(tmp_path, data))
    assert e.value.field == field
    assert text in str(e.value)


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(SpecError, match="no such file.*nope.yaml"):
        load_scenario(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("fabric: [1, 2\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_scenario(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(SpecError, match="empty"):
        load_scenario(empty)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(SpecError, match="mapping"):
        load_scenario(lst)


def test_seed_reproduces_draws(tmp_path):
    s = load_scenario(write(tmp_path, {"seed": 5}))
    a = s.workload.sample_lengths(s.rng())
    b = s.workload.sample_lengths(s.rng())
    assert (a == b).all()


def test_controller_delay_override():
    s = Scenario(controller=ControllerSettings(reconfig_delay_ms=2.5))
    assert s.reconfig_delay_ms == 2.5 and s.wall_delay_ms == 2.5


def test_the_switching_delay_is_resolved_and_dilated_once_in_the_scenario():
    s = Scenario(fabric=FabricSpec(reconfig_delay_ms=4.0, time_dilation=3.0))
    assert s.reconfig_delay_ms == 4.0 and s.wall_delay_ms == 12.0  # real time; wall time = x time dilation
    s = Scenario(fabric=FabricSpec(reconfig_delay_ms=4.0, time_dilation=3.0),
                 controller=ControllerSettings(reconfig_delay_ms=1.5))
    assert s.reconfig_delay_ms == 1.5 and s.wall_delay_ms == 4.5  # the controller's setting overrides the fabric's


@pytest.mark.parametrize("fabric,controller,field", [
    ({"reconfig_delay_ms": 40000.0, "time_dilation": 2.0}, {}, "fabric.reconfig_delay_ms"),
    ({"time_dilation": 4.0}, {"reconfig_delay_ms": 20000.0}, "controller.reconfig_delay_ms"),
    ({"time_dilation": 4.0}, {"delay_ms": 20000.0}, "controller.delay_ms"),  # the old spelling, as written
])
def test_a_switching_delay_over_the_limit_in_wall_time_names_its_field(tmp_path, fabric, controller, field):
    with pytest.raises(SpecError) as e:
        load_scenario(write(tmp_path, {"fabric": fabric, "controller": controller}))
    assert e.value.field == field and "wall time" in str(e.value)


def test_the_controllers_old_delay_key_is_still_read(tmp_path):
    s = load_scenario(write(tmp_path, {"controller": {"delay_ms": 3.0}}))
    assert s.controller.reconfig_delay_ms == 3.0 and s.reconfig_delay_ms == 3.0
    with pytest.raises(SpecError) as e:
        load_scenario(write(tmp_path, {"controller": {"delay_ms": 3.0, "reconfig_delay_ms": 4.0}}))
    assert e.value.field == "controller.delay_ms"


def test_the_hosts_congestion_control_is_the_scenarios(tmp_path):
    assert load_scenario(write(tmp_path, {"name": "x"})).fabric.host_tcp_cc == "cubic"
    assert load_scenario(write(tmp_path, {"fabric": {"host_tcp_cc": "bbr"}})).fabric.host_tcp_cc == "bbr"


def _sysctl_tree(root, allowed: str):
    d = root / "net" / "ipv4"
    d.mkdir(parents=True)
    (d / "tcp_allowed_congestion_control").write_text(allowed + "\n")
    (d / "tcp_available_congestion_control").write_text("reno bbr cubic\n")
    return d / "tcp_allowed_congestion_control"


def test_a_congestion_control_the_kernel_lacks_is_refused_by_name(tmp_path, monkeypatch):
    from emulation import machine
    from emulation.builder import check_tcp_cc

    monkeypatch.setattr(machine, "SYSCTL_DIR", tmp_path / "sys")
    _sysctl_tree(tmp_path / "sys", "reno cubic")
    avail = tmp_path / "available"
    avail.write_text("reno cubic\n")
    check_tcp_cc("cubic", str(avail))  # offered and allowed: nothing to do
    with pytest.raises(SpecError) as e:
        check_tcp_cc("nosuchcc", str(avail))  # modprobe finds no tcp_nosuchcc either
    assert e.value.field == "host_tcp_cc" and "'nosuchcc' is not available" in str(e.value)
    assert "reno, cubic" in str(e.value)


def test_a_congestion_control_missing_from_the_allowed_list_is_added(tmp_path, monkeypatch, caplog):
    """A fresh machine allows only 'reno bbr' in namespaces other than the root one: the builder adds the
    scenario's algorithm (and says so) instead of failing every host; where it cannot, the error names the
    sysctl and the fix."""
    from emulation import machine
    from emulation.builder import check_tcp_cc

    monkeypatch.setattr(machine, "SYSCTL_DIR", tmp_path / "sys")
    allowed = _sysctl_tree(tmp_path / "sys", "reno bbr")
    avail = tmp_path / "available"
    avail.write_text("reno bbr cubic\n")
    check_tcp_cc("cubic", str(avail))
    assert allowed.read_text().split() == ["reno", "bbr", "cubic"]
    assert "added cubic" in caplog.text
    check_tcp_cc("bbr", str(avail))  # already allowed: unchanged
    assert allowed.read_text().split() == ["reno", "bbr", "cubic"]

    def refuse(setting, value):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(machine, "write", refuse)
    allowed.write_text("reno bbr\n")
    with pytest.raises(SpecError) as e:
        check_tcp_cc("cubic", str(avail))
    assert e.value.field == "host_tcp_cc"
    assert "net.ipv4.tcp_allowed_congestion_control" in str(e.value) and "provision.sh" in str(e.value)


def test_machine_settings_are_checked_and_applied_as_floors(tmp_path, monkeypatch):
    """emulation/machine.py: doctor's check fails on each setting below its floor and names it; apply raises
    only what falls short (more is left alone) and writes the sysctl.d file provision.sh installs."""
    from emulation import machine

    root = tmp_path / "sys"
    monkeypatch.setattr(machine, "SYSCTL_DIR", root)
    monkeypatch.setattr(machine, "SYSCTL_CONF", tmp_path / "etc" / "60-orchestrrl.conf")
    _sysctl_tree(root, "reno bbr")
    values = {"net.core.wmem_default": "212992", "net.core.wmem_max": "33554432", "net.core.rmem_max": "4194304",
              "net.core.netdev_max_backlog": "1000", "net.ipv4.tcp_rmem": "4096\t131072\t33554432",
              "net.ipv4.tcp_wmem": "4096 16384 4194304"}
    for key, val in values.items():
        p = root / key.replace(".", "/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(val + "\n")
    found = {s.key: (ok, msg) for s, ok, msg in machine.check()}
    assert set(found) == {s.key for s in machine.SETTINGS}
    assert found["net.core.wmem_max"][0]  # above the floor: fine as it is
    for key in ("net.ipv4.tcp_allowed_congestion_control", "net.core.wmem_default", "net.core.rmem_max",
                "net.core.netdev_max_backlog", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
        assert not found[key][0] and key in found[key][1]
    assert machine.apply(lambda m: None) == 0
    assert all(ok for _, ok, _ in machine.check())
    read = {s.key: machine.read(s) for s in machine.SETTINGS}
    assert read["net.ipv4.tcp_rmem"] == "10240 131072 33554432"  # each field raised to its floor, no lower
    assert read["net.core.wmem_max"] == "33554432"
    assert read["net.ipv4.tcp_allowed_congestion_control"] == "reno bbr cubic"
    conf = (tmp_path / "etc" / "60-orchestrrl.conf").read_text()
    assert "net.core.netdev_max_backlog = 5000" in conf and "net.ipv4.tcp_allowed_congestion_control = reno bbr cubic" in conf