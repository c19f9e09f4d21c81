"""A run's failed generators and the requests they held: what the driver does when a server dies.

A failure is seen at once when an agent's process exits, or at a planning tick when a server stays silent
past its deadline (the backend's ``states``). Every request the failed server held and no live one holds is
re-queued on the live generators from the tokens already delivered; a request that finished while tokens a
failed server sent never arrived is repaired from the collectors' contiguous prefix. Everything goes
through the Backend interface (testbed/backends/base.py) and is recorded in the run's timeline.
"""
from __future__ import annotations

import logging

import numpy as np

from testbed.backends.base import Backend, StepRequests
from testbed.ticks import tick_deadline_s, tick_fail_after_s

log = logging.getLogger(__name__)


class Recovery:
    """The failed servers of a run (``failed``: server -> why) and the re-queueing of their requests."""

    def __init__(self, backend: Backend, timeline, interval_s: float):
        self.backend = backend
        self.timeline = timeline
        self.interval_s = interval_s
        self.failed: dict[int, str] = {}
        self._repaired: dict[int, frozenset] = {}  # rid -> the failed servers when it was last repaired

    def live(self) -> list[int]:
        """The generators not known to have failed, in the backend's order."""
        return [s for s in self.backend.gen_servers if s not in self.failed]

    def place(self, s: int, specs: list[dict], chunked: bool = False) -> None:
        """Submit ``specs`` to server ``s``; if it failed (or fails now), to the next live generator."""
        b = self.backend
        order = [s] + [x for x in b.gen_servers if x != s]
        for cand in order:
            if cand in self.failed or cand in b.failures():
                continue
            try:
                b.submit(cand, specs, chunked=chunked)
                return
            except Exception as e:  # noqa: BLE001 - it failed under the call: try the next one
                if cand not in b.failures():
                    raise
                log.warning("submit to server %d failed (%s); placing its requests elsewhere", cand, e)
        raise RuntimeError("every generator failed")

    def check(self, req: StepRequests | None, states: dict | None = None) -> bool:
        """Act on servers newly failed (a process exit is seen at once; a missed deadline by states()): their
        requests are re-queued on the live generators now. ``req``: the step being generated (None: between
        steps, nothing placed yet); ``states``: this tick's, when fresh; else the live servers are asked now
        (what they hold is not re-queued). True when there were any."""
        b = self.backend
        new = {s: why for s, why in b.failures().items() if s not in self.failed}
        if not new:
            return False
        if req is None:  # between steps: nothing of this step is placed yet
            for s, why in new.items():
                self.failed[s] = why
                self.timeline.event(b.now(), "agent_failed", server=s, why=why, requests=0)
            return True
        gone_trainers = sorted(s for s in new if s not in b.gen_servers)
        if gone_trainers:
            self.failed.update(new)
            raise RuntimeError(f"trainer agent(s) {gone_trainers} failed ({new[gone_trainers[0]]}): their token "
                               "collectors held this step's responses, so the run cannot go on")
        if states is None or any(s in new for s in states):
            states = b.states(tick_deadline_s(self.interval_s), tick_fail_after_s(self.interval_s))
        self._requeue({s: why for s, why in b.failures().items() if s not in self.failed}, req, states)
        return True

    def _requeue(self, failed: dict[int, str], req: StepRequests, states) -> None:
        b = self.backend
        live = [s for s in b.gen_servers if s not in self.failed and s not in failed]
        held = set(np.concatenate([st.snapshot["rid"] for s, st in states.items() if s in live]).tolist()) \
            if any(s in live for s in states) else set()
        now = b.now()
        for s, why in failed.items():
            self.failed[s] = why
            lost = b.lost_requests(s, held=held)
            self.timeline.event(now, "agent_failed", server=s, why=why, requests=len(lost))
            if not live:
                raise RuntimeError(f"every generator failed ({why})")
            per = self._resume(req, lost, live)
            self.timeline.event(b.now(), "requeued", server=s, to=sorted(per), requests=sum(len(v) for v in per.values()),
                                delivered_tokens=int(sum(lost.values())), noticed=now)

    def repair(self, req: StepRequests, states, deadline_s: float | None) -> None:
        """Requests that finished on a live server while tokens a failed one sent before handing them over never
        arrived (it died with them queued): resumed from the collectors' contiguous prefix on a live generator
        (what arrived past the gap comes again, counted as a duplicate), so every response is delivered whole."""
        held = set(np.concatenate([st.snapshot["rid"] for st in states.values()]).tolist()) if states else set()
        failed = frozenset(self.failed)
        # once per request and set of failures: a repaired copy that finished with its last tokens still in
        # flight looks stranded until they arrive
        todo = {r: g for r, g in self.backend.stranded(held, deadline_s).items() if self._repaired.get(r) != failed}
        if not todo:
            return
        self._repaired.update({r: failed for r in todo})
        live = self.live()
        if not live:
            raise RuntimeError("every generator failed")
        per = self._resume(req, todo, live)
        self.timeline.event(self.backend.now(), "repaired", to=sorted(per), requests=sum(len(v) for v in per.values()),
                            missing_from=sorted(self.failed))

    def _resume(self, req: StepRequests, got: dict[int, int], live: list[int]) -> dict[int, list[dict]]:
        """The step's unfinished requests of ``got`` ({rid: tokens delivered}) placed round robin on ``live``,
        each resuming where its delivered tokens end: server -> the request specs it was given."""
        tgt = dict(zip(req.rid.tolist(), req.target.tolist()))
        pr = dict(zip(req.rid.tolist(), req.prompt.tolist()))
        dest = dict(zip(req.rid.tolist(), req.dest.tolist()))
        per: dict[int, list[dict]] = {}
        for k, (rid, n) in enumerate(sorted(got.items())):
            if rid in tgt and n < tgt[rid]:
                per.setdefault(live[k % len(live)], []).append(
                    {"rid": rid, "prompt": pr[rid], "target": tgt[rid], "dest": dest[rid], "generated": n})
        for s, specs in per.items():
            self.place(s, specs)
        return per
