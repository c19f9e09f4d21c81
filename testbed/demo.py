"""The default demo: one scenario's RL phase cycle on a real emulated RFabric, beside RLSim's prediction.

For every step of the scenario: the controller re-wires the OCS layer for the phase (gen -> sync -> train)
and real traffic crosses the emulated fabric:

* gen:   token streams (paced UDP, sequence-numbered) from every generator server to a trainer server, over
         the pod-isolated generation topology (its minimal inter-pod circuits). Generation *compute* is
         modelled (RLSim's cost model says how long it would take); the emulator does not sleep through it.
* sync:  a real torch.distributed (Gloo) broadcast of the model's weights, scaled by the fabric's scale,
         from the first trainer server to every generator server over the broadcast-tree topology.
* train: a real Gloo all-reduce of the gradients (scaled) among the trainer servers over the train mesh.

Results go to ``OUT/demo.json`` and ``OUT/demo.png``; RLSim's per-phase prediction for the same scenario on
RFabric stands beside the measured communication times (a comparison to read, not a pass/fail).
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Callable

from agents.costmodel import CostModel
from emulation.scenario import Scenario
from testbed.harness import running_testbed
from testbed.traffic import ProbeStream, collective

log = logging.getLogger(__name__)

MAX_EMULATED_BYTES = 64 * 2**20  # keep one collective under ~2 s at 400 Mb/s on a 2-core machine


def _scaled(spec, real_bytes: float) -> int:
    return int(min(MAX_EMULATED_BYTES, max(4.0, spec.scaled_bytes(real_bytes))))


def run_demo(scn: Scenario, out_dir: Path, steps: int | None = None, token_stream_s: float = 1.5,
             progress: Callable[[str], None] | None = None) -> dict:
    from rlsim.sim import simulate_iteration

    spec, layout, w = scn.fabric, scn.layout, scn.workload
    steps = steps if steps is not None else w.steps
    cm = CostModel.for_names(w.model, w.gpu)
    trainers, gens = layout.train_servers(spec), layout.gen_servers(spec)
    sync_bytes = _scaled(spec, cm.weight_bytes())
    grad_bytes = _scaled(spec, cm.gradient_bytes())
    delay = scn.controller.effective_delay_ms(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    sim = simulate_iteration(scn, "rfabric")
    events: list[dict] = []
    t_start = time.monotonic()

    def note(msg: str) -> None:
        log.info(msg)
        if progress:
            progress(msg)

    with running_testbed(spec, layout, initial_phase=scn.controller.initial_phase, delay_ms=delay) as tb:
        for step in range(steps):
            for phase in ("gen", "sync", "train"):
                t0 = time.monotonic()
                rec = tb.client.set_phase(phase, delay_ms=delay)
                ev = {"step": step, "phase": phase, "t_start_s": round(t0 - t_start, 4),
                      "reconfig": {k: rec.get(k) for k in ("status", "overhead_ms", "dark_ms", "total_ms")}}
                if phase == "gen":
                    streams = [ProbeStream(tb.fabric, g, trainers[i % len(trainers)], pps=1000.0,
                                           duration_s=token_stream_s, port=48000 + i)
                               for i, g in enumerate(gens)]
                    for s in streams:
                        s.start_receiver()
                    for s in streams:
                        s.start_sender()
                    sums = [s.summary() for s in streams]
                    ev["token_streams"] = {"streams": len(sums), "sent": sum(x["sent"] for x in sums),
                                           "received": sum(x["received"] for x in sums),
                                           "lost": sum(x["lost"] for x in sums)}
                elif phase == "sync":
                    res = collective(tb.fabric, [trainers[0]] + gens, "broadcast", sync_bytes, iters=2,
                                     port=29600 + step)
                    ok = all(r["check_value"] == res[0]["check_value"] for r in res)
                    ev["broadcast"] = {"ranks": len(res), "bytes": res[0]["bytes"], "consistent": ok,
                                       "time_s": _collective_time(res)}
                elif len(trainers) < 2:  # one trainer server: its gradients never leave it
                    ev["all_reduce"] = {"ranks": 1, "bytes": 0, "time_s": None,
                                        "skipped": "one trainer server: no all-reduce across the fabric"}
                else:
                    res = collective(tb.fabric, trainers, "all_reduce", grad_bytes, iters=2, port=29700 + step)
                    ev["all_reduce"] = {"ranks": len(res), "bytes": res[0]["bytes"], "time_s": _collective_time(res)}
                ev["t_end_s"] = round(time.monotonic() - t_start, 4)
                events.append(ev)
                note(f"step {step} {phase}: {rec.get('status')} ({rec.get('total_ms')} ms reconfiguration)")
        history = tb.client.history()
    meas_sync = _median([e["broadcast"]["time_s"] for e in events if "broadcast" in e])
    meas_ar = _median([e["all_reduce"]["time_s"] for e in events if "all_reduce" in e])
    result = {
        "scenario": scn.name, "servers": spec.n_servers, "gpus": spec.n_gpus, "steps": steps,
        "scale": spec.scale, "link_mbps": spec.server_link_mbps, "switching_delay_ms": delay,
        "bytes": {"weights_real": cm.weight_bytes(), "weights_emulated": sync_bytes,
                  "gradients_real": cm.gradient_bytes(), "gradients_emulated": grad_bytes,
                  "capped": sync_bytes == MAX_EMULATED_BYTES or grad_bytes == MAX_EMULATED_BYTES},
        "events": events,
        "reconfigurations": [h for h in history if h.get("kind") == "phase"],
        "measured": {"sync_broadcast_s": meas_sync, "train_all_reduce_s": meas_ar},
        "rlsim_rfabric": {"iteration_s": sim["iteration_s"], "phases": sim["phases"],
                          "train_dp_allreduce_s": sim["detail"]["train"].get("dp_allreduce_s")},
        "note": "generation compute is modelled (RLSim); the emulator measures the phases' communication. "
                "RLSim's sync uses pipelined chains, Gloo's broadcast its own algorithm: compare, don't equate.",
    }
    (out_dir / "demo.json").write_text(json.dumps(result, indent=1))
    _plot(result, out_dir / "demo.png")
    return result


def _collective_time(res: list[dict]) -> float:
    """Median over iterations of the slowest rank's time (a collective is done when its last rank is)."""
    n = len(res[0]["times_s"])
    return round(statistics.median(max(r["times_s"][i] for r in res) for i in range(n)), 4)


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"gen": "#4c9be8", "sync": "#f2a541", "train": "#59b36b"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    for e in result["events"]:
        ax1.barh(0, e["t_end_s"] - e["t_start_s"], left=e["t_start_s"], color=colors[e["phase"]],
                 edgecolor="black", linewidth=0.5)
        ax1.axvline(e["t_start_s"], color="black", linewidth=0.6, linestyle=":")
    for ph, c in colors.items():
        ax1.barh(0, 0, color=c, label=ph)
    ax1.set_yticks([])
    ax1.set_xlabel("wall time (s); dotted: OCS re-wired for the phase")
    ax1.set_title(f"{result['scenario']}: {result['steps']} RL steps on the emulated RFabric")
    ax1.legend(loc="upper right", ncol=3, fontsize=8)
    m, s = result["measured"], result["rlsim_rfabric"]
    labels = ["sync\nbroadcast", "train\nall-reduce"]
    xs = range(len(labels))
    ax2.bar([x - 0.2 for x in xs], [m["sync_broadcast_s"] or 0, m["train_all_reduce_s"] or 0], width=0.4,
            label="emulated (Gloo over OVS)", color="#666666")
    ax2.bar([x + 0.2 for x in xs], [s["phases"]["sync_s"], s["train_dp_allreduce_s"] or 0], width=0.4,
            label="RLSim (RFabric)", color="#bbbbbb")
    ax2.set_xticks(list(xs), labels)
    ax2.set_ylabel("seconds (real-time equivalent)")
    ax2.set_title("communication per phase")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
