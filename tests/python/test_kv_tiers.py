"""The KV tier core (cpp/kv/tiers): the cache state machine, round trips through L2 host
memory and an L3 file, and fault handling on real files.

TierHarness drives the real TierManager over an L1 pool of its own (a numpy view). In
manual mode every copy and I/O waits until the test releases it, so hypothesis chooses the
order in which transfers complete, including after the block was freed.
"""
import os
import random
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from k25 import _C, errors

BLOCK = 3000  # not a multiple of 4096: the page trailer and padding are exercised
PAGE = _C.kv_page_bytes(BLOCK)
SETTLED = {"in_l2", "in_l3", "resident", "lost"}
IN_FLIGHT = {"demoting", "spilling", "fetching", "copying_up"}


def make(tmp_path, l1=6, l2_slots=3, l3_pages=4, manual=False, staging=1, backend="auto", name="l3.bin"):
    path = str(tmp_path / name) if l3_pages else ""
    return _C.TierHarness(l1, BLOCK, l2_slots * PAGE, path, l3_pages * PAGE, manual, backend, staging)


def fill(h, block, seed):
    data = np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)
    h.l1()[block] = data
    return data


@pytest.fixture(params=["threads", "io_uring"])
def backend(request, tmp_path):
    if request.param == "io_uring":
        try:
            make(tmp_path, backend="io_uring", name="probe.bin").close()
        except errors.UnsupportedModelError as e:  # no liburing in this build, or the kernel refuses
            pytest.skip(str(e))
    return request.param


def test_a_machine_with_liburing_builds_the_io_uring_backend(tmp_path):
    # scripts/install.sh (and so .ci/run) installs liburing-dev where it can: then the io_uring
    # tests here must run, not skip because the build did not pick the library up.
    if not os.path.exists("/usr/include/liburing.h"):
        pytest.skip("liburing-dev is not installed on this machine")
    try:
        make(tmp_path, backend="io_uring", name="probe.bin").close()
    except errors.UnsupportedModelError as e:
        assert "no io_uring support" not in str(e), "liburing.h is here, but this build has no io_uring backend"
        pytest.skip(f"the kernel refuses io_uring here: {e}")


def test_the_build_without_liburing_keeps_a_working_fallback():
    # Without liburing-dev (or with -DK25_IO_URING=off) CMake compiles async_file_uring.cpp
    # without K25_HAVE_LIBURING: that branch only says io_uring is absent, and L3 I/O runs on
    # the pread/pwrite threads the `backend` tests above exercise. This machine usually has
    # liburing, so its build took the other branch: compile this one here.
    import shutil
    from pathlib import Path
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler on this machine")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", "-UK25_HAVE_LIBURING", "-Icpp/include", "-Icpp",
                        "cpp/kv/tiers/async_file_uring.cpp"], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_crc32c_known_value_and_hardware_matches_portable():
    assert _C.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert _C.crc32c(b"") == 0
    rng = random.Random(1)
    for n in [1, 7, 8, 9, 63, 64, 4095, 4096, 100_003]:
        data = bytes(rng.getrandbits(8) for _ in range(n))
        assert _C.crc32c(data) == _C.crc32c_portable(data)
        cut = n // 3
        assert _C.crc32c(data[cut:], _C.crc32c(data[:cut])) == _C.crc32c(data)  # continuation


def test_page_size_is_block_plus_trailer_rounded_to_4096():
    assert _C.kv_page_bytes(3000) == 4096
    assert _C.kv_page_bytes(4096) == 8192  # the 64-byte trailer needs room
    assert _C.kv_page_bytes(4032) == 4096
    assert _C.kv_page_bytes(737280) == 737280 + 4096  # the default model's block (float32)


