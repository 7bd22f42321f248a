"""Sparse decode attention (issue #5) against dense, in one process on one GPU.

Llama-3.1-8B attention shape (GQA 32/8, head_dim 128, bf16, pages of 16 in shuffled order).
Per case: dense = k25's decode kernel over every block (the CUDA-graph form, splits by the
one-wave rule); sparse = the device selection (cuda/block_sparsity.cu: two launches on sm_90) plus
the same decode kernel over each head's kept blocks; beside it, the dense kernel over as many
keys as were kept (each row's first ones, one table for every head), and the sparse path as a
decode step runs it: the step's summary update (summary_kernel), then the selection and the attention;
and from RoPE on (RoPE and the cache write of the step's token, which updates the summaries
itself where the tree fuses it, against RoPE and the dense kernel). Random keys spread the attention
mass, so the cap decides the count: the skipped fraction r is measured from the
selection's statistics, the bound on the speed-up is 1 / (1 - r), and the issue's target
is 0.85 of it at 32K and 128K. Summaries of bf16 KV are 4-bit codes and a scale: 128 + 16
bytes per (block, KV head) = 1.76% of the block's K and V bytes, read by the selection; with
--rules codes (the key-code estimate) 512 bytes of 2-bit key codes more (8.0% in all).
--width N pads the block tables to N columns, as the engine's CUDA graphs size them; a case
B1xL1+B2xL2 is one batch of rows of both lengths (e.g. 1x131072+7x2048).

    python3 bench/gpu/sparse_attention_bench.py [--json out.json] [--cases 1x8192,...] [--width 8192] [--overlap 2,4]
"""
import argparse
import json
import math

import torch

from attention_bench import batch_label, batch_lengths, time_ms
from k25 import _C

HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16
cu = _C.cuda_ops


