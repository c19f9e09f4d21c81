"""``python -m controller``: run the OrchestrRL SDN controller (options: controller/config.py)."""
from __future__ import annotations

import logging
import sys

from emulation.validation import SpecError

from .config import build_arg_parser, config_from_options, options_from_args


def main(argv: list[str] | None = None) -> int:
    """Parse and validate (exit 2 naming the field, before os-ken is imported), then run the controller."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose == 0 else logging.DEBUG,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_options(options_from_args(args))
    except SpecError as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    from .app import run_controller  # os-ken only from here on

    return run_controller(cfg)


if __name__ == "__main__":
    sys.exit(main())
