"""Small-batch linear layers on the GPU: k25's gemv (cuda/gemv.cu) against cuBLAS (torch.mm)
on the 8B shape's weights, in the same run, as bandwidth of W and as a ratio, with the
device-to-device copy bandwidth measured here as the reference ceiling.

Each timing replays a CUDA graph of 16 products over rotating weight copies (> 4x the L2
size in all), so W comes from HBM as in a decode step and the host's launch cost is out.
k25's products chain through programmatic dependent launch there (each starts under the
previous one's tail, as a decode step's kernels do); cuBLAS's do not.

    python3 bench/gpu/gemv_bench.py [--rows 1] [--json out.json]
"""
import argparse
import json
import os
import sys

import torch

from k25 import _C

sys.path.insert(0, os.path.dirname(__file__))
from model_bench import copy_bandwidth  # noqa: E402

cu = _C.cuda_ops

SHAPES = {  # name: (N, K) of the Llama-3.1-8B shape
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def graph_time(fn, reps=16, iters=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / reps)
    return best * 1e-3  # seconds per product


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write); L2 {l2 >> 20} MB")
    results = []
    for name, (N, K) in SHAPES.items():
        wbytes = N * K * 2
        copies = max(2, -(-4 * l2 // wbytes))
        g = torch.Generator(device="cuda").manual_seed(N + K)
        ws = [torch.randn(N, K, device="cuda", dtype=dtype, generator=g) * 0.02 for _ in range(copies)]
        for M in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
            # correctness on the way: against float64
            ref = (x.double() @ ws[0].double().t())
            got = cu.gemv(x, ws[0])
            err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
            t_cublas = graph_time(lambda i: torch.mm(x, ws[i % copies].t()))
            t_k25 = graph_time(lambda i: cu.gemv(x, ws[i % copies]))
            row = dict(shape=name, N=N, K=K, M=M, cublas_us=t_cublas * 1e6, k25_us=t_k25 * 1e6,
                       cublas_tbs=wbytes / t_cublas / 1e12, k25_tbs=wbytes / t_k25 / 1e12,
                       speedup=t_cublas / t_k25, of_copy=wbytes / t_k25 / copy_bw, max_rel_err=err)
            if M == 1:
                for tpr in (32, 64, 128, 256):
                    os.environ["K25_GEMV_TPR"] = str(tpr)
                    row[f"k25_tpr{tpr}_tbs"] = wbytes / graph_time(lambda i: cu.gemv(x, ws[i % copies])) / 1e12
                del os.environ["K25_GEMV_TPR"]
            results.append(row)
            sweep = "  ".join(f"tpr{t} {row[f'k25_tpr{t}_tbs']:.2f}" for t in (32, 64, 128, 256)
                              if f"k25_tpr{t}_tbs" in row)
            print(f"{name:8s} N {N:6d} K {K:5d} M {M}: cuBLAS {row['cublas_us']:7.1f} us {row['cublas_tbs']:.2f} TB/s"
                  f"   k25 {row['k25_us']:7.1f} us {row['k25_tbs']:.2f} TB/s   {row['speedup']:.2f}x"
                  f"   {100 * row['of_copy']:.0f}% of copy   err {err:.1e}   {sweep}")
        del ws
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_tbs=copy_bw / 1e12, results=results), f, indent=1)


if __name__ == "__main__":
    main()
