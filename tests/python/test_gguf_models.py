"""GGUF files of other architectures and tensor types, against transformers' GGUF loader.

The tests convert small random Hugging Face checkpoints to GGUF the way llama.cpp's
converter does (tensor names, q/k row interleaving for "llama"), with a mix of F32, F16,
BF16, Q8_0, Q4_0 and Q4_1 tensors, then load the file in both k25 and transformers.
"""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from k25 import K25Config, K25Model

from oracles import hf_logits, write_random_checkpoint

TYPES = {  # role -> storage type, so every supported type is exercised
    "token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.F16,
    "attn_output": Q.BF16, "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0, "output": Q.F16,
}


def interleave_qk(w, n_head):
    """llama.cpp's converter reorders q/k rows of "llama" models for its RoPE kernel."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add(writer, name, arr, qtype):
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == Q.F32:
        writer.add_tensor(name, arr)
    elif qtype == Q.F16:
        writer.add_tensor(name, arr.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)


def write_gguf(model, path, arch):
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    add(w, "token_embd.weight", sd["model.embed_tokens.weight"], TYPES["token_embd"])
    add(w, "output_norm.weight", sd["model.norm.weight"], Q.F32)
    if "lm_head.weight" in sd and not cfg.tie_word_embeddings:
        add(w, "output.weight", sd["lm_head.weight"], TYPES["output"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = interleave_qk(q, cfg.num_attention_heads), interleave_qk(k, cfg.num_key_value_heads)
        add(w, f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], Q.F32)
        add(w, f"blk.{i}.attn_q.weight", q, TYPES["attn_q"])
        add(w, f"blk.{i}.attn_k.weight", k, TYPES["attn_k"])
        add(w, f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], TYPES["attn_v"])
        add(w, f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], TYPES["attn_output"])
        if arch == "qwen2":
            for t in ("q", "k", "v"):
                add(w, f"blk.{i}.attn_{t}.bias", sd[p + f"self_attn.{t}_proj.bias"], Q.F32)
        add(w, f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], Q.F32)
        add(w, f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"], TYPES["ffn_gate"])
        add(w, f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"], TYPES["ffn_up"])
        add(w, f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"], TYPES["ffn_down"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,hf_arch", [("llama", "llama3"), ("qwen2", "qwen2")])
def test_gguf_of_each_tensor_type_matches_transformers(tmp_path, arch, hf_arch):
    src = write_random_checkpoint(tmp_path / "hf", hf_arch)
    if arch == "llama":  # GGUF "llama" here: plain RoPE (scaling would need rope_freqs)
        src.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    gguf_path = tmp_path / "model.gguf"
    write_gguf(src, gguf_path, arch)
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32).eval()
    prompt = torch.randint(3, 1000, (90,), generator=torch.Generator().manual_seed(11)).tolist()
    m = K25Model(K25Config(model_path=str(gguf_path), num_threads=2, kv_cache_bytes=16 << 20))
    try:
        assert m.tokenizer is None
        ours = m.score(prompt)
    finally:
        m.close()
    theirs = hf_logits(ref, prompt)
    err = np.abs(ours - theirs).max()
    assert err < 1e-4 * max(1.0, np.abs(theirs).max()), f"max |diff| {err}"
    # And the quantisation really happened: the logits differ from the float32 source.
    assert np.abs(hf_logits(src, prompt) - theirs).max() > 1e-3
