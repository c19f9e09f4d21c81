"""Sweeps: fabrics x scales x OCS switching times x RFabric configurations x switch radix, on Ray when it is
installed, serially otherwise.

``run_sweep`` returns one result per point (the dict of :func:`rlsim.sim.simulate_iteration`, without its
bulky ``detail``; a point whose fabric cannot carry the workload, e.g. one uplink per ToR, is kept with its
``error``); ``write_outputs`` writes ``sweep.json`` and three plots (matplotlib, Agg backend): performance
against cost with the Pareto frontier (every fabric and every RFabric configuration), per-phase time by
fabric, and sensitivity to T_ocs with each transition's switched / stalled / kept decision marked.

Dimensions: T_ocs only matters for fabrics that re-wire during a job (RFabric; MixNet is modelled static);
the RFabric configuration (``uplinks``: uplinks per ToR, the taper against the ToR's server ports;
``ocs``: OCS count, which sets each OCS's radix = ToRs x uplinks / OCSes) only for RFabric; the packet
switch radix (``radix``: the Fat-Tree tier count, FabricOptions.switch_radix) only for fabrics with packet
tiers. The others run once per scale.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Sequence

from emulation import plots
from emulation.files import write_json_atomic
from emulation.scenario import Scenario
from emulation.validation import SpecError, to_dict

from .fabric_models import fabric_model, fabric_names
from .fabrics import OVERSUB
from .limits import scale_scenario
from .sim import TRAIN_REWIRE, SimSettings, simulate_iteration

log = logging.getLogger(__name__)

# 1 us .. 10 s: CALIENT-class bulk reconfiguration takes up to 200 ms; beyond a few seconds the switching time
# exceeds the slack windows of this workload and decisions turn from switched to stalled to kept
DEFAULT_RECONFIG_DELAYS_MS = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0)


# a fabric's model, looked up once per name: the summary asks per base and result (errors are not cached)
_model = functools.lru_cache(maxsize=None)(fabric_model)


def reconfigures(fabric: str) -> bool:
    """Re-wired during the job (rlsim.fabric_models; MixNet is modelled static for the job, docs/rlsim.md)."""
    return _model(fabric).reconfigures


def configurable(fabric: str) -> bool:
    """Swept over uplinks per ToR and OCS count."""
    return _model(fabric).configurable


def radix_priced(fabric: str) -> bool:
    """Its cost depends on the packet switch radix."""
    return _model(fabric).radix_priced
SLOWDOWN_GOAL = 0.05  # "within 5% of the non-blocking Fat-Tree": the summary's best configuration
MAX_UPLINKS = 1024  # per ToR (and OCSes): far beyond any switch, small enough to size-check before work


@dataclass(frozen=True)
class Point:
    fabric: str
    gpus: int
    reconfig_delay_ms: float
    uplinks: int | None = None  # uplinks per ToR (None: the scenario's)
    ocs: int | None = None  # OCS count (None: the scenario's)
    radix: int | None = None  # packet switch radix (None: prices.yaml's)


def _ints_in(values: Sequence[int] | None, field: str, lo: int, hi: int) -> list:
    if not values:
        return [None]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise SpecError(field, f"must be integers in {lo}..{hi}, got {v!r}")
    return list(dict.fromkeys(values))


def default_ocs(scn: Scenario, uplinks: int) -> int:
    """OCS count for ``uplinks`` per ToR when none is given: the scenario's OCSes-per-uplink ratio when it
    gives a whole number that divides the uplinks, else one OCS per uplink."""
    f = scn.fabric
    k = f.uplinks_per_tor // f.ocs_count  # ports per ToR on each OCS
    return uplinks // k if uplinks % k == 0 else uplinks


def plan(scn: Scenario, fabrics: Sequence[str], scales: Sequence[int], reconfig_delay_ms: Sequence[float],
         uplinks: Sequence[int] | None = None, ocs: Sequence[int] | None = None,
         radix: Sequence[int] | None = None) -> list[Point]:
    """Every point to simulate. Combinations of ``uplinks`` and ``ocs`` where the OCS count does not divide
    the uplinks (every ToR needs the same ports on every OCS) are left out; SpecError (naming the field)
    for a bad value or when no combination is left."""
    for f in fabrics:
        fabric_model(f, "fabrics")  # SpecError naming the field for an unknown fabric
    for n in scales:
        scale_scenario(scn, n)  # validates the scale (exit 2 before any work)
    for t in reconfig_delay_ms:
        SimSettings(reconfig_delay_ms=t)  # validates it (finite, 0 .. the controller's limit)
    ups = _ints_in(uplinks, "uplinks", 1, MAX_UPLINKS)
    ocss = _ints_in(ocs, "ocs", 1, MAX_UPLINKS)
    radices = _ints_in(radix, "radix", 4, 4096)
    configs = []
    for u in ups:
        for o in ocss:
            uu = scn.fabric.uplinks_per_tor if u is None else u
            oo = (scn.fabric.ocs_count if u is None else default_ocs(scn, u)) if o is None else o
            if uu % oo:
                log.info("sweep: %d uplinks per ToR on %d OCSes is not a valid wiring; left out", uu, oo)
                continue
            configs.append((u, oo if (u is not None or o is not None) else None))
    if not configs:
        raise SpecError("ocs", f"no OCS count in {ocs} divides any uplink count in {uplinks}")
    default_t = scn.reconfig_delay_ms
    pts = []
    for n in scales:
        for f in fabrics:
            for t in (reconfig_delay_ms if reconfigures(f) else [default_t]):
                for u, o in (configs if configurable(f) else [(None, None)]):
                    for r in (radices if radix_priced(f) else [None]):
                        pts.append(Point(f, n, float(t), u, o, r))
    return pts


def point_scenario(scn: Scenario, p: Point) -> Scenario:
    """``scn`` with the point's RFabric configuration (uplinks per ToR, OCS count; OCS ports exactly needed)."""
    if p.uplinks is None and p.ocs is None:
        return scn
    fab = dataclasses.replace(scn.fabric, uplinks_per_tor=p.uplinks or scn.fabric.uplinks_per_tor,
                              ocs_count=p.ocs or scn.fabric.ocs_count, ocs_ports=0)
    return dataclasses.replace(scn, fabric=fab)


