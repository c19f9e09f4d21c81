"""Build the emulated RFabric from a FabricSpec: Mininet hosts, userspace OVS ToR and OCS bridges, htb-shaped
links, static ARP, and a management network that never touches OVS.

A static fabric (``spec.kind`` a Fat-Tree kind) gets spine bridges in the OCSes' places, on the same uplinks,
shaped to the tree's oversubscription (``FabricSpec.static_uplink_mbps``), and no controller: the builder
installs :func:`static_flows`, a fixed rule (see there), once at start.

``plan_fabric(spec)`` is the pure part (names, ports, rates); ``EmulatedFabric`` builds it (root + OVS).
Mininet is imported only when a fabric starts.

Every process / bridge / interface is recorded in ``emulation.registry`` before it can leak, so that
``orchestrrl clean`` undoes a run that was killed with ``kill -9``.
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Callable, Sequence

from . import capacity, machine, registry, sendbuf, shaping
from .netlink import Netlink, NetlinkFailed
from .signals import shielded
from .spec import NAME_PREFIX, FabricSpec
from .validation import SpecError

log = logging.getLogger(__name__)

MGMT_BRIDGE = f"{NAME_PREFIX}mgmt"
# Open vSwitch's userspace datapath receives from every bridge port on an AF_PACKET socket opened with the
# kernel's default receive buffer (net.core.rmem_default, 212 KB here: three 64 KB GSO packets). When
# ovs-vswitchd waits a few ms for a core, that buffer overflows and TCP loses segments (`ss -0 -m` shows
# the drops; each costs a retransmission, some a 200 ms timeout). The builder raises the default to this
# while the fabric's ports are added, and restores it at once: only these sockets get it.
PACKET_RCVBUF = 8 * 2**20
RMEM_DEFAULT = "/proc/sys/net/core/rmem_default"


@contextlib.contextmanager
def packet_socket_buffers(nbytes: int = PACKET_RCVBUF):
    """net.core.rmem_default at least ``nbytes`` inside the block (sockets opened then keep it), the old
    value after. Best effort: without the file (or permission) nothing changes."""
    try:
        with open(RMEM_DEFAULT, encoding="ascii") as f:
            old = f.read().strip()
    except OSError:
        yield
        return
    changed = False
    try:
        if int(old) < nbytes:
            with open(RMEM_DEFAULT, "w", encoding="ascii") as f:
                f.write(str(nbytes))
            changed = True
    except (OSError, ValueError) as e:
        log.warning("cannot raise %s for the datapath's sockets: %s", RMEM_DEFAULT, e)
    try:
        yield
    finally:
        if changed:
            try:
                with open(RMEM_DEFAULT, "w", encoding="ascii") as f:
                    f.write(old)
            except OSError as e:
                log.error("could not restore %s to %s: %s", RMEM_DEFAULT, old, e)


# ---- the plan (pure) ----------------------------------------------------------------------------
@dataclass(frozen=True)
class HostPlan:
    server: int
    name: str
    ip: str
    mac: str
    intf: str  # fabric interface (in the host's namespace)
    mgmt_ip: str
    mgmt_intf: str  # management veth end inside the host
    mgmt_peer: str  # management veth end in the root namespace (port of MGMT_BRIDGE)


@dataclass(frozen=True)
class SwitchPlan:
    name: str
    kind: str  # "tor" | "ocs" | "spine" (a static fabric's, in an OCS's place)
    index: int
    dpid: int


@dataclass(frozen=True)
class LinkPlan:
    kind: str  # "server" (host - ToR) | "uplink" (ToR - OCS)
    node1: str
    port1: int  # 0 for a host's only fabric interface
    intf1: str
    node2: str
    port2: int
    intf2: str
    rate_mbps: float  # shaped on both ends


@dataclass(frozen=True)
class FabricPlan:
    hosts: tuple[HostPlan, ...]
    switches: tuple[SwitchPlan, ...]
    links: tuple[LinkPlan, ...]
    mgmt_bridge: str
    mgmt_gateway_ip: str
    mgmt_prefixlen: int
    fabric_prefixlen: int

    def interfaces(self) -> list[str]:
        """Every interface name the build creates (fabric veth ends, mgmt veth ends, the mgmt bridge)."""
        names = []
        for link in self.links:
            names += [link.intf1, link.intf2]
        for h in self.hosts:
            names += [h.mgmt_peer, h.mgmt_intf]
        names.append(self.mgmt_bridge)
        return names


def intf_name(node: str, port: int) -> str:
    name = f"{node}-eth{port}"
    if len(name) > 15:
        raise SpecError("servers", f"interface name {name!r} is longer than Linux's 15 characters")
    return name


def plan_fabric(spec: FabricSpec) -> FabricPlan:
    """Which hosts, bridges and links the emulated fabric has, with OpenFlow ports and shaped rates."""
    mgmt_prefix = ipaddress.IPv4Network(spec.mgmt_subnet).prefixlen
    hosts = []
    for s in range(spec.n_servers):
        name = spec.host_name(s)
        hosts.append(HostPlan(server=s, name=name, ip=spec.host_ip(s), mac=spec.host_mac(s),
                              intf=intf_name(name, 0), mgmt_ip=spec.host_mgmt_ip(s),
                              mgmt_intf=f"{name}-m", mgmt_peer=f"{NAME_PREFIX}m{s}"))
    switches = [SwitchPlan(spec.tor_name(t), "tor", t, spec.tor_dpid(t)) for t in range(spec.n_tors)]
    upper = "spine" if spec.is_static else "ocs"
    switches += [SwitchPlan(spec.ocs_name(o), upper, o, spec.ocs_dpid(o)) for o in range(spec.ocs_count)]
    links = []
    for s in range(spec.n_servers):
        h = spec.host_name(s)
        tor = spec.tor_name(spec.tor_of_server(s))
        p = spec.server_port(s)
        links.append(LinkPlan("server", h, 0, intf_name(h, 0), tor, p, intf_name(tor, p), spec.server_link_mbps))
    for up in spec.built_uplinks():
        tor, ocs = spec.tor_name(up.tor), spec.ocs_name(up.ocs)
        links.append(LinkPlan("uplink", tor, up.tor_port, intf_name(tor, up.tor_port),
                              ocs, up.ocs_port, intf_name(ocs, up.ocs_port),
                              spec.static_uplink_mbps if spec.is_static else spec.uplink_mbps))
    for h in hosts:
        for n in (h.mgmt_intf, h.mgmt_peer):
            if len(n) > 15:
                raise SpecError("servers", f"interface name {n!r} is longer than Linux's 15 characters")
    return FabricPlan(tuple(hosts), tuple(switches), tuple(links), MGMT_BRIDGE, spec.mgmt_gateway_ip,
                      mgmt_prefix, spec.prefixlen)


def static_flows(spec: FabricSpec) -> dict[str, list[str]]:
    """The forwarding rule of a static packet fabric, as ``ovs-ofctl`` flows per bridge (pure).

    A ToR has one uplink to each spine (``FabricSpec.built_uplinks``), shaped to its share of the ToR's up
    capacity. A server's traffic to another ToR leaves on the uplink to spine ``(server's local index) mod
    spines``; the spine delivers it by destination address to the destination ToR, which hands it to the
    server's port. With one spine (the emulated scenarios) every flow shares one ToR pipe of the whole up
    capacity, RLSim's aggregated pipe; the paths are the same in every run (no ECMP hash collisions). ToRs
    deliver their own servers' addresses first. Anything else (non-IP: hosts have static ARP) matches
    nothing and is dropped.
    """
    if not spec.is_static:
        raise SpecError("kind", f"static_flows is for a static fabric, got {spec.kind!r}")
    n_sp = spec.ocs_count
    out: dict[str, list[str]] = {}
    for t in range(spec.n_tors):
        flows = [f"priority=200,ip,nw_dst={spec.host_ip(s)},actions=output:{spec.server_port(s)}"
                 for s in spec.servers_on_tor(t)]
        flows += [f"priority=100,ip,in_port={spec.server_port(s)},actions=output:{spec.uplink(t, i % n_sp).tor_port}"
                  for i, s in enumerate(spec.servers_on_tor(t))]
        out[spec.tor_name(t)] = flows
    for o in range(n_sp):
        out[spec.ocs_name(o)] = [f"priority=100,ip,nw_dst={spec.host_ip(s)},"
                                 f"actions=output:{spec.uplink(spec.tor_of_server(s), o).ocs_port}"
                                 for s in range(spec.n_servers)]
    return out


def host_batch(plan: FabricPlan, server: int) -> list[str]:
    """``ip -batch`` lines run inside host ``server``: static ARP for every other server, mgmt address."""
    me = plan.hosts[server]
    lines = [f"neigh replace {h.ip} lladdr {h.mac} dev {me.intf} nud permanent"
             for h in plan.hosts if h.server != server]
    lines += [f"addr add {me.mgmt_ip}/{plan.mgmt_prefixlen} dev {me.mgmt_intf}",
              f"link set {me.mgmt_intf} up"]
    return lines


def mgmt_root_batch(plan: FabricPlan, host_pids: dict[int, int]) -> list[str]:
    """``ip -batch`` lines in the root namespace: the mgmt bridge and one veth per host into its netns."""
    lines = [f"link add {plan.mgmt_bridge} type bridge",
             f"addr add {plan.mgmt_gateway_ip}/{plan.mgmt_prefixlen} dev {plan.mgmt_bridge}",
             f"link set {plan.mgmt_bridge} up"]
    for h in plan.hosts:
        lines += [f"link add {h.mgmt_peer} type veth peer name {h.mgmt_intf} netns {host_pids[h.server]}",
                  f"link set {h.mgmt_peer} master {plan.mgmt_bridge} up"]
    return lines


# ---- helpers ------------------------------------------------------------------------------------
def _run(argv: list[str], input_text: str | None = None, timeout_s: float = 60.0) -> str:
    r = subprocess.run(argv, input=input_text, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])}... failed ({r.returncode}): {r.stderr.strip()[:500]}")
    return r.stdout


def _link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def port_bytes(bridge: str, timeout_s: float = 10.0) -> dict[str, dict[str, int]]:
    """``{port: {"rx": bytes, "tx": bytes}}`` of every port of ``bridge``, live from the datapath (OpenFlow port
    stats, ``ovs-ofctl dump-ports``); raises RuntimeError naming the command if it cannot be read."""
    return parse_port_bytes(_run(["ovs-ofctl", "-O", "OpenFlow13", "dump-ports", bridge], timeout_s=timeout_s))


def parse_port_bytes(dump: str) -> dict[str, dict[str, int]]:
    """``ovs-ofctl dump-ports`` output -> ``{port: {"rx": bytes, "tx": bytes}}`` (pure)."""
    out: dict[str, dict[str, int]] = {}
    port = None
    for line in dump.splitlines():
        line = line.strip()
        if line.startswith("port"):  # "port  1: rx pkts=.., bytes=.., ..."; its tx counters on the next line
            port = line.split(":")[0].split()[-1]
            out[port] = {"rx": 0, "tx": 0}
        if port is not None and "bytes=" in line:
            out[port]["tx" if line.startswith("tx") else "rx"] = int(line.split("bytes=")[1].split(",")[0])
    return out


# ---- the builder --------------------------------------------------------------------------------
TCP_CC_AVAILABLE = "/proc/sys/net/ipv4/tcp_available_congestion_control"


def check_tcp_cc(cc: str, available_path: str = TCP_CC_AVAILABLE) -> None:
    """Raise SpecError (``host_tcp_cc``) unless the kernel offers congestion control ``cc``, loading its module
    (``tcp_<cc>``) first where it is missing: a host told to use one the kernel lacks fails at start, by name.
    Then make sure a host's namespace may choose it: a namespace other than the root one may only pick an
    algorithm in the root namespace's ``net.ipv4.tcp_allowed_congestion_control``, which on a freshly booted
    machine is ``reno bbr`` (emulation/machine.py; ``scripts/provision.sh`` adds the rest for good)."""
    def available() -> list[str]:
        try:
            with open(available_path) as f:
                return f.read().split()
        except OSError:
            return []
    if cc not in available():
        if shutil.which("modprobe"):
            subprocess.run(["modprobe", "-q", f"tcp_{cc}"], capture_output=True, timeout=30)
        have = available()
        if cc not in have:
            raise SpecError("host_tcp_cc", f"{cc!r} is not available in this kernel (it offers {', '.join(have) or 'none'}"
                                           f"; `modprobe tcp_{cc}` did not add it): pick one of those")
    key = "net.ipv4.tcp_allowed_congestion_control"
    try:
        old = machine.ensure_tcp_cc_allowed(cc)
    except OSError as e:
        raise SpecError("host_tcp_cc", f"{cc!r} is not in {key} and it cannot be added ({e}): run "
                                       "`sudo scripts/provision.sh`, or `sysctl -w "
                                       f"{key}=\"$(sysctl -n {key}) {cc}\"`") from None
    if old is not None:
        log.warning("%s was '%s': added %s so the hosts may use it (scripts/provision.sh sets it for good)",
                    key, old, cc)


class EmulatedFabric:
    """The emulated fabric of ``spec`` (context manager). Needs root and Open vSwitch.

    ``wait_connected(dpids, timeout_s)``, when given, is called after the switches start and must return
    once the controller sees every dpid (raise on timeout); ``timeout_s`` is ``connect_timeout_s``.
    """

    def __init__(self, spec: FabricSpec, controller_port: int | None, controller_host: str = "127.0.0.1",
                 wait_connected: Callable[[set[int], float], None] | None = None,
                 connect_timeout_s: float = 30.0):
        if not isinstance(spec, FabricSpec):
            raise SpecError("spec", f"must be a FabricSpec, got {type(spec).__name__}")
        if spec.is_static:  # no controller: static_flows are installed at start
            if controller_port is not None:
                raise SpecError("controller_port", f"a static fabric ({spec.kind}) has no controller: give None")
        elif isinstance(controller_port, bool) or not isinstance(controller_port, int) \
                or not 1 <= controller_port <= 65535:
            raise SpecError("controller_port", f"must be an integer in 1..65535, got {controller_port!r}")
        try:
            ipaddress.IPv4Address(controller_host)
        except ValueError:
            raise SpecError("controller_host", f"must be an IPv4 address, got {controller_host!r}") from None
        if not connect_timeout_s > 0:
            raise SpecError("connect_timeout_s", f"must be > 0, got {connect_timeout_s!r}")
        self.spec = spec
        self.plan = plan_fabric(spec)
        self.controller_port = controller_port
        self.controller_host = controller_host
        self.wait_connected = wait_connected
        self.connect_timeout_s = float(connect_timeout_s)
        self.net = None
        self._hosts: dict[int, object] = {}
        self._shell_recs: list[registry.ProcessRecord] = []
        self._procs: list[tuple[subprocess.Popen, registry.ProcessRecord | None]] = []
        self._tmpdir: str | None = None
        self._started = False
        self._stopped = False
        self.timings: dict[str, float] = {}
        self._capacity: dict | None = None

    # ---- context manager ----
    def __enter__(self) -> "EmulatedFabric":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- capacity ----
    def capacity_check(self) -> dict:
        if self._capacity is None:
            self._capacity = capacity.check_capacity(self.spec.aggregate_emulated_gbps, capacity.load_capacity())
        return self._capacity

    # ---- start ----
    def names_in_use(self) -> list[str]:
        """This fabric's bridge and interface names that already exist on the machine."""
        try:
            bridges = set(registry.ovs_bridges())
        except (OSError, RuntimeError, subprocess.SubprocessError):  # OVS down: the build says so itself
            bridges = set()
        return ([f"bridge {b}" for b in self.bridge_names() if b in bridges]
                + [f"interface {n}" for n in self.plan.interfaces() if _link_exists(n)])

    def start(self) -> "EmulatedFabric":
        if self._started:
            return self
        self.spec.check_emulatable()
        if os.geteuid() != 0:
            raise PermissionError("building the emulated fabric needs root")
        clash = self.names_in_use()
        if clash:  # before anything is built: stop() must never delete what another fabric made
            raise registry.NameInUse(
                f"{', '.join(clash[:5])}{' ...' if len(clash) > 5 else ''} already exist(s): another fabric is "
                "running on this machine, or a crashed run left them (`orchestrrl clean` removes what this "
                "installation recorded; `orchestrrl clean --all --dry-run` lists every orl* name)")
        self._started = True
        self._stopped = False
        cap = self.capacity_check()
        if cap["ok"] is None:
            log.warning("capacity: %s; this fabric can inject %.3g Gb/s", cap["message"],
                        cap["aggregate_emulated_gbps"])
        elif not cap["ok"]:
            log.warning("capacity: %s", cap["message"])
        else:
            log.info("capacity: %s", cap["message"])
        check_tcp_cc(self.spec.host_tcp_cc)
        buf_ok, buf = sendbuf.check()
        if not buf_ok:  # the fabric works, but drops packets wherever flows converge on a shaped port
            log.warning("Open vSwitch send buffer: %s (sudo scripts/provision.sh sets it)", buf)
        try:
            self._start()
        except BaseException:
            log.exception("fabric start failed; cleaning up")
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from mininet.link import Link
        from mininet.net import Mininet
        from mininet.node import Host, OVSSwitch, RemoteController

        t0 = time.monotonic()
        plan = self.plan
        self._tmpdir = tempfile.mkdtemp(prefix="orchestrrl-fabric-")
        registry.record_tmpdir(self._tmpdir)  # a driver killed with SIGKILL leaves it: `orchestrrl clean` removes it
        net = Mininet(topo=None, switch=OVSSwitch, host=Host, controller=None, link=Link,
                      ipBase=self.spec.fabric_subnet, build=False, autoSetMacs=False, autoStaticArp=False,
                      waitConnected=False)
        self.net = net
        class _Remote(RemoteController):
            def checkListening(self) -> None:
                """Skipped: Mininet telnets to the OpenFlow port and decodes what comes back as UTF-8, which
                fails now and then on the controller's binary hello (UnicodeDecodeError, start aborted).
                ``wait_connected`` checks the connection for real."""

        if not self.spec.is_static:
            net.addController("orlc0", controller=_Remote, ip=self.controller_host, port=self.controller_port)
        # interfaces first in the registry, then the things that create them
        for name in plan.interfaces():
            registry.record_resource("interface", name)
        for sw in plan.switches:
            registry.record_resource("bridge", sw.name)
        for h in plan.hosts:
            node = net.addHost(h.name, ip=f"{h.ip}/{plan.fabric_prefixlen}", mac=h.mac)
            self._record_shell(node.pid, "mnhost")
            self._hosts[h.server] = node
        for sw in plan.switches:
            node = net.addSwitch(sw.name, cls=OVSSwitch, dpid="%016x" % sw.dpid, datapath="user",
                                 protocols="OpenFlow13", failMode="secure", batch=True)
            self._record_shell(node.pid, "mnswitch")
        for link in plan.links:
            net.addLink(link.node1, link.node2, port1=link.port1, port2=link.port2,
                        intfName1=link.intf1, intfName2=link.intf2)
        with packet_socket_buffers():  # the bridges' ports (their datapath sockets) are added in here
            net.build()
            self.timings["build_s"] = time.monotonic() - t0
            t1 = time.monotonic()
            net.start()
            self._check_ports()
        self._configure_root()
        self._configure_hosts()
        if self.spec.is_static:
            self._install_static_flows()
        self.timings["start_s"] = time.monotonic() - t1
        if self.wait_connected is not None:
            t2 = time.monotonic()
            self.wait_connected({sw.dpid for sw in plan.switches}, self.connect_timeout_s)
            self.timings["connect_s"] = time.monotonic() - t2
        log.info("fabric up: %d hosts, %d bridges, %d links (%s)", len(plan.hosts), len(plan.switches),
                 len(plan.links), ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()))

    def _record_shell(self, pid: int, role: str) -> None:
        # Mininet shells are interactive bash (ignores SIGTERM) leading their own session: SIGHUP the group
        self._shell_recs.append(registry.record_process(pid, role, group=True, stop_signal=signal.SIGHUP))

    def _check_ports(self) -> None:
        """Every switch port got the OpenFlow number the spec says (ofport_request honoured)."""
        out = _run(["ovs-vsctl", "--timeout=10", "--format=csv", "--data=bare", "--no-headings",
                    "--columns=name,ofport", "list", "Interface"])
        got = {}
        for line in out.splitlines():
            parts = line.split(",")
            if len(parts) == 2:
                got[parts[0]] = parts[1]
        for link in self.plan.links:
            for node, port, intf in ((link.node1, link.port1, link.intf1), (link.node2, link.port2, link.intf2)):
                if node.startswith(f"{NAME_PREFIX}h"):
                    continue
                if got.get(intf) != str(port):
                    raise RuntimeError(f"{intf}: OpenFlow port {got.get(intf)!r}, expected {port}")

    def _configure_root(self) -> None:
        plan = self.plan
        # no IPv6 chatter from the switch-side veth ends; shape their egress (switch -> peer)
        sysctls = [f"net.ipv6.conf.{link.intf2}.disable_ipv6=1" for link in plan.links]
        sysctls += [f"net.ipv6.conf.{link.intf1}.disable_ipv6=1" for link in plan.links if link.kind == "uplink"]
        _run(["sysctl", "-q", "-w"] + sysctls)
        items = [(link.intf2, link.rate_mbps) for link in plan.links]
        items += [(link.intf1, link.rate_mbps) for link in plan.links if link.kind == "uplink"]
        shaping.shape_many(items)  # netlink, one socket: no tc spawned
        pids = {s: node.pid for s, node in self._hosts.items()}
        _run(["ip", "-batch", "-"], input_text="\n".join(mgmt_root_batch(plan, pids)) + "\n")
        _run(["sysctl", "-q", "-w", f"net.ipv6.conf.{plan.mgmt_bridge}.disable_ipv6=1"])

    def _install_static_flows(self) -> None:
        """:func:`static_flows` on every bridge, one ``ovs-ofctl add-flows`` per bridge (at start only)."""
        for br, flows in static_flows(self.spec).items():
            _run(["ovs-ofctl", "-O", "OpenFlow13", "add-flows", br, "-"], input_text="\n".join(flows) + "\n")

    def _configure_hosts(self) -> None:
        plan = self.plan
        assert self._tmpdir is not None
        for h in plan.hosts:
            node = self._hosts[h.server]
            ipf = os.path.join(self._tmpdir, f"{h.name}.ip")
            with open(ipf, "w") as f:
                f.write("\n".join(host_batch(plan, h.server)) + "\n")
            # IPv6 off where the kernel has it (best effort, as before); the host's own TCP congestion control
            # (FabricSpec.host_tcp_cc, checked at start) before any socket is made in it, or the host fails
            out = node.cmd(f"sysctl -q -w net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1"
                           f" >/dev/null; sysctl -q -w net.ipv4.tcp_congestion_control={self.spec.host_tcp_cc}"
                           f" && ip -batch {ipf} && echo ORL_OK")
            if "ORL_OK" not in out:
                raise RuntimeError(f"configuring host {h.name} failed: {out.strip()[:500]}")
            shaping.shape_many([(h.intf, self.spec.server_link_mbps)], netns_pid=node.pid)  # in its namespace

    # ---- accessors ----
    def _plan_host(self, server: int) -> HostPlan:
        self.spec._check_index("server", server, self.spec.n_servers)
        return self.plan.hosts[server]

    def host(self, server: int):
        """The Mininet Host of ``server``."""
        self._plan_host(server)
        if server not in self._hosts:
            raise RuntimeError("the fabric is not started")
        return self._hosts[server]

    @property
    def workdir(self) -> str:
        """A scratch folder that lives as long as the running fabric (stop() removes it): put run files here."""
        if self._tmpdir is None:
            raise RuntimeError("the fabric is not running")
        return self._tmpdir

    def intf_of(self, server: int) -> str:
        return self._plan_host(server).intf

    def mgmt_ip(self, server: int) -> str:
        return self._plan_host(server).mgmt_ip

    def bridge_names(self) -> list[str]:
        return [sw.name for sw in self.plan.switches]

    def dpids(self) -> list[int]:
        return [sw.dpid for sw in self.plan.switches]

    def popen(self, server: int, argv: Sequence[str], stdin: int | IO | None = None,
              stdout: int | IO | None = None, stderr: int | IO | None = None,
              env: dict[str, str] | None = None, cwd: str | None = None, text: bool = False,
              role: str = "hostproc") -> subprocess.Popen:
        """Run ``argv`` in host ``server``'s namespaces, in its own session; stop() stops it."""
        node = self.host(server)
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise SpecError("argv", "must be a non-empty list of strings")
        p = subprocess.Popen(["mnexec", "-a", str(node.pid)] + list(argv), stdin=stdin, stdout=stdout,
                             stderr=stderr, env=env, cwd=cwd, text=text, start_new_session=True)
        try:
            rec = registry.record_process(p.pid, f"{role}:{self.plan.hosts[server].name}", group=True)
        except SpecError:  # already exited
            rec = None
        self._procs.append((p, rec))
        return p

    # ---- stop ----
    def stop(self) -> None:
        """Remove everything this fabric made. Idempotent; never raises for cleanup trouble (logs it). A
        teardown signal arriving meanwhile waits until it is done (emulation.signals.shielded)."""
        if self._stopped or not self._started:
            return
        with shielded():
            self._stop()

    def _stop(self) -> None:
        self._stopped = True
        t0 = time.monotonic()
        # 1. processes started in hosts
        recs = [r for _, r in self._procs if r is not None]
        if recs:
            registry.stop_processes(recs, timeout_s=3.0)
        for p, rec in self._procs:
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                log.warning("process %d did not exit", p.pid)
            if rec is not None:
                registry.forget_process(rec.pid)
        self._procs = []
        # 2. Mininet (links, bridges, shells)
        if self.net is not None:
            try:
                self.net.stop()
            except Exception:
                log.exception("Mininet stop failed; removing what is left directly")
        # 3. shells Mininet did not stop, bridges, interfaces
        left = [r for r in self._shell_recs if registry.process_alive(r.pid, r.start_time)]
        if left:
            registry.stop_processes(left, timeout_s=2.0)
        for r in self._shell_recs:
            registry.forget_process(r.pid)
        self._shell_recs = []
        try:
            argv = ["ovs-vsctl", "--timeout=10"]
            for sw in self.plan.switches:
                argv += ["--", "--if-exists", "del-br", sw.name]
            _run(argv)
        except Exception:
            log.exception("deleting bridges failed")
        names = self.plan.interfaces()
        try:
            with Netlink() as nl:  # in-process: no `ip link del` spawned per interface
                for name in names:
                    if _link_exists(name):
                        try:
                            nl.delete_link(name)  # a veth goes with its peer: the peer is then gone
                        except NetlinkFailed as e:  # stop() never raises for cleanup trouble
                            log.error("deleting interface %s: %s", name, e)
        except NetlinkFailed as e:
            log.error("cannot open a netlink socket to delete interfaces: %s", e)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_link_exists(n) for n in names):
            time.sleep(0.02)
        still = [n for n in names if _link_exists(n)]
        if still:
            log.error("interfaces left after stop: %s", still)
        else:
            for name in names:
                registry.forget_resource("interface", name)
        for sw in self.plan.switches:
            registry.forget_resource("bridge", sw.name)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            registry.forget_tmpdir(self._tmpdir)
            self._tmpdir = None
        self._hosts = {}
        self.net = None
        self.timings["stop_s"] = time.monotonic() - t0
        self._started = False
