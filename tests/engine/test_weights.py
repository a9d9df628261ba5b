"""The weights' fingerprint (`kvhal.weights`): content, not place; every file that computes KV."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kvhal import weights
from kvhal.cli import main
from kvhal.weights import WeightsError, fingerprint


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A two-shard safetensors checkpoint with a config, a tokenizer, a model card, a trainer's
    files (top-level and a checkpoint subfolder) and a hidden cache folder."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (folder / "model-00001-of-00002.safetensors").write_bytes(bytes(range(256)) * 64)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"\x01" * 5000)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "generation_config.json").write_text("{}")
    (folder / "README.md").write_text("card")
    (folder / "training_args.bin").write_bytes(b"\x04" * 10)
    (folder / "checkpoint-500").mkdir()
    (folder / "checkpoint-500" / "optimizer.pt").write_bytes(b"\x02" * 10)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "stale.safetensors").write_bytes(b"\x03" * 10)
    return folder


def test_names_every_file_that_computes_kv(checkpoint):
    assert fingerprint(str(checkpoint)).names == (
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def test_identical_weights_elsewhere_have_the_same_fingerprint(checkpoint, tmp_path):
    copy = shutil.copytree(checkpoint, tmp_path / "elsewhere" / "other-name")
    assert fingerprint(str(copy)).digest == fingerprint(str(checkpoint)).digest


@pytest.mark.parametrize("name", ["model-00002-of-00002.safetensors", "config.json"])
def test_one_changed_byte_in_a_model_file_changes_it(checkpoint, name):
    before = fingerprint(str(checkpoint)).digest
    path = checkpoint / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert fingerprint(str(checkpoint)).digest != before


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json", "README.md",
                                  ".cache/stale.safetensors", "training_args.bin",
                                  "checkpoint-500/optimizer.pt"])
def test_files_that_do_not_compute_kv_leave_it(checkpoint, name):
    before = fingerprint(str(checkpoint)).digest
    (checkpoint / name).write_bytes(b"changed")
    assert fingerprint(str(checkpoint)).digest == before


def test_a_renamed_shard_changes_it(checkpoint):
    before = fingerprint(str(checkpoint)).digest
    os.rename(checkpoint / "model-00002-of-00002.safetensors", checkpoint / "model-2.safetensors")
    assert fingerprint(str(checkpoint)).digest != before


def test_bin_weights_only_without_safetensors_and_only_indexed_shards(checkpoint):
    (checkpoint / "pytorch_model.bin").write_bytes(b"\x05" * 10)
    assert "pytorch_model.bin" not in fingerprint(str(checkpoint)).names
    (checkpoint / "consolidated.safetensors").write_bytes(b"\x06" * 10)
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert fingerprint(str(checkpoint)).names == (
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json")
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "consolidated.safetensors", "model.safetensors.index.json"):
        os.unlink(checkpoint / name)
    assert fingerprint(str(checkpoint)).names == ("config.json", "pytorch_model.bin")


def test_a_broken_index_is_named(checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text("{")
    with pytest.raises(WeightsError, match=r"model\.safetensors\.index\.json: not a "
                       r"safetensors index \(JSONDecodeError\)"):
        fingerprint(str(checkpoint))


def test_a_change_in_a_later_piece_of_a_big_file_changes_it(checkpoint, monkeypatch):
    monkeypatch.setattr(weights, "PIECE_BYTES", 4096)     # the 16 KiB shard: 4 pieces
    path = checkpoint / "model-00001-of-00002.safetensors"
    before = fingerprint(str(checkpoint))
    data = bytearray(path.read_bytes())
    data[3 * 4096 + 7] ^= 0x80
    path.write_bytes(bytes(data))
    assert fingerprint(str(checkpoint)).digest != before.digest
    assert before.nbytes == 16384 + 5000 + len('{"hidden_size": 8}')


def test_pieces_and_threads_do_not_change_it(checkpoint, monkeypatch):
    whole = fingerprint(str(checkpoint)).digest
    monkeypatch.setattr(weights, "MAX_THREADS", 1)
    assert fingerprint(str(checkpoint)).digest == whole


def test_a_single_gguf_file_by_content_not_name(tmp_path):
    path = tmp_path / "model.Q4_K_M.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 100)
    found = fingerprint(str(path))
    assert found.names == ("model.Q4_K_M.gguf",) and found.nbytes == 104
    renamed = tmp_path / "elsewhere.gguf"
    renamed.write_bytes(path.read_bytes())
    assert fingerprint(str(renamed)).digest == found.digest
    path.write_bytes(b"GGUF" + b"\1" * 100)
    assert fingerprint(str(path)).digest != found.digest


def test_refuses_a_folder_without_weights_and_a_missing_one(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsError, match=f"{tmp_path}: no weight file"):
        fingerprint(str(tmp_path))
    with pytest.raises(WeightsError, match="nope: not a directory"):
        fingerprint(str(tmp_path / "nope"))


def test_cli_prints_the_digest(checkpoint, capsys):
    assert main(["fingerprint", str(checkpoint), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["digest"] == fingerprint(str(checkpoint)).digest
    assert report["names"][0] == "config.json"
