"""Plots a reader can read (emulation/plots.py): titles wrapped inside the figure, time axes from the run's
start, for the plots every run writes (testbed/runs/report.py)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from emulation import plots  # noqa: E402
from testbed.runs import report  # noqa: E402


def _inside(fig, artist) -> bool:
    fig.canvas.draw()
    box = artist.get_window_extent(renderer=fig.canvas.get_renderer())
    return box.x0 >= 0 and box.x1 <= fig.bbox.width


def test_a_long_title_wraps_inside_its_figure():
    text = "default on the emulated backend (labels: speedup vs best static static-TP8x1@256) " * 2
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.set_title(text)
    assert not _inside(fig, ax.title)  # what the plots did before: cut off at both edges
    plots.title(ax, text)
    assert _inside(fig, ax.title) and "\n" in ax.get_title()
    plt.close(fig)


def _timeline(t0: float) -> dict:
    samples = [{"t": t0 + k, "servers": {"4": {"running": [3, 2], "waiting": [0, 1]}},
                "load": {"4": 1.0 + k}} for k in range(5)]
    events = [{"kind": "migration", "t": t0 + 2.5}, {"kind": "phase_start", "phase": "train", "t": t0 + 3.0}]
    return {"samples": samples, "events": events}


def test_time_axes_start_at_the_runs_start(tmp_path, monkeypatch):
    seen = []
    real_save = plots.save

    def keep(fig, path):
        seen.append((str(path), [ax.get_xlim() for ax in fig.axes], [ax.get_xlabel() for ax in fig.axes]))
        return real_save(fig, path)

    monkeypatch.setattr(plots, "save", keep)
    files = report.plot_timeline(tmp_path, "orchestrrl", _timeline(5900.0))
    assert set(files) == {"timeline_png", "load_png"}
    assert len(seen) == 2
    for path, xlims, labels in seen:
        lo, hi = xlims[0]
        assert -1.0 <= lo <= 0.5 and hi < 10, (path, xlims)  # 0..4 s, not 5,900..5,904
        assert "run's start" in labels[0]
    assert plots.run_start(_timeline(5900.0)) == 5900.0
    assert plots.run_start({"samples": [], "events": [{"kind": "layout_switch", "start": 7.0, "end": 9.0}]}) == 7.0
