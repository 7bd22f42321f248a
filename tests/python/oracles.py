"""Shared helpers for tests that compare k25 with Hugging Face transformers."""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import numpy as np
import torch

from k25.model import resolve_model_path


def default_gguf() -> Path:
    return resolve_model_path(None)


@contextlib.contextmanager
def memoised_gguf_parsing():
    """transformers' GGUF loading parses the file twice (config, then weights) and rebuilds
    gguf-py's tensor-name map once per submodule: most of the ~30 s a load of the default model
    took on this workplace's CPU box (about half with both memoised). Both are pure functions
    of their arguments, so while this is active each is computed once; the weights and config
    are what transformers computes either way (its loader and dequantisation still run)."""
    import gguf
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def shared_reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def load_hf_gguf():
    """transformers' model for the default GGUF, dequantised to float32."""
    from transformers import AutoModelForCausalLM
    path = default_gguf()
    with memoised_gguf_parsing():
        m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    m.eval()
    return m


def hf_logits(hf_model, ids) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([list(ids)])).logits[0].float().numpy()


def long_text() -> str:
    from pydoc_data import topics
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def check_greedy_against_reference(prompt, generated, ref_logits, near_tie=1e-3):
    """Every greedy token must be the reference's argmax given the same prefix, except where
    the reference's logit of the chosen token is within near_tie of its best (a near-tie),
    where the sequences may part.

    ref_logits: the reference's logits over prompt + generated (teacher-forced).
    Returns the number of tokens compared before any near-tie divergence.
    """
    P = len(prompt)
    for i, tok in enumerate(generated):
        row = ref_logits[P - 1 + i]
        best = int(np.argmax(row))
        if tok == best:
            continue
        gap = float(row[best] - row[tok])
        assert gap <= near_tie, (
            f"token {i}: k25 chose {tok} (logit {row[tok]:.5f}) but the reference's argmax is {best} "
            f"(logit {row[best]:.5f}); the gap {gap:.2e} is not a near-tie")
        return i
    return len(generated)


def write_random_checkpoint(path: Path, arch: str, dtype=torch.float32, shard_bytes=None, seed=0, **overrides):
    """A small random-weight HF checkpoint of the given architecture, written by transformers.

    `overrides` replace config fields (e.g. hidden_size=256 for head_dim 64 on the GPU)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)
    torch.manual_seed(seed)
    common = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  initializer_range=0.25, bos_token_id=1, eos_token_id=2)
    head_dim = overrides.pop("head_dim", 32)
    common.update(overrides)
    if arch == "llama3":
        cfg = LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                          **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1000000.0, **common)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif arch == "mistral":
        cfg = MistralConfig(num_key_value_heads=2, head_dim=head_dim, sliding_window=24, tie_word_embeddings=False,
                            rope_theta=10000.0, **common)
        model = MistralForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # norms away from 1 so that their weights are exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return model.float().eval()
