"""Registry records (tmp ORCHESTRRL_STATE_DIR): atomic JSON files, recycled-PID safety, name checks."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from emulation import registry
from emulation.validation import SpecError


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    d = tmp_path / "state"
    monkeypatch.setenv("ORCHESTRRL_STATE_DIR", str(d))
    return d


def test_process_record_roundtrip(state_dir):
    rec = registry.record_process(os.getpid(), "test", group=False)
    assert rec.start_time == registry.proc_start_time(os.getpid())
    assert rec.cmdline == registry.proc_cmdline(os.getpid()) and rec.cmdline
    files = list(state_dir.iterdir())
    assert [f.name for f in files] == [f"proc-{os.getpid()}.json"]
    data = json.loads(files[0].read_text())
    assert data["pid"] == os.getpid() and data["role"] == "test"
    assert registry.list_processes() == [rec]
    registry.forget_process(os.getpid())
    registry.forget_process(os.getpid())  # idempotent
    assert registry.list_processes() == []


def test_no_temporary_files_left(state_dir):
    for i in range(5):
        registry.record_resource("bridge", f"orlt{i}")
    assert all(not f.name.startswith(".tmp") for f in state_dir.iterdir())
    assert registry.list_resources() == [("bridge", f"orlt{i}") for i in range(5)]


def test_partial_and_foreign_files_are_skipped(state_dir):
    registry.record_resource("interface", "orlh0-eth0")
    (state_dir / "proc-123.json").write_text('{"pid": 12')  # torn write (cannot happen with rename)
    (state_dir / ".tmp-abc").write_text("junk")
    assert registry.list_processes() == []
    assert registry.list_resources() == [("interface", "orlh0-eth0")]


@pytest.mark.parametrize("kind,name", [("bridge", "br0"), ("interface", "orl-very-long-name"), ("disk", "orl1"),
                                       ("netns", "orl/../x")])
def test_bad_resources_rejected(kind, name, state_dir):
    with pytest.raises(SpecError):
        registry.record_resource(kind, name)
    assert not state_dir.exists() or list(state_dir.iterdir()) == []


def test_record_missing_process_rejected():
    with pytest.raises(SpecError, match="pid"):
        registry.record_process(2**22 + 12345, "ghost")


def test_recycled_pid_is_not_alive():
    st = registry.proc_start_time(os.getpid())
    assert registry.process_alive(os.getpid(), st)
    assert not registry.process_alive(os.getpid(), st + 1)


def test_stop_process_group_and_recycled_pid_safety():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        rec = registry.record_process(p.pid, "sleeper", group=True)
        fake = registry.ProcessRecord(pid=p.pid, role="x", start_time=rec.start_time + 7, cmdline=[])
        assert registry.stop_process(fake) == "gone"  # wrong start time: nothing sent
        assert p.poll() is None
        assert registry.stop_process(rec, timeout_s=5) == "stopped"
        assert p.wait(timeout=5) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_stop_escalates_to_sigkill():
    code = "import signal, time, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        rec = registry.record_process(p.pid, "stubborn")
        res = registry.stop_processes([rec], timeout_s=0.2)
        assert res == {p.pid: "killed"}
        assert p.wait(timeout=5) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("exits_after_s", [2.6, None])
def test_clean_waits_for_a_killed_process_to_finish_exiting(monkeypatch, exits_after_s):
    """A SIGKILLed process still exiting past stop_processes' 2 s (a Mininet host shell on a loaded machine) is
    waited for, up to KILLED_EXIT_WAIT_S, before clean calls it a survivor; one that never exits is reported and
    keeps its record. The process's life is faked (no signal is sent to the real sleeper behind the record)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rec = registry.record_process(p.pid, "mnhost")
        killed_at = []
        monkeypatch.setattr(registry, "_signal", lambda r, sig: killed_at.append(time.monotonic())
                            if sig == signal.SIGKILL else None)
        real_alive = registry.process_alive

        def alive(pid, start_time=None):
            if pid != rec.pid:
                return real_alive(pid, start_time)
            return not killed_at or exits_after_s is None or time.monotonic() - killed_at[0] < exits_after_s

        monkeypatch.setattr(registry, "process_alive", alive)
        if exits_after_s is None:
            monkeypatch.setattr(registry, "KILLED_EXIT_WAIT_S", 0.3)
        rep = registry.clean(process_timeout_s=0.05, system=FakeSystem([]))
        assert len(killed_at) == 1
        if exits_after_s is None:
            assert rep.errors == [f"process {rec.pid} (mnhost) survived SIGKILL; its record is kept"]
            assert [r.pid for r in registry.list_processes()] == [rec.pid]
        else:
            assert rep.errors == [] and registry.list_processes() == []
            assert time.monotonic() - killed_at[0] >= exits_after_s
    finally:
        p.kill()
        p.wait()


