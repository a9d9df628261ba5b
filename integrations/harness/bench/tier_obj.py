"""`kvhal bench tier --tier obj`: the raw S3 loops the obj tier is measured against.

Two raw loops at the tier's concurrency (`io_threads`) against the same bucket: obstore (the
tier's client, so the tier's ratios are against it) and boto3 (the client not chosen; kept in
the table because the choice was made on these figures). A raw PUT sends the chunk's bytes as
they are; a raw GET copies the body into the chunk's host slot (obstore) or `readinto`s it
(boto3), with no checks. Without a `store_config` in `--config`, the run starts a local
`moto_server` (`LocalS3Server`) on a free port; with one, it uses that bucket and deletes what
it wrote.
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

#: Bucket of the local server started for a run.
LOCAL_BUCKET = "kvhal-bench"


@contextlib.contextmanager
def bucket_config(config: dict) -> Iterator[dict]:
    """`config` with a `store_config`: the caller's, or that of a local moto_server started for
    the `with` block (credentials are throwaway values the local server accepts)."""
    if "store_config" in config:
        yield config
        return
    from kvhal.tiers.obj.local_server import LocalS3Server
    with LocalS3Server() as server:
        server.create_bucket(LOCAL_BUCKET)
        yield config | {"store_config": {"bucket": LOCAL_BUCKET,
                                         "endpoint_override": server.endpoint,
                                         "access_key": "bench", "secret_key": "bench"}}


class _RawS3Loop:
    """One raw client loop as a bench contender (`write(rep)`, `read(rep)`, `close()`)."""

    durability = "store"
    o_direct = False

    def __init__(self, name: str, put, get, deleter, host: memoryview, chunk: int, count: int,
                 threads: int, prefix: str) -> None:
        self.name, self._put, self._get, self._delete = name, put, get, deleter
        self.host, self.chunk, self.count = host, chunk, count
        self.threads = (threads, threads)
        self._pool = ThreadPoolExecutor(threads)
        self._prefix = f"{prefix}/bench-raw/{os.getpid()}-{name.split()[1]}".lstrip("/")
        self._names: list[str] = []

    def _map(self, fn, rep: int) -> list[str]:
        names = [f"{self._prefix}/{rep}/{i}" for i in range(self.count)]
        list(self._pool.map(
            lambda i: fn(names[i], self.host[i * self.chunk:(i + 1) * self.chunk]),
            range(self.count)))
        return names

    def write(self, rep: int) -> None:
        self._names += self._map(self._put, rep)

    def read(self, rep: int) -> None:
        self._map(self._get, rep)

    def close(self) -> None:
        self._pool.shutdown()
        self._delete(self._names)


def raw_contenders(config: dict, host: memoryview, chunk: int, count: int) -> list:
    """The obstore and boto3 loops for the obj tier of `config` (a validated-by-parse dict)."""
    import boto3
    import botocore.config
    import obstore

    from kvhal.tiers.obj.client import S3Client
    from kvhal.tiers.obj.config import parse_config
    cfg = parse_config(config)
    store = cfg.store
    client = S3Client(store, cfg.timeout_s, 2 * cfg.io_threads)

    def obstore_put(name: str, view: memoryview) -> None:
        obstore.put(client.obstore, name, view, use_multipart=False)

    def obstore_get(name: str, view: memoryview) -> None:
        view[:] = memoryview(obstore.get(client.obstore, name).bytes())

    boto = boto3.client(
        "s3", endpoint_url=store.endpoint, region_name=client.region,
        aws_access_key_id=store.access_key, aws_secret_access_key=store.secret_key,
        aws_session_token=store.session_token,
        config=botocore.config.Config(max_pool_connections=2 * cfg.io_threads,
                                      request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))

    def boto_put(name: str, view: memoryview) -> None:
        boto.put_object(Bucket=store.bucket, Key=name, Body=bytes(view))

    def boto_get(name: str, view: memoryview) -> None:
        body, done = boto.get_object(Bucket=store.bucket, Key=name)["Body"], 0
        while done < len(view) and (n := body._raw_stream.readinto(view[done:])):
            done += n
        body.close()

    return [_RawS3Loop(name, put, get, client.delete, host, chunk, count, cfg.io_threads,
                       cfg.prefix)
            for name, put, get in (("raw obstore", obstore_put, obstore_get),
                                   ("raw boto3", boto_put, boto_get))]
