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

from .fabric_models import fabric_model
from .fabrics import FabricOptions, radix_tiers  # noqa: F401 - radix_tiers re-exported (tests)

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


def port_counts(fabric: str, spec: FabricSpec, nic_gbps: float, opts: FabricOptions = FabricOptions(),
                prices: "Prices | None" = None) -> dict:
    """Counts of NICs, EPS ports by speed, OCS ports and fibres of ``fabric`` (a registered fabric kind or a
    plug-in: rlsim.fabric_models) built on ``spec``."""
    prices = prices or load_prices()
    model = fabric_model(fabric)
    nics_per_server = math.ceil(spec.server_gbps / nic_gbps - 1e-9)
    n_nic = spec.n_servers * nics_per_server
    eps = {nic_gbps: n_nic}  # ToR (or rail leaf) ports facing the NICs
    above = model.ports(spec, n_nic, opts, prices)
    for speed, n in above["eps"].items():
        eps[speed] = eps.get(speed, 0) + n
    packet = above["tiers"] is not None
    return {"nics": n_nic, "nic_gbps": nic_gbps, "eps_ports": {str(k): v for k, v in eps.items()},
            "ocs_ports": above["ocs"], "fibres": n_nic + above["links"],
            "packet_tiers": (above["tiers"] + 1) if packet else 1, "tier_method": above["tier_method"],
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
