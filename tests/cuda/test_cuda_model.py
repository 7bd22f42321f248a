"""End to end on the GPU: float32 on CUDA against the CPU path, bf16 against transformers
in bf16 on the same GPU, batch invariance, fused against unfused.

Models: small random-weight checkpoints written by transformers here, and the default
GGUF model when it is installed (or K25_DEFAULT_MODEL_PATH points at it).
"""
import numpy as np
import pytest
import torch

from k25 import K25Config, K25Model
from k25.errors import ModelNotFoundError
from k25.model import resolve_model_path

from oracles import check_greedy_against_reference as greedy_agrees, write_random_checkpoint

BF16_NEAR_TIE = 0.15  # bf16 logits of magnitude ~10-30 are spaced 0.06-0.12 apart


def bf16_near_tie(rows):
    """Two logits count as tied when at most four bf16 steps apart at the rows' largest
    magnitude (logits of 8-16 are spaced 0.0625 apart, of 32-64 0.25): two bf16
    implementations' attention rows differ by ~0.5% (bench/gpu/diag_prefill.py measures
    k25's and SDPA's against float64), which moves logits by a few steps."""
    top = float(np.max(np.abs(rows[np.isfinite(rows)])))
    return max(BF16_NEAR_TIE, 4.01 * 2.0 ** (np.floor(np.log2(max(top, 1e-30))) - 7))


def default_model_path():
    try:
        return str(resolve_model_path(None))
    except ModelNotFoundError:
        return None


@pytest.fixture(scope="module", params=["llama3", "qwen2", "mistral", "default"])
def model_dir(request, tmp_path_factory):
    if request.param == "default":
        path = default_model_path()
        if path is None:
            pytest.skip("the default model is not on this machine")
        return path
    d = tmp_path_factory.mktemp(request.param)
    # head_dim 64 (the CUDA kernels take 64 and 128), GQA 8/2 or 8/1
    write_random_checkpoint(d, request.param, hidden_size=512, num_attention_heads=8, intermediate_size=1024,
                            head_dim=64, initializer_range=0.15)
    return str(d)


def prompt_for(model, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = model.model_config["vocab_size"]
    return torch.randint(3, min(vocab, 30000), (n,), generator=g).tolist()


@pytest.mark.parametrize("block_size", [16, 128])  # 128: README's choice for long dense decodes
def test_float32_on_gpu_gives_the_cpu_tokens(model_dir, block_size):
    cpu = K25Model(K25Config(model_path=model_dir, device="cpu", kv_cache_bytes=256 << 20))
    gpu = K25Model(K25Config(model_path=model_dir, device="cuda", dtype="float32", kv_cache_bytes=1 << 30,
                             block_size=block_size))
    try:
        prompt = prompt_for(cpu)
        a, b = cpu.score(prompt), gpu.score(prompt)
        assert np.abs(a - b).max() < 2e-3 * max(1.0, np.abs(a).max())
        ta = cpu.generate([prompt], max_new_tokens=32, temperature=0.0, min_new_tokens=32)[0].token_ids
        tb = gpu.generate([prompt], max_new_tokens=32, temperature=0.0, min_new_tokens=32)[0].token_ids
        full = cpu.score(prompt + tb)
        full[:, cpu.eos_token_ids] = -np.inf
        assert greedy_agrees(prompt, tb, full, near_tie=1e-3) >= 16
        assert ta[:8] == tb[:8]
    finally:
        cpu.close()
        gpu.close()


def test_bf16_on_gpu_agrees_with_transformers_bf16(model_dir):
    from transformers import AutoModelForCausalLM
    import os
    if os.path.isfile(model_dir):  # GGUF: transformers dequantises it
        ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_dir), gguf_file=os.path.basename(model_dir),
                                                   dtype=torch.bfloat16)
    else:
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    ref = ref.cuda().eval()
    m = K25Model(K25Config(model_path=model_dir, device="cuda", dtype="bfloat16", kv_cache_bytes=1 << 30))
    try:
        prompt = prompt_for(m, seed=1)
        ours = m.score(prompt)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt], device="cuda")).logits[0].float().cpu().numpy()
        rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
        assert rel < 3e-2, f"relative logit error {rel}"
        compared = []
        for seed in (1, 2, 3):
            prompt = prompt_for(m, seed=seed)
            out = m.generate([prompt], max_new_tokens=32, temperature=0.0, min_new_tokens=32)[0].token_ids
            with torch.no_grad():
                full = ref(torch.tensor([prompt + out], device="cuda")).logits[0].float().cpu().numpy()
            full[:, m.eos_token_ids] = -np.inf
            compared.append(greedy_agrees(prompt, out, full, near_tie=bf16_near_tie(full[len(prompt) - 1:])))
        # Each run may part at a near-tie; together they must compare a fair number of tokens.
        assert sum(compared) >= 24, f"tokens compared before a near-tie divergence: {compared}"
    finally:
        m.close()
        del ref
        torch.cuda.empty_cache()


