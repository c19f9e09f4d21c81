"""The controller's command line and its validated configuration: one home for every controller option.

A controller option is one field of :class:`ControllerOptions` (its type, default and help text). From that
one place come the parser of ``python -m controller`` (:func:`build_arg_parser`), the options of
``orchestrrl controller`` (:func:`add_arguments`), and the argv a :class:`controller.process.ControllerProcess`
starts the controller with (:func:`to_argv`). :func:`check_config` validates options into a
:class:`ControllerConfig` without creating any file; :func:`with_token` then reads or creates the token.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from emulation.scenario import check_metrics_host, check_metrics_port
from emulation.spec import FabricSpec, JobLayout, check_delay_ms, check_phase
from emulation.validation import SpecError, from_dict, require
from emulation.workload import WorkloadSpec

from .datapath import check_flush_mode, open_flow_cache
from .fabric_rules import fabric_rule
from .runtime import load_state

PROG = "python -m controller"


def _opt(default: Any, help: str, group: str | None = None, action: str | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "group": group, "action": action})


@dataclass(frozen=True)
class ControllerOptions:
    """The controller's command line, one field per option (``--of-port`` is ``of_port``).

    ``group``: options of one group exclude each other. Every field but ``verbose`` reaches
    :func:`check_config`; a new option is a new field here (plus its use in ControllerConfig).
    """

    scenario: str | None = _opt(None, "scenario YAML (fabric, layout, controller settings)", group="source")
    spec_json: str | None = _opt(None, 'JSON: {"fabric": {FabricSpec fields}, "layout": {JobLayout fields}}',
                                 group="source")
    of_port: int | None = _opt(None, "OpenFlow listen port")
    of_host: str = _opt("127.0.0.1", "OpenFlow listen address (default 127.0.0.1)")
    rest_port: int | None = _opt(None, "REST API port")
    rest_host: str = _opt("127.0.0.1", "REST API address (default 127.0.0.1)")
    token_file: str | None = _opt(None, "bearer token file (created with a random token, mode 0600, if absent)",
                                  group="auth")
    no_auth: bool = _opt(False, "serve the REST API without a token", group="auth")
    state_file: str | None = _opt(None, "JSON file holding the intended circuits (reconciled after a restart)")
    initial_phase: str | None = _opt(None, "phase installed on a fresh fabric (default: the scenario's, else train)")
    delay_ms: float | None = _opt(None, "OCS switching delay in wall-clock ms, for requests that give none "
                                        "(default: the scenario's reconfig delay x its time dilation)")
    datapath_flush: str = _opt("auto", "purge Open vSwitch's cached datapath flows when a reconfiguration's deletes "
                                       "and adds are confirmed, so changed paths are dark for D and no longer "
                                       "(controller/datapath.py): auto (when the local ovs-vswitchd is found), on, off")
    owner_pid: int | None = _opt(None, "exit when the process with this PID is gone (the process that started "
                                       "the controller: a driver killed with SIGKILL takes its controller with it)")
    owner_start: int | None = _opt(None, "the owner's start time (field 22 of /proc/PID/stat), so a recycled PID "
                                         "is not mistaken for it")
    metrics_port: int = _opt(0, "Prometheus /metrics port (README \"Live metrics\"; 0: no endpoint)")
    metrics_host: str = _opt("127.0.0.1", "Prometheus /metrics address (default 127.0.0.1; read-only, no token)")
    verbose: int = _opt(0, "more logging (-vv: debug)", action="count")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_arguments(parser: argparse.ArgumentParser, skip: Iterable[str] = (),
                  defaults: Mapping[str, Any] | None = None, required: Iterable[str] = (),
                  required_groups: Iterable[str] = ()) -> None:
    """Add every ControllerOptions field not in ``skip`` to ``parser`` (``defaults`` override the fields')."""
    skip, defaults, required = set(skip), dict(defaults or {}), set(required)
    hints = typing.get_type_hints(ControllerOptions)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(ControllerOptions):
        if f.name in skip:
            continue
        meta = f.metadata
        target: Any = parser
        if meta["group"]:
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_mutually_exclusive_group(
                    required=meta["group"] in set(required_groups))
            target = groups[meta["group"]]
        default = defaults.get(f.name, f.default)
        help_text = meta["help"] + (f" (default {default})" if f.name in defaults else "")
        if meta["action"] == "count":
            target.add_argument("-v", _flag(f.name), action="count", default=default, help=help_text)
        elif _base_type(hints[f.name]) is bool:
            target.add_argument(_flag(f.name), action="store_true", help=help_text)
        else:
            target.add_argument(_flag(f.name), type=_base_type(hints[f.name]), default=default, help=help_text,
                                required=f.name in required)


def build_arg_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m controller``."""
    p = argparse.ArgumentParser(prog=PROG, description="OrchestrRL SDN controller (os-ken)")
    add_arguments(p, required=("of_port", "rest_port"), required_groups=("source",))
    return p


def options_from_args(args: argparse.Namespace, **overrides: Any) -> ControllerOptions:
    """ControllerOptions from parsed arguments (fields the parser lacks keep their defaults)."""
    names = {f.name for f in dataclasses.fields(ControllerOptions)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"not controller options: {unknown}")
    values = {n: getattr(args, n) for n in names if hasattr(args, n)}
    values.update(overrides)
    return ControllerOptions(**values)


def to_argv(opts: ControllerOptions) -> list[str]:
    """The command-line arguments that give ``opts`` (options at their default are left out)."""
    out: list[str] = []
    for f in dataclasses.fields(ControllerOptions):
        v = getattr(opts, f.name)
        if v == f.default:
            continue
        if f.metadata["action"] == "count":
            out += ["-v"] * int(v)
        elif isinstance(v, bool):
            out += [_flag(f.name)] if v else []
        else:
            out += [_flag(f.name), str(v)]
    return out


# ---- the validated configuration ---------------------------------------------------------------------
@dataclass(frozen=True)
class SpecJson:
    """``--spec-json``: a FabricSpec plus an optional layout and workload (and nothing else). The workload
    is what the train topology is built from (``controller.traffic``); without it the train phase is the
    uniform mesh."""

    fabric: FabricSpec = FabricSpec()
    layout: JobLayout = JobLayout()
    workload: Optional[WorkloadSpec] = None
    rule: str = "benefit-aware"  # the fabric's phase rule (controller.fabric_rules)
    rule_params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ControllerConfig:
    spec: FabricSpec
    layout: JobLayout
    of_port: int
    rest_port: int
    delay_ms: float  # the OCS switching delay in wall time, resolved once by config_from_options
    rest_host: str = "127.0.0.1"
    of_host: str = "127.0.0.1"
    token: str | None = None  # None: no auth (--no-auth), or not read yet (check_config)
    token_file: str | None = None  # None: no auth
    state_file: str | None = None
    initial_phase: str = "train"
    datapath_flush: str = "auto"
    owner_pid: int | None = None  # exit once this process is gone
    owner_start: int | None = None
    workload: WorkloadSpec | None = None  # what the phase topologies are planned for (None: unknown)
    metrics_port: int = 0  # 0: no Prometheus endpoint
    metrics_host: str = "127.0.0.1"
    rule: str = "benefit-aware"  # the fabric's phase rule (controller.fabric_rules), resolved at start
    rule_params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.owner_pid is not None:
            require(isinstance(self.owner_pid, int) and not isinstance(self.owner_pid, bool) and self.owner_pid > 1,
                    "owner_pid", f"must be a PID > 1, got {self.owner_pid!r}")
        if self.owner_start is not None:
            require(self.owner_pid is not None, "owner_start", "needs owner_pid")
            require(isinstance(self.owner_start, int) and self.owner_start >= 0, "owner_start",
                    f"must be >= 0, got {self.owner_start!r}")
        for name in ("of_port", "rest_port"):
            v = getattr(self, name)
            require(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535, name,
                    f"must be a TCP port 1..65535, got {v!r}")
        require(self.of_port != self.rest_port, "rest_port", f"must differ from of_port ({self.of_port})")
        require(self.metrics_port is not None, "metrics_port", "must be a TCP port 1..65535 or 0 (off), got None")
        check_metrics_port(self.metrics_port, "metrics_port")
        require(not self.metrics_port or self.metrics_port not in (self.of_port, self.rest_port), "metrics_port",
                f"must differ from of_port ({self.of_port}) and rest_port ({self.rest_port})")
        check_metrics_host(self.metrics_host, "metrics_host")
        require(check_delay_ms(self.delay_ms, "delay_ms") is not None, "delay_ms", "must be given (wall-clock ms)")
        check_flush_mode(self.datapath_flush)


def read_or_create_token(path: str) -> str:
    """The token in ``path``; when the file does not exist, a new random token written there (mode 0600).

    Raises SpecError("token_file", ...) when the file cannot be read or created (a directory, a missing
    parent folder, no permission, not text) or holds too short a token.
    """
    p = Path(path)
    try:
        if p.exists() or p.is_symlink():
            tok = p.read_text().strip()
            require(len(tok) >= 16, "token_file", f"{path}: token must be at least 16 characters")
            return tok
        tok = secrets.token_urlsafe(32)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(tok + "\n")
        return tok
    except IsADirectoryError:
        raise SpecError("token_file", f"{path}: is a directory, not a token file") from None
    except FileNotFoundError:
        raise SpecError("token_file", f"{path}: cannot create it (folder {str(p.parent)!r} does not exist)") from None
    except PermissionError as e:
        raise SpecError("token_file", f"{path}: permission denied ({e.strerror})") from None
    except UnicodeDecodeError:
        raise SpecError("token_file", f"{path}: not a text token file") from None
    except OSError as e:
        raise SpecError("token_file", f"{path}: {e.strerror or e}") from None


def check_config(opts: ControllerOptions) -> ControllerConfig:
    """The validated config, without its token yet (see :func:`with_token`).

    Reads the scenario and state file but creates nothing. SpecError names the field.
    """
    require(bool(opts.scenario) != bool(opts.spec_json), "scenario", "give exactly one of --scenario, --spec-json")
    require(opts.of_port is not None, "of_port", "is required")
    require(opts.rest_port is not None, "rest_port", "is required")
    initial_phase, delay_ms = opts.initial_phase, opts.delay_ms
    if opts.scenario:
        from emulation.scenario import load_scenario

        sc = load_scenario(opts.scenario)
        spec, layout, workload = sc.fabric, sc.layout, sc.workload
        rule, rule_params = sc.controller.rule, sc.controller.rule_params
        initial_phase = initial_phase or sc.controller.initial_phase
        wall_delay_ms = sc.wall_delay_ms
    else:
        try:
            data = json.loads(opts.spec_json)
        except ValueError as e:
            raise SpecError("spec_json", f"not valid JSON: {e}") from None
        sj = from_dict(SpecJson, data, "spec_json")
        spec, layout, workload = sj.fabric, sj.layout, sj.workload
        rule, rule_params = sj.rule, sj.rule_params
        wall_delay_ms = spec.wall_ms(spec.reconfig_delay_ms)
    delay_ms = wall_delay_ms if delay_ms is None else delay_ms  # resolved here, once
    layout.check(spec)
    fabric_rule(rule, rule_params, "rule")  # a rule that does not resolve stops the start (exit 2)
    initial_phase = check_phase(initial_phase or "train", "initial_phase")
    if opts.state_file:
        load_state(Path(opts.state_file), spec)  # a broken state file stops the start (exit 2), not later
    token_file = None
    if not opts.no_auth:
        require(bool(opts.token_file), "token_file", "give --token-file FILE (or --no-auth explicitly)")
        token_file = str(opts.token_file)
    cfg = ControllerConfig(spec=spec, layout=layout, of_port=opts.of_port, rest_port=opts.rest_port,
                           rest_host=opts.rest_host, of_host=opts.of_host, token=None,
                           token_file=token_file, state_file=opts.state_file,
                           initial_phase=initial_phase, delay_ms=delay_ms, datapath_flush=opts.datapath_flush,
                           owner_pid=opts.owner_pid, owner_start=opts.owner_start,
                           workload=workload, metrics_port=opts.metrics_port, metrics_host=opts.metrics_host,
                           rule=rule, rule_params=dict(rule_params))
    if cfg.datapath_flush == "on":
        open_flow_cache("on")  # no ovs-vswitchd to flush: stop here (exit 2), not at the first reconfiguration
    return cfg


def with_token(cfg: ControllerConfig) -> ControllerConfig:
    """``cfg`` with the token read from (or created in) its token file; unchanged without auth."""
    if cfg.token_file is None:
        return cfg
    return replace(cfg, token=read_or_create_token(cfg.token_file))


def config_from_options(opts: ControllerOptions) -> ControllerConfig:
    """Validated config with its token (SpecError names the field). Everything is checked before any file
    is created: a bad port leaves no token file behind."""
    return with_token(check_config(opts))
