"""The memory a model takes in k25, worked out before loading it (`k25 mem`).

    plan = memory_plan("smollm2-135m-instruct", device="cpu", batch=8, max_seq_len=4096)
    plan.total_bytes, plan.required_bytes, plan.fits, plan.max_batch, plan.kv_cache_bytes

Each part comes from the rule the engine itself sizes it by, so a plan is what a K25Model
with the same settings allocates:
- weights: every tensor the model keeps, in the compute dtype (GGUF quantized weights are
  dequantized at load today: float32 on the CPU, bfloat16 / float16 on CUDA);
- KV pool: blocks of `block_size` tokens, K and V of every layer (`kv_block_bytes`), a
  sequence of max_seq_len taking ceil(max_seq_len / block_size) of them;
- with dynamic sparsity, each block's key summaries (the same rows the engine allocates,
  from the engine: `_C.cpu_summary_bytes`, `_C.cuda_sparsity_bytes`) and on CUDA the
  selection's scratch;
- a step's workspace: on CUDA the reserve K25Model leaves when it sizes the pool from
  gpu_memory_utilization (`cuda_workspace_bytes`, used by both); on the CPU an estimate of
  one step's activations by the same per-token count (the CPU allocator has no reserve).
- the RoPE tables (float32 cos and sin for every position up to max_seq_len), and on CUDA
  the one KV block (and summary row) past the pool that padded graph rows use;
- with cache_mode="hierarchical", the L2 host pool at its default size (`default_l2_bytes`,
  which K25Model calls too).
What it leaves out (CUDA graphs' pools, the CUDA context, allocator fragmentation, the
Python process itself) is what the safety margin is for: `required_bytes` is the total
times (1 + margin), 10% unless told.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Dict, Optional

from . import _C
from .config import _KV_DTYPES, default_score_rule
from .errors import ConfigError

DEFAULT_MARGIN = 0.10


def weight_bytes(c: Dict[str, Any], elem: int) -> int:
    """Bytes of the weights LlamaModel keeps for config `c` at `elem` bytes an element."""
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_layers"], c["vocab_size"]
    D, Hq, Hkv = c["head_dim"], c["num_heads"], c["num_kv_heads"]
    qkv = (Hq + 2 * Hkv) * D
    layer = (H + qkv * H + (qkv if c["qkv_bias"] else 0) + Hq * D * H + (H if c["o_bias"] else 0)
             + H + 2 * I * H + H * I)
    n = V * H + H + (0 if c["tie_word_embeddings"] else V * H) + L * layer
    return n * elem


def model_parameters(path, c: Dict[str, Any]) -> int:
    """Parameters the engine loads from the model at `path` (config `c`, from read_model_config):
    biases included, and an untied output head whenever the file has one (weight_loader.cpp keeps
    it even where the config says tied)."""
    if c["source_format"] == "gguf":
        own_head = "output.weight" in {t["name"] for t in _C.read_gguf(str(path))["tensors"]}
    else:
        own_head = "lm_head.weight" in {t["name"] for t in _C.read_safetensors(str(path))["tensors"]}
    return weight_bytes(dict(c, tie_word_embeddings=not own_head), 1)


def step_bytes(c: Dict[str, Any], elem: int, max_num_batched_tokens: int, max_batch_size: int) -> int:
    """One step's activations: two sets of a token's hidden, QKV and MLP rows for every token
    of the step's budget, and three float rows of logits for each sequence."""
    qkv = (c["num_heads"] + 2 * c["num_kv_heads"]) * c["head_dim"]
    per_token = (4 * c["hidden_size"] + qkv + 3 * c["intermediate_size"]) * elem
    return max_num_batched_tokens * per_token * 2 + max_batch_size * c["vocab_size"] * 4 * 3


def cuda_workspace_bytes(c: Dict[str, Any], elem: int, max_num_batched_tokens: int, max_batch_size: int,
                         cold_gather: bool) -> int:
    """What K25Model leaves free on the GPU beside weights and KV pool: a step's activations, 512
    MiB for cuBLAS, graphs and the allocator, and with tiers but no sparsity the two buffers cold
    blocks are gathered into (docs/offload.md "Cold blocks on CUDA", at most 32 MiB)."""
    return step_bytes(c, elem, max_num_batched_tokens, max_batch_size) + (512 << 20) + ((32 << 20) if cold_gather else 0)


