"""`orchestrrl doctor`: is this machine ready to run the emulated testbed? Each check prints OK/FAIL and a fix."""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

PROVISION = "sudo scripts/provision.sh"
PROJECT_PACKAGES = ("emulation", "controller", "agents", "rlsim", "testbed", "contrib")
SEPARATE = ("mininet",)  # Debian's, checked on its own (and linked into .venv by provision.sh)
# compared against by a benchmark (bench_costmodel.py llm-analysis), loaded from the folder its
# --llm-analysis-path names: no dependency of the testbed, so neither declared nor checked
REFERENCE_ONLY = ("llm_analysis",)
TEST_BRIDGE = "orl-doctor-test"
TEST_VETH = ("orldoc0", "orldoc1")
TEST_NETNS = "orldoctest"


@dataclass
class Check:
    name: str
    status: str  # OK | WARN (an optional module is missing: still ready) | FAIL | SKIP
    detail: str = ""
    fix: str = ""


def _run(argv: list[str], timeout_s: float = 10.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as e:
        return subprocess.CompletedProcess(argv, 127, "", str(e))
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout_s}s")


def _err(r: subprocess.CompletedProcess) -> str:
    return (r.stderr or r.stdout).strip().splitlines()[-1][:200] if (r.stderr or r.stdout).strip() else f"exit {r.returncode}"


def check_root() -> Check:
    if os.geteuid() == 0:
        return Check("root", "OK", "running as root")
    return Check("root", "FAIL", f"running as uid {os.geteuid()}", "run as root (sudo .venv/bin/orchestrrl ...)")


def check_ovs() -> list[Check]:
    out = []
    if not shutil.which("ovs-vsctl"):
        return [Check("ovs-vsctl present", "FAIL", "ovs-vsctl not on PATH", PROVISION)]
    out.append(Check("ovs-vsctl present", "OK", shutil.which("ovs-vsctl") or ""))
    r = _run(["ovs-vsctl", "--timeout=5", "show"])
    if r.returncode != 0:
        out.append(Check("ovsdb-server answering", "FAIL", _err(r), PROVISION + " (starts Open vSwitch)"))
        return out
    out.append(Check("ovsdb-server answering", "OK"))
    r = _run(["ovs-appctl", "--timeout=5", "version"])
    if r.returncode != 0:
        out.append(Check("ovs-vswitchd answering", "FAIL", _err(r), PROVISION + " (starts Open vSwitch)"))
        return out
    out.append(Check("ovs-vswitchd answering", "OK", r.stdout.strip().splitlines()[0] if r.stdout.strip() else ""))
    r = _run(["ovs-vsctl", "--timeout=5", "get", "Open_vSwitch", ".", "other_config:userspace-tso-enable"])
    val = r.stdout.strip().strip('"') if r.returncode == 0 else ""
    if val == "true":
        out.append(Check("userspace TSO enabled", "OK", "other_config:userspace-tso-enable=true"))
    else:
        out.append(Check("userspace TSO enabled", "FAIL", f"userspace-tso-enable={val or 'unset'} (TCP through "
                         "userspace bridges fails with bad checksums)", PROVISION + " (sets it and restarts OVS)"))
    from emulation import sendbuf

    ok, msg = sendbuf.check()
    out.append(Check("OVS send buffer", "OK" if ok else "FAIL", msg,
                     "" if ok else PROVISION + " (sets net.core.wmem_default, restarts ovs-vswitchd if needed)"))
    return out


def check_machine() -> list[Check]:
    """The root namespace's settings the testbed needs (emulation/machine.py), one check each, with the fix."""
    from emulation import machine

    out = []
    for setting, ok, msg in machine.check():
        out.append(Check(f"sysctl {setting.key}", "OK" if ok else "FAIL", msg,
                         "" if ok else f"{PROVISION} (emulation/machine.py sets it and keeps it in "
                                       f"{machine.SYSCTL_CONF})"))
    return out


def check_netdev_bridge() -> Check:
    r = _run(["ovs-vsctl", "--timeout=10", "--", "--if-exists", "del-br", TEST_BRIDGE, "--", "add-br", TEST_BRIDGE,
              "--", "set", "bridge", TEST_BRIDGE, "datapath_type=netdev"])
    d = _run(["ovs-vsctl", "--timeout=10", "--if-exists", "del-br", TEST_BRIDGE])
    if r.returncode != 0:
        return Check("netdev bridge", "FAIL", _err(r), PROVISION)
    if d.returncode != 0:
        return Check("netdev bridge", "FAIL", f"created but could not delete {TEST_BRIDGE}: {_err(d)}",
                     "orchestrrl clean")
    return Check("netdev bridge", "OK", f"created and deleted {TEST_BRIDGE} (datapath_type=netdev)")


