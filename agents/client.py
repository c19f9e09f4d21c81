"""A client of an agent's RPC server (ZeroMQ DEALER, msgpack messages of agents.protocol), for whoever drives
agents: the testbed's cluster, the orchestrator's emulated backend, and agents themselves (migration).

Calls are thread-safe: every thread gets its own socket, so a long call (a collective, a migration) never
holds up a short one (stats) to the same agent. Every call has a deadline: no answer in time raises
:class:`AgentTimeout` (the agent may be dead: see :meth:`AgentClient.alive`); an error reply raises
:class:`AgentError` with the field the agent named.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

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

    def call(self, method: str, params: Any = None, timeout_s: float | None = None) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        rid = next(_ids)
        s = self._sock()
        s.send(encode_request(rid, method, params))
        deadline_ms = int(timeout * 1000)
        while True:
            if not s.poll(deadline_ms):
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
             pool: ThreadPoolExecutor | None = None) -> dict[int, Any]:
    """Call ``method`` on every agent at once (``params_of(i)`` gives agent i's parameters); every result,
    or the first error after all calls returned (so no call is left running behind the caller's back)."""
    own = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=max(1, len(clients)))
    try:
        futs: dict[int, Future] = {i: pool.submit(c.call, method, params_of(i), timeout_s) for i, c in clients.items()}
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
