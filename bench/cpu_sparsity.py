"""Dynamic block sparsity on the CPU: accuracy and decode speed, sparse against dense in
the same run, on the default model and real English text (pydoc_data).

    python bench/cpu_sparsity.py [--contexts 4096,8192] [--docs 3] [--decoded 128]
                                 [--caps 0.6,0.8] [--threads 2] [--compensation off|on|both]
                                 [--mass-targets 0.95,0.99] [--intervals 1,2] [--device cpu|cuda] [--dtype D]
                                 [--topics path/to/pydoc_data/topics.py] [--accuracy-only]
                                 [--reference-dtype float32] [--json out.json]

For each context length, --docs windows of the text are scored teacher-forced: the first
ctx - decoded positions in prompt chunks (dense), the last `decoded` positions one token
per step (decode steps: sparse when on). Reports perplexity of those positions, top-1
agreement of sparse with dense, the sparsity reached, and decode-step time ratios.
--device cuda runs the same windows through the CUDA backend (bfloat16 unless --dtype): the
accuracy of the GPU's rule (the Quest bound on 4-bit summaries) on the CPU's yardstick; its
decode-time ratio there is one sequence of a small model, not the speed benchmark
(bench/gpu/sparse_model_bench.py is).
--reference-dtype D also scores the windows densely in dtype D (e.g. float32) and reports the
top-1 agreement of the dense run and of each sparse run with it: how much of the sparse-vs-dense
disagreement the compute dtype's rounding alone gives (near-ties of the top-2 logits flip).
"""
import argparse
import json
import time

import numpy as np


def text_ids(model, topics_path=None):
    """The pydoc topics of this Python, or of the pydoc_data/topics.py at topics_path: the text
    changes between Python versions, so windows compare across machines only from one file."""
    if topics_path:
        import importlib.util
        spec = importlib.util.spec_from_file_location("k25_pydoc_topics", topics_path)
        topics = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(topics)
    else:
        from pydoc_data import topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return model.tokenize([text])[0]


def nll(logits, ids, n):
    lg = logits[-n - 1:-1].astype(np.float64)
    tgt = np.asarray(ids[-n:])
    mx = lg.max(1, keepdims=True)
    lse = np.log(np.exp(lg - mx).sum(1)) + mx[:, 0]
    return lse - lg[np.arange(n), tgt]


def windows_nll(outs, docs, n):
    """The per-token negative log-likelihoods of one run over the n scored positions of every window."""
    return np.concatenate([nll(o, d, n) for o, d in zip(outs, docs)])


def agreement(a, b, n):
    """Top-1 agreement of two runs' logits over the n scored positions of every window."""
    return float(np.mean(np.concatenate([x[-n - 1:-1].argmax(1) == y[-n - 1:-1].argmax(1) for x, y in zip(a, b)])))


