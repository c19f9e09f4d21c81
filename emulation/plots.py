"""The house style of every plot the testbed writes (runs, comparisons, maps, RLSim's sweeps): a title that
wraps to the figure's width instead of running off its edge, time axes in seconds from the run's start, and a
saved image that keeps every label inside it. matplotlib is imported by the callers (headless, Agg)."""
from __future__ import annotations

import textwrap


def title(ax, text: str, fontsize: float = 10.0) -> None:
    """``ax``'s title, wrapped to the width of its figure (about 0.55 em per character)."""
    width_pt = ax.figure.get_figwidth() * 72.0 * ax.get_position().width
    chars = max(20, int(width_pt / (0.55 * fontsize)))
    ax.set_title("\n".join(textwrap.wrap(text, chars)), fontsize=fontsize)


def run_start(timeline: dict) -> float:
    """The first instant a run's timeline records (a sample or an event), in backend seconds: what its plots'
    time axes start from. A backend's clock need not start at 0 (the emulated one counts from its cluster's
    start, across the runs of a comparison)."""
    ts = [float(s["t"]) for s in timeline.get("samples", ())]
    for e in timeline.get("events", ()):
        for k in ("t", "start"):
            if isinstance(e.get(k), (int, float)):
                ts.append(float(e[k]))
    return min(ts) if ts else 0.0


def save(fig, path) -> str:
    """Save ``fig`` at the house resolution with every title and label inside the image; close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)
