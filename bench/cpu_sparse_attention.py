"""Decode attention time with dynamic sparsity on vs off, one layer, CPU (issue #5 speed):
the default model's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16)
on random keys, batch 1 and 8, contexts 4K / 8K / 32K. The sparse call is the whole sparse
path (selection from the summaries, plus the channel estimate when on, then attention over
the kept blocks; `codes` in --channels: the key-code estimate, from summaries with key
codes); mass_target 0 makes the cap bind, so the skipped fraction r is the cap and the best
possible speedup is 1 / (1 - r). Reference: dense paged attention over the same pool in
the same run; dense and the sparse variants take turns in each of --rounds rounds and each
keeps its best round (the machine may be shared). The timed sparse call
passes info=False: it builds no Python lists of the selection, and its selection buffers
persist across calls as the engine's per-layer ones do. --mass-target > 0 times the count
of the mass rule too (on random keys the masses are flat, so the count is then near the
90% floor of kept blocks, not the cap). --intervals N,... (N > 1) also times a step that reuses
each variant's selection (sparsity_selection_interval: no scoring, the attention over the kept
blocks) and reports the average of one selecting and N - 1 reusing steps against the bound.
Each call reads the next of NL copies of the layer (pool layers with their own keys and
summaries), NL the fewest whose blocks kept at the largest cap together exceed --cold-mib (128
MiB, four times this box's L3): as in a model's decode step, where the other layers evict a
layer's blocks, no call finds its blocks cached by an earlier one. (Until 2026-12-07 one layer
was called repeatedly: at contexts whose kept blocks fit in L3 and whose whole layer did not, the
sparse call read from cache and dense from memory, and the speed-ups came out above the
1 / (1 - r) bound.)

    python bench/cpu_sparse_attention.py [--contexts 4096,8192,32768] [--batches 1,8] [--caps 0.6,0.8]
                                         [--channels codes,8,0] [--rounds 5] [--mass-target 0]
                                         [--intervals 2,4] [--cold-mib 128]
"""
import argparse
import json
import math
import time

import torch

from k25 import _C

HQ, HKV, D, BS = 9, 3, 64, 16


