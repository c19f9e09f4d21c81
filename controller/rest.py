"""The controller's REST API: a small WSGI app over a :class:`ControllerAPI` (no os-ken, no web framework).

Endpoints (JSON in, JSON out; ``Authorization: Bearer <token>`` unless the app was made with token None):

* ``GET  /api/v1/topology``  spec, layout, ToRs, OCSes, uplink wiring
* ``GET  /api/v1/circuits``  ``{"0": [[1, 3], [2, 4]], ...}``
* ``GET  /api/v1/state``     connected/expected dpids, ready, phase, busy
* ``GET  /api/v1/history``   every reconfiguration (done | deferred | rejected | failed) with timestamps
* ``POST /api/v1/circuits``  ``{"circuits": {"0": [[1, 3]]}, "delay_ms": 10, "window_ms": null, "gain_ms": null}``
* ``POST /api/v1/phase``     ``{"phase": "train", "delay_ms": 10, "window_ms": null, "gain_ms": null}``

POSTs answer after the reconfiguration completed, with its history record: ``status`` (done | deferred | ...)
and ``decision`` (switched | stalled | deferred, from ``controller.reconfig.decide_switch``) with ``stall_ms``. Errors are
``{"error": "<field>: <message>", "field": "<field>"}`` with 400 (bad input), 401 (token), 404 (path),
405 (method), 413 (body too large), 503 (fabric not ready / a switch did not confirm).
"""
from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Callable, Iterable, Protocol

from emulation.validation import SpecError

log = logging.getLogger(__name__)

PREFIX = "/api/v1"
MAX_BODY_BYTES = 256 * 1024


class ControllerAPI(Protocol):
    def topology(self) -> dict: ...

    def circuits(self) -> dict: ...

    def state(self) -> dict: ...

    def history(self) -> list: ...

    def request_circuits(self, data: Any) -> dict: ...

    def request_phase(self, data: Any) -> dict: ...

    def record_rejected(self, kind: str, error: str) -> dict: ...


class HttpError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            411: "Length Required", 413: "Payload Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON (no NaN/Infinity); HttpError 400 naming ``body`` otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HttpError(400, f"body: not UTF-8 ({e})", "body") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise HttpError(400, f"body: malformed JSON: {e}", "body") from None


def _read_body(environ: dict, max_bytes: int) -> bytes:
    cl = environ.get("CONTENT_LENGTH") or ""
    if not cl:
        if (environ.get("HTTP_TRANSFER_ENCODING") or "").lower() == "chunked":
            raise HttpError(411, "body: chunked bodies are not accepted; send Content-Length", "body")
        return b""
    try:
        n = int(cl)
    except ValueError:
        raise HttpError(400, f"Content-Length: not an integer: {cl!r}", "Content-Length") from None
    if n < 0:
        raise HttpError(400, f"Content-Length: must be >= 0, got {n}", "Content-Length")
    if n > max_bytes:
        raise HttpError(413, f"body: {n} bytes is larger than the limit of {max_bytes} bytes", "body")
    data = environ["wsgi.input"].read(n)
    return data


class RestApp:
    """WSGI callable. ``token`` None disables authentication (only with an explicit --no-auth)."""

    def __init__(self, api: ControllerAPI, token: str | None, max_body_bytes: int = MAX_BODY_BYTES):
        self.api = api
        self.token = token
        self.max_body_bytes = max_body_bytes
        self._get: dict[str, Callable[[], Any]] = {
            "topology": api.topology, "circuits": api.circuits, "state": api.state, "history": api.history}
        self._post: dict[str, Callable[[Any], Any]] = {
            "circuits": api.request_circuits, "phase": api.request_phase}

    def _check_auth(self, environ: dict) -> None:
        if self.token is None:
            return
        header = environ.get("HTTP_AUTHORIZATION")
        if not header:
            raise HttpError(401, "Authorization: missing (send 'Authorization: Bearer <token>')", "Authorization")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise HttpError(401, "Authorization: must be 'Bearer <token>'", "Authorization")
        if not hmac.compare_digest(value.strip().encode(), self.token.encode()):
            raise HttpError(401, "Authorization: bad token", "Authorization")

    def handle(self, environ: dict) -> tuple[int, Any]:
        method = environ.get("REQUEST_METHOD", "GET").upper()
        path = environ.get("PATH_INFO", "") or "/"
        if path != PREFIX and not path.startswith(PREFIX + "/"):
            raise HttpError(404, f"path: no such endpoint {path!r} (the API lives under {PREFIX}/)", "path")
        self._check_auth(environ)
        name = path[len(PREFIX) + 1:].rstrip("/")
        if name not in self._get and name not in self._post:
            known = sorted(set(self._get) | set(self._post))
            raise HttpError(404, f"path: no such endpoint {path!r} (known: {', '.join(known)})", "path")
        if method == "GET":
            if name not in self._get:
                raise HttpError(405, f"method: {path} accepts POST only", "method")
            return 200, self._get[name]()
        if method == "POST":
            if name not in self._post:
                raise HttpError(405, f"method: {path} accepts GET only", "method")
            try:
                data = parse_json_body(_read_body(environ, self.max_body_bytes))
            except HttpError as e:
                self.api.record_rejected(name, e.message)
                raise
            return 200, self._post[name](data)
        raise HttpError(405, f"method: {method} not allowed (GET or POST)", "method")

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        from .runtime import NotReady, ReconfigFailed

        try:
            status, body = self.handle(environ)
        except HttpError as e:
            status, body = e.status, {"error": e.message, "field": e.field}
        except SpecError as e:
            status, body = 400, {"error": str(e), "field": e.field}
        except (NotReady, ReconfigFailed) as e:
            status, body = 503, {"error": str(e), "field": None}
        except Exception as e:  # noqa: BLE001 - the API must answer, and log the bug
            log.exception("REST handler failed")
            status, body = 500, {"error": f"internal error: {type(e).__name__}: {e}", "field": None}
        data = json.dumps(body).encode()
        start_response(f"{status} {_REASONS.get(status, 'Error')}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]
