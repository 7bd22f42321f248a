"""Decode tok/s of the 8B shape at small batches under launch settings, in one process:
k25's GEMV with programmatic dependent launch (the default), the GEMV without it
(K25_PDL=0), and cuBLAS without it (K25_GEMV=0 K25_PDL=0, the earlier path). Each setting
gets its own model (graphs are captured at load with the settings of that moment); the
settings run in order, then again in reverse, so drift shows as disagreement.

    python3 bench/gpu/decode_ab.py [--batches 1,2] [--json out.json]
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from model_bench import copy_bandwidth, decode_rate, write_checkpoint  # noqa: E402

SETTINGS = [
    ("gemv + pdl", {}),
    ("gemv", {"K25_PDL": "0"}),
    ("cublas", {"K25_GEMV": "0", "K25_PDL": "0"}),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", default="/tmp/llama8b-random")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.path, "config.json")):
        write_checkpoint(args.path, args.layers)
    from k25 import K25Config, K25Model
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    out = []
    for name, env in SETTINGS + SETTINGS[::-1]:
        for k in ("K25_PDL", "K25_GEMV"):
            os.environ.pop(k, None)
        os.environ.update(env)
        m = K25Model(K25Config(model_path=args.path, device="cuda", dtype="bfloat16", max_seq_len=8192,
                               max_batch_size=8))
        wbytes = m.stats()["weight_bytes"]
        kv_per_token = m.kv_block_bytes / m.engine_config.block_size
        for b in [int(x) for x in args.batches.split(",")]:
            extra = {}
            rate, _ = decode_rate(m, b, 1024, args.new_tokens, steady=extra)
            floor = b / ((wbytes + b * (1024 + args.new_tokens / 2) * kv_per_token) / bw)
            row = dict(setting=name, batch=b, tok_s=rate, floor_tok_s=floor, **extra)
            out.append(row)
            print(f"{name:11s} batch {b}: {rate:8.1f} tok/s ({100 * rate / floor:5.1f}% of floor)   steady "
                  f"{extra['steady_tok_s']:8.1f}   engine {extra['engine_ms_per_step']:.3f} ms/step", flush=True)
        m.close()
        del m
        torch.cuda.empty_cache()
    for k in ("K25_PDL", "K25_GEMV"):
        os.environ.pop(k, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), copy_TBps=bw / 1e12, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
