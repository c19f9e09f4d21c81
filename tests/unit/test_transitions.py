"""What an application sees during a reconfiguration, on a fake fabric (ToR tables + OCS tables, install
latency, fake clock): a packet walk between every pair of servers after every flow change.

Goals (issue 8): a path whose ToR routes must move to other uplinks is dark for D, like the circuits (its
routes toward the new circuits are in place when they light up); a path with a stable alternative, and an
unchanged path, loses nothing; no mixed state ever loops."""
from __future__ import annotations

import random

import pytest

from controller import phases, routing
from controller.ocs import Matching
from controller.reconfig.executor import execute_plan
from controller.reconfig.plan import plan_reconfig
from controller.tor_sync import TorTables, tor_ops
from emulation.spec import FabricSpec, JobLayout
from fakes_controller import FakeClock, FakeDriver, FakeTorTable

INSTALL_S, RTT_S = 0.0035, 0.0005


class FabricModel(FakeDriver):
    """FakeDriver whose ToR route changes land in fake ToR tables ``install_s`` after they are sent (the
    call returns at its barrier, like the app's), with a packet walk over ToRs and OCSes."""

    def __init__(self, spec: FabricSpec, clock: FakeClock):
        super().__init__(clock, spec.ocs_count, install_s=INSTALL_S, rtt_s=RTT_S)
        self.spec = spec
        self.tors = {t: FakeTorTable() for t in range(spec.n_tors)}
        self.timeline: list[tuple[float, dict]] = []  # (time, {(src, dst): status}) after every change
        for o, table in self.tables.items():
            orig = table.apply

            def applied(deletes, adds, _orig=orig):
                _orig(deletes, adds)
                self.snapshot()

            table.apply = applied

    def apply_route_changes(self, changes, full=False):
        self.log.append(("routes", changes, full))
        held = {t: TorTables() for t in range(self.spec.n_tors)} if full else {}
        ops = tor_ops(changes, full, held)

        def land():
            for op in ops:
                self.tors[op.tor].apply(op)
            self.snapshot()

        self.clock.at(self.clock.now() + self.install_s, land)
        self.clock.advance_to(self.clock.now() + self.install_s + self.rtt_s)

    # ---- the data plane ----
    def walk(self, src: int, dst: int) -> str:
        """'ok' (every select-group bucket delivers), 'partial', 'dark' (none does) or 'loop'."""
        spec = self.spec
        ip = spec.host_ip(dst)

        def at(tor: int, seen: frozenset) -> list[str]:
            if tor in seen:
                return ["loop"]
            flows = self.tors[tor].flows
            act = None
            for prio in (routing.LOCAL_PRIORITY, routing.REMOTE_PRIORITY):
                act = flows.get((prio, (("eth_type", routing.ETH_TYPE_IPV4), ("ipv4_dst", ip))))
                if act:
                    break
            if not act:
                return ["dark"]
            kind, arg = act[0]
            if kind == "output":
                return ["ok" if tor == spec.tor_of_server(dst) and arg == spec.server_port(dst) else "dark"]
            out = []
            for port in self.tors[tor].groups.get(arg, ()):
                up = spec.uplink(tor, port - spec.servers_per_tor - 1)
                peer_port = self.tables[up.ocs].lookup(up.ocs_port)
                owner = spec.ocs_port_owner(up.ocs, peer_port) if peer_port is not None else None
                out += at(owner.tor, seen | {tor}) if owner is not None else ["dark"]
            return out or ["dark"]

        res = at(spec.tor_of_server(src), frozenset())
        if "loop" in res:
            return "loop"
        return "ok" if set(res) == {"ok"} else ("dark" if "ok" not in res else "partial")

    def snapshot(self) -> None:
        n = self.spec.n_servers
        pairs = [(s, d) for s in range(n) for d in range(n)
                 if self.spec.tor_of_server(s) != self.spec.tor_of_server(d)]
        self.timeline.append((self.clock.now(), {p: self.walk(*p) for p in pairs}))

    def not_ok_s(self, pair, t_end: float) -> float:
        """Seconds ``pair`` was not fully delivering, over the recorded timeline up to ``t_end``."""
        total = 0.0
        for (t0, st), (t1, _) in zip(self.timeline, self.timeline[1:] + [(t_end, None)]):
            if st[pair] != "ok":
                total += t1 - t0
        return total


