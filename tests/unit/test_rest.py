"""controller.rest: the WSGI app over a FabricController with a fake datapath (no os-ken event loop).

Every bad input gets the right status, an error naming the field, and sends nothing to the switches."""
from __future__ import annotations

import io
import json
import threading

import pytest

from controller import phases
from controller.rest import MAX_BODY_BYTES, RestApp
from controller.runtime import FabricController
from emulation.spec import FabricSpec, JobLayout
from fakes_controller import FakeClock, FakeDriver
from raw_http import raw_post

SPEC = FabricSpec()
LAYOUT = JobLayout()
TOKEN = "t0ken-" + "x" * 20


@pytest.fixture
def fab(connected_core):
    core, drv, _ = connected_core(SPEC, LAYOUT)
    return core, drv, RestApp(core, TOKEN)


def call(app, method, path, body=None, raw=None, token=TOKEN, headers=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
    env = {"REQUEST_METHOD": method, "PATH_INFO": path, "wsgi.input": io.BytesIO(data),
           "CONTENT_LENGTH": str(len(data)) if data else ""}
    if token is not None:
        env["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    env.update(headers or {})
    out = {}

    def start_response(status, hdrs):
        out["status"] = int(status.split()[0])
        out["headers"] = dict(hdrs)

    payload = b"".join(app(env, start_response))
    assert out["headers"]["Content-Type"] == "application/json"
    return out["status"], json.loads(payload)


def test_gets(fab):
    core, drv, app = fab
    st, topo = call(app, "GET", "/api/v1/topology")
    assert st == 200 and len(topo["tors"]) == SPEC.n_tors and len(topo["uplinks"]) == SPEC.n_tors * 2
    assert topo["ocses"][0]["dpid"] == SPEC.ocs_dpid(0)
    st, circ = call(app, "GET", "/api/v1/circuits")
    assert st == 200 and circ == {"0": phases.phase_matchings(SPEC, LAYOUT, "train")[0].to_json()}
    st, state = call(app, "GET", "/api/v1/state")
    assert st == 200 and state["ready"] and state["phase"] == "train" and not state["busy"]
    assert state["connected"] == state["expected"] and state["missing"] == []
    st, hist = call(app, "GET", "/api/v1/history")
    assert st == 200 and hist[0]["source"] == "initial"
    assert drv.sent() == []


def test_post_circuits_changes_only_listed_and_reports(fab):
    core, drv, app = fab
    cur = core.matchings[0].pairs()
    (a, b), (c, d) = cur[0], cur[1]
    new = [[a, c], [b, d]] + [list(p) for p in cur[2:]]
    st, rep = call(app, "POST", "/api/v1/circuits", {"circuits": {"0": new}, "delay_ms": 0})
    assert st == 200 and rep["status"] == "done", rep
    assert rep["changes"]["ocs"]["0"]["unchanged"] == len(cur) - 2
    assert set(rep["t_ms"]) >= {"received", "routes_moved", "dark_sent", "dark_confirmed", "new_sent",
                                "confirmed", "final_routes"}
    ocs_ops = [e for e in drv.log if e[0] == "ocs"]
    touched = {dict(f.match)["in_port"] for e in ocs_ops for f in e[2] + e[3]}
    assert touched == {a, b, c, d}
    assert call(app, "GET", "/api/v1/circuits")[1] == {"0": sorted(sorted(p) for p in new)}
    assert call(app, "GET", "/api/v1/state")[1]["phase"] is None  # custom circuits: no phase


def test_post_phase(fab):
    core, drv, app = fab
    st, rep = call(app, "POST", "/api/v1/phase", {"phase": "sync", "delay_ms": 10})
    assert st == 200 and rep["status"] == "done" and rep["phase"] == "sync"
    assert core.phase == "sync" and drv.sent()


BAD = [
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 99]]}}, None, 400, "circuits.0[0]"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2], [2, 3]]}}, None, 400, "circuits.0[1]"),
    ("POST", "/api/v1/circuits", {"circuits": {"7": [[1, 2]]}}, None, 400, "circuits.7"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2]]}, "bogus": 1}, None, 400, "bogus"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [["1", 2]]}}, None, 400, "circuits.0[0]"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2]]}, "delay_ms": "fast"}, None, 400, "delay_ms"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2]]}, "delay_ms": -1}, None, 400, "delay_ms"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2]]}, "delay_ms": 60001}, None, 400, "delay_ms"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2]]}, "window_ms": True}, None, 400, "window_ms"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2]]}, "gain_ms": -3600000.5}, None, 400, "gain_ms"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2]]}, "gain_ms": [1]}, None, 400, "gain_ms"),
    ("POST", "/api/v1/phase", {"phase": "gen", "gain_ms": 3600001}, None, 400, "gain_ms"),
    ("POST", "/api/v1/phase", {"phase": "gen", "gain_ms": False}, None, 400, "gain_ms"),
    ("POST", "/api/v1/phase", None, b'{"phase": "gen", "gain_ms": Infinity}', 400, "body"),
    ("POST", "/api/v1/circuits", None, b"{not json", 400, "body"),
    ("POST", "/api/v1/circuits", None, b'{"circuits": {"0": []}, "delay_ms": NaN}', 400, "body"),
    ("POST", "/api/v1/circuits", None, b"", 400, "body"),
    ("POST", "/api/v1/phase", {"phase": "bogus"}, None, 400, "phase"),
    ("POST", "/api/v1/phase", {"phase": 3}, None, 400, "phase"),
    ("POST", "/api/v1/phase", {"phase": "gen", "window": 3}, None, 400, "window"),
    ("POST", "/api/v1/phase", ["gen"], None, 400, ""),
    # the fault corpus: recursion, overflow, non-ASCII digits (each was a 500 or a wrong success)
    ("POST", "/api/v1/circuits", None, b"[" * 10000 + b"]" * 10000, 400, "body"),
    ("POST", "/api/v1/circuits", None, b'{"circuits": ' + b'{"a": ' * 40 + b"1" + b"}" * 41, 400, "body"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2]]}, "delay_ms": 10 ** 400}, None, 400, "delay_ms"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2]]}, "window_ms": 10 ** 400}, None, 400, "window_ms"),
    ("POST", "/api/v1/phase", {"phase": "gen", "delay_ms": 10 ** 400}, None, 400, "delay_ms"),
    ("POST", "/api/v1/circuits", None, b'{"circuits": {"0": []}, "delay_ms": 1' + b"0" * 5000 + b"}", 400, "body"),
    ("POST", "/api/v1/circuits", {"circuits": {"\u0660": [[1, 2]]}}, None, 400, "circuits.\u0660"),
    ("POST", "/api/v1/circuits", {"circuits": {"\u00b2": [[1, 2]]}}, None, 400, "circuits.\u00b2"),
    ("POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2]]}, "delay_ms": 60001}, None, 400, "delay_ms"),
    ("POST", "/api/v1/phase", {"phase": ["gen"]}, None, 400, "phase"),
    ("POST", "/api/v1/nothing", {}, None, 404, "path"),
    ("GET", "/elsewhere", None, None, 404, "path"),
    ("GET", "/api/v1/phase", None, None, 405, "method"),
    ("POST", "/api/v1/state", {}, None, 405, "method"),
    ("DELETE", "/api/v1/circuits", None, None, 405, "method"),
]


