"""Response-length forecasts for the proactive planner: across steps (ARIMA) and within a step.

**Across steps.** Each finished step is summarised by :class:`emulation.workload.StepStats`. The forecaster
extrapolates two of its statistics, the log-mean ``mu`` and the log-std ``sigma`` of the step's response
lengths, each with its own ARIMA (``statsmodels.tsa.arima.model.ARIMA``; order and trend from
:class:`ForecastSettings`) fitted on the last ``history_steps`` steps, and carries the *shape* of the
recent steps over: their log-quantiles at 101 levels, standardised by their own (mu, sigma) and averaged
(``shape="empirical"``; ``"lognormal"`` assumes a lognormal). The next step's lengths are then
``min(L, cap)`` with ``log L = mu + sigma Z``, Z of that shape (:class:`_Shape`: a piecewise-affine map of a
normal score through the quantile knots, normal tails; a lognormal's own knots give it exactly) and ``cap``
the workload's ``max_response_tokens``. Why location and scale of log L: the log makes a multiplicative drift
additive, two series keep the fits cheap, and the shape need not be lognormal (REFERENCE.md: a heavy right
tail, a lognormal assumed, a poor fit to PolyTrace's upper quantiles; a mixture is bimodal).

With fewer than ``min_arima_steps`` steps of history (default 8: ARIMA(1,1,1) has three parameters with
its variance, and 7 differences give them ~2 points each; with a drift term, four) the forecast falls back to
``fallback``: ``drift`` (random walk with drift: the last value plus the mean step-to-step change; needs 3
steps) or ``last`` (the last step's value, which is also what 1-2 steps of history give). An ARIMA fit that
fails, or whose forecast moves further from the last value than the whole window ranged (a sanity guard,
at least 0.05 in log), also falls back; the forecast says which method made it and why.

**Within a step.** :meth:`LengthForecast.remaining` gives the expected remaining length of a request still
running after ``g`` generated tokens, ``E[min(L, cap) - g | L > g]``, and
:meth:`LengthForecast.remaining_quantile` a quantile of it, in closed form (scipy's ``log_ndtr`` keeps far
tails exact), vectorised over requests. :meth:`LengthForecast.updated` re-estimates (mu, sigma), keeping the
shape, from the step's own observations: completed responses (exact lengths; at the cap: censored) and
running ones (censored at their ``g``), by EM for right-censored data on the log scale with the step's
forecast as a prior worth ``(sigma / mu_se)^2`` pseudo-samples (``mu_se``: the forecast's standard error of mu).

**Error.** :class:`ForecastErrors` records, per step, the absolute percentage error of the forecast's mean
response length ``E[min(L, cap)]`` against the realised mean length of that step (``StepStats.mean``), and
the MAPE over the steps recorded.

**Off the decision path.** statsmodels imports in ~1.5 s and an ARIMA fit takes tens of ms, seconds on a busy
machine when OpenBLAS runs its default threads (PLATFORM.md; testbed/benchmarks/bench_forecast.py):
testbed.forecast_service.ForecastService runs :func:`forecast_next` in one background thread while the
planner reads the newest finished forecast and never waits. This module starts no thread.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy.special import log_ndtr, ndtr, ndtri_exp

from emulation.orchestration import ForecastSettings
from emulation.validation import require
from emulation.workload import LOG_QUANTILE_LEVELS, LengthComponent, StepStats, WorkloadSpec
from testbed.orchestrator import schedule_kernel

log = logging.getLogger(__name__)

# Sanity guard: an ARIMA forecast may move at most max(window range, this) in log from the last value.
GUARD_MIN_LOG = 0.05
# Pseudo-sample weight of the prior in the online update is clipped to this range.
PRIOR_WEIGHT_RANGE = (0.0, 1.0e6)


# ---- the laws a forecast can have -------------------------------------------------------------------------
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _mills(a: np.ndarray) -> np.ndarray:
    """phi(a) / (1 - Phi(a)), stable far in both tails."""
    return np.exp(-0.5 * a * a - _LOG_SQRT_2PI - log_ndtr(-a))


class _Lognormal:
    """min(L, cap) with log L ~ N(mu, sigma^2): every quantity in closed form (log_ndtr keeps tails exact)."""

    def __init__(self, mu: float, sigma: float, cap: int):
        self.mu, self.sigma, self.cap = mu, sigma, cap
        zc = (math.log(cap) - mu) / sigma
        self._m = mu + sigma * sigma / 2
        # E[(L - cap)+] = e^m Phi(sigma - zc) - cap Phi(-zc): the mean the cap cuts off, >= 0
        excess = math.exp(self._m + log_ndtr(sigma - zc)) - cap * math.exp(log_ndtr(-zc))
        self._log_excess = math.log(excess) if excess > 0 else -math.inf

    def survival(self, g: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.exp(log_ndtr(-(np.log(g) - self.mu) / self.sigma))

    def remaining(self, g: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            z = (np.log(g) - self.mu) / self.sigma
        ls = log_ndtr(-z)  # log P(L > g)
        # E[min(L, cap) | L > g] = (e^m Phi(sigma - z) - E[(L - cap)+]) / P(L > g)
        e = np.exp(self._m + log_ndtr(self.sigma - z) - ls) - np.exp(self._log_excess - ls)
        return np.clip(e - g, 0.0, np.maximum(self.cap - g, 0.0))

    def remaining_quantile(self, g: np.ndarray, q: float) -> np.ndarray:
        with np.errstate(divide="ignore"):
            z = (np.log(g) - self.mu) / self.sigma
        # P(L > x) = (1 - q) P(L > g)  ->  z_x = -ndtri_exp(log(1 - q) + log P(L > g))
        zx = -ndtri_exp(np.log1p(-q) + log_ndtr(-z))
        return np.clip(np.minimum(np.exp(self.mu + self.sigma * zx), self.cap) - g, 0.0, None)

    @staticmethod
    def z_moments_above(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """E[Z | Z > a], E[Z^2 | Z > a] for a standard normal Z."""
        lam = _mills(a)
        return lam, 1.0 + a * lam


def _phi(w: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * w * w - _LOG_SQRT_2PI)


def _mass(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Phi(hi) - Phi(lo) for lo <= hi, accurate in both tails (upper-tail pieces as Phi(-lo) - Phi(-hi))."""
    flip = lo > 0
    return ndtr(np.where(flip, -lo, hi)) - ndtr(np.where(flip, -hi, lo))


