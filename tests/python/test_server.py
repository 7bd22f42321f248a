"""`k25 serve` as a real process on loopback, driven by the official openai client and by
raw HTTP. Expected outputs come from K25Model in the test process (same weights, greedy or
seeded), request counts from what the tests send."""
from __future__ import annotations

import json
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait as wait_futures
from pathlib import Path

import httpx
import openai
import pytest

from server_utils import (KV_BYTES, MODEL, Metrics, Server, check_error_shape, listening_address, sse_events)

KEY = "sk-test-5f1c"
MAIN_SEQ_LEN = 128
MAIN_BODY_LIMIT = 32768
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """The shared server: an API key, a 128-token context and a 32 KiB body limit."""
    s = Server(tmp_path_factory.mktemp("main"), "--api-key", KEY, "--max-body-bytes", str(MAIN_BODY_LIMIT),
               name="main", api_key=KEY, max_seq_len=MAIN_SEQ_LEN)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def model(default_model):
    return default_model


def close(a, b, tol=1e-4):
    return abs(a - b) <= tol


def wait_idle(s: Server, timeout=10.0) -> Metrics:
    """Waits until nothing runs or waits and every KV block is free; returns that scrape."""
    def idle():
        m = s.metrics()
        ok = (m.get("k25_requests_running") == 0 and m.get("k25_requests_queued") == 0
              and m.get("k25_requests_spooled") == 0 and m.get("k25_kv_blocks_used") == 0)
        return m if ok else None
    return s.wait_for(idle, timeout, what="an idle server")


# ---- basics: binding, models, auth ------------------------------------------------------

def test_binds_loopback_by_default(srv):
    addr = listening_address(srv.port)
    assert addr in (None, "127.0.0.1")  # None: /proc/net/tcp unreadable
    if addr is None:
        pytest.fail("cannot read /proc/net/tcp to check the bind address")


def test_models_and_api_key(srv):
    client = srv.client()
    assert [m.id for m in client.models.list().data] == [MODEL]

    for path, method in (("/v1/models", "GET"), ("/v1/chat/completions", "POST"), ("/v1/completions", "POST")):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1} if path == "/v1/completions" else \
            {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
        for auth in (None, "Bearer wrong-key", KEY, f"Basic {KEY}", "Bearer"):
            h = {"authorization": auth} if auth else {}
            r = httpx.request(method, srv.url + path, json=body if method == "POST" else None, headers=h,
                              timeout=30)
            check_error_shape(r, 401, code="invalid_api_key")
        h = {"authorization": f"Bearer {KEY}"}
        r = httpx.request(method, srv.url + path, json=body if method == "POST" else None, headers=h, timeout=30)
        assert r.status_code == 200, r.text

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    # Health and metrics stay open.
    assert httpx.get(srv.url + "/healthz").status_code == 200
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and "k25_requests_running" in r.text


# ---- chat and completions against the engine -------------------------------------------

def test_chat_greedy_matches_engine(srv, model):
    exp = model.chat(MESSAGES, max_new_tokens=12, temperature=0.0)
    ids = model.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    assert list(exp.prompt_token_ids) == ids
    r = srv.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant"
    assert c.message.content == exp.text
    assert c.finish_reason == exp.finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(exp.token_ids)
    assert r.usage.total_tokens == len(ids) + len(exp.token_ids)

    # An answer that ends at EOS: finish_reason "stop" and the exact token count.
    msgs = [{"role": "user", "content": "Reply with the single word: yes"}]
    exp = model.chat(msgs, max_new_tokens=40, temperature=0.0)
    r = srv.client().chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=40, temperature=0)
    assert r.choices[0].message.content == exp.text
    assert r.choices[0].finish_reason == exp.finish_reason
    assert r.usage.completion_tokens == len(exp.token_ids)
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)


def test_chat_stream_with_usage(srv, model):
    exp = model.chat(MESSAGES, max_new_tokens=12, temperature=0.0)
    chunks = list(srv.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == exp.text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [exp.finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == len(exp.prompt_token_ids)
    assert last.usage.completion_tokens == len(exp.token_ids)
    assert last.usage.total_tokens == len(exp.prompt_token_ids) + len(exp.token_ids)
    assert all(ch.usage is None for ch in chunks[:-1])

    # Raw SSE: the content type, JSON events, and [DONE] last; no usage chunk unless asked.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, headers=srv.headers(),
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    objs = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in o or o["usage"] is None for o in objs)
    assert "".join(o["choices"][0]["delta"].get("content", "") for o in objs) == exp.text


def test_completion_greedy_matches_engine(srv, model):
    client = srv.client()
    prompt = "Once upon a time"
    exp = model.generate(prompt, max_new_tokens=10, temperature=0.0)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == exp.text
    assert r.choices[0].finish_reason == exp.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(exp.prompt_token_ids), 10)

    # Token ids as the prompt.
    ids = model.tokenize("The capital of France is")
    exp_ids = model.generate([ids], max_new_tokens=6, temperature=0.0)[0]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == exp_ids.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(exp_ids.token_ids)

    # Several prompts: one choice each, in order, usage summed.
    prompts = ["The sky is", "Water boils at"]
    exps = model.generate(prompts, max_new_tokens=5, temperature=0.0)
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [e.text for e in exps]
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in exps)
    assert r.usage.completion_tokens == sum(len(e.token_ids) for e in exps)

    # Streaming with usage.
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == exp.text
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(exp.prompt_token_ids), 10)
    with httpx.stream("POST", srv.url + "/v1/completions", headers=srv.headers(), timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0,
                            "stream": True}) as resp:
        events = list(sse_events(resp))
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == exp.text


def test_n_choices(srv, model):
    client = srv.client()
    exp = model.chat(MESSAGES, max_new_tokens=8, temperature=0.0)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.message.content == exp.text for c in r.choices)
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)  # the prompt counts once
    assert r.usage.completion_tokens == 3 * len(exp.token_ids)

    # Sampled n with a seed: choice 0 is the engine's draw for that seed, the choices are
    # not all the same, the request is reproducible, and usage counts every token.
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=7, n=3, logprobs=0)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    one = model.generate("Once upon a time", max_new_tokens=10, temperature=1.0, seed=7)[0]
    assert a.choices[0].text == one.text
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices) == 30

    # n with streaming: every index gets its text and one finish_reason.
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    texts, fins = {0: "", 1: ""}, {0: [], 1: []}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                fins[c.index].append(c.finish_reason)
    assert texts == {0: exp.text, 1: exp.text} and fins == {0: ["length"], 1: ["length"]}
    assert chunks[-1].usage.completion_tokens == 2 * len(exp.token_ids)


