"""Crash-safe bookkeeping of what the testbed started and created, and ``clean()`` that undoes it.

Every process the testbed starts and every bridge / interface / network namespace it creates is
recorded here *before* it can leak, as one small JSON file per record under the state directory
(``$ORCHESTRRL_STATE_DIR``, default ``/run/orchestrrl``: a tmpfs, so a reboot clears it together with
the PIDs it names). Files are written atomically (temporary file + rename): a ``kill -9`` at any moment
leaves only complete records.

``clean()`` (what ``orchestrrl clean`` runs) stops recorded processes whose start time still matches
(so a recycled PID is never killed), deletes the bridges, root-namespace interfaces and named network
namespaces this registry recorded, and removes the records; other ``orl*`` names (another checkout's
running fabric) are only reported, and deleted only with ``sweep`` (``orchestrrl clean --all``). It never
kills by name.

The lab VM (``make vm-test``: testbed/benchmarks/bench_labvm.py) records its libvirt objects the same way: the VM (a libvirt
domain), its disk volumes and its libvirt network (kinds ``vm``, ``vm-disk``, ``vm-network``), removed through
libvirt before any recorded process is stopped (libvirtd itself may be one). Shell scripts record and forget
through ``python3 -m emulation.registry record|forget KIND ARG``.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .files import write_json_atomic
from .spec import NAME_PREFIX
from .validation import SpecError

log = logging.getLogger(__name__)

HOST_KINDS = ("bridge", "interface", "netns")  # the emulated fabric's, in the root namespace
VM_KINDS = ("vm", "vm-disk", "vm-network")  # libvirt's, deleted in this order (a VM before its disk and network)
RESOURCE_KINDS = HOST_KINDS + VM_KINDS
_PLURAL = {"bridge": "bridges", "interface": "interfaces", "netns": "netns",  # CleanReport's field names
           "vm": "vms", "vm-disk": "vm_disks", "vm-network": "vm_networks"}
VM_NAME_PREFIXES = (NAME_PREFIX, "orchestrrl-")  # a VM's objects; 'orchestrrl-' is the box's cached base volume
DEFAULT_STATE_DIR = "/run/orchestrrl"
_PROC_PREFIX = "proc-"
_RES_PREFIX = "res-"
_DIR_PREFIX = "dir-"
TMPDIR_PREFIXES = (NAME_PREFIX, "orchestrrl-")  # the scratch folders the testbed makes under the temp dir


def state_dir() -> Path:
    return Path(os.environ.get("ORCHESTRRL_STATE_DIR", DEFAULT_STATE_DIR))


class NameInUse(RuntimeError):
    """A bridge or interface the testbed is about to create already exists (another fabric is running on
    this machine, or a crashed run left it): nothing was built, nothing was touched."""


# ---- /proc helpers ------------------------------------------------------------------------------
def _proc_stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state first), None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'
    return data[data.rfind(")") + 2:].split()


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot), None if no such process."""
    rest = _proc_stat_fields(pid)
    try:
        return int(rest[19]) if rest is not None else None  # rest[0] is field 3, so field 22 is rest[19]
    except (IndexError, ValueError):
        return None


def proc_state(pid: int) -> str | None:
    rest = _proc_stat_fields(pid)
    return rest[0] if rest else None


def proc_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """True when ``pid`` runs (not a zombie) and, if given, still has ``start_time``."""
    st = proc_start_time(pid)
    if st is None:
        return False
    if start_time is not None and st != start_time:
        return False
    return proc_state(pid) != "Z"


# ---- records ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcessRecord:
    pid: int
    role: str
    start_time: int
    cmdline: list[str]
    group: bool = False  # stop the whole process group (pgid == pid)
    stop_signal: int = int(signal.SIGTERM)
    recorded_at: float = 0.0


