"""`orchestrrl` command line: one entry point, one module per command group.

Each module in COMMAND_MODULES exposes ``register(subparsers)`` which adds its parser(s) and sets
``func`` (``func(args) -> int``, the exit code). Exit codes: 0 ok, 1 failure/not ready, 2 bad input.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy here does small vector work: a BLAS thread pool only fights the agents and OVS for 2 cores (fits 0.05-0.1 s instead of 0.2-10 s, docs/forecast.md)
import importlib
import logging
import sys

from emulation.registry import NameInUse
from emulation.signals import exit_code, teardown_on_signals
from emulation.validation import SpecError

COMMAND_MODULES = (
    "testbed.commands.doctor",
    "testbed.commands.clean",
    "testbed.commands.controller",
    "testbed.commands.fabric",
    "testbed.commands.bench",
    "testbed.commands.sim",
    "testbed.commands.demo",
    "testbed.commands.run",
)


class UsageError(Exception):
    """Bad command-line input detected after parsing (exit code 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrrl", description="OrchestrRL emulation testbed")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
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
    except NameInUse as e:  # another fabric holds the names: not bad input, nothing was touched
        print(f"orchestrrl {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"orchestrrl {args.command}: interrupted ({e or 'SIGINT'}): everything it started was stopped",
              file=sys.stderr)
        return exit_code(e)
    except BrokenPipeError:  # e.g. `orchestrrl sim ... --json | head`: the reader left, nothing is wrong
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