def test_seed_and_sampling_parameters_are_honoured(srv, model):
    client = srv.client()
    prompt = "My favourite animal is"
    samp = dict(temperature=0.9, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3, seed=1234)
    extra = {"top_k": 40, "min_p": 0.05}
    exp = model.generate(prompt, max_new_tokens=12, top_k=40, min_p=0.05, **samp)[0]
    outs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, extra_body=extra, **samp)
            for _ in range(2)]
    assert outs[0].choices[0].text == outs[1].choices[0].text == exp.text
    # Each parameter reaches the engine: changing any one changes the draw as it does there.
    for change in ({"seed": 99}, {"top_k": 2}, {"temperature": 0.0}, {"presence_penalty": 2.0}):
        kw = {**samp, **extra, **change}
        e = model.generate(prompt, max_new_tokens=12, **kw)[0]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, **kw}
        r = srv.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == e.text, change
    # Chat with a seed, twice, equals the engine's chat.
    e = model.chat(MESSAGES, max_new_tokens=10, temperature=1.0, seed=5)
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=5)
        assert r.choices[0].message.content == e.text


def test_stop_strings(srv, model):
    full = model.chat(MESSAGES, max_new_tokens=16, temperature=0.0).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    expected = full[:full.find(stop)]
    exp = model.chat(MESSAGES, max_new_tokens=16, temperature=0.0, stop=[stop])
    assert exp.text == expected and exp.finish_reason == "stop"
    client = srv.client()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                       stop=[stop, "\u00a7never\u00a7"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(exp.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_chat_logprobs(srv, model):
    exp = model.chat(MESSAGES, max_new_tokens=6, temperature=0.0, logprobs=3)
    r = srv.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                             logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(exp.logprobs) == 6
    tok = model.tokenizer
    for got, want in zip(content, exp.logprobs):
        assert got.token == tok.decode([want.token_id])
        assert close(got.logprob, want.logprob)
        assert got.bytes == list(got.token.encode("utf-8"))
        assert len(got.top_logprobs) == len(want.top) == 3
        want_top = sorted(((tok.decode([t]), v) for t, v in want.top.items()), key=lambda x: -x[1])
        got_top = sorted(((t.token, t.logprob) for t in got.top_logprobs), key=lambda x: -x[1])
        for (gt, gv), (wt, wv) in zip(got_top, want_top):
            assert gt == wt and close(gv, wv)
        assert got.logprob >= max(v for _, v in want_top) - 1e-4  # greedy picks the top token
    # logprobs=True alone: the sampled token's logprob, no alternatives.
    r = srv.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                             logprobs=True)
    assert [close(c.logprob, w.logprob) for c, w in zip(r.choices[0].logprobs.content, exp.logprobs)] == [True] * 3
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)
    # Without logprobs there are none.
    r = srv.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_completion_logprobs(srv, model):
    prompt = "The capital of France is"
    exp = model.generate(prompt, max_new_tokens=6, temperature=0.0, logprobs=2)[0]
    r = srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    tok = model.tokenizer
    assert lp.tokens == [tok.decode([w.token_id]) for w in exp.logprobs]
    assert all(close(g, w.logprob) for g, w in zip(lp.token_logprobs, exp.logprobs))
    assert len(lp.token_logprobs) == 6
    off = 0
    for t, o in zip(lp.tokens, lp.text_offset):
        assert o == off
        off += len(t)
    for got, want in zip(lp.top_logprobs, exp.logprobs):
        want_by_text = {}
        for t, v in want.top.items():
            want_by_text.setdefault(tok.decode([t]), []).append(v)
        assert set(got) == set(want_by_text)
        for t, v in got.items():
            assert any(close(v, w) for w in want_by_text[t])
    # Streamed logprobs are the same values, chunk by chunk.
    chunks = list(srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                  logprobs=2, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert len(streamed) == 6 and all(close(a, w.logprob) for a, w in zip(streamed, exp.logprobs))


def test_request_id_echo_and_logs(srv, model):
    rid = "test-rid-7c1f0e"
    raw = srv.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, extra_headers={"x-request-id": rid})
    assert raw.headers["x-request-id"] == rid
    usage = raw.parse().usage
    # Errors echo it too; a request without one gets a fresh id.
    r = srv.post("/v1/completions", {"model": MODEL, "prompt": ""}, headers={"x-request-id": rid + "-err"})
    assert r.status_code == 400 and r.headers["x-request-id"] == rid + "-err"
    r = srv.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and len(r.headers.get("x-request-id", "")) >= 8

    def logged():
        log = srv.log()
        return all(f"[{tag}] req_id={rid} " in log for tag in ("QUEUE", "PREFILL", "DECODE"))
    srv.wait_for(logged, 5, what="the [QUEUE]/[PREFILL]/[DECODE] lines of the request")
    log = srv.log()
    q = srv.queue_lines()[rid]
    assert len(q) == 1 and q[0]["priority"] == "silver" and q[0]["degraded"] is False and q[0]["queue_time"] >= 0
    prefill = next(l for l in log.splitlines() if f"[PREFILL] req_id={rid} " in l)
    assert f"seq_len={usage.prompt_tokens} " in prefill and "chunk_count=" in prefill \
        and "avg_time_per_chunk=" in prefill
    decode = next(l for l in log.splitlines() if f"[DECODE] req_id={rid} " in l)
    assert f"tokens={usage.completion_tokens} " in decode


# ---- bad input ------------------------------------------------------------------------

def _chat(**kw):
    return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **kw}).encode()


def _cmpl(**kw):
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}).encode()


def _without(body: bytes, key: str) -> bytes:
    d = json.loads(body)
    d.pop(key)
    return json.dumps(d).encode()