class FakeSystem(registry.System):
    """Bridges, interfaces and namespaces that deletions really remove (as OVS and the kernel would), and
    libvirt's domains, volumes and networks (as virsh would); never the machine's."""

    def __init__(self, bridges=(), intfs=(), netns=(), effective=True, vms=(), disks=(), nets=()):
        self.b, self.i, self.n, self.calls, self.effective = list(bridges), list(intfs), list(netns), [], effective
        self.libvirt = {"vm": list(vms), "vm-disk": list(disks), "vm-network": list(nets)}

    def vms(self):
        return list(self.libvirt["vm"])

    def vm_disks(self):
        return list(self.libvirt["vm-disk"])

    def vm_networks(self):
        return list(self.libvirt["vm-network"])

    def _vm_delete(self, kind, name):
        self.calls.append((f"del-{kind}", name))
        if self.effective and name in self.libvirt[kind]:
            self.libvirt[kind].remove(name)

    def delete_vm(self, name):
        self._vm_delete("vm", name)

    def delete_vm_disk(self, name):
        self._vm_delete("vm-disk", name)

    def delete_vm_network(self, name):
        self._vm_delete("vm-network", name)

    def bridges(self):
        return list(self.b)

    def interfaces(self):
        return list(self.i)

    def netns(self):
        return list(self.n)

    def delete_bridges(self, names):
        self.calls.append(("del-br", list(names)))
        if self.effective:
            self.b = [x for x in self.b if x not in names]

    def delete_interface(self, name):
        self.calls.append(("del-link", name))
        if name in self.i:
            self.i.remove(name)
            return True
        return False

    def delete_netns(self, name):
        self.calls.append(("del-netns", name))
        self.n.remove(name)


@pytest.mark.parametrize("sweep", [False, True])
def test_clean_dry_run_changes_nothing(state_dir, sweep):
    sysm = FakeSystem(["orlt0", "orlo9", "br-other"], ["lo", "orlt0-eth1", "orlx-eth0", "eth0"], ["orlns", "other"])
    registry.record_resource("bridge", "orlt0")
    registry.record_resource("interface", "orlt0-eth1")
    rep = registry.clean(dry_run=True, sweep=sweep, system=sysm)
    assert sysm.calls == []
    if sweep:  # --all --dry-run says what the sweep would remove, whoever made it
        assert (rep.bridges, rep.interfaces, rep.netns) == (["orlo9", "orlt0"], ["orlt0-eth1", "orlx-eth0"],
                                                           ["orlns"])
    else:
        assert (rep.bridges, rep.interfaces, rep.netns) == (["orlt0"], ["orlt0-eth1"], [])
    assert rep.not_recorded == {"bridges": ["orlo9"], "interfaces": ["orlx-eth0"], "netns": ["orlns"]}
    assert registry.list_resources() == [("bridge", "orlt0"), ("interface", "orlt0-eth1")]


def test_clean_deletes_only_what_this_registry_recorded_and_all_sweeps_the_prefix(state_dir):
    sysm = FakeSystem(["orlt0", "orlo0", "br-other"], ["lo", "orlt0-eth1", "orlo0-eth1", "eth0"], ["orlns9"])
    registry.record_resource("bridge", "orlt0")
    registry.record_resource("interface", "orlt0-eth1")
    registry.record_resource("interface", "orlt9-eth1")  # recorded, already gone: just forgotten
    rep = registry.clean(system=sysm)
    assert sysm.calls == [("del-br", ["orlt0"]), ("del-link", "orlt0-eth1")]
    assert rep.not_recorded == {"bridges": ["orlo0"], "interfaces": ["orlo0-eth1"], "netns": ["orlns9"]}
    assert sysm.b == ["orlo0", "br-other"] and sysm.i == ["lo", "orlo0-eth1", "eth0"]
    assert rep.records_removed == 3 and registry.list_resources() == [] and rep.errors == []
    sysm.calls.clear()
    rep = registry.clean(sweep=True, system=sysm)  # --all: every orl* name, never another prefix
    assert sysm.calls == [("del-br", ["orlo0"]), ("del-link", "orlo0-eth1"), ("del-netns", "orlns9")]
    assert sysm.b == ["br-other"] and sysm.i == ["lo", "eth0"] and sysm.n == []


