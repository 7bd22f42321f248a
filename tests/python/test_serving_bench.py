"""`k25 bench` (k25.serving_bench): workloads, the report's arithmetic, and real runs against
`k25 serve` on loopback."""
import json
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from k25.errors import BenchError
from k25.serving_bench import (LengthMode, RequestRecord, _error_message, arrival_times, parse_goodput, parse_lengths,
                                sample_lengths, summarize)

from server_utils import Server

KEY = "sk-bench-31"
SEQ_LEN = 256


def k25(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "k25.cli", *args], capture_output=True, text=True, timeout=timeout)


# ---- workloads -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, modes", [
    ("128", [LengthMode(128, 0, 1.0)]),
    ("210±30", [LengthMode(210, 30, 1.0)]),
    ("210+-30", [LengthMode(210, 30, 1.0)]),
    ("210±30:0.9, 12400±1800:0.1", [LengthMode(210, 30, 0.9), LengthMode(12400, 1800, 0.1)]),
    ("10:1,20:3", [LengthMode(10, 0, 0.25), LengthMode(20, 0, 0.75)]),
])
def test_length_mixes_parse(spec, modes):
    got = parse_lengths(spec)
    assert [(m.mean, m.sd) for m in got] == [(m.mean, m.sd) for m in modes]
    assert [m.weight for m in got] == pytest.approx([m.weight for m in modes])


@pytest.mark.parametrize("spec", ["", "many", "0", "5:0", "-3", "210±", "1,,2"])
def test_bad_length_mixes_raise(spec):
    with pytest.raises(BenchError):
        parse_lengths(spec)


def test_a_bimodal_mix_draws_both_modes_in_their_proportions():
    got = np.array(sample_lengths(parse_lengths("210±30:0.9,12400±1800:0.1"), 20000, np.random.default_rng(1)))
    short, long_ = got[got < 5000], got[got >= 5000]
    assert len(short) / len(got) == pytest.approx(0.9, abs=0.01)
    assert short.mean() == pytest.approx(210, abs=2) and short.std() == pytest.approx(30, rel=0.05)
    assert long_.mean() == pytest.approx(12400, abs=100) and long_.std() == pytest.approx(1800, rel=0.08)
    assert got.min() >= 1
    tiny = sample_lengths(parse_lengths("1±5"), 1000, np.random.default_rng(2))
    assert min(tiny) == 1  # clipped, never 0 or negative


# ---- the report --------------------------------------------------------------------------------

def _records():
    recs = []
    for i in range(10):
        ttft = 0.1 * (i + 1)
        r = RequestRecord("completions", 11, 20, ok=True, status=200, start=0.01 * i, ttft=ttft,
                          latency=ttft + 0.05 * 10, prompt_tokens=20 + i, completion_tokens=11)
        r.token_times = [ttft + 0.05 * k for k in range(11)]
        recs.append(r)
    recs.append(RequestRecord("completions", 11, 900, ok=False, status=400, error="HTTP 400: too long"))
    recs.append(RequestRecord("chat", 11, None, ok=False, status=400, error="HTTP 400: too long"))
    return recs


