"""The cost model against published engine measurements, end to end (``orchestrrl bench engine``).

Every case of ``agents/data/engine_cases.yaml`` is a measurement someone published of a serving engine (model,
GPU, engine and version, layout, load, lengths, the figure, its source) and :func:`model_figure` computes the
same figure from the cost model with that engine's profile (``emulation/data/engines.yaml``). A case is
``fit`` (a profile figure was fitted to it: its error shows the fit, it validates nothing), ``validate``
(never fitted: the check) or ``context``. Ratios between two cases (the same set-up at two layouts) are
checked too. Goals (issue 33): every validated case within 15%, every ratio within 10%; the docs table
(docs/costmodel.md "Engine validation") is generated from :func:`run_cases`.

Kinds of case:

* ``step_ms``: one decode step of ``batch`` sequences of ``context`` tokens each (ms);
* ``cpu_share``: the engine's CPU time as a share of its step (no API server: the engine alone);
* ``overlap_speedup``: a step's time without the profile's overlap over with it (SGLang's overlap scheduler);
* ``eager_ms``: a step launched eagerly (above the CUDA-graph cap) less the same step as a graph;
* ``rollout_s``: a whole rollout round through the generation engine (:func:`rollpacker_rounds`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field

import numpy as np
import yaml

from agents.costmodel import CostModel
from agents.engine import Engine, Layout, ModelledCost, NewRequest
from emulation.orchestration import EngineSettings
from emulation.validation import SpecError, from_dict, require

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
CASES_FILE = os.path.join(ROOT, "agents", "data", "engine_cases.yaml")
KINDS = ("step_ms", "cpu_share", "overlap_speedup", "eager_ms", "rollout_s")
ROLES = ("fit", "validate", "context")
ROUNDS = ("short", "long")  # rollout_s: RollPacker's rounds (:func:`rollpacker_rounds`)
ROLLOUT_LAYOUTS = ("TP1x8", "TP2x4")  # rollout_s: the layouts :func:`rollpacker_rounds` runs (its default)
CASE_TOLERANCE = 0.15  # a validated case within 15% of its measured figure
RATIO_TOLERANCE = 0.10  # a ratio between two layouts of one set-up within 10%


@dataclass(frozen=True)
class Case:
    id: str
    kind: str
    role: str
    model: str
    gpu: str
    profile: str
    measured: float
    source: str
    tp: int = 1
    batch: int = 1
    context: int = 0  # tokens of context per sequence (prompt + half the response, for a run's average step)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    engine: str = ""  # the engine and version measured
    notes: str = ""
    scenario: str | None = None  # rollout_s: the scenario file (repo-relative)
    round: str | None = None  # rollout_s: "short" | "long"
    layout: str | None = None  # rollout_s: e.g. TP2x4

    def __post_init__(self) -> None:
        require(self.kind in KINDS, "kind", f"must be one of {', '.join(KINDS)}, got {self.kind!r}")
        require(self.role in ROLES, "role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        require(math.isfinite(self.measured) and self.measured > 0, "measured", f"must be > 0, got {self.measured}")
        if self.kind == "rollout_s":  # a round of RollPacker's through the engine: which scenario, round and layout
            require(bool(self.scenario), "scenario", "is required for a rollout_s case (a scenario file, repo-relative)")
            require(os.path.isfile(os.path.join(ROOT, self.scenario)), "scenario",
                    f"no such file {self.scenario!r} (repo-relative, under {ROOT})")
            require(self.round in ROUNDS, "round", f"must be one of {', '.join(ROUNDS)}, got {self.round!r}")
            require(self.layout in ROLLOUT_LAYOUTS, "layout",
                    f"must be one of {', '.join(ROLLOUT_LAYOUTS)} (the layouts rollpacker_rounds runs), got {self.layout!r}")


@dataclass(frozen=True)
class Ratio:
    id: str
    numerator: str
    denominator: str
    notes: str = ""


@dataclass(frozen=True)
class CaseFile:
    cases: tuple[Case, ...]
    ratios: tuple[Ratio, ...] = field(default_factory=tuple)


def load_cases(path: str = CASES_FILE) -> CaseFile:
    """The case file at ``path``; SpecError naming what is wrong (no such file, not YAML, not a mapping, a bad
    case or ratio)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise SpecError("cases", f"no such file {path!r}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError("cases", f"{path}: cannot be read ({e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise SpecError("cases", f"{path}: not valid YAML ({str(e).splitlines()[0]}{where})") from None
    if not isinstance(raw, dict):
        raise SpecError("cases", f"{path}: must be a mapping with 'cases' (and 'ratios'), got {type(raw).__name__}")
    for k in ("cases", "ratios"):
        require(isinstance(raw.get(k, []), list), k, f"must be a list, got {type(raw.get(k)).__name__}")
    cases = tuple(from_dict(Case, c, f"cases[{i}]") for i, c in enumerate(raw.get("cases", [])))
    ratios = tuple(from_dict(Ratio, r, f"ratios[{i}]") for i, r in enumerate(raw.get("ratios", [])))
    for i, c in enumerate(cases):  # the model, GPU and engine profile exist (named by the case, before any runs)
        try:
            _cm(c)
        except SpecError as e:
            raise SpecError(f"cases[{i}].{e.field}", e.message) from None
    ids = [c.id for c in cases]
    require(len(set(ids)) == len(ids), "cases", "ids must be unique")
    for r in ratios:
        for side in (r.numerator, r.denominator):
            require(side in ids, f"ratios.{r.id}", f"names no case {side!r}")
    return CaseFile(cases, ratios)


def _settings(c: Case) -> EngineSettings:
    return EngineSettings(profile=c.profile, max_num_seqs=c.max_num_seqs,
                          max_num_batched_tokens=max(c.max_num_batched_tokens, c.max_num_seqs))


def _cm(c: Case) -> CostModel:
    return CostModel.for_engine(c.model, c.gpu, _settings(c))


def model_figure(c: Case) -> float:
    """The cost model's figure for case ``c`` (the case's unit)."""
    if c.kind == "step_ms":
        return _cm(c).decode_step_s(c.batch, c.batch * c.context, c.tp) * 1e3
    if c.kind == "cpu_share":
        d = _cm(c).decode_breakdown(c.batch, c.batch * c.context, c.tp)
        return d.get("engine_cpu", 0.0) / sum(d.values())
    if c.kind == "overlap_speedup":
        cm = _cm(c)
        on = cm.decode_step_s(c.batch, c.batch * c.context, c.tp)
        serial = dataclasses.replace(cm.engine.profile, overlap=False)
        off = CostModel(cm.model, cm.gpu, engine=dataclasses.replace(cm.engine, profile=serial))
        return off.decode_step_s(c.batch, c.batch * c.context, c.tp) / on
    if c.kind == "eager_ms":  # the same step launched kernel by kernel: its GPU side, less the graph's kernels
        cm = _cm(c)
        gpu = cm.kernel_decode_step_s(c.batch, c.batch * c.context, c.tp)
        return (max(gpu, cm.model.layers * cm.engine.profile.eager_layer_us * 1e-6) - gpu) * 1e3
    if c.kind == "rollout_s":
        return _rollpacker(os.path.join(ROOT, c.scenario))[c.layout][c.round]["time_s"]
    raise SpecError("kind", f"unknown case kind {c.kind!r}")


@functools.lru_cache(maxsize=8)
def _rollpacker(path: str) -> dict:
    """:func:`rollpacker_rounds` of the scenario at ``path`` (both layouts, once for every case that names it)."""
    from emulation.scenario import load_scenario

    return rollpacker_rounds(load_scenario(path))


# ---- RollPacker's rounds (tail batching) ------------------------------------------------------------
def rollpacker_rounds(scn, layouts=ROLLOUT_LAYOUTS, short_rounds: int = 4, eta: float = 1.25,
                      seed: int | None = None) -> dict:
    """RollPacker's rounds of ``scn``'s workload on one generator server, per layout (RollPacker section 3,
    tail batching): a short round launches ``eta`` x the prompts and ``eta`` x the samples and ends when
    prompts x samples responses have finished (the rest are cut, their prompts deferred); the long round runs
    1,024 of the deferred requests (the longest ``1 - 1/eta^2`` of each short round's draws) to completion.
    Every layout sees the same requests. Returns ``{layout: {"short": {time_s, preemptions}, "long": {...},
    "short_times_s": [...]}}``: the short round's figures are the mean over ``short_rounds``."""
    w = scn.workload
    settings = scn.orchestrator.engine
    gpus = scn.fabric.gpus_per_server
    rng = np.random.default_rng([scn.seed if seed is None else seed, 33])
    P, S = w.prompts_per_step, w.samples_per_prompt
    wide = dataclasses.replace(w, prompts_per_step=int(round(P * eta)), samples_per_prompt=int(round(S * eta)))
    accept = P * S
    shorts, pool = [], []
    for _ in range(short_rounds):
        lengths = wide.sample_lengths(rng)
        shorts.append(lengths)
        pool.append(np.sort(lengths)[accept:])  # what the round cuts: its longest
    pool = np.concatenate(pool)
    long = rng.choice(pool, size=accept, replace=len(pool) < accept)
    cost = ModelledCost(CostModel.for_engine(w.model, w.gpu, settings), gpus)
    out = {}
    for name in layouts:
        lay = Layout.parse(name, gpus)
        res = [_round(cost, gpus, lay, settings, w.prompt_tokens, ls, accept) for ls in shorts]
        out[name] = {"short": {"time_s": float(np.mean([r[0] for r in res])),
                               "preemptions": float(np.mean([r[1] for r in res]))},
                     "short_times_s": [round(r[0], 2) for r in res],
                     "long": dict(zip(("time_s", "preemptions"), _round(cost, gpus, lay, settings, w.prompt_tokens,
                                                                     long, len(long))))}
    return out


def _round(cost, gpus: int, lay: Layout, settings: EngineSettings, prompt: int, lengths: np.ndarray,
           accept: int) -> tuple[float, int]:
    """(time until ``accept`` responses finished, preemptions by then) of one round on one server."""
    def engine() -> Engine:
        e = Engine(cost, gpus, lay, settings)
        e.add([NewRequest(rid=i, prompt=prompt, target=int(t)) for i, t in enumerate(lengths)], 0.0, chunked=True)
        return e

    e = engine()
    e.run_until(math.inf)
    done = sorted(t for _, t in e.finished_log)
    t_round = done[accept - 1]
    if accept < len(lengths):  # again to the round's end: the preemptions made by then (a round that runs
        e = engine()           # every request to its end made them all by its last finish)
        e.run_until(t_round)
    return float(t_round), int(e.stats(t_round)["num_preemptions_total"])


# ---- every case ---------------------------------------------------------------------------------------
def run_cases(cases: CaseFile | str = CASES_FILE, only: tuple[str, ...] = ()) -> dict:
    """Every case's measured and model figure and error, every ratio, and whether the goals hold (``cases``:
    loaded already, or the file to load)."""
    cf = load_cases(cases) if isinstance(cases, str) else cases
    rows = {}
    for c in cf.cases:
        if only and c.id not in only and c.kind not in only:
            continue
        got = model_figure(c)
        rows[c.id] = {"id": c.id, "kind": c.kind, "role": c.role, "model": c.model, "gpu": c.gpu,
                      "profile": c.profile, "engine": c.engine, "tp": c.tp, "batch": c.batch,
                      "measured": c.measured, "model_figure": round(got, 4),
                      "error": round(got / c.measured - 1.0, 4), "source": c.source, "notes": c.notes}
    ratios = []
    for r in cf.ratios:
        if r.numerator in rows and r.denominator in rows:
            a, b = rows[r.numerator], rows[r.denominator]
            meas = a["measured"] / b["measured"]
            got = a["model_figure"] / b["model_figure"]
            ratios.append({"id": r.id, "numerator": r.numerator, "denominator": r.denominator,
                           "measured": round(meas, 4), "model_figure": round(got, 4),
                           "error": round(got / meas - 1.0, 4), "notes": r.notes})
    val = [x for x in rows.values() if x["role"] == "validate"]
    return {"cases": list(rows.values()), "ratios": ratios,
            "validated_within_15pct": sum(abs(x["error"]) <= CASE_TOLERANCE for x in val),
            "validated": len(val),
            "ratios_within_10pct": sum(abs(x["error"]) <= RATIO_TOLERANCE for x in ratios),
            "ratios_total": len(ratios)}


def markdown_table(doc: dict) -> str:
    """The docs table of :func:`run_cases`' document."""
    lines = ["| case | role | model, GPU, engine | TP | batch | measured | model | error | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in doc["cases"]:
        lines.append(f"| {x['id']} | {x['role']} | {x['model']}, {x['gpu']}, {x['engine'] or x['profile']} | "
                     f"{x['tp']} | {x['batch']} | {x['measured']:g} | {x['model_figure']:.4g} | "
                     f"{x['error']:+.1%} | {x['source']} |")
    lines += ["", "| ratio | measured | model | error |", "|---|---|---|---|"]
    for r in doc["ratios"]:
        lines.append(f"| {r['id']} ({r['numerator']} / {r['denominator']}) | {r['measured']:.3f} | "
                     f"{r['model_figure']:.3f} | {r['error']:+.1%} |")
    return "\n".join(lines)
