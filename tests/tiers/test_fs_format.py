"""The fs tier's names: chunk file names map back to keys, temp names are unique per writer."""
from __future__ import annotations

import os

from kvhal.keys import ChunkKey
from kvhal.tiers.fs.format import chunk_path, key_from_name, temp_owner_pid, temp_path

from .helpers import NAMESPACE

KEY = ChunkKey(NAMESPACE, 3, bytes(range(32)))


def test_chunk_names_map_back_to_keys():
    assert key_from_name(NAMESPACE, KEY.hex() + ".kv") == KEY
    assert key_from_name(NAMESPACE, KEY.hex() + ".tmp") is None
    assert key_from_name(NAMESPACE, "0003-zz.kv") is None


def test_temp_names_are_unique_and_carry_the_pid():
    names = {os.path.basename(temp_path("/ns", KEY)) for _ in range(1000)}
    assert len(names) == 1000
    assert {temp_owner_pid(n) for n in names} == {os.getpid()}
    # next to the chunk file: the rename that publishes it stays inside one folder
    assert os.path.dirname(temp_path("/ns", KEY)) == os.path.dirname(chunk_path("/ns", KEY))
