"""FabricSpec and JobLayout: the emulated (and simulated) cluster as plain, validated data.

Numbering conventions (shared by the Mininet builder, the controller and RLSim):

* servers are numbered 0..n_servers-1, ToR by ToR; ToRs 0..n_tors-1, pod by pod; OCSes 0..ocs_count-1.
* ToR OpenFlow ports: 1..servers_per_tor face servers (server local index + 1); then
  servers_per_tor+1 .. servers_per_tor+uplinks_per_tor face the OCS layer (uplink u -> port S+1+u).
* uplink u of ToR t lands on OCS ``u % ocs_count`` at port ``1 + t*k + u // ocs_count`` where
  ``k = uplinks_per_tor // ocs_count`` (every ToR has k ports on every OCS).
* names carry the prefix ``orl`` (NAME_PREFIX) so that ``orchestrrl clean`` finds every leftover.

Rates: ``server_gbps`` and ``uplink_gbps`` are *real* link rates; the emulator shapes each link to
``real_gbps * 1000 * scale`` Mb/s and every byte count is scaled by the same factor, so times stay real.
"""
from __future__ import annotations

import functools
import ipaddress
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from .machine import HOST_TCP_CCS  # noqa: F401 (re-exported: FabricSpec.host_tcp_cc's choices)
from .validation import SpecError, few, finite_float, require

NAME_PREFIX = "orl"
TOR_DPID_BASE = 0x1000
OCS_DPID_BASE = 0x2000
MAX_EMULATED_SERVERS = 250
MAX_TIME_DILATION = 100.0
# Below 1 the emulator runs faster than real time (time compression): a long-response step of minutes takes a
# fraction of that; scale must then be lowered by the same factor so the shaped rates stay what this machine
# forwards (FabricSpec.check_emulatable), and the agents' CPU must keep up (the fidelity monitor says so).
MIN_TIME_DILATION = 0.05
MAX_DELAY_MS = 60000.0  # longest OCS switching delay anything accepts (scenario, controller, REST)
FIT_MODES = ("off", "auto")  # FabricSpec.fit
PHASES = ("train", "gen", "sync")  # the phase topologies (controller/phases.py builds them)
# Fabric kinds: one name set for the emulator (``FabricSpec.kind``) and RLSim (rlsim/fabric_models.py registers a
# model of each, and takes plug-ins beside them)
FABRICS = ("fat-tree", "fat-tree-2to1", "fat-tree-4to1", "fat-tree-8to1", "fat-tree-16to1", "rail", "topoopt",
           "mixnet", "rfabric")
# the Fat-Trees' oversubscription at the ToR: 2:1 .. 16:1 are the tapers of RFabric's swept configurations
# (16 .. 2 uplinks against 32 server ports), a cluster architect's cheaper static alternatives
OVERSUB = {"fat-tree": 1.0, "fat-tree-2to1": 2.0, "fat-tree-4to1": 4.0, "fat-tree-8to1": 8.0, "fat-tree-16to1": 16.0}
# what the emulator builds: RFabric (OCS bridges under the controller) or a static packet tree (spine bridges)
EMULATED_FABRICS = ("rfabric",) + tuple(OVERSUB)
# The largest optical circuit switch on sale, in duplex ports (one port = one ToR uplink, each circuit pairs two):
# CALIENT's S320, 320 x 320 (the S-series' largest; its hardware user guide: bulk reconfiguration <= 200 ms,
# REFERENCE.md), ahead of Lumentum's R300, 300 x 300 (MEMS, shown at OFC 2025: gazettabyte.com, 2025-06-07).
# Google's Palomar (136 ports) is not sold. A scenario's explicit ``ocs_ports`` may not exceed it; RLSim's
# derived radix (ocs_ports 0 at thousands of GPUs) is a hypothetical OCS and is not bounded here.
MAX_OCS_PORTS = 320


@functools.lru_cache(maxsize=65536)
def _host_addr(subnet: str, index: int) -> str:
    """Address ``index + 1`` of ``subnet`` (cached: route planning asks for every host's address per change)."""
    net = ipaddress.IPv4Network(subnet)
    if index + 1 >= net.num_addresses - 1:
        raise SpecError(subnet, f"subnet {subnet} too small for host index {index}")
    return str(net.network_address + index + 1)


