"""Plug-ins (emulation/plugins.py and the registries on it): every registry resolves its built-ins, dotted paths
and entry points; each malformed plug-in is refused naming the field, before anything starts (the CLI exits
2); a plug-in whose decision cannot be carried out stops the run with a clear error (the CLI exits 1); a
plug-in sees what the built-ins see and never a length before its response finished; the two published
policies of contrib/ run end to end on the simulated backend."""
from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import plugin_cases
from emulation.orchestration import PolicySpec, orchestrator_settings
from emulation.plugins import DecisionError
from emulation.validation import SpecError, to_dict
from testbed.orchestrator.interfaces import BALANCERS, DISPATCHERS, PLANNERS
from testbed.orchestrator.policies import compose, make_policy, parse_policy_arg, split_policies

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from small_scenario import small_scenario  # noqa: E402

LAYOUTS = [__import__("agents.engine", fromlist=["Layout"]).Layout(t) for t in (1, 2, 4, 8)]


# ---- the registries ------------------------------------------------------------------------------------
def test_every_registry_resolves_its_builtins():
    from controller.fabric_rules import FABRIC_RULES, BenefitAware
    from rlsim.fabric_models import FABRIC_MODELS, fabric_model
    from testbed.backends.registry import BACKENDS
    from testbed.orchestrator.balancer import Balancer
    from testbed.orchestrator.dispatch import Contiguous, Random
    from testbed.orchestrator.planner import Planner

    assert DISPATCHERS.resolve("contiguous", "f") is Contiguous and DISPATCHERS.resolve("random", "f") is Random
    assert PLANNERS.resolve("forecast", "f") is Planner is PLANNERS.resolve("builtin", "f")
    assert BALANCERS.resolve("load-index", "f") is Balancer is BALANCERS.resolve("builtin", "f")
    assert FABRIC_RULES.resolve("benefit-aware", "f") is BenefitAware
    assert {"emulated", "simulated"} <= set(BACKENDS.names())
    from emulation.spec import FABRICS
    assert FABRIC_MODELS.names() == FABRICS
    assert fabric_model("rfabric").reconfigures and not fabric_model("fat-tree-4to1").reconfigures
    assert fabric_model("fat-tree-4to1").oversub == 4.0


def test_dotted_paths_and_entry_points_resolve(monkeypatch):
    assert PLANNERS.resolve("plugin_cases:KeepPlanner", "f") is plugin_cases.KeepPlanner
    assert PLANNERS.resolve("plugin_cases.KeepPlanner", "f") is plugin_cases.KeepPlanner  # module.Class too
    from contrib.rollpacker import RollPackerPlanner
    from contrib.seer import SeerDispatch
    assert PLANNERS.resolve("contrib.rollpacker:RollPackerPlanner", "f") is RollPackerPlanner
    assert DISPATCHERS.resolve("contrib.seer:SeerDispatch", "f") is SeerDispatch

    class EP:  # an installed package's entry point (importlib.metadata.EntryPoint's interface)
        name, value, group = "keep", "plugin_cases:KeepPlanner", "orchestrrl.planners"

        def load(self):
            return plugin_cases.KeepPlanner

    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [EP()] if group == "orchestrrl.planners" else real(group=group))
    assert PLANNERS.resolve("keep", "f") is plugin_cases.KeepPlanner


@pytest.mark.parametrize("ref, role, match", [
    ("round-robin", "dispatch", "unknown dispatch 'round-robin'"),
    ("plugin_cases:Nowhere", "planner", "has no 'Nowhere'"),
    ("no_such_module:Cls", "planner", "does not import: ModuleNotFoundError"),
    ("plugin_cases:NOT_A_CLASS", "planner", "is a NotAClass, not a class"),
    ("plugin_cases:NoMethods", "planner", r"lacks evaluate_all\(\), initial\(\)"),
    ("plugin_cases:NoMethods", "balancer", r"lacks moves\(\)"),
    ("plugin_cases:KeepPlanner", "balancer", r"does not implement the balancer interface"),
    ("plugin_cases:BadParams", "planner", "Params must be a dataclass"),
])
def test_a_malformed_plugin_is_refused_naming_the_field(ref, role, match):
    with pytest.raises(SpecError, match=match) as e:
        compose(PolicySpec("mine", **{role: ref}), "orchestrator.policies[0]")
    assert e.value.field == f"orchestrator.policies[0].{role}"


