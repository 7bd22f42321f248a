"""CPU linear layers of a decode step: k25's few-rows kernel against torch.mm (MKL's sgemm).

y = x w^T for the default model's shapes (SmolLM2-135M: qkv 960x576, o 576x576, gate+up
3072x576, down 576x1536, lm_head 49152x576), float32, on one thread (the engine splits the
output features over its threads; each slice is one single-threaded call, as here). The two
take turns in each of --rounds rounds and each keeps its best (the machine may be shared).
k25's result is checked against torch's first. Prints us per call, GFLOP/s, GB/s of weight
read and the speed ratio; the summed row is one layer plus the lm_head.

    python bench/cpu_linear.py [--rows 1,2,4,8,16,32] [--rounds 5]
"""
import argparse

import torch

from k25 import _C

from cpu_sparse_attention import timed_rounds

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(n, kk, generator=g) for k, (n, kk) in SHAPES.items()}
    for M in [int(r) for r in args.rows.split(",")]:
        tot_k25 = tot_mkl = 0.0
        for name, w in weights.items():
            x = torch.randn(M, w.shape[1], generator=g)
            ref = torch.mm(x, w.t())
            err = ((_C.ops.linear_few_rows(x, w) - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-5, (name, M, err)
            reps = max(2, int(2e6 // w.numel()))
            t_k25, t_mkl = timed_rounds([lambda: _C.ops.linear_few_rows(x, w), lambda: torch.mm(x, w.t())],
                                        reps, args.rounds)
            tot_k25 += t_k25
            tot_mkl += t_mkl
            flops = 2.0 * M * w.numel()
            print(f"rows {M:3d} {name:8s} {tuple(w.shape)!s:14s}: k25 {t_k25 * 1e6:8.1f} us "
                  f"({flops / t_k25 / 1e9:5.1f} GFLOP/s, {w.numel() * 4 / t_k25 / 1e9:5.1f} GB/s)  "
                  f"MKL {t_mkl * 1e6:8.1f} us ({flops / t_mkl / 1e9:5.1f})  k25 / MKL speed {t_mkl / t_k25:.2f}x",
                  flush=True)
        print(f"rows {M:3d} one layer + lm_head: k25 {tot_k25 * 1e3:.2f} ms, MKL {tot_mkl * 1e3:.2f} ms, "
              f"{tot_mkl / tot_k25:.2f}x", flush=True)


if __name__ == "__main__":
    main()