C, P = "/v1/chat/completions", "/v1/completions"
ANY = "__any__"
# (id, path, body bytes, extra headers, status, param, code)
BAD_CASES = [
    ("malformed-json", C, b'{"model": "x", "messages": [', {}, 400, ANY, "invalid_json"),
    ("empty-body", C, b"", {}, 400, ANY, "invalid_json"),
    ("not-an-object", P, b"[1, 2, 3]", {}, 400, ANY, "invalid_json"),
    ("json-nan", P, b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL.encode(), {}, 400,
     "temperature", ANY),
    ("deep-nesting", P, b'{"model": "x", "prompt": ' + b"[" * 12000 + b"]" * 12000 + b"}", {}, 400, ANY, ANY),
    ("huge-integer", P, b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (MODEL.encode(), b"9" * 5000), {},
     400, ANY, "invalid_json"),
    ("json-infinity", P, b'{"model": "%s", "prompt": "hi", "temperature": -Infinity}' % MODEL.encode(), {}, 400,
     "temperature", ANY),
    ("invalid-utf8", P, b'{"model": "%s", "prompt": "caf\xc3 \xff\xfe"}' % MODEL.encode(), {}, 400, ANY,
     "invalid_encoding"),
    ("raw-control-byte-in-json", P, b'{"model": "%s", "prompt": "a\x07b"}' % MODEL.encode(), {}, 400, ANY, ANY),
    ("unknown-field", C, _chat(frobnicate=1), {}, 400, "frobnicate", "unknown_field"),
    ("unknown-field-completions", P, _cmpl(temperatur=0.5), {}, 400, "temperatur", "unknown_field"),
    ("unknown-message-field", C, _chat(messages=[{"role": "user", "content": "hi", "mood": "x"}]), {}, 400,
     "messages[0].mood", "unknown_field"),
    ("unknown-stream-option", C, _chat(stream=True, stream_options={"include_usage": True, "x": 1}), {}, 400,
     "stream_options.x", "unknown_field"),
    ("logit-bias", C, _chat(logit_bias={"100": 5}), {}, 400, "logit_bias", "unsupported_parameter"),
    ("tools", C, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), {}, 400, "tools",
     "unsupported_parameter"),
    ("echo", P, _cmpl(echo=True), {}, 400, "echo", "unsupported_parameter"),
    ("best-of", P, _cmpl(best_of=3), {}, 400, "best_of", "unsupported_parameter"),
    ("response-format-json", C, _chat(response_format={"type": "json_object"}), {}, 400, "response_format",
     "unsupported_parameter"),
    ("image-part", C, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     {}, 400, "messages[0].content[0]", ANY),
    ("max-tokens-string", C, _chat(max_tokens="5"), {}, 400, "max_tokens", "invalid_type"),
    ("max-tokens-float", P, _cmpl(max_tokens=5.5), {}, 400, "max_tokens", "invalid_type"),
    ("max-tokens-bool", P, _cmpl(max_tokens=True), {}, 400, "max_tokens", "invalid_type"),
    ("max-tokens-zero", P, _cmpl(max_tokens=0), {}, 400, "max_tokens", ANY),
    ("both-max-tokens", C, _chat(max_completion_tokens=3), {}, 400, "max_completion_tokens", ANY),
    ("temperature-string", C, _chat(temperature="hot"), {}, 400, "temperature", "invalid_type"),
    ("temperature-range", C, _chat(temperature=5), {}, 400, "temperature", ANY),
    ("top-p-zero", P, _cmpl(top_p=0), {}, 400, "top_p", ANY),
    ("n-zero", P, _cmpl(n=0), {}, 400, "n", ANY),
    ("n-huge", P, _cmpl(n=1000), {}, 400, "n", ANY),
    ("seed-too-big", P, _cmpl(seed=1 << 70), {}, 400, "seed", ANY),
    ("stream-string", C, _chat(stream="yes"), {}, 400, "stream", "invalid_type"),
    ("stream-options-without-stream", C, _chat(stream_options={"include_usage": True}), {}, 400,
     "stream_options", ANY),
    ("stop-int", P, _cmpl(stop=5), {}, 400, "stop", "invalid_type"),
    ("stop-empty-string", P, _cmpl(stop=[""]), {}, 400, "stop", ANY),
    ("stop-control-char", P, _cmpl(stop=["\u0000"]), {}, 400, "stop", ANY),
    ("user-int", C, _chat(user=5), {}, 400, "user", "invalid_type"),
    ("top-logprobs-without-logprobs", C, _chat(top_logprobs=2), {}, 400, "top_logprobs", ANY),
    ("top-logprobs-too-many", C, _chat(logprobs=True, top_logprobs=50), {}, 400, "top_logprobs", ANY),
    ("logprobs-string", P, _cmpl(logprobs="yes"), {}, 400, "logprobs", "invalid_type"),
    ("messages-string", C, _chat(messages="hi"), {}, 400, "messages", ANY),
    ("messages-empty", C, _chat(messages=[]), {}, 400, "messages", ANY),
    ("messages-missing", C, _without(_chat(), "messages"), {}, 400, "messages", "missing_field"),
    ("message-not-object", C, _chat(messages=["hi"]), {}, 400, "messages[0]", "invalid_type"),
    ("content-int", C, _chat(messages=[{"role": "user", "content": 5}]), {}, 400, "messages[0].content",
     "invalid_type"),
    ("role-bad", C, _chat(messages=[{"role": "wizard", "content": "hi"}]), {}, 400, "messages[0].role", ANY),
    ("model-missing", P, _without(_cmpl(), "model"), {}, 400, "model", "missing_field"),
    ("model-int", P, _cmpl(model=5), {}, 400, "model", "invalid_type"),
    ("prompt-missing", P, _without(_cmpl(), "prompt"), {}, 400, "prompt", "missing_field"),
    ("prompt-object", P, _cmpl(prompt={"text": "hi"}), {}, 400, "prompt", "invalid_type"),
    ("prompt-bools", P, _cmpl(prompt=[True, False]), {}, 400, "prompt", "invalid_type"),
    ("prompt-mixed", P, _cmpl(prompt=["a", 1]), {}, 400, "prompt", "invalid_type"),
    ("prompt-empty", P, _cmpl(prompt=""), {}, 400, "prompt", ANY),
    ("prompt-empty-ids", P, _cmpl(prompt=[]), {}, 400, "prompt", ANY),
    ("prompt-empty-in-list", P, _cmpl(prompt=["hi", ""]), {}, 400, "prompt", ANY),
    ("token-id-out-of-vocab", P, _cmpl(prompt=[1, 10 ** 9]), {}, 400, "prompt", ANY),
    ("token-id-negative", P, _cmpl(prompt=[-1, 5]), {}, 400, "prompt", ANY),
    ("prompt-too-long", P, _cmpl(prompt="word " * 300), {}, 400, "prompt", "context_length_exceeded"),
    ("prompt-ids-too-long", P, _cmpl(prompt=[42] * MAIN_SEQ_LEN), {}, 400, "prompt", "context_length_exceeded"),
    ("chat-too-long", C, _chat(messages=[{"role": "user", "content": "hello " * 200}]), {}, 400, "messages",
     "context_length_exceeded"),
    ("prompt-plus-max-tokens-too-long", P, _cmpl(max_tokens=MAIN_SEQ_LEN), {}, 400, "max_tokens",
     "context_length_exceeded"),
    ("control-char", C, _chat(messages=[{"role": "user", "content": "hi\u0001there"}]), {}, 400,
     "messages[0].content", ANY),
    ("escape-char", P, _cmpl(prompt="a\u001bb"), {}, 400, "prompt", ANY),
    ("unassigned-code-point", P, _cmpl(prompt="x\u0378y"), {}, 400, "prompt", ANY),
    ("noncharacter-plane-16", C, _chat(messages=[{"role": "user", "content": "\U0010FFFF"}]), {}, 400,
     "messages[0].content", ANY),
    ("lone-surrogate", P, b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode(), {}, 400, "prompt", ANY),
    ("unknown-model", C, _chat(model="gpt-4o"), {}, 404, "model", "model_not_found"),
    ("bad-sla", C, _chat(), {"x-latency-sla": "platinum"}, 400, "x-latency-sla", ANY),
    ("body-too-large", P, _cmpl(prompt="a" * (MAIN_BODY_LIMIT + 10)), {}, 413, ANY, ANY),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input(srv, case):
    name, path, body, headers, status, param, code = case
    rid = f"bad-{name}"
    h = {"content-type": "application/json", "x-request-id": rid, **headers}
    r = srv.post(path, content=body, headers=h)
    err = check_error_shape(r, status, param=param, code=code)
    assert r.headers.get("x-request-id") == rid
    assert srv.alive() and srv.health() == 200


