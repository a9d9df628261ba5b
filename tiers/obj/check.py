"""Offline verification of an obj tier bucket (`kvhal fsck s3://BUCKET/PREFIX [--repair]`).

GETs every chunk object of every namespace under a prefix and checks header, key, size and
xxh3-128 payload checksum (`kvhal.tiers.chunk_format`), like `kvhal.tiers.fs.check` does for
a folder, and fills the same `CheckReport`. Repair deletes corrupt objects (content-addressed:
a live tier stores the chunk again); good objects, other objects and objects that could not
be read (counted as `unreadable`, reason = the failed request) are never touched. S3 has
no temp or quarantine objects: those counts stay 0.
"""
from __future__ import annotations

from kvhal.keys import ChunkKey

from ..chunk_format import (
    HEADER_BYTES,
    CorruptChunk,
    check_record_size,
    checked_header,
    verify_payload,
)
from ..fs.check import CheckReport
from ..prefix import normalize_prefix
from .client import S3Client, StoreFailure
from .config import DEFAULT_TIMEOUT_S, StoreConfig
from .names import key_from_object, namespace_of


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of "s3://bucket[/prefix]" (prefix without surrounding "/").

    Raises:
        ValueError: not an s3:// URL, or a bad bucket name or prefix.
    """
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}")
    return bucket, normalize_prefix(prefix)


def verify_object(client: S3Client, name: str, key: ChunkKey, namespace: bytes) -> None:
    """GET the object `name` and fully verify it as the chunk record of `key`: header, key,
    size, xxh3-128 payload checksum.

    Raises:
        StoreFailure: the GET failed (`errno_name` "ENOENT": no such object).
        CorruptChunk: any check fails.
    """
    body = client.get(name)
    header = checked_header(body[:HEADER_BYTES], key, namespace)
    check_record_size(header, len(body), None)
    verify_payload(header, body[HEADER_BYTES:HEADER_BYTES + header.payload_nbytes])


def check_bucket(store: StoreConfig, prefix: str, repair: bool = False) -> CheckReport:
    """Verify every namespace under `prefix` in `store`'s bucket (see module docstring).

    Raises:
        StoreFailure: a LIST failed (missing bucket, denied, unreachable); a failed GET of
            one object counts that object as unreadable with the failure as its reason.
    """
    client = S3Client(store, DEFAULT_TIMEOUT_S, 4)
    report = CheckReport(repaired=repair)
    for folder in client.list_dirs(prefix):
        namespace = namespace_of(prefix, folder + "/")
        if namespace is None:
            continue
        report.namespaces += 1
        ns_prefix = folder.rstrip("/") + "/"
        for name, size, _ in client.list(ns_prefix):
            key = key_from_object(ns_prefix, namespace, name)
            if key is None:
                report.other_files += 1
                continue
            try:
                verify_object(client, name, key, namespace)
            except StoreFailure as failure:
                if failure.errno_name != "ENOENT":  # else: evicted by a live tier meanwhile
                    report.unreadable += 1
                    report.problems.append((f"s3://{store.bucket}/{name}",
                                            f"unreadable ({failure})"))
                continue
            except CorruptChunk as exc:
                report.corrupt += 1
                report.corrupt_bytes += size
                report.problems.append((f"s3://{store.bucket}/{name}", str(exc)))
                if repair:
                    client.delete([name])
                continue
            report.good += 1
            report.good_bytes += size
    return report
