"""Dynamic block sparsity on the CPU (ops/block_sparsity.h): key summaries, the selection
rule, sparse attention against dense attention over the kept blocks (PyTorch, float64),
and the engine-level switches and statistics."""
import math

import numpy as np
import pytest
import torch

from k25 import K25Config, K25Model, _C
from k25.errors import ConfigError

L, HKV, D, BS = 2, 2, 64, 16
LAYOUT = (L, HKV, D, BS)


def empty_pool(num_blocks, bs=BS):
    # CPU layout: [blocks][layers][K, V][heads] with K transposed ([D][bs]) and V [bs][D].
    return torch.full((num_blocks, L, 2, HKV, bs * D), float("nan"))


def write_keys(pool, layer, table, keys, values, start=0, bs=BS):
    """Writes keys/values [n, HKV, D] for positions start.. through the block table."""
    for i in range(keys.shape[0]):
        pos = start + i
        b, off = table[pos // bs], pos % bs
        kt = pool[b, layer, 0].view(HKV, D, bs)
        kt[:, :, off] = keys[i]
        pool[b, layer, 1].view(HKV, bs, D)[:, off] = values[i]


def batch(ctxs, qlens, tables):
    qs = torch.tensor([0] + list(np.cumsum(qlens)), dtype=torch.int32)
    cl = torch.tensor(ctxs, dtype=torch.int32)
    width = max(len(t) for t in tables)
    bt = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return qs, cl, bt


def bounds(summ):
    """The minima and maxima a summary row stands for (field 0: per channel one 32-bit word,
    the minimum's bfloat16 bits in its low half, the maximum's in its high half)."""
    w = summ[..., 0, :].contiguous().view(torch.int32)
    return (w << 16).view(torch.float32), (w & -65536).view(torch.float32)


def bf16_outward(x, up):
    """x rounded to bfloat16 toward +inf (up) or -inf, from torch's round-to-nearest: where the
    nearest lies on the wrong side of x, one bfloat16 step further."""
    r = x.to(torch.bfloat16).to(torch.float32)
    wrong = r < x if up else r > x
    bits = r.view(torch.int32)
    # One step up (down): the magnitude grows for a value of that sign, shrinks for the other.
    away = (r > 0) if up else (r < 0)
    step = torch.where(away, bits + 65536, bits - 65536)
    step = torch.where(r == 0, torch.tensor(65536 if up else -2147418112, dtype=torch.int32), step)
    return torch.where(wrong, step.view(torch.float32), r)


def stored_codes(summ, bs=BS):
    """The key codes of summary rows [..., fields, D] with codes (fields 1 .. W, W = ceil(bs / 16);
    key t of word w at bits 2 (t % 16)): [..., 16 W, D] integers."""
    W = -(-bs // 16)
    w = summ[..., 1:1 + W, :].contiguous().view(torch.int32)  # [..., W, D]
    shifts = torch.arange(16, dtype=torch.int32)[:, None] * 2
    return ((w[..., None, :, :].transpose(-3, -2) >> shifts) & 3).flatten(-3, -2)


def reference_codes(keys, lo, hi):
    """The documented 2-bit code of each key (float32 like the engine): the nearest of
    lo + c (hi - lo) / 3, halves to even, 0 where lo == hi."""
    inv = torch.where(hi > lo, 3.0 / (hi - lo), torch.zeros_like(hi))
    return torch.round((keys - lo) * inv).clamp(0, 3).to(torch.int32)


@pytest.mark.parametrize("bs", [8, 16, 24, 32])
def test_key_codes_place_each_key_in_its_channels_bounds(bs):
    """With key codes, each key of a block is coded against the block's bounds as they stand
    after the step: a later key that widens a channel's range re-codes the earlier ones."""
    g = torch.Generator().manual_seed(bs)
    W, n = -(-bs // 16), 130
    nb = -(-n // bs) + 2
    pool = empty_pool(nb, bs)
    summ = torch.full((nb, L, HKV, 1 + W, D), float("nan"))
    table = torch.randperm(nb, generator=g)[:-(-n // bs)].tolist()
    keys = torch.randn(n, HKV, D, generator=g)
    keys[77] *= 4  # widens its block's ranges after earlier keys were coded
    vals = torch.randn(n, HKV, D, generator=g)
    write_keys(pool, 1, table, keys[:70], vals[:70], bs=bs)
    qs, cl, bt = batch([70], [70], [table])
    _C.ops.update_key_summaries(pool.view(-1), (L, HKV, D, bs), summ, 1, qs, cl, bt, key_codes=True)
    # A chunk of 7 that starts inside a block (and at bs 8 ends in the next), then single tokens.
    write_keys(pool, 1, table, keys[70:77], vals[70:77], start=70, bs=bs)
    qs, cl, bt = batch([77], [7], [table])
    _C.ops.update_key_summaries(pool.view(-1), (L, HKV, D, bs), summ, 1, qs, cl, bt, key_codes=True)
    for t in range(77, n):
        write_keys(pool, 1, table, keys[t:t + 1], vals[t:t + 1], start=t, bs=bs)
        qs, cl, bt = batch([t + 1], [1], [table])
        _C.ops.update_key_summaries(pool.view(-1), (L, HKV, D, bs), summ, 1, qs, cl, bt, key_codes=True)
    mn, mx = bounds(summ[:, 1])
    codes = stored_codes(summ[:, 1], bs)  # [nb, HKV, 16 W, D]
    widened = 0
    for j in range(-(-n // bs)):
        blk = keys[j * bs:(j + 1) * bs]  # [k, HKV, D]
        k = blk.shape[0]
        assert torch.equal(mn[table[j]], bf16_outward(blk.amin(0), up=False)), j
        want = reference_codes(blk, mn[table[j]], mx[table[j]]).transpose(0, 1)  # [HKV, k, D]
        got = codes[table[j]]
        assert torch.equal(got[:, :k], want), j
        assert (got[:, k:] == 0).all(), "codes past the block's keys are 0"
        step = (mx[table[j]] - mn[table[j]]) / 3
        back = mn[table[j]] + got[:, :k].transpose(0, 1) * step
        assert ((back - blk).abs() <= step / 2 * 1.0001 + 1e-6).all(), j
        if j == 77 // bs:  # its earlier keys were coded against narrower bounds first, then again
            early = keys[j * bs:77]
            before = reference_codes(early, bf16_outward(early.amin(0), up=False), bf16_outward(early.amax(0), up=True))
            assert not torch.equal(got[:, :77 - j * bs], before.transpose(0, 1)), "not re-coded"
            widened += 1
    assert widened == 1
    assert torch.isnan(summ[:, 0]).all(), "another layer's summaries were touched"
    # Sums follow the codes when both are kept.
    both = torch.full((nb, L, HKV, 3 + W, D), float("nan"))
    qs, cl, bt = batch([n], [n], [table])
    _C.ops.update_key_summaries(pool.view(-1), (L, HKV, D, bs), both, 1, qs, cl, bt, key_codes=True)
    assert torch.equal(both[:, 1, :, :1 + W][torch.tensor(table)].view(torch.int32),
                       summ[:, 1, :, :1 + W][torch.tensor(table)].view(torch.int32))
    for j in range(-(-n // bs)):
        blk = slice(j * bs, min(n, (j + 1) * bs))
        assert torch.allclose(both[table[j], 1, :, 1 + W], keys[blk].sum(0), atol=1e-4)
        assert torch.allclose(both[table[j], 1, :, 2 + W], vals[blk].sum(0), atol=1e-4)
    wrong = torch.zeros(nb, L, HKV, 2 + W, D)  # neither codes alone nor codes and sums
    with pytest.raises(ValueError, match="fields"):
        _C.ops.update_key_summaries(pool.view(-1), (L, HKV, D, bs), wrong, 1, qs, cl, bt, key_codes=True)


def test_summaries_are_the_per_channel_min_and_max_of_each_blocks_keys():
    # Rounded outward to bfloat16 (the Quest bound stays a bound), the minimum down, the maximum up.
    g = torch.Generator().manual_seed(0)
    nb = 12
    pool = empty_pool(nb)
    summ = torch.full((nb, L, HKV, 1, D), float("nan"))
    table = torch.randperm(nb, generator=g)[:9].tolist()
    keys = torch.randn(130, HKV, D, generator=g)
    vals = torch.randn(130, HKV, D, generator=g)
    # A prefill chunk of 70, then 60 more tokens one step at a time (the decode path).
    write_keys(pool, 1, table, keys[:70], vals[:70])
    qs, cl, bt = batch([70], [70], [table])
    _C.ops.update_key_summaries(pool.view(-1), LAYOUT, summ, 1, qs, cl, bt)
    for t in range(70, 130):
        write_keys(pool, 1, table, keys[t:t + 1], vals[t:t + 1], start=t)
        qs, cl, bt = batch([t + 1], [1], [table])
        _C.ops.update_key_summaries(pool.view(-1), LAYOUT, summ, 1, qs, cl, bt)
    mn, mx = bounds(summ[:, 1])
    for j in range(-(-130 // BS)):
        blk = keys[j * BS:(j + 1) * BS]  # [n, HKV, D]
        assert torch.equal(mn[table[j]], bf16_outward(blk.amin(0), up=False)), j
        assert torch.equal(mx[table[j]], bf16_outward(blk.amax(0), up=True)), j
        assert (mn[table[j]] <= blk.amin(0)).all() and (mx[table[j]] >= blk.amax(0)).all()
        assert ((blk.amin(0) - mn[table[j]]) <= blk.amin(0).abs() / 128).all()
    assert torch.isnan(summ[:, 0]).all(), "another layer's summaries were touched"
    # A reused block starts over at its first slot: no stale minimum survives.
    write_keys(pool, 1, table, keys[:1] + 100.0, vals[:1])
    qs, cl, bt = batch([1], [1], [table])
    _C.ops.update_key_summaries(pool.view(-1), LAYOUT, summ, 1, qs, cl, bt)
    mn, mx = bounds(summ[table[0], 1])
    assert torch.equal(mn, bf16_outward(keys[0] + 100.0, up=False))
    assert torch.equal(mx, bf16_outward(keys[0] + 100.0, up=True))


def random_sequences(seed, ctxs, Hq, bs=BS, codes=False):
    g = torch.Generator().manual_seed(seed)
    nb_total = sum(-(-c // bs) for c in ctxs) + 2
    pool = empty_pool(nb_total, bs)
    summ = torch.zeros(nb_total, L, HKV, 1 + (-(-bs // 16) if codes else 0), D)
    free = torch.randperm(nb_total, generator=g).tolist()
    tables, ks, vs = [], [], []
    for c in ctxs:
        table = [free.pop() for _ in range(-(-c // bs))]
        # Keys with structure: a few "topic" directions so that some blocks matter more.
        base = torch.randn(8, HKV, D, generator=g)
        which = torch.randint(8, (c,), generator=g)
        k = base[which] * 2 + torch.randn(c, HKV, D, generator=g) * 0.5
        v = torch.randn(c, HKV, D, generator=g)
        write_keys(pool, 0, table, k, v, bs=bs)
        qs, cl, bt = batch([c], [c], [table])
        _C.ops.update_key_summaries(pool.view(-1), (L, HKV, D, bs), summ, 0, qs, cl, bt, key_codes=codes)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(ctxs), Hq * D, generator=g)
    # Queries pointing at one topic, so the selection has something to find.
    for i in range(len(ctxs)):
        q[i] = (torch.randn(Hq, D, generator=g) + 3 * ks[i][len(ks[i]) // 3].repeat_interleave(Hq // HKV, 0)).reshape(-1)
    return pool, summ, tables, ks, vs, q


def dense_over(q, k, v, Hq, positions):
    """Attention of one query row over the keys at `positions` (float64)."""
    group = Hq // HKV
    qq = q.view(Hq, D).double()
    kk = k[positions].double().repeat_interleave(group, 1)  # [n, Hq, D]
    vv = v[positions].double().repeat_interleave(group, 1)
    s = torch.einsum("hd,nhd->hn", qq, kk) / math.sqrt(D)
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv)


@pytest.mark.parametrize("Hq", [2, 6])
def test_sparse_attention_equals_dense_attention_over_the_kept_blocks(Hq):
    ctxs = [3000, 700, 2500]
    pool, summ, tables, ks, vs, q = random_sequences(Hq, ctxs, Hq)
    qs, cl, bt = batch(ctxs, [1, 1, 1], tables)
    out, info = _C.ops.sparse_attention(q, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ, Hq, 1 / math.sqrt(D),
                                        min_context=1000, recent_blocks=4, sink_blocks=1, max_ratio=0.6)
    MB = bt.shape[1]
    heads = torch.tensor(info["head_tables"]).view(len(ctxs), HKV, MB)
    assert info["sparse"] == [1, 0, 1], "only contexts above min_context go sparse"
    for i, ctx in enumerate(ctxs):
        o = out[i].view(Hq, D).double()
        if not info["sparse"][i]:
            ref = dense_over(q[i], ks[i], vs[i], Hq, torch.arange(ctx))
            assert torch.allclose(o, ref, atol=1e-5)
            assert info["context_lens"][i] == ctx
            continue
        nb = -(-ctx // BS)
        for h in range(HKV):
            kept_phys = [b for b in heads[i, h].tolist() if b >= 0]
            kept = sorted(tables[i].index(b) for b in kept_phys)
            assert [tables[i][j] for j in kept] == kept_phys, "kept blocks are in position order"
            # Mandatory blocks, and the clamp: skipped fraction in [0.1, 0.6].
            assert 0 in kept and all(j in kept for j in range(nb - 4, nb))
            assert 0.1 - 1e-9 <= 1 - len(kept) / nb <= 0.6 + 1e-9
            positions = torch.cat([torch.arange(j * BS, min(ctx, (j + 1) * BS)) for j in kept])
            assert info["context_lens"][i] == len(positions)
            group = Hq // HKV
            ref = dense_over(q[i], ks[i], vs[i], Hq, positions)[h * group:(h + 1) * group]
            err = (o[h * group:(h + 1) * group] - ref).abs().max().item()
            assert err < 3e-5, (i, h, err)
    assert info["blocks_total"] == HKV * sum(-(-c // BS) for c in (3000, 2500))


@pytest.mark.parametrize("codes", [False, True])
def test_reused_selection_attends_over_its_kept_blocks_and_those_written_since(codes):
    """A selection kept from an earlier step (reuse=): no scoring; each head attends over the
    blocks it kept then plus every block written since, whatever the new query would select."""
    # 2512: a full last block, the next token starts a new one; 2200 grows inside its last block.
    Hq, ctxs = 4, [3000, 2512, 700, 2200]
    pool, summ, tables, ks, vs, q = random_sequences(11, ctxs, Hq, codes=codes)
    kw = dict(min_context=1000, recent_blocks=4, sink_blocks=1, max_ratio=0.6, key_codes=codes,
              score_channels=0 if codes else 8)
    scale = 1 / math.sqrt(D)
    qs, cl, bt = batch(ctxs, [1] * len(ctxs), tables)
    _, first = _C.ops.sparse_attention(q, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ, Hq, scale, **kw)
    assert first["sparse"] == [1, 1, 0, 1] and first["reused"] == [0, 0, 0, 0]
    MB = bt.shape[1]
    pos = torch.tensor(first["positions"]).view(len(ctxs), HKV, MB)
    heads = torch.tensor(first["head_tables"]).view(len(ctxs), HKV, MB)
    kept = {}
    for i in (0, 1, 3):
        rows = [[j for j in pos[i, h].tolist() if j >= 0] for h in range(HKV)]
        for h in range(HKV):  # positions name the head table's blocks
            assert [tables[i][j] for j in rows[h]] == [b for b in heads[i, h].tolist() if b >= 0]
        kept[i] = rows
    assert kept[0][0] != kept[0][1] or kept[1][0] != kept[1][1], "heads select differently"
    # Later steps: 20 more tokens for the first (into a new block), one for the second (a new
    # block), three for the last (no new block).
    g = torch.Generator().manual_seed(12)
    grow = [20, 1, 1, 3]
    spare = [b for b in range(pool.shape[0]) if all(b not in t for t in tables)] + \
        list(range(pool.shape[0], pool.shape[0] + 2))
    pool = torch.cat([pool, torch.full_like(pool[:2], float("nan"))])
    summ = torch.cat([summ, torch.zeros_like(summ[:2])])
    for i, n in enumerate(grow):
        c = ctxs[i]
        while len(tables[i]) * BS < c + n:
            tables[i].append(spare.pop())
        k = torch.randn(n, HKV, D, generator=g) * 2
        v = torch.randn(n, HKV, D, generator=g)
        write_keys(pool, 0, tables[i], k, v, start=c)
        ks[i], vs[i] = torch.cat([ks[i], k]), torch.cat([vs[i], v])
    ctxs2 = [c + n for c, n in zip(ctxs, grow)]
    qs, cl, bt = batch(ctxs2, grow, tables)  # the summaries follow the writes, as in the engine
    _C.ops.update_key_summaries(pool.view(-1), LAYOUT, summ, 0, qs, cl, bt, key_codes=codes)
    q2 = torch.randn(len(ctxs), Hq * D, generator=g) * 3  # a query the old selection was not made for
    qs, cl, bt = batch(ctxs2, [1] * len(ctxs), tables)
    out, info = _C.ops.sparse_attention(q2, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ, Hq, scale,
                                        reuse=[kept[0], kept[1], None, kept[3]], **kw)
    assert info["reused"] == [1, 1, 0, 1] and info["sparse"] == [1, 1, 0, 1]
    assert info["reused_selections"] == 3 * HKV and info["selections"] == 0
    # The same rows as int32 tensors [Hkv, count] (the form a timing loop passes): the same call.
    as_t = [None if r is None else torch.tensor(r, dtype=torch.int32) for r in (kept[0], kept[1], None, kept[3])]
    out_t, info_t = _C.ops.sparse_attention(q2, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ, Hq, scale, reuse=as_t,
                                            **kw)
    assert torch.equal(out_t, out) and info_t == info
    MB = bt.shape[1]
    heads = torch.tensor(info["head_tables"]).view(len(ctxs), HKV, MB)
    group = Hq // HKV
    blocks_kept = 0
    for i in (0, 1, 3):
        nb_old, nb = -(-ctxs[i] // BS), -(-ctxs2[i] // BS)
        assert nb == nb_old + (i != 3)
        for h in range(HKV):
            want = kept[i][h] + list(range(nb_old, nb))
            assert [b for b in heads[i, h].tolist() if b >= 0] == [tables[i][j] for j in want]
            blocks_kept += len(want)
            positions = torch.cat([torch.arange(j * BS, min(ctxs2[i], (j + 1) * BS)) for j in want])
            assert info["context_lens"][i] == len(positions)
            ref = dense_over(q2[i], ks[i], vs[i], Hq, positions)[h * group:(h + 1) * group]
            o = out[i].view(Hq, D)[h * group:(h + 1) * group].double()
            assert (o - ref).abs().max().item() < 3e-5, (i, h)
    assert info["context_lens"][2] == ctxs2[2]
    assert info["blocks_total"] == HKV * sum(-(-ctxs2[i] // BS) for i in (0, 1, 3))
    assert info["blocks_kept"] == blocks_kept
    # The same step selecting afresh keeps other blocks (the reuse above skipped the rule).
    _, fresh = _C.ops.sparse_attention(q2, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ, Hq, scale, **kw)
    assert fresh["selections"] == 3 * HKV and fresh["head_tables"] != info["head_tables"]
    # A malformed reuse is a clear error.
    call = lambda r: _C.ops.sparse_attention(q2, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ, Hq, scale, reuse=r, **kw)
    nb0 = -(-ctxs2[0] // BS)
    rest = [None, None, None]
    for bad, match in [([None], "one entry per sequence"),
                       ([[kept[0][0]]] + rest, "one non-empty row per KV head"),
                       ([[kept[0][0], kept[0][1][:-1]]] + rest, "one length"),
                       ([[r[::-1] for r in kept[0]]] + rest, "ascend"),
                       ([[r + [nb0 + 5] for r in kept[0]]] + rest, "fewer blocks|below"),
                       ([[list(range(nb0)) for _ in range(HKV)]] + rest, "fewer blocks"),
                       ([torch.tensor(kept[0], dtype=torch.int64)] + rest, "int32"),
                       ([torch.tensor(kept[0][:1], dtype=torch.int32)] + rest, "int32 \\[num_kv_heads"),
                       ([torch.tensor([r[::-1] for r in kept[0]], dtype=torch.int32)] + rest, "ascend")]:
        with pytest.raises(ValueError, match=match):
            call(bad)


@pytest.mark.parametrize("codes", [False, True])
def test_compensation_folds_skipped_blocks_back_as_mean_pseudo_keys(codes):
    """With sums in the summaries (after the key codes, where kept) the key and value sums are
    kept too; compensation adds, per skipped block, a pseudo-key mean(k) with value mean(v) and
    weight = its token count."""
    Hq, ctxs = 4, [2600, 3100]
    pool, summ2, tables, ks, vs, q = random_sequences(5, ctxs, Hq, codes=codes)
    W = summ2.shape[3] - 1  # the key codes' fields
    summ = torch.zeros(summ2.shape[0], L, HKV, 3 + W, D)
    for t, c in zip(tables, ctxs):
        qs, cl, bt = batch([c], [c], [t])
        _C.ops.update_key_summaries(pool.view(-1), LAYOUT, summ, 0, qs, cl, bt, key_codes=codes)
    assert torch.equal(summ[:, :, :, :1 + W].view(torch.int32), summ2.view(torch.int32))
    # Diffuse queries: the skipped blocks carry real mass, so compensation must matter.
    q = q * 0.05
    for i, (t, c) in enumerate(zip(tables, ctxs)):
        for j in range(-(-c // BS)):
            sl = slice(j * BS, min(c, (j + 1) * BS))
            assert torch.allclose(summ[t[j], 0, :, 1 + W], ks[i][sl].sum(0), atol=1e-4)
            assert torch.allclose(summ[t[j], 0, :, 2 + W], vs[i][sl].sum(0), atol=1e-4)
    qs, cl, bt = batch(ctxs, [1, 1], tables)
    kw = dict(min_context=1000, recent_blocks=4, sink_blocks=1, max_ratio=0.8, mass_target=0.5, key_codes=codes,
              score_channels=0 if codes else 8)
    out, info = _C.ops.sparse_attention(q, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ, Hq, 1 / math.sqrt(D),
                                        compensation=True, **kw)
    plain, info2 = _C.ops.sparse_attention(q, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ, Hq, 1 / math.sqrt(D),
                                           **kw)
    assert info["head_tables"] == info2["head_tables"] and info["sparse"] == [1, 1]
    heads = torch.tensor(info["head_tables"]).view(len(ctxs), HKV, -1)
    group = Hq // HKV
    for i, ctx in enumerate(ctxs):
        nb = -(-ctx // BS)
        for h in range(HKV):
            kept = sorted(tables[i].index(b) for b in heads[i, h].tolist() if b >= 0)
            skipped = [j for j in range(nb) if j not in kept]
            assert skipped and nb - 1 not in skipped
            pos = torch.cat([torch.arange(j * BS, min(ctx, (j + 1) * BS)) for j in kept])
            k = ks[i][pos, h].double()                     # [n, D]
            v = vs[i][pos, h].double()
            mk = torch.stack([ks[i][j * BS:(j + 1) * BS, h].double().mean(0) for j in skipped])
            mv = torch.stack([vs[i][j * BS:(j + 1) * BS, h].double().mean(0) for j in skipped])
            qq = q[i].view(Hq, D)[h * group:(h + 1) * group].double()
            s = torch.cat([qq @ k.T / math.sqrt(D), qq @ mk.T / math.sqrt(D) + math.log(BS)], 1)
            ref = torch.softmax(s, -1) @ torch.cat([v, mv])
            o = out[i].view(Hq, D)[h * group:(h + 1) * group].double()
            assert (o - ref).abs().max().item() < 3e-5, (i, h)
            assert (o - plain[i].view(Hq, D)[h * group:(h + 1) * group]).abs().max().item() > 1e-4
    with pytest.raises(ValueError, match="sums"):
        _C.ops.sparse_attention(q, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ2, Hq, 1 / math.sqrt(D),
                                compensation=True, **kw)


def upper_bound_scores(q, summ, table, Hq, nb, centre=False):
    """The documented score: per query head the Quest bound (scaled) minus the head's best,
    the max over the group, per KV head; with centre=True the same from q·(min + max)/2,
    the estimate the kept count comes from."""
    group = Hq // HKV
    mn, mx = (x.double() for x in bounds(summ[table[:nb], 0]))  # [nb, HKV, D] each
    qq = q.view(Hq, D).double()
    out = []
    for h in range(HKV):
        per = []
        for gi in range(group):
            qh = qq[h * group + gi]
            if centre:
                ub = (qh * (mn[:, h] + mx[:, h]) / 2).sum(-1) / math.sqrt(D)
            else:
                ub = torch.maximum(qh * mn[:, h], qh * mx[:, h]).sum(-1) / math.sqrt(D)
            per.append(ub - ub.max())
        out.append(torch.stack(per).amax(0))
    return torch.stack(out)  # [HKV, nb]


def channel_estimates(q, summ, table, keys, Hq, nb, ctx, R, bs=BS):
    """The channel estimate (float64): per query head, the R channels of largest |q_d|
    (ties: lower channel first); each key's score q_d k_d on those channels plus
    q_d (min_d + max_d) / 2 on the others, scaled; a block's log-mass is the log-sum-exp
    of its keys' scores. Per head minus its best block, max over the group, per KV head."""
    group = Hq // HKV
    mn, mx = (x.double() for x in bounds(summ[table[:nb], 0]))  # [nb, HKV, D] each
    qq = q.view(Hq, D)
    out = []
    for h in range(HKV):
        per = []
        for gi in range(group):
            q32 = qq[h * group + gi]
            qh = q32.double()
            chans = sorted(range(D), key=lambda d: (-abs(float(q32[d])), d))[:min(R, D)]
            sel = torch.zeros(D, dtype=torch.bool)
            sel[chans] = True
            rest = (qh * (mn[:, h] + mx[:, h]) / 2)[:, ~sel].sum(-1)  # [nb]
            est = []
            for j in range(nb):
                k = keys[j * bs:min(ctx, (j + 1) * bs), h].double()  # [n, D]
                s = ((k[:, sel] * qh[sel]).sum(-1) + rest[j]) / math.sqrt(D)
                est.append(torch.logsumexp(s, 0))
            est = torch.stack(est)
            per.append(est - est.max())
        out.append(torch.stack(per).amax(0))
    return torch.stack(out)  # [HKV, nb]


def code_estimates(q, summ, table, Hq, nb, ctx, bs=BS):
    """The key-code estimate (float64): each key's score q·(lo + c (hi - lo) / 3) from its
    stored codes c and the block's bounds, scaled; a block's log-mass is the log-sum-exp of
    its keys' scores. Per head minus its best block, max over the group, per KV head."""
    group = Hq // HKV
    mn, mx = (x.double() for x in bounds(summ[table[:nb], 0]))  # [nb, HKV, D] each
    codes = stored_codes(summ[table[:nb], 0], bs).double()  # [nb, HKV, 16 W, D]
    khat = mn[:, :, None] + codes * ((mx - mn) / 3)[:, :, None]
    n = torch.full((nb,), bs)
    n[-1] = ctx - (nb - 1) * bs
    valid = torch.arange(khat.shape[2])[None] < n[:, None]  # [nb, 16 W]
    qq = q.view(Hq, D).double()
    out = []
    for h in range(HKV):
        per = []
        for gi in range(group):
            s = torch.einsum("d,jtd->jt", qq[h * group + gi], khat[:, h]) / math.sqrt(D)
            est = torch.logsumexp(torch.where(valid, s, -math.inf), -1)
            per.append(est - est.max())
        out.append(torch.stack(per).amax(0))
    return torch.stack(out)  # [HKV, nb]


def reference_scores(q, summ, table, keys, Hq, ctx, channels, bs=BS):
    """The documented rule (float64): per KV head the rank score and the estimate that sizes
    the count ([HKV, nb] each), and the weight a block's estimated mass carries."""
    nb = -(-ctx // bs)
    if channels == "codes":
        est = code_estimates(q, summ, table, Hq, nb, ctx, bs)
        return est, est, torch.ones(nb, dtype=torch.float64)
    if channels == 0:
        # Quest bound ranks; the centre estimate (times the token count) sizes.
        tok = torch.full((nb,), float(bs), dtype=torch.float64)
        tok[-1] = ctx - (nb - 1) * bs
        return (upper_bound_scores(q, summ, table, Hq, nb), upper_bound_scores(q, summ, table, Hq, nb, centre=True),
                tok)
    # The channel estimate does both (token count included); channels > D: exact scores.
    est = channel_estimates(q, summ, table, keys, Hq, nb, ctx, channels, bs)
    return est, est, torch.ones(nb, dtype=torch.float64)


def reference_need(est, weight, mand, target):
    """Fewest blocks, mandatory ones first, then by estimate, whose estimated mass reaches
    `target` of the total."""
    nb = est.shape[0]
    w = weight * torch.exp(est - est.max())
    covered = float(sum(w[j] for j in mand))
    k = len(mand)
    for j in sorted((j for j in range(nb) if j not in mand), key=lambda j: -float(est[j])):
        if covered >= target * float(w.sum()):
            break
        covered += float(w[j])
        k += 1
    return k


# Block sizes: 16 (the default; one vector of keys per channel), 32 (several per block),
# 8 and 24 (the path that gathers keys for any block size).
# Query heads: 4 (groups of 2); 10 and 16 (groups of 5 and 8: the key codes score four heads at a time).
@pytest.mark.parametrize("channels,bs,Hq", [(0, 16, 4), (8, 16, 4), (64, 16, 4), (200, 16, 4), (0, 24, 4), (8, 8, 4),
                                            (8, 24, 4), (8, 32, 4), ("codes", 16, 4), ("codes", 8, 4), ("codes", 24, 4),
                                            ("codes", 32, 4), ("codes", 16, 10), ("codes", 24, 16), (8, 16, 10)])
def test_selection_keeps_each_heads_best_blocks_and_follows_the_mass_rule(channels, bs, Hq):
    ctx = 4007  # a partial last block at every block size
    codes = channels == "codes"
    pool, summ, tables, ks, vs, q = random_sequences(11, [ctx], Hq, bs, codes=codes)
    qs, cl, bt = batch([ctx], [1], [tables[0]])
    nb = -(-ctx // bs)
    sc, est, weight = reference_scores(q[0], summ, tables[0], ks[0], Hq, ctx, channels, bs)
    mand = set([0] + list(range(nb - 2, nb)))
    for target, cap in [(0.5, 0.8), (0.95, 0.6), (0.999, 0.8), (0.2, 0.8)]:
        _, info = _C.ops.sparse_attention(q, pool.view(-1), (L, HKV, D, bs), 0, qs, cl, bt, summ, Hq,
                                          1 / math.sqrt(D), min_context=100, recent_blocks=2, sink_blocks=1,
                                          max_ratio=cap, mass_target=target,
                                          score_channels=0 if codes else channels, key_codes=codes)
        want = max(reference_need(est[h], weight, mand, target) for h in range(HKV))
        keep = min(max(want, math.ceil(nb * (1 - cap) - 1e-9)), math.floor(nb * 0.9 + 1e-9))
        heads = torch.tensor(info["head_tables"]).view(1, HKV, -1)
        for h in range(HKV):
            kept = {tables[0].index(b) for b in heads[0, h].tolist() if b >= 0}
            assert len(kept) == keep, (target, cap, h, len(kept), keep)
            assert mand <= kept
            others = sorted((j for j in range(nb) if j not in mand), key=lambda j: (-float(sc[h, j]), j))
            ref = set(others[:keep - len(mand)])
            # Equal to the reference's best, except where two blocks' scores lie within float32
            # rounding of each other at the boundary (the engine scores in float32).
            diff = (kept - mand) ^ ref
            tied = float(sc[h, others[keep - len(mand) - 1]]) if keep > len(mand) else math.inf
            assert all(abs(float(sc[h, j]) - tied) < 1e-5 for j in diff), (target, cap, h, sorted(diff))
            assert len(diff) <= 2, (target, cap, h, sorted(diff))
        assert info["blocks_kept"] == keep * HKV


@pytest.mark.parametrize("channels", [0, 8, "codes"])
def test_batched_selection_and_its_statistics_follow_the_reference(channels):
    """Several sequences in one call, the first too short to go sparse, and the partial last
    block among the ranked ones (recent_blocks=0): per sequence the count and every head's
    kept blocks, and the statistics (entropy of the estimated masses summed over the
    selections; the best-scoring blocks of the first selection) equal a float64 reference."""
    codes = channels == "codes"
    # (The key codes estimate these keys' masses more peaked: a higher target keeps the mass rule,
    # not the cap, deciding.)
    Hq, ctxs, cap, target = 6, [700, 3001, 2213, 2600], 0.8, 0.99999 if codes else 0.99
    pool, summ, tables, ks, vs, q = random_sequences(23, ctxs, Hq, codes=codes)
    qs, cl, bt = batch(ctxs, [1] * len(ctxs), tables)
    _, info = _C.ops.sparse_attention(q, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ, Hq, 1 / math.sqrt(D),
                                      min_context=1000, recent_blocks=0, sink_blocks=2, max_ratio=cap,
                                      mass_target=target, score_channels=0 if codes else channels, key_codes=codes)
    heads = torch.tensor(info["head_tables"]).view(len(ctxs), HKV, -1)
    assert info["sparse"] == [0, 1, 1, 1]
    entropy, kept_total, top, by_rule = 0.0, 0, None, 0
    for i, ctx in enumerate(ctxs[1:], 1):
        nb = -(-ctx // BS)
        sc, est, weight = reference_scores(q[i], summ, tables[i], ks[i], Hq, ctx, channels)
        mand = {0, 1}
        keep = max(reference_need(est[h], weight, mand, target) for h in range(HKV))
        keep = min(max(keep, math.ceil(nb * (1 - cap) - 1e-9)), math.floor(nb * 0.9 + 1e-9))
        by_rule += keep > math.ceil(nb * (1 - cap) - 1e-9)
        for h in range(HKV):
            kept_phys = [b for b in heads[i, h].tolist() if b >= 0]
            kept = [tables[i].index(b) for b in kept_phys]
            assert kept == sorted(kept) and len(kept) == keep, (i, h)
            others = sorted(range(2, nb), key=lambda j: (-float(sc[h, j]), j))
            assert set(kept) - mand == set(others[:keep - 2]), (i, h)
            w = weight * torch.exp(est[h] - est[h].max())
            p = w / w.sum()
            entropy += float(-(p[p > 0] * torch.log2(p[p > 0])).sum())
        assert info["context_lens"][i] == (keep - 1) * BS + ctx - (nb - 1) * BS
        kept_total += keep * HKV
        if top is None:
            top = [tables[i][j] for j in sorted(range(nb), key=lambda j: (-float(sc[0, j]), j))[:8]]
    assert by_rule >= 2, "the mass rule, not the cap, sets most counts"
    assert info["blocks_kept"] == kept_total and info["selections"] == 3 * HKV
    assert info["entropy_bits"] == pytest.approx(entropy, rel=1e-5)
    assert info["top_blocks"] == top


def test_vectorised_exp_and_log_are_within_an_ulp():
    """vexp16 and vlog16 (ops/vec16.h: vexp_lanes and vlog_lanes on 16 lanes, the templates
    the selection's log-sum-exp runs at the machine's width): at most about one float32 ulp
    from the float64 result; exp flushes inputs below -87 to 0. vexp8d (vexp_d_lanes, the
    estimated block masses, in double): within about one double ulp of exp."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(100000, generator=g) * -87, torch.rand(50000, generator=g) * 80 - 40,
                   torch.rand(1000, generator=g) * -1e-3])
    ref = torch.exp(x.double())
    ulps = (_C.ops.vexp16(x).double() - ref).abs() / torch.from_numpy(np.spacing(ref.float().numpy())).double()
    assert ulps.max() < 1.5, ulps.max()
    assert _C.ops.vexp16(torch.tensor([-87.5, -200.0])).tolist() == [0.0, 0.0]
    x = torch.cat([1 + torch.rand(100000, generator=g) * 255, torch.exp(torch.rand(50000, generator=g) * 170 - 85),
                   1 + torch.rand(1000, generator=g) * 1e-3])
    ref = torch.log(x.double())
    ulps = (_C.ops.vlog16(x).double() - ref).abs() / torch.from_numpy(np.spacing(ref.float().abs().numpy())).double()
    assert ulps.max() < 1.5, ulps.max()
    assert _C.ops.vlog16(torch.tensor([1.0, 2.0, 0.5])).tolist() == [0.0, pytest.approx(math.log(2)),
                                                                     pytest.approx(-math.log(2))]
    assert math.isnan(_C.ops.vlog16(torch.tensor([float("nan")])).item())
    x = torch.cat([torch.rand(100000, generator=g, dtype=torch.float64) * -708,
                   torch.rand(50000, generator=g, dtype=torch.float64) * -30,
                   torch.rand(1000, generator=g, dtype=torch.float64) * -1e-6])
    ref = torch.exp(x)
    ulps = (_C.ops.vexp8d(x) - ref).abs() / torch.from_numpy(np.spacing(ref.numpy()))
    assert ulps.max() < 2.5, ulps.max()
    assert _C.ops.vexp8d(torch.tensor([0.0, -708.5, -1e4], dtype=torch.float64)).tolist() == [1.0, 0.0, 0.0]


def test_channel_estimate_ranks_closer_to_the_true_block_mass_than_the_bound():
    """On keys whose channels vary independently inside a block (the bound is loose), the
    blocks kept by the channel estimate carry more of the exact softmax mass than those
    kept by the Quest bound, and with every channel the estimate is the exact mass."""
    Hq, ctx = 4, 4000
    pool, summ, tables, ks, vs, q = random_sequences(11, [ctx], Hq)
    qs, cl, bt = batch([ctx], [1], [tables[0]])
    nb = -(-ctx // BS)
    group = Hq // HKV
    qq = q[0].view(Hq, D).double()
    covered = {}
    for channels in (0, 8, 64):
        _, info = _C.ops.sparse_attention(q, pool.view(-1), LAYOUT, 0, qs, cl, bt, summ, Hq, 1 / math.sqrt(D),
                                          min_context=100, recent_blocks=2, sink_blocks=1, max_ratio=0.8,
                                          mass_target=0.2, score_channels=channels)
        heads = torch.tensor(info["head_tables"]).view(HKV, -1)
        frac = []
        for h in range(HKV):
            kept = sorted(tables[0].index(b) for b in heads[h].tolist() if b >= 0)
            pos = torch.cat([torch.arange(j * BS, min(ctx, (j + 1) * BS)) for j in kept])
            s = qq[h * group:(h + 1) * group] @ ks[0][:, h].double().T / math.sqrt(D)  # [group, ctx]
            p = torch.softmax(s, -1)
            frac.append(p[:, pos].sum(-1))
        covered[channels] = torch.cat(frac)
        assert info["blocks_kept"] == HKV * math.ceil(nb * 0.2 - 1e-9), "the cap binds: same count"
    # Measured: 0.42 (bound), 0.64 (8 channels), 0.95 (all channels).
    assert covered[8].mean() > covered[0].mean() + 0.1
    assert covered[64].mean() > covered[8].mean() + 0.1


def test_engine_sparsity_switches_and_statistics(tmp_path):
    with pytest.raises(ConfigError, match="sparsity_compensation=True needs enable_dynamic_sparsity"):
        K25Config(sparsity_compensation=True)
    with pytest.raises(ConfigError, match="enable_kernel_fusion"):
        K25Config(device="cpu", enable_dynamic_sparsity=True, enable_kernel_fusion=False)
    # CUDA's selection ranks by the Quest bound or the key codes (these fail before the device check).
    with pytest.raises(ConfigError, match="channel estimate runs on the CPU"):
        K25Config(device="cuda", enable_dynamic_sparsity=True, sparsity_score_channels=8)
    with pytest.raises(ConfigError, match="CPU backend only"):
        K25Config(device="cuda", enable_dynamic_sparsity=True, sparsity_compensation=True)
    with pytest.raises(ConfigError, match="sparsity_mass_target"):
        K25Config(sparsity_mass_target=0.0)
    for bad in (-1, 257, 2.5, True, "8"):
        with pytest.raises(ConfigError, match="sparsity_score_channels"):
            K25Config(sparsity_score_channels=bad)
    assert K25Config().sparsity_score_channels is None
    assert K25Config(device="cpu").resolved_score_channels() == 8
    assert K25Config(device="cpu", sparsity_score_channels=0).resolved_score_channels() == 0
    # The rule: named, or from sparsity_score_channels.
    assert K25Config(device="cpu").resolved_score_rule() == "channels"
    assert K25Config(device="cpu", sparsity_score_channels=0).resolved_score_rule() == "bound"
    on = dict(device="cpu", enable_dynamic_sparsity=True)
    assert K25Config(**on, sparsity_score_rule="codes").resolved_score_rule() == "codes"
    assert K25Config(**on, sparsity_score_rule="codes").resolved_score_channels() == 0
    assert K25Config(**on, sparsity_score_rule="channels", sparsity_score_channels=16).resolved_score_channels() == 16
    for bad in ("quest", "", 1, True):
        with pytest.raises(ConfigError, match="sparsity_score_rule must be"):
            K25Config(sparsity_score_rule=bad)
    for rule in ("codes", "bound"):
        with pytest.raises(ConfigError, match="reads no key channels"):
            K25Config(**on, sparsity_score_rule=rule, sparsity_score_channels=8)
    with pytest.raises(ConfigError, match="needs sparsity_score_channels > 0"):
        K25Config(**on, sparsity_score_rule="channels", sparsity_score_channels=0)
    with pytest.raises(ConfigError, match="needs enable_dynamic_sparsity"):
        K25Config(device="cpu", sparsity_score_rule="codes")  # a rule for a feature that is off
    with pytest.raises(ConfigError, match="channel estimate runs on the CPU"):
        K25Config(device="cuda", enable_dynamic_sparsity=True, sparsity_score_rule="channels")
    with pytest.raises(ConfigError, match="needs 16-bit KV"):  # the codes on CUDA: bf16 / fp16 KV only
        K25Config(device="cuda", dtype="float32", enable_dynamic_sparsity=True, sparsity_score_rule="codes")
    if not _C.cuda_available():  # past the rule's checks, the device check
        with pytest.raises(ConfigError, match="no CUDA backend"):
            K25Config(device="cuda", enable_dynamic_sparsity=True, sparsity_score_rule="codes")


def test_default_score_rule_is_the_accurate_one_per_backend(monkeypatch):
    """sparsity_score_rule=None: the channel estimate on the CPU; on CUDA the key codes with 16-bit
    KV, and the Quest bound with float32 KV (the codes need 16-bit KV there) or with
    sparsity_score_channels=0. The CUDA half checks the configuration's resolution with a device
    pretended; tests/cuda/test_cuda_sparse_model.py checks that the engine runs what it names."""
    on = dict(enable_dynamic_sparsity=True)
    assert K25Config(device="cpu", **on).resolved_score_rule() == "channels"
    monkeypatch.setattr(_C, "cuda_available", lambda: True)
    for dtype, rule in (("auto", "codes"), ("bfloat16", "codes"), ("float16", "codes"), ("float32", "bound")):
        cfg = K25Config(device="cuda", dtype=dtype, **on)
        assert (cfg.resolved_score_rule(), cfg.resolved_score_channels()) == (rule, 0), dtype
    assert K25Config(device="cuda", sparsity_score_channels=0, **on).resolved_score_rule() == "bound"
    assert K25Config(device="cuda", sparsity_score_rule="bound", **on).resolved_score_rule() == "bound"
    assert K25Config(device="auto", **on).resolved_score_rule() == "codes"
    assert K25Config(device="cpu", **on).resolved_score_rule() == "channels"  # the device decides, not the build


def pydoc_ids(model, n, offset):
    from pydoc_data import topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = model.tokenize([text[offset * 4:offset * 4 + 8 * n]])[0]
    assert len(ids) >= n
    return ids[:n]


def next_token_nll(logits, ids, n):
    lg = logits[-n - 1:-1].astype(np.float64)
    mx = lg.max(1, keepdims=True)
    lse = np.log(np.exp(lg - mx).sum(1)) + mx[:, 0]
    return lse - lg[np.arange(n), np.asarray(ids[-n:])]


def agreement_and_perplexity_ratio(sparse, dense, docs, decoded):
    """Over the last `decoded` positions of each doc: top-1 agreement of the sparse logits
    with the dense ones, and the sparse perplexity over the dense one."""
    agree = np.mean(np.concatenate([s[-decoded - 1:-1].argmax(1) == d[-decoded - 1:-1].argmax(1)
                                    for s, d in zip(sparse, dense)]))
    d_nll = np.concatenate([next_token_nll(d, ids, decoded) for d, ids in zip(dense, docs)])
    s_nll = np.concatenate([next_token_nll(s, ids, decoded) for s, ids in zip(sparse, docs)])
    return agree, float(np.exp(s_nll.mean() - d_nll.mean()))


def test_sparse_decode_on_the_default_model_tracks_dense(default_model):
    """Teacher-forced decode steps over real text: sparse against dense on the same model.

    The issue's targets (perplexity within 2%, top-1 agreement >= 97%) are measured by
    bench/cpu_sparsity.py on longer texts; this guards the behaviour in CI."""
    # One document of 2,048 tokens, its last 192 positions decoded, sparse past
    # sparsity_min_context = 1024 (the prefills are most of this test's time on a CPU: at 3,072
    # tokens past the default 2048 it took ~50% longer). Agreement 0.99 and perplexity ratio
    # 1.002 here, 0.97 / 1.007 on the window at offset 30000; the former 3,072 tokens past 2048
    # gave 0.99 / 1.004.
    ctx, decoded, min_context = 2048, 192, 1024
    docs = [pydoc_ids(default_model, ctx, 0)]
    dense = [default_model.score(ids, decode_from=ctx - decoded) for ids in docs]
    m = K25Model(K25Config(num_threads=2, kv_cache_bytes=512 << 20, enable_dynamic_sparsity=True,
                           sparsity_min_context=min_context))
    try:
        short = pydoc_ids(m, 600, 5000)  # below sparsity_min_context: no selection at all
        assert np.array_equal(m.score(short, decode_from=500), default_model.score(short, decode_from=500))
        assert m.get_current_sparsity_ratio() == 0.0
        sparse = [m.score(ids, decode_from=ctx - decoded) for ids in docs]
        layers = m.stats()["sparsity_layers"]
        ratio = m.get_current_sparsity_ratio()
    finally:
        m.close()
    # The key-code estimate on the same text, selecting every step and every second step
    # (sparsity_selection_interval=2: half the decode steps reuse the kept blocks): top-1
    # agreement 0.984 / 0.964 and perplexity ratio 1.001 / 0.998 on this window (2026-12-07).
    for interval in (1, 2):
        m = K25Model(K25Config(num_threads=2, kv_cache_bytes=512 << 20, enable_dynamic_sparsity=True,
                               sparsity_min_context=min_context, sparsity_score_rule="codes",
                               sparsity_selection_interval=interval))
        try:
            coded = [m.score(ids, decode_from=ctx - decoded) for ids in docs]
            coded_ratio = m.get_current_sparsity_ratio()
            reused = sum(l["reused_selections"] for l in m.stats()["sparsity_layers"])
        finally:
            m.close()
        assert 0.3 < coded_ratio <= 0.6
        assert (reused > 0) == (interval == 2)
        c_agree, c_ppl = agreement_and_perplexity_ratio(coded, dense, docs, decoded)
        assert c_agree >= 0.94, f"key codes every {interval} steps: top-1 agreement {c_agree:.3f}"
        assert c_ppl <= 1.03, f"key codes every {interval} steps: perplexity ratio {c_ppl:.4f}"
    for s, d in zip(sparse, dense):
        # Prompt chunks are dense: bit for bit the same rows.
        assert np.array_equal(s[:ctx - decoded], d[:ctx - decoded])
    assert len(layers) == default_model.model_config["num_layers"]
    assert ratio == pytest.approx(sum(l["blocks_skipped"] for l in layers) / sum(l["blocks_total"] for l in layers))
    assert 0.3 < ratio <= 0.6
    assert ctx - decoded > min_context
    for l in layers:
        # Every decode past min_context (ctx - decoded > min_context) selected in every layer.
        assert l["selections"] == decoded * len(docs) * default_model.model_config["num_kv_heads"]
        assert 0.1 - 1e-9 <= l["ratio"] <= 0.6 + 1e-9
        assert l["mean_entropy_bits"] > 0 and 1 <= len(l["top_blocks"]) <= 8
    agree, ppl_ratio = agreement_and_perplexity_ratio(sparse, dense, docs, decoded)
    assert agree >= 0.94, f"top-1 agreement {agree:.3f}"
    assert ppl_ratio <= 1.03, f"perplexity ratio {ppl_ratio:.4f}"


def test_score_decode_from_is_validated_and_matches_chunked_scoring(default_model):
    ids = pydoc_ids(default_model, 300, 100)
    chunked = default_model.score(ids)
    stepwise = default_model.score(ids, decode_from=250)
    # The same positions, computed one token per step: equal up to float32 GEMM rounding.
    assert np.abs(chunked - stepwise).max() < 2e-3
    assert (chunked.argmax(1) == stepwise.argmax(1)).mean() > 0.98
    from k25.errors import RequestError
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(RequestError, match="decode_from"):
            default_model.score(ids, decode_from=bad)


def sparse_score_runs(ctx, decoded, option_sets):
    """Per set of sparsity options, a model with sparsity on past 512 tokens: teacher-forced
    logits of a pydoc window of ctx tokens whose last `decoded` are computed one per step,
    and the sparsity ratio reached."""
    runs = []
    for options in option_sets:
        m = K25Model(K25Config(num_threads=2, kv_cache_bytes=256 << 20, enable_dynamic_sparsity=True,
                               sparsity_min_context=512, **options))
        try:
            ids = pydoc_ids(m, ctx, 12000)
            runs.append((m.score(ids, decode_from=ctx - decoded), m.get_current_sparsity_ratio()))
        finally:
            m.close()
    return runs


def test_engine_compensation_changes_only_the_sparse_decode_rows():
    """sparsity_compensation=True is honoured end to end: prompt rows
    bit-identical, the sparse decode rows differ (skipped blocks folded back in)."""
    ctx, decoded = 900, 6
    (plain, r0), (comp, r1) = sparse_score_runs(ctx, decoded, [dict(sparsity_compensation=c) for c in (False, True)])
    assert r0 > 0 and r1 > 0
    assert np.array_equal(plain[:ctx - decoded], comp[:ctx - decoded])
    assert not np.allclose(plain[-decoded:], comp[-decoded:], atol=1e-4)
    assert np.isfinite(comp).all()


def test_engine_score_rule_is_honoured_end_to_end():
    """sparsity_score_rule reaches the selection: the key codes give bit-identical prompt
    rows and sparse decode rows that differ from both other rules'."""
    ctx, decoded = 900, 6
    runs = sparse_score_runs(ctx, decoded, [dict(sparsity_score_rule=r) for r in ("codes", "channels", "bound")])
    (codes, r0), others = runs[0], runs[1:]
    assert r0 > 0 and np.isfinite(codes).all()
    for other, r in others:
        assert r > 0
        assert np.array_equal(codes[:ctx - decoded], other[:ctx - decoded])
        assert np.abs(codes[ctx - decoded:] - other[ctx - decoded:]).max() > 1e-4


def test_engine_score_channels_is_honoured_end_to_end():
    """sparsity_score_channels reaches the selection: the Quest-bound rule (0) and the
    channel estimate (8) give bit-identical prompt rows and different sparse decode rows."""
    ctx, decoded = 900, 6
    (bound, r0), (chan, r1) = sparse_score_runs(ctx, decoded, [dict(sparsity_score_channels=c) for c in (0, 8)])
    assert r0 > 0 and r1 > 0
    assert np.array_equal(bound[:ctx - decoded], chan[:ctx - decoded])
    assert np.abs(bound[ctx - decoded:] - chan[ctx - decoded:]).max() > 1e-4


def test_engine_selection_interval_reuses_each_selection_for_the_next_steps():
    """sparsity_selection_interval=N: decode steps at context lengths that are multiples of N
    select, the steps up to the next multiple reuse that selection (counted apart in the
    statistics); prompt rows and the first decode row are bit-identical to selecting every
    step, later rows differ."""
    ctx, decoded, Hkv = 1200, 40, None
    runs = {}
    for n in (1, 2, 3):
        m = K25Model(K25Config(num_threads=2, kv_cache_bytes=256 << 20, enable_dynamic_sparsity=True,
                               sparsity_min_context=512, sparsity_score_rule="codes", sparsity_selection_interval=n))
        try:
            ids = pydoc_ids(m, ctx, 12000)
            Hkv = m.model_config["num_kv_heads"]
            runs[n] = (m.score(ids, decode_from=ctx - decoded), m.stats()["sparsity_layers"],
                       m.get_current_sparsity_ratio())
        finally:
            m.close()
    every = runs[1][0]
    steps = range(ctx - decoded + 1, ctx + 1)  # the decode steps' context lengths
    for n, (logits, layers, ratio) in runs.items():
        # The first decode step selects, then those at multiples of n.
        fresh = 1 + sum(c % n == 0 for c in steps[1:])
        for l in layers:
            assert l["selections"] == fresh * Hkv, (n, l)
            assert l["reused_selections"] == (decoded - fresh) * Hkv, (n, l)
        assert 0.1 <= ratio <= 0.6
        assert np.array_equal(logits[:ctx - decoded + 1], every[:ctx - decoded + 1])
        if n > 1:
            assert np.abs(logits[ctx - decoded + 1:] - every[ctx - decoded + 1:]).max() > 1e-4
            agree = np.mean(logits[ctx - decoded:].argmax(1) == every[ctx - decoded:].argmax(1))
            assert agree >= 0.9, (n, agree)
    with pytest.raises(ConfigError, match="needs enable_dynamic_sparsity"):
        K25Config(sparsity_selection_interval=2)
    for bad in (0, -1, 65, 2.0, True, "2"):
        with pytest.raises(ConfigError, match="sparsity_selection_interval"):
            K25Config(device="cpu", enable_dynamic_sparsity=True, sparsity_selection_interval=bad)


def test_engine_reused_selections_follow_each_request_in_a_batch():
    """Selections are kept per request: two requests of different lengths give the same
    tokens decoding together as alone (a selection reused for the wrong row would change
    them, or fail on positions past the shorter one's blocks)."""
    m = K25Model(K25Config(num_threads=2, kv_cache_bytes=256 << 20, enable_dynamic_sparsity=True,
                           sparsity_min_context=256, sparsity_score_rule="codes", sparsity_selection_interval=3))
    try:
        prompts = [pydoc_ids(m, 700, 3000), pydoc_ids(m, 420, 9000)]
        alone = [m.generate([p], max_new_tokens=14, ignore_eos=True, temperature=0.0)[0].token_ids for p in prompts]
        together = [o.token_ids for o in m.generate(prompts, max_new_tokens=14, ignore_eos=True, temperature=0.0)]
        layers = m.stats()["sparsity_layers"]
    finally:
        m.close()
    assert together == alone
    assert all(l["reused_selections"] > 0 and l["selections"] > 0 for l in layers)
