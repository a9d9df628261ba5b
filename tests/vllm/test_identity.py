"""The namespace of a vLLM engine's chunks and the key scope of its adapters
(`integrations/vllm/identity.py`): what changes them and what does not."""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvhal.config import ConfigError, parse_config
from kvhal.integrations.vllm.geometry import Deployment
from kvhal.integrations.vllm.identity import AdapterIdentities, cache_namespace
from kvhal.keys import chunk_keys
from kvhal.weights import WeightsError

FS = [{"type": "fs", "root_dir": "/tmp/kvhal-identity-test"}]
DEP = Deployment((), 128, 1, 1, "bfloat16", "sha256", "vllm-none-hash")


def _folder(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 8}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def _vllm_config(model: Path | str, **model_fields) -> SimpleNamespace:
    fields = dict(model=str(model), revision=None, dtype="torch.bfloat16", quantization=None,
                  hf_overrides={}, served_model_name="prod") | model_fields
    return SimpleNamespace(model_config=SimpleNamespace(**fields),
                           load_config=SimpleNamespace(load_format="auto", download_dir=None))


def _namespace(model, tiers=FS, dep=DEP, **config) -> bytes:
    return cache_namespace(_vllm_config(model), dep, parse_config(
        {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": tiers, **config}))


def test_the_same_weights_elsewhere_and_under_other_names_share_a_namespace(tmp_path):
    a = _folder(tmp_path / "a", b"\1" * 64)
    copy = shutil.copytree(a, tmp_path / "b")
    assert _namespace(a) == _namespace(copy) == cache_namespace(
        _vllm_config(copy, served_model_name="other"), DEP,
        parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": FS}))


def test_other_weights_under_the_same_path_and_name_get_another(tmp_path):
    a = _folder(tmp_path / "a", b"\1" * 64)
    before = _namespace(a)
    (a / "model.safetensors").write_bytes(b"\2" * 64)
    assert _namespace(a) != before


@pytest.mark.parametrize("field,value", [("dtype", "torch.float16"), ("quantization", "fp8"),
                                         ("hf_overrides", {"rope_theta": 1e6})])
def test_engine_settings_that_change_the_kv_enter_it(tmp_path, field, value):
    a = _folder(tmp_path / "a", b"\1" * 64)
    config = parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": FS})
    assert (cache_namespace(_vllm_config(a, **{field: value}), DEP, config)
            != cache_namespace(_vllm_config(a), DEP, config))


def test_a_pinned_identity_reads_nothing_and_a_new_pin_bumps_it(tmp_path):
    missing = tmp_path / "streamed-from-elsewhere"
    assert _namespace(missing, model_identity="prod-2026-12") == _namespace(
        missing, model_identity="prod-2026-12")
    assert _namespace(missing, model_identity="prod-2026-12") != _namespace(
        missing, model_identity="prod-2026-13")


def test_pinning_the_printed_fingerprint_gives_the_unpinned_namespace(tmp_path):
    from kvhal.weights import fingerprint

    a = _folder(tmp_path / "a", b"\1" * 64)
    assert _namespace(a, model_identity=fingerprint(str(a)).digest) == _namespace(a)


def test_weights_kvhal_cannot_read_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^model_identity: kvhal cannot fingerprint the "
                       r"weights of model 'org/not-cached' \(org/not-cached: no local folder"):
        _namespace("org/not-cached")
    config = _vllm_config(_folder(tmp_path / "a", b"\1"))
    config.load_config.load_format = "runai_streamer"
    with pytest.raises(ConfigError, match="load_format 'runai_streamer' does not read"):
        cache_namespace(config, DEP, parse_config({"cpu_bytes_to_use": 1,
                                                   "secondary_tiers": FS}))


def test_without_secondary_tiers_nothing_is_read_and_the_namespace_is_the_process_own():
    assert _namespace("org/not-cached", tiers=[]) != _namespace("org/not-cached", tiers=[])


def test_private_block_hashes_make_the_namespace_the_process_own(tmp_path):
    a = _folder(tmp_path / "a", b"\1" * 64)
    private = Deployment((), 128, 1, 1, "bfloat16", "xxhash", None)
    assert _namespace(a, dep=private) != _namespace(a, dep=private)


def _lora(path: Path, lora_id: int = 1, name: str = "ad", **fields) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=lora_id, lora_path=str(path), **fields)


def test_an_adapter_is_known_by_its_content(tmp_path):
    one = _folder(tmp_path / "one", b"\1" * 32)
    copy = shutil.copytree(one, tmp_path / "copy")
    other = _folder(tmp_path / "other", b"\2" * 32)
    ids = AdapterIdentities()
    assert ids.of(None) is None
    assert ids.of(_lora(one)) == ids.of(_lora(copy, 2, "b")) != ids.of(_lora(other, 3))


def test_an_adapter_is_read_once_per_id_and_again_when_vllm_reloads_it(tmp_path):
    one = _folder(tmp_path / "one", b"\1" * 32)
    ids = AdapterIdentities()
    first = ids.of(_lora(one))
    (one / "model.safetensors").write_bytes(b"\2" * 32)     # rewritten while the engine runs
    assert ids.of(_lora(one)) == first                      # vLLM keeps the loaded weights
    assert ids.of(_lora(one, load_inplace=True)) != first   # ... until it reloads them


def test_an_adapter_not_on_disk_is_refused(tmp_path):
    with pytest.raises(WeightsError, match="org/adapter-not-downloaded: no local folder"):
        AdapterIdentities().of(_lora("org/adapter-not-downloaded"))


def test_adapter_keys_are_neither_the_base_models_nor_another_adapters():
    hashes = [bytes([i]) * 32 for i in range(4)]
    base = chunk_keys(hashes, 2, bytes(16))
    one, again = chunk_keys(hashes, 2, bytes(16), adapter=b"a1"), chunk_keys(
        hashes, 2, bytes(16), adapter=b"a1")
    other = chunk_keys(hashes, 2, bytes(16), adapter=b"a2")
    assert one == again
    assert not {k.block_hash for k in one} & {k.block_hash for k in base + other}
    assert [k.block_hash for k in base] == [hashes[1], hashes[3]]
