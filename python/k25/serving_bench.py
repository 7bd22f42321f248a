"""`k25 bench`: a serving benchmark against any OpenAI-compatible server.

    k25 bench --num-prompts 64 --input-len 512 --output-len 128            # starts `k25 serve` itself
    k25 bench --url http://host:8000 --input-len "210±30:0.9,12400±1800:0.1" --request-rate 4
    k25 bench --url http://host:8000 --dataset requests.jsonl --goodput ttft:500 tpot:50

Every request streams (SSE, `stream_options.include_usage`), so each one gives its time to
first token (TTFT), its inter-token gaps (ITL), its time per output token after the first
(TPOT = (end - first token) / (output tokens - 1)) and its end-to-end latency; token counts
are the server's own `usage`. The report gives mean and percentiles of each, request and
token throughput over the run, and goodput: requests a second that met every SLO given.

Workloads (docs/tools.md):
- synthetic: prompt lengths from a mix of normal modes, "MEAN±SD:WEIGHT,..." ("210±30" one
  mode; "±" may be written "+-"), lengths clipped to at least 1 token. Prompts are slices
  of the Python documentation's text (pydoc_data.topics) tokenized by the model's own
  tokenizer and sent to /v1/completions as token ids, so a prompt has exactly its length;
  with `--endpoint chat` the slice goes as text in one user message (the chat template
  adds its tokens).
- a JSONL dataset: a line {"prompt": text or token ids, "max_tokens": N} goes to
  /v1/completions, {"messages": [...], "max_tokens": N} to /v1/chat/completions; an OpenAI
  batch line's "body" is read the same way. A line without max_tokens takes --output-len.

Arrivals: all at once (`--request-rate inf`, the default) or a Poisson process of that
rate, with at most `--max-concurrency` in flight when given. Without `--url` the benchmark
starts `k25 serve` on a free loopback port with `--model` (and `--server-args`), waits for
/healthz, and stops it with SIGTERM at the end.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union
from xml.sax.saxutils import escape

import numpy as np

from .errors import BenchError

# ---- workloads -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthMode:
    mean: float
    sd: float
    weight: float


_MODE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:(?:±|\+-|\+/-)\s*([0-9]+(?:\.[0-9]+)?))?\s*(?::\s*([0-9]*\.?[0-9]+))?\s*")


def parse_lengths(spec: str) -> List[LengthMode]:
    """'128', '210±30', '210+-30', '210±30:0.9,12400±1800:0.1' -> modes, weights summing to 1."""
    modes = []
    for part in str(spec).split(","):
        m = _MODE.fullmatch(part)
        if m is None:
            raise BenchError(f"not a length mix: {spec!r} (examples: 128, 210±30, 210±30:0.9,12400±1800:0.1)")
        mean, sd, w = float(m.group(1)), float(m.group(2) or 0.0), float(m.group(3) or 1.0)
        if mean < 1 or w <= 0:
            raise BenchError(f"a length mode needs a mean of at least 1 and a positive weight: {part.strip()!r}")
        modes.append(LengthMode(mean, sd, w))
    total = sum(m.weight for m in modes)
    return [LengthMode(m.mean, m.sd, m.weight / total) for m in modes]


def sample_lengths(modes: Sequence[LengthMode], n: int, rng: np.random.Generator) -> List[int]:
    """n lengths: a mode drawn by weight, then a normal draw around its mean, rounded, >= 1."""
    pick = rng.choice(len(modes), size=n, p=[m.weight for m in modes])
    means = np.array([m.mean for m in modes])[pick]
    sds = np.array([m.sd for m in modes])[pick]
    return [max(1, int(round(v))) for v in rng.normal(means, sds)]


@dataclass
class BenchRequest:
    endpoint: str                                   # "completions" or "chat"
    prompt: Union[str, List[int], None] = None      # completions
    messages: Optional[List[Dict[str, Any]]] = None  # chat
    max_tokens: int = 128
    prompt_len: Optional[int] = None                # exact, for token-id prompts


def _corpus_ids(tokenizer, need: int) -> List[int]:
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise BenchError("the tokenizer gave no tokens for the corpus")
    return ids * (need // len(ids) + 1) if need > len(ids) else ids


def synthetic_requests(tokenizer, input_len: str, output_len: str, n: int, endpoint: str,
                       rng: np.random.Generator) -> List[BenchRequest]:
    ins = sample_lengths(parse_lengths(input_len), n, rng)
    outs = sample_lengths(parse_lengths(output_len), n, rng)
    corpus = _corpus_ids(tokenizer, 2 * max(ins))
    reqs = []
    for i_len, o_len in zip(ins, outs):
        start = int(rng.integers(0, len(corpus) - i_len + 1))
        ids = corpus[start:start + i_len]
        if endpoint == "chat":
            reqs.append(BenchRequest("chat", messages=[{"role": "user", "content": tokenizer.decode(ids)}],
                                     max_tokens=o_len))
        else:
            reqs.append(BenchRequest("completions", prompt=ids, max_tokens=o_len, prompt_len=i_len))
    return reqs


def dataset_requests(path: Union[str, Path], output_len: str, limit: Optional[int],
                     rng: np.random.Generator) -> List[BenchRequest]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read the dataset {path}: {e}") from None
    outs = parse_lengths(output_len)
    reqs = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{no}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{where}: not JSON ({e.msg})") from None
        if isinstance(d, dict) and isinstance(d.get("body"), dict):
            d = d["body"]
        if not isinstance(d, dict):
            raise BenchError(f"{where}: a line must be a JSON object")
        mt = d.get("max_completion_tokens", d.get("max_tokens"))
        if mt is None:
            mt = sample_lengths(outs, 1, rng)[0]
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise BenchError(f"{where}: max_tokens must be a positive integer, got {mt!r}")
        p, msgs = d.get("prompt"), d.get("messages")
        if msgs is not None:
            if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m for m in msgs)):
                raise BenchError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
            reqs.append(BenchRequest("chat", messages=msgs, max_tokens=mt))
        elif isinstance(p, str) and p:
            reqs.append(BenchRequest("completions", prompt=p, max_tokens=mt))
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            reqs.append(BenchRequest("completions", prompt=p, max_tokens=mt, prompt_len=len(p)))
        else:
            raise BenchError(f"{where}: needs 'messages' or a non-empty 'prompt' (text or token ids)")
        if limit is not None and len(reqs) == limit:
            break
    if not reqs:
        raise BenchError(f"the dataset {path} has no requests")
    return reqs


# ---- the client ----------------------------------------------------------------------------


@dataclass
class RequestRecord:
    endpoint: str
    max_tokens: int
    sent_prompt_len: Optional[int]
    ok: bool = False
    status: int = 0
    error: str = ""
    start: float = 0.0           # seconds from the run's start
    ttft: float = 0.0            # seconds
    latency: float = 0.0         # seconds, end to end
    token_times: List[float] = field(default_factory=list)  # seconds after start of each content chunk
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tpot(self) -> Optional[float]:
        if not self.ok or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)

    def itl(self) -> List[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def _error_message(err: Any) -> str:
    """An OpenAI-style error's message: {"error": {"message": ...}}, {"error": "..."}, or as is."""
    if isinstance(err, dict) and "error" in err:
        err = err["error"]
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err)[:300]


