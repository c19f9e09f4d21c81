"""setup.cfg against the code: every module the code imports is declared, data folders are packages, and
`orchestrrl doctor` checks exactly what the code imports (derived from the source, not a hand list)."""
from __future__ import annotations

import configparser
import importlib.metadata as md
import re
from pathlib import Path

from testbed.commands import doctor

ROOT = Path(__file__).resolve().parents[2]


def _cfg() -> configparser.ConfigParser:
    c = configparser.ConfigParser()
    c.read(ROOT / "setup.cfg")
    return c


def _names(block: str) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
            for line in block.splitlines() if line.strip()}


def declared() -> dict[str, set[str]]:
    c = _cfg()
    out = {"install_requires": _names(c["options"]["install_requires"])}
    out.update({k: _names(v) for k, v in c["options.extras_require"].items()})
    return out


def test_every_third_party_import_is_declared_in_setup_cfg():
    dists = md.packages_distributions()
    everything = set().union(*declared().values())
    missing = {}
    for mod, rec in doctor.code_imports(ROOT).items():
        if mod in doctor.SEPARATE:  # Debian's mininet, not from PyPI
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(mod, [])}
        assert names, f"{mod} (imported by {rec['files']}) is not installed here"
        if not names & everything:
            missing[mod] = rec["files"]
    assert missing == {}, f"imported but in no setup.cfg dependency list: {missing}"


def test_the_emu_extra_has_what_the_demo_and_agents_need():
    emu = declared()["emu"]
    assert {"matplotlib", "pyzmq", "os-ken", "pyroute2", "torch"} <= emu  # demo plot; agents' transport
    assert "msgpack" in declared()["install_requires"]


def test_doctor_derives_its_list_from_the_code():
    found = doctor.code_imports(ROOT)
    assert {"numpy", "yaml", "os_ken", "pyroute2", "torch", "tqdm", "matplotlib"} <= set(found)
    assert found["ray"]["optional"] and not found["numpy"]["optional"]  # rlsim/sweep.py runs without Ray
    assert not {"json", "os", "emulation", "controller", "__future__"} & set(found)
    checked = {c.name.split(": ", 1)[1].split(" ")[0] for c in doctor.check_python() if c.name.startswith("python: ")}
    assert checked == set(found) - set(doctor.SEPARATE)


def test_namespace_discovery_ships_the_data_folders():
    from setuptools import find_namespace_packages

    c = _cfg()
    assert c["options"]["packages"].strip() == "find_namespace:"
    inc = [x for x in c["options.packages.find"]["include"].split() if x]
    exc = [x for x in c["options.packages.find"]["exclude"].split() if x]
    pkgs = set(find_namespace_packages(where=str(ROOT), include=inc, exclude=exc))
    assert {"rlsim.data", "agents.data", "emulation.data", "controller", "testbed.commands"} <= pkgs
    assert not any("__pycache__" in p or p.startswith("tests") for p in pkgs)


def test_provision_names_every_machine_setting_and_doctor_fails_on_each(tmp_path, monkeypatch):
    """scripts/provision.sh applies emulation/machine.py and lists the keys it sets (what a reader of the script,
    and the fresh-machine comparison, look for); doctor fails on a setting below its floor, naming the fix."""
    from emulation import machine

    text = (ROOT / "scripts" / "provision.sh").read_text()
    assert "-m emulation.machine apply" in text
    listed = set(re.findall(r"\bnet\.[a-z0-9_.]+", text.split("It sets:", 1)[1].split("\n/usr/bin", 1)[0]))
    assert listed == {s.key for s in machine.SETTINGS}
    monkeypatch.setattr(machine, "SYSCTL_DIR", tmp_path)
    for s in machine.SETTINGS:
        s.path.parent.mkdir(parents=True, exist_ok=True)
        s.path.write_text(s.want + "\n")
    (tmp_path / "net/ipv4/tcp_available_congestion_control").write_text("reno bbr cubic\n")
    assert all(c.status == "OK" for c in doctor.check_machine())
    machine.by_key("net.ipv4.tcp_allowed_congestion_control").path.write_text("reno bbr\n")
    bad = [c for c in doctor.check_machine() if c.status != "OK"]
    assert [c.name for c in bad] == ["sysctl net.ipv4.tcp_allowed_congestion_control"]
    assert "provision.sh" in bad[0].fix and "cubic" in bad[0].detail
