"""Tiered KV in the engine (cache_mode="hierarchical"): preemption parks a sequence's KV in
L2 host memory and an L3 file, and fetches it back instead of recomputing.

A KV pool too small for the batch forces preemptions; the tokens must equal those of a
run with a pool large enough for everyone (the batch-invariance tests show a request's
tokens do not depend on its batch), and the prompts must be computed exactly once.
"""
import pytest

from k25 import K25Config, K25Model, _C, errors

from oracles import long_text

NEW_TOKENS = 20
BLOCK = 16


def make_prompts(tok):
    text = long_text()
    return [
        tok.encode_chat([{"role": "user", "content": "Name a colour."}]),
        tok.encode(text[3000:12000])[:600],
        tok.encode_chat([{"role": "user", "content": "Write a Python function that reverses a string."}]),
        tok.encode(text[20000:26000])[:300],
        tok.encode("1, 2, 3, 4,"),
    ]


@pytest.fixture(scope="module")
def reference(default_model):
    prompts = make_prompts(default_model.tokenizer)
    outs = default_model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
    return prompts, [o.token_ids for o in outs], default_model.kv_block_bytes


def tiered(tmp_path, per_block, prompts, l2_slots, l3_pages, **kw):
    page = _C.kv_page_bytes(per_block)
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    l3 = dict(l3_path=str(tmp_path / "l3.bin"), l3_bytes=l3_pages * page) if l3_pages else {}
    return K25Model(K25Config(num_threads=2, kv_cache_bytes=(-(-longest // BLOCK) + 2) * per_block,
                              block_size=BLOCK, prefill_chunk_size=64, max_num_batched_tokens=96, max_batch_size=4,
                              cache_mode="hierarchical", enable_async_offload=True, l2_bytes=l2_slots * page,
                              **l3, **kw))


def test_swap_through_l2_and_l3_gives_the_same_tokens_without_recompute(tmp_path, reference):
    prompts, want, per_block = reference
    # Three L2 slots, two of them staging for L3: almost every parked block goes to disk.
    model = tiered(tmp_path, per_block, prompts, l2_slots=3, l3_pages=200)
    try:
        # Every preemption swaps: on a busy box the measured L3 round trip can come out above
        # the recompute estimate, and the engine then (rightly) recomputes one of them; the
        # swap-or-recompute rule has its own test (test_preemption_recomputes_when_that_is_estimated_cheaper).
        model._engine.set_swap_cost_for_test(0.0)
        outs = model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        s = model.stats()
        tiers = model.tier_stats()
        events = model.drain_kv_events()
        assert (tmp_path / "l3.bin").exists()
    finally:
        model.close()
    assert not (tmp_path / "l3.bin").exists()  # created by the tier, removed with it
    for i, (o, w) in enumerate(zip(outs, want)):
        assert o.token_ids == w, f"prompt {i} differs after swapping"
    assert s["preemptions"] > 0 and s["swap_outs"] == s["preemptions"] == s["swap_ins"]
    assert s["swap_fallbacks"] == 0
    assert s["prefill_tokens"] == sum(len(p) for p in prompts)  # nothing recomputed
    assert tiers["offloads_to_l3"] > 0 and tiers["fetches_from_l3"] == tiers["offloads_to_l3"]
    assert tiers["fetches"] == tiers["offloads"] == s["offload_count"] > 0
    assert tiers["bytes_to_l3"] == tiers["bytes_from_l3"] > 0 and tiers["failures"] == 0
    assert tiers["offload_latency"]["count"] == tiers["offloads"]
    assert {e[2] for e in events} == {"preempt_swap"}
    assert s["blocks_used"] == 0
    check_prometheus_export(tiers)


def check_prometheus_export(tiers):
    """The server's /metrics view of these counters (k25.server.metrics.tier_metrics)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from k25.server.metrics import tier_metrics

    class Collector:
        def collect(self):
            yield from tier_metrics({"m": {"tiers": tiers}, "plain": {"tiers": None}})

    reg = CollectorRegistry()
    reg.register(Collector())
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value for x in fams["k25_offload_latency_seconds"].samples}
    for op, n in (("offload", tiers["offloads"]), ("fetch", tiers["fetches"]), ("spill", tiers["spills"])):
        assert samples[("k25_offload_latency_seconds_count", (("model", "m"), ("op", op)))] == n
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in samples.items()
                         if k[0] == "k25_offload_latency_seconds_bucket" and dict(k[1])["op"] == op)
        assert buckets[-1] == (float("inf"), n) and all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))
        assert samples[("k25_offload_latency_seconds_sum", (("model", "m"), ("op", op)))] == \
            pytest.approx(tiers[f"{op}_latency"]["sum"])
    assert tiers["offloads"] > 0
    moved = {tuple(sorted(x.labels.items())): x.value for x in fams["k25_kv_tier_bytes"].samples}
    assert moved[(("direction", "out"), ("model", "m"), ("tier", "l3"))] == tiers["bytes_to_l3"]
    fetched = {tuple(sorted(x.labels.items())): x.value for x in fams["k25_kv_tier_fetches"].samples}
    assert fetched[(("model", "m"), ("tier", "l3"))] == tiers["fetches_from_l3"]
    held = {tuple(sorted(x.labels.items())): x.value for x in fams["k25_kv_tier_blocks"].samples}
    assert held == {(("model", "m"), ("tier", "l2")): tiers["l2_blocks"],
                    (("model", "m"), ("tier", "l3")): tiers["l3_blocks"]}
    assert not any(dict(k[1])["model"] == "plain" for k in samples)  # no tiers, no series


def test_l2_without_room_falls_back_to_recompute(tmp_path, reference):
    prompts, want, per_block = reference
    model = tiered(tmp_path, per_block, prompts, l2_slots=2, l3_pages=0)  # no L3, two slots
    try:
        outs = model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        s = model.stats()
        tiers = model.tier_stats()
    finally:
        model.close()
    assert [o.token_ids for o in outs] == want
    assert s["preemptions"] > 0 and s["swap_fallbacks"] > 0  # parked what fit, recomputed the rest
    assert tiers["refused"] > 0
    assert s["prefill_tokens"] > sum(len(p) for p in prompts)


def test_corrupted_l3_pages_are_recomputed_and_output_stays_correct(tmp_path, reference):
    prompts, want, per_block = reference
    model = tiered(tmp_path, per_block, prompts, l2_slots=3, l3_pages=200)
    try:
        model._engine.corrupt_next_l3_writes_for_test(3)  # real bytes flipped on disk
        outs = model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        s = model.stats()
        tiers = model.tier_stats()
        reasons = [e[2] for e in model.drain_kv_events()]
    finally:
        model.close()
    assert [o.token_ids for o in outs] == want
    assert tiers["faults"]["checksum_mismatch"] == 3
    assert reasons.count("checksum_mismatch") == 3
    assert s["swap_fallbacks"] > 0 and s["prefill_tokens"] > sum(len(p) for p in prompts)


@pytest.mark.parametrize("kw,match", [
    (dict(cache_mode="hierarchical"), "needs enable_async_offload=True"),
    (dict(cache_mode="hierarchical", enable_async_offload=True, l3_path="/tmp/x"), "go together"),
    (dict(cache_mode="hierarchical", enable_async_offload=True, l3_bytes=1 << 20), "go together"),
    (dict(cache_mode="hierarchical", enable_async_offload=True, l2_bytes=0), "l2_bytes"),
    (dict(l2_bytes=1 << 20), "applies to cache_mode='hierarchical'"),
    (dict(enable_async_offload=True), "needs cache_mode='hierarchical'"),
])
def test_inconsistent_tier_configs_are_config_errors(kw, match):
    with pytest.raises(errors.ConfigError, match=match):
        K25Config(device="cpu", **kw)


def test_tier_sizes_and_paths_are_checked_when_the_model_starts(tmp_path):
    base = dict(num_threads=1, kv_cache_bytes=64 << 20, cache_mode="hierarchical", enable_async_offload=True)
    with pytest.raises(errors.ConfigError, match="holds no L2 slot"):
        K25Model(K25Config(l2_bytes=4096, **base))
    with pytest.raises(errors.ConfigError, match="holds no L3 page"):
        K25Model(K25Config(l2_bytes=64 << 20, l3_path=str(tmp_path / "l3.bin"), l3_bytes=4096, **base))
    with pytest.raises(errors.K25IOError, match="cannot open l3_path"):
        K25Model(K25Config(l2_bytes=64 << 20, l3_path="/nonexistent-k25/l3.bin", l3_bytes=64 << 20, **base))


def test_an_l3_file_on_a_full_filesystem_is_refused_at_start_naming_enospc(tmp_path):
    # A real ENOSPC: a 1 MB tmpfs cannot hold 64 MB of L3, and fallocate says so when the model
    # starts (the tier reserves its whole file then, so a full disk is never found mid-run; a
    # write that fails anyway, e.g. on a filesystem without fallocate, is a fault the engine
    # recomputes: test_cold_l3's disk that keeps failing). Needs mount(8) permission.
    import subprocess
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        base = dict(num_threads=1, kv_cache_bytes=64 << 20, cache_mode="hierarchical", enable_async_offload=True)
        with pytest.raises(errors.ResourceExhaustedError, match=r"No space left on device \(errno 28\); free disk space"):
            K25Model(K25Config(l2_bytes=64 << 20, l3_path=str(mnt / "l3.bin"), l3_bytes=64 << 20, **base))
        assert not (mnt / "l3.bin").exists()  # the file it created is gone again
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_aborts_while_swapped_or_fetching_leak_nothing(tmp_path, reference):
    """Requests cancelled at every point of a swap; the rest still get their tokens."""
    import asyncio

    prompts, want, per_block = reference
    model = tiered(tmp_path, per_block, prompts, l2_slots=3, l3_pages=200)

    async def run(i, stop_after):
        got = []
        async for ev in model.stream_events(prompts[i], max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                            temperature=0.0):
            got += ev.token_ids
            if stop_after is not None and len(got) >= stop_after:
                break  # aborts the request
        return got

    async def main():
        plan = [None, 3, None, 1, 8, None, 2, None, 5, None]
        return await asyncio.gather(*(run(k % len(prompts), s) for k, s in enumerate(plan))), plan

    try:
        outs, plan = asyncio.run(main())
        s = model.stats()
    finally:
        model.close()
    for k, (got, stop) in enumerate(zip(outs, plan)):
        full = want[k % len(prompts)]
        assert got == (full if stop is None else full[:len(got)])
    assert s["preemptions"] > 0 and s["swap_outs"] > 0
    assert s["blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0


# ---- prefix caching with tiers (issue #6 use (c)) -----------------------------------------

def prefix_tiered(tmp_path, per_block, l1_blocks, l2_slots, l3_pages):
    page = _C.kv_page_bytes(per_block)
    l3 = dict(l3_path=str(tmp_path / "l3p.bin"), l3_bytes=l3_pages * page) if l3_pages else {}
    return K25Model(K25Config(num_threads=2, kv_cache_bytes=l1_blocks * per_block, block_size=BLOCK,
                              prefill_chunk_size=64, max_num_batched_tokens=96, max_batch_size=4,
                              enable_prefix_caching=True, cache_mode="hierarchical", enable_async_offload=True,
                              l2_bytes=l2_slots * page, **l3))


@pytest.mark.parametrize("where", ["l2", "l3", "l3_corrupt"])
def test_cached_prefix_blocks_spill_to_tiers_and_come_back(tmp_path, reference, default_model, where):
    """A prompt's cached blocks, pushed out of a small L1 by other requests, go down to L2
    (or L3) and a later request with that prompt fetches them instead of recomputing; the
    tokens equal those without any cache. Corrupted L3 pages are recomputed instead."""
    prompts, want, per_block = reference
    shared = prompts[1][:200]   # 12 full blocks
    others = [prompts[3][:240], prompts[1][300:540], prompts[3][40:280]]
    gen = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
    expect = [o.token_ids for o in default_model.generate([shared + [11, 12]], **gen)]
    l2_slots, l3_pages = {"l2": (64, 0), "l3": (2, 64), "l3_corrupt": (2, 64)}[where]
    model = prefix_tiered(tmp_path, per_block, l1_blocks=24, l2_slots=l2_slots, l3_pages=l3_pages)
    try:
        model.generate([shared + [7, 8, 9]], **gen)           # caches 13 blocks in L1
        if where == "l3_corrupt":
            model._engine.corrupt_next_l3_writes_for_test(4)  # the first spilled pages
        for p in others:                                     # 17 blocks each: evict them
            model.generate([p], **gen)
        s0 = model.stats()
        assert s0["prefix_spilled_blocks"] >= 13 and s0["prefix_tier_blocks"] >= 13
        model.drain_kv_events()
        outs = [o.token_ids for o in model.generate([shared + [11, 12]], **gen)]
        s1 = model.stats()
        tiers = model.tier_stats()
        reasons = [e[2] for e in model.drain_kv_events()]
    finally:
        model.close()
    assert outs == expect
    assert s1["swap_ins"] == s0["swap_ins"]  # fetching cached prefix blocks is not a swap-in
    hit = s1["prefix_cache_tier_hits"] - s0["prefix_cache_tier_hits"]
    computed = s1["prefill_tokens"] - s0["prefill_tokens"]
    if where == "l2":
        assert hit == 192 and tiers["fetches_from_l2"] > 0 and computed == 202 - 192
    elif where == "l3":
        assert hit == 192 and tiers["fetches_from_l3"] >= 12 and computed == 202 - 192
    else:
        # a corrupted page fails its checksum when fetched: the prompt is recomputed from
        # the first bad block on, and the output is still exact
        assert tiers["faults"]["checksum_mismatch"] >= 1 and "checksum_mismatch" in reasons
        assert hit == 192 and computed > 202 - 192


def test_preemption_recomputes_when_that_is_estimated_cheaper(tmp_path, reference):
    """The swap-or-recompute choice: with moving a block down and back costing more than
    recomputing its tokens (forced here: 10 s a block), preemptions recompute; the tokens
    are the same either way. Left to its measurements on this CPU, it swaps (a block's round
    trip through L2 is far cheaper than 16 tokens of prompt compute), and says why."""
    prompts, want, per_block = reference
    model = tiered(tmp_path, per_block, prompts, l2_slots=64, l3_pages=0)
    try:
        model._engine.set_swap_cost_for_test(10.0)
        outs = model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        forced = model.stats()
        events = {e[2] for e in model.drain_kv_events()}
        model._engine.set_swap_cost_for_test(-1.0)  # back to the measured costs
        again = model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        measured = model.stats()
    finally:
        model.close()
    assert [o.token_ids for o in outs] == want and [o.token_ids for o in again] == want
    assert forced["preemptions"] > 0 and forced["swap_outs"] == 0
    assert forced["swap_declined"] == forced["preemptions"] and "preempt_recompute" in events
    assert forced["recompute_s_per_token"] > 0
    # measured: swaps again (the first preemption swaps: nothing measured yet)
    assert measured["swap_outs"] > 0 and measured["swap_declined"] == forced["swap_declined"]
    if measured["swap_s_per_block"] > 0:
        assert measured["swap_s_per_block"] < BLOCK * measured["recompute_s_per_token"]


def test_two_prompts_claiming_the_same_tier_copies_in_one_step(tmp_path, reference, default_model):
    """Two requests admitted in the same step both find a prefix in L2; a tier copy is used
    once, so the second recomputes what the first took (or starts from it once it is back in
    L1): both outputs exact, no engine error."""
    prompts, want, per_block = reference
    shared = prompts[1][:200]
    others = [prompts[3][:240], prompts[1][300:540], prompts[3][40:280]]
    gen = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
    pair = [shared + [11, 12], shared + [13]]
    expect = [o.token_ids for o in default_model.generate(pair, **gen)]
    model = prefix_tiered(tmp_path, per_block, l1_blocks=40, l2_slots=64, l3_pages=0)
    try:
        model.generate([shared + [7, 8, 9]], **gen)
        for p in others:
            model.generate([p], **gen)
        s0 = model.stats()
        outs = [o.token_ids for o in model.generate(pair, **gen)]
        s1 = model.stats()
    finally:
        model.close()
    assert outs == expect
    assert s1["requests_failed"] == s0["requests_failed"]
    assert s1["prefix_cache_tier_hits"] > s0["prefix_cache_tier_hits"]


def test_swapping_with_dynamic_sparsity_rebuilds_the_block_summaries(tmp_path, reference):
    """Dynamic sparsity ranks blocks by per-block key summaries kept beside the pool; a
    block fetched back from L2/L3 lands in a different L1 block, so its summaries are
    rebuilt from its keys before the next step selects. The oracle is the same sparse
    configuration on a pool that never swaps: equal tokens, with sparse steps on both."""
    prompts, _, per_block = reference
    sparse = dict(enable_dynamic_sparsity=True, sparsity_min_context=128, sparsity_recent_blocks=2,
                  max_sparsity_ratio=0.8, sparsity_mass_target=0.5)
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    roomy = K25Model(K25Config(num_threads=2, kv_cache_bytes=len(prompts) * (-(-longest // BLOCK) + 1) * per_block,
                               block_size=BLOCK, prefill_chunk_size=64, max_num_batched_tokens=96, max_batch_size=4,
                               **sparse))
    try:
        want = [o.token_ids for o in roomy.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                    temperature=0.0)]
        assert roomy.stats()["preemptions"] == 0 and roomy.get_current_sparsity_ratio() > 0
    finally:
        roomy.close()
    model = tiered(tmp_path, per_block, prompts, l2_slots=3, l3_pages=200, **sparse)
    try:
        outs = model.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        s = model.stats()
        ratio = model.get_current_sparsity_ratio()
    finally:
        model.close()
    assert s["swap_ins"] > 0 and s["swap_fallbacks"] == 0 and ratio > 0
    for i, (o, w) in enumerate(zip(outs, want)):
        assert o.token_ids == w, f"prompt {i} differs after swapping with sparsity"


# ---- a swap-in in flight holds no one else (issue #6 point 5) -----------------------------

SLOW_COPY_S = 4.0  # every copy into L1 calls back this long after it began (a slow bus)


def swap_in_scene(default_model, tmp_path):
    """A (bronze, 300 tokens) decodes until B (gold, 600 tokens) needs its room: L1 holds one
    of them, not both, so A is preempted and swapped out to L2, and comes back once B is done.
    E (a short prompt) arrives right after B ends, while A's blocks are coming back."""
    tok, text = default_model.tokenizer, long_text()
    scene = {"A": (tok.encode(text[3000:12000])[:300], 24, "bronze"),
             "B": (tok.encode(text[30000:45000])[:600], 4, "gold"),
             "E": (tok.encode("1, 2, 3, 4,"), 8, "silver")}
    want = {k: default_model.generate([ids], max_new_tokens=n, ignore_eos=True, temperature=0.0)[0].token_ids
            for k, (ids, n, _) in scene.items()}
    per_block = default_model.kv_block_bytes
    need_a, need_b = (-(-(len(scene[k][0]) + scene[k][1]) // BLOCK) for k in "AB")
    l1 = need_b + need_a // 2 + 2  # B and half of A: never both
    model = K25Model(K25Config(num_threads=2, kv_cache_bytes=l1 * per_block, block_size=BLOCK,
                               prefill_chunk_size=64, max_num_batched_tokens=96, max_batch_size=4,
                               cache_mode="hierarchical", enable_async_offload=True,
                               l2_bytes=(need_a + 4) * _C.kv_page_bytes(per_block)))
    model._engine.set_swap_cost_for_test(0.0)  # swap, never recompute
    return scene, want, model


async def stamped(model, scene, key, stamps):
    """The request's tokens, and (arrival time, tokens so far) of each event that carried some."""
    import time
    ids, n, priority = scene[key]
    got = []
    async for ev in model.stream_events(ids, max_new_tokens=n, ignore_eos=True, temperature=0.0, priority=priority):
        if ev.token_ids:
            got += ev.token_ids
            stamps.append((time.monotonic(), len(got)))
    return got


async def preempt_a_then_end_b(model, scene, stamps):
    """A runs until its first token; B (gold) then takes its room and runs to its end, with
    every copy into L1 held SLOW_COPY_S from then on. Returns A's task: A's blocks are coming
    back (or about to) when this returns."""
    import asyncio
    a = asyncio.create_task(stamped(model, scene, "A", stamps["A"]))
    while not stamps["A"]:
        await asyncio.sleep(0.01)
    model._engine.delay_tier_copies_in_for_test(SLOW_COPY_S)
    return a, await stamped(model, scene, "B", stamps["B"])


def test_a_sequence_waiting_for_its_swap_in_holds_no_one_else(default_model, tmp_path):
    """While a preempted sequence's blocks come back (each copy held SLOW_COPY_S here), the
    scheduler skips it and everyone else keeps running: a request that arrives meanwhile gets
    all its tokens before the swapped sequence moves on, and every output is exact."""
    import asyncio
    import time

    scene, want, model = swap_in_scene(default_model, tmp_path)
    stamps = {k: [] for k in scene}

    async def main():
        a, got_b = await preempt_a_then_end_b(model, scene, stamps)
        got = {"B": got_b}
        b_done = time.monotonic()  # B has ended: A's blocks are coming back
        got["E"] = await stamped(model, scene, "E", stamps["E"])
        got["A"] = await a
        return got, b_done

    try:
        got, b_done = asyncio.run(main())
        s, tiers = model.stats(), model.tier_stats()
    finally:
        model.close()
    assert got == want
    assert s["preemptions"] >= 1 and s["swap_outs"] == s["swap_ins"] >= 1 and s["swap_fallbacks"] == 0
    assert s["prefill_tokens"] == sum(len(ids) for ids, _, _ in scene.values())  # nothing recomputed
    fetches = tiers["fetch_latency"]
    assert fetches["count"] > 0 and fetches["sum"] / fetches["count"] >= SLOW_COPY_S
    a_back = next(t for t, _ in stamps["A"] if t > b_done)  # A's first token after its swap-in
    e_last = stamps["E"][-1][0]
    assert a_back - b_done >= SLOW_COPY_S / 2, "the swap-in was not slow: the scene tests nothing"
    # E ran start to end while A's copies were in flight.
    assert e_last < a_back and e_last - b_done < SLOW_COPY_S / 2, (e_last - b_done, a_back - b_done)


def test_closing_the_model_during_a_swap_in_waits_for_its_copies(default_model, tmp_path):
    """Shutdown waits for transfers in flight: closed while a swapped-out sequence's blocks
    are coming back (each copy held SLOW_COPY_S), close() returns only once those copies have
    called back (the tiers' last counters, taken after the drain, include them), nothing
    crashes, and the request that was waiting for them ends instead of hanging."""
    import asyncio
    import time

    scene, _, model = swap_in_scene(default_model, tmp_path)
    stamps = {k: [] for k in scene}

    async def main():
        a, _ = await preempt_a_then_end_b(model, scene, stamps)
        await asyncio.sleep(SLOW_COPY_S / 4)  # A's swap-in begins in the step after B's last
        t0 = time.monotonic()
        model.close()
        closed_after = time.monotonic() - t0
        try:
            await asyncio.wait_for(a, 30)
        except asyncio.TimeoutError:
            raise AssertionError("the request waiting for its swap-in hangs after close()") from None
        except Exception:
            pass  # it ends with an error: the engine stopped under it
        return closed_after

    try:
        closed_after = asyncio.run(main())
        tiers = model.tier_stats()
    finally:
        model.close()
    # Every block A swapped out was on its way back when close() aborted A: each copy called
    # back (cancelled: its key was freed meanwhile) before close() returned, which took the
    # copies' time.
    assert tiers["offloads"] > 0 and tiers["fetches"] + tiers["cancelled"] == tiers["offloads"], tiers
    assert closed_after >= SLOW_COPY_S / 2, closed_after
    assert tiers["failures"] == 0
