"""Live metrics (controller/metrics.py, testbed/runs/metrics.py, emulation/metrics.py): README's table is what the
registries hold; a reconfiguration moves its counters by exactly one; the driver's observer turns a run's
timeline into the engines' and the orchestrator's metrics; the endpoint's port rule and bad input."""
from __future__ import annotations

import dataclasses
import logging
import re
import socket
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller.metrics import CONTROLLER_METRICS, ControllerMetrics
from controller.rest import RestApp
from controller.runtime import FabricController, NotReady
from emulation.metrics import MetricDef, bind_port, registered, serve, serve_free
from emulation.scenario import MetricsSettings, Scenario
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError, from_dict
from testbed import cli
from testbed.driver import Timeline
from testbed.runs.metrics import DRIVER_METRICS, DriverMetrics, markdown_table
from fakes_controller import FakeClock, FakeDriver
from small_scenario import small_scenario

ROOT = Path(__file__).resolve().parents[2]
SPEC = FabricSpec()
LAYOUT = JobLayout()


def values(registry, name: str) -> dict[tuple, float]:
    """``name``'s samples in a scrape of ``registry``: sorted label items -> value."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(registry, name: str, **match) -> float:
    return sum(v for k, v in values(registry, name).items() if all(dict(k).get(a) == b for a, b in match.items()))


# ---- README's table is the registries ---------------------------------------------------------------------
def readme_rows() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- metrics-table:start -->\n(.*?)\n<!-- metrics-table:end -->", text, re.S)
    assert m, "README.md has no metrics table between its markers"
    assert m.group(1) == markdown_table(), "README's metric table drifted: paste `python -m testbed.runs.metrics`"
    rows = {}
    for line in m.group(1).splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        labels = () if cells[3] == "-" else tuple(x.strip(" `") for x in cells[3].split(","))
        rows[cells[0].strip("`")] = (cells[1], cells[2], labels)
    return rows


def test_every_metric_the_readme_lists_is_registered_with_its_labels():
    rows = readme_rows()
    reg = {**{n: ("controller",) + v for n, v in registered(ControllerMetrics().registry).items()},
           **{n: ("driver",) + v for n, v in registered(DriverMetrics().registry).items()}}
    assert set(rows) == set(reg)  # nothing listed that is not exported, nothing exported unlisted
    for name, (kind, process, labels) in rows.items():
        assert reg[name] == (process, kind, labels), name
    # the names their users know: vLLM's, with its types and its first two labels
    for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:generation_tokens_total", "counter"),
                       ("vllm:num_preemptions_total", "counter")):
        assert rows[name][0] == kind and rows[name][2][0] == "model_name"
    assert rows["vllm:num_requests_running"][2][:2] == ("model_name", "engine")


def test_a_metric_definition_is_checked():
    with pytest.raises(SpecError, match="_total"):
        MetricDef("orl_x", "counter", "a counter without _total")
    with pytest.raises(SpecError, match="kind"):
        MetricDef("orl_x", "summary", "not a kind we export")
    assert len({d.name for d in CONTROLLER_METRICS + DRIVER_METRICS}) == len(CONTROLLER_METRICS + DRIVER_METRICS)


# ---- the controller: one record, one count -------------------------------------------------------------------
def ready_core():
    clock = FakeClock()
    drv = FakeDriver(clock, SPEC.ocs_count)
    cm = ControllerMetrics()
    core = FabricController(SPEC, LAYOUT, drv, clock, threading.Lock(), delay_ms=SPEC.reconfig_delay_ms,
                            metrics=cm)
    for d in core.switches.expected:
        core.switch_connected(d)
    for d in core.switches.expected:
        core.switch_synced(d, [] if SPEC.classify_dpid(d)[0] == "ocs" else None)
    assert core.ready
    return core, cm


RECONF = "orchestrrl_reconfigurations_total"


def counts(cm) -> dict[str, float]:
    r = cm.registry
    return {"reconf": total(r, RECONF), "rejected": total(r, "orchestrrl_reconfigurations_rejected_total"),
            "blackout": total(r, "orchestrrl_reconfiguration_blackout_seconds_count"),
            "overhead": total(r, "orchestrrl_reconfiguration_overhead_seconds_count"),
            "stages": total(r, "orchestrrl_reconfiguration_overhead_stage_seconds_total")}


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def test_a_reconfiguration_moves_each_counter_by_exactly_one():
    core, cm = ready_core()
    r = cm.registry
    # the initial installation is a reconfiguration too (kind initial), counted once
    assert values(r, RECONF)[(("decision", "switched"), ("kind", "initial"), ("status", "done"))] == 1
    assert values(r, "orchestrrl_fabric_phase")[(("phase", "train"),)] == 1
    before = counts(cm)
    rec = core.request_phase({"phase": "gen", "delay_ms": 10})
    assert rec["decision"] == "switched" and not rec["noop"]
    assert delta(before, counts(cm)) == {"reconf": 1, "blackout": 1, "overhead": 1, "stages": pytest.approx(
        sum(rec["overhead_stages_ms"].values()) / 1000, abs=1e-6)}
    assert values(r, RECONF)[(("decision", "switched"), ("kind", "phase"), ("status", "done"))] == 1
    assert {k[0][1]: v for k, v in values(r, "orchestrrl_fabric_phase").items()} == \
        {"train": 0, "gen": 1, "sync": 0, "none": 0}
    assert values(r, "orchestrrl_ocs_circuits")[(("ocs", "0"),)] == len(core.matchings[0].circuits)
    assert total(r, "orchestrrl_reconfiguration_blackout_seconds_sum") == pytest.approx(rec["dark_ms"] / 1000)
    # deferred: the decision counter only, and nothing about the fabric moves
    before = counts(cm)
    rec = core.request_phase({"phase": "train", "delay_ms": 10, "window_ms": 2})
    assert rec["status"] == "deferred"
    assert delta(before, counts(cm)) == {"reconf": 1}
    assert values(r, RECONF)[(("decision", "deferred"), ("kind", "phase"), ("status", "deferred"))] == 1
    assert values(r, "orchestrrl_fabric_phase")[(("phase", "gen"),)] == 1
    # stalled: counted under its decision, its stall added to the stall counter
    before = counts(cm)
    rec = core.request_phase({"phase": "train", "delay_ms": 10, "window_ms": 1, "gain_ms": 50})
    assert rec["decision"] == "stalled"
    d = delta(before, counts(cm))
    assert d.pop("stages") == pytest.approx(sum(rec["overhead_stages_ms"].values()) / 1000, abs=1e-6)
    assert d == {"reconf": 1, "blackout": 1, "overhead": 1}
    assert total(r, "orchestrrl_reconfiguration_stall_seconds_total") == pytest.approx(rec["stall_ms"] / 1000)
    # bad input: rejected, no decision
    before = counts(cm)
    with pytest.raises(SpecError):
        core.request_phase({"phase": "lunch"})
    assert delta(before, counts(cm)) == {"rejected": 1}
    # circuits set directly: the phase is "none"
    core.request_circuits({"circuits": {"0": [[1, 3], [2, 4]]}, "delay_ms": 5})
    assert values(r, "orchestrrl_fabric_phase")[(("phase", "none"),)] == 1
    assert values(r, "orchestrrl_ocs_circuits")[(("ocs", "0"),)] == 2
    # the counters agree with the history, record for record
    hist: dict[tuple, int] = {}
    for h in core.history():
        if "decision" in h:
            key = (("decision", h["decision"]), ("kind", h["kind"]), ("status", h["status"]))
            hist[key] = hist.get(key, 0) + 1
    assert {k: v for k, v in values(r, RECONF).items() if v} == hist
    assert total(r, "orchestrrl_reconfigurations_rejected_total") == \
        sum(1 for h in core.history() if h["status"] == "rejected")


def test_a_reconfiguration_refused_while_not_ready_is_a_rejection():
    clock = FakeClock()
    cm = ControllerMetrics()
    core = FabricController(SPEC, LAYOUT, FakeDriver(clock, 1), clock, threading.Lock(),
                            delay_ms=SPEC.reconfig_delay_ms, metrics=cm)
    with pytest.raises(NotReady):
        core.request_phase({"phase": "gen"})
    assert values(cm.registry, "orchestrrl_reconfigurations_rejected_total") == {(("kind", "phase"),): 1,
                                                                                 (("kind", "circuits"),): 0}
    assert total(cm.registry, RECONF) == 0
    assert values(cm.registry, "orchestrrl_controller_ready")[()] == 0
    assert values(cm.registry, "orchestrrl_controller_switches_expected")[()] == len(core.switches.expected)


def test_rest_answers_are_counted_by_status():
    core, cm = ready_core()
    app = RestApp(core, "t" * 20, on_answer=cm.rest)

    def call(method, path, token="t" * 20, body=b""):
        import io

        env = {"REQUEST_METHOD": method, "PATH_INFO": path, "CONTENT_LENGTH": str(len(body)),
               "wsgi.input": io.BytesIO(body)}
        if token:
            env["HTTP_AUTHORIZATION"] = f"Bearer {token}"
        app(env, lambda status, headers: None)

    call("GET", "/api/v1/state")
    call("GET", "/api/v1/state", token="wrong-token-wrong-token")
    call("POST", "/api/v1/phase", body=b'{"phase": "nope"}')
    call("GET", "/nowhere")
    got = {tuple(v for _, v in k): n for k, n in values(cm.registry, "orchestrrl_controller_rest_requests_total").items()}
    # labels sorted by name: code, endpoint, method
    assert got == {("200", "state", "GET"): 1, ("401", "state", "GET"): 1, ("400", "phase", "POST"): 1,
                   ("404", "other", "GET"): 1}


def test_datapath_flushes_are_counted_by_result():
    from controller.app import OsKenDriver
    from controller.datapath import FlowCacheError

    class Cache:
        path, fail = "/nowhere.ctl", False

        def purge(self):
            if self.fail:
                raise FlowCacheError("gone")
            return 0.4

    cm, cache = ControllerMetrics(), Cache()
    drv = OsKenDriver(app=None, flow_cache=cache, metrics=cm)
    drv.flush_flow_cache()
    cache.fail = True
    drv.flush_flow_cache()
    assert {k[0][1]: v for k, v in values(cm.registry, "orchestrrl_datapath_flushes_total").items()} == \
        {"ok": 1, "failed": 1}
    assert total(cm.registry, "orchestrrl_datapath_flush_seconds_total") == pytest.approx(0.0004)


# ---- the driver: a run's timeline becomes metrics ------------------------------------------------------------
SMALL = small_scenario("metrics-small", seed=3, steps=2, orchestrator={"step_mode": "sync"})


def test_a_simulated_run_exports_what_its_run_json_says(tmp_path):
    from testbed.runs.experiment import Experiment

    dm = DriverMetrics()
    exp = Experiment(SMALL, "simulated", metrics=dm)
    with exp:
        res, files = exp.run(exp.policy("orchestrrl"), 1, tmp_path)
    r = dm.registry
    tokens = sum(s["tokens"] for s in res["steps"])
    assert res["lost_requests"] == 0
    # the engines' own counters (sampled at the ticks and once when a step's generation ends) add up exactly
    assert total(r, "vllm:generation_tokens_total", policy="orchestrrl") == tokens
    assert total(r, "orchestrrl_step_tokens_total", policy="orchestrrl") == tokens
    assert total(r, "orchestrrl_steps_total") == 1
    assert values(r, "orchestrrl_step_makespan_seconds")[(("policy", "orchestrrl"),)] == \
        pytest.approx(res["step_makespan_s"][-1])
    assert values(r, "orchestrrl_forecast_error_ratio")[(("policy", "orchestrrl"),)] == \
        pytest.approx(res["forecast"]["per_step"][-1]["ape"])
    import json

    events = json.loads(Path(files["timeline"]).read_text())["events"]
    live = [e for e in events if e["kind"] == "layout_switch" and not e.get("initial")]
    assert total(r, "orchestrrl_layout_switches_total", kind="live") == len(live) == res["layout_switches"]
    assert total(r, "orchestrrl_migrations_total") == res["migrations"]
    fabric = [e for e in events if e["kind"] == "fabric"]
    assert total(r, "orchestrrl_fabric_requests_total") == len(fabric) > 0
    plans = [e for e in events if e["kind"] == "plan"]
    assert total(r, "orchestrrl_planner_decisions_total") == sum(len(e["gain_s"]) for e in plans) > 0
    # the run ended: its live gauges are gone, its counters and last-step figures stay
    assert values(r, "vllm:num_requests_running") == {} and values(r, "orchestrrl_load_index_seconds") == {}
    assert values(r, "orchestrrl_run_active")[(("backend", "simulated"), ("policy", "orchestrrl"),
                                               ("scenario", "metrics-small"))] == 0


def sample(servers: dict) -> dict:
    return {"t": 1.0, "load": {s: 2.5 for s in servers},
            "servers": {s: {"layout": lay, "running": [3] * n, "waiting": [1] * n, "kv": [0.5] * n, "tokens": tok,
                            "preemptions": pre, "switching": False}
                        for s, (lay, n, tok, pre) in servers.items()}}


def test_the_observer_follows_replicas_and_engine_counters():
    dm = DriverMetrics()
    tl = Timeline()
    obs = dm.observe(tl, "p", "M", "simulated", "s")
    r = dm.registry
    tl.sample(sample({4: ("TP1x8", 8, 100, 2), 5: ("TP1x8", 8, 50, 0)}))
    assert len(values(r, "vllm:num_requests_running")) == 16
    assert values(r, "vllm:kv_cache_usage_perc")[(("engine", "7"), ("model_name", "M"), ("policy", "p"),
                                                  ("server", "4"))] == 0.5
    # a layout switch rebuilds server 4 as one replica: its seven other engines' series go
    tl.sample(sample({4: ("TP8x1", 1, 180, 3), 5: ("TP1x8", 8, 90, 0)}))
    assert sorted(dict(k)["engine"] for k in values(r, "vllm:num_requests_running") if dict(k)["server"] == "4") == ["0"]
    assert values(r, "orchestrrl_server_layout") == {
        (("layout", "TP8x1"), ("policy", "p"), ("server", "4")): 1,
        (("layout", "TP1x8"), ("policy", "p"), ("server", "5")): 1}
    assert total(r, "vllm:generation_tokens_total", server="4") == 180
    assert total(r, "vllm:num_preemptions_total", server="4") == 3
    # an engine that restarted (a reset agent) counts on from its new value: the counter never goes back
    tl.sample(sample({4: ("TP8x1", 1, 20, 0), 5: ("TP1x8", 8, 90, 0)}))
    assert total(r, "vllm:generation_tokens_total", server="4") == 200
    # a server that stops answering (failed) loses its engine series, not its counters
    tl.sample(sample({5: ("TP1x8", 8, 95, 0)}))
    assert {dict(k)["server"] for k in values(r, "vllm:num_requests_waiting")} == {"5"}
    assert total(r, "vllm:generation_tokens_total", server="4") == 200
    tl.event(2.0, "agent_failed", server=4, why="gone", requests=3)
    tl.event(2.0, "requeued", server=4, to=[5], requests=3, delivered_tokens=10)
    tl.event(2.0, "migration", rid=1, src=5, dst=4, result="moved", downtime_s=0.002)
    tl.event(2.0, "migration_failed", rid=2, src=5, dst=4, error="busy")
    assert total(r, "orchestrrl_agent_failures_total", server="4") == 1
    assert total(r, "orchestrrl_requeued_requests_total") == 3
    assert values(r, "orchestrrl_migrations_total")[(("policy", "p"), ("result", "moved"))] == 1
    assert values(r, "orchestrrl_migrations_total")[(("policy", "p"), ("result", "failed"))] == 1
    assert total(r, "orchestrrl_migration_downtime_seconds_count") == 1
    tl.event(3.0, "run_end", steps=1, distorted=True, tdf_needed=2.5, link_efficiency_min=0.7,
             agents_distorted={"5": True})
    assert values(r, "orchestrrl_fidelity_distorted")[(("policy", "p"),)] == 1
    assert values(r, "orchestrrl_fidelity_agent_distorted")[(("policy", "p"), ("server", "5"))] == 1
    obs.close()
    assert obs not in tl.observers and values(r, "vllm:num_requests_running") == {}
    obs.close()  # idempotent


def test_a_failing_observer_is_logged_and_the_run_goes_on(caplog):
    class Broken:
        def on_event(self, e):
            raise RuntimeError("observer bug")

        def on_sample(self, s):
            raise RuntimeError("observer bug")

    tl = Timeline(observers=[Broken()])
    with caplog.at_level(logging.ERROR):
        tl.event(1.0, "step", step=0)
        tl.sample({"t": 1.0, "servers": {}, "load": {}})
    assert len(tl.events) == 1 and len(tl.samples) == 1
    assert "observer" in caplog.text


# ---- the endpoint: loopback, the port rule, bad input --------------------------------------------------------
def test_the_endpoint_serves_on_loopback_and_stops():
    dm = DriverMetrics().serve("127.0.0.1", 0)
    assert dm.url is None  # 0: no endpoint
    dm = DriverMetrics()
    with socket.socket() as s:  # the default port is taken: the endpoint falls back to a free one
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        dm.server = serve(dm.registry, "127.0.0.1", None, taken, "metrics.driver_port")
    try:
        assert dm.server.port not in (0, taken) and dm.url == f"http://127.0.0.1:{dm.server.port}/metrics"
        body = urllib.request.urlopen(dm.url, timeout=5).read().decode()
        assert "# TYPE vllm:num_requests_running gauge" in body
    finally:
        dm.stop()
        dm.stop()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(dm.url, timeout=2)


def test_a_port_in_use_is_an_error_when_given_and_a_fallback_when_default(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(SpecError, match=f"metrics.driver_port: port {taken} on 127.0.0.1 is in use"):
            serve(DriverMetrics().registry, "127.0.0.1", taken, 9481, "metrics.driver_port")
        with pytest.raises(SpecError, match="metrics.controller_port: port"):
            bind_port("127.0.0.1", taken, 9480, "metrics.controller_port")
        with caplog.at_level(logging.WARNING):
            picked = bind_port("127.0.0.1", None, taken, "metrics.controller_port")
        assert picked not in (0, taken) and "in use" in caplog.text
        assert bind_port("127.0.0.1", 0, taken, "metrics.controller_port") == 0


@pytest.mark.parametrize("section, field", [
    ({"driver_port": -1}, "metrics.driver_port"), ({"controller_port": 70000}, "metrics.controller_port"),
    ({"driver_port": "9481"}, "metrics.driver_port"), ({"host": "localhost"}, "metrics.host"),
    ({"port": 1}, "metrics.port")])
def test_a_bad_metrics_section_names_its_field(section, field):
    with pytest.raises(SpecError) as e:
        from_dict(Scenario, {"metrics": section})
    assert e.value.field == field


def test_a_bad_metrics_flag_exits_2_naming_it(capsys):
    assert cli.main(["run", "scenarios/default.yaml", "--backend", "simulated", "--metrics-port", "-5"]) == 2
    assert "--metrics-port" in capsys.readouterr().err
    assert cli.main(["fabric", "up", "scenarios/default.yaml", "--controller-metrics-port", "99999"]) == 2
    assert "--controller-metrics-port" in capsys.readouterr().err


def test_run_prints_its_endpoint_and_serves_it_while_it_runs(tmp_path, capsys, monkeypatch):
    """`orchestrrl run` prints the URL before it starts; the endpoint answers while the run goes on."""
    import testbed.runs.experiment

    seen = {}
    real_run = testbed.runs.experiment.Experiment.run

    def run_and_scrape(self, policy, steps, out, progress=None):
        res = real_run(self, policy, steps, out, progress)
        if self.metrics.url is not None:
            seen["body"] = urllib.request.urlopen(self.metrics.url, timeout=5).read().decode()
        return res

    monkeypatch.setattr(testbed.runs.experiment.Experiment, "run", run_and_scrape)
    scn = tmp_path / "small.yaml"
    scn.write_text("workload: {prompts_per_step: 4, samples_per_prompt: 4, response_median_tokens: 60, "
                   "max_response_tokens: 200, steps: 1}\n")
    assert cli.main(["run", str(scn), "--backend", "simulated", "--policy", "planner", "--out",
                     str(tmp_path / "out"), "-q", "--metrics-port", "0"]) == 0
    assert "metrics: off" in capsys.readouterr().err and "body" not in seen
    assert cli.main(["run", str(scn), "--backend", "simulated", "--policy", "planner", "--out",
                     str(tmp_path / "out"), "-q"]) == 0
    out = capsys.readouterr().err
    m = re.search(r"metrics: orchestrator and engines (http://127\.0\.0\.1:\d+/metrics)", out)
    assert m, out
    assert 'orchestrrl_steps_total{policy="planner"} 1.0' in seen["body"]


def test_metrics_settings_defaults_are_loopback():
    ms = MetricsSettings()
    assert (ms.host, ms.controller_port, ms.driver_port) == ("127.0.0.1", None, None)
    assert dataclasses.replace(ms, driver_port=0).driver_port == 0


def test_a_scrape_keeps_vllms_colons_whatever_the_scraper_offers():
    """prometheus_client 0.26 turns ``vllm:x`` into ``vllm_x`` on OpenMetrics sample lines (client_python
    #1177); Prometheus 2.42 asks for OpenMetrics first, so the endpoint answers in the text format."""
    dm = DriverMetrics()
    dm.m["vllm:generation_tokens_total"].labels("M", "4", "p").inc(5)
    dm.server = serve_free(dm.registry)
    try:
        req = urllib.request.Request(dm.url, headers={"Accept": "application/openmetrics-text;version=1.0.0,"
                                                                "application/openmetrics-text;version=0.0.1;q=0.75,"
                                                                "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
        with urllib.request.urlopen(req, timeout=5) as r:
            body = r.read().decode()
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    finally:
        dm.stop()
    assert 'vllm:generation_tokens_total{model_name="M",policy="p",server="4"} 5.0' in body
    assert "vllm_generation_tokens" not in body


def dashboard_exprs() -> list[tuple[str, str]]:
    import json

    doc = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]


def test_the_grafana_dashboard_queries_only_exported_metrics():
    known = set(registered(ControllerMetrics().registry)) | set(registered(DriverMetrics().registry))
    hist = {n for n, (kind, _) in {**registered(ControllerMetrics().registry),
                                   **registered(DriverMetrics().registry)}.items() if kind == "histogram"}
    used = set()
    for title, expr in dashboard_exprs():
        names = set(re.findall(r"\b(?:orchestrrl_[a-z0-9_]+|vllm:[a-z0-9_]+)", expr))
        assert names, f"{title}: {expr} queries none of the testbed's metrics"
        for n in names:
            base = re.sub(r"_(bucket|sum|count)$", "", n)
            assert n in known or (base in hist and base != n), f"{title}: {n} is not exported"
            used.add(base if base in hist else n)
    # the panels the issue names: phase and circuits, queues and KV, switches and migrations, step makespans
    for name in ("orchestrrl_fabric_phase", "orchestrrl_ocs_circuits", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "orchestrrl_layout_switches_total",
                 "orchestrrl_migrations_total", "orchestrrl_step_makespan_seconds"):
        assert name in used, name


@pytest.mark.parametrize("argv, field", [
    (["--metrics-port", "70000"], "metrics_port"), (["--metrics-port", "-1"], "metrics_port"),
    (["--metrics-port", "7002"], "metrics_port"),  # the REST port
    (["--metrics-port", "7003", "--metrics-host", "localhost"], "metrics_host")])
def test_the_controllers_metrics_options_are_checked(argv, field, tmp_path, capsys):
    from controller.__main__ import main

    rc = main(["--spec-json", '{"fabric": {}}', "--of-port", "7001", "--rest-port", "7002", "--token-file",
               str(tmp_path / "token")] + argv)
    assert rc == 2 and f"error: {field}:" in capsys.readouterr().err
    assert not (tmp_path / "token").exists()  # nothing created
