"""Where the wall time of a decode step goes with CUDA graphs on: a torch.profiler trace of
a few steps (CPU and GPU), then per step: wall time, GPU busy time (union of kernel and
copy intervals), the idle gaps inside the step and between steps, and the largest gaps
with what ran before and after them.

    python3 bench/gpu/profile_timeline.py [--layers 32] [--batch 1] [--steps 24] [--trace out.json]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from model_bench import write_checkpoint  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--path", default=None)
    ap.add_argument("--trace", default="/tmp/k25_trace.json")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--kv-gb", type=float, default=16, help="KV pool in GB; 0: gpu_memory_utilization's default")
    args = ap.parse_args()
    path = args.path or f"/tmp/llama8b-{args.layers}l"
    if not os.path.exists(os.path.join(path, "config.json")):
        write_checkpoint(path, args.layers)
    from k25 import K25Config, K25Model
    kv = dict(kv_cache_bytes=int(args.kv_gb * 2**30)) if args.kv_gb > 0 else {}
    m = K25Model(K25Config(model_path=path, device="cuda", dtype="bfloat16", max_seq_len=args.max_seq_len,
                           max_batch_size=max(args.max_batch, args.batch), **kv))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 100000, (args.ctx,), generator=g).tolist() for _ in range(args.batch)]
    m.generate(prompts, max_new_tokens=8, temperature=0.0, ignore_eos=True)

    def unprofiled(tag):
        # The same request without the profiler: (long - short) / extra tokens, i.e. the
        # steady-state time per decode step, to compare with the profiled wall below.
        import time
        per = []
        for _ in range(3):
            t = time.perf_counter()
            m.generate(prompts, max_new_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
            t_long = time.perf_counter() - t
            t = time.perf_counter()
            m.generate(prompts, max_new_tokens=5, temperature=0.0, ignore_eos=True)
            per.append(1e6 * (t_long - (time.perf_counter() - t)) / (args.steps - 4))
        print(f"unprofiled ({tag}): {', '.join(f'{x:.1f}' for x in per)} us per decode step")

    unprofiled("before")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        m.generate(prompts, max_new_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    prof.export_chrome_trace(args.trace)
    unprofiled("after")
    m.close()
    ev = json.load(open(args.trace))["traceEvents"]
    gpu = sorted([e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")],
                 key=lambda e: e["ts"])
    launches = sorted([e for e in ev if e.get("ph") == "X" and e.get("name") in ("cudaGraphLaunch",)],
                      key=lambda e: e["ts"])
    print(f"{len(gpu)} GPU events, {len(launches)} graph launches")
    if len(launches) < 3:
        print("no graph launches traced: are CUDA graphs on?")
        return
    # Steps: from one graph launch to the next (the last few decode steps only).
    rows = []
    for a, b in zip(launches[:-1], launches[1:]):
        t0, t1 = a["ts"], b["ts"]
        ks = [e for e in gpu if t0 <= e["ts"] < t1]
        busy, end, gaps = 0.0, None, []
        for e in ks:
            s, f = e["ts"], e["ts"] + e["dur"]
            if end is not None and s > end:
                gaps.append((s - end, prev, e["name"]))
            if end is None or f > end:
                busy += f - max(s, end) if end is not None else f - s
                end = f
            prev = e["name"]
        rows.append((t1 - t0, busy, len(ks), sorted(gaps, reverse=True)[:8], ks))
    wall = sum(r[0] for r in rows) / len(rows)
    busy = sum(r[1] for r in rows) / len(rows)
    print(f"per step (graph launch to graph launch, {len(rows)} steps): wall {wall:.1f} us, "
          f"GPU busy {busy:.1f} us ({100 * busy / wall:.1f}%), GPU events {rows[-1][2]}")
    first = rows[len(rows) // 2]
    print("largest gaps of one step (us, after -> before):")
    for gap, before, after in first[3]:
        print(f"  {gap:8.1f}  {before[:60]} -> {after[:60]}")
    # Kernel time by name over the measured steps.
    agg = {}
    for r in rows:
        for e in r[4]:
            agg.setdefault(e["name"][:80], [0.0, 0])
            agg[e["name"][:80]][0] += e["dur"]
            agg[e["name"][:80]][1] += 1
    print("kernel time per step (us), by name:")
    for name, (t, n) in sorted(agg.items(), key=lambda x: -x[1][0])[:18]:
        print(f"  {t / len(rows):9.1f}  x{n / len(rows):5.1f}  {name}")
    # Between two steps: the host's CUDA calls from the end of one step's last GPU event to
    # the start of the next step's first (where the device waits for the host).
    rt = sorted([e for e in ev if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"], key=lambda e: e["ts"])
    mid = len(rows) // 2
    last_end = max(e["ts"] + e["dur"] for e in rows[mid][4])
    nxt = rows[mid + 1][4] if mid + 1 < len(rows) else []
    if nxt:
        first_start = nxt[0]["ts"]
        print(f"device idle between steps {mid} and {mid + 1}: {first_start - last_end:.1f} us; host CUDA calls then:")
        for e in rt:
            if last_end - 50 <= e["ts"] <= first_start:
                print(f"  +{e['ts'] - last_end:8.1f} us  {e['dur']:7.1f} us  {e['name']}")
    big = [g for r in rows for g in r[3] if g[0] >= 5]
    print(f"gaps >= 5 us per step: {sum(g[0] for g in big) / len(rows):.1f} us")
    # Inter-kernel gaps inside the graph (kernel to kernel), as a distribution.
    inner = []
    for r in rows:
        ks = [e for e in r[4] if e.get("cat") == "kernel"]
        for p, q in zip(ks[:-1], ks[1:]):
            inner.append(q["ts"] - (p["ts"] + p["dur"]))
    inner.sort()
    if inner:
        n = len(inner)
        print(f"kernel-to-kernel gaps: n {n}, median {inner[n // 2]:.2f} us, p90 {inner[int(n * 0.9)]:.2f} us, "
              f"sum of gaps < 20 us per step {sum(x for x in inner if x < 20) / len(rows):.1f} us")


if __name__ == "__main__":
    main()
