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
