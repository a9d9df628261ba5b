"""`kvhal fsck DIR [--repair]`: verify every chunk file of an fs tier directory.

Prints counts and bytes of good chunk files, corrupt chunk files, orphaned temp files and
quarantined files, then one line per corrupt file. Exit code 1 if corrupt files were found and
not repaired; with `--repair`, corrupt files are moved to their namespace's `quarantine/` folder,
orphaned temp files are deleted, and the exit code is 0. With `--json`, stdout holds the JSON
report alone and the summary line goes to stderr.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from kvhal.report import print_json, print_table
from kvhal.tiers.fs.check import check_dir


def run(args: argparse.Namespace) -> int:
    """Check (and optionally repair) `args.dir`; returns the exit code."""
    report = check_dir(args.dir, repair=args.repair)
    if args.json:
        print_json(asdict(report))
    else:
        print_table(f"kvhal fsck {args.dir} — {report.namespaces} namespace(s)"
                    + (" — repaired" if args.repair else ""),
                    ["what", "files", "bytes"],
                    [["good chunks", report.good, report.good_bytes],
                     ["corrupt chunks", report.corrupt, report.corrupt_bytes],
                     ["orphaned temp files", report.orphaned_temps, report.orphaned_temp_bytes],
                     ["quarantined", report.quarantined, ""],
                     ["other files (left alone)", report.other_files, ""]])
        for path, reason in report.problems:
            print(f"corrupt: {path}: {reason}")
    summary = sys.stderr if args.json else sys.stdout  # --json: stdout is the JSON alone
    if report.corrupt and not args.repair:
        print(f"kvhal fsck: {report.corrupt} corrupt chunk file(s); run with --repair to "
              "quarantine them", file=summary)
        return 1
    if args.repair and (report.corrupt or report.orphaned_temps):
        print(f"kvhal fsck: quarantined {report.corrupt} corrupt chunk file(s), removed "
              f"{report.orphaned_temps} orphaned temp file(s)", file=summary)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal fsck`."""
    p = sub.add_parser("fsck", help="verify (and repair) an fs tier directory")
    p.add_argument("dir", help="the fs tier's root_dir")
    p.add_argument("--repair", action="store_true",
                   help="quarantine corrupt chunk files and delete orphaned temp files")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
