"""Swap-in vs recompute of a preempted long sequence through the engine (issue #6), default
model, CPU or CUDA.

A bronze request with a long prompt is decoding when a gold request of the same length
arrives; the KV pool holds one of them, so the engine preempts the bronze one. With
cache_mode="hierarchical" it swaps the bronze sequence's blocks out to L2 (pinned host
memory on CUDA) and, once the gold request is done, fetches them back instead of computing
the prompt again. Reports what the engine measured on the way (stats(): the swap round
trip per block, copy out plus fetch back, and the prompt's compute per token), the round trip
of the preempted sequence's blocks against the recompute of its tokens (the engine's estimate,
and the prompt's prefill timed in the same script), and checks that the
bronze request's tokens equal a run without preemption.

    python bench/preempt_swap.py [--device cuda] [--tokens 8000] [--new 32] [--json out.json]

bench/cpu_offload.py times the tier mover alone on the CPU (L2 and L3); this is the engine's
whole swap path on either backend.
"""
import argparse
import json
import threading
import time

from cpu_long_context import text_ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    from k25 import K25Config, K25Model, _C
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    base = dict(device=args.device, dtype=dtype, num_threads=args.threads, block_size=16,
                max_seq_len=max(args.tokens + args.new + 8, 8192), prefill_chunk_size=512, max_num_batched_tokens=512)
    gen = dict(max_new_tokens=args.new, ignore_eos=True, temperature=0.0)
    probe = K25Model(K25Config(**base))
    try:
        ids = text_ids(probe, 2 * args.tokens)
        bronze_ids, gold_ids = ids[:args.tokens], ids[args.tokens:]
        per_block = probe.kv_block_bytes
        want = probe.generate([bronze_ids], **gen)[0].token_ids
        # What a recompute costs, timed here: the bronze prompt prefilled again (same chunks, one
        # token out, no prefix cache), best of two; the engine's own estimate is reported beside it.
        timed = []
        for _ in range(2):
            t0 = time.perf_counter()
            probe.generate([bronze_ids], max_new_tokens=1, temperature=0.0)
            timed.append(time.perf_counter() - t0)
        recompute_timed = min(timed)
    finally:
        probe.close()
    need = -(-(args.tokens + args.new) // 16)
    m = K25Model(K25Config(**base, kv_cache_bytes=(need + 8) * per_block, cache_mode="hierarchical",
                           enable_async_offload=True, l2_bytes=(need + 8) * _C.kv_page_bytes(per_block)))
    try:
        m.generate([bronze_ids[:64]], max_new_tokens=2, temperature=0.0)  # warm-up
        d0 = m.stats()["decode_tokens"]
        out = {}
        t = threading.Thread(target=lambda: out.update(bronze=m.generate([bronze_ids], priority="bronze", **gen)[0]))
        t0 = time.perf_counter()
        t.start()
        while m.stats()["decode_tokens"] < d0 + 2 and t.is_alive():  # the bronze one is decoding
            time.sleep(0.005)
        gold = m.generate([gold_ids], priority="gold", **gen)[0]
        t.join()
        wall = time.perf_counter() - t0
        s = m.stats()
    finally:
        m.close()
    bronze = out["bronze"]
    blocks = -(-(args.tokens + 2) // 16)  # what the bronze sequence held when preempted (about)
    res = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "dtype": dtype, "tokens": args.tokens,
           "block_bytes": per_block, "swap_outs": s["swap_outs"], "swap_ins": s["swap_ins"],
           "preemptions": s["preemptions"], "swap_declined": s["swap_declined"],
           "swap_s_per_block": s["swap_s_per_block"], "recompute_s_per_token": s["recompute_s_per_token"],
           "same_tokens": bronze.token_ids == want, "gold_tokens": len(gold.token_ids), "wall_s": wall}
    res["recompute_timed_s"] = recompute_timed
    if s["swap_s_per_block"] > 0 and s["recompute_s_per_token"] > 0:
        res["swap_round_trip_s"] = s["swap_s_per_block"] * blocks
        res["recompute_s"] = s["recompute_s_per_token"] * args.tokens
        res["swap_over_recompute"] = res["swap_round_trip_s"] / res["recompute_s"]
        res["swap_over_recompute_timed"] = res["swap_round_trip_s"] / recompute_timed
    print(f"{args.device} {dtype}: {args.tokens}-token bronze sequence preempted by a gold one; "
          f"{s['preemptions']} preemption(s), {s['swap_outs']} swapped out, {s['swap_ins']} swapped in, "
          f"{s['swap_declined']} declined")
    if "swap_over_recompute" in res:
        mb = blocks * per_block / 1e6
        print(f"swap round trip of {blocks} blocks ({mb:.0f} MB): {res['swap_round_trip_s'] * 1e3:.2f} ms "
              f"({2 * mb / 1e3 / res['swap_round_trip_s']:.1f} GB/s out + in); recompute of {args.tokens} tokens: "
              f"{res['recompute_s'] * 1e3:.2f} ms (the engine's estimate), {recompute_timed * 1e3:.2f} ms (timed: "
              f"the prompt prefilled again); swap / recompute {res['swap_over_recompute']:.4f} (estimate), "
              f"{res['swap_over_recompute_timed']:.4f} (timed)")
    print(f"bronze tokens equal to a run without preemption: {res['same_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if not res["same_tokens"]:
        raise SystemExit("the preempted request's tokens differ from a run without preemption")
    if s["swap_ins"] == 0:
        raise SystemExit("no swap happened: the scenario did not preempt by swap")


if __name__ == "__main__":
    main()