def timed_rounds(fns, reps, rounds):
    """Best mean time of each function over `rounds` rounds; the functions take turns within
    a round, so dense and sparse see the same conditions on a shared machine."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t) / reps)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--caps", default="0.6,0.8")
    ap.add_argument("--channels", default="codes,8,0",
                    help="rules: sparsity_score_channels values (0: the Quest bound rule) or codes (key codes)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of timing; each function's best round counts")
    ap.add_argument("--mass-target", type=float, default=0.0,
                    help="sparsity_mass_target (0: the cap binds, the skipped fraction is the cap)")
    ap.add_argument("--cold-mib", type=int, default=128,
                    help="KV read by consecutive calls at least (copies of the layer taken in turn), so that each "
                         "call reads its blocks from memory as in a model's decode step (this box's L3: 32 MiB)")
    ap.add_argument("--intervals", default="",
                    help="comma list of N > 1: also time a step reusing the selection, report the N-step average")
    ap.add_argument("--json")
    args = ap.parse_args()
    intervals = [int(n) for n in args.intervals.split(",") if n]
    g = torch.Generator().manual_seed(0)
    rows = []
    for ctx in [int(x) for x in args.contexts.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            nb = -(-ctx // BS)
            # Copies of the layer (pool layers), each call the next: the calls between two visits of
            # a layer read at least --cold-mib of KV even when each reads only the blocks the largest
            # cap keeps, so no call finds its blocks in the cache (in the engine the other layers
            # evict them).
            layer_bytes = b * nb * 2 * HKV * BS * D * 4
            least = layer_bytes * (1 - max(float(x) for x in args.caps.split(",")))
            NL = max(1, math.ceil(args.cold_mib * (1 << 20) / least))
            layout = (NL, HKV, D, BS)
            pool = torch.randn(b * nb, NL, 2, HKV, BS * D, generator=g)
            tables = torch.randperm(b * nb, generator=g).view(b, nb).to(torch.int32)
            qs = torch.arange(b + 1, dtype=torch.int32)
            cl = torch.full((b,), ctx, dtype=torch.int32)
            # Summaries from the keys (prompt-style write of every block), every layer.
            summ = torch.empty(b * nb, NL, HKV, 1, D)  # packed bfloat16 min / max words (ops/block_sparsity.h)
            summ_codes = torch.empty(b * nb, NL, HKV, 1 + -(-BS // 16), D)  # the same plus the key codes
            prompt_qs = torch.arange(b + 1, dtype=torch.int32) * ctx
            for layer in range(NL):
                _C.ops.update_key_summaries(pool.view(-1), layout, summ, layer, prompt_qs, cl, tables)
                _C.ops.update_key_summaries(pool.view(-1), layout, summ_codes, layer, prompt_qs, cl, tables,
                                            key_codes=True)
            q = torch.randn(b, HQ * D, generator=g)
            scale = 1 / math.sqrt(D)
            reps = max(NL, int(1e6 // (ctx * b)))
            at = [0]

            def next_layer():
                at[0] = (at[0] + 1) % NL
                return at[0]

            variants, fns = [], [lambda: _C.ops.paged_attention(q, pool.view(-1), layout, next_layer(), qs, cl, tables,
                                                                HQ, scale, 0)]
            for ch in args.channels.split(","):
                codes = ch == "codes"
                sm = summ_codes if codes else summ
                for cap in [float(x) for x in args.caps.split(",")]:
                    kw = dict(min_context=2048, recent_blocks=16, sink_blocks=1, max_ratio=cap,
                              mass_target=args.mass_target, compensation=False,
                              score_channels=0 if codes else int(ch), key_codes=codes)
                    kept, kept_blocks, total_blocks = [], 0, 0
                    for layer in range(NL):
                        _, info = _C.ops.sparse_attention(q, pool.view(-1), layout, layer, qs, cl, tables, sm, HQ,
                                                          scale, **kw)
                        kept_blocks += info["blocks_kept"]
                        total_blocks += info["blocks_total"]
                        if intervals:
                            # Each sequence's kept positions per KV head (cut at -1), as a reusing step gets
                            # them; at the same context the reusing step keeps the same blocks. As int32
                            # tensors [Hkv, count]: the engine hands them over as they lie, and lists of
                            # ints would time their conversion too (~12 us a call at B1 @ 4K).
                            pos = torch.tensor(info["positions"]).view(b, HKV, -1)
                            kept.append([torch.tensor([[j for j in pos[i, h].tolist() if j >= 0] for h in range(HKV)],
                                                      dtype=torch.int32) for i in range(b)])
                            _, again = _C.ops.sparse_attention(q, pool.view(-1), layout, layer, qs, cl, tables, sm,
                                                               HQ, scale, reuse=kept[-1], **kw)
                            assert again["blocks_kept"] == info["blocks_kept"] and again["selections"] == 0
                    r = 1 - kept_blocks / total_blocks
                    sparse_at = len(fns)
                    fns.append(lambda kw=kw, sm=sm: _C.ops.sparse_attention(q, pool.view(-1), layout, next_layer(), qs,
                                                                            cl, tables, sm, HQ, scale, info=False, **kw))
                    reuse_at = None
                    if intervals:
                        reuse_at = len(fns)

                        def reusing(kw=kw, sm=sm, kept=kept):
                            layer = next_layer()
                            return _C.ops.sparse_attention(q, pool.view(-1), layout, layer, qs, cl, tables, sm, HQ,
                                                           scale, info=False, reuse=kept[layer], **kw)

                        fns.append(reusing)
                    variants.append((ch, cap, r, sparse_at, reuse_at))
            times = timed_rounds(fns, reps, args.rounds)
            dense = times[0]
            for ch, cap, r, idx, reuse_at in variants:
                sparse = times[idx]
                speedup, bound = dense / sparse, 1 / (1 - r)
                row = dict(ctx=ctx, batch=b, layers=NL, channels=ch, cap=cap, skipped=r, dense_us=dense * 1e6,
                           sparse_us=sparse * 1e6, speedup=speedup, bound=bound, of_bound=speedup / bound)
                line = (f"ctx {ctx:6d} batch {b:2d} rule {ch:>5} cap {cap}: skipped {r:.3f}  dense {dense * 1e6:8.1f} us"
                        f"  sparse {sparse * 1e6:8.1f} us  speedup {speedup:.2f}x  bound {bound:.2f}x  "
                        f"{speedup / bound:.2f} of bound")
                if reuse_at is not None:
                    reuse = times[reuse_at]
                    row["reuse_us"] = reuse * 1e6
                    row["intervals"] = {}
                    line += f"; reusing step {reuse * 1e6:.1f} us"
                    for n in intervals:
                        avg = (sparse + (n - 1) * reuse) / n
                        row["intervals"][n] = dict(avg_us=avg * 1e6, speedup=dense / avg, of_bound=dense / avg / bound)
                        line += f", every {n}: {dense / avg:.2f}x = {dense / avg / bound:.2f} of bound"
                rows.append(row)
                print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
