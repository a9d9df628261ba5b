"""Fixtures and helpers of the tier conformance suite (`--kvhal-tier NAME`, repeatable).

`tier_name` is parametrized over the selected harnesses (`tier_harness.py`); `open_tier`
builds the tier under test on a pinned host region from the cpu backend and closes it after
the test; `shared_store` runs the harness's services (p2p: a keeper peer process) for tests
whose chunks must outlive the instance that stored them.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Callable, Iterable

import numpy as np
import pytest

from kvhal import plugins
from kvhal.hal import host_array
from kvhal.keys import ChunkKey
from kvhal.tier import JobKind, JobResult, Lookup, SecondaryTier, TierJob

from .tier_harness import TierHarness, harnesses

#: Bytes of the host region every test gets.
HOST_BYTES = 16 << 20
#: Seconds a test waits for a tier's jobs (generous; a healthy tier needs milliseconds).
DRAIN_TIMEOUT_S = 60.0


def selected_tiers(config: pytest.Config) -> list[str]:
    """Tier names chosen with `--kvhal-tier`, else every harness whose tier is registered.

    Raises:
        pytest.UsageError: a chosen name has no harness.
    """
    chosen = config.getoption("--kvhal-tier")
    known = harnesses()
    if chosen:
        unknown = [n for n in chosen if n not in known]
        if unknown:
            raise pytest.UsageError(f"--kvhal-tier {unknown[0]}: no conformance harness; "
                                    f"known: {', '.join(known)}")
        return chosen
    registered = plugins.tiers()
    return [n for n in known if n in registered]


@pytest.fixture
def harness(tier_name: str) -> TierHarness:
    """The harness of the tier under test, or a skip naming the extra its tier needs."""
    harness = harnesses()[tier_name]
    missing = harness.missing_extra()
    if missing:
        pytest.skip(missing)
    return harness


@pytest.fixture(scope="session")
def cpu_backend():
    """The cpu reference backend (its pinned allocations are page-aligned)."""
    return plugins.backend_spec("cpu").cls()


@pytest.fixture
def host(cpu_backend) -> Iterable[memoryview]:
    """A zeroed `HOST_BYTES` pinned host region as a writable memoryview."""
    alloc = cpu_backend.alloc_pinned(HOST_BYTES)
    array = host_array(alloc)
    array[:] = 0
    yield memoryview(array)
    cpu_backend.free(alloc)


@pytest.fixture
def namespace(tier_name: str) -> bytes:
    """A 16-byte namespace digest."""
    return hashlib.sha256(b"kvhal conformance " + tier_name.encode()).digest()[:16]


@pytest.fixture
def shared_store(harness, tmp_path, namespace) -> Iterable[str]:
    """This test's store folder, for a test whose chunks must outlive the instance or process
    that stored them: `harness.services` run (p2p: the keeper peer process) until teardown."""
    services = harness.services or (lambda tmp, ns: contextlib.nullcontext())
    with services(str(tmp_path), namespace):
        yield str(tmp_path)


@pytest.fixture
def open_tier(harness, tmp_path, namespace) -> Iterable[Callable[..., SecondaryTier]]:
    """`open_tier(host, max_bytes=64 MiB)` → a new tier instance on this test's store folder
    (every call shares the folder, so a second call is a restart); all closed at teardown."""
    opened: list[SecondaryTier] = []

    def make(host: memoryview, max_bytes: int = 64 << 20) -> SecondaryTier:
        opened.append(harness.make(harness.config(str(tmp_path), max_bytes), host, namespace))
        return opened[-1]

    yield make
    for tier in opened:
        tier.close()


def lookup(tier: SecondaryTier, key: ChunkKey, timeout_s: float = 10.0) -> Lookup:
    """`tier.lookup(key)` once it is no longer RETRY (a tier checking its store in the
    background answers RETRY first, e.g. mooncake), or RETRY after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    answer = tier.lookup(key)
    while answer is Lookup.RETRY and time.monotonic() < deadline:
        time.sleep(0.005)
        answer = tier.lookup(key)
    return answer


def chunk_key(namespace: bytes, i: int, group: int = 0) -> ChunkKey:
    """The i-th test key: a sha256 block hash like vLLM's default."""
    return ChunkKey(namespace, group, hashlib.sha256(i.to_bytes(8, "little")).digest())


def payload(seed: int, nbytes: int) -> np.ndarray:
    """Reproducible random uint8 bytes, shape (nbytes,)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def run_jobs(tier: SecondaryTier, jobs: list[TierJob]) -> dict[int, JobResult]:
    """Submit `jobs`, drain, and return the results by job id; asserts every job is reported
    exactly once and nothing else is."""
    for job in jobs:
        (tier.submit_store if job.kind is JobKind.STORE else tier.submit_load)(job)
    tier.drain(DRAIN_TIMEOUT_S)
    results = tier.get_finished_jobs()
    ids = [r.job_id for r in results]
    assert sorted(ids) == sorted(j.job_id for j in jobs), "each job must be reported once"
    assert tier.get_finished_jobs() == []
    return {r.job_id: r for r in results}


def store(tier, key: ChunkKey, offset: int, nbytes: int, job_id: int = 0) -> JobResult:
    """Run one store job and return its result."""
    return run_jobs(tier, [TierJob(job_id, JobKind.STORE, key, offset, nbytes)])[job_id]


def load(tier, key: ChunkKey, offset: int, nbytes: int, job_id: int = 0) -> JobResult:
    """Run one load job and return its result."""
    return run_jobs(tier, [TierJob(job_id, JobKind.LOAD, key, offset, nbytes)])[job_id]
