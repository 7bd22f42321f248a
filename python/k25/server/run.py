"""`k25 serve`: load the model(s), build the app, run uvicorn with a graceful drain.

On SIGTERM the server keeps its socket open but answers new requests with 503, lets the
admitted and queued (memory and spool) requests finish for up to --drain-timeout, answers
whatever is still waiting with 503, stops, and exits 0. A second signal (or Ctrl-C)
stops at once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional

import uvicorn

from ..config import DEFAULT_MODEL, K25Config
from ..model import K25Model
from .app import ServerSettings, create_app
from .protocol import ApiError

log = logging.getLogger("k25.server")


def served_name(path: Optional[str]) -> str:
    if path is None or path == DEFAULT_MODEL:
        return DEFAULT_MODEL
    p = Path(path)
    return p.stem if p.suffix in (".gguf", ".safetensors") else p.name


class DrainingServer(uvicorn.Server):
    def __init__(self, config, state, drain_timeout_s: float):
        super().__init__(config)
        self.k25 = state
        self.drain_timeout_s = drain_timeout_s
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        if self._loop is None:
            return super().handle_exit(sig, frame)
        if sig != signal.SIGTERM or self.k25.draining:
            # Ctrl-C, or a second SIGTERM: stop now. Waiters get a 503 first; the signal is
            # not re-raised after the loop ends, so the engines still close cleanly.
            self.k25.draining = True
            self.k25.admission.start_draining()

            def stop_now():
                self.k25.admission.fail_waiters(ApiError(503, "the server stopped", "service_unavailable",
                                                         code="draining"))
                self.should_exit = True
                self.force_exit = True
            self._loop.call_soon_threadsafe(stop_now)
            return
        if sig == signal.SIGTERM:
            self.k25.draining = True
            self.k25.admission.start_draining()
            log.info("[SERVER] SIGTERM: draining (new requests get 503; up to %.0f s for the rest)",
                     self.drain_timeout_s)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
            return
        super().handle_exit(sig, frame)

    async def _drain(self):
        deadline = time.monotonic() + self.drain_timeout_s
        a = self.k25.admission
        while not a.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = a.fail_waiters(ApiError(503, "the server shut down before this request could run",
                                       "service_unavailable", code="draining"))
        log.info("[SERVER] drain done: %d running, %d queued answered with 503", a.running, left)
        self.should_exit = True


def serve(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine_kw = dict(num_threads=args.threads, max_seq_len=args.max_seq_len, kv_cache_bytes=args.kv_cache_bytes,
                     kv_cache_dtype=args.kv_cache_dtype,
                     max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
                     prefill_chunk_size=args.prefill_chunk_size, device=args.device, dtype=args.dtype,
                     batching_window_ms=args.batching_window_ms, enable_prefix_caching=args.enable_prefix_caching,
                     enable_dynamic_sparsity=args.enable_dynamic_sparsity, max_sparsity_ratio=args.max_sparsity_ratio,
                     cache_mode=args.cache_mode, enable_async_offload=args.enable_async_offload,
                     l2_bytes=args.l2_bytes, l3_path=args.l3_path, l3_bytes=args.l3_bytes)
    engine_kw = {k: v for k, v in engine_kw.items() if v is not None}
    models: Dict[str, K25Model] = {}
    primary = args.served_model_name or served_name(args.model)
    models[primary] = K25Model(K25Config(model_path=args.model, **engine_kw))
    degrade = args.degrade
    if degrade.startswith("fallback:"):
        target = degrade.split(":", 1)[1]
        name = served_name(target)
        if name not in models:
            # The fallback model gets no tiers of its own (an L3 file is one engine's).
            fallback_kw = {k: v for k, v in engine_kw.items()
                           if k not in ("cache_mode", "enable_async_offload", "l2_bytes", "l3_path", "l3_bytes")}
            models[name] = K25Model(K25Config(model_path=None if target == DEFAULT_MODEL else target, **fallback_kw))
        degrade = f"fallback:{name}"
    # Default spool: one directory per port, so that a restart after a crash removes the
    # bodies a killed server left behind; it is deleted at a clean exit.
    spool_dir = args.spool_dir or os.path.join(tempfile.gettempdir(), f"k25-spool-{args.port}")
    settings = ServerSettings(
        api_key=args.api_key or os.environ.get("K25_API_KEY") or None,
        max_concurrent_requests=args.max_concurrent_requests, max_queue=args.max_queue, max_spool=args.max_spool,
        spool_dir=spool_dir, queue_timeout_ms=args.queue_timeout_ms, memory_watermark=args.memory_watermark,
        degrade=degrade, max_body_bytes=args.max_body_bytes, drain_timeout_s=args.drain_timeout)
    app = create_app(models, primary, settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=5, access_log=False)
    server = DrainingServer(config, app.state.k25, args.drain_timeout)
    log.info("[SERVER] serving %s on http://%s:%d", ", ".join(models), args.host, args.port)
    try:
        server.run()
    finally:
        for m in models.values():
            m.close()
        if not args.spool_dir:
            shutil.rmtree(spool_dir, ignore_errors=True)
    return 0


