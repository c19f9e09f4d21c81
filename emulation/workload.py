"""WorkloadSpec: the RL post-training workload, shared by the emulator, the orchestrator and RLSim.

One spec drives every backend: which model (a key of ``emulation/data/models.yaml``), which GPU (a key of
``emulation/data/gpus.yaml``), how big a step is (prompts x samples), how long responses are, and how the
model is parallelised for rollout and for training. Defaults and their sources are in REFERENCE.md
(/work/shared/REFERENCE.md, "RL workloads"); each default below says where it comes from.

Response lengths are drawn from a lognormal (median, sigma) clipped to ``[1, max_response_tokens]``, with
an optional spike of ``cap_fraction`` of the responses exactly at the cap (truncated responses). The
lognormal is an *assumption*: REFERENCE.md reports a heavy right tail everywhere, not a demonstrated fit.

Over the steps of a run (:class:`LengthSchedule`, the one API the backends call), the lengths can drift
longer (``median_growth_per_step``: DAPO and R1 report mean lengths growing several-fold over training),
jitter from step to step (``step_sigma``), come from a mixture of lognormals (``mixture``: bimodal or
long-tail cases), or be replayed from a trace file (``trace``: CSV or JSONL with step, prompt id and
response length). :func:`step_stats` summarises one step for the forecaster (``testbed/orchestrator``).

This module is pure (numpy only) and validated at the boundary with :func:`emulation.validation.from_dict`.
The model and GPU catalogues (``emulation/data/models.yaml``, ``emulation/data/gpus.yaml``: every figure the
cost model uses, cited) live here, below everything that reads them: a workload names an entry of each
(:func:`model_names`, :func:`gpu_names`), so a typo in a scenario fails with the field name, and the cost
model (``agents.costmodel``) reads the same files.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from .validation import SpecError, require

CATALOGUE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # models, gpus, engines


@functools.lru_cache(maxsize=None)
def catalogue(filename: str) -> dict:
    """The raw entries of a catalogue file of :data:`CATALOGUE_DIR` (``models.yaml``, ``gpus.yaml``), by name."""
    return read_catalogue(os.path.join(CATALOGUE_DIR, filename), filename)


def read_catalogue(p: str, filename: str) -> dict:
    """The raw entries of the catalogue file at ``p`` (the format of ``filename``), by name."""
    import yaml

    try:
        with open(p, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise SpecError(filename, f"no such file: {p}") from None
    if not isinstance(raw, dict) or not raw:
        raise SpecError(filename, f"{p} must map names to entries")
    return {str(k): v for k, v in raw.items()}


def model_names() -> tuple[str, ...]:
    """The models a workload may name: the entries of ``emulation/data/models.yaml``."""
    return tuple(catalogue("models.yaml"))


def gpu_names() -> tuple[str, ...]:
    """The GPUs a workload may name: the entries of ``emulation/data/gpus.yaml``."""
    return tuple(catalogue("gpus.yaml"))


def engine_names() -> tuple[str, ...]:
    """The serving-engine profiles a scenario may name (``orchestrator.engine.profile``): the entries of
    ``emulation/data/engines.yaml`` (agents/engineprofile.py reads their figures)."""
    return tuple(catalogue("engines.yaml"))

# The field every trace error names (the trace is the workload's, inside a scenario file).
TRACE_FIELD = "workload.trace"
TRACE_COLUMNS = ("step", "prompt_id", "response_length")
MAX_MIXTURE_COMPONENTS = 16


@dataclass(frozen=True)
class LengthComponent:
    """One lognormal of a ``mixture``: a sample comes from it with probability weight / sum(weights)."""
    weight: float = 1.0
    median_tokens: float = 460.0
    sigma: float = 0.93

    def __post_init__(self) -> None:
        require(math.isfinite(self.weight) and self.weight > 0, "weight", f"must be > 0, got {self.weight}")
        require(math.isfinite(self.median_tokens) and self.median_tokens >= 1, "median_tokens",
                f"must be >= 1, got {self.median_tokens}")
        require(math.isfinite(self.sigma) and 0 <= self.sigma <= 5, "sigma", f"must be in [0, 5], got {self.sigma}")


# Responses one step may hold: every command draws a step's lengths as arrays (the engines, RLSim, the controller's
# traffic), 32 MiB of int64 at 4 M. Checked when the scenario loads, so no command starts on a step beyond it
# (a billion prompts died of a 60 GiB allocation inside `fabric up` and `controller`, leaving their folders).
MAX_SAMPLES_PER_STEP = 1 << 22


@dataclass(frozen=True)
class WorkloadSpec:
    # Model and GPU. Qwen2.5-7B: the smallest model of the RollPacker/veRL set-ups (REFERENCE.md "Batches").
    model: str = "Qwen2.5-7B"
    # H800: the GPU of DAPO, RollPacker and the OrchestrRL evaluation (REFERENCE.md "GPUs", "Batches").
    gpu: str = "H800"

    # Batch per RL step. 128 prompts x 8 samples: RollPacker (REFERENCE.md "Long tail").
    prompts_per_step: int = 128
    samples_per_prompt: int = 8
    # Prompt length in tokens: an assumption (REFERENCE.md gives no prompt-length figure; math/code
    # prompts are a few hundred tokens).
    prompt_tokens: int = 256

    # Response lengths. Median 460 tokens and log-sigma 0.93: the PolyTrace DAPO Qwen2.5-32B trace
    # (p50 439-486 per step, pooled log-sigma ~0.93; REFERENCE.md "RL workloads", derived figures).
    response_median_tokens: float = 460.0
    response_sigma: float = 0.93
    # Cap 16,384 tokens: RollPacker's and DeepCoder's 16k cap (DAPO uses 20,480).
    max_response_tokens: int = 16384
    # Fraction of responses truncated at the cap (a spike at max_response_tokens). 0 by default: PolyTrace
    # (20k cap) shows no spike; DeepCoder-14B with a 16k cap had 6-27% at the cap - set it for such runs.
    cap_fraction: float = 0.0

    # Rollout (generation) tensor parallelism: RollPacker uses TP 1/2/2 for 7B/14B/32B; DAPO/ORZ TP 4.
    rollout_tp: int = 1
    # Training parallelism. TP inside a server (NVLink), PP across servers, EP for MoE experts.
    # train_dp = 0: data parallelism fills the trainer GPUs (trainer GPUs / (tp * pp)).
    train_tp: int = 8
    train_pp: int = 1
    train_dp: int = 0
    train_ep: int = 1
    # Share of GPUs that generate, used when a backend re-sizes the cluster (RLSim --gpus); at the
    # scenario's own size the layout's pods decide. 0.5: veRL's rollout:train 16:16 .. 64:64.
    gen_fraction: float = 0.5

    # RL steps to run.
    steps: int = 1

    # ---- lengths over steps (see LengthSchedule) ----
    # Drift: the median at schedule step s (s = 0 is the first warm-up step, or the first run step when
    # warmup_steps is 0) is response_median_tokens * min(1 + median_growth_per_step * s, median_growth_max):
    # linear growth relative to step 0 with a ceiling (null: none but the cap). With sigma fixed the mean
    # grows by the same factor. R1-Zero (mean ~550 -> ~9.5k tokens over 8.4k steps, 17x): 0.00194 with
    # max 17.3; DAPO Qwen2.5-32B (~750 -> ~4.45k at ~4k steps, 5.9x): 0.00123 with max 5.9 (REFERENCE.md
    # "RL workloads"). An emulated run of a few dozen steps compresses training: DAPO's 4k steps in 20
    # steps is 0.25 per step with max 5.9. 0: today's stationary lengths.
    median_growth_per_step: float = 0.0
    median_growth_max: float | None = None
    # Step-to-step jitter: each step's median is multiplied by exp(N(0, step_sigma)) (drawn with the
    # step's generator before its lengths). 0: none beyond sampling noise (PolyTrace's p50 439-486 over
    # six steps of 768 responses is what sampling alone gives at sigma 0.93).
    step_sigma: float = 0.0
    # Mixture of lognormals; when given it replaces response_median_tokens/response_sigma (each sample
    # picks a component independently). E.g. a long tail: [{weight: 0.9, median_tokens: 400, sigma: 0.6},
    # {weight: 0.1, median_tokens: 6000, sigma: 0.5}]. Drift, the cap and the cap spike apply to it too.
    mixture: tuple[LengthComponent, ...] = ()
    # Trace file replayed step by step instead of sampling (CSV with a header or JSONL; columns/keys step,
    # prompt_id, response_length; a path relative to the scenario file's folder). See LengthSchedule.
    trace: str | None = None
    # Steps before the run whose statistics warm-start the forecaster (LengthSchedule.history): drawn
    # (or, for a trace, its first warmup_steps steps) but not run.
    warmup_steps: int = 0
    # Prompt difficulty: the log-lengths of one prompt's samples share an offset ~ N(0, prompt_sigma^2) (a
    # hard prompt gets long responses in all its samples), and the samples vary around it with
    # sqrt(response_sigma^2 - prompt_sigma^2), so the pooled log-sigma stays response_sigma. An assumption:
    # REFERENCE.md gives no within/between-prompt split; GRPO's groups of samples per prompt and veRL's
    # dispatch of whole groups to a worker are what make one rollout worker take 73 s and another 167 s on
    # the same step (veRL issue #658, REFERENCE.md). 0: samples independent of their prompt. With a
    # mixture, the offset is added to every component.
    prompt_sigma: float = 0.0

    def __post_init__(self) -> None:
        models, gpus = model_names(), gpu_names()
        require(self.model in models, "model", f"must be one of {', '.join(models)}, got {self.model!r}")
        require(self.gpu in gpus, "gpu", f"must be one of {', '.join(gpus)}, got {self.gpu!r}")
        for name in ("prompts_per_step", "samples_per_prompt", "prompt_tokens", "max_response_tokens",
                     "rollout_tp", "train_tp", "train_pp", "train_ep", "steps"):
            v = getattr(self, name)
            require(v >= 1, name, f"must be >= 1, got {v}")
        n = self.prompts_per_step * self.samples_per_prompt
        if n > MAX_SAMPLES_PER_STEP:
            big = max(("prompts_per_step", "samples_per_prompt"), key=lambda k: getattr(self, k))
            raise SpecError(big, f"prompts_per_step x samples_per_prompt = {n} responses per step; a step's "
                                 f"lengths are drawn as arrays of at most {MAX_SAMPLES_PER_STEP}")
        require(self.train_dp >= 0, "train_dp", f"must be >= 0 (0: fill the trainer GPUs), got {self.train_dp}")
        require(math.isfinite(self.response_median_tokens) and self.response_median_tokens >= 1,
                "response_median_tokens", f"must be >= 1, got {self.response_median_tokens}")
        # (a trace replaces the lognormal: its median is unused then)
        require(self.trace is not None or self.response_median_tokens <= self.max_response_tokens,
                "response_median_tokens",
                f"must be <= max_response_tokens ({self.max_response_tokens}), got {self.response_median_tokens}")
        require(math.isfinite(self.response_sigma) and 0 <= self.response_sigma <= 5, "response_sigma",
                f"must be in [0, 5], got {self.response_sigma}")
        require(0 <= self.cap_fraction <= 1, "cap_fraction", f"must be in [0, 1], got {self.cap_fraction}")
        require(0 < self.gen_fraction < 1, "gen_fraction", f"must be in (0, 1), got {self.gen_fraction}")
        for name in ("rollout_tp", "train_tp"):
            v = getattr(self, name)
            require(v & (v - 1) == 0, name, f"must be a power of two, got {v}")
        require(math.isfinite(self.median_growth_per_step) and self.median_growth_per_step >= 0,
                "median_growth_per_step", f"must be >= 0, got {self.median_growth_per_step}")
        if self.median_growth_max is not None:
            require(math.isfinite(self.median_growth_max) and self.median_growth_max >= 1, "median_growth_max",
                    f"must be >= 1 (a factor on the step-0 median), got {self.median_growth_max}")
        require(math.isfinite(self.step_sigma) and 0 <= self.step_sigma <= 2, "step_sigma",
                f"must be in [0, 2], got {self.step_sigma}")
        require(len(self.mixture) <= MAX_MIXTURE_COMPONENTS, "mixture",
                f"must have at most {MAX_MIXTURE_COMPONENTS} components, got {len(self.mixture)}")
        for i, c in enumerate(self.mixture):
            require(isinstance(c, LengthComponent), f"mixture[{i}]",
                    f"must be a LengthComponent, got {type(c).__name__}")
            require(c.median_tokens <= self.max_response_tokens, f"mixture[{i}].median_tokens",
                    f"must be <= max_response_tokens ({self.max_response_tokens}), got {c.median_tokens}")
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require(math.isfinite(self.prompt_sigma) and 0 <= self.prompt_sigma <= 5, "prompt_sigma",
                f"must be in [0, 5], got {self.prompt_sigma}")
        require(self.mixture or self.prompt_sigma <= self.response_sigma, "prompt_sigma",
                f"must be <= response_sigma ({self.response_sigma}): it is the prompts' share of it, got "
                f"{self.prompt_sigma}")
        if self.trace is not None:
            require(bool(self.trace.strip()), "trace", "must be a file path, got an empty string")
            for name, off in (("median_growth_per_step", 0.0), ("step_sigma", 0.0)):
                require(getattr(self, name) == off, name, f"must be {off} with a trace (a trace is replayed "
                        f"as recorded), got {getattr(self, name)}")
            require(not self.mixture, "mixture", "must be empty with a trace (a trace is replayed as recorded)")

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def sample_lengths(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray:
        """``n`` response lengths (int64 tokens, default one step's samples) drawn with ``rng``.

        Lognormal(log(median), sigma) (or the ``mixture``), rounded, clipped to [1, max_response_tokens];
        then each response independently hits the cap with probability ``cap_fraction``. No drift: this is
        the distribution at step 0 (:class:`LengthSchedule` gives the lengths of any step, trace included).
        """
        if n is None:
            n = self.samples_per_step
        _check_rng(rng)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        if self.trace is not None:
            raise ValueError("a trace workload is replayed, not sampled: use LengthSchedule(workload)")
        return self._draw(rng, int(n), 1.0)

    def median_factor(self, schedule_step: int) -> float:
        """The drift factor on every median at schedule step ``schedule_step`` (0: no drift yet)."""
        f = 1.0 + self.median_growth_per_step * schedule_step
        return f if self.median_growth_max is None else min(f, self.median_growth_max)

    def _draw(self, rng: np.random.Generator, n: int, factor: float) -> np.ndarray:
        if self.mixture:
            w = np.array([c.weight for c in self.mixture])
            comp = rng.choice(len(w), size=n, p=w / w.sum())
            mu = np.log(np.array([c.median_tokens for c in self.mixture]) * factor)[comp]
            sig = np.array([c.sigma for c in self.mixture])[comp]
            raw = np.exp(mu + sig * rng.standard_normal(n))
        else:
            within = math.sqrt(max(self.response_sigma ** 2 - self.prompt_sigma ** 2, 0.0))
            raw = rng.lognormal(mean=math.log(self.response_median_tokens * factor), sigma=within, size=n)
        if self.prompt_sigma > 0:  # drawn after the samples: prompt_sigma 0 keeps the old stream exactly
            S = self.samples_per_prompt
            offsets = rng.normal(0.0, self.prompt_sigma, size=-(-n // S))
            raw = raw * np.exp(np.repeat(offsets, S)[:n])
        lengths = np.clip(np.rint(raw), 1, self.max_response_tokens).astype(np.int64)
        if self.cap_fraction > 0:
            lengths[rng.random(n) < self.cap_fraction] = self.max_response_tokens
        return lengths


def _check_rng(rng: object) -> None:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")


# ---- one step's statistics (the forecaster's input) ------------------------------------------------
# Probability levels of StepStats.log_quantiles: every percent, plus points in both tails. A sketch of the
# step's shape (101 numbers), enough for the forecaster to carry a non-lognormal shape from step to step.
LOG_QUANTILE_LEVELS = (0.005,) + tuple(k / 100 for k in range(1, 100)) + (0.995, 0.999)


@dataclass(frozen=True)
class StepStats:
    """Summary of one step's response lengths (tokens, as generated: capped).

    ``log_mean`` / ``log_std`` are the mean and (population) standard deviation of log(length): the
    lognormal's maximum-likelihood parameters, the series the forecaster extrapolates. ``log_quantiles``
    are the quantiles of log(length) at :data:`LOG_QUANTILE_LEVELS` (empty: not recorded).
    """
    step: int
    n: int
    mean: float
    log_mean: float
    log_std: float
    p50: float
    p90: float
    p99: float
    max: int
    cap: int
    cap_fraction: float  # share of the step's responses at the cap
    log_quantiles: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        require(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        require(self.cap >= 1, "cap", f"must be >= 1, got {self.cap}")
        for name in ("mean", "log_mean", "log_std", "p50", "p90", "p99"):
            v = getattr(self, name)
            require(math.isfinite(v), name, f"must be finite, got {v}")
        require(self.mean >= 1, "mean", f"must be >= 1, got {self.mean}")
        require(self.log_std >= 0, "log_std", f"must be >= 0, got {self.log_std}")
        require(0 <= self.cap_fraction <= 1, "cap_fraction", f"must be in [0, 1], got {self.cap_fraction}")
        q = self.log_quantiles
        if q:
            require(len(q) == len(LOG_QUANTILE_LEVELS), "log_quantiles",
                    f"must have {len(LOG_QUANTILE_LEVELS)} values (one per LOG_QUANTILE_LEVELS), got {len(q)}")
            require(all(math.isfinite(v) for v in q) and all(b >= a for a, b in zip(q, q[1:])), "log_quantiles",
                    "must be finite and non-decreasing")


def step_stats(lengths: np.ndarray, step: int, cap: int) -> StepStats:
    """The :class:`StepStats` of one step's response lengths (every length in [1, cap])."""
    x = np.asarray(lengths)
    if x.ndim != 1 or len(x) == 0 or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"lengths must be a non-empty 1-d integer array, got shape {x.shape} {x.dtype}")
    lo, hi = int(x.min()), int(x.max())
    if lo < 1 or hi > cap:
        raise ValueError(f"lengths must be in [1, cap={cap}], got [{lo}, {hi}]")
    lx = np.log(x)
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    lq = np.maximum.accumulate(np.percentile(lx, [100 * p for p in LOG_QUANTILE_LEVELS]))  # rounding-safe
    return StepStats(step=int(step), n=len(x), mean=float(x.mean()), log_mean=float(lx.mean()),
                     log_std=float(lx.std()), p50=float(p50), p90=float(p90), p99=float(p99), max=hi,
                     cap=int(cap), cap_fraction=float(np.mean(x >= cap)), log_quantiles=tuple(lq.tolist()))