def test_l2_round_trip_is_byte_exact_without_l3(tmp_path):
    h = make(tmp_path, l1=4, l2_slots=3, l3_pages=0)
    datas = {b: fill(h, b, b) for b in range(4)}
    keys = [h.demote(b) for b in range(4)]
    assert keys[3] == 0  # L2 holds three blocks and there is no L3: refused, nothing started
    h.drain()
    assert all(c["ok"] and c["tier"] == "L2" for c in h.completions())
    h.l1()[:] = 0
    for b, k in enumerate(keys[:3]):
        h.fetch(k, 3 - b)  # back into other blocks
    h.drain()
    for b, k in enumerate(keys[:3]):
        assert h.entry(k)["state"] == "resident"
        assert np.array_equal(h.l1()[3 - b], datas[b])
        h.free(k)
    s = h.stats()
    assert s["offloads_to_l2"] == 3 and s["fetches_from_l2"] == 3 and s["refused"] == 1
    assert s["bytes_to_l2"] == s["bytes_from_l2"] == 3 * BLOCK
    assert h.counts()["l2_slots_used"] == 0
    h.check_invariants()


def test_l3_round_trip_is_byte_exact(tmp_path, backend):
    # L2 holds one resident block; the rest go straight to L3 through the staging slot,
    # and the L2 resident is spilled too.
    h = make(tmp_path, l1=8, l2_slots=2, l3_pages=10, staging=1, backend=backend)
    assert h.io_backend == backend and h.l2_capacity == 1
    datas = {b: fill(h, b, 100 + b) for b in range(8)}
    keys = [h.demote(b) for b in range(8)]
    assert all(keys)
    h.drain()
    tiers = [c["tier"] for c in sorted(h.completions(), key=lambda c: c["key"])]
    assert tiers == ["L2"] + ["L3"] * 7
    assert h.spill(keys[0])
    h.drain()
    assert h.completions()[0]["op"] == "spill"
    assert h.counts()["in_l3"] == 8 and h.counts()["l2_slots_used"] == 0
    h.l1()[:] = 0xEE
    for b, k in enumerate(keys):
        h.fetch(k, 7 - b)
    h.drain()
    for c in h.completions():
        assert c["ok"] and c["op"] == "fetch" and c["tier"] == "L3", c
    for b in range(8):
        assert np.array_equal(h.l1()[7 - b], datas[b])
    s = h.stats()
    assert s["offloads"] == 8 and s["offloads_to_l3"] == 7 and s["spills"] == 1
    assert s["fetches_from_l3"] == 8 and s["failures"] == 0
    assert s["bytes_to_l3"] == 8 * PAGE and s["bytes_from_l3"] == 8 * PAGE
    assert s["fetch_latency"]["count"] == 8 and sum(s["fetch_latency"]["counts"]) == 8
    for k in keys:
        h.free(k)
    h.check_invariants()
    h.close()
    assert not (tmp_path / "l3.bin").exists()  # a file the tier created goes with it


# ---- the state machine, under every completion order --------------------------------