def test_unknown_route_and_method_get_openai_errors(srv):
    r = httpx.get(srv.url + "/v1/completions", headers=srv.headers(), timeout=10)
    check_error_shape(r, 405)
    r = httpx.post(srv.url + "/v1/engines/x/completions", headers=srv.headers(), json={}, timeout=10)
    check_error_shape(r, 404)
    assert srv.health() == 200


def test_valid_unicode_is_accepted(srv, model):
    prompt = "Caf\u00e9 \U0001F600 \u65e5\u672c\u8a9e\n\tdone:"
    exp = model.generate(prompt, max_new_tokens=3, temperature=0.0)[0]
    r = srv.post(P, {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(model.tokenize(prompt))
    assert r.json()["choices"][0]["text"] == exp.text
    r = srv.post(C, {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": "Tu es gentil. \u2603"},
        {"role": "user", "content": [{"type": "text", "text": "Bonjour "}, {"type": "text", "text": "\u00e0 toi"}]}]})
    assert r.status_code == 200, r.text


def test_body_too_large_without_content_length(srv):
    def gen():
        for _ in range(48):
            yield b" " * 1024
        yield _cmpl()

    r = httpx.post(srv.url + P, content=gen(), headers=srv.headers(**{"content-type": "application/json"}),
                   timeout=30)
    check_error_shape(r, 413)
    assert srv.health() == 200


def test_bad_content_length(srv):
    # A Content-Length that lies (longer than the body sent): the server must not hang or crash.
    import socket
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        body = _cmpl()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 999999999\r\n\r\n" + body)
        s.settimeout(10)
        data = s.recv(4096)
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert srv.health() == 200


def test_openai_client_errors(srv):
    client = srv.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"frobnicate": 1})
    assert e.value.status_code == 400 and "frobnicate" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logit_bias={"42": 3})
    assert "logit_bias" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    # Still serving, and no request ever ended in a 500.
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    assert srv.metrics().get("k25_requests_total", status="500") == 0
    assert "Traceback" not in srv.log()


# ---- metrics ---------------------------------------------------------------------------

EXPECTED_FAMILIES = [
    "k25_requests", "k25_prompt_tokens", "k25_generation_tokens", "k25_time_to_first_token_seconds",
    "k25_time_per_output_token_seconds", "k25_e2e_request_latency_seconds", "k25_queue_time_seconds",
    "k25_requests_running", "k25_requests_queued", "k25_requests_spooled", "k25_kv_blocks_used",
    "k25_kv_blocks_free", "k25_preemptions", "k25_requests_degraded", "k25_requests_rejected",
    "k25_sparsity_ratio", "k25_offload",
]


