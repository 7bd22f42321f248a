"""GPU model benchmark: decode and prefill throughput of a Llama-3.1-8B-shape model with
random bf16 weights (real checkpoint layout, written here), next to the physical floor
(weight + KV bytes over the measured device-to-device copy bandwidth).

    python3 bench/gpu/model_bench.py [--layers 32] [--json out.json]
"""
import argparse
import json
import os
import time

import torch


def copy_bandwidth():
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        y.copy_(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / n
    del x, y
    return 2 * (2 << 30) / dt  # bytes read + written per second


def write_checkpoint(path, layers):
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg.architectures = ["LlamaForCausalLM"]
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    from safetensors.torch import save_file
    H, I, V, D = 4096, 14336, 128256, 128
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) * scale).cpu()

    shard, n_shard, index = {}, 0, {}

    def flush():
        nonlocal shard, n_shard
        if shard:
            name = f"model-{n_shard:05d}.safetensors"
            save_file(shard, os.path.join(path, name))
            for k in shard:
                index[k] = name
            shard, n_shard = {}, n_shard + 1

    shard["model.embed_tokens.weight"] = rnd(V, H)
    shard["lm_head.weight"] = rnd(V, H)
    shard["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    flush()
    for i in range(layers):
        p = f"model.layers.{i}."
        shard[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        shard[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        shard[p + "self_attn.q_proj.weight"] = rnd(32 * D, H)
        shard[p + "self_attn.k_proj.weight"] = rnd(8 * D, H)
        shard[p + "self_attn.v_proj.weight"] = rnd(8 * D, H)
        shard[p + "self_attn.o_proj.weight"] = rnd(H, 32 * D)
        shard[p + "mlp.gate_proj.weight"] = rnd(I, H)
        shard[p + "mlp.up_proj.weight"] = rnd(I, H)
        shard[p + "mlp.down_proj.weight"] = rnd(H, I)
        if i % 4 == 3:
            flush()
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)


def decode_rate(model, batch, ctx, new_tokens, steady=None, **sampling):
    """Decode tok/s of `batch` prompts of `ctx` tokens: (N new tokens - 1) per sequence over
    the time of an N-token request minus that of a 1-token one. With steady (a dict), also
    the steady-state rate from an N-token and an N/4-token request (no first or last step
    in it) and the engine's own step time (stats: busy time / steps) of the N-token run."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, 100000, (ctx,), generator=g).tolist() for _ in range(batch)]
    kw = sampling or dict(temperature=0.0)

    def timed(n):
        t = time.perf_counter()
        outs = model.generate(prompts, max_new_tokens=n, ignore_eos=True, **kw)
        return time.perf_counter() - t, outs

    model.generate(prompts, max_new_tokens=1, temperature=0.0)  # warm-up, and prefill time
    t_prefill, _ = timed(1)
    s0 = model.stats()
    total, outs = timed(new_tokens)
    s1 = model.stats()
    n = sum(len(o.token_ids) - 1 for o in outs)
    if steady is not None:
        short = max(2, new_tokens // 4)
        t_short, _ = timed(short)
        steady["steady_tok_s"] = batch * (new_tokens - short) / (total - t_short)
        steps = s1["steps"] - s0["steps"]
        steady["engine_ms_per_step"] = 1e3 * (s1["busy_time_s"] - s0["busy_time_s"]) / max(1, steps)
        steady["pipelined_steps"] = s1.get("pipelined_steps", 0) - s0.get("pipelined_steps", 0)
        steady["steps"] = steps
    return n / (total - t_prefill), total - t_prefill


def prefill_rate(model, n=4096, reps=3):
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(10, 100000, (n,), generator=g).tolist()
    model.generate([prompt], max_new_tokens=1, temperature=0.0)
    t = time.perf_counter()
    for _ in range(reps):
        model.generate([prompt], max_new_tokens=1, temperature=0.0)
    return n * reps / (time.perf_counter() - t)


def transformers_reference(path, batches, ctx, new_tokens, prefill_tokens=4096):
    """The same checkpoint through Hugging Face transformers (bf16, sdpa): decode tok/s by
    generate() (time of N new tokens minus the time of 1, i.e. without the prefill) and one
    forward of a 4K prompt (logits of the last row only)."""
    from transformers import AutoModelForCausalLM
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.cuda().eval()
    out = {"decode": {}}
    g = torch.Generator().manual_seed(7)

    def gen(ids, n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.no_grad():
        for b in batches:
            ids = torch.randint(10, 100000, (b, ctx), generator=g).cuda()
            gen(ids, 2)  # warm-up
            t1 = gen(ids, 1)
            tn = gen(ids, new_tokens)
            rate = b * (new_tokens - 1) / (tn - t1)
            out["decode"][b] = rate
            print(f"transformers decode batch {b:4d} @1K: {rate:9.1f} tok/s", flush=True)
        ids = torch.randint(10, 100000, (1, prefill_tokens), generator=g).cuda()
        for _ in range(2):
            hf(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            hf(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        out["prefill_4k_tok_s"] = 3 * prefill_tokens / (time.perf_counter() - t)
        print(f"transformers prefill 4K: {out['prefill_4k_tok_s']:9.1f} tok/s", flush=True)
    del hf
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--path", default="/tmp/llama8b-random")
    ap.add_argument("--json")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers and the unfused path")
    args = ap.parse_args()
    res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name()}
    bw = copy_bandwidth()
    res["copy_TBps"] = bw / 1e12
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    t = time.perf_counter()
    if not os.path.exists(os.path.join(args.path, "config.json")):
        write_checkpoint(args.path, args.layers)
    res["write_s"] = time.perf_counter() - t
    from k25 import K25Config, K25Model
    t = time.perf_counter()
    m = K25Model(K25Config(model_path=args.path, device="cuda", dtype="bfloat16", max_seq_len=8192,
                           max_batch_size=128, max_num_batched_tokens=8192, prefill_chunk_size=4096))
    res["load_s"] = time.perf_counter() - t
    s = m.stats()
    wbytes = s["weight_bytes"]
    res["weight_GB"] = wbytes / 1e9
    print(f"loaded {wbytes / 1e9:.2f} GB of weights in {res['load_s']:.1f} s; KV pool {s['kv_cache_bytes'] / 1e9:.1f} GB",
          flush=True)
    kv_per_token = m.kv_block_bytes / m.engine_config.block_size
    res["decode"] = {}
    for b in [int(x) for x in args.batches.split(",")]:
        extra = {}
        rate, dt = decode_rate(m, b, 1024, args.new_tokens, steady=extra)
        # Floor (the definition): every step reads the weights and each sequence's KV
        # once, at the measured copy bandwidth (bytes read + written per second).
        step_bytes = wbytes + b * (1024 + args.new_tokens / 2) * kv_per_token
        floor_rate = b / (step_bytes / bw)
        res["decode"][b] = {"tok_s": rate, "floor_tok_s": floor_rate, "frac_of_floor": rate / floor_rate, **extra}
        print(f"decode batch {b:4d} @1K: {rate:9.1f} tok/s   floor {floor_rate:9.1f} tok/s   "
              f"{100 * rate / floor_rate:5.1f}% of floor   steady {extra['steady_tok_s']:9.1f} tok/s "
              f"({100 * extra['steady_tok_s'] / floor_rate:5.1f}%)   engine {extra['engine_ms_per_step']:.2f} ms/step, "
              f"{extra['pipelined_steps']}/{extra['steps']} steps pipelined", flush=True)
    # Sampled decode (temperature, top-p, a repetition penalty: the device sampler) next
    # to greedy (device argmax) at the same batch sizes.
    res["decode_sampled"] = {}
    # Without a penalty the sampled steps are pipelined too; a repetition penalty reads the
    # token history, so those steps wait for the one in flight.
    res["decode_sampled_no_penalty"] = {}
    for b in [int(x) for x in args.batches.split(",")][:3]:
        rate, _ = decode_rate(m, b, 1024, args.new_tokens, temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=1)
        res["decode_sampled"][b] = {"tok_s": rate, "vs_greedy": rate / res["decode"][b]["tok_s"]}
        print(f"decode batch {b:4d} @1K sampled (T 0.8, top-p 0.9, repetition 1.1): {rate:9.1f} tok/s "
              f"= {rate / res['decode'][b]['tok_s']:.3f} x greedy", flush=True)
        rate, _ = decode_rate(m, b, 1024, args.new_tokens, temperature=0.8, top_p=0.9, seed=1)
        res["decode_sampled_no_penalty"][b] = {"tok_s": rate, "vs_greedy": rate / res["decode"][b]["tok_s"]}
        print(f"decode batch {b:4d} @1K sampled (T 0.8, top-p 0.9): {rate:9.1f} tok/s "
              f"= {rate / res['decode'][b]['tok_s']:.3f} x greedy", flush=True)
    res["prefill_4k_tok_s"] = prefill_rate(m)
    print(f"prefill 4K: {res['prefill_4k_tok_s']:9.1f} tok/s", flush=True)
    m.close()
    del m
    torch.cuda.empty_cache()
    if not args.no_reference:
        # Fused vs unfused (enable_kernel_fusion=False: separate RoPE, cache write, norms,
        # activation, attention through plain ops; eager). Per decoder layer = step time /
        # layers: the LM head and sampling are the same in both, so the difference is the
        # layers'.
        cfg = dict(model_path=args.path, device="cuda", dtype="bfloat16", max_seq_len=8192, max_batch_size=128,
                   max_num_batched_tokens=8192, prefill_chunk_size=4096)
        res["fusion"] = {}
        for fused in (True, False):
            os.environ["K25_DISABLE_CUDA_GRAPHS"] = "1"  # both eager: the fusion alone differs
            mf = K25Model(K25Config(enable_kernel_fusion=fused, **cfg))
            os.environ.pop("K25_DISABLE_CUDA_GRAPHS")
            r = {}
            for b in (1, 32):
                rate, _ = decode_rate(mf, b, 1024, 32)
                r[f"decode_b{b}_layer_us"] = 1e6 * b / rate / args.layers
            r["prefill_4k_layer_us"] = 1e6 * 4096 / prefill_rate(mf, reps=2) / args.layers
            res["fusion"]["fused" if fused else "unfused"] = r
            mf.close()
            del mf
            torch.cuda.empty_cache()
        f, u = res["fusion"]["fused"], res["fusion"]["unfused"]
        for k in f:
            print(f"per decoder layer ({k[:-9]}, eager): fused {f[k]:8.1f} us   unfused {u[k]:8.1f} us   "
                  f"unfused / fused {u[k] / f[k]:.2f}", flush=True)
        res["transformers"] = transformers_reference(args.path, [1, 32], 1024, 32)
        hf = res["transformers"]
        for b in (1, 32):
            if b in res["decode"]:
                print(f"k25 / transformers decode batch {b}: {res['decode'][b]['tok_s'] / hf['decode'][b]:.1f}x",
                      flush=True)
        print(f"k25 / transformers prefill 4K: {res['prefill_4k_tok_s'] / hf['prefill_4k_tok_s']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
