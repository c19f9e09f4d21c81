"""The same RL steps on several fabrics (``orchestrrl compare --fabric rfabric,fat-tree,...``): each fabric
kind builds its own cluster (RFabric's OCS bridges under the controller, or a static packet tree: see
``emulation.builder.static_flows``) and runs the policies of a comparison; the report puts the fabrics side
by side: per policy the mean step makespan and the network time of each phase (training's all-to-all and
all-reduce, the weight broadcast), and on the emulated backend the same numbers from RLSim (the simulated
backend on the same fabric kind, same seed), with their ratio: a phase whose emulated network time is more
than CROSS_CHECK_TOL off RLSim's is flagged. Network cost per fabric from ``rlsim.cost`` (two packet tiers,
the architecture the emulator builds).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from emulation import plots
from emulation.spec import FABRICS
from emulation.validation import require
from testbed.runs.report import write_json

log = logging.getLogger(__name__)

CROSS_CHECK_TOL = 0.10  # per-phase network time, emulated against RLSim


def with_kind(scn, kind: str):
    """``scn`` on fabric ``kind`` (SpecError naming ``fabric`` when the kind is unknown)."""
    require(kind in FABRICS, "fabric", f"must be one of {', '.join(FABRICS)}, got {kind!r}")
    return dataclasses.replace(scn, fabric=dataclasses.replace(scn.fabric, kind=kind))


def check_kinds(kinds: list[str], backend: str) -> None:
    from testbed.backends.registry import backend_kind

    require(bool(kinds), "fabric", "give at least one fabric")
    allowed = backend_kind(backend).fabrics
    for k in kinds:
        require(k in allowed, "fabric", f"the {backend} backend runs {', '.join(allowed)}, got {k!r}")


def network_times(step: dict) -> dict:
    """One step's network time per phase from its train and sync details (either backend's)."""
    tr, sy = step.get("train") or {}, step.get("sync") or {}
    if "allreduce_s" in tr or "alltoall_s" in tr:  # emulated: the real collectives' spans
        train = {"alltoall_s": tr.get("alltoall_s", 0.0), "allreduce_s": tr.get("allreduce_s", 0.0)}
        sync = sy.get("broadcast_s", 0.0)
    else:  # simulated: RLSim's stages and the sync phase
        train = {"alltoall_s": tr.get("ep_alltoall_s", 0.0), "allreduce_s": tr.get("dp_allreduce_s", 0.0)}
        sync = step["phases"]["sync_s"]
    return {**train, "sync_s": sync}


def _runs(out: Path, names: list[str]) -> dict:
    return {n: json.loads((out / n / "run.json").read_text()) for n in names}


def summarise(report: dict, runs: dict) -> dict:
    out = {}
    for name, r in runs.items():
        nt = [network_times(s) for s in r["steps"]]
        out[name] = {"makespan_s": float(np.mean(r["step_makespan_s"])),
                     "speedup_vs_best_static": report["policies"][name]["speedup_vs_best_static"],
                     **{k: float(np.mean([x[k] for x in nt])) for k in ("alltoall_s", "allreduce_s", "sync_s")}}
    return out


def fabric_costs(scn, kinds: list[str]) -> dict:
    from agents.costmodel import CostModel
    from rlsim.cost import fabric_cost
    from rlsim.fabrics import FabricOptions

    nic = CostModel.for_names(scn.workload.model, scn.workload.gpu).gpu.nic_gbps
    return {k: fabric_cost(k, scn.fabric, nic, opts=FabricOptions(fat_tree_tiers="2"))["total_usd"] for k in kinds}


def compare_fabrics(scn, kinds: list[str], backend: str, policies: list | None, steps: int, out: Path,
                    progress=None, on_policy=None) -> tuple[dict, dict]:
    from testbed.runs.experiment import Experiment

    check_kinds(kinds, backend)
    out = Path(out)
    report: dict = {"scenario": scn.name, "backend": backend, "steps": steps, "fabrics": {},
                    "cost_usd": fabric_costs(scn, kinds), "cross_check_tol": CROSS_CHECK_TOL}
    files: dict = {}
    for kind in kinds:
        sk = with_kind(scn, kind)
        exp = Experiment(sk, backend, steps=steps)
        given = policies or exp.default_policies()
        pols = [exp.policy(n) for n in given]  # SpecError before anything starts
        with exp:
            rep, f = exp.compare(pols, steps, out / kind, progress=progress,
                                 on_policy=(lambda n, k=kind: on_policy(f"{k}: {n}")) if on_policy else None)
        files.update({f"{kind}_{k}": v for k, v in f.items()})
        names = [p.name for p in pols]
        entry = {"report": f["report"], "best_static": rep["best_static"], "policies": summarise(rep, _runs(out / kind, names))}
        if exp.kind.reference:  # the cross-check: RLSim on the same fabric, seed and policies
            sim = Experiment(sk, exp.kind.reference, steps=steps)
            with sim:
                # the same policies (a layout tuned for one, start: best, is tuned once, on the simulated backend)
                srep, _ = sim.compare(pols, steps, out / kind / "simulated")
            simd = summarise(srep, _runs(out / kind / "simulated", names))
            for n, e in entry["policies"].items():
                s = simd[n]
                e["simulated"] = s
                ratios = {k: (e[k] / s[k] if s[k] > 0 else None) for k in ("makespan_s", "alltoall_s", "allreduce_s", "sync_s")}
                e["emulated_vs_simulated"] = ratios
                e["outside_tol"] = sorted(k for k, v in ratios.items() if v is not None and abs(v - 1) > CROSS_CHECK_TOL)
        report["fabrics"][kind] = entry
    write_json(out / "fabrics.json", report)
    files["fabrics"] = str(out / "fabrics.json")
    files["fabrics_png"] = plot_fabrics(out, report)
    return report, files


def plot_fabrics(out: Path, report: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(report["fabrics"])
    pols = sorted({p for k in kinds for p in report["fabrics"][k]["policies"]})
    keys = (("makespan_s", "step makespan"), ("allreduce_s", "train: all-reduce"), ("alltoall_s", "train: all-to-all"),
            ("sync_s", "weight sync"))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.0))
    width = 0.8 / max(1, len(kinds))
    for ax, (key, title) in zip(axes, keys):
        for i, k in enumerate(kinds):
            ps = report["fabrics"][k]["policies"]
            xs = [j + i * width for j in range(len(pols))]
            ax.bar(xs, [ps[p][key] if p in ps else 0 for p in pols], width, label=f"{k} ({report['backend']})")
            sims = [ps[p].get("simulated", {}).get(key) if p in ps else None for p in pols]
            if any(v is not None for v in sims):
                ax.scatter(xs, [v if v is not None else np.nan for v in sims], color="k", marker="_", s=120,
                           zorder=3, label="RLSim" if i == 0 else None)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(pols))])
        ax.set_xticklabels(pols, rotation=25, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("seconds (mean per step)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{report['scenario']}: the same RL steps on each fabric", fontsize=10)
    fig.tight_layout()
    return plots.save(fig, Path(out) / "fabrics.png")


def format_fabrics(report: dict) -> str:
    rows = [f"{'fabric':<16} {'policy':<16} {'makespan s':>11} {'all-reduce s':>13} {'all-to-all s':>13} "
            f"{'sync s':>8}  {'cost $':>9}  vs RLSim (makespan/ar/a2a/sync)"]
    for k, e in report["fabrics"].items():
        for n, p in e["policies"].items():
            r = p.get("emulated_vs_simulated")
            vs = "" if r is None else "/".join("-" if r[x] is None else f"{r[x]:.2f}"
                                               for x in ("makespan_s", "allreduce_s", "alltoall_s", "sync_s"))
            if p.get("outside_tol"):
                vs += f"  (off by > {report['cross_check_tol']:.0%}: {', '.join(p['outside_tol'])})"
            rows.append(f"{k:<16} {n:<16} {p['makespan_s']:>11.2f} {p['allreduce_s']:>13.3f} {p['alltoall_s']:>13.3f} "
                        f"{p['sync_s']:>8.3f}  {report['cost_usd'][k]:>9.0f}  {vs}")
    return "\n".join(rows)

