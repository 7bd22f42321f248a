"""Attention kernels against their peers, in one process on one GPU.

Decode (GQA 32/8, head_dim 128, bf16, pages of 16 in shuffled order): KV bytes read per
second by k25's paged decode (the eager plan and the CUDA-graph form), PyTorch SDPA on
contiguous KV, and FlashInfer's paged decode (tensor cores). Prefill (causal, 16K):
TFLOP/s of k25's paged prefill, SDPA and FlashInfer's paged prefill, each after the same
idle pause, over a short run and settled under the power limit (burst_and_sustained). Every
kernel's output is checked against SDPA's before it is timed. A mixed decode batch (rows of
different lengths, e.g. 1x32768+7x2048) has no contiguous SDPA form: it is compared with
FlashInfer only, its reference being SDPA row by row.

    python3 bench/gpu/attention_bench.py [--json out.json] [--skip-flashinfer] [--decode-only]
        [--decode-cases 8x32768,1x32768+7x2048,...]
"""
import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

from k25 import _C

HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16


def batch_lengths(case):
    """The context lengths of a case: BxL, or a mixed batch B1xL1+B2xL2 (e.g. 1x32768+7x2048)."""
    lens = []
    for part in case.split("+"):
        B, L = (int(x) for x in part.split("x"))
        lens += [L] * B
    return lens


def batch_label(lens):
    """B8 @ 32K, or 1x128K+7x2K for a mixed batch (the sparsity benches' labels)."""
    if len(set(lens)) == 1:
        return f"B{len(lens)} @ {lens[0] // 1024}K"
    return "+".join(f"{lens.count(n)}x{n // 1024}K" for n in sorted(set(lens), reverse=True))


