"""k25 against Hugging Face transformers on the same weights.

The default GGUF model (transformers dequantises it to float32) and small random-weight
safetensors checkpoints written by transformers for Llama-3 (rope scaling), Qwen2 (QKV
bias, tied embeddings) and Mistral (sliding window, head_dim != hidden/heads).
Logits must agree closely at every position; greedy tokens must be the reference's
argmax at every step (a divergence is allowed only at a near-tie of its top two logits).
"""
import json

import numpy as np
import pytest
import torch

from k25 import K25Config, K25Model

from oracles import (check_greedy_against_reference, hf_logits, load_hf_gguf, long_text,
                     write_random_checkpoint)

LOGIT_ATOL = 1e-3  # float32 end to end; observed ~6e-5 on logits of magnitude ~30


@pytest.fixture(scope="module")
def k25_default():
    m = K25Model(K25Config(num_threads=2, kv_cache_bytes=256 << 20))
    yield m
    m.close()


@pytest.fixture(scope="module")
def hf_default():
    return load_hf_gguf()


def prompts(model):
    tok = model.tokenizer
    chat = tok.encode_chat([{"role": "user", "content": "What are three good habits for learning to code?"}])
    code = tok.encode("def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n    out = []\n")
    chinese = tok.encode_chat([{"role": "user", "content": "请用三句话介绍一下长城。"}])
    text = long_text()
    long_ids = tok.encode(text[:20000])[:1600]
    long_ids += tok.encode("\n\nSummarise the text above in one sentence:")
    assert len(long_ids) > 1500
    return {"chat": chat, "code": code, "chinese": chinese, "long": long_ids}


@pytest.mark.parametrize("name", ["chat", "code", "chinese", "long"])
def test_default_model_logits_and_greedy_tokens_match_transformers(k25_default, hf_default, name):
    ids = prompts(k25_default)[name]
    ours = k25_default.score(ids)
    out = k25_default.generate([ids], max_new_tokens=32, temperature=0.0, min_new_tokens=32)[0]
    assert len(out.token_ids) == 32
    # One teacher-forced reference pass over prompt + generated tokens: its first rows are the
    # prompt's logits (causal), the rest check every generated step.
    ref_full = hf_logits(hf_default, ids + out.token_ids)
    ref = ref_full[:len(ids)]
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max()
    assert err < LOGIT_ATOL, f"max |logit difference| {err}"
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.99

    # min_new_tokens bans EOS in k25; ban the same ids in the reference's rows.
    ref_full[:, k25_default.eos_token_ids] = -np.inf
    compared = check_greedy_against_reference(ids, out.token_ids, ref_full)
    assert compared >= 16, f"diverged at a near-tie after only {compared} tokens"


def test_unfused_path_matches_fused(k25_default):
    ids = prompts(k25_default)["code"]
    unfused = K25Model(K25Config(num_threads=2, kv_cache_bytes=64 << 20, enable_kernel_fusion=False))
    try:
        a = k25_default.score(ids)
        b = unfused.score(ids)
        assert np.abs(a - b).max() < 1e-3
        ga = k25_default.generate([ids], max_new_tokens=16, temperature=0.0)[0].token_ids
        gb = unfused.generate([ids], max_new_tokens=16, temperature=0.0)[0].token_ids
        assert ga == gb
        # A batch of decodes over different context lengths (the unfused path pads them into
        # one attention call).
        p = prompts(k25_default)
        batch = [ids, ids[: len(ids) // 3], p["chat"], p["chinese"]]
        ga = [o.token_ids for o in k25_default.generate(batch, max_new_tokens=12, temperature=0.0)]
        gb = [o.token_ids for o in unfused.generate(batch, max_new_tokens=12, temperature=0.0)]
        assert ga == gb
    finally:
        unfused.close()


@pytest.mark.parametrize("arch,dtype,shard", [
    ("llama3", torch.float32, None),
    ("llama3", torch.bfloat16, "150KB"),  # bf16 storage, sharded with an index
    ("qwen2", torch.float32, None),
    ("mistral", torch.float32, None),
])
def test_random_checkpoints_match_transformers(tmp_path, arch, dtype, shard):
    ref_model = write_random_checkpoint(tmp_path, arch, dtype=dtype, shard_bytes=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    # Reload the reference from disk so both sides see exactly the stored weights.
    from transformers import AutoModelForCausalLM
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 1000, (150,), generator=g).tolist()  # longer than the 24-token window
    for fused in (True, False):
        m = K25Model(K25Config(model_path=str(tmp_path), num_threads=2, kv_cache_bytes=32 << 20,
                               prefill_chunk_size=64, enable_kernel_fusion=fused))
        try:
            assert m.tokenizer is None  # the checkpoint has no tokenizer: ids only
            ours = m.score(prompt)
            ref = hf_logits(ref_model, prompt)
            scale = np.abs(ref).max()
            err = np.abs(ours - ref).max()
            assert err < 1e-4 * max(1.0, scale), f"{arch} fused={fused}: max |diff| {err} (scale {scale})"
            out = m.generate([prompt], max_new_tokens=24, temperature=0.0, min_new_tokens=24)[0]
            ref_full = hf_logits(ref_model, prompt + out.token_ids)
            ref_full[:, m.eos_token_ids] = -np.inf
            assert check_greedy_against_reference(prompt, out.token_ids, ref_full) >= 12
        finally:
            m.close()


def test_sliding_window_really_limits_attention(tmp_path):
    """Guards the test above: with the window ignored, Mistral's logits would differ."""
    write_random_checkpoint(tmp_path, "mistral")
    cfg = json.loads((tmp_path / "config.json").read_text())
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 1000, (80,), generator=g).tolist()
    m = K25Model(K25Config(model_path=str(tmp_path), num_threads=2, kv_cache_bytes=16 << 20))
    windowed = m.score(prompt)
    m.close()
    cfg["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = K25Model(K25Config(model_path=str(tmp_path), num_threads=2, kv_cache_bytes=16 << 20))
    full = m.score(prompt)
    m.close()
    np.testing.assert_allclose(windowed[:24], full[:24], atol=1e-4)  # inside the window: same
    assert np.abs(windowed[40:] - full[40:]).max() > 1e-2           # beyond it: different


def test_llama3_rope_scaling_is_applied(tmp_path):
    """Guards the parity test: dropping the llama3 scaling from config.json changes logits."""
    write_random_checkpoint(tmp_path, "llama3")
    prompt = torch.randint(3, 1000, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    m = K25Model(K25Config(model_path=str(tmp_path), num_threads=2, kv_cache_bytes=16 << 20))
    scaled = m.score(prompt)
    m.close()
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = K25Model(K25Config(model_path=str(tmp_path), num_threads=2, kv_cache_bytes=16 << 20))
    plain = m.score(prompt)
    m.close()
    assert np.abs(scaled - plain).max() > 1e-2
