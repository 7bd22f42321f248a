"""The OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: /v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models,
/healthz, /metrics. Every request passes the same gate: API key, size limit, strict
parsing, admission control (admission.py), the circuit breaker, then generation through
K25Model.stream_events, with usage, timing, metrics and structured log lines.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import InvalidArgumentError, K25Error, ResourceExhaustedError
from ..model import K25Model
from .admission import PRIORITY_RANK, Admission, CircuitBreaker, parse_degrade
from .metrics import Metrics
from .protocol import (ApiError, ParsedRequest, bad, chat_logprobs, completion_logprobs, new_id, now,
                       parse_chat, parse_completion, parse_json_body, sse, usage)

log = logging.getLogger("k25.server")


@dataclass
class ServerSettings:
    api_key: Optional[str] = None
    max_concurrent_requests: int = 128
    max_queue: int = 128
    max_spool: int = 4096
    spool_dir: Optional[str] = None      # None: a fresh directory under the system temp dir
    queue_timeout_ms: Optional[float] = None
    memory_watermark: float = 0.92
    degrade: str = "reject"
    max_body_bytes: int = 4 << 20
    drain_timeout_s: float = 30.0
    breaker_queue_fraction: float = 0.5
    breaker_queue_wait_s: float = 2.0
    breaker_trip_after_s: float = 0.5
    breaker_reset_after_s: float = 5.0


class ServerState:
    def __init__(self, models: Dict[str, K25Model], primary: str, settings: ServerSettings):
        self.models = models
        self.primary = primary
        self.settings = settings
        mode, arg = parse_degrade(settings.degrade)
        if mode == "fallback" and arg not in models:
            raise ValueError(f"--degrade fallback:{arg}: no model named {arg!r} is served")
        self.fallback = arg if mode == "fallback" else None
        # A spool directory of our own is removed at shutdown; a given one is emptied of
        # leftovers at start (admission.py).
        self.own_spool = settings.spool_dir is None
        spool = settings.spool_dir or tempfile.mkdtemp(prefix="k25-spool-")
        self.spool_dir = spool
        self.admission = Admission(settings.max_concurrent_requests, settings.max_queue, settings.max_spool, spool,
                                   settings.queue_timeout_ms)
        self.breaker = CircuitBreaker(self.admission, self.kv_fill, settings.memory_watermark,
                                      settings.breaker_queue_fraction, settings.breaker_queue_wait_s,
                                      settings.breaker_trip_after_s, settings.breaker_reset_after_s, settings.degrade)
        self.metrics = Metrics(self.engine_stats, self.admission)
        self.draining = False
        self.engine_req: Dict[tuple, str] = {}  # (model, engine id) -> http request id, for [KV_CACHE] logs

    def kv_fill(self) -> float:
        s = self.models[self.primary].stats()
        return s["blocks_used"] / max(1, s["blocks_total"])

    def engine_stats(self) -> Dict[str, Dict]:
        out = {}
        for name, m in self.models.items():
            s = dict(m.stats())
            s["sparsity_ratio"] = m.get_current_sparsity_ratio()
            s["offload_count"] = m.get_offload_count()
            s["tiers"] = m.tier_stats()
            out[name] = s
        return out


def _error_response(e: ApiError, req_id: str) -> JSONResponse:
    headers = dict(e.headers)
    headers["x-request-id"] = req_id
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad("invalid Content-Length header", code="invalid_header")
        if int(length) > limit:
            raise ApiError(413, f"the request body has {length} bytes; the limit is {limit}", code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():  # read ourselves: starlette would keep a cached copy
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise _ClientGone() from None
    return b"".join(chunks)


def create_app(models: Dict[str, K25Model], primary: str, settings: Optional[ServerSettings] = None) -> FastAPI:
    settings = settings or ServerSettings()
    state = ServerState(models, primary, settings)
    @contextlib.asynccontextmanager
    async def lifespan(app):
        kv_logger = asyncio.create_task(_log_kv_events(state))
        try:
            yield
        finally:
            kv_logger.cancel()
            if state.own_spool:
                shutil.rmtree(state.spool_dir, ignore_errors=True)

    app = FastAPI(title="k25", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.k25 = state

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # never a bare 500 page
        log.exception("unexpected error")
        return JSONResponse(ApiError(500, f"internal error: {exc}", "internal_error").body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unknown path, wrong method
        e = ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
        return JSONResponse(e.body(), status_code=exc.status_code, headers=exc.headers)

    def check_auth(request: Request) -> None:
        if not settings.api_key:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error",
                           code="invalid_api_key")

    @app.get("/healthz")
    async def healthz():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "models": list(models)}

    @app.get("/metrics")
    async def metrics():
        state.metrics.breaker_trips.set(state.breaker.level())
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request):
        req_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            check_auth(request)
        except ApiError as e:
            return _error_response(e, req_id)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "k25"}
                                           for name in models]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    async def handle(request: Request, kind: str):
        t_arrival = time.monotonic()
        req_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        endpoint = "chat" if kind == "chat" else "completions"
        priority = "silver"
        try:
            check_auth(request)
            priority = (request.headers.get("x-latency-sla") or "silver").strip().lower()
            if priority not in PRIORITY_RANK:
                priority = "silver"
                raise bad("x-latency-sla must be gold, silver or bronze", "x-latency-sla", "invalid_header")
            if state.draining:
                raise ApiError(503, "the server is shutting down; retry on another instance",
                               "service_unavailable", code="draining")
            raw = await _read_body(request, settings.max_body_bytes)
            parsed = _parse(raw, kind)
            model_name = parsed.model
            if model_name not in models:
                raise ApiError(404, f"the model '{model_name}' does not exist; see /v1/models", param="model",
                               code="model_not_found")
            # Check the prompts now (a 400 must not wait in the queue).
            _prepare(models[model_name], parsed)
            degraded = None
            if state.breaker.applies_to(priority):
                mode, arg = state.breaker.degrade
                if mode == "reject":
                    state.metrics.rejected.labels("breaker", priority).inc()
                    state.metrics.degraded.labels("reject", priority).inc()
                    log.info("[QUEUE] req_id=%s priority=%s queue_time=0.000 degraded=True mode=reject", req_id,
                             priority)
                    raise ApiError(429, "the server is under sustained load and sheds low-priority requests; retry "
                                        "later", "rate_limit_exceeded", code="overloaded",
                                   headers={"Retry-After": str(state.admission.retry_after()),
                                            "x-k25-degraded": "reject"})
                degraded = mode
            # A request that waits on disk must not keep its parsed form in memory: the
            # admission empties `holder` when it spools, and the body is parsed again once
            # admitted. Only `holder` and `payload` may refer to them from here on.
            holder = {"parsed": parsed}
            parsed = None
            payload = [raw]
            del raw
            ticket = await _acquire_unless_gone(state, request, priority, payload, holder)
            parsed = holder.pop("parsed", None)
        except _ClientGone:
            state.metrics.requests.labels(endpoint, "499", priority).inc()
            log.info("[QUEUE] req_id=%s priority=%s left before it could run", req_id, priority)
            return Response(status_code=499)
        except ApiError as e:
            if e.code == "queue_timeout":
                state.breaker.observe_queue_wait(time.monotonic() - t_arrival)
            reason = {429: "queue_full", 503: "unavailable"}.get(e.status)
            if e.code in ("overloaded",):
                reason = None  # counted above
            if reason:
                state.metrics.rejected.labels(e.code or reason, priority).inc()
            state.metrics.requests.labels(endpoint, str(e.status), priority).inc()
            return _error_response(e, req_id)

        queue_time = ticket.queue_time
        state.breaker.observe_queue_wait(queue_time)
        try:
            if parsed is None:  # it waited on disk: parse it again
                parsed = _parse(ticket.body, kind)
                _prepare(models[parsed.model], parsed)
            ticket.body = None
            model_name = parsed.model
            if degraded == "cap-tokens":
                cap = state.breaker.degrade[1]
                parsed.sampling["max_new_tokens"] = min(parsed.sampling["max_new_tokens"], cap)
            elif degraded == "fallback" and state.fallback != model_name:
                model_name = state.fallback
                _prepare(models[model_name], parsed)
            if degraded:
                state.metrics.degraded.labels(degraded, priority).inc()
            log.info("[QUEUE] req_id=%s priority=%s queue_time=%.3f degraded=%s%s", req_id, priority, queue_time,
                     bool(degraded), f" mode={degraded}" if degraded else "")
            headers = {"x-request-id": req_id}
            if degraded:
                headers["x-k25-degraded"] = degraded
            ctx = _Ctx(state, models[model_name], model_name, parsed, req_id, priority, t_arrival, queue_time,
                       endpoint)
            if parsed.stream:
                return StreamingResponse(_stream_body(ctx, ticket, request), media_type="text/event-stream",
                                         headers=headers)
            try:
                body = await _complete(ctx, request)
            finally:
                ticket.release()
            state.metrics.requests.labels(endpoint, "200", priority).inc()
            return JSONResponse(body, headers=headers)
        except ApiError as e:
            ticket.release()
            state.metrics.requests.labels(endpoint, str(e.status), priority).inc()
            return _error_response(e, req_id)
        except BaseException:
            ticket.release()
            raise

    return app


class _ClientGone(Exception):
    pass


async def _acquire_unless_gone(state: ServerState, request: Request, priority: str, payload: list, holder: dict):
    """Waits for admission, giving up the place in the queue if the client disconnects,
    so that a burst of abandoned requests does not later take slots."""
    task = asyncio.ensure_future(state.admission.acquire(priority, payload, holder))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, ApiError):
                    pass
                else:  # admitted in the same instant: give the slot back
                    task.result().release()
                raise _ClientGone()
    except asyncio.CancelledError:
        task.cancel()
        raise


def _parse(raw: bytes, kind: str) -> ParsedRequest:
    body = parse_json_body(raw)
    return parse_chat(body) if kind == "chat" else parse_completion(body)


def _prepare(model: K25Model, p: ParsedRequest) -> None:
    """Tokenises the prompts (chat template for chat) and fills in max_new_tokens."""
    if model.tokenizer is None and (p.kind == "chat" or any(isinstance(x, str) for x in p.prompts)):
        raise bad("this model has no tokenizer: send token ids to /v1/completions", "prompt")
    ids_list: List[List[int]] = []
    try:
        if p.kind == "chat":
            ids_list.append(model.tokenizer.encode_chat(p.prompts[0], add_generation_prompt=True))
        else:
            for x in p.prompts:
                ids_list.append(model.tokenize(x) if isinstance(x, str) else list(x))
    except K25Error as e:
        raise bad(str(e), "messages" if p.kind == "chat" else "prompt") from None
    vocab = model.model_config["vocab_size"]
    # The longest sequence this model can run: its context, and what its KV pool holds.
    ec = model.engine_config
    limit = min(model.max_seq_len, ec.num_kv_blocks * ec.block_size)
    requested = p.requested_max_tokens
    param = "messages" if p.kind == "chat" else "prompt"
    for ids in ids_list:
        if not ids:
            raise bad("the prompt is empty", "prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
        if len(ids) >= limit:
            raise bad(f"the prompt has {len(ids)} tokens; this model runs sequences of at most {limit} tokens "
                      "including the output", param, "context_length_exceeded")
        if requested is not None and len(ids) + requested > limit:
            raise bad(f"the prompt ({len(ids)} tokens) plus max_tokens ({requested}) exceeds the {limit} tokens a "
                      "sequence may have on this model", "max_tokens", "context_length_exceeded")
    p.prompt_ids = ids_list
    p.sampling["max_new_tokens"] = requested if requested is not None else limit - max(len(i) for i in ids_list)
    # The engine's own checks, now rather than as a failure after admission.
    if p.sampling.get("stop") and model.tokenizer is None:
        raise bad("stop strings need a tokenizer; this model has none", "stop")
    try:
        params = model._params(**p.sampling)
        from .. import _C
        _C.validate_sampling_params(params, vocab)
    except K25Error as e:
        raise bad(str(e)) from None


@dataclass
class _Ctx:
    state: ServerState
    model: K25Model
    model_name: str
    parsed: ParsedRequest
    req_id: str
    priority: str
    t_arrival: float
    queue_time: float
    endpoint: str
    first_token_seen: bool = False  # TTFT and queue time are observed once per request


def _choices(ctx: _Ctx):
    return choice_params(ctx.parsed)


def choice_params(p: ParsedRequest):
    """(choice index, prompt ids, sampling) for every prompt x n; seeds differ per choice."""
    out = []
    for pi, ids in enumerate(p.prompt_ids):
        for j in range(p.n):
            kw = dict(p.sampling)
            if kw.get("seed") is not None and j:
                kw["seed"] = kw["seed"] + j
            if p.logprobs is not None:
                kw["logprobs"] = p.logprobs
            out.append((pi * p.n + j, ids, kw))
    return out


class _Tracker:
    """Per-choice timing and token accounting, for usage, metrics and logs."""

    def __init__(self, ctx: _Ctx, ids, index: int):
        self.ctx = ctx
        self.prompt_tokens = len(ids)
        # n choices of one prompt share it: its tokens count once, as in usage.
        self.counts_prompt = index % ctx.parsed.n == 0
        self.tokens = 0
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.logged_prefill = False
        self.engine_id = None

    def see(self, ev) -> None:
        t = time.monotonic()
        if ev.request_id and self.engine_id is None:
            self.engine_id = ev.request_id
            self.ctx.state.engine_req[(self.ctx.model_name, ev.request_id)] = self.ctx.req_id
            if len(self.ctx.state.engine_req) > 10000:
                self.ctx.state.engine_req.pop(next(iter(self.ctx.state.engine_req)))
        if ev.token_ids:
            if self.first is None:
                self.first = t
            self.last = t
            self.tokens += len(ev.token_ids)
            if not self.ctx.first_token_seen:
                self.ctx.first_token_seen = True
                m = self.ctx.state.metrics
                m.ttft.observe(t - self.ctx.t_arrival)
                m.queue_time.labels(self.ctx.priority).observe(self.ctx.queue_time + ev.queue_time_s)
        if not self.logged_prefill and ev.token_ids:
            self.logged_prefill = True
            chunks = max(1, ev.prefill_chunks)
            log.info("[PREFILL] req_id=%s seq_len=%d chunk_count=%d avg_time_per_chunk=%.4f", self.ctx.req_id,
                     self.prompt_tokens, ev.prefill_chunks, ev.prefill_time_s / chunks)

    def done(self, finish_reason: str) -> None:
        m = self.ctx.state.metrics
        if self.counts_prompt:
            m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(self.tokens)
        tpot = (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 and self.first else 0.0
        if self.tokens > 1:
            m.tpot.observe(tpot)
        log.info("[DECODE] req_id=%s tokens=%d tpot=%.4f finish_reason=%s", self.ctx.req_id, self.tokens, tpot,
                 finish_reason)


async def run_choice(model: K25Model, ids, kw, priority: str = "silver", see=None):
    """Runs one choice to its end: (text, token ids, logprobs or None, finish_reason);
    `see` is called with every StreamEvent."""
    text, tokens, lps, finish = [], [], [], None
    async for ev in model.stream_events(ids, priority=priority, **kw):
        if see is not None:
            see(ev)
        text.append(ev.text)
        tokens.extend(ev.token_ids)
        if ev.logprobs:
            lps.extend(ev.logprobs)
        if ev.finish_reason:
            finish = ev.finish_reason
    return "".join(text), tokens, (lps if kw.get("logprobs") is not None else None), finish


async def _run_choice(ctx: _Ctx, index, ids, kw):
    tracker = _Tracker(ctx, ids, index)
    text, tokens, lps, finish = await run_choice(ctx.model, ids, kw, ctx.priority, tracker.see)
    tracker.done(finish)
    return text, tokens, lps, finish, tracker


async def _complete(ctx: _Ctx, request: Request) -> Dict[str, Any]:
    p = ctx.parsed
    tasks = [asyncio.ensure_future(_run_choice(ctx, i, ids, kw)) for i, ids, kw in _choices(ctx)]

    async def watch_disconnect():
        while True:
            await asyncio.sleep(0.2)
            if await request.is_disconnected():
                for t in tasks:
                    t.cancel()  # aborts the engine requests and frees their KV
                return

    watcher = asyncio.ensure_future(watch_disconnect())
    try:
        results = await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        raise ApiError(499, "the client closed the connection", code="client_closed") from None
    except (InvalidArgumentError, ResourceExhaustedError) as e:
        raise bad(str(e)) from None
    except K25Error as e:
        raise ApiError(500, f"generation failed: {e}", "internal_error") from None
    finally:
        watcher.cancel()
        for t in tasks:
            if not t.done():
                t.cancel()
    ctx.state.metrics.e2e.observe(time.monotonic() - ctx.t_arrival)
    return response_body(p, ctx.model_name, ctx.model.tokenizer, [r[:4] for r in results])


def response_body(p: ParsedRequest, model_name: str, tok, results) -> Dict[str, Any]:
    """The JSON of a non-streamed response; `results` holds (text, token ids, logprobs,
    finish_reason) of each choice, in the order of choice_params(p)."""
    choices = []
    prompt_tokens = sum(len(ids) for ids in p.prompt_ids)
    completion_tokens = 0
    for (index, ids, kw), (text, tokens, lps, finish) in zip(choice_params(p), results):
        completion_tokens += len(tokens)
        finish = finish if finish in ("stop", "length") else "stop"
        if p.kind == "chat":
            choices.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": chat_logprobs(tok, lps), "finish_reason": finish})
        else:
            choices.append({"index": index, "text": text, "logprobs": completion_logprobs(tok, lps),
                            "finish_reason": finish})
    return {"id": new_id(p.kind), "object": "chat.completion" if p.kind == "chat" else "text_completion",
            "created": now(), "model": model_name, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


async def _stream_body(ctx: _Ctx, ticket, request: Request):
    """SSE events of every choice, interleaved as they come; [DONE] last. A client that
    goes away cancels this generator, which aborts every engine request of it."""
    p = ctx.parsed
    rid = new_id(p.kind)
    created = now()
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    queue: asyncio.Queue = asyncio.Queue()
    choices = _choices(ctx)

    async def pump(index, ids, kw):
        tracker = _Tracker(ctx, ids, index)
        try:
            async for ev in ctx.model.stream_events(ids, priority=ctx.priority, **kw):
                tracker.see(ev)
                await queue.put((index, ev, None))
                if ev.finish_reason:
                    tracker.done(ev.finish_reason)
        except K25Error as e:  # the request is known good (checked before admission): a real failure
            await queue.put((index, None, e))
        except asyncio.CancelledError:
            raise
        finally:
            await queue.put((index, "end", tracker))

    tasks = [asyncio.ensure_future(pump(i, ids, kw)) for i, ids, kw in choices]
    ended, trackers = 0, []
    tok = ctx.model.tokenizer
    offsets = {i: 0 for i, _, _ in choices}
    status = "200"
    try:
        if p.kind == "chat":
            for i, _, _ in choices:
                yield sse({"id": rid, "object": obj, "created": created, "model": ctx.model_name,
                           "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]})
        while ended < len(tasks):
            index, ev, extra = await queue.get()
            if ev == "end":
                ended += 1
                trackers.append(extra)
                continue
            if ev is None:  # the engine failed this choice
                status = "500"
                yield sse(ApiError(500, f"generation failed: {extra}", "internal_error").body())
                continue
            finish = ev.finish_reason if ev.finish_reason in (None, "stop", "length") else "stop"
            if not ev.text and not ev.finish_reason and not (ev.logprobs and p.logprobs is not None):
                continue
            if p.kind == "chat":
                delta = {"content": ev.text} if ev.text else {}
                choice = {"index": index, "delta": delta,
                          "logprobs": chat_logprobs(tok, ev.logprobs) if p.logprobs is not None else None,
                          "finish_reason": finish}
            else:
                choice = {"index": index, "text": ev.text,
                          "logprobs": completion_logprobs(tok, ev.logprobs, offsets[index])
                          if p.logprobs is not None else None, "finish_reason": finish}
                offsets[index] += len(ev.text)
            yield sse({"id": rid, "object": obj, "created": created, "model": ctx.model_name, "choices": [choice]})
        if p.include_usage:
            prompt_tokens = sum(len(ids) for ids in p.prompt_ids)
            yield sse({"id": rid, "object": obj, "created": created, "model": ctx.model_name, "choices": [],
                       "usage": usage(prompt_tokens, sum(t.tokens for t in trackers))})
        yield sse("[DONE]")
        ctx.state.metrics.e2e.observe(time.monotonic() - ctx.t_arrival)
    except asyncio.CancelledError:
        status = "499"
        raise
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        ticket.release()
        ctx.state.metrics.requests.labels(ctx.endpoint, status, ctx.priority).inc()


async def _log_kv_events(state: ServerState) -> None:
    while True:
        await asyncio.sleep(0.5)
        for name, m in state.models.items():
            try:
                events = m.drain_kv_events()
            except K25Error:
                continue
            for engine_id, blocks, reason in events:
                req = state.engine_req.get((name, engine_id), f"engine-{engine_id}")
                shown = ",".join(str(b) for b in blocks[:16]) + (",..." if len(blocks) > 16 else "")
                log.info("[KV_CACHE] req_id=%s model=%s block_id=%s blocks=%d evict_reason=%s", req, name, shown,
                         len(blocks), reason)