def cuda_sparsity_bytes(c: Dict[str, Any], dtype: str, block_size: int, max_batch_size: int, seq_blocks: int,
                        hierarchical: bool, key_codes: bool, selection_interval: int) -> "tuple[int, int]":
    """(bytes a KV block's summaries take, the selection's scratch) on CUDA, from the engine's
    own allocation sizes: summaries for every block, scratch for max_batch_size sequences (at
    least the largest CUDA-graph bucket's) of seq_blocks blocks, and with a selection interval
    over 1 the kept selections (docs/sparsity.md "CUDA")."""
    if not hasattr(_C, "cuda_sparsity_bytes"):
        raise ConfigError("sizing dynamic sparsity on CUDA needs a CUDA build of k25 (the summaries' and the "
                          "selection's sizes come from its kernels); plan it on the GPU machine, or without "
                          "sparsity")
    seqs = max(max_batch_size, 1 << (min(max_batch_size, 128) - 1).bit_length())
    layout = (c["num_layers"], c["num_kv_heads"], c["head_dim"], block_size)
    summary, scratch = _C.cuda_sparsity_bytes(layout, dtype, c["num_heads"], seqs, seq_blocks, hierarchical,
                                              key_codes)
    if selection_interval > 1:
        scratch += _C.cuda_sparse_memory_bytes(layout, seqs, seq_blocks)
    return int(summary), int(scratch)


