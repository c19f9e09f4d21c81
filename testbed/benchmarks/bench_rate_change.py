"""Live htb rate change: a spawned ``tc`` against netlink in-process (pyroute2), side by side.

    flock /tmp/orchestrrl-ovs.lock .venv/bin/python testbed/benchmarks/bench_rate_change.py [--changes 50]

Needs root. Makes one veth pair in the root namespace (``orlbr0``/``orlbr1``, recorded in the registry, removed
at the end) and one inside a private network namespace (a process started with ``unshare -n``, so the pair
dies with it), shapes one end, then changes its rate ``--changes`` times with each method in turn, the
methods interleaved so that machine noise hits them alike:

* ``spawn``: ``tc class change ...`` (through ``nsenter -t PID -n`` for the namespace), what the code did;
* ``netlink_once``: ``shaping.change_rate(...)``: a netlink socket opened for the one change;
* ``netlink_held``: ``Shaper.change_rate(...)`` on a socket kept open (what a live-rate loop uses).

Each change is checked: the rate read back through netlink must be the one just set. Prints one JSON document
with the median and p90 per method (ms) and the ratios of the medians. A benchmark reports; it asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from emulation import registry, shaping, signals  # noqa: E402
from emulation.netlink import Netlink  # noqa: E402

PAIR = ("orlbr0", "orlbr1")


def _tc_change(intf: str, rate_mbps: float, netns_pid: int | None) -> None:
    p = shaping.class_params(rate_mbps)
    argv = (["nsenter", "-t", str(netns_pid), "-n"] if netns_pid else []) + [
        "tc", "class", "change", "dev", intf, "parent", "1:", "classid", "1:1", "htb", "rate", p["rate"],
        "ceil", p["ceil"], "burst", str(p["burst"]), "cburst", str(p["cburst"]), "quantum", str(p["quantum"])]
    subprocess.run(argv, check=True, capture_output=True, timeout=10)


def _measure(intf: str, netns_pid: int | None, n: int) -> dict:
    shaping.shape_many([(intf, 100.0)], netns_pid)
    times: dict[str, list[float]] = {"spawn": [], "netlink_once": [], "netlink_held": []}
    mismatches = 0
    with shaping.Shaper(netns_pid) as held, shaping.Shaper(netns_pid) as reader:
        for i in range(n):
            for k, method in enumerate(times):
                rate = 100.0 + 3 * i + k + 1  # a new rate every change
                t0 = time.perf_counter()
                if method == "spawn":
                    _tc_change(intf, rate, netns_pid)
                elif method == "netlink_once":
                    shaping.change_rate(intf, rate, netns_pid)
                else:
                    held.change_rate(intf, rate)
                times[method].append((time.perf_counter() - t0) * 1000.0)
                got = reader.rate_mbps(intf)
                mismatches += got is None or abs(got - rate) > 1e-6
    out: dict = {}
    for method, xs in times.items():
        xs.sort()
        out[method] = {"median_ms": round(statistics.median(xs), 3), "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 3)}
    med = {m: v["median_ms"] for m, v in out.items()}
    out["spawn_over_netlink_held"] = round(med["spawn"] / med["netlink_held"], 1)
    out["spawn_over_netlink_once"] = round(med["spawn"] / med["netlink_once"], 1)
    out["readback_mismatches"] = mismatches
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=50, help="changes per method and namespace (default 50)")
    a = ap.parse_args(argv)
    if a.changes < 1:
        ap.error(f"--changes must be >= 1, got {a.changes}")
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 1
    # SIGINT/SIGTERM/SIGHUP unwind: the pairs and the namespace go
    rc, res = signals.run_torn_down(lambda: _bench(a.changes), "bench_rate_change",
                                    "; its veth pairs and namespace were removed")
    if rc:
        return rc
    print(json.dumps(res, indent=1))
    return 0


def _bench(changes: int) -> dict:
    """Both namespaces measured (:func:`main`'s document)."""
    res: dict = {"changes": changes, "cpus": os.cpu_count()}
    for name in PAIR:
        registry.record_resource("interface", name)
    try:
        subprocess.run(["ip", "link", "add", PAIR[0], "type", "veth", "peer", "name", PAIR[1]], check=True)
        subprocess.run(["ip", "link", "set", PAIR[0], "up"], check=True)
        res["root_namespace"] = _measure(PAIR[0], None, changes)
    finally:
        with Netlink() as nl:
            nl.delete_link(PAIR[0])
        for name in PAIR:
            registry.forget_resource("interface", name)
    ns = subprocess.Popen(["unshare", "-n", "sleep", "600"])  # a namespace like a Mininet host's
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{ns.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            if time.monotonic() > deadline:
                raise TimeoutError("unshare -n did not enter a new namespace")
            time.sleep(0.01)
        subprocess.run(["nsenter", "-t", str(ns.pid), "-n", "ip", "link", "add", "orlbn0", "type", "veth", "peer",
                        "name", "orlbn1"], check=True)
        res["host_namespace"] = _measure("orlbn0", ns.pid, changes)
    finally:
        ns.kill()
        ns.wait()
    return res


if __name__ == "__main__":
    sys.exit(main())
