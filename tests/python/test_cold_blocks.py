"""A sequence longer than the primary KV pool (tiered KV, issue #6 use (a), CPU backend).

With cache_mode="hierarchical", a sequence that would have to preempt itself for want of
L1 blocks moves some of its computed blocks to L2 instead ("cold" blocks) and keeps
running: the attention reads them where they lie in L2. The oracle is the same prompt on
a pool that holds everything: the tokens must be equal, nothing may be recomputed, and
every tier copy must be freed at the end.
"""
import threading

import pytest

from k25 import K25Config, K25Model, _C, errors

from oracles import long_text

NEW_TOKENS = 20
BLOCK = 16


@pytest.fixture(scope="module")
def prompts(default_model):
    tok = default_model.tokenizer
    text = long_text()
    return [tok.encode(text[3000:12000])[:600], tok.encode(text[20000:26000])[:300]]


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


def test_a_sequence_three_times_longer_than_l1_gives_the_all_resident_tokens(default_model, prompts, reference):
    need = -(-(len(prompts[0]) + NEW_TOKENS) // BLOCK)  # 39 blocks
    model = small_l1(default_model, l1_blocks=12, l2_slots=need)
    try:
        out = model.generate([prompts[0]], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
        s = model.stats()
        tiers = model.tier_stats()
    finally:
        model.close()
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


def test_without_tiers_a_request_longer_than_the_pool_is_still_refused(default_model, prompts):
    model = K25Model(K25Config(num_threads=2, kv_cache_bytes=12 * default_model.kv_block_bytes, block_size=BLOCK))
    try:
        with pytest.raises(errors.ResourceExhaustedError, match="the KV pool holds 12 blocks"):
            model.generate([prompts[0]], max_new_tokens=NEW_TOKENS)
    finally:
        model.close()


@pytest.mark.parametrize("channels", [8, 0])
def test_cold_blocks_with_dynamic_sparsity_select_like_an_all_resident_run(default_model, prompts, channels):
    # The selection ranks cold blocks by the key summaries saved when they left L1 (the
    # Quest bound, channels=0, ranks by them alone) or reads their keys in L2 (the channel
    # estimate), and attends over the kept ones in L2.
    sparse = dict(enable_dynamic_sparsity=True, sparsity_min_context=128, sparsity_recent_blocks=2,
                  max_sparsity_ratio=0.8, sparsity_mass_target=0.5, sparsity_score_channels=channels)
    roomy = K25Model(K25Config(num_threads=2, kv_cache_bytes=48 * default_model.kv_block_bytes, block_size=BLOCK,
                               prefill_chunk_size=64, max_num_batched_tokens=96, **sparse))
    try:
        want = roomy.generate([prompts[0]], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
        assert roomy.get_current_sparsity_ratio() > 0
    finally:
        roomy.close()
    model = small_l1(default_model, l1_blocks=12, l2_slots=40, **sparse)
    try:
        out = model.generate([prompts[0]], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
        s = model.stats()
        ratio = model.get_current_sparsity_ratio()
    finally:
        model.close()
    assert s["cold_demotes"] >= 27 and s["preemptions"] == 0 and ratio > 0
    assert out.token_ids == want.token_ids
