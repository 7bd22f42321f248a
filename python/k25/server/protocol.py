"""OpenAI request parsing and response building, shared by the server and `k25 batch`.

Every field of a request is checked by name: an unknown field, or a known one that k25
does not support, is a 400 naming it. Text is checked for invalid or unassigned code
points and control characters. Nothing here touches the engine.
"""
from __future__ import annotations

import json
import time
import unicodedata
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- JSON body --------------------------------------------------------------------

def parse_json_body(raw: bytes) -> Dict[str, Any]:
    if not raw:
        raise bad("the request body is empty; send a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}", code="invalid_json") from None
    except (RecursionError, ValueError) as e:  # nesting too deep; an integer of over 4300 digits
        raise bad(f"malformed JSON: {'nested too deeply' if isinstance(e, RecursionError) else e}",
                  code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    return obj


_ALLOWED_CONTROL = {"\t", "\n", "\r"}


def check_text(s: str, param: str) -> str:
    """Rejects lone surrogates, unassigned code points and control characters."""
    for i, ch in enumerate(s):
        cat = unicodedata.category(ch)
        if cat == "Cs":
            raise bad(f"'{param}' holds an invalid (surrogate) code point at character {i}", param)
        if cat == "Cn":
            raise bad(f"'{param}' holds an unassigned code point U+{ord(ch):04X} at character {i}", param)
        if cat == "Cc" and ch not in _ALLOWED_CONTROL:
            raise bad(f"'{param}' holds a control character U+{ord(ch):04X} at character {i}", param)
    return s


# ---- field checks -------------------------------------------------------------------

def _type_name(v) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _int(body, name, lo=None, hi=None, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer, got {_type_name(v)}", name, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def _num(body, name, lo=None, hi=None, default=None, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"'{name}' must be a number, got {_type_name(v)}", name, "invalid_type")
    v = float(v)
    if v != v or (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        raise bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return v


def _bool(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {_type_name(v)}", name, "invalid_type")
    return v


def _stop(body) -> List[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(v) > 16:
        raise bad("'stop' holds at most 16 strings", "stop")
    for s in v:
        if not s:
            raise bad("'stop' strings must not be empty", "stop")
        check_text(s, "stop")
    return v


def _stream_options(body) -> bool:
    v = body.get("stream_options")
    if v is None:
        return False
    if not isinstance(v, dict):
        raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
    for k in v:
        if k != "include_usage":
            raise bad(f"unknown field 'stream_options.{k}'", f"stream_options.{k}", "unknown_field")
    if not body.get("stream"):
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    return _bool(v, "include_usage")


# Fields accepted only at their neutral value (k25 does not implement the rest).
_NEUTRAL = {
    "logit_bias": lambda v: v in (None, {}),
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v is None,
    "parallel_tool_calls": lambda v: v is None,
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "response_format": lambda v: v in (None, {"type": "text"}),
    "service_tier": lambda v: v in (None, "auto", "default"),
    "store": lambda v: v in (None, False),
    "metadata": lambda v: v in (None, {}),
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "audio": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "function_call": lambda v: v is None,
    "functions": lambda v: v in (None, []),
    "web_search_options": lambda v: v is None,
}

_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "n", "stream", "stream_options", "user", "model",
                    "min_tokens", "ignore_eos"}
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "logprobs"}

MAX_N = 16


def _check_fields(body: Dict[str, Any], allowed: set) -> None:
    for k, v in body.items():
        if k in allowed:
            continue
        if k in _NEUTRAL:
            if _NEUTRAL[k](v):
                continue
            raise bad(f"'{k}' is not supported by this server", k, "unsupported_parameter")
        raise bad(f"unknown field '{k}'", k, "unknown_field")


@dataclass
class ParsedRequest:
    kind: str                         # "chat" | "completion"
    model: str
    prompts: List[Any]                # chat: one message list; completion: strings or id lists
    sampling: Dict[str, Any]          # keywords for K25Model.generate/stream
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None    # None: none; k: the sampled token and the k best
    user: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict)
    prompt_ids: List[List[int]] = field(default_factory=list)  # filled by the server
    requested_max_tokens: Optional[int] = None                 # the client's, before defaults


def _common(body: Dict[str, Any], kind: str) -> Tuple[Dict[str, Any], int]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string", "model", "missing_field" if model is None else "invalid_type")
    if kind == "chat" and body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        raise bad("give 'max_tokens' or 'max_completion_tokens', not both", "max_completion_tokens")
    max_tokens = _int(body, "max_completion_tokens", 1, 1 << 20) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 1 << 20)
    sampling = {
        "temperature": _num(body, "temperature", 0.0, 2.0, 1.0),
        "top_p": _num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        "top_k": _int(body, "top_k", -1, 1 << 20, 0),
        "min_p": _num(body, "min_p", 0.0, 1.0, 0.0),
        "presence_penalty": _num(body, "presence_penalty", -2.0, 2.0, 0.0),
        "frequency_penalty": _num(body, "frequency_penalty", -2.0, 2.0, 0.0),
        "repetition_penalty": _num(body, "repetition_penalty", 0.01, 100.0, 1.0),
        "seed": _int(body, "seed", -(1 << 63), (1 << 64) - 1),
        "stop": _stop(body),
        "min_new_tokens": _int(body, "min_tokens", 0, 1 << 20, 0),
        "ignore_eos": _bool(body, "ignore_eos"),
    }
    if sampling["top_k"] == -1:
        sampling["top_k"] = 0
    sampling["max_new_tokens"] = max_tokens  # None: the server fills in what is left of max_seq_len
    n = _int(body, "n", 1, MAX_N, 1)
    return sampling, n


def parse_chat(body: Dict[str, Any]) -> ParsedRequest:
    _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' is required and must be a non-empty array", "messages",
                  "missing_field" if messages is None else "invalid_value")
    clean = []
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{p}' must be an object", p, "invalid_type")
        for k in m:
            if k not in ("role", "content", "name"):
                raise bad(f"unknown field '{p}.{k}'", f"{p}.{k}", "unknown_field")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "developer"):
            raise bad(f"'{p}.role' must be system, user, assistant or developer", f"{p}.role")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"'{p}.content[{j}]' must be a text part; only text is supported",
                              f"{p}.content[{j}]", "unsupported_parameter")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"'{p}.content' must be a string", f"{p}.content", "invalid_type")
        check_text(content, f"{p}.content")
        clean.append({"role": "system" if role == "developer" else role, "content": content})
    sampling, n = _common(body, "chat")
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0, 20, 0)
    elif body.get("top_logprobs") is not None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    stream = _bool(body, "stream")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("'user' must be a string", "user", "invalid_type")
    return ParsedRequest("chat", body["model"], [clean], sampling, n, stream, _stream_options(body), logprobs, user,
                         body, requested_max_tokens=sampling["max_new_tokens"])