def check_delay_ms(value: float | None, field: str) -> float | None:
    """An OCS switching delay (ms) or None (the default): finite, 0..MAX_DELAY_MS; SpecError naming ``field``."""
    if value is None:
        return None
    v = finite_float(value, field)
    require(0 <= v <= MAX_DELAY_MS, field, f"must be in 0..{MAX_DELAY_MS:g} ms, got {v:g}")
    return v


def check_phase(phase: object, field: str = "phase") -> str:
    """``phase`` when it names one of PHASES; SpecError naming ``field`` otherwise."""
    require(isinstance(phase, str) and phase in PHASES, field,
            f"unknown phase {phase!r} (known: {', '.join(PHASES)})")
    return phase  # type: ignore[return-value]


class Uplink(NamedTuple):
    tor: int
    uplink: int  # 0..uplinks_per_tor-1
    tor_port: int  # OpenFlow port on the ToR
    ocs: int
    ocs_port: int  # OpenFlow port on the OCS


@dataclass(frozen=True)
class FabricSpec:
    pods: int = 2
    tors_per_pod: int = 2
    servers_per_tor: int = 2
    gpus_per_server: int = 8
    ocs_count: int = 1
    ocs_ports: int = 0  # 0: exactly the ports the ToR uplinks need
    uplinks_per_tor: int = 2
    server_gbps: float = 400.0  # real rate of a server's fabric link
    uplink_gbps: float = 400.0  # real rate of one ToR uplink (one OCS circuit)
    scale: float = 0.001  # emulated Mb/s = real Gb/s * 1000 * scale
    reconfig_delay_ms: float = 10.0  # default OCS switching time (3D-MEMS, REFERENCE.md)
    # Time dilation (Etalon's TDF): the emulator runs time_dilation times slower than real time: links are
    # shaped to rate / TDF, modelled compute and the OCS switching delay last TDF times longer in wall time,
    # and every time reported is divided by TDF. For a scenario too big for this machine's cores or its
    # forwarding capacity (the fidelity monitor says which TDF a run needed). Below 1 it compresses time (steps
    # of long responses in a fraction of their real time; lower ``scale`` by the same factor). RLSim ignores it.
    time_dilation: float = 1.0
    # Fit the emulation to this machine (testbed/cluster/fit.py): "auto" lowers ``scale`` (and, where the smallest
    # messages would get too small, raises ``time_dilation``) until the traffic each phase plans fits what this
    # machine's userspace datapath forwards beside the agents; "off" emulates exactly these numbers and says
    # before the run starts when they will not be faithful. ``time_dilation`` is the least a fitted run uses.
    fit: str = "off"
    fabric_subnet: str = "10.0.0.0/24"
    mgmt_subnet: str = "10.0.1.0/24"
    # rfabric: the uplinks go to OCS bridges re-wired per phase by the controller; a Fat-Tree kind
    # (OVERSUB): one uplink per ToR to each of ocs_count spine bridges (in the OCSes' places) that forward
    # by destination, static for the job; together they carry the ToR's up capacity, servers_per_tor x
    # server rate / oversubscription (RLSim's aggregated ToR pipe; the builder's static_flows rule). RLSim
    # takes the fabric to simulate as an argument (any of FABRICS).
    kind: str = "rfabric"
    # TCP congestion control in every host's namespace (the agents' Gloo and KV connections), set by the builder
    # whatever the machine's default. Not BBR: BBR (v1, Linux's) re-measures its minimum RTT when its estimate
    # is 10 s old, holding the window at 4 packets for 200 ms; a collective's connections sit idle through a
    # generation phase (20 s on moe-small), so every train and sync phase began with its flows at ~1/3 of the
    # link for 0.2 s: moe-small's weight sync took 0.80-0.88 s against 0.66-0.69 s under CUBIC, the same run
    # side by side (docs/emulation.md "Congestion control"). An RDMA fabric has no such pause.
    host_tcp_cc: str = "cubic"

    def __post_init__(self) -> None:
        require(self.kind in FABRICS, "kind", f"must be one of {', '.join(FABRICS)}, got {self.kind!r}")
        require(self.fit in FIT_MODES, "fit", f"must be one of {', '.join(FIT_MODES)}, got {self.fit!r}")
        require(self.host_tcp_cc in HOST_TCP_CCS, "host_tcp_cc",
                f"must be one of {', '.join(HOST_TCP_CCS)}, got {self.host_tcp_cc!r}")
        for name in ("pods", "tors_per_pod", "servers_per_tor", "gpus_per_server", "ocs_count",
                     "uplinks_per_tor"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(0 <= self.ocs_ports <= MAX_OCS_PORTS, "ocs_ports",
                f"must be in 0..{MAX_OCS_PORTS} (the largest commercial OCS, CALIENT S320, has {MAX_OCS_PORTS} "
                f"ports; 0: exactly the ports the ToR uplinks need), got {self.ocs_ports}")
        require(self.uplinks_per_tor % self.ocs_count == 0, "uplinks_per_tor",
                f"must be a multiple of ocs_count ({self.ocs_count}) so every ToR has the same ports on "
                f"every OCS, got {self.uplinks_per_tor}")
        if self.ocs_ports:
            require(self.ocs_ports >= self.ocs_ports_needed, "ocs_ports",
                    f"{self.n_tors} ToRs x {self.ports_per_tor_per_ocs} uplinks per OCS need "
                    f"{self.ocs_ports_needed} ports, got {self.ocs_ports}")
        for name in ("server_gbps", "uplink_gbps", "scale"):
            v = finite_float(getattr(self, name), name)
            require(v > 0, name, f"must be > 0, got {v:g}")
        check_delay_ms(self.reconfig_delay_ms, "reconfig_delay_ms")
        v = finite_float(self.time_dilation, "time_dilation")
        require(MIN_TIME_DILATION <= v <= MAX_TIME_DILATION, "time_dilation",
                f"must be in [{MIN_TIME_DILATION:g}, {MAX_TIME_DILATION:g}], got {v:g}")
        nets = {}
        for name in ("fabric_subnet", "mgmt_subnet"):
            try:
                nets[name] = ipaddress.IPv4Network(getattr(self, name), strict=True)
            except ValueError as e:
                raise SpecError(name, f"not an IPv4 network: {e}") from None
        require(not nets["fabric_subnet"].overlaps(nets["mgmt_subnet"]), "mgmt_subnet",
                f"overlaps fabric_subnet {self.fabric_subnet}")

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def n_tors(self) -> int:
        return self.pods * self.tors_per_pod

    @property
    def n_servers(self) -> int:
        return self.n_tors * self.servers_per_tor

    @property
    def n_gpus(self) -> int:
        return self.n_servers * self.gpus_per_server

    @property
    def ports_per_tor_per_ocs(self) -> int:
        return self.uplinks_per_tor // self.ocs_count

    @property
    def ocs_ports_needed(self) -> int:
        return self.n_tors * self.ports_per_tor_per_ocs

    @property
    def ports_per_ocs(self) -> int:
        return self.ocs_ports or self.ocs_ports_needed

    # ---- structure ---------------------------------------------------------------------------
    def tor_of_server(self, server: int) -> int:
        self._check_index("server", server, self.n_servers)
        return server // self.servers_per_tor

    def pod_of_tor(self, tor: int) -> int:
        self._check_index("tor", tor, self.n_tors)
        return tor // self.tors_per_pod

    def pod_of_server(self, server: int) -> int:
        return self.pod_of_tor(self.tor_of_server(server))

    def tors_in_pod(self, pod: int) -> range:
        self._check_index("pod", pod, self.pods)
        return range(pod * self.tors_per_pod, (pod + 1) * self.tors_per_pod)

    def servers_on_tor(self, tor: int) -> range:
        self._check_index("tor", tor, self.n_tors)
        return range(tor * self.servers_per_tor, (tor + 1) * self.servers_per_tor)

    def server_port(self, server: int) -> int:
        """ToR port facing ``server``."""
        self._check_index("server", server, self.n_servers)
        return server % self.servers_per_tor + 1

    def uplink(self, tor: int, u: int) -> Uplink:
        self._check_index("tor", tor, self.n_tors)
        self._check_index("uplink", u, self.uplinks_per_tor)
        ocs = u % self.ocs_count
        port = 1 + tor * self.ports_per_tor_per_ocs + u // self.ocs_count
        return Uplink(tor, u, self.servers_per_tor + 1 + u, ocs, port)

    def uplinks(self) -> Iterator[Uplink]:
        for t in range(self.n_tors):
            for u in range(self.uplinks_per_tor):
                yield self.uplink(t, u)

    def ocs_port_owner(self, ocs: int, port: int) -> Uplink | None:
        """The ToR uplink wired to ``(ocs, port)``, or None for a spare port."""
        self._check_index("ocs", ocs, self.ocs_count)
        if not 1 <= port <= self.ports_per_ocs:
            raise SpecError("port", f"OCS {ocs} has ports 1..{self.ports_per_ocs}, got {port}")
        idx = port - 1
        if idx >= self.ocs_ports_needed:
            return None
        tor, j = divmod(idx, self.ports_per_tor_per_ocs)
        return self.uplink(tor, j * self.ocs_count + ocs)

    def _check_index(self, what: str, i: int, n: int) -> bool:
        if not (isinstance(i, int) and 0 <= i < n):
            raise SpecError(what, f"must be in 0..{n - 1}, got {i!r}")
        return True

    # ---- names, ids, addresses ---------------------------------------------------------------
    @staticmethod
    def host_name(server: int) -> str:
        return f"{NAME_PREFIX}h{server}"

    @staticmethod
    def tor_name(tor: int) -> str:
        return f"{NAME_PREFIX}t{tor}"

    @staticmethod
    def ocs_name(ocs: int) -> str:
        return f"{NAME_PREFIX}o{ocs}"

    @staticmethod
    def tor_dpid(tor: int) -> int:
        return TOR_DPID_BASE + tor

    @staticmethod
    def ocs_dpid(ocs: int) -> int:
        return OCS_DPID_BASE + ocs

    def classify_dpid(self, dpid: int) -> tuple[str, int] | None:
        """('tor', t) or ('ocs', o) for a dpid of this fabric, else None."""
        if TOR_DPID_BASE <= dpid < TOR_DPID_BASE + self.n_tors:
            return ("tor", dpid - TOR_DPID_BASE)
        if OCS_DPID_BASE <= dpid < OCS_DPID_BASE + self.ocs_count:
            return ("ocs", dpid - OCS_DPID_BASE)
        return None

    def _addr(self, subnet: str, index: int) -> str:
        return _host_addr(subnet, index)

    def host_ip(self, server: int) -> str:
        self._check_index("server", server, self.n_servers)
        return self._addr(self.fabric_subnet, server)

    def host_mgmt_ip(self, server: int) -> str:
        self._check_index("server", server, self.n_servers)
        return self._addr(self.mgmt_subnet, server)

    @property
    def mgmt_gateway_ip(self) -> str:
        """Root-namespace end of the management network (last usable address)."""
        net = ipaddress.IPv4Network(self.mgmt_subnet)
        return str(net.broadcast_address - 1)

    @property
    def prefixlen(self) -> int:
        return ipaddress.IPv4Network(self.fabric_subnet).prefixlen

    @staticmethod
    def host_mac(server: int) -> str:
        return "02:00:00:%02x:%02x:%02x" % ((server >> 16) & 0xFF, (server >> 8) & 0xFF, server & 0xFF)

    # ---- rates -------------------------------------------------------------------------------
    def emulated_mbps(self, real_gbps: float) -> float:
        """The shaped rate of a link of ``real_gbps``: scaled, and slowed by the time dilation."""
        return real_gbps * 1000.0 * self.scale / self.time_dilation

    def wall_ms(self, ms: float) -> float:
        """A real-time duration as it lasts on the emulator (x time dilation)."""
        return ms * self.time_dilation

    @property
    def server_link_mbps(self) -> float:
        return self.emulated_mbps(self.server_gbps)

    @property
    def uplink_mbps(self) -> float:
        return self.emulated_mbps(self.uplink_gbps)

    def scaled_bytes(self, real_bytes: float) -> float:
        """Bytes to send on the emulated fabric for ``real_bytes`` on the real one (same duration)."""
        return real_bytes * self.scale

    @property
    def aggregate_emulated_gbps(self) -> float:
        """Most traffic the hosts can inject at once (all server links busy), emulated Gb/s."""
        return self.n_servers * self.server_link_mbps / 1000.0

    @property
    def is_static(self) -> bool:
        """A static packet fabric (spine bridges), not RFabric's OCSes."""
        return self.kind != "rfabric"

    @property
    def static_uplink_mbps(self) -> float:
        """A static tree's shaped ToR uplink (one per spine): the ToR's up capacity (its servers' rate /
        oversubscription) over its spines."""
        return self.servers_per_tor * self.server_link_mbps / OVERSUB[self.kind] / self.ocs_count

    def built_uplinks(self) -> Iterator[Uplink]:
        """The ToR uplinks the emulator wires: all of them for RFabric; for a static tree the first on each
        spine (uplinks 0..ocs_count-1: one per spine per ToR)."""
        for up in self.uplinks():
            if not self.is_static or up.uplink < self.ocs_count:
                yield up

    def check_emulatable(self) -> None:
        """Raise SpecError when the Mininet builder cannot build this spec on one machine, or would build
        something else than it says (the builder makes only the OCS ports the ToR uplinks are wired to)."""
        require(self.kind in EMULATED_FABRICS, "kind",
                f"the emulator builds {', '.join(EMULATED_FABRICS)}, got {self.kind!r} (RLSim models it)")
        require(self.ocs_ports in (0, self.ocs_ports_needed), "ocs_ports",
                f"{self.ocs_ports} ports per OCS, but the emulator builds only the {self.ocs_ports_needed} the ToR "
                f"uplinks are wired to (a circuit to a spare port would go nowhere): use 0 or "
                f"{self.ocs_ports_needed} to emulate it (RLSim prices spare ports)")
        require(self.n_servers <= MAX_EMULATED_SERVERS, "servers",
                f"{self.n_servers} servers; the emulator builds at most {MAX_EMULATED_SERVERS} "
                "(use RLSim for larger clusters)")
        for name in ("fabric_subnet", "mgmt_subnet"):
            net = ipaddress.IPv4Network(getattr(self, name))
            require(net.num_addresses - 3 >= self.n_servers, name,
                    f"{getattr(self, name)} has too few addresses for {self.n_servers} servers")


@dataclass(frozen=True)
class JobLayout:
    """Which pods train and which generate (every pod exactly one role)."""

    train_pods: tuple[int, ...] = (0,)
    gen_pods: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        require(len(self.train_pods) >= 1, "train_pods", "needs at least one pod")
        require(len(self.gen_pods) >= 1, "gen_pods", "needs at least one pod")
        both = set(self.train_pods) & set(self.gen_pods)
        require(not both, "gen_pods", f"pods {few(sorted(both))} are also in train_pods")
        for name in ("train_pods", "gen_pods"):
            vals = getattr(self, name)
            dups = sorted(v for v, n in Counter(vals).items() if n > 1)
            require(not dups, name, f"has duplicates: {few(dups)}")
            neg = [v for v in vals if v < 0]
            require(not neg, name, f"pod indices must be >= 0, got {few(neg)}")

    def check(self, spec: FabricSpec) -> None:
        """Raise SpecError unless this layout covers exactly the pods of ``spec``."""
        used = set(self.train_pods) | set(self.gen_pods)
        bad = sorted(p for p in used if p >= spec.pods)
        require(not bad, "layout", f"pods {few(bad)} do not exist (fabric has {spec.pods} pods)")
        n_missing = spec.pods - len(used)
        if n_missing:  # name the first few without listing (or building) a million pods
            first = []
            p = 0
            while len(first) < 5 and p < spec.pods:
                if p not in used:
                    first.append(p)
                p += 1
            more = f", ... ({n_missing} in all)" if n_missing > len(first) else ""
            raise SpecError("layout", f"pods [{', '.join(map(str, first))}{more}] have no role "
                                      "(list them in train_pods or gen_pods)")

    def role_of_pod(self, pod: int) -> str:
        if pod in self.train_pods:
            return "train"
        if pod in self.gen_pods:
            return "gen"
        raise SpecError("pod", f"pod {pod} has no role in this layout")

    def train_servers(self, spec: FabricSpec) -> list[int]:
        return [s for p in sorted(self.train_pods) for t in spec.tors_in_pod(p) for s in spec.servers_on_tor(t)]

    def gen_servers(self, spec: FabricSpec) -> list[int]:
        return [s for p in sorted(self.gen_pods) for t in spec.tors_in_pod(p) for s in spec.servers_on_tor(t)]
