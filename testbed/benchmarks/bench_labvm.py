"""`make vm-test`: the lab VM round trip, measured. A benchmark-style target: it reports (JSON), it never asserts.

Builds the box if Vagrant lacks it (scripts/build-lab-box.sh), boots a fresh VM from the Vagrantfile (libvirt;
KVM or TCG, the Vagrantfile's choice), provisions it through the Vagrantfile (scripts/provision.sh), runs the
README's test command inside (`sudo make test`), copies the results out and destroys the VM. The summary says
how long each part took (box build, box upload into libvirt, boot, provision, test, destroy) and what the suite
reported (passed / failed / errors / skipped, the failed tests by name).

Nothing outlives a run: every libvirt object `vagrant up` is about to create (the domain, its disk, the libvirt
network, the box's volume while it uploads) and every daemon this run starts (libvirtd, virtlogd) is recorded
in the project's registry *before* it exists; a normal end or an exception destroys them and forgets the
records; after a kill -9, `orchestrrl clean` removes them (emulation/registry.py).

    .venv/bin/python -m testbed.benchmarks.bench_labvm [--out DIR] [--rebuild-box] [--keep-vm] [--wheels DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, Iterable

from emulation import libvirt, machine, registry, signals
from emulation.files import write_json_atomic

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "scripts" / "labvm.json"
GUEST_RESULTS = "/vagrant/runs/vm-test"  # runs/ is not synced into the VM: what the suite writes stays there
TEST_COMMAND = (f"cd /vagrant && sudo make test PYTEST_ARGS='-ra -p no:cacheprovider "
                f"--junitxml={GUEST_RESULTS}/junit.xml'")
LIBVIRTD = (("virtlogd", "/usr/sbin/virtlogd", "/run/virtlogd.pid"),  # started in this order when not running
            ("libvirtd", "/usr/sbin/libvirtd", "/run/libvirtd.pid"))
# libvirt's NAT network turns the host's IPv4 forwarding on (and with it ICMP redirects off) and never turns it
# back, not even when the network is destroyed: a run puts back what the host had (in this order: writing
# ip_forward resets the others)
FORWARDING = ("net/ipv4/ip_forward", "net/ipv4/conf/all/forwarding", "net/ipv4/conf/all/accept_redirects")


class LabVMError(RuntimeError):
    """The round trip cannot go on; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class LabNames:
    """The lab VM's names (scripts/labvm.json, which the Vagrantfile reads too)."""
    box: str
    domain: str  # vagrant-libvirt: default_prefix + machine name
    disk: str  # vagrant-libvirt: the domain's name + ".img", in the storage pool
    network: str

    @classmethod
    def load(cls, path: Path = CONFIG) -> "LabNames":
        cfg = json.loads(path.read_text())
        domain = f"{cfg['domain_prefix']}{cfg['machine']}"
        return cls(box=cfg["box"], domain=domain, disk=f"{domain}.img", network=cfg["network"])


def box_volume_name(box: str, version: str, image_mtime: int) -> str:
    """The volume vagrant-libvirt 0.11 uploads a box's image into (action/handle_box_image.rb): a box without a
    version (`vagrant box add FILE`) is named by its image's mtime."""
    if version in ("", "0"):
        version = f"0_{image_mtime}"
    return f"{box.replace('/', '-VAGRANTSLASH-')}_vagrant_box_image_{version}_box.img"


