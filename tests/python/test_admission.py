"""Admission control and the circuit breaker, driven directly on an event loop with the
spool I/O slowed down so that the races in question are hit every time."""
import asyncio
import os

import pytest

from k25.server import admission as adm
from k25.server.admission import Admission, CircuitBreaker
from k25.server.protocol import ApiError


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def gate_io(monkeypatch, which):
    """Makes _write_file or _read_file wait for an event before doing its work."""
    gate = asyncio.Event()
    real = getattr(adm, which)

    async def slow(*a):
        await gate.wait()
        return await real(*a)

    monkeypatch.setattr(adm, which, slow)
    return gate


def spool_files(d):
    return [f for f in os.listdir(d) if f.endswith(".req")]


def test_a_slot_freed_during_the_spool_write_admits_the_writer(tmp_path, monkeypatch):
    async def main():
        a = Admission(max_concurrent=1, max_queue=0, max_spool=4, spool_dir=str(tmp_path))
        first = await a.acquire("silver", [b"a"])
        gate = gate_io(monkeypatch, "_write_file")
        task = asyncio.ensure_future(a.acquire("silver", [b"b" * 1000], {"parsed": 1}))
        await asyncio.sleep(0.05)   # task is inside the spool write
        first.release()             # the only slot frees while nobody sits in the heap's view
        gate.set()
        second = await asyncio.wait_for(task, 5)
        assert second.body == b"b" * 1000
        third_task = asyncio.ensure_future(a.acquire("gold", [b"c"]))
        await asyncio.sleep(0.05)
        assert not third_task.done()  # the slot is taken by the spooled request
        second.release()
        (await asyncio.wait_for(third_task, 5)).release()
        assert a.idle() and spool_files(tmp_path) == []
    run(main())


def test_cancel_during_the_spool_write_leaves_nothing(tmp_path, monkeypatch):
    async def main():
        a = Admission(max_concurrent=1, max_queue=0, max_spool=4, spool_dir=str(tmp_path))
        first = await a.acquire("silver", [b"a"])
        gate_io(monkeypatch, "_write_file")
        task = asyncio.ensure_future(a.acquire("silver", [b"b"]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (a.running, a.queued, a.spooled) == (1, 0, 0) and spool_files(tmp_path) == []
        first.release()
        assert a.idle()
    run(main())


def test_cancel_during_the_read_back_gives_the_slot_back(tmp_path, monkeypatch):
    async def main():
        a = Admission(max_concurrent=1, max_queue=0, max_spool=4, spool_dir=str(tmp_path))
        first = await a.acquire("silver", [b"a"])
        gate_io(monkeypatch, "_read_file")
        task = asyncio.ensure_future(a.acquire("silver", [b"b"]))
        await asyncio.sleep(0.05)
        first.release()              # admits the spooled request, which starts reading back
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert a.idle(), (a.running, a.queued, a.spooled)
        assert spool_files(tmp_path) == []
        (await a.acquire("gold", [b"c"])).release()  # the slot is usable
    run(main())


def test_priority_then_arrival_and_timeouts(tmp_path):
    async def main():
        a = Admission(max_concurrent=1, max_queue=2, max_spool=2, spool_dir=str(tmp_path), queue_timeout_ms=300)
        holder = await a.acquire("silver", [b"x"])
        order = []

        async def wait(name, prio):
            t = await a.acquire(prio, [name.encode()])
            order.append(name)
            await asyncio.sleep(0.01)
            t.release()

        tasks = [asyncio.ensure_future(wait(n, p)) for n, p in
                 (("b1", "bronze"), ("s1", "silver"), ("g1", "gold"), ("b2", "bronze"))]
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as full:
            await a.acquire("gold", [b"late"])
        assert full.value.status == 429 and "Retry-After" in full.value.headers
        holder.release()
        await asyncio.gather(*tasks)
        assert order == ["g1", "s1", "b1", "b2"]
        # a waiter that outlives queue_timeout_ms gets a 503
        blocker = await a.acquire("silver", [b"y"])
        with pytest.raises(ApiError) as late:
            await a.acquire("gold", [b"z"])
        assert late.value.status == 503 and late.value.code == "queue_timeout"
        blocker.release()
        assert a.idle() and spool_files(tmp_path) == []
    run(main())


def test_breaker_closes_once_old_waits_age_out(monkeypatch):
    a = Admission(max_concurrent=1, max_queue=10)
    br = CircuitBreaker(a, lambda: 0.0, queue_wait_s=1.0, trip_after_s=0.0, reset_after_s=0.05)
    for _ in range(5):
        br.observe_queue_wait(30.0)  # a burst of long waits, then silence
    assert br.level() == 1 and br.applies_to("bronze") and not br.applies_to("gold")
    monkeypatch.setattr(CircuitBreaker, "WAIT_WINDOW_S", 0.0)
    import time
    time.sleep(0.1)
    assert br.level() == 0 and not br.applies_to("bronze")
