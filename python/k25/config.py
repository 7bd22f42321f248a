"""K25Config: every knob of the engine, validated before anything is loaded.

A configuration that asks for something this build cannot do raises ConfigError at
construction of the model; nothing is silently disabled. Defaults follow vLLM where the
brief is silent (see docs/configuration.md).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from .errors import ConfigError

DEFAULT_MODEL = "smollm2-135m-instruct"

_KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4")
_CACHE_MODES = ("standard", "hierarchical")


def default_score_rule(device: str, dtype: str) -> str:
    """The sparsity rule neither sparsity_score_rule nor sparsity_score_channels names: each
    backend's accurate one, "channels" on the CPU, on CUDA "codes" with 16-bit KV and "bound"
    with float32 KV (which the key codes do not take there)."""
    if device.startswith("cuda"):
        return "bound" if dtype == "float32" else "codes"
    return "channels"


@dataclass
class K25Config:
    model_path: Optional[str] = None  # None: the default model (smollm2-135m-instruct)
    device: str = "auto"              # auto (cuda when available, else cpu) | cpu | cuda[:N]
    dtype: str = "auto"               # compute dtype; auto = float32 on CPU, bfloat16 on CUDA
    max_seq_len: Optional[int] = None  # None: min(8192, the model's context length)
    max_batch_size: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    decode_max_tokens: Optional[int] = None
    block_size: int = 16
    kv_cache_bytes: Optional[int] = None
    gpu_memory_utilization: Optional[float] = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = False
    enable_dynamic_sparsity: bool = False
    max_sparsity_ratio: float = 0.6
    sparsity_min_context: int = 2048
    sparsity_recent_blocks: int = 16
    sparsity_sink_blocks: int = 1
    sparsity_mass_target: float = 0.95  # estimated softmax mass the kept blocks must reach
    sparsity_compensation: bool = False
    # channels of the block mass estimate; 0: Quest bound; None: 8 on the CPU, 0 on CUDA
    # (the device selection reads no key channels: the key codes or the bound; docs/sparsity.md)
    sparsity_score_channels: Optional[int] = None
    # the rule that ranks and sizes: "channels" (the channel estimate on sparsity_score_channels
    # channels; CPU only), "codes" (the key-code estimate: 2-bit codes of every key kept in the block
    # summaries; on CUDA with 16-bit KV), "bound" (Quest bound); None: each backend's accurate rule,
    # "channels" on the CPU, "codes" on CUDA with 16-bit KV, else "bound" (resolved_score_rule;
    # docs/sparsity.md "Which rule by default")
    sparsity_score_rule: Optional[str] = None
    # decode steps one selection of a sequence serves (1: select every step; N: steps at context
    # lengths that are multiples of N select, the others reuse the latest kept blocks plus those
    # written since; docs/sparsity.md "Selection reuse")
    sparsity_selection_interval: int = 1
    enable_async_offload: bool = False  # with cache_mode="hierarchical": tiered KV (docs/offload.md)
    cache_mode: str = "standard"        # or "hierarchical"
    l2_bytes: Optional[int] = None      # L2 host pool; None: as large as the primary KV pool
    l3_path: Optional[str] = None       # L3 file or block device on an SSD (O_DIRECT); None: no L3
    l3_bytes: Optional[int] = None      # L3 size, reserved when the model starts
    # The predictor of a sequence longer than L1 (cold blocks; docs/offload.md "The predictor")
    predictor_decay: float = 0.75         # weight of a block's history in its heat, [0, 1)
    predictor_promote_heat: float = 0.5   # a cold block at least this hot comes back to L1, (0, 1]
    predictor_margin: float = 0.25        # an exchange needs the resident block this much colder, [0, 1]
    predictor_max_moves: int = 2          # promotions per sequence per step, >= 0
    predictor_free_watermark: float = 0.1 # share of L1 that promotions leave free, [0, 1]
    predictor_max_entropy: float = 0.95   # no exchanges while a sequence's access entropy is above, [0, 1]
    enable_kernel_fusion: bool = True
    batching_window_ms: float = 0.0  # an idle engine waits this long to gather a burst
    num_threads: Optional[int] = None  # None: every core this process may run on

    def __post_init__(self):
        self.validate()

    def replace(self, **changes) -> "K25Config":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Raises ConfigError naming the first option that cannot be honoured."""
        def need(cond, msg):
            if not cond:
                raise ConfigError(msg)

        def positive_int(name, allow_none=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"{name} must be a positive integer, got {v!r}")

        need(self.model_path is None or isinstance(self.model_path, (str, os.PathLike)),
             f"model_path must be a path or a model name, got {self.model_path!r}")
        need(isinstance(self.device, str) and (self.device in ("auto", "cpu", "cuda")
                                               or (self.device.startswith("cuda:") and self.device[5:].isdigit())),
             f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        device = self.resolved_device()
        need(self.sparsity_score_rule in (None, "channels", "codes", "bound"),
             f"sparsity_score_rule must be None, 'channels', 'codes' or 'bound', got {self.sparsity_score_rule!r}")
        if self.enable_dynamic_sparsity is True and device.startswith("cuda"):
            if self.sparsity_score_rule == "channels":
                raise ConfigError("sparsity_score_rule='channels': on CUDA the block selection ranks by the key "
                                  "codes ('codes', the CUDA default with 16-bit KV) or the Quest bound ('bound'); "
                                  "the channel estimate runs on the CPU backend")
            if self.sparsity_score_rule == "codes" and self.resolved_dtype() == "float32":
                raise ConfigError("sparsity_score_rule='codes' on CUDA needs 16-bit KV (dtype 'bfloat16' or "
                                  "'float16'); with float32 the device selection ranks by the Quest bound")
            if self.sparsity_score_channels not in (None, 0):
                raise ConfigError(f"sparsity_score_channels={self.sparsity_score_channels!r}: on CUDA the block "
                                  "selection reads no key channels (None: the key codes with 16-bit KV, the Quest "
                                  "bound with float32; 0: the Quest bound); the channel estimate runs on the CPU "
                                  "backend")
            if self.sparsity_compensation is True:
                raise ConfigError("sparsity_compensation=True runs on the CPU backend only (the CUDA selection "
                                  "keeps no key or value sums)")
        if device.startswith("cuda"):
            from . import _C
            if not _C.cuda_available():
                raise ConfigError(f"device={self.device!r}: this build of k25 has no CUDA backend or no CUDA "
                                  "device is visible; use device='cpu' or 'auto'")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        need(device.startswith("cuda") or self.dtype in ("auto", "float32"),
             f"dtype={self.dtype!r} needs the CUDA backend; the CPU backend computes in float32")
        positive_int("max_seq_len", allow_none=True)
        positive_int("max_batch_size")
        positive_int("max_num_batched_tokens")
        positive_int("prefill_chunk_size")
        positive_int("decode_max_tokens", allow_none=True)
        positive_int("block_size")
        need(self.block_size <= 256, f"block_size must be at most 256, got {self.block_size}")
        positive_int("kv_cache_bytes", allow_none=True)
        positive_int("num_threads", allow_none=True)
        need(self.num_threads is None or self.num_threads <= 1024,
             f"num_threads must be at most 1024, got {self.num_threads}")
        if self.gpu_memory_utilization is not None:
            need(device.startswith("cuda"), "gpu_memory_utilization applies to the CUDA backend; on the "
                                            "CPU set kv_cache_bytes")
            need(isinstance(self.gpu_memory_utilization, (int, float))
                 and 0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        need(self.kv_cache_dtype in _KV_DTYPES,
             f"kv_cache_dtype must be one of {_KV_DTYPES}, got {self.kv_cache_dtype!r}")
        kv = self.resolved_kv_dtype()  # the rule of make_executor (resolve_kv_dtype)
        need(kv == self.resolved_dtype() or (kv == "bfloat16" and device == "cpu"),
             f"kv_cache_dtype={self.kv_cache_dtype!r} is not implemented yet for {self.resolved_dtype()} compute on "
             f"{device}: KV is stored in the compute dtype ('auto' = {self.resolved_dtype()}), or on the CPU in "
             f"bfloat16 (docs/configuration.md)")
        need(self.cache_mode in _CACHE_MODES,
             f"cache_mode must be one of {_CACHE_MODES}, got {self.cache_mode!r}")
        need(isinstance(self.max_sparsity_ratio, (int, float))
             and 0.1 <= self.max_sparsity_ratio <= 0.8,
             f"max_sparsity_ratio must be in [0.1, 0.8], got {self.max_sparsity_ratio!r}")
        positive_int("sparsity_min_context")
        positive_int("sparsity_recent_blocks")
        need(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching must be a bool")
        positive_int("sparsity_sink_blocks")
        need(isinstance(self.sparsity_mass_target, (int, float)) and not isinstance(self.sparsity_mass_target, bool)
             and 0.0 < self.sparsity_mass_target <= 1.0,
             f"sparsity_mass_target must be in (0, 1], got {self.sparsity_mass_target!r}")
        need(self.sparsity_score_channels is None
             or (isinstance(self.sparsity_score_channels, int) and not isinstance(self.sparsity_score_channels, bool)
                 and 0 <= self.sparsity_score_channels <= 256),
             f"sparsity_score_channels must be None or an int in [0, 256], got {self.sparsity_score_channels!r}")
        if self.sparsity_score_rule in ("bound", "codes"):
            need(self.sparsity_score_channels in (None, 0),
                 f"sparsity_score_rule={self.sparsity_score_rule!r} reads no key channels: "
                 f"sparsity_score_channels={self.sparsity_score_channels!r} must be None or 0")
        if self.sparsity_score_rule == "channels":
            need(self.sparsity_score_channels != 0,
                 "sparsity_score_rule='channels' needs sparsity_score_channels > 0 (or None: 8)")
        need(isinstance(self.enable_dynamic_sparsity, bool), "enable_dynamic_sparsity must be a bool")
        need(isinstance(self.sparsity_compensation, bool), "sparsity_compensation must be a bool")
        positive_int("sparsity_selection_interval")
        need(self.sparsity_selection_interval <= 64,
             f"sparsity_selection_interval must be at most 64, got {self.sparsity_selection_interval}")
        if self.sparsity_selection_interval != 1 and not self.enable_dynamic_sparsity:
            raise ConfigError(f"sparsity_selection_interval={self.sparsity_selection_interval} needs "
                              "enable_dynamic_sparsity=True")
        if self.sparsity_score_rule is not None and self.enable_dynamic_sparsity is not True:
            raise ConfigError(f"sparsity_score_rule={self.sparsity_score_rule!r} needs enable_dynamic_sparsity=True")
        if self.sparsity_compensation and not self.enable_dynamic_sparsity:
            raise ConfigError("sparsity_compensation=True needs enable_dynamic_sparsity=True (it approximates "
                              "the blocks that sparsity skips)")
        if self.enable_dynamic_sparsity:
            need(self.enable_kernel_fusion, "enable_dynamic_sparsity=True needs enable_kernel_fusion=True "
                                            "(the unfused path has no sparse attention)")
        need(isinstance(self.enable_async_offload, bool), "enable_async_offload must be a bool")
        if self.enable_async_offload and self.cache_mode != "hierarchical":
            raise ConfigError("enable_async_offload=True needs cache_mode='hierarchical' "
                              "(the standard cache has no tiers to offload to)")
        if self.cache_mode == "hierarchical":
            # What works (docs/offload.md): preemption parks a sequence's KV in L2/L3 and
            # fetches it back (CPU and CUDA); cached prefix blocks spill there; on the CPU a
            # sequence longer than L1 runs with its older blocks in L2.
            need(self.enable_async_offload, "cache_mode='hierarchical' needs enable_async_offload=True (tier "
                                            "moves are asynchronous; there is no synchronous offload)")
            positive_int("l2_bytes", allow_none=True)
            need((self.l3_path is None) == (self.l3_bytes is None),
                 "l3_path and l3_bytes go together: set both for an L3 tier, or neither")
            if self.l3_path is not None:
                need(isinstance(self.l3_path, (str, os.PathLike)) and str(self.l3_path) != "",
                     f"l3_path must be a file path, got {self.l3_path!r}")
                positive_int("l3_bytes")
        def in_range(name, lo, hi, lo_open=False, hi_open=False):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v > lo if lo_open else v >= lo) \
                and (v < hi if hi_open else v <= hi)
            need(ok, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, got {v!r}")
        in_range("predictor_decay", 0, 1, hi_open=True)
        in_range("predictor_promote_heat", 0, 1, lo_open=True)
        in_range("predictor_margin", 0, 1)
        in_range("predictor_free_watermark", 0, 1)
        in_range("predictor_max_entropy", 0, 1)
        need(isinstance(self.predictor_max_moves, int) and not isinstance(self.predictor_max_moves, bool)
             and 0 <= self.predictor_max_moves <= 1024,
             f"predictor_max_moves must be an int in [0, 1024], got {self.predictor_max_moves!r}")
        tuned = [f.name for f in dataclasses.fields(self)
                 if f.name.startswith("predictor_") and getattr(self, f.name) != f.default]
        # Cold blocks (docs/offload.md): tiered KV with the fused kernels.
        cold_blocks = self.cache_mode == "hierarchical" and self.enable_kernel_fusion
        if tuned and not cold_blocks:
            raise ConfigError(f"{', '.join(tuned)} tune(s) the predictor of cold blocks, which only "
                              f"cache_mode='hierarchical' with kernel fusion has")
        if self.cache_mode != "hierarchical":
            for name in ("l2_bytes", "l3_path", "l3_bytes"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} applies to cache_mode='hierarchical' (tiered KV), not "
                                      f"cache_mode={self.cache_mode!r}")
        need(isinstance(self.enable_kernel_fusion, bool), "enable_kernel_fusion must be a bool")
        need(isinstance(self.batching_window_ms, (int, float)) and not isinstance(self.batching_window_ms, bool)
             and 0 <= self.batching_window_ms <= 1000,
             f"batching_window_ms must be in [0, 1000], got {self.batching_window_ms!r}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        from . import _C
        return "cuda" if _C.cuda_available() else "cpu"

    def resolved_score_channels(self) -> int:
        """sparsity_score_channels with None resolved for the device and rule: 8 on the CPU, 0 on
        CUDA; 0 with the "bound" or "codes" rule (neither reads channels of the keys)."""
        if self.sparsity_score_rule in ("bound", "codes"):
            return 0
        if self.sparsity_score_channels is not None:
            return self.sparsity_score_channels
        return 0 if self.resolved_device().startswith("cuda") else 8

    def resolved_score_rule(self) -> str:
        """"channels", "codes" or "bound": sparsity_score_rule, or with None what the device and
        sparsity_score_channels say: 0 gives "bound"; None gives "channels" on the CPU and, on
        CUDA, "codes" with 16-bit KV and "bound" with float32 KV (which the key codes do not take
        there). The defaults are the rules that hold #5's accuracy target on each backend; the
        bound is the fast one that does not (docs/sparsity.md "CUDA")."""
        if self.sparsity_score_rule is not None:
            return self.sparsity_score_rule
        if self.sparsity_score_channels is None:
            return default_score_rule(self.resolved_device(), self.resolved_dtype())
        return "channels" if self.sparsity_score_channels > 0 else "bound"

    def resolved_kv_dtype(self) -> str:
        """The KV pool's dtype: the compute dtype for "auto"."""
        return self.resolved_dtype() if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"

    def resolved_threads(self) -> int:
        if self.num_threads:
            return self.num_threads
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)
