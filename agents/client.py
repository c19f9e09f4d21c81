"""A client of an agent's RPC server (ZeroMQ DEALER, msgpack messages of agents.protocol), for whoever drives
agents: the testbed's cluster, the orchestrator's emulated backend, and agents themselves (migration).

Calls are thread-safe: every thread gets its own socket, so a long call (a collective, a migration) never
holds up a short one (stats) to the same agent. Every call has a deadline: no answer in time raises
:class:`AgentTimeout` (the agent may be dead); an error reply raises :class:`AgentError` with the field the
agent named. A call can also be given ``abort``, a function polled every :data:`ABORT_POLL_S` while it
waits: when it returns a reason (e.g. "agent 3 exited"), the call gives up at once with :class:`AgentGone`
instead of waiting out its deadline (a ZeroMQ socket to a dead peer never errors: it waits for a reconnect).
"""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import zmq

from .protocol import ProtocolError, decode_reply, encode_request


class AgentError(Exception):
    """The agent answered with an error (``field``: what was wrong)."""

    def __init__(self, agent: str, method: str, message: str, field: str | None):
        super().__init__(f"{agent} {method}: {message}")
        self.agent, self.method, self.message, self.field = agent, method, message, field


class AgentTimeout(TimeoutError):
    def __init__(self, agent: str, method: str, timeout_s: float):
        super().__init__(f"{agent} {method}: no answer within {timeout_s:g} s")
        self.agent, self.method, self.timeout_s = agent, method, timeout_s


class AgentGone(ConnectionError):
    """A call given up because an agent it depends on is known to be gone (``why``), not for its deadline."""

    def __init__(self, agent: str, method: str, why: str):
        super().__init__(f"{agent} {method}: given up: {why}")
        self.agent, self.method, self.why = agent, method, why


ABORT_POLL_S = 0.02  # how often a waiting call asks its ``abort`` whether to give up


_ids = itertools.count(1)
_ctx_lock = threading.Lock()
_ctx: zmq.Context | None = None


def context() -> zmq.Context:
    global _ctx
    with _ctx_lock:
        if _ctx is None or _ctx.closed:
            _ctx = zmq.Context()
        return _ctx


class AgentClient:
    def __init__(self, url: str, name: str = "", timeout_s: float = 10.0, ctx: zmq.Context | None = None):
        self.url = url
        self.name = name or url
        self.timeout_s = timeout_s
        self._ctx = ctx or context()
        self._local = threading.local()
        self._socks: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def _sock(self) -> zmq.Socket:
        s = getattr(self._local, "sock", None)
        if s is None:
            if self._closed:
                raise RuntimeError(f"client of {self.name} is closed")
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 0)
            s.connect(self.url)
            self._local.sock = s
            with self._lock:
                self._socks.append(s)
        return s

    def _reset_sock(self) -> None:
        """Drop this thread's socket (after a timeout its late reply must not be read as the next answer)."""
        s = getattr(self._local, "sock", None)
        if s is not None:
            with self._lock:
                if s in self._socks:
                    self._socks.remove(s)
            s.close(0)
            self._local.sock = None

    def call(self, method: str, params: Any = None, timeout_s: float | None = None,
             abort: Callable[[], str | None] | None = None) -> Any:
        """``method(params)`` on the agent; its result. ``abort()``, polled while waiting, gives up the call
        (AgentGone) as soon as it returns a reason; checked once before anything is sent, too."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if abort is not None and (why := abort()):
            raise AgentGone(self.name, method, why)
        rid = next(_ids)
        s = self._sock()
        s.send(encode_request(rid, method, params))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if abort is None:
                ready = left > 0 and s.poll(int(left * 1000) + 1)
            else:
                ready = left > 0 and s.poll(int(min(left, ABORT_POLL_S) * 1000) + 1)
                if not ready and left > 0:
                    why = abort()
                    if why:
                        self._reset_sock()
                        raise AgentGone(self.name, method, why)
                    continue
            if not ready:
                self._reset_sock()
                raise AgentTimeout(self.name, method, timeout)
            try:
                rep = decode_reply(s.recv())
            except ProtocolError as e:
                raise AgentError(self.name, method, f"unreadable reply: {e}", None) from None
            if rep.id != rid:  # a reply to an abandoned call on this socket: skip it
                continue
            if not rep.ok:
                raise AgentError(self.name, method, rep.error or "error", rep.field)
            return rep.result

    def call_raw(self, payload: bytes, timeout_s: float | None = None):
        """Send bytes as they are (tests of malformed input); returns the decoded reply (ok or not)."""
        s = self._sock()
        s.send(payload)
        if not s.poll(int((self.timeout_s if timeout_s is None else timeout_s) * 1000)):
            self._reset_sock()
            raise AgentTimeout(self.name, "raw", self.timeout_s if timeout_s is None else timeout_s)
        return decode_reply(s.recv())

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for s in self._socks:
                s.close(0)
            self._socks.clear()


def call_all(clients: dict[int, AgentClient], method: str, params_of, timeout_s: float,
             pool: ThreadPoolExecutor | None = None, abort: Callable[[], str | None] | None = None) -> dict[int, Any]:
    """Call ``method`` on every agent at once (``params_of(i)`` gives agent i's parameters); every result,
    or the first error after all calls returned (so no call is left running behind the caller's back).
    ``abort``: as for :meth:`AgentClient.call`, for every one of the calls."""
    own = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=max(1, len(clients)))
    try:
        futs: dict[int, Future] = {i: pool.submit(c.call, method, params_of(i), timeout_s, abort)
                                   for i, c in clients.items()}
        out, err = {}, None
        for i, f in futs.items():
            try:
                out[i] = f.result()
            except Exception as e:  # noqa: BLE001 - collected, the first one re-raised below
                err = err or e
        if err is not None:
            raise err
        return out
    finally:
        if own:
            pool.shutdown(wait=True)


def call_each(clients: dict[int, AgentClient], method: str, params_of, timeout_s: float,
              pool: ThreadPoolExecutor, abort_of: Callable[[int], Callable[[], str | None] | None] | None = None
              ) -> tuple[dict[int, Any], dict[int, Exception]]:
    """Call ``method`` on every agent at once, each with the deadline ``timeout_s``; (results, errors) by agent:
    one agent's silence costs the others nothing (the per-tick calls of a planning tick)."""
    futs: dict[int, Future] = {i: pool.submit(c.call, method, params_of(i), timeout_s,
                                              abort_of(i) if abort_of else None) for i, c in clients.items()}
    out: dict[int, Any] = {}
    errs: dict[int, Exception] = {}
    for i, f in futs.items():
        try:
            out[i] = f.result()
        except Exception as e:  # noqa: BLE001 - reported per agent
            errs[i] = e
    return out, errs
