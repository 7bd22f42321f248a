"""CPU prefill/decode throughput of k25 next to Hugging Face transformers, same run.

    python bench/cpu_generate.py [--threads 2] [--prompt-tokens 512] [--new-tokens 128] [--batch 1]

Both engines run the default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantised to
float32) on the same prompt token ids, greedy, each in its own child process so that
load time and peak RSS are its own. Prints one line per engine and the k25/transformers
ratios; --json writes the figures for bench/RESULTS.md. With --batch B the decode rate is that
of B sequences decoding together (B windows of the same text, each --prompt-tokens long, so
transformers needs no padding), in tokens per second summed over the batch; prefill stays
one prompt. k25 then decodes with prefix caching on (the prompts' KV is served from the
cache, so the variance of four prefills does not swamp the decode time); transformers
prefills every repeat, and its figure is the median of --repeats.
"""
import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time


def prompt_ids(tokenizer_encode, n, batch=1):
    """`batch` windows of n tokens of real English text (the Python docs shipped with the
    standard library), one after the other."""
    from pydoc_data import topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tokenizer_encode(text[:200000 * batch])
    if len(ids) < n * batch:
        raise SystemExit("not enough text for the prompts")
    return [ids[i * n:(i + 1) * n] for i in range(batch)]


def run_k25(args, q):
    t0 = time.perf_counter()
    from k25 import K25Config, K25Model
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = K25Model(K25Config(num_threads=args.threads, kv_cache_bytes=1 << 30))
    load = time.perf_counter() - t0
    prompts = prompt_ids(lambda s: model.tokenize(s), args.prompt_tokens, args.batch)
    ids = prompts[0]
    model.generate([ids[:32]], max_new_tokens=4, temperature=0.0)  # warm-up
    prefill, decode = [], []
    tokens = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        model.generate([ids], max_new_tokens=1, temperature=0.0)
        prefill.append(args.prompt_tokens / (time.perf_counter() - t0))
    if args.batch > 1:
        # B prompts' prefills vary by more than their decode steps take: a second engine with
        # prefix caching serves the prompts from its cache after the first call, so the time
        # after the first token is the decode steps'.
        model.close()
        model = K25Model(K25Config(num_threads=args.threads, kv_cache_bytes=1 << 30, enable_prefix_caching=True))
        model.generate(prompts, max_new_tokens=1, temperature=0.0)
    for _ in range(args.repeats):
        # Decode rate: tokens after the first, over the time after the first token
        # (the same method as for transformers below).
        t0 = time.perf_counter()
        model.generate(prompts, max_new_tokens=1, temperature=0.0)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = model.generate(prompts, max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        total = time.perf_counter() - t0
        tokens = [o.token_ids for o in outs]
        decode.append(args.batch * (args.new_tokens - 1) / (total - t_first))
    model.close()
    q.put(dict(engine="k25", import_s=t_import, load_s=load, prefill_tok_s=statistics.median(prefill),
               decode_tok_s=statistics.median(decode), peak_rss_mb=peak_rss_mb(), tokens=tokens,
               prompts=prompts))


def run_hf(args, prompts, q):
    import torch
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from k25.model import resolve_model_path
    path = resolve_model_path(None)
    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    m.eval()
    load = time.perf_counter() - t0
    ids = prompts[0]
    x = torch.tensor([ids])
    xb = torch.tensor(prompts)
    prefill, decode = [], []
    tokens = None
    with torch.no_grad():
        m.generate(x[:, :32], max_new_tokens=4, do_sample=False)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            m(x, logits_to_keep=1)
            prefill.append(len(ids) / (time.perf_counter() - t0))
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            m.generate(xb, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = m.generate(xb, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             do_sample=False)
            total = time.perf_counter() - t0
            tokens = out[:, len(ids):].tolist()
            decode.append(args.batch * (args.new_tokens - 1) / (total - t_first))
    q.put(dict(engine="transformers", load_s=load, prefill_tok_s=statistics.median(prefill),
               decode_tok_s=statistics.median(decode), peak_rss_mb=peak_rss_mb(), tokens=tokens))


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(target, *a):
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=target, args=(*a, q))
    p.start()
    r = q.get()
    p.join()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    k = child(run_k25, args)
    rows = [k]
    if not args.skip_hf:
        h = child(run_hf, args, k["prompts"])
        rows.append(h)
    for r in rows:
        print(f"{r['engine']:>13}: prefill {r['prefill_tok_s']:8.1f} tok/s   decode {r['decode_tok_s']:6.1f} tok/s"
              f"   load {r['load_s']:5.2f} s   peak RSS {r['peak_rss_mb']:7.0f} MB")
    if not args.skip_hf:
        pairs = [(a, b) for ka, ha in zip(k["tokens"], h["tokens"]) for a, b in zip(ka, ha)]
        same = sum(1 for a, b in pairs if a == b)
        first_diff = next((i for i, (a, b) in enumerate(zip(k["tokens"][0], h["tokens"][0])) if a != b), None)
        print(f"ratio k25/transformers: prefill {k['prefill_tok_s'] / h['prefill_tok_s']:.2f}x   "
              f"decode {k['decode_tok_s'] / h['decode_tok_s']:.2f}x   load {h['load_s'] / k['load_s']:.1f}x faster")
        print(f"greedy tokens equal: {same}/{len(pairs)} (first sequence's first difference at {first_diff})")
    if args.json:
        for r in rows:
            r.pop("tokens", None)
            r.pop("prompts", None)
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=rows, date=time.strftime("%Y-%m-%d")), f, indent=1)


if __name__ == "__main__":
    main()
