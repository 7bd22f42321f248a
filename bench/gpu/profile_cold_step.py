"""Where a cold run's slow decode steps spend their time (issue #6's P99): one tiered run of
the default model (sparse, graphs, batch 1) under torch.profiler, then per decode step (one
cudaGraphLaunch to the next on the engine thread) its wall time, the CUDA runtime calls made
in it and the host time between them, and the GPU's busy time and its kernels by name.
Steps that demote a block (a device -> pinned copy of the block's bytes) are compared with
the others, call by call. --resident: an all-resident run instead; --dense: sparsity off.

    python3 bench/gpu/profile_cold_step.py [--tokens 7600] [--new 160] [--l1-fraction 0.75] [--max-moves 0]
                                           [--resident] [--dense]
"""
import argparse
import asyncio
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cpu_long_context import timed_stream, workload  # noqa: E402


def busy_us(events):
    """Union of [ts, ts + dur) intervals, in us."""
    total, end = 0.0, None
    for e in sorted(events, key=lambda e: e["ts"]):
        s, f = e["ts"], e["ts"] + e["dur"]
        if end is None or s > end:
            total += f - s
            end = f
        elif f > end:
            total += f - end
            end = f
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=7600)
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--l1-fraction", type=float, default=0.75)
    ap.add_argument("--max-moves", type=int, default=0)
    ap.add_argument("--resident", action="store_true", help="all-resident run instead (the reference)")
    ap.add_argument("--dense", action="store_true", help="dynamic sparsity off")
    ap.add_argument("--trace", default="/tmp/k25_cold_trace.json")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    from k25 import K25Model
    base = dict(device="cuda", dtype="bfloat16", max_seq_len=8192, prefill_chunk_size=512,
                max_num_batched_tokens=512, block_size=16, enable_dynamic_sparsity=not args.dense)
    w = workload(base, args.tokens, args.new, args.l1_fraction)  # cpu_long_context's pools
    ids, per_block = w.ids, w.per_block
    m = K25Model(w.resident if args.resident else w.cold(args.max_moves))
    try:
        m.generate([ids[:64]], max_new_tokens=2, temperature=0.0)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            stamps, _, _ = asyncio.run(timed_stream(m, ids, args.new))
        prof.export_chrome_trace(args.trace)
    finally:
        m.close()
    steps_ms = 1e3 * np.diff(np.array(stamps))
    print(f"{'resident' if args.resident else f'L1 {args.l1_fraction:.0%}'}{', dense' if args.dense else ''}, "
          f"{args.tokens} + {args.new}: "
          f"profiled decode step P50 {np.percentile(steps_ms, 50):.2f} ms, P99 {np.percentile(steps_ms, 99):.2f} ms")
    analyze([e for e in json.load(open(args.trace))["traceEvents"] if e.get("ph") == "X"], per_block)


def analyze(ev, per_block):
    runtime = sorted([e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")], key=lambda e: e["ts"])
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = [e for e in runtime if e["name"] == "cudaGraphLaunch"]
    # The decode phase's launches (the prefill runs eagerly).
    print(f"{len(runtime)} runtime calls, {len(gpu)} GPU events, {len(launches)} graph launches")
    if len(launches) < 10:
        print("too few graph launches traced")
        return
    threads = collections.Counter(e["tid"] for e in runtime)
    engine_tid = max((e["tid"] for e in launches), key=lambda t: threads[t])
    rows = []
    for a, b in zip(launches[:-1], launches[1:]):
        t0, t1 = a["ts"], b["ts"]
        calls = [e for e in runtime if t0 <= e["ts"] < t1 and e["tid"] == engine_tid]
        g = [e for e in gpu if t0 <= e["ts"] < t1]
        down = [e for e in g if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]
                and e.get("args", {}).get("bytes", 0) >= per_block // 2]
        by = collections.defaultdict(float)
        for c in calls:
            by[c["name"]] += c["dur"]
        other_threads = [e for e in runtime if t0 <= e["ts"] < t1 and e["tid"] != engine_tid]
        ops = collections.defaultdict(float)
        for e in ev:
            if e.get("cat") == "cpu_op" and t0 <= e["ts"] < t1:
                ops[e["name"]] += e["dur"]
        kernels = collections.defaultdict(float)
        for e in g:
            kernels[e["name"][:60]] += e["dur"]
        rows.append({"ops": ops, "kernels": kernels, "wall": t1 - t0, "calls": by, "n_calls": len(calls), "host_gap": (t1 - t0) - sum(by.values()),
                     "gpu_busy": busy_us(g), "demote": bool(down), "down_bytes": sum(e["args"]["bytes"] for e in down),
                     "other": len(other_threads)})
    # A step is staged (schedule, demote, upload) at the end of the interval before its graph
    # launch, so an interval with the demote's copy holds the demote's host work and the
    # interval after it the GPU work of the step that waited for the copy.
    for i, r in enumerate(rows):
        r["kind"] = "demote" if r["demote"] else ("after demote" if i and rows[i - 1]["demote"] else "other")
    for kind in ("demote", "after demote", "other"):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        names = collections.Counter()
        for r in sel:
            for k, v in r["calls"].items():
                names[k] += v
        n = len(sel)
        print(f"\n{kind} intervals: {n}, wall mean {np.mean([r['wall'] for r in sel]):.0f} us "
              f"(P90 {np.percentile([r['wall'] for r in sel], 90):.0f}), GPU busy {np.mean([r['gpu_busy'] for r in sel]):.0f} us, "
              f"runtime calls {np.mean([r['n_calls'] for r in sel]):.1f} a step, host time outside them "
              f"{np.mean([r['host_gap'] for r in sel]):.0f} us, other threads' calls {np.mean([r['other'] for r in sel]):.1f}")
        for k, v in names.most_common(12):
            print(f"    {k:<36} {v / n:8.1f} us a step")
        ops = collections.Counter()
        for r in sel:
            for k, v in r["ops"].items():
                ops[k] += v
        for k, v in ops.most_common(8):  # nested ops count in each of their parents
            print(f"    op {k:<33} {v / n:8.1f} us a step")
        kernels = collections.Counter()
        for r in sel:
            for k, v in r["kernels"].items():
                kernels[k] += v
        for k, v in kernels.most_common(10):  # GPU time by kernel (and copy) name
            print(f"    gpu {k:<60} {v / n:8.1f} us a step")
    slow = sorted(rows, key=lambda r: r["wall"], reverse=True)[:5]
    print("\nslowest traced steps:")
    for r in slow:
        top = sorted(r["calls"].items(), key=lambda kv: kv[1], reverse=True)[:5]
        print(f"  {r['wall']:.0f} us ({r['kind']}, GPU busy {r['gpu_busy']:.0f}, host outside calls "
              f"{r['host_gap']:.0f}): " + ", ".join(f"{k} {v:.0f}" for k, v in top))


if __name__ == "__main__":
    main()
