"""Prefix caching on the CPU, default model: time to first token of a request whose prompt
starts with a 1,024-token prefix that an earlier request computed, with the prefix's
blocks found in L1, fetched from L2 host memory, fetched from an L3 file, or not cached at
all (computed), in the same run. The L2/L3 cases use a small L1 that other requests have
filled, so the prefix's cached blocks were evicted and spilled down (docs/offload.md).

    python bench/cpu_prefix_cache.py [--prefix 1024] [--reps 3]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))

from k25 import K25Config, K25Model, _C  # noqa: E402
from oracles import long_text  # noqa: E402

BS = 16


def ttft(model, prompt):
    t = time.perf_counter()
    model.generate([prompt], max_new_tokens=1, temperature=0.0)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    probe = K25Model(K25Config(kv_cache_bytes=16 << 20))
    tok = probe.tokenizer
    per_block = probe.kv_block_bytes
    probe.close()
    text = tok.encode(long_text())
    prefix = text[:args.prefix]
    fillers = [text[20000 + 1200 * i:20000 + 1200 * i + args.prefix + 64] for i in range(3)]
    page = _C.kv_page_bytes(per_block)
    l1_small = (args.prefix + 128) // BS + 8   # room for one request: fillers evict the prefix
    base = dict(num_threads=2, block_size=BS, prefill_chunk_size=512, max_num_batched_tokens=512)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        setups = {
            "not cached (computed)": dict(kv_cache_bytes=64 << 20),
            "L1 hit": dict(kv_cache_bytes=64 << 20, enable_prefix_caching=True),
            "L2 hit": dict(kv_cache_bytes=l1_small * per_block, enable_prefix_caching=True,
                           cache_mode="hierarchical", enable_async_offload=True, l2_bytes=400 * page),
            "L3 hit": dict(kv_cache_bytes=l1_small * per_block, enable_prefix_caching=True,
                           cache_mode="hierarchical", enable_async_offload=True, l2_bytes=2 * page,
                           l3_path=os.path.join(tmp, "l3.bin"), l3_bytes=400 * page),
        }
        for name, kw in setups.items():
            m = K25Model(K25Config(**base, **kw))
            times = []
            try:
                for r in range(args.reps):
                    # a fresh tail each time, so only the prefix can be found
                    prompt = prefix + text[50000 + 40 * r:50000 + 40 * r + 32]
                    m.generate([prefix + [r + 5] * 20], max_new_tokens=1, temperature=0.0)  # caches the prefix
                    if "L2" in name or "L3" in name:
                        for f in fillers:                       # push it out of L1
                            m.generate([f], max_new_tokens=1, temperature=0.0)
                    s0 = m.stats()
                    times.append(ttft(m, prompt))
                    s1 = m.stats()
                hit = s1["prefix_cache_hits"] - s0["prefix_cache_hits"]
                tier = s1.get("prefix_cache_tier_hits", 0) - s0.get("prefix_cache_tier_hits", 0)
            finally:
                m.close()
            rows[name] = (statistics.median(times), hit, tier)
    ref = rows["not cached (computed)"][0]
    print(f"prefix {args.prefix} tokens + 32 new, default model, 2 threads; median of {args.reps}")
    print("| prefix found in | time to first token | vs computed | prompt tokens found (of which from L2/L3) |")
    print("| --- | ---: | ---: | ---: |")
    for name, (t, hit, tier) in rows.items():
        print(f"| {name} | {t * 1e3:.0f} ms | {ref / t:.1f}x | {hit} ({tier}) |")


if __name__ == "__main__":
    main()
