"""`KVHalConnector` against the connector API of the overlaid vLLM release's own source.

Runs on every claimed release, 0.34 included (its connector base imports on a CPU). Fails when
the release adds an abstract method kvhal lacks, or when kvhal overrides a method with another
parameter list than the release's base (checked once by adding a parameter to
`KVHalConnector.take_events` and by removing `wait_for_save`: both fail here).
"""
from __future__ import annotations

import inspect

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1 import base

from kvhal.integrations.vllm.connector import KVHalConnector

BASES = (base.KVConnectorBase_V1, base.SupportsHMA)


def _overrides() -> list[tuple[str, type]]:
    """(name, base class) of every base method or property KVHalConnector defines itself."""
    return [(name, b) for name in vars(KVHalConnector) if not name.startswith("_")
            for b in BASES if name in vars(b)]


def _params(sig: inspect.Signature) -> list[tuple]:
    """A signature as vLLM calls it: names, kinds and defaults (annotations differ freely)."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_no_abstract_method_is_left():
    assert not inspect.isabstract(KVHalConnector)
    assert KVHalConnector.__abstractmethods__ == frozenset()


def test_kvhal_overrides_the_methods_it_routes():
    names = {name for name, _ in _overrides()}
    # The hooks every step of both roles goes through, and the hybrid (SupportsHMA) one.
    assert {"register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
            "wait_for_save", "get_finished", "get_num_new_matched_tokens",
            "update_state_after_alloc", "build_connector_meta", "request_finished",
            "request_finished_all_groups", "supports_sleep_mode"} <= names


@pytest.mark.parametrize("name,owner", _overrides(), ids=lambda v: getattr(v, "__name__", v))
def test_override_has_the_base_signature(name, owner):
    mine, theirs = inspect.getattr_static(KVHalConnector, name), vars(owner)[name]
    assert type(mine) is type(theirs)   # property, classmethod, staticmethod or function
    if isinstance(theirs, property):
        return
    assert _params(inspect.signature(getattr(KVHalConnector, name))) == \
        _params(inspect.signature(getattr(owner, name)))


def test_an_idle_engine_core_wakes_as_kvhal_wakes_it():
    """`integrations/vllm/wake.py` puts vLLM's `WAKEUP` sentinel on `EngineCoreProc.input_queue`,
    found on the call stack while the connector is built: the release must have the sentinel,
    ignore it in its dispatch, and make the queue before the scheduler (and with it the
    connector). Fails on a release that renamed any of these (kvhal's idle events would then
    wait for the next request again)."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc

    from kvhal.integrations.vllm.wake import engine_waker

    assert EngineCoreRequestType.WAKEUP
    init = inspect.getsource(EngineCoreProc.__init__)
    assert init.index("self.input_queue =") < init.index("super().__init__(")
    assert "WAKEUP" in inspect.getsource(EngineCoreProc._handle_client_request)
    assert engine_waker() is None          # not built inside an engine core: nobody to wake
