"""Where a decode step's GPU time goes: torch.profiler over a few decode steps of the
Llama-3.1-8B shape (fewer layers, same per-layer shapes), graphs off so kernels show.

    K25_DISABLE_CUDA_GRAPHS=1 python3 bench/gpu/profile_decode.py --layers 4 --batch 1
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from model_bench import write_checkpoint  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = f"/tmp/llama8b-{args.layers}l"
    if not os.path.exists(os.path.join(path, "config.json")):
        write_checkpoint(path, args.layers)
    from k25 import K25Config, K25Model
    m = K25Model(K25Config(model_path=path, device="cuda", dtype="bfloat16", kv_cache_bytes=8 << 30,
                           max_seq_len=4096))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 100000, (args.ctx,), generator=g).tolist() for _ in range(args.batch)]
    m.generate(prompts, max_new_tokens=4, temperature=0.0, ignore_eos=True)
    from torch.profiler import ProfilerActivity, profile
    tables = []
    for new in (1, 65):  # prefill alone, then prefill + 64 decode steps: the difference is decode
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            m.generate(prompts, max_new_tokens=new, temperature=0.0, ignore_eos=True)
        tables.append(f"== max_new_tokens={new}\n" + prof.key_averages().table(sort_by="cuda_time_total",
                                                                              row_limit=22, max_name_column_width=70))
    print("\n".join(tables))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(tables))
    m.close()


if __name__ == "__main__":
    main()
