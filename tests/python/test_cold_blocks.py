"""A sequence longer than the primary KV pool (tiered KV, issue #6 use (a), CPU backend).

With cache_mode="hierarchical", a sequence that would have to preempt itself for want of
L1 blocks moves some of its computed blocks to L2 instead ("cold" blocks) and keeps
running: the attention reads them where they lie in L2. The oracle is the same prompt on
a pool that holds everything: the tokens must be equal, nothing may be recomputed, and
every tier copy must be freed at the end.
"""
import asyncio
import os
import threading
import time

import pytest

from k25 import K25Config, K25Model, _C, errors

from oracles import long_text

NEW_TOKENS = 20
BLOCK = 16


def long_prompts(tok):
    """A 600- and a 300-token text (test_cold_l3.py uses them too)."""
    text = long_text()
    return [tok.encode(text[3000:12000])[:600], tok.encode(text[20000:26000])[:300]]


@pytest.fixture(scope="module")
def prompts(default_model):
    return long_prompts(default_model.tokenizer)


@pytest.fixture(scope="module")
def reference(default_model, prompts):
    outs = default_model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
    return [o.token_ids for o in outs]


def small_l1(default_model, l1_blocks, l2_slots, **kw):
    per_block = default_model.kv_block_bytes
    return K25Model(K25Config(num_threads=2, kv_cache_bytes=l1_blocks * per_block, block_size=BLOCK,
                              prefill_chunk_size=64, max_num_batched_tokens=96, max_batch_size=4,
                              cache_mode="hierarchical", enable_async_offload=True,
                              l2_bytes=l2_slots * _C.kv_page_bytes(per_block), **kw))


