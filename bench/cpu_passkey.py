"""Pass-key retrieval on the CPU: dense against dynamic block sparsity (issue #5).

    python bench/cpu_passkey.py [--contexts 2500,4500,6800] [--depths 0.1,0.5,0.9]
                                [--caps 0.6,0.8] [--score-rule channels|codes|bound] [--intervals 1,2]
                                [--threads 2] [--seed 0] [--json out.json]

A random 5-digit key is planted at each depth of a filler context of about each length, and
the prompt ends by asking for it (format below, see docs/sparsity.md "Retrieval"). The default
model answers greedily, first dense, then with sparsity on at each cap. Prefill is dense in
every run (so the answer's first token is too); the following tokens are decode steps of a
sequence longer than sparsity_min_context, which are sparse. A case is right when the planted
key begins the answer. Reports per case the answers, and per run the accuracy, the agreement
with dense (same answer text) and the sparsity reached.
"""
import argparse
import json
import random
import time

# The filler and the key line. The key line avoids "... is the pass key" and the prompt asks
# for nothing but "The pass key is": otherwise the model tends to continue that phrase from
# the question or from a restatement instead of from the key line.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. The pass key is {key}."
QUESTION = " The pass key is"
MAX_NEW_TOKENS = 8


def passkey_prompt(tokenizer, context, depth, key):
    """Token ids of about `context` tokens (never more): FILLER repeated, NEEDLE after the
    fraction `depth` of the repetitions, then QUESTION."""
    def ids_of(before, after):
        parts = [FILLER] * before + [NEEDLE.format(key=key)] + [FILLER] * after
        return tokenizer.encode(" ".join(parts) + QUESTION)
    base = len(ids_of(0, 0))
    per = len(ids_of(1, 0)) - base
    n = max(0, (context - base) // per)
    before = round(depth * n)
    return ids_of(before, n - before)


def cases(tokenizer, contexts, depths, seed):
    rng = random.Random(seed)
    out = []
    for ctx in contexts:
        for depth in depths:
            key = str(rng.randint(10000, 99999))
            ids = passkey_prompt(tokenizer, ctx, depth, key)
            out.append({"context": ctx, "depth": depth, "key": key, "tokens": len(ids), "ids": ids})
    return out


def run(cfg_kw, all_cases):
    from k25 import K25Config, K25Model
    m = K25Model(K25Config(**cfg_kw))
    answers, t0 = [], time.perf_counter()
    try:
        for c in all_cases:
            answers.append(m.generate([c["ids"]], max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)[0].text)
        ratio = m.get_current_sparsity_ratio()
    finally:
        m.close()
    return answers, ratio, time.perf_counter() - t0


def retrieved(answer, key):
    return answer.strip().startswith(key)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="2500,4500,6800")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--caps", default="0.6,0.8", help="max_sparsity_ratio of the sparse runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random keys")
    ap.add_argument("--score-rule", default=None, choices=["channels", "codes", "bound"],
                    help="sparsity_score_rule of the sparse runs (default: the engine's)")
    ap.add_argument("--intervals", default="1", help="sparsity_selection_interval values of the sparse runs (comma list)")
    ap.add_argument("--json")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    caps = [float(c) for c in args.caps.split(",")] if args.caps else []
    base = dict(device="cpu", num_threads=args.threads, max_seq_len=8192,
                kv_cache_bytes=512 << 20)  # ~11K tokens of KV for the default model

    from k25 import K25Config, K25Model
    probe = K25Model(K25Config(device="cpu", num_threads=args.threads, kv_cache_bytes=16 << 20))
    all_cases = cases(probe.tokenizer, contexts, depths, args.seed)
    probe.close()

    intervals = [int(n) for n in args.intervals.split(",")]
    runs = [("dense", None, base)] + [
        (f"sparse {cap}" + (f" every {n}" if n > 1 else ""), cap,
         dict(base, enable_dynamic_sparsity=True, max_sparsity_ratio=cap, sparsity_score_rule=args.score_rule,
              sparsity_selection_interval=n))
        for cap in caps for n in intervals]
    summary = []
    for name, cap, kw in runs:
        answers, ratio, secs = run(kw, all_cases)
        for c, a in zip(all_cases, answers):
            c[name] = a
        hits = [retrieved(a, c["key"]) for c, a in zip(all_cases, answers)]
        row = {"run": name, "cap": cap, "accuracy": sum(hits) / len(hits), "hits": sum(hits), "cases": len(hits),
               "sparsity": ratio, "seconds": secs}
        if cap is not None:
            same = [a == c["dense"] for c, a in zip(all_cases, answers)]
            row["agreement"] = sum(same) / len(same)
            row["same_retrieval"] = sum(retrieved(a, c["key"]) == retrieved(c["dense"], c["key"])
                                        for c, a in zip(all_cases, answers)) / len(answers)
        summary.append(row)
        print(f"{name}: accuracy {row['accuracy']:.3f} ({row['hits']}/{row['cases']})"
              + (f", same answer as dense {row['agreement']:.3f}, same hit/miss {row['same_retrieval']:.3f}, "
                 f"sparsity {ratio:.3f}" if cap is not None else "") + f"  [{secs:.0f} s]", flush=True)

    names = [r[0] for r in runs]
    print()
    print("| context | tokens | depth | key | " + " | ".join(names) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " |")
    for c in all_cases:
        cells = []
        for n in names:
            mark = "ok" if retrieved(c[n], c["key"]) else "MISS"
            if n != "dense" and c[n] != c["dense"]:
                mark += " (differs)"
            cells.append(f"{mark} {c[n].strip()[:14]!r}")
        print(f"| {c['context']} | {c['tokens']} | {c['depth']} | {c['key']} | " + " | ".join(cells) + " |")
    print()
    print("| run | accuracy | same answer as dense | sparsity reached |")
    print("| --- | --- | --- | --- |")
    for r in summary:
        print(f"| {r['run']} | {r['accuracy']:.3f} ({r['hits']}/{r['cases']}) | "
              f"{r.get('agreement', 1.0):.3f} | {r['sparsity']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"format": {"filler": FILLER, "needle": NEEDLE, "question": QUESTION},
                       "summary": summary,
                       "cases": [{k: v for k, v in c.items() if k != "ids"} for c in all_cases]}, f, indent=1)


if __name__ == "__main__":
    main()
