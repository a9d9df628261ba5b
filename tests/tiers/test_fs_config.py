"""fs tier config validation: every bad key is a TierError naming the key."""
from __future__ import annotations

import os

import pytest

from kvhal.tier import TierError
from kvhal.tiers.fs import FsTier, parse_config

from .helpers import NAMESPACE, host_region

BAD = [
    ({}, "root_dir: required"),
    ({"root_dir": ""}, "root_dir: required"),
    ({"root_dir": 5}, "root_dir: required"),
    ({"root_dir": "/x", "max_bytes": 0}, "max_bytes: must be a positive integer, got 0"),
    ({"root_dir": "/x", "max_bytes": True}, "max_bytes: must be a positive integer, got True"),
    ({"root_dir": "/x", "max_bytes": "1G"}, "max_bytes: must be a positive integer, got '1G'"),
    ({"root_dir": "/x", "n_read_threads": 0}, "n_read_threads: must be a positive integer"),
    ({"root_dir": "/x", "n_write_threads": -2}, "n_write_threads: must be a positive integer"),
    ({"root_dir": "/x", "o_direct": "yes"},
     "o_direct: must be \"adaptive\", \"small\", \"small-writes\", \"auto\", true or "
     "false; got 'yes'"),
    ({"root_dir": "/x", "o_direct": 1},
     "o_direct: must be \"adaptive\", \"small\", \"small-writes\", \"auto\", true or "
     "false; got 1"),
    ({"root_dir": "/x", "o_direct": 1.0},
     "o_direct: must be \"adaptive\", \"small\", \"small-writes\", \"auto\", true or "
     "false; got 1.0"),
    ({"root_dir": "/x", "o_direct": "small_writes"},
     "o_direct: must be \"adaptive\", \"small\", \"small-writes\", \"auto\", true or "
     "false; got 'small_writes'"),
    ({"root_dir": "/x", "refresh_interval_s": 0},
     "refresh_interval_s: must be a number of seconds in [0.001, 86400.0], got 0"),
    ({"root_dir": "/x", "refresh_interval_s": float("nan")},
     "refresh_interval_s: must be a number of seconds in [0.001, 86400.0], got nan"),
    ({"root_dir": "/x", "refresh_interval_s": float("inf")},
     "refresh_interval_s: must be a number of seconds in [0.001, 86400.0], got inf"),
    ({"root_dir": "/x", "refresh_interval_s": 1e-300},
     "refresh_interval_s: must be a number of seconds in [0.001, 86400.0], got 1e-300"),
    ({"root_dir": "/x\0y"},
     "root_dir: required, a non-empty path string without NUL; got '/x\\x00y'"),
    ({"root_dir": "kv-cache"},
     "root_dir: must be an absolute path, got 'kv-cache' (a relative one would depend on "
     "each process's working directory"),
    ({"root_dir": "~/kv"}, "root_dir: must be an absolute path, got '~/kv'"),
    ({"root_dir": "/x", "durability": "fsync"},
     "durability: must be one of 'process', 'power-loss'; got 'fsync'"),
    ({"root_dir": "/x", "durability": True},
     "durability: must be one of 'process', 'power-loss'; got True"),
    ({"root_dir": "/x", "rootdir": "/y"}, "rootdir: unknown key for the fs tier; accepted: "
                                          "durability, max_bytes, n_read_threads, "
                                          "n_write_threads, o_direct, recycle_files, "
                                          "refresh_interval_s, "
                                          "root_dir"),
]


@pytest.mark.parametrize("config,message", BAD, ids=[m.split(":")[0] + str(i)
                                                      for i, (_, m) in enumerate(BAD)])
def test_bad_config_names_the_key(config, message):
    with pytest.raises(TierError) as info:
        parse_config(config)
    assert str(info.value).startswith(message)


def test_defaults():
    cfg = parse_config({"type": "fs", "root_dir": "/data/kv"})
    assert (cfg.root_dir, cfg.max_bytes, cfg.n_read_threads, cfg.n_write_threads, cfg.o_direct,
            cfg.refresh_interval_s, cfg.durability) == ("/data/kv", None, 16, 16,
                                                        "adaptive", 1.0, "process")


def test_root_dir_that_cannot_be_created_is_a_tier_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    host, _ = host_region(4096)
    with pytest.raises(TierError) as info:
        FsTier({"root_dir": str(blocker / "kv")}, host, NAMESPACE)
    assert str(info.value) == (f"root_dir: cannot use {str(blocker / 'kv')!r} "
                               f"(ENOTDIR: Not a directory)")


def test_default_max_bytes_is_most_of_the_free_space(tmp_path):
    host, _ = host_region(4096)
    tier = FsTier({"root_dir": str(tmp_path)}, host, NAMESPACE)
    free = os.statvfs(tmp_path)
    tier.close()
    assert abs(tier.max_bytes - 0.9 * free.f_bavail * free.f_frsize) < 0.01 * tier.max_bytes


def test_relative_root_dir_is_refused_naming_the_key_path(tmp_path, monkeypatch):
    """Launched from a folder where the relative root_dir could be created: still refused,
    and nothing is created there."""
    from kvhal.config import ConfigError, build_tiers, parse_config as parse_engine_config

    monkeypatch.chdir(tmp_path)
    config = parse_engine_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [
        {"type": "fs", "root_dir": "kv-cache"}]})
    view, _ = host_region()
    with pytest.raises(ConfigError) as info:
        build_tiers(config, view, NAMESPACE)
    assert str(info.value).startswith("secondary_tiers[0].root_dir: must be an absolute path, "
                                      "got 'kv-cache'")
    assert os.listdir(tmp_path) == []
