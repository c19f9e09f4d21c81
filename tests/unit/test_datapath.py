"""The controller's datapath flow-cache flush: the unixctl client against a fake ovs-vswitchd socket, the
socket discovery, and the ``datapath_flush`` option's validation."""
from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from controller.config import ControllerOptions, check_config
from controller.datapath import FlowCache, FlowCacheError, open_flow_cache, vswitchd_socket
from emulation.validation import SpecError


class FakeVswitchd:
    """A unixctl socket that answers each request with ``reply(method, params)`` (a dict) and records it."""

    def __init__(self, rundir, reply, pid=4242):
        self.path = rundir / f"ovs-vswitchd.{pid}.ctl"
        (rundir / "ovs-vswitchd.pid").write_text(f"{pid}\n")
        self.reply, self.got = reply, []
        self.closed = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                req = json.loads(conn.recv(65536))
                self.got.append((req["method"], req["params"]))
                out = self.reply(req["method"], req["params"])
                if out is None:
                    self.closed.wait(5.0)  # silent until the test is done: the client's timeout ends it
                else:
                    data = json.dumps(dict(out, id=req["id"])).encode()
                    conn.sendall(data[:5])  # a reply in pieces is read whole
                    conn.sendall(data[5:])

    def close(self):
        self.closed.set()
        self.sock.close()


@pytest.fixture
def rundir(tmp_path, monkeypatch):
    d = tmp_path / "ovs"
    d.mkdir()
    monkeypatch.setenv("OVS_RUNDIR", str(d))
    return d


def test_purge_sends_revalidator_purge_and_reads_the_reply(rundir):
    fake = FakeVswitchd(rundir, lambda m, p: {"result": "", "error": None})
    try:
        assert vswitchd_socket() == fake.path
        cache = open_flow_cache("auto")
        assert isinstance(cache, FlowCache) and cache.path == fake.path
        assert cache.purge() >= 0.0
        assert fake.got == [("revalidator/purge", [])]
        assert open_flow_cache("on").path == fake.path
    finally:
        fake.close()


def test_an_error_reply_or_a_dead_socket_is_a_flow_cache_error(rundir):
    fake = FakeVswitchd(rundir, lambda m, p: {"result": None, "error": f"\"{m}\" is not a valid command"})
    try:
        with pytest.raises(FlowCacheError, match="not a valid command"):
            FlowCache(fake.path).purge()
    finally:
        fake.close()
    with pytest.raises(FlowCacheError, match="revalidator/purge"):
        FlowCache(rundir / "gone.ctl").purge()


def test_a_silent_vswitchd_times_out(rundir):
    fake = FakeVswitchd(rundir, lambda m, p: None)  # reads the request, never answers
    try:
        with pytest.raises(FlowCacheError, match="timed out"):
            FlowCache(fake.path, timeout_s=0.2).purge()
    finally:
        fake.close()


def test_modes_without_a_vswitchd(rundir):
    assert vswitchd_socket() is None
    assert open_flow_cache("auto") is None and open_flow_cache("off") is None
    with pytest.raises(SpecError) as ei:
        open_flow_cache("on")
    assert ei.value.field == "datapath_flush" and str(rundir) in str(ei.value)
    (rundir / "ovs-vswitchd.pid").write_text("not a pid\n")
    assert vswitchd_socket() is None


@pytest.mark.parametrize("mode", ["sometimes", "ON", ""])
def test_check_config_names_a_bad_datapath_flush(mode):
    opts = ControllerOptions(spec_json='{"fabric": {}}', of_port=1234, rest_port=4321, no_auth=True,
                             datapath_flush=mode)
    with pytest.raises(SpecError) as ei:
        check_config(opts)
    assert ei.value.field == "datapath_flush"


def test_check_config_stops_on_flush_on_without_a_vswitchd(rundir):
    opts = ControllerOptions(spec_json='{"fabric": {}}', of_port=1234, rest_port=4321, no_auth=True,
                             datapath_flush="on")
    with pytest.raises(SpecError) as ei:
        check_config(opts)
    assert ei.value.field == "datapath_flush"
    assert check_config(ControllerOptions(spec_json='{"fabric": {}}', of_port=1234, rest_port=4321, no_auth=True,
                                          datapath_flush="auto")).datapath_flush == "auto"
    assert os.listdir(rundir) == []  # nothing created
