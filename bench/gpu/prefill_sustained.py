"""Causal prefill attention (16K, GQA 32/8, d128, bf16) per call over a sustained run, after
an idle pause, with the GPU's clock and power sampled alongside: k25's paged wgmma kernel,
SDPA's default path and FlashInfer's paged prefill, in alternating rounds.

Why: the torch-free probe (prefill_probe.cu, separate processes, single calls) and
attention_bench.py (one process, a few back-to-back calls right after SDPA's) gave 613 and
537 TFLOP/s for the same kernel in the same GPU call. This separates the candidates: the
kernel's state at the start of a run (clock after idle) from its sustained figure, the
timing method, and the data (k25-ih: the probe's Irwin-Hall values instead of randn).

    python3 bench/gpu/prefill_sustained.py [--seconds 1.5] [--rounds 2] [--json out.json]
"""
import argparse
import json
import math
import statistics
import subprocess
import time

import torch

from attention_bench import HQ, D, Paged, prefill_kernels, sustained


def irwin_hall_(t, gen):
    """The probe's fill: the sum of 4 uniforms, centred and scaled to unit variance."""
    u = torch.rand((4,) + tuple(t.shape), device=t.device, generator=gen).sum(0)
    t.copy_(((u - 2.0) * math.sqrt(3.0)).to(t.dtype))


def smi_sampler(path):
    return subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
         "-lms", "50"], stdout=open(path, "w"), stderr=subprocess.DEVNULL)


def smi_window(path, t0, t1):
    """Mean SM clock (MHz) and power (W) of the samples taken between t0 and t1 (epoch s)."""
    clocks, watts = [], []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + parts[0].split(".")[1])
            if t0 <= ts <= t1:
                clocks.append(float(parts[1]))
                watts.append(float(parts[2]))
        except (ValueError, IndexError):
            continue
    if not clocks:
        return None, None
    return statistics.mean(clocks), statistics.mean(watts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--idle", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smi", default="/tmp/smi.csv")
    ap.add_argument("--json")
    args = ap.parse_args()
    from k25 import _C  # noqa: F401  (attention_bench's Paged.k25 uses it)
    L = args.len
    flops = 2 * HQ * D * L * L
    try:
        import flashinfer as fi
    except Exception as e:  # the peer is optional
        fi = None
        print(f"flashinfer unavailable: {type(e).__name__}: {e}", flush=True)
    checks = {}
    kernels, _, qkv, _ = prefill_kernels(L, fi, checks)
    if "flashinfer_error" in checks:
        print(f"flashinfer failed: {checks['flashinfer_error']}", flush=True)
    assert all(v < 1e-2 for k, v in checks.items() if k.endswith("_err")), checks
    # The same kernel on the probe's data distribution (its own pool, plan and query).
    g = torch.Generator(device="cuda").manual_seed(1)
    P2 = Paged([L], seed=L + 1)
    irwin_hall_(P2.k25_kv, g)
    qkv2 = torch.empty_like(qkv)
    irwin_hall_(qkv2, g)
    call2 = P2.k25([L])
    kernels["k25-ih"] = lambda: call2.run(qkv2)
    for fn in kernels.values():  # compile / plan caches before any timing
        fn()
    torch.cuda.synchronize()
    smi = smi_sampler(args.smi)
    time.sleep(0.5)
    rows = []
    try:
        for r in range(args.rounds):
            for name, fn in kernels.items():
                time.sleep(args.idle)
                t0 = time.time()
                ms = sustained(fn, args.seconds, 3.6)
                t1 = time.time()
                clock, watts = smi_window(args.smi, t0, t1)
                head, tail = statistics.median(ms[1:11]), statistics.median(ms[len(ms) // 2:])
                row = {"round": r, "kernel": name, "calls": len(ms), "first_ms": round(ms[0], 3),
                       "calls_2_11_TFLOPs": round(flops / head / 1e9, 1),
                       "second_half_TFLOPs": round(flops / tail / 1e9, 1),
                       "mean_sm_MHz": clock and round(clock), "mean_W": watts and round(watts)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        smi.terminate()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
