"""A small client of the controller's REST API (urllib + JSON; no dependencies)."""
from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any, Iterable, Mapping, Sequence

log = logging.getLogger(__name__)


class ControllerError(Exception):
    """The controller answered with an error status (``status``, ``message``, ``field``)."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.field = field


class ControllerClient:
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 120.0):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    # ---- transport ----------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                timeout_s: float | None = None) -> Any:
        """One JSON request; raises ControllerError on a 4xx/5xx answer, OSError when unreachable."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(f"{self.base_url}/api/v1/{path.lstrip('/')}", data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                return json.loads(resp.read().decode() or "null")
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                err = json.loads(text)
                msg, field = err.get("error", text), err.get("field")
            except (ValueError, AttributeError):
                msg, field = text, None
            raise ControllerError(e.code, msg, field) from None

    # ---- API ----------------------------------------------------------------------------------------
    def topology(self) -> dict:
        return self.request("GET", "topology")

    def circuits(self) -> dict[str, list[list[int]]]:
        return self.request("GET", "circuits")

    def state(self) -> dict:
        return self.request("GET", "state")

    def history(self) -> list[dict]:
        return self.request("GET", "history")

    def set_circuits(self, circuits: Mapping[int | str, Iterable[Sequence[int]]], delay_ms: float | None = None,
                     window_ms: float | None = None, gain_ms: float | None = None) -> dict:
        """Install ``circuits``; ``gain_ms``: the new circuits' predicted gain (``decide_switch``)."""
        body = {"circuits": {str(o): [list(p) for p in pairs] for o, pairs in circuits.items()},
                "delay_ms": delay_ms, "window_ms": window_ms, "gain_ms": gain_ms}
        return self.request("POST", "circuits", body)

    def set_phase(self, phase: str, delay_ms: float | None = None, window_ms: float | None = None,
                  gain_ms: float | None = None, part: str | None = None) -> dict:
        """Install ``phase``'s topology (``part``: one part of the train step's, "mp" or "dp"); the answer's
        ``decision`` is switched, stalled or deferred, and its ``reason`` says why."""
        body = {"phase": phase, "delay_ms": delay_ms, "window_ms": window_ms, "gain_ms": gain_ms}
        if part is not None:
            body["part"] = part
        return self.request("POST", "phase", body)

    # ---- waits ---------------------------------------------------------------------------------------
    def _poll(self, cond, timeout_s: float, poll_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        st = None
        while True:
            try:
                st = self.state()
                if cond(st):
                    return st
            except OSError as e:  # not listening yet
                log.debug("controller not answering yet: %s", e)
            if time.monotonic() >= deadline:
                return st
            time.sleep(poll_s)

    def wait_switches(self, dpids: Iterable[int], timeout_s: float = 30.0, poll_s: float = 0.05) -> dict:
        """Wait until every dpid is connected; TimeoutError names the missing ones."""
        want = set(dpids)
        st = self._poll(lambda s: want <= set(s["connected"]), timeout_s, poll_s)
        if st is None or not want <= set(st["connected"]):
            have = set(st["connected"]) if st else set()
            missing = sorted(want - have)
            raise TimeoutError(f"switches not connected after {timeout_s} s: "
                               f"{', '.join(hex(d) for d in missing)}")
        return st

    def wait_ready(self, timeout_s: float = 30.0, poll_s: float = 0.05) -> dict:
        """Wait until every switch is connected and the intended circuits are installed. A fabric that does not
        match its spec (an OCS with other ports than it says) never gets ready: raised at once (SpecError naming
        ``fabric.ocs_ports``: the start is refused)."""
        st = self._poll(lambda s: s["ready"] or bool(s.get("mismatch")), timeout_s, poll_s)
        if st is not None and st.get("mismatch"):
            from emulation.validation import SpecError

            raise SpecError("fabric.ocs_ports", "the built fabric does not match the scenario: "
                            + "; ".join(st["mismatch"]))
        if st is None or not st["ready"]:
            missing = st["missing"] if st else "unknown (controller not answering)"
            raise TimeoutError(f"controller not ready after {timeout_s} s (missing dpids: {missing})")
        return st
