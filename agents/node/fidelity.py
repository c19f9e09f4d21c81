"""The agent's fidelity monitor: how late each step's tokens left the agent after the step's modelled end."""
from __future__ import annotations

import math
from collections import deque

import numpy as np

LAG_BOUND_S = 0.05  # tokens streamed more than 50 ms (engine time) after their step ended, p99: distorted


class Fidelity:
    """How late each step's tokens left the agent after the step's modelled end (engine time = real-time
    equivalent seconds). The engine's schedule never slips (agents.node.runner.EngineRunner.loop): lateness
    delays the tokens on their way to the collectors, whose arrival times are what a step's makespan is
    measured on."""

    def __init__(self, keep: int = 200_000):
        self.modelled: deque[float] = deque(maxlen=keep)
        self.late: deque[float] = deque(maxlen=keep)
        self.batch: deque[int] = deque(maxlen=keep)
        self.steps = 0

    def record(self, modelled_s: float, late_s: float, batch: int) -> None:
        self.modelled.append(modelled_s)
        self.late.append(max(0.0, late_s))
        self.batch.append(batch)
        self.steps += 1

    def clear(self) -> None:
        self.modelled.clear(); self.late.clear(); self.batch.clear()
        self.steps = 0

    def report(self, tdf: float) -> dict:
        if not self.modelled:
            return {"steps": 0, "tdf": tdf, "distorted": False}
        m = np.asarray(self.modelled)
        late = np.asarray(self.late)
        p50, p99 = (float(x) for x in np.percentile(late, [50, 99]))
        distorted = bool(p99 > LAG_BOUND_S)
        # the agents' CPU did not keep up: a larger dilation gives every step more wall time
        need = tdf * min(10.0, max(1.5, p99 / LAG_BOUND_S)) if distorted else tdf
        return {"steps": int(self.steps), "tdf": tdf, "modelled_step_ms_p50": float(np.percentile(m, 50)) * 1e3,
                "lag_ms_p50": p50 * 1e3, "lag_ms_p99": p99 * 1e3, "lag_bound_ms": LAG_BOUND_S * 1e3,
                "batch_p50": float(np.percentile(np.asarray(self.batch), 50)), "distorted": distorted,
                "tdf_needed": float(math.ceil(need * 10) / 10.0)}