class Model:
    """What the test expects of each key: state, tier, L1 block, freed, data."""

    def __init__(self, h):
        self.h = h
        self.keys = {}       # key -> dict(state, via, l1, freed, data)
        self.pinned = {}     # L1 block -> key moving it
        self.begun = {}      # (key, op) -> transfers begun
        self.done = {}       # (key, op) -> completions seen
        self.results = {"demote": 0, "spill": 0, "fetch": 0, "copy_up": 0, "cancelled": 0}
        self.copied = 0
        self.maybe_copied = 0

    def residents(self):
        return sum(1 for k in self.keys.values()
                   if k["state"] in ("in_l2", "spilling", "copying_up") or
                   (k["state"] in ("demoting", "fetching") and k["via"] == "L2"))

    def pages(self):
        return sum(1 for k in self.keys.values()
                   if k["state"] in ("in_l3", "spilling") or
                   (k["state"] in ("demoting", "fetching") and k["via"] == "L3"))

    def slots_used(self):
        return self.h.counts()["l2_slots_used"]

    def absorb(self):
        # A demote lets go of its L1 source once the bytes are copied out ("copied").
        for key, k in self.keys.items():
            e = self.h.entry(key)  # None: cancelled; its completion is below
            if k["state"] == "demoting" and k["l1"] is not None and e is not None and e["l1_block"] < 0:
                assert self.pinned.pop(k["l1"]) == key
                k["l1"] = None
                self.copied += 1
        for c in self.h.completions():
            key, op = c["key"], c["op"]
            self.done[(key, op)] = self.done.get((key, op), 0) + 1
            k = self.keys[key]
            assert c["ok"] or c["cancelled"], c  # no faults in this test
            if k["l1"] is not None and op in ("demote", "fetch", "copy_up"):
                assert self.pinned.pop(k["l1"]) == key
                if op == "demote":  # copied and completed within one step of the test
                    if c["ok"]:
                        self.copied += 1
                    else:
                        self.maybe_copied += 1  # cancelled: copied unless it never started
            if c["cancelled"]:
                assert k["freed"]
                del self.keys[key]
                self.results["cancelled"] += 1
                continue
            assert not k["freed"]
            self.results[op] += 1
            if op == "demote":
                k["state"] = "in_l2" if c["tier"] == "L2" else "in_l3"
            elif op == "spill":
                k["state"] = "in_l3"
            elif op == "copy_up":
                # The bytes are in L1 now, and still in L2.
                assert np.array_equal(self.h.l1()[k["l1"]], k["data"])
                assert np.array_equal(np.frombuffer(self.h.l2_data(key), dtype=np.uint8), k["data"])
                k["state"] = "in_l2"
                event("a copy up landed")
            else:
                assert np.array_equal(self.h.l1()[k["l1"]], k["data"])
                k["state"] = "resident"
            k["l1"] = None

    def check(self):
        h = self.h
        assert self.copied <= h.num_copied <= self.copied + self.maybe_copied
        h.check_invariants()
        assert sorted(h.keys()) == sorted(self.keys)
        for key, k in self.keys.items():
            e = h.entry(key)
            assert e["state"] == k["state"], (key, e, k)
            assert e["free_requested"] == k["freed"]
            if k["state"] in ("fetching", "copying_up"):
                assert h.l1_user(k["l1"]) == key
            if k["state"] in ("in_l2", "copying_up"):
                assert h.l2_data(key) is not None  # readable in L2 meanwhile
            elif k["state"] in ("in_l3", "fetching", "spilling"):
                assert h.l2_data(key) is None
            elif k["state"] == "demoting" and k["l1"] is not None:
                assert h.l1_user(k["l1"]) == key and e["l1_block"] == k["l1"]
        c = h.counts()
        assert c["in_flight"] == sum(1 for k in self.keys.values() if k["state"] in IN_FLIGHT)
        assert c["l2_residents"] == self.residents() <= h.l2_capacity
        assert c["l3_pages_used"] == self.pages()


op_strategy = st.lists(st.tuples(st.sampled_from(["demote"] * 3 + ["run"] * 5 + ["fetch"] * 2 +
                                                 ["spill", "free", "illegal", "copy_up"]),
                                 st.integers(0, 10_000), st.integers(0, 10_000)),
                       min_size=30, max_size=150)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(ops=op_strategy, l2_slots=st.integers(1, 4), staging=st.integers(1, 2), l3_pages=st.integers(1, 5))
