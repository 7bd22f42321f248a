"""Chat templates: turn a list of chat messages into the prompt text a model was trained on.

Templates are Jinja2 programs shipped with checkpoints (tokenizer_config.json, chat_template.jinja,
or the GGUF key ``tokenizer.chat_template``). They are untrusted code, so they run in Jinja's
ImmutableSandboxedEnvironment, configured the way Hugging Face transformers configures it
(trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson``
filter that keeps non-ASCII text and accepts ``indent``), so a template renders here exactly as it
renders in ``transformers``' ``apply_chat_template(..., tokenize=False)``.

Checkpoints without a template get :data:`DEFAULT_CHAT_TEMPLATE`, a plain ChatML template.

Errors:
    * a template that does not compile -> :class:`k25.errors.ModelLoadError`
      (it comes with the model, so the model is what is broken);
    * messages that are not a list of ``{"role": str, ...}`` dicts, or that the template rejects
      (``raise_exception``, a missing field the template needs, ...) -> :class:`k25.errors.RequestError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import ModelLoadError, RequestError

__all__ = ["DEFAULT_CHAT_TEMPLATE", "compile_chat_template", "render_chat"]

#: The fallback for checkpoints that ship no chat template: ChatML
#: (``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, then ``<|im_start|>assistant\n`` when a
#: generation prompt is asked for). It is the format most small open chat models are trained on;
#: for a model trained on another format the output will be poor, and the checkpoint should be
#: given its own template. ``content`` may be a string or a list of ``{"type": "text", "text": ...}``
#: parts (other parts are dropped); a missing/None content renders as empty.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}"
    "{% if part is mapping and part.get('type', 'text') == 'text' %}{{ part.get('text', '') }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: Any) -> None:
    import jinja2

    # TemplateError (not RequestError) so that render_chat's single except clause wraps it with context.
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' which would corrupt tool schemas shown to the model.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment():
    # Built lazily: importing jinja2 costs tens of milliseconds that raw-completion users never need.
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationBlock(jinja2.ext.Extension):
        # transformers' {% generation %} marks assistant spans for training masks; for inference the
        # block only has to render its body.
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class _Namespace(jinja2.utils.Namespace):
        # Underscore names on a namespace are the only way left for a sandboxed template to reach
        # interpreter internals, so they are refused outright.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                _Namespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key: str, value: Any) -> None:
            _Namespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key: Any) -> None:
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates may not set underscore attributes on a namespace ({key!r})")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=32)
def compile_chat_template(template: str):
    """Compile ``template`` (cached). Raises ModelLoadError when it is not valid Jinja."""
    if not isinstance(template, str):
        raise ModelLoadError(f"chat template must be a string, got {type(template).__name__}")
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelLoadError(
            f"the model's chat template does not compile: {e.message} (template line {e.lineno}); "
            "fix the template or pass one explicitly") from None
    except jinja2.exceptions.TemplateError as e:
        raise ModelLoadError(f"the model's chat template does not compile: {e}") from None


def _plain(value: Any, where: str) -> Any:
    # Templates only ever see JSON-like data: rich objects would expose methods to untrusted code,
    # and the copy keeps the template from mutating the caller's messages.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise RequestError(f"{where}: keys must be strings, got {type(k).__name__}")
            out[str.__str__(k)] = _plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise RequestError(f"{where}: unsupported type {type(value).__name__} (use str, numbers, bools, "
                       "lists and dicts)")


def _check_messages(messages: Any) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise RequestError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RequestError(f"messages[{i}] must be a dict with 'role' and 'content', "
                               f"got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}] needs a non-empty string 'role', got {role!r}")
        # OpenAI-style clients send content=None / tool_calls=None; templates test for the key's
        # presence and would print "None", so such keys are dropped (as transformers does).
        out.append(_plain({k: v for k, v in message.items() if v is not None}, f"messages[{i}]"))
    return out


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
    """Render ``messages`` with the Jinja chat ``template``.

    ``bos_token``/``eos_token`` and every ``extra`` keyword (``tools``, ``documents``, ``unk_token``,
    ``enable_thinking``, ...) become template variables. ``tools`` and ``documents`` default to None
    rather than undefined, because templates test ``tools is not none`` and transformers passes None.

    Raises ModelLoadError if the template does not compile, RequestError if the messages are
    malformed or the template rejects them.
    """
    compiled = compile_chat_template(template)
    msgs = _check_messages(messages)
    variables = {"tools": None, "documents": None}
    variables.update(_plain(extra, "chat template argument"))
    variables.update(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                     bos_token=bos_token or "", eos_token=eos_token or "")
    import jinja2

    try:
        return compiled.render(**variables)
    except jinja2.exceptions.TemplateError as e:
        raise RequestError(f"the chat template rejected the messages: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        # Templates index messages freely; a message missing a field they need lands here.
        raise RequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
