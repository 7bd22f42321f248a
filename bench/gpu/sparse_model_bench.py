"""End-to-end decode with dynamic sparsity on vs off (issue #5): the Llama-3.1-8B shape with
random bf16 weights (model_bench.write_checkpoint), batch 1 and 8 at 8K, 32K and 128K
contexts, dense and at max_sparsity_ratio 0.6 (the default) and 0.8, in one process.

The three configurations load one after another (one 8B model fits the GPU at a time) and
decode the same random prompts. Per case: the prompts are prefilled once (prefix caching keeps
their blocks), then decode tok/s = batch x (N - 1) over the time of an N-token request minus a
1-token one (model_bench's method; the 1-token request's time is the median of three, and N is
128 by default: with one 1-token run and N = 64 the same configuration's B8 @ 128K rate moved by
up to 25% between runs on an H100, 2026-12-07); the skipped fraction is the sparsity
statistics' delta over the N-token request. Reports tok/s, the speed-up over dense, and the skipped fraction.
Random weights spread attention evenly, so the default rule keeps ~90% of the blocks (its
floor); --mass-target 0.05 makes the caps bind, as real text at long contexts does.

A case whose KV does not fit the device's memory next to the weights is skipped with a line
saying so (B8 @ 128K at 32 layers needs 137 GB of KV): --layers 8 keeps every layer's shape
and fits it. Prefill dominates the run time (B8 @ 32K is 262K tokens per configuration).

    python3 bench/gpu/sparse_model_bench.py [--layers 32] [--cases 1x8192,...] [--new 128] [--rule codes]
                                            [--intervals 1,2] [--json out.json]
    python3 bench/gpu/sparse_model_bench.py --device cpu --path default --cases 1x2600 --new 4  (smoke run)
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def skipped_blocks(model):
    layers = model.stats()["sparsity_layers"]
    return sum(l["blocks_skipped"] for l in layers), sum(l["blocks_total"] for l in layers)


def decode(model, prompts, new):
    """(tok/s, skipped fraction) of decoding `new` tokens for every prompt (already cached)."""
    def timed(n):
        t = time.perf_counter()
        outs = model.generate(prompts, max_new_tokens=n, ignore_eos=True, temperature=0.0)
        return time.perf_counter() - t, outs

    t1 = sorted(timed(1)[0] for _ in range(3))[1]
    s0, n0 = skipped_blocks(model)
    tn, outs = timed(new)
    s1, n1 = skipped_blocks(model)
    steps = sum(len(o.token_ids) - 1 for o in outs)
    return steps / (tn - t1), (s1 - s0) / (n1 - n0) if n1 > n0 else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the checkpoint written at --path")
    ap.add_argument("--path", default="/tmp/llama8b-random", help="'default': the default model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="1x8192,8x8192,1x32768,8x32768,1x131072,8x131072")
    ap.add_argument("--caps", default="0.6,0.8")
    ap.add_argument("--mass-target", type=float, default=None,
                    help="sparsity_mass_target (default: the config's 0.95). Random weights spread attention "
                         "evenly, so the rule keeps ~90%% of the blocks; a low target (0.05) makes the cap bind, "
                         "as real text at long contexts does")
    ap.add_argument("--rule", default=None, choices=["bound", "codes"], help="sparsity_score_rule (default: the "
                                                                             "config's: the codes on CUDA in bf16)")
    ap.add_argument("--intervals", default="1", help="sparsity_selection_interval values (comma list): one "
                                                     "selection serving that many decode steps")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    from k25 import K25Config, K25Model
    # A case longer than max_seq_len allows for its new tokens runs at the longest prompt that
    # fits (131,008 tokens for "128K" in the 8B shape's 131,072).
    base = dict(device=args.device, max_batch_size=max(B for B, _ in cases), enable_prefix_caching=True)
    if args.path != "default":
        if not os.path.exists(os.path.join(args.path, "config.json")):
            from model_bench import write_checkpoint
            write_checkpoint(args.path, args.layers)
        base["model_path"] = args.path
        # max_seq_len as long as the longest case needs (K25Config's default is shorter than
        # the 8B shape's 128K context), within the checkpoint's context.
        with open(os.path.join(args.path, "config.json")) as f:
            context = json.load(f).get("max_position_embeddings", 131072)
        base["max_seq_len"] = min(context, max(L for _, L in cases) + args.new + 16)
    if args.device == "cuda":
        base.update(dtype="bfloat16", gpu_memory_utilization=0.92, max_num_batched_tokens=8192,
                    prefill_chunk_size=4096)
        print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    else:
        base.update(kv_cache_bytes=1 << 30)
    sparse = dict(enable_dynamic_sparsity=True)
    if args.mass_target is not None:
        sparse["sparsity_mass_target"] = args.mass_target
    if args.rule is not None:
        sparse["sparsity_score_rule"] = args.rule
    configs = [("dense", {})] + [
        (f"cap {c}" + (f" every {n}" if int(n) > 1 else ""),
         dict(sparse, max_sparsity_ratio=float(c), sparsity_selection_interval=int(n)))
        for c in args.caps.split(",") for n in args.intervals.split(",")]
    results = {name: {} for name, _ in configs}
    for name, kw in configs:
        t = time.perf_counter()
        model = K25Model(K25Config(**base, **kw))
        print(f"[{name}] loaded in {time.perf_counter() - t:.1f} s", flush=True)
        try:
            pool_tokens = model.stats()["kv_cache_bytes"] // (model.kv_block_bytes // model.engine_config.block_size)
            for B, L in cases:
                L = min(L, model.max_seq_len - args.new - 16)
                if B * (L + args.new + 16) > pool_tokens:
                    print(f"[{name}] B{B} @ {L / 1024:.0f}K: skipped, {B * L} tokens of KV against a pool of "
                          f"{pool_tokens} (--layers fewer fits it)", flush=True)
                    continue
                g = torch.Generator().manual_seed(B * 1000003 + L)
                prompts = [torch.randint(10, 30000, (L,), generator=g).tolist() for _ in range(B)]
                t = time.perf_counter()
                model.generate(prompts, max_new_tokens=1, temperature=0.0)  # prefill; later requests hit the cache
                prefill_s = time.perf_counter() - t
                rate, skipped = decode(model, prompts, args.new)
                results[name][f"{B}x{L}"] = dict(tok_s=rate, skipped=skipped, prefill_s=prefill_s)
                dense = results["dense"].get(f"{B}x{L}")
                vs = f", {rate / dense['tok_s']:.2f}x dense" if dense and name != "dense" else ""
                print(f"[{name}] B{B} @ {L / 1024:.0f}K: {rate:8.1f} tok/s{vs}, skipped {skipped:.3f} "
                      f"(prefill {prefill_s:.1f} s)", flush=True)
        finally:
            model.close()
            del model
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), model=args.path, new=args.new, mass_target=args.mass_target,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
