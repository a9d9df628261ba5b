"""`kvhal.procs.free_port`: ports for servers other processes bind, clear of the ports the
kernel hands out to connections."""
from __future__ import annotations

import random
import socket

from kvhal import procs


def test_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    """Fails when `free_port` binds port 0 (the kernel picks inside the ephemeral range, where
    an outgoing connection can take the port before the server binds it: CI's "Address
    already in use") or hands one process the same port twice."""
    floor = procs._ephemeral_floor()
    ports = [procs.free_port() for _ in range(50)]
    assert all(procs.PORT_FLOOR <= p < floor for p in ports), (floor, ports)
    assert len(set(ports)) == len(ports)


def test_a_seeded_random_does_not_make_two_processes_draw_alike():
    """Fails when `free_port` draws from `random`'s global state, which tests seed."""
    draws = []
    for _ in range(2):
        random.seed(7)
        procs._handed_out.clear()
        draws.append([procs.free_port() for _ in range(3)])
    assert draws[0] != draws[1]


def test_a_port_held_by_a_listener_is_not_handed_out(monkeypatch):
    """Fails when `free_port` returns a port a process listens on: the first port drawn is
    held, the second is not."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            spare = s.getsockname()[1]
        order = iter([port, spare])
        monkeypatch.setattr(procs, "_draw", type("Drawn", (), {
            "randrange": staticmethod(lambda lo, hi: next(order))}))
        assert procs.free_port() == spare


def test_listens_tells_the_process_holding_a_port_from_one_that_does_not(monkeypatch):
    """Fails when `listens` answers for a port rather than for the process (a service whose
    bind failed silently would pass as ready while another process holds its port), or
    answers False instead of None where /proc cannot tell."""
    import builtins
    import os
    import subprocess
    import sys

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert procs.listens(os.getpid(), port) is True
        assert procs.listens(other.pid, port) is False
        server.close()
        assert procs.listens(os.getpid(), port) is False
        real_open = builtins.open

        def no_proc_net(path, *args, **kwargs):
            if str(path).startswith("/proc/net/tcp"):
                raise PermissionError(path)
            return real_open(path, *args, **kwargs)
        monkeypatch.setattr(builtins, "open", no_proc_net)
        assert procs.listens(os.getpid(), port) is None
        monkeypatch.undo()

        def no_fds(path):
            raise PermissionError(path)
        monkeypatch.setattr(os, "listdir", no_fds)
        held = socket.create_server(("127.0.0.1", 0))
        try:
            assert procs.listens(os.getpid(), held.getsockname()[1]) is None
        finally:
            held.close()
    finally:
        other.kill()
        other.wait()
