"""K25Model's public behaviour on the default model (SmolLM2-135M-Instruct GGUF).

Expectations come from independent sources: the model's own teacher-forced logits
(`score()`), torch.log_softmax, the tokenizer's decode of a reference greedy run, and solo
runs compared with batched / threaded / streamed ones.
"""
import asyncio
import json
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from k25 import K25Config, K25Model, _C, errors
from k25.model import resolve_model_path

PROMPT = "The capital of France is"
EOS_PROMPT = "Write a haiku about the sea."          # greedy output ends with EOS after ~13 tokens
EMOJI_PROMPT = "Emoji for happy: 😀, sad: 😢, angry:"  # greedy output has emoji split over tokens
REF_LEN = 16


def small_config(**kw):
    return K25Config(num_threads=2, **{"kv_cache_bytes": 16 << 20, **kw})


def wait_until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


async def async_wait_until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return pred()


def idle(m):
    s = m.stats()
    return s["blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0


def log_softmax(row):
    return torch.log_softmax(torch.from_numpy(np.asarray(row)).double(), -1).numpy()


@pytest.fixture(scope="module")
def ref(default_model):
    """A greedy reference run (ignore_eos, logprobs=5) plus the teacher-forced logits row
    for every generated position, each from its own score(prompt + generated[:i]) call."""
    m = default_model
    prompt = m.tokenize(PROMPT)
    out = m.generate(PROMPT, max_new_tokens=REF_LEN, temperature=0.0, ignore_eos=True, logprobs=5)[0]
    rows = np.stack([m.score(prompt + out.token_ids[:i])[-1] for i in range(REF_LEN)])
    return prompt, out, rows


@pytest.fixture(scope="module")
def eos_run(default_model):
    out = default_model.generate(EOS_PROMPT, max_new_tokens=30, temperature=0.0)[0]
    assert out.finish_reason == "stop"  # the setup this module relies on
    return out


# ---------------------------------------------------------------------------------------
# generate: prompt forms, lengths, finish reasons

def test_generate_accepts_every_prompt_form_in_order(default_model, eos_run):
    m = default_model
    kw = dict(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    solo = [m.generate(p, **kw)[0] for p in (PROMPT, EOS_PROMPT)]
    assert solo[0].token_ids != solo[1].token_ids
    ids = [m.tokenize(PROMPT), m.tokenize(EOS_PROMPT)]
    for form in ([PROMPT, EOS_PROMPT], ids, (PROMPT, EOS_PROMPT)):
        outs = m.generate(form, **kw)
        assert len(outs) == 2
        for o, s, i in zip(outs, solo, ids):
            assert o.prompt_token_ids == i
            assert o.token_ids == s.token_ids and o.text == s.text
    single_ids = m.generate(ids[0], **kw)      # a flat list of ids is one prompt
    assert len(single_ids) == 1 and single_ids[0].token_ids == solo[0].token_ids
    single_str = m.generate(PROMPT, **kw)
    assert len(single_str) == 1 and single_str[0].text == solo[0].text
    assert solo[0].text == m.detokenize(solo[0].token_ids)


@pytest.mark.parametrize("n", [1, 5])
def test_length_finish_at_max_new_tokens(default_model, n):
    out = default_model.generate([PROMPT, EOS_PROMPT], max_new_tokens=n, temperature=0.8, seed=3,
                                 ignore_eos=True)
    for o in out:
        assert len(o.token_ids) == n and o.num_output_tokens == n
        assert o.finish_reason == "length"


def test_max_new_tokens_is_an_upper_bound(default_model):
    outs = default_model.generate([EOS_PROMPT, PROMPT], max_new_tokens=14, temperature=0.0)
    for o in outs:
        assert len(o.token_ids) <= 14
    assert outs[0].finish_reason == "stop" and outs[1].finish_reason == "length"


def test_eos_ends_generation_with_eos_last(default_model, eos_run):
    eos = set(default_model.eos_token_ids)
    toks = eos_run.token_ids
    assert toks[-1] in eos and not eos & set(toks[:-1])
    assert eos_run.text == default_model.detokenize(toks[:-1])
    # ignore_eos=True runs through the same EOS and keeps going
    out = default_model.generate(EOS_PROMPT, max_new_tokens=len(toks) + 2, temperature=0.0, ignore_eos=True)[0]
    assert out.finish_reason == "length" and out.token_ids[:len(toks)] == toks


def test_min_new_tokens_prevents_early_eos(default_model, eos_run):
    m = default_model
    eos = set(m.eos_token_ids)
    k = len(eos_run.token_ids) - 1         # the index where the model greedily picks EOS
    min_new = k + 3
    out = m.generate(EOS_PROMPT, max_new_tokens=min_new + 2, min_new_tokens=min_new, temperature=0.0)[0]
    assert len(out.token_ids) >= min_new
    assert not eos & set(out.token_ids[:min_new])
    assert out.token_ids[:k] == eos_run.token_ids[:k]
    # at the EOS position the best non-EOS id under teacher forcing is chosen instead
    row = m.score(m.tokenize(EOS_PROMPT) + out.token_ids[:k])[-1].copy()
    row[list(eos)] = -np.inf
    assert out.token_ids[k] == int(np.argmax(row))


def test_stop_token_ids_end_generation_at_that_token(default_model, ref):
    _, out, _ = ref
    toks = out.token_ids
    k = next(i for i in range(3, REF_LEN) if toks[i] not in toks[:i])
    got = default_model.generate(PROMPT, max_new_tokens=REF_LEN, temperature=0.0, ignore_eos=True,
                                 stop_token_ids=[toks[k]])[0]
    assert got.finish_reason == "stop"
    assert got.token_ids == toks[:k + 1]


def _stop_case(m, out):
    """A stop string spanning two tokens of the reference output, and the index of the
    token that completes it (found by decoding growing prefixes)."""
    toks = out.token_ids
    for a in range(3, REF_LEN - 2):
        pa, pb = m.detokenize([toks[a]]), m.detokenize([toks[a + 1]])
        if len(pa.strip()) >= 2 and len(pb.strip()) >= 1 and pa.isascii() and pb.isascii():
            stop = pa[-2:] + pb[:1]
            if stop in m.detokenize(toks[:a + 1]):
                continue
            end = next(j for j in range(len(toks)) if stop in m.detokenize(toks[:j + 1]))
            assert end == a + 1
            return stop, end
    pytest.fail("no stop string found in the reference output")


def test_stop_string_cuts_text_and_ends_at_completing_token(default_model, ref):
    m = default_model
    _, out, _ = ref
    stop, end = _stop_case(m, out)
    got = m.generate(PROMPT, max_new_tokens=REF_LEN, temperature=0.0, ignore_eos=True, stop=[stop, "zzzq"])[0]
    assert got.finish_reason == "stop"
    assert got.token_ids == out.token_ids[:end + 1]
    assert got.text == out.text[:out.text.index(stop)]
    assert stop not in got.text


def test_seed_determinism(default_model):
    m = default_model
    kw = dict(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    a = m.generate(PROMPT, seed=7, **kw)[0].token_ids
    b = m.generate(PROMPT, seed=7, **kw)[0].token_ids
    assert a == b
    # the same seed gives the same tokens whatever batch the request runs in
    batch = m.generate([PROMPT, EOS_PROMPT, PROMPT], seed=7, **kw)
    assert batch[0].token_ids == a and batch[2].token_ids == a
    others = [m.generate(PROMPT, seed=s, **kw)[0].token_ids for s in (1, 2, 3, 4)]
    assert len({tuple(t) for t in others + [a]}) > 1


# ---------------------------------------------------------------------------------------
# logprobs and teacher forcing

def test_logprobs_match_log_softmax_of_score(default_model, ref):
    prompt, out, rows = ref
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == REF_LEN
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        ls = log_softmax(rows[i])
        assert lp.token_id == tok
        assert abs(lp.logprob - ls[tok]) < 1e-4, i
        assert len(lp.top) == 5
        for t, v in lp.top.items():
            assert abs(v - ls[t]) < 1e-4
        srt = np.sort(ls)[::-1]
        if srt[4] - srt[5] > 1e-3:   # the top-5 set is well defined
            assert set(lp.top) == set(np.argsort(-ls)[:5].tolist())


def test_greedy_tokens_are_argmax_of_teacher_forced_logits(default_model, ref):
    prompt, out, rows = ref
    compared = 0
    for i, tok in enumerate(out.token_ids):
        top2 = np.sort(rows[i])[-2:]
        if top2[1] - top2[0] < 1e-3:
            break  # a near tie: the runs may part here
        assert tok == int(np.argmax(rows[i])), i
        compared += 1
    assert compared >= 10
    # one full-sequence score gives the same rows (causality)
    full = default_model.score(prompt + out.token_ids)
    np.testing.assert_allclose(full[len(prompt) - 1:-1], rows, atol=2e-4)


def test_sampled_run_logprobs_are_raw_model_logprobs(default_model):
    m = default_model
    prompt = m.tokenize(PROMPT)
    out = m.generate(PROMPT, max_new_tokens=8, temperature=1.3, top_k=40, repetition_penalty=1.2,
                     seed=11, ignore_eos=True, logprobs=3)[0]
    rows = m.score(prompt + out.token_ids)[len(prompt) - 1:-1]
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        ls = log_softmax(rows[i])
        assert lp.token_id == tok and abs(lp.logprob - ls[tok]) < 2e-4
        assert len(lp.top) == 3 and all(abs(v - ls[t]) < 2e-4 for t, v in lp.top.items())


def test_engine_penalties_match_numpy_reference_on_teacher_forced_logits(default_model):
    m = default_model
    prompt = m.tokenize("Repeat after me: apple apple apple apple apple")
    kw = dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4)
    out = m.generate([prompt], max_new_tokens=8, temperature=0.0, ignore_eos=True, **kw)[0]
    plain = m.generate([prompt], max_new_tokens=8, temperature=0.0, ignore_eos=True)[0]
    assert out.token_ids != plain.token_ids      # the penalties changed the output
    P = len(prompt)
    compared = 0
    for i, tok in enumerate(out.token_ids):
        hist = prompt + out.token_ids[:i]
        x = m.score(hist)[-1].astype(np.float64)
        for t in set(hist):                       # repetition: prompt and output
            x[t] = x[t] / 1.4 if x[t] > 0 else x[t] * 1.4
        ids, counts = np.unique(np.array(hist[P:], dtype=np.int64), return_counts=True)
        for t, c in zip(ids, counts):             # presence/frequency: output only
            x[t] -= 0.6 + 0.4 * c
        top2 = np.sort(x)[-2:]
        if top2[1] - top2[0] < 1e-3:
            break
        assert tok == int(np.argmax(x)), i
        compared += 1
    assert compared >= 6


def test_top_k_1_and_every_priority_are_greedy(default_model, ref):
    m = default_model
    _, out, _ = ref
    for pr in ("gold", "silver", "bronze"):
        got = m.generate(PROMPT, max_new_tokens=4, temperature=1.5, top_k=1, seed=5, ignore_eos=True,
                         priority=pr)[0]
        assert got.token_ids == out.token_ids[:4]


def test_max_new_tokens_zero_and_stop_only_in_prompt(default_model, ref):
    m = default_model
    _, out, _ = ref
    z = m.generate(PROMPT, max_new_tokens=0)[0]
    assert z.token_ids == [] and z.text == "" and z.finish_reason == "length"
    assert asyncio.run(collect(m, PROMPT, max_new_tokens=0)) == []
    # a stop string that occurs in the prompt but not in the output never matches
    word = "France"
    assert word not in out.text
    got = m.generate(PROMPT, max_new_tokens=6, temperature=0.0, ignore_eos=True, stop=word)[0]
    assert got.token_ids == out.token_ids[:6] and got.finish_reason == "length"


def test_no_logprobs_unless_asked(default_model):
    out = default_model.generate(PROMPT, max_new_tokens=2, temperature=0.0)[0]
    assert out.logprobs is None
    out = default_model.generate(PROMPT, max_new_tokens=2, temperature=0.0, logprobs=0)[0]
    assert len(out.logprobs) == 2 and all(lp.top == {} for lp in out.logprobs)


# ---------------------------------------------------------------------------------------
# streaming

async def collect(m, prompt, **kw):
    return [p async for p in m.stream(prompt, **kw)]


def test_stream_concatenates_to_generate_text(default_model, ref):
    m = default_model
    _, out, _ = ref
    pieces = asyncio.run(collect(m, PROMPT, max_new_tokens=REF_LEN, temperature=0.0, ignore_eos=True))
    assert "".join(pieces) == out.text
    assert len(pieces) > 3 and all(pieces)


def test_stream_multibyte_characters_are_never_split(default_model):
    m = default_model
    kw = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    out = m.generate(EMOJI_PROMPT, **kw)[0]
    tb = m.tokenizer.token_bytes()

    def valid(b):
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False
    # the setup: non-ASCII output with characters split across tokens
    assert not out.text.isascii() and "\ufffd" not in out.text
    assert any(not valid(tb[t]) for t in out.token_ids)
    pieces = asyncio.run(collect(m, EMOJI_PROMPT, **kw))
    assert "".join(pieces) == out.text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_with_stop_string_never_yields_it(default_model, ref):
    m = default_model
    _, out, _ = ref
    stop, _ = _stop_case(m, out)
    pieces = asyncio.run(collect(m, PROMPT, max_new_tokens=REF_LEN, temperature=0.0, ignore_eos=True, stop=stop))
    text = "".join(pieces)
    assert text == out.text[:out.text.index(stop)]
    assert stop not in text and not any(stop in p for p in pieces)


def test_stream_releases_held_back_stop_prefix_at_the_end(default_model, ref):
    # The output ends with the start of a stop string that never completes: streaming
    # holds those characters back while it might, and must yield them at the finish.
    m = default_model
    _, out, _ = ref
    tail = out.text[-3:]
    stop = tail + "\x01never"
    kw = dict(max_new_tokens=REF_LEN, temperature=0.0, ignore_eos=True, stop=stop)
    pieces = asyncio.run(collect(m, PROMPT, **kw))
    assert "".join(pieces) == out.text
    # before the finish, what was shown never ends with a start of the stop string
    shown = ""
    for piece in pieces[:-1]:
        shown += piece
        assert not any(shown.endswith(stop[:k]) for k in range(1, len(stop))), shown
    assert pieces[-1].endswith(tail)
    got = m.generate(PROMPT, **kw)[0]
    assert got.text == out.text and got.finish_reason == "length"


def test_breaking_out_of_stream_aborts_request(default_model):
    m = default_model
    before = m.stats()

    async def main():
        n = 0
        async for _ in m.stream(PROMPT, max_new_tokens=200, temperature=0.0, ignore_eos=True):
            n += 1
            if n == 2:
                assert m.stats()["blocks_used"] > 0
                break
        ok = await async_wait_until(lambda: m.stats()["requests_aborted"] == before["requests_aborted"] + 1)
        return ok and await async_wait_until(lambda: idle(m))

    assert asyncio.run(main())
    after = m.stats()
    assert after["requests_finished"] == before["requests_finished"]
    assert after["generated_tokens"] - before["generated_tokens"] < 200
    assert m.generate(PROMPT, max_new_tokens=2, temperature=0.0)[0].finish_reason == "length"


def test_cancelling_a_stream_task_aborts_request(default_model):
    m = default_model
    before = m.stats()["requests_aborted"]

    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in m.stream(PROMPT, max_new_tokens=200, temperature=0.0, ignore_eos=True):
                started.set()
        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await async_wait_until(lambda: m.stats()["requests_aborted"] == before + 1 and idle(m))

    assert asyncio.run(main())


def test_a_cancel_landing_with_an_output_still_ends_the_stream_and_aborts(default_model, monkeypatch):
    """The server's disconnect watcher cancels a request's task once. That cancellation must
    end the stream and abort the request also when it arrives just as the next output is
    read: asyncio.wait_for (Python 3.11) returned the output and dropped the cancellation,
    so the request ran on to its end (tests/python/test_server.py's non-streaming
    disconnect test failed that way now and then). The engine is a fake here, so that the
    output and the cancel land in chosen turns of the event loop."""
    m = default_model
    sinks, aborted = [], []

    def submit(ids, params, priority, sink, *args, **kwargs):
        sinks.append(sink)
        return len(sinks)

    class Engine:
        def abort(self, rid):
            aborted.append(rid)

    monkeypatch.setattr(m, "_submit", submit)
    monkeypatch.setattr(m, "_engine", Engine())
    step = SimpleNamespace(finish_reason=None, finished=False, new_token_ids=[42], new_logprobs=[],
                           stop_string="", num_output_tokens=1, queue_time_s=0.0, prefill_chunks=1,
                           prefill_time_s=0.0, num_preemptions=0, error="")

    async def consume():
        async for _ in m.stream_events(PROMPT, max_new_tokens=50):
            pass

    async def trial(turns_before_output, turns_before_cancel):
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)  # the stream has submitted and waits for its first output
        for _ in range(turns_before_output):
            await asyncio.sleep(0)
        sinks[-1].queue.put_nowait(step)
        for _ in range(turns_before_cancel):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait((task,), timeout=2.0)
        ended = task.cancelled()
        if not task.done():  # the cancellation was lost: end it for good
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return ended

    async def main():
        return [await trial(a, b) for a in range(3) for b in range(5)]

    ended = asyncio.run(main())
    assert all(ended), f"cancellations lost in {ended.count(False)} of {len(ended)} orders"
    assert aborted == list(range(1, len(sinks) + 1))


def test_many_concurrent_streams_complete(default_model):
    m = default_model
    prompts = [f"Count from {i} to {i + 5}:" for i in range(6)] + [PROMPT, EOS_PROMPT]
    kw = dict(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    expect = [o.text for o in m.generate(prompts, **kw)]

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(collect(m, p, **kw) for p in prompts)), 60)

    got = ["".join(p) for p in asyncio.run(main())]
    assert got == expect
    assert wait_until(lambda: idle(m))


