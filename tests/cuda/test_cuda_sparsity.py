"""Dynamic block sparsity on the device (cuda/block_sparsity.cu) against PyTorch.

- Block summaries equal the per-channel min / max of each written block's keys (torch): exactly
  for float32 KV, as 4-bit codes rounded outward on the row's scale for 16-bit KV.
- The selection equals a float64 PyTorch implementation of the documented device rule
  (docs/sparsity.md "CUDA": Quest bound ranks, centre estimate sizes, estimates quantised to
  1/32 nat) up to blocks whose quantum rounding differs; its invariants hold exactly
  (mandatory blocks, one count per sequence within the clamp, position order, lengths);
  planted high-scoring blocks are kept by every head.
- Attention over the selected per-head tables equals float64 attention restricted to those
  blocks, in the work-list (plan) form and the CUDA-graph (derived splits) form.
"""
import math

import pytest
import torch

from test_cuda_kernels import TOL, paged_pool, query_buffer, rel_err, write_kv

from k25 import _C

cu = getattr(_C, "cuda_ops", None)
BINS, PER_NAT = 1024, 32


def quantum(x):
    d = -x * PER_NAT
    return 0 if not d < BINS - 1 else BINS - 1 - max(0, int(d))


def ref_select(q, mn, mx, ctx, bs, group, scale, p):
    """The device rule in float64 for one sequence: keep count and each KV head's kept block indices."""
    Hkv, nb, D = mn.shape
    qg = q.double().view(Hkv, group, 1, D)
    lo, hi = mn.double()[:, None], mx.double()[:, None]
    u = torch.maximum(qg * lo, qg * hi).sum(-1) * scale           # [Hkv, group, nb]
    c = 0.5 * scale * (qg * (lo + hi)).sum(-1)
    score = (u - u.amax(-1, keepdim=True)).amax(1)                # [Hkv, nb]
    est = (c - c.amax(-1, keepdim=True)).amax(1)
    n = torch.full((nb,), float(bs), dtype=torch.float64, device=q.device)
    n[-1] = ctx - (nb - 1) * bs
    return ref_choose(score, est, n * est.exp(), p)


def ref_select_codes(e, p):
    """The key-code rule for one sequence: its blocks' log-mass e (ref_codes_log_mass) ranks and sizes."""
    est = (e - e.amax(-1, keepdim=True)).amax(1)
    return ref_choose(est, est, est.exp(), p)


def ref_codes_log_mass(q, parts, ctx, bs, group, scale):
    """Each block's log-mass per query head [Hkv, group, nb], in float64 but for the two roundings
    to fp16 the device makes: parts = coded_parts() of the sequence. A key's score is scale x row
    scale x (q.lo + sum_d c_d q_d (hi_d - lo_d) / 3) in code units, with q times its head's power of
    two qs (the largest |q| in [2^10, 2^11)) rounded to fp16 and q_d (hi_d - lo_d) rounded again
    (the B operand), and 3 q_d qs rounded to fp16 for the lo term; a block's log-mass, the
    log-sum-exp over its keys (those past ctx left out)."""
    lo, hi, rs, codes = parts  # [Hkv, nb, D] ints, [Hkv, nb] row scales, [Hkv, nb, bs, D]
    Hkv, nb, D = lo.shape
    qf = q.float().view(Hkv, group, D)
    mabs = qf.abs().amax(-1, keepdim=True)
    qs = torch.where(mabs > 0, torch.exp2(10 - torch.floor(torch.log2(mabs))), torch.ones_like(mabs))
    qr = (qf * qs).half().double()                                          # [Hkv, group, D]
    br = (qr[:, :, None] * (hi - lo)[:, None]).half().double()              # [Hkv, group, nb, D]
    bl = (3 * qf * qs).half().double()
    s3 = torch.einsum("hgbd,hbtd->hgbt", br, codes) + torch.einsum("hgd,hbd->hgb", bl, lo)[..., None]
    s = s3 * (rs[:, None, :, None] * scale / (3 * qs[..., None]))            # [Hkv, group, nb, bs]
    s = s.reshape(Hkv, group, nb * bs)[..., :ctx]
    pad = torch.full((Hkv, group, nb * bs - ctx), -math.inf, dtype=torch.float64, device=q.device)
    return torch.logsumexp(torch.cat([s, pad], -1).view(Hkv, group, nb, bs), -1)


def ref_choose(score, est, mass, p):
    """The count and the per-head kept blocks from rank scores and estimates relative to the
    best ([Hkv, nb], maxed over the group) and the blocks' masses."""
    Hkv, nb = score.shape
    ob = min(max(p["sink_blocks"], 0), nb)
    oe = max(ob, nb - max(p["recent_blocks"], 0))
    n_mand = nb - (oe - ob)
    needs = []
    for h in range(Hkv):
        m = mass[h].tolist()
        e = est[h].tolist()
        total = sum(m)
        have = sum(m[:ob]) + sum(m[oe:])
        want = p["mass_target"] * total
        need = n_mand
        if have < want:
            bins = {}
            for j in range(ob, oe):
                b = bins.setdefault(quantum(e[j]), [0.0, 0])
                b[0] += m[j]
                b[1] += 1
            need = nb
            taken = 0
            for b in sorted(bins, reverse=True):
                v, cnt = bins[b]
                if have + v >= want:
                    k = min(cnt, max(1, math.ceil((want - have) / (v / cnt) - 1e-9)))
                    need = n_mand + taken + k
                    break
                have += v
                taken += cnt
        needs.append(need)
    keep_min = math.ceil(nb * (1 - p["max_ratio"]) - 1e-9)
    keep_max = math.floor(nb * (1 - p["min_ratio"]) + 1e-9)
    keep = max(n_mand, min(max(max(needs), keep_min), keep_max))
    if keep >= nb:
        return nb, None
    kept = []
    for h in range(Hkv):
        s = score[h].tolist()
        others = sorted(range(ob, oe), key=lambda j: (-quantum(s[j]), j))
        kept.append(sorted(list(range(ob)) + others[:keep - n_mand] + list(range(oe, nb))))
    return keep, kept