def _error_text(raw: bytes) -> str:
    try:
        return _error_message(json.loads(raw))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw[:300].decode("utf-8", "replace")


async def _send(client, base: str, model: str, req: BenchRequest, extra: Dict[str, Any], t_run: float,
                rec: RequestRecord) -> None:
    body: Dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, **extra}
    if req.endpoint == "chat":
        body["messages"] = req.messages
        url = base + "/v1/chat/completions"
    else:
        body["prompt"] = req.prompt
        url = base + "/v1/completions"
    t0 = time.perf_counter()
    rec.start = t0 - t_run
    try:
        await _stream(client, url, body, req, t0, rec)
    except Exception as e:  # a network error or a timeout ends this request, not the run
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        rec.latency = time.perf_counter() - t0  # failures too: the run lasts until its last answer


async def _stream(client, url: str, body: Dict[str, Any], req: BenchRequest, t0: float, rec: RequestRecord) -> None:
    async with client.stream("POST", url, json=body) as r:
        rec.status = r.status_code
        if r.status_code != 200:
            rec.error = f"HTTP {r.status_code}: {_error_text(await r.aread())}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict) or "error" in chunk:
                rec.error = f"stream error: {_error_message(chunk)}"
                return
            for ch in chunk.get("choices") or []:
                piece = ch.get("text") if req.endpoint != "chat" else (ch.get("delta") or {}).get("content")
                if piece:
                    t = time.perf_counter() - t0
                    if not rec.token_times:
                        rec.ttft = t
                    rec.token_times.append(t)
            usage = chunk.get("usage")
            if usage:
                rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
                rec.completion_tokens = int(usage.get("completion_tokens", 0))
    if not rec.token_times and rec.completion_tokens == 0:
        rec.error = "the stream ended without a token"
    elif rec.completion_tokens == 0:
        rec.error = "the stream gave no usage (stream_options.include_usage)"
    else:
        if not rec.token_times:  # tokens that decode to no text (e.g. only special tokens)
            rec.ttft = time.perf_counter() - t0
        rec.ok = True


