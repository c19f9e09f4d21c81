"""When planning ticks happen, and what a planning interval allows (pure: times are passed in).

Ticks run on the clock: tick ``k`` of a generation phase is due at ``start + k * interval``. A tick that starts
late runs once, in the interval it starts in; the intervals it overran are skipped, never made up for (a
driver that waited on something for three intervals does not then plan three times back to back). So every
interval ``[start + k * interval, start + (k + 1) * interval)`` holds at most one tick start.

:class:`IntervalBudget` holds a per-interval limit (the balancer's ``max_migrations``) over the same intervals,
counted by when each action starts: a tick whose actions spill into the next interval spends that interval's
budget, so no interval of time ever holds more than the limit, whatever the ticks do.

The per-tick calls to the backend get :data:`TICK_DEADLINE_FRACTION` of the interval (:func:`tick_deadline_s`),
so a tick waits at most that long on the servers. A generator that does not answer in that time is left out of
the tick, and failed if its call has no answer :data:`TICK_FAIL_FRACTION` of the interval after it was made
(:func:`tick_fail_after_s`): a hung agent is failed within 2 intervals of going silent (silent just after one
tick's answer, failed one interval after the next tick's call), while a healthy agent that a loaded machine
made late once (a 2-core machine with other jobs: one missed 250 ms deadline in 8 default-scenario runs) is
not killed for it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

TICK_DEADLINE_FRACTION = 0.5  # of the planning interval: the per-tick calls' deadline
TICK_FAIL_FRACTION = 1.0  # of the planning interval: a per-tick call with no answer by then fails its server


def tick_deadline_s(interval_s: float) -> float:
    """The deadline of a planning tick's calls to the servers (backend seconds)."""
    return TICK_DEADLINE_FRACTION * interval_s


def tick_fail_after_s(interval_s: float) -> float:
    """How long after a per-tick call a server that has not answered it is failed (backend seconds)."""
    return TICK_FAIL_FRACTION * interval_s


def _index(t: float, start: float, interval: float) -> int:
    return int(math.floor((t - start) / interval + 1e-9))


@dataclass
class TickClock:
    """Planning ticks on the grid ``start + k * interval`` (backend seconds), never caught up."""

    start: float
    interval: float
    next_at: float = field(init=False)
    last: int = field(init=False, default=0)  # index of the last tick started (0: none yet; tick 1 is due first)
    skipped: int = field(init=False, default=0)  # intervals that held no tick because a tick overran them
    ticks: list[dict] = field(init=False, default_factory=list)  # {"t", "due", "late_s", "took_s"} per tick

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval) and self.interval > 0):
            raise ValueError(f"interval must be > 0, got {self.interval}")
        self.next_at = self.start + self.interval

    def due(self, now: float) -> bool:
        return now + 1e-9 >= self.next_at

    def begin(self, now: float) -> dict:
        """A tick starts at ``now`` (due): its record. The intervals between the last tick and this one that
        held no tick are counted in ``skipped``."""
        k = max(_index(now, self.start, self.interval), self.last + 1)
        self.skipped += k - self.last - 1
        due = self.start + k * self.interval
        self.last = k
        rec = {"t": now, "due": due, "late_s": max(0.0, now - due), "took_s": None}
        self.ticks.append(rec)
        self.next_at = self.start + (k + 1) * self.interval
        return rec

    def end(self, rec: dict, now: float) -> None:
        """The tick of ``rec`` ended at ``now``; if it overran into later intervals, their ticks are skipped."""
        rec["took_s"] = now - rec["t"]
        k = _index(now, self.start, self.interval)
        if k >= self.last + 1:  # the next tick's interval has begun (or passed): wait for the one after
            self.skipped += k - self.last
            self.last = k
            self.next_at = self.start + (k + 1) * self.interval

    def summary(self) -> dict:
        took = [r["took_s"] for r in self.ticks if r["took_s"] is not None]
        late = [r["late_s"] for r in self.ticks]
        return {"ticks": len(self.ticks), "skipped_intervals": self.skipped,
                "took_s_max": max(took) if took else None, "late_s_max": max(late) if late else None}


@dataclass
class IntervalBudget:
    """At most ``limit`` actions per interval ``[start + k * interval, start + (k + 1) * interval)``, counted by
    the time each action starts."""

    start: float
    interval: float
    limit: int
    used: dict[int, int] = field(default_factory=dict)

    def left(self, now: float) -> int:
        return max(0, self.limit - self.used.get(_index(now, self.start, self.interval), 0))

    def spend(self, now: float) -> None:
        k = _index(now, self.start, self.interval)
        self.used[k] = self.used.get(k, 0) + 1

    def most(self) -> int:
        """The most actions any interval held."""
        return max(self.used.values(), default=0)