def test_clean_keeps_the_record_of_what_survives_and_reports_it(state_dir):
    sysm = FakeSystem(["orlt0"], effective=False)  # deletion silently has no effect
    registry.record_resource("bridge", "orlt0")
    rep = registry.clean(system=sysm)
    assert rep.records_removed == 0
    assert [(k, n) for k, n in registry.list_resources()] == [("bridge", "orlt0")]
    assert any("orlt0 still exists" in e for e in rep.errors)


def test_clean_reports_a_netlink_failure_and_keeps_the_record(state_dir):
    from emulation.netlink import NetlinkFailed

    class Refusing(FakeSystem):
        def delete_interface(self, name):
            raise NetlinkFailed(f"interface {name}", 1, "Operation not permitted")

    sysm = Refusing(intfs=["orlx0"])
    registry.record_resource("interface", "orlx0")
    rep = registry.clean(system=sysm)
    assert rep.interfaces == [] and any("orlx0" in e and "errno 1" in e for e in rep.errors)
    assert registry.list_resources() == [("interface", "orlx0")]


# ---- the lab VM's libvirt objects (make vm-test) --------------------------------------------------------
class NoLibvirt(FakeSystem):
    """A machine whose libvirt does not answer (libvirtd stopped): every VM listing fails."""

    def __init__(self, *a, asked=None, **kw):
        super().__init__(*a, **kw)
        self.asked = asked if asked is not None else []

    def vms(self):
        self.asked.append("vms")
        raise RuntimeError("virsh list failed: failed to connect to the hypervisor")

    vm_disks = vm_networks = vms


def test_vm_names_checked():
    for kind, name in (("vm", "lab"), ("vm-disk", "orl/x.img"), ("vm-network", "orl net"), ("vm", "")):
        with pytest.raises(SpecError, match="name"):
            registry.record_resource(kind, name)
    # a VM's names are not interface names: no 15-character limit; the box's cached volume is 'orchestrrl-*'
    registry.record_resource("vm-disk", "orchestrrl-debian12_vagrant_box_image_0_1733_box.img")
    registry.record_resource("vm", "orllab-default-with-a-long-name")
    assert sorted(registry.list_resources()) == [("vm", "orllab-default-with-a-long-name"),
                                                 ("vm-disk", "orchestrrl-debian12_vagrant_box_image_0_1733_box.img")]


def test_clean_removes_a_killed_vm_run_vm_first_while_its_libvirtd_still_runs(state_dir):
    """What a `make vm-test` killed by SIGKILL half-way leaves: its records. clean deletes the domain, then its
    disks, then its network, and only then stops the libvirtd the run started (a recorded process)."""
    libvirtd = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        registry.record_process(libvirtd.pid, "libvirtd")
        alive_at_delete = []

        class Watching(FakeSystem):
            def _vm_delete(self, kind, name):
                alive_at_delete.append(libvirtd.poll() is None)
                super()._vm_delete(kind, name)

        box_vol = "orchestrrl-debian12_vagrant_box_image_0_box.img"
        sysm = Watching(vms=["orllab-default", "other-vm"], disks=["orllab-default.img", box_vol, "orlzz.img"],
                        nets=["orllab", "default"])
        for kind, name in (("vm", "orllab-default"), ("vm-disk", "orllab-default.img"), ("vm-disk", box_vol),
                           ("vm-network", "orllab")):
            registry.record_resource(kind, name)
        rep = registry.clean(system=sysm)
        assert sysm.calls == [("del-vm", "orllab-default"), ("del-vm-disk", "orllab-default.img"),
                              ("del-vm-disk", box_vol), ("del-vm-network", "orllab")]
        assert alive_at_delete == [True] * 4
        assert libvirtd.wait(timeout=5) == -signal.SIGTERM
        assert (rep.vms, rep.vm_disks, rep.vm_networks) == (["orllab-default"], ["orllab-default.img", box_vol],
                                                            ["orllab"])  # the VM's disk before the box's
        assert rep.not_recorded == {"vm_disks": ["orlzz.img"]}  # orl*, not ours: reported; other names unseen
        assert rep.errors == [] and registry.list_resources() == [] and registry.list_processes() == []
        assert sysm.libvirt == {"vm": ["other-vm"], "vm-disk": ["orlzz.img"], "vm-network": ["default"]}
    finally:
        if libvirtd.poll() is None:
            libvirtd.kill()
            libvirtd.wait()


