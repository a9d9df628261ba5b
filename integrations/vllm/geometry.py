"""What kvhal needs to know about a vLLM deployment: KV cache groups, geometry, hashing.

Read from vLLM's `VllmConfig` and `KVCacheConfig` (vLLM 0.32: `ModelConfig.get_head_size`,
`get_total_num_kv_heads`; `KVCacheConfig.kv_cache_groups[i]` has `layer_names` and a
`kv_cache_spec`: `FullAttentionSpec`, `SlidingWindowSpec` (`sliding_window` tokens) or
`MLAAttentionSpec` (one latent row per token), each with `block_size`, `dtype`, `num_kv_heads`
(per rank), `head_size`, or `MambaSpec` (a recurrent state per block: `shapes`/`dtypes` of its
parts, `real_page_size_bytes` = the state's bytes, `page_size_bytes` = the page padded to the
attention page, `mamba_cache_mode`); `KVCacheConfig.hash_block_size` is the token span of one
entry of `request.block_hashes`). Both connector roles compute the same values from the same configs, so
the scheduler (which sizes the host region) and every worker (which maps its KV tensors into
it) agree without talking.

Group g of vLLM is kvhal's group g everywhere: `ChunkKey.group`, host pool g
(`kvhal.host.host_layout`), the chunk layout of `GroupInfo.spec`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvhal.config import ConfigError
from kvhal.keys import HASH_SEED_ENV, resolve_hash_seed
from kvhal.layout import Kind, KVCacheSpec, LayerGroup, LayoutError, chunk_layout


class UnsupportedModelError(ValueError):
    """The deployment's KV cache is of a kind the connector does not map (names what)."""


#: vLLM spec class name → the kvhal kind it maps to. Every other spec is refused by name.
#: vLLM 0.32's recurrent-state spec: Mamba, Mamba2, gated delta net (Qwen3-Next), linear
#: attention and short conv layers all register a `MambaSpec`.
SPEC_KINDS = {"FullAttentionSpec": Kind.FULL, "SlidingWindowSpec": Kind.SLIDING_WINDOW,
              "MLAAttentionSpec": Kind.MLA, "MambaSpec": Kind.MAMBA}

#: torch dtype names (as `str(torch.dtype)` without "torch.") → `kvhal.layout.ELEMENT_BYTES` keys.
_DTYPES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
           "float8_e4m3fnuz": "fp8_e4m3fnuz"}
#: vLLM `--kv-cache-dtype` values of a per-tensor fp8 KV cache → `ELEMENT_BYTES` keys. vLLM
#: keeps such a page as uint8 (`STR_DTYPE_TO_TORCH_DTYPE`), so its format comes from here;
#: "fp8" is e4m3 (vLLM's `CacheDType` documentation).
_FP8_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One of vLLM's KV cache groups as kvhal sees it.

    Attributes:
        group_id: vLLM's group index (= `ChunkKey.group` = host pool index).
        spec: The group's geometry at TP=1 (all KV heads), one `LayerGroup`.
        layer_names: vLLM's layer names of the group, in layer order.
        chunk_nbytes: Canonical bytes of one chunk of this group (all its layers).
    """

    group_id: int
    spec: KVCacheSpec
    layer_names: tuple[str, ...]
    chunk_nbytes: int

    @property
    def kind(self) -> Kind:
        """What the group's layers store."""
        return self.spec.groups[0].kind

    @property
    def sliding_window(self) -> int | None:
        """The attention window in tokens (sliding-window groups), else None."""
        return self.spec.groups[0].sliding_window