def run_closed(model, batch):
    """Greedy outputs of a batch of prompts, then the model's stats and tier stats once every
    block is back in the pool (a promotion's copy may end after its request: the idle engine
    applies it and gives its block back); closes the model."""
    try:
        outs = model.generate(batch, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        deadline = time.monotonic() + 10
        while model.stats()["blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.02)
        return outs, model.stats(), model.tier_stats()
    finally:
        model.close()


def test_a_sequence_three_times_longer_than_l1_gives_the_all_resident_tokens(default_model, prompts, reference):
    need = -(-(len(prompts[0]) + NEW_TOKENS) // BLOCK)  # 39 blocks
    (out,), s, tiers = run_closed(small_l1(default_model, l1_blocks=12, l2_slots=need), [prompts[0]])
    assert out.token_ids == reference[0]
    # Every block past what L1 holds went to L2 (first block and the newest stay in L1).
    assert s["cold_demotes"] >= need - 12
    assert tiers["offloads_to_l2"] == s["cold_demotes"] and tiers["offloads_to_l3"] == 0
    assert s["preemptions"] == 0 and s["prefill_tokens"] == len(prompts[0])  # nothing recomputed
    assert s["cold_blocks"] == 0 and s["blocks_used"] == 0
    assert tiers["l2_blocks"] == 0  # every cold copy freed with the sequence


def test_two_long_sequences_share_l1_by_preemption_and_cold_blocks(default_model, prompts, reference):
    # Neither fits the 12-block pool; the lower-ranked one is preempted while the other
    # goes cold, then runs (cold too) on its own.
    model = small_l1(default_model, l1_blocks=12, l2_slots=80)
    try:
        outs = model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        s = model.stats()
        tiers = model.tier_stats()
    finally:
        model.close()
    for i, (o, want) in enumerate(zip(outs, reference)):
        assert o.token_ids == want, f"prompt {i} differs"
    assert s["cold_demotes"] > 0 and s["preemptions"] > 0
    assert s["cold_blocks"] == 0 and s["blocks_used"] == 0 and tiers["l2_blocks"] == 0


def test_a_preempted_cold_sequence_recomputes_and_frees_its_copies(default_model, prompts, reference):
    # A gold request arriving while a bronze one runs cold preempts it: the cold sequence
    # recomputes (its KV never fitted L1), and its L2 copies are freed at once.
    model = small_l1(default_model, l1_blocks=12, l2_slots=40)
    try:
        results = {}
        started = threading.Event()

        def long_one():
            results["bronze"] = model.generate([prompts[0]], priority="bronze", max_new_tokens=NEW_TOKENS,
                                               ignore_eos=True, temperature=0.0)[0]

        t = threading.Thread(target=long_one)
        t.start()
        while model.stats()["cold_blocks"] < 8:
            if not t.is_alive():
                break
            started.wait(0.01)
        gold = model.generate([prompts[1][:150]], priority="gold", max_new_tokens=NEW_TOKENS, ignore_eos=True,
                              temperature=0.0)[0]
        t.join()
        s = model.stats()
        tiers = model.tier_stats()
        events = model.drain_kv_events()
    finally:
        model.close()
    assert results["bronze"].token_ids == reference[0]
    want_gold = default_model.generate([prompts[1][:150]], max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                       temperature=0.0)[0].token_ids
    assert gold.token_ids == want_gold
    assert s["preemptions"] >= 1 and s["prefill_tokens"] > len(prompts[0]) + 150  # the bronze one recomputed
    # The cold sequence is not swapped out (readmitted, it may be swapped later while it
    # has no cold blocks yet).
    assert "preempt_recompute" in {e[2] for e in events}
    assert s["cold_blocks"] == 0 and tiers["l2_blocks"] == 0 and s["blocks_used"] == 0


def test_a_request_longer_than_l1_plus_l2_is_refused_with_both_sizes(default_model, prompts):
    model = small_l1(default_model, l1_blocks=12, l2_slots=10)
    try:
        with pytest.raises(errors.ResourceExhaustedError, match="KV pool and L2 hold"):
            model.generate([prompts[0]], max_new_tokens=NEW_TOKENS)
        # The engine is unharmed: a request that fits runs.
        out = model.generate([prompts[1][:100]], max_new_tokens=4, ignore_eos=True, temperature=0.0)[0]
        assert len(out.token_ids) == 4
    finally:
        model.close()


def test_on_the_unfused_path_tiers_do_not_lengthen_requests_and_the_refusal_says_so(default_model, prompts):
    # The unfused path reads no cold blocks: with tiers on, the bound is still the pool, and
    # the message points at enable_kernel_fusion rather than at l2_bytes, which cannot help.
    model = small_l1(default_model, l1_blocks=12, l2_slots=40, enable_kernel_fusion=False)
    try:
        with pytest.raises(errors.ResourceExhaustedError,
                           match=r"the KV pool holds 12 blocks.*raise kv_cache_bytes or lower max_new_tokens.*"
                                 r"enable_kernel_fusion=True") as e:
            model.generate([prompts[0]], max_new_tokens=NEW_TOKENS)
        assert "l2_bytes" not in str(e.value)
        out = model.generate([prompts[1][:100]], max_new_tokens=4, ignore_eos=True, temperature=0.0)[0]
        assert len(out.token_ids) == 4
    finally:
        model.close()


def test_without_tiers_a_request_longer_than_the_pool_is_still_refused(default_model, prompts):
    model = K25Model(K25Config(num_threads=2, kv_cache_bytes=12 * default_model.kv_block_bytes, block_size=BLOCK))
    try:
        with pytest.raises(errors.ResourceExhaustedError, match="the KV pool holds 12 blocks"):
            model.generate([prompts[0]], max_new_tokens=NEW_TOKENS)
    finally:
        model.close()


SPARSE = dict(enable_dynamic_sparsity=True, sparsity_min_context=128, sparsity_recent_blocks=2,
              max_sparsity_ratio=0.8, sparsity_mass_target=0.5, sparsity_score_channels=8)
# Predictor thresholds low enough that this text's block heat triggers promotions.
EAGER = dict(predictor_promote_heat=0.2, predictor_margin=0.05, predictor_max_moves=4)


def all_resident_sparse_tokens(default_model, prompt, **sparse):
    roomy = K25Model(K25Config(num_threads=2, kv_cache_bytes=48 * default_model.kv_block_bytes, block_size=BLOCK,
                               prefill_chunk_size=64, max_num_batched_tokens=96, **sparse))
    try:
        want = roomy.generate([prompt], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
        assert roomy.get_current_sparsity_ratio() > 0
    finally:
        roomy.close()
    return want.token_ids


@pytest.mark.parametrize("channels", [8, 0])
def test_cold_blocks_with_dynamic_sparsity_select_like_an_all_resident_run(default_model, prompts, channels):
    # The selection ranks cold blocks by the key summaries saved when they left L1 (the
    # Quest bound, channels=0, ranks by them alone) or reads their keys in L2 (the channel
    # estimate), and attends over the kept ones in L2.
    sparse = dict(SPARSE, sparsity_score_channels=channels)
    want = all_resident_sparse_tokens(default_model, prompts[0], **sparse)
    model = small_l1(default_model, l1_blocks=12, l2_slots=40, **sparse)
    try:
        out = model.generate([prompts[0]], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
        s = model.stats()
        ratio = model.get_current_sparsity_ratio()
    finally:
        model.close()
    assert s["cold_demotes"] >= 27 and s["preemptions"] == 0 and ratio > 0
    assert out.token_ids == want


def test_the_predictor_brings_hot_cold_blocks_back_without_changing_tokens(default_model, prompts):
    # Promotions into free L1 blocks and in exchange for colder resident ones; a promotion's
    # copy runs while the sequence goes on reading the block in L2.
    want = all_resident_sparse_tokens(default_model, prompts[0], **SPARSE)
    (out,), s, tiers = run_closed(small_l1(default_model, l1_blocks=12, l2_slots=40, **EAGER, **SPARSE), [prompts[0]])
    assert out.token_ids == want
    p = s["predictor"]
    assert p["exchanges"] > 0 and p["promotions"] >= p["exchanges"]
    assert 0 < p["promotions_read"] <= p["promotions"]
    assert p["reads_l1"] > 0 and p["reads_lower"] > 0 and 0 < p["hit_rate"] < 1
    assert p["reads_l2"] == p["reads_lower"] and p["reads_l3"] == 0  # no L3 here
    # A promotion is a copy from L2 (counted as a fetch) that lands in the block table unless
    # the request ended first.
    assert 0 < s["cold_promotions"] <= tiers["fetches_from_l2"] <= p["promotions"]
    assert s["preemptions"] == 0 and s["cold_blocks"] == 0 and s["blocks_used"] == 0 and tiers["l2_blocks"] == 0


def test_without_promotions_the_predictor_only_orders_demotions(default_model, prompts):
    _, s, _ = run_closed(small_l1(default_model, l1_blocks=12, l2_slots=40, predictor_max_moves=0, **SPARSE),
                         [prompts[0]])
    assert s["cold_promotions"] == 0 and s["predictor"]["exchanges"] == 0 and s["cold_demotes"] >= 27


def test_hits_and_misses_count_every_block_read_of_every_decode_step(default_model, prompts, reference):
    # Dense attention reads every block in every pass (a layer and KV head): the counts
    # must add up to passes x the blocks of each decode step's context, and the hits to
    # the resident share.
    (out,), s, _ = run_closed(small_l1(default_model, l1_blocks=12, l2_slots=40), [prompts[0]])
    p = s["predictor"]
    assert out.token_ids == reference[0]
    c = default_model.model_config
    passes = c["num_layers"] * c["num_kv_heads"]
    n = len(prompts[0])
    # The first token comes from the prompt step; decode step i computes token n + i - 1
    # and reads a context of n + i tokens.
    blocks = sum(-(-(n + i) // BLOCK) for i in range(1, NEW_TOKENS))
    assert p["reads_l1"] + p["reads_lower"] == passes * blocks
    # L1 holds 12 blocks, one of them the block being written: at most 12 of each step's
    # blocks are hits, at least the first and the newest.
    assert passes * 2 * (NEW_TOKENS - 1) <= p["reads_l1"] <= passes * 12 * (NEW_TOKENS - 1)


def test_predictor_thresholds_are_checked_and_need_cold_blocks():
    with pytest.raises(errors.ConfigError, match="predictor_decay"):
        K25Config(cache_mode="hierarchical", enable_async_offload=True, predictor_decay=1.0)
    with pytest.raises(errors.ConfigError, match="predictor_max_moves"):
        K25Config(cache_mode="hierarchical", enable_async_offload=True, predictor_max_moves=-1)
    with pytest.raises(errors.ConfigError, match="predictor_max_entropy"):
        K25Config(cache_mode="hierarchical", enable_async_offload=True, predictor_max_entropy=1.5)
    with pytest.raises(errors.ConfigError, match="predictor_margin"):
        K25Config(predictor_margin=0.5)  # no tiers, so no cold blocks to predict for
    with pytest.raises(errors.ConfigError, match="predictor_promote_heat"):
        K25Config(cache_mode="hierarchical", enable_async_offload=True, enable_kernel_fusion=False,
                  predictor_promote_heat=0.3)


def test_a_failure_releasing_kv_costs_neither_the_output_nor_the_engine(default_model, prompts):
    # An engine bug while a request's KV is let go (here injected into the tiers' release)
    # is logged and recorded as a KV event; the request still ends as it would have, on the
    # step path and on the abort path (which runs outside a step), and the engine serves on.
    short = prompts[1][:150]
    want = default_model.generate([short], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
    model = small_l1(default_model, l1_blocks=12, l2_slots=40)
    try:
        model._engine.fail_next_kv_release_for_test()
        out = model.generate([short], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
        assert out.token_ids == want.token_ids and out.finish_reason == "length"
        assert [e[2] for e in model.drain_kv_events()].count("release_error") == 1

        async def first_tokens():
            async for ev in model.stream_events(short, max_new_tokens=400, ignore_eos=True, temperature=0.0):
                if ev.token_ids:
                    return ev.token_ids  # closing the stream aborts the request

        model._engine.fail_next_kv_release_for_test()
        assert asyncio.run(first_tokens())
        deadline = time.monotonic() + 30
        events = []
        while "release_error" not in [e[2] for e in events] and time.monotonic() < deadline:
            time.sleep(0.05)
            events += model.drain_kv_events()
        assert "release_error" in [e[2] for e in events] and "abort" in [e[2] for e in events]
        again = model.generate([short], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
        assert again.token_ids == want.token_ids
        s = model.stats()
        assert s["running"] == 0 and s["blocks_used"] == 0 and s["requests_aborted"] == 1
    finally:
        model.close()


@pytest.mark.parametrize("l1_blocks,prefix,piped", [(24, False, False), (30, True, False), (30, True, True)])
def test_cold_blocks_promotions_and_swaps_together_give_the_all_resident_tokens(default_model, prompts, l1_blocks,
                                                                               prefix, piped):
    # Three requests (two sharing a prefix) on an L1 that none of the long ones fits next to
    # the others: preemption by swap, cold blocks, the predictor's promotions and (with
    # prefix caching) spilled prefix blocks all happen in one run. Oracle: the same batch on
    # a pool that holds everything.
    tok = default_model.tokenizer
    a = prompts[0]
    b = a[:200] + prompts[1][:250]
    c = tok.encode(long_text()[30000:36000])[:380]
    roomy = K25Model(K25Config(num_threads=2, kv_cache_bytes=200 * default_model.kv_block_bytes, block_size=BLOCK,
                               prefill_chunk_size=64, max_num_batched_tokens=96, **SPARSE))
    try:
        want = [o.token_ids for o in roomy.generate([a, b, c], max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                   temperature=0.0)]
    finally:
        roomy.close()
    # piped: decode steps pipelined (K25_ASYNC_SCHEDULING=1, below) between the others.
    make = lambda: small_l1(default_model, l1_blocks=l1_blocks, l2_slots=120,  # noqa: E731
                            enable_prefix_caching=prefix, **EAGER, **SPARSE)
    outs, s, tiers = run_closed(pipelined(make) if piped else make(), [a, b, c])
    assert (s["pipelined_steps"] > 0) == piped
    for i, (o, w) in enumerate(zip(outs, want)):
        assert o.token_ids == w, f"request {i} differs"
    assert s["preemptions"] > 0 and s["swap_outs"] == s["swap_ins"] > 0
    assert s["cold_demotes"] > 0 and s["cold_promotions"] > 0
    assert s["blocks_used"] == 0 and s["cold_blocks"] == 0
    # What the tiers still hold is cached prefix blocks only.
    assert tiers["l2_blocks"] + tiers["l3_blocks"] == s["prefix_tier_blocks"]
    assert prefix or s["prefix_tier_blocks"] == 0


def pipelined(fn):
    """fn() with K25_ASYNC_SCHEDULING=1 while it builds its model: the CPU executor then runs
    the engine's pipelined decode (each launched step at once, its results held until
    collected; test_async_scheduling.py)."""
    old = os.environ.get("K25_ASYNC_SCHEDULING")
    os.environ["K25_ASYNC_SCHEDULING"] = "1"
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("K25_ASYNC_SCHEDULING")
        else:
            os.environ["K25_ASYNC_SCHEDULING"] = old


def test_pipelined_decode_with_cold_blocks_gives_the_tokens_and_observes_every_step(default_model, prompts,
                                                                                    reference):
    # Decode steps with tiers are pipelined too, the steps that open a block by demoting
    # one included (Scheduler::decode_step_fits); the predictor sees each launched step's reads
    # when it is collected: every decode step's, once.
    model = pipelined(lambda: small_l1(default_model, l1_blocks=12, l2_slots=40))
    (out,), s, _ = run_closed(model, [prompts[0]])
    assert out.token_ids == reference[0]
    c = default_model.model_config
    passes = c["num_layers"] * c["num_kv_heads"]
    n = len(prompts[0])
    blocks = sum(-(-(n + i) // BLOCK) for i in range(1, NEW_TOKENS))
    assert s["predictor"]["reads_l1"] + s["predictor"]["reads_lower"] == passes * blocks
    # Every decode step, also the one that opens a block at position 608 (on the full L1 it
    # demotes one to get it); only the prompt's steps ran unpipelined.
    assert n % BLOCK + NEW_TOKENS - 1 > BLOCK
    assert s["pipelined_steps"] == NEW_TOKENS - 1
    assert s["cold_demotes"] >= 27 and s["preemptions"] == 0


def test_pipelined_decode_with_sparsity_and_promotions_gives_the_all_resident_tokens(default_model, prompts):
    want = all_resident_sparse_tokens(default_model, prompts[0], **SPARSE)
    model = pipelined(lambda: small_l1(default_model, l1_blocks=12, l2_slots=40, **EAGER, **SPARSE))
    (out,), s, tiers = run_closed(model, [prompts[0]])
    assert out.token_ids == want
    p = s["predictor"]
    # Every decode step, also one that opens a block while a promotion's copy is still on its
    # way (its L1 block counts as the sequence's: Scheduler::l1_blocks_held).
    assert s["pipelined_steps"] == NEW_TOKENS - 1
    assert p["exchanges"] > 0 and s["cold_promotions"] > 0 and 0 < p["hit_rate"] < 1
    assert s["preemptions"] == 0 and s["blocks_used"] == 0 and tiers["l2_blocks"] == 0
