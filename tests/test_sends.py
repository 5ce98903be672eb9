"""Rounds of cross-process sends (reshard/sends.py): every piece sent exactly once, one block
shape per round, no device sending or receiving twice in a round, the same rounds whatever
process computes them. (The collectives themselves run in tests/test_multiprocess.py.)"""
from collections import Counter
from typing import NamedTuple

from hypothesis import given, strategies as st

from autoshard.reshard.sends import Send, rounds


class FakeDevice(NamedTuple):
    id: int
    process_index: int


DEVICES = [FakeDevice(i, i // 4) for i in range(8)]


def _check(sends, got):
    assert sorted(s.key for r in got for s in r) == sorted(s.key for s in sends)
    for members in got:
        assert len({s.shape for s in members}) == 1
        assert max(Counter(s.src.id for s in members).values()) == 1
        assert max(Counter(s.dst.id for s in members).values()) == 1


def test_one_block_per_device_is_one_round():
    sends = [Send(k, DEVICES[k], DEVICES[k + 4], (4, 6)) for k in range(4)]
    got = rounds(sends)
    assert [[s.key for s in r] for r in got] == [[0, 1, 2, 3]]


def test_a_device_receiving_two_pieces_takes_two_rounds():
    # device 4 gathers two halves (from 0 and 1); device 5 one piece of another shape
    sends = [Send("a", DEVICES[0], DEVICES[4], (2, 6)), Send("b", DEVICES[1], DEVICES[4], (2, 6)),
             Send("c", DEVICES[2], DEVICES[5], (3, 6))]
    got = rounds(sends)
    _check(sends, got)
    assert [[s.key for s in r] for r in got] == [["a"], ["b"], ["c"]]


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(4, 7), st.sampled_from([(2,), (3, 1)])),
                max_size=24))
def test_rounds_cover_every_send_without_conflicts(pairs):
    sends = [Send(k, DEVICES[a], DEVICES[b], shape) for k, (a, b, shape) in enumerate(pairs)]
    got = rounds(sends)
    _check(sends, got)
    assert rounds(list(sends)) == got  # deterministic: every process derives the same rounds