def _check_name(kind: str, name: str) -> None:
    if kind not in RESOURCE_KINDS:
        raise SpecError("kind", f"must be one of {', '.join(RESOURCE_KINDS)}, got {kind!r}")
    if kind in VM_KINDS:
        if (not isinstance(name, str) or not name.startswith(VM_NAME_PREFIXES) or "/" in name
                or any(c.isspace() for c in name)):
            raise SpecError("name", f"must start with {' or '.join(map(repr, VM_NAME_PREFIXES))} (and contain no "
                                    f"'/' or space), got {name!r}")
        return
    if not isinstance(name, str) or not name.startswith(NAME_PREFIX) or "/" in name:
        raise SpecError("name", f"must start with {NAME_PREFIX!r} (and contain no '/'), got {name!r}")
    if kind == "interface" and len(name) > 15:
        raise SpecError("name", f"interface names have at most 15 characters, got {name!r}")


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def record_process(pid: int, role: str, group: bool = False, stop_signal: int = signal.SIGTERM) -> ProcessRecord:
    """Record a running process so that ``clean()`` can stop it after a crash.

    ``group``: stop its whole process group (only when the process leads its own group).
    ``stop_signal``: the polite signal sent first (interactive bash shells need SIGHUP); SIGKILL follows
    after the deadline.
    """
    if not isinstance(pid, int) or pid <= 1:
        raise SpecError("pid", f"must be an integer > 1, got {pid!r}")
    st = proc_start_time(pid)
    if st is None:
        raise SpecError("pid", f"no process {pid}")
    rec = ProcessRecord(pid=pid, role=str(role), start_time=st, cmdline=proc_cmdline(pid), group=bool(group),
                        stop_signal=int(stop_signal), recorded_at=time.time())
    write_json_atomic(state_dir() / f"{_PROC_PREFIX}{pid}.json", asdict(rec), mkdir=True)
    return rec


def forget_process(pid: int) -> None:
    _unlink(state_dir() / f"{_PROC_PREFIX}{int(pid)}.json")


def record_resource(kind: str, name: str) -> None:
    _check_name(kind, name)
    write_json_atomic(state_dir() / f"{_RES_PREFIX}{kind}-{name}.json",
                  {"kind": kind, "name": name, "recorded_at": time.time()}, mkdir=True)


def forget_resource(kind: str, name: str) -> None:
    _check_name(kind, name)
    _unlink(state_dir() / f"{_RES_PREFIX}{kind}-{name}.json")


def _check_tmpdir(path: str | os.PathLike) -> Path:
    import tempfile

    p = Path(path)
    if p.parent != Path(tempfile.gettempdir()) or not p.name.startswith(TMPDIR_PREFIXES):
        raise SpecError("path", f"must be a folder {'|'.join(TMPDIR_PREFIXES)}* directly in "
                                f"{tempfile.gettempdir()}, got {str(path)!r}")
    return p


def record_tmpdir(path: str | os.PathLike) -> None:
    """Record a scratch folder (``/tmp/orl*``, ``/tmp/orchestrrl-*``) so that ``clean()`` removes it after a
    crash; forget it when it is removed, or kept on purpose (a failure's log, named in a message)."""
    p = _check_tmpdir(path)
    write_json_atomic(state_dir() / f"{_DIR_PREFIX}{p.name}.json", {"path": str(p), "recorded_at": time.time()},
                      mkdir=True)


def forget_tmpdir(path: str | os.PathLike) -> None:
    _unlink(state_dir() / f"{_DIR_PREFIX}{_check_tmpdir(path).name}.json")


def list_tmpdirs() -> list[Path]:
    d = state_dir()
    if not d.is_dir():
        return []
    out = []
    for rec in sorted(d.glob(f"{_DIR_PREFIX}*.json")):
        data = read_json(rec)
        try:
            out.append(_check_tmpdir(str((data or {}).get("path", ""))))
        except SpecError:
            log.warning("ignoring a malformed folder record %s", rec)
    return out


