"""Swap-in vs recompute for a preempted long sequence (issue #6), default model, CPU.

A sequence preempted at N tokens either recomputes its KV (a prefill of N tokens) or, with
cache_mode="hierarchical", had its blocks parked in L2 / L3 and fetches them back. This
times, in one process: the prefill of N tokens (the recompute), and the tier mover
(k25's TierManager, through the test harness, same block size as the model) demoting the
N tokens' blocks to L2 host memory or to an L3 file and fetching them back, checked byte
for byte. The engine's swap path is these transfers plus bookkeeping.

    python bench/cpu_offload.py [--tokens 8184] [--threads 2] [--l3-dir /tmp] [--json out.json]
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np


def text_ids(model, n):
    from pydoc_data import topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = model.tokenize([text])[0]
    assert len(ids) >= n
    return ids[:n]


def swap_round_trip(block_bytes, blocks, l3_dir):
    """Seconds to demote `blocks` blocks and to fetch them back, through L2 only and
    through L3 (L2 of two staging slots)."""
    from k25 import _C
    page = _C.kv_page_bytes(block_bytes)
    out = {}
    for tier in ("l2", "l3"):
        path = os.path.join(l3_dir, f"k25-bench-l3-{os.getpid()}.bin") if tier == "l3" else ""
        l2 = (blocks + 1) * page if tier == "l2" else 3 * page
        h = _C.TierHarness(blocks, block_bytes, l2, path, (blocks + 1) * page if path else 0, False, "auto", 2)
        try:
            rng = np.random.default_rng(0)
            h.l1()[:] = rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
            want = np.array(h.l1(), copy=True)
            t0 = time.perf_counter()
            keys = [h.demote(b) for b in range(blocks)]
            h.drain()
            t1 = time.perf_counter()
            assert all(keys), "a tier refused a block"
            done = h.completions()
            assert all(c["ok"] for c in done), [c for c in done if not c["ok"]][:3]
            h.l1()[:] = 0
            t2 = time.perf_counter()
            for b, k in enumerate(keys):
                h.fetch(k, b)
            h.drain()
            t3 = time.perf_counter()
            assert all(c["ok"] for c in h.completions())
            assert np.array_equal(np.asarray(h.l1()), want), "fetched bytes differ"
            s = h.stats()
            out[tier] = {"out_s": t1 - t0, "in_s": t3 - t2, "io_backend": h.io_backend if path else None,
                         "offloads_to_l3": s["offloads_to_l3"], "fetches_from_l3": s["fetches_from_l3"]}
        finally:
            h.close()
            if path and os.path.exists(path):
                os.remove(path)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8184, help="context of the preempted sequence (8K less room for 1 token)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--l3-dir", default=tempfile.gettempdir(), help="where the L3 file goes (O_DIRECT)")
    ap.add_argument("--json")
    args = ap.parse_args()
    from k25 import K25Config, K25Model
    m = K25Model(K25Config(num_threads=args.threads, max_seq_len=max(args.tokens + 8, 8192), prefill_chunk_size=2048,
                           max_num_batched_tokens=2048))
    try:
        ids = text_ids(m, args.tokens)
        m.generate([ids[:256]], max_new_tokens=1, temperature=0.0)  # warm-up
        t = time.perf_counter()
        m.generate([ids], max_new_tokens=1, temperature=0.0)
        recompute = time.perf_counter() - t
        block_bytes, block_size = m.kv_block_bytes, m.engine_config.block_size
    finally:
        m.close()
    blocks = -(-args.tokens // block_size)
    swap = swap_round_trip(block_bytes, blocks, args.l3_dir)
    gb = blocks * block_bytes / 1e9
    res = {"date": time.strftime("%Y-%m-%d"), "tokens": args.tokens, "blocks": blocks, "kv_GB": gb,
           "recompute_s": recompute, "swap": swap}
    print(f"{args.tokens} tokens = {blocks} blocks of {block_bytes} bytes ({gb:.2f} GB of KV, float32)")
    print(f"recompute (prefill of {args.tokens} tokens, {args.threads} threads): {recompute:8.2f} s")
    for tier, r in swap.items():
        total = r["out_s"] + r["in_s"]
        backend = f", {r['io_backend']}" if r["io_backend"] else ""
        print(f"swap via {tier.upper()}{backend}: out {r['out_s']:6.2f} s ({gb / r['out_s']:5.2f} GB/s), "
              f"in {r['in_s']:6.2f} s ({gb / r['in_s']:5.2f} GB/s); swap-in / recompute = "
              f"{r['in_s'] / recompute:.4f}, out + in / recompute = {total / recompute:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