def test_summary_statistics_and_goodput():
    recs = _records()
    s = summarize(recs, duration=2.0, percentiles=(50, 90), slo=parse_goodput(["ttft:500", "tpot:60"]))
    ttft_ms = [100.0 * (i + 1) for i in range(10)]
    assert s["completed"] == 10 and s["failed"] == 2
    assert s["errors"] == {"HTTP 400": {"count": 2, "example": "HTTP 400: too long"}}
    assert s["input_tokens"] == sum(20 + i for i in range(10)) and s["output_tokens"] == 110
    assert s["request_throughput"] == pytest.approx(5.0) and s["output_throughput"] == pytest.approx(55.0)
    assert s["total_token_throughput"] == pytest.approx((110 + 245) / 2.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(statistics.mean(ttft_ms))
    assert s["ttft_ms"]["p50"] == pytest.approx(statistics.median(ttft_ms))
    assert s["ttft_ms"]["p90"] == pytest.approx(910.0)  # linear between the 9th (900) and 10th (1000)
    assert s["tpot_ms"]["mean"] == pytest.approx(50.0) and s["tpot_ms"]["std"] == pytest.approx(0.0, abs=1e-9)
    assert s["itl_ms"]["p50"] == pytest.approx(50.0)
    assert s["e2e_ms"]["mean"] == pytest.approx(statistics.mean(t + 500 for t in ttft_ms))
    # ttft <= 500 ms holds for the first five; tpot 50 <= 60 for all: 5 good in 2 s
    assert s["good_requests"] == 5 and s["goodput"] == pytest.approx(2.5)
    tight = summarize(recs, 2.0, slo=parse_goodput(["tpot:40"]))
    assert tight["good_requests"] == 0


def test_poisson_arrivals_have_the_asked_rate():
    t = arrival_times(20000, 8.0, np.random.default_rng(3))
    gaps = np.diff(t)
    assert t[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03) and gaps.std() == pytest.approx(1 / 8.0, rel=0.05)
    assert (arrival_times(5, float("inf"), np.random.default_rng(3)) == 0).all()


@pytest.mark.parametrize("err, msg", [
    ({"error": {"message": "too long", "type": "invalid_request_error"}}, "too long"),
    ({"error": "overloaded"}, "overloaded"),
    ("plain", "plain"),
    ([1, 2], "[1, 2]"),
])
def test_error_messages_of_every_shape(err, msg):
    assert _error_message(err) == msg


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "ttft:-5", "latency:100", "tpot:abc"])
def test_bad_goodput_slos_raise(bad):
    with pytest.raises(BenchError, match="NAME:MILLISECONDS"):
        parse_goodput([bad])


# ---- real runs -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("bench"), "--api-key", KEY, name="bench", api_key=KEY, max_seq_len=SEQ_LEN)
    yield s
    s.kill()


def _intervals_overlap_at_most(recs, limit):
    events = sorted([(r["start"], 1) for r in recs] + [(r["start"] + r["latency"], -1) for r in recs],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak <= limit


def test_synthetic_run_against_a_server(srv, tmp_path):
    out, svg = tmp_path / "r.json", tmp_path / "r.svg"
    r = k25("bench", "--url", srv.url + "/v1", "--api-key", KEY, "--num-prompts", "10", "--input-len", "20±5",
            "--output-len", "6", "--ignore-eos", "--max-concurrency", "3", "--request-rate", "40",
            "--json", str(out), "--plot", str(svg), "--goodput", "e2e:600000")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Successful requests:" in r.stdout and "Time to first token" in r.stdout
    d = json.loads(out.read_text())
    s, recs = d["summary"], d["requests"]
    assert s["completed"] == 10 and s["failed"] == 0 and s["good_requests"] == 10
    assert d["config"]["served_model_name"] == "smollm2-135m-instruct"
    for rec in recs:
        # token-id prompts arrive with exactly their length; ignore_eos runs each to max_tokens
        assert rec["ok"] and rec["prompt_tokens"] == rec["sent_prompt_len"] and rec["completion_tokens"] == 6
        assert 0 < rec["ttft"] <= rec["latency"] and 1 <= len(rec["token_times"]) <= 6
        assert rec["token_times"] == sorted(rec["token_times"])
    assert s["output_tokens"] == 60 and s["input_tokens"] == sum(rec["sent_prompt_len"] for rec in recs)
    assert s["output_throughput"] == pytest.approx(60 / s["duration_s"])
    assert _intervals_overlap_at_most(recs, 3)
    starts = sorted(rec["start"] for rec in recs)
    assert starts[-1] > 0.05  # Poisson arrivals at 40/s spread ten requests over ~0.25 s, not all at 0
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}polyline")) == 2 and len(root.findall(f"{ns}circle")) == 10


