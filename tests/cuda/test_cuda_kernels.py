"""CUDA kernels against PyTorch references (float64 for attention).

Fresh random inputs per case; ragged batches mixing prefill chunks and decodes, permuted
block tables, GQA ratios 1-8, head dims 64 and 128, float32/float16/bfloat16, sliding
windows, split-KV decode, long prefill chunks and decodes (bf16/fp16 take the tensor-core
kernels: wgmma for prefill on compute capability 9.0 with head_dim 128, mma.sync otherwise),
block sizes that tiles do not align to, and NaN in every KV slot that must not be read.
"""
import math
import os

import pytest
import torch

from k25 import _C

cu = getattr(_C, "cuda_ops", None)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1000, 4096, 8192, 1001])  # vectorised sizes, and one that is not
def test_rms_norm_and_add(dtype, n):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(37, n, device="cuda", generator=g).to(dtype)
    w = (torch.rand(n, device="cuda", generator=g) + 0.5).to(dtype)
    # transformers: norm in float32, then the weight in the model dtype
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out = cu.rms_norm(x, w, 1e-5)
    assert rel_err(out, ref) < TOL[dtype] / 4
    d = torch.randn_like(x)
    h = x.clone()
    out = cu.add_rms_norm(h, d, w, 1e-5)
    hs = x + d
    assert torch.equal(h, hs)
    hf = hs.float()
    ref = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert rel_err(out, ref) < TOL[dtype] / 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1])
@pytest.mark.parametrize("N,K", [(1, 8), (37, 576), (300, 4096), (129, 14336), (1000, 2056), (64, 17000)])
@pytest.mark.parametrize("tpr", [None, 32, 256])
def test_gemv_against_float64(dtype, M, N, K, tpr, monkeypatch):
    """y = x W^T (+ b) for a few rows: each output within one rounding of the model dtype
    (plus float32 summation) of the float64 product, for every threads-per-row shape
    (K25_GEMV_TPR), K not a multiple of a CTA's chunks, and N not a multiple of its rows."""
    if tpr:
        monkeypatch.setenv("K25_GEMV_TPR", str(tpr))
    g = torch.Generator(device="cuda").manual_seed(M * 1000 + N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) / math.sqrt(K)).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype)
    # x as a row slice of a wider matrix (stride != K), as the model's activations can be
    x = torch.randn(M, K + 8, device="cuda", generator=g).to(dtype)[:, :K]
    assert cu.gemv_supported(x, w, b)
    ref = x.double() @ w.double().t()
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    for bias in (None, b):
        full = ref + (bias.double() if bias is not None else 0.0)
        y = cu.gemv(x, w, bias)
        assert y.shape == (M, N) and y.dtype == dtype
        # the output's rounding (half an ulp) + float32 sums (2^-16 of the sum of |products|;
        # one missed or doubled chunk of 8 products moves an output by ~100x that)
        bound = full.abs() * eps + 2.0 ** -16 * (x.double().abs() @ w.double().abs().t()) + 1e-30
        assert ((y.double() - full).abs() <= bound).all(), (y.double() - full).abs().max().item()