def test_state_machine_every_block_in_one_state_and_no_transfer_lost(tmp_path_factory, ops, l2_slots, staging,
                                                                     l3_pages):
    tmp = tmp_path_factory.mktemp("tiers")
    L1 = 5
    h = make(tmp, l1=L1, l2_slots=l2_slots, l3_pages=l3_pages, manual=True, staging=staging, backend="threads")
    m = Model(h)

    def begin(key, op):
        m.begun[(key, op)] = m.begun.get((key, op), 0) + 1

    for op, a, b in ops:
        live = sorted(k for k, v in m.keys.items() if not v["freed"])
        if op == "demote":
            blk = a % L1
            if blk in m.pinned:
                with pytest.raises(errors.EngineError):
                    h.demote(blk)
            else:
                data = fill(h, blk, a * 10_007 + b)
                if m.residents() < h.l2_capacity and m.slots_used() < h.l2_slots:
                    want = "L2"
                elif m.pages() < h.l3_pages:
                    want = "L3"
                else:
                    want = None
                key = h.demote(blk)
                if want is None:
                    assert key == 0
                else:
                    assert key > 0 and h.entry(key)["via"] == want
                    if h.entry(key)["l2_slot"] < 0:
                        event("an L3 demote waited for a staging slot")
                    m.keys[key] = dict(state="demoting", via=want, l1=blk, freed=False, data=data)
                    m.pinned[blk] = key
                    begin(key, "demote")
        elif op == "spill" and live:
            # Mostly a block that can spill; sometimes any block (illegal unless in L2).
            ready = [k for k in live if m.keys[k]["state"] == "in_l2"]
            key = ready[a % len(ready)] if ready and b % 4 else live[a % len(live)]
            k = m.keys[key]
            if k["state"] != "in_l2":
                with pytest.raises(errors.EngineError):
                    h.spill(key)
            elif m.pages() < h.l3_pages:
                assert h.spill(key)
                k["state"], k["via"] = "spilling", "L3"
                begin(key, "spill")
            else:
                assert not h.spill(key)
        elif op == "fetch" and live:
            ready = [k for k in live if m.keys[k]["state"] in ("in_l2", "in_l3")]
            key = ready[a % len(ready)] if ready and b % 4 else live[a % len(live)]
            k = m.keys[key]
            blk = b % L1
            if k["state"] not in ("in_l2", "in_l3") or blk in m.pinned:
                with pytest.raises(errors.EngineError):
                    h.fetch(key, blk)
            else:
                h.l1()[blk] = 0xEE  # the caller's new block: garbage until the fetch lands
                h.fetch(key, blk)
                if h.entry(key)["l2_slot"] < 0:
                    event("an L3 fetch waited for a staging slot")
                k["via"] = "L2" if k["state"] == "in_l2" else "L3"
                k["state"], k["l1"] = "fetching", blk
                m.pinned[blk] = key
                begin(key, "fetch")
        elif op == "copy_up" and live:
            # A copy into L1 that keeps the L2 copy (a promoted cold block): only from L2.
            ready = [k for k in live if m.keys[k]["state"] == "in_l2"]
            key = ready[a % len(ready)] if ready and b % 4 else live[a % len(live)]
            k = m.keys[key]
            blk = b % L1
            if k["state"] != "in_l2" or blk in m.pinned:
                with pytest.raises(errors.EngineError):
                    h.copy_up(key, blk)
            else:
                h.l1()[blk] = 0xEE
                h.copy_up(key, blk)
                k["state"], k["l1"] = "copying_up", blk
                m.pinned[blk] = key
                begin(key, "copy_up")
        elif op == "free" and live:
            key = live[a % len(live)]
            h.free(key)
            if m.keys[key]["state"] in SETTLED:
                del m.keys[key]
            else:
                m.keys[key]["freed"] = True  # the completion will say "cancelled"
        elif op == "run":
            n = h.num_pending()
            if n:
                assert h.run_pending(a % n)
        elif op == "illegal":
            freed = [k for k, v in m.keys.items() if v["freed"]]
            if a % 3 == 0 and freed:
                with pytest.raises(errors.EngineError, match="double free"):
                    h.free(freed[0])
            elif a % 3 == 1:
                with pytest.raises(errors.EngineError, match="unknown key"):
                    h.free(10_000_000 + a)
            else:
                with pytest.raises(errors.EngineError):
                    h.fetch(10_000_000 + a, 0)
        # Completions arrive from run_pending, and also from demote/fetch calls: a freed
        # transfer that waited for a staging slot ends as soon as the queue reaches it.
        m.absorb()
        m.check()

    h.drain()
    m.absorb()
    m.check()
    assert h.in_flight() == 0 and h.num_pending() == 0
    assert not m.pinned
    assert m.done == m.begun  # every transfer begun completed exactly once
    s = h.stats()
    assert s["offloads"] == m.results["demote"]
    assert h.num_copied >= s["offloads"]  # every demote that landed was copied out first
    assert s["spills"] == m.results["spill"]
    assert s["fetches"] == m.results["fetch"] + m.results["copy_up"]  # a copy up counts as a fetch from L2
    assert s["cancelled"] == m.results["cancelled"]
    assert s["failures"] == 0
    if s["cancelled"]:
        event("a transfer completed after its block was freed")
    if s["fetches_from_l3"]:
        event("a block came back from L3")
    assert s["bytes_to_l2"] == s["offloads_to_l2"] * BLOCK
    assert s["bytes_to_l3"] == (s["offloads_to_l3"] + s["spills"]) * PAGE
    assert s["bytes_from_l3"] == s["fetches_from_l3"] * PAGE
    assert s["bytes_from_l2"] == s["fetches_from_l2"] * BLOCK
    for key in list(m.keys):
        h.free(key)
    c = h.counts()
    assert c["l2_slots_used"] == 0 and c["l3_pages_used"] == 0 and not h.keys()
    h.check_invariants()
    h.close()