def junit_counts(xml_text: str, slowest: int = 10) -> dict:
    """pytest's JUnit XML -> {total, passed, failed, errors, skipped, failed_tests, timed_out, slowest}:
    timed_out names the failures pytest-timeout made (setup.cfg's per-test limit), slowest the longest tests."""
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    out = {"total": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failed_tests": [], "timed_out": []}
    times = []
    for s in suites:
        for case in s.iter("testcase"):
            out["total"] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            times.append((float(case.get("time") or 0.0), name))
            bad = case.find("failure")
            bad = bad if bad is not None else case.find("error")
            if bad is not None:
                out["failed" if bad.tag == "failure" else "errors"] += 1
                out["failed_tests"].append(name)
                if "Timeout >" in (bad.get("message") or "") + (bad.text or ""):
                    out["timed_out"].append(name)
            elif case.find("skipped") is not None:
                out["skipped"] += 1
            else:
                out["passed"] += 1
    out["slowest"] = [{"test": n, "s": round(t, 1)} for t, n in sorted(times, key=lambda x: (-x[0], x[1]))[:slowest]]
    return out


_PYTEST_TALLY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def pytest_tally(text: str) -> dict[str, int]:
    """The counts in pytest's last summary line ('== 3 failed, 250 passed, 9 skipped in 612.0s =='), {} if none."""
    for line in reversed(text.splitlines()):
        if line.startswith("=") and " in " in line and _PYTEST_TALLY.search(line):
            return {("errors" if k.startswith("error") else k): int(n) for n, k in _PYTEST_TALLY.findall(line)}
    return {}


# Markers in `vagrant up`'s output (vagrant 2.3 with vagrant-libvirt 0.11) that split its time into parts.
UP_MARKERS = {
    "upload": "Uploading base box image as volume",
    "create": "Creating image (snapshot of base box volume)",
    "start": "Starting domain.",
    "ready": "Machine booted and ready!",
    "rsync": "Rsyncing folder:",
}


def up_phases(lines: Iterable[tuple[float, str]], end_s: float) -> dict[str, float | None]:
    """Seconds spent in `vagrant up`'s parts, from its output lines stamped with seconds since it started:
    box_upload (the box's image into libvirt's pool: the first run after a box build only), boot (domain
    started -> SSH answers), sync (folders rsynced into the VM)."""
    first: dict[str, float] = {}
    for t, line in lines:
        for key, marker in UP_MARKERS.items():
            if marker in line and key not in first:
                first[key] = t

    def span(a: str, b: str | None) -> float | None:
        if a not in first:
            return None
        end = first.get(b) if b else end_s
        return None if end is None else round(end - first[a], 1)

    return {"box_upload": span("upload", "create"), "boot": span("start", "ready"), "sync": span("rsync", None)}


# ---- the machine -------------------------------------------------------------------------------------
class Host:
    """What the round trip does on the machine (unit tests pass a fake)."""

    def __init__(self, env: dict[str, str]):
        self.env = env

    def run(self, argv: list[str], log_path: Path, timeout_s: float | None = None) -> tuple[int, float, list]:
        """Run ``argv`` in the checkout, its output streamed to ``log_path`` line by line with a timestamp;
        returns (exit status, seconds, [(seconds since start, line)]). A timeout kills its process group."""
        t0 = time.monotonic()
        lines: list[tuple[float, str]] = []
        with open(log_path, "a", buffering=1) as log, subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                errors="replace", start_new_session=True) as p:
            log.write(f"$ {shlex.join(argv)}\n")
            timer = None
            if timeout_s is not None:
                timer = threading.Timer(timeout_s, lambda: _kill_group(p.pid))
                timer.start()
            try:
                for line in p.stdout:
                    t = time.monotonic() - t0
                    lines.append((t, line.rstrip("\n")))
                    if "Progress: " not in line:  # Vagrant's progress bars: a line per percent
                        log.write(f"[{t:8.1f}s] {line}")
                rc = p.wait()
            except BaseException:
                _kill_group(p.pid)
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            log.write(f"exit status {rc} after {time.monotonic() - t0:.1f} s\n")
        return rc, time.monotonic() - t0, lines

    def capture(self, argv: list[str], timeout_s: float = 120.0) -> str:
        r = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise LabVMError(f"{shlex.join(argv[:3])}... failed: {(r.stderr or r.stdout).strip()[-400:]}")
        return r.stdout

    def libvirt_answers(self) -> bool:
        return libvirt.answers()

    def start_daemon(self, role: str, binary: str, pidfile: str) -> int:
        """Start a libvirt daemon (`-d`: it forks) and return its PID, read from its pid file."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pidfile)
        r = subprocess.run([binary, "-d"], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise LabVMError(f"{role} did not start: {r.stderr.strip()}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                pid = int(Path(pidfile).read_text().split()[0])
                if registry.process_alive(pid):
                    return pid
            time.sleep(0.1)
        raise LabVMError(f"{role} wrote no pid file {pidfile} within 30 s")

    def libvirt_objects(self) -> dict[str, list[str]]:
        return {kind: fn() for kind, (fn, _) in registry.vm_listers(registry.System()).items()}

    def delete(self, kind: str, name: str) -> None:
        registry.vm_deleters(registry.System())[kind](name)

    def forwarding(self) -> dict[str, str]:
        """The host's IPv4 forwarding sysctls, which libvirt's NAT network changes (:data:`FORWARDING`)."""
        out = {}
        for key in FORWARDING:
            with contextlib.suppress(OSError):
                out[key] = (machine.SYSCTL_DIR / key).read_text().strip()
        return out

    def restore_forwarding(self, saved: dict[str, str]) -> None:
        for key in FORWARDING:  # in order: writing ip_forward resets accept_redirects
            if key in saved and self.forwarding().get(key) != saved[key]:
                (machine.SYSCTL_DIR / key).write_text(saved[key] + "\n")

    def boxes(self) -> list[str]:
        out = self.capture(["vagrant", "box", "list", "--machine-readable"])
        return [f.split(",")[3] for f in out.splitlines() if f.split(",")[2:3] == ["box-name"]]

    def box_image(self, box: str) -> Path | None:
        home = Path(self.env.get("VAGRANT_HOME") or Path.home() / ".vagrant.d")
        found = sorted((home / "boxes" / box.replace("/", "-VAGRANTSLASH-")).glob("*/libvirt/box.img"))
        return found[-1] if found else None

    def domain_facts(self, domain: str) -> dict:
        """The domain's virtualisation type (kvm | qemu, i.e. TCG) and its QEMU's PID, from libvirt."""
        xml = self.capture(["virsh", "-c", libvirt.URI, "dumpxml", domain])
        facts = {"accel": ET.fromstring(xml).get("type")}
        with contextlib.suppress(FileNotFoundError, ValueError):
            facts["qemu_pid"] = int(Path(f"/run/libvirt/qemu/{domain}.pid").read_text().split()[0])
        return facts


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# ---- the round trip ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Options:
    out: Path
    rebuild_box: bool = False
    keep_vm: bool = False
    wheels: Path | None = None
    test_timeout_s: float = 6 * 3600.0


class LabRun:
    """One `make vm-test`: ``run()`` returns the summary (also written to out/summary.json)."""

    def __init__(self, opts: Options, host: Host | None = None, names: LabNames | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.opts, self.names, self.clock = opts, names or LabNames.load(), clock
        self.host = host or Host(vm_env(opts.wheels))
        self.recorded: list[tuple[str, str]] = []  # (kind, name) this run recorded and has not forgotten
        self.daemons: list[registry.ProcessRecord] = []
        self.qemu: list[registry.ProcessRecord] = []  # recorded once the domain runs
        self.times: dict[str, float | None] = {}
        self.summary: dict = {"command": "make vm-test", "ok": False, "out": str(opts.out),
                              "box": {"name": self.names.box}, "times_s": self.times, "tests": None}

    # -- records: before the thing exists, forgotten once it is gone
    def _record(self, kind: str, name: str) -> None:
        registry.record_resource(kind, name)
        self.recorded.append((kind, name))

    def _forget(self, kind: str, name: str) -> None:
        registry.forget_resource(kind, name)
        self.recorded.remove((kind, name))

    def _log(self, name: str) -> Path:
        return self.opts.out / name

    def _vagrant(self, args: list[str], log: str, timeout_s: float | None = None) -> tuple[int, float, list]:
        return self.host.run(["vagrant", *args], self._log(log), timeout_s)

    def run(self) -> dict:
        self.opts.out.mkdir(parents=True, exist_ok=True)
        t0 = self.clock()
        # what the host had before libvirt (a daemon started here starts its autostart networks too)
        self.summary["host_forwarding"] = forwarding = self.host.forwarding()
        try:
            self._libvirtd()
            self._box()
            self._up()
            self._provision_and_test()
        except LabVMError as e:
            self.summary["error"] = str(e)
        finally:
            try:
                with signals.shielded():  # a second signal does not cut the teardown short
                    if not self.opts.keep_vm:
                        self._destroy()
                    self._stop_daemons()
                    if not self.opts.keep_vm and not self.summary.get("leftovers"):
                        with contextlib.suppress(OSError):
                            self.host.restore_forwarding(forwarding)
            finally:
                self.times["total"] = round(self.clock() - t0, 1)
                write_json_atomic(self.opts.out / "summary.json", self.summary, indent=1, fsync=False)
        return self.summary

    def _libvirtd(self) -> None:
        if self.host.libvirt_answers():
            return
        t = self.clock()
        for role, binary, pidfile in LIBVIRTD:
            pid = self.host.start_daemon(role, binary, pidfile)
            self.daemons.append(registry.record_process(pid, f"lab-vm {role}"))
        self.times["libvirtd_start"] = round(self.clock() - t, 1)

    def _box(self) -> None:
        built = self.opts.rebuild_box or self.names.box not in self.host.boxes()
        self.summary["box"]["built"] = built
        if built:
            argv = ["bash", "scripts/build-lab-box.sh"] + (["--force"] if self.opts.rebuild_box else [])
            rc, secs, _ = self.host.run(argv, self._log("box-build.log"))
            self.times["box_build"] = round(secs, 1)
            if rc != 0:
                raise LabVMError(f"building the box failed (exit {rc}): {self._log('box-build.log')}")

    def _up(self) -> None:
        n = self.names
        have = self.host.libvirt_objects()
        if n.domain in have["vm"]:
            raise LabVMError(f"a lab VM {n.domain} already exists: another run, or a killed one "
                             f"(`orchestrrl clean` removes a recorded one; `virsh destroy/undefine` any other)")
        # recorded before `vagrant up` creates them: a kill -9 from here on leaves only records behind
        self._record("vm", n.domain)
        self._record("vm-disk", n.disk)
        if n.network not in have["vm-network"]:
            self._record("vm-network", n.network)
        image = self.host.box_image(n.box)
        box_volume = box_volume_name(n.box, "0", int(image.stat().st_mtime)) if image else None
        uploading = box_volume is not None and box_volume not in have["vm-disk"]
        if uploading:  # a half-uploaded base volume would be reused as if whole: recorded until complete
            self._record("vm-disk", box_volume)
        self.summary["box"]["volume_cached"] = not uploading
        rc, secs, lines = self._vagrant(["up", "--provider=libvirt", "--no-provision"], "vagrant-up.log")
        self.times["up"] = round(secs, 1)
        self.times.update(up_phases(lines, secs))
        if uploading and rc == 0:
            self._forget("vm-disk", box_volume)  # whole now: the cache the next run reuses
        if rc != 0:
            raise LabVMError(f"vagrant up failed (exit {rc}): {self._log('vagrant-up.log')}")
        facts = self.host.domain_facts(n.domain)
        self.summary["vm"] = {"accel": facts["accel"]}
        if "qemu_pid" in facts:  # stopped by PID too, should libvirtd be gone when `orchestrrl clean` runs
            with contextlib.suppress(Exception):
                self.qemu.append(registry.record_process(facts["qemu_pid"], "lab-vm qemu"))

    def _guest(self, command: str, timeout_s: float = 300.0) -> str:
        return self.host.capture(["vagrant", "ssh", "--no-tty", "-c", command], timeout_s)

    def _provision_and_test(self) -> None:
        with contextlib.suppress(LabVMError, subprocess.SubprocessError):
            self.summary["vm"].update(_guest_facts(self._guest(GUEST_FACTS)))
        rc, secs, _ = self._vagrant(["provision"], "provision.log")
        self.times["provision"] = round(secs, 1)
        if rc != 0:
            raise LabVMError(f"provisioning failed (exit {rc}): {self._log('provision.log')}")
        rc, secs, lines = self._vagrant(["ssh", "--no-tty", "-c", TEST_COMMAND], "test.log", self.opts.test_timeout_s)
        self.times["test"] = round(secs, 1)
        tests: dict = {"exit_status": rc, "tally": pytest_tally("\n".join(line for _, line in lines))}
        t = self.clock()
        with contextlib.suppress(LabVMError, subprocess.SubprocessError):
            xml = self._guest(f"sudo cat {GUEST_RESULTS}/junit.xml")
            (self.opts.out / "junit.xml").write_text(xml)
            tests.update(junit_counts(xml))
        self.times["copy_out"] = round(self.clock() - t, 1)
        self.summary["tests"] = tests
        self.summary["ok"] = rc == 0 and tests.get("failed", 1) == 0 and tests.get("errors", 1) == 0

    def _destroy(self) -> None:
        t = self.clock()
        if any(kind == "vm" for kind, _ in self.recorded):
            self._vagrant(["destroy", "-f"], "vagrant-destroy.log", 600)
        # whatever vagrant left of what this run recorded (its network when a domain still used it, a disk after
        # a failed up, a half-uploaded box volume): removed here, the records forgotten once it is gone
        leftovers = []
        with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
            have = self.host.libvirt_objects()
            for kind in registry.VM_KINDS:
                for k, name in list(self.recorded):
                    if k == kind and name in have[kind]:
                        try:
                            self.host.delete(kind, name)
                        except RuntimeError as e:
                            leftovers.append(f"{kind} {name}: {e}")
            have = self.host.libvirt_objects()
            for kind, name in list(self.recorded):
                if name not in have[kind]:
                    self._forget(kind, name)
        for rec in self.qemu:
            if not registry.process_alive(rec.pid, rec.start_time):
                registry.forget_process(rec.pid)
        if self.recorded:
            leftovers.append(f"still recorded (`orchestrrl clean` removes them): {self.recorded}")
        if leftovers:
            self.summary["leftovers"] = leftovers
        self.times["destroy"] = round(self.clock() - t, 1)

    def _stop_daemons(self) -> None:
        if self.summary.get("leftovers"):  # libvirt must answer `orchestrrl clean` for what is left
            return
        for rec in reversed(self.daemons):  # libvirtd before virtlogd
            registry.stop_process(rec, timeout_s=10.0)
            if not registry.process_alive(rec.pid, rec.start_time):
                registry.forget_process(rec.pid)


GUEST_FACTS = ("echo kernel=$(uname -r); echo cpus=$(nproc); echo memory_mib=$(free -m | awk '/^Mem:/{print $2}'); "
               "echo cpu_model=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); "
               "echo boot=$(sudo systemd-analyze time 2>&1 | head -1)")


def _guest_facts(text: str) -> dict:
    out: dict = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key in ("kernel", "cpus", "memory_mib", "cpu_model", "boot"):
            value = value.strip()
            out[key] = int(value) if value.isdigit() else value
    return out


def vm_env(wheels: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"VAGRANT_DEFAULT_PROVIDER": "libvirt", "VAGRANT_CHECKPOINT_DISABLE": "1",
                "VAGRANT_BOX_UPDATE_CHECK_DISABLE": "1", "LIBVIRT_DEFAULT_URI": libvirt.URI})
    if wheels is not None:
        env["ORCHESTRRL_VM_WHEELS"] = str(wheels)
    return env


def default_wheels() -> Path | None:
    """The host's local wheel folder when it holds torch (pip's find-links here: /opt/wheels), else None."""
    d = Path("/opt/wheels")
    return d if any(d.glob("torch-*.whl")) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_labvm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="results folder (default runs/vm-test/<UTC time>)")
    ap.add_argument("--rebuild-box", action="store_true", help="build the box again even if Vagrant has it")
    ap.add_argument("--keep-vm", action="store_true", help="leave the VM running (vagrant destroy -f later)")
    ap.add_argument("--wheels", type=Path, default=None,
                    help="host folder of wheels copied into the VM for pip (default /opt/wheels when it holds torch)")
    ap.add_argument("--test-timeout-s", type=float, default=6 * 3600.0, help="limit for `make test` in the VM")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_labvm: run as root (libvirt's system connection, debootstrap)", file=sys.stderr)
        return 2
    if args.wheels is not None and not args.wheels.is_dir():
        print(f"bench_labvm: --wheels: no folder {args.wheels}", file=sys.stderr)
        return 2
    if args.test_timeout_s <= 0:
        print(f"bench_labvm: --test-timeout-s must be > 0, got {args.test_timeout_s:g}", file=sys.stderr)
        return 2
    out = args.out or ROOT / "runs" / "vm-test" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    opts = Options(out=out, rebuild_box=args.rebuild_box, keep_vm=args.keep_vm,
                   wheels=args.wheels or default_wheels(), test_timeout_s=args.test_timeout_s)
    # SIGINT/SIGTERM/SIGHUP unwind: the VM is destroyed
    rc, summary = signals.run_torn_down(lambda: LabRun(opts).run(), "bench_labvm",
                                        f"; what it had made is destroyed (summary in {out})")
    if rc:
        return rc
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
