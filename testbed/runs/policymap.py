"""Where adaptive compute pays: a map of the oracle's gains and each policy's over the knobs that decide the
room (`orchestrrl map SCENARIO --out DIR`).

Every point of the map is the scenario with two knobs changed (one heatmap per pair of knobs, the others at
the scenario's values): its tuned static baseline (testbed.runs.tuning: every layout x max_num_seqs), its oracle
bounds (testbed.runs.oracle: layout switches, placement, both; every length known) and the planner's, the
balancer's and orchestrrl's speedups over that baseline, all on the simulated backend (the engine in virtual
time). The knobs (:data:`KNOBS`): the model, the requests per generator GPU, the response-length median,
spread (log-sigma), cap and share at the cap, the prompt-group correlation (prompt_sigma: the share of the
spread that a prompt's samples share), the adaptive policies' max_num_seqs, and the fixed part of a layout
switch. Points run in parallel on Ray where it is installed (``--ray-address`` for a cluster), serially
otherwise; results are cached by content like the tuning grid, so a map re-drawn with more points only
computes the new ones. Writes ``map.json`` and ``map-<panel>.png`` (per panel, one heatmap per quantity).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import socket
import tempfile
from pathlib import Path

from emulation import plots
from emulation.orchestration import orchestrator_settings
from emulation.validation import to_dict

log = logging.getLogger(__name__)

# knob -> (where it lives, values a map tries by default)
KNOBS = {
    "model": ("workload.model", ("Qwen2.5-7B", "Qwen2.5-14B", "Qwen2.5-32B")),
    "requests_per_gpu": ("requests_per_gpu", (16, 32, 64, 128)),
    "median": ("workload.response_median_tokens", (500.0, 1500.0, 4000.0)),
    "sigma": ("workload.response_sigma", (0.5, 0.9, 1.2)),
    "cap": ("workload.max_response_tokens", (4096, 16384)),
    "cap_fraction": ("workload.cap_fraction", (0.0, 0.05, 0.15)),
    "prompt_sigma": ("workload.prompt_sigma", (0.0, 0.3, 0.6)),
    "max_num_seqs": ("orchestrator.engine.max_num_seqs", (256, 1024)),
    "switch_reinit_s": ("orchestrator.engine.switch_reinit_s", (0.1, 1.0, 5.0)),
    # the serving engine's per-step terms (emulation/data/engines.yaml): its CPU time decides which layout wins
    "engine": ("orchestrator.engine.profile", ("kernels", "vllm-v1", "vllm-v0", "sglang")),
}
DEFAULT_PANELS = (("median", "requests_per_gpu"), ("sigma", "cap_fraction"), ("model", "max_num_seqs"),
                  ("prompt_sigma", "switch_reinit_s"), ("engine", "requests_per_gpu"))
QUANTITIES = ("oracle_both", "orchestrrl", "oracle_switch", "planner", "oracle_placement", "balancer")


def apply(scenario, knob: str, value):
    """``scenario`` with one knob set (a new frozen Scenario; the workload re-validated)."""
    where, _ = KNOBS[knob]
    if where == "requests_per_gpu":
        gen = scenario.layout.gen_servers(scenario.fabric)
        n = int(value) * len(gen) * scenario.fabric.gpus_per_server
        w = scenario.workload
        return dataclasses.replace(scenario, workload=dataclasses.replace(
            w, prompts_per_step=max(1, n // w.samples_per_prompt)))
    part, *path = where.split(".")
    if part == "workload":
        w = scenario.workload
        if path[0] == "response_sigma":  # keep the prompt share of the spread inside it
            value = float(value)
            return dataclasses.replace(scenario, workload=dataclasses.replace(
                w, response_sigma=value, prompt_sigma=min(w.prompt_sigma, value)))
        if path[0] == "max_response_tokens":
            return dataclasses.replace(scenario, workload=dataclasses.replace(
                w, max_response_tokens=int(value), response_median_tokens=min(w.response_median_tokens, int(value))))
        if path[0] == "prompt_sigma":
            value = min(float(value), w.response_sigma)
        return dataclasses.replace(scenario, workload=dataclasses.replace(w, **{path[0]: value}))
    orch = to_dict(scenario.orchestrator)
    node = orch
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value
    return dataclasses.replace(scenario, orchestrator=orchestrator_settings(orch))


def point(scenario, steps: int = 1, use_cache: bool = True, tmp_root: tuple | None = None) -> dict:
    """One point of the map: the oracle bounds and every adaptive policy's speedup over the tuned baseline.
    ``tmp_root``: (host, folder) its runs' temporary folder is made in: the map's own, which the map removes
    however it ends, a worker killed mid-point included (on another host, a Ray cluster's other node: the
    system's temporary folder). On the map's host with that folder gone the map has ended: nothing is made."""
    from testbed.runs.experiment import ADAPTIVE, Experiment

    host, root = tmp_root or (None, None)
    if host != socket.gethostname():
        root = None
    elif not os.path.isdir(root):
        raise RuntimeError(f"the map's folder {root} is gone: the map ended")
    exp = Experiment(scenario, "simulated", steps=steps, use_cache=use_cache)
    with exp, tempfile.TemporaryDirectory(prefix="orl-map-", dir=root) as tmp:
        rep, _ = exp.compare([exp.policy(n) for n in ADAPTIVE], steps, Path(tmp))
    out = {"best_static": rep["best_static"], "floor": rep["oracle"]["floor_speedup"]}
    for k, v in rep["oracle"]["kinds"].items():
        out[f"oracle_{k}"] = v["speedup"]
    for n in ADAPTIVE:
        out[n] = rep["policies"][n]["speedup_vs_best_static"]
        out[f"{n}_oracle_fraction"] = rep["policies"][n]["oracle_fraction"]
    return out


def _run_point(args):
    scenario, steps, use_cache, tmp_root = args
    try:
        return point(scenario, steps, use_cache, tmp_root)
    except Exception as e:  # noqa: BLE001 - a point that cannot run (no layout fits, ...) is reported, not fatal
        return {"error": f"{type(e).__name__}: {e}"}


def build(scenario, panels=DEFAULT_PANELS, values: dict | None = None, steps: int = 1, use_ray: bool | None = None,
          ray_address: str | None = None, use_cache: bool = True, progress=None) -> dict:
    """Every point of every panel (a panel: two knobs, each at its values)."""
    from rlsim.sweep import ray_available

    values = values or {}
    cells = []
    for a, b in panels:
        for va in values.get(a, KNOBS[a][1]):
            for vb in values.get(b, KNOBS[b][1]):
                cells.append((f"{a}x{b}", a, va, b, vb))
    jobs = []
    # every point's runs in a folder of the map's own, removed however the map ends: a point's own temporary
    # folder is not removed when its Ray worker is killed mid-point (a SIGTERM, Ctrl-C)
    tmp_root = tempfile.mkdtemp(prefix="orl-map-")
    for _, a, va, b, vb in cells:
        scn = apply(apply(scenario, a, va), b, vb)
        jobs.append((dataclasses.replace(scn, name=f"{scenario.name}-{a}={va}-{b}={vb}"), steps, use_cache,
                     (socket.gethostname(), tmp_root)))
    if use_ray is None:
        use_ray = ray_available()
    results = [None] * len(jobs)
    try:
        _run_jobs(jobs, cells, results, use_ray, ray_address, progress)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    out = {"scenario": scenario.name, "steps": steps, "panels": {}}
    for (panel, a, va, b, vb), res in zip(cells, results):
        p = out["panels"].setdefault(panel, {"x": a, "y": b, "x_values": [], "y_values": [], "points": []})
        if va not in p["x_values"]:
            p["x_values"].append(va)
        if vb not in p["y_values"]:
            p["y_values"].append(vb)
        p["points"].append({a: va, b: vb, **res})
    return out


def _run_jobs(jobs: list, cells: list, results: list, use_ray: bool, ray_address: str | None, progress) -> None:
    """:func:`build`'s points, on Ray where asked (and more than one), else one after another, into ``results``."""
    if use_ray and len(jobs) > 1:
        import ray

        from emulation.signals import handlers_kept

        started = not ray.is_initialized()
        if started:
            with handlers_kept():  # a SIGTERM still unwinds the map (ray.shutdown below), not Ray's own exit
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
        try:
            remote = ray.remote(_run_point)
            refs = {remote.remote(j): k for k, j in enumerate(jobs)}
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=3600)
                for d in done:
                    results[refs[d]] = ray.get(d)
                    if progress:
                        progress(cells[refs[d]])
        finally:
            if started:
                ray.shutdown()
    else:
        for k, j in enumerate(jobs):
            results[k] = _run_point(j)
            if progress:
                progress(cells[k])