def read_json(path: Path) -> dict | None:
    """A JSON object from ``path``; None when missing or unreadable (logged), never an exception."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("unreadable file %s: %s", path, e)
        return None
    return data if isinstance(data, dict) else None


def list_processes() -> list[ProcessRecord]:
    out = []
    d = state_dir()
    if not d.is_dir():
        return out
    for p in sorted(d.glob(f"{_PROC_PREFIX}*.json")):
        data = read_json(p)
        if data is None:
            continue
        try:
            out.append(ProcessRecord(pid=int(data["pid"]), role=str(data.get("role", "")),
                                     start_time=int(data["start_time"]), cmdline=list(data.get("cmdline", [])),
                                     group=bool(data.get("group", False)),
                                     stop_signal=int(data.get("stop_signal", signal.SIGTERM)),
                                     recorded_at=float(data.get("recorded_at", 0.0))))
        except (KeyError, TypeError, ValueError) as e:
            log.warning("malformed process record %s: %s", p, e)
    return out


def list_resources() -> list[tuple[str, str]]:
    out = []
    d = state_dir()
    if not d.is_dir():
        return out
    for p in sorted(d.glob(f"{_RES_PREFIX}*.json")):
        data = read_json(p)
        if not data or data.get("kind") not in RESOURCE_KINDS:
            continue
        try:
            _check_name(data["kind"], data.get("name"))
        except SpecError:
            log.warning("ignoring a malformed resource record %s", p)
            continue
        out.append((data["kind"], data["name"]))
    return out


# ---- stopping processes -------------------------------------------------------------------------
def _signal(rec: ProcessRecord, sig: int) -> None:
    try:
        if rec.group and os.getpgid(rec.pid) == rec.pid:
            os.killpg(rec.pid, sig)
        else:
            os.kill(rec.pid, sig)
    except ProcessLookupError:
        pass


def stop_process(rec: ProcessRecord, timeout_s: float = 2.0, poll_s: float = 0.01) -> str:
    """Stop one recorded process: polite signal, then SIGKILL at the deadline.

    Returns "gone" (not running or PID recycled: nothing sent), "stopped" or "killed".
    """
    if not process_alive(rec.pid, rec.start_time):
        return "gone"
    _signal(rec, rec.stop_signal)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process_alive(rec.pid, rec.start_time):
            return "stopped"
        time.sleep(poll_s)
    if process_alive(rec.pid, rec.start_time):
        _signal(rec, signal.SIGKILL)
        kill_deadline = time.monotonic() + 2.0
        while time.monotonic() < kill_deadline and process_alive(rec.pid, rec.start_time):
            time.sleep(poll_s)
    return "killed"


def _still_alive(recs: list[ProcessRecord], timeout_s: float, poll_s: float = 0.01) -> list[ProcessRecord]:
    """Those of ``recs`` still running after waiting up to ``timeout_s`` for them all to end."""
    deadline = time.monotonic() + timeout_s
    live = [r for r in recs if process_alive(r.pid, r.start_time)]
    while live and time.monotonic() < deadline:
        time.sleep(poll_s)
        live = [r for r in live if process_alive(r.pid, r.start_time)]
    return live


def stop_processes(recs: list[ProcessRecord], timeout_s: float = 2.0, poll_s: float = 0.01) -> dict[int, str]:
    """Stop several processes in parallel (signal all, then wait once for all)."""
    result: dict[int, str] = {}
    live = []
    for r in recs:
        if process_alive(r.pid, r.start_time):
            _signal(r, r.stop_signal)
            live.append(r)
        else:
            result[r.pid] = "gone"
    still = _still_alive(live, timeout_s, poll_s)
    for r in live:
        if r not in still:
            result[r.pid] = "stopped"
    for r in still:
        _signal(r, signal.SIGKILL)
    _still_alive(still, 2.0, poll_s)
    for r in recs:  # SIGKILLed ones that are gone were killed; a survivor (e.g. stuck in D state) says so
        result.setdefault(r.pid, "survived" if process_alive(r.pid, r.start_time) else "killed")
    return result


# ---- the machine: OVS bridges (ovs-vsctl), interfaces and named namespaces (netlink, in-process) ---------------
def _run(argv: list[str], timeout_s: float = 10.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)


def ovs_bridges() -> list[str]:
    """All OVS bridges (raises OSError / subprocess errors when OVS does not answer)."""
    r = _run(["ovs-vsctl", "--timeout=5", "list-br"])
    if r.returncode != 0:
        raise RuntimeError(f"ovs-vsctl list-br failed: {r.stderr.strip()}")
    return [b for b in r.stdout.split() if b]


def root_interfaces() -> list[str]:
    """Every interface in the root network namespace."""
    from .netlink import Netlink

    with Netlink() as nl:
        return nl.link_names()


def named_netns() -> list[str]:
    """Named network namespaces (``ip netns``'s, under /run/netns)."""
    from pyroute2 import netns

    try:
        return sorted(netns.listnetns())
    except OSError:
        return []


class System:
    """What ``clean`` reads and deletes on the machine (unit tests pass a fake)."""

    def bridges(self) -> list[str]:
        return ovs_bridges()

    def interfaces(self) -> list[str]:
        return root_interfaces()

    def netns(self) -> list[str]:
        return named_netns()

    def delete_bridges(self, names: list[str]) -> None:
        """Delete OVS bridges (one ovs-vsctl transaction); RuntimeError saying why on failure."""
        argv = ["ovs-vsctl", "--timeout=10"]
        for b in names:
            argv += ["--", "--if-exists", "del-br", b]
        try:
            r = _run(argv)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"ovs-vsctl del-br failed: {e}") from None
        if r.returncode != 0:
            raise RuntimeError(f"ovs-vsctl del-br failed: {r.stderr.strip()}")

    def delete_interface(self, name: str) -> bool:
        """Delete a root-namespace interface; False when it was already gone (e.g. with its veth peer)."""
        from .netlink import Netlink

        with Netlink() as nl:
            return nl.delete_link(name)

    def delete_netns(self, name: str) -> None:
        from pyroute2 import netns

        netns.remove(name)

    # the lab VM's libvirt objects (emulation/libvirt.py); clean lists them only when one is recorded or on a sweep
    def vms(self) -> list[str]:
        from . import libvirt

        return libvirt.domains()

    def vm_disks(self) -> list[str]:
        from . import libvirt

        return sorted(libvirt.volumes())

    def vm_networks(self) -> list[str]:
        from . import libvirt

        return libvirt.networks()

    def delete_vm(self, name: str) -> None:
        from . import libvirt

        libvirt.delete_domain(name)

    def delete_vm_disk(self, name: str) -> None:
        from . import libvirt

        libvirt.delete_volume(name)

    def delete_vm_network(self, name: str) -> None:
        from . import libvirt

        libvirt.delete_network(name)


