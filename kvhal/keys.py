"""Block hashes, chunk keys and namespaces (DESIGN §4): what names a chunk in every tier.

Block hashes chain over token ids exactly as vLLM computes them, so KV events and keys match the
engine's (source: vLLM `vllm/v1/core/kv_cache_utils.py::hash_block_tokens` and
`init_none_hash`, `vllm/utils/hashing.py`, read at vLLM 0.32/0.33):

    h_0 = H((NONE_HASH, tuple(tokens_0), extra_keys_0))
    h_i = H((h_{i-1},  tuple(tokens_i), extra_keys_i))

- H is one of (each returns the digest bytes of the serialised 3-tuple):
  `sha256`      = SHA-256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))   (32 bytes)
  `sha256_cbor` = SHA-256(cbor2.dumps(obj, canonical=True))                      (32 bytes)
  `xxhash`      = XXH3-128(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))  (16 bytes)
  `xxhash_cbor` = XXH3-128(cbor2.dumps(obj, canonical=True))                     (16 bytes)
- token ids are Python ints (a numpy int pickles differently, so they are converted);
  `extra_keys` is None or a tuple (LoRA name, multimodal hashes, cache salt on block 0).
- NONE_HASH = H(seed), seed a *string* (vLLM `resolve_none_hash_seed`): PYTHONHASHSEED if set;
  otherwise "vllm-none-hash" for the cryptographic sha256 forms (so independent processes agree
  by default) and 32 random bytes per process for the xxhash forms (their keys can never be
  shared then). `resolve_hash_seed` applies the same rule.
- Only full blocks are hashed (a partial last block has no hash).

A chunk key is `(namespace, group, hash of the chunk's last block)`. The namespace digest covers
everything that makes two caches incompatible (the identity of the weights, KV dtype, canonical
format, tokens per chunk, hash function and seed, tenant salt), so caches that must not mix
never share keys. A request computed with a LoRA adapter has keys of its own: its block hashes
are scoped by the adapter's identity (`chunk_keys(adapter=...)`), because vLLM hashes an adapter
by name and path only, which an adapter rewritten in place keeps.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import xxhash as _xxhash

#: Bytes of a namespace digest.
NAMESPACE_BYTES = 16
_MAX_HASH_BYTES = 64


class KeyFormatError(ValueError):
    """A key or its serialised form is malformed; the message names the field."""


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """The key of one chunk.

    Attributes:
        namespace: 16-byte namespace digest.
        group: KV cache group index (vLLM's group id; 0 for single-group models), 0..65535.
        block_hash: Hash of the chunk's last block (32 bytes for sha256, 8 for xxhash, ...).
    """

    namespace: bytes
    group: int
    block_hash: bytes

    def __post_init__(self) -> None:
        if len(self.namespace) != NAMESPACE_BYTES:
            raise KeyFormatError(f"namespace must be {NAMESPACE_BYTES} bytes, got "
                            f"{len(self.namespace)}")
        if not 0 <= self.group <= 0xFFFF:
            raise KeyFormatError(f"group must be in 0..65535, got {self.group}")
        if not 1 <= len(self.block_hash) <= _MAX_HASH_BYTES:
            raise KeyFormatError(f"block_hash must be 1..{_MAX_HASH_BYTES} bytes, got "
                            f"{len(self.block_hash)}")

    def to_bytes(self) -> bytes:
        """Serialise as namespace(16) ‖ group(2, big-endian) ‖ len(1) ‖ block_hash."""
        return (self.namespace + self.group.to_bytes(2, "big")
                + bytes([len(self.block_hash)]) + self.block_hash)

    @classmethod
    def from_bytes(cls, data: bytes) -> "ChunkKey":
        """Inverse of `to_bytes`.

        Raises:
            KeyFormatError: the bytes are truncated or have trailing garbage.
        """
        if len(data) < NAMESPACE_BYTES + 3:
            raise KeyFormatError(f"serialised chunk key too short: {len(data)} bytes")
        n = data[NAMESPACE_BYTES + 2]
        if len(data) != NAMESPACE_BYTES + 3 + n:
            raise KeyFormatError(f"serialised chunk key length {len(data)} does not match its "
                            f"hash length {n}")
        return cls(data[:NAMESPACE_BYTES], int.from_bytes(data[NAMESPACE_BYTES:NAMESPACE_BYTES + 2],
                                                          "big"), data[NAMESPACE_BYTES + 3:])

    def __hash__(self) -> int:
        # bytes cache their hash, so this costs two lookups, not a tuple build (hot path).
        return hash(self.block_hash) ^ self.group

    def hex(self) -> str:
        """A filesystem/URL-safe name: `<group>-<block_hash hex>` (namespace is the folder)."""
        return f"{self.group:04x}-{self.block_hash.hex()}"


#: Hash function names, as vLLM spells them (`--prefix-caching-hash-algo`).
HASH_FUNCTIONS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

#: The env var whose string value seeds NONE_HASH (vLLM `init_none_hash`).
HASH_SEED_ENV = "PYTHONHASHSEED"
#: vLLM's NONE_HASH seed for sha256/sha256_cbor when PYTHONHASHSEED is unset (vLLM 0.32
#: `kv_cache_utils.DEFAULT_NONE_HASH_SEED`).
DEFAULT_HASH_SEED = "vllm-none-hash"
#: Hash functions vLLM seeds randomly per process when PYTHONHASHSEED is unset (vLLM 0.32
#: `kv_cache_utils._NON_CRYPTO_HASH_FUNCTIONS`: not collision resistant, so the seed stays secret).
PER_PROCESS_SEED_HASHES = frozenset({"xxhash", "xxhash_cbor"})


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    import cbor2  # only the *_cbor hash functions need it
    return cbor2.dumps(obj, canonical=True)


_HASHERS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda obj: hashlib.sha256(_pickled(obj)).digest(),
    "sha256_cbor": lambda obj: hashlib.sha256(_cbor(obj)).digest(),
    "xxhash": lambda obj: _xxhash.xxh3_128_digest(_pickled(obj)),
    "xxhash_cbor": lambda obj: _xxhash.xxh3_128_digest(_cbor(obj)),
}


def hash_function(name: str) -> Callable[[Any], bytes]:
    """The hash function vLLM registers under `name` (see the module docstring).

    Returns:
        A callable taking any picklable (or CBOR-encodable for `*_cbor`) object and returning
        its digest: 32 bytes for sha256*, 16 bytes for xxhash*.

    Raises:
        KeyFormatError: `name` is not one of `HASH_FUNCTIONS`.
    """
    try:
        return _HASHERS[name]
    except KeyError:
        raise KeyFormatError(f"hash function {name!r} is unknown; accepted: "
                             f"{', '.join(HASH_FUNCTIONS)}") from None


def resolve_hash_seed(hash_name: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The seed vLLM derives NONE_HASH from (vLLM 0.32 `resolve_none_hash_seed`).

    Args:
        hash_name: One of `HASH_FUNCTIONS`.
        environ: Where PYTHONHASHSEED is read (default: this process's environment).

    Returns:
        PYTHONHASHSEED if set; else `DEFAULT_HASH_SEED` for sha256/sha256_cbor; else None: vLLM
        picks random bytes per process for the xxhash forms, which no one can reproduce.

    Raises:
        KeyFormatError: unknown hash name.
    """
    hash_function(hash_name)
    seed = environ.get(HASH_SEED_ENV)
    if seed is not None:
        return seed
    return None if hash_name in PER_PROCESS_SEED_HASHES else DEFAULT_HASH_SEED


def none_hash(hash_name: str, seed: str | None = None) -> bytes:
    """The parent hash of a prefix's first block (vLLM's NONE_HASH).

    Args:
        hash_name: One of `HASH_FUNCTIONS`.
        seed: The seed string; None resolves it as vLLM does (`resolve_hash_seed`). vLLM hashes
            this *string*.

    Returns:
        `hash_function(hash_name)(seed)`.

    Raises:
        KeyFormatError: unknown hash name, or no seed given for an xxhash form while
            PYTHONHASHSEED is unset (vLLM then uses random bytes no one can reproduce).
    """
    fn = hash_function(hash_name)
    seed = resolve_hash_seed(hash_name) if seed is None else seed
    if seed is None:
        raise KeyFormatError(f"no hash seed for {hash_name}: pass seed= or set {HASH_SEED_ENV} "
                             "(vLLM uses random bytes then, so no other instance could share "
                             "the cache)")
    return fn(seed)


def hash_block_tokens(hash_fn: Callable[[Any], bytes], parent: bytes | None,
                      token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None, *,
                      root: bytes) -> bytes:
    """Hash one full block given its parent's hash (vLLM `hash_block_tokens`).

    Args:
        hash_fn: From `hash_function`.
        parent: Hash of the previous block; None or b"" for the first block (then `root`).
        token_ids: The block's token ids (ints); numpy integers are converted to int.
        extra_keys: None or a tuple of extra keys (LoRA name, mm hashes, cache salt).
        root: NONE_HASH, from `none_hash`.

    Returns:
        The block hash bytes.
    """
    return hash_fn((parent or root, tuple(int(t) for t in token_ids), extra_keys))


def block_hashes(token_ids: Sequence[int], block_size: int, hash_fn: Callable[[Any], bytes], *,
                 root: bytes, parent: bytes | None = None,
                 extra_keys: Sequence[tuple[Any, ...] | None] | None = None) -> list[bytes]:
    """Hashes of every full block of `token_ids` (a partial last block gets none).

    Args:
        token_ids: Token ids, length n (ints).
        block_size: Tokens per block (> 0).
        hash_fn: From `hash_function`.
        root: NONE_HASH, from `none_hash`.
        parent: Hash of the block before `token_ids[0]` (continuing a chain), or None.
        extra_keys: Per-block extra keys (length ≥ n // block_size), or None for none.

    Returns:
        `n // block_size` hashes, in block order.

    Raises:
        KeyFormatError: block_size ≤ 0.
    """
    if block_size <= 0:
        raise KeyFormatError(f"block_size must be > 0, got {block_size}")
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        extra = extra_keys[i] if extra_keys is not None else None
        parent = hash_block_tokens(hash_fn, parent, token_ids[i * block_size:(i + 1) * block_size],
                                   extra, root=root)
        out.append(parent)
    return out


def chunk_keys(hashes: Sequence[bytes], blocks_per_chunk: int, namespace: bytes,
               group: int = 0, adapter: bytes | None = None) -> list[ChunkKey]:
    """Keys of every full chunk: chunk i is named by block `(i + 1) * blocks_per_chunk - 1`.

    Args:
        hashes: Block hashes of a prefix, in order (from `block_hashes` or vLLM's
            `request.block_hashes`).
        blocks_per_chunk: Blocks per chunk (> 0).
        namespace: From `namespace_digest`.
        group: KV cache group index.
        adapter: Identity of the LoRA adapter the prefix was computed with (e.g. its content
            fingerprint, `kvhal.weights`), or None for the base model. With one, each key's
            hash is `BLAKE2b-256(adapter ‖ block hash)`: no key of the base model or of another
            adapter identity, and not the block hash itself (a KV event maps it back through
            the request's own block hashes).

    Returns:
        `len(hashes) // blocks_per_chunk` keys, in prefix order.

    Raises:
        KeyFormatError: blocks_per_chunk ≤ 0, an empty adapter identity, or a malformed
            namespace/group/hash.
    """
    if blocks_per_chunk <= 0:
        raise KeyFormatError(f"blocks_per_chunk must be > 0, got {blocks_per_chunk}")
    last = hashes[blocks_per_chunk - 1::blocks_per_chunk]
    if adapter is not None:
        if not adapter:
            raise KeyFormatError("adapter identity must not be empty")
        last = [hashlib.blake2b(adapter + h, digest_size=32).digest() for h in last]
    return [ChunkKey(namespace, group, h) for h in last]


def namespace_digest(*, weights: str, kv_dtype: str, format_id: str, tokens_per_chunk: int,
                     hash_name: str, hash_seed: str, tenant_salt: str | None = None) -> bytes:
    """The 16-byte namespace of a cache: BLAKE2b-128 over the canonical JSON of every input.

    Two caches share keys only if every argument is equal. The JSON is
    `json.dumps({...}, sort_keys=True, separators=(",", ":"))` of the arguments by name, UTF-8.

    Args:
        weights: Identity of what computes the KV besides the token ids: a content fingerprint
            of the checkpoint (`kvhal.weights.fingerprint`) with the engine settings that
            change the KV of the same files (compute dtype, quantization, config
            overrides), or an operator's pinned identity. Never a model name or path alone:
            a rollout reuses those for other weights.
        kv_dtype: KV cache dtype name (e.g. "bfloat16", "fp8_e4m3").
        format_id: Canonical page format id (e.g. "kvhal-hnd-v1").
        tokens_per_chunk: Tokens per chunk (> 0).
        hash_name: One of `HASH_FUNCTIONS`.
        hash_seed: The NONE_HASH seed string.
        tenant_salt: Optional per-tenant salt; None means no tenant separation.

    Raises:
        KeyFormatError: tokens_per_chunk ≤ 0, an empty `weights`, or an unknown hash name.
    """
    hash_function(hash_name)
    if tokens_per_chunk <= 0:
        raise KeyFormatError(f"tokens_per_chunk must be > 0, got {tokens_per_chunk}")
    if not weights:
        raise KeyFormatError("weights: the identity of the weights must not be empty")
    fields = {"weights": weights, "kv_dtype": kv_dtype, "format_id": format_id,
              "tokens_per_chunk": tokens_per_chunk, "hash_name": hash_name,
              "hash_seed": hash_seed, "tenant_salt": tenant_salt}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=NAMESPACE_BYTES).digest()