def default_l2_bytes(num_kv_blocks: int, kv_block_bytes: int, device: str) -> int:
    """K25Model's L2 host pool when l2_bytes is not given (cache_mode="hierarchical"): a slot for
    every block of the primary pool plus the two staging slots L3 transfers borrow; on CUDA,
    where it is pinned, at most a quarter of the host's memory."""
    page = int(_C.kv_page_bytes(kv_block_bytes))  # an L2 slot / L3 page: the block and its trailer
    n = (num_kv_blocks + 2) * page
    if device.startswith("cuda"):
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        n = max(page, min(n, host // 4 // page * page))
    return n


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'24GiB', '80 GB', '1.5g', '123456' -> bytes (decimal units for k/m/g/t and kb/..., binary
    for kib/...)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"not a size: {text!r} (examples: 24GiB, 80GB, 512MiB, 1000000)")
    n = float(m.group(1)) * _UNITS[unit]
    if n <= 0:
        raise ConfigError(f"a size must be positive, got {text!r}")
    return int(n)


@dataclass
class MemoryPlan:
    model: str
    device: str                 # "cpu" or "cuda"
    dtype: str                  # compute dtype (weights)
    kv_dtype: str               # the KV pool's dtype
    block_size: int
    max_seq_len: int
    model_context: int          # the model's trained context length
    batch: int                  # sequences of max_seq_len at once
    weight_bytes: int
    rope_bytes: int             # the RoPE cos / sin tables (float32, a row per position up to max_seq_len)
    kv_block_bytes: int         # the KV pool's bytes a block (K and V, every layer)
    summary_block_bytes: int    # sparsity summaries a block (0 without sparsity)
    blocks_per_seq: int
    extra_blocks: int           # blocks allocated past the pool: on CUDA the padded graph rows' scratch block
    workspace_bytes: int        # CUDA: K25Model's reserve; CPU: one step's activations (estimate)
    l2_bytes: int               # the tiered cache's L2 host pool (cache_mode="hierarchical"), else 0
    margin: float
    available_bytes: Optional[int]  # None: not known (no --memory, no such device here)
    max_batch: Optional[int] = None    # sequences of max_seq_len that fit (with the margin)
    max_context: Optional[int] = None  # tokens each of `batch` sequences may hold (not capped by the model)

    @property
    def kv_cache_bytes(self) -> int:
        """The `kv_cache_bytes` that holds `batch` sequences of max_seq_len."""
        return self.batch * self.blocks_per_seq * self.kv_block_bytes

    @property
    def summary_bytes(self) -> int:
        return (self.batch * self.blocks_per_seq + self.extra_blocks) * self.summary_block_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the device's memory: on the CPU the L2 pool is in it, on CUDA it is host memory."""
        l2 = self.l2_bytes if self.device == "cpu" else 0
        return (self.weight_bytes + self.rope_bytes + self.kv_cache_bytes + self.extra_blocks * self.kv_block_bytes
                + self.summary_bytes + self.workspace_bytes + l2)

    def _margin(self) -> Fraction:
        return Fraction(self.margin).limit_denominator(1 << 20)

    @property
    def required_bytes(self) -> int:
        """The total times (1 + margin), rounded up: the least memory the plan fits in."""
        m = self._margin()
        return -(-self.total_bytes * (m.denominator + m.numerator) // m.denominator)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.available_bytes is None else self.required_bytes <= self.available_bytes

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        for k in ("kv_cache_bytes", "summary_bytes", "total_bytes", "required_bytes", "fits"):
            d[k] = getattr(self, k)
        return d


def _largest(fits, hi: int) -> int:
    """The largest n in [0, hi] with fits(n) (fits monotone: true up to some n, false after); 0 if
    none."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def memory_plan(model: Optional[str] = None, *, device: str = "cpu", dtype: str = "auto", kv_cache_dtype: str = "auto",
                batch: int = 1,
                max_seq_len: Optional[int] = None, block_size: int = 16, max_num_batched_tokens: int = 2048,
                sparsity: bool = False, score_rule: Optional[str] = None, compensation: bool = False,
                selection_interval: int = 1, cache_mode: str = "standard", margin: float = DEFAULT_MARGIN,
                available_bytes: Optional[int] = None) -> MemoryPlan:
    """The memory `batch` sequences of max_seq_len take on `device` ("cpu" or "cuda"), without
    loading the weights (only the model's header and tensor names). Options mean what
    K25Config's do; the engine's max_batch_size is taken to be `batch`. With available_bytes,
    also the most sequences of max_seq_len, and the longest sequences of `batch`, that fit."""
    from .model import resolve_model_path

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if device == "cpu" and dtype != "float32":
        raise ConfigError(f"dtype={dtype!r} needs the CUDA backend; the CPU backend computes in float32")
    if kv_cache_dtype not in _KV_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {_KV_DTYPES}, got {kv_cache_dtype!r}")
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if kv_dtype != dtype and not (device == "cpu" and kv_dtype == "bfloat16"):
        raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r} is not implemented for {dtype} compute on {device} "
                          f"(K25Config says the same)")
    for name, v in (("batch", batch), ("block_size", block_size), ("max_num_batched_tokens", max_num_batched_tokens),
                    ("selection_interval", selection_interval)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if block_size > 256:
        raise ConfigError(f"block_size must be at most 256, got {block_size}")
    if not (isinstance(margin, (int, float)) and 0.0 <= margin <= 10.0):
        raise ConfigError(f"the safety margin must be a fraction in [0, 10], got {margin!r}")
    if score_rule not in (None, "channels", "codes", "bound"):
        raise ConfigError(f"score_rule must be None, 'channels', 'codes' or 'bound', got {score_rule!r}")
    if cache_mode not in ("standard", "hierarchical"):
        raise ConfigError(f"cache_mode must be 'standard' or 'hierarchical', got {cache_mode!r}")
    if available_bytes is not None and (not isinstance(available_bytes, int) or available_bytes < 0):
        raise ConfigError(f"available_bytes must be a non-negative integer, got {available_bytes!r}")
    path = resolve_model_path(model)
    c = dict(_C.read_model_config(str(path)))
    context = int(c["max_position_embeddings"])
    if max_seq_len is None:
        max_seq_len = min(int(_C.DEFAULT_MAX_POSITIONS), context)
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    if max_seq_len > context:
        raise ConfigError(f"max_seq_len={max_seq_len} exceeds the model's context length ({context})")
    if device == "cuda":
        # The engine's own refusals (load_model, K25Config), so that a plan is one it would run.
        if c["head_dim"] not in (64, 128):
            raise ConfigError(f"the CUDA backend supports head_dim 64 and 128, not {c['head_dim']}")
        if c["num_heads"] // c["num_kv_heads"] > 16:
            raise ConfigError("the CUDA backend supports up to 16 query heads per KV head")
        if sparsity and (score_rule == "channels" or compensation):
            raise ConfigError("on CUDA, dynamic sparsity ranks by the key codes or the Quest bound, without "
                              "compensation (K25Config says the same)")
        if sparsity and score_rule == "codes" and dtype == "float32":
            raise ConfigError("sparsity_score_rule='codes' on CUDA needs 16-bit KV (K25Config says the same)")
    elem = 4 if dtype == "float32" else 2
    kv_block = int(_C.kv_bytes_per_token(str(path), kv_dtype)) * block_size
    weights = model_parameters(path, c) * elem
    rule = score_rule or default_score_rule(device, dtype)
    cpu_summary = 0  # a block's summary rows on the CPU: the same for every batch and length
    if device == "cpu" and sparsity:
        layout = (c["num_layers"], c["num_kv_heads"], c["head_dim"], block_size)
        cpu_summary = int(_C.cpu_summary_bytes(layout, rule == "codes", bool(compensation)))

    def plan(b: int, seq_len: int, avail: Optional[int]) -> MemoryPlan:
        seq_blocks = -(-seq_len // block_size)
        summary_block = cpu_summary
        if device == "cpu":
            workspace = step_bytes(c, elem, max_num_batched_tokens, b)
        else:
            workspace = cuda_workspace_bytes(c, elem, max_num_batched_tokens, b,
                                             cache_mode == "hierarchical" and not sparsity)
            if sparsity:
                summary_block, scratch = cuda_sparsity_bytes(c, dtype, block_size, max(b, 1), seq_blocks,
                                                             cache_mode == "hierarchical", rule == "codes",
                                                             selection_interval)
                workspace += scratch
        l2 = default_l2_bytes(b * seq_blocks, kv_block, device) if cache_mode == "hierarchical" else 0
        return MemoryPlan(model=str(path), device=device, dtype=dtype, kv_dtype=kv_dtype, block_size=block_size,
                          max_seq_len=seq_len,
                          model_context=context, batch=b, weight_bytes=weights,
                          rope_bytes=4 * seq_len * c["head_dim"], kv_block_bytes=kv_block,
                          summary_block_bytes=summary_block, blocks_per_seq=seq_blocks,
                          extra_blocks=1 if device == "cuda" else 0, workspace_bytes=workspace, l2_bytes=l2,
                          margin=float(margin), available_bytes=avail)

    result = plan(batch, max_seq_len, available_bytes)
    if available_bytes is not None:
        # Searched, not divided out: the workspace (logits rows, the selection's scratch) and the
        # L2 pool grow with the batch and the length too.
        per_token = max(1, kv_block // block_size)
        result.max_batch = _largest(lambda b: plan(b, max_seq_len, available_bytes).fits,
                                    available_bytes // (per_token * max_seq_len) + 1)
        blocks = _largest(lambda n: plan(batch, n * block_size, available_bytes).fits,
                          available_bytes // (kv_block * batch) + 1)
        result.max_context = blocks * block_size
    return result


def available_memory(device: str, gpu_memory_utilization: float = 0.9) -> Optional[int]:
    """Memory this process could plan with now: on the CPU MemAvailable; on CUDA the device's
    total times gpu_memory_utilization less what others use (K25Model's rule); None when this
    machine has no such device."""
    from .model import _available_memory_bytes

    if device == "cpu":
        return _available_memory_bytes()
    if not _C.cuda_available():
        return None
    free, total = _C.cuda_memory(0)
    return int(total * gpu_memory_utilization) - (total - free)


def _size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n} B"


def format_plan(p: MemoryPlan) -> str:
    """The plan as `k25 mem` prints it."""
    lines = [
        f"model:        {p.model}",
        f"device:       {p.device} ({p.dtype}, KV {p.kv_dtype}), block_size {p.block_size}",
        f"weights:      {_size(p.weight_bytes)} (+ RoPE tables {_size(p.rope_bytes)})",
        f"KV cache:     {_size(p.kv_block_bytes // p.block_size)} a token, {_size(p.kv_block_bytes)} a block, "
        f"{_size(p.blocks_per_seq * p.kv_block_bytes)} a sequence of {p.max_seq_len}",
        f"              x {p.batch} sequences = {_size(p.kv_cache_bytes)} (kv_cache_bytes={p.kv_cache_bytes})"
        + (f", + {p.extra_blocks} scratch block" if p.extra_blocks else ""),
    ]
    if p.summary_block_bytes:
        lines.append(f"summaries:    {_size(p.summary_block_bytes)} a block = {_size(p.summary_bytes)} (dynamic sparsity)")
    what = "reserve for a step, cuBLAS and graphs" if p.device == "cuda" else "one step's activations (estimate)"
    if p.l2_bytes:
        where = "pinned host memory, not in the GPU total" if p.device == "cuda" else "host memory"
        lines.append(f"L2 tier:      {_size(p.l2_bytes)} (cache_mode hierarchical, default size: {where})")
    lines += [
        f"workspace:    {_size(p.workspace_bytes)} ({what})",
        f"total:        {_size(p.total_bytes)}",
        f"with margin:  {_size(p.required_bytes)} (+{p.margin:.0%})",
    ]
    if p.available_bytes is None:
        lines.append("available:    unknown here (give --memory)")
    else:
        beyond = f" (past the model's context, {p.model_context})" if p.max_context > p.model_context else ""
        lines += [
            f"available:    {_size(p.available_bytes)} -> {'fits' if p.fits else 'does NOT fit'}",
            f"              at most {p.max_batch} sequences of {p.max_seq_len} tokens, or {p.batch} of "
            f"{p.max_context} tokens{beyond}",
        ]
    return "\n".join(lines)
