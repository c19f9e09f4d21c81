"""Results of runs and comparisons: JSON (run.json, timeline.json, report.json), a Chrome-trace/Perfetto file
of the timeline, and plots (matplotlib, Agg backend).

Plots: step makespan by policy (``makespan.png``); per policy, a per-replica timeline of the generation phase
(running requests per replica over time: the long tail is the thin end of it) with the layout switches and
the migrations marked (``timeline-<policy>.png``); the load index of every generator over time
(``load-<policy>.png``).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from emulation import plots
from emulation.files import write_json_atomic

PHASE_COLOURS = {"gen": "#4c9be8", "train": "#59b36b", "sync": "#f2a541"}


def write_json(path: Path, doc) -> None:
    """Atomic JSON write (emulation.files): a crash never leaves half a report."""
    write_json_atomic(path, doc, indent=1, fsync=False, mkdir=True, default=_jsonable)


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def chrome_trace(timeline: dict, policy: str) -> dict:
    """The timeline as Chrome trace events (open in chrome://tracing or ui.perfetto.dev): phases as complete
    events on the "phases" track, layout switches per server, migrations and fabric decisions as instants."""
    ev = []
    starts: dict = {}
    for e in timeline["events"]:
        us = e["t"] * 1e6
        k = e["kind"]
        if k == "phase_start":
            starts[(e["phase"], e.get("step"))] = us
        elif k == "phase_end" and (e["phase"], e.get("step")) in starts:
            t0 = starts.pop((e["phase"], e.get("step")))
            ev.append({"name": f"{e['phase']} (step {e.get('step')})", "ph": "X", "ts": t0, "dur": us - t0,
                       "pid": 0, "tid": 0, "cat": "phase"})
        elif k == "layout_switch":
            ev.append({"name": f"{e['frm']} -> {e['to']}", "ph": "X", "ts": e["start"] * 1e6,
                       "dur": (e["end"] - e["start"]) * 1e6, "pid": 1, "tid": e["server"], "cat": "layout"})
        elif k in ("migration", "fabric", "agent_failed", "requeued", "handover"):
            ev.append({"name": k, "ph": "i", "s": "g" if k == "fabric" else "t", "ts": us, "pid": 1 if k != "fabric" else 0,
                       "tid": e.get("src", e.get("server", 0)), "args": {kk: vv for kk, vv in e.items()
                                                                        if isinstance(vv, (int, float, str))}})
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"{policy}: phases and fabric"}},
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"{policy}: generator servers"}}]
    return {"traceEvents": meta + ev, "displayTimeUnit": "ms"}


def write_run(out: Path, result: dict, timeline: dict) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "run.json", result)
    write_json(out / "timeline.json", timeline)
    write_json(out / f"trace-{result['policy']}.json", chrome_trace(timeline, result["policy"]))
    files = {"run": str(out / "run.json"), "timeline": str(out / "timeline.json"),
             "trace": str(out / f"trace-{result['policy']}.json")}
    files.update(plot_timeline(out, result["policy"], timeline))
    return files


def plot_timeline(out: Path, policy: str, timeline: dict) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = timeline["samples"]
    files = {}
    if not samples:
        return files
    t0 = plots.run_start(timeline)  # every time axis in seconds from the run's start
    servers = sorted({int(s) for smp in samples for s in smp["servers"]})
    fig, ax = plt.subplots(figsize=(12, 0.9 + 0.55 * max(1, len(servers)) * 2))
    row = 0
    yt, yl = [], []
    for s in servers:
        ts = [smp["t"] - t0 for smp in samples if str(s) in smp["servers"] or s in smp["servers"]]
        recs = [smp["servers"].get(str(s), smp["servers"].get(s)) for smp in samples
                if str(s) in smp["servers"] or s in smp["servers"]]
        nrep = max(len(r["running"]) for r in recs)
        for j in range(nrep):
            vals = [(r["running"][j] if j < len(r["running"]) else 0) + (r["waiting"][j] if j < len(r["waiting"]) else 0)
                    for r in recs]
            peak = max(vals) or 1
            ax.fill_between(ts, row, [row + 0.9 * v / peak for v in vals], step="post", color="#4c9be8", lw=0)
            row += 1
        yt.append(row - nrep / 2)
        yl.append(f"server {s}")
        ax.axhline(row, color="black", lw=0.4)
    for e in timeline["events"]:
        if e["kind"] == "layout_switch":
            y = servers.index(e["server"]) if e["server"] in servers else 0
            ax.axvspan(e["start"] - t0, e["end"] - t0, color="#f2a541", alpha=0.35, lw=0)
            ax.annotate(e["to"], (e["start"] - t0, row), fontsize=6, rotation=90, va="top")
        elif e["kind"] == "migration":
            ax.axvline(e["t"] - t0, color="#d62728", lw=0.5, alpha=0.6)
        elif e["kind"] == "phase_start" and e["phase"] != "gen":
            ax.axvline(e["t"] - t0, color=PHASE_COLOURS[e["phase"]], lw=1.2, ls="--")
    ax.set_yticks(yt, yl)
    ax.set_xlabel("seconds from the run's start (real-time equivalent)")
    plots.title(ax, f"{policy}: requests per replica (running + waiting, each row scaled to its peak); "
                "orange: layout switches, red: migrations, dashed: train/sync")
    files["timeline_png"] = plots.save(fig, out / f"timeline-{policy}.png")
    # load index
    loads = [(smp["t"], smp.get("load", {})) for smp in samples if smp.get("load")]
    if loads:
        fig, ax = plt.subplots(figsize=(10, 3.4))
        for s in servers:
            xs = [t - t0 for t, ld in loads if str(s) in ld or s in ld]
            ys = [ld.get(str(s), ld.get(s)) for t, ld in loads if str(s) in ld or s in ld]
            ax.plot(xs, ys, label=f"server {s}", lw=1)
        for e in timeline["events"]:
            if e["kind"] == "migration":
                ax.axvline(e["t"] - t0, color="#d62728", lw=0.4, alpha=0.5)
        ax.set_xlabel("seconds from the run's start (real-time equivalent)")
        ax.set_ylabel("load index (predicted remaining s)")
        plots.title(ax, f"{policy}: load index per generator (red: migrations)")
        ax.legend(fontsize=7, ncol=4)
        files["load_png"] = plots.save(fig, out / f"load-{policy}.png")
    return files


def plot_makespans(out: Path, report: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = report["policies"]
    names = list(pol)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 3.8))
    steps = max(len(pol[n]["step_makespan_s"]) for n in names)
    width = 0.8 / max(1, steps)
    for k in range(steps):
        ax.bar([i + k * width for i in range(len(names))],
               [pol[n]["step_makespan_s"][k] if k < len(pol[n]["step_makespan_s"]) else 0 for n in names],
               width=width, label=f"step {k}")
    for i, n in enumerate(names):
        sp = pol[n].get("speedup_vs_best_static")
        if sp:
            ax.annotate(f"{sp:.2f}x", (i + (steps - 1) * width / 2, max(pol[n]["step_makespan_s"])), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks([i + (steps - 1) * width / 2 for i in range(len(names))], names, rotation=20, fontsize=8)
    ax.set_ylabel("step makespan (s)")
    plots.title(ax, f"{report['scenario']} on the {report['backend']} backend (labels: speedup vs best static "
                f"{report['best_static']})")
    ax.legend(fontsize=7)
    return plots.save(fig, Path(out) / "makespan.png")
