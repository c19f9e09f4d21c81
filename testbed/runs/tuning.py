"""The tuned static baseline: every layout *and* every ``max_num_seqs`` a user would try, on the simulated
backend (virtual time: seconds per configuration, as a user would profile before a run), the best of them
being the baseline every policy is compared against.

vLLM's ``max_num_seqs`` is per engine, i.e. per replica (REFERENCE.md "Engine settings users run"): at 64,
``TP8x1`` runs 64 of its server's 512 requests at a time while ``TP1x8`` runs all of them, so a comparison
at one fixed value handicaps the large-TP layouts. The grid is every feasible layout x :data:`GRID`
(64 .. 1024: vLLM's default 256 and veRL's rollout default 1024 among them).

Two things keep the grid cheap, neither an approximation:

* a run in which ``max_num_seqs`` never kept a waiting request out of a batch (``Engine.seq_bound``) is the
  run of every larger value too, step for step, as long as the larger value's KV cache (smaller: the engine
  reserves ``max_num_seqs`` sequences' logits, agents/costmodel.py) still holds the most the run ever held
  and the cache never kept a request out or preempted one (``Engine.kv_peak``, ``kv_bound``): those are
  reported with ``same_as`` and not run again;
* results are cached by the scenario's content (every field, a trace file's bytes), the grid, the steps
  and :data:`CACHE_VERSION` (bumped when the engine's or the phase model's numbers change), in
  ``$ORCHESTRRL_CACHE_DIR`` (default ``~/.cache/orchestrrl``)/tuning/.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from emulation.files import write_json_atomic

log = logging.getLogger(__name__)

GRID = (64, 128, 256, 512, 1024)  # max_num_seqs values tried for every layout
CACHE_VERSION = 2  # 2: engine profiles (CPU time per step, CUDA graphs, KV sizing by max_num_seqs)


@dataclass(frozen=True)
class GridPoint:
    """One static configuration of the tuning grid and its mean step makespan (simulated backend)."""

    layout: str
    max_num_seqs: int
    makespan_s: float  # mean step makespan
    step_makespan_s: tuple[float, ...]
    gen_s: tuple[float, ...]  # per step: the generation phase
    same_as: int | None = None  # not run: max_num_seqs never bound at this smaller value, so the run is that one's

    @property
    def name(self) -> str:
        return static_name(self.layout, self.max_num_seqs)

    def to_json(self) -> dict:
        return {"layout": self.layout, "max_num_seqs": self.max_num_seqs, "makespan_s": self.makespan_s,
                "step_makespan_s": list(self.step_makespan_s), "gen_s": list(self.gen_s), "same_as": self.same_as,
                "name": self.name}

    @classmethod
    def from_json(cls, d: dict) -> "GridPoint":
        return cls(d["layout"], int(d["max_num_seqs"]), float(d["makespan_s"]), tuple(d["step_makespan_s"]),
                   tuple(d["gen_s"]), d.get("same_as"))


def static_name(layout: str, max_num_seqs: int) -> str:
    """The policy name of a static configuration: ``static-TP8x1@1024`` (layout, then max_num_seqs)."""
    return f"static-{layout}@{max_num_seqs}"


def best(grid: list[GridPoint]) -> GridPoint:
    """The tuned static configuration: the smallest mean step makespan (ties: the smaller max_num_seqs, then
    the grid's layout order)."""
    if not grid:
        raise ValueError("an empty tuning grid has no best configuration")
    return min(grid, key=lambda p: (p.makespan_s, p.max_num_seqs))


def cache_key(scenario, steps: int, grid: tuple[int, ...]) -> str:
    doc = {"scenario": dataclasses.asdict(scenario), "steps": steps, "grid": list(grid), "version": CACHE_VERSION}
    trace = scenario.workload.trace
    if trace:
        doc["trace_sha256"] = hashlib.sha256(Path(trace).read_bytes()).hexdigest()
    text = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cached(kind: str, key: str, compute: Callable[[], dict], use_cache: bool = True) -> dict:
    """``compute()``'s JSON document, from ``cache_dir()/<kind>-<key>.json`` when it is there (``use_cache``)."""
    path = cache_dir() / f"{kind}-{key}.json"
    if use_cache and path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("ignoring an unreadable cache %s: %s", path, e)
    doc = compute()
    if use_cache:
        try:
            write_json_atomic(path, doc, indent=1, fsync=False, mkdir=True)
        except OSError as e:
            log.warning("could not write the cache %s: %s", path, e)
    return doc


def cache_dir() -> Path:
    return Path(os.environ.get("ORCHESTRRL_CACHE_DIR") or Path.home() / ".cache" / "orchestrrl") / "tuning"


@dataclass(frozen=True)
class Bounds:
    """What bound one run's engines (``Engine.seq_bound``, ``kv_bound``, ``kv_peak``): whether a run at a larger
    ``max_num_seqs`` is this one, step for step (:func:`tune`)."""

    seq_bound: bool
    kv_bound: bool = False
    kv_peak_blocks: int = 0

    def same_at(self, kv_blocks: int | None) -> bool:
        """Whether the run at a larger ``max_num_seqs`` whose replicas hold ``kv_blocks`` blocks (None: the same
        cache) schedules the same steps."""
        if self.seq_bound:
            return False
        return kv_blocks is None or (not self.kv_bound and self.kv_peak_blocks <= kv_blocks)


def tune(scenario, layouts: list, gpus: int, steps: int, run: Callable, grid: tuple[int, ...] = GRID,
         use_cache: bool = True, progress: Callable[[str], None] | None = None,
         kv_blocks: Callable | None = None, fits: Callable | None = None) -> list[GridPoint]:
    """The tuning grid of ``scenario``: every layout of ``layouts`` x every ``max_num_seqs`` of ``grid``.

    ``run(layout, max_num_seqs) -> (result, bounds)`` runs one static configuration for ``steps`` steps on
    the simulated backend (``result``: the driver's result dict; ``bounds``: a :class:`Bounds`, or a bool:
    whether max_num_seqs ever kept a waiting request out, see the module docstring); ``kv_blocks(layout,
    max_num_seqs)``: the KV blocks of one replica there (None: the cache does not depend on max_num_seqs).
    ``fits(layout, max_num_seqs)``: whether a replica there holds one request of the longest length; a
    configuration that does not is left out of the grid (the engine would refuse its requests), and so is every
    larger ``max_num_seqs`` of that layout (its activation workspace grows, its KV cache only shrinks)."""
    grid = tuple(sorted(set(int(x) for x in grid)))
    key = cache_key(scenario, steps, grid)
    path = cache_dir() / f"{key}.json"
    if use_cache and path.is_file():
        try:
            doc = json.loads(path.read_text())
            pts = [GridPoint.from_json(d) for d in doc["grid"]]
            log.info("tuning grid of %s from the cache %s", scenario.name, path)
            return pts
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring an unreadable tuning cache %s: %s", path, e)
    out: list[GridPoint] = []
    for lay in layouts:
        name = lay.name(gpus)
        prev: GridPoint | None = None
        prev_bounds = Bounds(True)
        for mns in grid:
            if fits is not None and not fits(lay, mns):
                log.info("tuning grid: %s left out from max_num_seqs %d: a replica's KV cache there does not hold "
                         "one request of the longest length", name, mns)
                break
            if prev is not None and prev_bounds.same_at(None if kv_blocks is None else kv_blocks(lay, mns)):
                out.append(GridPoint(name, mns, prev.makespan_s, prev.step_makespan_s, prev.gen_s,
                                     prev.same_as or prev.max_num_seqs))
                continue
            if progress:
                progress(static_name(name, mns))
            res, bound = run(lay, mns)
            ms = tuple(float(x) for x in res["step_makespan_s"])
            pt = GridPoint(name, mns, sum(ms) / len(ms), ms, tuple(float(p["gen_s"]) for p in res["phases"]))
            out.append(pt)
            prev, prev_bounds = pt, (bound if isinstance(bound, Bounds) else Bounds(bool(bound)))
    if use_cache:
        try:
            write_json_atomic(path, {"scenario": scenario.name, "steps": steps, "grid": [p.to_json() for p in out]},
                              indent=1, fsync=False, mkdir=True)
        except OSError as e:
            log.warning("could not write the tuning cache %s: %s", path, e)
    return out
