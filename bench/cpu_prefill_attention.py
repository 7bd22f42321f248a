"""Prefill attention time on the CPU, one layer: k25's paged kernel against PyTorch SDPA.

The default model's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16 in
a shuffled pool), float32, causal: a whole prompt of --contexts tokens, and a chunk of --chunk
tokens at the end of such a context (chunked prefill). Reference: torch's
scaled_dot_product_attention (causal, GQA by repeating the KV heads, contiguous K/V) on the
same inputs in the same run, with the same number of threads; the two take turns in each of
--rounds rounds and each keeps its best round (the machine may be shared). k25's output is
checked against SDPA's first. Prints ms, GFLOP/s (4 * pairs * heads * head_dim) and the ratio.

    python bench/cpu_prefill_attention.py [--contexts 1024,4096] [--chunk 256] [--threads 2] [--rounds 3]
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

from k25 import _C

from cpu_sparse_attention import BS, D, HKV, HQ, timed_rounds  # same shape, same turn-taking timer


def case(ctx, chunk, rounds, seed):
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // BS)
    layout = (1, HKV, D, BS)
    k = torch.randn(ctx, HKV, D, generator=g)
    v = torch.randn(ctx, HKV, D, generator=g)
    table = torch.randperm(nb, generator=g).to(torch.int32)
    pool = torch.empty(nb, 1, 2, HKV, D * BS)
    kp = torch.zeros(nb * BS, HKV, D)
    vp = torch.zeros(nb * BS, HKV, D)
    kp[:ctx], vp[:ctx] = k, v
    # [blocks][layer][K: heads x D x bs | V: heads x bs x D] at each block's pool slot
    pool[table.long(), 0, 0] = kp.view(nb, BS, HKV, D).permute(0, 2, 3, 1).reshape(nb, HKV, D * BS)
    pool[table.long(), 0, 1] = vp.view(nb, BS, HKV, D).permute(0, 2, 1, 3).reshape(nb, HKV, BS * D)
    q = torch.randn(chunk, HQ, D, generator=g)
    qkv = torch.cat([q.reshape(chunk, HQ * D), torch.zeros(chunk, 2 * HKV * D)], 1)
    qs = torch.tensor([0, chunk], dtype=torch.int32)
    cl = torch.tensor([ctx], dtype=torch.int32)
    scale = 1.0 / math.sqrt(D)

    def k25():
        return _C.ops.paged_attention(qkv, pool.view(-1), layout, 0, qs, cl, table.view(1, nb), HQ, scale, 0)

    kk = k.repeat_interleave(HQ // HKV, 1).transpose(0, 1)  # [HQ, ctx, D]
    vv = v.repeat_interleave(HQ // HKV, 1).transpose(0, 1)
    qq = q.transpose(0, 1)  # [HQ, chunk, D]
    qpos = torch.arange(ctx - chunk, ctx)[:, None]
    mask = torch.arange(ctx)[None, :] <= qpos  # [chunk, ctx]: the chunk is the context's last tokens

    def sdpa():
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=None if chunk == ctx else mask,
                                              is_causal=chunk == ctx)

    ref = sdpa().transpose(0, 1).reshape(chunk, HQ * D)
    err = ((k25() - ref).norm() / ref.norm()).item()
    assert err < 1e-4, err
    t_k25, t_sdpa = timed_rounds([k25, sdpa], 1, rounds)
    pairs = sum(ctx - chunk + i + 1 for i in range(chunk))
    flops = 4.0 * pairs * HQ * D
    return {"context": ctx, "chunk": chunk, "k25_ms": t_k25 * 1e3, "sdpa_ms": t_sdpa * 1e3,
            "k25_gflops": flops / t_k25 / 1e9, "sdpa_gflops": flops / t_sdpa / 1e9,
            "k25_vs_sdpa": t_sdpa / t_k25, "rel_err": err}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _C.set_num_threads(args.threads)
    rows = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        for chunk in sorted({ctx, min(args.chunk, ctx)}, reverse=True):
            r = case(ctx, chunk, args.rounds, seed=ctx + chunk)
            rows.append(r)
            print(f"context {ctx:6d} chunk {chunk:6d}: k25 {r['k25_ms']:8.1f} ms ({r['k25_gflops']:5.1f} GFLOP/s)  "
                  f"SDPA {r['sdpa_ms']:8.1f} ms ({r['sdpa_gflops']:5.1f})  k25 / SDPA speed {r['k25_vs_sdpa']:.2f}x  "
                  f"rel_err {r['rel_err']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