def time_ms(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):  # best of three batches of iters: the machine is shared
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def graph_per_call(fn, n=20):
    """ms per call of fn, n calls captured in one CUDA graph (after one eager call), so the
    kernels chain as in a decode step's graph and no host launch is timed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    return time_ms(graph.replay, iters=5) / n


def sustained(fn, seconds, per_call_ms):
    """Back-to-back calls for about `seconds`, each between two events: per-call ms."""
    n = max(20, int(seconds * 1e3 / per_call_ms))
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn()
        ev[i + 1].record()
    ev[-1].synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]


def burst_and_sustained(kernels, rounds=2, idle=1.5, seconds=1.2):
    """Per kernel, in alternating rounds after an idle pause each: the median of calls 2-11
    (the clock of a short run) and of the second half of ~`seconds` of back-to-back calls (the
    clock the power limit settles at, ~12% lower at causal 16K). The best of the rounds each.
    A kernel timed right after another one's long run would start at that one's settled clock
    (prefill_sustained.py, 2026-12-01: the same k25 kernel 537 vs 618 TFLOP/s that way)."""
    import statistics
    import time
    best = {name: [float("inf"), float("inf")] for name in kernels}
    for _ in range(rounds):
        for name, fn in kernels.items():
            time.sleep(idle)
            ms = sustained(fn, seconds, 3.6)
            b = best[name]
            b[0] = min(b[0], statistics.median(ms[1:11]))
            b[1] = min(b[1], statistics.median(ms[len(ms) // 2:]))
    return best


class Paged:
    """One random KV history per sequence, stored in k25's pool (block-major, 1 layer) and
    in FlashInfer's NHD page layout over the same shuffled page ids, plus a contiguous copy
    for SDPA."""

    def __init__(self, lens, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.lens = lens
        pages = [-(-n // PAGE) for n in lens]
        total = sum(pages)
        perm = torch.randperm(total, device="cuda", generator=g)
        self.tables, self.indptr = [], [0]
        at = 0
        for n in pages:
            self.tables.append(perm[at:at + n])
            at += n
            self.indptr.append(at)
        self.k25_kv = torch.empty(total, 1, 2, HKV, PAGE, D, dtype=DT, device="cuda")
        self.fi_kv = torch.empty(total, 2, PAGE, HKV, D, dtype=DT, device="cuda")
        self.k, self.v = [], []
        for n, t in zip(lens, self.tables):
            k = torch.randn(n, HKV, D, device="cuda", generator=g, dtype=DT)
            v = torch.randn(n, HKV, D, device="cuda", generator=g, dtype=DT)
            self.k.append(k)
            self.v.append(v)
            p = torch.arange(n, device="cuda")
            b, o = t[p // PAGE], p % PAGE
            self.k25_kv[b, 0, 0, :, o] = k
            self.k25_kv[b, 0, 1, :, o] = v
            self.fi_kv[b, 0, o] = k
            self.fi_kv[b, 1, o] = v
        width = max(pages)
        self.block_tables = torch.full((len(lens), width), -1, dtype=torch.int32)
        for i, t in enumerate(self.tables):
            self.block_tables[i, :len(t)] = t.int().cpu()

    def kv_bytes(self):
        return sum(self.lens) * HKV * D * 2 * 2

    def k25(self, q_lens, decode_splits=0, wave=0):
        qs = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
        cl = torch.tensor(self.lens, dtype=torch.int32)
        return _C.cuda_ops.AttentionCall(self.k25_kv, (1, HKV, D, PAGE), 0, qs, cl, self.block_tables, HQ,
                                     1.0 / math.sqrt(D), 0, 264, decode_splits, wave)

    def flashinfer_args(self):
        indptr = torch.tensor(self.indptr, dtype=torch.int32, device="cuda")
        indices = torch.cat(self.tables).int()
        last = torch.tensor([(n - 1) % PAGE + 1 for n in self.lens], dtype=torch.int32, device="cuda")
        return indptr, indices, last


def sdpa_decode(q, k, v):
    # q [B, HQ, D] -> the group's query heads as rows of their KV head (exact, no mask).
    B = q.shape[0]
    return F.scaled_dot_product_attention(q.view(B, HKV, HQ // HKV, D), k, v).reshape(B, HQ, D)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def decode_case(lens, fi, results):
    """One decode batch of rows of these context lengths. Rows of one length are also run
    through SDPA on contiguous KV; a mixed batch (e.g. 1x32768+7x2048: the graph form's split
    ranges shared by keys) only against FlashInfer's paged decode, which plans its own."""
    B, L = len(lens), max(lens)
    same = len(set(lens)) == 1
    P = Paged(lens, seed=B * 7 + L if same else sum(lens))
    q = torch.randn(B, HQ, D, device="cuda", dtype=DT)
    if same:
        kc = torch.stack(P.k).transpose(1, 2).contiguous()  # [B, HKV, L, D]
        vc = torch.stack(P.v).transpose(1, 2).contiguous()
        ref = sdpa_decode(q, kc, vc)
    else:
        ref = torch.cat([sdpa_decode(q[i:i + 1], P.k[i].transpose(0, 1)[None].contiguous(),
                                     P.v[i].transpose(0, 1)[None].contiguous()) for i in range(B)])
    gb = P.kv_bytes() / 1e9
    label = f"B{B} L{L}" if same else "+".join(f"{lens.count(n)}x{n}" for n in sorted(set(lens), reverse=True))
    row = {"case": f"decode {label}", "kv_GB": round(gb, 3)}
    # q as k25 sees it: rows of the fused qkv buffer.
    qkv = torch.zeros(B, (HQ + 2 * HKV) * D, device="cuda", dtype=DT)
    qkv[:, :HQ * D] = q.reshape(B, -1)
    splits = _C.cuda_ops.decode_splits_for(q, D, HQ // HKV, B, HKV)
    # The eager plan as LlamaModel makes it on the GPU: split to fit one wave of the decode kernel.
    # (Until 2026-12-06 this column planned for 264 workers' soft rule, ~2 x 264 items: up to
    # two waves of CTAs, which the engine never runs.)
    wave = _C.cuda_ops.decode_wave(q, D, HQ // HKV)
    runs = {"k25_plan": P.k25([1] * B, wave=wave), "k25_graph_form": P.k25([1] * B, decode_splits=splits)}
    for name, call in runs.items():
        out = call.run(qkv).view(B, HQ, D)
        row[name + "_err"] = rel(out, ref)
        row[name + "_TBps"] = gb / 1e3 / (time_ms(lambda: call.run(qkv)) / 1e3)
    # Split counts past one wave (the graph form's rule fills exactly one, two CTAs an SM), and
    # one CTA an SM (half the partials to merge): a sweep for the rule, not part of the
    # comparison below.
    one_per_sm = max(1, torch.cuda.get_device_properties(0).multi_processor_count // (B * HKV))
    for more in sorted({min(64, splits * 2), min(64, splits * 4), min(splits, one_per_sm)} - {splits}):
        call = P.k25([1] * B, decode_splits=more)
        row[f"k25_splits{more}_err"] = rel(call.run(qkv).view(B, HQ, D), ref)
        row[f"k25_splits{more}_TBps"] = gb / 1e3 / (time_ms(lambda: call.run(qkv)) / 1e3)
    row["graph_form_splits"] = splits
    # As a decode step runs it: RoPE and the cache write of each row's token (the engine's
    # kernel, identity tables) right before each attention call, 20 such pairs captured in one
    # CUDA graph (as a step's layers are), less 20 RoPE calls captured the same way. The
    # back-to-back calls above let each launch overlap the one before it (programmatic dependent
    # launch: the decode kernel's work before its pdl_wait, and the previous call's tail), which
    # a decode step gives the attention only over RoPE's span. (Graphs of one pair each would
    # add a replay's start to every pair; stream launches would time Python's launch rate for
    # RoPE alone. RoPE writes zeros into key ctx - 1: after it the k25 outputs are no longer
    # the reference's, so it runs after their checks.)
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device="cuda")
    slots = torch.tensor([int(P.block_tables[b, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE for b, n in enumerate(lens)],
                         dtype=torch.int64, device="cuda")
    cos = torch.ones(L, D // 2, dtype=torch.float32, device="cuda")
    sin = torch.zeros(L, D // 2, dtype=torch.float32, device="cuda")
    rope = lambda: _C.cuda_ops.rope_write_kv(qkv, pos, slots, HQ, cos, sin, P.k25_kv, (1, HKV, D, PAGE), 0)  # noqa: E731
    graph_call = runs["k25_graph_form"]
    rope_ms = graph_per_call(rope)
    pair_ms = graph_per_call(lambda: (rope(), graph_call.run(qkv)))
    row["rope_us"] = rope_ms * 1e3
    row["k25_graph_after_rope_TBps"] = gb / 1e3 / ((pair_ms - rope_ms) / 1e3)
    if same:
        row["sdpa_TBps"] = gb / 1e3 / (time_ms(lambda: sdpa_decode(q, kc, vc)) / 1e3)
        sdpa_gqa = lambda: F.scaled_dot_product_attention(q.view(B, HQ, 1, D), kc, vc, enable_gqa=True)  # noqa: E731
        row["sdpa_enable_gqa_TBps"] = gb / 1e3 / (time_ms(sdpa_gqa) / 1e3)
    if fi is not None:
        try:
            ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            indptr, indices, last = P.flashinfer_args()
            w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)
            out = w.run(q, P.fi_kv)
            row["flashinfer_err"] = rel(out, ref)
            row["flashinfer_TBps"] = gb / 1e3 / (time_ms(lambda: w.run(q, P.fi_kv)) / 1e3)
        except Exception as e:
            row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:300]
    if same:
        best_peer = max(row["sdpa_TBps"], row["sdpa_enable_gqa_TBps"])
        row["k25_vs_sdpa"] = max(row["k25_plan_TBps"], row["k25_graph_form_TBps"]) / best_peer
        row["k25_after_rope_vs_sdpa"] = row["k25_graph_after_rope_TBps"] / best_peer
    if "flashinfer_TBps" in row:
        row["k25_vs_flashinfer"] = max(row["k25_plan_TBps"], row["k25_graph_form_TBps"]) / row["flashinfer_TBps"]
    results.append(row)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    del P


def prefill_kernels(L, fi, row):
    """Causal prefill of one random L-token sequence: {name: call} for SDPA (contiguous KV),
    k25's paged call and, with `fi`, FlashInfer's paged prefill, each output's error against
    SDPA's put in `row` (or FlashInfer's failure: the peer is optional); also the k25 call, its
    qkv input and SDPA's output [L, HQ, D]."""
    P = Paged([L], seed=L)
    q = torch.randn(L, HQ, D, device="cuda", dtype=DT)
    kc, vc = P.k[0].transpose(0, 1)[None], P.v[0].transpose(0, 1)[None]  # [1, HKV, L, D]
    qs = q.transpose(0, 1)[None]
    sdpa = lambda: F.scaled_dot_product_attention(qs, kc, vc, is_causal=True, enable_gqa=True)  # noqa: E731
    ref = sdpa()[0].transpose(0, 1)
    qkv = torch.zeros(L, (HQ + 2 * HKV) * D, device="cuda", dtype=DT)
    qkv[:, :HQ * D] = q.reshape(L, -1)
    call = P.k25([L])
    row["k25_err"] = rel(call.run(qkv).view(L, HQ, D), ref)
    kernels = {"sdpa": sdpa, "k25": lambda: call.run(qkv)}
    if fi is not None:
        try:
            ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
            w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            indptr, indices, last = P.flashinfer_args()
            qo = torch.tensor([0, L], dtype=torch.int32, device="cuda")
            w.plan(qo, indptr, indices, last, HQ, HKV, D, PAGE, causal=True, q_data_type=DT, kv_data_type=DT)
            row["flashinfer_err"] = rel(w.run(q, P.fi_kv), ref)
            kernels["flashinfer"] = lambda: w.run(q, P.fi_kv)
        except Exception as e:
            row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:300]
    return kernels, call, qkv, ref


def prefill_case(L, fi, results):
    flops = 2 * HQ * D * L * L  # QK and PV over the causal half: 2 * (2 * HQ * D * L^2 / 2)
    row = {"case": f"prefill causal L{L}", "TFLOP": round(flops / 1e12, 3)}
    kernels, call, qkv, ref = prefill_kernels(L, fi, row)
    # Every kernel from the same state (burst_and_sustained): "_TFLOPs" a short run's figure,
    # "_sustained_TFLOPs" the settled one.
    for name, (burst, settled) in burst_and_sustained(kernels).items():
        row[f"{name}_TFLOPs"] = flops / 1e12 / (burst / 1e3)
        row[f"{name}_sustained_TFLOPs"] = flops / 1e12 / (settled / 1e3)
    # The mma.sync kernel (forced), next to the one the device takes (wgmma on Hopper).
    os.environ["K25_PREFILL_ATTENTION"] = "mma"
    try:
        row["k25_mma_err"] = rel(call.run(qkv).view(L, HQ, D), ref)
        row["k25_mma_TFLOPs"] = flops / 1e12 / (time_ms(lambda: call.run(qkv), iters=3, warmup=1) / 1e3)
    finally:
        del os.environ["K25_PREFILL_ATTENTION"]
    for form in ("", "_sustained"):
        best = max(row[f"sdpa{form}_TFLOPs"], row.get(f"flashinfer{form}_TFLOPs", 0.0))
        row[f"k25_vs_best{form}"] = row[f"k25{form}_TFLOPs"] / best
    results.append(row)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--skip-flashinfer", action="store_true")
    ap.add_argument("--prefill-len", type=int, default=16384)
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--decode-cases", default="8x32768,32x8192,1x32768,1x1024,8x1024,1x32768+7x2048",
                    help="BxL, or a mixed batch B1xL1+B2xL2 (compared with FlashInfer only)")
    args = ap.parse_args()
    fi = None
    if not args.skip_flashinfer:
        try:
            import flashinfer as fi  # noqa: F811
        except Exception as e:  # the peer is optional: report and go on without it
            print(f"flashinfer unavailable: {type(e).__name__}: {e}")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "flashinfer",
          getattr(fi, "__version__", None) if fi else None, flush=True)
    results = []
    for c in [] if args.prefill_only else args.decode_cases.split(","):
        try:
            decode_case(batch_lengths(c), fi, results)
        except Exception as e:
            print(f"decode {c} failed: {type(e).__name__}: {e}", flush=True)
            results.append({"case": f"decode {c}", "error": str(e)})
    try:
        if not args.decode_only:
            prefill_case(args.prefill_len, fi, results)
    except Exception as e:
        print(f"prefill failed: {type(e).__name__}: {e}", flush=True)
        results.append({"case": "prefill", "error": str(e)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
