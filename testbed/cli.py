"""`orchestrrl` command line: one entry point, one module per command group.

It only dispatches: each module in COMMAND_MODULES exposes ``register(subparsers)`` which adds its parser(s) and sets
``func`` (``func(args) -> int``, the exit code). Exit codes: 0 ok, 1 failure/not ready (a plug-in's
impossible decision: ``emulation.plugins.DecisionError``), 2 bad input (``testbed.commands.common.UsageError`` or
``SpecError``). What the commands share lives in
``testbed.commands.common``, never here: a command never imports this module.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy here does small vector work: a BLAS thread pool only fights the agents and OVS for 2 cores (fits 0.05-0.1 s instead of 0.2-10 s, docs/forecast.md)
import logging
import signal
import sys

from emulation.plugins import DecisionError
from emulation.registry import NameInUse
from emulation.signals import exit_code, signal_of, teardown_on_signals
from emulation.validation import SpecError
from testbed.commands import bench, clean, controller, demo, doctor, fabric, run, sim
from testbed.commands.common import UsageError

COMMAND_MODULES = (doctor, clean, controller, fabric, bench, sim, demo, run)  # the order of `orchestrrl -h`


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrrl", description="OrchestrRL emulation testbed")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with teardown_on_signals():  # SIGINT, SIGTERM, SIGHUP: the same teardown (emulation/signals.py)
            return int(args.func(args) or 0)
    except (SpecError, UsageError) as e:
        print(f"orchestrrl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except DecisionError as e:  # a plug-in's decision could not be carried out: the run stopped
        print(f"orchestrrl {args.command}: error: a plug-in decided what cannot be carried out: {e}; the run was "
              "stopped (everything it started was stopped)", file=sys.stderr)
        return 1
    except NameInUse as e:  # another fabric holds the names: not bad input, nothing was touched
        print(f"orchestrrl {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"orchestrrl {args.command}: interrupted ({signal.Signals(signal_of(e)).name}): everything it "
              "started was stopped", file=sys.stderr)
        return exit_code(e)
    except BrokenPipeError:  # e.g. `orchestrrl sim ... --json | head`: the reader left, nothing is wrong
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
