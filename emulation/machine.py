"""The root namespace's settings the testbed needs: one home for each (what, why), read by the three places that
act on them: ``scripts/provision.sh`` applies them (``python3 -m emulation.machine apply``, and writes
``/etc/sysctl.d/60-orchestrrl.conf`` so a reboot keeps them), ``orchestrrl doctor`` checks each one and names
the fix, and the builder makes sure of the one it can fix itself at start (the host congestion control).

A freshly booted Debian 12 machine of this project's kind differs from one that has run experiments: its
``net.ipv4.tcp_allowed_congestion_control`` is ``reno bbr``, and a network namespace other than the root one
may only choose an algorithm from that list, so every host the builder told to use CUBIC failed
(``sysctl: setting key "net.ipv4.tcp_congestion_control": Operation not permitted``) on a fresh machine and
worked on a used one. Its socket buffers and input backlog differ from image to image too (one booted with a 1000-packet backlog
and 4 MiB buffers); Mininet raises those five to the floors below the first time it builds a network in a
process (``mininet.util.fixLimits``), so every figure the project measured ran at them: they are set here,
before anything is built, so that a machine's first run and its doctor see what its later runs will (values
above a floor are left alone).

Stdlib only: provision.sh runs it with Debian's python3 before the virtual environment exists.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

SYSCTL_DIR = Path("/proc/sys")
SYSCTL_CONF = Path("/etc/sysctl.d/60-orchestrrl.conf")
# TCP congestion controls a host namespace may use (FabricSpec.host_tcp_cc; all three ship with Debian's kernel)
HOST_TCP_CCS = ("cubic", "bbr", "reno")
# net.core.wmem_default Open vSwitch's shared packet send socket needs (emulation/sendbuf.py says why)
OVS_SEND_BUFFER = 8 * 2**20


@dataclass(frozen=True)
class Setting:
    """One sysctl the testbed relies on. ``rule``: ``min`` (an integer floor), ``min-each`` (a floor for each
    field of a tuple such as tcp_rmem), ``contains`` (a space-separated list that must hold every word of
    ``want``; words the kernel does not offer are left out, see :func:`wanted`)."""

    key: str
    want: str
    rule: str
    why: str

    @property
    def path(self) -> Path:
        return SYSCTL_DIR / self.key.replace(".", "/")


SETTINGS: tuple[Setting, ...] = (
    Setting("net.ipv4.tcp_allowed_congestion_control", " ".join(HOST_TCP_CCS), "contains",
            "the builder sets FabricSpec.host_tcp_cc inside every host's namespace, and a namespace other than "
            "the root one may only choose an algorithm listed here (a fresh machine lists 'reno bbr')"),
    Setting("net.core.wmem_default", str(OVS_SEND_BUFFER), "min",
            "Open vSwitch's userspace datapath sends every packet through one socket sized from this when "
            "vswitchd starts; smaller, it drops packets where flows converge on a shaped port (emulation/sendbuf.py)"),
    Setting("net.core.wmem_max", str(16 * 2**20), "min",
            "the ceiling of any socket's send buffer: at least the datapath's; Mininet's fixLimits value"),
    Setting("net.core.rmem_max", str(16 * 2**20), "min",
            "the ceiling of any socket's receive buffer (Mininet's fixLimits value; the builder gives the "
            "datapath's packet sockets 8 MiB)"),
    Setting("net.core.netdev_max_backlog", "5000", "min",
            "packets a veth hands to the stack queue here per core while the core is busy (Mininet's "
            "fixLimits value; some images boot with 1000)"),
    Setting("net.ipv4.tcp_rmem", "10240 87380 16777216", "min-each",
            "TCP's receive buffer (min, default, max), copied into every host's namespace (Mininet's fixLimits "
            "value)"),
    Setting("net.ipv4.tcp_wmem", "10240 87380 16777216", "min-each",
            "TCP's send buffer (min, default, max), copied into every host's namespace (Mininet's fixLimits "
            "value; some images boot capped at 4 MiB)"),
)


def by_key(key: str) -> Setting:
    for s in SETTINGS:
        if s.key == key:
            return s
    raise KeyError(key)


def read(setting: Setting) -> str | None:
    """The kernel's current value (words joined by one space), None when it cannot be read."""
    try:
        return " ".join(setting.path.read_text().split())
    except OSError:
        return None


def available_tcp_ccs() -> list[str]:
    try:
        return (SYSCTL_DIR / "net/ipv4/tcp_available_congestion_control").read_text().split()
    except OSError:
        return []