# ---------------------------------------------------------------------------------------
# threads

def test_generate_from_several_threads_matches_solo_runs(default_model):
    m = default_model
    prompts = [PROMPT, EOS_PROMPT, "One, two, three,", "def fibonacci(n):"]
    kw = dict(max_new_tokens=8, temperature=0.0)
    solo = [m.generate(p, **kw)[0].token_ids for p in prompts]
    results = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def worker(i):
        barrier.wait()
        results[i] = m.generate(prompts[i], **kw)[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == solo


# ---------------------------------------------------------------------------------------
# stats and introspection

def test_stats_counters(default_model):
    m = default_model
    s0 = m.stats()
    outs = m.generate([PROMPT, EOS_PROMPT, "Hello"], max_new_tokens=15, temperature=0.0)
    s1 = m.stats()
    assert s1["requests_added"] - s0["requests_added"] == 3
    assert s1["requests_finished"] - s0["requests_finished"] == 3
    assert s1["generated_tokens"] - s0["generated_tokens"] == sum(len(o.token_ids) for o in outs)
    assert s1["steps"] > s0["steps"]
    assert s1["blocks_used"] == 0 and s1["blocks_free"] == s1["blocks_total"] == s0["blocks_total"]
    assert s1["running"] == 0 and s1["waiting"] == 0
    assert s1["requests_aborted"] == s0["requests_aborted"]
    assert s1["kv_cache_bytes"] == s1["blocks_total"] * s1["kv_block_bytes"] <= 512 << 20
    assert m.get_gpu_memory_usage() == 0
    assert m.get_current_sparsity_ratio() == 0.0
    assert m.get_offload_count() == 0


# ---------------------------------------------------------------------------------------
# bad input

BAD_REQUESTS = [
    ("", {}, errors.RequestError),
    ([], {}, errors.RequestError),
    ([[]], {}, errors.RequestError),
    ([[1, 2], []], {}, errors.RequestError),
    ([1, 2.5], {}, errors.RequestError),
    ([[1, "a"]], {}, errors.RequestError),
    ([True, 2], {}, errors.RequestError),
    (None, {}, errors.RequestError),
    (42, {}, errors.RequestError),
    ([[1, 49152]], {}, errors.InvalidArgumentError),
    ([[1, 10 ** 6]], {}, errors.InvalidArgumentError),
    ([[-1, 5]], {}, errors.InvalidArgumentError),
    (PROMPT, {"max_new_tokens": -1}, errors.InvalidArgumentError),
    (PROMPT, {"min_new_tokens": -1}, errors.InvalidArgumentError),
    (PROMPT, {"temperature": -0.5}, errors.InvalidArgumentError),
    (PROMPT, {"temperature": "hot"}, errors.RequestError),
    (PROMPT, {"top_p": 0.0}, errors.InvalidArgumentError),
    (PROMPT, {"top_p": 1.5}, errors.InvalidArgumentError),
    (PROMPT, {"top_k": -1}, errors.InvalidArgumentError),
    (PROMPT, {"min_p": 1.5}, errors.InvalidArgumentError),
    (PROMPT, {"repetition_penalty": 0.0}, errors.InvalidArgumentError),
    (PROMPT, {"presence_penalty": 3.0}, errors.InvalidArgumentError),
    (PROMPT, {"logprobs": 21}, errors.InvalidArgumentError),
    (PROMPT, {"stop_token_ids": [10 ** 6]}, errors.InvalidArgumentError),
    (PROMPT, {"stop": [""]}, errors.InvalidArgumentError),
    (PROMPT, {"priority": "platinum"}, errors.RequestError),
    (PROMPT, {"no_such_option": 1}, TypeError),
]


@pytest.mark.parametrize("prompt,kw,exc", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_input_raises_typed_error_and_model_keeps_working(default_model, prompt, kw, exc):
    m = default_model
    added = m.stats()["requests_added"]
    with pytest.raises(exc):
        m.generate(prompt, **kw)
    assert m.stats()["requests_added"] == added   # nothing was queued
    out = m.generate(PROMPT, max_new_tokens=2, temperature=0.0, ignore_eos=True)[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


def test_bad_prompt_later_in_batch_queues_nothing(default_model):
    # Every prompt of a batch is checked before the first is queued.
    m = default_model
    before = m.stats()
    with pytest.raises(errors.InvalidArgumentError):
        m.generate([m.tokenize(PROMPT), [1, 10 ** 6]], max_new_tokens=50, temperature=0.0, ignore_eos=True)
    assert m.stats()["requests_added"] == before["requests_added"]
    assert idle(m)
    assert m.generate(PROMPT, max_new_tokens=2, temperature=0.0)[0].token_ids


def test_a_batch_is_queued_at_once(default_model):
    # generate() hands the engine its prompts in one call: all of them or none are queued,
    # and the engine sees them together (the same schedule on every run).
    m = default_model
    before = m.stats()
    params = m._params(max_new_tokens=4)
    with pytest.raises(errors.InvalidArgumentError):
        m._engine.add_requests([m.tokenize(PROMPT), [1, 10 ** 6]], params, 1)
    assert m.stats()["requests_added"] == before["requests_added"]
    assert idle(m)
    prompts = [m.tokenize(p) for p in ("One", "Two words", "Three more words", "Four, now five words")]
    for _ in range(3):
        s0 = m.stats()
        outs = m.generate(prompts, max_new_tokens=1, temperature=0.0)
        s1 = m.stats()
        assert [len(o.token_ids) for o in outs] == [1, 1, 1, 1]
        assert s1["steps"] - s0["steps"] == 1  # one prefill step for the four


def test_bad_stream_request_raises(default_model):
    async def main():
        with pytest.raises(errors.InvalidArgumentError):
            await collect(default_model, PROMPT, top_p=2.0)
        with pytest.raises(errors.RequestError):
            await collect(default_model, "")
    asyncio.run(main())


def test_prompt_too_long(default_model):
    with K25Model(small_config(max_seq_len=64)) as m:
        assert m.max_seq_len == 64
        ids = m.tokenize("one two three four five six seven eight nine ten " * 10)[:70]
        with pytest.raises(errors.PromptTooLongError):
            m.generate([ids], max_new_tokens=4)
        with pytest.raises(errors.PromptTooLongError):
            m.generate([ids[:64]], max_new_tokens=4)
        with pytest.raises(errors.PromptTooLongError):
            asyncio.run(collect(m, ids[:64], max_new_tokens=4))
        # 63 tokens fit with one new token; generation stops at max_seq_len
        out = m.generate([ids[:63]], max_new_tokens=10, temperature=0.0, ignore_eos=True)[0]
        assert len(out.token_ids) == 1 and out.finish_reason == "length"
        # scoring needs no room for a new token
        assert m.score(ids[:64]).shape == (64, m.model_config["vocab_size"])
        assert m.generate(PROMPT, max_new_tokens=3, temperature=0.0, ignore_eos=True)[0].finish_reason == "length"


def test_request_that_never_fits_kv_pool(default_model):
    two_blocks = 2 * default_model.kv_block_bytes    # 2 blocks of 16 tokens
    with K25Model(K25Config(num_threads=2, kv_cache_bytes=two_blocks)) as m:
        assert m.stats()["blocks_total"] == 2
        ids = m.tokenize(PROMPT)
        with pytest.raises(errors.ResourceExhaustedError):
            m.generate([ids], max_new_tokens=100)
        with pytest.raises(errors.ResourceExhaustedError):
            m.generate([list(range(100, 140))], max_new_tokens=1)
        out = m.generate([ids], max_new_tokens=32 - len(ids), temperature=0.0, ignore_eos=True)[0]
        assert len(out.token_ids) == 32 - len(ids)
        assert wait_until(lambda: idle(m))


def test_kv_cache_bytes_smaller_than_a_block(default_model):
    with pytest.raises(errors.ConfigError):
        K25Model(K25Config(num_threads=2, kv_cache_bytes=default_model.kv_block_bytes - 1))


# ---------------------------------------------------------------------------------------
# lifetime

def test_close_is_idempotent_and_later_calls_raise():
    m = K25Model(small_config(max_seq_len=256))
    assert m.generate(PROMPT, max_new_tokens=2, temperature=0.0)[0].token_ids
    m.close()
    m.close()
    with pytest.raises(errors.EngineError):
        m.generate(PROMPT, max_new_tokens=2)
    with pytest.raises(errors.EngineError):
        m.score(m.tokenize(PROMPT))
    with pytest.raises(errors.EngineError):
        asyncio.run(collect(m, PROMPT, max_new_tokens=2))


def test_context_manager_closes():
    with K25Model(small_config(max_seq_len=256)) as m:
        out = m.generate(PROMPT, max_new_tokens=3, temperature=0.0, ignore_eos=True)[0]
        assert len(out.token_ids) == 3
    with pytest.raises(errors.EngineError):
        m.generate(PROMPT, max_new_tokens=2)
    m.close()


def test_close_while_generating_unblocks_the_caller():
    m = K25Model(small_config(max_seq_len=256))
    box = {}

    def worker():
        try:
            box["out"] = m.generate(PROMPT, max_new_tokens=250, temperature=0.0, ignore_eos=True)[0]
        except BaseException as e:  # noqa: BLE001
            box["exc"] = e

    t = threading.Thread(target=worker)
    t.start()
    assert wait_until(lambda: m.stats()["generated_tokens"] > 0)
    m.close()
    t.join(15)
    assert not t.is_alive()
    if "exc" in box:
        assert isinstance(box["exc"], errors.EngineError)
    else:
        assert box["out"].finish_reason == "abort" and len(box["out"].token_ids) < 250


# ---------------------------------------------------------------------------------------
# K25Config validation

_NEEDS_NO_CUDA = pytest.mark.skipif(_C.cuda_available(), reason="valid where a CUDA device exists")


@pytest.mark.parametrize("kw", [
    pytest.param(dict(device="cuda"), marks=_NEEDS_NO_CUDA), pytest.param(dict(device="cuda:0"), marks=_NEEDS_NO_CUDA),
    dict(device="tpu"), dict(device="cuda:x"),
    dict(device="cpu", dtype="bfloat16"), dict(device="cpu", dtype="float16"), dict(dtype="float64"),
    dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8"),
    dict(enable_prefix_caching="yes"), dict(enable_dynamic_sparsity=True, enable_kernel_fusion=False),
        dict(sparsity_compensation=True), dict(sparsity_mass_target=1.5), dict(sparsity_sink_blocks=0),
    dict(sparsity_score_channels=-1), dict(sparsity_score_channels=True),
    dict(cache_mode="hierarchical"), dict(cache_mode="bogus"), dict(enable_async_offload=True),
    dict(l2_bytes=1 << 30), dict(l3_path="/tmp/x"), dict(device="cpu", gpu_memory_utilization=0.9),
    dict(block_size=0), dict(block_size=300), dict(max_batch_size=0), dict(max_batch_size=-1),
    dict(max_sparsity_ratio=0.9), dict(max_sparsity_ratio=0.05), dict(max_seq_len=0),
    dict(kv_cache_bytes=0), dict(num_threads=0), dict(prefill_chunk_size=0),
    dict(max_num_batched_tokens=0), dict(max_batch_size=2.5),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_unsupported_config_raises_config_error(kw):
    with pytest.raises(errors.ConfigError):
        K25Config(**kw)
    with pytest.raises(errors.ConfigError):
        K25Model(**kw)


def test_supported_config_values_are_accepted():
    K25Config(device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=256,
              max_sparsity_ratio=0.8, cache_mode="standard")


def test_max_seq_len_beyond_model_context(default_model):
    ctx = default_model.model_config["max_position_embeddings"]
    with pytest.raises(errors.ConfigError):
        K25Model(K25Config(num_threads=2, max_seq_len=ctx + 1, kv_cache_bytes=16 << 20))


# ---------------------------------------------------------------------------------------
# model loading errors

def _load(path):
    return K25Model(K25Config(model_path=str(path), num_threads=2, kv_cache_bytes=16 << 20))


def test_missing_path(tmp_path):
    with pytest.raises(errors.ModelNotFoundError):
        _load(tmp_path / "no-such-model.gguf")


def test_truncated_gguf_copies(tmp_path):
    from k25 import _C
    src = resolve_model_path(None)
    size = os.path.getsize(src)
    data_offset = _C.read_gguf(str(src))["data_offset"]
    cuts = {"10B": 10, "header-100B": 100, "header-5000B": 5000, "1MB": 1 << 20,
            "tensor-data": data_offset + 4096, "middle": size // 2, "last-byte": size - 1}
    with open(src, "rb") as f:
        head = f.read(size // 2)
    for name, n in cuts.items():
        p = tmp_path / f"{name}.gguf"
        with open(p, "wb") as g:
            if n <= len(head):
                g.write(head[:n])
            else:
                with open(src, "rb") as f:
                    g.write(f.read(n))
        with pytest.raises(errors.CorruptModelError):
            _load(p)
        p.unlink()


def test_random_bytes_gguf(tmp_path):
    rng = np.random.default_rng(0)
    p = tmp_path / "x.gguf"
    p.write_bytes(rng.bytes(8192))
    with pytest.raises((errors.UnsupportedModelError, errors.CorruptModelError)):
        _load(p)
    p.write_bytes(b"GGUF" + rng.bytes(8192))
    with pytest.raises((errors.UnsupportedModelError, errors.CorruptModelError)):
        _load(p)
    p.write_bytes(b"")
    with pytest.raises((errors.UnsupportedModelError, errors.CorruptModelError)):
        _load(p)


def test_hf_dir_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256, "n_embd": 64,
        "n_layer": 2, "n_head": 4}))
    with pytest.raises(errors.UnsupportedModelError):
        _load(tmp_path)


def test_hf_dir_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{model_type: llama,")
    with pytest.raises(errors.CorruptModelError):
        _load(tmp_path)


def test_hf_dir_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path), safe_serialization=True)
    # the complete checkpoint loads and runs (token ids only: it has no tokenizer)
    with _load(tmp_path) as m:
        out = m.generate([[1, 2, 3]], max_new_tokens=3, temperature=0.0, ignore_eos=True)[0]
        assert len(out.token_ids) == 3 and all(0 <= t < 256 for t in out.token_ids)
        with pytest.raises(errors.RequestError):
            m.generate("text needs a tokenizer", max_new_tokens=2)
        with pytest.raises(errors.InvalidArgumentError):
            m.generate([[1, 2, 3]], max_new_tokens=2, stop=["x"])
    st = tmp_path / "model.safetensors"
    tensors = load_file(str(st))
    name = "model.layers.1.self_attn.k_proj.weight"
    assert name in tensors
    del tensors[name]
    save_file(tensors, str(st), metadata={"format": "pt"})
    with pytest.raises(errors.ModelNotFoundError) as ei:
        _load(tmp_path)
    assert "k_proj" in str(ei.value)


def test_a_dropped_model_is_collected_and_its_engine_stops():
    import gc
    import threading
    import time
    import weakref
    from k25 import K25Config, K25Model
    before = threading.active_count()
    m = K25Model(K25Config(num_threads=2, kv_cache_bytes=64 << 20))
    m.generate("Hi", max_new_tokens=2, temperature=0.0)
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None, "something still holds the model"
    deadline = time.time() + 5
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before  # the dispatcher thread ended


def test_concurrent_close_does_not_hang():
    m = K25Model(K25Config(num_threads=2, kv_cache_bytes=64 << 20))
    box = {}

    def gen():
        try:
            box["r"] = m.generate([list(range(10, 3000))], max_new_tokens=4, temperature=0.0)
        except errors.K25Error as e:
            box["r"] = e
    worker = threading.Thread(target=gen, daemon=True)
    worker.start()
    time.sleep(0.3)  # the long prefill is running
    closers = [threading.Thread(target=m.close, daemon=True) for _ in range(3)]
    for t in closers:
        t.start()
    for t in closers + [worker]:
        t.join(timeout=30)
        assert not t.is_alive(), "close() hung"


def test_tiny_temperature_is_greedy_and_fails_nobody(default_model):
    ids = default_model.tokenize("The weather today is")
    greedy = default_model.generate([ids], max_new_tokens=6, temperature=0.0)[0].token_ids
    outs = default_model.generate([ids, ids], max_new_tokens=6, temperature=1e-30)
    assert [o.token_ids for o in outs] == [greedy, greedy]


def test_a_bad_sampling_row_fails_only_its_own_request(default_model):
    ids = default_model.tokenize("Once upon a time")
    # A repetition penalty this small overflows the logits it divides: that request
    # fails, the other request of the same steps finishes normally.
    box = {}

    def bad():
        try:
            box["bad"] = default_model.generate([ids], max_new_tokens=8, temperature=0.7, seed=1,
                                                repetition_penalty=1e-38)
        except errors.K25Error as e:
            box["bad"] = e
    t = threading.Thread(target=bad)
    t.start()
    good = default_model.generate([ids], max_new_tokens=8, temperature=0.0)[0]
    t.join(timeout=60)
    assert good.finish_reason in ("length", "stop") and len(good.token_ids) > 0
    assert isinstance(box["bad"], (errors.EngineError, list))


def test_engine_refuses_max_seq_len_beyond_its_rope_table():
    path = str(resolve_model_path(None))
    h = _C.load_model(path, 64, 2)
    ec = _C.EngineConfig()
    ec.num_kv_blocks = 64
    ec.max_seq_len = 512
    with pytest.raises(errors.InvalidArgumentError):
        _C.Engine(h, ec, True, [], [2])


def test_engine_threads_leave_the_host_torch_settings_alone(default_model):
    before = torch.get_num_threads()
    default_model.generate("hi", max_new_tokens=2, temperature=0.0)
    seen = {}
    t = threading.Thread(target=lambda: seen.setdefault("n", torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == before and seen["n"] == before


def test_min_new_tokens_holds_back_stop_strings(default_model):
    ids = default_model.tokenize("List: apples, pears, plums, figs, dates, limes, kiwis,")
    free = default_model.generate([ids], max_new_tokens=24, temperature=0.0)[0]
    text = free.text
    if "," not in text:
        pytest.skip("the reference output has no comma to stop at")
    early = default_model.generate([ids], max_new_tokens=24, temperature=0.0, stop=[","])[0]
    held = default_model.generate([ids], max_new_tokens=24, temperature=0.0, stop=[","], min_new_tokens=10)[0]
    assert len(held.token_ids) >= 10
    assert len(held.token_ids) >= len(early.token_ids)


def test_huge_token_ids_are_request_errors(default_model):
    with pytest.raises(errors.RequestError):
        default_model.generate([[1, 2, 2 ** 40]], max_new_tokens=2)


def test_default_pool_resizes_safely_while_kernels_run():
    import math
    q = torch.randn(1, 8 * 64)
    kv = torch.randn(200 * 2 * 2 * 16 * 64)
    layout = (1, 2, 64, 16)
    qs = torch.tensor([0, 1], dtype=torch.int32)
    cl = torch.tensor([3000], dtype=torch.int32)
    bt = torch.arange(188, dtype=torch.int32)[None]
    stop = threading.Event()

    def attend():
        while not stop.is_set():
            _C.ops.paged_attention(q, kv, layout, 0, qs, cl, bt, 8, 1 / math.sqrt(64), 0)

    before = _C.get_num_threads()
    t = threading.Thread(target=attend, daemon=True)
    t.start()
    for i in range(200):
        _C.set_num_threads(1 + i % 3)
    stop.set()
    t.join(timeout=30)
    _C.set_num_threads(before)
    assert not t.is_alive(), "a kernel hung while the pool was replaced"


def test_batching_window_gathers_a_burst_into_one_step():
    def run(window):
        m = K25Model(K25Config(num_threads=2, kv_cache_bytes=64 << 20, batching_window_ms=window))
        try:
            box = []

            def one(text):
                box.append(m.generate(text, max_new_tokens=1, temperature=0.0)[0])

            t1 = threading.Thread(target=one, args=("The sky is",))
            t2 = threading.Thread(target=one, args=("Water is",))
            t1.start()
            time.sleep(0.05)
            t2.start()
            t1.join()
            t2.join()
            return m.stats()["steps"]
        finally:
            m.close()

    assert run(300.0) == 1   # both prompts prefetched in the first step
    assert run(0.0) == 2     # no window: the first request starts alone
