"""The fs tier's names: chunk file names map back to keys, temp names are unique per writer."""
from __future__ import annotations

import os

from kvhal.keys import ChunkKey
from kvhal.tiers.fs.format import chunk_path, chunk_paths, key_from_name, temp_owner_pid

from .helpers import NAMESPACE

KEY = ChunkKey(NAMESPACE, 3, bytes(range(32)))


def test_chunk_names_map_back_to_keys():
    assert key_from_name(NAMESPACE, KEY.hex() + ".kv") == KEY
    assert key_from_name(NAMESPACE, KEY.hex() + ".tmp") is None
    assert key_from_name(NAMESPACE, "0003-zz.kv") is None


def test_temp_names_are_unique_and_carry_the_pid():
    paths = [chunk_paths("/ns", KEY) for _ in range(1000)]
    names = {os.path.basename(tmp) for _, _, tmp in paths}
    assert len(names) == 1000
    assert {temp_owner_pid(n) for n in names} == {os.getpid()}
    # next to the chunk file: the rename that publishes it stays inside one folder
    assert {(folder, os.path.dirname(tmp)) for folder, _, tmp in paths} == {
        (os.path.dirname(chunk_path("/ns", KEY)),) * 2}
    assert {final for _, final, _ in paths} == {chunk_path("/ns", KEY)}


def test_a_forked_child_draws_temp_names_of_its_own():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the child: report one temp name, exit
        os.write(write, os.path.basename(chunk_paths("/ns", KEY)[2]).encode())
        os._exit(0)
    os.close(write)
    child_name = os.read(read, 4096).decode()
    os.close(read)
    os.waitpid(pid, 0)
    parent_name = os.path.basename(chunk_paths("/ns", KEY)[2])
    assert temp_owner_pid(child_name) == pid
    assert child_name.split(".")[2] != parent_name.split(".")[2]   # other random bits
