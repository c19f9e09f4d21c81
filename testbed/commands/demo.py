"""`orchestrrl demo [SCENARIO]` (what `make demo` runs): `orchestrrl compare SCENARIO --backend emulated` on
the default scenario: the tuned static baseline (tuned first on the simulated backend), static-low, static-high,
the planner, the balancer and both, on real agents in Mininet hosts over the emulated RFabric; prints whether
every run was faithful and what the run was fitted to (first line), the speedup table and the oracle bounds,
and writes report.json and the plots. The run is fitted to this machine first (``--time-dilation auto``,
testbed/cluster/fit.py): a lower scale, or a larger dilation, until each phase's traffic fits what this machine
forwards beside the agents."""
from __future__ import annotations

import argparse
import time

from testbed.commands.common import shipped_scenario


def _run(args: argparse.Namespace) -> int:
    from testbed.commands.run import _compare

    args.backend = "emulated"
    args.policies = None
    args.out = args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    return _compare(args)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="compare every policy on the emulated cluster (the default scenario)")
    p.add_argument("scenario", nargs="?", default=shipped_scenario("default.yaml"), help="scenario YAML")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the scenario's)")
    p.add_argument("--out", default=None, help="output folder (default runs/demo-<time>)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-cache", action="store_true", help="tune the static baseline and the oracle afresh")
    from testbed.commands.run import time_dilation_arg

    p.add_argument("--time-dilation", type=time_dilation_arg, default="auto", metavar="TDF|auto",
                   help="'auto' (default): fit the run to this machine, a lower scale or a larger dilation than the "
                        "scenario's until each phase's traffic fits (testbed/cluster/fit.py); a number: emulate "
                        "at exactly that dilation")
    from testbed.runs.metrics import add_flags

    add_flags(p)
    p.set_defaults(func=_run)
