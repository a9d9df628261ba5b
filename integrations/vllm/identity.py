"""What computes a vLLM engine's KV, as kvhal names it: the namespace of the base model's
chunks and the key scope of each LoRA adapter (DESIGN §4; `kvhal.weights` for the fingerprint).

The namespace holds the content fingerprint of the checkpoint (not `served_model_name`, `model`
or `revision`: a rollout reuses them for other weights, and vLLM's own prefix cache, which
keys by name, dies with its process while kvhal's tiers do not), the engine settings that
change the KV of the same files (`dtype`, `quantization`, `hf_overrides`), the KV dtype,
canonical format, tokens per chunk and vLLM's block hash function and seed. vLLM 0.32 hashes a
LoRA adapter by name and path only, so a request with an adapter gets keys scoped by the
adapter's content fingerprint too (`kvhal.keys.chunk_keys(adapter=...)`).

Only the scheduler side computes these (the workers never name a chunk), and only with
secondary tiers: without them nothing outlives the process, and the namespace is the
process's own.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from kvhal.config import ConfigError, EngineConfig
from kvhal.keys import namespace_digest
from kvhal.layout import FORMAT_ID
from kvhal.weights import WeightsError, fingerprint

from .geometry import Deployment

logger = logging.getLogger(__name__)

#: Config key that pins the weights' identity (`kvhal.config`).
IDENTITY_KEY = "model_identity"


def cache_namespace(vllm_config: Any, dep: Deployment, config: EngineConfig) -> bytes:
    """The 16-byte namespace of the engine's chunks (module docstring).

    With no secondary tier, or with vLLM's block hashes private to this process
    (`Deployment.hash_seed` None), the namespace is this process's own and nothing is read.

    Raises:
        ConfigError: (key `model_identity`) the checkpoint is not in a local folder kvhal can
            read (weights streamed from elsewhere, a hub id not in the local cache) and no
            `model_identity` is set.
    """
    model = vllm_config.model_config
    private = not config.secondary_tiers or dep.hash_seed is None
    if private:
        weights = f"process:{os.urandom(16).hex()}"
    else:
        # a pinned identity stands for the fingerprint itself: pinning the digest
        # `kvhal fingerprint` prints gives the namespace an unpinned engine computes
        checkpoint = (config.model_identity if config.model_identity is not None
                      else _checkpoint_fingerprint(vllm_config))
        weights = json.dumps({"checkpoint": checkpoint, "dtype": str(model.dtype),
                              "quantization": model.quantization,
                              "hf_overrides": _overrides(model.hf_overrides)},
                             sort_keys=True, separators=(",", ":"))
    return namespace_digest(weights=weights, kv_dtype=dep.kv_dtype, format_id=FORMAT_ID,
                            tokens_per_chunk=dep.tokens_per_chunk, hash_name=dep.hash_name,
                            hash_seed=dep.hash_seed or weights)


def _checkpoint_fingerprint(vllm_config: Any) -> str:
    """The content fingerprint of the engine's checkpoint folder (or GGUF file), logged with
    its cost.

    Raises:
        ConfigError: (key `model_identity`) no local folder or file, or it cannot be read.
    """
    model = vllm_config.model_config
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    try:
        if load_format not in ("auto", "safetensors", "pt", "npcache", "gguf", "fastsafetensors"):
            raise WeightsError(f"load_format {load_format!r} does not read the weights from "
                               "a local folder")
        where = _local_checkpoint(str(model.model), model.revision,
                                  getattr(vllm_config.load_config, "download_dir", None))
        found = fingerprint(where)
    except WeightsError as exc:
        raise ConfigError(IDENTITY_KEY, f"kvhal cannot fingerprint the weights of model "
                          f"{model.model!r} ({exc}); set {IDENTITY_KEY} to a string that "
                          "changes whenever the weights change") from None
    logger.info("kvhal: weights of %s fingerprinted (%d files, %.2f GB in %.2f s): %s",
                where, len(found.names), found.nbytes / 1e9, found.seconds, found.digest)
    return found.digest


def _local_checkpoint(model: str, revision: str | None, download_dir: str | None) -> str:
    """The local folder (or GGUF file) of `model`: itself when it exists, else its snapshot in
    the Hugging Face cache (never downloaded here).

    Raises:
        WeightsError: neither exists.
    """
    if os.path.exists(model):
        return os.path.abspath(model)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 local_files_only=True)
    except Exception as exc:  # not a hub id, not cached, hub library errors of every kind
        raise WeightsError(f"{model}: no local folder and no cached snapshot "
                           f"({type(exc).__name__})") from None


def _overrides(overrides: Any) -> Any:
    """vLLM's `hf_overrides` as JSON-able data: a dict as is (values by `str` where not JSON),
    a callable by its qualified name."""
    if callable(overrides):
        return f"callable:{getattr(overrides, '__module__', '?')}." \
               f"{getattr(overrides, '__qualname__', repr(overrides))}"
    return json.loads(json.dumps(overrides or {}, sort_keys=True, default=str))


class AdapterIdentities:
    """The content identity of each LoRA adapter requests name, for their keys' scope.

    An adapter is fingerprinted the first time a request names its `lora_int_id` and path
    (vLLM's worker likewise loads it once per id), and again for a request that asks vLLM to
    reload it (`load_inplace`). A rewrite while the engine runs is seen at the next such
    reload or restart, as vLLM sees it.
    """

    def __init__(self) -> None:
        self._known: dict[tuple[int, str], bytes] = {}

    def of(self, lora_request: Any) -> bytes | None:
        """The identity of `lora_request`'s adapter (vLLM `LoRARequest`), or None for a
        request without one.

        Raises:
            WeightsError: the adapter is not in a local folder (a hub id vLLM has not
                downloaded yet) or cannot be read; the request must not reuse or store KV.
        """
        if lora_request is None:
            return None
        key = (int(lora_request.lora_int_id), str(lora_request.lora_path))
        if key not in self._known or getattr(lora_request, "load_inplace", False):
            folder = _local_checkpoint(os.path.expanduser(key[1]), None, None)
            found = fingerprint(folder)
            logger.info("kvhal: LoRA adapter %r (%s) fingerprinted in %.3f s: %s",
                        lora_request.lora_name, folder, found.seconds, found.digest)
            self._known[key] = found.digest.encode()
        return self._known[key]
