"""Cold blocks in L3 (tiered KV, issue #6 use (a), CPU backend).

A sequence longer than L1 plus L2's resident slots keeps running: when L2 is full its cold
blocks go to the L3 file, and every step of it reads their layers back while it runs (in the
L3 lane, a layer at a time between the other requests' steps; reads run ahead of the layers,
each layer's bytes checked against a checksum taken when the page was written). The
oracle is the same prompt on a pool that holds everything: the tokens must be equal.
A page that comes back wrong makes the sequence recompute; the output stays right.
"""
import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest

from k25 import K25Config, K25Model, _C, errors

from test_cold_blocks import long_prompts, pipelined

NEW_TOKENS = 20
BLOCK = 16
L1_BLOCKS = 12
L2_SLOTS = 4  # two of them staging for L3: two resident cold blocks at most


@pytest.fixture(scope="module")
def prompts(default_model):
    return long_prompts(default_model.tokenizer)


@pytest.fixture(scope="module")
def reference(default_model, prompts):
    outs = default_model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
    return [o.token_ids for o in outs]


def with_l3(default_model, tmp_path, l3_pages=80, l2_slots=L2_SLOTS, **kw):
    per_block = default_model.kv_block_bytes
    page = _C.kv_page_bytes(per_block)
    l3 = dict(l3_path=str(tmp_path / "l3.bin"), l3_bytes=l3_pages * page) if l3_pages else {}
    return K25Model(K25Config(num_threads=2, kv_cache_bytes=L1_BLOCKS * per_block, block_size=BLOCK,
                              prefill_chunk_size=64, max_num_batched_tokens=96, max_batch_size=4,
                              cache_mode="hierarchical", enable_async_offload=True, l2_bytes=l2_slots * page,
                              **l3, **kw))