@pytest.mark.parametrize("params, field, match", [
    ({"planner": {"colour": 1}}, "params.planner.colour", "unknown key"),
    ({"planner": {"margin": "wide"}}, "params.planner.margin", "must be a number"),
    ({"planner": {"margin": 1.5}}, "params.planner.margin", r"must be in \[0, 1\)"),
    ({"planner": 3}, "params.planner", "must be a mapping"),
])
def test_a_bad_parameter_is_refused_naming_the_field(params, field, match):
    with pytest.raises(SpecError, match=match) as e:
        compose(PolicySpec("mine", planner="plugin_cases:KeepPlanner", params=params), "orchestrator.policies[0]")
    assert e.value.field == f"orchestrator.policies[0].{field}"
    with pytest.raises(SpecError, match="takes no parameters"):  # the built-ins take theirs from the scenario
        compose(PolicySpec("mine", planner="builtin", params={"planner": {"x": 1}}), "p")


def test_scenario_policies_are_validated_where_the_scenario_loads():
    bad = [({"policies": [{"name": "a,b"}]}, "orchestrator.policies[0].name"),
           ({"policies": [{"name": "m", "params": {"planner": {}}}]}, "orchestrator.policies[0].params.planner"),
           ({"policies": [{"name": "m", "params": {"trainer": {}}}]}, "orchestrator.policies[0].params.trainer"),
           ({"policies": [{"name": "m"}, {"name": "m"}]}, "orchestrator.policies[1].name"),
           ({"policies": [{"name": "m", "colour": 1}]}, "orchestrator.policies[0].colour"),
           ({"dispatch": "a b"}, "orchestrator.dispatch")]
    for data, field in bad:
        with pytest.raises(SpecError) as e:
            orchestrator_settings(data)
        assert e.value.field == field, data
    from testbed.runs.experiment import Experiment
    with pytest.raises(SpecError, match="names a built-in policy"):
        Experiment(small_scenario("x", orchestrator={"policies": [{"name": "planner", "planner": "builtin"}]}),
                   "simulated")
    with pytest.raises(SpecError) as e:
        Experiment(small_scenario("x", orchestrator={"policies": [{"name": "m", "planner": "nope:X"}]}), "simulated")
    assert e.value.field == "orchestrator.policies[0].planner"


def test_compare_policies_definitions_parse():
    items = split_policies("planner, mine[planner=plugin_cases:KeepPlanner,planner.layout=TP8x1,planner.margin=0.1],x")
    assert items == ["planner", "mine[planner=plugin_cases:KeepPlanner,planner.layout=TP8x1,planner.margin=0.1]", "x"]
    spec = parse_policy_arg(items[1])
    assert spec == PolicySpec("mine", planner="plugin_cases:KeepPlanner",
                              params={"planner": {"layout": "TP8x1", "margin": 0.1}})
    pol = make_policy(spec, LAYOUTS, 8)
    assert pol.planner.params.layout == "TP8x1" and pol.oracle_kind == "switch" and pol.layout is None
    for bad in ("m[planner=x", "m[trainer=x]", "m[planner]"):
        with pytest.raises(SpecError) as e:
            parse_policy_arg(bad)
        assert e.value.field.startswith("--policies")


def test_builtin_policies_are_compositions():
    assert make_policy("orchestrrl", LAYOUTS, 8).planner.ref == "forecast"
    assert make_policy("orchestrrl", LAYOUTS, 8).oracle_kind == "both"
    bal = make_policy("balancer", LAYOUTS, 8, tuned=make_policy("static-TP8x1@256", LAYOUTS, 8))
    assert bal.layout.tp == 8 and bal.max_num_seqs == 256 and bal.oracle_kind == "placement"
    seer = compose(PolicySpec("seer", dispatch="contrib.seer:SeerDispatch"), "p")
    assert seer.oracle_kind == "placement" and not seer.static
    assert make_policy("static-low", LAYOUTS, 8).oracle_kind is None


def test_the_cli_refuses_a_malformed_plugin_with_exit_2(capsys):
    from testbed.cli import main

    scn = str(Path(__file__).resolve().parents[2] / "scenarios" / "default.yaml")
    assert main(["compare", scn, "--backend", "simulated", "--policies", "m[planner=plugin_cases:NoMethods]"]) == 2
    assert "--policies.m.planner" in capsys.readouterr().err
    assert main(["run", scn, "--backend", "simulated", "--policy", "m[planner=plugin_cases:KeepPlanner,"
                                                                   "planner.margin=2]"]) == 2
    assert "--policies.m.params.planner.margin" in capsys.readouterr().err
    assert main(["compare", scn, "--backend", "pkg_nowhere:Backend"]) == 2
    assert "--backend" in capsys.readouterr().err


