"""The tier predictor of cold blocks (cpp/kv/tiers/predictor.h), against a plain-Python
model of its rules: heat as an exponentially weighted mean of the fraction of attention
passes that read a block, demotion order (coldest, least recently read, oldest), and the
promotion decisions (hottest cold blocks above the threshold, into free blocks first,
then in exchange for resident blocks at least `margin` colder)."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from k25 import _C, errors


class Model:
    """What the predictor should compute, in float64."""

    def __init__(self, decay):
        self.decay = decay
        self.heat, self.last, self.obs = {}, {}, 0

    def observe(self, reads, passes):
        self.obs += 1
        for b, r in enumerate(reads):
            h = self.heat.get(b, 1.0)
            self.heat[b] = self.decay * h + (1 - self.decay) * r / passes
            if r > 0:
                self.last[b] = self.obs

    def h(self, b):
        return self.heat.get(b, 1.0)

    def key(self, b):
        return (self.h(b), self.last.get(b, -1), b)


observation = st.lists(st.integers(0, 12), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(observation, min_size=1, max_size=12), decay=st.sampled_from([0.0, 0.5, 0.75, 0.9]))
def test_heat_is_the_weighted_mean_of_read_fractions(steps, decay):
    passes = 12
    p = _C.BlockPredictor(decay=decay)
    m = Model(decay)
    n = 0
    for reads in steps:
        n = max(n, len(reads))
        reads = reads + [0] * (n - len(reads))  # a sequence's blocks only grow
        p.observe(7, reads, [False] * n, passes)
        m.observe(reads, passes)
    for b in range(n):
        assert p.heat(7, b) == pytest.approx(m.h(b), abs=1e-5)
    assert p.heat(8, 0) == 1.0  # a sequence never observed: unknown counts as hot
    assert p.counters["steps"] == len(steps)


def test_reads_are_counted_by_the_tier_that_served_them():
    p = _C.BlockPredictor()
    p.observe(1, [3, 1, 2, 4], [0, 1, 2, 2], passes=4)
    c = p.counters
    assert (c["reads_l1"], c["reads_l2"], c["reads_l3"], c["reads_lower"]) == (3, 1, 6, 7)
    assert c["hit_rate"] == pytest.approx(3 / 10)
    with pytest.raises(errors.InvalidArgumentError, match="0 \\(L1\\), 1 \\(L2\\) or 2 \\(L3\\)"):
        p.observe(1, [1], [3], passes=4)
    assert p.counters == c  # the bad call (refused by the binding's check) changed nothing


def test_dense_steps_count_hits_and_misses_but_leave_heat_alone():
    p = _C.BlockPredictor(decay=0.5)
    p.observe(1, [4, 0, 2], [False, True, False], passes=4)
    before = [p.heat(1, b) for b in range(3)]
    p.observe(1, [4, 4, 4], [False, True, True], passes=4, sparse=False)
    assert [p.heat(1, b) for b in range(3)] == before
    c = p.counters
    assert c["reads_l1"] == 4 + 2 + 4 and c["reads_lower"] == 0 + 4 + 4
    assert c["hit_rate"] == pytest.approx(10 / 18)
    assert c["steps"] == 1  # only the sparse observation


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.lists(st.integers(0, 3), min_size=10, max_size=10), min_size=0, max_size=6),
       candidates=st.lists(st.integers(0, 9), unique=True, max_size=10))
def test_demotion_order_is_coldest_then_least_recently_read_then_oldest(steps, candidates):
    p = _C.BlockPredictor(decay=0.5)
    m = Model(0.5)
    for reads in steps:
        p.observe(3, reads, [False] * 10, passes=3)
        m.observe(reads, 3)
    got = p.order_for_demotion(3, candidates)
    assert sorted(got) == sorted(candidates)
    keys = [m.key(b) for b in got]
    for a, b in zip(keys, keys[1:]):
        # float32 heats may tie where float64 ones differ by rounding only
        assert a[0] < b[0] + 1e-6 and (abs(a[0] - b[0]) > 1e-6 or a[1:] <= b[1:])
    if not steps:
        assert got == sorted(candidates)  # nothing observed: oldest first


@settings(max_examples=150, deadline=None)
@given(reads=st.lists(st.integers(0, 8), min_size=4, max_size=20), data=st.data(),
       promote=st.sampled_from([0.1, 0.3, 0.5, 0.9]), margin=st.sampled_from([0.0, 0.1, 0.3]),
       max_moves=st.integers(0, 5), free=st.integers(0, 4))
def test_decisions_promote_the_hottest_cold_blocks_within_the_limits(reads, data, promote, margin, max_moves, free):
    n = len(reads)
    # (max_entropy 1: no access entropy holds a decision back; its own test is below)
    p = _C.BlockPredictor(decay=0.0, promote_heat=promote, margin=margin, max_moves=max_moves, max_entropy=1.0)
    p.observe(5, reads, [False] * n, passes=8)  # decay 0: heat = reads / 8 exactly
    heat = [r / 8 for r in reads]
    cold = data.draw(st.lists(st.sampled_from(range(n)), unique=True))
    resident = data.draw(st.lists(st.sampled_from([b for b in range(n) if b not in cold] or [0]), unique=True))
    resident = [b for b in resident if b not in cold]
    moves = p.decide(5, cold, resident, free)
    promoted = [c for c, _ in moves]
    demoted = [d for _, d in moves if d >= 0]
    assert len(moves) <= max_moves
    assert set(promoted) <= set(cold) and len(set(promoted)) == len(promoted)
    assert set(demoted) <= set(resident) and len(set(demoted)) == len(demoted)
    assert all(heat[c] >= promote for c in promoted)
    # Free blocks first, as many as there are.
    frees = [d for _, d in moves if d < 0]
    assert len(frees) <= free and [d for _, d in moves[:len(frees)]] == frees
    for c, d in moves:
        if d >= 0:
            assert heat[d] + margin <= heat[c] + 1e-9
    # The promoted blocks are the hottest cold ones: none left behind is hotter.
    left = [c for c in cold if c not in promoted]
    if promoted and left:
        assert max(heat[c] for c in left) <= min(heat[c] for c in promoted)
    # Nothing more could have been done: the limit is reached, or the next hottest cold
    # block is below the threshold, or no resident block is cold enough to leave for it.
    if len(moves) < max_moves and left:
        nxt = max(heat[c] for c in left)
        spare = sorted(heat[r] for r in resident if r not in demoted)
        assert nxt < promote or len(frees) == free and (not spare or spare[0] + margin > nxt)


def test_evenly_spread_reads_hold_exchanges_back_by_their_access_entropy():
    def predictor(max_entropy):
        p = _C.BlockPredictor(decay=0.5, promote_heat=0.5, margin=0.25, max_entropy=max_entropy)
        assert p.entropy(3) == 1.0  # nothing observed: as spread as can be
        for _ in range(2):  # block 1 unread (heat 1 -> 0.25), three read alike
            p.observe(3, [4, 0, 4, 4], [1, 0, 0, 0], passes=4)
        return p

    h = math.log(3) / math.log(4)  # each step's entropy: three of four blocks alike
    p = predictor(0.9)
    assert p.entropy(3) == pytest.approx(h) and p.counters["access_entropy"] == pytest.approx(h)
    assert p.decide(3, cold=[0], resident=[1], free_blocks=0) == [(0, 1)]
    assert p.counters["entropy_holds"] == 0
    # The same reads count as spread under a lower bound: no exchange for the hot cold block...
    p = predictor(0.7)
    assert p.decide(3, cold=[0], resident=[1], free_blocks=0) == []
    assert p.counters["entropy_holds"] == 1
    # ... but a free L1 block still takes it.
    assert p.decide(3, cold=[0], resident=[1], free_blocks=1) == [(0, -1)]
    # Every read on one block: entropy 0; every block read alike: 1.
    p.observe(4, [0, 4, 0], [0, 0, 0], passes=4)
    assert p.entropy(4) == 0.0
    p.observe(5, [4, 4, 4], [0, 0, 0], passes=4)
    assert p.entropy(5) == 1.0
    # Passes that select nothing (e.g. sliding-window layers) read every block: that floor does
    # not make a selection look spread. Two such passes under the reads of the first steps:
    p.observe(6, [6, 2, 6, 6], [0, 0, 0, 0], passes=6)
    assert p.entropy(6) == pytest.approx(h)


def test_promoted_blocks_are_counted_and_watched_for_a_read():
    p = _C.BlockPredictor(decay=0.0, promote_heat=0.5, margin=0.25)
    p.observe(9, [4, 4, 0, 4], [False, True, False, True], passes=4)
    moves = p.decide(9, cold=[1, 3], resident=[2], free_blocks=1)
    # Equally hot: the newer first (the reverse of the demotion order); the free block first.
    assert moves == [(3, -1), (1, 2)]
    for c, d in moves:
        p.moved(9, c, d)
    p.observe(9, [4, 4, 0, 0], [False, False, True, False], passes=4)  # 1 read again, 3 not
    c = p.counters
    assert c["promotions"] == 2 and c["exchanges"] == 1 and c["promotions_read"] == 1
    p.forget(9)
    assert p.heat(9, 0) == 1.0 and p.decide(9, [1], [], 5) == []


def test_a_promotion_waits_for_the_reads_of_the_step_it_was_planned_with():
    # Pipelined decode observes step N after planning N + 1: a promotion of plan N + 1 is not
    # judged by step N's reads (which ran before it), but by step N + 1's.
    p = _C.BlockPredictor(decay=0.0, promote_heat=0.5, margin=0.25)
    p.begin_plan(1)
    p.observe(9, [4, 4, 4, 4], [False, True, False, True], passes=4, step=1)
    p.begin_plan(2)
    p.moved(9, 1, -1)
    p.observe(9, [4, 4, 4, 4], [False, True, False, True], passes=4, step=1)  # step 1 read it: too early
    assert p.counters["promotions_read"] == 0
    p.observe(9, [4, 0, 4, 4], [False, False, False, True], passes=4, step=2)  # step 2 did not
    assert p.counters["promotions_read"] == 0
    p.begin_plan(3)
    p.moved(9, 3, -1)
    p.observe(9, [4, 0, 4, 4], [False, False, False, False], passes=4, step=3)  # planned with 3, read by 3
    assert p.counters["promotions"] == 2 and p.counters["promotions_read"] == 1


def test_watermark_keeps_a_share_of_l1_free():
    p = _C.BlockPredictor(free_watermark=0.1)
    assert p.free_blocks_above_watermark(10, 100) == 0
    assert p.free_blocks_above_watermark(13, 100) == 3
    assert p.free_blocks_above_watermark(3, 12) == 1  # ceil(1.2) = 2 kept


@pytest.mark.parametrize("kw", [dict(decay=1.0), dict(decay=-0.1), dict(promote_heat=0.0), dict(promote_heat=1.5),
                                dict(margin=-0.1), dict(max_moves=-1), dict(free_watermark=1.1),
                                dict(max_entropy=-0.1), dict(max_entropy=1.5)])
def test_bad_thresholds_are_errors(kw):
    with pytest.raises(errors.InvalidArgumentError, match="predictor_"):
        _C.BlockPredictor(**kw)
