"""The few libvirt operations the registry's ``clean`` needs for the lab VM (``make vm-test``), through ``virsh``
on the system connection: list and delete domains, storage volumes and networks by name.

No libvirt on the machine (no ``virsh``) means no VM can exist: every listing is empty. A ``virsh`` that fails
(libvirtd not running) raises RuntimeError saying why. Deleting something already gone is not an error.
"""
from __future__ import annotations

import shutil
import subprocess

URI = "qemu:///system"


def _virsh(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["virsh", "-q", "-c", URI, *args], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"virsh {args[0]}: {e}") from None


def _names(*args: str) -> list[str]:
    if shutil.which("virsh") is None:
        return []
    r = _virsh(*args)
    if r.returncode != 0:
        raise RuntimeError(f"virsh {' '.join(args)} failed: {r.stderr.strip() or r.stdout.strip()}")
    return [line.strip() for line in r.stdout.splitlines() if line.strip()]


def _gone(r: subprocess.CompletedProcess) -> bool:
    """A virsh failure that only says the object does not exist (or is not running)."""
    text = (r.stderr + r.stdout).lower()
    return any(w in text for w in ("not found", "no domain", "no network", "no storage vol", "not running",
                                   "not active", "domain is not running", "network is not active"))


def answers() -> bool:
    """Whether libvirt's system connection answers (virsh installed and libvirtd running)."""
    if shutil.which("virsh") is None:
        return False
    try:
        return _virsh("version", timeout_s=30).returncode == 0
    except RuntimeError:
        return False


def domains() -> list[str]:
    return _names("list", "--all", "--name")


def networks() -> list[str]:
    return _names("net-list", "--all", "--name")


def volumes() -> dict[str, str]:
    """Volume name -> the (active) storage pool holding it."""
    out: dict[str, str] = {}
    for pool in _names("pool-list", "--name"):
        for vol in _names("vol-list", "--pool", pool):
            name = vol.split()[0]
            out.setdefault(name, pool)
    return out


def delete_domain(name: str) -> None:
    """Stop (hard) and undefine a domain."""
    r = _virsh("destroy", name)
    if r.returncode != 0 and not _gone(r):
        raise RuntimeError(f"virsh destroy {name} failed: {r.stderr.strip()}")
    r = _virsh("undefine", name, "--managed-save", "--snapshots-metadata", "--nvram")
    if r.returncode != 0 and not _gone(r):
        raise RuntimeError(f"virsh undefine {name} failed: {r.stderr.strip()}")


def delete_volume(name: str) -> None:
    pool = volumes().get(name)
    if pool is None:
        return
    r = _virsh("vol-delete", "--pool", pool, name)
    if r.returncode != 0 and not _gone(r):
        raise RuntimeError(f"virsh vol-delete {name} (pool {pool}) failed: {r.stderr.strip()}")


def delete_network(name: str) -> None:
    """Stop (its bridge and dnsmasq go with it) and undefine a network."""
    r = _virsh("net-destroy", name)
    if r.returncode != 0 and not _gone(r):
        raise RuntimeError(f"virsh net-destroy {name} failed: {r.stderr.strip()}")
    r = _virsh("net-undefine", name)
    if r.returncode != 0 and not _gone(r):
        raise RuntimeError(f"virsh net-undefine {name} failed: {r.stderr.strip()}")
