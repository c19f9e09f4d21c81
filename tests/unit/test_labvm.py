"""The lab VM round trip (`make vm-test`, testbed/benchmarks/bench_labvm.py) without a VM: what it records and
when (a kill -9 at any point leaves nothing `orchestrrl clean` cannot remove), what it destroys, how it counts."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from emulation import registry
from testbed.benchmarks import bench_labvm as lab

ROOT = Path(__file__).resolve().parents[2]
NAMES = lab.LabNames.load()


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    d = tmp_path / "state"
    monkeypatch.setenv("ORCHESTRRL_STATE_DIR", str(d))
    return d


def test_names_are_the_vagrantfiles_and_recordable():
    cfg = json.loads((ROOT / "scripts" / "labvm.json").read_text())
    vf = (ROOT / "Vagrantfile").read_text()
    for key in ("box", "domain_prefix", "network", "network_address", "storage_pool", "guest_wheels"):
        assert f'lab.fetch("{key}")' in vf, f"the Vagrantfile does not read {key} from scripts/labvm.json"
    assert NAMES.domain == cfg["domain_prefix"] + cfg["machine"] and NAMES.disk == NAMES.domain + ".img"
    for kind, name in (("vm", NAMES.domain), ("vm-disk", NAMES.disk), ("vm-network", NAMES.network),
                       ("vm-disk", lab.box_volume_name(NAMES.box, "0", 1733))):
        registry.record_resource(kind, name)  # every name passes the registry's checks
    # the box's cached volume is not an orl* name: `orchestrrl clean --all` leaves the cache alone
    assert not NAMES.box.startswith(registry.NAME_PREFIX) and NAMES.domain.startswith(registry.NAME_PREFIX)


def test_box_volume_name_is_vagrant_libvirts():
    assert lab.box_volume_name("orchestrrl-debian12", "0", 1733) == \
        "orchestrrl-debian12_vagrant_box_image_0_1733_box.img"
    assert lab.box_volume_name("org/box", "1.2", 5) == "org-VAGRANTSLASH-box_vagrant_box_image_1.2_box.img"


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.unit.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.unit.test_a" name="test_ok2" time="0.1"/>
<testcase classname="tests.system.test_b" name="test_bad" time="1"><failure message="x">boom</failure></testcase>
<testcase classname="tests.system.test_c" name="test_err" time="1"><error message="y">setup</error></testcase>
<testcase classname="tests.system.test_e" name="test_slow" time="300.2"><failure message="Failed: Timeout &gt;300.0s">
</failure></testcase>
<testcase classname="tests.gpu.test_d" name="test_gpu" time="0"><skipped message="no CUDA"/></testcase>
</testsuite></testsuites>"""


def test_junit_counts():
    c = lab.junit_counts(JUNIT, slowest=2)
    assert (c["total"], c["passed"], c["failed"], c["errors"], c["skipped"]) == (6, 2, 2, 1, 1)
    assert c["failed_tests"] == ["tests.system.test_b::test_bad", "tests.system.test_c::test_err",
                                 "tests.system.test_e::test_slow"]
    assert c["timed_out"] == ["tests.system.test_e::test_slow"]
    assert c["slowest"] == [{"test": "tests.system.test_e::test_slow", "s": 300.2},
                            {"test": "tests.system.test_b::test_bad", "s": 1.0}]


def test_pytest_tally_reads_the_last_summary_line():
    text = "tests/unit/test_a.py ....\n= 2 failed, 250 passed, 9 skipped, 1 error in 612.04s (0:10:12) =\n"
    assert lab.pytest_tally(text) == {"failed": 2, "passed": 250, "skipped": 9, "errors": 1}
    assert lab.pytest_tally("no summary here") == {}


def test_up_phases_from_vagrants_output():
    lines = [(0.5, "==> default: Uploading base box image as volume into Libvirt storage..."),
             (40.0, "==> default: Creating image (snapshot of base box volume)."),
             (41.0, "==> default: Starting domain."), (130.0, "==> default: Machine booted and ready!"),
             (131.0, "==> default: Rsyncing folder: /work/x/ => /vagrant")]
    assert lab.up_phases(lines, 150.0) == {"box_upload": 39.5, "boot": 89.0, "sync": 19.0}
    assert lab.up_phases(lines[2:], 150.0)["box_upload"] is None  # cached box volume: no upload


