"""A bfloat16 KV pool against a float32 one on the CPU: decode attention time, and decode
tokens/s end to end (kv_cache_dtype="bfloat16", docs/configuration.md).

Attention: one layer of the default model's shape (9 query / 3 KV heads, head_dim 64, blocks
of 16), dense paged decode attention (the kernel the engine runs) over random keys in random
block order; the float32 pool holds the bfloat16 pool's values, so both calls compute the
same thing. Each call reads the next of NL copies of the layer, NL such that the rotation
exceeds --cold-mib of float32 KV: the reads come from memory, as a real step's do (the other
layers' KV runs through the cache between two visits of one). Both pools are timed in the
same rounds, alternating; each one's best round counts.

End to end (--e2e N): the default model decoding --new tokens after an N-token pydoc prompt,
batch 1, with each pool in the same process (median step).

    python bench/cpu_kv_dtype.py [--contexts 4096,8192,32768] [--batches 1,8] [--e2e 4096]
"""
import argparse
import asyncio
import json
import math
import statistics
import time

import torch

from k25 import K25Config, K25Model, _C

HQ, HKV, D, BS = 9, 3, 64, 16


def best_of(fns, reps, rounds):
    best = [math.inf] * len(fns)
    for _ in range(rounds):
        for i, f in enumerate(fns):
            f()  # one call outside the clock
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            best[i] = min(best[i], (time.perf_counter() - t0) / reps)
    return best


def attention_case(ctx, b, cold_mib, rounds):
    nb = -(-ctx // BS)
    layer_bytes = b * nb * 2 * HKV * BS * D * 4
    NL = max(2, -(-(cold_mib << 20) // layer_bytes))
    g = torch.Generator().manual_seed(ctx + b)
    pf = torch.randn(b * nb, NL, 2, HKV, BS * D, generator=g).to(torch.bfloat16).float()
    pb = pf.to(torch.bfloat16)
    tables = torch.randperm(b * nb, generator=g).to(torch.int32).view(b, nb)
    qs = torch.arange(b + 1, dtype=torch.int32)
    cl = torch.full((b,), ctx, dtype=torch.int32)
    q = torch.randn(b, HQ * D, generator=g)
    layout = (NL, HKV, D, BS)
    turn = [0, 0]

    def call(pool, k):
        turn[k] = (turn[k] + 1) % NL
        return _C.ops.paged_attention(q, pool.view(-1), layout, turn[k], qs, cl, tables, HQ, 1 / math.sqrt(D), 0)

    assert torch.equal(call(pf, 0), call(pb, 1)), "the two pools must give the same attention"
    reps = max(3, int(2e7 // (b * ctx * HKV * D)))
    t32, t16 = best_of([lambda: call(pf, 0), lambda: call(pb, 1)], reps, rounds)
    return {"case": f"B{b} @ {ctx}", "layers_rotated": NL, "float32_us": round(t32 * 1e6, 1),
            "bfloat16_us": round(t16 * 1e6, 1), "speedup": round(t32 / t16, 3),
            "float32_GBps": round(layer_bytes / t32 / 1e9, 2), "bfloat16_GBps": round(layer_bytes / 2 / t16 / 1e9, 2)}


def e2e(ctx, new, threads):
    from pydoc_data import topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    out = {"case": f"e2e B1 @ {ctx}, {new} tokens"}
    for kv in ("float32", "bfloat16"):
        m = K25Model(K25Config(num_threads=threads, kv_cache_bytes=((ctx + new) * 30 * 2 * 3 * 64 * 4) * 2,
                               kv_cache_dtype=kv, max_seq_len=ctx + new + 16))
        try:
            ids = m.tokenize([text])[0][:ctx]
            stamps = []

            async def run():
                async for ev in m.stream_events(ids, max_new_tokens=new, ignore_eos=True, temperature=0.0):
                    if ev.token_ids:
                        stamps.append(time.perf_counter())
            asyncio.run(run())
            steps = [b - a for a, b in zip(stamps, stamps[1:])]
            out[f"{kv}_ms_per_token"] = round(statistics.median(steps) * 1e3, 2)
            out[f"{kv}_kv_bytes_per_token"] = m.kv_block_bytes // 16
        finally:
            m.close()
    out["speedup"] = round(out["float32_ms_per_token"] / out["bfloat16_ms_per_token"], 3)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--cold-mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--e2e", type=int, default=0, help="prompt tokens of an end-to-end decode run (0: none)")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    _C.set_num_threads(a.threads)
    rows = []
    for ctx in map(int, a.contexts.split(",")):
        for b in map(int, a.batches.split(",")):
            rows.append(attention_case(ctx, b, a.cold_mib, a.rounds))
            print(json.dumps(rows[-1]), flush=True)
    if a.e2e:
        rows.append(e2e(a.e2e, a.new, a.threads))
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
