"""Arguments of `k25 serve` (kept free of heavy imports: the CLI builds every parser)."""
from ..config import DEFAULT_MODEL


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help=f"a .gguf file or HF directory (default: {DEFAULT_MODEL})")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: from the path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set K25_API_KEY)")
    p.add_argument("--max-concurrent-requests", type=int, default=128)
    p.add_argument("--max-queue", type=int, default=128, help="requests waiting in memory")
    p.add_argument("--max-spool", type=int, default=4096, help="requests waiting with the body on disk")
    p.add_argument("--spool-dir", default=None, help="where waiting bodies go (default: a new temp directory)")
    p.add_argument("--queue-timeout-ms", type=float, default=None, help="503 after this long in the queue")
    p.add_argument("--memory-watermark", type=float, default=0.92, help="KV-cache fill that trips the breaker")
    p.add_argument("--degrade", default="reject", help="reject | cap-tokens:N | fallback:MODEL")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish work after SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default=None,
                   help="KV pool dtype (auto: the compute dtype; bfloat16 halves the CPU's pool)")
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--prefill-chunk-size", type=int, default=None)
    p.add_argument("--batching-window-ms", type=float, default=5.0,
                   help="an idle engine waits this long to gather arrivals (small: it delays short requests)")
    p.add_argument("--enable-dynamic-sparsity", action="store_true", default=None,
                   help="block-sparse decode attention for long contexts (CPU and CUDA; docs/sparsity.md)")
    p.add_argument("--max-sparsity-ratio", type=float, default=None,
                   help="most of a sequence-layer's KV blocks a decode step may skip (0.1-0.8, default 0.6)")
    p.add_argument("--enable-prefix-caching", action="store_true", default=None,
                   help="share the KV of identical token prefixes between requests (README 'Prefix caching')")
    p.add_argument("--cache-mode", default=None, choices=["standard", "hierarchical"],
                   help="hierarchical: tiered KV (needs --enable-async-offload; CPU and CUDA; docs/offload.md)")
    p.add_argument("--enable-async-offload", action="store_true", default=None,
                   help="with --cache-mode hierarchical: preempted sequences' KV goes to L2/L3 instead of being "
                        "recomputed (when cheaper), sequences longer than the KV pool keep cold blocks there, and "
                        "evicted prefix blocks spill there")
    p.add_argument("--l2-bytes", type=int, default=None, help="L2 host pool of the tiered KV cache")
    p.add_argument("--l3-path", default=None, help="L3 file of the tiered KV cache (with --l3-bytes)")
    p.add_argument("--l3-bytes", type=int, default=None, help="size of the L3 file")