class FakeHost(lab.Host):
    """libvirt and Vagrant as far as the round trip sees them. ``on_up`` runs while `vagrant up` has created the
    VM's objects and the daemons run: the moment a kill -9 would leave the most behind."""

    def __init__(self, tmp_path, boxes=(), objects=None, up_rc=0, test_rc=0, on_up=None):
        super().__init__({})
        self.tmp, self.box_list, self.up_rc, self.test_rc, self.on_up = tmp_path, list(boxes), up_rc, test_rc, on_up
        self.objects = objects or {"vm": [], "vm-disk": [], "vm-network": []}
        self.daemons: list[subprocess.Popen] = []
        self.calls: list[str] = []
        image = tmp_path / "box.img"
        image.write_text("qcow2")
        self.image = image

    def run(self, argv, log_path, timeout_s=None):
        cmd = " ".join(argv[:3])
        self.calls.append(cmd)
        lines = []
        if "build-lab-box.sh" in cmd:
            self.box_list.append(NAMES.box)
        elif argv[:2] == ["vagrant", "up"]:
            self.objects["vm-disk"] += [self.box_volume(), NAMES.disk]
            self.objects["vm"].append(NAMES.domain)
            if NAMES.network not in self.objects["vm-network"]:
                self.objects["vm-network"].append(NAMES.network)
            lines = [(1.0, "==> default: Starting domain."), (50.0, "==> default: Machine booted and ready!")]
            if self.on_up:
                self.on_up(self)
            return self.up_rc, 60.0, lines
        elif argv[:2] == ["vagrant", "destroy"]:
            self.objects["vm"] = [n for n in self.objects["vm"] if n != NAMES.domain]
            self.objects["vm-disk"] = [n for n in self.objects["vm-disk"] if n != NAMES.disk]
        elif argv[:2] == ["vagrant", "ssh"]:
            return self.test_rc, 600.0, [(599.0, "= 250 passed, 9 skipped in 598.00s =")]
        return 0, 1.0, lines

    def box_volume(self):
        return lab.box_volume_name(NAMES.box, "0", int(self.image.stat().st_mtime))

    def capture(self, argv, timeout_s=120.0):
        self.calls.append(" ".join(argv[:3]))
        if "junit.xml" in argv[-1]:
            return JUNIT
        return "kernel=6.1.0-57-amd64\ncpus=2\nmemory_mib=7951\n"

    def libvirt_answers(self):
        return bool(self.daemons)

    def start_daemon(self, role, binary, pidfile):
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.daemons.append(p)
        return p.pid

    def libvirt_objects(self):
        return {k: list(v) for k, v in self.objects.items()}

    def delete(self, kind, name):
        self.calls.append(f"delete {kind} {name}")
        self.objects[kind].remove(name)

    def boxes(self):
        return list(self.box_list)

    def box_image(self, box):
        return self.image if box in self.box_list else None

    def domain_facts(self, domain):
        return {"accel": "qemu"}

    def stop_all(self):
        for p in self.daemons:
            if p.poll() is None:
                p.kill()
            p.wait()


class CleanView(registry.System):
    """`orchestrrl clean` looking at the fake host's libvirt (dry run: it only says what it would remove)."""

    def __init__(self, host):
        self.host = host

    def bridges(self):
        return []

    def interfaces(self):
        return []

    def netns(self):
        return []

    def vms(self):
        return list(self.host.objects["vm"])

    def vm_disks(self):
        return list(self.host.objects["vm-disk"])

    def vm_networks(self):
        return list(self.host.objects["vm-network"])


def test_a_kill_during_vagrant_up_leaves_only_what_clean_removes(tmp_path):
    """First run on a fresh host: libvirtd not running, no box. While `vagrant up` runs, everything it and this
    run created is recorded, so `orchestrrl clean` after a kill -9 there would remove all of it."""
    seen = {}

    def kill_minus_9_here(host):
        rep = registry.clean(dry_run=True, system=CleanView(host))
        seen["vms"], seen["disks"], seen["nets"] = rep.vms, rep.vm_disks, rep.vm_networks
        seen["procs"] = sorted(p["role"] for p in rep.processes)
        seen["created"] = {k: sorted(v) for k, v in host.objects.items()}

    host = FakeHost(tmp_path, on_up=kill_minus_9_here)
    try:
        summary = lab.LabRun(lab.Options(out=tmp_path / "out"), host=host).run()
        assert seen["vms"] == [NAMES.domain] and seen["nets"] == [NAMES.network]
        assert sorted(seen["disks"]) == sorted(seen["created"]["vm-disk"])  # the VM's disk and the box upload
        assert seen["procs"] == ["lab-vm libvirtd", "lab-vm virtlogd"]
        # a normal end: the VM, its disk and network destroyed, the daemons it started stopped, nothing recorded
        assert host.objects == {"vm": [], "vm-disk": [host.box_volume()], "vm-network": []}  # the box: cached
        assert registry.list_resources() == [] and registry.list_processes() == []
        assert all(p.poll() is not None for p in host.daemons)
        assert summary["box"] == {"name": NAMES.box, "built": True, "volume_cached": False}
        assert host.calls[0] == "bash scripts/build-lab-box.sh" and "error" not in summary
    finally:
        host.stop_all()


