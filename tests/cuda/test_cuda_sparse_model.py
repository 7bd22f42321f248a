"""Dynamic block sparsity end to end on the GPU.

On the default model (bf16): sparse against dense on the same GPU over real text
(teacher-forced decode steps through the eager path), and generation through the
CUDA-graph path with its statistics, for both device rules (docs/sparsity.md "CUDA"): the
Quest bound, whose accuracy on this model is below the channel estimate's (bench/RESULTS.md),
and the key codes (the default with 16-bit KV), held to the CPU test's bounds. On a
random-weight checkpoint: tiered KV with sparsity, whose fetched blocks need their summaries
recomputed on the device, with either rule.
"""
import numpy as np
import pytest

from k25 import K25Config, K25Model

from oracles import write_random_checkpoint
from test_cuda_model import default_model_path, prompt_for
from test_sparsity import agreement_and_perplexity_ratio, pydoc_ids


@pytest.fixture(scope="module")
def model_path():
    path = default_model_path()
    if path is None:
        pytest.skip("the default model is not on this machine")
    return path


def gpu_model(path, **kw):
    # An explicit pool: other tests' tensors may sit in torch's cache (device memory the
    # gpu_memory_utilization sizing would count as taken).
    return K25Model(K25Config(model_path=path, device="cuda", dtype="bfloat16", max_seq_len=4096,
                              kv_cache_bytes=256 << 20, **kw))


@pytest.mark.parametrize("rule", ["bound", "codes"])
def test_sparse_decode_on_gpu_tracks_dense(model_path, rule):
    ctx, decoded = 3072, 96
    dense_m = gpu_model(model_path)
    try:
        docs = [pydoc_ids(dense_m, ctx, off) for off in (0, 30000)]
        dense = [dense_m.score(ids, decode_from=ctx - decoded) for ids in docs]
        cfg = dense_m.model_config
    finally:
        dense_m.close()
    m = gpu_model(model_path, enable_dynamic_sparsity=True, sparsity_score_rule=rule)
    try:
        sparse = [m.score(ids, decode_from=ctx - decoded) for ids in docs]
        layers = m.stats()["sparsity_layers"]
        ratio = m.get_current_sparsity_ratio()
    finally:
        m.close()
    for s, d in zip(sparse, dense):
        assert np.array_equal(s[:ctx - decoded], d[:ctx - decoded]), "prompt chunks are dense"
        assert not np.array_equal(s[-decoded:], d[-decoded:]), "decode steps went sparse"
    assert len(layers) == cfg["num_layers"]
    for l in layers:
        assert l["selections"] == decoded * len(docs) * cfg["num_kv_heads"]
        assert 0.1 - 1e-9 <= l["ratio"] <= 0.6 + 1e-9
        assert l["mean_entropy_bits"] > 0
    assert 0.1 < ratio <= 0.6
    agree, ppl_ratio = agreement_and_perplexity_ratio(sparse, dense, docs, decoded)
    print(f"GPU sparse ({rule}) vs dense: top-1 agreement {agree:.3f}, perplexity ratio {ppl_ratio:.4f}, "
          f"sparsity {ratio:.3f}")
    # The key codes: the CPU test's bounds (tests/python/test_sparsity.py); the bound's are looser.
    min_agree, max_ppl = (0.94, 1.03) if rule == "codes" else (0.9, 1.10)
    assert agree >= min_agree, f"top-1 agreement {agree:.3f}"
    assert ppl_ratio <= max_ppl, f"perplexity ratio {ppl_ratio:.4f}"


@pytest.mark.parametrize("rule", ["bound", "codes"])
def test_sparse_generation_runs_in_cuda_graphs(model_path, rule):
    m = gpu_model(model_path, enable_dynamic_sparsity=True, sparsity_score_rule=rule)
    try:
        ids = pydoc_ids(m, 2600, 100)
        short = m.generate([ids[:500]], max_new_tokens=8, temperature=0.0, ignore_eos=True)[0]
        assert m.get_current_sparsity_ratio() == 0.0, "nothing past sparsity_min_context yet"
        out = m.generate([ids], max_new_tokens=24, temperature=0.0, ignore_eos=True)[0]
        st = m.stats()
        hkv = m.model_config["num_kv_heads"]
    finally:
        m.close()
    assert len(short.token_ids) == 8 and len(out.token_ids) == 24
    assert st["pipelined_steps"] > 0, "decode steps ran as (pipelined) CUDA graphs"
    for l in st["sparsity_layers"]:
        # 23 decode steps past min_context (the first token comes from the prefill).
        assert l["selections"] == 23 * hkv
        assert 0.1 - 1e-9 <= l["ratio"] <= 0.6 + 1e-9