# ---- impossible decisions: a clear error, the run stops ----------------------------------------------
def _run(policy: dict, tmp_path, steps: int = 1, **orch):
    from testbed.runs.experiment import Experiment

    exp = Experiment(small_scenario("plugins", orchestrator={"policies": [policy], **orch}), "simulated", steps=steps)
    with exp:
        return exp.run(exp.policy(policy["name"]), steps, tmp_path)


@pytest.mark.parametrize("policy, who, match", [
    ({"name": "big", "planner": "plugin_cases:HugeTP"}, "planner 'plugin_cases:HugeTP'",
     "layout .* is not one the server can hold"),
    ({"name": "ghost", "balancer": "plugin_cases:GhostMove"}, "balancer 'plugin_cases:GhostMove'",
     "move of request 123456789 from server 2: the server does not hold it"),
    ({"name": "twice", "dispatch": "plugin_cases:Twice"}, "dispatch 'plugin_cases:Twice'", "dealt twice"),
    ({"name": "hoard", "dispatch": "plugin_cases:Hoarder"}, "dispatch 'plugin_cases:Hoarder'",
     "holds 96 requests while every server is idle"),
])
def test_an_impossible_decision_stops_the_run_with_a_clear_error(policy, who, match, tmp_path):
    with pytest.raises(DecisionError, match=match) as e:
        _run(policy, tmp_path)
    assert e.value.who == f"policy {policy['name']!r}: {who}"


def test_the_cli_stops_an_impossible_decision_with_exit_1(tmp_path, capsys):
    from testbed.cli import main

    scn = small_scenario("plugins", orchestrator={"policies": [{"name": "big", "planner": "plugin_cases:HugeTP"}]})
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(to_dict(scn)))
    assert main(["run", str(path), "--backend", "simulated", "--policy", "big", "--out", str(tmp_path / "o"),
                 "-q", "--metrics-port", "0"]) == 1
    err = capsys.readouterr().err
    assert "policy 'big': planner 'plugin_cases:HugeTP'" in err and "the run was stopped" in err


# ---- what a plug-in sees, and its decisions on the common path ------------------------------------------
def test_a_plugin_sees_snapshots_and_stats_and_only_finished_lengths(tmp_path):
    plugin_cases.KeepPlanner.seen.clear()
    plugin_cases.Trickle.pools.clear()
    res, _ = _run({"name": "mine", "planner": "plugin_cases:KeepPlanner", "dispatch": "plugin_cases:Trickle",
                   "params": {"planner": {"layout": "TP8x1"}}}, tmp_path, steps=2)
    assert res["lost_requests"] == 0 and res["exactly_once"]
    assert set(res["layouts"].values()) == {"TP8x1"}  # its layout, carried out at the first step's start
    assert plugin_cases.KeepPlanner.seen and all(st for tick in plugin_cases.KeepPlanner.seen for _, st in tick.values())
    pools = plugin_cases.Trickle.pools
    assert pools and any(fin for fin, *_ in pools)
    for fin, held, running, step in pools:  # a length is shown once its response finished, never before
        rids = {step * (1 << 24) + i for i in fin}
        assert not fin & held and not rids & running


def test_the_published_policies_run_end_to_end_on_the_simulated_backend(tmp_path):
    from testbed.runs.experiment import Experiment

    scn = small_scenario("contrib", steps=2, orchestrator={"policies": [
        {"name": "seer", "dispatch": "contrib.seer:SeerDispatch"},
        {"name": "seer-orchestrrl", "dispatch": "contrib.seer:SeerDispatch", "planner": "builtin",
         "balancer": "builtin"},
        {"name": "rollpacker", "planner": "contrib.rollpacker:RollPackerPlanner"}]})
    exp = Experiment(scn, "simulated", steps=2)
    with exp:
        rep, files = exp.compare([exp.policy(n) for n in ("seer", "seer-orchestrrl", "rollpacker")], 2, tmp_path)
    pol = rep["policies"]
    assert {"seer", "seer-orchestrrl", "rollpacker", rep["best_static"]} <= set(pol)
    for n in ("seer", "seer-orchestrrl", "rollpacker"):
        assert pol[n]["lost_requests"] == 0 and pol[n]["exactly_once"] and pol[n]["speedup_vs_best_static"] > 0
        assert pol[n]["oracle_fraction"] == pytest.approx(
            pol[n]["speedup_vs_best_static"] / rep["oracle"]["kinds"][pol[n]["oracle_kind"]]["speedup"])
    assert (pol["seer"]["oracle_kind"], pol["rollpacker"]["oracle_kind"]) == ("placement", "switch")


