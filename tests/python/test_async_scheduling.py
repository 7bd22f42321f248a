"""Pipelined decode (async scheduling; engine.cpp): step N+1 is launched before step N's
sampled ids reach the host. On CUDA it runs on graph steps; K25_ASYNC_SCHEDULING=1 runs the
same engine logic on the CPU (each launched step runs at once, its ids handed to the next
through the executor), which these tests use. The reference is the same model with
K25_ASYNC_SCHEDULING=0: every output (tokens, finish reason, counts, stop strings) must be
the same, and the pipelined model must really have pipelined (stats()["pipelined_steps"]).
"""
import asyncio
import os

import pytest

from k25 import K25Config, K25Model

EOS_PROMPT = "Write a haiku about the sea."  # greedy output ends with EOS after ~13 tokens
PROMPTS = [EOS_PROMPT, "The capital of France is", "def fibonacci(n):", "List three colors:"]


def make(value):
    old = os.environ.get("K25_ASYNC_SCHEDULING")
    os.environ["K25_ASYNC_SCHEDULING"] = value
    try:
        return K25Model(K25Config(num_threads=2, kv_cache_bytes=64 << 20))
    finally:
        if old is None:
            os.environ.pop("K25_ASYNC_SCHEDULING")
        else:
            os.environ["K25_ASYNC_SCHEDULING"] = old


@pytest.fixture(scope="module")
def models():
    piped, plain = make("1"), make("0")
    yield piped, plain
    piped.close()
    plain.close()


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert [o.num_output_tokens for o in a] == [o.num_output_tokens for o in b]


def idle(m):
    s = m.stats()
    return s["blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0


def test_greedy_batch_with_eos_and_lengths_matches_the_unpipelined_engine(models):
    piped, plain = models
    before = piped.stats()["pipelined_steps"]
    kw = dict(max_new_tokens=24, temperature=0.0)
    a, b = piped.generate(PROMPTS, **kw), plain.generate(PROMPTS, **kw)
    same(a, b)
    # The setup: one sequence stops on EOS while the others go on (the batch shrinks under
    # a step in flight), the rest stop on length.
    assert a[0].finish_reason == "stop" and a[0].num_output_tokens < 24
    assert any(o.finish_reason == "length" and o.num_output_tokens == 24 for o in a)
    assert piped.stats()["pipelined_steps"] - before >= 10
    assert plain.stats()["pipelined_steps"] == 0
    assert idle(piped)


@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_exact_lengths(models, n):
    piped, plain = models
    kw = dict(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    s0 = piped.stats()
    a, b = piped.generate(PROMPTS[1:3], **kw), plain.generate(PROMPTS[1:3], **kw)
    s1 = piped.stats()
    same(a, b)
    assert [o.num_output_tokens for o in a] == [n, n]
    # The first token comes from the prompt's step; no decode row is computed past the last
    # allowed token (a pipelined step is not launched for a sequence that ends there).
    assert s1["generated_tokens"] - s0["generated_tokens"] == 2 * n
    assert s1["decode_tokens"] - s0["decode_tokens"] == 2 * (n - 1)
    assert idle(piped)


def test_stop_strings_and_stop_tokens(models):
    piped, plain = models
    ref = plain.generate(PROMPTS[1], max_new_tokens=20, temperature=0.0, ignore_eos=True)[0]
    stop_text = ref.text[len(ref.text) // 2:][:4]
    kw = dict(max_new_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop_text])
    same(piped.generate(PROMPTS, **kw), plain.generate(PROMPTS, **kw))
    kw = dict(max_new_tokens=20, temperature=0.0, stop_token_ids=[ref.token_ids[5]])
    a, b = piped.generate(PROMPTS, **kw), plain.generate(PROMPTS, **kw)
    same(a, b)
    assert a[1].finish_reason == "stop" and a[1].num_output_tokens == 6


def test_sampling_logprobs_and_unpipelined_options(models):
    """Seeded sampling (top-k / top-p / min-p) and logprobs are pipelined and give the
    unpipelined results; penalties (they read the token history) and a pending
    min_new_tokens are not pipelined, and still give them."""
    piped, plain = models
    for kw in (dict(temperature=0.8, seed=3), dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=11),
               dict(temperature=0.0, logprobs=2), dict(temperature=0.9, logprobs=1, seed=5),
               dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=0.8, frequency_penalty=0.5, seed=2),
               dict(temperature=0.0, min_new_tokens=20)):
        before = piped.stats()["pipelined_steps"]
        a = piped.generate(PROMPTS, max_new_tokens=12, **kw)
        b = plain.generate(PROMPTS, max_new_tokens=12, **kw)
        same(a, b)
        if "logprobs" in kw:
            # Prompt steps batch differently from run to run (arrival timing): float noise only.
            for x, y in zip(a, b):
                assert [t.token_id for t in x.logprobs] == [t.token_id for t in y.logprobs]
                assert max(abs(t.logprob - u.logprob) for t, u in zip(x.logprobs, y.logprobs)) < 1e-4
        pipelined = piped.stats()["pipelined_steps"] - before
        if "repetition_penalty" in kw or "frequency_penalty" in kw or "min_new_tokens" in kw:
            assert pipelined == 0, kw
        else:
            assert pipelined >= 5, kw


def test_arrivals_and_aborts_during_pipelined_steps(models):
    """A request that arrives while steps are pipelined, and one aborted under a step in
    flight: the others give their solo outputs, the pool ends empty."""
    piped, plain = models
    solo = [plain.generate(p, max_new_tokens=40, temperature=0.0, ignore_eos=True)[0].token_ids for p in PROMPTS[1:3]]

    async def run():
        async def collect(prompt, delay):
            await asyncio.sleep(delay)
            return [t async for t in piped.stream(prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True)]

        async def aborted():
            n = 0
            async for _ in piped.stream(PROMPTS[3], max_new_tokens=200, temperature=0.0, ignore_eos=True):
                n += 1
                if n == 5:
                    break
            return n

        return await asyncio.gather(collect(PROMPTS[1], 0.0), collect(PROMPTS[2], 0.3), aborted())

    before = piped.stats()
    first, second, n = asyncio.run(run())
    assert n == 5
    assert "".join(first) == piped.detokenize(solo[0], skip_special_tokens=True)
    assert "".join(second) == piped.detokenize(solo[1], skip_special_tokens=True)
    after = piped.stats()
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    assert after["pipelined_steps"] > before["pipelined_steps"]
    for _ in range(100):
        if idle(piped):
            break
        asyncio.run(asyncio.sleep(0.05))
    assert idle(piped)