def arrival_times(n: int, request_rate: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds after the start at which each of n requests is sent: all at 0 for an infinite
    rate, else a Poisson process of that rate (exponential gaps) whose first arrival is at 0."""
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = rng.exponential(1.0 / request_rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def run_requests(base: str, model: str, reqs: Sequence[BenchRequest], *, request_rate: float = math.inf,
                       max_concurrency: Optional[int] = None, extra: Optional[Dict[str, Any]] = None,
                       api_key: Optional[str] = None, rng: Optional[np.random.Generator] = None,
                       request_timeout: Optional[float] = 600.0) -> Tuple[List[RequestRecord], float]:
    """Sends every request (arrival_times) and returns their records and the run's duration
    (first send to the last answer, failures included, in seconds). A request whose stream is
    silent for request_timeout seconds fails with a timeout."""
    import httpx

    rng = rng or np.random.default_rng(0)
    arrivals = arrival_times(len(reqs), request_rate, rng)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(reqs), max_keepalive_connections=64)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    records = [RequestRecord(r.endpoint, r.max_tokens, r.prompt_len) for r in reqs]
    timeout = httpx.Timeout(request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        t_run = time.perf_counter()

        async def one(i):
            delay = t_run + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                await _send(client, base, model, reqs[i], extra or {}, t_run, records[i])

        await asyncio.gather(*(one(i) for i in range(len(reqs))))
    duration = max(r.start + r.latency for r in records) - min(r.start for r in records)
    return records, duration


# ---- the report ----------------------------------------------------------------------------

SLO_KEYS = ("ttft", "tpot", "e2e")


def parse_goodput(items: Optional[Sequence[str]]) -> Dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (milliseconds in, seconds out)."""
    slo = {}
    for it in items or []:
        k, _, v = str(it).partition(":")
        try:
            ms = float(v)
        except ValueError:
            ms = -1.0
        if k not in SLO_KEYS or ms <= 0:
            raise BenchError(f"a goodput SLO is NAME:MILLISECONDS with NAME one of {', '.join(SLO_KEYS)}, got {it!r}")
        slo[k] = ms / 1e3
    return slo


def _stats(values: Sequence[float], percentiles: Sequence[float]) -> Dict[str, Optional[float]]:
    """mean, std and percentiles (numpy's linear interpolation), in milliseconds."""
    if not values:
        return {"mean": None, "std": None, **{f"p{p:g}": None for p in percentiles}}
    a = np.asarray(values, dtype=np.float64) * 1e3
    return {"mean": float(a.mean()), "std": float(a.std()),
            **{f"p{p:g}": float(np.percentile(a, p)) for p in percentiles}}


def meets_slo(r: RequestRecord, slo: Dict[str, float]) -> bool:
    if not r.ok:
        return False
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.latency}
    return all(got[k] <= v for k, v in slo.items())


def summarize(records: Sequence[RequestRecord], duration: float, percentiles: Sequence[float] = (50, 95, 99),
              slo: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    ok = [r for r in records if r.ok]
    errors: Dict[str, Dict[str, Any]] = {}  # by reason (the HTTP status, or the error's kind): count, an example
    for r in records:
        if not r.ok:
            reason = f"HTTP {r.status}" if r.status not in (0, 200) else r.error.split(":")[0]
            e = errors.setdefault(reason, {"count": 0, "example": r.error})
            e["count"] += 1
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.completion_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    s: Dict[str, Any] = {
        "completed": len(ok), "failed": len(records) - len(ok), "errors": errors, "duration_s": duration,
        "input_tokens": inp, "output_tokens": out,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(out), "total_token_throughput": per_s(inp + out),
        "ttft_ms": _stats([r.ttft for r in ok], percentiles),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None], percentiles),
        "itl_ms": _stats([g for r in ok for g in r.itl()], percentiles),
        "e2e_ms": _stats([r.latency for r in ok], percentiles),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        s["goodput"] = per_s(good)
        s["good_requests"] = good
        s["slo_ms"] = {k: v * 1e3 for k, v in slo.items()}
    return s


