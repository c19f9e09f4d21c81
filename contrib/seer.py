"""Seer's context-aware scheduling, as a plug-in dispatcher (testbed.orchestrator.interfaces.Dispatcher).

Source: R. Qin et al., "Seer: Online Context Learning for Fast Synchronous LLM Reinforcement Learning",
arXiv 2511.14617 (2025), its context-aware scheduling. The samples of one prompt (a GRPO group) run to
similar lengths, so the first sample of each group is a *probe*: the probes run first, shortest first; a
group's length estimate is the longest of its samples finished so far; the rest of the batch is dealt and
queued longest estimate first (approximate longest-job-first), so the groups that will make the tail start
early. A group none of whose samples has finished is estimated at ``unknown`` (``cap``: the response cap,
i.e. first among the rest, the paper's conservative reading; ``last``: after every known group).

On this testbed a server runs at most its seats (``max_num_seqs`` per replica) at once and queues the rest
first come first served, so the order of the deal is the schedule: the probes are queued first on every
server (round robin, shortest prompt first, then by prompt); the rest fill each server up to ``fill`` x its
seats, longest estimate first, each to the server with the most room; what does not fit waits in the pool and
is dealt at every planning tick (the paper's global request pool), longest estimate first, as seats free up.
Seer's other two parts (divided rollout into chunks, grouped speculative decoding) are not modelled.

What it reads is what every policy sees: prompt ids, the prompt lengths, the lengths of finished responses
(the collectors received them), the servers' snapshots; never the lengths of running or queued responses.
Use it as ``dispatch: contrib.seer:SeerDispatch`` (docs/plugins.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from testbed.orchestrator.interfaces import Batch, Deal, Dispatcher, Pool, PolicyContext

UNKNOWN = ("cap", "last")


class SeerDispatch(Dispatcher):
    @dataclass(frozen=True)
    class Params:
        fill: float = 1.0  # a server is dealt requests up to fill x its seats (max_num_seqs x replicas)
        unknown: str = "cap"  # a group's estimate before any of its samples finished: cap | last

        def __post_init__(self) -> None:
            from emulation.validation import require

            require(0 < self.fill <= 64, "fill", f"must be in (0, 64], got {self.fill!r}")
            require(self.unknown in UNKNOWN, "unknown", f"must be one of {', '.join(UNKNOWN)}, got {self.unknown!r}")

    def __init__(self, ctx: PolicyContext, params: Params):
        self.ctx, self.p = ctx, params
        self.layouts: dict = {}

    def _room(self, server: int, held: int) -> int:
        return max(0, int(self.p.fill * self.ctx.seats(self.layouts[server])) - held)

    def _estimates(self, prompt_id: np.ndarray, finished: dict) -> dict[int, float]:
        """Every group's estimate: the longest of its finished samples."""
        est: dict[int, float] = {}
        for i, n in finished.items():
            g = int(prompt_id[i])
            est[g] = max(est.get(g, 0.0), float(n))
        return est

    def _longest_first(self, idx: np.ndarray, prompt_id: np.ndarray, est: dict) -> np.ndarray:
        unknown = self.ctx.max_response_tokens if self.p.unknown == "cap" else -1.0
        key = np.array([est.get(int(prompt_id[i]), unknown) for i in idx], float)
        return idx[np.lexsort((idx, -key))]  # longest estimate first; a group's samples together, in order

    def _fill(self, order: np.ndarray, room: dict[int, int], placed: dict[int, list]) -> np.ndarray:
        """Deal ``order`` (longest first) to the servers with the most room; what fits nowhere is returned."""
        left = []
        for i in order.tolist():
            s = max(room, key=lambda x: (room[x], -x))
            if room[s] <= 0:
                left.append(i)
                continue
            placed[s].append(i)
            room[s] -= 1
        return np.asarray(left, np.int64)

    def deal(self, batch: Batch) -> Deal:
        self.layouts = dict(batch.layouts)
        servers = list(batch.servers)
        first = np.unique(batch.prompt_id, return_index=True)[1]  # each group's first sample: its probe
        probes = first[np.lexsort((batch.prompt_id[first], batch.prompt[first]))]  # shortest prompt first
        placed: dict[int, list] = {s: [] for s in servers}
        for k, i in enumerate(probes.tolist()):
            placed[servers[k % len(servers)]].append(i)
        rest = np.setdiff1d(np.arange(batch.n), probes)
        room = {s: self._room(s, len(placed[s])) for s in servers}
        held = self._fill(self._longest_first(rest, batch.prompt_id, {}), room, placed)
        return Deal({s: np.asarray(v, np.int64) for s, v in placed.items()}, chunked=False, held=held)

    def release(self, pool: Pool) -> dict:
        self.layouts.update({s: st.layout for s, st in pool.states.items()})
        room = {s: self._room(s, len(st.snapshot["rid"])) for s, st in pool.states.items()}
        if not room or not any(room.values()):
            return {}
        est = self._estimates(pool.prompt_id, pool.finished)
        placed: dict[int, list] = {s: [] for s in room}
        self._fill(self._longest_first(pool.held, pool.prompt_id, est), room, placed)
        return {s: np.asarray(v, np.int64) for s, v in placed.items() if v}