def plot(doc: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    files = []
    for name, p in doc["panels"].items():
        xs, ys = p["x_values"], p["y_values"]
        fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(3.1 * len(QUANTITIES), 3.0 + 0.25 * len(ys)),
                                 squeeze=False)
        vals = [pt[q] for pt in p["points"] for q in QUANTITIES if "error" not in pt and pt.get(q) is not None]
        # centred on 1.0x: a loss (below the tuned static) red, a gain green, no gain pale
        norm = TwoSlopeNorm(vmin=min([0.95] + vals), vcenter=1.0, vmax=max([1.05] + vals))
        for col, (ax, q) in enumerate(zip(axes[0], QUANTITIES)):
            grid = np.full((len(ys), len(xs)), np.nan)
            for pt in p["points"]:
                if "error" not in pt and pt.get(q) is not None:
                    grid[ys.index(pt[p["y"]]), xs.index(pt[p["x"]])] = pt[q]
            im = ax.imshow(grid, origin="lower", cmap="RdYlGn", norm=norm, aspect="auto")
            for i in range(len(ys)):
                for j in range(len(xs)):
                    v = grid[i, j]
                    ax.text(j, i, "n/a" if math.isnan(v) else f"{v:.2f}x", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(xs)), [str(x) for x in xs], fontsize=7)
            ax.set_yticks(range(len(ys)), [str(y) for y in ys], fontsize=7)
            ax.set_xlabel(p["x"], fontsize=8)
            if col == 0:
                ax.set_ylabel(p["y"], fontsize=8)
            ax.set_title(q.replace("_", " "), fontsize=9)
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="speedup over the tuned static baseline")
        fig.suptitle(f"{doc['scenario']}: where adaptive compute pays ({p['x']} x {p['y']}; simulated backend, "
                     f"{doc['steps']} step(s) per point)", fontsize=10)
        files.append(plots.save(fig, Path(out) / f"map-{name}.png"))
    return files