def format_summary(s: Dict[str, Any]) -> str:
    def num(v, f="{:,.2f}"):
        return "-" if v is None else f.format(v)

    lines = ["============ k25 bench ============",
             f"{'Successful requests:':<36}{s['completed']}",
             f"{'Failed requests:':<36}{s['failed']}",
             f"{'Benchmark duration (s):':<36}{s['duration_s']:.2f}",
             f"{'Input tokens:':<36}{s['input_tokens']}",
             f"{'Output tokens:':<36}{s['output_tokens']}",
             f"{'Request throughput (req/s):':<36}{s['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<36}{s['output_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<36}{s['total_token_throughput']:.2f}"]
    if "goodput" in s:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slo_ms"].items())
        lines.append(f"{'Goodput (req/s):':<36}{s['goodput']:.2f}  ({s['good_requests']} met {slo})")
    for key, title in (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token (excl. 1st)"),
                       ("itl_ms", "Inter-token latency"), ("e2e_ms", "End-to-end latency")):
        lines.append(f"---------- {title} ----------")
        for k, v in s[key].items():
            label = "Mean" if k == "mean" else ("Std" if k == "std" else k.upper())
            lines.append(f"{label + ' (ms):':<36}{num(v)}")
    for reason, e in s["errors"].items():
        lines.append(f"failed: {e['count']} x {reason}, e.g. {e['example']}")
    return "\n".join(lines)


# ---- plots (SVG, no plotting library) --------------------------------------------------------


