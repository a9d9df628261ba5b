"""`kvhal soak`'s pieces that need no server: the seeded fault schedule, the answer check, the
load's order and tenants, the fs damage."""
from __future__ import annotations

import pytest

from kvhal.integrations.harness.soak import faults
from kvhal.integrations.harness.soak.load import common_prefix, compare, conversations, order
from kvhal.integrations.harness.vllm.chat import ChatShape


def test_the_same_seed_gives_the_same_fault_schedule():
    a, b = faults.schedule(3, 600), faults.schedule(3, 600)
    assert a == b and len(a) >= 15
    assert faults.schedule(4, 600) != a


def test_every_kind_comes_once_before_any_comes_twice():
    """Fails when kinds are drawn independently (a kind can then repeat before another
    came at all)."""
    for seed in range(20):
        kinds = [f.kind for f in faults.schedule(seed, 600)][:len(faults.KINDS)]
        assert sorted(kinds) == sorted(faults.KINDS), (seed, kinds)


def test_faults_stay_inside_the_run_and_target_servers():
    for f in faults.schedule(1, 300, gap_s=10):
        assert 20.0 <= f.at_s < 290.0
        assert f.target in ((0, 1) if f.kind in faults.SERVER_KINDS else (0,))


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="fault kind 'reboot'"):
        faults.schedule(0, 600, ("kill_restart", "reboot"))


def _answer(tokens, logprobs, gaps):
    return {"token_ids": tokens, "logprobs": logprobs, "top2_gap": gaps}


@pytest.mark.parametrize("got, verdict", [
    (_answer([5, 6, 7], [-1.0, -2.0, -3.0], []), "ok"),
    (_answer([5, 6, 7], [-1.0, -2.1, -3.0], []), "ok"),          # within LOGPROB_TOL
    (_answer([5, 6, 7], [-1.0, -2.0, -4.0], []), "wrong"),        # same tokens, other numbers
    (_answer([5, 9, 7], [-1.0, -2.0, -3.0], []), "near_tie"),     # reference gap 0.01 there
    (_answer([5, 6, 9], [-1.0, -2.0, -3.0], []), "wrong"),        # reference gap 2.0 there
    (_answer([5, 6], [-1.0, -2.0], []), "wrong"),                 # cut short
])
def test_an_answer_is_ok_a_near_tie_or_wrong(got, verdict):
    """Fails when any differing token counts as a near tie, or logprobs are not compared."""
    ref = _answer([5, 6, 7], [-1.0, -2.0, -3.0], [1.0, 0.01, 2.0])
    assert compare(got, ref)[0] == verdict


def test_each_group_is_played_by_two_tenants_with_the_same_tokens():
    shape = ChatShape(conversations=6, turns=4, initial_tokens=64, turn_tokens=8,
                      answer_tokens=4, concurrency=1, seed=9)
    convs = conversations(9, 0, 3, shape, 1000)
    assert len({c.salt for c in convs}) == 6
    for a, b in zip(convs[::2], convs[1::2]):
        assert a.name == b.name and a.prompt == b.prompt and a.salt != b.salt
    steps = order(9, 0, convs, 4)
    assert steps == order(9, 0, convs, 4) and len(steps) == 24
    assert {s for _, s in steps} == {0, 1}


def test_damage_truncates_or_overwrites_the_picked_chunk_file(tmp_path):
    folder = tmp_path / "ns" / "chunks" / "00"
    folder.mkdir(parents=True)
    for i in range(3):
        (folder / f"{i}.kv").write_bytes(bytes(range(256)) * 64)
    path = faults.damage(str(tmp_path), faults.Fault(1.0, "fs_truncate", 0, 4))
    assert path.endswith("1.kv") and (folder / "1.kv").stat().st_size == 8192
    path = faults.damage(str(tmp_path), faults.Fault(1.0, "fs_overwrite", 0, 5))
    data = (folder / "2.kv").read_bytes()
    assert path.endswith("2.kv") and len(data) == 16384 and data != bytes(range(256)) * 64
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
