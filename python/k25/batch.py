"""`k25 batch INPUT OUTPUT`: OpenAI batch-format JSONL through the engine, crash-safe.

Each input line is one request in the OpenAI batch format:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

(url /v1/chat/completions or /v1/completions). Each output line is one result:

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

The body of a 200 is the JSON the server returns for the same request (the same parsing,
tokenisation and response building: k25.server.protocol and k25.server.app), so with
temperature 0 it equals the server's answer except for "id" and "created". A body the
server would refuse gets its status and error body (400, 404 for another model name, 500
when generation fails), as OpenAI does. A line that is not a request at all (bad JSON,
missing or duplicate custom_id, another method or url, unknown envelope field) gets
`"response": null, "error": {"code", "message", "line"}`, where line is the 1-based line
number of the input. Blank lines are skipped. Streaming ("stream": true) is refused with
a 400: a batch result is one JSON object.

Results are appended in the order they complete, not in input order (match them by
custom_id). Every line is written with one write() followed by fsync, so a crash loses at
most the line being written. Started again on the same output, the run truncates a torn
last line away, skips every input line that already has a result, and does only the
rest: the output ends with exactly one result per non-blank input line. Result ids are
derived from the custom_id (from the line number for lines without a usable one), which
is how a restart recognises finished lines; an output that holds results for lines that
are not in the input is refused rather than appended to. An exclusive flock on the output
keeps a second run from writing the same file at once.
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, TextIO, Union

from .errors import K25Error

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
ENVELOPE_FIELDS = ("custom_id", "method", "url", "body")


class BatchError(K25Error):
    """A batch that cannot run: output locked, unreadable input, or an output that does
    not belong to this input."""


@dataclass
class BatchLine:
    """One non-blank input line, validated."""
    lineno: int                      # 1-based line number in the input file
    id: str                          # the result id ("batch_req_..."), stable across runs
    custom_id: Optional[str]
    kind: Optional[str] = None       # "chat" | "completion"; None when the line is invalid
    body: Any = None
    error: Optional[Dict[str, Any]] = None  # a line-level error: {"code", "message", "line"}


@dataclass
class BatchSummary:
    lines: int = 0      # non-blank input lines
    done: int = 0       # results with status 200 written by this run
    failed: int = 0     # error results (line errors, non-200 responses) written by this run
    skipped: int = 0    # lines that already had a result in the output
    truncated_bytes: int = 0  # a torn last line removed from the output

    def line(self, output_path) -> str:
        s = (f"k25 batch: {self.lines} lines: {self.done} done, {self.skipped} skipped (already in the output), "
             f"{self.failed} failed -> {output_path}")
        if self.truncated_bytes:
            s += f" (removed a torn last line of {self.truncated_bytes} bytes)"
        return s


def result_id(key: str) -> str:
    return "batch_req_" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


# ---- input ------------------------------------------------------------------------------

def read_input(path: Union[str, os.PathLike]) -> List[BatchLine]:
    """Every non-blank line of the input, validated; invalid ones carry their error."""
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")
    except OSError as e:
        raise BatchError(f"cannot read the input {path}: {e.strerror or e}") from None
    lines: List[BatchLine] = []
    seen: Dict[str, int] = {}
    for lineno, raw in enumerate(raw_lines, 1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if not raw.strip():
            continue
        lines.append(_validate_line(lineno, raw, seen))
    return lines


def _line_error(lineno: int, custom_id, code: str, message: str) -> BatchLine:
    cid = custom_id if isinstance(custom_id, str) else None
    return BatchLine(lineno, result_id(f"line:{lineno}"), cid,
                     error={"code": code, "message": f"line {lineno}: {message}", "line": lineno})


def _validate_line(lineno: int, raw: bytes, seen: Dict[str, int]) -> BatchLine:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return _line_error(lineno, None, "invalid_json_line", f"not valid UTF-8 (byte {e.start})")
    except json.JSONDecodeError as e:
        return _line_error(lineno, None, "invalid_json_line", f"malformed JSON: {e.msg} at column {e.colno}")
    except RecursionError:
        return _line_error(lineno, None, "invalid_json_line", "malformed JSON: nested too deeply")
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        return _line_error(lineno, None, "invalid_json_line", f"malformed JSON: {e}")
    if not isinstance(obj, dict):
        return _line_error(lineno, None, "invalid_json_line", "a line must be a JSON object")
    cid = obj.get("custom_id")
    if cid is None:
        return _line_error(lineno, None, "missing_custom_id", "'custom_id' is required")
    if not isinstance(cid, str) or not cid:
        return _line_error(lineno, None, "invalid_custom_id", "'custom_id' must be a non-empty string")
    if cid in seen:
        return _line_error(lineno, cid, "duplicate_custom_id",
                           f"the custom_id {cid!r} is a duplicate of line {seen[cid]}; custom_ids must be unique")
    seen[cid] = lineno
    for k in obj:
        if k not in ENVELOPE_FIELDS:
            return _line_error(lineno, cid, "unknown_field",
                               f"unknown field {k!r}; a line holds {', '.join(ENVELOPE_FIELDS)}")
    if obj.get("method") != "POST":
        return _line_error(lineno, cid, "invalid_method",
                           f"'method' must be \"POST\", got {json.dumps(obj.get('method'))}")
    url = obj.get("url")
    if url not in URLS:
        return _line_error(lineno, cid, "invalid_url",
                           f"'url' must be one of {', '.join(URLS)}, got {json.dumps(url)}")
    if "body" not in obj:
        return _line_error(lineno, cid, "missing_body", "'body' is required")
    return BatchLine(lineno, result_id(f"cid:{cid}"), cid, URLS[url], obj["body"])


# ---- output -----------------------------------------------------------------------------

class BatchOutput:
    """The output file, held under an exclusive lock; results are appended durably."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = os.fspath(path)
        existed = os.path.exists(self.path)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise BatchError(f"cannot open the output {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise BatchError(f"another k25 batch is writing {self.path} (its lock is held); wait for it to "
                                 "finish or choose another output file") from None
            raise BatchError(f"cannot lock the output {self.path}: {e.strerror or e}") from None
        if not existed:  # make the new file's directory entry durable too
            _fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def recover(self) -> tuple:
        """Reads the results already written: (their ids, bytes of a torn tail removed).

        A last line without its newline, or whose JSON does not parse, is what a crash in
        the middle of a write leaves; it is truncated away. Any other line that is not a
        result means the file is not ours: BatchError."""
        size = os.fstat(self.fd).st_size
        chunks, pos = [], 0
        while pos < size:
            b = os.pread(self.fd, min(1 << 24, size - pos), pos)
            if not b:
                break
            chunks.append(b)
            pos += len(b)
        data = b"".join(chunks)
        end = data.rfind(b"\n") + 1
        lines = data[:end].split(b"\n")[:-1]
        results = []
        offset = 0
        for i, raw in enumerate(lines, 1):
            try:
                obj = json.loads(raw.decode("utf-8"))
                ok = isinstance(obj, dict) and isinstance(obj.get("id"), str)
            except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
                ok = False
            if not ok:
                if i == len(lines):  # the last line: torn
                    end = offset
                    break
                raise BatchError(f"{self.path} line {i} is not a batch result; refusing to append to it "
                                 "(choose another output file)")
            # Only what resume needs: keeping every earlier body would hold the whole file.
            results.append({"id": obj["id"], "custom_id": obj.get("custom_id")})
            offset += len(raw) + 1
        torn = len(data) - end
        if torn:
            os.ftruncate(self.fd, end)
            os.fsync(self.fd)
        return results, torn

    def append(self, result: Dict[str, Any]) -> None:
        data = (json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        view = memoryview(data)
        try:
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
            os.fsync(self.fd)
        except OSError as e:  # a torn line left behind is cut by the next run
            raise BatchError(f"cannot write to the output {self.path}: {e.strerror or e}; run again to resume") \
                from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- results ----------------------------------------------------------------------------

def error_result(line: BatchLine) -> Dict[str, Any]:
    return {"id": line.id, "custom_id": line.custom_id, "response": None, "error": line.error}


def response_result(line: BatchLine, status: int, body: Dict[str, Any], request_id: str) -> Dict[str, Any]:
    return {"id": line.id, "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


async def run_line(line: BatchLine, model, model_name: str) -> Dict[str, Any]:
    """The result of one valid line, computed as the server computes a response."""
    from .server.app import _prepare, choice_params, response_body, run_choice
    from .server.protocol import ApiError, bad, parse_chat, parse_completion

    request_id = uuid.uuid4().hex
    try:
        if not isinstance(line.body, dict):
            raise bad("the request body must be a JSON object", code="invalid_json")
        p = parse_chat(line.body) if line.kind == "chat" else parse_completion(line.body)
        if p.model != model_name:
            raise ApiError(404, f"the model '{p.model}' does not exist; this batch runs '{model_name}'",
                           param="model", code="model_not_found")
        if p.stream:
            raise bad("'stream' is not supported in a batch; every result is one JSON object", "stream",
                      "unsupported_parameter")
        _prepare(model, p)
        tasks = [asyncio.ensure_future(run_choice(model, ids, kw)) for _, ids, kw in choice_params(p)]
        try:
            results = await asyncio.gather(*tasks)
        except K25Error as e:
            raise ApiError(500, f"generation failed: {e}", "internal_error") from None
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()  # aborts the engine requests of the other choices
        return response_result(line, 200, response_body(p, model_name, model.tokenizer, results), request_id)
    except ApiError as e:
        return response_result(line, e.status, e.body(), request_id)


def run_batch(input_path: Union[str, os.PathLike], output_path: Union[str, os.PathLike],
              model: Union["K25Model", Callable[[], "K25Model"]], concurrency: int = 32,
              model_name: Optional[str] = None, log: Optional[TextIO] = None) -> BatchSummary:  # noqa: F821
    """Runs every line of `input_path` that has no result in `output_path` yet, appending
    each result as it completes. Returns the counts; `log` (default stderr) gets the
    summary line.

    `model`: a K25Model, or a callable that returns one; the callable is called only once
    the output is locked and recovered and only if work is left, and the model it returns
    is closed at the end. `model_name`: the name requests must give in "model" and that
    the responses carry (default: the name `k25 serve` would serve the model under).
    `concurrency`: the most lines in flight at once (each may be several engine requests:
    n > 1 or several prompts). Raises BatchError when the output is locked by another run
    or does not belong to this input.
    """
    if concurrency < 1:
        raise BatchError(f"concurrency must be at least 1, got {concurrency}")
    log = sys.stderr if log is None else log
    if os.path.exists(output_path) and os.path.exists(input_path) and os.path.samefile(input_path, output_path):
        raise BatchError("the output must be another file than the input")
    summary = BatchSummary()
    lines = read_input(input_path)
    summary.lines = len(lines)
    with BatchOutput(output_path) as out:
        existing, summary.truncated_bytes = out.recover()
        expected = {ln.id for ln in lines}
        done_ids = set()
        for r in existing:
            if r["id"] not in expected:
                raise BatchError(f"{out.path} holds a result ({r['id']}, custom_id {r.get('custom_id')!r}) for no "
                                 f"line of {input_path}; was it written for another input? Choose another output "
                                 "file")
            if r["id"] in done_ids:
                raise BatchError(f"{out.path} holds two results with the id {r['id']}; it was not written by a "
                                 "single k25 batch")
            done_ids.add(r["id"])
        pending = []
        for ln in lines:
            if ln.id in done_ids:
                summary.skipped += 1
            elif ln.error is not None:  # known without the engine: written at once
                out.append(error_result(ln))
                summary.failed += 1
            else:
                pending.append(ln)
        if pending:
            own = not hasattr(model, "stream_events")
            m = model() if own else model
            try:
                if model_name is None:
                    from .server.run import served_name
                    model_name = served_name(None if m.config.model_path is None else str(m.config.model_path))
                asyncio.run(_process(pending, m, model_name, out, concurrency, summary))
            finally:
                if own:
                    m.close()
    print(summary.line(output_path), file=log, flush=True)
    return summary


async def _process(pending: List[BatchLine], model, model_name: str, out: BatchOutput, concurrency: int,
                   summary: BatchSummary) -> None:
    work = iter(pending)

    async def worker():
        for line in work:  # one shared iterator: each line goes to exactly one worker
            result = await run_line(line, model, model_name)
            out.append(result)
            if result["response"]["status_code"] == 200:
                summary.done += 1
            else:
                summary.failed += 1

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, len(pending)))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()  # re-raises a worker's unexpected failure
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