@dataclass(frozen=True, slots=True)
class Deployment:
    """One vLLM deployment as kvhal sees it.

    Attributes:
        groups: Every KV cache group, in vLLM's group order.
        block_size: vLLM's block size in tokens (128 on vLLM-CPU, 16 for its MLA backend),
            equal for every group.
        blocks_per_chunk: vLLM blocks per kvhal chunk.
        tp_size: Tensor-parallel size.
        kv_dtype: The KV bytes' element formats, "+"-joined over the groups (e.g.
            "bfloat16", "bfloat16+state[(3, 512) bfloat16]"): part of the namespace
            (`identity.cache_namespace`).
        hash_name: vLLM's `prefix_caching_hash_algo`.
        hash_seed: The NONE_HASH seed vLLM uses (`kvhal.keys.resolve_hash_seed`), or None when
            vLLM seeds randomly per process (xxhash forms without PYTHONHASHSEED): then the
            namespace is this process's own and no other process can share its keys.
        vllm_layout: The memory order vLLM resolved for its `[B, H, N, C]` KV views
            (`views.resolved_layout`, e.g. "LBHNC"; vLLM-CPU 0.32 and vLLM >= 0.33 resolve
            one), or None where it resolved none: the worker side then refuses attention.
    """

    groups: tuple[GroupInfo, ...]
    block_size: int
    blocks_per_chunk: int
    tp_size: int
    kv_dtype: str
    hash_name: str
    hash_seed: str | None
    vllm_layout: str | None = None

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens per chunk."""
        return self.block_size * self.blocks_per_chunk

    @property
    def async_loads(self) -> bool:
        """True with several KV cache groups: vLLM 0.32 cannot map a failed block id back to
        a request then (`Scheduler._handle_invalid_blocks` refuses block-level errors for more
        than one group), so every load runs asynchronously and a failed chunk cuts the request
        back on the scheduler side (`scheduler.loads` module docstring). Also True with a state
        group: a failed state leaves no shorter prefix to resume from, which only the
        scheduler side's cut-back handles."""
        return len(self.groups) > 1 or any(g.kind is Kind.MAMBA for g in self.groups)

    @property
    def chunk_nbytes(self) -> tuple[int, ...]:
        """Canonical bytes of one chunk, per group."""
        return tuple(g.chunk_nbytes for g in self.groups)


def _refuse(gi: int, group: Any, backend: str, reason: str) -> UnsupportedModelError:
    """A refusal of vLLM KV cache group `gi`, naming its first layer, its spec type, the
    attention backend of that layer (`views.backend_of`: "unknown" in vLLM's engine-core
    process, which holds no layers; its workers build the connector first and refuse with
    the name) and the page shape (`page_shape`)."""
    spec = group.kv_cache_spec
    first = group.layer_names[0] if group.layer_names else "?"
    return UnsupportedModelError(f"kv_cache_groups[{gi}] (layer {first}, "
                                 f"{type(spec).__name__}, backend {backend}, "
                                 f"{page_shape(spec)}): {reason}")


def page_shape(spec: Any) -> str:
    """One layer's page of a vLLM KV cache spec as this rank's `[B, H, N, C]` view holds it
    (`create_kv_cache_views`), for messages: "page [H, N, C] = [2, 128, 128] bfloat16" (C is
    K then V, or an MLA latent), "state (3, 512) bfloat16, (4, 64, 64) bfloat16" for a
    `MambaSpec`, else the spec's per-layer types or "page shape unknown"."""
    if getattr(spec, "shapes", None) is not None:
        return "state " + ", ".join(f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
                                    for shape, dtype in zip(spec.shapes, spec.dtypes))
    try:
        heads, tokens, head_size = spec.num_kv_heads, spec.block_size, spec.head_size
    except AttributeError:
        inner = getattr(spec, "kv_cache_specs", None)
        if isinstance(inner, Mapping):
            kinds = sorted({type(s).__name__ for s in inner.values()})
            return f"{len(inner)} per-layer specs ({', '.join(kinds)})"
        return "page shape unknown"
    cell = head_size if "MLA" in type(spec).__name__ else (
        head_size + (getattr(spec, "head_size_v", None) or head_size))
    dtype = str(getattr(spec, "dtype", "?")).removeprefix("torch.")
    return f"page [H, N, C] = [{heads}, {tokens}, {cell}] {dtype}"


