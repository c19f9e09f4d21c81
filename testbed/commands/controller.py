"""`orchestrrl controller SCENARIO`: run the SDN controller in the foreground until Ctrl-C."""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def _home() -> Path:
    """The testbed's home folder (not created here: see :func:`_make_home`)."""
    return Path(os.environ.get("ORCHESTRRL_HOME", Path.home() / ".orchestrrl"))


def _make_home(home: Path) -> None:
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        from emulation.validation import SpecError

        raise SpecError("ORCHESTRRL_HOME", f"cannot create {str(home)!r}: {e.strerror or e}") from None


def register(subparsers) -> None:
    from controller.config import add_arguments

    p = subparsers.add_parser("controller", help="run the SDN controller (OpenFlow + REST API) in the foreground",
                              description="Runs the os-ken controller for the fabric of SCENARIO until Ctrl-C. "
                                          "Switches connect to --of-port; the REST API listens on "
                                          "--rest-host:--rest-port and needs the bearer token in --token-file "
                                          "(default ~/.orchestrrl/controller.token, created with a random token "
                                          "if absent) unless --no-auth. The state file defaults to "
                                          "~/.orchestrrl/state-<scenario>.json.")
    p.add_argument("scenario", help="scenario YAML file")
    # every option of python -m controller (controller/config.py), with this command's port defaults
    from emulation.scenario import DEFAULT_CONTROLLER_METRICS_PORT

    add_arguments(p, skip=("scenario", "spec_json", "verbose", "owner_pid", "owner_start"),
                  defaults={"of_port": 6653, "rest_port": 8080, "metrics_port": DEFAULT_CONTROLLER_METRICS_PORT})
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from controller.config import check_config, options_from_args, with_token
    from testbed.commands.common import UsageError

    if not Path(args.scenario).is_file():
        raise UsageError(f"scenario: no such file {args.scenario!r}")
    needs_home = not args.state_file or not (args.no_auth or args.token_file)
    home = _home() if needs_home else None
    token_file = None if args.no_auth else (args.token_file or str(home / "controller.token"))
    state_file = args.state_file or str(home / f"state-{Path(args.scenario).stem}.json")
    opts = options_from_args(args, scenario=args.scenario, token_file=token_file, state_file=state_file)
    cfg = check_config(opts)  # SpecError -> exit 2 naming the field; creates nothing
    if home is not None:  # only now that the input is valid: a bad option leaves no file behind
        _make_home(home)
    cfg = with_token(cfg)  # may create the token file (SpecError "token_file" when it cannot)
    print(f"OpenFlow: tcp:{cfg.of_host}:{cfg.of_port}")
    print(f"REST API: http://{cfg.rest_host}:{cfg.rest_port}/api/v1/")
    print("auth:     none (--no-auth)" if cfg.token is None else f"token:    {token_file}")
    print(f"state:    {state_file}")
    from emulation.metrics import url

    print(f"metrics:  {url(cfg.metrics_host, cfg.metrics_port)}" if cfg.metrics_port else "metrics:  off")
    print("Ctrl-C to stop", flush=True)
    from controller.app import run_controller

    return run_controller(cfg)