PARAMS = {
    # the cap binds (random keys spread the mass)
    "capped": dict(min_context=64, sink_blocks=1, recent_blocks=4, min_ratio=0.1, max_ratio=0.6, mass_target=0.95),
    # a loose cap: the mass rule sizes
    "mass": dict(min_context=64, sink_blocks=2, recent_blocks=3, min_ratio=0.1, max_ratio=0.97, mass_target=0.9),
}


def build(seed, dtype, Hq, Hkv, D, bs, seqs, hot_frac=0.05, decode_splits=0, q_mult=1.0, width=None):
    """A paged batch whose single-token sequences have a few 'hot' blocks (keys aligned with
    the query), so that the estimated mass is concentrated there. Returns the call, the q
    buffer, per-sequence keys / values / tables / hot blocks, the layout and the pool.
    q_mult multiplies the queries and divides the call's softmax scale (the same selection);
    width pads the block tables to that many columns."""
    g = torch.Generator().manual_seed(seed)
    L, layer = 2, 1
    layout = (L, Hkv, D, bs)
    kv, pv, tables, lists = paged_pool(g, seqs, layout, dtype)
    if width is not None:
        tables = torch.cat([tables, torch.full((len(seqs), width - tables.shape[1]), -1, dtype=torch.int32)], 1)
    qs, cl, qrows, info = [0], [], [], []
    group = Hq // Hkv
    for (ctx, qlen), table in zip(seqs, lists):
        n = len(table)
        q = torch.randn(qlen, Hq, D, generator=g)
        k = torch.randn(ctx, Hkv, D, generator=g) * 0.5
        hot = sorted(torch.randperm(n, generator=g)[:max(1, int(hot_frac * n))].tolist())
        # A hot block's keys point along every query head of their group (the rule keeps a
        # block that any head of the group ranks high, relative to that head's best).
        qn = q[-1] / q[-1].norm(dim=-1, keepdim=True)
        for b in hot:
            sl = slice(b * bs, min(ctx, (b + 1) * bs))
            for h in range(Hkv):
                k[sl, h] += 0.6 * math.sqrt(D) * qn[h * group:(h + 1) * group].sum(0)
        q = q * q_mult
        k, v, q = k.to(dtype).cuda(), torch.randn(ctx, Hkv, D, generator=g).to(dtype).cuda(), q.to(dtype).cuda()
        write_kv(pv, layer, bs, table, k, v)
        qrows.append(q.reshape(qlen, Hq * D))
        qs.append(qs[-1] + qlen)
        cl.append(ctx)
        info.append(dict(k=k, v=v, table=table, hot=hot, ctx=ctx, qlen=qlen))
    buf = query_buffer(qrows, Hkv, D, dtype)
    call = cu.AttentionCall(kv, layout, layer, torch.tensor(qs, dtype=torch.int32), torch.tensor(cl, dtype=torch.int32),
                            tables, Hq, 1.0 / (math.sqrt(D) * q_mult), 0, 264, decode_splits)
    return call, buf, info, layout, kv


