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
90% floor of kept blocks, not the cap).

    python bench/cpu_sparse_attention.py [--contexts 4096,8192,32768] [--batches 1,8] [--caps 0.6,0.8]
                                         [--channels codes,8,0] [--rounds 5] [--mass-target 0]
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
    ap.add_argument("--json")
    args = ap.parse_args()
    layout = (1, HKV, D, BS)
    g = torch.Generator().manual_seed(0)
    rows = []
    for ctx in [int(x) for x in args.contexts.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            nb = -(-ctx // BS)
            pool = torch.randn(b * nb, 1, 2, HKV, BS * D, generator=g)
            tables = torch.randperm(b * nb, generator=g).view(b, nb).to(torch.int32)
            qs = torch.arange(b + 1, dtype=torch.int32)
            cl = torch.full((b,), ctx, dtype=torch.int32)
            # Summaries from the keys (prompt-style write of every block).
            summ = torch.empty(b * nb, 1, HKV, 1, D)  # packed bfloat16 min / max words (ops/block_sparsity.h)
            prompt_qs = torch.arange(b + 1, dtype=torch.int32) * ctx
            _C.ops.update_key_summaries(pool.view(-1), layout, summ, 0, prompt_qs, cl, tables)
            summ_codes = torch.empty(b * nb, 1, HKV, 1 + -(-BS // 16), D)  # the same plus the key codes
            _C.ops.update_key_summaries(pool.view(-1), layout, summ_codes, 0, prompt_qs, cl, tables, key_codes=True)
            q = torch.randn(b, HQ * D, generator=g)
            scale = 1 / math.sqrt(D)
            reps = max(1, int(1e6 // (ctx * b)))
            variants, fns = [], [lambda: _C.ops.paged_attention(q, pool.view(-1), layout, 0, qs, cl, tables, HQ,
                                                                scale, 0)]
            for ch in args.channels.split(","):
                codes = ch == "codes"
                sm = summ_codes if codes else summ
                for cap in [float(x) for x in args.caps.split(",")]:
                    kw = dict(min_context=2048, recent_blocks=16, sink_blocks=1, max_ratio=cap,
                              mass_target=args.mass_target, compensation=False,
                              score_channels=0 if codes else int(ch), key_codes=codes)
                    _, info = _C.ops.sparse_attention(q, pool.view(-1), layout, 0, qs, cl, tables, sm, HQ, scale,
                                                      **kw)
                    variants.append((ch, cap, 1 - info["blocks_kept"] / info["blocks_total"]))
                    fns.append(lambda kw=kw, sm=sm: _C.ops.sparse_attention(q, pool.view(-1), layout, 0, qs, cl,
                                                                            tables, sm, HQ, scale, info=False, **kw))
            times = timed_rounds(fns, reps, args.rounds)
            dense = times[0]
            for (ch, cap, r), sparse in zip(variants, times[1:]):
                speedup, bound = dense / sparse, 1 / (1 - r)
                row = dict(ctx=ctx, batch=b, channels=ch, cap=cap, skipped=r, dense_us=dense * 1e6,
                           sparse_us=sparse * 1e6, speedup=speedup, bound=bound, of_bound=speedup / bound)
                rows.append(row)
                print(f"ctx {ctx:6d} batch {b:2d} rule {ch:>5} cap {cap}: skipped {r:.3f}  dense {dense * 1e6:8.1f} us"
                      f"  sparse {sparse * 1e6:8.1f} us  speedup {speedup:.2f}x  bound {bound:.2f}x  "
                      f"{speedup / bound:.2f} of bound", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