def test_selection_reuse_on_gpu(model_path):
    """sparsity_selection_interval=2 on the device (the key codes): teacher-forced decode steps
    (eager) select at even context lengths and reuse in between (the statistics count both by the
    rule), the first decode row equals selecting every step, and accuracy stays within the CPU
    test's bounds; generation in CUDA graphs keeps the same rhythm."""
    ctx, decoded = 3072, 96
    dense_m = gpu_model(model_path)
    try:
        docs = [pydoc_ids(dense_m, ctx, off) for off in (0, 30000)]
        dense = [dense_m.score(ids, decode_from=ctx - decoded) for ids in docs]
        hkv = dense_m.model_config["num_kv_heads"]
    finally:
        dense_m.close()
    runs = {}
    for n in (1, 2):
        m = gpu_model(model_path, enable_dynamic_sparsity=True, sparsity_score_rule="codes",
                      sparsity_selection_interval=n)
        try:
            runs[n] = ([m.score(ids, decode_from=ctx - decoded) for ids in docs], m.stats()["sparsity_layers"])
            if n == 2:
                ids = pydoc_ids(m, 2600, 100)
                m.generate([ids], max_new_tokens=24, temperature=0.0, ignore_eos=True)
                st = m.stats()
        finally:
            m.close()
    steps = range(ctx - decoded + 1, ctx + 1)  # the decode steps' context lengths
    fresh = 1 + sum(c % 2 == 0 for c in steps[1:])
    for l in runs[2][1]:
        assert l["selections"] == fresh * len(docs) * hkv
        assert l["reused_selections"] == (decoded - fresh) * len(docs) * hkv
        assert 0.1 - 1e-9 <= l["ratio"] <= 0.6 + 1e-9
    for l in runs[1][1]:
        assert l["reused_selections"] == 0
    for every, reusing in zip(runs[1][0], runs[2][0]):
        assert np.array_equal(every[:ctx - decoded + 1], reusing[:ctx - decoded + 1])
        assert not np.array_equal(every[ctx - decoded + 1:], reusing[ctx - decoded + 1:])
    agree, ppl_ratio = agreement_and_perplexity_ratio(runs[2][0], dense, docs, decoded)
    print(f"GPU codes, a selection every 2 steps, vs dense: top-1 agreement {agree:.3f}, "
          f"perplexity ratio {ppl_ratio:.4f}")
    assert agree >= 0.94 and ppl_ratio <= 1.03, (agree, ppl_ratio)
    # The graph steps: 23 decodes at context lengths 2601..2623 (the first token from the prefill).
    assert st["pipelined_steps"] > 0
    gen = range(2601, 2624)
    g_fresh = 1 + sum(c % 2 == 0 for c in gen[1:])
    for l, e in zip(st["sparsity_layers"], runs[2][1]):
        assert l["selections"] - e["selections"] == g_fresh * hkv
        assert l["reused_selections"] - e["reused_selections"] == (len(gen) - g_fresh) * hkv


def test_default_rule_on_gpu_is_the_key_codes(model_path):
    """No rule named, 16-bit KV: the device selection ranks by the key codes (the configuration's
    default, tests/python/test_sparsity.py), so its sparse decode rows equal those of
    sparsity_score_rule="codes" bit for bit and differ from the Quest bound's."""
    ctx, decoded = 2600, 32
    rows = {}
    for rule in (None, "codes", "bound"):
        m = gpu_model(model_path, enable_dynamic_sparsity=True,
                      **({} if rule is None else dict(sparsity_score_rule=rule)))
        try:
            ids = pydoc_ids(m, ctx, 100)
            rows[rule] = m.score(ids, decode_from=ctx - decoded)[-decoded:]
            assert m.get_current_sparsity_ratio() > 0.1
        finally:
            m.close()
    assert np.array_equal(rows[None], rows["codes"])
    assert not np.array_equal(rows[None], rows["bound"])


# float32 KV ranks by the Quest bound (the key codes take 16-bit KV on CUDA); bfloat16 by the
# default there, the key codes.
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiered_kv_with_sparsity_on_gpu(tmp_path, dtype):
    """Swapping sequences out to L2 and back must not change a sparse run: fetched blocks
    land in other L1 blocks, whose summaries the engine recomputes on the device
    (refresh_fetched_kv). Tokens equal a never-swapping sparse run's with the same scheduling
    limits (so the same prompt chunks: bf16 results depend on them)."""
    d = tmp_path / "llama3"
    write_random_checkpoint(d, "llama3", hidden_size=512, num_attention_heads=8, intermediate_size=1024,
                            head_dim=64, initializer_range=0.15)
    sparse = dict(enable_dynamic_sparsity=True, sparsity_min_context=64, sparsity_recent_blocks=2, dtype=dtype,
                  max_batch_size=4, prefill_chunk_size=64, max_num_batched_tokens=96)
    gen = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    plain = K25Model(K25Config(model_path=str(d), device="cuda", kv_cache_bytes=1 << 30, **sparse))
    try:
        prompts = [prompt_for(plain, n, seed=n) for n in (150, 90, 200, 120)]
        want = [o.token_ids for o in plain.generate(prompts, **gen)]
        assert plain.get_current_sparsity_ratio() > 0.1
        per_block = plain.kv_block_bytes
    finally:
        plain.close()
    from k25 import _C
    page = _C.kv_page_bytes(per_block)
    m = K25Model(K25Config(model_path=str(d), device="cuda", kv_cache_bytes=26 * per_block,
                           cache_mode="hierarchical", enable_async_offload=True, l2_bytes=256 * page, **sparse))
    try:
        got = [o.token_ids for o in m.generate(prompts, **gen)]
        s = m.stats()
        ratio = m.get_current_sparsity_ratio()
    finally:
        m.close()
    assert s["swap_outs"] > 0 and s["swap_ins"] == s["swap_outs"], "the small pool was meant to swap"
    assert ratio > 0.1
    assert got == want
