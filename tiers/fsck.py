"""`kvhal fsck DIR|s3://BUCKET/PREFIX [--repair]`: verify every chunk of an fs tier directory or
of an obj tier bucket (`--endpoint URL` for a non-AWS server; credentials from the AWS chain:
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws files, ...; never on the command line).

Prints counts and bytes of good chunk files, corrupt chunk files, orphaned temp files and
quarantined files, then one line per corrupt file. Exit code 1 if corrupt files were found and
not repaired; with `--repair`, corrupt files are moved to their namespace's `quarantine/` folder
(deleted from a bucket), orphaned temp files are deleted, and the exit code is 0 unless chunk
objects of a bucket could not be read (a failed GET: unverified, left alone, exit code 1). With `--json`, stdout holds the JSON
report alone and the summary line goes to stderr.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from kvhal.report import print_json, print_table
from kvhal.tiers.fs.check import CheckReport, check_dir


def _check_s3(args: argparse.Namespace) -> CheckReport:
    from kvhal.tier import TierError
    from kvhal.tiers.obj.check import check_bucket, parse_url
    from kvhal.tiers.obj.client import StoreFailure
    from kvhal.tiers.obj.config import parse_config
    bucket, prefix = parse_url(args.dir)
    store_config = {"bucket": bucket, "endpoint_override": args.endpoint or "",
                    "region": args.region or ""}
    try:
        store = parse_config({"store_config": store_config}).store
        return check_bucket(store, prefix, repair=args.repair)
    except StoreFailure as failure:
        raise ValueError(f"cannot list {store.describe()}: {failure}") from None
    except TierError as exc:  # "store_config.KEY: why" → "--endpoint: why" / "why"
        key, _, why = str(exc).partition(": ")
        flag = {"store_config.endpoint_override": "--endpoint: ",
                "store_config.region": "--region: "}.get(key, "")
        raise ValueError(flag + why) from None


def run(args: argparse.Namespace) -> int:
    """Check (and optionally repair) `args.dir`; returns the exit code."""
    s3 = args.dir.startswith("s3://")
    if not s3 and (args.endpoint or args.region):
        raise ValueError("--endpoint/--region: only for an s3://BUCKET/PREFIX target")
    report = _check_s3(args) if s3 else check_dir(args.dir, repair=args.repair)
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
                     ["other files (left alone)", report.other_files, ""]]
                    + ([["unreadable (not verified)", report.unreadable, ""]] if s3 else []))
        for path, reason in report.problems:
            print(f"corrupt: {path}: {reason}")
    summary = sys.stderr if args.json else sys.stdout  # --json: stdout is the JSON alone
    if report.corrupt and not args.repair:
        print(f"kvhal fsck: {report.corrupt} corrupt chunk file(s); run with --repair to "
              f"{'delete' if s3 else 'quarantine'} them", file=summary)
        return 1
    if args.repair and (report.corrupt or report.orphaned_temps):
        print(f"kvhal fsck: {'deleted' if s3 else 'quarantined'} {report.corrupt} corrupt "
              f"chunk file(s), removed "
              f"{report.orphaned_temps} orphaned temp file(s)", file=summary)
    if report.unreadable:
        print(f"kvhal fsck: {report.unreadable} chunk object(s) could not be read (not "
              "verified, left alone); run again", file=summary)
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal fsck`."""
    p = sub.add_parser("fsck", help="verify (and repair) an fs tier directory or obj bucket")
    p.add_argument("dir", help="the fs tier's root_dir, or s3://BUCKET/PREFIX of an obj tier")
    p.add_argument("--endpoint", default=None,
                   help="s3:// only: S3-compatible server, e.g. http://127.0.0.1:9000 "
                        "(default: AWS S3)")
    p.add_argument("--region", default=None, help="s3:// only: region (default: AWS chain)")
    p.add_argument("--repair", action="store_true",
                   help="quarantine corrupt chunk files and delete orphaned temp files (s3://: "
                        "delete corrupt objects)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
