"""The fabrics RLSim models, as a registry (emulation.plugins.Registry): each kind says how its network looks
in a phase (:meth:`FabricModel.network`; a re-wiring fabric also per topology, from the fabric's phase rule:
:meth:`FabricModel.topology`), what ports it is built of (:meth:`FabricModel.ports`, priced by rlsim.cost) and
how a sweep treats it (``reconfigures``, ``configurable``, ``radix_priced``). RLSim (rlsim.sim, rlsim.cost,
rlsim.sweep) and the testbed's phase model ask the model, never the fabric's name.

Built-ins (rlsim.fabrics' module docstring describes them): ``fat-tree`` and its oversubscribed variants
``fat-tree-2to1`` .. ``fat-tree-16to1``, ``rail``, ``topoopt``, ``mixnet`` and ``rfabric``; a user's by
``sim --fabric pkg.mod:Class`` or an entry point in group ``orchestrrl.fabrics`` (docs/plugins.md).
"""
from __future__ import annotations

import abc
import math

from emulation.plugins import Registry
from emulation.spec import OVERSUB, FabricSpec, JobLayout

from .fabrics import (TIER_METHODS, CircuitNetwork, FabricOptions, Network, TreeNetwork, fat_tree_tiers_above_tor,
                      mixnet_counts, mixnet_split, rfabric_network, topoopt_counts)


class FabricModel(abc.ABC):
    """A fabric kind. ``reconfigures``: re-wired per phase by the fabric's phase rule (RLSim then runs the
    phases' transitions); ``configurable``: a sweep varies its uplinks per ToR and OCS count; ``radix_priced``:
    its cost depends on the packet switches' radix."""

    reconfigures = False
    configurable = False
    radix_priced = False

    def __init__(self, name: str):
        self.name = name

    @abc.abstractmethod
    def network(self, spec: FabricSpec, layout: JobLayout, phase: str, opts: FabricOptions,
                traffic=None, rule=None) -> Network:
        """The network during ``phase`` (``traffic``, ``rule``: what a re-wiring fabric's topologies are built
        from: controller.traffic.PhaseTraffic and controller.fabric_rules.FabricRule)."""

    def topology(self, spec: FabricSpec, layout: JobLayout, topology: str, opts: FabricOptions, traffic=None,
                 rule=None) -> tuple[Network, dict | None]:
        """The network on the topology named ``topology`` (a phase's, or ``train:mp``/``train:dp``) and its
        OCS matchings (None for a static fabric: one network whatever the phase)."""
        return self.network(spec, layout, "train", opts, traffic, rule), None

    @abc.abstractmethod
    def ports(self, spec: FabricSpec, n_nic: int, opts: FabricOptions, prices) -> dict:
        """What it is built of above the NIC-facing ToR ports: ``eps`` ({speed: ports}), ``ocs`` (OCS ports),
        ``links`` (fibres), ``tiers`` (packet tiers above the ToR; None: not a packet fabric), ``tier_method``."""

    def detail(self, spec: FabricSpec, opts: FabricOptions) -> dict:
        """What RLSim's result reports of its configuration."""
        return {}


class Tree(FabricModel):
    """Fat-Tree with ``oversub``:1 at the ToR (rlsim.fabrics.TreeNetwork)."""

    oversub = 1.0
    radix_priced = True
    group_is_pod = False  # TreeNetwork's groups: ToRs (a Fat-Tree) or pods (rail leaves)

    def network(self, spec, layout, phase, opts, traffic=None, rule=None) -> Network:
        return TreeNetwork(self.name, spec, self.oversub, group_is_pod=self.group_is_pod)

    def tiers(self, spec, n_nic, opts, prices) -> tuple[int, str]:
        """Packet tiers above the ToR, and how that number was chosen."""
        return fat_tree_tiers_above_tor(spec, n_nic, self.oversub, opts, prices), TIER_METHODS[opts.fat_tree_tiers]

    def ports(self, spec, n_nic, opts, prices) -> dict:
        up = spec.uplink_gbps
        tor_up = spec.n_tors * math.ceil(spec.servers_per_tor * spec.server_gbps / self.oversub / up - 1e-9)
        tiers, method = self.tiers(spec, n_nic, opts, prices)
        # per tier above the ToR: the tier below's up ports + its own down ports
        return {"eps": {up: 2 * tor_up * tiers}, "ocs": 0, "links": tor_up * tiers, "tiers": tiers,
                "tier_method": method}


