"""End-to-end decode speed with dynamic sparsity on vs off, default model, CPU, batch 1.

Four models in one process (dense; sparse with the default channel estimate; sparse with
the key-code estimate, sparsity_score_rule="codes"; sparse with the Quest bound,
sparsity_score_channels=0) decode the same real-text prompt. They take
turns, --rounds times, each round re-submitting the prompt (prefix caching keeps its
blocks, so a round is decode steps only) and timing --new streamed tokens; each keeps its
best round's median step, since the machine may be shared. Reports ms per token, the
speed-up over dense, and the skipped fraction.

    python bench/cpu_sparse_decode.py [--contexts 4096,8000] [--new 24] [--rounds 3] [--threads 2]
                                      [--intervals 2,4]

--intervals adds, per value N, the channel estimate and the key codes with one selection
serving N decode steps (sparsity_selection_interval=N).
"""
import argparse
import asyncio
import json
import time

import numpy as np

from cpu_long_context import text_ids  # the same pydoc text


async def step_times(model, ids, new):
    stamps = []
    async for ev in model.stream_events(ids, max_new_tokens=new, ignore_eos=True, temperature=0.0):
        if ev.token_ids:
            stamps.append(time.perf_counter())
    return np.diff(np.array(stamps))  # decode steps (the first token comes from the prefill)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,8000")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--intervals", default="", help="sparsity_selection_interval values > 1 to add (comma list)")
    ap.add_argument("--json")
    args = ap.parse_args()
    from k25 import K25Config, K25Model
    variants = [("dense", {}), ("sparse, channel estimate", dict(enable_dynamic_sparsity=True)),
                ("sparse, key codes", dict(enable_dynamic_sparsity=True, sparsity_score_rule="codes")),
                ("sparse, Quest bound", dict(enable_dynamic_sparsity=True, sparsity_score_channels=0))]
    for n in (int(v) for v in args.intervals.split(",") if v):
        variants += [(f"channels, every {n} steps", dict(enable_dynamic_sparsity=True, sparsity_selection_interval=n)),
                     (f"key codes, every {n} steps", dict(enable_dynamic_sparsity=True, sparsity_score_rule="codes",
                                                          sparsity_selection_interval=n))]
    results = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        base = dict(num_threads=args.threads, max_seq_len=ctx + args.new + 16, kv_cache_bytes=1 << 30,
                    enable_prefix_caching=True)
        models = [K25Model(K25Config(**base, **kw)) for _, kw in variants]
        try:
            ids = text_ids(models[0], ctx)
            for m in models:
                m.generate([ids], max_new_tokens=1, temperature=0.0)  # prefill once; later rounds hit the cache
            best = [float("inf")] * len(models)
            for _ in range(args.rounds):
                for i, m in enumerate(models):
                    best[i] = min(best[i], float(np.median(asyncio.run(step_times(m, ids, args.new)))))
            ratios = [m.get_current_sparsity_ratio() for m in models]
        finally:
            for m in models:
                m.close()
        print(f"context {ctx}, {args.threads} threads, best of {args.rounds} rounds of {args.new} tokens:")
        for (name, _), t, r in zip(variants, best, ratios):
            print(f"  {name:26s} {1e3 * t:7.1f} ms/token  x{best[0] / t:5.2f} of dense  skipped {r:.3f}")
            results.append(dict(context=ctx, variant=name, ms_per_token=1e3 * t, speedup=best[0] / t, skipped=r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
