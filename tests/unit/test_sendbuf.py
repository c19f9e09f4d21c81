"""Open vSwitch's shared send socket (emulation/sendbuf.py): found in ``ss`` output however ss wraps it, and
judged by its size and the sysctl it is made from."""
from __future__ import annotations

from emulation import sendbuf

# as `ss -0 -a -m -p` prints it on Debian 12 (one line per socket), the per-port receive sockets beside it
ONE_LINE = """Netid State  Recv-Q Send-Q Local Address:Port       Peer Address:PortProcess
p_raw UNCONN 0      0                [0]:*                      *     users:(("ovs-vswitchd",pid=2500,fd=84)) skmem:(r0,rb212992,t0,tb212992,f0,w0,o0,bl0,d0)
p_raw UNCONN 0      0                  *:orlo0-eth5             *     users:(("ovs-vswitchd",pid=2500,fd=40)) skmem:(r0,rb8388608,t0,tb8388608,f0,w0,o176,bl0,d0)
"""
# skmem on a continuation line (ss wraps long lines on a terminal); another program's unbound socket first
WRAPPED = """Netid State  Recv-Q Send-Q Local Address:Port Peer Address:PortProcess
p_raw UNCONN 0      0      [0]:*      *     users:(("dhclient",pid=11,fd=3))
\t skmem:(r0,rb212992,t0,tb4096,f0,w0,o0,bl0,d0)
p_raw UNCONN 0      0      [0]:*      *     users:(("ovs-vswitchd",pid=9,fd=71))
\t skmem:(r0,rb212992,t0,tb8388608,f0,w0,o0,bl0,d0)
"""


def test_the_send_socket_is_the_unbound_one_of_vswitchd():
    assert sendbuf.vswitchd_send_buffer(ONE_LINE) == 212992
    assert sendbuf.vswitchd_send_buffer(WRAPPED) == 8388608
    assert sendbuf.vswitchd_send_buffer(ONE_LINE.splitlines()[0]) is None  # none yet: made at the first send


def test_the_check_names_what_is_short(monkeypatch, tmp_path):
    f = tmp_path / "wmem_default"
    monkeypatch.setattr(sendbuf, "WMEM_DEFAULT", f)
    monkeypatch.setattr(sendbuf.subprocess, "run",
                        lambda *a, **k: type("R", (), {"stdout": ONE_LINE})())
    f.write_text("212992\n")
    ok, msg = sendbuf.check()
    assert not ok and "net.core.wmem_default is 212992" in msg
    f.write_text(f"{sendbuf.WANT_BYTES}\n")
    ok, msg = sendbuf.check()  # raised, but vswitchd's socket was made before: it needs a restart
    assert not ok and "restart ovs-vswitchd" in msg and "212992" in msg
    monkeypatch.setattr(sendbuf.subprocess, "run", lambda *a, **k: type("R", (), {"stdout": WRAPPED})())
    assert sendbuf.check() == (True, f"net.core.wmem_default={sendbuf.WANT_BYTES}, ovs-vswitchd's send socket "
                                     "8388608 bytes")
    f.unlink()
    assert not sendbuf.check()[0]
