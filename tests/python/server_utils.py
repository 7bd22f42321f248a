"""Helpers for tests that run `k25 serve` as a real subprocess on loopback."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"
KV_BYTES = 64 << 20


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `python -m k25.cli serve` process; its stdout and stderr go to `log_path`."""

    def __init__(self, tmp: Path, *args: str, name: str = "server", env: Optional[Dict[str, str]] = None,
                 api_key: Optional[str] = None, threads: int = 2, kv_bytes: int = KV_BYTES,
                 max_seq_len: int = 512):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(tmp) / f"{name}.log"
        # The spool under the test's own directory: a server stopped with SIGKILL (kill()) cannot
        # remove the default one (the system temp dir, named by port) the way a clean exit does.
        spool = [] if "--spool-dir" in args else ["--spool-dir", str(Path(tmp) / f"{name}-spool")]
        cmd = [sys.executable, "-m", "k25.cli", "serve", "--port", str(self.port), "--threads", str(threads),
               "--kv-cache-bytes", str(kv_bytes), "--max-seq-len", str(max_seq_len), *spool, *args]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1")
        full_env.pop("K25_API_KEY", None)
        full_env.update(env or {})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self.wait_ready()

    # ---- lifetime ------------------------------------------------------------------
    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"the server did not come up within {timeout} s:\n{self.log()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    # ---- I/O -----------------------------------------------------------------------
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def headers(self, **extra) -> Dict[str, str]:
        h = {}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        for k, v in extra.items():
            h[k.replace("_", "-")] = v
        return h

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=kw.pop("timeout", 60.0), **kw)

    def post(self, path: str, body=None, *, content: Optional[bytes] = None, headers: Optional[dict] = None,
             timeout: float = 60.0) -> httpx.Response:
        h = self.headers()
        h.update(headers or {})
        if content is None:
            content = json.dumps(body).encode()
            h.setdefault("content-type", "application/json")
        return httpx.post(self.url + path, content=content, headers=h, timeout=timeout)

    def metrics(self) -> "Metrics":
        r = httpx.get(self.url + "/metrics", timeout=10.0)
        assert r.status_code == 200, r.text
        return Metrics(r.text)

    def health(self) -> int:
        return httpx.get(self.url + "/healthz", timeout=10.0).status_code

    def queue_lines(self) -> Dict[str, List[dict]]:
        """[QUEUE] log lines by req_id: {"priority", "queue_time", "degraded", "mode"}."""
        out: Dict[str, List[dict]] = defaultdict(list)
        pat = re.compile(r"\[QUEUE\] req_id=(\S+) priority=(\S+) queue_time=([0-9.]+) degraded=(True|False)"
                         r"(?: mode=(\S+))?")
        for m in pat.finditer(self.log()):
            out[m.group(1)].append({"priority": m.group(2), "queue_time": float(m.group(3)),
                                    "degraded": m.group(4) == "True", "mode": m.group(5)})
        return out

    def wait_for(self, pred, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = pred()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"timed out waiting for {what} (last value {last!r})\n--- log tail ---\n"
                             f"{self.log()[-3000:]}")


class Metrics:
    """A parsed /metrics scrape: samples by (name, labels)."""

    def __init__(self, text: str):
        self.text = text
        self.samples: Dict[Tuple[str, frozenset], float] = {}
        self.families = set()
        self.types: Dict[str, str] = {}
        for fam in text_string_to_metric_families(text):
            self.families.add(fam.name)
            self.types[fam.name] = fam.type
            for s in fam.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def get(self, name: str, **labels) -> float:
        """The sum of the samples of `name` whose labels include `labels` (0 when none)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= set(ls))

    def series(self, name: str) -> Dict[frozenset, float]:
        return {ls: v for (n, ls), v in self.samples.items() if n == name}

    def has_family(self, name: str) -> bool:
        return name in self.families or f"# TYPE {name} " in self.text


def sse_events(resp: httpx.Response) -> Iterable[str]:
    """The `data:` payloads of an SSE response, in order (the raw strings)."""
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[6:]
        else:
            assert line == "" or line.startswith(":"), f"unexpected SSE line {line!r}"


def check_error_shape(resp: httpx.Response, status: int, param: Optional[str] = "__any__",
                      code: Optional[str] = "__any__") -> dict:
    """The response is an OpenAI-style error with `status`; returns the error object."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param != "__any__":
        assert err["param"] == param, err
    if code != "__any__":
        assert err["code"] == code, err
    return err


def listening_address(port: int) -> Optional[str]:
    """The local IPv4 address a LISTEN socket on `port` is bound to (from /proc/net/tcp)."""
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        local, state = parts[1], parts[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":
            raw = bytes.fromhex(addr)[::-1]
            return ".".join(str(b) for b in raw)
    return None