def _one(scn: Scenario, p: Point, settings: SimSettings) -> dict:
    fab = settings.fabric if p.radix is None else dataclasses.replace(settings.fabric, switch_radix=p.radix)
    s = dataclasses.replace(settings, reconfig_delay_ms=p.reconfig_delay_ms, fabric=fab)
    sc = point_scenario(scn, p)
    spec = scale_scenario(sc, p.gpus).fabric
    base = {"fabric": p.fabric, "gpus": p.gpus, "reconfig_delay_ms": p.reconfig_delay_ms, "uplinks_per_tor": spec.uplinks_per_tor,
            "ocs_count": spec.ocs_count, "ocs_radix": spec.ports_per_ocs,
            "taper": spec.servers_per_tor * spec.server_gbps / (spec.uplinks_per_tor * spec.uplink_gbps),
            "switch_radix": p.radix, "swept_config": p.uplinks is not None or p.ocs is not None}
    try:
        r = simulate_iteration(sc, p.fabric, p.gpus, s)
    except SpecError as e:  # e.g. too few uplinks to connect the phase topologies (rlsim.fabrics.Unreachable)
        return {**base, "error": str(e), "iteration_s": None, "cost_usd": None}
    r.update(base, switch_radix=r["detail"]["cost"]["counts"]["switch_radix"])
    r["stall_s"] = sum(v["stall_s"] for v in r["detail"]["reconfig"].values())
    r["decisions"] = {k: v["action"] for k, v in r["detail"]["reconfig"].items()}
    r["sync_vs_bound"] = r["detail"]["sync"].get("vs_bound")
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
            from emulation.signals import handlers_kept

            with handlers_kept():  # a SIGTERM still unwinds the sweep (ray.shutdown below), not Ray's own exit
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


