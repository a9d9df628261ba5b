"""The soak's fault schedule: which fault, when, on what; the same seed gives the same schedule.

Kinds (each one a real event, applied from a thread while requests run):
    kill_restart: SIGKILL a kvhal server's whole process tree, start it again on the same fs
        folder (its requests in flight fail; each is retried once after the restart).
    stop_cont: SIGSTOP a kvhal server's process tree for `STOP_S`, then SIGCONT.
    s3_restart: SIGKILL `moto_server` and start it again on the same port (its objects are
        gone: moto keeps them in memory).
    fs_truncate: truncate a chunk file of the fs tier to half its size.
    fs_overwrite: overwrite 4 KiB in the middle of a chunk file with random bytes.
    fs_full: fill the fs tier's (small) filesystem with a file for `FULL_S`, then delete it.
    obj_truncate / obj_overwrite: the same damage to an object in `moto_server`, read and
        written back directly (boto3, not through kvhal).
    mooncake_restart: SIGKILL `mooncake_master` and start it again on the same ports (the
        pool's objects are gone; the servers' clients reconnect). Skipped without Mooncake.
    p2p_kill_mid_pull: a request goes to one server for a conversation whose KV the other
        server's host tier holds (it just served it), and that other server is SIGKILLed
        `PULL_KILL_S` after the request was sent, while the first may be pulling from it over
        p2p (a timing approximation: the pull's start is not observed), then restarted.
    tp2_sigterm: a third kvhal server at TP=2 (its own fs folder) answers one prompt and gets
        SIGTERM as its answer arrives; every chunk of the prompt must be on its disk once it
        exited (stores in flight at a clean shutdown are drained: `drain.py`). Runs on a
        thread of its own.
"""
from __future__ import annotations

import glob
import os
import random
from dataclasses import asdict, dataclass

KINDS = ("kill_restart", "stop_cont", "s3_restart", "fs_truncate", "fs_overwrite", "fs_full",
         "obj_truncate", "obj_overwrite", "mooncake_restart", "p2p_kill_mid_pull",
         "tp2_sigterm")
#: Seconds a stopped server stays stopped (above every tier's deadline used by the soak,
#: `fleet.TIER_TIMEOUT_S`).
STOP_S = 8.0
#: Seconds the fs tier's filesystem stays full.
FULL_S = 8.0
#: Seconds after the pulling request was sent that `p2p_kill_mid_pull` kills the peer.
PULL_KILL_S = 0.3
#: Kinds that take a server (0 or 1) as their target.
SERVER_KINDS = ("kill_restart", "stop_cont", "p2p_kill_mid_pull")


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault.

    Attributes:
        at_s: Seconds after the load started.
        kind: One of `KINDS`.
        target: The server index (0 or 1) for `SERVER_KINDS`, else 0.
        pick: A seeded number choosing the file for the fs kinds (an index modulo the files
            there at the time).
    """

    at_s: float
    kind: str
    target: int
    pick: int

    def to_json(self) -> dict:
        """The fault as a JSON-able dict."""
        return asdict(self)


def schedule(seed: int, seconds: float, kinds: tuple[str, ...] = KINDS,
             first_s: float = 20.0, gap_s: float = 25.0) -> list[Fault]:
    """Faults at seeded times over [first_s, seconds - gap_s): one every `gap_s` on average
    (uniform jitter of ±40%), kinds cycling through a seeded shuffle of `kinds` so every kind
    comes once before any comes twice.

    Raises:
        ValueError: an unknown kind (named).
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"fault kind {unknown[0]!r}: not one of {', '.join(KINDS)}")
    rng = random.Random(seed)
    out: list[Fault] = []
    t, cycle = first_s, []
    while t < seconds - gap_s and kinds:
        if not cycle:
            cycle = list(kinds)
            rng.shuffle(cycle)
        kind = cycle.pop()
        out.append(Fault(round(t, 3), kind, rng.randrange(2) if kind in SERVER_KINDS else 0,
                         rng.randrange(1 << 30)))
        t += gap_s * rng.uniform(0.6, 1.4)
    return out


def chunk_files(root: str) -> list[str]:
    """The fs tier's chunk files under `root`, sorted (so a seeded pick is reproducible)."""
    return sorted(glob.glob(os.path.join(root, "*", "chunks", "*", "*.kv")))


def damaged(data: bytes, fault: Fault) -> bytes:
    """`data` truncated to half (`*_truncate`) or with up to 4 KiB from its middle replaced by
    seeded random bytes (`*_overwrite`)."""
    half = len(data) // 2
    if fault.kind.endswith("_truncate"):
        return data[:half]
    junk = random.Random(fault.pick).randbytes(min(4096, len(data) - half))
    return data[:half] + junk + data[half + len(junk):]


def damage(root: str, fault: Fault) -> str | None:
    """Apply `fs_truncate` or `fs_overwrite` to the picked chunk file; its path (None: no
    chunk file, or it vanished meanwhile)."""
    files = chunk_files(root)
    if not files:
        return None
    path = files[fault.pick % len(files)]
    try:
        with open(path, "r+b") as f:
            new = damaged(f.read(), fault)
            f.seek(0)
            f.write(new)
            f.truncate(len(new))
    except OSError:
        return None
    return path


def s3_client(endpoint: str, keys: dict):
    """A boto3 S3 client of the server at `endpoint` (`keys`: {"access_key", "secret_key"})."""
    import boto3
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=keys["access_key"],
                        aws_secret_access_key=keys["secret_key"])


def object_names(endpoint: str, bucket: str, keys: dict) -> list[str]:
    """The names of the objects in `bucket` of an S3 server (first 1,000: one listing page),
    sorted (so a seeded pick is reproducible); `keys`: {"access_key", "secret_key"}."""
    page = s3_client(endpoint, keys).list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in page.get("Contents", []))


def damage_object(endpoint: str, bucket: str, keys: dict, fault: Fault) -> str | None:
    """Apply `obj_truncate` or `obj_overwrite` to the picked object (`damaged`, written back
    with a plain PUT, boto3); its name (None: no object, or it vanished meanwhile)."""
    import botocore.exceptions
    names = object_names(endpoint, bucket, keys)
    if not names:
        return None
    name = names[fault.pick % len(names)]
    client = s3_client(endpoint, keys)
    try:
        data = client.get_object(Bucket=bucket, Key=name)["Body"].read()
        client.put_object(Bucket=bucket, Key=name, Body=damaged(data, fault))
    except botocore.exceptions.ClientError:
        return None
    return name


def fill(folder: str) -> str | None:
    """Fill the filesystem of `folder` with one file (written until ENOSPC); its path, or
    None when even creating it failed (the filesystem is full already)."""
    path = os.path.join(folder, "soak-filler")
    block = b"\0" * (1 << 20)
    try:
        # unbuffered: a buffered file's close would flush what ENOSPC left and raise again
        f = open(path, "wb", buffering=0)
    except OSError:
        return None
    with f:
        try:
            while f.write(block):
                pass
        except OSError:
            pass
    return path
