"""`remove_tree`: a namespace-shaped folder of files goes away completely."""
from __future__ import annotations

import os

from kvhal.tiers.fs.remove import remove_tree


def test_remove_tree_removes_nested_folders_files_and_empty_folders(tmp_path):
    root = tmp_path / "root"
    for sub in ("ns/chunks/00", "ns/chunks/01", "ns/tmp", "ns/quarantine"):
        os.makedirs(root / sub)
    for i in range(40):
        (root / "ns" / "chunks" / f"{i % 2:02x}" / f"{i}.kv").write_bytes(b"x" * i)
    (root / "ns" / "config.json").write_text("{}")

    remove_tree(str(root), threads=4)

    assert os.listdir(tmp_path) == []


def test_remove_tree_of_a_missing_folder_does_nothing(tmp_path):
    remove_tree(str(tmp_path / "missing"))
    assert os.listdir(tmp_path) == []
