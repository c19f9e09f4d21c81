"""`orchestrrl clean`: undo what a crashed run left (recorded processes, every orl* bridge / interface / netns)."""
from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    p = subparsers.add_parser("clean", help="stop recorded processes and delete every orl* bridge/interface/netns",
                              description="Stops the processes the testbed recorded (checking their start time, "
                                          "never by name) and deletes every OVS bridge, network interface and "
                                          "named network namespace whose name starts with 'orl'.")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.epilog = "Exit status: 0 when everything was removed, 1 when something could not be."
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from emulation import registry

    rep = registry.clean(dry_run=args.dry_run)
    status = 1 if rep.errors else 0  # something could not be removed: say so to scripts and CI
    if args.json:
        print(json.dumps(rep.to_dict(), indent=1))
        return status
    verb = "would remove" if rep.dry_run else "removed"
    if rep.nothing_done and not rep.errors:
        print("nothing to clean")
    for p in rep.processes:
        print(f"process {p['pid']} ({p['role']}): {p['result']}  {' '.join(p['cmdline'])[:80]}")
    if rep.bridges:
        print(f"{verb} {len(rep.bridges)} OVS bridge(s): {' '.join(rep.bridges)}")
    if rep.interfaces:
        print(f"{verb} {len(rep.interfaces)} interface(s): {' '.join(rep.interfaces)}")
    if rep.netns:
        print(f"{verb} {len(rep.netns)} netns: {' '.join(rep.netns)}")
    if rep.records_removed:
        print(f"removed {rep.records_removed} registry record(s)")
    for e in rep.errors:
        print(f"error: {e}")
    return status