def test_seer_probes_first_then_longest_estimate_first():
    from agents.engine import Layout
    from contrib.seer import SeerDispatch
    from testbed.backends.base import ServerState
    from testbed.orchestrator.interfaces import Batch, Pool

    class Ctx:
        gpus, max_response_tokens = 8, 4096
        settings = orchestrator_settings({"engine": {"max_num_seqs": 4}})

        def seats(self, layout):
            return layout.replicas(8) * 4

    pid = np.repeat(np.arange(6), 4)  # 6 groups of 4 samples
    d = SeerDispatch(Ctx(), SeerDispatch.Params()).deal(
        Batch(0, 24, pid, np.full(24, 256), (2, 3), {2: Layout(8), 3: Layout(8)}, None, np.random.default_rng(0)))
    probes = {0, 4, 8, 12, 16, 20}
    assert set(d.placed[2][:3]) | set(d.placed[3][:3]) == probes  # the probes head every server's queue
    assert sum(len(v) for v in d.placed.values()) == 8 and len(d.held) == 16  # 4 seats each
    # group 1 finished a sample of 900 tokens, group 2 one of 100: group 1's samples go first, then the groups
    # not known yet (estimated at the cap: first, with unknown=cap)
    empty = {"rid": np.zeros(0, np.int64)}
    st = {s: ServerState(s, Layout(8), empty, {}) for s in (2, 3)}
    out = SeerDispatch(Ctx(), SeerDispatch.Params(unknown="last")).release(
        Pool(1.0, 0, np.array(sorted(set(range(24)) - probes)), pid, np.full(24, 256), {4: 900, 8: 100}, st))
    first = sorted(np.concatenate(list(out.values())).tolist())
    assert set(first) == {5, 6, 7, 9, 10, 11, 1, 2}  # group 1 (900), then group 2 (100), 8 seats


def test_rollpacker_doubles_on_rising_preemptions_and_halves_after_calm_steps():
    from agents.engine import Layout
    from contrib.rollpacker import RollPackerPlanner
    from testbed.backends.base import ServerState

    class Ctx:
        gpus, layouts = 8, tuple(LAYOUTS)

    rp = RollPackerPlanner(Ctx(), RollPackerPlanner.Params())
    assert rp.tp == 1
    total = {2: 0}

    def step(k, preempted):
        total[2] += preempted
        rp.step_end(k, {2: ServerState(2, Layout(rp.tp), {}, {"num_preemptions_total": total[2]})})
        return rp.tp

    assert step(0, 10) == 2  # 10 > 1.05 x 0: TP doubles
    assert step(1, 10) == 2  # not more than 1.05 x 10: stays
    assert step(2, 11) == 4  # 11 > 10.5: doubles
    assert [step(k, 0) for k in range(3, 7)] == [4, 4, 4, 2]  # the 4th step without a preemption halves
    assert [step(k, n) for k, n in ((7, 50), (8, 100), (9, 200))] == [4, 8, 8]  # up to the server's 8 GPUs


def test_a_request_may_move_on_within_a_tick_but_only_from_where_it_is():
    """The built-in balancer moves a request between a server's replicas and then to another server in one tick
    (MoE): a chain is carried out; a move from a server the request already left is refused."""
    from types import SimpleNamespace

    from agents.engine import Layout
    from testbed.decision_checks import checked_moves
    from testbed.orchestrator.balancer import Move

    views = {s: SimpleNamespace(layout=Layout(1)) for s in (4, 5, 6)}
    rids = {4: np.array([10, 11]), 5: np.array([20]), 6: np.array([], np.int64)}
    chain = [Move(10, 4, 4, 3), Move(10, 4, 5, 0), Move(10, 5, 6, 7)]
    assert checked_moves("b", chain, views, rids, 8) == chain
    with pytest.raises(DecisionError, match="an earlier move of this tick put it on server 5"):
        checked_moves("b", [Move(11, 4, 5), Move(11, 4, 6)], views, rids, 8)
    with pytest.raises(DecisionError, match="has replicas 0..7"):
        checked_moves("b", [Move(20, 5, 6, 8)], views, rids, 8)
