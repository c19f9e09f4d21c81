"""`orchestrrl clean [--all]`: undo what a crashed run left (what this installation's registry recorded)."""
from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    p = subparsers.add_parser("clean", help="stop recorded processes and delete recorded bridges/interfaces/netns/VMs",
                              description="Stops the processes this installation's registry recorded (checking "
                                          "their start time, never by name) and deletes the OVS bridges, network "
                                          "interfaces and named network namespaces it recorded, and the lab VM's "
                                          "libvirt domain, disks and network (make vm-test). Other names "
                                          "starting with 'orl' (another checkout's running fabric) are listed "
                                          "and left alone; --all deletes them too.")
    p.add_argument("--all", action="store_true", dest="sweep",
                   help="also delete every orl* bridge, interface, netns and libvirt domain/volume/network on "
                        "this machine, whoever made it")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.epilog = "Exit status: 0 when everything was removed, 1 when something could not be."
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from emulation import registry

    rep = registry.clean(dry_run=args.dry_run, sweep=args.sweep)
    status = 1 if rep.errors else 0  # something could not be removed: say so to scripts and CI
    if args.json:
        print(json.dumps(rep.to_dict(), indent=1))
        return status
    verb = "would remove" if rep.dry_run else "removed"
    if rep.nothing_done and not rep.errors:
        print("nothing to clean" + (" (dry run)" if rep.dry_run else ""))
    for p in rep.processes:
        print(f"process {p['pid']} ({p['role']}): {p['result']}  {' '.join(p['cmdline'])[:80]}")
    for what, names in (("VM(s)", rep.vms), ("VM disk(s)", rep.vm_disks), ("VM network(s)", rep.vm_networks),
                        ("OVS bridge(s)", rep.bridges), ("interface(s)", rep.interfaces), ("netns", rep.netns),
                        ("scratch folder(s)", rep.tmpdirs)):
        if names:
            print(f"{verb} {len(names)} {what}: {' '.join(names)}")
    if rep.records_removed:
        print(f"removed {rep.records_removed} registry record(s)")
    if rep.not_recorded and not rep.sweep:
        left = "; ".join(f"{k}: {' '.join(v)}" for k, v in rep.not_recorded.items())
        print(f"left alone (not recorded by this installation's registry {registry.state_dir()}): {left}")
        print("  `orchestrrl clean --all` removes them too (see what with --all --dry-run)")
    for e in rep.errors:
        print(f"error: {e}")
    return status