def _fp8_format(gi: int, group: Any, backend: str, cache_dtype: str, page_dtype: str) -> str:
    """The `ELEMENT_BYTES` key of a per-tensor fp8 page of dtype `page_dtype` (vLLM's uint8,
    or a float8 dtype already mapped by `_DTYPES`) under `--kv-cache-dtype cache_dtype`.

    Only fp8, fp8_e4m3 and fp8_e5m2 are kept: vLLM's other per-tensor fp8 values hold scales
    kvhal cannot see (fp8_inc: Intel Neural Compressor's own; fp8_ds_mla: per-tile scales in
    the page). The format comes from `cache_dtype` and the platform: where vLLM's fp8 is
    e4m3fnuz (`Platform.is_fp8_fnuz`: ROCm on MI300, whose same bytes decode to half the OCP
    value), e4m3 pages are kept as "fp8_e4m3fnuz", a namespace of their own, so "fp8_e4m3"
    names OCP e4m3 bytes everywhere and MI300 instances share only with each other; e5m2 is
    refused there (vLLM's byte format of it on fnuz platforms is not pinned down here). A
    float8 page of another format than the one resolved is refused.
    """
    fmt = _FP8_CACHE_DTYPES.get(cache_dtype)
    if fmt is None:
        raise _refuse(gi, group, backend,
                      f"a per-tensor fp8 page under --kv-cache-dtype "
                      f"{cache_dtype!r}: its fp8 format is unknown or its scales "
                      "are not the layer's (kvhal keeps fp8, fp8_e4m3, fp8_e5m2)")
    if _platform_fp8_fnuz():
        if fmt != "fp8_e4m3":
            raise _refuse(gi, group, backend,
                          f"--kv-cache-dtype {cache_dtype!r} on a platform whose fp8 is "
                          "e4m3fnuz (ROCm on MI300): kvhal keeps e4m3fnuz there "
                          "(--kv-cache-dtype fp8 or fp8_e4m3)")
        fmt = "fp8_e4m3fnuz"
    if page_dtype not in ("uint8", fmt):
        raise _refuse(gi, group, backend,
                      f"page dtype {page_dtype} under --kv-cache-dtype "
                      f"{cache_dtype!r} ({fmt}): its fp8 format is ambiguous")
    return fmt


