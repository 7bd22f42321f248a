"""Tokenizer layer of k25: text <-> token ids, on top of Hugging Face ``tokenizers``.

Two sources are supported:

* a Hugging Face checkpoint directory (:meth:`Tokenizer.from_hf_dir`): ``tokenizer.json`` plus the
  optional ``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json`` and
  ``config.json``;
* the tokenizer metadata of a GGUF file (:meth:`Tokenizer.from_gguf_metadata`), interpreted the way
  llama.cpp interprets it: ``tokenizer.ggml.model`` "gpt2" (byte-level BPE, pre-tokenizer chosen by
  ``tokenizer.ggml.pre``) or "llama" (SentencePiece-style BPE over scores with ``<0xXX>`` byte
  fallback).

Decoding is defined on bytes: every token id maps to the exact bytes it contributes to the output
(:meth:`Tokenizer.token_bytes`), ``decode`` joins those bytes and decodes them as UTF-8 (invalid
sequences become U+FFFD), and :class:`IncrementalDetokenizer` streams the same bytes through an
incremental UTF-8 decoder. So the streamed text, the decoded text and the byte table the C++ engine
uses for stop strings always agree. Two deliberate differences from ``transformers``' ``decode``:
``clean_up_tokenization_spaces`` is never applied (it is lossy and cannot be streamed), and
tokenizer.json decoders other than byte-level and SentencePiece-style (Replace/ByteFallback/Fuse/Strip
or Metaspace) fall back to ``tokenizers``' own decode, where the byte table is only approximate.
"""

from __future__ import annotations

import bisect
import codecs
import itertools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from . import chat_template as _chat
from .errors import (CorruptModelError, ModelLoadError, ModelNotFoundError, RequestError,
                     UnsupportedModelError)