def test_metrics_count_the_traffic(srv, model):
    m0 = wait_idle(srv)
    for fam in EXPECTED_FAMILIES:
        assert m0.has_family(fam), fam
    client = srv.client()
    usages = []
    for i in range(3):
        r = client.completions.create(model=MODEL, prompt=f"Number {i}:", max_tokens=3 + i, temperature=0,
                                      extra_headers={"x-latency-sla": "silver"})
        usages.append(r.usage)
    for i in range(2):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                           extra_headers={"x-latency-sla": "gold"})
        usages.append(r.usage)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_headers={"x-latency-sla": "bronze"}))
    usages.append(chunks[-1].usage)
    bad = srv.post(P, {"model": MODEL, "prompt": ""}, headers={"x-latency-sla": "bronze"})
    assert bad.status_code == 400

    def settled():
        m = srv.metrics()
        d = m.get("k25_requests_total") - m0.get("k25_requests_total")
        return m if d == 7 else None
    m1 = srv.wait_for(settled, 5, what="7 more requests in k25_requests_total")

    def delta(name, **labels):
        return m1.get(name, **labels) - m0.get(name, **labels)

    assert delta("k25_requests_total", endpoint="completions", status="200", priority="silver") == 3
    assert delta("k25_requests_total", endpoint="chat", status="200", priority="gold") == 2
    assert delta("k25_requests_total", endpoint="chat", status="200", priority="bronze") == 1
    assert delta("k25_requests_total", endpoint="completions", status="400", priority="bronze") == 1
    assert delta("k25_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("k25_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 3 + 4 + 5 + 8 + 5
    for hist in ("k25_time_to_first_token_seconds", "k25_e2e_request_latency_seconds",
                 "k25_time_per_output_token_seconds"):
        assert delta(hist + "_count") == 6, hist
        assert delta(hist + "_sum") > 0, hist
    for prio, n in (("silver", 3), ("gold", 2), ("bronze", 1)):
        assert delta("k25_queue_time_seconds_count", priority=prio) == n
    ttft_mean = delta("k25_time_to_first_token_seconds_sum") / 6
    e2e_mean = delta("k25_e2e_request_latency_seconds_sum") / 6
    assert 0 < ttft_mean <= e2e_mean < 30
    tpot_mean = delta("k25_time_per_output_token_seconds_sum") / 6
    assert 0 < tpot_mean < 1.0
    # Gauges at rest.
    m2 = wait_idle(srv)
    total_blocks = KV_BYTES // model.kv_block_bytes
    assert m2.get("k25_kv_blocks_used") == 0
    assert m2.get("k25_kv_blocks_free") == total_blocks
    assert m2.get("k25_kv_blocks_used", model=MODEL, tier="l1") + m2.get("k25_kv_blocks_free", model=MODEL) \
        == total_blocks
    assert m2.get("k25_preemptions_total", model=MODEL) >= 0
    assert m2.get("k25_sparsity_ratio", model=MODEL) == 0.0
    assert m2.get("k25_offload_total", model=MODEL) == 0
    assert m2.get("k25_requests_degraded_total") == 0 and m2.get("k25_requests_rejected_total") == 0


# ---- client disconnects ------------------------------------------------------------------

def _kv_abort_logged(srv, rid):
    return any(f"[KV_CACHE] req_id={rid} " in l and "evict_reason=abort" in l for l in srv.log().splitlines())


def test_disconnect_mid_stream_aborts_and_frees_kv(srv):
    wait_idle(srv)
    m0 = srv.metrics()
    rid = "disconnect-stream-1"
    body = {"model": MODEL, "prompt": "Count to one hundred:", "max_tokens": 110, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", srv.url + P, json=body, headers=srv.headers(**{"x-request-id": rid})) as r:
            assert r.status_code == 200
            n = 0
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    n += 1
                    if n == 4:
                        # Still streaming: it runs and holds KV blocks.
                        during = srv.metrics()
                        assert during.get("k25_requests_running") == 1 and during.get("k25_kv_blocks_used") > 0
                        break
            assert n == 4
        # Leaving the block closes the connection without reading the rest.
    t0 = time.monotonic()
    # The abort frees everything before the remaining ~100 tokens are generated: no
    # [DECODE] line and fewer tokens than asked (below) say it was the abort; the time
    # bound allows for a loaded machine (idle, this takes well under a second).
    wait_idle(srv, timeout=10.0)
    assert time.monotonic() - t0 < 10.0
    srv.wait_for(lambda: _kv_abort_logged(srv, rid), 3, what="a [KV_CACHE] evict_reason=abort line")
    assert f"[DECODE] req_id={rid} " not in srv.log()
    m1 = srv.wait_for(lambda: (lambda m: m if m.get("k25_requests_total", status="499")
                               > m0.get("k25_requests_total", status="499") else None)(srv.metrics()),
                      3, what="the aborted request counted")
    # Fewer tokens generated than asked for.
    assert m1.get("k25_generation_tokens_total") - m0.get("k25_generation_tokens_total") < 110
    assert srv.health() == 200


def test_disconnect_non_streaming_aborts(srv):
    wait_idle(srv)
    rid = "disconnect-plain-1"
    body = {"model": MODEL, "prompt": "Count to one hundred:", "max_tokens": 110, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        srv.post(P, body, headers={"x-request-id": rid}, timeout=0.6)
    wait_idle(srv, timeout=5.0)  # the abort itself is proven by the log lines below
    srv.wait_for(lambda: _kv_abort_logged(srv, rid), 3, what="a [KV_CACHE] evict_reason=abort line")
    assert f"[DECODE] req_id={rid} " not in srv.log()


# ---- overload: queue, spool, priorities ---------------------------------------------------

def _fire(s: Server, rid, prio, max_tokens, timeout=120.0, path=P, stream=False):
    body = {"model": MODEL, "prompt": f"Item {rid}:", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    t0 = time.monotonic()
    r = s.post(path, body, headers={"x-request-id": rid, "x-latency-sla": prio}, timeout=timeout)
    r.elapsed_s = time.monotonic() - t0
    return r


def test_overload_burst_queues_spools_and_orders_by_priority(tmp_path):
    spool = tmp_path / "spool"
    s = Server(tmp_path, "--max-concurrent-requests", "2", "--max-queue", "3", "--max-spool", "4",
               "--spool-dir", str(spool), "--queue-timeout-ms", "120000", name="overload")
    pool = ThreadPoolExecutor(32)
    try:
        m0 = s.metrics()
        sent = []  # (rid, priority, wave, future)

        def send(rid, prio, wave, max_tokens):
            sent.append((rid, prio, wave, pool.submit(_fire, s, rid, prio, max_tokens)))

        def gauges():
            m = s.metrics()
            return m.get("k25_requests_running"), m.get("k25_requests_queued"), m.get("k25_requests_spooled")

        # Two long requests take both engine places.
        for i in range(2):
            send(f"blk-{i}", "silver", "blocker", 120)
        s.wait_for(lambda: gauges() == (2, 0, 0), 10, what="2 running")
        # Bronze first, then silver, then gold: arrival order is the reverse of priority.
        for i in range(2):
            send(f"w-bronze-{i}", "bronze", "queued", 6)
            s.wait_for(lambda: gauges() == (2, i + 1, 0), 10, what=f"{i + 1} queued")
        for i in range(3):
            send(f"w-silver-{i}", "silver", "queued", 6)
            s.wait_for(lambda: sum(gauges()[1:]) == 3 + i, 10, what=f"{3 + i} waiting")
        for i in range(2):
            send(f"w-gold-{i}", "gold", "queued", 6)
            s.wait_for(lambda: sum(gauges()[1:]) == 6 + i, 10, what=f"{6 + i} waiting")
        peak = gauges()
        assert peak == (2, 3, 4), peak  # memory queue full, 4 bodies on disk
        spool_files = sorted(p.name for p in spool.glob("*.req"))
        assert len(spool_files) == 4, spool_files
        # The burst: 13 more at once, every priority; nothing has room for them.
        prios = ["gold", "silver", "bronze"]
        for i in range(13):
            send(f"b3-{prios[i % 3]}-{i}", prios[i % 3], "overflow", 6)
        overflow = [f for _, _, w, f in sent if w == "overflow"]
        done, pending = wait_futures(overflow, timeout=30)
        assert not pending, "overflow requests hung"
        assert gauges()[0] == 2, "the blockers finished too early for this test"

        done, pending = wait_futures([f for *_, f in sent], timeout=90)
        assert not pending, f"{len(pending)} requests hung"
        results = [(rid, prio, wave, f.result()) for rid, prio, wave, f in sent]
        assert len(results) == 22  # none lost
        statuses = {}
        for rid, prio, wave, r in results:
            assert r.status_code in (200, 429, 503), (rid, r.status_code, r.text)
            statuses[(str(r.status_code), prio)] = statuses.get((str(r.status_code), prio), 0) + 1
            if wave in ("blocker", "queued"):
                assert r.status_code == 200, (rid, r.text)
                body = r.json()
                assert body["usage"]["completion_tokens"] == (120 if wave == "blocker" else 6)
                assert "x-k25-degraded" not in r.headers
            else:
                err = check_error_shape(r, 429)
                assert int(r.headers["retry-after"]) >= 1
                if prio == "gold":  # gold is never shed by the breaker: the queue is just full
                    assert err["code"] == "queue_full" and "x-k25-degraded" not in r.headers
                else:  # the queue is >= 90% full: the breaker sheds bronze and silver
                    assert err["code"] == "overloaded" and r.headers["x-k25-degraded"] == "reject"

        # Gold waited less than silver, silver less than bronze, although they came later.
        q = s.queue_lines()
        qt = {p: [q[f"w-{p}-{i}"][0]["queue_time"] for i in range(n)] for p, n in
              (("gold", 2), ("silver", 3), ("bronze", 2))}
        assert all(not q[f"w-{p}-{i}"][0]["degraded"] for p, n in (("gold", 2), ("bronze", 2)) for i in range(n))
        assert max(qt["gold"]) < min(qt["bronze"]), qt
        assert statistics.median(qt["gold"]) < statistics.median(qt["silver"]) < statistics.median(qt["bronze"]), qt
        # Admission order (the order of the [QUEUE] lines): priority first, then arrival.
        order = [rid for rid in q if rid.startswith("w-")]
        assert max(order.index(f"w-gold-{i}") for i in range(2)) < min(order.index(f"w-bronze-{i}")
                                                                        for i in range(2)), order
        assert order.index("w-bronze-0") < order.index("w-bronze-1"), order
        assert order.index("w-silver-0") < order.index("w-silver-2"), order
        assert order.index("w-silver-1") < order.index("w-silver-2"), order
        shed = [rid for rid, prio, wave, _ in results if wave == "overflow" and prio != "gold"]
        assert all(q[rid] and q[rid][0]["degraded"] and q[rid][0]["mode"] == "reject" for rid in shed)

        # Metrics agree with what was sent; the histogram per priority agrees with the logs.
        m1 = s.wait_for(lambda: (lambda m: m if m.get("k25_requests_total") - m0.get("k25_requests_total") == 22
                                 else None)(s.metrics()), 5, what="22 requests counted")
        for (status, prio), n in statuses.items():
            assert m1.get("k25_requests_total", status=status, priority=prio) \
                - m0.get("k25_requests_total", status=status, priority=prio) == n, (status, prio)
        assert m1.get("k25_requests_rejected_total") == 13
        assert m1.get("k25_requests_rejected_total", reason="breaker") == 8
        assert m1.get("k25_requests_rejected_total", reason="queue_full", priority="gold") == 5
        mean = {p: m1.get("k25_queue_time_seconds_sum", priority=p) / m1.get("k25_queue_time_seconds_count",
                                                                              priority=p)
                for p in ("gold", "bronze")}
        assert mean["gold"] < mean["bronze"]
        # Still up, nothing left behind.
        assert s.health() == 200
        wait_idle(s)
        assert not list(spool.glob("*.req"))
        r = _fire(s, "after", "gold", 2)
        assert r.status_code == 200
        assert "Traceback" not in s.log()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        s.kill()


def test_queue_timeout_gives_503(tmp_path):
    s = Server(tmp_path, "--max-concurrent-requests", "1", "--queue-timeout-ms", "300", "--log-level", "warning",
               name="qtimeout")
    pool = ThreadPoolExecutor(8)
    try:
        blocker = pool.submit(_fire, s, "blk", "gold", 60)
        s.wait_for(lambda: s.metrics().get("k25_requests_running") == 1, 10, what="the blocker running")
        waiters = [pool.submit(_fire, s, f"wait-{i}", "gold", 4) for i in range(3)]
        for f in waiters:
            r = f.result(timeout=30)
            err = check_error_shape(r, 503, code="queue_timeout")
            assert err["type"] == "service_unavailable"
            assert int(r.headers["retry-after"]) >= 1
            assert 0.25 <= r.elapsed_s < 5.0, r.elapsed_s
        assert blocker.result(timeout=60).status_code == 200
        m = wait_idle(s)
        assert m.get("k25_requests_rejected_total", reason="queue_timeout") == 3
        assert m.get("k25_requests_total", status="503") == 3
        assert m.get("k25_requests_total", status="200") == 1
        assert _fire(s, "after", "silver", 2).status_code == 200
        # --log-level warning: no info lines.
        assert "[QUEUE]" not in s.log() and "[DECODE]" not in s.log()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        s.kill()


# ---- circuit breaker -----------------------------------------------------------------------

def _trip(s: Server, level=1):
    # --memory-watermark 0.0: the KV fill is always "over" it, so the breaker trips after
    # its 0.5 s debounce; /metrics evaluates it.
    s.wait_for(lambda: s.metrics().get("k25_circuit_breaker_level") >= level, 5, what="the breaker tripped")


def test_breaker_reject_sheds_bronze_keeps_gold(tmp_path):
    s = Server(tmp_path, "--memory-watermark", "0.0", "--degrade", "reject", name="reject",
               env={"K25_API_KEY": "env-key-1"}, api_key="env-key-1")
    try:
        # The key comes from K25_API_KEY.
        r = httpx.post(s.url + P, json={"model": MODEL, "prompt": "hi"}, timeout=10)
        check_error_shape(r, 401)
        _trip(s)
        for i in range(2):
            r = s.post(C, {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
                       headers={"x-latency-sla": "bronze", "x-request-id": f"shed-{i}"})
            err = check_error_shape(r, 429, code="overloaded")
            assert err["type"] == "rate_limit_exceeded"
            assert r.headers["x-k25-degraded"] and int(r.headers["retry-after"]) >= 1
            assert r.headers["x-request-id"] == f"shed-{i}"
        with pytest.raises(openai.RateLimitError):
            s.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                               extra_headers={"x-latency-sla": "bronze"})
        r = s.post(C, {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0},
                   headers={"x-latency-sla": "gold", "x-request-id": "gold-1"})
        assert r.status_code == 200 and "x-k25-degraded" not in r.headers
        assert r.json()["usage"]["completion_tokens"] == 4
        m = s.metrics()
        assert m.get("k25_requests_rejected_total", reason="breaker", priority="bronze") == 3
        assert m.get("k25_requests_degraded_total", mode="reject", priority="bronze") == 3
        assert m.get("k25_requests_total", status="429", priority="bronze") == 3
        assert m.get("k25_requests_total", status="200", priority="gold") == 1
        assert m.get("k25_requests_rejected_total", priority="gold") == 0
        q = s.queue_lines()
        assert q["shed-0"][0]["degraded"] and q["shed-1"][0]["degraded"] and not q["gold-1"][0]["degraded"]
        assert s.health() == 200
    finally:
        s.kill()


def test_breaker_cap_tokens_caps_bronze(tmp_path, model):
    s = Server(tmp_path, "--memory-watermark", "0.0", "--degrade", "cap-tokens:2", name="captokens")
    try:
        _trip(s)
        prompt = "Once upon a time"
        exp2 = model.generate(prompt, max_new_tokens=2, temperature=0.0, ignore_eos=True)[0]
        exp10 = model.generate(prompt, max_new_tokens=10, temperature=0.0, ignore_eos=True)[0]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        r = s.post(P, body, headers={"x-latency-sla": "bronze", "x-request-id": "cap-1"})
        assert r.status_code == 200, r.text
        assert r.headers["x-k25-degraded"] == "cap-tokens"
        assert r.json()["usage"]["completion_tokens"] == 2
        assert r.json()["choices"][0]["text"] == exp2.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        # Streaming bronze: marked and capped too.
        with httpx.stream("POST", s.url + C, headers={"x-latency-sla": "bronze", "x-request-id": "cap-2"},
                          json={"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "stream": True,
                                "stream_options": {"include_usage": True}}, timeout=60) as rs:
            assert rs.status_code == 200 and rs.headers["x-k25-degraded"] == "cap-tokens"
            events = list(sse_events(rs))
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 2
        # Gold is untouched.
        r = s.post(P, body, headers={"x-latency-sla": "gold", "x-request-id": "gold-1"})
        assert r.status_code == 200 and "x-k25-degraded" not in r.headers
        assert r.json()["choices"][0]["text"] == exp10.text
        assert r.json()["usage"]["completion_tokens"] == 10
        m = s.metrics()
        assert m.get("k25_requests_degraded_total", mode="cap-tokens", priority="bronze") == 2
        assert m.get("k25_requests_degraded_total", priority="gold") == 0
        assert m.get("k25_requests_total", status="200") == 3
        q = s.queue_lines()
        for rid in ("cap-1", "cap-2"):
            assert q[rid][0]["degraded"] and q[rid][0]["mode"] == "cap-tokens"
        assert not q["gold-1"][0]["degraded"]
    finally:
        s.kill()


# ---- graceful shutdown --------------------------------------------------------------------

def test_sigterm_drains_and_exits_zero(tmp_path):
    spool = tmp_path / "spool"
    drain = 20.0
    s = Server(tmp_path, "--max-concurrent-requests", "1", "--max-queue", "1", "--max-spool", "4",
               "--spool-dir", str(spool), "--drain-timeout", str(drain), name="sigterm")
    pool = ThreadPoolExecutor(8)
    try:
        first_chunk = threading.Event()

        def stream():
            events = []
            body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 100, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", s.url + P, json=body, timeout=60) as r:
                assert r.status_code == 200
                for e in sse_events(r):
                    events.append(e)
                    first_chunk.set()
            return events

        streamer = pool.submit(stream)
        assert first_chunk.wait(20)
        waiters = [pool.submit(_fire, s, f"queued-{i}", "silver", 4) for i in range(3)]
        s.wait_for(lambda: (lambda m: (m.get("k25_requests_queued"), m.get("k25_requests_spooled")) == (1, 2))(
            s.metrics()), 10, what="1 queued and 2 spooled")
        assert len(list(spool.glob("*.req"))) == 2
        t_term = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.wait_for(lambda: "SIGTERM" in s.log(), 5, what="the SIGTERM log line")
        # New work is refused while the old finishes.
        r = s.post(P, {"model": MODEL, "prompt": "late", "max_tokens": 2})
        check_error_shape(r, 503, code="draining")
        assert httpx.get(s.url + "/healthz").status_code == 503
        assert s.alive()
        assert not streamer.done()
        events = streamer.result(timeout=drain)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 100
        assert all("error" not in json.loads(e) for e in events[:-1])
        for f in waiters:  # the queued and spooled requests are served, not dropped
            r = f.result(timeout=drain)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        rc = s.proc.wait(timeout=drain + 10)
        assert rc == 0, s.log()[-3000:]
        assert time.monotonic() - t_term < drain + 10
        assert not list(spool.glob("*.req"))
        assert "drain done" in s.log() and "Traceback" not in s.log()
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/healthz", timeout=2)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        s.kill()


def test_sigterm_drain_timeout_answers_waiters_and_exits_zero(tmp_path):
    spool = tmp_path / "spool"
    s = Server(tmp_path, "--max-concurrent-requests", "1", "--max-queue", "0", "--max-spool", "4",
               "--spool-dir", str(spool), "--drain-timeout", "1", name="sigterm-timeout")
    pool = ThreadPoolExecutor(4)
    try:
        long = pool.submit(_fire, s, "long", "silver", 400, 60.0)
        s.wait_for(lambda: s.metrics().get("k25_requests_running") == 1, 10, what="the long request running")
        waiter = pool.submit(_fire, s, "spooled", "silver", 4, 60.0)
        s.wait_for(lambda: s.metrics().get("k25_requests_spooled") == 1, 10, what="1 spooled")
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        r = waiter.result(timeout=20)
        check_error_shape(r, 503, code="draining")
        rc = s.proc.wait(timeout=20)
        assert rc == 0, s.log()[-3000:]
        assert time.monotonic() - t0 < 1 + 10
        assert not list(spool.glob("*.req"))
        try:
            long.result(timeout=10)
        except httpx.HTTPError:
            pass  # cut off at the deadline: a closed connection is the expected outcome
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        s.kill()


def test_breaker_fallback_routes_bronze_to_the_second_model(tmp_path):
    """--degrade fallback:MODEL: while tripped, bronze requests are served by a second model
    loaded by the same process (here a small random Llama checkpoint), marked as degraded;
    gold stays on the main model."""
    from k25 import K25Config, K25Model
    from oracles import write_random_checkpoint
    ckpt = tmp_path / "fallback-llama"
    write_random_checkpoint(ckpt, "llama3")
    s = Server(tmp_path, "--memory-watermark", "0.0", "--degrade", f"fallback:{ckpt}", name="fallback")
    try:
        names = [m["id"] for m in httpx.get(s.url + "/v1/models", timeout=10).json()["data"]]
        assert names == [MODEL, "fallback-llama"]
        _trip(s)
        ids = [5, 17, 99, 250, 3, 41]  # token ids both vocabularies have
        body = {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = s.post(P, body, headers={"x-latency-sla": "bronze", "x-request-id": "fb-1"})
        assert r.status_code == 200, r.text
        assert r.headers["x-k25-degraded"] == "fallback"
        assert r.json()["model"] == "fallback-llama"
        small = K25Model(K25Config(model_path=str(ckpt), num_threads=1, kv_cache_bytes=16 << 20))
        try:
            expect = small.generate([ids], max_new_tokens=6, temperature=0.0, ignore_eos=True)[0].token_ids
        finally:
            small.close()
        assert r.json()["usage"]["completion_tokens"] == len(expect) == 6
        g = s.post(P, body, headers={"x-latency-sla": "gold"})
        assert g.status_code == 200 and g.json()["model"] == MODEL and "x-k25-degraded" not in g.headers
        assert s.metrics().get("k25_requests_degraded_total", mode="fallback", priority="bronze") == 1
        assert s.queue_lines()["fb-1"][0]["degraded"]
    finally:
        s.kill()


def test_a_client_leaving_the_queue_gives_up_its_place(tmp_path):
    """A non-streaming client that disconnects while queued is dropped from the queue: it
    is never admitted (no [PREFILL]/[DECODE] for it) and is counted as a 499."""
    s = Server(tmp_path, "--max-concurrent-requests", "1", "--max-queue", "4", name="leaver")
    pool = ThreadPoolExecutor(4)
    try:
        blocker = pool.submit(_fire, s, "blocker", "silver", 40)
        s.wait_for(lambda: s.metrics().get("k25_requests_running") == 1, 10, what="the blocker runs")
        with pytest.raises(httpx.ReadTimeout):
            _fire(s, "leaver", "silver", 4, timeout=0.5)
        s.wait_for(lambda: s.metrics().get("k25_requests_queued") == 0, 3, what="the leaver left the queue")
        assert blocker.result(timeout=120).status_code == 200
        after = _fire(s, "after", "silver", 2)
        assert after.status_code == 200
        log = s.log()
        assert "[PREFILL] req_id=leaver " not in log and "[DECODE] req_id=leaver " not in log
        assert "req_id=leaver priority=silver left before it could run" in log
        assert s.metrics().get("k25_requests_total", status="499", priority="silver") == 1
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        s.kill()


def test_limits_the_engine_would_refuse_are_400s_not_500s(tmp_path):
    """A server whose KV pool holds fewer tokens than the context: a request without
    max_tokens gets the pool's room as its default; an explicit max_tokens beyond it, or a
    top_p that rounds to 0 in float32, is a 400 before admission."""
    s = Server(tmp_path, name="smallkv", kv_bytes=8 * 737280, max_seq_len=8192)  # 8 blocks = 128 tokens
    try:
        r = s.post(P, {"model": MODEL, "prompt": "Hello there", "max_tokens": 400})
        check_error_shape(r, 400, param="max_tokens", code="context_length_exceeded")
        r = s.post(P, {"model": MODEL, "prompt": "Hello there", "top_p": 1e-300, "max_tokens": 2})
        check_error_shape(r, 400)
        r = s.post(P, {"model": MODEL, "prompt": "Hello there", "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"] <= 8 * 16
        assert 'status="500"' not in httpx.get(s.url + "/metrics", timeout=10).text
    finally:
        s.kill()


def test_metrics_count_a_request_with_n_choices_once(srv):
    before = srv.metrics()
    r = srv.post(P, {"model": MODEL, "prompt": "Name three birds:", "max_tokens": 3, "n": 3, "temperature": 0.5,
                     "seed": 4})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    after = srv.metrics()
    assert after.get("k25_prompt_tokens_total") - before.get("k25_prompt_tokens_total") == u["prompt_tokens"]
    assert after.get("k25_generation_tokens_total") - before.get("k25_generation_tokens_total") == \
        u["completion_tokens"]
    assert after.get("k25_time_to_first_token_seconds_count") - before.get("k25_time_to_first_token_seconds_count") == 1


def test_tiered_kv_server_swaps_and_exports_offload_metrics(tmp_path):
    """k25 serve --cache-mode hierarchical --enable-async-offload: a KV pool too small for
    four concurrent requests preempts by swap to L2; every request completes, and /metrics
    has the tiers' latency histogram and byte counters."""
    s = Server(tmp_path, "--cache-mode", "hierarchical", "--enable-async-offload", "--l2-bytes", str(64 << 20),
               "--max-num-batched-tokens", "128", "--prefill-chunk-size", "64", name="tiers", kv_bytes=10 << 20)
    pool = ThreadPoolExecutor(4)
    try:
        text = " ".join(f"word{i}" for i in range(30))

        def fire(i):
            body = {"model": MODEL, "prompt": f"{i}: {text}", "max_tokens": 60, "temperature": 0,
                    "ignore_eos": True}
            return s.post(P, body, timeout=120)

        rs = [f.result(timeout=180) for f in [pool.submit(fire, i) for i in range(4)]]
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        assert all(r.json()["usage"]["completion_tokens"] == 60 for r in rs)
        m = s.metrics()
        offloads = m.get("k25_offload_latency_seconds_count", op="offload")
        assert offloads > 0, s.log()[-2000:]
        assert m.get("k25_offload_latency_seconds_count", op="fetch") == offloads
        assert m.get("k25_offload_latency_seconds_bucket", op="offload", le="+Inf") == offloads
        assert m.get("k25_kv_tier_bytes_total", tier="l2", direction="out") > 0
        assert m.get("k25_offload_total") == offloads
        # Every sequence fits L1 alone: no cold blocks, so every decode block read is a hit.
        assert m.get("k25_kv_predictor_reads_total", tier="l1") > 0
        assert m.get("k25_kv_predictor_reads_total", tier="l2") == 0
        assert m.get("k25_kv_predictor_reads_total", tier="l3") == 0
        assert m.get("k25_kv_predictor_promotions_total") == 0
        assert "preempt_swap" in s.log()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        s.kill()


def test_prefix_caching_server_reuses_a_shared_prompt(tmp_path):
    """k25 serve --enable-prefix-caching: the second request with the same long prompt
    starts from the first one's cached blocks (the /metrics counters say how many prompt
    tokens were looked up and found), with the same completion."""
    s = Server(tmp_path, "--enable-prefix-caching", name="prefix")
    try:
        text = " ".join(f"word{i}" for i in range(60))
        body = {"model": MODEL, "prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        first = s.post(P, body, timeout=120)
        m0 = s.metrics()
        second = s.post(P, body, timeout=120)
        m1 = s.metrics()
        assert first.status_code == second.status_code == 200
        assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
        prompt_tokens = second.json()["usage"]["prompt_tokens"]
        hits = m1.get("k25_prefix_cache_hits_total", model=MODEL) - m0.get("k25_prefix_cache_hits_total", model=MODEL)
        queries = (m1.get("k25_prefix_cache_queries_total", model=MODEL)
                   - m0.get("k25_prefix_cache_queries_total", model=MODEL))
        assert queries == prompt_tokens
        assert hits == (prompt_tokens - 1) // 16 * 16 > 0
    finally:
        s.kill()