def _ticks(lo: float, hi: float, n: int = 5) -> List[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    t = math.ceil(lo / step) * step
    out = []
    while t <= hi + 1e-9 * step:
        out.append(t)
        t += step
    return out


def _panel(x: float, y: float, w: float, h: float, title: str, xlabel: str, ylabel: str,
           points: Sequence[Tuple[float, float]], kind: str) -> List[str]:
    out = [f'<text x="{x + w / 2:.1f}" y="{y - 8:.1f}" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="none" stroke="#444"/>']
    if not points:
        out.append(f'<text x="{x + w / 2:.1f}" y="{y + h / 2:.1f}" text-anchor="middle">no data</text>')
        return out
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    # A CDF's x axis spans its values (latencies bunch far from 0), with 5% to spare each side.
    lo, hi = min(xs), max(xs)
    spare = 0.05 * (hi - lo) or 0.05 * abs(hi) or 1.0
    x0, x1 = (lo - spare, hi + spare) if kind == "line" else (min(0.0, lo), hi if hi > 0 else 1.0)
    y0, y1 = min(0.0, min(ys)), max(ys) if max(ys) > 0 else 1.0
    sx = lambda v: x + (v - x0) / ((x1 - x0) or 1.0) * w  # noqa: E731
    sy = lambda v: y + h - (v - y0) / ((y1 - y0) or 1.0) * h  # noqa: E731
    for t in _ticks(x0, x1):
        out.append(f'<line x1="{sx(t):.1f}" y1="{y + h}" x2="{sx(t):.1f}" y2="{y + h + 4}" stroke="#444"/>'
                   f'<text x="{sx(t):.1f}" y="{y + h + 16}" text-anchor="middle" font-size="10">{t:g}</text>')
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{x - 4}" y1="{sy(t):.1f}" x2="{x}" y2="{sy(t):.1f}" stroke="#444"/>'
                   f'<text x="{x - 6}" y="{sy(t) + 3:.1f}" text-anchor="end" font-size="10">{t:g}</text>')
    out.append(f'<text x="{x + w / 2:.1f}" y="{y + h + 32}" text-anchor="middle" font-size="11">{escape(xlabel)}</text>')
    out.append(f'<text x="{x - 40}" y="{y + h / 2:.1f}" text-anchor="middle" font-size="11" '
               f'transform="rotate(-90 {x - 40} {y + h / 2:.1f})">{escape(ylabel)}</text>')
    if kind == "line":
        pts = " ".join(f"{sx(a):.1f},{sy(b):.1f}" for a, b in points)
        out.append(f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{pts}"/>')
    else:
        out += [f'<circle cx="{sx(a):.1f}" cy="{sy(b):.1f}" r="2.5" fill="#d62728"/>' for a, b in points]
    return out


def _cdf(values_ms: Sequence[float]) -> List[Tuple[float, float]]:
    v = sorted(values_ms)
    n = len(v)
    return [(a, (i + 1) / n) for i, a in enumerate(v)]


def plot_svg(records: Sequence[RequestRecord], path: Union[str, Path]) -> None:
    """Three panels: the CDF of TTFT, the CDF of TPOT, and end-to-end latency against prompt tokens."""
    ok = [r for r in records if r.ok]
    w, h, pad = 300, 220, 70
    body = []
    body += _panel(pad, 40, w, h, "TTFT", "ms", "fraction of requests", _cdf([r.ttft * 1e3 for r in ok]), "line")
    body += _panel(2 * pad + w, 40, w, h, "TPOT", "ms", "fraction of requests",
                   _cdf([r.tpot * 1e3 for r in ok if r.tpot is not None]), "line")
    body += _panel(3 * pad + 2 * w, 40, w, h, "End-to-end latency", "prompt tokens", "ms",
                   [(float(r.prompt_tokens), r.latency * 1e3) for r in ok], "scatter")
    width, height = 3 * (w + pad) + pad, h + 100
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")
    Path(path).write_text(svg, encoding="utf-8")


# ---- a server of our own ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnServer:
    """`k25 serve` in a subprocess on a free loopback port, for a benchmark given no --url."""

    def __init__(self, model: Optional[str], server_args: str = "", timeout: float = 600.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="k25-bench-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "k25.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if model:
            cmd += ["--model", model]
        cmd += shlex.split(server_args)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("K25_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(cmd, timeout)
        except BaseException:  # a failed start, Ctrl-C or anything else: no server left behind
            self.stop()
            raise

    def _wait_ready(self, cmd: List[str], timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            failure = None
            if self.proc.poll() is not None:
                failure = f"`{' '.join(cmd[1:])}` exited with {self.proc.returncode}"
            else:
                try:
                    if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    failure = f"the server did not answer /healthz within {timeout:.0f} s"
            if failure is not None:
                raise BenchError(f"{failure}:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, keep_log: bool = False) -> None:
        """SIGTERM (the server drains), then SIGKILL after 60 s; the log is removed unless kept."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
            if not keep_log:
                os.unlink(self.log.name)


def served_model_name(base: str, api_key: Optional[str]) -> str:
    import httpx

    try:
        r = httpx.get(base + "/v1/models", timeout=30.0,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"{base}/v1/models answered HTTP {r.status_code}: {_error_text(r.content)}; "
                         "name the model with --served-model-name")
    try:
        data = r.json().get("data") or []
        name = str(data[0]["id"]) if data else None
    except (ValueError, AttributeError, KeyError, TypeError, IndexError):
        raise BenchError(f"{base}/v1/models did not answer an OpenAI model list; name the model with "
                         "--served-model-name") from None
    if name is None:
        raise BenchError(f"{base}/v1/models lists no model; name one with --served-model-name")
    return name


# ---- the command ---------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("--url", default=None, help="an OpenAI-compatible server (default: start `k25 serve` here)")
    p.add_argument("--model", default=None,
                   help="the model to serve without --url; also the tokenizer of synthetic prompts (default: the "
                        "default model)")
    p.add_argument("--server-args", default="", help="more `k25 serve` options for the server started here")
    p.add_argument("--served-model-name", default=None, help="the request's 'model' (default: /v1/models' first)")
    p.add_argument("--tokenizer", default=None, help="a model file or directory whose tokenizer makes synthetic "
                                                     "prompts (default: --model, or with --url the served model "
                                                     "when this machine has it)")
    p.add_argument("--api-key", default=None, help="Bearer key (default: $K25_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="where synthetic prompts go (token ids to completions, text to chat)")
    p.add_argument("--dataset", default=None, help="a JSONL file of requests instead of synthetic ones")
    p.add_argument("--num-prompts", type=int, default=None, help="requests (default: 100 synthetic, or the dataset's)")
    p.add_argument("--input-len", default="512", help="prompt tokens: N, MEAN±SD, or a mix MEAN±SD:W,...")
    p.add_argument("--output-len", default="128", help="max_tokens, the same forms (dataset lines without one)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (k25, vLLM): every request runs to "
                                                            "max_tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals a second (default: inf, "
                                                                        "all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a stream may stay silent before its request fails (default: 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="50,95,99")
    p.add_argument("--goodput", nargs="*", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2e:10000")
    p.add_argument("--json", default=None, metavar="FILE", help="write the summary and every request's record")
    p.add_argument("--plot", default=None, metavar="FILE.svg", help="TTFT and TPOT CDFs, latency against prompt "
                                                                   "length")


def _tokenizer_for(a, served: str):
    """The tokenizer of synthetic prompts: --tokenizer, else --model, else (with --url) the served
    model's name when it names a model on this machine."""
    from .errors import ModelNotFoundError
    from .model import load_tokenizer, resolve_model_path

    source = a.tokenizer or a.model or (served if a.url is not None else None)
    try:
        tok = load_tokenizer(resolve_model_path(source))
    except ModelNotFoundError:
        raise BenchError(f"synthetic prompts are token ids of the served model's vocabulary, and {source!r} is "
                         "not a model on this machine: give --tokenizer (a .gguf file or HF directory of that "
                         "model), or --dataset") from None
    if tok is None:
        raise BenchError(f"{source or 'the default model'} has no tokenizer: give --tokenizer a model with one, "
                         "or --dataset")
    return tok


def main(a) -> int:
    if a.num_prompts is not None and a.num_prompts < 1:
        raise BenchError(f"--num-prompts must be positive, got {a.num_prompts}")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be positive, got {a.max_concurrency}")
    if not a.request_rate > 0:
        raise BenchError(f"--request-rate must be positive (inf: all at once), got {a.request_rate}")
    if a.request_timeout is not None and not a.request_timeout > 0:
        raise BenchError(f"--request-timeout must be positive, got {a.request_timeout}")
    try:
        percentiles = [float(x) for x in a.percentiles.split(",")]
    except ValueError:
        percentiles = [-1.0]
    if not all(0 <= p <= 100 for p in percentiles):
        raise BenchError(f"--percentiles takes numbers in [0, 100], got {a.percentiles!r}")
    slo = parse_goodput(a.goodput)
    if a.plot and not str(a.plot).endswith(".svg"):
        raise BenchError(f"--plot writes SVG: give a file name ending in .svg, got {a.plot!r}")
    parse_lengths(a.input_len), parse_lengths(a.output_len)  # bad specs fail before a server starts
    rng = np.random.default_rng(a.seed)
    reqs = dataset_requests(a.dataset, a.output_len, a.num_prompts, rng) if a.dataset else None
    api_key = a.api_key or os.environ.get("K25_API_KEY") or os.environ.get("OPENAI_API_KEY")
    server, records = None, None
    try:
        if a.url is None:
            server = OwnServer(a.model, a.server_args)
            base, api_key = server.url, None
        else:
            base = a.url.rstrip("/")
            if base.endswith("/v1"):
                base = base[:-3]
        model = a.served_model_name or served_model_name(base, api_key)
        if reqs is None:
            reqs = synthetic_requests(_tokenizer_for(a, model), a.input_len, a.output_len, a.num_prompts or 100,
                                      a.endpoint, rng)
        extra: Dict[str, Any] = {"temperature": a.temperature}
        if a.ignore_eos:
            extra["ignore_eos"] = True
        records, duration = asyncio.run(run_requests(base, model, reqs, request_rate=a.request_rate,
                                                     max_concurrency=a.max_concurrency, extra=extra,
                                                     api_key=api_key, rng=rng, request_timeout=a.request_timeout))
    finally:
        if server is not None:
            failed = records is None or any(not r.ok for r in records)
            server.stop(keep_log=failed)
            if failed:
                print(f"k25 bench: the server's log is kept at {server.log.name}", file=sys.stderr)
    summary = summarize(records, duration, percentiles, slo)
    print(format_summary(summary))
    if a.json:
        conf = {k: v for k, v in vars(a).items() if k not in ("fn", "api_key") and not callable(v)}
        conf["request_rate"] = None if math.isinf(a.request_rate) else a.request_rate
        conf.update(url=base, served_model_name=model)
        Path(a.json).write_text(json.dumps({"config": conf, "summary": summary,
                                            "requests": [asdict(r) for r in records]}, indent=1))
    if a.plot:
        plot_svg(records, a.plot)
    return 0 if summary["completed"] > 0 else 1
