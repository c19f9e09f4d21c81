"""Live metrics end to end: a real Prometheus server (Debian's ``prometheus``, started here on loopback with a
1 s scrape interval, its data in a temporary folder, stopped by its PID) scrapes the controller and the driver
through a short emulated comparison and two more fabric reconfigurations; its HTTP API then holds the run's
generated tokens as report.json says them and the reconfiguration counts as GET /history says them."""
from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from controller.process import free_port
from emulation import registry
from emulation.scenario import MetricsSettings
from testbed.runs.experiment import Experiment
from testbed.runs.metrics import DriverMetrics
from small_scenario import small_scenario

pytestmark = pytest.mark.system

SCN = small_scenario("metrics-small")  # tests/small_scenario.py: seconds a step

PROMETHEUS = shutil.which("prometheus")
ROOT = Path(__file__).resolve().parents[2]
SCRAPE_S = 1.0


class Prometheus:
    """A Prometheus server scraping ``targets`` ({job: port}) every second; its HTTP API on loopback."""

    def __init__(self, folder, targets: dict[str, int]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = folder / "prometheus.yml"
        jobs = "".join(f"  - job_name: {job}\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
                       for job, port in targets.items())
        cfg.write_text(f"global:\n  scrape_interval: {SCRAPE_S:g}s\n  scrape_timeout: {SCRAPE_S:g}s\n"
                       f"scrape_configs:\n{jobs}")
        self.log = folder / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        registry.record_process(self.proc.pid, "prometheus")  # `orchestrrl clean` stops it after a crash
        try:
            self._wait_ready(30.0)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready after {timeout_s} s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def query(self, promql: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def query_range(self, promql: str, start: float, end: float, step_s: float = 1.0) -> list[dict]:
        q = urllib.parse.urlencode({"query": promql, "start": start, "end": end, "step": step_s})
        with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{q}", timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", (promql, doc)
        return doc["data"]["result"]

    def by(self, promql: str, *labels: str) -> dict[tuple, float]:
        return {tuple(x["metric"].get(k) for k in labels): float(x["value"][1]) for x in self.query(promql)}

    def wait_scraped_after(self, t: float, promql: str, timeout_s: float = 20.0) -> None:
        """Until every series of ``promql`` has a sample scraped after wall time ``t``."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.query(f"timestamp({promql})")
            if got and min(float(x["value"][1]) for x in got) > t:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no scrape of {promql} after {t} within {timeout_s} s: {got}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        registry.forget_process(self.proc.pid)


def dashboard_queries() -> list[tuple[str, str]]:
    doc = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]


@pytest.fixture
def prometheus(tmp_path):
    if PROMETHEUS is None:
        pytest.skip("needs a prometheus server binary (Debian's prometheus package: scripts/provision.sh installs it)")
    ports = {"controller": free_port(), "driver": free_port()}
    prom = Prometheus(tmp_path, ports)
    prom.ports = ports
    try:
        yield prom
    finally:
        prom.stop()


def test_prometheus_scrapes_a_run_and_a_reconfiguration(prometheus, tmp_path):
    prom = prometheus
    scn = dataclasses.replace(SCN, metrics=MetricsSettings(controller_port=prom.ports["controller"],
                                                           driver_port=prom.ports["driver"]))
    dm = DriverMetrics().serve(scn.metrics.host, scn.metrics.driver_port)
    exp = Experiment(scn, "emulated", metrics=dm)
    with dm, exp:
        client = exp.cluster[0].client
        started = time.time()
        report, files = exp.compare([exp.policy("static-TP1x8"), exp.policy("orchestrrl")], 1, tmp_path / "run")
        # a fabric reconfiguration beyond the run's: one carried out, one deferred (window shorter than D)
        other = [[1, 4], [2, 3]] if sorted(map(sorted, client.circuits()["0"])) == [[1, 3], [2, 4]] else [[1, 3], [2, 4]]
        assert client.set_circuits({0: other}, delay_ms=10)["decision"] == "switched"
        assert client.set_phase("gen", delay_ms=10, window_ms=1)["status"] == "deferred"
        history = client.history()
        done_at = time.time()
        prom.wait_scraped_after(done_at, "orchestrrl_controller_ready")
        prom.wait_scraped_after(done_at, "orchestrrl_run_active")
        assert prom.by("up", "job") == {("controller",): 1.0, ("driver",): 1.0}
        # reconfigurations: Prometheus holds what GET /history says, decision by decision
        scraped = {k: v for k, v in prom.by("orchestrrl_reconfigurations_total", "kind", "decision", "status").items()
                   if v}
        want = Counter((h["kind"], h["decision"], h["status"]) for h in history if "decision" in h)
        assert scraped == {k: float(n) for k, n in want.items()}
        assert ("circuits", "switched", "done") in scraped and ("phase", "deferred", "deferred") in scraped
        assert ("phase", "switched", "done") in scraped  # the run's own phase changes
        changed = [h for h in history if h.get("status") == "done" and not h.get("noop") and "dark_ms" in h]
        assert prom.by("sum(orchestrrl_reconfiguration_blackout_seconds_count)") == {(): float(len(changed))}
        # the driver asked for every phase reconfiguration but the deferred one above
        asked = prom.by("sum(orchestrrl_fabric_requests_total)")[()]
        assert asked + 1 == sum(n for (kind, _, _), n in want.items() if kind == "phase")
        # generated tokens: the engines' own counters (over the agents' RPC) and the driver's step count
        tokens = prom.by("sum by (policy) (vllm:generation_tokens_total)", "policy")
        steps = prom.by("orchestrrl_step_tokens_total", "policy")
        # the Grafana dashboard: every query runs on the server, and the panels the run must fill have data
        filled: dict[str, bool] = {}
        for title, expr in dashboard_queries():
            got = prom.query_range(expr.replace("$policy", ".*"), started, done_at + SCRAPE_S)
            filled.setdefault(title, []).append(bool(got))
        # every query of every panel shows the run (a counter that never moved shows its 0)
        assert {t: ok for t, ok in filled.items() if not all(ok)} == {}
    doc = json.loads(open(files["report"]).read())
    assert set(tokens) == set(steps) == {(name,) for name in doc["policies"]}
    for name, p in doc["policies"].items():
        assert p["lost_requests"] == 0
        run = json.loads(open(tmp_path / "run" / name / "run.json").read())
        expected = sum(s["tokens"] for s in run["steps"])
        assert round(p["throughput_tokens_per_s"] * sum(p["step_makespan_s"])) == expected  # report.json's
        assert tokens[(name,)] == expected and steps[(name,)] == expected