def check_kernel() -> list[Check]:
    out = []
    a, b = TEST_VETH
    _run(["ip", "link", "del", a])
    r = _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
    if r.returncode != 0:
        out.append(Check("veth", "FAIL", _err(r), "a kernel with veth (CONFIG_VETH); " + PROVISION + " installs iproute2"))
        out.append(Check("htb qdisc", "SKIP", "needs veth"))
    else:
        out.append(Check("veth", "OK"))
        r = _run(["tc", "qdisc", "add", "dev", a, "root", "handle", "1:", "htb", "default", "1"])
        r2 = _run(["tc", "class", "add", "dev", a, "parent", "1:", "classid", "1:1", "htb", "rate", "1500mbit"]) \
            if r.returncode == 0 else r
        if r.returncode == 0 and r2.returncode == 0:
            out.append(Check("htb qdisc", "OK"))
            # every link's small packets are filtered into a class of their own (emulation/shaping.py)
            r3 = _run(["tc", "filter", "add", "dev", a, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                       "match", "u16", "0", "0xff80", "at", "2", "flowid", "1:1"])
            out.append(Check("u32 filter", "OK") if r3.returncode == 0 else
                       Check("u32 filter", "FAIL", _err(r3), "a kernel with cls_u32 (CONFIG_NET_CLS_U32)"))
        else:
            out.append(Check("htb qdisc", "FAIL", _err(r2), "a kernel with sch_htb (CONFIG_NET_SCH_HTB)"))
            out.append(Check("u32 filter", "SKIP", "needs htb"))
        _run(["ip", "link", "del", a])
    _run(["ip", "netns", "del", TEST_NETNS])
    r = _run(["ip", "netns", "add", TEST_NETNS])
    if r.returncode == 0:
        _run(["ip", "netns", "del", TEST_NETNS])
        out.append(Check("netns", "OK"))
    else:
        out.append(Check("netns", "FAIL", _err(r), "a kernel with network namespaces (CONFIG_NET_NS)"))
    return out


def _import(name: str) -> tuple[bool, str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eventlet's deprecation notice is not a finding
            mod = importlib.import_module(name)
    except Exception as e:  # any import failure is the finding
        return False, f"{type(e).__name__}: {e}"
    return True, str(getattr(mod, "__version__", ""))


def _guards_import_error(handler: ast.ExceptHandler) -> bool:
    names = []
    t = handler.type
    for node in (t.elts if isinstance(t, ast.Tuple) else [t]):
        if isinstance(node, ast.Name):
            names.append(node.id)
    return bool({"ImportError", "ModuleNotFoundError"} & set(names))


def code_imports(root: Path | None = None) -> dict[str, dict]:
    """Every third-party module the project's code imports, derived from its source (never a hand list).

    ``{top-level module: {"optional": bool, "files": [...]}}``; optional when the code imports it inside a
    ``try`` that catches ImportError somewhere (it checks for it and runs without it, like Ray in the sweep).
    Standard-library and project modules are left out, and :data:`REFERENCE_ONLY`.
    """
    root = root or Path(__file__).resolve().parents[2]
    found: dict[str, dict] = {}
    for pkg in PROJECT_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            guarded: set[int] = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Try) and any(_guards_import_error(h) for h in node.handlers):
                    guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if (top in sys.stdlib_module_names or top in PROJECT_PACKAGES or top == "__future__"
                            or top in REFERENCE_ONLY):
                        continue
                    rec = found.setdefault(top, {"optional": False, "files": []})
                    rec["optional"] = rec["optional"] or id(node) in guarded
                    rel = str(path.relative_to(root))
                    if rel not in rec["files"]:
                        rec["files"].append(rel)
    return dict(sorted(found.items()))


def check_python() -> list[Check]:
    out = []
    ok, detail = _import("mininet.net")
    out.append(Check("Mininet importable", "OK" if ok else "FAIL", detail,
                     "" if ok else PROVISION + " (Debian's mininet, linked into .venv)"))
    if not shutil.which("mnexec"):
        out.append(Check("mnexec present", "FAIL", "mnexec not on PATH", PROVISION))
    for name, rec in code_imports().items():
        if name in SEPARATE:
            continue
        ok, detail = _import(name)
        where = f"imported by {rec['files'][0]}" + (f" and {len(rec['files']) - 1} more" if len(rec["files"]) > 1 else "")
        if ok:
            out.append(Check(f"python: {name}", "OK", detail))
        elif rec["optional"]:
            out.append(Check(f"python: {name} (optional)", "WARN", f"{detail}; {where}, which runs without it",
                             "pip install the extra that lists it (setup.cfg) to use it"))
        else:
            out.append(Check(f"python: {name}", "FAIL", f"{detail}; {where}",
                             PROVISION + " (creates .venv with the project's extras)"))
    return out


def run_checks(progress: Callable[[Check], None] | None = None) -> list[Check]:
    checks: list[Check] = []

    def add(c: Check) -> None:
        checks.append(c)
        if progress:
            progress(c)

    root = check_root()
    add(root)
    ovs = check_ovs()
    for c in ovs:
        add(c)
    ovs_up = all(c.status == "OK" for c in ovs if c.name != "userspace TSO enabled") and len(ovs) >= 3
    for c in check_machine():
        add(c)
    if root.status != "OK":
        for name in ("netdev bridge", "veth", "htb qdisc", "netns"):
            add(Check(name, "SKIP", "needs root", "run as root"))
    else:
        add(check_netdev_bridge() if ovs_up else Check("netdev bridge", "SKIP", "Open vSwitch not answering",
                                                       PROVISION))
        for c in check_kernel():
            add(c)
    for c in check_python():
        add(c)
    return checks


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="check that this machine can run the emulated testbed",
                              description="Checks root, Open vSwitch (answering, userspace TSO, netdev bridges), "
                                          "the root namespace's sysctls the testbed needs (emulation/machine.py), "
                                          "kernel features (veth, htb, netns), Mininet and the Python "
                                          "dependencies. Exit 0 when ready, 1 when not.")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    def show(c: Check) -> None:
        line = f"[{c.status:4}] {c.name}"
        if c.detail:
            line += f": {c.detail}"
        print(line, flush=True)
        if c.status not in ("OK",) and c.fix:
            print(f"       fix: {c.fix}", flush=True)

    checks = run_checks(None if args.json else show)
    ready = all(c.status in ("OK", "WARN") for c in checks)
    if args.json:
        print(json.dumps({"ready": ready, "checks": [asdict(c) for c in checks]}, indent=1))
    else:
        print("ready" if ready else "NOT ready: fix the failures above")
    return 0 if ready else 1