def test_clean_asks_libvirt_nothing_without_a_vm_record(state_dir):
    asked = []
    sysm = NoLibvirt(["orlt0"], asked=asked)
    registry.record_resource("bridge", "orlt0")
    rep = registry.clean(system=sysm)
    assert asked == [] and rep.errors == [] and sysm.calls == [("del-br", ["orlt0"])]
    # a sweep asks; no libvirt answering with nothing recorded is no error (no VM of ours can be there)
    rep = registry.clean(sweep=True, system=sysm)
    assert asked and rep.errors == [] and rep.vms == []


def test_clean_keeps_vm_records_when_libvirt_does_not_answer(state_dir):
    class Down(NoLibvirt):
        def delete_vm(self, name):
            raise RuntimeError(f"virsh destroy {name} failed: failed to connect to the hypervisor")

        delete_vm_disk = delete_vm_network = delete_vm

    registry.record_resource("vm", "orllab-default")
    registry.record_resource("vm-network", "orllab")
    rep = registry.clean(system=Down())
    assert any("cannot list libvirt domains" in e for e in rep.errors)
    assert any("deleting vm orllab-default" in e for e in rep.errors)
    assert any("libvirt does not answer; its record is kept" in e for e in rep.errors)
    assert sorted(registry.list_resources()) == [("vm", "orllab-default"), ("vm-network", "orllab")]
    rep = registry.clean(system=FakeSystem(vms=["orllab-default"], nets=["orllab"]))  # libvirtd back: done
    assert rep.errors == [] and registry.list_resources() == [] and rep.vms == ["orllab-default"]


@pytest.mark.parametrize("sweep", [False, True])
def test_clean_dry_run_lists_vms_and_deletes_nothing(state_dir, sweep):
    sysm = FakeSystem(vms=["orllab-default", "orlother"], disks=["orllab-default.img"], nets=["orllab"])
    registry.record_resource("vm", "orllab-default")
    rep = registry.clean(dry_run=True, sweep=sweep, system=sysm)
    assert sysm.calls == []
    assert rep.vms == (["orllab-default", "orlother"] if sweep else ["orllab-default"])
    assert rep.vm_disks == (["orllab-default.img"] if sweep else [])
    assert rep.not_recorded == {"vms": ["orlother"], "vm_disks": ["orllab-default.img"], "vm_networks": ["orllab"]}
    assert registry.list_resources() == [("vm", "orllab-default")]


def test_vm_survivor_keeps_its_record(state_dir):
    registry.record_resource("vm", "orllab-default")
    rep = registry.clean(system=FakeSystem(vms=["orllab-default"], effective=False))
    assert any("vm orllab-default still exists" in e for e in rep.errors)
    assert registry.list_resources() == [("vm", "orllab-default")]


def test_shell_entry_point(state_dir, capsys):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert registry.main(["record", "process", str(p.pid), "qemu"]) == 0
        assert [(r.pid, r.role) for r in registry.list_processes()] == [(p.pid, "qemu")]
        assert registry.main(["forget", "process", str(p.pid)]) == 0 and registry.list_processes() == []
    finally:
        p.kill()
        p.wait()
    assert registry.main(["record", "vm-network", "orllab"]) == 0
    assert registry.list_resources() == [("vm-network", "orllab")]
    assert registry.main(["forget", "vm-network", "orllab"]) == 0 and registry.list_resources() == []
    assert registry.main(["record", "vm", "not-ours"]) == 2 and "name" in capsys.readouterr().err
    assert registry.main(["record", "process", "abc"]) == 2 and "pid" in capsys.readouterr().err
    assert registry.main(["delete", "vm", "orlx"]) == 2 and "usage" in capsys.readouterr().err
    assert registry.list_resources() == [] and registry.list_processes() == []
