"""CPU kernels against plain PyTorch references in float64.

Every case draws fresh random inputs: ragged batches, permuted block tables, GQA ratios,
head dims with and without the vectorised fast path, sliding windows, and NaN garbage in
KV slots that must never be read.
"""
import math

import pytest
import torch

from k25 import _C

ops = _C.ops


def ref_rms(x, w, eps):
    x = x.double()
    return (w.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))).float()


@pytest.mark.parametrize("rows,n", [(1, 576), (7, 64), (33, 1000), (5, 17)])
def test_rms_norm_matches_reference(rows, n):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, n, generator=g) * 3
    w = torch.randn(n, generator=g)
    out = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, ref_rms(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    # strided rows (a view into a wider buffer)
    wide = torch.randn(rows, n + 9, generator=g)
    view = wide[:, 3:3 + n]
    torch.testing.assert_close(ops.rms_norm(view, w, 1e-6), ref_rms(view, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_add_rms_norm_updates_residual_and_normalises():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(9, 576, generator=g)
    d = torch.randn(9, 576, generator=g)
    w = torch.randn(576, generator=g)
    expect_h = h + d
    out = ops.add_rms_norm(h, d, w, 1e-5)
    torch.testing.assert_close(h, expect_h, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, ref_rms(expect_h, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_silu_mul_matches_reference():
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(13, 2 * 300, generator=g) * 6
    out = ops.silu_mul(gu)
    gd = gu.double()
    ref = (torch.nn.functional.silu(gd[:, :300]) * gd[:, 300:]).float()
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("M,N,K", [(1, 3072, 576), (3, 7, 37), (4, 65, 128), (6, 130, 1536), (16, 33, 576)])
def test_linear_few_rows_matches_reference_and_each_row_is_batch_independent(M, N, K):
    g = torch.Generator().manual_seed(M * 7 + N + K)
    wide = torch.randn(M, K + 5, generator=g)
    x = wide[:, 2:2 + K]  # rows with a stride wider than K
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    ref = x.double() @ w.double().T
    tol = 1e-6 * math.sqrt(K)
    torch.testing.assert_close(ops.linear_few_rows(x, w), ref.float(), rtol=1e-5, atol=tol)
    yb = ops.linear_few_rows(x, w, b)
    torch.testing.assert_close(yb, (ref + b.double()).float(), rtol=1e-5, atol=tol)
    # A row's outputs are the same bits alone, in any position of a batch, with any N split.
    for m in range(M):
        assert torch.equal(ops.linear_few_rows(x[m:m + 1], w, b), yb[m:m + 1])
    assert torch.equal(ops.linear_few_rows(x.flip(0).contiguous(), w, b), yb.flip(0))
    assert torch.equal(torch.cat([ops.linear_few_rows(x, w[:N // 2], b[:N // 2]),
                                  ops.linear_few_rows(x, w[N // 2:], b[N // 2:])], 1), yb)
    with pytest.raises(Exception, match="w: need 2-D rows"):
        ops.linear_few_rows(x, w.T.contiguous().T)
    with pytest.raises(Exception, match="b must have N elements"):
        ops.linear_few_rows(x, w, b[1:])


# ---- paged KV helpers (the layout is restated here independently of the C++ code) ----

def pool_view(pool, layout, num_blocks):
    L, Hkv, D, bs = layout
    return pool.view(num_blocks, L, 2, Hkv, bs * D)


def put_kv(pool, layout, num_blocks, layer, block, off, k, v):
    """Stores k, v ([Hkv, D]) for one slot: K transposed [D][bs], V [bs][D]."""
    L, Hkv, D, bs = layout
    pv = pool_view(pool, layout, num_blocks)
    kb = pv[block, layer, 0].view(Hkv, D, bs)
    vb = pv[block, layer, 1].view(Hkv, bs, D)
    kb[:, :, off] = k
    vb[:, off, :] = v


def get_kv(pool, layout, num_blocks, layer, table, n):
    """K, V of the first n positions of a sequence: [n, Hkv, D] each."""
    L, Hkv, D, bs = layout
    pv = pool_view(pool, layout, num_blocks)
    ks, vs = [], []
    for p in range(n):
        b, off = table[p // bs], p % bs
        ks.append(pv[b, layer, 0].view(Hkv, D, bs)[:, :, off])
        vs.append(pv[b, layer, 1].view(Hkv, bs, D)[:, off, :])
    return torch.stack(ks), torch.stack(vs)


def rope_tables(max_pos, D, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return f.cos().float(), f.sin().float()


def ref_rope(x, pos, cos, sin):
    """x: [T, H, D]; rotate-half RoPE in float64."""
    D = x.shape[-1]
    c = torch.cat([cos[pos], cos[pos]], -1).double()[:, None, :]
    s = torch.cat([sin[pos], sin[pos]], -1).double()[:, None, :]
    xd = x.double()
    rot = torch.cat([-xd[..., D // 2:], xd[..., :D // 2]], -1)
    return (xd * c + rot * s).float()


@pytest.mark.parametrize("Hq,Hkv,D,bs", [(9, 3, 64, 16), (4, 4, 128, 32), (8, 1, 80, 8)])
def test_rope_write_kv_matches_reference(Hq, Hkv, D, bs):
    g = torch.Generator().manual_seed(Hq * 7 + D)
    L, layer, num_blocks, T = 3, 1, 12, 21
    layout = (L, Hkv, D, bs)
    pool = torch.full((num_blocks * L * 2 * Hkv * bs * D,), float("nan"))
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g)
    positions = torch.randint(0, 500, (T,), generator=g, dtype=torch.int32)
    slots = torch.randperm(num_blocks * bs, generator=g)[:T].to(torch.int64)
    cos, sin = rope_tables(512, D)
    q_ref = ref_rope(qkv[:, :Hq * D].view(T, Hq, D), positions.long(), cos, sin)
    k_ref = ref_rope(qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D), positions.long(), cos, sin)
    v_ref = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D).clone()
    work = qkv.clone()
    ops.rope_write_kv(work, positions, slots, Hq, cos, sin, pool, layout, layer)
    torch.testing.assert_close(work[:, :Hq * D].view(T, Hq, D), q_ref, rtol=1e-5, atol=1e-5)
    pv = pool_view(pool, layout, num_blocks)
    for t in range(T):
        b, off = int(slots[t]) // bs, int(slots[t]) % bs
        torch.testing.assert_close(pv[b, layer, 0].view(Hkv, D, bs)[:, :, off], k_ref[t], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pv[b, layer, 1].view(Hkv, bs, D)[:, off, :], v_ref[t], rtol=0, atol=0)
    # Other layers stay untouched.
    assert torch.isnan(pv[:, 0]).all() and torch.isnan(pv[:, 2]).all()

    # The unfused pair (rope_inplace + write_kv) gives the same cache and q.
    pool2 = torch.full_like(pool, float("nan"))
    work2 = qkv.clone()
    ops.rope_inplace(work2, positions, Hq, Hkv, D, cos, sin)
    ops.write_kv(work2, slots, Hq, pool2, layout, layer)
    torch.testing.assert_close(work2[:, :Hq * D], work[:, :Hq * D], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool2.nan_to_num(7.0), pool.nan_to_num(7.0), rtol=1e-6, atol=1e-6)


def ref_attention(q, k, v, positions, window):
    """q: [n, Hq, D] at `positions`; k, v: [ctx, Hkv, D]; float64 causal attention."""
    n, Hq, D = q.shape
    ctx, Hkv, _ = k.shape
    group = Hq // Hkv
    kk = k.double().repeat_interleave(group, 1)  # [ctx, Hq, D]
    vv = v.double().repeat_interleave(group, 1)
    s = torch.einsum("nhd,chd->hnc", q.double(), kk) / math.sqrt(D)
    kpos = torch.arange(ctx)[None, :]
    qpos = positions[:, None]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(s, -1)
    return torch.einsum("hnc,chd->nhd", p, vv).float()


def run_attention_case(seed, Hq, Hkv, D, bs, window, seqs):
    """seqs: list of (context_len, q_len): each sequence's last q_len tokens are new."""
    g = torch.Generator().manual_seed(seed)
    L, layer = 2, 1
    layout = (L, Hkv, D, bs)
    need = sum(-(-c // bs) for c, _ in seqs)
    num_blocks = need + 5
    pool = torch.full((num_blocks * L * 2 * Hkv * bs * D,), float("nan"))
    free = torch.randperm(num_blocks, generator=g).tolist()  # tables are permutations
    max_blocks = max(-(-c // bs) for c, _ in seqs)
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    qs, cl, qrows, refs = [0], [], [], []
    for i, (ctx, qlen) in enumerate(seqs):
        nb = -(-ctx // bs)
        table = [free.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(ctx, Hkv, D, generator=g)
        v = torch.randn(ctx, Hkv, D, generator=g)
        for p in range(ctx):
            put_kv(pool, layout, num_blocks, layer, table[p // bs], p % bs, k[p], v[p])
        q = torch.randn(qlen, Hq, D, generator=g)
        positions = torch.arange(ctx - qlen, ctx)
        refs.append(ref_attention(q, k, v, positions, window))
        qrows.append(q.reshape(qlen, Hq * D))
        qs.append(qs[-1] + qlen)
        cl.append(ctx)
    # q rows inside a wider buffer, as the model passes them (q part of the qkv rows)
    qcat = torch.cat(qrows)
    buf = torch.randn(qcat.shape[0], qcat.shape[1] + 2 * Hkv * D, generator=g)
    buf[:, :Hq * D] = qcat
    out = ops.paged_attention(buf, pool, layout, layer, torch.tensor(qs, dtype=torch.int32),
                              torch.tensor(cl, dtype=torch.int32), tables, Hq, 1.0 / math.sqrt(D), window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.cat(refs).reshape(out.shape), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("D,bs", [(64, 16), (128, 16), (64, 32), (80, 16), (64, 8)])
def test_paged_attention_mixed_batch(group, D, bs):
    Hkv = 2 if group < 8 else 1
    # prefill from scratch, chunk continuing a prefix, decodes (incl. block edges), a tiny seq
    seqs = [(37, 37), (70, 19), (33, 1), (16, 1), (1, 1), (129, 5)]
    run_attention_case(seed=group * 100 + D + bs, Hq=Hkv * group, Hkv=Hkv, D=D, bs=bs, window=0, seqs=seqs)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_paged_attention_sliding_window(window):
    seqs = [(90, 30), (64, 1), (17, 17)]
    run_attention_case(seed=window, Hq=6, Hkv=2, D=64, bs=16, window=window, seqs=seqs)


def test_paged_attention_random_shapes():
    g = torch.Generator().manual_seed(1234)
    for trial in range(6):
        n = int(torch.randint(1, 6, (1,), generator=g))
        seqs = []
        for _ in range(n):
            ctx = int(torch.randint(1, 300, (1,), generator=g))
            qlen = int(torch.randint(1, ctx + 1, (1,), generator=g))
            seqs.append((ctx, qlen))
        group = [1, 3, 4][trial % 3]
        run_attention_case(seed=trial, Hq=2 * group, Hkv=2, D=[64, 128][trial % 2], bs=16, window=0, seqs=seqs)


@pytest.mark.parametrize("Hq,Hkv,D,window", [(9, 3, 64, 0), (8, 1, 128, 0), (4, 2, 80, 0), (6, 2, 64, 700)])
def test_paged_attention_split_kv_decode(Hq, Hkv, D, window):
    # Few long decode rows: the kernel splits their keys across threads and merges.
    run_attention_case(seed=D + window, Hq=Hq, Hkv=Hkv, D=D, bs=16, window=window, seqs=[(2100, 1)])
    run_attention_case(seed=D + window + 1, Hq=Hq, Hkv=Hkv, D=D, bs=16, window=window, seqs=[(1500, 1), (613, 1)])
    # Rows of unequal length: the long one takes the ranges the short ones do not need.
    run_attention_case(seed=D + window + 2, Hq=Hq, Hkv=Hkv, D=D, bs=16, window=window,
                       seqs=[(3000, 1), (300, 1), (40, 1)])


def test_paged_attention_does_not_depend_on_thread_count():
    before = _C.get_num_threads()
    try:
        for n in (1, 2, 3):
            _C.set_num_threads(n)
            assert _C.get_num_threads() == n
            run_attention_case(seed=99, Hq=6, Hkv=2, D=64, bs=16, window=0, seqs=[(1800, 1), (40, 7)])
    finally:
        _C.set_num_threads(before)


def plan_of(lens, heads=8, group=4, wave=264, parallelism=1, window=0, q_lens=None):
    """ops.plan_attention of decode rows of these lengths (q_lens: other query lengths), with
    every item's key range resolved to [begin, end) of its row."""
    q_lens = q_lens or [1] * len(lens)
    qs = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    work, merges, num_decode = ops.plan_attention(qs, torch.tensor(lens, dtype=torch.int32), heads, group, 128,
                                                  parallelism, wave, 256, window)
    ctx = torch.tensor(lens, dtype=torch.int64)[work[:, 0].long()]
    lo = (ctx - window).clamp(min=0) if window else torch.zeros_like(ctx)
    begin = torch.maximum(work[:, 4].long(), lo)
    end = torch.minimum(work[:, 5].long(), ctx)
    return work, merges, num_decode, begin, end


def check_plan_covers(rows, heads, window, work, merges, begin, end):
    """Every decode row (rows: {row: context length}) and KV head is covered once: its items'
    ranges tile [lo, ctx) in order, and a split row's pieces are exactly its merge's slots."""
    for s, ctx in rows.items():
        lo = max(0, ctx - window) if window else 0
        for h in range(heads):
            mine = ((work[:, 0] == s) & (work[:, 1] == h)).nonzero().flatten().tolist()
            ranges = sorted((int(begin[i]), int(end[i])) for i in mine)
            assert ranges[0][0] == lo and ranges[-1][1] == ctx
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            if len(mine) > 1:
                m = {int(work[i, 7]) for i in mine}
                assert len(m) == 1
                seq, head, first, count = merges[m.pop()].tolist()
                assert (seq, head, count) == (s, h, len(mine))
                assert sorted(int(work[i, 6]) for i in mine) == list(range(first, first + count))
            else:
                assert work[mine[0], 6] == -1


@pytest.mark.parametrize("window", [0, 700])
def test_attention_plan_shares_split_ranges_by_keys(window):
    # A long decode row beside short ones on a GPU wave of 264 CTAs, 8 KV heads: each of the 64
    # (row, head) items would get 264 // 64 = 4 ranges under an equal share, i.e. 8,192 keys a
    # range for the long row. Shared by keys, the longest range is within twice the batch's
    # keys over the ranges made, and the items still fit one wave.
    lens = [32768] + [2048] * 7
    work, merges, num_decode, begin, end = plan_of(lens, window=window)
    check_plan_covers(dict(enumerate(lens)), 8, window, work, merges, begin, end)
    assert len(work) <= 264 and num_decode == len(work)
    keys = end - begin
    assert keys.max() <= 2 * keys.sum() / len(work), (keys.max(), keys.sum(), len(work))
    # Equal rows keep the equal share: 264 // 64 ranges each (at most one per 256 keys), all
    # the same size.
    work, merges, _, begin, end = plan_of([8192] * 8, window=window)
    check_plan_covers(dict(enumerate([8192] * 8)), 8, window, work, merges, begin, end)
    span = min(8192, window or 8192)
    assert len(work) == 64 * min(264 // 64, span // 256) and len(set((end - begin).tolist())) == 1


def test_attention_plan_mixed_step_and_thread_share():
    # A prompt chunk of 200 tokens between two decodes: the chunk's items (32 query rows of a
    # group of 4 each) are never split and come after the decodes, which are covered.
    work, merges, num_decode, begin, end = plan_of([4000, 300, 5000], q_lens=[1, 200, 1])
    chunk = work[:, 0] == 1
    assert chunk.sum() == 8 * -(-200 // 32) and (work[chunk, 6] == -1).all()
    assert num_decode == (~chunk).sum() and not chunk[:num_decode].any()
    check_plan_covers({0: 4000, 2: 5000}, 8, 0, work, merges, begin, end)
    # The CPU's soft rule (twice the threads, rounded up): one decode row of 3,000 keys beside
    # two short ones on 2 threads, 4 targets over 3 items (want = 2 ranges an item), gets more
    # ranges than its equal share of 2, and the plan makes at most want x items.
    work, merges, _, begin, end = plan_of([3000, 300, 40], heads=1, group=8, wave=0, parallelism=2)
    check_plan_covers({0: 3000, 1: 300, 2: 40}, 1, 0, work, merges, begin, end)
    assert (work[:, 0] == 0).sum() > 2 and len(work) <= 2 * 3


def test_plan_attention_rejects_bad_shapes():
    qs, cl = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    for kw in (dict(group=0), dict(max_rows=0), dict(num_kv_heads=0), dict(group=-1)):
        args = dict(num_kv_heads=1, group=4, max_rows=128, parallelism=1, wave=0, min_split_keys=256,
                    sliding_window=0)
        args.update(kw)
        with pytest.raises(Exception, match="plan_attention"):
            ops.plan_attention(qs, cl, **args)
    with pytest.raises(Exception, match="query_start"):
        ops.plan_attention(torch.tensor([0, 1, 2], dtype=torch.int32), cl, 1, 4, 128, 1, 0, 256, 0)