def wanted(setting: Setting, current: str | None) -> str | None:
    """The value the setting should have given the ``current`` one: None when ``current`` already meets it.
    For ``contains``, only words the kernel offers are added (a module it lacks is reported, not written)."""
    cur = current or ""
    if setting.rule == "min":
        try:
            return None if int(cur.split()[0]) >= int(setting.want) else setting.want
        except (ValueError, IndexError):
            return setting.want
    if setting.rule == "min-each":
        want = [int(x) for x in setting.want.split()]
        try:
            have = [int(x) for x in cur.split()]
        except ValueError:
            have = []
        if len(have) != len(want):
            return setting.want
        new = [max(a, b) for a, b in zip(have, want)]
        return None if new == have else " ".join(map(str, new))
    if setting.rule == "contains":
        have = cur.split()
        offered = set(available_tcp_ccs()) if setting.key.endswith("congestion_control") else None
        add = [w for w in setting.want.split() if w not in have and (offered is None or w in offered)]
        return " ".join(have + add) if add else None
    raise ValueError(f"unknown rule {setting.rule!r}")


def missing(setting: Setting, current: str | None) -> list[str]:
    """Words of a ``contains`` setting the kernel does not even offer (its module is absent)."""
    if setting.rule != "contains" or not setting.key.endswith("congestion_control"):
        return []
    offered = set(available_tcp_ccs())
    return [w for w in setting.want.split() if w not in (current or "").split() and w not in offered]


def write(setting: Setting, value: str) -> None:
    """Set the kernel's value now (root). OSError when the kernel refuses."""
    setting.path.write_text(value + "\n")


def check() -> list[tuple[Setting, bool, str]]:
    """(setting, ok, what was found) for every setting: what ``orchestrrl doctor`` prints."""
    out = []
    for s in SETTINGS:
        cur = read(s)
        if cur is None:
            out.append((s, False, f"{s.key} cannot be read"))
            continue
        need = wanted(s, cur)
        absent = missing(s, cur)
        if need is None and not absent:
            out.append((s, True, f"{s.key} = {cur}"))
        else:
            target = need or cur
            extra = f" (the kernel lacks {', '.join(absent)}: modprobe tcp_<name>)" if absent else ""
            out.append((s, False, f"{s.key} = {cur}, needs {target}: {s.why}{extra}"))
    return out


def ensure_tcp_cc_allowed(cc: str) -> str | None:
    """Make sure a host namespace may choose congestion control ``cc`` (it must be available already): add it to
    the root namespace's allowed list when it is not there. Returns the old list when it changed it, None when
    nothing needed changing. OSError when the kernel refuses (not root)."""
    s = by_key("net.ipv4.tcp_allowed_congestion_control")
    cur = read(s) or ""
    if cc in cur.split():
        return None
    write(s, " ".join(cur.split() + [cc]))
    return cur


def apply(log=print) -> int:
    """Raise every setting that falls short (root), and write them to :data:`SYSCTL_CONF` so a reboot keeps
    them. Returns the number of settings the kernel refused."""
    refused = 0
    lines = ["# orchestrrl (scripts/provision.sh, emulation/machine.py): the root namespace's settings the testbed needs"]
    for s in SETTINGS:
        cur = read(s)
        new = wanted(s, cur)
        if new is not None:
            try:
                write(s, new)
                log(f"{s.key}: {cur} -> {new}")
            except OSError as e:
                log(f"{s.key}: cannot set {new!r}: {e}")
                refused += 1
        final = read(s) or new or s.want
        lines.append(f"# {s.why}")
        lines.append(f"{s.key} = {final}")
    try:
        SYSCTL_CONF.parent.mkdir(parents=True, exist_ok=True)
        SYSCTL_CONF.write_text("\n".join(lines) + "\n")
    except OSError as e:
        log(f"cannot write {SYSCTL_CONF}: {e}")
    return refused


def _main(argv: list[str]) -> int:
    if argv == ["apply"]:
        return 1 if apply(lambda m: print(f"[provision] {m}")) else 0
    if argv == ["check"]:
        bad = 0
        for s, ok, msg in check():
            print(f"[{'OK' if ok else 'FAIL':4}] {msg}")
            bad += not ok
        return 1 if bad else 0
    if argv == ["want-send-buffer"]:
        print(OVS_SEND_BUFFER)
        return 0
    print("usage: python3 -m emulation.machine apply|check|want-send-buffer", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
