"""Cold KV blocks on CUDA (tiered KV, issue #6 use (a)): a sequence longer than the device
pool moves some of its computed blocks to L2 (pinned host memory, mapped) and keeps
running; the attention kernels read those blocks in place over the bus. The oracle is the
same prompt on a device pool that holds everything, with the same prefill chunking.

Covers every kernel that reads KV through a block table: float32 (CUDA-core prefill and
decode kernels), bf16 at head_dim 64 (mma.sync prefill, tensor-core decode) and at 128
(the wgmma prefill kernel on Hopper, tensor-core decode); with dynamic sparsity, the device
selection ranks cold blocks by the summaries they took to L2.
"""
import pytest

from k25 import K25Config, K25Model, _C, errors

from oracles import write_random_checkpoint
from test_cuda_model import BF16_NEAR_TIE, prompt_for

NEW_TOKENS = 20
BLOCK = 16
PROMPT = 600


@pytest.fixture(scope="module", params=[64, 128])
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"cold{request.param}")
    write_random_checkpoint(d, "llama3", hidden_size=8 * request.param, num_attention_heads=8,
                            intermediate_size=1024, head_dim=request.param, initializer_range=0.15)
    return str(d)


def common(model_dir, dtype):
    return dict(model_path=model_dir, device="cuda", dtype=dtype, block_size=BLOCK, prefill_chunk_size=64,
                max_num_batched_tokens=96, max_batch_size=4)


def make_prompts(model_dir, dtype, specs):
    """Prompts of the checkpoint's vocabulary, one per (length, seed), and its KV block bytes."""
    m0 = K25Model(K25Config(kv_cache_bytes=1 << 26, **common(model_dir, dtype)))
    try:
        return [prompt_for(m0, n, seed=seed) for n, seed in specs], m0.kv_block_bytes
    finally:
        m0.close()