def run(model, batch):
    try:
        outs = model.generate(batch, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        return outs, model.stats(), model.tier_stats(), model.drain_kv_events()
    finally:
        model.close()


def test_a_sequence_longer_than_l1_and_l2_runs_with_cold_blocks_in_l3(default_model, prompts, reference, tmp_path):
    # 600 + 20 tokens are 39 blocks: 12 in L1, 2 resident in L2, the rest cold in L3.
    blocks = -(-(len(prompts[0]) + NEW_TOKENS) // BLOCK)
    assert blocks > L1_BLOCKS + L2_SLOTS
    outs, s, tiers, events = run(with_l3(default_model, tmp_path), [prompts[0]])
    assert outs[0].token_ids == reference[0]
    assert s["preemptions"] == 0 and s["prefill_tokens"] == len(prompts[0])  # nothing recomputed
    assert s["cold_demotes"] >= blocks - L1_BLOCKS
    # Every block past L1 and L2's two resident slots went to L3 and was read back, layer by
    # layer, in every step after (30 layers of the default model).
    assert tiers["offloads_to_l3"] >= blocks - L1_BLOCKS - 2
    assert tiers["l3_slice_reads"] >= 30 * tiers["offloads_to_l3"]
    assert tiers["bytes_from_l3"] > 0 and tiers["failures"] == 0
    assert tiers["l2_blocks"] == 0 and tiers["l3_blocks"] == 0  # every copy freed at the end
    assert s["blocks_used"] == 0 and not events
    # The predictor counts every decode read (dense: each block in every pass) by the tier
    # that served it: two cold blocks stayed in L2, the rest were read back from L3.
    p = s["predictor"]
    c = default_model.model_config
    passes = c["num_layers"] * c["num_kv_heads"]
    n = len(prompts[0])
    read = sum(-(-(n + i) // BLOCK) for i in range(1, NEW_TOKENS))
    assert p["reads_l1"] + p["reads_l2"] + p["reads_l3"] == passes * read
    assert 0 < p["reads_l2"] < p["reads_l3"] and p["reads_lower"] == p["reads_l2"] + p["reads_l3"]


def test_without_l3_the_same_request_is_refused_naming_the_sizes(default_model, prompts, tmp_path):
    model = with_l3(default_model, tmp_path, l3_pages=0)  # no staging slots then: 4 resident
    try:
        with pytest.raises(errors.ResourceExhaustedError, match="the KV pool and L2 hold 16 blocks"):
            model.generate([prompts[0]], max_new_tokens=NEW_TOKENS)
    finally:
        model.close()
    model = with_l3(default_model, tmp_path, l3_pages=10)
    try:
        with pytest.raises(errors.ResourceExhaustedError, match="the KV pool, L2 and L3 hold 24 blocks.*l3_bytes"):
            model.generate([prompts[0]], max_new_tokens=NEW_TOKENS)
    finally:
        model.close()


def test_two_long_sequences_with_cold_blocks_in_l3_give_the_all_resident_tokens(default_model, prompts, reference,
                                                                                tmp_path):
    outs, s, tiers, _ = run(with_l3(default_model, tmp_path, l3_pages=120), prompts)
    assert [o.token_ids for o in outs] == reference
    assert tiers["l3_slice_reads"] > 0 and tiers["failures"] == 0
    assert tiers["l3_blocks"] == 0 and s["blocks_used"] == 0


SPARSE = dict(enable_dynamic_sparsity=True, sparsity_min_context=128, sparsity_recent_blocks=2,
              max_sparsity_ratio=0.8, sparsity_mass_target=0.5, sparsity_score_channels=8)


def all_resident(default_model, prompt, **kw):
    """The oracle of a tiered run with other settings (kw): the prompt's greedy output on a pool
    that holds all of it."""
    roomy = K25Model(K25Config(num_threads=2, kv_cache_bytes=48 * default_model.kv_block_bytes, block_size=BLOCK,
                               prefill_chunk_size=64, max_num_batched_tokens=96, **kw))
    try:
        return roomy.generate([prompt], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
    finally:
        roomy.close()


@pytest.mark.parametrize("channels,selective", [(0, None), ("codes", None), (8, "1"), (8, None)])
def test_cold_blocks_in_l3_with_dynamic_sparsity_read_only_what_the_selection_needs(default_model, prompts,
                                                                                    tmp_path, monkeypatch,
                                                                                    channels, selective):
    # Selective reads: each layer of an L3 page has a checksummed K half and V half. Ahead of a
    # layer only what its selection reads is read (nothing for the bound rule, the K halves for
    # the channel estimate); after it, the halves of the blocks its attention reads. The tokens
    # are those of an all-resident run, which reads everything from memory. With the channel
    # estimate they are on only with K25_L3_SELECTIVE=1 (they make more reads than whole
    # layers); by default its steps read whole layers ahead. The key-code estimate, like the
    # bound, reads only the summaries.
    if selective:
        monkeypatch.setenv("K25_L3_SELECTIVE", selective)
    if channels == "codes":
        sparse = dict(SPARSE, sparsity_score_channels=0, sparsity_score_rule="codes")
    else:
        sparse = dict(SPARSE, sparsity_score_channels=channels)
    reads_keys = channels not in (0, "codes")
    want = all_resident(default_model, prompts[0], **sparse)
    model = with_l3(default_model, tmp_path, **sparse)
    try:
        out = model.generate([prompts[0]], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
        ratio = model.get_current_sparsity_ratio()
        tiers = model.tier_stats()
        s = model.stats()
    finally:
        model.close()
    assert ratio > 0 and s["preemptions"] == 0 and s["lane_steps"] > 0
    assert out.token_ids == want.token_ids
    assert s["predictor"]["reads_l3"] > 0
    read, skipped, late = s["l3_halves_read"], s["l3_halves_skipped"], s["l3_halves_late"]
    if reads_keys and not selective:
        assert read == skipped == late == 0 and tiers["l3_slice_reads"] > 0  # whole layers, one slice each
        return
    assert tiers["l3_slice_reads"] == read and skipped > 0
    if reads_keys:
        assert skipped <= (read + skipped) // 2  # every K half was read: only V halves were skipped
    else:
        assert skipped > (read + skipped) // 2  # K halves too
    # What a block's last lane step read of it is read ahead in the next, so few halves wait
    # for their layer's selection: here 4% of the reads with the channel estimate and 12% with
    # the bound rule, where without that read-ahead it was 12% and 48% (measured).
    assert 0 < late and late * (10 if reads_keys else 4) < read


def test_corrupted_cold_pages_in_l3_are_recomputed_and_output_stays_correct(default_model, prompts, reference,
                                                                           tmp_path):
    model = with_l3(default_model, tmp_path)
    model._engine.corrupt_next_l3_writes_for_test(2)  # real bytes flipped on disk (in layer 0)
    outs, s, tiers, events = run(model, [prompts[0]])
    assert outs[0].token_ids == reference[0]
    assert tiers["faults"]["checksum_mismatch"] >= 1
    assert "checksum_mismatch" in {e[2] for e in events}
    assert s["prefill_tokens"] > len(prompts[0])  # recomputed from scratch
    assert tiers["l3_blocks"] == 0 and s["blocks_used"] == 0


def test_an_l3_file_cut_short_under_a_running_request_is_a_short_read_and_tokens_stay_right(default_model, prompts,
                                                                                          reference, tmp_path):
    # Another process truncates the L3 file while the request decodes: the next lane step's
    # reads come back short, a fault like a checksum mismatch (logged with its reason), so the
    # sequence recomputes, its pages are written again, and the tokens are the all-resident run's.
    model = with_l3(default_model, tmp_path)
    path = tmp_path / "l3.bin"

    async def decode():
        ids = []
        async for ev in model.stream_events(prompts[0], max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                            temperature=0.0):
            ids.extend(ev.token_ids)
            if len(ids) == 3:
                os.truncate(path, 4096)
        return ids

    try:
        ids = asyncio.run(decode())
        s, tiers, events = model.stats(), model.tier_stats(), model.drain_kv_events()
    finally:
        model.close()
    assert ids == reference[0]
    assert tiers["faults"]["short_read"] >= 1
    assert "short_read" in {e[2] for e in events}
    assert s["prefill_tokens"] > len(prompts[0])  # recomputed
    assert tiers["l3_blocks"] == 0 and s["blocks_used"] == 0


def test_corrupted_cold_pages_with_selective_reads_are_recomputed_and_tokens_stay_right(default_model, prompts,
                                                                                        tmp_path):
    # The same with dynamic sparsity's bound rule: each half of a layer has its own checksum,
    # and a bad half read (here in a prompt step, which reads whole layers) makes the sequence
    # recompute; its tokens are the all-resident sparse run's.
    sparse = dict(SPARSE, sparsity_score_channels=0)
    want = all_resident(default_model, prompts[0], **sparse)
    model = with_l3(default_model, tmp_path, **sparse)
    model._engine.corrupt_next_l3_writes_for_test(2)
    outs, s, tiers, events = run(model, [prompts[0]])
    assert outs[0].token_ids == want.token_ids
    assert tiers["faults"]["checksum_mismatch"] >= 1 and s["l3_halves_skipped"] > 0
    assert s["prefill_tokens"] > len(prompts[0])  # recomputed
    assert tiers["l3_blocks"] == 0 and s["blocks_used"] == 0


def test_a_disk_that_keeps_failing_ends_the_request_with_a_clear_error(default_model, prompts, tmp_path):
    # A file size limit makes every L3 write past page 2 fail (EFBIG, as a full disk fails
    # with ENOSPC): the sequence recomputes a few times, then fails with the reason; the
    # engine stays up and serves a short request after it.
    code = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {str(__import__('os').path.dirname(__file__))!r})
        from k25 import K25Config, K25Model, _C, errors
        from test_cold_blocks import long_prompts
        m = K25Model(K25Config(num_threads=2))
        per_block = m.kv_block_bytes
        tok = m.tokenizer
        m.close()
        page = _C.kv_page_bytes(per_block)
        model = K25Model(K25Config(num_threads=2, kv_cache_bytes={L1_BLOCKS} * per_block, block_size={BLOCK},
                                   prefill_chunk_size=64, max_num_batched_tokens=96, cache_mode="hierarchical",
                                   enable_async_offload=True, l2_bytes={L2_SLOTS} * page,
                                   l3_path={str(tmp_path / 'l3.bin')!r}, l3_bytes=80 * page))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 * page, resource.RLIM_INFINITY))
        prompt = long_prompts(tok)[0]
        try:
            model.generate([prompt], max_new_tokens=4, ignore_eos=True, temperature=0.0)
            error = "no error"
        except errors.EngineError as e:
            error = str(e)
        reasons = [e[2] for e in model.drain_kv_events()]
        short = model.generate([tok.encode("1, 2, 3,")], max_new_tokens=4, temperature=0.0)[0]
        tiers = model.tier_stats()
        model.close()
        print("RESULT", error, "|", reasons.count("no_space"), tiers["faults"]["no_space"], short.finish_reason,
              len(short.token_ids))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    error, rest = line[0][len("RESULT "):].split(" | ")
    events, faults, short_reason, short_len = rest.split()
    assert "L3 failed 4 times for this request (no_space)" in error
    assert int(events) == 4 and int(faults) >= 4
    assert short_reason == "length" and int(short_len) == 4


def test_decode_is_pipelined_only_while_no_cold_block_is_in_l3(default_model, prompts, reference, tmp_path):
    # Pipelined decode (K25_ASYNC_SCHEDULING=1: the CPU executor emulates the launches) and an
    # L3 configured for cold blocks: a step that reads (or could demote to) L3 runs inside
    # execute(), so with most cold blocks in L3 no decode step is pipelined; with L2 room for
    # every cold block the same L3 configuration pipelines them all.
    outs, s, tiers, _ = run(pipelined(lambda: with_l3(default_model, tmp_path)), [prompts[0]])
    assert outs[0].token_ids == reference[0]
    assert tiers["l3_slice_reads"] > 0 and s["pipelined_steps"] == 0
    outs, s, tiers, _ = run(pipelined(lambda: with_l3(default_model, tmp_path, l2_slots=40)), [prompts[0]])
    assert outs[0].token_ids == reference[0]
    assert tiers["l3_slice_reads"] == 0 and s["cold_demotes"] >= 27
    assert s["pipelined_steps"] == NEW_TOKENS - 1


def test_corrupted_cold_pages_with_prefix_caching_keep_both_requests_right(default_model, prompts, reference,
                                                                           tmp_path):
    # With prefix caching on, the blocks a spoiled step filled hold KV computed from zeros;
    # the engine ends the step for that sequence before complete_step, so they are never
    # offered to the cache. (This test checks the outputs of the recompute and of a second
    # request with the same prompt; it does not tell the two orders apart: the prefix chain
    # breaks at the first cold block, so match_prefix never reaches the spoiled step's
    # blocks in this configuration.)
    model = with_l3(default_model, tmp_path, enable_prefix_caching=True)
    model._engine.corrupt_next_l3_writes_for_test(2)
    try:
        first = model.generate([prompts[0]], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
        tiers = model.tier_stats()
        again = model.generate([prompts[0]], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
    finally:
        model.close()
    assert tiers["faults"]["checksum_mismatch"] >= 1
    assert first.token_ids == reference[0]
    assert again.token_ids == reference[0]


# A slow disk (tests hold each layer's L3 reads this long): a lane step of 30 layers, its reads
# four layers ahead, then lasts at least 30 / 4 * DELAY_S = 7.5 s, and a step that waited for
# the disk (as every step with L3 reads did before the lane) at least 30 * DELAY_S.
DELAY_S = 1.0


def beside(model, short_prompt, short_new, long_prompt, long_new, at_short_end=lambda: None, timed_from=None):
    """Streams a short request and, from its first token on, a long one beside it. Returns the
    short request's token arrival times and ids, the long one's ids, and what at_short_end()
    gave when the short one ended. With timed_from (a callable), the times are those of the
    tokens that came once it returned true."""
    async def both():
        started = asyncio.Event()
        times, short_ids, long_ids = [], [], []

        async def short():
            async for ev in model.stream_events(short_prompt, max_new_tokens=short_new, ignore_eos=True,
                                                temperature=0.0):
                if timed_from is None or times or timed_from():
                    times.append(time.monotonic())
                short_ids.extend(ev.token_ids)
                started.set()
            return at_short_end()

        async def long():
            await started.wait()
            async for ev in model.stream_events(long_prompt, max_new_tokens=long_new, ignore_eos=True,
                                                temperature=0.0):
                long_ids.extend(ev.token_ids)

        end, _ = await asyncio.gather(short(), long())
        return times, short_ids, long_ids, end

    return asyncio.run(both())


def short_beside_long(default_model, prompts, tmp_path):
    """The two tests below: a short request (48 new tokens, one block of 64 tokens) and the
    long prompts[0] (1 new token), their all-resident outputs, and a tiered model with L1 of 6
    blocks of 64, L2_SLOTS slots and an L3 file, where the long one's cold blocks reach L3."""
    short_prompt = default_model.tokenize("Count with me: 1, 2, 3,")
    want_short = default_model.generate([short_prompt], max_new_tokens=48, ignore_eos=True, temperature=0.0)[0]
    want_long = default_model.generate([prompts[0]], max_new_tokens=1, ignore_eos=True, temperature=0.0)[0]
    assert len(short_prompt) + 48 <= 64
    page = _C.kv_page_bytes(default_model.kv_block_bytes * 4)
    model = K25Model(K25Config(num_threads=2, kv_cache_bytes=6 * 4 * default_model.kv_block_bytes, block_size=64,
                               prefill_chunk_size=256, max_num_batched_tokens=288, max_batch_size=4,
                               cache_mode="hierarchical", enable_async_offload=True, l2_bytes=L2_SLOTS * page,
                               l3_path=str(tmp_path / "l3.bin"), l3_bytes=20 * page))
    return short_prompt, want_short, want_long, model


def test_a_request_beside_a_sequence_reading_l3_is_not_held_up_by_the_disk(default_model, prompts, tmp_path):
    # Blocks of 64 tokens: the short request (11 + 48 tokens) runs first in one block, which
    # it never outgrows (a sequence that needs a block preempts the lowest-ranked one, here
    # the long one, lane step or not). The long one (600 tokens in chunks of 256, 4 blocks:
    # from its second chunk on it needs more than L1's 6 blocks, so it moves some of its own
    # to L2 and L3 rather than preempt itself) then streams its cold blocks from L3 in the
    # lane, and the short request's steps go on between the lane's layers.
    short_prompt, want_short, want_long, model = short_beside_long(default_model, prompts, tmp_path)
    model._engine.delay_l3_reads_for_test(DELAY_S)

    try:
        times, short_ids, long_ids, (reads, lane_steps) = beside(
            model, short_prompt, 48, prompts[0], 1,
            lambda: (model.tier_stats()["l3_slice_reads"], model.stats()["lane_steps"]),
            lambda: model.tier_stats()["l3_slice_reads"] > 0)
        s, tiers = model.stats(), model.tier_stats()
    finally:
        model.close()
    assert short_ids == want_short.token_ids and long_ids == want_long.token_ids
    # The long request's first lane step had begun reading L3 when the short one ended, and had
    # not ended: the short request's last ~45 tokens all came while that one step ran.
    assert reads > 0 and lane_steps == 0, (reads, lane_steps, times)
    assert s["lane_steps"] >= 2
    # Gaps from the first L3 read on (before it, the long prompt's first chunk shares a step
    # with the short request: a compute step, seconds long on a slow CPU, and no disk in it).
    # A step that waited for the lane step's reads would take at least 30 / 4 * DELAY_S.
    assert len(times) >= 10, times
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < 2.0, gaps
    assert tiers["l3_blocks"] == 0 and s["blocks_used"] == 0


def test_a_cold_page_write_to_l3_holds_no_step_and_its_lane_step_reads_after_it(default_model, prompts, tmp_path):
    # The setup above, with a slow disk's writes instead of its reads: every cold page written
    # to L3 counts as written write_delay_s after its demote began. The demote holds its step
    # only until its L1 block is copied out; the lane step that reads the page back starts its
    # reads once it is written, after the others' steps. So the short request's tokens keep
    # coming (no gap near write_delay_s) while a lane step waits for a write, and both requests
    # give their all-resident tokens. Were the step to wait for the write, the short request
    # would stall for the whole delay (and no lane start would be deferred).
    write_delay_s = 3.0
    short_prompt, want_short, want_long, model = short_beside_long(default_model, prompts, tmp_path)
    model._engine.delay_l3_writes_for_test(write_delay_s)

    def at_short_end():
        deferred = model.stats()["lane_deferred_starts"]
        model._engine.delay_l3_writes_for_test(0)  # the writes begun after this count as they end
        return deferred

    try:
        times, short_ids, long_ids, deferred = beside(model, short_prompt, 48, prompts[0], 1, at_short_end,
                                                      lambda: model.stats()["cold_demotes"] > 0)
        s, tiers = model.stats(), model.tier_stats()
    finally:
        model.close()
    assert short_ids == want_short.token_ids and long_ids == want_long.token_ids
    assert deferred >= 1, (deferred, times)  # a lane step waited for a write while the short one ran
    # Gaps from the first cold demote on (before it, no write can be waited for, and the long
    # prompt's first chunk shares a step with the short request: seconds on a slow CPU).
    assert len(times) >= 10, times
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < write_delay_s / 2, gaps
    assert tiers["offloads_to_l3"] >= 1 and s["lane_steps"] >= 2
    assert tiers["l3_blocks"] == 0 and s["blocks_used"] == 0


def test_a_request_aborted_during_its_lane_step_ends_after_it_and_frees_everything(default_model, prompts,
                                                                                   reference, tmp_path):
    model = with_l3(default_model, tmp_path)
    model._engine.delay_l3_reads_for_test(0.2)

    async def abort_in_lane():
        task = asyncio.ensure_future(consume())
        deadline = time.monotonic() + 120
        while model.tier_stats()["l3_slice_reads"] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        reads = model.tier_stats()["l3_slice_reads"]
        task.cancel()  # closing the stream aborts the request, whose lane step is reading L3
        try:
            await task
        except asyncio.CancelledError:
            pass
        return reads

    async def consume():
        async for _ in model.stream_events(prompts[0], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0):
            pass

    try:
        assert asyncio.run(abort_in_lane()) > 0
        deadline = time.monotonic() + 60
        while model.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        s, tiers = model.stats(), model.tier_stats()
        assert s["running"] == 0 and s["requests_aborted"] == 1
        assert s["lane_deferred_aborts"] == 1  # it came during the lane step, which ended first
        assert s["blocks_used"] == 0 and tiers["l2_blocks"] == 0 and tiers["l3_blocks"] == 0
        model._engine.delay_l3_reads_for_test(0)
        again = model.generate([prompts[0]], max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)[0]
    finally:
        model.close()
    assert again.token_ids == reference[0]


def test_a_sequence_preempted_during_its_lane_step_drops_the_step_and_recomputes(default_model, prompts, tmp_path):
    # Blocks of 16: the short request, ranked first, needs a block every 16 tokens; with L1 full
    # of the long one's blocks it preempts the long one, whose lane step (reading L3 slowly) is
    # dropped first (Scheduler::set_lane_cancel). Both requests still give their tokens.
    short_prompt = default_model.tokenize("Count with me: 1, 2, 3,")
    want_short = default_model.generate([short_prompt], max_new_tokens=48, ignore_eos=True, temperature=0.0)[0]
    want_long = default_model.generate([prompts[1]], max_new_tokens=2, ignore_eos=True, temperature=0.0)[0]
    page = _C.kv_page_bytes(default_model.kv_block_bytes)
    model = K25Model(K25Config(num_threads=2, kv_cache_bytes=L1_BLOCKS * default_model.kv_block_bytes,
                               block_size=BLOCK, prefill_chunk_size=128, max_num_batched_tokens=160, max_batch_size=4,
                               cache_mode="hierarchical", enable_async_offload=True, l2_bytes=L2_SLOTS * page,
                               l3_path=str(tmp_path / "l3.bin"), l3_bytes=80 * page))
    model._engine.delay_l3_reads_for_test(0.2)
    try:
        _, short_ids, long_ids, _ = beside(model, short_prompt, 48, prompts[1], 2)
        s, tiers, events = model.stats(), model.tier_stats(), model.drain_kv_events()
    finally:
        model.close()
    assert short_ids == want_short.token_ids and long_ids == want_long.token_ids
    assert s["preemptions"] >= 1 and "preempt_recompute" in {e[2] for e in events}
    assert tiers["l3_slice_reads"] > 0 and s["lane_steps"] >= 1
    assert tiers["l3_blocks"] == 0 and tiers["l2_blocks"] == 0 and s["blocks_used"] == 0
