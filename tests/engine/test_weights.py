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
    """A two-shard checkpoint folder with a config, a tokenizer and a nested file."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (folder / "model-00001-of-00002.safetensors").write_bytes(bytes(range(256)) * 64)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"\x01" * 5000)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "generation_config.json").write_text("{}")
    (folder / "README.md").write_text("card")
    (folder / "sub").mkdir()
    (folder / "sub" / "extra.bin").write_bytes(b"\x02" * 10)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "stale.safetensors").write_bytes(b"\x03" * 10)
    return folder


def test_names_every_file_that_computes_kv(checkpoint):
    assert fingerprint(str(checkpoint)).names == (
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "sub/extra.bin")


def test_identical_weights_elsewhere_have_the_same_fingerprint(checkpoint, tmp_path):
    copy = shutil.copytree(checkpoint, tmp_path / "elsewhere" / "other-name")
    assert fingerprint(str(copy)).digest == fingerprint(str(checkpoint)).digest


@pytest.mark.parametrize("name", ["model-00002-of-00002.safetensors", "config.json",
                                  "sub/extra.bin"])
def test_one_changed_byte_in_a_model_file_changes_it(checkpoint, name):
    before = fingerprint(str(checkpoint)).digest
    path = checkpoint / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert fingerprint(str(checkpoint)).digest != before


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json", "README.md",
                                  ".cache/stale.safetensors"])
def test_files_that_do_not_compute_kv_leave_it(checkpoint, name):
    before = fingerprint(str(checkpoint)).digest
    (checkpoint / name).write_bytes(b"changed")
    assert fingerprint(str(checkpoint)).digest == before


def test_a_renamed_shard_changes_it(checkpoint):
    before = fingerprint(str(checkpoint)).digest
    os.rename(checkpoint / "sub" / "extra.bin", checkpoint / "sub" / "other.bin")
    assert fingerprint(str(checkpoint)).digest != before


def test_a_change_in_a_later_piece_of_a_big_file_changes_it(checkpoint, monkeypatch):
    monkeypatch.setattr(weights, "PIECE_BYTES", 4096)     # the 16 KiB shard: 4 pieces
    path = checkpoint / "model-00001-of-00002.safetensors"
    before = fingerprint(str(checkpoint))
    data = bytearray(path.read_bytes())
    data[3 * 4096 + 7] ^= 0x80
    path.write_bytes(bytes(data))
    assert fingerprint(str(checkpoint)).digest != before.digest
    assert before.nbytes == 16384 + 5000 + 10 + len('{"hidden_size": 8}')


def test_pieces_and_threads_do_not_change_it(checkpoint, monkeypatch):
    whole = fingerprint(str(checkpoint)).digest
    monkeypatch.setattr(weights, "MAX_THREADS", 1)
    assert fingerprint(str(checkpoint)).digest == whole


def test_a_single_gguf_file(tmp_path):
    path = tmp_path / "model.Q4_K_M.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 100)
    found = fingerprint(str(path))
    assert found.names == ("model.Q4_K_M.gguf",) and found.nbytes == 104
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