def install(spec, layout_or_matchings, clock=None):
    """A fabric model holding ``matchings`` with their routes, as after the controller's initial install."""
    clock = clock or FakeClock()
    fab = FabricModel(spec, clock)
    target = layout_or_matchings
    empty = {o: Matching.empty(spec.ports_per_ocs) for o in range(spec.ocs_count)}
    first = plan_reconfig(spec, empty, None, target)
    execute_plan(first, 0.0, fab, clock)
    clock.advance_to(clock.pending_until() + 1.0)
    fab.timeline.clear()
    return fab, first.final_routes


def run(spec, cur, routes, target, delay_ms, fab, clock):
    plan = plan_reconfig(spec, cur, routes, target)
    fab.snapshot()
    t0 = clock.now()
    ex = execute_plan(plan, delay_ms, fab, clock)
    clock.advance_to(clock.pending_until() + 0.05)
    fab.snapshot()
    return plan, ex, t0, clock.now()


def stable_reachable(spec, cur, target):
    g = phases.circuit_graph(spec, {o: Matching(m.n_ports, m.circuits & target[o].circuits) for o, m in cur.items()})
    r = routing.compute_routes(spec, g)
    return lambda s, d: r.reachable(spec.tor_of_server(s), spec.tor_of_server(d))


def check(spec, cur, target, delay_ms, slack_s=0.0):
    clock = FakeClock()
    fab, routes = install(spec, cur, clock)
    assert all(v == "ok" for v in fab.timeline[-1][1].values()) if fab.timeline else True
    plan, ex, t0, t1 = run(spec, cur, routes, target, delay_ms, fab, clock)
    assert not any(v == "loop" for _, st in fab.timeline for v in st.values()), "a mixed state looped"
    final_ok = {p for p, v in fab.timeline[-1][1].items() if v == "ok"}
    tor = spec.tor_of_server

    def reachable_on(matchings):
        r = routing.compute_routes(spec, phases.circuit_graph(spec, matchings))
        return lambda s, d: r.reachable(tor(s), tor(d))

    before, after, stable = reachable_on(cur), reachable_on(target), stable_reachable(spec, cur, target)
    lit = ex.t.get("new_sent", t0) + INSTALL_S  # when the new circuits light up
    worst = 0.0
    for p in fab.timeline[-1][1]:
        if not after(*p):
            continue
        assert p in final_ok, p
        if not before(*p):  # had no path: delivers from the moment the new circuits light up
            first_ok = min(t for t, st in fab.timeline if st[p] == "ok")
            assert first_ok <= lit + 1e-9, (p, (first_ok - lit) * 1000)
            continue
        dark = fab.not_ok_s(p, t1)
        if stable(*p):  # a stable path existed: make before break, never dark
            assert dark == 0.0, (p, dark)
        else:  # dark for the switching delay, like the circuits: no longer
            assert dark <= delay_ms / 1000.0 + slack_s + 1e-9, (p, dark * 1000)
            worst = max(worst, dark)
    return plan, ex, worst


# the benchmark's two cases on the default scenario's fabric (2 pods x 2 ToRs x 2 servers, 1 OCS, 2 uplinks)
DEFAULT = FabricSpec()


def m(*pairs):
    return {0: Matching.from_pairs(DEFAULT.ports_per_ocs, [list(p) for p in pairs])}


REPAIRED = (m((1, 3), (2, 4), (5, 7), (6, 8)), m((1, 4), (2, 3), (5, 7), (6, 8)))
REROUTED = (m((1, 3), (2, 6), (4, 8), (5, 7)), m((2, 4), (1, 6), (3, 8), (5, 7)))


@pytest.mark.parametrize("case", ["repaired", "rerouted"])
@pytest.mark.parametrize("delay_ms", [0.0, 10.0, 50.0])
def test_changed_path_dark_for_exactly_d_and_unchanged_path_never(case, delay_ms):
    a, b = REPAIRED if case == "repaired" else REROUTED
    # at D = 0 a re-routed path waits for the deletes' round trip, then the routes' (no mixed state may loop)
    plan, ex, worst = check(DEFAULT, a, b, delay_ms, slack_s=2 * (INSTALL_S + RTT_S) if delay_ms == 0 else 0.0)
    if case == "rerouted":
        assert plan.dark_steps and not plan.final_steps  # ToR 0 -> ToR 1 moves to uplink 1: routed while dark
    else:
        assert not plan.dark_steps and not plan.move_steps and not plan.final_steps  # same uplinks
    if delay_ms:
        assert worst == pytest.approx(delay_ms / 1000.0, abs=1e-9)