def parse_completion(body: Dict[str, Any]) -> ParsedRequest:
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt", "missing_field")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad("'prompt' must be a string, an array of strings, an array of token ids, or an array of such "
                  "arrays", "prompt", "invalid_type")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise bad("the prompt is empty", "prompt")
            check_text(p, "prompt")
    if len(prompts) > 64:
        raise bad("at most 64 prompts per request", "prompt")
    sampling, n = _common(body, "completion")
    logprobs = _int(body, "logprobs", 0, 20)
    stream = _bool(body, "stream")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("'user' must be a string", "user", "invalid_type")
    return ParsedRequest("completion", body["model"], prompts, sampling, n, stream, _stream_options(body), logprobs,
                         user, body, requested_max_tokens=sampling["max_new_tokens"])


# ---- responses ------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(tokenizer, lps) -> Optional[Dict[str, Any]]:
    if lps is None:
        return None
    content = []
    for lp in lps:
        tok = tokenizer.decode([lp.token_id]) if tokenizer else str(lp.token_id)
        content.append({
            "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [{"token": (t := tokenizer.decode([tid]) if tokenizer else str(tid)), "logprob": v,
                              "bytes": list(t.encode("utf-8"))} for tid, v in lp.top.items()],
        })
    return {"content": content}


def completion_logprobs(tokenizer, lps, text_offset0: int = 0) -> Optional[Dict[str, Any]]:
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset0
    for lp in lps:
        tok = tokenizer.decode([lp.token_id]) if tokenizer else str(lp.token_id)
        tokens.append(tok)
        token_lps.append(lp.logprob)
        tops.append({(tokenizer.decode([tid]) if tokenizer else str(tid)): v for tid, v in lp.top.items()})
        offsets.append(off)
        off += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def sse(obj: Union[Dict[str, Any], str]) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


def now() -> int:
    return int(time.time())
