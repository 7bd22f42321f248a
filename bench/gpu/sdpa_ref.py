"""PyTorch SDPA on the probes' shapes (GQA 32/8, head_dim 128, bf16, contiguous KV): the
reference that bench/gpu/prefill_probe.cu's and decode_probe.cu's figures are compared with
in the same GPU call.

    python3 bench/gpu/sdpa_ref.py [L ...]         # causal prefill, TFLOP/s per backend, median of 10
    python3 bench/gpu/sdpa_ref.py --decode BxL .. # decode, KV TB/s (the better GQA form), as attention_bench
    python3 bench/gpu/sdpa_ref.py --once L        # one prefill call after a warm-up (for a profiler)
    python3 bench/gpu/sdpa_ref.py --summary LOG   # each probe variant's best median / SDPA's
"""
import re
import sys

HQ, HKV, D = 32, 8, 128


def summary(path):
    """Best median per (variant, case) of the probe lines in the log, over SDPA's in the log
    (prefill: its default path; decode: its better GQA form)."""
    best = {}
    for line in open(path):
        m = re.match(r"(\S+)\s+L=(\d+) .*?([\d.]+) TFLOP/s", line)
        d = re.match(r"(\S+)\s+B=(\d+) L=(\d+) (?:.*?tables=(\d+))?.*?([\d.]+) TB/s", line)
        if m:
            key, value = (m.group(1), f"prefill L={m.group(2)}"), float(m.group(3))
        elif d:
            tables = f" tables={d.group(4)}" if d.group(4) and d.group(4) != "0" else ""
            key, value = (d.group(1), f"decode B={d.group(2)} L={d.group(3)}{tables}"), float(d.group(5))
        else:
            continue
        best[key] = max(best.get(key, 0.0), value)
    for (name, case), v in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if name.startswith("sdpa"):
            continue
        ref = best.get(("sdpa-default" if case.startswith("prefill") else "sdpa-decode", case.split(" tables=")[0]))
        unit = "TFLOP/s" if case.startswith("prefill") else "TB/s"
        ratio = f"{v / ref:.3f}x SDPA" if ref else "no SDPA figure"
        print(f"{name:24s} {case:22s} {v:8.2f} {unit}  {ratio}")


def call_ms(fn, rounds, per_round=1):
    """Sorted times of `rounds` rounds of `per_round` back-to-back calls, in ms per call,
    after three warm-up calls (as probe_common.cuh's time_calls)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_round):
            fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b) / per_round)
    return sorted(ms)


def inputs(B, Lq, L):
    """Random q [B, HQ, Lq, D] and contiguous k, v [B, HKV, L, D] in bf16."""
    import torch

    q = torch.randn(B, HQ, Lq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def decode(cases):
    import torch.nn.functional as F

    for c in cases:
        B, L = (int(x) for x in c.split("x"))
        q, k, v = inputs(B, 1, L)
        gb = B * L * HKV * D * 2 * 2 / 1e9
        rows = lambda: F.scaled_dot_product_attention(q.view(B, HKV, HQ // HKV, D), k, v)  # noqa: E731
        gqa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        tbps = max(gb / call_ms(fn, 5, 20)[0] for fn in (rows, gqa))  # GB / ms = TB/s, best round
        print(f"sdpa-decode  B={B} L={L}  {tbps:.2f} TB/s", flush=True)


def once(L):
    import torch
    import torch.nn.functional as F

    q, k, v = inputs(1, L, L)
    for _ in range(2):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()


def main():
    if sys.argv[1:2] == ["--summary"]:
        return summary(sys.argv[2])
    if sys.argv[1:2] == ["--once"]:
        return once(int(sys.argv[2]))
    if sys.argv[1:2] == ["--decode"]:
        return decode(sys.argv[2:])
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lens = [int(a) for a in sys.argv[1:]] or [16384]
    for L in lens:
        q, k, v = inputs(1, L, L)
        flops = 2 * HQ * D * L * L
        for name, be in [("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("flash", SDPBackend.FLASH_ATTENTION)]:
            def f():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            try:
                if be is None:
                    fn = f
                else:
                    def fn(be=be):
                        with sdpa_kernel(be):
                            return f()
                med = call_ms(fn, 10)[5]
                print(f"sdpa-{name:8s} L={L} {med:.3f} ms  {flops / med / 1e9:.1f} TFLOP/s", flush=True)
            except Exception as e:  # a backend this build or shape lacks
                print(f"sdpa-{name:8s} L={L} unavailable: {type(e).__name__}: {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
