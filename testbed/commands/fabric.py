"""`orchestrrl fabric up SCENARIO`: bring up the scenario's fabric and controller; hold until Ctrl-C."""
from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

from emulation.signals import TEARDOWN_SIGNALS
from emulation.validation import SpecError


def check_info_file(path: str) -> Path:
    """``--info-file``: a file (new or to replace) in an existing, writable folder; SpecError naming
    ``info_file`` otherwise. Checked before anything is built; creates nothing."""
    p = Path(path)
    if p.is_dir():
        raise SpecError("info_file", f"{path}: is a directory, not a file")
    parent = p.parent
    if not parent.is_dir():
        raise SpecError("info_file", f"{path}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise SpecError("info_file", f"{path}: not writable")
    return p


def _up(args: argparse.Namespace) -> int:
    from emulation.files import write_json_atomic
    from emulation.scenario import load_scenario
    from testbed.cluster.fabric import running_testbed
    from testbed.runs.metrics import apply_flags, pin_controller_port

    scn = apply_flags(load_scenario(args.scenario), args)
    spec, layout = scn.fabric, scn.layout
    spec.check_emulatable()  # before anything starts (running_testbed checks it too)
    info_file = check_info_file(args.info_file) if args.info_file else None
    scn = pin_controller_port(scn)  # a taken port given explicitly: exit 2, nothing built
    written: tuple[int, int] | None = None  # (inode, mtime_ns) of the info file this run wrote
    stop = threading.Event()
    old: dict = {}

    def on_signal(signum, frame):  # once up: Ctrl-C, SIGTERM or SIGHUP ends the hold; the with-blocks tear down
        stop.set()

    # while starting, the CLI's handler (emulation.signals) aborts the start-up, which cleans up as it unwinds
    try:
        with running_testbed(spec, layout, initial_phase=scn.controller.initial_phase,
                             delay_ms=scn.wall_delay_ms, workload=scn.workload,
                             metrics_port=scn.metrics.controller_port, metrics_host=scn.metrics.host,
                             rule=scn.controller.rule, rule_params=scn.controller.rule_params) as tb:
            ctl = tb.controller  # None: a static tree (spines with the builder's fixed rule, no controller)
            info = {
                "scenario": scn.name, "kind": spec.kind,
                "rest": f"{ctl.client.base_url}/api/v1/" if ctl else None,
                "token_file": str(ctl.token_file) if ctl else None,
                "controller_pid": ctl.pid if ctl else None,
                "controller_log": str(ctl.log_path) if ctl else None,
                "of_port": ctl.of_port if ctl else None,
                "metrics": ctl.metrics_url if ctl else None,  # the controller's Prometheus endpoint (null: off)
                "phase": tb.client.state().get("phase") if ctl else None,
                "hosts": [{"name": spec.host_name(s), "fabric_ip": spec.host_ip(s), "mgmt_ip": tb.fabric.mgmt_ip(s),
                           "pid": tb.fabric.host(s).pid, "tor": spec.tor_of_server(s),
                           "role": layout.role_of_pod(spec.pod_of_server(s))} for s in range(spec.n_servers)],
                "bridges": tb.fabric.bridge_names(),
            }
            if info_file is not None:
                write_json_atomic(info_file, info, indent=1)
                st = info_file.stat()
                written = (st.st_ino, st.st_mtime_ns)
            if ctl is None:
                print(f"fabric '{scn.name}' is up: {spec.n_servers} hosts, {spec.n_tors} ToRs, {spec.ocs_count} "
                      f"spine(s): a static {spec.kind} tree (no controller; the builder's static_flows rule)")
            else:
                print(f"fabric '{scn.name}' is up: {spec.n_servers} hosts, {spec.n_tors} ToRs, {spec.ocs_count} OCS; "
                      f"phase {info['phase']}")
                print(f"REST API   {info['rest']}   (token in {info['token_file']})")
                print(f"  curl -s -H \"Authorization: Bearer $(cat {info['token_file']})\" {info['rest']}circuits")
                print(f"  curl -s -H \"Authorization: Bearer $(cat {info['token_file']})\" -d '{{\"phase\": \"gen\"}}' "
                      f"{info['rest']}phase")
                print(f"metrics    {info['metrics'] or 'off'}   (Prometheus; README \"Live metrics\")")
            print("hosts (run a shell in one: mnexec -a PID bash, or nsenter -t PID -n -m bash):")
            for h in info["hosts"]:
                print(f"  {h['name']:>6}  fabric {h['fabric_ip']:<12} mgmt {h['mgmt_ip']:<12} pid {h['pid']:<7} "
                      f"ToR {h['tor']}  {h['role']}")
            print("Ctrl-C (or SIGTERM, SIGHUP) to tear everything down", flush=True)
            old.update({sig: signal.signal(sig, on_signal) for sig in TEARDOWN_SIGNALS})
            while not stop.wait(0.5):
                if ctl is not None and not ctl.running:
                    print("controller exited; tearing down (see its log: " + info["controller_log"] + ")")
                    return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if written is not None:  # it names PIDs and files that are gone now; remove it only if it is ours
            _remove_if_unchanged(info_file, written)
    print("fabric down")
    return 0


def _remove_if_unchanged(path: Path, written: tuple[int, int]) -> None:
    """Remove ``path`` if it is still the file this run wrote (same inode and mtime): never another's."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if (st.st_ino, st.st_mtime_ns) == written:
        path.unlink()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fabric", help="bring an emulated fabric up for interactive use")
    fsub = p.add_subparsers(dest="fabric_cmd", metavar="ACTION")
    fsub.required = True
    up = fsub.add_parser("up", help="fabric + controller for SCENARIO, held until Ctrl-C")
    up.add_argument("scenario", help="scenario YAML file")
    up.add_argument("--info-file", help="write hosts, REST address, token file and metrics URL here (JSON) once up")
    from testbed.runs.metrics import add_flags

    add_flags(up, driver=False)
    up.set_defaults(func=_up)
