"""Config validation names the key path; out-of-tree tiers and cache policies plug in."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings, strategies as st

from kvhal import plugins
from kvhal.config import ConfigError, build_tiers, parse_config
from kvhal.layout import Kind
from kvhal.tier import Lookup
from kvhal.tiers.memory import MemoryTier

from .rig import chunk_blocks, make_rig, synthetic_keys


def test_defaults():
    cfg = parse_config('{"cpu_bytes_to_use": 1073741824}')
    assert (cfg.spec_name, cfg.eviction_policy, cfg.offload_prompt_only, cfg.max_offload_tokens,
            cfg.state_slot_share, cfg.secondary_tiers, cfg.blocks_per_chunk_for(16)) == (
        "TieringOffloadingSpec", "lru", True, None, 0.5, (), 1)


def test_state_slot_share_applies_to_state_groups_only():
    cfg = parse_config({"cpu_bytes_to_use": 1, "state_slot_share": 0.125})
    kinds = [Kind.MAMBA, Kind.FULL, Kind.SLIDING_WINDOW, Kind.MLA]
    assert cfg.slot_shares(kinds) == (0.125, 1.0, 1.0, 1.0)
    assert parse_config({"cpu_bytes_to_use": 1, "state_slot_share": 1}).state_slot_share == 1.0


def test_block_size_in_tokens_resolves_to_blocks_per_chunk():
    assert parse_config({"cpu_bytes_to_use": 1, "block_size": 256}).blocks_per_chunk_for(16) == 16
    with pytest.raises(ConfigError, match="block_size: 250 tokens is not a multiple of the "
                                          "engine's block size 16"):
        parse_config({"cpu_bytes_to_use": 1, "block_size": 250}).blocks_per_chunk_for(16)


@pytest.mark.parametrize("config,message", [
    ({}, "cpu_bytes_to_use: required"),
    ({"cpu_bytes_to_use": "8GiB"}, "cpu_bytes_to_use: must be an integer ≥ 1, got '8GiB'"),
    ({"cpu_bytes_to_use": 1, "spec_name": "X"},
     "spec_name: 'X' is not accepted; accepted: CPUOffloadingSpec, TieringOffloadingSpec"),
    ({"cpu_bytes_to_use": 1, "blocks_per_chunk": 2, "block_size": 32},
     "block_size: give blocks_per_chunk or block_size, not both"),
    ({"cpu_bytes_to_use": 1, "eviction_policy": "fifo"},
     "eviction_policy: 'fifo' is not a registered cache policy; registered: lru, arc"),
    ({"cpu_bytes_to_use": 1, "max_offload_tokens": -1},
     "max_offload_tokens: must be an integer ≥ 0, got -1"),
    ({"cpu_bytes_to_use": 1, "offload_prompt_only": "yes"},
     "offload_prompt_only: must be true or false, got 'yes'"),
    ({"cpu_bytes_to_use": 1, "cpu_bytes": 1}, "cpu_bytes: unknown key; accepted: spec_name"),
    *[({"cpu_bytes_to_use": 1, "state_slot_share": v}, "state_slot_share: must be a number in "
       f"(0, 1] (host slots of a state group per slot of an attention group), got {v!r}")
      for v in (0, 1.5, -0.5, float("nan"), float("inf"), "0.5", True, [0.5])],
    # an integer too big for a float (JSON 1000…0) raised OverflowError
    ('{"cpu_bytes_to_use": 1, "state_slot_share": 1%s}' % ("0" * 400),
     f"state_slot_share: must be a number in (0, 1] (host slots of a state group per slot of "
     f"an attention group), got {10 ** 400!r}"),
    *[({"cpu_bytes_to_use": 1, "model_identity": v}, "model_identity: must be a non-empty "
       f"string that changes whenever the weights change, got {v!r}") for v in ("", "  ", 7)],
    ({"cpu_bytes_to_use": 1, "secondary_tiers": {"type": "memory"}},
     "secondary_tiers: must be a list, got dict"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "memory"}, {"type": "nfs"}]},
     "secondary_tiers[1].type: 'nfs' is not a registered tier type; registered: memory"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{}]}, "secondary_tiers[0].type: required"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_errors_name_the_key_path(config, message):
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    assert str(err.value).startswith(message)


def test_invalid_json_is_a_config_error():
    with pytest.raises(ConfigError, match="<config>: not valid JSON"):
        parse_config("{cpu_bytes_to_use: 1}")


def test_a_tier_refusing_its_options_is_reported_under_its_entry():
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.max_bytes: must be a positive "
                                          "integer, got -5"):
        make_rig(tiers=[{"type": "memory", "max_bytes": -5}])


THROWAWAY_TIER = '''
"""An out-of-tree tier: a dict of bytes that completes every job at once."""
from kvhal.hookspecs import hookimpl
from kvhal.plugins import TierSpec
from kvhal.tier import JobResult, Lookup, SecondaryTier


class DictTier(SecondaryTier):
    name = "dict"

    def __init__(self, config, host, namespace):
        self.host, self.data, self.done = host, {}, []

    def lookup(self, key):
        return Lookup.HIT if key in self.data else Lookup.MISS

    def submit_store(self, job):
        self.data[job.key] = bytes(self.host[job.offset:job.offset + job.nbytes])
        self.done.append(JobResult(job.job_id, job.kind, job.key, True))

    def submit_load(self, job):
        self.host[job.offset:job.offset + job.nbytes] = self.data[job.key]
        self.done.append(JobResult(job.job_id, job.kind, job.key, True))

    def get_finished_jobs(self):
        out, self.done = self.done, []
        return out

    def drain(self, timeout_s=None):
        pass

    def close(self):
        self.data.clear()


@hookimpl
def kvhal_register_tiers():
    return [TierSpec("dict", DictTier)]
'''


@pytest.mark.parametrize("module_path", ["throwaway_tier", "throwaway_tier:DictTier"])
def test_out_of_tree_tier_loads_by_module_path(tmp_path, monkeypatch, module_path):
    (tmp_path / "throwaway_tier.py").write_text(THROWAWAY_TIER)
    monkeypatch.syspath_prepend(str(tmp_path))
    rig = make_rig(capacity=4, blocks_per_chunk=1, block_bytes=1024, num_blocks=8,
                   tiers=[{"type": "dict", "module_path": module_path}])
    try:
        keys = synthetic_keys(2)
        rig.dev[0:2] = [[7], [9]]
        rig.store(keys, chunk_blocks(0, 2, 1))
        rig.manager.poll()
        assert len(rig.manager.tiers[0].data) == 2
        rig.manager.clear()
        assert rig.manager.lookup(keys) == [Lookup.RETRY, Lookup.RETRY]
        assert rig.manager.lookup(keys) == [Lookup.HIT, Lookup.HIT]
        rig.load(keys, chunk_blocks(4, 2, 1))
        assert rig.dev[4:6, :3].tolist() == [[7, 7, 7], [9, 9, 9]]
    finally:
        rig.close()


def test_module_path_without_the_tier_names_what_it_found(tmp_path, monkeypatch):
    (tmp_path / "throwaway_tier.py").write_text(THROWAWAY_TIER)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.module_path: 'throwaway_tier' "
                                          r"registers no tier of type 'fs' .*\['dict'\]"):
        make_rig(tiers=[{"type": "fs", "module_path": "throwaway_tier"}])
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.module_path: cannot import "
                                          "'no_such_module'"):
        make_rig(tiers=[{"type": "x", "module_path": "no_such_module"}])



BROKEN_TIER_MODULES = {
    "raises_at_import": "raise RuntimeError('no licence server')\n",
    "bad_syntax": "def (:\n",
    "register_fails": "def kvhal_register_tiers():\n    raise KeyError('x')\n",
    "register_junk": "def kvhal_register_tiers():\n    return [1, 2]\nNOT_CALLABLE = 5\n",
    "factory_bugs": ("def no_args():\n    pass\n"
                     "def denied(config, host, namespace):\n"
                     "    raise PermissionError(13, 'Permission denied')\n"
                     "def leaky(config, host, namespace):\n"
                     "    raise RuntimeError('signature of ' + config['secret_key'] + ' refused')\n"
                     "def leaky_value(config, host, namespace):\n"
                     "    raise ValueError('secret_key: ' + config['secret_key'] + ' refused')\n"),
}


@pytest.mark.parametrize("module_path,message", [
    ("raises_at_import", r"secondary_tiers\[1\]\.module_path: cannot import 'raises_at_import': "
                         "RuntimeError: no licence server$"),
    ("bad_syntax", r"secondary_tiers\[1\]\.module_path: cannot import 'bad_syntax': SyntaxError"),
    ("register_fails", r"secondary_tiers\[1\]\.module_path: register_fails\.kvhal_register_tiers"
                       r"\(\) failed: KeyError: 'x'$"),
    ("register_junk", r"secondary_tiers\[1\]\.module_path: 'register_junk' registers no tier of "
                      r"type 'x' \(kvhal_register_tiers returned names \[None, None\]\)$"),
    ("register_junk:NOT_CALLABLE", r"secondary_tiers\[1\]\.module_path: 'register_junk' has no "
                                   "callable attribute 'NOT_CALLABLE'$"),
    ("factory_bugs:no_args", r"secondary_tiers\[1\]: building the 'x' tier failed: TypeError: "),
    ("factory_bugs:denied", r"secondary_tiers\[1\]: building the 'x' tier failed: "
                            r"PermissionError: \[Errno 13\] Permission denied$"),
    (":", r"secondary_tiers\[1\]\.module_path: cannot import '': ValueError"),
    ("..relative", r"secondary_tiers\[1\]\.module_path: cannot import '\.\.relative': TypeError"),
])
def test_a_broken_module_path_is_a_config_error_and_closes_built_tiers(tmp_path, monkeypatch,
                                                                        module_path, message):
    for name, text in BROKEN_TIER_MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    closed = []
    monkeypatch.setattr(MemoryTier, "close", lambda self: closed.append(self))
    cfg = parse_config({"cpu_bytes_to_use": 1, "secondary_tiers": [
        {"type": "memory"}, {"type": "x", "module_path": module_path}]})
    with pytest.raises(ConfigError, match=message):
        build_tiers(cfg, memoryview(bytearray(64)), bytes(16))
    assert len(closed) == 1


@pytest.mark.parametrize("factory", ["leaky", "leaky_value"])
def test_a_tier_error_quoting_a_secret_option_is_scrubbed(tmp_path, monkeypatch, factory):
    """An out-of-tree tier whose error quotes its secret option: the ConfigError (which
    reaches logs and reports) says "***" instead. Fails without `config._scrub`."""
    (tmp_path / "factory_bugs.py").write_text(BROKEN_TIER_MODULES["factory_bugs"])
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = parse_config({"cpu_bytes_to_use": 1, "secondary_tiers": [
        {"type": "x", "module_path": f"factory_bugs:{factory}",
         "secret_key": "wJalrXUtnFEMI/K7MDENG"}]})
    with pytest.raises(ConfigError) as err:
        build_tiers(cfg, memoryview(bytearray(64)), bytes(16))
    assert "wJalrXUtnFEMI" not in str(err.value) and "*** refused" in str(err.value)


@pytest.mark.parametrize("source,message", [
    ("[" * 100_000, "<config>: not valid JSON: nested too deeply"),
    ({"cpu_bytes_to_use": 1, "eviction_policy": ["lru"]},
     "eviction_policy: ['lru'] is not a registered cache policy; registered: lru, arc"),
    ({"cpu_bytes_to_use": 1, 7: "x", "z": 0}, "7: unknown key; accepted: spec_name"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "memory", "max_byte": 5}]},
     "secondary_tiers[0].max_byte: unknown key for the memory tier; accepted: max_bytes"),
])
def test_garbage_values_are_config_errors(source, message):
    with pytest.raises(ConfigError) as err:
        build_tiers(parse_config(source), memoryview(bytearray(64)), bytes(16))
    assert str(err.value).startswith(message)


THROWAWAY_POLICY = '''
"""An out-of-tree cache policy: evict the most recently inserted chunk first."""
from kvhal.hookspecs import hookimpl
from kvhal.plugins import PolicySpec


class NewestFirst:
    def __init__(self, capacity):
        self.order = []

    def insert(self, key):
        self.order.append(key)

    def touch(self, key):
        pass

    def remove(self, key):
        if key in self.order:
            self.order.remove(key)

    def evict(self, n, can_evict):
        out = [k for k in reversed(self.order) if can_evict(k)][:n]
        for k in out:
            self.order.remove(k)
        return out


@hookimpl
def kvhal_register_cache_policies():
    return [PolicySpec("newest", NewestFirst)]
'''

USE_POLICY = '''
from tests.engine.rig import chunk_blocks, make_rig, synthetic_keys
rig = make_rig(capacity=2, blocks_per_chunk=1, block_bytes=64, num_blocks=8, policy="newest")
a, b, c = synthetic_keys(3)
rig.store([a, b], chunk_blocks(0, 2, 1))
rig.store([c], chunk_blocks(2, 1, 1))
print([r.value for r in rig.manager.lookup([a])], [r.value for r in rig.manager.lookup([b])])
rig.close()
'''


def test_out_of_tree_cache_policy_arrives_by_entry_point(tmp_path):
    """A throwaway distribution on sys.path (dist-info + module) declares a `kvhal` entry
    point; a fresh process picks the policy up by name from the config."""
    site = tmp_path / "site"
    dist = site / "kvhal_newest_policy-0.0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvhal-newest-policy\n"
                                   "Version: 0.0.1\n")
    (dist / "entry_points.txt").write_text("[kvhal]\nnewest = kvhal_newest_policy\n")
    (site / "kvhal_newest_policy.py").write_text(THROWAWAY_POLICY)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), root]))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(USE_POLICY)], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == "['hit'] ['miss']"       # the newest (b) was evicted, not a


def test_registered_policy_is_listed_in_errors_and_usable(monkeypatch):
    import types
    module = types.ModuleType("inline_policy")
    exec(THROWAWAY_POLICY, module.__dict__)
    pm = plugins.plugin_manager()
    pm.register(module)
    try:
        assert set(plugins.cache_policies()) == {"newest", "lru", "arc"}
        assert parse_config({"cpu_bytes_to_use": 1, "eviction_policy": "newest"}
                            ).eviction_policy == "newest"
    finally:
        pm.unregister(module)
    assert sorted(plugins.cache_policies()) == ["arc", "lru"]


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 1 << 44), bpc=st.integers(1, 512),
       policy=st.sampled_from(["lru", "arc"]), cap=st.none() | st.integers(0, 1 << 20),
       prompt_only=st.booleans())
def test_valid_configs_round_trip(budget, bpc, policy, cap, prompt_only):
    cfg = parse_config({"cpu_bytes_to_use": budget, "blocks_per_chunk": bpc,
                        "eviction_policy": policy, "max_offload_tokens": cap,
                        "offload_prompt_only": prompt_only})
    assert (cfg.cpu_bytes_to_use, cfg.blocks_per_chunk_for(16), cfg.eviction_policy,
            cfg.max_offload_tokens, cfg.offload_prompt_only) == (budget, bpc, policy, cap,
                                                                 prompt_only)


@settings(max_examples=60, deadline=None)
@given(key=st.sampled_from(["cpu_bytes_to_use", "blocks_per_chunk", "block_size"]),
       value=st.integers(-(1 << 40), 0) | st.floats() | st.text(max_size=3) | st.booleans())
def test_bad_sizes_name_their_key(key, value):
    config = {"cpu_bytes_to_use": 1, key: value}
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    assert err.value.path == key