# ---- clean --------------------------------------------------------------------------------------
@dataclass
class CleanReport:
    dry_run: bool = False
    sweep: bool = False  # --all: every orl* name on the machine, not only this registry's records
    processes: list[dict] = field(default_factory=list)  # {pid, role, cmdline, result}
    bridges: list[str] = field(default_factory=list)
    interfaces: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    vms: list[str] = field(default_factory=list)  # the lab VM's libvirt domain, its disks and its network
    vm_disks: list[str] = field(default_factory=list)
    vm_networks: list[str] = field(default_factory=list)
    tmpdirs: list[str] = field(default_factory=list)  # scratch folders of crashed runs
    records_removed: int = 0
    # orl* names that exist but this registry did not record (another checkout's fabric?): left alone
    # unless sweep; {"bridges": [...], "interfaces": [...], "netns": [...], "vms": [...], ...}
    not_recorded: dict[str, list[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def nothing_done(self) -> bool:
        return not (self.processes or self.bridges or self.interfaces or self.netns or self.vms or self.vm_disks
                    or self.vm_networks or self.tmpdirs or self.records_removed)


_CLEAN_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError)  # NetlinkFailed is a RuntimeError


def _listing(fn: Callable[[], list[str]], what: str, errors: list[str] | None,
             also: set[str] = frozenset()) -> list[str] | None:
    """``fn()``'s orl* names (and those in ``also``); None (and an error, when ``errors`` is a list) when the
    listing failed."""
    try:
        return sorted(n for n in fn() if n.startswith(NAME_PREFIX) or n in also)
    except _CLEAN_ERRORS as e:
        if errors is not None:
            errors.append(f"cannot list {what} ({e})")
        return None


def vm_listers(system: System) -> dict[str, tuple[Callable[[], list[str]], str]]:
    """Per VM kind: what lists its objects, and what they are called in an error."""
    return {"vm": (system.vms, "libvirt domains"), "vm-disk": (system.vm_disks, "libvirt volumes"),
            "vm-network": (system.vm_networks, "libvirt networks")}


def vm_deleters(system: System) -> dict[str, Callable[[str], None]]:
    """Per VM kind: what deletes one object by name."""
    return {"vm": system.delete_vm, "vm-disk": system.delete_vm_disk, "vm-network": system.delete_vm_network}


def _clean_vms(rep: CleanReport, system: System, recorded: dict[str, set[str]]) -> bool:
    """The lab VM's libvirt objects: the recorded ones (every orl* one on a sweep), a domain before its disks and
    its network. Libvirt is asked only when a VM object is recorded or on a sweep; a sweep that finds no
    libvirt answering (none installed, libvirtd stopped) with nothing recorded is not an error.
    Returns whether libvirt was asked (so that the records are checked against it afterwards)."""
    if not rep.sweep and not any(recorded[k] for k in VM_KINDS):
        return False
    deleters = vm_deleters(system)
    for kind, (fn, what) in vm_listers(system).items():
        have = _listing(fn, what, rep.errors if recorded[kind] else None, also=recorded[kind])
        if have is None:  # cannot tell what exists: try the recorded ones (deleting a gone one is harmless)
            have = sorted(recorded[kind])
        else:
            others = [n for n in have if n not in recorded[kind]]
            if others:
                rep.not_recorded[_PLURAL[kind]] = others
        # a VM's own (orl*) disks before the box's cached base volume that backs them
        for name in sorted((n for n in have if n in recorded[kind] or rep.sweep),
                           key=lambda n: (not n.startswith(NAME_PREFIX), n)):
            try:
                if not rep.dry_run:
                    deleters[kind](name)
                getattr(rep, _PLURAL[kind]).append(name)
            except _CLEAN_ERRORS as e:
                rep.errors.append(f"deleting {kind} {name}: {e}")
    return True


# how long clean() waits, after its stops and deletions, for a SIGKILLed process to finish exiting before it
# reports the process as a survivor (and keeps its record)
KILLED_EXIT_WAIT_S = 10.0


def clean(dry_run: bool = False, sweep: bool = False, process_timeout_s: float = 2.0,
          system: System | None = None) -> CleanReport:
    """Undo what this registry recorded: stop its live processes, delete its bridges, interfaces and
    namespaces (those that exist), remove its records.

    ``sweep`` (``orchestrrl clean --all``): also delete every other ``orl*`` bridge, root-namespace
    interface, named network namespace and libvirt domain / volume / network on the machine, whoever made it
    (another checkout's running fabric too). Without it, such names are only reported (``not_recorded``).
    Never kills by name. The lab VM's libvirt objects go first, while the libvirtd a run started (a recorded
    process) still answers.
    """
    system = system or System()
    rep = CleanReport(dry_run=dry_run, sweep=sweep)
    procs = list_processes()
    resources = list_resources()
    recorded = {k: {n for kind, n in resources if kind == k} for k in RESOURCE_KINDS}
    vms_asked = _clean_vms(rep, system, recorded)
    live = [p for p in procs if process_alive(p.pid, p.start_time)]
    if dry_run:
        rep.processes = [{"pid": p.pid, "role": p.role, "cmdline": proc_cmdline(p.pid) or p.cmdline,
                          "result": "would stop"} for p in live]
    else:
        # the command line now (a record taken between fork and exec holds the parent's or none)
        cmdlines = {p.pid: proc_cmdline(p.pid) or p.cmdline for p in live}
        results = stop_processes(live, timeout_s=process_timeout_s)
        rep.processes = [{"pid": p.pid, "role": p.role, "cmdline": cmdlines[p.pid], "result": results[p.pid]}
                         for p in live]

    # a userspace bridge leaves a tap named like the bridge: the bridge's record covers it
    recorded["interface"] |= recorded["bridge"]
    listers = {"bridge": (system.bridges, "OVS bridges"), "interface": (system.interfaces, "interfaces"),
               "netns": (system.netns, "network namespaces")}
    todo: dict[str, list[str]] = {}
    for kind in HOST_KINDS:
        have = _listing(*listers[kind], rep.errors)
        if have is None:  # cannot tell what exists: try the recorded ones (deleting a gone one is harmless)
            todo[kind] = sorted(recorded[kind]) if kind != "interface" else []
            continue
        others = [n for n in have if n not in recorded[kind]]
        if others:
            rep.not_recorded[_PLURAL[kind]] = others
        todo[kind] = [n for n in have if n in recorded[kind] or sweep]

    rep.bridges = todo["bridge"]
    if rep.bridges and not dry_run:
        try:
            system.delete_bridges(rep.bridges)
        except _CLEAN_ERRORS as e:
            rep.errors.append(str(e))
    for name in todo["interface"]:  # root namespace; a bridge's tap usually went with its bridge
        try:
            if dry_run or system.delete_interface(name):
                rep.interfaces.append(name)
        except _CLEAN_ERRORS as e:
            rep.errors.append(f"deleting interface {name}: {e}")
    for name in todo["netns"]:
        try:
            if not dry_run:
                system.delete_netns(name)
            rep.netns.append(name)
        except _CLEAN_ERRORS as e:
            rep.errors.append(f"deleting netns {name}: {e}")

    for d in list_tmpdirs():  # only recorded ones: another checkout's running fabric keeps its folders
        if d.exists():
            rep.tmpdirs.append(str(d))
            if not dry_run:
                import shutil

                shutil.rmtree(d, ignore_errors=True)
                if d.exists():
                    rep.errors.append(f"folder {d} could not be removed; its record is kept")

    if not dry_run:
        dirs_forgotten = 0
        for d in list_tmpdirs():
            if not d.exists():
                forget_tmpdir(d)
                dirs_forgotten += 1
        # forget only what is really gone: a survivor stays recorded (clean never kills by name, so a forgotten
        # record would leave it untracked for good) and is reported as an error. A SIGKILLed process can take
        # seconds to finish exiting on a loaded machine (Mininet host shells were still there ~4 s after it, once
        # in 17 CI runs): they get KILLED_EXIT_WAIT_S more before they count as survivors
        removed = 0
        pending = _still_alive(procs, KILLED_EXIT_WAIT_S, 0.05)
        for p in procs:
            if p in pending:
                rep.errors.append(f"process {p.pid} ({p.role}) survived SIGKILL; its record is kept")
            else:
                forget_process(p.pid)
                removed += 1
        left = {kind: _listing(fn, what, [], also=recorded[kind]) or [] for kind, (fn, what) in listers.items()}
        if vms_asked:  # a libvirt that does not answer cannot say a VM is gone: its records are kept
            left.update({kind: _listing(fn, what, [], also=recorded[kind])
                         for kind, (fn, what) in vm_listers(system).items()})
        for kind, name in resources:
            if left.get(kind) is None and kind in VM_KINDS:
                rep.errors.append(f"{kind} {name}: libvirt does not answer; its record is kept")
                continue
            if name in left.get(kind, ()):
                rep.errors.append(f"{kind} {name} still exists; its record is kept")
                continue
            forget_resource(kind, name)
            removed += 1
        rep.records_removed = removed + dirs_forgotten
    return rep


# ---- for shell scripts ----------------------------------------------------------------------------
_USAGE = ("usage: python3 -m emulation.registry record|forget process PID [ROLE]\n"
          "       python3 -m emulation.registry record|forget tmpdir PATH\n"
          f"       python3 -m emulation.registry record|forget {'|'.join(RESOURCE_KINDS)} NAME")


def main(argv: list[str] | None = None) -> int:
    """Record or forget one thing from a shell script (scripts/build-lab-box.sh): exit 2 naming what is wrong."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] not in ("record", "forget"):
        print(_USAGE, file=sys.stderr)
        return 2
    verb, kind, arg, rest = args[0], args[1], args[2], args[3:]
    try:
        if kind == "process":
            if not arg.isdigit():
                raise SpecError("pid", f"must be an integer > 1, got {arg!r}")
            if verb == "record":
                record_process(int(arg), rest[0] if rest else "script")
            else:
                forget_process(int(arg))
        elif kind == "tmpdir":
            (record_tmpdir if verb == "record" else forget_tmpdir)(arg)
        else:
            (record_resource if verb == "record" else forget_resource)(kind, arg)
    except SpecError as e:
        print(f"emulation.registry: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
