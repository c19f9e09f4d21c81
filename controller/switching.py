"""The benefit-aware switching rule (pure): may a reconfiguration be made now, and what does it cost?

One function (:func:`decide_switch`) answers for the controller, the simulated backend and RLSim alike, and
says why. This module imports nothing of the controller's runtime (no os-ken, sockets or threads), so RLSim
and the testbed import it without pulling the controller in.
"""
from __future__ import annotations

from dataclasses import dataclass


def fits_slack(window_ms: float | None, delay_ms: float) -> bool:
    """True when a reconfiguration taking ``delay_ms`` fits an idle window of ``window_ms``.

    No window (None) means the caller does not constrain it: it fits. Otherwise the window must be strictly
    longer than the switching delay (a window exactly as long as the delay leaves no margin).
    """
    if window_ms is None:
        return True
    return window_ms > delay_ms


SWITCH_ACTIONS = ("switched", "stalled", "deferred")  # what decide_switch answers
#: a predicted gain this far below zero (ms) means the new topology makes the next phase slower: never switch.
#: Within it a gain counts as "no loss" (RLSim's own gains of equal topologies differ by microseconds of latency).
LOSS_TOLERANCE_MS = 1.0


@dataclass(frozen=True)
class SwitchDecision:
    """The benefit-aware rule's answer: ``action`` (one of SWITCH_ACTIONS), the stall the next phase waits
    (ms; 0 unless ``stalled``) and a sentence saying why."""

    action: str
    stall_ms: float
    reason: str


def decide_switch(window_ms: float | None, delay_ms: float, gain_ms: float | None) -> SwitchDecision:
    """Benefit-aware switching, for the controller and RLSim alike (pure). The gain is weighed in every case.

    ``gain_ms`` is what the next phase is predicted to save on the new topology against staying on the old
    one (negative: the new one is slower; ``inf``: the old one cannot carry that phase; None: not predicted).

    * ``deferred`` when ``gain_ms < -LOSS_TOLERANCE_MS``: the switch would make the next phase slower, so it
      is never made, however long the window;
    * ``switched`` when the reconfiguration fits the idle window (:func:`fits_slack`: no window given, or
      one longer than ``delay_ms``) or takes no time (``delay_ms == 0``): nothing waits. A gain within
      +-LOSS_TOLERANCE_MS (no loss) still switches here: the slack makes it free, and the phase's own
      topology is what the phases beside it were planned for (in the async mode the next generation streams
      its tokens and migrates its KV over the circuits training or sync hand back; the next transition's
      window and gain are predicted from the phase's own circuits). No gain given (None) trusts the caller;
    * ``stalled``: the window is too short, but the gain exceeds the stall ``delay_ms - max(window_ms, 0)``:
      switch anyway and the next phase waits that long;
    * ``deferred`` otherwise (no gain given, or one not larger than the stall): keep the old topology.
    """
    if gain_ms is not None and gain_ms < -LOSS_TOLERANCE_MS:
        return SwitchDecision("deferred", 0.0, f"gain_ms {gain_ms:g}: the new topology is predicted to make "
                                               f"the next phase slower (by more than {LOSS_TOLERANCE_MS:g} ms), "
                                               "so it is never switched to: the current circuits stay")
    if fits_slack(window_ms, delay_ms) or delay_ms == 0:
        why = ("no window_ms given" if window_ms is None else
               f"window_ms {window_ms:g} is longer than the switching delay {delay_ms:g} ms" if delay_ms
               else "a switch that takes no time needs no window")
        if gain_ms is None:
            gain = "no gain_ms given"
        elif gain_ms > LOSS_TOLERANCE_MS:
            gain = f"gain_ms {gain_ms:g}"
        else:
            gain = (f"gain_ms {gain_ms:g} is no loss (within {LOSS_TOLERANCE_MS:g} ms): the phase gets its own "
                    "topology, which the phases beside it were planned for, at no cost")
        return SwitchDecision("switched", 0.0, f"{why}, {gain}: switching in the slack")
    stall = delay_ms - max(window_ms, 0.0)
    short = f"window_ms {window_ms:g} is not longer than the switching delay {delay_ms:g} ms"
    if gain_ms is not None and gain_ms > stall:
        return SwitchDecision("stalled", stall, f"{short}, but gain_ms {gain_ms:g} exceeds the stall: "
                                                f"switching, the next phase waits {stall:g} ms")
    if gain_ms is None:
        return SwitchDecision("deferred", 0.0, f"{short} and no gain_ms was given: the current circuits stay")
    return SwitchDecision("deferred", 0.0, f"{short} and gain_ms {gain_ms:g} does not exceed the stall "
                                           f"{stall:g} ms: the current circuits stay")
