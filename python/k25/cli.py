"""The k25 command line: generate, chat, info, mem, serve, batch, bench.

    k25 generate "Write a haiku about the sea."   # streams to the terminal
    k25 chat                                        # multi-turn, with the chat template
    k25 info [MODEL]                                # architecture, sizes, dtypes
    k25 mem [MODEL] --batch 8 --max-seq-len 4096    # memory calculator, with a safety margin
    k25 serve [--model M] [--port 8000]             # OpenAI-compatible server
    k25 batch input.jsonl output.jsonl              # OpenAI batch file, resumable
    k25 bench [--url URL] --input-len 512           # serving benchmark: TTFT, TPOT, goodput

`generate` applies the model's chat template when it has one (instruct models answer
a bare prompt poorly); pass --raw to send the prompt as plain text.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path

from .config import DEFAULT_MODEL, K25Config
from .errors import K25Error


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"a .gguf file or HF directory (default: {DEFAULT_MODEL})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV pool dtype (auto: the compute dtype; bfloat16 halves the CPU's pool)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling(a) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop)


def _load(a):
    from .model import K25Model
    return K25Model(K25Config(model_path=a.model, num_threads=a.threads, max_seq_len=a.max_seq_len,
                              kv_cache_bytes=a.kv_cache_bytes, kv_cache_dtype=a.kv_cache_dtype))


async def _stream_to(out, model, prompt, sampling) -> str:
    text = []
    async for piece in model.stream(prompt, **sampling):
        out.write(piece)
        out.flush()
        text.append(piece)
    return "".join(text)


def cmd_generate(a) -> int:
    model = _load(a)
    try:
        prompt = a.prompt
        if prompt == "-":
            prompt = sys.stdin.read()
        if not a.raw and model.tokenizer is not None and model.tokenizer.chat_template:
            messages = ([{"role": "system", "content": a.system}] if a.system else [])
            messages.append({"role": "user", "content": prompt})
            prompt = model.tokenizer.encode_chat(messages, add_generation_prompt=True)
        asyncio.run(_stream_to(sys.stdout, model, prompt, _sampling(a)))
        sys.stdout.write("\n")
    finally:
        model.close()
    return 0


def cmd_chat(a) -> int:
    model = _load(a)
    if model.tokenizer is None:
        model.close()
        print("k25: error: this model has no tokenizer, so it cannot chat", file=sys.stderr)
        return 2
    history = [{"role": "system", "content": a.system}] if a.system else []
    interactive = sys.stdin.isatty()
    try:
        while True:
            if interactive:
                sys.stdout.write("> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
            if line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            ids = model.tokenizer.encode_chat(history, add_generation_prompt=True)
            reply = asyncio.run(_stream_to(sys.stdout, model, ids, _sampling(a)))
            sys.stdout.write("\n")
            sys.stdout.flush()
            history.append({"role": "assistant", "content": reply})
    finally:
        model.close()
    return 0


def cmd_info(a) -> int:
    from . import _C
    from .memory import model_parameters
    from .model import resolve_model_path
    path = resolve_model_path(a.model_path or a.model)
    cfg = dict(_C.read_model_config(str(path)))
    info = {"path": str(path)}
    info.update(cfg)
    H, I, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_layers"], cfg["vocab_size"]
    D, Hq, Hkv = cfg["head_dim"], cfg["num_heads"], cfg["num_kv_heads"]
    params = model_parameters(path, cfg)
    info["parameters"] = params
    info["kv_bytes_per_token_f32"] = _C.kv_bytes_per_token(str(path))
    if cfg["source_format"] == "gguf":
        g = _C.read_gguf(str(path))
        info["file_bytes"] = path.stat().st_size
        info["tensor_types"] = dict(Counter(t["type"] for t in g["tensors"]))
        info["gguf_version"] = g["version"]
        meta = g["metadata"]
        info["name"] = meta.get("general.name")
        info["tokenizer"] = meta.get("tokenizer.ggml.model")
        info["chat_template"] = bool(meta.get("tokenizer.chat_template"))
    else:
        d = path if path.is_dir() else path.parent
        s = _C.read_safetensors(str(path))
        info["file_bytes"] = sum(os.path.getsize(f) for f in s["files"])
        info["tensor_types"] = dict(Counter(t["dtype"] for t in s["tensors"]))
        info["tokenizer"] = "tokenizer.json" if (d / "tokenizer.json").is_file() else None
    if a.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"model:        {info['path']}")
    if info.get("name"):
        print(f"name:         {info['name']}")
    print(f"format:       {cfg['source_format']}  ({info['file_bytes'] / 1e6:.1f} MB)")
    print(f"architecture: {cfg['architecture']}  layers={L} hidden={H} ffn={I} heads={Hq} kv_heads={Hkv} "
          f"head_dim={D}")
    print(f"vocab:        {V}   context: {cfg['max_position_embeddings']}   tied embeddings: "
          f"{cfg['tie_word_embeddings']}   qkv bias: {cfg['qkv_bias']}")
    print(f"rope:         theta={cfg['rope_theta']:g} type={cfg['rope_type']} factor={cfg['rope_factor']:g}")
    windows = sorted(set(cfg["layer_sliding_window"]))
    if windows != [0]:
        print(f"sliding window: {windows}")
    print(f"parameters:   {params / 1e6:.1f} M   (float32 in memory: {params * 4 / 1e6:.0f} MB)")
    print(f"tensor types: {', '.join(f'{k} x{v}' for k, v in sorted(info['tensor_types'].items()))}")
    print(f"KV cache:     {info['kv_bytes_per_token_f32']} bytes per token (float32)")
    print(f"tokenizer:    {info.get('tokenizer')}" + ("   chat template: yes" if info.get("chat_template") else ""))
    return 0


def cmd_mem(a) -> int:
    from . import memory
    avail = memory.parse_bytes(a.memory) if a.memory is not None else memory.available_memory(
        a.device, a.gpu_memory_utilization)
    plan = memory.memory_plan(a.model_path or a.model, device=a.device, dtype=a.dtype,
                              kv_cache_dtype=a.kv_cache_dtype, batch=a.batch,
                              max_seq_len=a.max_seq_len, block_size=a.block_size,
                              max_num_batched_tokens=a.max_num_batched_tokens, sparsity=a.sparsity,
                              score_rule=a.score_rule, compensation=a.compensation,
                              selection_interval=a.selection_interval,
                              cache_mode=a.cache_mode, margin=a.safety_margin, available_bytes=avail)
    print(json.dumps(plan.as_dict(), indent=1) if a.json else memory.format_plan(plan))
    return 0 if plan.fits is not False else 1


def cmd_serve(a) -> int:
    from .server.run import serve
    return serve(a)


def cmd_batch(a) -> int:
    from .batch import run_batch
    run_batch(a.input, a.output, lambda: _load(a), concurrency=a.concurrency, model_name=a.served_model_name)
    return 0


def cmd_bench(a) -> int:
    from .serving_bench import main as bench_main
    return bench_main(a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="k25", description="k25 LLM inference engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for a prompt, streamed to the terminal")
    g.add_argument("prompt", help="the prompt ('-' reads stdin)")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--system", default=None, help="system message (chat template only)")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat", help="multi-turn chat on stdin/stdout (/exit ends)")
    _add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(fn=cmd_chat)
    i = sub.add_parser("info", help="architecture, sizes and dtypes of a model")
    i.add_argument("model_path", nargs="?", default=None)
    i.add_argument("--model", default=None)
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_info)
    m = sub.add_parser("mem", help="memory calculator: weights, KV cache, workspace, with a safety margin",
                       description="What a model takes in memory for BATCH sequences of MAX_SEQ_LEN tokens, from "
                                   "the rules the engine sizes by (docs/tools.md). Exits 1 when it does not fit.")
    m.add_argument("model_path", nargs="?", default=None)
    m.add_argument("--model", default=None)
    m.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    m.add_argument("--dtype", default="auto", help="compute dtype (auto: float32 on cpu, bfloat16 on cuda)")
    m.add_argument("--kv-cache-dtype", default="auto",
                   help="KV pool dtype (auto: the compute dtype; bfloat16 with float32 compute on cpu)")
    m.add_argument("--batch", type=int, default=1, help="sequences of max-seq-len at once (default: 1)")
    m.add_argument("--max-seq-len", type=int, default=None, help="default: min(8192, the model's context)")
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--max-num-batched-tokens", type=int, default=2048)
    m.add_argument("--sparsity", action="store_true", help="with dynamic sparsity's block summaries")
    m.add_argument("--score-rule", choices=("channels", "codes", "bound"), default=None)
    m.add_argument("--compensation", action="store_true", help="with the key and value sums compensation keeps "
                                                               "(CPU)")
    m.add_argument("--selection-interval", type=int, default=1)
    m.add_argument("--cache-mode", choices=("standard", "hierarchical"), default="standard")
    m.add_argument("--memory", default=None,
                   help="memory to plan against, e.g. 80GiB (default: MemAvailable on cpu; on cuda the device's "
                        "total x --gpu-memory-utilization less what others use, when one is here)")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    m.add_argument("--safety-margin", type=float, default=0.10, help="fraction added to the total (default: 0.10)")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_mem)
    from .server.cli_args import add_arguments as serve_arguments
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve_arguments(sv)
    sv.set_defaults(fn=cmd_serve)
    b = sub.add_parser("batch", help="run an OpenAI batch file (JSONL); crash-safe, resumes where it stopped")
    b.add_argument("input", help="requests, one a line: {custom_id, method, url, body}")
    b.add_argument("output", help="results, appended as they complete (in completion order)")
    _add_model_args(b)
    b.add_argument("--concurrency", type=int, default=32, help="lines in flight at once (default: 32)")
    b.add_argument("--served-model-name", default=None,
                   help="the model name requests give (default: as `k25 serve` names the model)")
    b.set_defaults(fn=cmd_batch)
    from .serving_bench import add_arguments as bench_arguments
    be = sub.add_parser("bench", help="serving benchmark against an OpenAI-compatible server (TTFT, TPOT, "
                                      "percentiles, throughput, goodput)",
                        description="Streams requests to /v1/completions or /v1/chat/completions and reports "
                                    "latency percentiles, throughput and goodput (docs/tools.md).")
    bench_arguments(be)
    be.set_defaults(fn=cmd_bench)
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except K25Error as e:
        print(f"k25: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