@pytest.mark.parametrize("spec,layout", [(DEFAULT, JobLayout()),
                                         (FabricSpec(pods=4, tors_per_pod=3, uplinks_per_tor=4, ocs_count=2),
                                          JobLayout((0, 1), (2, 3)))])
@pytest.mark.parametrize("a,b", [("train", "gen"), ("gen", "sync"), ("sync", "train"), ("train", "sync")])
def test_phase_changes_dark_for_d_at_most_and_never_loop(spec, layout, a, b):
    check(spec, phases.phase_matchings(spec, layout, a), phases.phase_matchings(spec, layout, b), 10.0)


def _random_matching(rng, spec):
    out = {}
    for o in range(spec.ocs_count):
        ports = list(range(1, spec.ports_per_ocs + 1))
        rng.shuffle(ports)
        k = rng.randint(len(ports) // 4, len(ports) // 2)
        out[o] = Matching.from_pairs(spec.ports_per_ocs, [ports[2 * i:2 * i + 2] for i in range(k)])
    return out


@pytest.mark.parametrize("spec", [FabricSpec(pods=3, tors_per_pod=2, servers_per_tor=1, uplinks_per_tor=3),
                                  FabricSpec(pods=4, tors_per_pod=2, servers_per_tor=1, uplinks_per_tor=4,
                                             ocs_count=2)])
def test_random_reconfigurations_never_loop_and_stay_dark_for_d_at_most(spec):
    rng = random.Random(8)
    for _ in range(40):
        check(spec, _random_matching(rng, spec), _random_matching(rng, spec), 10.0)


def test_route_moves_in_rounds_keep_traffic_flowing_and_never_loop():
    """Where switching every ToR at once could loop, routes move nearest the destination first, in rounds
    (found by a seeded search: about 1 in 300 random reconfigurations of this fabric needs them)."""
    rng = random.Random(1)
    spec = FabricSpec(pods=4, tors_per_pod=2, servers_per_tor=1, uplinks_per_tor=4, ocs_count=2)
    empty = {o: Matching.empty(spec.ports_per_ocs) for o in range(spec.ocs_count)}
    for _ in range(3000):
        a, b = _random_matching(rng, spec), _random_matching(rng, spec)
        p = plan_reconfig(spec, a, plan_reconfig(spec, empty, None, a).final_routes, b)
        if len(p.move_steps) > 1 or len(p.final_steps) > 1:
            break
    else:
        pytest.fail("no reconfiguration needing rounds found")
    check(spec, a, b, 10.0)


def test_safe_steps_refuses_states_that_loop_and_takes_one_step_when_it_can():
    spec = FabricSpec(pods=3, tors_per_pod=1, servers_per_tor=1, uplinks_per_tor=2, ocs_count=1)
    u = [spec.uplink(t, k).tor_port for t in range(3) for k in range(2)]  # tor_port of (t, k) = u[2t + k]
    # forged states for dst ToR 2, each sending ToR 0 and ToR 1 at each other (on uplinks 0, then 1)
    before = routing.Routes({0: {2: (u[0],)}, 1: {2: (u[2],)}, 2: {}})
    after = routing.Routes({0: {2: (u[1],)}, 1: {2: (u[3],)}, 2: {}})
    # lit: ToR 0 uplink 0 <-> ToR 1 uplink 0 and ToR 0 uplink 1 <-> ToR 1 uplink 1; nothing reaches ToR 2
    pairs = [[spec.uplink(0, 0).ocs_port, spec.uplink(1, 0).ocs_port],
             [spec.uplink(0, 1).ocs_port, spec.uplink(1, 1).ocs_port]]
    lit = phases.circuit_graph(spec, {0: Matching.from_pairs(spec.ports_per_ocs, pairs)})
    assert routing.find_loop(routing.merge(before, after), routing.port_peers(lit), 3) is not None
    with pytest.raises(routing.RouteLoop):  # both states loop on these circuits: no order can help
        routing.safe_steps(before, after, lit, lit, "test")
    # a loop-free pair of states on a line 0 - 1 - 2: one step
    line = phases.circuit_graph(spec, {0: Matching.from_pairs(spec.ports_per_ocs, [
        [spec.uplink(0, 0).ocs_port, spec.uplink(1, 0).ocs_port],
        [spec.uplink(1, 1).ocs_port, spec.uplink(2, 0).ocs_port]])})
    r = routing.compute_routes(spec, line)
    assert routing.safe_steps(routing.Routes({0: {}, 1: {}, 2: {}}), r, line, line, "test") == [r]
