"""Admission control ("three-tier elastic buffering") and the circuit breaker.

Tier 1: at most `max_concurrent` requests generate at once. Tier 2: up to `max_queue`
more wait in memory. Tier 3: beyond that, up to `max_spool` more wait with their request
body written to `spool_dir` (the handler drops its copy and reads it back when admitted),
so a burst does not sit in RAM. Waiters are served by priority class, then arrival; a
waiter that is not admitted within `queue_timeout_ms` gets a 503. Past all three tiers a
request gets a 429 with Retry-After. Nothing is dropped silently.

The circuit breaker watches queue depth, recent queue waits and KV-cache occupancy, and
while tripped applies the configured degradation to bronze requests (and, under severe
pressure, silver): reject with 429, cap the tokens, or route to a fallback model.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from .protocol import ApiError

PRIORITY_RANK = {"gold": 0, "silver": 1, "bronze": 2}


@dataclass(order=True)
class _Waiter:
    rank: int
    seq: int
    future: asyncio.Future = field(compare=False)
    spool_path: Optional[str] = field(default=None, compare=False)
    cancelled: bool = field(default=False, compare=False)


class Ticket:
    """A slot in the engine. release() (or `async with`) gives it back."""

    def __init__(self, admission: "Admission", queue_time: float, body: Optional[bytes]):
        self._admission = admission
        self.queue_time = queue_time
        self.body = body  # the request body when asked for (read back from the spool)
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release()

    def __del__(self):
        # A streaming response whose client vanished before its body ran never reaches
        # its own release: the slot comes back when the ticket is dropped.
        try:
            self.release()
        except Exception:
            pass

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.release()


class Admission:
    def __init__(self, max_concurrent: int = 128, max_queue: int = 128, max_spool: int = 4096,
                 spool_dir: Optional[str] = None, queue_timeout_ms: Optional[float] = None):
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.max_spool = max_spool
        self.spool_dir = spool_dir
        self.queue_timeout = queue_timeout_ms / 1000.0 if queue_timeout_ms else None
        self.running = 0
        self.queued = 0      # waiting in memory
        self.spooled = 0     # waiting with the body on disk
        self._heap: list = []
        self._seq = itertools.count()
        self.draining = False
        self.timeouts = 0
        if spool_dir:
            os.makedirs(spool_dir, exist_ok=True)
            for name in os.listdir(spool_dir):  # leftovers of a killed process
                if name.endswith(".req"):
                    os.unlink(os.path.join(spool_dir, name))

    @property
    def waiting(self) -> int:
        return self.queued + self.spooled

    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0

    def retry_after(self) -> int:
        # A rough, honest hint: the backlog over the concurrency, at least one second.
        return max(1, min(60, (self.waiting + self.running) // max(1, self.max_concurrent) + 1))

    async def acquire(self, priority: str, payload: list, holder: Optional[dict] = None) -> Ticket:
        """Waits for a slot.

        `payload` is a one-element list holding the request body, taken out of it so that no
        copy stays in memory once the body is on disk. `holder` is a dict of the caller's
        parsed request: it is emptied, before anything yields, when the request is spooled,
        and the ticket then carries the body read back from disk to parse again."""
        body = payload.pop()
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another instance", "service_unavailable",
                           code="draining")
        if self.running < self.max_concurrent and self.waiting == 0:
            self.running += 1
            return Ticket(self, 0.0, None)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(PRIORITY_RANK[priority], next(self._seq), loop.create_future())
        if self.queued < self.max_queue:
            self.queued += 1
        elif self.spool_dir and self.spooled < self.max_spool:
            waiter.spool_path = os.path.join(self.spool_dir, f"{waiter.seq:012d}.req")
            if holder is not None:
                holder.clear()
        else:
            raise ApiError(429, "the server is at capacity (all queue and spool places are taken); retry later",
                           "rate_limit_exceeded", code="queue_full", headers={"Retry-After": str(self.retry_after())})
        # In the queue before anything yields: a slot freed meanwhile is not lost.
        if waiter.spool_path:
            self.spooled += 1
        heapq.heappush(self._heap, waiter)
        t0 = time.monotonic()
        if waiter.spool_path:
            try:
                await _write_file(waiter.spool_path, body)
            except BaseException as e:
                self._forget(waiter)
                if self._admitted(waiter):
                    self._release()
                if isinstance(e, OSError):
                    raise ApiError(503, f"the request could not be queued on disk ({e.strerror}); retry later",
                                   "service_unavailable", code="spool_failed") from None
                raise
            body = None
        self._admit_next()
        try:
            if self.queue_timeout is None:
                await asyncio.shield(waiter.future)
            else:
                remaining = max(0.0, self.queue_timeout - (time.monotonic() - t0))
                await asyncio.wait_for(asyncio.shield(waiter.future), remaining)
        except asyncio.TimeoutError:
            if not self._admitted(waiter):  # admission may have raced the timer: then go ahead
                self._forget(waiter)
                self.timeouts += 1
                raise ApiError(503, f"the request waited {self.queue_timeout * 1000:.0f} ms without a place to run; "
                                    "retry later", "service_unavailable", code="queue_timeout",
                               headers={"Retry-After": str(self.retry_after())}) from None
        except BaseException:  # the client went away while queued
            if self._admitted(waiter):
                self._release()
            self._forget(waiter)
            raise
        result = waiter.future.result()
        if result != "admitted":
            self._forget(waiter)
            raise result
        body_back = None
        if waiter.spool_path:
            try:
                body_back = await _read_file(waiter.spool_path)
            except BaseException as e:
                self._release()
                self._forget(waiter)
                if isinstance(e, OSError):
                    raise ApiError(503, f"the queued request could not be read back ({e.strerror})",
                                   "service_unavailable", code="spool_failed") from None
                raise
            self._forget(waiter)  # removes the file
        return Ticket(self, time.monotonic() - t0, body_back)

    @staticmethod
    def _admitted(waiter: _Waiter) -> bool:
        f = waiter.future
        return f.done() and not f.cancelled() and f.result() == "admitted"

    def _forget(self, waiter: _Waiter) -> None:
        if waiter.cancelled:
            return
        waiter.cancelled = True
        if not waiter.future.done():
            waiter.future.cancel()
            self._stop_waiting(waiter)
        if waiter.spool_path and os.path.exists(waiter.spool_path):
            os.unlink(waiter.spool_path)

    def _release(self) -> None:
        self.running -= 1
        self._admit_next()

    def _stop_waiting(self, waiter: _Waiter) -> None:
        if waiter.spool_path:
            self.spooled -= 1
        else:
            self.queued -= 1

    def _pop_waiting(self) -> Optional[_Waiter]:
        """The best live waiter, taken off the heap and out of the waiting counts."""
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if not (waiter.cancelled or waiter.future.done()):
                self._stop_waiting(waiter)
                return waiter
        return None

    def _admit_next(self) -> None:
        while self.running < self.max_concurrent:
            waiter = self._pop_waiting()
            if waiter is None:
                return
            self.running += 1
            waiter.future.set_result("admitted")

    def start_draining(self) -> None:
        self.draining = True

    def fail_waiters(self, error: ApiError) -> int:
        """Answers every waiter with `error` (end of a drain); returns how many."""
        n = 0
        while (waiter := self._pop_waiting()) is not None:
            waiter.future.set_result(error)
            n += 1
        return n


async def _write_file(path: str, data: bytes) -> None:
    import aiofiles
    async with aiofiles.open(path, "wb") as f:
        await f.write(data)


async def _read_file(path: str) -> bytes:
    import aiofiles
    async with aiofiles.open(path, "rb") as f:
        return await f.read()


# ---- circuit breaker ---------------------------------------------------------------------

class CircuitBreaker:
    """Trips on sustained pressure; `level()` is 0 (closed), 1 (bronze degraded) or 2
    (bronze and silver degraded). Gold is never degraded.

    Pressure: the queue (memory + spool) above `queue_fraction` of its capacity, the median
    queue wait of the last requests above `queue_wait_s`, or the KV cache fuller than
    `memory_watermark`. It trips after `trip_after_s` of pressure and resets after
    `reset_after_s` without it (hysteresis, so it does not flap)."""

    def __init__(self, admission: Admission, kv_fill: Callable[[], float], memory_watermark: float = 0.92,
                 queue_fraction: float = 0.5, queue_wait_s: float = 2.0, trip_after_s: float = 0.5,
                 reset_after_s: float = 5.0, degrade: str = "reject"):
        self.admission = admission
        self.kv_fill = kv_fill
        self.memory_watermark = memory_watermark
        self.queue_fraction = queue_fraction
        self.queue_wait_s = queue_wait_s
        self.trip_after_s = trip_after_s
        self.reset_after_s = reset_after_s
        self.degrade = parse_degrade(degrade)
        self._waits: deque = deque(maxlen=64)  # (when, seconds waited)
        self._pressure_since: Optional[float] = None
        self._last_pressure: Optional[float] = None
        self._level = 0
        self.trips = 0

    # Waits older than this no longer count: a shed class records none, and the breaker
    # must be able to close on an idle server.
    WAIT_WINDOW_S = 30.0

    def observe_queue_wait(self, seconds: float) -> None:
        self._waits.append((time.monotonic(), seconds))

    def _pressure(self) -> int:
        a = self.admission
        capacity = max(1, a.max_queue + (a.max_spool if a.spool_dir else 0))
        fill = a.waiting / capacity
        now = time.monotonic()
        while self._waits and now - self._waits[0][0] > self.WAIT_WINDOW_S:
            self._waits.popleft()
        waits = sorted(w for _, w in self._waits)
        median_wait = waits[len(waits) // 2] if waits else 0.0
        kv = self.kv_fill()
        if fill >= 0.9 or kv >= min(1.0, self.memory_watermark + 0.04):
            return 2
        if fill >= self.queue_fraction or median_wait >= self.queue_wait_s or kv >= self.memory_watermark:
            return 1
        return 0

    def level(self) -> int:
        now = time.monotonic()
        p = self._pressure()
        if p > 0:
            self._last_pressure = now
            if self._pressure_since is None:
                self._pressure_since = now
            if now - self._pressure_since >= self.trip_after_s or p == 2:
                if self._level == 0:
                    self.trips += 1
                self._level = max(self._level, p)
        else:
            self._pressure_since = None
            # Calm is counted from the last time pressure was seen, not from this call.
            if self._level and (self._last_pressure is None or now - self._last_pressure >= self.reset_after_s):
                self._level = 0
        return self._level

    def applies_to(self, priority: str) -> bool:
        lvl = self.level()
        return (lvl >= 1 and priority == "bronze") or (lvl >= 2 and priority == "silver")


def parse_degrade(spec: str):
    """'reject' | 'cap-tokens:N' | 'fallback:MODEL' -> (mode, argument)."""
    if spec == "reject":
        return ("reject", None)
    if spec.startswith("cap-tokens:"):
        n = spec.split(":", 1)[1]
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--degrade cap-tokens:N needs a positive N, got {spec!r}")
        return ("cap-tokens", int(n))
    if spec.startswith("fallback:") and spec.split(":", 1)[1]:
        return ("fallback", spec.split(":", 1)[1])
    raise ValueError(f"--degrade must be reject, cap-tokens:N or fallback:MODEL, got {spec!r}")
