"""Emulated links (`integrations/harness/link.py`): real namespaces, real sockets, real `tc`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from kvhal.integrations.harness import link as links

REASON = links.unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated links: {REASON}")

#: Sends `nbytes` over 127.0.0.1 twice, 0.5 s apart, printing the seconds of each transfer
#: as JSON once each is done; the parent may change the link between them (it reads line 1).
_TRANSFER = textwrap.dedent("""
    import json, socket, sys, threading, time
    nbytes = int(sys.argv[1])
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
    def serve():
        for _ in range(2):
            c, _ = srv.accept(); c.sendall(b"x" * nbytes); c.close()
    threading.Thread(target=serve, daemon=True).start()
    for i in range(2):
        c = socket.create_connection(srv.getsockname()); t0 = time.perf_counter(); got = 0
        while (b := c.recv(1 << 20)):
            got += len(b)
        assert got == nbytes
        print(json.dumps(time.perf_counter() - t0), flush=True)
        if i == 0:
            sys.stdin.readline()       # the parent changed the link
""")


def _transfers(link, nbytes: int, between=None) -> list[float]:
    proc = link.popen([sys.executable, "-c", _TRANSFER, str(nbytes)], stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        if between:
            between()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        second = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
    return [first, second]


@needs_netns
def test_loopback_runs_at_the_rate_and_changes_mid_run():
    """2.5 MB at 20 Mbit/s takes ≥ 0.8 s (the 256 KiB bucket lets the first bytes through at
    once: 2.24 MB / 2.5 MB/s = 0.9 s); after `set_rate(2 Gbit/s)` the same socket transfer
    takes under a tenth of that."""
    nbytes = 2_500_000
    with links.EmulatedLink(links.parse_link("20mbit")) as link:
        assert "rate 20Mbit" in link.qdisc()
        slow, fast = _transfers(link, nbytes, lambda: link.set_rate(2e9))
        assert "rate 2Gbit" in link.qdisc()
    assert slow >= 0.8
    assert fast < slow / 10


@needs_netns
def test_close_ends_processes_inside_and_deletes_the_namespace():
    with pytest.raises(RuntimeError, match="boom"), links.EmulatedLink(1e9) as link:
        proc = link.popen([sys.executable, "-c", "import time; time.sleep(120)"])
        assert link.name in links._namespaces()
        raise RuntimeError("boom")
    assert proc.wait(timeout=10) is not None
    assert link.name not in links._namespaces()
    with pytest.raises(links.LinkError, match="closed"):
        link.set_rate(1e8)


@needs_netns
def test_a_killed_creator_leaves_a_namespace_that_sweep_stale_removes():
    code = ("import os, signal; from kvhal.integrations.harness.link import EmulatedLink; "
            "link = EmulatedLink(1e9); print(link.name, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    name = out.stdout.strip()
    assert name.startswith(links.NAME_PREFIX) and name in links._namespaces()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and name in links._namespaces():
        links.sweep_stale()
    assert name not in links._namespaces()


@needs_netns
def test_sweep_leaves_namespaces_of_live_creators():
    with links.EmulatedLink(1e9) as link:
        assert link.name not in links.sweep_stale()
        assert link.name in links._namespaces()


@pytest.mark.parametrize("text,rate,rtt", [("20mbit", 20e6, None), ("25gbit", 25e9, None),
                                           ("1.5gbit,2ms", 1.5e9, 0.002),
                                           ("100m,0.5s", 100e6, 0.5)])
def test_parse_link(text, rate, rtt):
    assert links.parse_link(text) == links.LinkSpec(rate, rtt)


@pytest.mark.parametrize("text,message", [("fast", "not a link rate"),
                                          ("0mbit", "outside"), ("20mbit,soon", "round-trip")])
def test_parse_link_refuses_bad_values(text, message):
    with pytest.raises(ValueError, match=message):
        links.parse_link(text)


@needs_netns
def test_an_rtt_without_netem_is_refused_and_leaves_nothing():
    if links.rtt_unavailable() is None:
        pytest.skip("this kernel has netem: an RTT is emulated, not refused")
    mine = f"{links.NAME_PREFIX}{os.getpid()}-"   # other test workers make theirs meanwhile
    before = {n for n in links._namespaces() if n.startswith(mine)}
    with pytest.raises(links.LinkError, match="netem"):
        links.EmulatedLink(links.parse_link("1gbit,2ms"))
    assert {n for n in links._namespaces() if n.startswith(mine)} == before
