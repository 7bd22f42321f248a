"""A short request beside a long one whose cold blocks are in L3 (issue #6 point 5), CPU or CUDA.

One process, the default model, four runs of the same short request (greedy, streamed; its
token arrival gaps are its decode step latencies):
  alone          the short request by itself on the tiered configuration (the reference);
  lane           a long request (--tokens) arrives after the short one's first token; its
                 blocks past L1 + L2 go to the L3 file, and its steps run in the L3 lane, a
                 layer at a time between the short request's steps (docs/offload.md);
  write wait     the lane with K25_L3_WRITE_WAIT=1: the step that plans a lane step waits for
                 the page writes of its cold demotes to L3 (the engine before a lane step's
                 reads could start after the others' step), the others with it;
  lane off       the same with K25_L3_LANE=0: a lane step runs whole inside the step that
                 plans it, so the short request waits for the disk (the engine before the lane).
Prints the short request's time from its first to its last token and its P50 / P99 / max gap,
each against the alone run's, the long request's time to its first token, and checks that
every run gives the same tokens. Prefill chunks of --chunk tokens (64): a lane step's layers
run between the short request's steps as their reads come in, so its compute (a chunk's
layer) still lands between two of them, as a chunk sharing their step would.

Blocks of --block tokens (256), so that the short request (its prompt and --short-new tokens)
lives in one block: a request that needs a block while a longer one fills L1 preempts the lowest-ranked one
(docs/offload.md, the scheduler), which is not what this measures.

    python bench/lane_beside_l3.py --l3 PATH [--tokens 8000] [--short-new 200] [--block 256] [--device cuda]
"""
import argparse
import asyncio
import json
import os
import time

import numpy as np


def text_ids(model, n):
    from pydoc_data import topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = model.tokenize([text])[0]
    assert len(ids) >= n
    return ids[:n]


async def scenario(model, short_ids, short_new, long_ids):
    started = asyncio.Event()
    stamps, short_out, long_out = [], [], {}

    async def short():
        async for ev in model.stream_events(short_ids, max_new_tokens=short_new, ignore_eos=True, temperature=0.0):
            if ev.token_ids:
                stamps.append(time.perf_counter())
                short_out.extend(ev.token_ids)
                started.set()
                if "l3_from" not in long_out and model.tier_stats()["l3_slice_reads"] > 0:
                    long_out["l3_from"] = len(stamps) - 1  # the long request reads L3 from here on

    async def long():
        await started.wait()
        t0 = time.perf_counter()
        async for ev in model.stream_events(long_ids, max_new_tokens=2, ignore_eos=True, temperature=0.0):
            if ev.token_ids and "ttft" not in long_out:
                long_out["ttft"] = time.perf_counter() - t0
            long_out.setdefault("ids", []).extend(ev.token_ids)

    await asyncio.gather(short(), *([long()] if long_ids else []))
    return stamps, short_out, long_out