__all__ = ["Tokenizer", "IncrementalDetokenizer"]

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Types whose text is emitted verbatim and that skip_special_tokens removes (llama.cpp prints
# these only when asked for special tokens).
_SKIPPED_TYPES = frozenset({TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNUSED})
_VERBATIM_TYPES = frozenset({TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED,
                             TOKEN_TYPE_UNUSED})

_BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")
_SPM_SPACE = "\u2581"


def _gpt2_byte_to_unicode() -> dict[int, str]:
    # GPT-2 byte-level BPE spells every byte as a printable character: bytes that are already
    # printable (and not space) keep their own code point; the other 68 are moved to U+0100 and up,
    # in byte order.
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


_BYTE_TO_CHAR = _gpt2_byte_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
# Latin-1 code points equal byte values, so translate + encode("latin-1") recovers a byte-level
# token's bytes in C rather than in a per-character Python loop.
_BYTELEVEL_TRANSLATE = {ord(c): b for c, b in _CHAR_TO_BYTE.items()}
_NOT_BYTELEVEL_RE = re.compile("[^" + re.escape("".join(_BYTE_TO_CHAR.values())) + "]")


# --------------------------------------------------------------------------------------------
# Pre-tokenizers for GGUF "gpt2" vocabularies, keyed by tokenizer.ggml.pre (llama.cpp's names).
# Each llama.cpp regex list is applied in order, every match and every gap becoming a piece, which
# is what tokenizers' Split(..., "isolated") does. Where llama.cpp rewrote a regex for its own
# engine, the original Hugging Face regex it was derived from is used here.

_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_RE_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_SEED_CODER = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                  r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")

# kind: "gpt2" = ByteLevel's built-in GPT-2 regex; "digits" = each \p{N} isolated, then GPT-2;
# "split" = the listed regexes in order, then byte mapping.
# value: (kind, regexes, ignore_merges, add_bos default)
_PRE_TYPES: dict[str, tuple[str, tuple[str, ...], bool, bool]] = {}


def _register(names: Iterable[str], kind: str, regexes: tuple[str, ...] = (),
              ignore_merges: bool = False, add_bos: bool = False) -> None:
    for name in names:
        _PRE_TYPES[name] = (kind, regexes, ignore_merges, add_bos)


_register(["default"], "split", (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_register(["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "trillion",
           "granite-docling", "exaone4", "mellum", "jina-es", "jina-de", "jina-v2-es",
           "jina-v2-de"], "gpt2")
_register(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
           "mellum2"], "digits")
_register(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
           "lfm2"], "split", (_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_register(["dbrx", "smaug-bpe"], "split", (_RE_LLAMA3,))
_register(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"], "split", (_RE_QWEN2,))
_register(["falcon"], "split", (r"[\p{P}\$\+<=>\^~\|`]+",
                                r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                                r"[0-9][0-9][0-9]"))
_register(["deepseek-coder"], "split", (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+",
                                        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"))
_register(["poro-chat", "bloom", "gpt3-finnish"], "split",
          (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",))
_register(["gpt-4o", "llama4"], "split", (_RE_GPT4O,))
_register(["tekken"], "split", (_RE_TEKKEN,), ignore_merges=True, add_bos=True)
_register(["seed-coder"], "split", (_RE_SEED_CODER,))


def _bpe_pre_tokenizer(pre: str):
    try:
        kind, regexes, ignore_merges, add_bos = _PRE_TYPES[pre]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported GGUF pre-tokenizer type tokenizer.ggml.pre={pre!r}; k25 supports: "
            + ", ".join(sorted(_PRE_TYPES))) from None
    if kind == "gpt2":
        pt = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif kind == "digits":
        pt = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        pt = pre_tokenizers.Sequence(steps)
    return pt, ignore_merges, add_bos


# --------------------------------------------------------------------------------------------
# Byte tables.

def _bytelevel_token_bytes(tokens: Sequence[str]) -> list[bytes]:
    """Bytes of byte-level tokens, following tokenizers' ByteLevel decoder: a token whose every
    character is in the GPT-2 table is mapped back to bytes, any other token is taken verbatim."""
    joined = "".join(tokens)
    # One pass over the whole vocabulary keeps a 49k-token table at a few milliseconds.
    mapped = joined.translate(_BYTELEVEL_TRANSLATE).encode("latin-1", "replace")
    ends = list(itertools.accumulate(map(len, tokens)))
    out = [mapped[s:e] for s, e in zip(itertools.chain((0,), ends), ends)]
    for m in _NOT_BYTELEVEL_RE.finditer(joined):
        i = bisect.bisect_right(ends, m.start())
        out[i] = tokens[i].encode("utf-8")
    return out


def _spm_piece_bytes(piece: str, byte_fallback: bool, replacement: str = _SPM_SPACE) -> bytes:
    if byte_fallback:
        m = _BYTE_TOKEN_RE.match(piece)
        if m:
            return bytes((int(m.group(1), 16),))
    return piece.replace(replacement, " ").encode("utf-8")


# --------------------------------------------------------------------------------------------
# Small helpers.

def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptModelError(f"cannot parse {path}: {e}") from None
    if not isinstance(data, dict):
        raise CorruptModelError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens either as a string or as a serialized AddedToken.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _dedupe(ids: Iterable[int | None], vocab_size: int) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i is not None and 0 <= i < vocab_size and i not in out:
            out.append(i)
    return out


def _meta_int(meta: Mapping[str, Any], key: str) -> int | None:
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        v = v[0] if len(v) == 1 else None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise CorruptModelError(f"GGUF key {key} must be an integer, got {v!r}") from None


def _meta_bool(meta: Mapping[str, Any], key: str) -> bool | None:
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, (list, tuple)) and len(v) == 1:
        v = v[0]
    return bool(v)


def _meta_str(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


# Token texts that llama.cpp treats as end-of-generation even when the GGUF metadata does not name
# them (converted checkpoints often only record a single eos id).
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
              "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
              "<end_of_utterance>", "<\uff5cend\u2581of\u2581sentence\uff5c>")


# --------------------------------------------------------------------------------------------

class Tokenizer:
    """Encode text to token ids and decode ids back, plus the model's special tokens and chat template.

    Build one with :meth:`from_hf_dir` or :meth:`from_gguf_metadata`. Instances are immutable and
    safe to share between threads.
    """

    def __init__(self, hf: _HFTokenizer, *, mode: str, token_bytes: list[bytes] | None,
                 special_ids: Iterable[int], strip_leading_space: bool = False,
                 bos_token_id: int | None = None, eos_token_ids: Iterable[int] = (),
                 pad_token_id: int | None = None, unk_token_id: int | None = None,
                 add_bos: bool = False, add_eos: bool = False, chat_template: str | None = None,
                 vocab_size: int | None = None, source: str = "") -> None:
        # Internal: use from_hf_dir / from_gguf_metadata.
        if mode not in ("bytelevel", "spm", "generic"):
            raise ValueError(f"unknown tokenizer mode {mode!r}")
        self._hf = hf
        self._mode = mode
        self._source = source
        self._vocab_size = int(vocab_size if vocab_size is not None
                               else hf.get_vocab_size(with_added_tokens=True))
        self._special_ids = frozenset(special_ids)
        self._strip_leading_space = bool(strip_leading_space) and mode != "generic"
        self._bos = bos_token_id
        self._eos = list(eos_token_ids)
        self._pad = pad_token_id
        self._unk = unk_token_id
        self._add_bos = bool(add_bos)
        self._add_eos = bool(add_eos)
        if self._add_bos and self._bos is None:
            raise ModelLoadError(f"{source}: the tokenizer asks for a BOS token but names none")
        if self._add_eos and not self._eos:
            raise ModelLoadError(f"{source}: the tokenizer asks for an EOS token but names none")
        if chat_template is not None:
            # Fail at load rather than on the first chat request.
            _chat.compile_chat_template(chat_template)
        self._chat_template = chat_template
        if token_bytes is None:
            token_bytes = self._generic_token_bytes()
        if len(token_bytes) != self._vocab_size:
            raise CorruptModelError(f"{source}: byte table has {len(token_bytes)} entries for "
                                    f"{self._vocab_size} tokens")
        self._token_bytes = token_bytes

    # ---- constructors ------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face checkpoint directory.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (bos/eos/pad/unk tokens,
        ``add_bos_token``/``add_eos_token``, ``chat_template`` as a string or a list of named
        templates, of which "default" is used, ``added_tokens_decoder``), ``chat_template.jinja``
        (overrides the config's template, as in transformers), and ``generation_config.json`` /
        ``config.json`` for more end-of-sequence ids. When the config does not say whether to add
        BOS/EOS, the tokenizer.json post-processor decides.
        """
        root = Path(path)
        if not root.is_dir():
            raise ModelNotFoundError(f"tokenizer directory {str(root)!r} does not exist")
        tj = root / "tokenizer.json"
        if not tj.is_file():
            raise ModelNotFoundError(
                f"{str(tj)!r} not found: k25 needs the 'fast' tokenizer file tokenizer.json "
                "(checkpoints with only tokenizer.model/vocab.json can be converted by loading them "
                "with transformers' AutoTokenizer and calling save_pretrained)")
        try:
            hf = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON or unknown types
            raise CorruptModelError(f"cannot load {str(tj)!r}: {e}") from None

        cfg = _read_json(root / "tokenizer_config.json") or {}
        gen = _read_json(root / "generation_config.json") or {}
        mcfg = _read_json(root / "config.json") or {}

        # Tokens the config declares but tokenizer.json lacks (older checkpoints) are added, as
        # transformers does, when they land on the id the config gives them.
        declared = cfg.get("added_tokens_decoder")
        if isinstance(declared, Mapping):
            numbered = sorted((int(k), v) for k, v in declared.items()
                              if str(k).isdigit() and isinstance(v, Mapping))
            for key, spec in numbered:
                content = _token_content(spec)
                if content is None or hf.token_to_id(content) is not None:
                    continue
                if key != hf.get_vocab_size(with_added_tokens=True):
                    continue
                tok = AddedToken(content, special=bool(spec.get("special", False)),
                                 normalized=bool(spec.get("normalized", not spec.get("special", False))),
                                 lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                                 single_word=bool(spec.get("single_word", False)))
                if spec.get("special", False):
                    hf.add_special_tokens([tok])
                else:
                    hf.add_tokens([tok])

        vocab = hf.get_vocab(with_added_tokens=True)
        vocab_size = max(vocab.values(), default=-1) + 1
        id_to_token = [""] * vocab_size
        for text, i in vocab.items():
            id_to_token[i] = text
        special_ids = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}

        def tid(name: str) -> int | None:
            content = _token_content(cfg.get(name))
            return None if content is None else hf.token_to_id(content)

        bos = tid("bos_token")
        eos = tid("eos_token")
        pad = tid("pad_token")
        unk = tid("unk_token")

        post_bos, post_eos = cls._post_processor_specials(hf)
        add_bos = cfg.get("add_bos_token")
        add_eos = cfg.get("add_eos_token")
        if not isinstance(add_bos, bool):
            add_bos = post_bos is not None and (bos is None or post_bos == bos)
        if not isinstance(add_eos, bool):
            add_eos = post_eos is not None and (eos is None or post_eos == eos)
        if bos is None:
            bos = post_bos if post_bos is not None else (_id_list(gen.get("bos_token_id"))
                                                         or _id_list(mcfg.get("bos_token_id")) or [None])[0]
        if pad is None:
            pad = (_id_list(gen.get("pad_token_id")) or _id_list(mcfg.get("pad_token_id")) or [None])[0]
        eos_ids = _dedupe([eos, post_eos if add_eos else None, *_id_list(gen.get("eos_token_id")),
                           *_id_list(mcfg.get("eos_token_id"))], vocab_size)
        if bos is not None and not 0 <= bos < vocab_size:
            bos = None
        if pad is not None and not 0 <= pad < vocab_size:
            pad = None
        # transformers quietly drops add_bos/add_eos when the token is not defined; do the same
        # rather than refuse a checkpoint it loads.
        add_bos = add_bos and bos is not None
        add_eos = add_eos and bool(eos_ids)

        template = cls._hf_chat_template(root, cfg)

        mode, token_bytes, strip = cls._hf_decoding(hf, id_to_token)
        return cls(hf, mode=mode, token_bytes=token_bytes, special_ids=special_ids,
                   strip_leading_space=strip, bos_token_id=bos, eos_token_ids=eos_ids,
                   pad_token_id=pad, unk_token_id=unk, add_bos=add_bos, add_eos=add_eos,
                   chat_template=template, vocab_size=vocab_size, source=str(root))

    @staticmethod
    def _post_processor_specials(hf: _HFTokenizer) -> tuple[int | None, int | None]:
        """(first, last) special-token ids that the tokenizer.json post-processor wraps a single
        sequence with, if it is a TemplateProcessing."""
        pp = hf.post_processor
        if pp is None:
            return None, None
        try:
            spec = json.loads(pp.__getstate__())
        except Exception:
            return None, None
        stack = [spec]
        while stack:
            node = stack.pop()
            if not isinstance(node, dict):
                continue
            if node.get("type") == "Sequence":
                stack.extend(reversed(node.get("processors") or []))
                continue
            if node.get("type") != "TemplateProcessing":
                continue
            single = node.get("single") or []
            specials = node.get("special_tokens") or {}

            def special_id(item: Any) -> int | None:
                if isinstance(item, dict) and "SpecialToken" in item:
                    name = item["SpecialToken"].get("id")
                    ids = (specials.get(name) or {}).get("ids") or []
                    if len(ids) == 1:
                        return int(ids[0])
                    return hf.token_to_id(name) if isinstance(name, str) else None
                return None

            first = special_id(single[0]) if single else None
            last = special_id(single[-1]) if len(single) > 1 else None
            return first, last
        return None, None

    @staticmethod
    def _hf_chat_template(root: Path, cfg: Mapping[str, Any]) -> str | None:
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                return jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CorruptModelError(f"cannot read {jinja_file}: {e}") from None
        template = cfg.get("chat_template")
        if template is None:
            extra = _read_json(root / "chat_template.json") or {}
            template = extra.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            if "default" in named:
                template = named["default"]
            elif named:
                # No "default": transformers would demand a name; the first one is the best guess.
                template = next(iter(named.values()))
            else:
                template = None
        if template is not None and not isinstance(template, str):
            raise CorruptModelError(f"{root}: chat_template must be a string or a list of "
                                    f"{{name, template}}, got {type(template).__name__}")
        return template

    @staticmethod
    def _hf_decoding(hf: _HFTokenizer, id_to_token: list[str]) -> tuple[str, list[bytes] | None, bool]:
        """Work out from the tokenizer.json decoder how each token turns into bytes."""
        dec = hf.decoder
        if dec is None:
            return "generic", None, False
        try:
            spec = json.loads(dec.__getstate__())
        except Exception:
            return "generic", None, False
        steps = spec.get("decoders") if spec.get("type") == "Sequence" else [spec]
        types = [s.get("type") for s in steps if isinstance(s, dict)]
        if types == ["ByteLevel"]:
            return "bytelevel", _bytelevel_token_bytes(id_to_token), False
        if types == ["Metaspace"]:
            repl = steps[0].get("replacement", _SPM_SPACE)
            scheme = steps[0].get("prepend_scheme")
            if scheme is None:
                scheme = "always" if steps[0].get("add_prefix_space", True) else "never"
            return "spm", [_spm_piece_bytes(t, False, repl) for t in id_to_token], scheme != "never"
        # SentencePiece-style chain: Replace(▁ -> " "), optional ByteFallback, Fuse, optional Strip.
        replace_ok = False
        byte_fallback = False
        strip = False
        for s in steps:
            t = s.get("type")
            if t == "Replace" and (s.get("pattern") or {}).get("String") == _SPM_SPACE and s.get("content") == " ":
                replace_ok = True
            elif t == "ByteFallback":
                byte_fallback = True
            elif t == "Fuse":
                pass
            elif t == "Strip" and s.get("content") == " " and s.get("start") in (0, 1) and s.get("stop") == 0:
                strip = s.get("start") == 1
            else:
                return "generic", None, False
        if not replace_ok:
            return "generic", None, False
        return "spm", [_spm_piece_bytes(t, byte_fallback) for t in id_to_token], strip

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (key -> Python value, e.g. from
        ``gguf.GGUFReader`` ``field.contents()``).

        Supported ``tokenizer.ggml.model`` values: "gpt2" (byte-level BPE; ``tokenizer.ggml.pre``
        selects llama.cpp's pre-tokenizer, missing means "default") and "llama" (SentencePiece
        BPE: merges come from ``tokenizer.ggml.scores``, bytes outside the vocabulary fall back to
        ``<0xXX>`` tokens, ``tokenizer.ggml.add_space_prefix`` defaults to true). Token types:
        CONTROL/UNKNOWN tokens are special (matched whole in text, removed by skip_special_tokens),
        USER_DEFINED tokens are matched whole and kept. End-of-sequence ids are
        ``tokenizer.ggml.eos_token_id``, ``eot_token_id``, ``eom_token_id`` and, like llama.cpp,
        any token spelled like a known end-of-turn marker ("<|im_end|>", "<|endoftext|>", ...).
        """
        if not isinstance(meta, Mapping):
            raise ModelLoadError(f"GGUF metadata must be a mapping, got {type(meta).__name__}")
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
        model = _meta_str(model)
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; k25 supports "
                "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)")
        raw_tokens = meta.get("tokenizer.ggml.tokens")
        if raw_tokens is None or isinstance(raw_tokens, (str, bytes)) or len(raw_tokens) == 0:
            raise CorruptModelError("GGUF file has no token list (tokenizer.ggml.tokens)")
        tokens = [t if type(t) is str else _meta_str(t) for t in raw_tokens]
        n = len(tokens)
        types_raw = meta.get("tokenizer.ggml.token_type")
        if types_raw is None:
            types = [TOKEN_TYPE_NORMAL] * n
        else:
            types = [int(t) for t in types_raw]
            if len(types) < n:
                raise CorruptModelError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
            types = types[:n]
        empty = [i for i, t in enumerate(tokens) if not t]
        for i in empty:
            # llama.cpp renames empty tokens so that the vocabulary stays a bijection.
            tokens[i] = f"[EMPTY_{i}]"
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if t in seen:
                    raise CorruptModelError(f"duplicate token {t!r} in GGUF vocabulary (ids {seen[t]} and {i})")
                seen[t] = i

        bos = _meta_int(meta, "tokenizer.ggml.bos_token_id")
        eos = _meta_int(meta, "tokenizer.ggml.eos_token_id")
        eot = _meta_int(meta, "tokenizer.ggml.eot_token_id")
        eom = _meta_int(meta, "tokenizer.ggml.eom_token_id")
        unk = _meta_int(meta, "tokenizer.ggml.unknown_token_id")
        pad = _meta_int(meta, "tokenizer.ggml.padding_token_id")
        if model == "llama":
            # llama.cpp's defaults for SentencePiece vocabularies.
            bos = 1 if bos is None and n > 1 else bos
            eos = 2 if eos is None and n > 2 else eos
            unk = 0 if unk is None else unk
        bos, eos, eot, eom, unk, pad = (i if i is not None and 0 <= i < n else None
                                        for i in (bos, eos, eot, eom, unk, pad))
        if types_raw is None:
            for i in (bos, eos, eot, eom, pad):
                if i is not None:
                    types[i] = TOKEN_TYPE_CONTROL
            if unk is not None:
                types[unk] = TOKEN_TYPE_UNKNOWN
            if model == "llama":
                for i, t in enumerate(tokens):
                    if _BYTE_TOKEN_RE.match(t):
                        types[i] = TOKEN_TYPE_BYTE

        if model == "gpt2":
            hf, add_bos_default = cls._gguf_bpe(meta, tokens, vocab)
            token_bytes = _bytelevel_token_bytes(tokens)
            mode, strip = "bytelevel", False
        else:
            add_space_prefix = _meta_bool(meta, "tokenizer.ggml.add_space_prefix")
            add_space_prefix = True if add_space_prefix is None else add_space_prefix
            hf = cls._gguf_spm(meta, tokens, types, vocab, unk, add_space_prefix)
            add_bos_default = True
            token_bytes = [t.replace(_SPM_SPACE, " ").encode("utf-8") for t in tokens]
            mode, strip = "spm", add_space_prefix

        # Special and user-defined tokens are matched whole in the input, before the model sees it.
        added = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
                added.append(AddedToken(t, special=True, normalized=False))
            elif ty == TOKEN_TYPE_USER_DEFINED:
                added.append(AddedToken(t, special=False, normalized=False))
            if ty in _VERBATIM_TYPES:
                token_bytes[i] = t.encode("utf-8")
            elif ty == TOKEN_TYPE_BYTE:
                token_bytes[i] = _spm_piece_bytes(t, True)
        if added:
            hf.add_tokens(added)
        for i in empty:
            token_bytes[i] = b""
        special_ids = [i for i, ty in enumerate(types) if ty in _SKIPPED_TYPES]

        add_bos = _meta_bool(meta, "tokenizer.ggml.add_bos_token")
        add_bos = add_bos_default if add_bos is None else add_bos
        add_eos = bool(_meta_bool(meta, "tokenizer.ggml.add_eos_token"))

        eog = [vocab.get(t) for t in _EOG_TEXTS]
        if "<|return|>" in vocab and "<|call|>" in vocab:
            # gpt-oss ends a message with <|end|> but keeps generating (llama.cpp does the same).
            eog = [i for i in eog if i != vocab.get("<|end|>")]
        eos_ids = _dedupe([eos, eot, eom, *eog], n)

        template = meta.get("tokenizer.chat_template")
        template = None if template is None else _meta_str(template)
        return cls(hf, mode=mode, token_bytes=token_bytes, special_ids=special_ids,
                   strip_leading_space=strip, bos_token_id=bos, eos_token_ids=eos_ids,
                   pad_token_id=pad, unk_token_id=unk, add_bos=add_bos, add_eos=add_eos,
                   chat_template=template, vocab_size=n, source="GGUF tokenizer")

    @staticmethod
    def _gguf_bpe(meta: Mapping[str, Any], tokens: list[str], vocab: dict[str, int]):
        pre = meta.get("tokenizer.ggml.pre")
        pre = "default" if pre is None else _meta_str(pre)
        pre_tok, ignore_merges, add_bos_default = _bpe_pre_tokenizer(pre)
        raw_merges = meta.get("tokenizer.ggml.merges")
        if raw_merges is None:
            raise CorruptModelError("GGUF gpt2 tokenizer has no merges (tokenizer.ggml.merges)")
        merges = []
        for m in raw_merges:
            m = m if type(m) is str else _meta_str(m)
            # Split at the first space after position 0, as llama.cpp does, so a left part that is
            # itself a space survives.
            cut = m.find(" ", 1)
            if cut < 0:
                raise CorruptModelError(f"malformed GGUF merge {m!r} (expected 'left right')")
            merges.append((m[:cut], m[cut + 1:]))
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges)
        except Exception as e:
            raise CorruptModelError(f"inconsistent GGUF BPE vocabulary/merges: {e}") from None
        hf = _HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tok
        hf.decoder = decoders.ByteLevel()
        return hf, add_bos_default

    @staticmethod
    def _gguf_spm(meta: Mapping[str, Any], tokens: list[str], types: list[int], vocab: dict[str, int],
                  unk: int | None, add_space_prefix: bool):
        raw_scores = meta.get("tokenizer.ggml.scores")
        n = len(tokens)
        if raw_scores is None:
            scores = [0.0] * n
        else:
            scores = [float(s) for s in raw_scores]
            if len(scores) < n:
                raise CorruptModelError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
        # llama.cpp's SentencePiece tokenizer repeatedly merges the adjacent pair whose concatenation
        # is the highest-scoring vocabulary piece. A BPE whose merges are every (left, right) split of
        # every piece, ranked by the piece's score, makes the same choices (ties between different
        # pieces of equal score aside: llama.cpp takes the leftmost pair, BPE the lower rank).
        pieces = {t for t, ty in zip(tokens, types) if ty in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNDEFINED)}
        candidates = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if len(t) < 2 or t not in pieces:
                continue
            s = -scores[i]
            for k in range(1, len(t)):
                left = t[:k]
                if left in pieces:
                    right = t[k:]
                    if right in pieces:
                        candidates.append((s, i, k, left, right))
        candidates.sort()
        merges = [(c[3], c[4]) for c in candidates]
        has_all_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
        unk_text = tokens[unk] if unk is not None else None
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk_text, fuse_unk=True,
                             byte_fallback=has_all_bytes)
        except Exception as e:
            raise CorruptModelError(f"inconsistent GGUF SentencePiece vocabulary: {e}") from None
        hf = _HFTokenizer(bpe)
        steps = []
        if add_space_prefix:
            steps.append(normalizers.Prepend(_SPM_SPACE))
        steps.append(normalizers.Replace(" ", _SPM_SPACE))
        hf.normalizer = normalizers.Sequence(steps)
        hf.decoder = decoders.Sequence(
            [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
        return hf

    def _generic_token_bytes(self) -> list[bytes]:
        texts = self._hf.decode_batch([[i] for i in range(self._vocab_size)], skip_special_tokens=False)
        return [t.encode("utf-8") for t in texts]

    # ---- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (max id + 1). The model's embedding table may be larger."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation; the first is the model's primary EOS."""
        return list(self._eos)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos[0] if self._eos else None

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    @property
    def unk_token_id(self) -> int | None:
        return self._unk

    @property
    def add_bos(self) -> bool:
        """Whether encode(..., add_special_tokens=True) prepends BOS."""
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        """Whether encode(..., add_special_tokens=True) appends EOS."""
        return self._add_eos

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template, or None (apply_chat_template then uses ChatML)."""
        return self._chat_template

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that decode(..., skip_special_tokens=True) drops."""
        return self._special_ids

    @property
    def hf_tokenizer(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (BOS/EOS are added by this class, not by it)."""
        return self._hf

    def to_str(self, pretty: bool = False) -> str:
        """The underlying tokenizer as tokenizer.json text."""
        return self._hf.to_str(pretty)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._hf.id_to_token(token_id) or ""

    # ---- encode / decode ----------------------------------------------------------------------

    def _wrap(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self._bos)
            if self._add_eos:
                ids.append(self._eos[0])
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token text in ``text`` (e.g. "<|im_start|>") is encoded as
        that special token, which is what rendered chat templates need."""
        if not isinstance(text, str):
            raise RequestError(f"text to encode must be a str, got {type(text).__name__}")
        return self._wrap(self._hf.encode(text, add_special_tokens=False).ids, add_special_tokens)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise RequestError("encode_batch needs a list of str")
        encs = self._hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, add_special_tokens) for e in encs]

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        try:
            ids = [int(i) for i in ids]
        except (TypeError, ValueError):
            raise RequestError("token ids must be integers") from None
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise RequestError(f"token id {bad} is out of range [0, {self._vocab_size})")
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``: their token_bytes joined and decoded as UTF-8, invalid sequences as U+FFFD.

        For SentencePiece vocabularies that add a space prefix, one leading space of the result is
        removed (the one encode added), as SentencePiece and transformers do.
        """
        ids = self._check_ids(ids)
        if self._mode == "generic":
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        table = self._token_bytes
        if skip_special_tokens and self._special_ids:
            skip = self._special_ids
            data = b"".join([table[i] for i in ids if i not in skip])
        else:
            data = b"".join([table[i] for i in ids])
        if self._strip_leading_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", "replace")

    def token_bytes(self) -> list[bytes]:
        """For every id, the raw UTF-8 bytes the token contributes to decoded text.

        Byte-level BPE tokens map through the GPT-2 byte table; SentencePiece pieces have "▁" as a
        space and ``<0xAB>`` as that byte; special and user-defined tokens are their text. For
        ordinary text ``b"".join(table[i] for i in ids) == decode(ids).encode()``, except that
        SentencePiece decoding drops one leading space of the whole output (see decode), and in
        "generic" mode (a tokenizer.json with another kind of decoder) the table is each token
        decoded on its own.
        """
        return list(self._token_bytes)

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render ``messages`` with the checkpoint's chat template (ChatML when it has none).

        Template variables bos_token/eos_token/unk_token/pad_token are the token texts, as in
        transformers; ``extra`` adds more (``tools=...``, ``enable_thinking=...``). The result may
        already start with BOS text, so encode it with ``add_special_tokens=False`` (or use
        :meth:`encode_chat`).
        """
        template = self._chat_template if self._chat_template is not None else _chat.DEFAULT_CHAT_TEMPLATE
        variables = {"unk_token": self._token_text(self._unk), "pad_token": self._token_text(self._pad)}
        variables.update(extra)
        return _chat.render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                                 bos_token=self._token_text(self._bos),
                                 eos_token=self._token_text(self.eos_token_id), **variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Token ids of the rendered chat, without adding BOS/EOS again (transformers'
        ``apply_chat_template(..., tokenize=True)``)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra),
                           add_special_tokens=False)

    def __repr__(self) -> str:
        return (f"Tokenizer({self._source!r}, mode={self._mode}, vocab_size={self._vocab_size}, "
                f"bos={self._bos}, eos={self._eos}, add_bos={self._add_bos})")


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text pieces.

    ``push(ids)`` returns the text that became final; bytes of a character that is not complete yet
    are held back (at most 3), so a piece never ends inside a UTF-8 character. ``flush()`` returns
    what is left, with U+FFFD for a sequence that never completed. The concatenation of all pieces
    equals ``tokenizer.decode(generated_ids)``; when ``prompt_ids`` are given, it equals the text
    that the generated ids add after the prompt, i.e. SentencePiece's leading space is kept when
    something was decoded before. Each push costs O(len(ids)).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = tokenizer._special_ids if skip_special_tokens else frozenset()
        self._skip_special = bool(skip_special_tokens)
        self._generic = tokenizer._mode == "generic"
        prompt = tokenizer._check_ids(prompt_ids) if prompt_ids is not None else []
        if self._generic:
            # Window of ids re-decoded on each push: text before read_offset was already returned,
            # ids from prefix_offset give the decoder the context it needs for spacing.
            self._ids = prompt[-6:]
            self._prefix_offset = 0
            self._read_offset = len(self._ids)
            return
        self._table = tokenizer._token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        table, skip = self._table, self._skip
        emitted_before = any(table[i] and i not in skip for i in prompt)
        self._strip_pending = tokenizer._strip_leading_space and not emitted_before

    def push(self, new_ids: Iterable[int]) -> str:
        ids = self._tok._check_ids(list(new_ids))
        if self._generic:
            return self._push_generic(ids)
        table, skip = self._table, self._skip
        parts = []
        for i in ids:
            if i in skip:
                continue
            b = table[i]
            if not b:
                continue
            if self._strip_pending:
                self._strip_pending = False
                if b[:1] == b" ":
                    b = b[1:]
            parts.append(b)
        if not parts:
            return ""
        return self._decoder.decode(b"".join(parts))

    def flush(self) -> str:
        """Return the held-back remainder (U+FFFD for an unfinished character) and reset."""
        if self._generic:
            out = self._push_generic([], final=True)
            self._prefix_offset = self._read_offset = len(self._ids)
            return out
        return self._decoder.decode(b"", final=True)

    def _push_generic(self, ids: list[int], final: bool = False) -> str:
        self._ids.extend(ids)
        dec = self._tok._hf.decode
        prefix = dec(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self._skip_special)
        full = dec(self._ids[self._prefix_offset:], skip_special_tokens=self._skip_special)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        out = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the id list bounded: only the current window matters.
        if self._prefix_offset > 64:
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return out
