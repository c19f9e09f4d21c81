"""Sweeps: fabrics x scales x OCS switching times, on Ray when it is installed, serially otherwise.

``run_sweep`` returns one result per point (the dict of :func:`rlsim.sim.simulate_iteration`, without its
bulky ``detail``); ``write_outputs`` writes ``sweep.json`` and three plots (matplotlib, Agg backend):
performance against cost with the Pareto frontier, per-phase time by fabric, and sensitivity to T_ocs.
T_ocs only matters for fabrics that re-wire during a job (RFabric; MixNet is modelled static); the others run once per scale.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Sequence

from emulation.scenario import Scenario
from emulation.validation import SpecError, to_dict

from .fabrics import FABRICS
from .sim import SimSettings, scale_scenario, simulate_iteration

log = logging.getLogger(__name__)

DEFAULT_T_OCS_MS = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0)  # 1 us .. 100 ms
RECONFIGURING = ("rfabric",)  # MixNet is modelled static for the job (docs/rlsim.md)


@dataclass(frozen=True)
class Point:
    fabric: str
    gpus: int
    t_ocs_ms: float


def plan(scn: Scenario, fabrics: Sequence[str], scales: Sequence[int], t_ocs_ms: Sequence[float]) -> list[Point]:
    for f in fabrics:
        if f not in FABRICS:
            raise SpecError("fabrics", f"must be in {', '.join(FABRICS)}, got {f!r}")
    for n in scales:
        scale_scenario(scn, n)  # validates the scale (exit 2 before any work)
    for t in t_ocs_ms:
        if not t >= 0:
            raise SpecError("t_ocs_ms", f"must be >= 0, got {t}")
    default_t = scn.controller.effective_delay_ms(scn.fabric)
    pts = []
    for n in scales:
        for f in fabrics:
            for t in (t_ocs_ms if f in RECONFIGURING else [default_t]):
                pts.append(Point(f, n, float(t)))
    return pts


def _one(scn: Scenario, p: Point, settings: SimSettings) -> dict:
    s = SimSettings(t_ocs_ms=p.t_ocs_ms, latency_us=settings.latency_us, sync_fanout=settings.sync_fanout,
                    sync_stripes=settings.sync_stripes, max_num_seqs=settings.max_num_seqs, fabric=settings.fabric)
    r = simulate_iteration(scn, p.fabric, p.gpus, s)
    r["stall_s"] = sum(v["stall_s"] for v in r["detail"]["reconfig"].values())
    r["cost_breakdown_usd"] = r["detail"]["cost"]["usd"]
    del r["detail"]
    return r


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def run_sweep(scn: Scenario, points: Sequence[Point], settings: SimSettings = SimSettings(),
              use_ray: bool | None = None, ray_address: str | None = None, progress: bool = True) -> list[dict]:
    """Simulate every point. ``use_ray``: None = when importable; ``ray_address``: None = a local Ray."""
    from tqdm import tqdm

    if use_ray is None:
        use_ray = ray_available()
    if use_ray:
        import ray

        started = False
        if not ray.is_initialized():
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
            started = True
        try:
            remote = ray.remote(_one)
            refs = [remote.remote(scn, p, settings) for p in points]
            out: dict = {}
            pending = list(refs)
            with tqdm(total=len(refs), desc="sweep (ray)", disable=not progress) as bar:
                while pending:
                    done, pending = ray.wait(pending, num_returns=1, timeout=600)
                    if not done:
                        raise TimeoutError("a sweep point took longer than 600 s")
                    for d in done:
                        out[d] = ray.get(d)
                        bar.update(1)
            return [out[r] for r in refs]
        finally:
            if started:
                ray.shutdown()
    return [_one(scn, p, settings) for p in tqdm(points, desc="sweep", disable=not progress)]


# ---- outputs -------------------------------------------------------------------------------------
def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (cost, perf) not dominated by a cheaper-or-equal, faster-or-equal point."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def summarise(results: Sequence[dict]) -> dict:
    """Per scale: each fabric's perf/cost relative to the non-blocking Fat-Tree (at the scenario's T_ocs
    default and at every T_ocs for re-wiring fabrics)."""
    out: dict = {}
    for n in sorted({r["gpus"] for r in results}):
        base = [r for r in results if r["gpus"] == n and r["fabric"] == "fat-tree"]
        if not base:
            continue
        b = base[0]
        rows = []
        for r in results:
            if r["gpus"] != n:
                continue
            rows.append({"fabric": r["fabric"], "t_ocs_ms": r["t_ocs_ms"], "iteration_s": r["iteration_s"],
                         "slowdown_vs_fat_tree": r["iteration_s"] / b["iteration_s"] - 1,
                         "cost_vs_fat_tree": r["cost_usd"] / b["cost_usd"],
                         "perf_per_cost_vs_fat_tree": (b["iteration_s"] * b["cost_usd"]) /
                                                      (r["iteration_s"] * r["cost_usd"])})
        out[str(n)] = rows
    return out


def write_outputs(results: Sequence[dict], out_dir: str, meta: dict | None = None) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    doc = {"meta": meta or {}, "results": list(results), "summary": summarise(results)}
    with open(os.path.join(out_dir, "sweep.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=to_dict)
    files = {"json": os.path.join(out_dir, "sweep.json")}
    fabrics = [f for f in FABRICS if any(r["fabric"] == f for r in results)]
    scales = sorted({r["gpus"] for r in results})
    colors = {f: plt.cm.tab10(i) for i, f in enumerate(FABRICS)}
    markers = "osD^v<>ph*"

    # 1. performance against cost, Pareto frontier per scale
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for si, n in enumerate(scales):
        pts, idx = [], []
        for f in fabrics:
            rs = [r for r in results if r["gpus"] == n and r["fabric"] == f]
            if not rs:
                continue
            r = min(rs, key=lambda r: abs(r["t_ocs_ms"] - 10.0))  # T_ocs = 10 ms (or nearest) per fabric
            x, y = r["cost_usd"] / 1e6, 3600.0 / r["iteration_s"]
            ax.scatter(x, y, color=colors[f], marker=markers[si % len(markers)], s=50,
                       label=f if si == 0 else None, edgecolors="k", linewidths=0.5)
            pts.append((x, y))
            idx.append(f)
        front = pareto_front(pts)
        fx = [pts[i][0] for i in front]
        fy = [pts[i][1] for i in front]
        ax.plot(fx, fy, "--", color="gray", lw=1)
        if pts:
            ax.annotate(f"{n} GPUs", (max(p[0] for p in pts), max(p[1] for p in pts)), fontsize=8,
                        textcoords="offset points", xytext=(4, 4))
    ax.set_xscale("log")
    ax.set_xlabel("network cost (million USD, log)")
    ax.set_ylabel("RL iterations per hour")
    ax.set_title("Performance vs network cost (dashed: Pareto frontier per scale; T_ocs = 10 ms)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    files["pareto"] = os.path.join(out_dir, "pareto.png")
    fig.savefig(files["pareto"], dpi=110)
    plt.close(fig)

    # 2. per-phase time by fabric at the largest scale: stacked (left), train and sync close up (right)
    n = scales[-1]
    vals = {}
    for f in fabrics:
        rs = [r for r in results if r["gpus"] == n and r["fabric"] == f]
        vals[f] = min(rs, key=lambda r: abs(r["t_ocs_ms"] - 10.0))["phases"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    bottoms = [0.0] * len(fabrics)
    for ph, col in (("gen_s", "#4c72b0"), ("train_s", "#dd8452"), ("sync_s", "#55a868")):
        v = [vals[f][ph] for f in fabrics]
        ax.bar(fabrics, v, bottom=bottoms, color=col, label=ph[:-2])
        bottoms = [b + x for b, x in zip(bottoms, v)]
    ax.set_ylabel("seconds per iteration")
    ax.set_title(f"Iteration by phase ({n} GPUs)")
    ax.legend(loc="lower right")
    width = 0.4
    xs = list(range(len(fabrics)))
    ax2.bar([x - width / 2 for x in xs], [vals[f]["train_s"] for f in fabrics], width, color="#dd8452", label="train")
    ax2.bar([x + width / 2 for x in xs], [vals[f]["sync_s"] for f in fabrics], width, color="#55a868", label="sync")
    ax2.set_xticks(xs)
    ax2.set_xticklabels(fabrics)
    ax2.set_ylabel("seconds")
    ax2.set_title("Train and sync phases (close up)")
    ax2.legend()
    for a_ in (ax, ax2):
        plt.setp(a_.get_xticklabels(), rotation=25, ha="right")
    fig.tight_layout()
    files["phases"] = os.path.join(out_dir, "phases.png")
    fig.savefig(files["phases"], dpi=110)
    plt.close(fig)

    # 3. sensitivity to T_ocs: iteration time relative to the non-blocking Fat-Tree
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for si, n in enumerate(scales):
        base = [r for r in results if r["gpus"] == n and r["fabric"] == "fat-tree"]
        for f in RECONFIGURING:
            rs = sorted((r for r in results if r["gpus"] == n and r["fabric"] == f), key=lambda r: r["t_ocs_ms"])
            if len(rs) < 2:
                continue
            ref = base[0]["iteration_s"] if base else rs[0]["iteration_s"]
            ax.plot([r["t_ocs_ms"] for r in rs], [100 * (r["iteration_s"] / ref - 1) for r in rs],
                    marker=markers[si % len(markers)], color=colors[f], label=f"{f}, {n} GPUs")
    ax.set_xscale("log")
    ax.set_xlabel("OCS switching time T_ocs (ms, log)")
    ax.set_ylabel("iteration time vs fat-tree (%)" if any(r["fabric"] == "fat-tree" for r in results)
                  else "iteration time vs smallest T_ocs (%)")
    ax.set_title("Sensitivity to the OCS switching time")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    files["t_ocs"] = os.path.join(out_dir, "t_ocs.png")
    fig.savefig(files["t_ocs"], dpi=110)
    plt.close(fig)
    return files
