"""One way to stop: SIGINT (Ctrl-C, to the process or to its whole group), SIGTERM (``kill``, ``timeout``) and
SIGHUP (the terminal went away) all unwind the command the same way, through every ``with`` block that
started something, so everything it started is stopped and everything it created is removed.

:func:`teardown_on_signals` turns the first of those signals into :class:`Interrupted` (a KeyboardInterrupt,
raised in the main thread); a second one while tearing down is logged and ignored, so the teardown is not
cut short halfway (each of its steps has its own deadline). The command exits with 128 + the signal number
(130, 143, 129), as a shell reports a process the signal ended.

:func:`shielded` marks a teardown (``stop()`` of a fabric, a controller, the agents): a teardown signal that
arrives inside it is held until it is over, so a signal never cuts a teardown short, not even one that was
running already when it came (a command ending normally).
"""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from typing import Iterator

log = logging.getLogger(__name__)

TEARDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A teardown signal arrived (``signum``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_caught: list[int] = []  # the teardown signal the last teardown_on_signals block caught, if any


def signal_of(exc: KeyboardInterrupt) -> int:
    """The signal that ended a command with ``exc``: an :class:`Interrupted`'s own; for a plain KeyboardInterrupt
    the one the teardown handler caught (a library that catches Interrupted and raises a KeyboardInterrupt of its
    own, as Ray's ``ray.wait`` does, loses it), else SIGINT (Ctrl-C before any handler)."""
    if isinstance(exc, Interrupted):
        return exc.signum
    return _caught[-1] if _caught else int(signal.SIGINT)


def exit_code(exc: KeyboardInterrupt) -> int:
    """The exit status of a command ended by ``exc`` (128 + :func:`signal_of`)."""
    return 128 + signal_of(exc)


_state = threading.local()  # per thread: how deep in shielded() blocks; signals held meanwhile


def _depth() -> int:
    return getattr(_state, "depth", 0)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """A teardown: a teardown signal arriving inside is held until the outermost shielded block ends, and
    raised (as Interrupted) only then."""
    _state.depth = _depth() + 1
    try:
        yield
    finally:
        _state.depth -= 1
        held = getattr(_state, "held", None)
        if _state.depth == 0 and held is not None:
            _state.held = None
            raise Interrupted(held)


@contextlib.contextmanager
def teardown_on_signals(signals=TEARDOWN_SIGNALS) -> Iterator[None]:
    """Inside: the first teardown signal raises :class:`Interrupted` (held until the end of a shielded
    teardown under way); later ones are ignored (logged)."""
    got: list[int] = []

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if got:
            print(f"{name}: still tearing down (every step has a deadline); please wait", file=sys.stderr,
                  flush=True)
            return
        got.append(signum)
        _caught.append(signum)
        log.warning("%s: tearing down", name)
        if _depth() > 0:  # a teardown is running: let it finish, then unwind
            _state.held = signum
            return
        raise Interrupted(signum)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    old = {s: signal.signal(s, handler) for s in signals}
    _caught.clear()  # a new command: kept after the block, for the exit status of what it raises (signal_of)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def handlers_kept(signals=TEARDOWN_SIGNALS) -> Iterator[None]:
    """Inside: whatever a library installs for the teardown signals is put back as it was when the block ends.
    ``ray.init`` installs Ray's own failure handler for SIGTERM, which logs and ends the process at once: the
    command's teardown (:func:`teardown_on_signals`) would not run, Ray's workers would be left running and
    what they created left behind. Wrapped around ``ray.init``, a SIGTERM unwinds the command as any other does
    (``ray.shutdown`` in its ``finally`` stops the workers)."""
    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's to set
        yield
        return
    saved = {s: signal.getsignal(s) for s in signals}
    try:
        yield
    finally:
        for s, h in saved.items():
            if h is not None:  # None: set outside Python, nothing of ours to put back
                signal.signal(s, h)


def run_torn_down(work, label: str, note: str = "") -> tuple[int, object]:
    """``work()`` under :func:`teardown_on_signals`, for a standalone script's main: (0, its result), or where a
    teardown signal ended it (its ``with`` blocks unwound: what it started stopped, what it made removed)
    ``LABEL: interrupted`` and ``note`` on stderr and (the exit status, None)."""
    try:
        with teardown_on_signals():
            return 0, work()
    except KeyboardInterrupt as e:
        print(f"{label}: interrupted{note}", file=sys.stderr)
        return exit_code(e), None
