"""Fabric cost: count every tier's ports and optics, price them from ``rlsim/data/prices.yaml``.

Counting method (MixNet's public calculator, REFERENCE.md "Network components"):

* one NIC per ``nic_gbps`` of server bandwidth (``server_gbps / nic_gbps`` per server), each with a transceiver;
* every electrical switch port has a transceiver; OCS ports are passive (the ToR-side module drives the fibre);
* one fibre per link (``fibre_m`` metres each; in an all-electrical fabric this is optical modules / 2);
* Fat-Tree ports per tier from the uplink ratio: ToR down = NICs, ToR up = down / oversubscription, then
  aggregation down and up and core ports equal the ToR uplinks (non-blocking above the ToR; three tiers
  when there are several pods of several ToRs).

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

from .fabrics import FABRICS, OVERSUB, FabricOptions, mixnet_split

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
                                             "fibre_per_m", "fibre_m")})
    except (KeyError, TypeError) as e:
        raise SpecError("prices", f"{path}: missing or bad entry {e}") from None


def _eps_tiers_above_tor(spec: FabricSpec) -> int:
    if spec.n_tors == 1:
        return 0
    if spec.pods == 1 or spec.tors_per_pod == 1:
        return 1
    return 2


def port_counts(fabric: str, spec: FabricSpec, nic_gbps: float, opts: FabricOptions = FabricOptions()) -> dict:
    """Counts of NICs, EPS ports by speed, OCS ports and fibres of ``fabric`` built on ``spec``."""
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
        tiers = _eps_tiers_above_tor(spec)
        if fabric == "rail":  # rail leaves span a pod; a non-blocking spine joins the pods
            tiers = 1 if spec.pods > 1 else 0
        if tiers >= 1:
            add(up, 2 * tor_up)  # ToR up + next tier down
            links += tor_up
        if tiers == 2:
            add(up, 2 * tor_up)  # aggregation up + core
            links += tor_up
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
        tiers = _eps_tiers_above_tor(spec)
        if tiers >= 1:
            add(up, eps_up)
        if tiers == 2:
            add(up, 2 * eps_up)
            links += eps_up
    return {"nics": n_nic, "nic_gbps": nic_gbps, "eps_ports": {str(k): v for k, v in eps.items()},
            "ocs_ports": ocs, "fibres": links}


def fabric_cost(fabric: str, spec: FabricSpec, nic_gbps: float, prices: Prices | None = None,
                opts: FabricOptions = FabricOptions()) -> dict:
    """Counts and USD breakdown; ``total_usd`` is the network's cost."""
    p = prices or load_prices()
    c = port_counts(fabric, spec, nic_gbps, opts)
    usd = {
        "nics": c["nics"] * p.by_speed("nic", nic_gbps),
        "nic_transceivers": c["nics"] * p.by_speed("transceiver", nic_gbps),
        "eps_ports": sum(n * p.by_speed("eps_port", float(s)) for s, n in c["eps_ports"].items()),
        "eps_transceivers": sum(n * p.by_speed("transceiver", float(s)) for s, n in c["eps_ports"].items()),
        "ocs_ports": c["ocs_ports"] * p.ocs_port,
        "fibres": c["fibres"] * p.fibre_m * p.fibre_per_m,
    }
    return {"counts": c, "usd": usd, "total_usd": float(sum(usd.values()))}