def test_real_threads_with_frees_racing_completions(tmp_path, backend):
    """Completions run on worker threads while the test frees, fetches and spills."""
    L1 = 12
    h = make(tmp_path, l1=L1, l2_slots=4, l3_pages=16, staging=2, backend=backend)
    rng = random.Random(7)
    keys = {}     # key -> dict(state, l1, data, freed)
    pinned = {}
    begun = done = 0
    fetched_ok = 0

    def absorb():
        nonlocal done, fetched_ok
        for c in h.completions():
            done += 1
            k = keys[c["key"]]
            assert c["ok"] or c["cancelled"], c
            if c["op"] in ("demote", "fetch"):
                pinned.pop(k["l1"])
            if c["cancelled"] or k["freed"]:
                # Freed in flight (cancelled), or freed after the transfer ended but before
                # this loop saw it (then the free released it at once).
                assert k["freed"]
                del keys[c["key"]]
                continue
            if c["op"] == "fetch":
                assert np.array_equal(h.l1()[k["l1"]], k["data"])
                fetched_ok += 1
                k["state"] = "resident"
            else:
                k["state"] = "in_l2" if c["tier"] == "L2" else "in_l3"

    # At least 3000 operations, and on until 25 fetches have landed (a loaded machine runs
    # the transfers slower than this loop issues them), within a minute.
    deadline = time.monotonic() + 60
    i = 0
    while i < 3000 or (fetched_ok <= 25 and time.monotonic() < deadline):
        i += 1
        absorb()
        r = rng.random()
        settled = [k for k, v in keys.items() if not v["freed"] and v["state"] in ("in_l2", "in_l3")]
        if r < 0.35:
            blk = rng.randrange(L1)
            if blk not in pinned:
                data = fill(h, blk, i)
                key = h.demote(blk)
                if key:
                    keys[key] = dict(state="moving", l1=blk, data=data, freed=False)
                    pinned[blk] = key
                    begun += 1
        elif r < 0.6 and settled:
            key = rng.choice(settled)
            blk = rng.randrange(L1)
            if blk not in pinned:
                h.fetch(key, blk)
                keys[key].update(state="moving", l1=blk)
                pinned[blk] = key
                begun += 1
        elif r < 0.7 and settled:
            key = rng.choice(settled)
            if keys[key]["state"] == "in_l2" and h.spill(key):
                keys[key]["state"] = "moving"
                keys[key]["l1"] = None
                begun += 1
        else:
            live = [k for k, v in keys.items() if not v["freed"]]
            if live:
                key = rng.choice(live)
                h.free(key)  # often while its transfer is still running
                keys[key]["freed"] = True
                if keys[key]["state"] in ("in_l2", "in_l3", "resident"):
                    del keys[key]
    h.drain()
    absorb()
    assert done == begun and h.in_flight() == 0 and not pinned
    assert fetched_ok > 20  # which frees beat their completion depends on timing; the
    # manual-mode property test covers every order deterministically
    h.check_invariants()
    assert sorted(h.keys()) == sorted(keys)
    for key in list(keys):
        h.free(key)
    assert h.counts()["l2_slots_used"] == 0 and h.counts()["l3_pages_used"] == 0
    h.close()


