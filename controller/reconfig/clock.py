"""The executor's time source: the :class:`Clock` protocol and :class:`PreciseClock`, which the controller uses
(the unit tests inject a manual clock, tests/unit/fakes_controller.py).
"""
from __future__ import annotations

import time
from typing import Callable, Protocol

SPIN_MARGIN_S = 0.001  # sleep until this long before a deadline, then spin on the clock


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""

    def sleep_until(self, deadline: float) -> None:
        """Return at ``deadline`` (not before)."""


class PreciseClock:
    """perf_counter time; waits by a coarse sleep until ``margin`` before the deadline, then spins.

    ``coarse_sleep`` is ``time.sleep`` inside the controller (os-ken's hub runs native threads, which run
    meanwhile); the spin holds this thread for at most ``margin`` so nothing else delays the deadline.
    """

    def __init__(self, coarse_sleep: Callable[[float], None] = time.sleep, margin: float = SPIN_MARGIN_S):
        self._sleep = coarse_sleep
        self._margin = margin

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, deadline: float) -> None:
        remaining = deadline - time.perf_counter()
        if remaining > self._margin:
            self._sleep(remaining - self._margin)
        while time.perf_counter() < deadline:
            pass