def gaps_ms(stamps):
    g = np.diff(np.array(stamps)) * 1e3
    return {"p50": float(np.percentile(g, 50)), "p99": float(np.percentile(g, 99)), "max": float(g.max())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--l3", required=True, help="the L3 file (created, removed at close)")
    ap.add_argument("--tokens", type=int, default=8000, help="the long request's prompt")
    ap.add_argument("--short-new", type=int, default=200)
    ap.add_argument("--block", type=int, default=256, help="tokens a KV block (the short request fits one)")
    ap.add_argument("--l1-blocks", type=int, default=4)
    ap.add_argument("--l2-slots", type=int, default=4, help="two of them staging for L3")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk: a lane layer's compute grows with it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args()

    from k25 import K25Config, K25Model, _C

    base = dict(num_threads=args.threads, device=args.device, block_size=args.block, prefill_chunk_size=args.chunk,
                max_num_batched_tokens=args.chunk + 64, max_batch_size=4)
    probe = K25Model(K25Config(**base))
    per_block = probe.kv_block_bytes
    short_ids = probe.tokenize(["Count with me: 1, 2, 3, 4,"])[0]
    long_ids = text_ids(probe, args.tokens)
    probe.close()
    assert len(short_ids) + args.short_new <= args.block, "the short request must fit one block"
    page = _C.kv_page_bytes(per_block)
    blocks = -(-(args.tokens + 2) // args.block)
    tiered = dict(base, kv_cache_bytes=args.l1_blocks * per_block, cache_mode="hierarchical",
                  enable_async_offload=True, l2_bytes=args.l2_slots * page, l3_path=args.l3,
                  l3_bytes=(blocks + 4) * page)

    results = {}
    runs = (("alone", False, {}), ("lane", True, {}), ("write wait", True, {"K25_L3_WRITE_WAIT": "1"}),
            ("lane off", True, {"K25_L3_LANE": "0"}))
    for name, with_long, env in runs:
        for k in ("K25_L3_LANE", "K25_L3_WRITE_WAIT"):
            os.environ.pop(k, None)
        os.environ.update(env)  # read when the engine starts
        model = K25Model(K25Config(**tiered))
        try:
            stamps, short_out, long_out = asyncio.run(
                scenario(model, short_ids, args.short_new, long_ids if with_long else None))
            s, tiers = model.stats(), model.tier_stats()
        finally:
            model.close()
        k = long_out.get("l3_from")
        r = dict(gaps_ms(stamps), short_s=stamps[-1] - stamps[0], short_tokens=short_out,
                 in_l3_phase=gaps_ms(stamps[k:]) if k is not None and len(stamps) - k > 2 else None,
                 l3_gaps=len(stamps) - k - 1 if k is not None else 0, lane_steps=s["lane_steps"],
                 l3_slice_reads=tiers["l3_slice_reads"], offloads_to_l3=tiers["offloads_to_l3"])
        if with_long:
            r.update(long_ttft_s=long_out["ttft"], long_tokens=long_out["ids"])
        results[name] = r
    for k in ("K25_L3_LANE", "K25_L3_WRITE_WAIT"):
        os.environ.pop(k, None)

    ref = results["alone"]
    same = all(r["short_tokens"] == ref["short_tokens"] for r in results.values())
    same_long = results["lane"]["long_tokens"] == results["lane off"]["long_tokens"]
    print(f"device {args.device}: short request {len(short_ids)} + {args.short_new} tokens; long request "
          f"{args.tokens} + 2 tokens ({blocks} blocks of {args.block}: L1 {args.l1_blocks}, L2 {args.l2_slots} slots, "
          f"the rest in L3)")
    for name, r in results.items():
        line = (f"{name:10s} short: {r['short_s']:6.2f} s first to last token ({r['short_s'] / ref['short_s']:6.2f}x alone),"
                f" gap P50 {r['p50']:7.2f} ms P99 {r['p99']:8.2f} ms max {r['max']:8.2f} ms"
                f" (P99 / alone {r['p99'] / ref['p99']:6.2f})")
        if r["in_l3_phase"]:
            p = r["in_l3_phase"]
            line += (f"\n{'':10s} while the long one reads L3 ({r['l3_gaps']} gaps): P50 {p['p50']:7.2f} ms"
                     f" P99 {p['p99']:8.2f} ms max {p['max']:8.2f} ms (P99 / alone {p['p99'] / ref['p99']:6.2f})")
        if "long_ttft_s" in r:
            line += (f"  long TTFT {r['long_ttft_s']:6.2f} s, {r['offloads_to_l3']} blocks to L3, "
                     f"{r['lane_steps']} lane steps")
        print(line)
    print(f"same short tokens in every run: {same}; same long tokens with and without the lane: {same_long}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=results, same=same, same_long=same_long, args=vars(args)), f, indent=1)


if __name__ == "__main__":
    main()