def _platform_fp8_fnuz() -> bool:
    """True where vLLM's platform stores fp8 as e4m3fnuz (`Platform.is_fp8_fnuz`)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - the connector runs inside vLLM
        return False
    return bool(current_platform.is_fp8_fnuz())


def group_spec(gi: int, group: Any, model: Any, cache_dtype: str = "auto",
               backend: str = "unknown") -> LayerGroup:
    """The kvhal `LayerGroup` (at TP=1) of vLLM KV cache group `gi`, of an engine whose
    `--kv-cache-dtype` is `cache_dtype`; `backend` is the attention backend of the group's
    first layer (`views.backend_of`), for refusals.

    A per-tensor fp8 page (`kv_quant_mode` FP8_PER_TENSOR, 1 byte per element) is kept as its
    bytes: its scales are one float per layer, outside the page, fixed by the checkpoint (the
    namespace holds the model) and checked to be 1.0 when the worker maps the pages
    (`check_kv_scales`).

    A `MambaSpec` group becomes a `Kind.MAMBA` group whose state is the layer's
    `real_page_size_bytes` (every state part, e.g. conv + recurrent, back to back as vLLM
    packs them at the start of each page; `MambaBase.bind_kv_cache`): the padding vLLM adds to
    make its page as large as an attention page is never copied or kept.

    Raises:
        UnsupportedModelError: a spec type kvhal does not map (chunked local attention, cross
            attention, ...), K and V of different head sizes, a quantised page other than
            per-tensor fp8 or a uint8 fp8 page under an unknown `cache_dtype`, a padded
            attention page, a state group outside vLLM's "align" cache mode or with
            speculative state blocks; the message names the group, its first layer, its
            spec type, the backend and the page shape (`page_shape`).
    """
    spec = group.kv_cache_spec
    name = type(spec).__name__
    kind = SPEC_KINDS.get(name)
    if kind is None:
        raise _refuse(gi, group, backend,
                      f"{name} is not supported; kvhal maps {', '.join(SPEC_KINDS)}")
    if kind is Kind.MAMBA:
        return _state_group(gi, group, backend)
    if getattr(spec, "page_size_padded", None) is not None:
        raise _refuse(gi, group, backend,
                      f"padded pages (page_size_padded={spec.page_size_padded}) "
                      "are not supported")
    quant = getattr(spec, "kv_quant_mode", None)
    quant = getattr(quant, "name", "NONE")
    if quant not in ("NONE", "FP8_PER_TENSOR"):
        raise _refuse(gi, group, backend,
                      f"quantised KV ({quant}, {spec.dtype}) is not supported: "
                      "its scales live outside the page, so a chunk could be read "
                      "back with another instance's scales; kvhal keeps per-tensor "
                      "fp8 (--kv-cache-dtype fp8, fp8_e4m3, fp8_e5m2)")
    if kind is not Kind.MLA and getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise _refuse(gi, group, backend,
                      f"K head size {spec.head_size} != V head size "
                      f"{spec.head_size_v}")
    if (getattr(spec, "num_head_slots", None) is not None
            or getattr(spec, "state_content_bytes", None) is not None):
        raise _refuse(gi, group, backend,
                      f"the attention backend packs its page its own way "
                      f"(num_head_slots={getattr(spec, 'num_head_slots', None)}, "
                      f"state_content_bytes={getattr(spec, 'state_content_bytes', None)}"
                      "; e.g. AITER's shuffled K and V tiles): kvhal maps one K ‖ V "
                      "row per (head, token)")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise _refuse(gi, group, backend,
                      f"tokens_per_state={spec.tokens_per_state}: pages that do not "
                      "hold one row per token are not supported")
    if getattr(spec, "extra_retained_tokens", 0):
        raise _refuse(gi, group, backend,
                      "extra_retained_tokens (multi-module speculative decoding) is "
                      "not supported")
    dtype = str(spec.dtype).removeprefix("torch.")
    dtype = _DTYPES.get(dtype, dtype)
    if quant == "FP8_PER_TENSOR":
        dtype = _fp8_format(gi, group, backend, cache_dtype, dtype)
    try:
        if kind is Kind.MLA:
            out = LayerGroup(kind, len(group.layer_names), 1, spec.head_size, dtype,
                             spec.block_size)
        else:
            out = LayerGroup(kind, len(group.layer_names), model.get_total_num_kv_heads(),
                             spec.head_size, dtype, spec.block_size,
                             sliding_window=getattr(spec, "sliding_window", None))
        out.validate()
    except LayoutError as exc:
        raise _refuse(gi, group, backend, str(exc)) from None
    return out


def _state_group(gi: int, group: Any, backend: str) -> LayerGroup:
    """`group_spec` of a `MambaSpec` group (see there)."""
    spec = group.kv_cache_spec
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise _refuse(gi, group, backend,
                      f"mamba_cache_mode {mode!r}: vLLM keeps no state at block "
                      "boundaries (prefix caching is off), so no prefix's state can "
                      "be stored or resumed; kvhal needs mamba_cache_mode 'align' "
                      "(--enable-prefix-caching)")
    if getattr(spec, "num_speculative_blocks", 0):
        raise _refuse(gi, group, backend,
                      f"num_speculative_blocks={spec.num_speculative_blocks} "
                      "(speculative decoding relocates state blocks) is not supported")
    try:
        dtype = str(spec.dtypes[0]).removeprefix("torch.")   # opaque; `state_format` keys it
        out = LayerGroup(Kind.MAMBA, len(group.layer_names), 1, 0, _DTYPES.get(dtype, dtype),
                         spec.block_size, state_bytes=int(spec.real_page_size_bytes))
        out.validate()
    except LayoutError as exc:
        raise _refuse(gi, group, backend, str(exc)) from None
    return out


def state_format(spec: Any) -> str:
    """The parts of one layer's state of a vLLM `MambaSpec`, e.g.
    "state[(3, 512) bfloat16, (4, 64, 64) bfloat16]": enters the namespace, so states of another
    shape or dtype never share keys."""
    parts = ", ".join(f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
                      for shape, dtype in zip(spec.shapes, spec.dtypes))
    return f"state[{parts}]"


def deployment(vllm_config: Any, kv_cache_config: Any, blocks_per_chunk: int) -> Deployment:
    """Describe the deployment from vLLM's configs.

    Raises:
        UnsupportedModelError: a group `group_spec` refuses, groups of different block sizes,
            a sliding window or a state group with blocks_per_chunk > 1, a state group at
            TP > 1, MLA on an engine without prefix caching (vLLM-CPU), or block hashes that
            do not span exactly one block.
    """
    from .views import backend_of, resolved_layout

    model = vllm_config.model_config
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise UnsupportedModelError("kv_cache_groups: the model has no KV cache")
    layers = getattr(getattr(vllm_config, "compilation_config", None),
                     "static_forward_context", None) or {}
    backends = [backend_of(layers.get(g.layer_names[0])) if g.layer_names else "unknown"
                for g in groups]
    specs = [group_spec(gi, g, model, vllm_config.cache_config.cache_dtype, backends[gi])
             for gi, g in enumerate(groups)]
    block_size = specs[0].block_size
    for gi, (group, spec, backend) in enumerate(zip(groups, specs, backends)):
        if spec.block_size != block_size:
            raise _refuse(gi, group, backend,
                          f"block size {spec.block_size} != group 0's {block_size} "
                          "(chunks of all groups must cover the same tokens)")
        if spec.kind is Kind.SLIDING_WINDOW and blocks_per_chunk != 1:
            raise _refuse(gi, group, backend,
                          f"a sliding window needs blocks_per_chunk 1, got "
                          f"{blocks_per_chunk} (the window's first block may sit "
                          "inside a chunk)")
        if spec.kind is Kind.MAMBA and blocks_per_chunk != 1:
            raise _refuse(gi, group, backend,
                          f"a state group needs blocks_per_chunk 1, got "
                          f"{blocks_per_chunk}: vLLM keeps a state only at the block "
                          "boundaries where a step ended (mamba_cache_mode 'align'), "
                          "which are rarely chunk boundaries of several blocks")
        tp = vllm_config.parallel_config.tensor_parallel_size
        if spec.kind is Kind.MAMBA and tp != 1:
            raise _refuse(gi, group, backend,
                          f"tensor_parallel_size {tp}: vLLM shards the state over "
                          "TP ranks in a layout kvhal has no TP-independent page for "
                          "(kvhal.layout.rank_share); state groups run at TP 1")
    if any(s.kind is Kind.MLA for s in specs) and not vllm_config.cache_config.enable_prefix_caching:
        gi = next(i for i, s in enumerate(specs) if s.kind is Kind.MLA)
        raise _refuse(gi, groups[gi], backends[gi],
                      "this engine runs MLA without prefix caching, so it cannot "
                      "compute on top of a reused prefix (vLLM-CPU 0.32 without "
                      "AMX: 'MLA is enabled on a non-GPU platform; forcing "
                      "chunked prefill and prefix caching to be disabled')")
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or block_size
    if hash_block != block_size:
        raise UnsupportedModelError(f"kv_cache_config.hash_block_size: {hash_block} tokens per "
                                    f"block hash, but blocks hold {block_size}; kvhal keys a "
                                    "chunk by the hash of its last block")
    dtypes = sorted({state_format(g.kv_cache_spec) if s.kind is Kind.MAMBA else s.dtype
                     for g, s in zip(groups, specs)})
    hash_name = vllm_config.cache_config.prefix_caching_hash_algo
    seed = resolve_hash_seed(hash_name)
    infos = []
    for gi, (group, spec) in enumerate(zip(groups, specs)):
        cache = KVCacheSpec((spec,))
        infos.append(GroupInfo(gi, cache, tuple(group.layer_names),
                               chunk_layout(cache, blocks_per_chunk).chunk_bytes))
    return Deployment(tuple(infos), block_size, blocks_per_chunk,
                      vllm_config.parallel_config.tensor_parallel_size, "+".join(dtypes),
                      hash_name,
                      seed, resolved_layout(kv_cache_config, vllm_config))


def check_kv_scales(dep: Deployment, layers: Mapping[str, Any]) -> None:
    """Refuse a per-tensor fp8 KV cache whose scales are not 1.0.

    Such a page holds K / scale and V / scale; the scales (`_k_scale_float`, `_v_scale_float`
    of vLLM's attention layer, 1.0 unless the checkpoint calibrated them) are not part of a
    chunk's key, so a chunk is only exchangeable between instances where they are 1.0. A
    layer whose scales cannot be read (missing from `layers`, without the attributes, not a
    number) is refused too: an unchecked scale is as unknown as a wrong one.

    Args:
        dep: The deployment.
        layers: vLLM's attention layers by layer name (the worker's
            `compilation_config.static_forward_context`).

    Raises:
        UnsupportedModelError: an fp8 group's layer has another scale, or one that cannot be
            read (names the group, the layer and the scales).
    """
    for group in dep.groups:
        if not group.spec.groups[0].dtype.startswith("fp8"):
            continue
        for name in group.layer_names:
            scales = _kv_scales(layers.get(name))
            if scales != (1.0, 1.0):
                shown = ("unknown (no such attention layer, or one without _k_scale_float)"
                         if scales is None else
                         f"k {scales[0]}, v {scales[1]} (from the checkpoint)")
                raise UnsupportedModelError(
                    f"kv_cache_groups[{group.group_id}] (layer {name}): fp8 KV scales "
                    f"{shown}: kvhal's keys do not hold scales, so it keeps fp8 KV only with "
                    "scales of 1.0")


def _kv_scales(layer: Any) -> tuple[Any, Any] | None:
    """(k, v) scale of a vLLM attention layer as floats, a value that is no number as its
    text (so it never equals 1.0); None without a layer or its `_k_scale_float`."""
    if layer is None or not hasattr(layer, "_k_scale_float"):
        return None
    out = []
    for attr in ("_k_scale_float", "_v_scale_float"):
        value = getattr(layer, attr, None)
        try:
            value = float(value)
        except (TypeError, ValueError, RuntimeError):  # None, a tensor of several values
            value = repr(value)
        out.append(value)
    return out[0], out[1]


def check_shareable(dep: Deployment, num_secondary_tiers: int) -> None:
    """Refuse secondary tiers when vLLM's block hashes are private to this process.

    Raises:
        kvhal.config.ConfigError: `secondary_tiers` is non-empty while vLLM seeds NONE_HASH
            randomly per process (an xxhash form and PYTHONHASHSEED unset): no restarted or
            other instance could ever hit what those tiers keep.
    """
    if num_secondary_tiers and dep.hash_seed is None:
        raise ConfigError("secondary_tiers", "vLLM's block hashes are random per process with "
                          f"--prefix-caching-hash-algo {dep.hash_name} and {HASH_SEED_ENV} "
                          "unset, so no restarted or other instance could reuse these tiers; "
                          f"set {HASH_SEED_ENV} to one value on every instance, or use sha256")


def check_vllm_hash_seed(dep: Deployment) -> None:
    """Verify that vLLM derived NONE_HASH from the seed kvhal keyed its namespace with (vLLM
    resolves it after the connector is built; call once requests arrive).

    Raises:
        RuntimeError: vLLM used another seed (a vLLM version whose rule kvhal does not know);
            names both seeds.
    """
    from vllm.v1.core import kv_cache_utils

    if dep.hash_seed is None:
        return
    used = kv_cache_utils.get_none_hash_seed()
    if used != dep.hash_seed:
        raise RuntimeError(f"vLLM seeded its block hashes with {used!r}, kvhal expected "
                           f"{dep.hash_seed!r}: kvhal's keys would not match vLLM's; set "
                           f"{HASH_SEED_ENV} explicitly")


def state_layout_name(tensor: Any) -> str:
    """The `kvhal.layout` layout of one of vLLM's state (Mamba) layers: the raw int8 page view
    `(num_blocks, 1, 1, state bytes)`, blocks a padded page apart
    (`vllm.v1.kv_cache_interface.create_kv_cache_views`, unpacked by `MambaBase.bind_kv_cache`):
    "mamba". Attention and MLA layers map through `views.view_layout`.

    Raises:
        UnsupportedModelError: another shape (names it).
    """
    shape = tuple(tensor.shape)
    if len(shape) >= 2 and all(n == 1 for n in shape[1:-1]):
        return "mamba"
    raise UnsupportedModelError(f"state tensor of shape {shape} on {tensor.device} is not "
                                "vLLM's (num_blocks, 1, 1, state bytes) page view")
