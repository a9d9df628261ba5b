"""Block hashes match vLLM's construction; chunk keys and namespaces separate caches."""
from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
import xxhash

from kvhal.keys import (HASH_FUNCTIONS, ChunkKey, KeyFormatError, block_hashes, chunk_keys,
                        hash_function, namespace_digest, none_hash,
                        resolve_hash_seed)

from .rig import namespace

SERIALISE = {"sha256": lambda o: hashlib.sha256(pickle.dumps(o, protocol=5)).digest(),
             "sha256_cbor": lambda o: hashlib.sha256(cbor2.dumps(o, canonical=True)).digest(),
             "xxhash": lambda o: xxhash.xxh3_128_digest(pickle.dumps(o, protocol=5)),
             "xxhash_cbor": lambda o: xxhash.xxh3_128_digest(cbor2.dumps(o, canonical=True))}


@pytest.mark.parametrize("name", HASH_FUNCTIONS)
def test_chain_is_vllms_construction(name):
    """h_i = H((h_{i-1} or H("42"), tuple(tokens_i), extra)), spelled out independently."""
    h = SERIALISE[name]
    root = h("42")
    tokens = list(range(40))
    b0 = h((root, tuple(range(16)), None))
    b1 = h((b0, tuple(range(16, 32)), ("lora-a",)))
    got = block_hashes(tokens, 16, hash_function(name), root=none_hash(name, "42"),
                       extra_keys=[None, ("lora-a",)])
    assert got == [b0, b1]
    assert len(b0) == (32 if name.startswith("sha256") else 16)


def test_numpy_token_ids_hash_like_python_ints():
    import numpy as np
    fn, root = hash_function("sha256"), none_hash("sha256", "0")
    assert block_hashes(np.arange(32), 16, fn, root=root) == block_hashes(list(range(32)), 16,
                                                                           fn, root=root)


def test_none_hash_reads_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert none_hash("sha256") == hashlib.sha256(pickle.dumps("7", protocol=5)).digest()
    assert none_hash("xxhash") == xxhash.xxh3_128_digest(pickle.dumps("7", protocol=5))


def test_unset_seed_is_vllms_fixed_default_for_sha256_only(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert none_hash("sha256") == hashlib.sha256(pickle.dumps("vllm-none-hash",
                                                              protocol=5)).digest()
    assert [resolve_hash_seed(n) for n in HASH_FUNCTIONS] == ["vllm-none-hash",
                                                            "vllm-none-hash", None, None]
    with pytest.raises(KeyFormatError, match="no hash seed for xxhash_cbor: .*PYTHONHASHSEED"):
        none_hash("xxhash_cbor")


@pytest.mark.parametrize("env", [{}, {"PYTHONHASHSEED": "3"}], ids=["unset", "set"])
@pytest.mark.parametrize("name", HASH_FUNCTIONS)
def test_seed_rule_is_vllms(name, env):
    """kvhal's seed rule against vLLM's own `resolve_none_hash_seed` (where vLLM is installed)."""
    kv_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils",
                                   reason="vllm is not installed in this environment")
    from vllm.utils.hashing import get_hash_fn_by_name
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTHONHASHSEED", raising=False)
        for k, v in env.items():
            mp.setenv(k, v)
        theirs = kv_utils.resolve_none_hash_seed(get_hash_fn_by_name(name))
        ours = resolve_hash_seed(name)
    # vLLM's per-process seed is 32 random bytes in hex; kvhal says it cannot know it
    assert ours == theirs if ours is not None else len(theirs) == 64


def test_unknown_hash_function_lists_accepted():
    with pytest.raises(KeyFormatError, match="accepted: sha256, sha256_cbor, xxhash, xxhash_cbor"):
        hash_function("md5")


def test_same_as_vllm_functions():
    """Compare with vLLM's own `hash_block_tokens` (runs where vLLM is installed)."""
    kv_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils",
                                   reason="vllm is not installed in this environment")
    from vllm.utils.hashing import get_hash_fn_by_name
    tokens = list(range(1000, 1064))
    for name in HASH_FUNCTIONS:
        vfn = get_hash_fn_by_name(name)
        root = vfn("5")
        kv_utils.NONE_HASH = root
        want, parent = [], None
        for i in range(4):
            parent = kv_utils.hash_block_tokens(vfn, parent, tokens[i * 16:(i + 1) * 16], None)
            want.append(bytes(parent))
        assert block_hashes(tokens, 16, hash_function(name), root=none_hash(name, "5")) == want


def test_partial_block_has_no_hash():
    fn, root = hash_function("sha256"), none_hash("sha256", "0")
    assert [len(block_hashes(list(range(n)), 16, fn, root=root)) for n in (0, 1, 15, 16, 17, 47)] \
        == [0, 0, 0, 1, 1, 2]


def test_chunk_key_is_last_block_of_each_full_chunk():
    hashes = [bytes([i]) * 32 for i in range(7)]
    ns = namespace()
    assert chunk_keys(hashes, 3, ns, group=2) == [ChunkKey(ns, 2, hashes[2]),
                                                   ChunkKey(ns, 2, hashes[5])]


@pytest.mark.parametrize("field,value", [("kv_dtype", "fp8_e4m3"), ("weights", "xxh3-128:other"),
                                         ("tenant_salt", "tenant-b"),
                                         ("format_id", "other-v1"), ("tokens_per_chunk", 512),
                                         ("hash_name", "xxhash"), ("hash_seed", "1")])
def test_namespace_covers_every_field(field, value):
    assert namespace(**{field: value}) != namespace()
    assert len(namespace()) == 16


def test_namespace_is_stable():
    """Pinned value: a change to the digest construction would orphan every stored cache."""
    assert namespace_digest(weights="w", kv_dtype="bfloat16",
                            format_id="kvhal-hnd-v1", tokens_per_chunk=256, hash_name="sha256",
                            hash_seed="0").hex() == hashlib.blake2b(
        b'{"format_id":"kvhal-hnd-v1","hash_name":"sha256","hash_seed":"0","kv_dtype":"bfloat16",'
        b'"tenant_salt":null,"tokens_per_chunk":256,"weights":"w"}',
        digest_size=16).hexdigest()


def test_chunk_key_hash_and_equality_include_namespace():
    a, b = ChunkKey(namespace(), 0, b"x" * 8), ChunkKey(namespace(weights="other"), 0, b"x" * 8)
    assert a != b and len({a, b}) == 2
    assert ChunkKey.from_bytes(a.to_bytes()) == a