# ---- trace files -------------------------------------------------------------------------------------
# A parsed trace: per distinct step (increasing), the step number and its prompts in order of first
# appearance, each (prompt_id, ((response_length, line), ...)) in file order.
_Prompt = tuple[int, tuple[tuple[int, int], ...]]
_Trace = tuple[tuple[int, tuple[_Prompt, ...]], ...]


def _trace_int(value: object, name: str, line: int, minimum: int, text: bool) -> int:
    """A trace cell as an int >= minimum (``text``: a CSV cell of digits; else a JSON integer), else a SpecError."""
    v: object = value
    if text and isinstance(value, str):
        t = value.strip()
        v = int(t) if t.lstrip("+-").isdigit() and t.isascii() else None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise SpecError(TRACE_FIELD, f"line {line}: {name} must be an integer >= {minimum}, got {value!r}")
    return v


def _trace_rows(path: str, text: str):
    """(line, step, prompt_id, response_length) of every data row of a CSV or JSONL trace."""
    kind = os.path.splitext(path)[1].lower()
    if kind not in (".csv", ".jsonl", ".ndjson"):
        raise SpecError(TRACE_FIELD, f"must be a .csv or .jsonl file, got {os.path.basename(path)!r}")
    header = None
    for line, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        if kind == ".csv":
            cells = [c.strip() for c in s.split(",")]
            if header is None:
                missing = [c for c in TRACE_COLUMNS if c not in cells]
                if missing or len(set(cells)) != len(cells):
                    raise SpecError(TRACE_FIELD, f"line {line}: the header must name each of the columns "
                                                 f"{', '.join(TRACE_COLUMNS)} once, got {s!r}")
                header = {c: cells.index(c) for c in TRACE_COLUMNS}
                width = len(cells)
                continue
            if len(cells) != width:
                raise SpecError(TRACE_FIELD, f"line {line}: expected {width} comma-separated fields, got {len(cells)}")
            row = {c: cells[i] for c, i in header.items()}
        else:
            try:
                row = json.loads(s)
            except json.JSONDecodeError as e:
                raise SpecError(TRACE_FIELD, f"line {line}: not valid JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise SpecError(TRACE_FIELD, f"line {line}: must be a JSON object, got {type(row).__name__}")
            for c in TRACE_COLUMNS:
                if c not in row:
                    raise SpecError(TRACE_FIELD, f"line {line}: missing key {c!r}")
        text = kind == ".csv"
        yield (line, _trace_int(row["step"], "step", line, 0, text),
               _trace_int(row["prompt_id"], "prompt_id", line, 0, text),
               _trace_int(row["response_length"], "response_length", line, 1, text))


@functools.lru_cache(maxsize=8)
def _parse_trace(path: str, mtime_ns: int, size: int) -> _Trace:
    # mtime_ns and size key the cache: an edited file is parsed again.
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(TRACE_FIELD, f"cannot read {path}: {e}") from None
    steps: dict[int, dict[int, list[tuple[int, int]]]] = {}
    for line, step, pid, length in _trace_rows(path, text):
        steps.setdefault(step, {}).setdefault(pid, []).append((length, line))
    if not steps:
        raise SpecError(TRACE_FIELD, f"{path} has no data rows")
    return tuple((k, tuple((pid, tuple(v)) for pid, v in steps[k].items())) for k in sorted(steps))


def load_trace(path: str | os.PathLike) -> _Trace:
    """Parse (and cache) the trace file at ``path``; every error is a SpecError naming ``workload.trace``."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise SpecError(TRACE_FIELD, f"no such file: {p}") from None
    except OSError as e:
        raise SpecError(TRACE_FIELD, f"cannot read {p}: {e}") from None
    if not os.path.isfile(p):
        raise SpecError(TRACE_FIELD, f"not a file: {p}")
    return _parse_trace(p, st.st_mtime_ns, st.st_size)


# ---- the lengths of every step of a run ----------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class LengthSchedule:
    """Response lengths step by step: the one API the backends (and the forecaster's history) use.

    Steps are the run's: ``0 .. workload.steps - 1``; the ``warmup_steps`` steps before it are
    ``-warmup_steps .. -1`` (:meth:`history`). A step's samples are grouped by prompt: prompt ``i``'s
    ``samples_per_prompt`` samples are contiguous, at ``[i * samples_per_prompt, (i + 1) * samples_per_prompt)``.

    Sampled workloads draw a step's lengths from the ``rng`` passed in (the caller's one seeded
    generator: same seed and same calls, same run). A trace is replayed: run step ``k`` is the trace's
    ``(warmup_steps + k)``-th distinct step number (increasing; gaps in the numbering are allowed), its first
    ``prompts_per_step`` prompts in order of first appearance and their first ``samples_per_prompt``
    responses in file order; extra prompts, samples, steps and columns are ignored, too few is an error.
    A replay draws nothing from ``rng``. A relative trace path is relative to ``base_dir`` (default: the
    working directory; :func:`emulation.scenario.load_scenario` makes it absolute against the scenario's folder).
    """
    workload: WorkloadSpec
    base_dir: str | None = None
    _replay: tuple = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        w = self.workload
        if w.trace is None:
            return
        path = os.path.join(self.base_dir or os.getcwd(), os.path.expanduser(w.trace))
        trace = load_trace(path)
        need = w.warmup_steps + w.steps
        if len(trace) < need:
            raise SpecError(TRACE_FIELD, f"has {len(trace)} steps; the run needs warmup_steps + steps = "
                                         f"{w.warmup_steps} + {w.steps} = {need}")
        P, S, cap = w.prompts_per_step, w.samples_per_prompt, w.max_response_tokens
        replay = []
        for number, prompts in trace[:need]:
            if len(prompts) < P:
                raise SpecError(TRACE_FIELD, f"step {number} has {len(prompts)} prompts; the workload needs "
                                             f"prompts_per_step = {P}")
            lengths = np.empty(P * S, dtype=np.int64)
            for i, (pid, samples) in enumerate(prompts[:P]):
                if len(samples) < S:
                    raise SpecError(TRACE_FIELD, f"step {number} prompt {pid} has {len(samples)} responses; the "
                                                 f"workload needs samples_per_prompt = {S}")
                for j, (length, line) in enumerate(samples[:S]):
                    if length > cap:
                        raise SpecError(TRACE_FIELD, f"line {line}: response_length {length} exceeds "
                                                     f"max_response_tokens ({cap})")
                    lengths[i * S + j] = length
            ids = np.repeat(np.array([pid for pid, _ in prompts[:P]], dtype=np.int64), S)
            lengths.setflags(write=False)
            ids.setflags(write=False)
            replay.append((number, lengths, ids))
        object.__setattr__(self, "_replay", tuple(replay))

    @property
    def steps(self) -> int:
        return self.workload.steps

    @property
    def warmup_steps(self) -> int:
        return self.workload.warmup_steps

    @property
    def samples_per_step(self) -> int:
        return self.workload.samples_per_step

    @property
    def cap(self) -> int:
        return self.workload.max_response_tokens

    @property
    def is_trace(self) -> bool:
        return self.workload.trace is not None

    def _index(self, step: int) -> int:
        """Schedule index of run step ``step`` (0 = the first warm-up step)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"step must be an integer, got {type(step).__name__}")
        hi = self.steps if self.is_trace else None
        if step < -self.warmup_steps or (hi is not None and step >= hi):
            raise ValueError(f"step must be in [{-self.warmup_steps}, {hi if hi is not None else 'inf'}), got {step}")
        return int(step) + self.warmup_steps

    def lengths_for_step(self, step: int, rng: np.random.Generator) -> np.ndarray:
        """Step ``step``'s response lengths: int64 tokens, one per sample, grouped by prompt."""
        s = self._index(step)
        _check_rng(rng)
        if self.is_trace:
            return self._replay[s][1].copy()
        w = self.workload
        factor = w.median_factor(s)
        if w.step_sigma > 0:
            factor *= math.exp(rng.normal(0.0, w.step_sigma))
        return w._draw(rng, w.samples_per_step, factor)

    def prompt_ids_for_step(self, step: int) -> np.ndarray:
        """The prompt id of every sample of step ``step`` (same order as :meth:`lengths_for_step`).

        A trace's own ids; sampled workloads number prompts across the schedule (unique over the run).
        """
        s = self._index(step)
        if self.is_trace:
            return self._replay[s][2].copy()
        P, S = self.workload.prompts_per_step, self.workload.samples_per_prompt
        return np.repeat(np.arange(s * P, (s + 1) * P, dtype=np.int64), S)

    def trace_step_number(self, step: int) -> int | None:
        """The step number in the trace file that run step ``step`` replays (None: not a trace)."""
        s = self._index(step)
        return self._replay[s][0] if self.is_trace else None

    def history(self, rng: np.random.Generator) -> list[StepStats]:
        """The warm-up steps' statistics (steps -warmup_steps .. -1), drawn with ``rng`` (a trace: replayed)."""
        return [step_stats(self.lengths_for_step(k, rng), k, self.cap) for k in range(-self.warmup_steps, 0)]


def resolve_trace(workload: WorkloadSpec, base_dir: str | os.PathLike) -> WorkloadSpec:
    """``workload`` with its trace path made absolute against ``base_dir`` and the trace checked against it.

    Unchanged without a trace. Raises SpecError naming ``workload.trace`` (missing file, bad line, too few
    steps, prompts or samples for the workload).
    """
    if workload.trace is None:
        return workload
    path = os.path.abspath(os.path.join(os.fspath(base_dir), os.path.expanduser(workload.trace)))
    resolved = dataclasses.replace(workload, trace=path)
    LengthSchedule(resolved)
    return resolved