def test_fused_matches_unfused_on_gpu(model_dir):
    kw = dict(model_path=model_dir, device="cuda", dtype="bfloat16", kv_cache_bytes=512 << 20)
    a = K25Model(K25Config(**kw))
    b = K25Model(K25Config(enable_kernel_fusion=False, **kw))
    try:
        prompt = prompt_for(a, seed=2)
        la, lb = a.score(prompt), b.score(prompt)
        assert np.linalg.norm(la - lb) / np.linalg.norm(lb) < 2e-2
    finally:
        a.close()
        b.close()


def test_batch_invariance_on_gpu(model_dir):
    solo = K25Model(K25Config(model_path=model_dir, device="cuda", dtype="float32", kv_cache_bytes=1 << 30))
    prompts = [prompt_for(solo, n, seed=n) for n in (5, 40, 300, 700, 120)]
    alone = [solo.generate([p], max_new_tokens=16, temperature=0.0, ignore_eos=True)[0].token_ids for p in prompts]
    per_block = solo.kv_block_bytes
    solo.close()
    blocks = -(-(700 + 16) // 16) + 6  # the longest request and a little: forces preemption
    batch = K25Model(K25Config(model_path=model_dir, device="cuda", dtype="float32",
                               kv_cache_bytes=blocks * per_block, prefill_chunk_size=64, max_num_batched_tokens=96,
                               max_batch_size=4))
    try:
        outs = batch.generate(prompts, max_new_tokens=16, temperature=0.0, ignore_eos=True)
        stats = batch.stats()
    finally:
        batch.close()
    assert stats["preemptions"] > 0
    for i, (x, y) in enumerate(zip(alone, outs)):
        assert y.token_ids == x, f"prompt {i}"


def test_gpu_memory_usage_is_real(model_dir):
    before = torch.cuda.memory_allocated()
    m = K25Model(K25Config(model_path=model_dir, device="cuda", kv_cache_bytes=256 << 20))
    try:
        used = m.get_gpu_memory_usage()
        s = m.stats()
        assert used >= s["weight_bytes"] + s["kv_cache_bytes"]
        assert used - before < s["weight_bytes"] + s["kv_cache_bytes"] + (1 << 30)
        assert s["device"] == "cuda" and s["dtype"] == "bfloat16"
    finally:
        m.close()


@pytest.mark.parametrize("sparsity", [False, True])
def test_memory_plan_matches_the_gpu_model(model_dir, sparsity):
    # `k25 mem`'s plan, made before the load, against the pool K25Model sizes from
    # gpu_memory_utilization after it: the same weight and block bytes, as many blocks up to what
    # the allocator rounds the weights' segments to, and the device memory the model then holds
    # within the plan's total (the workspace reserve covers what warm-up and graph capture took).
    import gc

    from k25 import memory
    gc.collect()
    torch.cuda.empty_cache()  # earlier models' cached segments would count as used before and reused after
    # What this process holds already (earlier tests' live tensors): the allocator's count is
    # process-wide, the plan is this model's.
    before = torch.cuda.memory_allocated()
    # Free space inside segments those tensors keep: the model's first tensors may land there
    # without the device's used memory growing, so its pool may exceed the plan by that much.
    slack = torch.cuda.memory_reserved() - before
    util = 0.25
    plan = memory.memory_plan(model_dir, device="cuda", batch=8, max_seq_len=2048, sparsity=sparsity, margin=0.0,
                              available_bytes=memory.available_memory("cuda", util))
    m = K25Model(K25Config(model_path=model_dir, device="cuda", max_seq_len=2048, max_batch_size=8,
                           gpu_memory_utilization=util, enable_dynamic_sparsity=sparsity))
    try:
        s = m.stats()
        assert s["weight_bytes"] == plan.weight_bytes and m.kv_block_bytes == plan.kv_block_bytes
        per_block = plan.kv_block_bytes + plan.summary_block_bytes
        planned = (plan.available_bytes - plan.weight_bytes - plan.rope_bytes - plan.workspace_bytes) // per_block
        got = s["kv_cache_bytes"] // m.kv_block_bytes
        assert planned * 0.98 <= got <= planned + slack // per_block, (planned, got, slack // per_block)
        held = m.get_gpu_memory_usage() - before
        resident = plan.weight_bytes + plan.rope_bytes + (got + 1) * per_block
        assert resident <= held <= resident + plan.workspace_bytes, (before, held, resident, plan.workspace_bytes)
    finally:
        m.close()


def _decode_runs(model_dir, dtype, graphs, monkeypatch):
    monkeypatch.setenv("K25_DISABLE_CUDA_GRAPHS", "0" if graphs else "1")
    m = K25Model(K25Config(model_path=model_dir, device="cuda", dtype=dtype, kv_cache_bytes=1 << 30))
    prompts = [prompt_for(m, n, seed=n) for n in (17, 100, 3, 250, 64)]
    runs = [(prompts[:b], dict(temperature=0.0)) for b in (1, 3, 5)]
    runs.append((prompts[:3], dict(temperature=0.8, seed=7)))
    outs = [(p, [o.token_ids for o in m.generate(p, max_new_tokens=12, ignore_eos=True, **kw)]) for p, kw in runs]
    return m, outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_matches_eager(model_dir, dtype, monkeypatch):
    """Decode steps replayed from CUDA graphs (padded to a batch bucket) give the tokens of
    the eager path, greedy and seeded, for batch sizes that need padding. In bf16 the two
    paths split attention differently (rounding differs), so a sequence may part only
    where the eager model's top two logits are a near-tie."""
    graph_model, with_graphs = _decode_runs(model_dir, dtype, True, monkeypatch)
    graph_model.close()
    eager, without = _decode_runs(model_dir, dtype, False, monkeypatch)
    try:
        if dtype == "float32":
            assert with_graphs == without
            return
        # Greedy runs only: a seeded draw near a probability boundary may flip on rounding.
        for (prompts, runs_g), (_, runs_e) in zip(with_graphs[:3], without[:3]):
            for p, b, a in zip(prompts, runs_g, runs_e):
                i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
                if i is None:
                    continue
                row = eager.score(p + a[:i])[-1]
                gap = abs(float(row[a[i]]) - float(row[b[i]]))
                assert gap <= BF16_NEAR_TIE, f"diverged at token {i} with a logit gap of {gap}"
    finally:
        eager.close()


def test_programmatic_launches_change_no_result(model_dir, monkeypatch):
    """The decode chain's kernels launched with programmatic dependent launch (each may start
    before the one before it ends; K25_PDL) run the same arithmetic: bf16 greedy tokens and
    logprobs of batch-1 (the GEMV path) and batch-2 decodes are those without it."""
    runs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("K25_PDL", mode)
        m = K25Model(K25Config(model_path=model_dir, device="cuda", dtype="bfloat16", kv_cache_bytes=1 << 30))
        try:
            prompts = [prompt_for(m, n, seed=n) for n in (40, 300)]
            outs = m.generate(prompts[:1], max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
            outs += m.generate(prompts, max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
            runs[mode] = [(o.token_ids, [(t.logprob, t.top) for t in o.logprobs]) for o in outs]
        finally:
            m.close()
    # One request alone runs the same steps both times: equal to the bit. Two requests may
    # be prefilled in one step or two (arrival timing): their tokens equal, logprobs close.
    assert runs["1"][0] == runs["0"][0]
    for (t1, lp1), (t0, lp0) in zip(runs["1"][1:], runs["0"][1:]):
        assert t1 == t0
        assert all(abs(a[0] - b[0]) < BF16_NEAR_TIE for a, b in zip(lp1, lp0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pipelined_decode_matches_unpipelined(model_dir, dtype, monkeypatch):
    """Pipelined decode on CUDA graphs (the next step launched before the previous one's ids
    reach the host, which the graph takes on the device) gives the unpipelined tokens: a
    batch that shrinks as sequences stop on a stop token (new, smaller buckets captured
    between two steps in flight), exact lengths, seeded sampling and logprobs. Same graphs
    both ways, so equal in bf16 too."""
    outs, piped = {}, {}
    for mode in ("1", "0"):
        monkeypatch.setenv("K25_ASYNC_SCHEDULING", mode)
        m = K25Model(K25Config(model_path=model_dir, device="cuda", dtype=dtype, kv_cache_bytes=1 << 30))
        try:
            prompts = [prompt_for(m, n, seed=n) for n in (17, 100, 3, 250, 64)]
            # prompt 0's tokens in this batch (in bf16 a batch of 1 takes another GEMV path)
            ref = m.generate(prompts, max_new_tokens=30, temperature=0.0, ignore_eos=True)[0].token_ids
            stops = [ref[7], ref[19]]
            runs = [m.generate(prompts, max_new_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=stops),
                    m.generate(prompts[:2], max_new_tokens=5, temperature=0.0, ignore_eos=True),
                    # the device sampler's ids handed over on the device too
                    m.generate(prompts[:3], max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
                    m.generate(prompts[:2], max_new_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)]
            outs[mode] = [[(o.token_ids, o.finish_reason, [(t.logprob, t.top) for t in o.logprobs or []])
                           for o in r] for r in runs]
            piped[mode] = m.stats()["pipelined_steps"]
        finally:
            m.close()
    # Tokens and finish reasons exactly; logprobs up to float noise (the prompts' first step
    # may batch them differently from run to run: arrival timing).
    assert [[o[:2] for o in r] for r in outs["1"]] == [[o[:2] for o in r] for r in outs["0"]]
    tol = 1e-3 if dtype == "float32" else BF16_NEAR_TIE
    for r1, r0 in zip(outs["1"], outs["0"]):
        for (_, _, a), (_, _, b) in zip(r1, r0):
            assert len(a) == len(b)
            assert all(abs(la - lb) < tol for (la, _), (lb, _) in zip(a, b))
    assert outs["1"][0][0][1] == "stop" and len(outs["1"][0][0][0]) <= 8
    assert [len(t) for t, _, _ in outs["1"][1]] == [5, 5]
    assert all(len(lp) == 8 for _, _, lp in outs["1"][3])
    assert piped["1"] >= 40 and piped["0"] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_caching_on_gpu(model_dir, dtype):
    """Requests that share a prompt prefix start from its cached blocks on the GPU too: the
    prefix is not recomputed (stats), and the tokens are those without the cache (float32:
    exactly; bf16: a later prefill chunk rounds differently, so up to a near-tie)."""
    kw = dict(model_path=model_dir, device="cuda", dtype=dtype, kv_cache_bytes=1 << 30, prefill_chunk_size=128)
    plain = K25Model(K25Config(**kw))
    try:
        base = prompt_for(plain, 200, seed=11)
        prompts = [base + prompt_for(plain, n, seed=n) for n in (5, 30, 77)]
        gen = dict(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
        want = [plain.generate([p], **gen)[0] for p in prompts]
    finally:
        plain.close()
    cached = K25Model(K25Config(enable_prefix_caching=True, **kw))
    try:
        got = [cached.generate([p], **gen)[0] for p in prompts]
        s = cached.stats()
    finally:
        cached.close()
    assert s["prefix_cache_hits"] == 2 * (200 // 16) * 16
    for g, w in zip(got, want):
        if dtype == "float32":
            assert g.token_ids == w.token_ids
        else:
            for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
                if a != b:
                    gap = abs(w.logprobs[i].top.get(a, -1e9) - w.logprobs[i].logprob)
                    assert gap <= BF16_NEAR_TIE, f"diverged at token {i}, logprob gap {gap}"
                    break


@pytest.mark.parametrize("l3", [False, True])
def test_tiered_kv_on_gpu(model_dir, tmp_path, l3):
    """cache_mode='hierarchical' on CUDA: pinned L2 (and an L3 file), copies on their own
    stream. A pool too small for the batch preempts by swap and fetches back (tokens equal
    to an all-resident run, prompts computed once); with prefix caching, a prompt's cached
    blocks pushed out of L1 come back from the tiers."""
    plain = K25Model(K25Config(model_path=model_dir, device="cuda", dtype="float32", kv_cache_bytes=1 << 30))
    try:
        prompts = [prompt_for(plain, n, seed=n) for n in (150, 90, 200, 120)]
        gen = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        want = [o.token_ids for o in plain.generate(prompts, **gen)]
        shared = prompts[2][:160]
        want_shared = plain.generate([shared + [5, 6]], **gen)[0].token_ids
        per_block = plain.kv_block_bytes
    finally:
        plain.close()
    from k25 import _C
    page = _C.kv_page_bytes(per_block)
    tiers = dict(l2_bytes=2 * page, l3_path=str(tmp_path / "l3.bin"), l3_bytes=256 * page) if l3 else \
        dict(l2_bytes=256 * page)
    m = K25Model(K25Config(model_path=model_dir, device="cuda", dtype="float32", kv_cache_bytes=26 * per_block,
                           cache_mode="hierarchical", enable_async_offload=True, enable_prefix_caching=True,
                           max_batch_size=4, prefill_chunk_size=64, max_num_batched_tokens=96, **tiers))
    try:
        got = [o.token_ids for o in m.generate(prompts, **gen)]
        s = m.stats()
        m.generate([shared + [7, 8]], **gen)           # caches its 10 blocks
        for seed in (31, 32, 33):                       # 3 x 14 fresh blocks push them out of L1
            m.generate([prompt_for(m, 200, seed=seed)], **gen)
        s0 = m.stats()
        again = m.generate([shared + [5, 6]], **gen)[0].token_ids
        s1 = m.stats()
        t = m.tier_stats()
    finally:
        m.close()
    assert got == want
    assert s["swap_outs"] > 0 and s["swap_ins"] == s["swap_outs"]
    assert t["fetches_from_l3" if l3 else "fetches_from_l2"] > 0
    assert again == want_shared
    assert s1["prefix_cache_tier_hits"] - s0["prefix_cache_tier_hits"] == 160