def test_shutdown_waits_for_transfers_in_flight(tmp_path, backend):
    h = make(tmp_path, l1=16, l2_slots=2, l3_pages=32, staging=1, backend=backend)
    for b in range(16):
        fill(h, b, b)
    keys = [h.demote(b) for b in range(16)]
    assert all(keys)
    h.close()  # returns once every transfer has called back
    got = h.completions()
    assert sorted(c["key"] for c in got) == sorted(keys) and all(c["ok"] for c in got)


# ---- faults on real files -----------------------------------------------------------

def to_l3(tmp_path, n=2, backend="auto"):
    """A harness whose L2 has no resident room: every demote lands in L3."""
    h = make(tmp_path, l1=4, l2_slots=1, l3_pages=6, staging=1, backend=backend)
    assert h.l2_capacity == 0
    datas = [fill(h, b, 500 + b) for b in range(n)]
    keys = [h.demote(b) for b in range(n)]
    h.drain()
    assert all(c["ok"] and c["tier"] == "L3" for c in h.completions())
    return h, keys, datas


def fetch_one(h, key, blk=3):
    h.l1()[blk] = 0xEE
    h.fetch(key, blk)
    h.drain()
    (c,) = h.completions()
    return c


def test_corrupted_page_on_disk_is_a_checksum_error_and_never_reaches_l1(tmp_path, backend):
    h, keys, datas = to_l3(tmp_path, backend=backend)
    path = tmp_path / "l3.bin"
    off = h.l3_offset(keys[0])
    with open(path, "r+b") as f:  # real bytes on disk change: one byte in the block data
        f.seek(off + 1234)
        old = f.read(1)
        f.seek(off + 1234)
        f.write(bytes([old[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())
    c = fetch_one(h, keys[0])
    assert not c["ok"] and c["fault"] == "checksum_mismatch" and c["code"] == "CorruptFile"
    assert "checksum_mismatch" in c["message"]
    assert (h.l1()[3] == 0xEE).all()  # the bad bytes never reached L1
    assert h.entry(keys[0])["state"] == "lost"
    (line,) = h.logs()
    assert line.startswith("[KV_CACHE]") and "evict_reason=checksum_mismatch" in line and "block_id=3" in line
    assert h.stats()["faults"]["checksum_mismatch"] == 1
    # The other page is fine: the tier keeps working.
    c = fetch_one(h, keys[1], blk=2)
    assert c["ok"] and np.array_equal(h.l1()[2], datas[1])
    h.free(keys[0])
    h.free(keys[1])
    h.check_invariants()


def test_page_holding_another_blocks_bytes_is_stale(tmp_path):
    h, keys, datas = to_l3(tmp_path)
    path = tmp_path / "l3.bin"
    with open(path, "r+b") as f:  # a misdirected write: key 0's page copied over key 1's
        f.seek(h.l3_offset(keys[0]))
        page = f.read(PAGE)
        f.seek(h.l3_offset(keys[1]))
        f.write(page)
        f.flush()
        os.fsync(f.fileno())
    c = fetch_one(h, keys[1])
    assert c["fault"] == "stale_page" and c["code"] == "CorruptFile"
    c = fetch_one(h, keys[0], blk=2)
    assert c["ok"] and np.array_equal(h.l1()[2], datas[0])


def test_damaged_trailer_is_detected(tmp_path):
    h, keys, _ = to_l3(tmp_path, n=1)
    with open(tmp_path / "l3.bin", "r+b") as f:
        f.seek(h.l3_offset(keys[0]) + BLOCK + 20)  # inside the trailer's key field
        f.write(b"\xff\xff")
    c = fetch_one(h, keys[0])
    assert c["fault"] == "bad_trailer" and not c["ok"]


def test_truncated_file_is_a_short_read(tmp_path, backend):
    h, keys, datas = to_l3(tmp_path, n=3, backend=backend)
    first, middle, last = sorted(keys, key=h.l3_offset)
    path = tmp_path / "l3.bin"
    os.truncate(path, h.l3_offset(last) + PAGE // 2)  # the last page loses its second half
    c = fetch_one(h, last)
    assert c["fault"] == "short_read" and c["code"] == "CorruptFile", c
    assert h.entry(last)["state"] == "lost"
    os.truncate(path, h.l3_offset(middle))  # now the file ends where this page starts
    c = fetch_one(h, middle)
    assert c["fault"] == "short_read", c
    c = fetch_one(h, first)
    assert c["ok"] and np.array_equal(h.l1()[3], datas[keys.index(first)])
    assert h.stats()["faults"]["short_read"] == 2


def run_in_subprocess(code):
    """Runs code in a fresh interpreter (for rlimits that must not touch this process)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_no_space_when_reserving_l3_is_a_clear_error(tmp_path):
    out = run_in_subprocess(f"""
        import resource, signal
        from k25 import _C, errors
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 * {PAGE}, resource.RLIM_INFINITY))
        try:
            _C.TierHarness(4, {BLOCK}, 2 * {PAGE}, {str(tmp_path / 'l3.bin')!r}, 8 * {PAGE})
        except errors.ResourceExhaustedError as e:
            print("ERR", e)
        """)
    assert out.startswith("ERR cannot reserve l3_bytes") and "File too large" in out
    assert not (tmp_path / "l3.bin").exists()


@pytest.mark.parametrize("io", ["threads", "io_uring"])
def test_no_space_while_writing_is_handled_and_nothing_crashes(tmp_path, io):
    # The file is reserved first; then a file size limit makes every write past page 2
    # fail (EFBIG, as a full disk fails with ENOSPC).
    out = run_in_subprocess(f"""
        import resource, signal
        import numpy as np
        from k25 import _C, errors
        try:
            h = _C.TierHarness(8, {BLOCK}, 3 * {PAGE}, {str(tmp_path / 'l3.bin')!r}, 6 * {PAGE}, False, {io!r}, 1)
        except errors.UnsupportedModelError:
            print("SKIP"); raise SystemExit(0)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 * {PAGE}, resource.RLIM_INFINITY))
        rng = np.random.default_rng(0)
        h.l1()[:] = rng.integers(0, 256, h.l1().shape, dtype=np.uint8)
        want = h.l1().copy()
        keys = [h.demote(b) for b in range(6)]  # 2 resident in L2, 4 straight to L3
        h.drain()
        res = {{c["key"]: c for c in h.completions()}}
        in_l2 = [k for k in keys if res[k]["ok"] and res[k]["tier"] == "L2"]
        failed = [k for k in keys if not res[k]["ok"]]
        assert len(in_l2) == 2, res
        assert {{res[k]["fault"] for k in failed}} == {{"no_space"}}, res
        assert all(res[k]["code"] == "ResourceExhausted" for k in failed)
        assert all(h.entry(k)["state"] == "lost" for k in failed)
        assert len(failed) == 2  # pages 0 and 1 are under the limit
        # A spill that fails keeps the block in L2 (nothing is lost).
        pages_left = [h.spill(k) for k in in_l2]
        h.drain()
        sp = h.completions()
        assert all(not c["ok"] and c["fault"] == "no_space" for c in sp), sp
        assert all(h.entry(k)["state"] == "in_l2" for k in in_l2)
        h.l1()[:] = 0
        ok = [k for k in keys if res[k]["ok"]]
        for i, k in enumerate(ok):
            h.fetch(k, i)
        h.drain()
        for i, k in enumerate(ok):
            assert (h.l1()[i] == want[keys.index(k)]).all()
        logs = h.logs()
        assert sum("evict_reason=no_space" in l for l in logs) == 4, logs
        h.check_invariants()
        print("OK", h.io_backend, h.stats()["faults"]["no_space"])
        """)
    if out.startswith("SKIP"):
        pytest.skip("io_uring is not available")
    assert out.startswith("OK") and out.split()[-1] == "4", out


def test_an_io_uring_submission_the_kernel_keeps_refusing_fails_its_transfer_instead_of_hanging(tmp_path):
    # Every submission refused with EAGAIN (a kernel short of memory): once its retries are
    # spent, the refused page write fails as an I/O fault (the block is lost; the engine
    # recomputes such blocks) instead of waiting for a submission that never comes; its ring
    # entry, rewritten as a no-op, completes nothing when the next submission carries it in.
    # A subprocess: the switch is process-wide, and a hang ends in its timeout.
    out = run_in_subprocess(f"""
        import numpy as np
        from k25 import _C, errors
        try:
            h = _C.TierHarness(8, {BLOCK}, 3 * {PAGE}, {str(tmp_path / 'l3.bin')!r}, 6 * {PAGE}, False, "io_uring", 1)
        except errors.UnsupportedModelError:
            print("SKIP"); raise SystemExit(0)
        rng = np.random.default_rng(0)
        h.l1()[:] = rng.integers(0, 256, h.l1().shape, dtype=np.uint8)
        want = h.l1().copy()
        resident = [h.demote(b) for b in range(2)]  # the two L2 slots besides the staging one
        h.drain()
        assert all(c["ok"] and c["tier"] == "L2" for c in h.completions())
        _C.refuse_uring_submits_for_test(True)
        refused = h.demote(2)  # to L3: its page write is refused throughout
        h.drain()
        c = h.completions()
        assert len(c) == 1 and c[0]["key"] == refused and not c[0]["ok"] and c[0]["fault"] == "io_error", c
        assert h.entry(refused)["state"] == "lost"
        _C.refuse_uring_submits_for_test(False)
        later = h.demote(3)  # this write's submission carries the no-op in too
        h.drain()
        c = h.completions()
        assert len(c) == 1 and c[0]["key"] == later and c[0]["ok"] and c[0]["tier"] == "L3", c
        h.l1()[4] = 0
        h.fetch(later, 4)
        h.drain()
        assert all(x["ok"] for x in h.completions())
        assert (h.l1()[4] == want[3]).all()
        assert h.completions() == []
        assert sum("evict_reason=io_error" in l for l in h.logs()) == 1
        h.check_invariants()
        h.close()
        print("OK")
        """)
    if out.startswith("SKIP"):
        pytest.skip("io_uring is not available")
    assert out.startswith("OK"), out


def test_unopenable_l3_path_is_a_clear_error(tmp_path):
    with pytest.raises(errors.K25IOError, match="cannot open l3_path /nonexistent-k25-dir/l3.bin"):
        _C.TierHarness(4, BLOCK, 2 * PAGE, "/nonexistent-k25-dir/l3.bin", 4 * PAGE)
    with pytest.raises(errors.K25IOError, match="cannot open l3_path /proc/k25-l3.bin"):
        _C.TierHarness(4, BLOCK, 2 * PAGE, "/proc/k25-l3.bin", 4 * PAGE)  # refused even to root
    with pytest.raises(errors.InvalidArgumentError, match="neither a regular file nor a block device"):
        _C.TierHarness(4, BLOCK, 2 * PAGE, str(tmp_path), 4 * PAGE)
    with pytest.raises(errors.InvalidArgumentError, match="holds no L3 page"):
        _C.TierHarness(4, BLOCK, 2 * PAGE, str(tmp_path / "x.bin"), PAGE - 1)
    with pytest.raises(errors.InvalidArgumentError, match="holds no L2 slot"):
        _C.TierHarness(4, BLOCK, PAGE - 1, str(tmp_path / "x.bin"), 4 * PAGE)
    assert not (tmp_path / "x.bin").exists()