@pytest.mark.parametrize("method,path,body,raw,status,field", BAD)
def test_bad_input_names_field_and_changes_nothing(fab, method, path, body, raw, status, field):
    core, drv, app = fab
    before = core.circuits()
    st, err = call(app, method, path, body=body, raw=raw)
    assert st == status, err
    assert err["field"] == field and isinstance(err["error"], str) and err["error"]
    if field:
        assert field in err["error"]
    assert drv.sent() == [] and drv.log == []
    assert core.circuits() == before
    assert len(err["error"]) < 500  # the input is quoted briefly, never echoed whole


def test_rejected_posts_are_in_history(fab):
    core, drv, app = fab
    call(app, "POST", "/api/v1/circuits", {"circuits": {"0": [[1, 2], [2, 3]]}})
    call(app, "POST", "/api/v1/phase", raw=b"[")
    hist = call(app, "GET", "/api/v1/history")[1]
    assert [h["status"] for h in hist[-2:]] == ["rejected", "rejected"]
    assert "circuits.0[1]" in hist[-2]["error"] and "body" in hist[-1]["error"]


def test_body_too_large_is_413_and_unread(fab):
    core, drv, app = fab
    raw = b"{" + b" " * (MAX_BODY_BYTES + 1) + b"}"
    st, err = call(app, "POST", "/api/v1/circuits", raw=raw)
    assert st == 413 and err["field"] == "body"
    assert drv.log == []


@pytest.mark.parametrize("token,headers", [
    (None, None), ("wrong-token-xxxxxxxxxxxx", None),
    (None, {"HTTP_AUTHORIZATION": "Basic dXNlcjpwdw=="}), (None, {"HTTP_AUTHORIZATION": "Bearer "})])
def test_token_required(fab, token, headers):
    core, drv, app = fab
    for method, path, body in (("GET", "/api/v1/state", None),
                               ("POST", "/api/v1/phase", {"phase": "gen"})):
        st, err = call(app, method, path, body=body, token=token, headers=headers)
        assert st == 401 and err["field"] == "Authorization"
    assert drv.log == [] and core.phase == "train"


def test_no_auth_only_when_token_is_none(fab):
    core, drv, _ = fab
    st, _ = call(RestApp(core, None), "GET", "/api/v1/state", token=None)
    assert st == 200


def test_deferred_reply(fab):
    core, drv, app = fab
    st, rep = call(app, "POST", "/api/v1/phase", {"phase": "gen", "delay_ms": 10, "window_ms": 8})
    assert st == 200 and rep["status"] == "deferred" and "window_ms" in rep["reason"]
    assert drv.log == [] and core.phase == "train"
    assert call(app, "GET", "/api/v1/history")[1][-1]["status"] == "deferred"


