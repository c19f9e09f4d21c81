"""The controller's REST API: a small WSGI app over a :class:`ControllerAPI` (no os-ken, no web framework).

Endpoints (JSON in, JSON out; ``Authorization: Bearer <token>`` unless the app was made with token None):

* ``GET  /api/v1/topology``  spec, layout, ToRs, OCSes, uplink wiring
* ``GET  /api/v1/circuits``  ``{"0": [[1, 3], [2, 4]], ...}``
* ``GET  /api/v1/state``     connected/expected dpids, ready, phase, busy
* ``GET  /api/v1/history``   every reconfiguration (done | deferred | rejected | failed) with timestamps
* ``POST /api/v1/circuits``  ``{"circuits": {"0": [[1, 3]]}, "delay_ms": 10, "window_ms": null, "gain_ms": null}``
* ``POST /api/v1/phase``     ``{"phase": "train", "delay_ms": 10, "window_ms": null, "gain_ms": null}``

POSTs answer after the reconfiguration completed, with its history record: ``status`` (done | deferred | ...)
and ``decision`` (switched | stalled | deferred, from ``controller.switching.decide_switch``) with
``stall_ms``. Errors are ``{"error": "<field>: <message>", "field": "<field>"}`` with 400 (bad input, and a
body that ends before its Content-Length: never executed), 401 (token), 404 (path), 405 (method), 408 (the body did not all arrive within
the read deadline), 411 (chunked body), 413 (body too large), 503 (fabric not ready / a switch did not confirm).
"""
from __future__ import annotations

import hmac
import json
import logging
import socket
import socketserver
import time
from typing import Any, Callable, Iterable, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from emulation.validation import SpecError

log = logging.getLogger(__name__)

PREFIX = "/api/v1"
MAX_BODY_BYTES = 256 * 1024
MAX_JSON_DEPTH = 32  # the bodies nest 4 deep; a 10,000-deep one must not reach a recursive parser
LISTEN_BACKLOG = 128  # socketserver's default of 5 made 11 of 50 concurrent clients retry their connect
READ_TIMEOUT_S = 5.0  # a client that stops sending (slow loris) loses its connection, not a thread for good; a
# request body must arrive whole within it (408 otherwise): loopback carries the largest (256 KiB) in milliseconds


class ControllerAPI(Protocol):
    def topology(self) -> dict: ...

    def circuits(self) -> dict: ...

    def state(self) -> dict: ...

    def history(self) -> list: ...

    def request_circuits(self, data: Any) -> dict: ...

    def request_phase(self, data: Any) -> dict: ...

    def record_rejected(self, kind: str, error: str) -> dict: ...


class Unavailable(Exception):
    """The fabric cannot serve the request now (not ready, a switch did not confirm): HTTP 503.

    The controller core's errors derive from it, so this module needs nothing from the core."""


