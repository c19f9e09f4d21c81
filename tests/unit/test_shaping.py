"""emulation.shaping / emulation.netlink without touching an interface: parameters, input checks, typed errors."""
from __future__ import annotations

import pytest

from emulation import shaping
from emulation.netlink import Netlink, NoSuchLink
from emulation.validation import SpecError


def test_class_params_keep_scaled_rates_and_the_burst():
    """A payload rate is shaped at its frame rate (1,514-byte frames carry 1,448 bytes of TCP payload)."""
    p = shaping.class_params(0.4)
    assert p == {"rate": "418kbit", "ceil": "418kbit", "burst": shaping.BURST_BYTES, "cburst": shaping.BURST_BYTES,
                 "quantum": shaping.QUANTUM_BYTES}
    assert shaping.class_params(40000.0)["rate"] == "41823204kbit"  # above 32 bits of bytes/s: pyroute2's rate64
    assert shaping.WIRE_PER_PAYLOAD == pytest.approx(1.0456, abs=1e-4)


def test_small_packets_have_a_class_of_their_own_inside_the_link_rate():
    from emulation.netlink import BULK_HANDLE, SMALL_HANDLE

    kids = shaping.child_params(20.0)
    (small, p_small), (bulk, p_bulk) = kids[SMALL_HANDLE], kids[BULK_HANDLE]
    assert list(kids) == [SMALL_HANDLE, BULK_HANDLE]  # the first takes the filter, the last is the default
    assert (p_small, p_bulk) == (0, 1)  # the small ones go first
    assert small["rate"] == "418kbit"  # 2% guaranteed
    assert bulk == shaping.class_params(20.0)  # the bulk at the link's rate: it never borrows
    assert small["ceil"] == shaping.class_params(20.0)["ceil"]  # the small ones may borrow up to the link's rate
    assert shaping.SMALL_BYTES & (shaping.SMALL_BYTES - 1) == 0  # the u32 mask needs a power of two
    with pytest.raises(SpecError):
        shaping.child_params(0)


@pytest.mark.parametrize("rate", [0, -1, float("nan"), float("inf"), True, "fast", shaping.MAX_RATE_MBPS * 2])
def test_bad_rates_are_refused_before_any_request(rate):
    with pytest.raises(SpecError) as e:
        shaping.change_rate("orlt0-eth3", rate)
    assert e.value.field == "rate_mbps"


@pytest.mark.parametrize("name", ["", "a" * 16, "has space", "a/b", 3])
def test_bad_interface_names_are_refused(name):
    with pytest.raises(SpecError) as e:
        shaping.change_rate(name, 100.0)
    assert e.value.field == "intf_name"


@pytest.mark.parametrize("pid", [0, -3, True, "12"])
def test_bad_namespace_pid(pid):
    with pytest.raises(SpecError) as e:
        Netlink(pid)
    assert e.value.field == "netns_pid"


def test_a_missing_interface_is_a_typed_error():
    with Netlink() as nl:
        with pytest.raises(NoSuchLink) as e:
            nl.index("orl-no-such0")
        assert e.value.name == "orl-no-such0" and e.value.errno == 19
        assert nl.delete_link("orl-no-such0") is False
        assert "lo" in nl.link_names()


def test_a_gone_namespace_is_a_typed_error():
    from emulation.netlink import NetlinkFailed

    with pytest.raises(NetlinkFailed) as e:
        Netlink(2 ** 22 + 12345)  # above pid_max: no such process, no such namespace
    assert e.value.errno == 2 and "namespace" in str(e.value)