def test_dataset_run_with_chat_and_completion_lines(srv, tmp_path):
    ds = tmp_path / "d.jsonl"
    lines = [{"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4},
             {"prompt": "The capital of France is", "max_tokens": 3},
             {"prompt": [504, 3458, 282, 4649], "max_tokens": 5},
             {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "ignored", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}},
             {"prompt": "No max_tokens here:"}]
    ds.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = tmp_path / "r.json"
    r = k25("bench", "--url", srv.url, "--api-key", KEY, "--dataset", str(ds), "--output-len", "7", "--ignore-eos",
            "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    recs = json.loads(out.read_text())["requests"]
    assert [x["endpoint"] for x in recs] == ["chat", "completions", "completions", "chat", "completions"]
    assert [x["completion_tokens"] for x in recs] == [4, 3, 5, 2, 7]
    assert recs[2]["prompt_tokens"] == 4 and all(x["ok"] for x in recs)


def test_failed_requests_are_counted_with_the_servers_reason(srv, tmp_path):
    out = tmp_path / "r.json"
    r = k25("bench", "--url", srv.url, "--api-key", KEY, "--num-prompts", "3", "--input-len", str(SEQ_LEN + 50),
            "--output-len", "4", "--json", str(out))
    assert r.returncode == 1  # nothing completed
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 0 and s["failed"] == 3
    assert s["duration_s"] > 0  # the run lasts until its last answer, failures included
    (reason, e), = s["errors"].items()
    assert reason == "HTTP 400" and e["count"] == 3 and f"at most {SEQ_LEN} tokens" in e["example"]
    wrong_key = k25("bench", "--url", srv.url, "--api-key", "nope", "--num-prompts", "1", "--input-len", "5")
    assert wrong_key.returncode == 2 and "HTTP 401" in wrong_key.stderr


@pytest.mark.parametrize("args, message", [
    (["--dataset", "/nonexistent.jsonl"], "cannot read the dataset"),
    (["--input-len", "lots"], "not a length mix"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--request-rate", "0"], "--request-rate"),
    (["--plot", "out.png"], ".svg"),
    (["--percentiles", "50,101"], "--percentiles"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--output-len", "0"], "a mean of at least 1"),
])
def test_bad_arguments_exit_2_before_sending(args, message):
    r = k25("bench", "--url", "http://127.0.0.1:9", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_bad_dataset_line_names_its_line(tmp_path):
    ds = tmp_path / "d.jsonl"
    ds.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    r = k25("bench", "--url", "http://127.0.0.1:9", "--dataset", str(ds))
    assert r.returncode == 2 and f"{ds}:2: not JSON" in r.stderr


def test_synthetic_prompts_need_the_served_models_tokenizer(srv):
    r = k25("bench", "--url", srv.url, "--api-key", KEY, "--served-model-name", "some-remote-model", "--num-prompts",
            "1", "--input-len", "5")
    assert r.returncode == 2 and "'some-remote-model' is not a model on this machine" in r.stderr


def test_unreachable_server_is_a_clear_error():
    r = k25("bench", "--url", "http://127.0.0.1:9", "--num-prompts", "1", "--input-len", "5")
    assert r.returncode == 2 and "cannot reach http://127.0.0.1:9" in r.stderr


def test_without_a_url_it_serves_the_model_itself(tmp_path):
    out = tmp_path / "r.json"
    r = k25("bench", "--num-prompts", "3", "--input-len", "12", "--output-len", "3", "--ignore-eos", "--json", str(out),
            "--server-args", f"--threads 2 --kv-cache-bytes {64 << 20} --max-seq-len 256")
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    assert d["summary"]["completed"] == 3 and d["config"]["url"].startswith("http://127.0.0.1:")


def test_a_server_that_cannot_start_is_reported_with_its_log():
    r = k25("bench", "--num-prompts", "1", "--input-len", "5", "--server-args", "--threads 1 --kv-cache-bytes 1")
    assert r.returncode == 2
    assert "exited with" in r.stderr and "holds no KV block" in r.stderr  # the server's own error, from its log
