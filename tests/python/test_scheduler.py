"""Property tests of the block pool and the scheduler (the real C++ policy, no model).

SchedulerSim drives k25's Scheduler as the engine does, with a fake model that emits one
token per emitting sequence. A Python model of each request checks what the plan says.
"""
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from k25 import _C, errors


def make_sim(blocks, block_size=4, budget=32, chunk=8, max_batch=4, prefix_caching=False):
    c = _C.EngineConfig()
    c.enable_prefix_caching = prefix_caching
    c.num_kv_blocks = blocks
    c.block_size = block_size
    c.max_num_batched_tokens = budget
    c.prefill_chunk_size = chunk
    c.max_batch_size = max_batch
    return _C.SchedulerSim(c)


def test_block_pool_refcounts_and_errors():
    pool = _C.BlockPool(8)
    a = pool.allocate(5)
    assert len(set(a)) == 5 and pool.num_free == 3
    pool.incref(a[0])
    pool.decref(a[0])
    assert pool.refcount(a[0]) == 1
    with pytest.raises(errors.ResourceExhaustedError):
        pool.allocate(4)
    assert pool.num_free == 3  # a failed allocation takes nothing
    for b in a:
        pool.decref(b)
    pool.check_invariants()
    with pytest.raises(errors.EngineError):  # double free is an internal error, not a crash
        pool.decref(a[0])
    with pytest.raises(errors.EngineError):
        pool.incref(99)


# The pool's property test (allocation, sharing and the prefix cache's ops):
# test_prefix_caching.py::test_pool_never_leaks_or_double_owns.


request = st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2))