def _label(r: dict) -> str:
    """A point's name in plots and summaries: the fabric, plus its configuration where it was swept."""
    out = r["fabric"]
    if configurable(r["fabric"]):
        out += f" u{r['uplinks_per_tor']}/o{r['ocs_count']}"
    if radix_priced(r["fabric"]) and r.get("switch_radix"):
        out += f" r{r['switch_radix']}"
    return out


def summarise(results: Sequence[dict], ceilings: dict | None = None) -> dict:
    """Per scale: each point's slowdown, cost and perf/cost relative to the non-blocking Fat-Tree built of
    switches of the same radix (points whose cost does not depend on the radix: against each such
    Fat-Tree): ``rows``; ``best_within_slowdown``: per Fat-Tree radix, the other point with the highest
    perf/cost whose iteration is within SLOWDOWN_GOAL of that Fat-Tree's (each at T_ocs = 10 ms or the
    nearest swept); ``vs_static``: per radix, the best static fabric (none re-wires during the job: the
    Fat-Trees, rail, TopoOpt, MixNet as modelled), the best oversubscribed Fat-Tree and the best RFabric
    configuration within the goal, and RFabric's perf/cost against the first two. ``ceilings`` (per scale,
    ``rlsim.bounds.perf_cost_ceiling``): ``ceiling``, what no fabric beats at these prices, and per radix
    ``ceiling_vs_best_oversubscribed_fat_tree``, the most any fabric could gain over that tree."""
    out: dict = {}
    ok = [r for r in results if r.get("iteration_s")]
    for n in sorted({r["gpus"] for r in ok}):
        bases = [r for r in ok if r["gpus"] == n and r["fabric"] == "fat-tree"]
        rows = []
        for b in bases:
            for r in ok:
                if r["gpus"] != n or (radix_priced(r["fabric"]) and r.get("switch_radix") != b.get("switch_radix")):
                    continue
                rows.append({"fabric": r["fabric"], "label": _label(r), "reconfig_delay_ms": r["reconfig_delay_ms"],
                             "uplinks_per_tor": r.get("uplinks_per_tor"), "ocs_count": r.get("ocs_count"),
                             "fat_tree_radix": b.get("switch_radix"), "iteration_s": r["iteration_s"],
                             "slowdown_vs_fat_tree": r["iteration_s"] / b["iteration_s"] - 1,
                             "cost_vs_fat_tree": r["cost_usd"] / b["cost_usd"],
                             "perf_per_cost_vs_fat_tree": (b["iteration_s"] * b["cost_usd"]) /
                                                          (r["iteration_s"] * r["cost_usd"])})
        if not rows:
            continue
        best, vs_static = {}, {}
        for rad in sorted({row["fat_tree_radix"] for row in rows}, key=str):
            near: dict = {}  # per configuration, the row at T_ocs = 10 ms (or the nearest swept)
            for row in rows:
                if row["fat_tree_radix"] == rad and row["fabric"] != "fat-tree":
                    k = row["label"]
                    if k not in near or abs(row["reconfig_delay_ms"] - 10.0) < abs(near[k]["reconfig_delay_ms"] - 10.0):
                        near[k] = row
            cands = [row for row in near.values() if row["slowdown_vs_fat_tree"] <= SLOWDOWN_GOAL]
            if cands:
                best[str(rad)] = max(cands, key=lambda row: row["perf_per_cost_vs_fat_tree"])
            # against the best static fabric (everything that does not re-wire during the job, the
            # non-blocking Fat-Tree included) and the best oversubscribed Fat-Tree, both within the goal
            ok_rows = [row for row in rows if row["fat_tree_radix"] == rad and row["slowdown_vs_fat_tree"] <= SLOWDOWN_GOAL]
            static = [row for row in ok_rows if not reconfigures(row["fabric"])]
            over = [row for row in ok_rows if row["fabric"] in OVERSUB and row["fabric"] != "fat-tree"]
            rf = [row for row in near.values() if reconfigures(row["fabric"])
                  and row["slowdown_vs_fat_tree"] <= SLOWDOWN_GOAL]
            entry: dict = {}
            for key, cand in (("best_static", static), ("best_oversubscribed_fat_tree", over),
                              ("best_rfabric", rf)):
                if cand:
                    entry[key] = max(cand, key=lambda row: row["perf_per_cost_vs_fat_tree"])
            ceil = (ceilings or {}).get(n) or (ceilings or {}).get(str(n))
            if (ceil and ceil.get("best_within_goal") and "best_oversubscribed_fat_tree" in entry
                    and str(ceil["fat_tree"].get("switch_radix")) == str(rad)):  # against the same Fat-Tree
                entry["ceiling_vs_best_oversubscribed_fat_tree"] = (
                    ceil["best_within_goal"]["perf_per_cost_ceiling_vs_fat_tree"] /
                    entry["best_oversubscribed_fat_tree"]["perf_per_cost_vs_fat_tree"])
            if "best_rfabric" in entry:
                for key in ("best_static", "best_oversubscribed_fat_tree"):
                    if key in entry:
                        entry[f"rfabric_vs_{key}"] = (entry["best_rfabric"]["perf_per_cost_vs_fat_tree"] /
                                                      entry[key]["perf_per_cost_vs_fat_tree"])
            if entry:
                vs_static[str(rad)] = entry
        out[str(n)] = {"rows": rows, "best_within_slowdown": best, "vs_static": vs_static,
                       "slowdown_goal": SLOWDOWN_GOAL}
        ceil = (ceilings or {}).get(n) or (ceilings or {}).get(str(n))
        if ceil:
            out[str(n)]["ceiling"] = ceil_summary(ceil)
    return out