def graphed(fn):
    """fn captured as a CUDA graph (as the engine runs decode; the host's launch cost is not
    timed): its replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def overlap_columns(lengths, q, kv, layout, tables, scale, summ, params, call, groups):
    """The batch's rows in G groups, each group its own selection and attention: timed one group
    after another, and with the selections on a second stream, so that a group's selection
    (issue-bound) runs beside the attention of the groups before it (DRAM-bound). The attention
    of every group is checked against the whole batch's sparse output (the selection is per row,
    so the kept blocks are the same)."""
    B = len(lengths)
    ref = call.run_sparse(q).float()
    out = {}
    for G in groups:
        if B % G:
            continue
        rows = B // G
        base = cu.decode_splits_for(q, D, HQ // HKV, rows, HKV)
        for split_name, splits in (("wave", base), ("half wave", max(1, base // 2))):
            parts = []
            for g in range(G):
                sl = slice(g * rows, (g + 1) * rows)
                qg = q[sl].contiguous()
                cg = cu.AttentionCall(kv, layout, 0, torch.arange(rows + 1, dtype=torch.int32),
                                      torch.tensor(lengths[sl], dtype=torch.int32), tables[sl].contiguous(), HQ, scale,
                                      0, 264, splits)
                parts.append((cg, qg, torch.zeros(1, 4, dtype=torch.float64, device="cuda")))
            for cg, qg, st in parts:
                cg.select(qg, summ, st, **params)
            got = torch.cat([cg.run_sparse(qg).float() for cg, qg, _ in parts])
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"groups of {rows} rows differ from the whole batch: {err}"
            side = torch.cuda.Stream()

            def serial():
                for cg, qg, st in parts:
                    cg.select(qg, summ, st, **params)
                    cg.run_sparse(qg)

            def overlapped():
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                for cg, qg, st in parts:
                    with torch.cuda.stream(side):
                        cg.select(qg, summ, st, **params)
                        done = torch.cuda.Event()
                        done.record(side)
                    main.wait_event(done)
                    cg.run_sparse(qg)
                main.wait_stream(side)

            out[f"{G} groups of {rows}, {split_name} ({splits} splits), one after another"] = time_ms(graphed(serial))
            out[f"{G} groups of {rows}, {split_name} ({splits} splits), selections on a second stream"] = \
                time_ms(graphed(overlapped))
            del parts
    return out


def case(lengths, caps, results, width=0, rules=("bound",), intervals=(1,), groups=()):
    """One batch of decode rows with these context lengths (all alike: the usual BxL cases)."""
    B, L = len(lengths), max(lengths)
    layout = (1, HKV, D, PAGE)
    nbs = [n // PAGE for n in lengths]
    nb = max(nbs)
    num_blocks = sum(nbs) + 1
    seed = B * 7 + L if len(set(lengths)) == 1 else sum(lengths)
    torch.manual_seed(seed)  # the same KV in every process (CPU and CUDA generators)
    kv = torch.randn(num_blocks * 2 * HKV * PAGE * D, device="cuda", dtype=DT)
    perm = torch.randperm(sum(nbs), dtype=torch.int32)
    tables = torch.full((B, max(nb, width)), -1, dtype=torch.int32)  # -1 past a row's blocks
    for b, o in enumerate([sum(nbs[:i]) for i in range(B)]):
        tables[b, :nbs[b]] = perm[o:o + nbs[b]]
    q = torch.randn(B, (HQ + 2 * HKV) * D, device="cuda", dtype=DT)
    # Random keys spread the mass evenly (the rule then keeps 90%: the floor); 2% of the
    # blocks get keys along their group's queries, so the mass concentrates and the cap
    # decides the count, as on real text at long contexts.
    pv = kv.view(num_blocks, 2, HKV, PAGE, D)
    qn = q[:, :HQ * D].float().view(B, HKV, HQ // HKV, D)
    qn = (qn / qn.norm(dim=-1, keepdim=True)).sum(2)  # [B, HKV, D]
    g = torch.Generator().manual_seed(seed)
    for b in range(B):
        hot = tables[b, torch.randperm(nbs[b], generator=g)[:max(1, nbs[b] // 50)]].long().cuda()
        pv[hot, 0] += (1.0 * math.sqrt(D) * qn[b])[None, :, None, :].to(DT)
    splits = cu.decode_splits_for(q, D, HQ // HKV, B, HKV)
    scale = 1.0 / math.sqrt(D)
    qs = torch.arange(B + 1, dtype=torch.int32)
    cl = torch.tensor(lengths, dtype=torch.int32)
    call = cu.AttentionCall(kv, layout, 0, qs, cl, tables, HQ, scale, 0, 264, splits)
    full = cu.AttentionCall(kv, layout, 0, torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                            cl, tables, HQ, scale, 0, 264, 0)
    dense_ms = time_ms(graphed(lambda: call.run(q)))
    # The decode step's part from the QKV projection's output to the attention's: RoPE and the
    # cache write of the step's token (slot ctx - 1 of each row) first, in both paths, on a copy
    # of q that every replay rotates in place. The tables are the identity rotation (cos 1, sin
    # 0): the kernel reads the same rows and does the same arithmetic, and q stays the query the
    # hot blocks were planted along. A real rotation, applied again at every replay, turns q
    # away from them: the mass spreads, the rule keeps ~90% of the blocks and the step is the
    # dense one's (the first run of this column, 2026-12-06, measured exactly that).
    qr = q.clone()
    pos = torch.tensor([n - 1 for n in lengths], dtype=torch.int32, device="cuda")
    slots = torch.tensor([int(tables[b, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE for b, n in enumerate(lengths)],
                         dtype=torch.int64, device="cuda")
    cos = torch.ones(L, D // 2, dtype=torch.float32, device="cuda")
    sin = torch.zeros(L, D // 2, dtype=torch.float32, device="cuda")
    rope = lambda **kw: cu.rope_write_kv(qr, pos, slots, HQ, cos, sin, kv, layout, 0, **kw)
    fused = "summaries" in (cu.rope_write_kv.__doc__ or "")  # a tree whose rope_write_kv updates summaries
    dense_rope_ms = time_ms(graphed(lambda: (rope(), call.run(qr))))
    kv_bytes = sum(lengths) * HKV * D * 2 * 2
    label = batch_label(lengths)
    print(f"{label}{f' (tables {width} wide)' if width > nb else ''}: dense {dense_ms * 1e3:.1f} us ({kv_bytes / dense_ms / 1e9:.2f} TB/s), splits {splits}")
    for rule, cap in [(rule, cap) for rule in rules for cap in caps]:
        codes = rule == "codes"
        if cap == caps[0]:
            # Summaries of every block (the prefill that wrote them), with key codes for that rule.
            summ = cu.make_block_summaries(num_blocks, layout, kv, key_codes=codes)
            full.update_summaries(summ, key_codes=codes)
        stats = torch.zeros(1, 4, dtype=torch.float64, device="cuda")
        params = dict(min_context=2048, sink_blocks=1, recent_blocks=16, min_ratio=0.1, max_ratio=cap,
                      mass_target=0.95, key_codes=codes)
        _, kept_lens = call.select(q, summ, stats, **params)
        # Copied now: kept_lens is the call's own buffer, which every later select rewrites.
        kl = kept_lens.cpu().to(torch.int32)
        r = 1.0 - stats[0, 1].item() / stats[0, 0].item()
        sparse_out = call.run_sparse(q)
        assert torch.isfinite(sparse_out).all()
        select_ms = time_ms(graphed(lambda: call.select(q, summ, stats, **params)))
        attend_ms = time_ms(graphed(lambda: call.run_sparse(q)))
        both_ms = time_ms(graphed(lambda: (call.select(q, summ, stats, **params), call.run_sparse(q))))
        # As a decode step runs it: the step's summary update (this call's last block of each row,
        # recomputed from the same keys) before the selection, which the dense step does without.
        step_ms = time_ms(graphed(lambda: (call.update_summaries(summ, codes), call.select(q, summ, stats, **params),
                                           call.run_sparse(q))))
        # From the QKV projection on: RoPE and the cache write, the summary update (fused into the
        # RoPE launch where the tree has it), the selection and the attention; against RoPE and
        # the dense attention.
        if fused and not codes:
            rope_step = lambda: (rope(summaries=summ), call.select(qr, summ, stats, **params), call.run_sparse(qr))
        else:
            rope_step = lambda: (rope(), call.update_summaries(summ, codes), call.select(qr, summ, stats, **params),
                                 call.run_sparse(qr))
        rope_step_ms = time_ms(graphed(rope_step))
        # The step's own selection must skip what the bare selection did (the step's key lands in
        # a recent block, kept either way), or the column would time another count.
        stats.zero_()
        rope_step()
        r_step = 1.0 - stats[0, 1].item() / stats[0, 0].item()
        assert abs(r_step - r) < 0.02, f"the step from RoPE on skipped {r_step:.3f}, the selection alone {r:.3f}"
        # The dense kernel over as many keys as were kept (each row's first kept-length keys
        # through its own shuffled table, one table for all heads): what the attention over
        # the kept blocks would cost without per-head tables.
        short = cu.AttentionCall(kv, layout, 0, qs, kl, tables[:, :-(-int(kl.max()) // PAGE)].contiguous(), HQ, scale,
                                 0, 264, splits)
        same_keys_ms = time_ms(graphed(lambda: short.run(q)))
        del short
        bound = 1.0 / (1.0 - r)
        speedup = dense_ms / both_ms
        reuse = {}
        if max(intervals) > 1:
            # Selection reuse (sparsity_selection_interval): one step in N selects and keeps its
            # selection (a slot a row), the others use it: their selection launch skips the
            # scoring and writes the tables from the slot. At the same context the kept tables are
            # the fresh ones, so the attention is the same; a step's cost over N steps is the
            # average of one selecting and N - 1 reusing ones (the reusing step's time does not
            # depend on N).
            memory = (torch.empty(B, 1, HKV, tables.shape[1], dtype=torch.int32, device="cuda"),
                      torch.zeros(B, 1, dtype=torch.int32, device="cuda"))
            modes = torch.arange(B, dtype=torch.int32, device="cuda") * 2
            stats5 = torch.zeros(1, 5, dtype=torch.float64, device="cuda")
            call.select(q, summ, stats5, **params, reuse=modes, memory=memory)
            use = modes + 1
            reuse_ms = time_ms(graphed(lambda: (call.select(q, summ, stats5, **params, reuse=use, memory=memory),
                                                call.run_sparse(q))))
            stats5.zero_()
            _, reused_lens = call.select(q, summ, stats5, **params, reuse=use, memory=memory)
            assert torch.equal(reused_lens.cpu().to(torch.int32), kl), "a reused selection keeps the same blocks"
            selecting = sum(n > params["min_context"] for n in lengths)  # (rows of min_context keys or fewer stay dense)
            assert stats5[0, 4].item() == selecting * HKV and stats5[0, 2].item() == 0
            reuse = dict(reuse_step_us=reuse_ms * 1e3, intervals={})
            for n in (n for n in intervals if n > 1):
                avg_ms = (both_ms + (n - 1) * reuse_ms) / n
                reuse["intervals"][n] = dict(avg_us=avg_ms * 1e3, speedup=dense_ms / avg_ms,
                                             of_bound=dense_ms / avg_ms / bound)
        ov = overlap_columns(lengths, q, kv, layout, tables, scale, summ, params, call, groups) if groups else {}
        print(f"  {rule} cap {cap}: skipped {r:.3f} (kept keys a row {int(kl.min())}-{int(kl.max())}), select {select_ms * 1e3:.1f} us + attend {attend_ms * 1e3:.1f} us "
              f"= {both_ms * 1e3:.1f} us; speed-up {speedup:.2f}x of bound {bound:.2f}x = {speedup / bound:.2f}; "
              f"dense over as many keys {same_keys_ms * 1e3:.1f} us; with the summary update {step_ms * 1e3:.1f} us: "
              f"{dense_ms / step_ms:.2f}x = {dense_ms / step_ms / bound:.2f} of bound; from RoPE on "
              f"({'summaries fused into RoPE' if fused and not codes else 'summary_kernel'}) {rope_step_ms * 1e3:.1f} us against "
              f"{dense_rope_ms * 1e3:.1f}: {dense_rope_ms / rope_step_ms:.2f}x = "
              f"{dense_rope_ms / rope_step_ms / bound:.2f} of bound")
        for key, v in ov.items():
            print(f"    {key}: {v * 1e3:.1f} us, {dense_ms / v:.2f}x = {dense_ms / v / bound:.2f} of bound")
        if reuse:
            print(f"    a reusing step (select launch and attend) {reuse['reuse_step_us']:.1f} us; a selection every "
                  + "; ".join(f"{n} steps: average {v['avg_us']:.1f} us, {v['speedup']:.2f}x = {v['of_bound']:.2f} "
                              f"of bound" for n, v in reuse["intervals"].items()))
        results.append(dict(batch=B, context=L, lengths=lengths, width=max(width, nb), rule=rule, cap=cap, skipped=r,
                            kept_min=int(kl.min()), kept_max=int(kl.max()), dense_us=dense_ms * 1e3,
                            select_us=select_ms * 1e3, attend_us=attend_ms * 1e3, sparse_us=both_ms * 1e3,
                            same_keys_us=same_keys_ms * 1e3, speedup=speedup, bound=bound, of_bound=speedup / bound,
                            step_us=step_ms * 1e3, step_speedup=dense_ms / step_ms, rope_step_us=rope_step_ms * 1e3,
                            dense_rope_us=dense_rope_ms * 1e3, rope_step_speedup=dense_rope_ms / rope_step_ms,
                            fused_summaries=fused and not codes, overlap_us={k: v * 1e3 for k, v in ov.items()},
                            **reuse))
    del kv, summ, call, full, cos, sin
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--cases", default="1x8192,1x32768,8x32768,1x131072,8x131072")
    ap.add_argument("--rules", default="bound,codes",
                    help="the selection rules, each on its own summaries: bound (the Quest bound) and / or codes "
                         "(the key-code estimate, summaries with key codes)")
    ap.add_argument("--width", type=int, default=0,
                    help="block-table columns (default: the context's blocks); the engine's CUDA graphs use "
                         "max positions / 16, e.g. 8192 for the 8B shape's 128K")
    ap.add_argument("--interval", default="1",
                    help="comma list; N > 1: also time a step that reuses the selection (sparsity_selection_interval) "
                         "and report the average of one selecting step and N - 1 reusing ones")
    ap.add_argument("--overlap", default="",
                    help="comma list of group counts G: also time the rows in G groups, each its own selection and "
                         "attention, one after another and with the selections on a second stream")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    results = []
    for c in args.cases.split(","):  # BxL, or a mixed batch: B1xL1+B2xL2 (e.g. 1x131072+7x2048)
        case(batch_lengths(c), [0.6, 0.8], results, args.width, tuple(args.rules.split(",")),
             tuple(int(n) for n in args.interval.split(",")),
             tuple(int(n) for n in args.overlap.split(",")) if args.overlap else ())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