def test_gemv_declines_what_it_does_not_run(monkeypatch):
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    assert cu.gemv_supported(torch.randn(1, 64, device="cuda", dtype=torch.bfloat16), w)
    assert not cu.gemv_supported(torch.randn(2, 64, device="cuda", dtype=torch.bfloat16), w)  # > 1 row
    assert not cu.gemv_supported(torch.randn(1, 64, device="cuda"), w.float())  # float32: cuBLAS
    w12 = torch.randn(64, 12, device="cuda", dtype=torch.bfloat16)
    assert not cu.gemv_supported(torch.randn(1, 12, device="cuda", dtype=torch.bfloat16), w12)  # K % 8
    assert not cu.gemv_supported(torch.randn(1, 64, device="cuda", dtype=torch.bfloat16), w.t())  # strided W
    with pytest.raises(ValueError):
        cu.gemv(torch.randn(2, 64, device="cuda", dtype=torch.bfloat16), w)
    monkeypatch.setenv("K25_GEMV", "0")
    assert not cu.gemv_supported(torch.randn(1, 64, device="cuda", dtype=torch.bfloat16), w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gu = (torch.randn(19, 2 * 700, device="cuda") * 4).to(dtype)
    ref = torch.nn.functional.silu(gu[:, :700]) * gu[:, 700:]
    assert rel_err(cu.silu_mul(gu), ref) < TOL[dtype] / 4


def rope_tables(max_pos, D):
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return f.cos().float().cuda(), f.sin().float().cuda()


def pool(num_blocks, layout, dtype):
    L, Hkv, D, bs = layout
    return torch.full((num_blocks * L * 2 * Hkv * bs * D,), float("nan"), device="cuda", dtype=dtype)


def pool_view(kv, layout):
    L, Hkv, D, bs = layout
    return kv.view(-1, L, 2, Hkv, bs, D)


def paged_pool(g, seqs, layout, dtype):
    """A NaN-filled pool with room for `seqs` ((context, q_len) pairs) and 3 spare blocks,
    each sequence's blocks drawn from a random permutation: (pool, pool view, block tables
    [sequences, max blocks] padded with -1, per-sequence block lists)."""
    bs = layout[3]
    nb = sum(-(-c // bs) for c, _ in seqs) + 3
    kv = pool(nb, layout, dtype)
    free = torch.randperm(nb, generator=g).tolist()
    tables = torch.full((len(seqs), max(-(-c // bs) for c, _ in seqs)), -1, dtype=torch.int32)
    lists = []
    for i, (ctx, _) in enumerate(seqs):
        table = [free.pop() for _ in range(-(-ctx // bs))]
        tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        lists.append(table)
    return kv, pool_view(kv, layout), tables, lists


def write_kv(pv, layer, bs, table, k, v):
    """Keys and values [context, Hkv, D] of one sequence into its blocks."""
    p = torch.arange(k.shape[0])
    blocks = torch.tensor(table)[p // bs].cuda()
    pv[blocks, layer, 0, :, (p % bs).cuda()] = k
    pv[blocks, layer, 1, :, (p % bs).cuda()] = v


def query_buffer(qrows, Hkv, D, dtype):
    """Rows of q followed by random k and v columns, as the fused QKV projection leaves them."""
    qcat = torch.cat(qrows)
    buf = torch.randn(qcat.shape[0], qcat.shape[1] + 2 * Hkv * D, device="cuda").to(dtype)
    buf[:, :qcat.shape[1]] = qcat
    return buf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D,bs", [(8, 2, 64, 16), (4, 4, 128, 32)])
def test_rope_write_kv(dtype, Hq, Hkv, D, bs):
    L, layer, nb, T = 3, 2, 9, 23
    layout = (L, Hkv, D, bs)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device="cuda").to(dtype)
    pos = torch.randint(0, 400, (T,), dtype=torch.int32, device="cuda")
    slots = torch.randperm(nb * bs, device="cuda")[:T].to(torch.int64)
    cos, sin = rope_tables(512, D)
    c = torch.cat([cos[pos.long()], cos[pos.long()]], -1).to(dtype)[:, None]
    s = torch.cat([sin[pos.long()], sin[pos.long()]], -1).to(dtype)[:, None]

    def ref_rope(x):  # transformers, in the model dtype
        rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
        return x * c + rot * s

    q_ref = ref_rope(qkv[:, :Hq * D].view(T, Hq, D))
    k_ref = ref_rope(qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D))
    v_ref = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    kv = pool(nb, layout, dtype)
    work = qkv.clone()
    cu.rope_write_kv(work, pos, slots, Hq, cos, sin, kv, layout, layer)
    assert rel_err(work[:, :Hq * D].view(T, Hq, D), q_ref) < TOL[dtype] / 4
    pv = pool_view(kv, layout)
    b, off = slots // bs, slots % bs
    assert rel_err(pv[b, layer, 0][torch.arange(T), :, off], k_ref) < TOL[dtype] / 4
    assert torch.equal(pv[b, layer, 1][torch.arange(T), :, off], v_ref)
    assert torch.isnan(pv[:, layer - 1]).all()
    # unfused pair: same results
    kv2 = pool(nb, layout, dtype)
    work2 = qkv.clone()
    cu.rope_inplace(work2, pos, Hq, Hkv, cos, sin)
    cu.write_kv(work2, slots, Hq, kv2, layout, layer)
    assert torch.equal(work2[:, :Hq * D], work[:, :Hq * D])
    assert torch.equal(kv2.nan_to_num(3.0), kv.nan_to_num(3.0))


def ref_attention(q, k, v, positions, window):
    n, Hq, D = q.shape
    ctx, Hkv, _ = k.shape
    kk = k.double().repeat_interleave(Hq // Hkv, 1)
    vv = v.double().repeat_interleave(Hq // Hkv, 1)
    s = torch.einsum("nhd,chd->hnc", q.double(), kk) / math.sqrt(D)
    kpos = torch.arange(ctx, device=q.device)[None, :]
    qpos = positions[:, None]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", torch.softmax(s, -1), vv)


def build_case(seed, dtype, Hq, Hkv, D, bs, window, seqs, parallelism=264, decode_splits=0, wave=0, decode_tail=-1):
    """(call, q buffer, float64 reference) of one random paged-attention case."""
    g = torch.Generator().manual_seed(seed)
    L, layer = 2, 1
    layout = (L, Hkv, D, bs)
    kv, pv, tables, lists = paged_pool(g, seqs, layout, dtype)
    qs, cl, qrows, refs = [0], [], [], []
    for (ctx, qlen), table in zip(seqs, lists):
        k = torch.randn(ctx, Hkv, D, generator=g).to(dtype).cuda()
        v = torch.randn(ctx, Hkv, D, generator=g).to(dtype).cuda()
        write_kv(pv, layer, bs, table, k, v)
        q = torch.randn(qlen, Hq, D, generator=g).to(dtype).cuda()
        refs.append(ref_attention(q, k, v, torch.arange(ctx - qlen, ctx, device="cuda"), window))
        qrows.append(q.reshape(qlen, Hq * D))
        qs.append(qs[-1] + qlen)
        cl.append(ctx)
    buf = query_buffer(qrows, Hkv, D, dtype)
    call = cu.AttentionCall(kv, layout, layer, torch.tensor(qs, dtype=torch.int32), torch.tensor(cl, dtype=torch.int32),
                            tables, Hq, 1.0 / math.sqrt(D), window, parallelism, decode_splits, wave, decode_tail)
    return call, buf, torch.cat(refs).reshape(buf.shape[0], Hq * D)


def run_case(seed, dtype, Hq, Hkv, D, bs, window, seqs, parallelism=264, decode_splits=0):
    call, buf, ref = build_case(seed, dtype, Hq, Hkv, D, bs, window, seqs, parallelism, decode_splits)
    out, merges = call.run(buf), call.merges
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype] / 2, f"relative error {err}"
    return merges


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("D", [64, 128])
def test_paged_attention_mixed_batches(dtype, group, D):
    # Single-token rows take the decode kernel (group <= 8), the others the tiled kernel.
    Hkv = 2
    seqs = [(37, 37), (70, 19), (33, 1), (16, 1), (1, 1), (129, 5), (300, 64)]
    run_case(group * 7 + D, dtype, Hkv * group, Hkv, D, 16, 0, seqs)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_paged_attention_sliding_window(window):
    run_case(window, torch.bfloat16, 8, 2, 128, 16, window, [(90, 30), (64, 1), (17, 17), (1000, 1)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_split_kv_decode(dtype):
    merges = run_case(5, dtype, 32, 8, 128, 16, 0, [(5000, 1), (1200, 1)], parallelism=264)
    assert merges > 0, "the plan was meant to split these decodes"
    assert run_case(6, dtype, 32, 8, 128, 16, 0, [(5000, 1)], parallelism=1) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("splits", [1, 7, 64])
def test_paged_attention_device_derived_splits(dtype, group, D, splits):
    # The CUDA-graph form: key ranges derived on the device from context_lens, including
    # ranges with no keys at all (more splits than keys).
    seqs = [(1, 1), (5, 1), (100, 1), (1000, 1), (3001, 1)]
    merges = run_case(splits * 31 + group, dtype, 2 * group, 2, D, 16, 0, seqs, decode_splits=splits)
    assert merges == (len(seqs) * 2 if splits > 1 else 0)


@pytest.mark.parametrize("window", [0, 33, 700])
def test_paged_attention_decode_long_context(window):
    # Many iterations per warp, block tables of thousands of entries, split and unsplit.
    run_case(window + 1, torch.bfloat16, 32, 8, 128, 16, window, [(20000, 1), (4099, 1)])
    run_case(window + 2, torch.bfloat16, 32, 8, 128, 16, window, [(20000, 1)], decode_splits=48)
    run_case(window + 3, torch.float16, 32, 8, 128, 16, window, [(9000, 1)], parallelism=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bs", [16, 48, 5, 128])
def test_decode_tc_block_sizes_and_splits(dtype, group, D, bs):
    # The tensor-core decode kernel: key tiles (16 or 32 keys) that start anywhere in a
    # block and span several (pages of 16, 48, 5; 128, README's choice for long dense decodes), contexts shorter than a tile or than the
    # four warps' first tiles, ragged ends, unsplit and split work lists, device-derived
    # splits, and a window that is no multiple of a tile.
    seqs = [(1, 1), (2, 1), (15, 1), (16, 1), (17, 1), (100, 1), (1000, 1), (3001, 1)]
    seed = group * 1000 + D + bs
    Hq, Hkv = 2 * group, 2
    assert run_case(seed, dtype, Hq, Hkv, D, bs, 0, seqs, parallelism=1) == 0
    assert run_case(seed + 1, dtype, Hq, Hkv, D, bs, 0, seqs) > 0
    assert run_case(seed + 2, dtype, Hq, Hkv, D, bs, 0, seqs, decode_splits=7) == len(seqs) * Hkv
    run_case(seed + 3, dtype, Hq, Hkv, D, bs, 50, seqs)
    run_case(seed + 4, dtype, Hq, Hkv, D, bs, 50, seqs, decode_splits=64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [4, 8])
def test_decode_tc_32k(dtype, group):
    # 32 query heads at 32K keys (and 32K + 3: a ragged last tile): one CTA walking every
    # key of a head (thousands of tiles per warp), work-list splits and derived splits.
    seqs = [(32771, 1), (32768, 1)]
    Hkv = 32 // group
    assert run_case(group, dtype, 32, Hkv, 128, 16, 0, seqs, parallelism=1) == 0
    assert run_case(group + 1, dtype, 32, Hkv, 128, 16, 0, seqs) > 0
    run_case(group + 2, dtype, 32, Hkv, 128, 16, 0, seqs, decode_splits=64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bs", [16, 48, 128])
@pytest.mark.parametrize("window", [0, 100])
def test_paged_attention_long_prefill_chunks(dtype, group, D, bs, window):
    # The tensor-core path at length: a whole 1500-token prompt and a 300-token chunk at
    # offset 900 (many key tiles per item, the causal edge inside a tile), pages of 48
    # (not a power of two), next to a decode.
    seqs = [(1500, 1500), (1200, 300), (700, 1)]
    run_case(group * 1000 + D + bs + window, dtype, 2 * group, 2, D, bs, window, seqs)


# Compute capability 9.0 (H100 / H200): bf16 / fp16 prefill items of head_dim 128 take the
# wgmma kernel (cuda/prefill_attention_sm90.cu), so every tensor-core test above runs it there;
# K25_PREFILL_ATTENTION=mma sends them to the mma.sync kernel instead.
SM90 = cu is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not SM90, reason="the wgmma prefill kernel runs on compute capability 9.0 only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4, 6, 8])
@pytest.mark.parametrize("bs", [16, 48, 128])
@pytest.mark.parametrize("window", [0, 100])
def test_prefill_sm90_matches_mma_and_float64(monkeypatch, dtype, group, bs, window):
    # A whole 1500-token prompt, chunks at offsets (the causal edge inside a tile, items whose
    # two warpgroups see different tile ranges), a 4K context with a 700-token chunk (many
    # trips around the stage ring) and a decode, through both kernels: each within the
    # tolerance of float64, the wgmma kernel no less accurate than the mma.sync one, and the
    # two not bit-identical (so the wgmma kernel did run).
    seqs = [(1500, 1500), (1200, 300), (4100, 700), (333, 77), (700, 1)]
    call, buf, ref = build_case(group * 100 + bs + window, dtype, 2 * group, 2, 128, bs, window, seqs)
    monkeypatch.delenv("K25_PREFILL_ATTENTION", raising=False)
    out90 = call.run(buf)
    monkeypatch.setenv("K25_PREFILL_ATTENTION", "mma")
    out80 = call.run(buf)
    monkeypatch.delenv("K25_PREFILL_ATTENTION")
    assert torch.isfinite(out90).all()
    e90, e80 = rel_err(out90, ref), rel_err(out80, ref)
    assert e90 < TOL[dtype] / 2, f"wgmma kernel: relative error {e90}"
    assert e80 < TOL[dtype] / 2, f"mma.sync kernel: relative error {e80}"
    assert e90 <= 1.5 * e80 + 1e-6, f"wgmma {e90} vs mma.sync {e80}"
    assert not torch.equal(out90, out80), "identical outputs: the wgmma kernel did not run"
    # Row by row too: a wrong mask or tile shows up as rows of O(1) error under a small total.
    def worst_row(out):
        diff = (out.double() - ref).view(-1, 128).norm(dim=-1)
        return (diff / ref.view(-1, 128).norm(dim=-1).clamp_min(1e-30)).max().item()

    assert worst_row(out90) <= 3 * worst_row(out80) + 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_split_kv_large_group(dtype):
    # 16 query heads per KV head is past the decode kernel: split single-token items take
    # the tiled kernels and their partial results, next to a prefill chunk.
    merges = run_case(9, dtype, 32, 2, 128, 16, 0, [(5000, 1), (1200, 1), (300, 40)])
    assert merges > 0, "the plan was meant to split these decodes"


def poisoned_run(call, buf, width):
    """call.run(buf) into an output block that held NaN: the caching allocator hands back
    the block just freed, so an output element that no kernel wrote shows up as NaN."""
    junk = torch.full((buf.shape[0], width), float("nan"), device="cuda", dtype=buf.dtype)
    del junk
    return call.run(buf)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_merge_in_decode_kernel_counters_reset(monkeypatch, dtype):
    # Split decodes are merged by the last CTA of each (sequence, KV head) in the decode
    # kernel, which sets its counter back to 0: the same call again (a work list twice,
    # derived splits several times, next to unsplit decodes) merges again, and every run
    # equals the two-kernel path (K25_SPLIT_MERGE=kernel: merge_kernel) bit for bit.
    monkeypatch.delenv("K25_SPLIT_MERGE", raising=False)
    seqs = [(5000, 1), (1200, 1), (300, 1), (3, 1)]
    for splits, runs in [(0, 2), (7, 4), (64, 5)]:
        call, buf, ref = build_case(40 + splits, dtype, 32, 8, 128, 16, 0, seqs, decode_splits=splits)
        assert call.merges > 0
        outs = [poisoned_run(call, buf, 32 * 128) for _ in range(runs)]
        for out in outs:
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) < TOL[dtype] / 2
            assert torch.equal(out, outs[0])
        monkeypatch.setenv("K25_SPLIT_MERGE", "kernel")
        two_kernels = poisoned_run(call, buf, 32 * 128)
        monkeypatch.delenv("K25_SPLIT_MERGE")
        assert torch.equal(two_kernels, outs[0]), "the decode kernel's merge differs from merge_kernel"
        assert torch.equal(poisoned_run(call, buf, 32 * 128), outs[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", ["equal", "mixed", "window", "many"])
def test_derived_splits_with_tail_ranges(monkeypatch, dtype, lengths):
    # Tail ranges (AttnBatch::decode_tail): a (sequence, KV head) with two or more ranges of
    # 4,096 keys or more on average gives its last tenth of keys to up to N shorter ranges
    # whose CTAs come after every long one; equal lengths take the in-order items, mixed ones
    # the shares by keys (there the rows of 70000 and 33333 keys get tails, the rest none). Each
    # tail count (the engine's rule, none, 2, 5, 64) against float64, against no tail (the
    # same up to rounding), twice bit for bit, and merged by merge_kernel bit for bit as by
    # the decode kernel. "many": 40 sequences, so the scan's second group of 32 rows (31 rows
    # get tails, two of them past the first 32).
    monkeypatch.delenv("K25_SPLIT_MERGE", raising=False)
    Hq, Hkv, D = 32, 8, 128
    seqs = {"equal": [(20000, 1)] * 8, "mixed": [(70000, 1), (9000, 1), (5000, 1), (2049, 1), (300, 1), (17, 1),
                                                 (1, 1), (33333, 1)],
            "many": [(8200 + i * 1777 % 4000, 1) for i in range(34)] + [(300, 1), (1, 1), (4000, 1), (17, 1),
                                                                       (6000, 1), (2, 1)],
            }.get(lengths, [(70000, 1), (3000, 1), (9000, 1)])
    window = 40000 if lengths == "window" else 0
    splits = 4 if lengths == "equal" else 2
    wave = cu.decode_wave(torch.empty(1, dtype=dtype, device="cuda"), D, Hq // Hkv)
    # The engine's rule: tails where the long ranges fill three quarters of a wave or more
    # (here only the equal case's 4 a row; the others' 2 a row take explicit counts), unless
    # K25_DECODE_TAIL=0 turned it off for this process.
    pairs = len(seqs) * Hkv
    rule = (0 if os.environ.get("K25_DECODE_TAIL") == "0" or 4 * pairs * splits < 3 * wave
            else max(2, min(64, wave // pairs)))
    plain = None
    for tail in [0, -1, 2, 64] if lengths == "many" else [0, -1, 2, 5, 64]:
        call, buf, ref = build_case(77 + splits, dtype, Hq, Hkv, D, 16, window, seqs, decode_splits=splits,
                                    decode_tail=tail)
        assert call.decode_tail == (rule if tail < 0 else tail)
        out = poisoned_run(call, buf, Hq * D)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL[dtype] / 2
        assert torch.equal(poisoned_run(call, buf, Hq * D), out)
        monkeypatch.setenv("K25_SPLIT_MERGE", "kernel")
        assert torch.equal(poisoned_run(call, buf, Hq * D), out), "merge_kernel's merge differs"
        monkeypatch.delenv("K25_SPLIT_MERGE")
        if plain is None:
            plain = out
        else:
            assert rel_err(out, plain) < TOL[dtype] / 2
            if call.decode_tail > 0:
                assert not torch.equal(out, plain), "the same rounding as without tails: were there any?"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [4, 16])
def test_split_merge_mixed_batch(monkeypatch, dtype, group):
    # Split decodes next to a prefill chunk in one launch. Group 4: a decode split into more
    # than 256 pieces (kMaxFusedSplits) is left to merge_kernel while one of ~23 pieces is
    # merged in the decode kernel, and the chunk writes its rows directly. Group 16: the
    # split decodes run in the tiled kernels and merge_kernel merges them all. Twice, and
    # bit for bit the two-kernel path.
    monkeypatch.delenv("K25_SPLIT_MERGE", raising=False)
    seqs = [(70000, 1), (6000, 1), (300, 40)]
    Hq, Hkv = 2 * group, 2
    call, buf, ref = build_case(group + 3, dtype, Hq, Hkv, 128, 16, 0, seqs, parallelism=4096)
    assert call.merges == 2 * Hkv
    outs = [poisoned_run(call, buf, Hq * 128) for _ in range(2)]
    for out in outs:
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL[dtype] / 2
    assert torch.equal(outs[0], outs[1])
    monkeypatch.setenv("K25_SPLIT_MERGE", "kernel")
    assert torch.equal(poisoned_run(call, buf, Hq * 128), outs[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [4, 16])
@pytest.mark.parametrize("splits", [2, 7])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("rows", ["40 mixed", "8 mixed", "8 equal", "40 equal"])
def test_device_derived_splits_shared_by_keys(monkeypatch, dtype, group, splits, window, rows):
    # The CUDA-graph form shares each KV head's rows x splits CTAs out over the rows by their
    # keys, in ranges of at most c keys (cuda/common.cuh, derived_item): 40 rows (the counts are
    # summed 32 rows a warp step) or 8, one long row among short ones (it takes most of the
    # CTAs) and rows of 1-3 keys; 8 rows of one length take the equal-span vote, 40 (more than
    # a warp's vote) the search for c, whose counts come to S_max each.
    # Against float64; group 16 takes the tiled kernel and merge_kernel; with group 4 the decode
    # kernel's own merges equal merge_kernel's bit for bit.
    monkeypatch.delenv("K25_SPLIT_MERGE", raising=False)
    n, kind = rows.split()
    g = torch.Generator().manual_seed(splits * 10 + group + window + int(n))
    if kind == "equal":
        lens = [2500] * int(n)
    else:
        lens = [9000] + torch.randint(1, 700, (int(n) - 4,), generator=g).tolist() + [1, 2, 3]
    seqs = [(k, 1) for k in lens]
    Hq, Hkv = 2 * group, 2
    call, buf, ref = build_case(group + splits + window, dtype, Hq, Hkv, 128, 16, window, seqs, decode_splits=splits)
    out = poisoned_run(call, buf, Hq * 128)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype] / 2
    assert torch.equal(poisoned_run(call, buf, Hq * 128), out)  # the counters went back to 0
    monkeypatch.setenv("K25_SPLIT_MERGE", "kernel")
    assert torch.equal(poisoned_run(call, buf, Hq * 128), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 3000])
def test_eager_plan_split_to_the_engines_wave(dtype, window):
    # LlamaModel's eager steps plan with the decode kernel's wave (AttentionCall's wave, as
    # attention_bench's k25_plan column now does): a long row among short ones and rows of 1-3
    # keys, split into ranges of at most c keys and merged, against float64.
    group, Hkv = 4, 2
    g = torch.Generator().manual_seed(11 + window)
    lens = [9000] + torch.randint(1, 700, (4,), generator=g).tolist() + [1, 2, 3]
    wave = cu.decode_wave(torch.empty(1, dtype=dtype, device="cuda"), 128, group)
    assert wave >= 32  # want = wave / 16 items >= 2, or the plan would not split
    call, buf, ref = build_case(window + 5, dtype, group * Hkv, Hkv, 128, 16, window, [(k, 1) for k in lens],
                                parallelism=1, wave=wave)
    assert call.merges >= Hkv  # the long row was split (parallelism 1 alone would split nothing)
    out = poisoned_run(call, buf, group * Hkv * 128)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype] / 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", ["graph", "eager"])
def test_decode_after_rope_reads_the_key_rope_wrote(dtype, form):
    # A decode step's order: RoPE and the cache write of each row's token (key ctx - 1), then
    # the decode kernel, which in a dense batch starts its prologue before its pdl_wait,
    # overlapping RoPE (cuda/decode_attention.cu). Key ctx - 1 is NaN before each RoPE: a
    # kernel that read it before RoPE wrote it would return NaN. Several rounds, each against
    # float64 over the pool as RoPE left it (identity tables: q and k pass through unchanged).
    group, Hkv, D, bs, layer = 4, 2, 128, 16, 1
    Hq, layout = group * Hkv, (2, Hkv, D, bs)
    lens = [3001, 2048, 777, 4096]
    g = torch.Generator().manual_seed(31)
    kv, pv, tables, lists = paged_pool(g, [(n, 1) for n in lens], layout, dtype)
    for n, table in zip(lens, lists):
        write_kv(pv, layer, bs, table, torch.randn(n, Hkv, D, generator=g).to(dtype).cuda(),
                 torch.randn(n, Hkv, D, generator=g).to(dtype).cuda())
    buf = query_buffer([torch.randn(1, Hq * D, generator=g).to(dtype).cuda() for _ in lens], Hkv, D, dtype)
    newest = torch.tensor([lists[i][(n - 1) // bs] for i, n in enumerate(lens)], device="cuda")
    off = torch.tensor([(n - 1) % bs for n in lens], device="cuda")
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device="cuda")
    slots = (newest * bs + off).to(torch.int64)
    cos = torch.ones(max(lens), D // 2, device="cuda")
    sin = torch.zeros(max(lens), D // 2, device="cuda")
    wave = cu.decode_wave(torch.empty(1, dtype=dtype, device="cuda"), D, group) if form == "eager" else 0
    call = cu.AttentionCall(kv, layout, layer, torch.arange(len(lens) + 1, dtype=torch.int32),
                            torch.tensor(lens, dtype=torch.int32), tables, Hq, 1.0 / math.sqrt(D), 0,
                            264 if form == "graph" else 1, 4 if form == "graph" else 0, wave)
    # The pool as RoPE leaves it (every round writes the same key and value), and its reference.
    cu.rope_write_kv(buf, pos, slots, Hq, cos, sin, kv, layout, layer)
    refs = []
    for i, (n, table) in enumerate(zip(lens, lists)):
        p = torch.arange(n, device="cuda")
        blocks = torch.tensor(table, device="cuda")[p // bs]
        k, v = pv[blocks, layer, 0, :, p % bs], pv[blocks, layer, 1, :, p % bs]
        q = buf[i, :Hq * D].view(1, Hq, D)
        refs.append(ref_attention(q, k, v, torch.tensor([n - 1], device="cuda"), 0).reshape(1, Hq * D))
    ref = torch.cat(refs)
    for _ in range(6):
        pv[newest, layer, :, :, off] = float("nan")
        cu.rope_write_kv(buf, pos, slots, Hq, cos, sin, kv, layout, layer)
        out = call.run(buf)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL[dtype] / 2


def test_paged_attention_random_shapes():
    g = torch.Generator().manual_seed(77)
    for trial in range(8):
        seqs = []
        for _ in range(int(torch.randint(1, 7, (1,), generator=g))):
            ctx = int(torch.randint(1, 700, (1,), generator=g))
            seqs.append((ctx, int(torch.randint(1, ctx + 1, (1,), generator=g))))
        run_case(trial, DTYPES[trial % 3], 4 * [1, 2, 4, 8][trial % 4], 4, [64, 128][trial % 2], [16, 32][trial % 2],
                 0, seqs)


@pytest.mark.parametrize("n", [1000, 50000, 128256])  # one CTA per row, and split into chunks
def test_argmax_rows_lowest_index_on_ties(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(9, n, device="cuda", generator=g)
    x[3, 100] = x[3, n - 5] = 1e9    # a tie across chunks: the lower index wins
    x[4, 7] = x[4, 9] = 1e9          # a tie inside one chunk
    x[5] = -1.0
    x[5, n // 2] = 0.0
    x[5, n // 3] = -0.0              # -0 == +0: the lower index wins, as in torch
    x[6, :n // 2] = float("nan")     # NaN is skipped
    ids = cu.argmax_rows(x)
    expect = torch.nan_to_num(x, nan=-float("inf")).argmax(-1).to(torch.int32)
    expect[3], expect[4], expect[5] = 100, 7, n // 3
    assert torch.equal(ids, expect)