def test_counts_and_times_in_the_summary(tmp_path):
    host = FakeHost(tmp_path, boxes=[NAMES.box], objects={"vm": [], "vm-disk": [], "vm-network": [NAMES.network]})
    host.daemons.append(subprocess.Popen([sys.executable, "-c", "pass"]))  # libvirtd already answers
    try:
        summary = lab.LabRun(lab.Options(out=tmp_path / "out"), host=host).run()
    finally:
        host.stop_all()
    assert summary["box"]["built"] is False and "box_build" not in summary["times_s"]
    t = summary["times_s"]
    assert (t["up"], t["boot"], t["provision"], t["test"]) == (60.0, 49.0, 1.0, 600.0)
    tests = summary["tests"]
    assert (tests["passed"], tests["failed"], tests["errors"], tests["skipped"]) == (2, 2, 1, 1)
    assert tests["tally"] == {"passed": 250, "skipped": 9} and tests["exit_status"] == 0
    assert summary["ok"] is False  # a failed test is not ok, whatever make's exit status said
    assert summary["vm"]["accel"] == "qemu" and summary["vm"]["cpus"] == 2
    # a network that existed before the run is not this run's: neither recorded nor deleted
    assert host.objects["vm-network"] == [NAMES.network] and registry.list_resources() == []
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["tests"]["failed"] == 2


def test_a_failed_up_still_destroys_and_forgets(tmp_path):
    host = FakeHost(tmp_path, boxes=[NAMES.box], up_rc=1)
    host.daemons.append(subprocess.Popen([sys.executable, "-c", "pass"]))
    try:
        summary = lab.LabRun(lab.Options(out=tmp_path / "out"), host=host).run()
    finally:
        host.stop_all()
    assert "vagrant up failed" in summary["error"] and summary["ok"] is False
    assert host.objects == {"vm": [], "vm-disk": [], "vm-network": []}  # half-uploaded box volume too
    assert f"delete vm-disk {host.box_volume()}" in host.calls and f"delete vm-network {NAMES.network}" in host.calls
    assert registry.list_resources() == []


def test_refuses_to_start_over_an_existing_lab_vm(tmp_path):
    host = FakeHost(tmp_path, boxes=[NAMES.box], objects={"vm": [NAMES.domain], "vm-disk": [], "vm-network": []})
    host.daemons.append(subprocess.Popen([sys.executable, "-c", "pass"]))
    try:
        summary = lab.LabRun(lab.Options(out=tmp_path / "out"), host=host).run()
    finally:
        host.stop_all()
    assert re.search(r"lab VM orllab-default already exists", summary["error"])
    assert host.objects["vm"] == [NAMES.domain] and not any("destroy" in c for c in host.calls)
    assert registry.list_resources() == []


def test_guest_facts():
    text = "kernel=6.1.0-57-amd64\ncpus=2\nmemory_mib=7951\ncpu_model= QEMU TCG CPU version 2.5+\njunk\n"
    assert lab._guest_facts(text) == {"kernel": "6.1.0-57-amd64", "cpus": 2, "memory_mib": 7951,
                                      "cpu_model": "QEMU TCG CPU version 2.5+"}


def _rsync_excluded(path: str, pattern: str) -> bool:
    """rsync's --exclude for one relative path (enough of it for the Vagrantfile's patterns): a leading '/'
    anchors at the synced folder, a trailing '/' matches folders only, otherwise any path component matches."""
    import fnmatch

    anchored, folder = pattern.startswith("/"), pattern.endswith("/")
    pat = pattern.strip("/")
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for i, prefix in enumerate(prefixes):
        is_folder = i < len(parts) - 1
        if folder and not is_folder:
            continue
        if anchored and fnmatch.fnmatchcase(prefix, pat):
            return True
        if not anchored and "/" not in pat and fnmatch.fnmatchcase(parts[i], pat):
            return True
    return False


def test_every_tracked_file_reaches_the_vm():
    vf = (ROOT / "Vagrantfile").read_text()
    m = re.search(r'synced_folder "\.", "/vagrant".*?rsync__exclude: \[(.*?)\]', vf, re.S)
    assert m, "the Vagrantfile no longer rsyncs the checkout to /vagrant"
    patterns = re.findall(r'"([^"]+)"', m.group(1))
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    dropped = sorted(f for f in tracked if any(_rsync_excluded(f, p) for p in patterns))
    assert not dropped, f"the Vagrantfile's rsync__exclude drops tracked files from the VM: {dropped[:5]}"
    assert _rsync_excluded("testbed/runs/x.py", "runs/") and not _rsync_excluded("testbed/runs/x.py", "/runs/")
    assert _rsync_excluded("runs/vm-test/s.json", "/runs/") and _rsync_excluded("a/__pycache__/b.pyc", "__pycache__/")
