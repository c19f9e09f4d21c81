"""`orchestrrl fabric up SCENARIO`: bring up the scenario's fabric and controller; hold until Ctrl-C."""
from __future__ import annotations

import argparse
import json
import os
import signal
import threading


def _up(args: argparse.Namespace) -> int:
    from emulation.scenario import load_scenario
    from testbed.harness import running_testbed

    scn = load_scenario(args.scenario)
    spec, layout = scn.fabric, scn.layout  # running_testbed checks the spec can be emulated
    stop = threading.Event()
    up = threading.Event()

    def on_signal(signum, frame):  # Ctrl-C or SIGTERM: leave the with-blocks, which tear everything down
        if not up.is_set():
            raise KeyboardInterrupt  # still starting: abort start-up now (it cleans up as it unwinds)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with running_testbed(spec, layout, initial_phase=scn.controller.initial_phase,
                             delay_ms=scn.controller.effective_delay_ms(spec)) as tb:
            ctl = tb.controller
            info = {
                "scenario": scn.name,
                "rest": f"{ctl.client.base_url}/api/v1/",
                "token_file": str(ctl.token_file),
                "controller_pid": ctl.pid,
                "controller_log": str(ctl.log_path),
                "of_port": ctl.of_port,
                "phase": tb.client.state().get("phase"),
                "hosts": [{"name": spec.host_name(s), "fabric_ip": spec.host_ip(s), "mgmt_ip": tb.fabric.mgmt_ip(s),
                           "pid": tb.fabric.host(s).pid, "tor": spec.tor_of_server(s),
                           "role": layout.role_of_pod(spec.pod_of_server(s))} for s in range(spec.n_servers)],
                "bridges": tb.fabric.bridge_names(),
            }
            if args.info_file:
                tmp = f"{args.info_file}.tmp{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(info, f, indent=1)
                os.replace(tmp, args.info_file)
            print(f"fabric '{scn.name}' is up: {spec.n_servers} hosts, {spec.n_tors} ToRs, {spec.ocs_count} OCS; "
                  f"phase {info['phase']}")
            print(f"REST API   {info['rest']}   (token in {info['token_file']})")
            print(f"  curl -s -H \"Authorization: Bearer $(cat {info['token_file']})\" {info['rest']}circuits")
            print(f"  curl -s -H \"Authorization: Bearer $(cat {info['token_file']})\" -d '{{\"phase\": \"gen\"}}' "
                  f"{info['rest']}phase")
            print("hosts (run a shell in one: mnexec -a PID bash, or nsenter -t PID -n -m bash):")
            for h in info["hosts"]:
                print(f"  {h['name']:>6}  fabric {h['fabric_ip']:<12} mgmt {h['mgmt_ip']:<12} pid {h['pid']:<7} "
                      f"ToR {h['tor']}  {h['role']}")
            print("Ctrl-C to tear everything down", flush=True)
            up.set()
            while not stop.wait(0.5):
                if not ctl.running:
                    print("controller exited; tearing down (see its log: " + info["controller_log"] + ")")
                    return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if args.info_file and os.path.exists(args.info_file):  # it names PIDs and files that are gone now
            os.unlink(args.info_file)
    print("fabric down")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fabric", help="bring an emulated fabric up for interactive use")
    fsub = p.add_subparsers(dest="fabric_cmd", metavar="ACTION")
    fsub.required = True
    up = fsub.add_parser("up", help="fabric + controller for SCENARIO, held until Ctrl-C")
    up.add_argument("scenario", help="scenario YAML file")
    up.add_argument("--info-file", help="write hosts, REST address and token file here (JSON) once up")
    up.set_defaults(func=_up)