@pytest.mark.parametrize("body,status,decision,stall,sent", [
    ({"window_ms": 8, "gain_ms": 2.5}, "done", "stalled", 2.0, True),
    ({"window_ms": 8, "gain_ms": 2.0}, "deferred", "deferred", 0.0, False),
    ({"window_ms": 8}, "deferred", "deferred", 0.0, False),
    ({"window_ms": 12, "gain_ms": 0}, "done", "switched", 0.0, True),
    ({"window_ms": 12000, "gain_ms": -250}, "deferred", "deferred", 0.0, False),  # slower: never, however long
    ({}, "done", "switched", 0.0, True),
])
def test_phase_reply_carries_the_decision(fab, body, status, decision, stall, sent):
    core, drv, app = fab
    st, rep = call(app, "POST", "/api/v1/phase", {"phase": "gen", "delay_ms": 10, **body})
    assert st == 200 and rep["status"] == status and rep["decision"] == decision
    assert rep["stall_ms"] == pytest.approx(stall) and rep["reason"]
    assert bool(drv.sent()) is sent and core.phase == ("gen" if sent else "train")
    assert call(app, "GET", "/api/v1/history")[1][-1]["decision"] == decision


def test_not_ready_is_503():
    clock = FakeClock()
    drv = FakeDriver(clock, 1)
    core = FabricController(SPEC, LAYOUT, drv, clock, threading.Lock(), delay_ms=SPEC.reconfig_delay_ms)
    st, err = call(RestApp(core, TOKEN), "POST", "/api/v1/phase", {"phase": "gen"})
    assert st == 503 and "missing" in err["error"]
    assert drv.log == []


# ---- the HTTP server itself: backlog, concurrency, a client that stops sending ------------------------------
@pytest.fixture
def served(fab):
    from controller.rest import make_server

    core, drv, app = fab
    server = make_server("127.0.0.1", 0, app, read_timeout_s=0.5)
    t = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    t.start()
    try:
        yield server.server_address, core
    finally:
        server.shutdown()
        server.server_close()
        t.join(timeout=10)


def _get_state(addr) -> int:
    import urllib.request

    req = urllib.request.Request(f"http://{addr[0]}:{addr[1]}/api/v1/state",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=20) as r:
        return r.status


def test_listen_backlog_is_deep():
    from controller.rest import LISTEN_BACKLOG, RestServer

    assert RestServer.request_queue_size == LISTEN_BACKLOG >= 50


def test_fifty_concurrent_requests_all_answered(served):
    addr, _ = served
    results: list = []
    start = threading.Barrier(50)

    def one():
        start.wait(timeout=10)
        try:
            results.append(_get_state(addr))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            results.append(e)

    threads = [threading.Thread(target=one) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [200] * 50


def test_a_client_that_stops_sending_is_cut_off_and_others_are_served(served):
    import socket
    import time

    addr, _ = served
    slow = socket.create_connection(addr, timeout=10)
    try:
        slow.sendall(b"GET /api/v1/state HTTP/1.1\r\nHost: x\r\n")  # ... and never the blank line
        assert _get_state(addr) == 200  # the stalled connection holds no one up
        deadline = time.monotonic() + 10
        closed = False
        while time.monotonic() < deadline and not closed:
            try:
                closed = slow.recv(4096) == b""  # the server timed the read out and closed
            except socket.timeout:
                pass
        assert closed
    finally:
        slow.close()


def test_a_body_shorter_than_its_content_length_is_refused_and_never_executed(served):
    addr, core = served
    body = json.dumps({"phase": "gen"}).encode()  # 16 bytes of a declared 50
    st, err, _ = raw_post(addr, TOKEN, body, 50, "half-close")
    assert st == 400 and err["field"] == "body" and "ended after 16 of the 50 bytes" in err["error"]
    assert core.phase == "train"  # not executed
    assert core.history()[-1]["status"] == "rejected" and "ended after" in core.history()[-1]["error"]


def test_a_stalled_body_gets_408_within_the_read_deadline(served):
    addr, core = served  # the fixture's server reads with a 0.5 s deadline
    st, err, took = raw_post(addr, TOKEN, b'{"phase": ', 50, "stall")
    assert st == 408 and err["field"] == "body" and "10 of the 50 bytes" in err["error"]
    assert took < 5.0
    assert core.phase == "train" and core.history()[-1]["status"] == "rejected"


def test_a_trickling_body_is_cut_off_by_the_whole_body_deadline(served):
    """A byte every 0.2 s never trips a 0.5 s per-read timeout; the deadline is for the whole body."""
    import socket
    import time

    addr, core = served
    s = socket.create_connection(addr, timeout=10)
    try:
        s.sendall(f"POST /api/v1/phase HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                  f"Content-Length: 50\r\n\r\n".encode())
        t0 = time.monotonic()
        s.setblocking(False)
        data = b""
        while time.monotonic() - t0 < 5.0:
            try:
                s.sendall(b" ")
            except OSError:
                pass
            try:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            except BlockingIOError:
                pass
            time.sleep(0.2)
    finally:
        s.close()
    assert data.split()[1] == b"408", data[:200]
    assert core.phase == "train"