class Rail(Tree):
    """Rail-optimised: rail leaves span a pod; a non-blocking spine joins the pods."""

    radix_priced = False
    group_is_pod = True

    def tiers(self, spec, n_nic, opts, prices) -> tuple[int, str]:
        return (1 if spec.pods > 1 else 0), "rail leaves + spine"


class _Circuits(FabricModel):
    """ToR uplinks on OCS ports (one OCS port per ToR uplink unless said otherwise)."""

    def ocs_ports(self, spec) -> int:
        return spec.n_tors * spec.uplinks_per_tor

    def ports(self, spec, n_nic, opts, prices) -> dict:
        ports = spec.n_tors * spec.uplinks_per_tor
        return {"eps": {spec.uplink_gbps: ports}, "ocs": self.ocs_ports(spec), "links": ports, "tiers": None,
                "tier_method": None}


class TopoOpt(_Circuits):
    def network(self, spec, layout, phase, opts, traffic=None, rule=None) -> Network:
        return CircuitNetwork(self.name, spec, topoopt_counts(spec, layout), opts.max_two_hop)


class MixNet(FabricModel):
    radix_priced = True

    def network(self, spec, layout, phase, opts, traffic=None, rule=None) -> Network:
        ocs, eps = mixnet_split(spec, opts)
        return CircuitNetwork(self.name, spec, mixnet_counts(spec, ocs), opts.max_two_hop,
                              eps_uplink_gbps=eps * spec.uplink_gbps)

    def ports(self, spec, n_nic, opts, prices) -> dict:
        up = spec.uplink_gbps
        n_ocs, n_eps = mixnet_split(spec, opts)
        eps_up = spec.n_tors * n_eps
        out = {"eps": {up: spec.n_tors * (n_ocs + n_eps)}, "ocs": spec.n_tors * n_ocs,
               "links": spec.n_tors * (n_ocs + n_eps), "tier_method": TIER_METHODS[opts.fat_tree_tiers]}
        tiers = fat_tree_tiers_above_tor(spec, n_nic, spec.uplinks_per_tor / n_eps if n_eps else 1.0, opts, prices)
        if tiers >= 1:  # the ToRs' packet uplinks are counted above; the first tier's down ports here
            out["eps"][up] += eps_up + 2 * eps_up * (tiers - 1)
            out["links"] += eps_up * (tiers - 1)
        out["tiers"] = tiers
        return out

    def detail(self, spec, opts) -> dict:
        return {"mixnet_split": list(mixnet_split(spec, opts))}


class RFabric(_Circuits):
    """The ToR uplinks on the FabricSpec's OCSes, wired per phase by the fabric's phase rule."""

    reconfigures = True
    configurable = True

    def ocs_ports(self, spec) -> int:
        return spec.ocs_count * spec.ports_per_ocs

    def network(self, spec, layout, phase, opts, traffic=None, rule=None) -> Network:
        return self.topology(spec, layout, phase, opts, traffic, rule)[0]

    def topology(self, spec, layout, topology, opts, traffic=None, rule=None):
        return rfabric_network(spec, layout, topology, traffic, opts.max_two_hop, rule)


def _tree(name: str, oversub: float) -> type:
    return type(f"FatTree{name.rpartition('-')[2].replace('to', 'To')}", (Tree,), {"oversub": oversub,
                                                                                   "__module__": __name__})


_TREES = {name: _tree(name, o) for name, o in OVERSUB.items()}
FABRIC_MODELS = Registry("fabric", FabricModel, "fabrics", {**_TREES, "rail": Rail, "topoopt": TopoOpt,
                                                            "mixnet": MixNet, "rfabric": RFabric})


def fabric_model(ref: str, field: str = "fabric") -> FabricModel:
    """The fabric ``ref`` names (a built-in kind, a path ``pkg.mod:Class`` or an entry point), made."""
    return FABRIC_MODELS.resolve(ref, field)(ref)


def build_network(fabric: str, spec: FabricSpec, layout: JobLayout, phase: str = "train",
                  opts: FabricOptions = FabricOptions(), traffic=None, rule=None) -> Network:
    """The network of ``fabric`` (a registered kind or a plug-in) during ``phase`` (only a re-wiring fabric
    changes with the phase; ``traffic``: what its train topology is built from, ``rule``: the fabric's phase
    rule)."""
    return fabric_model(fabric).network(spec, layout, phase, opts, traffic, rule)


def fabric_names() -> tuple[str, ...]:
    """The registered fabric kinds."""
    return FABRIC_MODELS.names()