def reference(model_dir, dtype, prompts):
    plain = K25Model(K25Config(kv_cache_bytes=1 << 28, **common(model_dir, dtype)))
    try:
        outs = plain.generate(prompts, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
        return outs, plain.kv_block_bytes
    finally:
        plain.close()


def small_l1(model_dir, dtype, per_block, l1_blocks, l2_slots, **kw):
    return K25Model(K25Config(kv_cache_bytes=l1_blocks * per_block, cache_mode="hierarchical",
                              enable_async_offload=True, l2_bytes=l2_slots * _C.kv_page_bytes(per_block),
                              **common(model_dir, dtype), **kw))


def same_tokens(got, want, dtype):
    """float32: equal. bf16: equal up to the first divergence, which must be at a near-tie of
    the reference's top two (a cold run's prefill chunks can differ from the reference's)."""
    if dtype == "float32":
        assert got.token_ids == want.token_ids
        return
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if a != b:
            gap = abs(want.logprobs[i].top.get(a, -1e9) - want.logprobs[i].logprob)
            assert gap <= BF16_NEAR_TIE, f"diverged at token {i}, logprob gap {gap}"
            return
    assert len(got.token_ids) == len(want.token_ids)


@pytest.mark.parametrize("dtype,l1_blocks", [("float32", 12), ("bfloat16", 12), ("float32", 8)])
def test_a_sequence_three_times_longer_than_the_device_pool_reads_cold_blocks_in_l2(model_dir, dtype, l1_blocks):
    """l1_blocks=8: with prompt chunks of 4 blocks, a block the previous step wrote is demoted
    at the start of the next step, which the host does not wait for (no sampling): the copy
    must wait for that step's kernels on the device."""
    (prompt,), _ = make_prompts(model_dir, dtype, [(PROMPT, 7)])
    (want,), per_block = reference(model_dir, dtype, [prompt])
    need = -(-(PROMPT + NEW_TOKENS) // BLOCK)  # 39 blocks
    m = small_l1(model_dir, dtype, per_block, l1_blocks=l1_blocks, l2_slots=need)
    try:
        got = m.generate([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)[0]
        s = m.stats()
        tiers = m.tier_stats()
    finally:
        m.close()
    same_tokens(got, want, dtype)
    # Every block past what the pool holds went to L2, and stayed readable there: nothing
    # was recomputed.
    assert s["cold_demotes"] >= need - l1_blocks
    assert tiers["offloads_to_l2"] >= s["cold_demotes"]
    assert s["preemptions"] == 0 and s["prefill_tokens"] == PROMPT


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prefetch", ["0", "8", None])
def test_dense_steps_gather_their_cold_blocks_a_layer_ahead_or_read_them_in_place(model_dir, dtype, prefetch,
                                                                                 monkeypatch):
    """Cold entries gathered into device memory a layer ahead (the default), read in place over the
    bus (K25_COLD_PREFETCH=0), or both in one request (=8: at most 8 entries a step are gathered;
    later steps have more cold blocks, which makes them eager and read in place): the same tokens
    as the all-resident run, and cold_gathered says which path ran."""
    if prefetch is not None:
        monkeypatch.setenv("K25_COLD_PREFETCH", prefetch)
    (prompt,), _ = make_prompts(model_dir, dtype, [(PROMPT, 11)])
    (want,), per_block = reference(model_dir, dtype, [prompt])
    need = -(-(PROMPT + NEW_TOKENS) // BLOCK)
    m = small_l1(model_dir, dtype, per_block, l1_blocks=12, l2_slots=need)
    try:
        got = m.generate([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)[0]
        s = m.stats()
    finally:
        m.close()
    same_tokens(got, want, dtype)
    cold = need - 12  # cold entries of the last steps
    assert s["cold_demotes"] >= cold
    if prefetch == "0":
        assert s["cold_gathered"] == 0
    elif prefetch == "8":
        # Prefill steps with up to 8 cold blocks gathered them; none of the decode steps did.
        assert 0 < s["cold_gathered"] <= 8 * (PROMPT // 64)
    else:
        # The decode steps gathered theirs (the prefill chunks alone gather fewer than half this).
        assert s["cold_gathered"] >= (cold // 2) * (NEW_TOKENS - 1)


def test_two_long_sequences_on_the_gpu_share_the_pool_by_preemption_and_cold_blocks(model_dir):
    prompts, _ = make_prompts(model_dir, "float32", [(PROMPT, 8), (300, 9)])
    want, per_block = reference(model_dir, "float32", prompts)
    m = small_l1(model_dir, "float32", per_block, l1_blocks=12, l2_slots=80)
    try:
        got = m.generate(prompts, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        s = m.stats()
    finally:
        m.close()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"prompt {i} differs"
    assert s["cold_demotes"] > 0


SPARSE = dict(enable_dynamic_sparsity=True, sparsity_min_context=256, sparsity_recent_blocks=4)


def sparse_reference(model_dir, seed, dtype="float32"):
    """A prompt of the checkpoint's vocabulary, its KV block bytes, and its greedy output (with
    the top-2 logprobs) and skipped share with SPARSE on a device pool that holds everything."""
    m0 = K25Model(K25Config(kv_cache_bytes=1 << 26, **common(model_dir, dtype), **SPARSE))
    try:
        prompt = prompt_for(m0, PROMPT, seed=seed)
        want = m0.generate([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)[0]
        return prompt, m0.kv_block_bytes, want, m0.get_current_sparsity_ratio()
    finally:
        m0.close()


# float32 ranks by the Quest bound, bfloat16 by the key codes (each dtype's default rule on CUDA),
# whose summary rows are 4-5x as wide (the 2-bit codes of every key): both travel with a block that goes cold.
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_with_dynamic_sparsity_cold_blocks_are_ranked_by_the_summaries_they_left_with(model_dir, dtype):
    """Sparsity on in both runs (the device selection, from 256 tokens on, 4 recent blocks):
    a block that goes cold takes its key summaries to its L2 slot's rows, so the cold run
    ranks every block as the all-resident run does, reads the kept cold blocks in L2, and
    gives the same tokens (float32; bf16 up to a near-tie, see same_tokens) with the same share
    of blocks skipped. The predictor sees the device selection's reads: as many as the
    selections kept, some of them in L2; and with promotions allowed it brings the hottest cold
    blocks back, tokens unchanged."""
    prompt, per_block, want, want_ratio = sparse_reference(model_dir, seed=10, dtype=dtype)
    need = -(-(PROMPT + NEW_TOKENS) // BLOCK)
    for moves in (0, 2):
        m = small_l1(model_dir, dtype, per_block, l1_blocks=12, l2_slots=need, predictor_max_moves=moves,
                     predictor_promote_heat=0.3, **SPARSE)
        try:
            got = m.generate([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)[0]
            s = m.stats()
            ratio = m.get_current_sparsity_ratio()
        finally:
            m.close()
        assert want_ratio > 0.1  # the selection skipped blocks
        same_tokens(got, want, dtype)
        diverged = got.token_ids != want.token_ids
        assert s["cold_demotes"] >= need - 12 and s["preemptions"] == 0
        p = s["predictor"]
        # Every decode step's selection kept fewer than all blocks (the ratio is clamped to
        # >= 0.1 skipped), so the reads the tables gave the predictor are the kept blocks the
        # selection statistics count, by another path (count_kernel's sums).
        kept = sum(l["blocks_total"] - l["blocks_skipped"] for l in s["sparsity_layers"])
        assert p["reads_l1"] + p["reads_lower"] == kept > 0
        assert p["reads_lower"] > 0 and p["reads_l1"] > 0, "some kept blocks were cold, most resident"
        assert p["reads_l2"] == p["reads_lower"] and p["reads_l3"] == 0
        assert p["steps"] == NEW_TOKENS - 1  # every decode step observed with sparse reads
        # ... though every decode step was pipelined (graphs), those that demote included: the
        # predictor saw each one's reads when it was collected, from that step's own buffer.
        assert s["pipelined_steps"] == NEW_TOKENS - 1
        if moves == 0:
            # (After a bf16 near-tie the decodes differ, and so may their selections.)
            assert ratio == (pytest.approx(want_ratio, abs=0.02) if diverged else pytest.approx(want_ratio))
            assert p["promotions"] == 0
        else:
            assert p["promotions"] > 0, "hot cold blocks came back"



def test_the_next_request_after_a_cold_run_starts_cleanly(model_dir):
    """A request that ends right after a step that demoted a block (its copy's callback may land
    after the request freed the key) leaves nothing that fails the next request's steps: the
    same prompt twice on one tiered model gives the same tokens, with cold blocks both times."""
    (prompt,), per_block = make_prompts(model_dir, "float32", [(PROMPT, 11)])
    need = -(-(PROMPT + NEW_TOKENS) // BLOCK)
    # No prefix caching: the second request computes (and demotes) everything again.
    m = small_l1(model_dir, "float32", per_block, l1_blocks=12, l2_slots=need, enable_prefix_caching=False)
    try:
        first = m.generate([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)[0]
        demotes = m.stats()["cold_demotes"]
        second = m.generate([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)[0]
        s = m.stats()
    finally:
        m.close()
    assert first.finish_reason == second.finish_reason == "length"
    assert second.token_ids == first.token_ids
    assert demotes >= need - 12 and s["cold_demotes"] >= 2 * (need - 12)
    assert s["requests_failed"] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_with_a_small_l2_cold_blocks_go_to_l3_and_each_step_stages_them_a_layer_at_a_time(model_dir, dtype,
                                                                                          tmp_path):
    """L2 of 4 slots (2 of them staging for L3): most cold blocks go to the L3 file. A step with
    cold blocks in L3 runs eagerly: before each layer's attention the host has read that
    layer's slice of every L3 block (and copied every L2 one) into mapped pinned memory, and
    the kernels read the blocks there; tokens as the all-resident run's. Without L3 the same
    request is refused."""
    (prompt,), _ = make_prompts(model_dir, dtype, [(PROMPT, 12)])
    (want,), per_block = reference(model_dir, dtype, [prompt])
    need = -(-(PROMPT + NEW_TOKENS) // BLOCK)  # 39 blocks
    page = _C.kv_page_bytes(per_block)
    l3 = dict(l3_path=str(tmp_path / "l3.bin"), l3_bytes=need * page)
    m = small_l1(model_dir, dtype, per_block, l1_blocks=12, l2_slots=4, **l3)
    try:
        got = m.generate([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)[0]
        s = m.stats()
        tiers = m.tier_stats()
    finally:
        m.close()
    same_tokens(got, want, dtype)
    assert s["preemptions"] == 0 and s["prefill_tokens"] == PROMPT
    assert tiers["offloads_to_l3"] >= need - 12 - 2
    assert tiers["l3_slice_reads"] >= tiers["offloads_to_l3"] and tiers["failures"] == 0
    assert tiers["l3_blocks"] == 0 and s["blocks_used"] == 0
    m = small_l1(model_dir, dtype, per_block, l1_blocks=12, l2_slots=4)
    try:
        with pytest.raises(errors.ResourceExhaustedError, match="the KV pool and L2 hold 16 blocks"):
            m.generate([prompt], max_new_tokens=NEW_TOKENS)
    finally:
        m.close()


@pytest.mark.parametrize("selective", [None, "0"])
def test_with_dynamic_sparsity_cold_blocks_in_l3_are_read_where_the_device_selection_keeps_them(
        model_dir, tmp_path, monkeypatch, selective):
    """Sparsity on (the device selection) with most cold blocks in L3: a staged step ranks its
    cold entries by the summaries they took down (an L3 block's copied to the host when it left,
    an L2 one's from its slot's rows), and each layer reads, after its selection, the L3 blocks
    its kept tables name that were not read ahead (the previous lane step's kept ones are). The
    tokens and the skipped share are the all-resident sparse run's (float32), every L3 read is
    one a selection kept, and the predictor sees the kept blocks as its reads. With
    K25_L3_SELECTIVE=0 every layer of every L3 block is read ahead, as without sparsity."""
    if selective:
        monkeypatch.setenv("K25_L3_SELECTIVE", selective)
    prompt, per_block, want, want_ratio = sparse_reference(model_dir, seed=13)
    need = -(-(PROMPT + NEW_TOKENS) // BLOCK)
    page = _C.kv_page_bytes(per_block)
    m = small_l1(model_dir, "float32", per_block, l1_blocks=12, l2_slots=4, l3_path=str(tmp_path / "l3.bin"),
                 l3_bytes=need * page, predictor_max_moves=0, **SPARSE)
    try:
        got = m.generate([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)[0]
        ratio = m.get_current_sparsity_ratio()
        s = m.stats()
        tiers = m.tier_stats()
    finally:
        m.close()
    assert want_ratio > 0.1  # the selection skipped blocks
    assert got.token_ids == want.token_ids
    assert ratio == pytest.approx(want_ratio)
    assert s["preemptions"] == 0 and s["lane_steps"] >= NEW_TOKENS - 1
    assert tiers["offloads_to_l3"] >= need - 12 - 2 and tiers["failures"] == 0
    kept = sum(l["blocks_total"] - l["blocks_skipped"] for l in s["sparsity_layers"])
    p = s["predictor"]
    assert p["reads_l1"] + p["reads_lower"] == kept > 0 and p["reads_l3"] > 0
    read, skipped, late = s["l3_halves_read"], s["l3_halves_skipped"], s["l3_halves_late"]
    if selective == "0":
        assert read == skipped == late == 0 and tiers["l3_slice_reads"] > 0
        return
    # A layer slice read is both halves of it (K and V); the prompt's steps read whole layers.
    assert tiers["l3_slice_reads"] * 2 == read and skipped > 0
    # Reads after a layer's selection: the first lane step's, and what a selection newly keeps.
    assert 0 < late < read
    assert tiers["l3_blocks"] == 0 and s["blocks_used"] == 0


def test_corrupted_l3_pages_on_the_gpu_are_recomputed_and_the_tokens_stay_right(model_dir, tmp_path):
    """The fault path with the staged reads: two pages written to L3 get a byte flipped on disk;
    the layer slice read back fails its checksum, the step reads zeros for that block, and the
    sequence drops the step and recomputes. float32: the all-resident run's tokens exactly."""
    (prompt,), _ = make_prompts(model_dir, "float32", [(PROMPT, 12)])
    (want,), per_block = reference(model_dir, "float32", [prompt])
    page = _C.kv_page_bytes(per_block)
    m = small_l1(model_dir, "float32", per_block, l1_blocks=12, l2_slots=4, l3_path=str(tmp_path / "l3.bin"),
                 l3_bytes=60 * page)
    try:
        m._engine.corrupt_next_l3_writes_for_test(2)
        got = m.generate([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)[0]
        s, tiers, events = m.stats(), m.tier_stats(), m.drain_kv_events()
    finally:
        m.close()
    assert got.token_ids == want.token_ids
    assert tiers["faults"]["checksum_mismatch"] >= 1 and "checksum_mismatch" in {e[2] for e in events}
    assert s["prefill_tokens"] > PROMPT  # recomputed
    assert tiers["l3_blocks"] == 0 and s["blocks_used"] == 0


def test_a_request_beside_an_l3_lane_step_on_the_gpu_is_not_held_up_by_the_disk(model_dir, tmp_path):
    """As tests/python/test_cold_l3.py's test of the lane: each layer's L3 reads held 2 s (a slow
    disk), so one lane step of the long request (3 layers, staged two at a time) lasts >= 4 s;
    the short request, running first in one block of 64 tokens, ends while the first one runs."""
    from test_cold_l3 import beside
    (short_prompt, long_prompt), per_block16 = make_prompts(model_dir, "float32", [(12, 3), (PROMPT, 12)])
    cfg = dict(common(model_dir, "float32"), block_size=64, prefill_chunk_size=256, max_num_batched_tokens=288)
    plain = K25Model(K25Config(kv_cache_bytes=1 << 28, **cfg))
    try:
        want_short = plain.generate([short_prompt], max_new_tokens=48, temperature=0.0, ignore_eos=True)[0]
        want_long = plain.generate([long_prompt], max_new_tokens=1, temperature=0.0, ignore_eos=True)[0]
    finally:
        plain.close()
    page = _C.kv_page_bytes(4 * per_block16)
    m = K25Model(K25Config(kv_cache_bytes=6 * 4 * per_block16, cache_mode="hierarchical", enable_async_offload=True,
                           l2_bytes=4 * page, l3_path=str(tmp_path / "l3.bin"), l3_bytes=20 * page, **cfg))
    try:
        m._engine.delay_l3_reads_for_test(2.0)
        _, short_ids, long_ids, (reads, lane_steps) = beside(
            m, short_prompt, 48, long_prompt, 1,
            at_short_end=lambda: (m.tier_stats()["l3_slice_reads"], m.stats()["lane_steps"]))
        s, tiers = m.stats(), m.tier_stats()
    finally:
        m.close()
    assert short_ids == want_short.token_ids and long_ids == want_long.token_ids
    assert reads > 0 and lane_steps == 0, (reads, lane_steps)
    assert s["lane_steps"] >= 1 and tiers["l3_blocks"] == 0 and s["blocks_used"] == 0
