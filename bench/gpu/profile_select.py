"""Where the device block selection's time goes: per-kernel GPU times (torch.profiler) of
one selection, 8B attention shape, at B1 @ 8K, B1 @ 32K, B8 @ 32K and B8 @ 128K (or the
cases given as BxL arguments). Diagnostic, not a benchmark. --plain B L runs three
selections of one case without the profiler, for Nsight Compute. The selection's launches use
programmatic dependent launch: a kernel starts before the one ahead of it ends and waits
inside its own duration, so per-kernel times include that wait (count_kernel's 18 us at B8 @ 128K
is 7.6 us alone); K25_PDL=0 gives each kernel's time alone. On sm_90 the last three steps are one
launch (choose_kernel); K25_SPARSE_FUSED=0 shows the three kernels instead:

    python3 bench/gpu/profile_select.py [--brief] [--codes] [--hq=N] [BxL ...]   (--brief: one line a
        case; --codes: the key-code estimate, sparsity_score_rule="codes", instead of the bound;
        --hq=N: N query heads over the 8 KV heads instead of 32, e.g. 64 for groups of 8 as
        Llama-3-70B's; a case may mix lengths: 1x131072+7x2048)
    ncu --metrics gpu__time_duration.sum --kernel-name regex:"score|bin|count|table" \
        --launch-skip 4 --launch-count 4 python3 bench/gpu/profile_select.py --plain 1 32768
"""
import math
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from attention_bench import batch_label, batch_lengths
from k25 import _C

cu = _C.cuda_ops
HQ, HKV, D, PAGE = 32, 8, 128, 16


def kernel_times(prof, n):
    """One line of the selection's kernels and their mean device time per selection (us)."""
    out = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None)
        if total is None:
            total = e.cuda_time_total
        name = re.search(r"\w+_kernel", e.key)
        if total > 0 and name:
            out.append((total / n, name.group(0)))
    return ", ".join(f"{name} {t:.1f}" for t, name in sorted(out, reverse=True))


def main():
    global HQ
    args = sys.argv[1:]
    for a in [a for a in args if a.startswith("--hq=")]:
        HQ = int(a[len("--hq="):])
        args.remove(a)
    brief = "--brief" in args
    codes = "--codes" in args
    args = [a for a in args if a not in ("--brief", "--codes")]
    plain = len(args) == 3 and args[0] == "--plain"

    if plain:
        cases = [[int(args[2])] * int(args[1])]
    else:
        cases = [batch_lengths(c) for c in args] or [[8192], [32768], [32768] * 8, [131072] * 8]
    for lengths in cases:
        B = len(lengths)
        label = batch_label(lengths) + (f" (Hq {HQ})" if HQ != 32 else "")
        layout = (1, HKV, D, PAGE)
        nbs = [n // PAGE for n in lengths]
        nb = max(nbs)
        kv = torch.randn((sum(nbs) + 1) * 2 * HKV * PAGE * D, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(sum(nbs), dtype=torch.int32)
        tables = torch.full((B, nb), -1, dtype=torch.int32)
        for b, o in enumerate([sum(nbs[:i]) for i in range(B)]):
            tables[b, :nbs[b]] = perm[o:o + nbs[b]]
        q = torch.randn(B, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
        cl = torch.tensor(lengths, dtype=torch.int32)
        call = cu.AttentionCall(kv, layout, 0, torch.arange(B + 1, dtype=torch.int32), cl, tables, HQ,
                                1 / math.sqrt(D), 0, 264, 1)
        summ = cu.make_block_summaries(sum(nbs) + 1, layout, kv, key_codes=codes)
        cu.AttentionCall(kv, layout, 0, torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                         cl, tables, HQ, 1.0, 0, 264, 0).update_summaries(summ, key_codes=codes)
        stats = torch.zeros(1, 4, dtype=torch.float64, device="cuda")
        p = dict(min_context=2048, sink_blocks=1, recent_blocks=16, min_ratio=0.1, max_ratio=0.6, mass_target=0.95)
        for _ in range(3):
            call.select(q, summ, stats, key_codes=codes, **p)
        torch.cuda.synchronize()
        if plain:
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call.select(q, summ, stats, key_codes=codes, **p)
            torch.cuda.synchronize()
        if brief:
            print(f"{label}, us per selection: {kernel_times(prof, 10)}")
            continue
        print(f"{label}, 10 selections:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
