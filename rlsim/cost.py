"""Fabric cost: count every tier's ports and optics, price them from ``rlsim/data/prices.yaml``.

Counting method (MixNet's public calculator, REFERENCE.md "Network components"):

* one NIC per ``nic_gbps`` of server bandwidth (``server_gbps / nic_gbps`` per server), each with a transceiver;
* every electrical switch port has a transceiver; OCS ports are passive (the ToR-side module drives the fibre);
* one fibre per link (``fibre_m`` metres each; in an all-electrical fabric this is optical modules / 2);
* Fat-Tree ports per tier from the uplink ratio: ToR down = NICs, ToR up = down / oversubscription, then
  every tier above the ToR has as many ports down and up as the ToR uplinks (non-blocking above the ToR;
  the top tier has down ports only). How many tiers (``FabricOptions.fat_tree_tiers``, ``TIER_METHODS``):
  ``"auto"`` (the default) the fewest tiers of ``switch_radix``-port switches (prices.yaml: 64 x 400G,
  REFERENCE.md) that cover the NICs: at 64 ports 2 tiers up to 2,048 NICs, 3 up to 65,536; ``"2"`` one
  spine tier; ``"3"`` the MixNet calculator's method (three tiers whenever there are several pods of
  several ToRs, whatever the radix).

GPUs and servers are not counted: this is the cost of the network only (NICs included, the same in every
fabric). ``docs/rlsim.md`` discusses which assumptions drive the ratios.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import yaml

from emulation.spec import FabricSpec
from emulation.validation import SpecError

from .fabrics import FABRICS, OVERSUB, TIER_METHODS, FabricOptions, mixnet_split

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prices.yaml")


@dataclass(frozen=True)
class Prices:
    transceiver: dict
    nic: dict
    eps_port: dict
    ocs_port: float
    patch_panel_port: float
    fibre_per_m: float
    fibre_m: float
    switch_radix: int = 64  # ports per packet switch, for fat_tree_tiers="auto"

    def by_speed(self, table: str, gbps: float) -> float:
        t = getattr(self, table)
        key = int(gbps) if float(gbps).is_integer() else gbps
        if key not in t:
            raise SpecError(f"prices.{table}", f"no price for {gbps:g} Gb/s (have {', '.join(map(str, sorted(t)))})")
        return float(t[key])


@lru_cache(maxsize=None)
def load_prices(path: str = DATA) -> Prices:
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    try:
        return Prices(**{k: raw[k] for k in ("transceiver", "nic", "eps_port", "ocs_port", "patch_panel_port",
                                             "fibre_per_m", "fibre_m", "switch_radix")})
    except (KeyError, TypeError) as e:
        raise SpecError("prices", f"{path}: missing or bad entry {e}") from None


def _structural_tiers_above_tor(spec: FabricSpec) -> int:
    if spec.n_tors == 1:
        return 0
    if spec.pods == 1 or spec.tors_per_pod == 1:
        return 1
    return 2


def radix_tiers(n_endpoints: int, radix: int, oversub: float = 1.0) -> int:
    """Fewest switch tiers of a folded Clos of ``radix``-port switches that cover ``n_endpoints`` NIC ports:
    a leaf has ``d = radix * o / (1 + o)`` ports down; 1 tier covers ``radix``, 2 tiers ``radix * d`` (a spine
    of radix ports reaches radix leaves), each further tier multiplies by ``radix / 2``."""
    if radix < 2:
        raise SpecError("prices.switch_radix", f"must be >= 2, got {radix}")
    if n_endpoints <= radix:
        return 1
    d = max(1, int(radix * oversub / (1 + oversub)))
    cover, tiers = radix * d, 2
    while cover < n_endpoints:
        cover *= radix // 2
        tiers += 1
    return tiers


def fat_tree_tiers_above_tor(spec: FabricSpec, n_nic: int, oversub: float, opts: FabricOptions,
                             prices: "Prices") -> int:
    """Packet tiers above the ToR: "auto" (from the radix, the default), "2" (one spine tier), "3" (the MixNet
    calculator's method: ToR, pod aggregation and core whenever there are several pods of several ToRs)."""
    if opts.fat_tree_tiers == "3":
        return _structural_tiers_above_tor(spec)
    if opts.fat_tree_tiers == "2":
        return min(1, _structural_tiers_above_tor(spec))
    radix = opts.switch_radix or prices.switch_radix
    return radix_tiers(n_nic, radix, oversub) - 1 if spec.n_tors > 1 else 0


def port_counts(fabric: str, spec: FabricSpec, nic_gbps: float, opts: FabricOptions = FabricOptions(),
                prices: "Prices | None" = None) -> dict:
    """Counts of NICs, EPS ports by speed, OCS ports and fibres of ``fabric`` built on ``spec``."""
    prices = prices or load_prices()
    if fabric not in FABRICS:
        raise SpecError("fabric", f"must be one of {', '.join(FABRICS)}, got {fabric!r}")
    nics_per_server = math.ceil(spec.server_gbps / nic_gbps - 1e-9)
    n_nic = spec.n_servers * nics_per_server
    up = spec.uplink_gbps
    eps = {nic_gbps: n_nic}  # ToR (or rail leaf) ports facing the NICs
    ocs = 0
    links = n_nic  # NIC - ToR

    def add(speed: float, n: int) -> None:
        eps[speed] = eps.get(speed, 0) + n

    if fabric in OVERSUB or fabric == "rail":
        o = OVERSUB.get(fabric, 1.0)
        tor_up = spec.n_tors * math.ceil(spec.servers_per_tor * spec.server_gbps / o / up - 1e-9)
        tiers = fat_tree_tiers_above_tor(spec, n_nic, o, opts, prices)
        if fabric == "rail":  # rail leaves span a pod; a non-blocking spine joins the pods
            tiers = 1 if spec.pods > 1 else 0
        add(up, 2 * tor_up * tiers)  # per tier above the ToR: the tier below's up ports + its own down ports
        links += tor_up * tiers
    elif fabric in ("topoopt", "rfabric"):
        ports = spec.n_tors * spec.uplinks_per_tor
        add(up, ports)
        ocs = spec.ocs_count * spec.ports_per_ocs if fabric == "rfabric" else ports
        links += ports
    else:  # mixnet
        n_ocs, n_eps = mixnet_split(spec, opts)
        add(up, spec.n_tors * (n_ocs + n_eps))
        ocs = spec.n_tors * n_ocs
        links += spec.n_tors * (n_ocs + n_eps)
        eps_up = spec.n_tors * n_eps
        tiers = fat_tree_tiers_above_tor(spec, n_nic, spec.uplinks_per_tor / n_eps if n_eps else 1.0, opts, prices)
        if tiers >= 1:  # the ToRs' packet uplinks are counted above; the first tier's down ports here
            add(up, eps_up + 2 * eps_up * (tiers - 1))
            links += eps_up * (tiers - 1)
    packet = fabric not in ("topoopt", "rfabric")
    return {"nics": n_nic, "nic_gbps": nic_gbps, "eps_ports": {str(k): v for k, v in eps.items()},
            "ocs_ports": ocs, "fibres": links, "packet_tiers": (tiers + 1) if packet else 1,
            "tier_method": (TIER_METHODS[opts.fat_tree_tiers] if fabric != "rail" else "rail leaves + spine")
            if packet else None,
            "switch_radix": (opts.switch_radix or prices.switch_radix) if packet else None}


def fabric_cost(fabric: str, spec: FabricSpec, nic_gbps: float, prices: Prices | None = None,
                opts: FabricOptions = FabricOptions()) -> dict:
    """Counts and USD breakdown; ``total_usd`` is the network's cost."""
    p = prices or load_prices()
    c = port_counts(fabric, spec, nic_gbps, opts, p)
    usd = {
        "nics": c["nics"] * p.by_speed("nic", nic_gbps),
        "nic_transceivers": c["nics"] * p.by_speed("transceiver", nic_gbps),
        "eps_ports": sum(n * p.by_speed("eps_port", float(s)) for s, n in c["eps_ports"].items()),
        "eps_transceivers": sum(n * p.by_speed("transceiver", float(s)) for s, n in c["eps_ports"].items()),
        "ocs_ports": c["ocs_ports"] * p.ocs_port,
        "fibres": c["fibres"] * p.fibre_m * p.fibre_per_m,
    }
    return {"counts": c, "usd": usd, "total_usd": float(sum(usd.values()))}