# With prefix caching every prompt (all token 0 in the sim) shares its leading blocks with
# every other: shared blocks, cached free blocks taken back, evictions, preemptions of
# sequences that hold shared blocks.
@pytest.mark.parametrize("prefix_caching", [False, True])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.integers(13, 40),
    budget=st.integers(1, 40),
    chunk=st.integers(1, 16),
    max_batch=st.integers(1, 6),
    arrivals=st.lists(st.lists(request, max_size=3), min_size=1, max_size=12),
    abort_picks=st.lists(st.integers(0, 100), max_size=4),
)
def test_scheduler_every_request_finishes_without_leaks(prefix_caching, blocks, budget, chunk, max_batch, arrivals,
                                                       abort_picks):
    bs = 4
    sim = make_sim(blocks, bs, budget, chunk, max_batch, prefix_caching)
    state = {}  # id -> [total tokens known, max_new, generated]
    finished, aborted = set(), set()
    step = 0
    pending = list(arrivals)
    while pending or sim.has_unfinished():
        if pending:
            for prompt, max_new, prio in pending.pop(0):
                if -(-(prompt + max_new) // bs) > blocks:
                    with pytest.raises(errors.ResourceExhaustedError):
                        sim.add(prompt, max_new, prio)
                    continue
                rid = sim.add(prompt, max_new, prio)
                state[rid] = [prompt, max_new, 0]
        if abort_picks and step % 3 == 2:
            live = sorted(set(state) - finished - aborted)
            if live:
                rid = live[abort_picks.pop() % len(live)]
                assert sim.abort(rid)
                aborted.add(rid)
        out = sim.step()
        sim.check_invariants()
        assert out["num_tokens"] <= budget
        assert len(out["seqs"]) <= max_batch
        assert len({s[0] for s in out["seqs"]}) == len(out["seqs"])  # no sequence twice
        for rid, computed, n, emits, prio in out["seqs"]:
            total = state[rid][0]
            assert 1 <= n <= max(1, min(chunk, budget))
            assert computed + n <= total
            assert emits == (computed + n == total)
            if emits:
                state[rid][0] += 1
                state[rid][2] += 1
        for rid in out["finished"]:
            assert state[rid][2] == state[rid][1]  # exactly max_new tokens
            finished.add(rid)
        step += 1
        assert step < 5000, "scheduler made no progress"
    assert finished | aborted == set(state)
    assert not (finished & aborted)
    assert sim.blocks_free == sim.blocks_total


def test_scheduler_starts_after_cached_blocks():
    # Prompts of 18 tokens (token 0 each, blocks of 4): the second request, added after
    # the first finished, starts after 4 cached blocks (not 16 + the last token's block).
    sim = make_sim(blocks=20, block_size=4, budget=64, chunk=64, prefix_caching=True)
    first = sim.add(18, 2, 1)
    out = sim.step()
    assert out["seqs"][0][:3] == (first, 0, 18)
    while sim.has_unfinished():
        sim.step()
    second = sim.add(18, 2, 1)
    out = sim.step()
    assert out["seqs"][0][:3] == (second, 16, 2)  # computed 16, computes the last 2
    assert sim.prefix_hit_tokens == 16
    sim.check_invariants()


def test_scheduler_preempts_lowest_priority_first():
    # 12 blocks of 4 tokens. Three requests of 16 prompt tokens (4 blocks each) fill the
    # pool; the first one that needs a new block forces a preemption, which must hit the
    # bronze request, not the gold or silver ones.
    sim = make_sim(blocks=12, block_size=4, budget=64, chunk=16, max_batch=4)
    gold = sim.add(16, 8, 0)
    bronze = sim.add(16, 8, 2)
    silver = sim.add(16, 8, 1)
    out = sim.step()
    assert {s[0] for s in out["seqs"]} == {gold, bronze, silver}
    out = sim.step()
    assert out["preempted"] == [bronze]
    assert {s[0] for s in out["seqs"]} == {gold, silver}
    assert sim.num_preemptions == 1
    sim.check_invariants()


def test_waiting_gold_preempts_running_bronze():
    sim = make_sim(blocks=8, block_size=4, budget=64, chunk=32, max_batch=4)
    bronze = sim.add(28, 4, 2)  # 7 blocks of 8
    sim.step()
    gold = sim.add(12, 4, 0)    # needs 3 blocks: only 1 free
    out = sim.step()
    assert out["preempted"] == [bronze]
    assert [s[0] for s in out["seqs"]] == [gold]
    sim.check_invariants()
    # A waiting bronze never preempts a running gold.
    sim2 = make_sim(blocks=8, block_size=4, budget=64, chunk=32, max_batch=4)
    g2 = sim2.add(28, 4, 0)
    sim2.step()
    sim2.add(12, 4, 2)
    out = sim2.step()
    assert out["preempted"] == [] and [s[0] for s in out["seqs"]] == [g2]


def test_chunked_prefill_shares_the_budget_with_decodes():
    sim = make_sim(blocks=64, block_size=4, budget=10, chunk=8, max_batch=4)
    a = sim.add(3, 20, 1)
    sim.step()                 # a's prompt
    b = sim.add(30, 2, 1)
    out = sim.step()
    plan = {s[0]: s[2] for s in out["seqs"]}
    assert plan[a] == 1        # a decodes
    assert plan[b] == 8        # b's first chunk is capped by prefill_chunk_size
    out = sim.step()
    plan = {s[0]: s[2] for s in out["seqs"]}
    assert plan == {a: 1, b: 8}
    assert out["num_tokens"] == 9


def test_waiting_gold_is_admitted_next_step_despite_the_watermark():
    # A long bronze request holds nearly the whole pool; a small gold request arrives.
    # Phase 0 must preempt with the same test Phase 2 admits by (watermark included),
    # so gold runs at once instead of after many bronze decode steps.
    c = _C.EngineConfig()
    c.num_kv_blocks, c.block_size = 1000, 16
    c.max_num_batched_tokens = c.prefill_chunk_size = 16384
    c.admission_watermark = 0.01
    sim = _C.SchedulerSim(c)
    bronze = sim.add(16 * 985, 200, 2)
    sim.step()
    gold = sim.add(160, 1, 0)
    out = sim.step()
    assert gold in [s[0] for s in out["seqs"]]
    assert bronze in out["preempted"]
    sim.check_invariants()