def ceil_summary(ceil: dict) -> dict:
    """The figures of a ``rlsim.bounds.perf_cost_ceiling`` answer a reader needs (its rows stay in it)."""
    b = ceil.get("best_within_goal")
    return {"free_network_perf_per_cost_vs_fat_tree": ceil["free_network"]["perf_per_cost_ceiling_vs_fat_tree"],
            "cost_floor_vs_fat_tree": ceil["free_network"]["cost_floor_vs_fat_tree"],
            "best_within_goal": {k: b[k] for k in ("uplinks_per_tor", "slowdown_vs_fat_tree", "cost_vs_fat_tree",
                                                   "perf_per_cost_ceiling_vs_fat_tree")} if b else None}


ACTION_STYLE = {"switched": ("#2ca02c", "o"), "stalled": ("#ff7f0e", "^"), "kept": ("#d62728", "X"),
                "unchanged": ("#7f7f7f", ".")}


def _near_10ms(rs: Sequence[dict]) -> dict:
    return min(rs, key=lambda r: abs(r["reconfig_delay_ms"] - 10.0))


def write_outputs(results: Sequence[dict], out_dir: str, meta: dict | None = None,
                  ceilings: dict | None = None) -> dict:
    """sweep.json (every result, the summary, ``ceilings`` per scale: ``rlsim.bounds.perf_cost_ceiling``) and
    the plots; the Pareto panels draw each scale's ceiling (what no fabric of any taper beats)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    ok = [r for r in results if r.get("iteration_s")]
    ceilings = {str(k): v for k, v in (ceilings or {}).items()}
    doc = {"meta": meta or {}, "results": list(results), "summary": summarise(results, ceilings),
           "ceilings": ceilings,
           "infeasible": [{k: r.get(k) for k in ("fabric", "gpus", "uplinks_per_tor", "ocs_count", "error")}
                          for r in results if not r.get("iteration_s")]}
    write_json_atomic(os.path.join(out_dir, "sweep.json"), doc, indent=1, fsync=False, default=to_dict)
    files = {"json": os.path.join(out_dir, "sweep.json")}
    fabrics = list(dict.fromkeys([f for f in fabric_names() if any(r["fabric"] == f for r in ok)]
                                 + [r["fabric"] for r in ok]))  # the built-ins in their order, then plug-ins
    scales = sorted({r["gpus"] for r in ok})
    # the built-ins keep their colours (their registry order), plug-ins take the next ones
    colors = {f: plt.cm.tab10(i % 10) for i, f in enumerate(dict.fromkeys([*fabric_names(), *fabrics]))}
    if not scales:
        return files

    # 1. performance against cost, one panel per scale: every fabric and every swept configuration of it
    #    (T_ocs = 10 ms or the nearest), the Pareto frontier dashed
    cols = min(2, len(scales))
    rows_n = math.ceil(len(scales) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(7.5 * cols, 5.2 * rows_n), squeeze=False)
    for ax, n in zip(axes.flat, scales):
        pts = []
        groups: dict = {}
        for r in ok:
            if r["gpus"] == n:
                groups.setdefault((r["fabric"], r.get("uplinks_per_tor"), r.get("ocs_count"),
                                   r.get("switch_radix")), []).append(r)
        for f in fabrics:
            first = True
            for key, rs in sorted(((k, v) for k, v in groups.items() if k[0] == f), key=lambda kv: str(kv[0])):
                r = _near_10ms(rs)
                x, y = r["cost_usd"] / 1e6, 3600.0 / r["iteration_s"]
                ax.scatter(x, y, color=colors[f], s=46, edgecolors="k", linewidths=0.5, label=f if first else None)
                first = False
                if (configurable(f) and r.get("swept_config")) or (radix_priced(f) and r.get("switch_radix")):
                    ax.annotate(_label(r).split(" ", 1)[1], (x, y), fontsize=6, textcoords="offset points",
                                xytext=(3, 3))
                pts.append((x, y))
        front = pareto_front(pts)
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "--", color="gray", lw=1)
        ceil = ceilings.get(str(n))
        if ceil:  # per uplink count: the least such a fabric costs, at the fastest it could iterate
            c_ft = ceil["fat_tree"]["cost_usd"]
            cs = [(r["cost_vs_fat_tree"] * c_ft / 1e6, 3600.0 / r["iteration_s"]) for r in ceil["per_uplinks"]]
            ax.plot([c for c, _ in cs], [y for _, y in cs], ":", color="k", lw=1,
                    label="ceiling: u uplinks per ToR, any fabric")
            fn = ceil["free_network"]
            ax.scatter(fn["cost_floor_usd"] / 1e6, 3600.0 / fn["iteration_s"], marker="*", s=90, color="k",
                       label="ceiling: floor cost, free network")
        ax.set_xscale("log")
        ax.set_xlabel("network cost (million USD, log)")
        ax.set_ylabel("RL iterations per hour")
        ax.set_title(f"{n} GPUs: performance vs network cost (dashed: Pareto frontier)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(scales):]:
        ax.set_visible(False)
    fig.suptitle("RFabric configurations: u = uplinks per ToR, o = OCSes; r = packet switch radix "
                 "(Fat-Tree tier count); T_ocs = 10 ms", fontsize=9)
    fig.tight_layout()
    files["pareto"] = os.path.join(out_dir, "pareto.png")
    plots.save(fig, files["pareto"])

    # 2. per-phase time by fabric at the largest scale (the scenario's own configuration where swept):
    #    stacked (left), train and sync close up (right)
    n = scales[-1]
    vals = {}
    for f in fabrics:
        rs = [r for r in ok if r["gpus"] == n and r["fabric"] == f]
        own = [r for r in rs if not r.get("swept_config")] or rs
        if own:
            vals[f] = _near_10ms(own)["phases"]
    names = list(vals)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    bottoms = [0.0] * len(names)
    for ph, col in (("gen_s", "#4c72b0"), ("train_s", "#dd8452"), ("sync_s", "#55a868")):
        v = [vals[f][ph] for f in names]
        ax.bar(names, v, bottom=bottoms, color=col, label=ph[:-2])
        bottoms = [b + x for b, x in zip(bottoms, v)]
    ax.set_ylabel("seconds per iteration")
    ax.set_title(f"Iteration by phase ({n} GPUs)")
    ax.legend(loc="lower right")
    width = 0.4
    xs = list(range(len(names)))
    ax2.bar([x - width / 2 for x in xs], [vals[f]["train_s"] for f in names], width, color="#dd8452", label="train")
    ax2.bar([x + width / 2 for x in xs], [vals[f]["sync_s"] for f in names], width, color="#55a868", label="sync")
    ax2.set_xticks(xs)
    ax2.set_xticklabels(names)
    ax2.set_ylabel("seconds")
    ax2.set_title("Train and sync phases (close up)")
    ax2.legend()
    for a_ in (ax, ax2):
        plt.setp(a_.get_xticklabels(), rotation=25, ha="right")
    fig.tight_layout()
    files["phases"] = os.path.join(out_dir, "phases.png")
    plots.save(fig, files["phases"])

    # 3. sensitivity to T_ocs: iteration time relative to the non-blocking Fat-Tree (top) and every
    #    transition's decision (bottom: switched / stalled / kept), per scale and configuration
    series = {}
    for r in ok:
        if reconfigures(r["fabric"]):
            series.setdefault((r["gpus"], r["fabric"], r.get("uplinks_per_tor"), r.get("ocs_count")), []).append(r)
    series = {k: sorted(v, key=lambda r: r["reconfig_delay_ms"]) for k, v in sorted(series.items()) if len(v) >= 2}
    transitions = ("gen->train", TRAIN_REWIRE, "train->sync", "sync->gen")
    strip_rows = [(k, t) for k in series for t in transitions
                  if t != TRAIN_REWIRE or any(t in r["decisions"] for r in series[k])]
    fig, (ax, axd) = plt.subplots(2, 1, figsize=(9, 4.5 + 0.22 * max(len(strip_rows), 3)), sharex=True,
                                  gridspec_kw={"height_ratios": [3, max(1.2, 0.22 * len(strip_rows))]})
    for si, (key, rs) in enumerate(series.items()):
        n, f, u, o = key
        base = [r for r in ok if r["gpus"] == n and r["fabric"] == "fat-tree"]
        ref = base[0]["iteration_s"] if base else rs[0]["iteration_s"]
        ax.plot([r["reconfig_delay_ms"] for r in rs], [100 * (r["iteration_s"] / ref - 1) for r in rs],
                marker="os^Dv<>ph*"[si % 10], label=f"{f} u{u}/o{o}, {n} GPUs")
        if len(series) == 1:  # one curve: a dotted line where any transition's decision changes
            for a_, b_ in zip(rs, rs[1:]):
                if a_["decisions"] != b_["decisions"]:
                    ax.axvline(b_["reconfig_delay_ms"], color="gray", ls=":", lw=0.8)
    for yi, (key, t) in enumerate(strip_rows):
        for r in series[key]:
            a = r["decisions"].get(t, "unchanged")
            c, m = ACTION_STYLE.get(a, ("k", "."))
            axd.scatter(r["reconfig_delay_ms"], yi, color=c, marker=m, s=28)
    axd.set_yticks(range(len(strip_rows)))
    axd.set_yticklabels([f"{k[0]} u{k[2]}/o{k[3]}: {t}" for k, t in strip_rows], fontsize=6)
    axd.invert_yaxis()
    for a, (c, m) in ACTION_STYLE.items():
        axd.scatter([], [], color=c, marker=m, label=a)
    axd.legend(fontsize=6, ncol=4, loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if series:
        axd.set_xscale("log")
    else:
        ax.text(0.5, 0.5, "no re-wiring fabric was swept over two or more T_ocs values", ha="center",
                transform=ax.transAxes)
    axd.set_xlabel("OCS switching time T_ocs (ms, log)")
    ax.set_ylabel("iteration time vs fat-tree (%)" if any(r["fabric"] == "fat-tree" for r in ok)
                  else "iteration time vs smallest T_ocs (%)")
    ax.set_title("Sensitivity to the OCS switching time; below: each transition's decision (decide_switch)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    files["reconfig_delay"] = os.path.join(out_dir, "reconfig_delay.png")
    plots.save(fig, files["reconfig_delay"])
    return files
