"""`k25 batch`: OpenAI batch files through the engine, run as a real subprocess.

Expected results come from the Python API in this process (greedy generate / chat for the
same prompts) and from the server app itself; the crash test SIGKILLs a run part-way,
tears the output's last line, and checks that a restart finishes with exactly one result
per input line and leaves the results written before the kill untouched.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from k25.batch import BatchError, BatchOutput, read_input, result_id, run_batch

MODEL = "smollm2-135m-instruct"
ENGINE_ARGS = ["--threads", "2", "--kv-cache-bytes", str(64 << 20)]


def k25_batch(inp, out, *extra, timeout=120):
    return subprocess.run([sys.executable, "-m", "k25.cli", "batch", str(inp), str(out), *ENGINE_ARGS, *extra],
                          capture_output=True, text=True, timeout=timeout)


def start_batch(inp, out, *extra):
    return subprocess.Popen([sys.executable, "-m", "k25.cli", "batch", str(inp), str(out), *ENGINE_ARGS, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def line(cid, url, body, method="POST"):
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body})


def chat_body(content, max_tokens=8, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **kw}


def completion_body(prompt, max_tokens=8, **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


def read_results(path):
    data = path.read_bytes()
    assert data.endswith(b"\n"), "the output ends with a torn line"
    return [json.loads(x) for x in data.decode("utf-8").splitlines()]


def by_custom_id(results):
    out = {}
    for r in results:
        assert r["custom_id"] not in out, f"two results for {r['custom_id']}"
        out[r["custom_id"]] = r
    return out


def expected_choice(model, kind, body):
    """(text, finish_reason, prompt tokens, completion tokens) from the Python API."""
    kw = dict(max_new_tokens=body["max_tokens"], temperature=0.0, stop=body.get("stop"))
    if kind == "chat":
        out = model.chat(body["messages"], **kw)
    else:
        out = model.generate(body["prompt"], **kw)[0]
    return out.text, out.finish_reason, len(out.prompt_token_ids), len(out.token_ids)


def check_ok(result, model, kind, body):
    assert result["error"] is None
    resp = result["response"]
    assert resp["status_code"] == 200 and resp["request_id"]
    b = resp["body"]
    assert b["object"] == ("chat.completion" if kind == "chat" else "text_completion")
    assert b["model"] == MODEL and len(b["choices"]) == 1
    text, finish, pt, ct = expected_choice(model, kind, body)
    choice = b["choices"][0]
    got = choice["message"]["content"] if kind == "chat" else choice["text"]
    if kind == "chat":
        assert choice["message"]["role"] == "assistant"
    assert got == text
    assert choice["finish_reason"] == finish
    assert b["usage"] == {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}


def test_batch_results_match_the_api_and_invalid_lines_get_errors(tmp_path, default_model):
    ok = {
        "chat-fruit": ("chat", chat_body("Name a fruit.")),
        "chat-stop": ("chat", chat_body("List three colours.", max_tokens=12, stop=[":"])),
        "cmpl-paris": ("completion", completion_body("The capital of France is")),
        "cmpl-colours": ("completion", completion_body("The three primary colours are", max_tokens=6)),
        "chat-sea": ("chat", chat_body("Write a haiku about the sea.", max_tokens=10)),
    }
    urls = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
    lines = [line(cid, urls[kind], body) for cid, (kind, body) in ok.items()]
    lines[2:2] = [
        "",                                                                            # blank: skipped
        '{"custom_id": "torn", "method": "POST", "url": ',                             # bad JSON
        line("chat-fruit", urls["chat"], chat_body("Another fruit?")),                 # duplicate custom_id
        line("embed", "/v1/embeddings", {"model": MODEL, "input": "hi"}),              # unsupported url
        line("get", urls["completion"], completion_body("hi"), method="GET"),          # unsupported method
        "   ",
        line("bad-field", urls["completion"], completion_body("hi", frobnicate=1)),    # 400: unknown field
        line("bad-temp", urls["chat"], chat_body("hi", temperature=9)),                # 400: out of range
        line("other-model", urls["completion"], {**completion_body("hi"), "model": "gpt-4o"}),  # 404
        json.dumps({"method": "POST", "url": urls["chat"], "body": chat_body("hi")}),  # no custom_id
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    nonblank = [x for x in lines if x.strip()]

    r = k25_batch(inp, out, "--concurrency", "3")
    assert r.returncode == 0, r.stderr
    assert f"{len(nonblank)} lines: {len(ok)} done, 0 skipped" in r.stderr and "8 failed" in r.stderr

    results = read_results(out)
    assert len(results) == len(nonblank) == 13
    assert len({x["id"] for x in results}) == len(results)
    assert all(x["id"].startswith("batch_req_") for x in results)

    # Line-level errors: response null, error with code, message and line number.
    line_errors = {x["error"]["line"]: x for x in results if x["response"] is None}
    assert {n: x["error"]["code"] for n, x in line_errors.items()} == {
        4: "invalid_json_line", 5: "duplicate_custom_id", 6: "invalid_url", 7: "invalid_method",
        12: "missing_custom_id"}
    assert line_errors[4]["custom_id"] is None and line_errors[12]["custom_id"] is None
    assert line_errors[5]["custom_id"] == "chat-fruit" and "line 1" in line_errors[5]["error"]["message"]
    assert line_errors[6]["custom_id"] == "embed"
    for x in line_errors.values():
        assert x["error"]["message"].startswith(f"line {x['error']['line']}: ")

    # Request validation failures: an HTTP-style response with the server's error body.
    rest = by_custom_id([x for x in results if x["response"] is not None])
    for cid, status, param, code in [("bad-field", 400, "frobnicate", "unknown_field"),
                                     ("bad-temp", 400, "temperature", "invalid_value"),
                                     ("other-model", 404, "model", "model_not_found")]:
        x = rest[cid]
        assert x["error"] is None and x["response"]["status_code"] == status, x
        err = x["response"]["body"]["error"]
        assert err["param"] == param and err["code"] == code and err["message"]

    # Successes: the same text, finish reason and usage as the Python API.
    assert set(rest) - {"bad-field", "bad-temp", "other-model"} == set(ok)
    for cid, (kind, body) in ok.items():
        check_ok(rest[cid], default_model, kind, body)
    assert rest["chat-stop"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"

    # ... and the same body as the server for the same request (but for id and created).
    from fastapi.testclient import TestClient
    from k25.server.app import ServerSettings, create_app
    app = create_app({MODEL: default_model}, MODEL, ServerSettings(spool_dir=str(tmp_path / "spool")))
    with TestClient(app) as client:
        for cid in ("chat-stop", "cmpl-paris"):
            kind, body = ok[cid]
            served = client.post(urls[kind], json=body)
            assert served.status_code == 200
            got = dict(rest[cid]["response"]["body"])
            want = served.json()
            for k in ("id", "created"):
                got.pop(k), want.pop(k)
            assert got == want
        served = client.post(urls["completion"], json=completion_body("hi", frobnicate=1))
        assert served.status_code == 400 and served.json() == rest["bad-field"]["response"]["body"]

    # A second run has nothing left to do and changes nothing.
    before = out.read_bytes()
    r = k25_batch(inp, out)
    assert r.returncode == 0, r.stderr
    assert f"0 done, {len(nonblank)} skipped" in r.stderr
    assert out.read_bytes() == before


def _big_input(path, n=40, max_tokens=16):
    lines, reqs = [], {}
    for i in range(n):
        if i % 2:
            kind, body = "completion", completion_body(f"Fact number {i} about the ocean:", max_tokens, ignore_eos=True)
            url = "/v1/completions"
        else:
            kind, body = "chat", chat_body(f"Give me a word that rhymes with {i}.", max_tokens, ignore_eos=True)
            url = "/v1/chat/completions"
        reqs[f"r{i}"] = (kind, body)
        lines.append(line(f"r{i}", url, body))
    path.write_text("\n".join(lines) + "\n")
    return reqs


def _wait_for_lines(path, n, proc, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"{path} did not reach {n} lines")


def test_sigkill_then_restart_finishes_with_exactly_one_result_per_line(tmp_path, default_model):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    reqs = _big_input(inp)
    proc = start_batch(inp, out, "--concurrency", "2")
    try:
        _wait_for_lines(out, 3, proc)
        # While it runs, a second run on the same output is refused and writes nothing.
        second = k25_batch(inp, out)
        assert second.returncode == 2
        assert "another k25 batch is writing" in second.stderr and "Traceback" not in second.stderr
        assert proc.poll() is None, "the first run finished before it could be killed; make the input longer"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    data = out.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    finished = [json.loads(x) for x in complete.decode().splitlines()]
    assert 3 <= len(finished) < len(reqs), len(finished)
    # A crash in the middle of a write: half a result with no newline.
    with open(out, "ab") as f:
        f.write(complete.splitlines(keepends=True)[0][:57])

    r = k25_batch(inp, out, "--concurrency", "4")
    assert r.returncode == 0, r.stderr
    assert (f"40 lines: {40 - len(finished)} done, {len(finished)} skipped" in r.stderr
            and "0 failed" in r.stderr and "torn last line" in r.stderr), r.stderr

    new = out.read_bytes()
    assert new.startswith(complete), "results written before the kill changed"
    results = read_results(out)  # also: no torn line remains
    assert len(results) == len(reqs)
    got = by_custom_id(results)  # every custom_id exactly once
    assert set(got) == set(reqs)
    assert len({x["id"] for x in results}) == len(results)

    # Every result, before and after the kill, is what the Python API computes.
    tok = default_model.tokenizer
    chat_ids = [c for c, (k, _) in reqs.items() if k == "chat"]
    cmpl_ids = [c for c, (k, _) in reqs.items() if k == "completion"]
    kw = dict(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    want = {}
    outs = default_model.generate([tok.encode_chat(reqs[c][1]["messages"], add_generation_prompt=True)
                                   for c in chat_ids], **kw)
    want.update(zip(chat_ids, outs))
    want.update(zip(cmpl_ids, default_model.generate([reqs[c][1]["prompt"] for c in cmpl_ids], **kw)))
    for cid, (kind, _) in reqs.items():
        body = got[cid]["response"]["body"]
        choice = body["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        assert text == want[cid].text, cid
        assert body["usage"]["completion_tokens"] == 16 and choice["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == len(want[cid].prompt_token_ids)


def test_recovery_of_the_output_file(tmp_path):
    """Torn tails are cut; foreign or doubled results are refused; nothing loads a model
    when every line already has a result."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(line("a", "/v1/completions", completion_body("x")) + "\n\n" +
                   line("b", "/v1/nope", {}) + "\n")
    lines = read_input(inp)
    assert [(x.lineno, x.custom_id, x.error and x.error["code"]) for x in lines] == [
        (1, "a", None), (3, "b", "invalid_url")]
    assert lines[0].id == result_id("cid:a") and lines[1].id == result_id("line:3")

    def no_model():
        raise AssertionError("the model was loaded though nothing was left to do")

    done_a = {"id": result_id("cid:a"), "custom_id": "a", "response": {"status_code": 200}, "error": None}
    good = json.dumps(done_a) + "\n"
    # A torn last line that does end with a newline but does not parse is cut too; the
    # line error of "b" is written without the engine.
    out.write_text(good + '{"id": "batch_req_x", "cus\n')
    log = open(os.devnull, "w")
    s = run_batch(inp, out, no_model, log=log)
    assert (s.lines, s.done, s.skipped, s.failed) == (2, 0, 1, 1) and s.truncated_bytes == 27
    results = read_results(out)
    assert results[0] == done_a and results[1]["error"]["code"] == "invalid_url" and len(results) == 2

    out.write_text(good + "not json\n" + good)
    with pytest.raises(BatchError, match="line 2 is not a batch result"):
        run_batch(inp, out, no_model, log=log)
    out.write_text(good + good)
    with pytest.raises(BatchError, match="two results"):
        run_batch(inp, out, no_model, log=log)
    out.write_text(json.dumps({**done_a, "id": result_id("cid:zzz")}) + "\n")
    with pytest.raises(BatchError, match="another input"):
        run_batch(inp, out, no_model, log=log)
    assert out.read_text().count("\n") == 1  # refused without touching it

    with BatchOutput(out):
        with pytest.raises(BatchError, match="another k25 batch is writing"):
            run_batch(inp, out, no_model, log=log)
    log.close()


def test_hostile_json_lines_are_error_results_not_crashes(tmp_path):
    from k25.batch import read_input
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"[" * 100000 + b"\n" + b'{"custom_id": "x", "n": ' + b"9" * 6000 + b"}\n")
    lines = read_input(str(src))
    assert [ln.error["code"] for ln in lines] == ["invalid_json_line", "invalid_json_line"]
