"""The forecast service: fits length forecasts (testbed.orchestrator.forecast, pure) in one background
thread, so that the planner never waits for statsmodels (an ARIMA fit takes tens of ms, seconds on a busy
machine: PLATFORM.md). The driver starts one per run; the math stays in the orchestrator's pure floor."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from emulation.orchestration import ForecastSettings
from emulation.workload import StepStats
from testbed.orchestrator.forecast import LengthForecast, forecast_next

log = logging.getLogger(__name__)

FitFunction = Callable[[Sequence[StepStats], ForecastSettings, "LengthForecast | None"], LengthForecast]


class ForecastService:
    """Fits forecasts in one background thread so that the planner never waits for statsmodels.

    ``submit(history)`` queues a fit (a newer submission replaces one not yet started) and returns at once;
    ``latest()`` is the newest finished forecast (before the first fit lands: the forecast of the
    construction ``history`` by the fallback, or ``prior``; None without either). A fit that raises is
    logged, counted in ``failures`` and leaves ``latest()`` as it was. A context manager; ``stop()`` is
    idempotent and joins the thread (a fit in flight is waited for up to ``timeout`` seconds).
    """

    def __init__(self, settings: ForecastSettings = ForecastSettings(), history: Sequence[StepStats] = (),
                 prior: LengthForecast | None = None, fit: FitFunction = forecast_next):
        self.settings = settings
        self._prior = prior
        self._fit = fit
        self._cond = threading.Condition()
        self._pending: tuple[int, tuple[StepStats, ...]] | None = None
        self._submitted = 0
        self._finished = 0  # ticket of the newest finished fit
        self._busy = False
        self._stopping = False
        self.failures = 0
        self.fit_times_s: list[float] = []
        self._latest: LengthForecast | None = prior
        if history:
            self._latest = forecast_next(history, settings, prior, use_arima=False)
        self._thread = threading.Thread(target=self._run, name="orl-forecast", daemon=True)
        self._thread.start()

    def __enter__(self) -> ForecastService:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, history: Sequence[StepStats]) -> int:
        """Queue a fit of ``history``; returns its ticket (increasing). Never blocks on a fit."""
        hist = tuple(history)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the forecast service is stopped")
            self._submitted += 1
            self._pending = (self._submitted, hist)
            self._cond.notify_all()
            return self._submitted

    def latest(self) -> LengthForecast | None:
        with self._cond:
            return self._latest

    @property
    def busy(self) -> bool:
        """Whether a fit is running now."""
        with self._cond:
            return self._busy

    def wait(self, ticket: int, timeout: float) -> bool:
        """Block until the fit of ``ticket`` (or a later one) has finished, at most ``timeout`` seconds.

        Not for the decision path: for step boundaries that want the fresh forecast, and for tests.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._finished < ticket:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    return self._finished >= ticket
                self._cond.wait(left)
            return True

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._pending = None
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("forecast thread still fitting after %.0f s; left as a daemon thread", timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                ticket, hist = self._pending
                self._pending = None
                self._busy = True
            result, t0 = None, time.perf_counter()
            try:
                result = self._fit(hist, self.settings, self._prior)
            except Exception:  # noqa: BLE001 - a failed fit must not kill the service
                log.exception("forecast fit failed (ticket %d)", ticket)
            with self._cond:
                self._busy = False
                self.fit_times_s.append(time.perf_counter() - t0)
                if result is None:
                    self.failures += 1
                elif self._latest is None or result.step >= self._latest.step:
                    self._latest = result
                self._finished = ticket
                self._cond.notify_all()
