"""What no fabric can beat, at these prices and in RLSim's model of a step: ceilings on performance per cost.

The sweep says what the modelled fabrics reach; this says how far any fabric could go, so a goal above the
ceiling is shown unreachable by arithmetic rather than argued. Two ceilings, both against the non-blocking
Fat-Tree (its simulated iteration and cost, ``perf/cost = (T_ft C_ft) / (T C)``):

* **free network** (:func:`cost_floor_usd`): every fabric pays for the NICs, their transceivers, the ToR
  ports facing them with theirs, and the NIC-ToR fibres (``rlsim.cost`` counts the same parts in every
  fabric); a fabric costing only that, with a network that takes no time at all (the iteration is the
  generation phase as simulated plus the training compute), is the best anything could do. Divided by the
  best oversubscribed Fat-Tree's perf/cost it bounds how much better than that tree any fabric can be.
* **u uplinks per ToR** (:func:`iteration_bounds_s`): a fabric whose ToRs have ``u`` uplinks of
  ``uplink_gbps`` (whatever is above them: circuits, re-wired at no cost and at any moment, or packet
  switches) cannot move a stage's bytes faster than its busiest server link or busiest ToR's uplinks allow.
  Per training stage (they run one after the other, as ``rlsim.sim.train_phase`` runs them): the all-to-all's
  and the pipeline's bytes between servers are fixed by the placement; an all-reduce of ``S`` bytes over
  ``n`` servers under ``T`` ToRs sends at least ``2 (n-1)/n S`` from every server and ``2 (T-1)/T S`` out
  of every ToR it spans (the bandwidth-optimal bound: reduce-scatter and all-gather, each ToR a node); the
  latency terms are the model's. The weight sync: every generator server receives the weights on its
  link and every generator ToR apart from the trainers through its uplinks. Priced at the floor plus the
  ToRs' uplink ports, their transceivers and fibres (:func:`uplinks_cost_usd`: whatever the uplinks reach
  costs more), and searched over every ``u`` up to the scenario's: the best of them within the slowdown
  goal is what no fabric, of any taper, beats at these prices. (Its premise: servers hang off ToRs of
  ``servers_per_tor``. A cluster small enough for one packet switch to hold every NIC, under 64 NICs at
  the default radix, is that switch, costs the floor and has no uplinks: there only the first ceiling holds.)

Neither bound is a fabric: they are what the sweep's RFabric rows are held to (``achieved`` beside each
ceiling). Pure (no I/O); the bench ``traffic`` section prints them.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from agents.costmodel import CostModel
from controller.traffic import train_bytes, train_traffic
from emulation.scenario import Scenario
from emulation.spec import FabricSpec
from emulation.workload import LengthSchedule

from .cost import fabric_cost, load_prices
from .fabrics import GBPS
from .limits import scale_scenario
from .sim import SimSettings, _train_layout, simulate_iteration


def cost_floor_usd(spec: FabricSpec, nic_gbps: float, prices=None) -> float:
    """What every fabric on ``spec`` pays (``rlsim.cost.fabric_cost`` counts these in each): the NICs and
    their transceivers, the ToR ports facing them and theirs, one fibre per NIC."""
    p = prices or load_prices()
    n_nic = spec.n_servers * math.ceil(spec.server_gbps / nic_gbps - 1e-9)
    per_nic = (p.by_speed("nic", nic_gbps) + 2 * p.by_speed("transceiver", nic_gbps) +
               p.by_speed("eps_port", nic_gbps) + p.fibre_m * p.fibre_per_m)
    return float(n_nic * per_nic)


def _tor_loads(spec: FabricSpec, demands) -> tuple[np.ndarray, np.ndarray]:
    """Per server the larger of its bytes sent and received, and per ToR the same for the bytes that leave
    or enter it (demands between its own servers stay below it)."""
    out_s, in_s = np.zeros(spec.n_servers), np.zeros(spec.n_servers)
    out_t, in_t = np.zeros(spec.n_tors), np.zeros(spec.n_tors)
    spt = spec.servers_per_tor
    for s, d, b in demands:
        out_s[s] += b
        in_s[d] += b
        if s // spt != d // spt:
            out_t[s // spt] += b
            in_t[d // spt] += b
    return np.maximum(out_s, in_s), np.maximum(out_t, in_t)


def iteration_bounds_s(scn: Scenario, gpus: int, uplinks: Sequence[int], gen_s: float,
                       settings: SimSettings = SimSettings()) -> list[dict]:
    """Per uplink count in ``uplinks``: a lower bound on the iteration of any fabric with that many uplinks
    per ToR on ``scn`` at ``gpus`` (module docstring); ``gen_s``: the generation phase as simulated (it
    carries little traffic and is the same on every fabric modelled). Per stage and phase in each answer."""
    sc = scale_scenario(scn, gpus)
    spec, layout, w = sc.fabric, sc.layout, sc.workload
    cm = CostModel.for_names(w.model, w.gpu)
    lengths = LengthSchedule(w).lengths_for_step(0, sc.rng())  # the step simulate_iteration runs
    train_servers, gen_servers = layout.train_servers(spec), layout.gen_servers(spec)
    tl = _train_layout(w, spec, train_servers)
    tokens = float(np.sum(lengths) + len(lengths) * w.prompt_tokens)
    micro = max(1, len(lengths) // tl.dp)
    compute = cm.train_compute_s(tokens, tl.dp * tl.tp * tl.pp, seq_len=tokens / len(lengths)) * \
        (1 + (tl.pp - 1) / micro)
    lat = settings.latency_us * 1e-6
    spt = spec.servers_per_tor
    parts = {}  # stage -> (busiest server's bytes, busiest ToR's bytes, latency)
    for st in train_traffic(tl, train_bytes(cm, tl, tokens)).stages:
        if st.name == "dp_allreduce":
            server_b, tor_b = np.zeros(spec.n_servers), np.zeros(spec.n_tors)
            latency = 0.0
            for g in st.groups:
                n = len(g.members)
                tors = sorted({m // spt for m in g.members})
                server_b[list(g.members)] += 2.0 * (n - 1) / n * g.nbytes
                if len(tors) > 1:
                    tor_b[tors] += 2.0 * (len(tors) - 1) / len(tors) * g.nbytes
                latency = max(latency, lat * 2 * (n - 1))
        else:
            server_b, tor_b = _tor_loads(spec, st.demands())
            latency = lat * tl.ep * micro if st.name == "ep_alltoall" else lat * 2 * micro * (tl.pp - 1)
        parts[st.name] = (float(server_b.max(initial=0.0)), float(tor_b.max(initial=0.0)), latency)
    W = cm.weight_bytes()
    apart = bool({s // spt for s in gen_servers} - {s // spt for s in train_servers})
    server_rate = spec.server_gbps * GBPS
    out = []
    for u in uplinks:
        up = u * spec.uplink_gbps * GBPS
        stages = {f"{k}_s": max(sb / server_rate, tb / up if tb > 0 else 0.0) + latency
                  for k, (sb, tb, latency) in parts.items()}
        sync = max(W / server_rate, W / up if apart else 0.0)
        train = compute + sum(stages.values())
        out.append({"uplinks_per_tor": u, "iteration_s": gen_s + train + sync, "gen_s": gen_s, "train_s": train,
                    "compute_s": compute, "sync_s": sync, "train_stages_s": stages})
    return out


def uplinks_cost_usd(spec: FabricSpec, nic_gbps: float, uplinks: int, prices=None) -> float:
    """The least a fabric whose ToRs have ``uplinks`` each can cost: the floor plus the ToRs' uplink ports,
    their transceivers and fibres (what lies above them, OCS ports or packet switches, costs more)."""
    p = prices or load_prices()
    up = spec.uplink_gbps
    per = p.by_speed("eps_port", up) + p.by_speed("transceiver", up) + p.fibre_m * p.fibre_per_m
    return cost_floor_usd(spec, nic_gbps, p) + spec.n_tors * uplinks * per


def perf_cost_ceiling(scn: Scenario, gpus: int, achieved_uplinks: Sequence[int] = (), slowdown_goal: float = 0.05,
                      settings: SimSettings = SimSettings(reconfig_delay_ms=10.0)) -> dict:
    """Both ceilings of the module docstring at ``gpus``: ``free_network``, and ``per_uplinks`` for every
    uplink count from 1 to a non-blocking ToR's (or the scenario's, if more), priced at :func:`uplinks_cost_usd`; ``best_within_goal``: the highest
    of those whose bound iteration is within ``slowdown_goal`` of the Fat-Tree's (no fabric of any taper
    does better at these prices). For each of ``achieved_uplinks`` RFabric's own row beside its ceiling
    (its OCS count as the sweep picks it, ``rlsim.sweep.default_ocs``; its bound priced at its own cost)."""
    from .sweep import Point, default_ocs, point_scenario

    ft = simulate_iteration(scn, "fat-tree", gpus, settings)
    t_ft, c_ft = ft["iteration_s"], ft["cost_usd"]
    nic = CostModel.for_names(scn.workload.model, scn.workload.gpu).gpu.nic_gbps
    spec = scale_scenario(scn, gpus).fabric
    floor = cost_floor_usd(spec, nic)
    gen_s = ft["phases"]["gen_s"]
    free_t = gen_s + ft["detail"]["train"]["compute_s"]

    def pc(t: float, c: float) -> float:
        return t_ft * c_ft / (t * c)

    rows = []
    full = max(spec.uplinks_per_tor, math.ceil(spec.servers_per_tor * spec.server_gbps / spec.uplink_gbps - 1e-9))
    for b in iteration_bounds_s(scn, gpus, range(1, full + 1), gen_s, settings):
        u = b["uplinks_per_tor"]
        cost = uplinks_cost_usd(spec, nic, u)
        rows.append({**b, "slowdown_vs_fat_tree": b["iteration_s"] / t_ft - 1, "cost_vs_fat_tree": cost / c_ft,
                     "perf_per_cost_ceiling_vs_fat_tree": pc(b["iteration_s"], cost)})
    rfabric = []
    for u in achieved_uplinks:
        sc = point_scenario(scn, Point("rfabric", gpus, 10.0, u, default_ocs(scn, u), None))
        b = next(r for r in rows if r["uplinks_per_tor"] == u)
        cost = fabric_cost("rfabric", scale_scenario(sc, gpus).fabric, nic)["total_usd"]
        row = {"uplinks_per_tor": u, "ocs_count": default_ocs(scn, u), "cost_vs_fat_tree": cost / c_ft,
               "bound_iteration_s": b["iteration_s"], "ceiling_at_its_cost_vs_fat_tree": pc(b["iteration_s"], cost)}
        try:
            rf = simulate_iteration(sc, "rfabric", gpus, settings)
        except Exception as e:  # noqa: BLE001 - too few uplinks to connect a phase (rlsim.fabrics.Unreachable)
            row["error"] = str(e)
        else:
            row.update(iteration_s=rf["iteration_s"], slowdown_vs_fat_tree=rf["iteration_s"] / t_ft - 1,
                       perf_per_cost_vs_fat_tree=pc(rf["iteration_s"], rf["cost_usd"]),
                       train_s=rf["phases"]["train_s"], sync_s=rf["phases"]["sync_s"],
                       vs_bound=rf["iteration_s"] / b["iteration_s"])
        rfabric.append(row)
    within = [r for r in rows if r["slowdown_vs_fat_tree"] <= slowdown_goal]
    return {"gpus": gpus, "slowdown_goal": slowdown_goal,
            "fat_tree": {"iteration_s": t_ft, "cost_usd": c_ft,
                         "switch_radix": ft["detail"]["cost"]["counts"]["switch_radix"]},
            "free_network": {"iteration_s": free_t, "cost_floor_usd": floor, "cost_floor_vs_fat_tree": floor / c_ft,
                             "perf_per_cost_ceiling_vs_fat_tree": pc(free_t, floor)},
            "per_uplinks": rows,
            "best_within_goal": max(within, key=lambda r: r["perf_per_cost_ceiling_vs_fat_tree"]) if within else None,
            "rfabric": rfabric}