def row_bytes(layout, dtype, key_codes=False):
    L, Hkv, D, bs = layout
    if dtype == torch.float32:
        return 8 * D
    return D + 16 + (4 * D * ((bs + 15) // 16) if key_codes else 0)


def summaries_view(summ, layout, layer, dtype, key_codes=False):
    """The minima and maxima that the summaries of `layer` stand for, float32 [blocks, Hkv, D]
    each, and the rows' scales ([blocks, Hkv, 1]; None for float32 rows, which hold the values).
    16-bit KV: rows of 2D 4-bit codes (code i in byte i / 2, the even one low) and a float32
    scale in D + 16 bytes (then the key codes, with key_codes: codes_view)."""
    L, Hkv, D, bs = layout
    if dtype == torch.float32:
        v = summ.view(torch.float32).view(-1, L, Hkv, 2, D)[:, layer]
        return v[:, :, 0], v[:, :, 1], None
    r = summ.view(-1, L, Hkv, row_bytes(layout, dtype, key_codes))[:, layer]
    b = r[..., :D].long()
    codes = torch.stack([b & 15, b >> 4], -1).flatten(-2)  # [.., 2D] in code order
    codes = ((codes ^ 8) - 8).float()
    scale = r[..., D:D + 4].contiguous().view(torch.float32)
    return codes[..., :D] * scale, codes[..., D:] * scale, scale


def codes_view(summ, layout, layer):
    """The key codes of 16-bit rows with key codes, int64 [blocks, Hkv, 16 * tiles, D], decoded as
    k25_cuda.h (summary_row_bytes) documents the layout: tile u's word i belongs to lane
    l = i // (D / 32), w = i % (D / 32); with g = l // 4, t = l % 4 it holds key 16u + g + 8 (w % 2)
    at channels b + 0..15, b = 64 (w // 2) + 16 t: bits 2j the code of channel b + j % 4 + 8 (j // 4),
    bits 16 + 2j that of the channel 4 above."""
    L, Hkv, D, bs = layout
    tiles = (bs + 15) // 16
    rb = row_bytes(layout, torch.bfloat16, True)
    words = summ.view(-1, L, Hkv, rb)[:, layer, :, D + 16:].contiguous().view(torch.int32).long() & 0xFFFFFFFF
    words = words.view(words.shape[0], Hkv, tiles, D)
    # Where each word's 16 codes go: (key, channel) of bit pair s (0..15: bits 2s) of word i.
    per = D // 32
    where = torch.empty(D, 16, dtype=torch.long)
    for i in range(D):
        l, w = divmod(i, per)
        g, t = divmod(l, 4)
        key, b = g + 8 * (w % 2), 64 * (w // 2) + 16 * t
        for j in range(8):
            c = b + j % 4 + 8 * (j // 4)
            where[i, j] = key * D + c
            where[i, 8 + j] = key * D + c + 4
    assert sorted(where.flatten().tolist()) == list(range(16 * D)), "the layout names every key and channel once"
    bits = (words[..., None] >> (2 * torch.arange(16, device=summ.device))) & 3  # [.., D, 16]
    out = torch.empty(*words.shape[:3], 16 * D, dtype=torch.long, device=summ.device)
    out[..., where.flatten().to(summ.device)] = bits.flatten(-2)
    return out.view(words.shape[0], Hkv, tiles * 16, D)


def coded_parts(summ, layout, layer, dtype, table):
    """A sequence's coded rows: the bounds' codes lo and hi (float64 [Hkv, nb, D], integers), the
    row scales [Hkv, nb] and the key codes [Hkv, nb, bs, D]: its keys read back as
    (lo + c (hi - lo) / 3) x scale."""
    L, Hkv, D, bs = layout
    mn, mx, scale = summaries_view(summ, layout, layer, dtype, key_codes=True)
    codes = codes_view(summ, layout, layer)[table, :, :bs].double().transpose(0, 1)
    rs = scale[table, :, 0].double().transpose(0, 1)
    lo = torch.round(mn[table].double().transpose(0, 1) / rs[..., None])
    hi = torch.round(mx[table].double().transpose(0, 1) / rs[..., None])
    return lo.nan_to_num(0.0), hi.nan_to_num(0.0), rs, codes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D,bs", [(64, 16), (128, 16), (128, 48), (64, 5), (128, 20)])
def test_key_codes_are_each_keys_place_in_its_coded_range(dtype, D, bs):
    # With key codes the rows gain 2-bit codes of every key of the block: round(3 (k - lo) /
    # (hi - lo)) in the row's coded [lo, hi], clamped to 0..3, 0 past the fill; a step re-codes
    # all keys of each block it wrote (a new key may widen the range). Compared in float64, a
    # code may differ by one only where the value lies within 1e-3 of a rounding boundary.
    Hq, Hkv = 4, 2
    seqs = [(1000, 1), (37, 37), (300, 20), (5, 5)]
    call, buf, info, layout, kv = build(D + bs + 1, dtype, Hq, Hkv, D, bs, seqs)
    nblocks = kv.numel() // (layout[0] * 2 * Hkv * bs * D)
    summ = cu.make_block_summaries(nblocks, layout, kv, key_codes=True)
    assert summ.numel() == nblocks * layout[0] * Hkv * row_bytes(layout, dtype, True)
    summ.fill_(255)
    call.update_summaries(summ, key_codes=True)
    plain = cu.make_block_summaries(nblocks, layout, kv)
    call.update_summaries(plain)
    rb, pb = row_bytes(layout, dtype, True), row_bytes(layout, dtype)
    rows = summ.view(-1, layout[0], Hkv, rb)
    mn, mx, scale = summaries_view(summ, layout, 1, dtype, key_codes=True)
    codes = codes_view(summ, layout, 1)
    checked = 0
    for s in info:
        ctx, qlen, table = s["ctx"], s["qlen"], s["table"]
        touched = range((ctx - qlen) // bs, (ctx - 1) // bs + 1)
        for j in range(len(table)):
            b = table[j]
            if j not in touched:
                assert (rows[b, 1] == 255).all(), "a block the step did not write"
                continue
            # The coded bounds and the scale (not the 12 bytes of padding) as without codes.
            assert torch.equal(rows[b, 1, :, :D + 4], plain.view(-1, layout[0], Hkv, pb)[b, 1, :, :D + 4]), \
                "bounds as without codes"
            keys = s["k"][j * bs:min(ctx, (j + 1) * bs)].double().transpose(0, 1)  # [Hkv, n, D]
            n = keys.shape[1]
            lo, hi = mn[b].double()[:, None], mx[b].double()[:, None]
            x = torch.where(hi > lo, 3 * (keys - lo) / (hi - lo), torch.zeros_like(keys))
            want = x.round().clamp(0, 3).long()
            got = codes[b][:, :n]
            off = got != want
            near = ((x - x.floor() - 0.5).abs() < 1e-3) & ((got - want).abs() == 1)
            assert not (off & ~near).any(), (j, ctx, int((off & ~near).sum()))
            assert (codes[b][:, n:] == 0).all(), "slots past the fill code 0"
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D,bs", [(64, 16), (128, 16), (128, 48), (64, 5)])
def test_summaries_are_the_min_and_max_of_each_written_block(dtype, D, bs):
    Hq, Hkv = 4, 2
    seqs = [(1000, 1), (37, 37), (300, 20), (5, 5)]
    call, buf, info, layout, kv = build(D + bs, dtype, Hq, Hkv, D, bs, seqs)
    summ = cu.make_block_summaries(kv.numel() // (layout[0] * 2 * Hkv * bs * D), layout, kv)
    summ.fill_(255)  # float32 rows NaN; 16-bit rows codes -1 and a NaN scale
    call.update_summaries(summ)
    mn, mx, scale = summaries_view(summ, layout, 1, dtype)
    for s in info:
        ctx, qlen, table = s["ctx"], s["qlen"], s["table"]
        touched = range((ctx - qlen) // bs, (ctx - 1) // bs + 1)
        for j in range(len(table)):
            b = table[j]
            if j in touched:
                keys = s["k"][j * bs:min(ctx, (j + 1) * bs)].float()  # [n, Hkv, D]
                lo, hi = keys.amin(0), keys.amax(0)
                if scale is None:
                    assert torch.equal(mn[b], lo) and torch.equal(mx[b], hi), (j, ctx)
                    continue
                # Codes on the row's scale (its largest magnitude / 7), rounded outward by at
                # most two steps (the floor, then one step for the division's rounding).
                top = torch.maximum(lo.abs(), hi.abs()).amax(-1, keepdim=True)
                torch.testing.assert_close(scale[b], top / 7, rtol=1e-5, atol=0)
                assert (mn[b] <= lo).all() and (mx[b] >= hi).all(), (j, ctx)
                assert (mn[b] >= lo - 2 * scale[b]).all() and (mx[b] <= hi + 2 * scale[b]).all(), (j, ctx)
            else:
                assert torch.isnan(mn[b]).all() and torch.isnan(mx[b]).all(), "a block the step did not write"


def summaries_of(info, layout, kv, Hq, key_codes=False):
    """Block summaries of every block of build's sequences (layer 1): an update over whole
    sequences, the prefill that wrote them."""
    L, Hkv, D, bs = layout
    summ = cu.make_block_summaries(kv.numel() // (L * 2 * Hkv * bs * D), layout, kv, key_codes=key_codes)
    width = max(len(s["table"]) for s in info)
    full = cu.AttentionCall(kv, layout, 1, torch.tensor([0] + [sum(s["ctx"] for s in info[:i + 1])
                                                                  for i in range(len(info))], dtype=torch.int32),
                            torch.tensor([s["ctx"] for s in info], dtype=torch.int32),
                            torch.tensor([s["table"] + [-1] * (width - len(s["table"])) for s in info],
                                         dtype=torch.int32), Hq, 1.0, 0, 264, 0)
    full.update_summaries(summ, key_codes=key_codes)
    return summ


def check_selection(call, buf, info, layout, kv, Hq, p, stats=None, planted=True, q_mult=1.0, key_codes=False,
                    **select_kw):
    """Selects with `call` and checks the result against ref_select (ref_select_codes with
    key_codes); returns (tables, lens, sparse heads). q_mult: build's (the call's scale is
    1 / (sqrt(D) q_mult)); select_kw go to call.select (reuse, memory)."""
    L, Hkv, D, bs = layout
    group = Hq // Hkv
    summ = summaries_of(info, layout, kv, Hq, key_codes)
    if stats is None:
        stats = torch.zeros(L, 4, dtype=torch.float64, device="cuda")
    before = stats[1].clone()
    tables, lens, reads = call.select(buf, summ, stats, **p, count_reads=True, key_codes=key_codes, **select_kw)
    tables, lens, reads = tables.cpu(), lens.cpu(), reads.cpu()
    raw = call.selection_raw().cpu() if key_codes else None
    # The reads the selection counted (the tiered KV's predictor reads them): per decode row
    # and block position, the KV heads whose table holds the block; nothing for a prompt chunk.
    for i, s in enumerate(info):
        nb = len(s["table"])
        want = torch.zeros(reads.shape[1], dtype=torch.int32)
        if s["qlen"] == 1:
            pos = {b: j for j, b in enumerate(s["table"])}
            n = (lens[i].item() - (s["ctx"] - (nb - 1) * bs)) // bs + 1  # kept blocks (nb if dense)
            for h in range(Hkv):
                for b in tables[i, h, :n].tolist():
                    want[pos[b]] += 1
        assert torch.equal(reads[i], want), f"sequence {i}: counted reads differ from its head tables"
    assert reads.sum().item() > 0
    mn, mx, _ = summaries_view(summ, layout, 1, buf.dtype, key_codes)
    scale = 1.0 / (math.sqrt(D) * q_mult)
    row = 0
    mismatched = kept_total = sparse_heads = nb_sum = keep_sum = 0
    for i, s in enumerate(info):
        ctx, table, qlen = s["ctx"], s["table"], s["qlen"]
        nb = len(table)
        q = buf[row + qlen - 1, :Hq * D].view(Hq, D)
        row += qlen
        keep_ref, kept_ref = nb, None
        if qlen == 1 and ctx > p["min_context"] and key_codes:
            e_ref = ref_codes_log_mass(q, coded_parts(summ, layout, 1, buf.dtype, table), ctx, bs, group, scale)
            keep_ref, kept_ref = ref_select_codes(e_ref, p)
            # Every block's log-mass (both raw values), the last one's keys past the fill left out.
            for v in range(2):
                torch.testing.assert_close(raw[i, :, v, :nb].double(), e_ref.reshape(Hq, nb).cpu(), rtol=1e-4,
                                           atol=2e-3)
        elif qlen == 1 and ctx > p["min_context"]:
            keep_ref, kept_ref = ref_select(q, mn[table].transpose(0, 1), mx[table].transpose(0, 1), ctx, bs, group,
                                            scale, p)
        if kept_ref is None:
            assert lens[i].item() == ctx
            for h in range(Hkv):
                assert tables[i, h, :nb].tolist() == table, "a dense sequence reads its own table"
            continue
        keep = (lens[i].item() - (ctx - (nb - 1) * bs)) // bs + 1
        assert lens[i].item() == (keep - 1) * bs + ctx - (nb - 1) * bs
        ob = min(p["sink_blocks"], nb)
        oe = max(ob, nb - p["recent_blocks"])
        assert math.ceil(nb * (1 - p["max_ratio"]) - 1e-9) <= keep <= math.floor(nb * (1 - p["min_ratio"]) + 1e-9)
        assert abs(keep - keep_ref) <= max(1, nb // 100), (keep, keep_ref, nb)
        hot_others = [j for j in s["hot"] if ob <= j < oe]
        pos = {b: j for j, b in enumerate(table)}
        for h in range(Hkv):
            got = [pos[b] for b in tables[i, h, :keep].tolist()]
            assert got == sorted(set(got)), "kept blocks in position order, each once"
            assert set(range(ob)) | set(range(oe, nb)) <= set(got), "sink and recent blocks are kept"
            if planted and keep - (nb - (oe - ob)) >= len(hot_others):
                assert set(hot_others) <= set(got), f"head {h} dropped a planted high-scoring block"
            mismatched += len(set(got) ^ set(kept_ref[h]))
            kept_total += keep
        sparse_heads += Hkv
        nb_sum += nb * Hkv
        keep_sum += keep * Hkv
    assert mismatched <= max(2, 0.02 * kept_total), f"{mismatched} of {kept_total} kept blocks differ"
    st = (stats[1] - before).cpu()
    assert st[2].item() == sparse_heads and st[0].item() == nb_sum and st[1].item() == keep_sum
    return tables, lens, sparse_heads


@pytest.mark.parametrize("key_codes", [False, True])
@pytest.mark.parametrize("long_row", [False, True])
def test_reused_selection_keeps_its_blocks_and_those_written_since(key_codes, long_row):
    # Selection reuse on the device (SparseSelect::reuse): rows in "select and keep" mode select
    # as before (checked against the float64 rule) and leave each head's kept positions and their
    # count in their memory slot; rows in "use" mode are not scored and attend over the slot's
    # positions plus every block after the last of them (here kept lists made up to end before the
    # last blocks, as a selection made some steps earlier would), whatever the new query; a kept
    # count of 0 (a selection that stayed dense) gives a dense row, a row with no slot selects.
    # long_row adds a row of 70,000 keys whose made-up list keeps nearly every block (over 4,096
    # entries: more than one batch of the table step's loads a thread).
    dtype, Hkv, group, D, bs = torch.bfloat16, 2, 4, 128, 16
    Hq = Hkv * group
    seqs = [(3000, 1), (1500, 1), (40, 1), (2000, 20), (2500, 1)] + [(70000, 1)] * long_row
    call, buf, info, layout, kv = build(77, dtype, Hq, Hkv, D, bs, seqs)
    L = layout[0]
    width = max(len(s["table"]) for s in info)
    slots = 5
    positions = torch.full((slots, L, Hkv, width + 3), -7, dtype=torch.int32, device="cuda")
    counts = torch.full((slots, L), -7, dtype=torch.int32, device="cuda")
    memory = (positions, counts)
    store = torch.tensor([0, 2, 4, -1, 6, 8][:len(seqs)], dtype=torch.int32, device="cuda")  # slots 0, 1, 2, none, 3, 4
    stats = torch.zeros(L, 5, dtype=torch.float64, device="cuda")
    p = PARAMS["capped"]
    tables, lens, heads = check_selection(call, buf, info, layout, kv, Hq, p, stats, key_codes=key_codes,
                                          reuse=store, memory=memory)
    assert heads == (3 + long_row) * Hkv and stats[1, 4].item() == 0
    tables, lens, cnt, pos = tables.cpu(), lens.cpu(), counts.cpu(), positions.cpu()
    assert cnt[2, 1].item() == 0, "a row that did not select keeps a count of 0"
    assert (cnt[:, 0] == -7).all() and (pos[:, 0] == -7).all(), "layer 0's entries untouched"
    for i, slot in ((0, 0), (1, 1), (4, 3), (5, 4))[:3 + long_row]:
        s = info[i]
        nb = len(s["table"])
        keep = (lens[i].item() - (s["ctx"] - (nb - 1) * bs)) // bs + 1
        assert cnt[slot, 1].item() == keep
        for h in range(Hkv):
            assert [s["table"][j] for j in pos[slot, 1, h, :keep].tolist()] == tables[i, h, :keep].tolist()
    # Made-up kept lists for slots 0 and 3: each head's every third position up to 5 blocks
    # before the end (heads differ); slot 1 with a count of 0; slot 2 untouched (count 0); the
    # long row's (slot 4) every position but its head's first ones, up to 5 blocks before the end.
    made = {}
    for i, slot in ((0, 0), (4, 3), (5, 4))[:2 + long_row]:
        nb = len(info[i]["table"])
        rows = [list(range(h, nb - 6, 3 if i < 5 else 1)) + [nb - 5] for h in range(Hkv)]
        rows = [r[:min(len(x) for x in rows)] for r in rows]  # one count for every head ...
        for h in range(Hkv):
            rows[h][-1] = nb - 5                                # ... ending at the same block
            positions[slot, 1, h, :len(rows[h])] = torch.tensor(rows[h], dtype=torch.int32)
        counts[slot, 1] = len(rows[0])
        made[i] = rows
    counts[1, 1] = 0
    use = torch.tensor([1, 3, 5, -1, 7, 9][:len(seqs)], dtype=torch.int32, device="cuda")
    summ = summaries_of(info, layout, kv, Hq, key_codes)
    before = stats[1].clone()
    other = (torch.randn(buf.shape, generator=torch.Generator().manual_seed(3)) * 2).to(dtype).cuda()
    t2, l2, reads = call.select(other, summ, stats, **p, count_reads=True, key_codes=key_codes, reuse=use,
                                memory=memory)
    t2, l2, reads = t2.cpu(), l2.cpu(), reads.cpu()
    st = (stats[1] - before).cpu()
    assert st[4].item() == (2 + long_row) * Hkv and st[2].item() == 0, "rows reused, none selected"
    if long_row:
        assert len(made[5][0]) + 4 > 4096, "the long row's list spans more than one batch of loads"
    nb_sum = keep_sum = 0
    for i, s in enumerate(info):
        nb, ctx = len(s["table"]), s["ctx"]
        if i in made:
            keep = len(made[i][0]) + 4
            assert l2[i].item() == (keep - 1) * bs + ctx - (nb - 1) * bs
            want_reads = torch.zeros(reads.shape[1], dtype=torch.int32)
            for h in range(Hkv):
                want = made[i][h] + [nb - 4, nb - 3, nb - 2, nb - 1]
                assert t2[i, h, :keep].tolist() == [s["table"][j] for j in want], (i, h)
                want_reads[want] += 1
            assert torch.equal(reads[i], want_reads)
            nb_sum += nb * Hkv
            keep_sum += keep * Hkv
        else:  # count 0, too short, a prompt chunk: dense
            assert l2[i].item() == ctx
            for h in range(Hkv):
                assert t2[i, h, :nb].tolist() == s["table"]
    assert st[0].item() == nb_sum and st[1].item() == keep_sum
    # Attention runs over the reused tables.
    out = call.run_sparse(other)
    row = 0
    for i, s in enumerate(info):
        last = row + s["qlen"] - 1
        if i in made:
            kept = [made[i][h] + [len(s["table"]) - k for k in (4, 3, 2, 1)] for h in range(Hkv)]
            ref = ref_restricted(other[last, :Hq * D].view(Hq, D), s, kept, len(kept[0]), bs, group)
            assert rel_err(out[last].view(Hq, D), ref) < TOL[dtype] / 2
        row = last + 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("rule", ["capped", "mass"])
def test_selection_matches_the_float64_rule(dtype, group, D, rule):
    Hkv = 2
    seqs = [(3000, 1), (40, 1), (1500, 1), (700, 1), (2000, 20)]  # one too short, one prompt chunk
    call, buf, info, layout, kv = build(group * 11 + D, dtype, Hkv * group, Hkv, D, 16, seqs)
    _, _, heads = check_selection(call, buf, info, layout, kv, Hkv * group, PARAMS[rule])
    assert heads == 3 * Hkv, "three sequences were meant to select"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 8, 12])
@pytest.mark.parametrize("D,bs", [(64, 16), (128, 16), (128, 40), (64, 24)])
@pytest.mark.parametrize("rule", ["capped", "mass", "no_recent"])
def test_key_code_selection_matches_the_float64_rule(dtype, group, D, bs, rule):
    # The key-code estimate on tensor cores (codes_score_kernel) against the float64 log-sum-exp
    # of scale q.k over the keys read back from the codes, every block's log-mass (check_selection
    # compares the raw scores too): groups over 8 take two passes of column heads, blocks of 40
    # keys three code tiles (the last one partly filled); 1569 keys at blocks of 16 are 99 blocks,
    # the last one of a single key scored without a pair; "no_recent" keeps no recent block, so the
    # last blocks compete with the others.
    Hkv = 2
    seqs = [(3000, 1), (40, 1), (1500, 1), (701, 1), (2000, 20), (1569, 1)]
    p = PARAMS[rule] if rule != "no_recent" else dict(PARAMS["capped"], recent_blocks=0)
    call, buf, info, layout, kv = build(group * 13 + D + bs, dtype, Hkv * group, Hkv, D, bs, seqs)
    _, _, heads = check_selection(call, buf, info, layout, kv, Hkv * group, p, key_codes=True)
    assert heads == 4 * Hkv, "four sequences were meant to select"


@pytest.mark.parametrize("q_mult", [2.0 ** 17, 2.0 ** -20])
def test_key_code_selection_of_far_scaled_queries_in_long_runs(q_mult):
    # The query goes in as fp16 times a power of two per head; long runs cross the prefetch of
    # table entries; the 8B shape (32 / 8 heads, d 128) in a CUDA graph's table width.
    seqs = [(60000, 1), (9000, 1), (40, 1), (2000, 20), (2100, 1), (300, 1), (1500, 3), (3000, 1)]
    call, buf, info, layout, kv = build(29, torch.bfloat16, 32, 8, 128, 16, seqs, hot_frac=0.03, q_mult=q_mult,
                                        width=16384)
    _, _, heads = check_selection(call, buf, info, layout, kv, 32, PARAMS["mass"], q_mult=q_mult, key_codes=True)
    assert heads == 5 * 8, "five sequences were meant to select"


def test_selection_of_a_long_context_and_many_heads():
    seqs = [(32768, 1), (9000, 1)]
    call, buf, info, layout, kv = build(7, torch.bfloat16, 32, 8, 128, 16, seqs, hot_frac=0.02)
    check_selection(call, buf, info, layout, kv, 32, PARAMS["mass"])
    call, buf, info, layout, kv = build(8, torch.bfloat16, 32, 8, 128, 16, seqs, hot_frac=0.02)
    check_selection(call, buf, info, layout, kv, 32, dict(PARAMS["capped"], max_ratio=0.8, recent_blocks=16))


@pytest.mark.parametrize("q_mult", [2.0 ** 17, 2.0 ** -20])
def test_selection_of_far_scaled_queries_in_long_runs(q_mult):
    # The tensor-core score kernel takes the query as fp16 times a power of two (a bf16 query
    # of 2^17 would overflow fp16, one of 2^-20 be subnormal there), and each sequence's warps
    # (an equal share of one wave: 33 a KV head for 8 rows on 132 SMs) split its own blocks:
    # 3750 blocks give runs of ~120, so a warp crosses chunks of 32 table entries, while the
    # short rows keep runs of 8, in a table as wide as a CUDA graph's (16384 columns). The same
    # selection as with q_mult 1 (power-of-two multiples of the query, the scale divided by them).
    seqs = [(60000, 1), (9000, 1), (40, 1), (2000, 20), (2100, 1), (300, 1), (1500, 3), (3000, 1)]
    call, buf, info, layout, kv = build(23, torch.bfloat16, 32, 8, 128, 16, seqs, hot_frac=0.03, q_mult=q_mult,
                                        width=16384)
    _, _, heads = check_selection(call, buf, info, layout, kv, 32, PARAMS["mass"], q_mult=q_mult)
    assert heads == 5 * 8, "five sequences were meant to select"


@pytest.mark.parametrize("key_codes", [False, True])
def test_selection_of_many_rows_shared_by_blocks(key_codes):
    # The tensor-core score kernels share one wave of warps out over the rows by their blocks
    # (score_task, run 0): 40 rows, so the device's scan over rows takes two rounds of 32, with
    # a long row in each round beside short ones (whose warps it takes), rows too short to
    # select and a prompt chunk (no CTA), in a table as wide as a CUDA graph's. Every selecting
    # row's blocks must be scored: the selection and every block's raw score against float64.
    seqs = [(30000, 1)] + [(300 + 97 * i, 1) for i in range(29)] + [(40, 1), (2000, 20), (50, 1)]
    seqs += [(700, 1), (20000, 1), (190, 1), (1200, 1), (165, 1), (3001, 1), (64, 1)]
    assert len(seqs) == 40
    call, buf, info, layout, kv = build(31 + key_codes, torch.bfloat16, 8, 2, 128, 16, seqs, hot_frac=0.03,
                                        width=4096)
    _, _, heads = check_selection(call, buf, info, layout, kv, 8, PARAMS["mass"], key_codes=key_codes)
    assert heads == 36 * 2, "36 rows were meant to select (three of 64 or fewer keys do not, nor the prompt chunk)"


def test_selection_of_one_sequence_with_an_odd_number_of_query_heads():
    # The default model's shape (9 query heads, 3 KV heads, head_dim 64) with one sequence:
    # scratch for S * Hq = 9 rows of maxima, after which the histograms (loaded 16 bytes at a
    # time) must still start 16-byte aligned (an eager step's scratch is sized like this).
    call, buf, info, layout, kv = build(3, torch.bfloat16, 9, 3, 64, 16, [(3000, 1)], hot_frac=0.02)
    _, _, heads = check_selection(call, buf, info, layout, kv, 9, PARAMS["mass"])
    assert heads == 3


def test_selection_leaves_its_scratch_clean():
    # The histograms and maxima are zero at rest: a second selection (another query, same
    # call and scratch) must equal one made with fresh scratch on the same inputs.
    seqs = [(2500, 1), (1200, 1)]
    p = PARAMS["mass"]
    stats = torch.zeros(2, 4, dtype=torch.float64, device="cuda")
    call, buf, info, layout, kv = build(1, torch.bfloat16, 8, 2, 128, 16, seqs)
    check_selection(call, buf, info, layout, kv, 8, p, stats)
    buf2 = buf.clone()
    buf2[:, :8 * 128] += torch.randn(buf.shape[0], 8 * 128, device="cuda").to(buf.dtype)
    again, lens_again, _ = check_selection(call, buf2, info, layout, kv, 8, p, stats, planted=False)
    f_call, _, f_info, f_layout, f_kv = build(1, torch.bfloat16, 8, 2, 128, 16, seqs)
    fresh, lens_fresh, _ = check_selection(f_call, buf2, f_info, f_layout, f_kv, 8, p, planted=False)
    assert torch.equal(lens_again, lens_fresh)
    for i, s in enumerate(info):  # entries past a head's kept count are not written
        nb, ctx = len(s["table"]), s["ctx"]
        keep = (lens_fresh[i].item() - (ctx - (nb - 1) * 16)) // 16 + 1
        assert torch.equal(again[i, :, :keep], fresh[i, :, :keep])
    assert stats[1, 2].item() == 2 * 2 * 2, "statistics add up over selections"


@pytest.mark.parametrize("count_reads", [False, True])
def test_sparsity_bytes_for_the_pool_sizing_are_what_the_selection_allocates(count_reads):
    # K25Model sizes the KV pool (gpu_memory_utilization) with _C.cuda_sparsity_bytes: one
    # block's summaries and the selection's scratch. They must be what is allocated: the
    # summaries' tensor, and the device memory the first selection of a call keeps (its scratch;
    # the caching allocator rounds each tensor up to 512 bytes, and the selection's own outputs
    # are views of the scratch).
    Hq, Hkv, D = 8, 2, 128
    seqs = [(30000, 1), (5000, 1), (2600, 1)]
    call, buf, info, layout, kv = build(5, torch.bfloat16, Hq, Hkv, D, 16, seqs)
    S, width = len(seqs), max(len(s["table"]) for s in info)
    for dtype in ("bfloat16", "float16", "float32"):
        like = torch.empty(1, dtype=getattr(torch, dtype), device="cuda")
        per_block, _ = _C.cuda_sparsity_bytes(layout, dtype, Hq, S, width, count_reads)
        assert per_block == cu.make_block_summaries(3, layout, like).numel() // 3
    summ = cu.make_block_summaries(kv.numel() // (layout[0] * 2 * Hkv * 16 * D), layout, kv)
    call.update_summaries(summ)
    stats = torch.zeros(2, 4, dtype=torch.float64, device="cuda")
    _, scratch = _C.cuda_sparsity_bytes(layout, "bfloat16", Hq, S, width, count_reads)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = call.select(buf, summ, stats, **PARAMS["mass"], count_reads=count_reads)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    assert scratch <= kept <= scratch + 16 * 512, (scratch, kept)
    assert out[0].shape[0] == S


def test_key_code_rows_are_sized_for_the_pool_and_need_16_bit_kv():
    # Rows with key codes: head_dim + 16 bytes, then 4 head_dim bytes a tile of 16 keys.
    for bs, D in ((16, 128), (5, 64), (48, 128), (17, 64)):
        layout = (3, 2, D, bs)
        like = torch.empty(1, dtype=torch.bfloat16, device="cuda")
        per_block, _ = _C.cuda_sparsity_bytes(layout, "bfloat16", 4, 2, 8, False, True)
        assert per_block == 3 * 2 * (D + 16 + 4 * D * ((bs + 15) // 16))
        assert per_block == cu.make_block_summaries(2, layout, like, key_codes=True).numel() // 2
    with pytest.raises(Exception, match="16-bit KV"):
        cu.make_block_summaries(2, (3, 2, 128, 16), torch.empty(1, device="cuda"), key_codes=True)


@pytest.mark.parametrize("Hq,Hkv,D,seqs", [
    (8, 2, 128, [(3000, 1), (40, 1), (2500, 1), (2000, 20)]),  # 157 blocks wide: rows not 16-byte aligned
    (9, 3, 64, [(3000, 1)]),  # a cluster of 3
    (32, 8, 128, [(9000, 1), (4001, 1), (2600, 1)]),  # a cluster of 8
])
def test_selection_in_one_launch_equals_the_three_kernels(monkeypatch, Hq, Hkv, D, seqs):
    # On sm_90, bin, count and table run as one launch (choose_kernel: a cluster of the
    # sequence's KV heads); K25_SPARSE_FUSED=0 runs bin_kernel, count_kernel and table_kernel.
    # Both apply the same integer rule: the same tables, kept lengths and counts (entropy up to
    # the summation order), each also checked against the float64 rule.
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the one-launch selection needs compute capability 9.0 (thread-block clusters)")
    call, buf, info, layout, kv = build(17 + Hkv, torch.bfloat16, Hq, Hkv, D, 16, seqs, hot_frac=0.03)
    got = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("K25_SPARSE_FUSED", fused)
        stats = torch.zeros(2, 4, dtype=torch.float64, device="cuda")  # the calls select layer 1
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tables, lens, heads = check_selection(call, buf, info, layout, kv, Hq, PARAMS["mass"], stats)
            torch.cuda.synchronize()
        launched = {e.key for e in prof.key_averages()}
        assert any("choose_kernel" in k for k in launched) == (fused == "1"), "the launch the variable selects"
        assert any("count_kernel" in k for k in launched) == (fused == "0")
        got[fused] = (tables, lens, heads, stats.cpu())
    (t1, l1, h1, s1), (t0, l0, h0, s0) = got["1"], got["0"]
    assert h1 == h0 > 0
    assert torch.equal(l1, l0)
    for i, s in enumerate(info):
        nb, ctx = len(s["table"]), s["ctx"]
        keep = (l1[i].item() - (ctx - (nb - 1) * 16)) // 16 + 1
        assert torch.equal(t1[i, :, :keep], t0[i, :, :keep]), f"sequence {i}"
    assert torch.equal(s1[1, :3], s0[1, :3])
    torch.testing.assert_close(s1[1, 3], s0[1, 3], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_selection_of_queries_in_rows_not_16_byte_aligned(dtype):
    # 16-bit scores run on tensor cores, which load q 16 bytes at a time; q rows that are not
    # 16-byte aligned (an odd row stride, one element in) take the CUDA-core kernel instead,
    # and the selection is the same rule.
    seqs = [(3000, 1), (1500, 1), (700, 1)]
    call, buf, info, layout, kv = build(5, dtype, 8, 2, 128, 16, seqs)
    wide = torch.zeros(buf.shape[0], buf.shape[1] + 1, dtype=dtype, device="cuda")
    wide[:, 1:] = buf
    odd = wide[:, 1:]
    assert odd.data_ptr() % 16 != 0 and odd.stride(0) % 8 != 0
    _, _, heads = check_selection(call, odd, info, layout, kv, 8, PARAMS["mass"])
    assert heads == 3 * 2


def ref_restricted(q, s, kept, keep, bs, group):
    """float64 attention of one query row over each KV head's kept blocks."""
    Hq, D = q.shape
    out = torch.empty(Hq, D, dtype=torch.float64, device=q.device)
    ctx, nb = s["ctx"], len(s["table"])
    for h in range(len(kept)):
        idx = torch.cat([torch.arange(j * bs, min(ctx, (j + 1) * bs)) for j in kept[h]]).cuda()
        k, v = s["k"][idx, h].double(), s["v"][idx, h].double()
        for g in range(group):
            w = torch.softmax(k @ q[h * group + g].double() / math.sqrt(D), 0)
            out[h * group + g] = w @ v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits", [0, 1, 16])
def test_attention_over_the_kept_blocks(dtype, group, splits):
    # splits 0: the work-list form (with a prompt chunk in the batch when it is allowed);
    # otherwise the CUDA-graph form with that many derived splits.
    Hkv, D, bs = 2, 128, 16
    seqs = [(5000, 1), (3000, 1), (100, 1)] + ([(800, 33)] if splits == 0 else [])
    call, buf, info, layout, kv = build(group + splits, dtype, Hkv * group, Hkv, D, bs, seqs, decode_splits=splits)
    p = PARAMS["capped"]
    tables, lens, heads = check_selection(call, buf, info, layout, kv, Hkv * group, p)
    assert heads == 3 * Hkv
    out = call.run_sparse(buf)
    dense = call.run(buf)
    Hq = Hkv * group
    row = 0
    for i, s in enumerate(info):
        last = row + s["qlen"] - 1
        got = out[last].view(Hq, D)
        if s["qlen"] == 1 and s["ctx"] > p["min_context"]:
            keep = (lens[i].item() - (s["ctx"] - (len(s["table"]) - 1) * bs)) // bs + 1
            pos = {b: j for j, b in enumerate(s["table"])}
            kept = [[pos[b] for b in tables[i, h, :keep].tolist()] for h in range(Hkv)]
            ref = ref_restricted(buf[last, :Hq * D].view(Hq, D), s, kept, keep, bs, group)
            assert rel_err(got, ref) < TOL[dtype] / 2
            assert not torch.equal(got, dense[last].view(Hq, D)), "the sparse path should have run"
        else:
            assert torch.equal(out[row:last + 1], dense[row:last + 1]), "rows that do not select are unchanged"
        row = last + 1