def run(cfg_kw, docs, decoded, timed=True):
    from k25 import K25Config, K25Model
    m = K25Model(K25Config(**cfg_kw))
    outs, decode_s = [], 0.0
    for ids in docs:
        # The prompt-chunk part of the scored run alone (the same ctx - decoded positions), the
        # faster of two: the decode steps' time is the difference, so a longer prefix here (it
        # used to be all ctx positions) or one slow pass biases it by a whole decode's worth.
        t_prefill = float("inf")
        for _ in range(2 if timed else 0):
            t = time.perf_counter()
            m.score(ids[:len(ids) - decoded])
            t_prefill = min(t_prefill, time.perf_counter() - t)
        t = time.perf_counter()
        # Only the rows the scores read (the last decoded + 1), copied: a view would keep the
        # whole [ctx, vocab] array alive (8 windows at 8K held ~25 GB and were killed).
        outs.append(np.array(m.score(ids, decode_from=len(ids) - decoded)[-decoded - 1:]))
        decode_s += max(0.0, time.perf_counter() - t - t_prefill) if timed else 0.0
    ratio = m.get_current_sparsity_ratio()
    layers = m.stats()["sparsity_layers"]
    m.close()
    return outs, decode_s, ratio, layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,8192")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--decoded", type=int, default=128)
    ap.add_argument("--caps", default="0.6,0.8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mass-targets", default="0.95", help="sparsity_mass_target values to run (comma list)")
    ap.add_argument("--intervals", default="1", help="sparsity_selection_interval values to run (comma list)")
    ap.add_argument("--compensation", default="off", choices=["off", "on", "both"],
                    help="sparsity_compensation for the sparse runs (both: each cap twice)")
    ap.add_argument("--score-channels", type=int, default=None,
                    help="sparsity_score_channels for the sparse runs (0: the Quest bound ranks, CUDA's rule; "
                         "default: the engine's, 8 on the CPU)")
    ap.add_argument("--score-rule", default=None, choices=["channels", "codes", "bound"],
                    help="sparsity_score_rule for the sparse runs (default: the engine's, from --score-channels)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the same windows through the CUDA kernels (the bound rule, 4-bit summaries)")
    ap.add_argument("--dtype", default=None, help="the model's compute dtype (default: the device's: "
                    "float32 on the CPU, bfloat16 on CUDA)")
    ap.add_argument("--topics", help="a pydoc_data/topics.py to take the text from (default: this Python's); "
                    "the text differs between Python versions (the GPU machine runs 3.12, this box 3.11)")
    ap.add_argument("--accuracy-only", action="store_true",
                    help="no decode timing (skips the two prompt-only passes a window that time it: ~3x faster)")
    ap.add_argument("--reference-dtype", help="also score densely in this dtype and report each run's top-1 "
                    "agreement with it (the rounding noise floor of the compute dtype)")
    ap.add_argument("--json")
    args = ap.parse_args()
    timed = not args.accuracy_only
    base = dict(device=args.device, max_seq_len=8192, prefill_chunk_size=1024, max_num_batched_tokens=2048)
    if args.device == "cpu":
        base["num_threads"] = args.threads
    else:  # an explicit pool, as tests/cuda does
        base["kv_cache_bytes"] = 1 << 30
    if args.dtype or args.device == "cuda":
        base["dtype"] = args.dtype or "bfloat16"
    from k25 import K25Config, K25Model
    probe = K25Model(K25Config(**base))
    all_ids = text_ids(probe, args.topics)
    probe.close()
    results = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        stride = (len(all_ids) - ctx) // max(1, args.docs)
        docs = [all_ids[i * stride:i * stride + ctx] for i in range(args.docs)]
        dense, dense_s, _, _ = run(base, docs, args.decoded, timed)
        d_nll = windows_nll(dense, docs, args.decoded)
        ref = None
        if args.reference_dtype:
            ref, _, _, _ = run(dict(base, dtype=args.reference_dtype), docs, args.decoded, False)
            r_nll = windows_nll(ref, docs, args.decoded)
            print(f"ctx {ctx} dense {base.get('dtype', 'float32')} against dense {args.reference_dtype}: top-1 agreement "
                  f"{agreement(dense, ref, args.decoded):.4f}, ppl {float(np.exp(r_nll.mean())):.3f} -> {float(np.exp(d_nll.mean())):.3f}",
                  flush=True)
        comps = {"off": [False], "on": [True], "both": [False, True]}[args.compensation]
        targets = [float(t) for t in args.mass_targets.split(",")]
        intervals = [int(n) for n in args.intervals.split(",")]
        for cap, comp, mt, every in [(float(c), comp, mt, n) for c in args.caps.split(",") for comp in comps
                                     for mt in targets for n in intervals]:
            sparse, sparse_s, ratio, layers = run(dict(base, enable_dynamic_sparsity=True, max_sparsity_ratio=cap,
                                                       sparsity_compensation=comp, sparsity_mass_target=mt,
                                                       sparsity_score_channels=args.score_channels,
                                                       sparsity_score_rule=args.score_rule,
                                                       sparsity_selection_interval=every),
                                                  docs, args.decoded, timed)
            s_nll = windows_nll(sparse, docs, args.decoded)
            agree = agreement(sparse, dense, args.decoded)
            row = {"context": ctx, "cap": cap, "compensation": comp, "mass_target": mt, "selection_interval": every,
                   "score_channels": args.score_channels, "score_rule": args.score_rule, "tokens": int(d_nll.size), "sparsity": ratio,
                   "ppl_dense": float(np.exp(d_nll.mean())), "ppl_sparse": float(np.exp(s_nll.mean())),
                   "ppl_ratio": float(np.exp(s_nll.mean() - d_nll.mean())), "top1_agreement": agree,
                   "decode_s_dense": dense_s, "decode_s_sparse": sparse_s,
                   "decode_speedup": dense_s / sparse_s if sparse_s > 0 else None,
                   "layer_ratios": [round(l["ratio"], 3) for l in layers]}
            if ref is not None:
                row["reference_dtype"] = args.reference_dtype
                row["top1_agreement_dense_vs_reference"] = agreement(dense, ref, args.decoded)
                row["top1_agreement_sparse_vs_reference"] = agreement(sparse, ref, args.decoded)
            results.append(row)
            print(f"ctx {ctx} cap {cap} mass {mt}{' +comp' if comp else ''}"
                  f"{f' every {every} steps' if every > 1 else ''}: sparsity {ratio:.3f}  ppl {row['ppl_dense']:.3f} -> {row['ppl_sparse']:.3f} "
                  f"({100 * (row['ppl_ratio'] - 1):+.2f}%)  top-1 agreement {agree:.4f} over {d_nll.size} tokens  "
                  f"decode steps {dense_s:.2f} s dense, {sparse_s:.2f} s sparse "
                  f"({'%.2fx' % row['decode_speedup'] if row['decode_speedup'] else 'not timed' + ('' if not timed else ': shorter than the prefill pass it subtracts')})"
                  + (f"; against {args.reference_dtype} dense: sparse {row['top1_agreement_sparse_vs_reference']:.4f}, "
                     f"dense {row['top1_agreement_dense_vs_reference']:.4f}" if ref is not None else ""),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