class HttpError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _nesting_depth(text: str) -> int:
    """The deepest ``[``/``{`` nesting of a JSON text (brackets inside strings do not count)."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON (no NaN/Infinity), nested at most ``max_depth`` deep; HttpError 400 naming ``body``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HttpError(400, f"body: not UTF-8 ({e})", "body") from None
    depth = _nesting_depth(text) if text.count("[") + text.count("{") > max_depth else 0
    if depth > max_depth:  # checked before parsing: json and the validators recurse once per level
        raise HttpError(400, f"body: nested {depth} levels deep; at most {max_depth} are accepted", "body")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise HttpError(400, f"body: malformed JSON: {e}", "body") from None


def _read_body(environ: dict, max_bytes: int) -> bytes:
    """The body, all ``Content-Length`` bytes of it, or an HttpError: 400 when it ends early (the client closed
    or half-closed: the request is never executed), 408 when it has not all arrived within the deadline
    (``orl.body_deadline_s`` from the server, for the whole body, not per read: a client trickling a byte
    at a time is cut off too)."""
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
    stream = environ["wsgi.input"]
    sock = environ.get("orl.socket")
    limit = float(environ.get("orl.body_deadline_s", READ_TIMEOUT_S))
    deadline = time.monotonic() + limit
    read = getattr(stream, "read1", stream.read)
    chunks, got = [], 0
    old_timeout = sock.gettimeout() if sock is not None else None
    try:
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if sock is not None:
                sock.settimeout(left)
            b = read(n - got)
            if not b:
                raise HttpError(400, f"body: ended after {got} of the {n} bytes its Content-Length declares; "
                                     "nothing was done", "body")
            chunks.append(b)
            got += len(b)
    except (TimeoutError, socket.timeout):
        raise HttpError(408, f"body: {got} of the {n} bytes its Content-Length declares arrived within "
                             f"{limit:g} s; nothing was done", "body") from None
    finally:
        if sock is not None:
            sock.settimeout(old_timeout)  # the answer is written under the connection's own timeout
    return b"".join(chunks)


class RestApp:
    """WSGI callable. ``token`` None disables authentication (only with an explicit --no-auth).

    ``on_answer(method, endpoint, status)``: called once per answered request (the controller's metrics);
    ``endpoint`` is the name under /api/v1/ (``other`` for anything else)."""

    def __init__(self, api: ControllerAPI, token: str | None, max_body_bytes: int = MAX_BODY_BYTES,
                 on_answer: Callable[[str, str, int], None] | None = None):
        self.api = api
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.on_answer = on_answer
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
        try:
            status, body = self.handle(environ)
        except HttpError as e:
            status, body = e.status, {"error": e.message, "field": e.field}
        except SpecError as e:
            status, body = 400, {"error": str(e), "field": e.field}
        except Unavailable as e:
            status, body = 503, {"error": str(e), "field": None}
        except Exception as e:  # noqa: BLE001 - the API must answer, and log the bug
            log.exception("REST handler failed")
            status, body = 500, {"error": f"internal error: {type(e).__name__}: {e}", "field": None}
        if self.on_answer is not None:
            path = environ.get("PATH_INFO", "") or "/"
            name = path[len(PREFIX) + 1:].rstrip("/") if path.startswith(PREFIX + "/") else "other"
            try:
                self.on_answer(str(environ.get("REQUEST_METHOD", "GET")).upper(), name, status)
            except Exception:  # noqa: BLE001 - counting must never cost the answer
                log.exception("REST metrics hook failed")
        data = json.dumps(body).encode()
        start_response(f"{status} {_REASONS.get(status, 'Error')}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]


# ---- the HTTP server --------------------------------------------------------------------------------------
class RestServer(socketserver.ThreadingMixIn, WSGIServer):
    """Threading WSGI server: one thread per connection, a deep listen backlog, a read timeout per client."""

    daemon_threads = True  # a request in flight never blocks the process from exiting
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def handle_error(self, request, client_address) -> None:
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (TimeoutError, ConnectionError)):  # a slow or vanished client: not a bug
            log.debug("REST client %s: %s", client_address, exc)
            return
        log.exception("REST connection from %s failed", client_address)


class _QuietHandler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # socketserver applies it to the connection (every read and write)

    def get_environ(self) -> dict:
        env = super().get_environ()
        env["orl.socket"] = self.connection  # the body's read deadline is set on it (_read_body)
        env["orl.body_deadline_s"] = float(self.timeout)
        return env

    def log_message(self, format: str, *args: Any) -> None:  # access log through logging, not stderr
        logging.getLogger("controller.rest.access").debug("%s " + format, self.address_string(), *args)


def make_server(host: str, port: int, app: Callable | None = None,
                read_timeout_s: float = READ_TIMEOUT_S) -> RestServer:
    """A bound :class:`RestServer` (OSError when the address is taken); serve with ``serve_forever``."""
    handler = type("RestHandler", (_QuietHandler,), {"timeout": float(read_timeout_s)})
    server = RestServer((host, port), handler)
    if app is not None:
        server.set_app(app)
    return server