class _Shape:
    """A standardised law of Z = (log L - mu) / sigma (mean 0, sd 1) from quantile knots.

    Z is a non-decreasing piecewise-affine function of a standard normal score W: through the knots
    ``(Phi^-1(level), z)``, and beyond the lowest and the top knot straight lines whose slopes are the
    knots' spread (lowest to the 0.1 level, 0.9 level to the top) against a normal's, in [0.25, 4]. A
    lognormal's own knots give Z = W exactly; flat stretches (ties, a spike at the cap) are point masses.
    The knots are shifted and scaled so the law has mean 0 and sd 1.
    """

    def __init__(self, levels: Sequence[float], z: Sequence[float]):
        p = np.asarray(levels, dtype=np.float64)
        zz = np.maximum.accumulate(np.asarray(z, dtype=np.float64))
        w = -ndtri_exp(np.log1p(-p))  # the levels' normal scores
        self.w = w
        lo1, hi9 = int(np.argmin(np.abs(p - 0.1))), int(np.argmin(np.abs(p - 0.9)))
        self._slopes = tuple(float(np.clip(s, 0.25, 4.0)) if math.isfinite(s) else 1.0 for s in
                             ((zz[lo1] - zz[0]) / (w[lo1] - w[0]), (zz[-1] - zz[hi9]) / (w[-1] - w[hi9])))
        self._set(zz, 1.0)
        s, m1, m2 = self.moments_above(np.array([-np.inf]))
        sd = math.sqrt(max(float(m2[0] - m1[0] ** 2), 1e-12))
        self._set((zz - float(m1[0])) / sd, sd)

    def _set(self, z: np.ndarray, scale: float) -> None:
        """Pieces k = 0..K on W in [lo_k, hi_k]: Z = alpha_k + beta_k W (0: below the lowest knot, K: above the top)."""
        w = self.w
        self.z = z
        slope_lo, slope_hi = (s / scale for s in self._slopes)
        with np.errstate(invalid="ignore", divide="ignore"):
            seg = np.diff(z) / np.diff(w)
        self.beta = np.concatenate([[slope_lo], seg, [slope_hi]])
        knots_z = np.concatenate([[z[0]], z[:-1], [z[-1]]])
        knots_w = np.concatenate([[w[0]], w[:-1], [w[-1]]])
        self.alpha = knots_z - self.beta * knots_w
        self.lo = np.concatenate([[-np.inf], w])
        self.hi = np.concatenate([w, [np.inf]])
        # each piece's upper end's terms in _piece_moments, for _moments_at to gather (the same numbers)
        ph = _phi(self.hi)
        with np.errstate(invalid="ignore"):
            self._hi_terms = (ndtr(self.hi), ndtr(-self.hi), ph, np.where(np.isfinite(self.hi), self.hi * ph, 0.0))
        full = self._piece_moments(self.lo, self.hi, self.alpha, self.beta)
        self._suffix = np.concatenate([np.cumsum(full[:, ::-1], axis=1)[:, ::-1], np.zeros((3, 1))], axis=1)

    @staticmethod
    def _piece_moments(lo, hi, alpha, beta) -> np.ndarray:
        """P(W in piece), E[Z 1{.}], E[Z^2 1{.}] for Z = alpha + beta W over W in [lo, hi]."""
        m0 = _mass(lo, hi)
        pl, ph = _phi(lo), _phi(hi)
        m1 = pl - ph
        with np.errstate(invalid="ignore"):
            m2 = m0 + np.where(np.isfinite(lo), lo * pl, 0.0) - np.where(np.isfinite(hi), hi * ph, 0.0)
        return np.stack([m0, alpha * m0 + beta * m1, alpha * alpha * m0 + 2 * alpha * beta * m1 + beta * beta * m2])

    def locate(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For thresholds ``a`` on Z: the piece holding them and the normal score w_a with P(Z > a) = Phi(-w_a)."""
        k = np.searchsorted(self.z, a, side="right")  # pieces 0..K; a sloped piece (a flat one holds no a)
        with np.errstate(invalid="ignore", divide="ignore"):
            wa = (a - self.alpha[k]) / self.beta[k]
        return k, np.clip(wa, self.lo[k], self.hi[k])

    def moments_above(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """P(Z > a), E[Z 1{Z > a}], E[Z^2 1{Z > a}] for each threshold in ``a``."""
        return self._moments_at(*self.locate(np.asarray(a, dtype=np.float64)))

    def _moments_at(self, k: np.ndarray, wa: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`moments_above` of thresholds already located (:meth:`locate`: their pieces and scores):
        :meth:`_piece_moments` from ``wa`` to the piece's upper end, with the upper end's terms gathered from
        the piece (its ndtr, phi and hi x phi) and both ndtr of the mass in one call (the online update's EM
        asks this of every censoring point at every iteration): the same operations on the same values."""
        al, be = self.alpha[k], self.beta[k]
        nd_hi, nd_neg_hi, ph, hi_ph = (t[k] for t in self._hi_terms)
        flip = wa > 0  # _mass: an upper-tail piece as Phi(-lo) - Phi(-hi)
        e = ndtr(np.where(flip, -wa, wa))
        m0 = np.where(flip, e - nd_neg_hi, nd_hi - e)
        pl = _phi(wa)
        m1 = pl - ph
        with np.errstate(invalid="ignore"):
            m2 = m0 + np.where(np.isfinite(wa), wa * pl, 0.0) - hi_ph
        part = np.stack([m0, al * m0 + be * m1, al * al * m0 + 2 * al * be * m1 + be * be * m2])
        out = part + np.take(self._suffix, k + 1, axis=1)
        return out[0], out[1], out[2]

    def z_moments_above(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """E[Z | Z > a], E[Z^2 | Z > a] (the top piece by the truncated normal's own ratios, exact far out)."""
        k, wa = self.locate(np.asarray(a, dtype=np.float64))  # once: the online update's EM asks every iteration
        s, m1, m2 = self._moments_at(k, wa)
        s = np.maximum(s, 1e-300)
        e1, e2 = m1 / s, m2 / s
        top = k == len(self.z)
        if top.any():
            al, be, lam = self.alpha[-1], self.beta[-1], _mills(wa[top])
            e1[top] = al + be * lam
            e2[top] = al * al + 2 * al * be * lam + be * be * (1 + wa[top] * lam)
        return e1, e2


_SHAPES: dict[bytes, _Shape] = {}  # _shape_of's: the shape's float64 bytes -> its _Shape


def _shape_of(shape: tuple[float, ...]) -> _Shape:
    """The :class:`_Shape` of the standardised log-quantiles ``shape`` at LOG_QUANTILE_LEVELS, made once per
    shape (~0.3 ms on 2 cores: every online update of a step's forecast keeps its shape and would rebuild it
    at every planning tick). Keyed by the values' bytes (0.0 and -0.0 apart); a _Shape is never changed once
    made, so forecasts share it."""
    key = np.asarray(shape, dtype=np.float64).tobytes()
    law = _SHAPES.get(key)
    if law is None:
        if len(_SHAPES) >= 64:
            _SHAPES.clear()
        law = _SHAPES[key] = _Shape(LOG_QUANTILE_LEVELS, shape)
    return law


class _Shaped:
    """min(L, cap) with log L = mu + sigma Z, Z of a :class:`_Shape`: log L = A_k + B_k W on each piece.

    The top piece is exactly a lognormal's tail, so requests beyond the top knot use :class:`_Lognormal`'s
    closed forms (exact far out); the rest sums closed-form piece integrals.
    """

    def __init__(self, mu: float, sigma: float, cap: int, shape: _Shape):
        self.mu, self.sigma, self.cap, self.shape = mu, sigma, cap, shape
        self.A, self.B = mu + sigma * shape.alpha, sigma * shape.beta
        self.q_top = mu + sigma * float(shape.z[-1])
        self.tail = _Lognormal(float(self.A[-1]), float(self.B[-1]), cap)
        self.log_cap = math.log(cap)
        full = self._capped_exp(shape.lo, shape.hi, self.A, self.B)
        self._suffix = np.concatenate([np.cumsum(full[::-1])[::-1], [0.0]])

    def _capped_exp(self, lo, hi, A, B) -> np.ndarray:
        """E[min(e^{A + B W}, cap) 1{W in [lo, hi]}] per piece."""
        with np.errstate(invalid="ignore", divide="ignore"):
            wc = np.where(B > 0, (self.log_cap - A) / B, np.where(A < self.log_cap, np.inf, -np.inf))
        mid = np.clip(wc, lo, hi)  # below mid: e^y < cap; above: the cap
        with np.errstate(over="ignore"):
            below = np.exp(A + B * B / 2) * _mass(lo - B, mid - B)
        return np.nan_to_num(below) + self.cap * _mass(mid, hi)

    def survival(self, g: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            _, wa = self.shape.locate((np.log(g) - self.mu) / self.sigma)
        return np.exp(log_ndtr(-wa))

    def remaining(self, g: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            y = np.log(g)
        in_tail = y >= self.q_top
        out = np.empty_like(g)
        if in_tail.any():
            out[in_tail] = self.tail.remaining(g[in_tail])
        body = ~in_tail
        if body.any():
            gb = g[body]
            k, wa = self.shape.locate((y[body] - self.mu) / self.sigma)
            total = self._capped_exp(wa, self.shape.hi[k], self.A[k], self.B[k]) + self._suffix[k + 1]
            s = np.exp(log_ndtr(-wa))
            out[body] = np.clip(total / s - gb, 0.0, np.maximum(self.cap - gb, 0.0))
        return out

    def remaining_quantile(self, g: np.ndarray, q: float) -> np.ndarray:
        with np.errstate(divide="ignore"):
            _, wa = self.shape.locate((np.log(g) - self.mu) / self.sigma)
        # P(L > x) = (1 - q) P(L > g): x's normal score, then through the piece that holds it
        wx = -ndtri_exp(np.log1p(-q) + log_ndtr(-wa))
        k = np.searchsorted(self.shape.w, wx, side="right")
        x = np.minimum(np.exp(np.minimum(self.A[k] + self.B[k] * wx, self.log_cap)), self.cap)
        return np.clip(x - g, 0.0, None)


def _standard_shape(min_sigma: float, history: Sequence[StepStats]) -> tuple[float, ...] | None:
    """The mean standardised log-quantile profile of ``history`` (None when a step has none)."""
    if not history or any(not h.log_quantiles for h in history):
        return None
    z = [(np.asarray(h.log_quantiles) - h.log_mean) / max(h.log_std, min_sigma) for h in history]
    return tuple(np.mean(z, axis=0).tolist())


@dataclass(frozen=True)
class LengthForecast:
    """A forecast of one step's response lengths: ``min(L, cap)`` with ``log L = mu + sigma Z``.

    ``Z`` is standard normal (``shape`` None: L is lognormal) or follows ``shape``, the standardised
    log-quantiles at :data:`emulation.workload.LOG_QUANTILE_LEVELS` (see :class:`_Shape`). ``mu`` and
    ``sigma`` are the mean and sd of log L. ``mu_se`` is the standard error of ``mu`` (from the ARIMA, or
    the fallback's own error); ``method`` says what made it (``arima``, ``drift``, ``last``, ``prior``;
    ``+online`` once updated within the step) and ``note`` why a fallback was used. ``fit_s`` is the wall
    time of the fit.
    """
    step: int
    mu: float
    sigma: float
    cap: int
    mu_se: float
    method: str
    note: str = ""
    fit_s: float = 0.0
    shape: tuple[float, ...] | None = None
    # the step's forecast before any online update (the prior of every update; None: this is it)
    base: LengthForecast | None = field(default=None, repr=False, compare=False)
    # the share of log-length variance a prompt's samples have in common (prompt_share): the spread left to
    # a request of a known prompt offset is (1 - prompt_share) of it (see prompt_law)
    prompt_share: float = 0.0

    def __post_init__(self) -> None:
        require(0.0 <= self.prompt_share < 1.0, "prompt_share", f"must be in [0, 1), got {self.prompt_share}")
        require(math.isfinite(self.mu), "mu", f"must be finite, got {self.mu}")
        require(math.isfinite(self.sigma) and self.sigma > 0, "sigma", f"must be > 0, got {self.sigma}")
        require(self.cap >= 1, "cap", f"must be >= 1, got {self.cap}")
        require(math.isfinite(self.mu_se) and self.mu_se > 0, "mu_se", f"must be > 0, got {self.mu_se}")
        if self.shape is None:
            law: _Lognormal | _Shaped = _Lognormal(self.mu, self.sigma, self.cap)
        else:
            require(len(self.shape) == len(LOG_QUANTILE_LEVELS) and all(math.isfinite(v) for v in self.shape),
                    "shape", f"must be {len(LOG_QUANTILE_LEVELS)} finite values, got {len(self.shape)}")
            law = _Shaped(self.mu, self.sigma, self.cap, _shape_of(self.shape))
        object.__setattr__(self, "_law", law)

    @classmethod
    def from_workload(cls, workload: WorkloadSpec, step: int = 0) -> LengthForecast:
        """The workload's configured distribution at run step ``step`` (the forecast before any history).

        Lognormal; a mixture or a cap spike (``cap_fraction``) is carried as a shape (its log-quantiles
        computed on a grid). ``mu_se`` is sigma / sqrt(samples_per_step): the prior counts as one step's
        worth of observations. Not for a trace (it has no configured law).
        """
        if workload.trace is not None:
            raise ValueError("a trace workload has no configured distribution: give a history instead")
        shift = math.log(workload.median_factor(step + workload.warmup_steps))
        comps = workload.mixture or (LengthComponent(1.0, workload.response_median_tokens, workload.response_sigma),)
        w = np.array([c.weight for c in comps]) / sum(c.weight for c in comps)
        mus = np.log([c.median_tokens for c in comps]) + shift
        sig = np.array([c.sigma for c in comps])
        shape = None
        if len(comps) == 1 and workload.cap_fraction == 0:
            mu, sigma = float(mus[0]), float(sig[0])
        else:
            log_cap, cf = math.log(workload.max_response_tokens), workload.cap_fraction
            y = np.linspace(min(mus.min() - 8 * sig.max(), 0.0), max(mus.max() + 8 * sig.max(), log_cap), 20001)
            with np.errstate(divide="ignore", invalid="ignore"):
                comp_cdf = np.where(sig[:, None] > 0, np.exp(log_ndtr((y - mus[:, None]) / sig[:, None])),
                                    (y >= mus[:, None]).astype(np.float64))
            cdf = (1 - cf) * (w @ comp_cdf) + cf * (y >= log_cap)
            q = y[np.minimum(np.searchsorted(cdf, LOG_QUANTILE_LEVELS), len(y) - 1)]
            mu = float((1 - cf) * (w @ mus) + cf * log_cap)
            m2 = float((1 - cf) * (w @ (sig ** 2 + mus ** 2)) + cf * log_cap ** 2)
            sigma = math.sqrt(max(m2 - mu * mu, 0.0))
            if sigma > 0:
                shape = tuple(((q - mu) / sigma).tolist())
        sigma = max(sigma, ForecastSettings.min_sigma)
        return cls(step=step, mu=mu, sigma=sigma, cap=workload.max_response_tokens,
                   mu_se=sigma / math.sqrt(workload.samples_per_step), method="prior", shape=shape)

    # ---- the distribution -----------------------------------------------------------------------------
    def mean(self) -> float:
        """E[min(L, cap)]: the forecast mean response length (what the forecast error compares)."""
        return float(self._law.remaining(np.zeros(1))[0])

    def quantile(self, q: float) -> float:
        """The q-quantile of min(L, cap)."""
        return float(self.remaining_quantile(np.zeros(1), q)[0])

    def survival(self, generated: np.ndarray) -> np.ndarray:
        """P(L > g) per request: the chance a request at ``g`` tokens is still running."""
        return self._law.survival(np.asarray(generated, dtype=np.float64))

    def remaining(self, generated: np.ndarray, shift: np.ndarray | None = None) -> np.ndarray:
        """E[min(L, cap) - g | L > g] for each request's generated tokens ``g`` >= 0 (float64, same shape).

        ``g = 0`` (not started) gives the forecast mean; ``g >= cap`` gives 0 (the cap ends a response).
        ``shift``: per request, the log-offset of its prompt (what its prompt group has shown,
        :func:`prompt_shifts`; NaN: nothing shown, the request has this law): its law is :meth:`prompt_law`'s.
        """
        g = np.asarray(generated, dtype=np.float64)
        if shift is None:
            return self._law.remaining(g.ravel()).reshape(g.shape)
        return _by_prompt(g, shift, lambda m: self._law.remaining(g[m]),
                          lambda m, s: self.prompt_law().remaining(g[m], s))

    def remaining_quantile(self, generated: np.ndarray, q, shift: np.ndarray | None = None) -> np.ndarray:
        """The q-quantile of min(L, cap) - g given L > g, per request (float64). ``q``: one level, or one per
        request (the planner's stratified sample). ``shift``: as in :meth:`remaining`."""
        qa = np.asarray(q, dtype=np.float64)
        if not ((qa > 0) & (qa < 1)).all():
            raise ValueError(f"q must be in (0, 1), got {q}")
        g = np.asarray(generated, dtype=np.float64)
        qq = qa.ravel() if qa.ndim else qa
        if shift is None:
            return self._law.remaining_quantile(g.ravel(), qq).reshape(g.shape)
        qk = np.broadcast_to(qa, g.shape)
        return _by_prompt(g, shift, lambda m: self._law.remaining_quantile(g[m], qk[m]),
                          lambda m, s: self.prompt_law().remaining_quantile(g[m], qk[m], s))

    def with_prompt_share(self, share: float) -> LengthForecast:
        """This forecast with ``prompt_share`` set (the shifted requests' spread; the rest unchanged): a copy
        that keeps the law already built (nothing of it depends on the share) and the prompt law's parameters
        with only the spread changed (the driver sets the share on every tick's forecast)."""
        if share == self.prompt_share:
            return self
        require(0.0 <= share < 1.0, "prompt_share", f"must be in [0, 1), got {share}")
        out = copy.copy(self)
        object.__setattr__(out, "prompt_share", float(share))
        law = self.__dict__.get("_prompt_law")
        if law is not None:
            object.__setattr__(out, "_prompt_law", dataclasses.replace(law, within=math.sqrt(1.0 - share)))
        return out

    def prompt_law(self) -> "PromptLaw":
        """The law of a request whose prompt's log-offset is known (:class:`PromptLaw`), made once."""
        law = self.__dict__.get("_prompt_law")
        if law is None:
            law = PromptLaw.of(self)
            object.__setattr__(self, "_prompt_law", law)
        return law

    # ---- within a step -----------------------------------------------------------------------------------
    def updated(self, completed: np.ndarray, running: np.ndarray,
                settings: ForecastSettings = ForecastSettings()) -> LengthForecast:
        """This step's forecast re-estimated (mu and sigma; the shape kept) from the step's observations.

        ``completed``: lengths of the responses that finished (a length at the cap is censored there);
        ``running``: generated tokens of those still running (censored: L > g; g = 0 says nothing). The
        prior is the step's forecast before any update (``base``), so calling this again with all
        observations so far never counts one twice.
        """
        base = self.base or self
        done = np.asarray(completed, dtype=np.float64)
        run = np.asarray(running, dtype=np.float64)
        if done.ndim != 1 or run.ndim != 1:
            raise ValueError("completed and running must be 1-d arrays")
        if done.size and done.min() < 1:
            raise ValueError("a completed length must be >= 1")
        exact = np.log(done[done < base.cap])
        # censoring points, grouped: running requests share few distinct token counts (one EM term each)
        cens, counts = np.unique(np.concatenate([np.full(int(np.sum(done >= base.cap)), float(base.cap)),
                                                 run[run > 0]]), return_counts=True)
        cens = np.log(cens)
        n_cens = int(counts.sum())
        if exact.size + n_cens == 0:
            return base
        law = base._law
        z_moments = law.shape.z_moments_above if isinstance(law, _Shaped) else _Lognormal.z_moments_above
        n0 = min(max((base.sigma / base.mu_se) ** 2, PRIOR_WEIGHT_RANGE[0]), PRIOR_WEIGHT_RANGE[1])
        s1 = n0 * base.mu + exact.sum()
        s2 = n0 * (base.mu ** 2 + base.sigma ** 2) + np.dot(exact, exact)
        n = n0 + exact.size + n_cens
        mu, sigma = base.mu, base.sigma
        for _ in range(settings.online_max_iter):
            # E-step: a censored y > c is replaced by E[y | y > c] (and E[y^2 | y > c]) under (mu, sigma)
            ez, ez2 = z_moments((cens - mu) / sigma)
            ey = mu + sigma * ez
            ey2 = mu * mu + 2 * mu * sigma * ez + sigma * sigma * ez2
            m1 = (s1 + np.dot(counts, ey)) / n
            var = (s2 + np.dot(counts, ey2)) / n - m1 * m1
            new_sigma = math.sqrt(max(var, settings.min_sigma ** 2))
            done_iter = abs(m1 - mu) < settings.online_tol and abs(new_sigma - sigma) < settings.online_tol
            mu, sigma = float(m1), new_sigma
            if done_iter:
                break
        info = n0 + exact.size  # censored observations carry less: count only exact ones (conservative)
        return dataclasses.replace(base, mu=mu, sigma=sigma, mu_se=sigma / math.sqrt(info) if info > 0 else base.mu_se,
                                   method=f"{base.method}+online", base=base)


def _by_prompt(g: np.ndarray, shift, plain, prompt) -> np.ndarray:
    """Per request: ``plain(mask)`` for those whose prompt has shown nothing (a NaN shift: the forecast's own
    law), ``prompt(mask, s)`` for those of known offset ``s`` (the prompt law); ``g``'s shape."""
    s = np.asarray(shift, dtype=np.float64).reshape(g.shape)
    known = ~np.isnan(s)
    # every request of one kind (a tick's, once every prompt has shown something): that law alone, on the same
    # values in the same order, rather than the other law on no request as well (~25 us a call on 2 cores)
    if known.all():
        return prompt(known, s[known]).reshape(g.shape)
    if not known.any():
        return plain(~known).reshape(g.shape)
    out = np.empty(g.shape)
    out[~known] = plain(~known)
    out[known] = prompt(known, s[known])
    return out


# ---- within a step: what a prompt's samples say about each other -------------------------------------
PROMPT_GRID = 41  # points of the posterior of a prompt's offset (+-4 of its prior sd)
PROMPT_PASSES = 32  # prompt_offsets sums a prompt's samples' terms rank by rank up to this many samples a prompt
SPIKE_TOL = 1e-9  # standardised log-quantiles this close to the top one are the top's atom (the cap spike)


def spike_mass(shape: Sequence[float] | None) -> float:
    """The mass of a shape's atom near its top, 0 for none: the topmost run of two or more knots in the upper
    half whose standardised log-quantiles are equal (a flat run, as a spike of responses at the cap leaves in
    a step's quantiles; above it may lie the body's tail past the cap, as in a prior made from the workload).
    Known to the levels' resolution (LOG_QUANTILE_LEVELS: every percent near the top): the mass lies between
    the run's span and the span to its neighbouring levels; the midpoint (0.052 for a 5% spike)."""
    if shape is None:
        return 0.0
    z = np.asarray(shape, dtype=np.float64)
    lv = np.asarray(LOG_QUANTILE_LEVELS, dtype=np.float64)
    flat = np.flatnonzero((np.abs(np.diff(z)) <= SPIKE_TOL) & (lv[1:] > 0.5))  # knot k equals knot k + 1
    if not len(flat):
        return 0.0
    i = len(flat) - 1  # the topmost run: consecutive indices in ``flat`` ending at its last
    while i > 0 and flat[i - 1] == flat[i] - 1:
        i -= 1
    first, last = int(flat[i]), int(flat[-1]) + 1  # the run's bottom and top knots
    inner = lv[last] - lv[first]
    outer = (lv[last + 1] if last + 1 < len(lv) else 1.0) - (lv[first - 1] if first > 0 else 0.0)
    return float((inner + outer) / 2.0)


_BODY_LEVELS = (float(ndtr(-1.0)), 0.5, float(ndtr(1.0)))  # PromptLaw.of's body quantiles (of the mass below the spike)


@dataclass(frozen=True)
class PromptLaw:
    """The length of a request whose prompt's log-offset ``s`` is known (:func:`prompt_shifts`): the model
    that prompt_shifts assumes, ``log L = mu + a + e`` with ``a`` the prompt's offset and ``e`` what is left
    to one sample, ``e ~ N(0, (1 - prompt_share) sigma^2)``, and apart from it the forecast's spike at the cap.

    * ``p``: the spike, responses at the cap whatever their prompt (emulation/workload.py draws
      ``cap_fraction`` so; a truncated response runs to the cap as the engine cuts it): the forecast's atom at
      the top of its shape (:func:`spike_mass`; 0 for a lognormal forecast), held at the cap (the forecast's
      own shape moves it with ``mu``: docs/forecast.md "Shape limits").
    * the body, the forecast's law below the spike, as a lognormal: ``mu``, ``sigma`` from its quantiles at
      (1 - p) x (Phi(-1), 1/2, Phi(1)) (exact for a lognormal body; a mixture's body is summarised so);
      a request of offset ``s`` has ``mu + s`` and the within-prompt spread ``within x sigma``, capped at
      the cap.

    Scaling the whole forecast by ``e^s`` instead (this law until 2026-12-07) kept the marginal spread around
    the prompt's offset, counting the prompt's share of it twice, and moved the spike off the cap with the
    prompt: on the default workload the running requests of short prompts were given 0.29-0.74 of what they
    had left and the sum over all running requests was 1.13-1.39x the truth early in a step
    (testbed/benchmarks/bench_forecast_within.py; docs/forecast.md "Inside a step")."""

    p: float
    mu: float
    sigma: float
    within: float
    cap: float

    @classmethod
    def of(cls, fc: "LengthForecast") -> "PromptLaw":
        p = min(spike_mass(fc.shape), 0.5)
        # the three quantiles in one call of the forecast (elementwise: the values three calls give; once a tick)
        lo, mid, hi = fc.remaining_quantile(np.zeros(3), np.array([x * (1.0 - p) for x in _BODY_LEVELS])).tolist()
        mu = math.log(max(mid, 1.0))
        sigma = max((math.log(max(hi, 1.0)) - math.log(max(lo, 1.0))) / 2.0, ForecastSettings.min_sigma)
        return cls(p, mu, sigma, math.sqrt(1.0 - fc.prompt_share), float(fc.cap))

    def _body(self, g: np.ndarray, s: np.ndarray):
        """(log-mean, sd, log g (-inf for none yet), log P(body > g), the spike's share of P(L > g)) per
        request."""
        m = self.mu + s
        sd = self.within * self.sigma
        with np.errstate(divide="ignore"):
            lg = np.where(g > 0, np.log(np.maximum(g, 1e-300)), -np.inf)
        log_s = log_ndtr(-((lg - m) / sd))
        if self.p > 0:
            with np.errstate(divide="ignore"):
                spike = 1.0 / (1.0 + (1.0 - self.p) / self.p * np.exp(log_s))
        else:
            spike = np.zeros(len(g))
        return m, sd, lg, log_s, spike

    def remaining(self, g: np.ndarray, s: np.ndarray) -> np.ndarray:
        """E[min(L, cap) - g | L > g] at offset ``s`` (per request)."""
        g = np.asarray(g, dtype=np.float64)
        m, sd, lg, log_s, spike = self._body(g, s)
        lc, cap = math.log(self.cap), self.cap
        with np.errstate(divide="ignore", invalid="ignore"):
            # E[min(X, cap) | X > g] for the body X: its partial expectation on (g, cap) plus cap P(X > cap),
            # each over P(X > g) in logs (far tails stay exact)
            head = np.exp(m + sd * sd / 2.0 + log_ndtr(-(lg - m - sd * sd) / sd) - log_s)
            head -= np.exp(m + sd * sd / 2.0 + log_ndtr(-(lc - m - sd * sd) / sd) - log_s)
            body = head + cap * np.exp(log_ndtr(-(lc - m) / sd) - log_s)
        body = np.clip(np.where(np.isfinite(body), body, cap), g, cap)
        out = spike * (cap - g) + (1.0 - spike) * (body - g)
        return np.where(g >= cap, 0.0, np.clip(out, 0.0, None))

    def remaining_quantile(self, g: np.ndarray, q: np.ndarray, s: np.ndarray) -> np.ndarray:
        """The q-quantile of min(L, cap) - g given L > g at offset ``s``: the spike's share of what is still
        running is its top (the cap is the longest a response runs), the body's conditional quantile below."""
        g = np.asarray(g, dtype=np.float64)
        m, sd, _, log_s, spike = self._body(g, s)
        q = np.broadcast_to(np.asarray(q, dtype=np.float64), g.shape)
        top = q >= 1.0 - spike
        qb = np.clip(q / np.maximum(1.0 - spike, 1e-300), 0.0, 1.0 - 1e-16)
        # P(X > x) = (1 - qb) P(X > g)
        with np.errstate(divide="ignore", invalid="ignore"):
            x = np.exp(m - sd * ndtri_exp(np.log1p(-qb) + log_s))
        x = np.where(np.isfinite(x), np.minimum(x, self.cap), self.cap)
        out = np.where(top, self.cap, x) - g
        return np.where(g >= self.cap, 0.0, np.clip(out, 0.0, None))


# the largest prompt share the forecast takes (LengthForecast.prompt_share must stay below 1: a share of 1 leaves
# the shifted requests no spread of their own); measured and prior shares alike are held to it
MAX_PROMPT_SHARE = 0.95


def prompt_share(steps: Sequence[tuple[np.ndarray, np.ndarray]], prior: float = 0.0) -> float:
    """The share of log-length variance that a prompt's samples have in common (0..1): one-way analysis of
    variance of log length by prompt over finished steps ``(lengths, prompt_ids)`` (between-prompt variance
    of the prompt means less what the within-prompt noise puts there), ``prior`` when there are none."""
    between, total, k = 0.0, 0.0, 0
    for lengths, pids in steps:
        y = np.log(np.asarray(lengths, dtype=np.float64))
        if len(y) < 4:
            continue
        uniq, inv, cnt = np.unique(np.asarray(pids), return_inverse=True, return_counts=True)
        if len(uniq) < 2 or cnt.max() < 2:
            continue
        means = np.bincount(inv, weights=y) / cnt
        within = float(np.sum((y - means[inv]) ** 2) / max(1, len(y) - len(uniq)))
        b = float(np.var(means)) - within * float(np.mean(1.0 / cnt))
        between += max(b, 0.0)
        total += float(np.var(y))
        k += 1
    if not k or total <= 0:
        return float(min(max(prior, 0.0), MAX_PROMPT_SHARE))
    return float(min(max(between / total, 0.0), MAX_PROMPT_SHARE))


def prompt_prior(workload: WorkloadSpec) -> float:
    """The prompt share before any finished step has measured one: the workload's own split of the spread,
    ``(prompt_sigma / response_sigma)^2`` (0 for a mixture or a trace, whose split it does not state), at most
    MAX_PROMPT_SHARE (a workload whose whole spread is its prompts', ``prompt_sigma == response_sigma``, is valid:
    the map's sigma panel at 0.5 beside the default prompt_sigma 0.6 makes one)."""
    w = workload
    if w.mixture or w.trace or w.response_sigma <= 0:
        return 0.0
    return min((w.prompt_sigma / w.response_sigma) ** 2, MAX_PROMPT_SHARE)


def prompt_shifts(forecast: "LengthForecast", share: float, done_pid: np.ndarray, done_len: np.ndarray,
                  run_pid: np.ndarray, run_gen: np.ndarray) -> dict[int, float]:
    """:func:`prompt_offsets` under the forecast's :class:`PromptLaw`."""
    return prompt_offsets(forecast.prompt_law(), share, done_pid, done_len, run_pid, run_gen)


def request_shifts(post: dict[int, float], pids: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per array of prompt ids (a server's requests'), each request's shift from :func:`prompt_shifts`' result
    ``post`` (prompt id -> offset; NaN for a request whose prompt is not in it: it showed nothing)."""
    keys = np.fromiter(post.keys(), np.int64, len(post))
    vals = np.fromiter(post.values(), np.float64, len(post))
    o = np.argsort(keys)
    keys, vals = keys[o], vals[o]
    out = []
    for pid in pids:
        pid = np.asarray(pid)
        if not len(keys):
            out.append(np.full(len(pid), np.nan))
            continue
        i = np.minimum(np.searchsorted(keys, pid), len(keys) - 1)
        out.append(np.where(keys[i] == pid, vals[i], np.nan))
    return out


def shifted_forecast(forecast: "LengthForecast", share: float, done_pid: np.ndarray, done_len: np.ndarray,
                     run_pid: np.ndarray, run_gen: np.ndarray, pids: Sequence[np.ndarray]) -> tuple:
    """A tick's forecast and its requests' prompt shifts, as the driver's tick takes them: the prompts' offsets
    (:func:`prompt_shifts`), each request's shift per array of prompt ids in ``pids`` (a server's requests':
    :func:`request_shifts`), and the forecast with ``prompt_share`` set to ``share`` (the shifted requests'
    spread). ``(forecast, None)`` where no prompt has shown anything."""
    post = prompt_shifts(forecast, share, done_pid, done_len, run_pid, run_gen)
    if not post:
        return forecast, None
    return forecast.with_prompt_share(share), request_shifts(post, pids)


def prompt_offsets(law: PromptLaw, share: float, done_pid: np.ndarray, done_len: np.ndarray,
                   run_pid: np.ndarray, run_gen: np.ndarray) -> dict[int, float]:
    """Per prompt, the posterior mean of its log-offset given its samples so far: finished ones (their
    lengths; one at the cap says nothing where the forecast has a spike there, else is censored there) and
    running ones (censored: L > g, g = 0 says nothing), under a :class:`PromptLaw`: log L = mu +
    a + e, a ~ N(0, share sigma^2), e ~ N(0, (1 - share) sigma^2), and apart from it the spike at the cap
    (mass p, whatever the prompt: a running sample may be one), ``law``'s parameters. The offsets are
    centred on the step's forecast, so a request's law (:meth:`LengthForecast.remaining` with its shift, the forecast's
    ``prompt_share`` set to ``share``) moves it towards its own prompt; a prompt with no evidence is not in
    the result. Exact on a grid of the offset (pure numpy, all prompts at once)."""
    if share <= 0 or (len(done_pid) + len(run_pid)) == 0:
        return {}
    mu, p = law.mu, law.p
    sa = math.sqrt(share) * law.sigma
    se = math.sqrt(max(1.0 - share, 1e-6)) * law.sigma
    grid = np.linspace(-4 * sa, 4 * sa, PROMPT_GRID)
    prior = -0.5 * (grid / sa) ** 2
    cap = law.cap
    dl = np.asarray(done_len, dtype=np.float64)
    exact = dl < cap
    rg = np.asarray(run_gen, dtype=np.float64)
    # a finished sample at the cap: censored there (L > cap) without a spike, nothing at all with one (it may
    # be the spike, which says nothing of its prompt)
    at_cap = np.asarray(done_pid)[~exact] if p == 0 else np.zeros(0, np.asarray(done_pid).dtype)
    cens_pid = np.concatenate([at_cap, np.asarray(run_pid)[rg > 0]])
    cens_y = np.log(np.concatenate([dl[~exact] if p == 0 else np.zeros(0), rg[rg > 0]])) if len(cens_pid) \
        else np.zeros(0)
    ex_pid, ex_y = np.asarray(done_pid)[exact], np.log(dl[exact]) if exact.any() else np.zeros(0)
    pids = np.unique(np.concatenate([ex_pid, cens_pid]))
    if not len(pids):
        return {}
    # the samples' log-likelihoods over the grid: ``table`` rows, sample i's is row ``src[i]``; its prompt ``rows``
    terms, src, rows = [], [], []
    if len(ex_pid):
        z = (ex_y[:, None] - mu - grid[None, :]) / se
        terms.append(-0.5 * z * z)
        src.append(np.arange(len(ex_pid)))
        rows.append(ex_pid)
    if len(cens_pid):  # still running at g (or at the cap): P(L > g | a) = p + (1 - p) P(body > g | a)
        # a replica's batch starts together and runs in lockstep, so the running samples' token counts repeat
        # (4,096 running, 5-10 distinct counts early in a step at 128 requests per GPU): each distinct one
        # is evaluated once, the same numbers
        uy, inv = np.unique(cens_y, return_inverse=True)
        z = (uy[:, None] - mu - grid[None, :]) / se
        lik = log_ndtr(-z) if p == 0 else _spiked_log_survival(p, -z)
        src.append(inv + (len(terms[0]) if terms else 0))
        terms.append(lik)
        rows.append(cens_pid)
    # each prompt's terms summed one after another in the samples' order (finished ones, then running ones),
    # as np.add.at sums them, in one pass per rank within a prompt (a prompt's k-th sample: as many passes as
    # a prompt has samples) rather than one per sample (np.add.reduceat sums in another order)
    table = np.concatenate(terms) if len(terms) > 1 else terms[0]
    src = np.concatenate(src)
    at = np.searchsorted(pids, np.concatenate(rows))
    if schedule_kernel.sum_rows is not None:  # compiled: np.add.at's sums, sample by sample in order
        ll = schedule_kernel.sum_rows(len(pids), at.astype(np.int64), np.ascontiguousarray(table, np.float64),
                                      src.astype(np.int64))
        return _offsets_mean(pids, ll, prior, grid)
    order = np.argsort(at, kind="stable")
    sat = at[order]
    first = np.flatnonzero(np.concatenate(([True], sat[1:] != sat[:-1])))
    rank = np.arange(len(sat)) - np.repeat(first, np.diff(np.append(first, len(sat))))
    ll = np.zeros((len(pids), len(grid)))
    if rank.max() >= PROMPT_PASSES:  # prompts of many samples: one pass per sample
        np.add.at(ll, at, table[src])
    else:
        for k in range(int(rank.max()) + 1):
            m = rank == k
            ll[sat[m]] += table[src[order[m]]]
    return _offsets_mean(pids, ll, prior, grid)


def _spiked_log_survival(p: float, x: np.ndarray) -> np.ndarray:
    """log(p + (1 - p) Phi(x)) for a spike of mass ``p`` in (0, 1): a censored sample's log-likelihood under
    :func:`prompt_offsets`' law. The spike keeps the sum at or above ``p``, so it is taken directly rather than in
    logs (``np.logaddexp(log p, log1p(-p) + log_ndtr(x))``, the same value to ~1e-15 absolute, 3x the time: the
    running samples' terms were 0.9 of the prompt shifts' 1.3 ms a ``bench planner`` tick); the logs are needed
    only without a spike, where Phi(x) underflows far out (p = 0: ``log_ndtr``)."""
    return np.log(p + (1.0 - p) * ndtr(x))


def _offsets_mean(pids: np.ndarray, ll: np.ndarray, prior: np.ndarray, grid: np.ndarray) -> dict[int, float]:
    """:func:`prompt_offsets`' posterior means from each prompt's summed log-likelihoods ``ll`` over ``grid``."""
    post = ll + prior[None, :]
    post = np.exp(post - post.max(axis=1, keepdims=True))
    mean = (post @ grid) / post.sum(axis=1)
    return dict(zip(pids.tolist(), mean.tolist()))


# ---- across steps ------------------------------------------------------------------------------------
def _fallback(y: np.ndarray, kind: str) -> tuple[float, float]:
    """(forecast, standard error) of the next value of series ``y`` by ``kind`` (drift needs >= 3 values)."""
    if kind == "drift" and len(y) >= 3:
        d = np.diff(y)
        sd = float(np.std(d, ddof=1)) if len(d) >= 2 else 0.0
        return float(y[-1] + d.mean()), sd * math.sqrt(1 + 1 / len(d))
    # last value: the error of a random walk step (when there are 2+ values), else unknown (sampling only)
    sd = float(np.std(np.diff(y), ddof=0)) if len(y) >= 2 else 0.0
    return float(y[-1]), sd


def _quiet_statsmodels() -> None:
    # statsmodels warns about starting parameters and convergence on short series: expected here, and
    # the forecast is checked by the sanity guard. (A filter, not catch_warnings: that is not thread-safe.)
    from statsmodels.tools.sm_exceptions import ModelWarning
    warnings.filterwarnings("ignore", category=ModelWarning)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"statsmodels(\.|$)")


def _arima(y: np.ndarray, settings: ForecastSettings) -> tuple[float, float]:
    from statsmodels.tsa.arima.model import ARIMA
    _quiet_statsmodels()
    res = ARIMA(y, order=settings.order, trend=settings.trend).fit()
    fc = res.get_forecast(1)
    return float(np.asarray(fc.predicted_mean)[0]), float(np.asarray(fc.se_mean)[0])


def forecast_next(history: Sequence[StepStats], settings: ForecastSettings = ForecastSettings(),
                  prior: LengthForecast | None = None, use_arima: bool = True) -> LengthForecast:
    """The forecast of the step after ``history``'s last (steps increasing); runs the ARIMA fits inline.

    Without history: ``prior`` (ValueError when there is none either). ``use_arima=False``: the fallback
    only (numpy, microseconds). With ARIMA it may take seconds: call it through testbed.forecast_service.ForecastService,
    never on the decision path.
    """
    if not history:
        if prior is None:
            raise ValueError("no history and no prior to forecast from")
        return prior
    steps = [h.step for h in history]
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"history steps must increase, got {steps}")
    t0 = time.perf_counter()
    hist = list(history)[-settings.history_steps:]
    cap = hist[-1].cap
    n_last = hist[-1].n
    mus = np.array([h.log_mean for h in hist])
    sigmas = np.array([h.log_std for h in hist])
    kind = settings.fallback if len(hist) >= 3 else "last"
    method, note = kind, ""
    out = {}
    if not use_arima:
        note = f"fallback requested; {kind} used"
    elif len(hist) >= settings.min_arima_steps:
        try:
            for name, y in (("mu", mus), ("sigma", sigmas)):
                f, se = _arima(y, settings)
                guard = max(float(np.ptp(y)), GUARD_MIN_LOG)
                if not (math.isfinite(f) and math.isfinite(se) and abs(f - y[-1]) <= guard):
                    raise ArithmeticError(f"{name} forecast {f:.4g} is more than {guard:.3g} from the last value "
                                          f"{y[-1]:.4g}")
                out[name] = (f, se)
            method = "arima"
        except Exception as e:  # noqa: BLE001 - any failed fit falls back; the forecast says why
            out = {}
            note = f"arima failed ({type(e).__name__}: {e}); {kind} used"
            log.debug("forecast for step %d: %s", steps[-1] + 1, note)
    else:
        note = f"{len(hist)} steps of history < min_arima_steps ({settings.min_arima_steps}); {kind} used"
    if not out:
        out = {"mu": _fallback(mus, kind), "sigma": _fallback(sigmas, kind)}
    mu, mu_se = out["mu"]
    sigma = max(out["sigma"][0], settings.min_sigma)
    # the forecast's error is never below the sampling error of one step's log-mean
    mu_se = max(mu_se, sigma / math.sqrt(n_last))
    shape = _standard_shape(settings.min_sigma, hist[-settings.shape_steps:]) if settings.shape == "empirical" else None
    return LengthForecast(step=steps[-1] + 1, mu=mu, sigma=sigma, cap=cap, mu_se=mu_se, method=method, note=note,
                          fit_s=time.perf_counter() - t0, shape=shape)


# ---- forecast error ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForecastRecord:
    step: int  # the realised step
    forecast_step: int  # the step the forecast was made for (== step unless a stale forecast was used)
    method: str
    forecast_mean: float  # E[min(L, cap)] under the forecast
    realised_mean: float  # the step's mean response length
    ape: float  # |forecast_mean - realised_mean| / realised_mean
    forecast_p90: float
    realised_p90: float


class ForecastErrors:
    """Per-step absolute percentage error of the forecast mean length, and their mean (MAPE, %)."""

    def __init__(self) -> None:
        self._records: list[ForecastRecord] = []

    def record(self, forecast: LengthForecast, realised: StepStats) -> ForecastRecord:
        """Record the forecast the planner used for step ``realised.step`` against what that step did."""
        if self._records and realised.step <= self._records[-1].step:
            raise ValueError(f"steps must be recorded in order: {realised.step} after {self._records[-1].step}")
        f = forecast.mean()
        r = ForecastRecord(step=realised.step, forecast_step=forecast.step, method=forecast.method,
                           forecast_mean=f, realised_mean=realised.mean,
                           ape=abs(f - realised.mean) / realised.mean, forecast_p90=forecast.quantile(0.9),
                           realised_p90=realised.p90)
        self._records.append(r)
        return r

    @property
    def records(self) -> tuple[ForecastRecord, ...]:
        return tuple(self._records)

    def mape(self) -> float | None:
        """Mean absolute percentage error (%) over the recorded steps; None before the first."""
        return 100.0 * float(np.mean([r.ape for r in self._records])) if self._records else None

    def to_json(self) -> dict:
        return {"mape_pct": self.mape(), "per_step": [dataclasses.asdict(r) for r in self._records]}
