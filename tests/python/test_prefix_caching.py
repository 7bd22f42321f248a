"""Prefix caching (enable_prefix_caching=True): the block pool's cache (registration,
lookup, LRU reuse of free cached blocks) and the engine end to end on the default model:
the same tokens as without the cache, with the shared prefix not recomputed."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k25 import K25Config, K25Model, _C, errors

BS = 16


def chain(tokens, bs=BS):
    hashes, parent = [], 0
    for i in range(len(tokens) // bs):
        parent = _C.block_chain_hash(parent, tokens[i * bs:(i + 1) * bs])
        hashes.append(parent)
    return hashes


def register(pool, blocks, tokens, bs=BS):
    hashes = chain(tokens, bs)
    for i, b in enumerate(blocks):
        pool.register_block(b, hashes[i], hashes[i - 1] if i else 0, tokens[i * bs:(i + 1) * bs])


def test_pool_finds_registered_prefix_and_stops_at_the_first_difference():
    pool = _C.BlockPool(8)
    toks = list(range(100, 100 + 3 * BS))
    blocks = pool.allocate(3)
    register(pool, blocks, toks)
    assert pool.num_cached == 3
    assert pool.match_prefix(toks, BS) == (blocks, chain(toks))
    assert pool.match_prefix(toks + [7] * 5, BS)[0] == blocks     # a partial last block is not matched
    other = list(toks)
    other[BS + 3] = 1  # the second block differs: only the first matches
    assert pool.match_prefix(other, BS)[0] == blocks[:1]
    other = list(toks)
    other[0] = 1  # the first differs: nothing (later blocks hash over their prefix)
    assert pool.match_prefix(other, BS)[0] == []
    # a hash registered with other tokens is not a hit (a forged collision)
    pool2 = _C.BlockPool(2)
    b = pool2.allocate(1)
    pool2.register_block(b[0], chain(toks)[0], 0, [5] * BS)
    assert pool2.match_prefix(toks, BS)[0] == []
    pool.check_invariants()


def test_free_cached_blocks_are_reused_last_and_forget_their_content():
    pool = _C.BlockPool(4)
    toks = list(range(2 * BS))
    cached = pool.allocate(2)
    register(pool, cached, toks)
    for b in cached:
        pool.decref(b)
    assert pool.num_free == 4 and pool.num_cached == 2          # free, and still findable
    assert pool.match_prefix(toks, BS)[0] == cached
    # a hit takes a free block back off the free list
    pool.acquire(cached[0])
    assert pool.num_free == 3 and pool.refcount(cached[0]) == 1
    pool.decref(cached[0])
    # the two never-used blocks go first; the next allocation evicts the oldest cached one
    fresh = pool.allocate(2)
    assert not set(fresh) & set(cached) and pool.num_cached == 2
    evicted = pool.allocate(1)
    assert evicted[0] in cached and pool.num_cached == 1
    assert pool.match_prefix(toks, BS)[0] == ([] if evicted[0] == cached[0] else cached[:1])
    pool.check_invariants()


# The block pool's property test (it lives here because the cache's ops need the helpers
# above): plain allocation and sharing, and the cache's registration and hits.
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "share", "register", "hit"]), st.integers(0, 50)),
                max_size=80))
def test_pool_never_leaks_or_double_owns(ops):
    pool = _C.BlockPool(12)
    owned = []  # one entry per reference held
    prefixes = [list(range(s, s + 2 * BS)) for s in (0, 1000, 2000)]
    for op, n in ops:
        if op == "alloc":
            k = n % 7
            if k <= pool.num_free:
                owned += pool.allocate(k)
            else:
                with pytest.raises(errors.ResourceExhaustedError):
                    pool.allocate(k)
        elif op == "free" and owned:
            pool.decref(owned.pop(n % len(owned)))
        elif op == "share" and owned:
            b = owned[n % len(owned)]
            pool.incref(b)
            owned.append(b)
        elif op == "register" and len(owned) >= 2:
            toks = prefixes[n % 3]
            register(pool, owned[-2:], toks)
        elif op == "hit":
            blocks, _ = pool.match_prefix(prefixes[n % 3], BS)
            for b in blocks:
                pool.acquire(b)
                owned.append(b)
        pool.check_invariants()
        assert pool.num_used == len(set(owned))
        for b in set(owned):
            assert pool.refcount(b) == owned.count(b)


@pytest.fixture(scope="module")
def models():
    cfg = dict(kv_cache_bytes=64 << 20, max_num_batched_tokens=256, prefill_chunk_size=128)
    cached = K25Model(K25Config(enable_prefix_caching=True, **cfg))
    plain = K25Model(K25Config(**cfg))
    yield cached, plain
    cached.close()
    plain.close()


def prompts_with_shared_prefix(m, n, prefix_len, seed):
    rng = random.Random(seed)
    vocab = 2000
    prefix = [rng.randrange(10, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(10, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def test_shared_prefix_is_not_recomputed_and_outputs_are_unchanged(models):
    cached, plain = models
    prompts = prompts_with_shared_prefix(cached, 4, 150, seed=1)
    kw = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    want = [plain.generate([p], **kw)[0] for p in prompts]
    s0 = cached.stats()
    first = cached.generate([prompts[0]], **kw)[0]
    s1 = cached.stats()
    rest = [cached.generate([p], **kw)[0] for p in prompts[1:]]
    s2 = cached.stats()
    assert s1["prefix_cache_hits"] == s0["prefix_cache_hits"]  # nothing cached yet
    # every later prompt starts after the 9 full blocks of the shared 150 tokens (144)
    assert s2["prefix_cache_hits"] - s1["prefix_cache_hits"] == 3 * (150 // BS) * BS
    assert s2["prefix_cache_queries"] - s1["prefix_cache_queries"] == sum(len(p) for p in prompts[1:])
    assert s2["prefill_tokens"] - s1["prefill_tokens"] == sum(len(p) - 144 for p in prompts[1:])
    for got, exp in zip([first] + rest, want):
        assert got.token_ids == exp.token_ids
        for a, b in zip(got.logprobs, exp.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-3


def test_a_repeated_prompt_recomputes_only_its_last_block(models):
    cached, plain = models
    p = prompts_with_shared_prefix(cached, 1, 70, seed=2)[0][:70]
    kw = dict(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    want = plain.generate([p], **kw)[0].token_ids
    assert cached.generate([p], **kw)[0].token_ids == want
    s0 = cached.stats()
    assert cached.generate([p], **kw)[0].token_ids == want
    s1 = cached.stats()
    assert s1["prefix_cache_hits"] - s0["prefix_cache_hits"] == (69 // BS) * BS  # the block of token 70 is redone
    # generated tokens were cached too: the prompt plus its first output is a longer hit
    out = cached.generate([p], max_new_tokens=40, temperature=0.0, ignore_eos=True)[0].token_ids
    s2 = cached.stats()
    longer = p + out[:30]
    assert cached.generate([longer], **kw)[0].token_ids == plain.generate([longer], **kw)[0].token_ids
    assert cached.stats()["prefix_cache_hits"] - s2["prefix_cache_hits"] == (len(longer) - 1) // BS * BS


def test_prompt_logits_are_computed_not_cached(models):
    cached, plain = models
    p = prompts_with_shared_prefix(cached, 1, 64, seed=3)[0]
    cached.generate([p], max_new_tokens=1, temperature=0.0)
    s0 = cached.stats()
    a = cached.score(p)
    assert cached.stats()["prefix_cache_hits"] == s0["prefix_cache_hits"]
    b = plain.score(p)
    assert abs(a - b).max() < 1e-3


def test_eviction_and_preemption_with_a_small_pool_keep_outputs_exact():
    # A pool of 24 blocks for 6 concurrent requests of 9-11 blocks each: cached blocks are
    # evicted for new work and sequences are preempted (recomputed from cached blocks).
    kw = dict(max_num_batched_tokens=128, prefill_chunk_size=64, max_batch_size=6)
    per_block = K25Model(K25Config(kv_cache_bytes=8 << 20, **kw))
    nbytes = 24 * per_block.kv_block_bytes
    per_block.close()
    cached = K25Model(K25Config(enable_prefix_caching=True, kv_cache_bytes=nbytes, **kw))
    plain = K25Model(K25Config(kv_cache_bytes=nbytes, **kw))
    try:
        rng = random.Random(4)
        prompts = []
        for base in prompts_with_shared_prefix(cached, 3, 96, seed=5):
            prompts += [base, base[:64] + [rng.randrange(10, 2000) for _ in range(50)]]
        gen = dict(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        want = [o.token_ids for o in plain.generate(prompts, **gen)]
        for _ in range(2):
            got = [o.token_ids for o in cached.generate(prompts, **gen)]
            assert got == want
        s = cached.stats()
        assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0
        assert s["blocks_used"] == 0 and s["blocks_free"] == s["blocks_total"]  # cached blocks count as free
        assert 0 < s["prefix_cached_blocks"] <= s["blocks_total"]
    finally:
        cached.close()
        plain.close()


@pytest.mark.parametrize("value", [1, "yes", None])
def test_prefix_caching_config_errors(value):
    with pytest.raises(errors.ConfigError):
        K25Config(enable_prefix_caching=value)
