"""`k25 mem` (k25.memory): its plans against what the engine allocates and needs."""
import json
import subprocess
import sys

import pytest

from k25 import K25Config, K25Model, memory
from k25.errors import ConfigError

from oracles import default_gguf, write_random_checkpoint


def k25(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "k25.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "mistral"])
def test_weight_bytes_are_the_checkpoints_parameters_in_float32(tmp_path, arch):
    # transformers' own parameter count (tied embeddings once) is the oracle; the engine's
    # count of what it keeps must agree too.
    hf = write_random_checkpoint(tmp_path, arch)
    params = sum(p.numel() for p in hf.parameters())
    plan = memory.memory_plan(str(tmp_path), batch=2, max_seq_len=256)
    assert plan.weight_bytes == 4 * params
    m = K25Model(K25Config(model_path=str(tmp_path), num_threads=1, max_seq_len=256, kv_cache_bytes=1 << 20))
    try:
        assert m.stats()["weight_bytes"] == plan.weight_bytes
        assert m.kv_block_bytes == plan.kv_block_bytes
    finally:
        m.close()


def test_the_default_model_plan_matches_the_loaded_model(default_model):
    plan = memory.memory_plan(None, batch=3, max_seq_len=1000)
    gguf_params = sum(int(t.n_elements) for t in __import__("gguf").GGUFReader(str(default_gguf())).tensors)
    assert plan.weight_bytes == default_model.stats()["weight_bytes"] == 4 * gguf_params
    assert plan.kv_block_bytes == default_model.kv_block_bytes
    assert plan.blocks_per_seq == 63  # ceil(1000 / 16)
    assert plan.kv_cache_bytes == 3 * 63 * default_model.kv_block_bytes


def _run_full_batch(kv_bytes, batch, length, prompt_len):
    m = K25Model(K25Config(num_threads=2, max_seq_len=length, max_batch_size=batch, kv_cache_bytes=kv_bytes))
    try:
        prompts = [[100 + 7 * i + j for j in range(prompt_len)] for i in range(batch)]
        outs = m.generate(prompts, max_new_tokens=length - prompt_len, temperature=0.0, ignore_eos=True)
        assert all(len(o.token_ids) == length - prompt_len for o in outs)
        return m.stats()["preemptions"]
    finally:
        m.close()


def test_the_planned_kv_cache_holds_the_batch_and_one_block_less_does_not():
    # Four sequences of 128 tokens each (a whole number of blocks) run side by side: with the
    # plan's kv_cache_bytes none is preempted; with one block fewer the engine must preempt.
    batch, length = 4, 128
    plan = memory.memory_plan(None, batch=batch, max_seq_len=length)
    assert _run_full_batch(plan.kv_cache_bytes, batch, length, 40) == 0
    assert _run_full_batch(plan.kv_cache_bytes - plan.kv_block_bytes, batch, length, 40) > 0


def test_cpu_summaries_grow_with_the_key_codes_and_sums():
    c = memory.memory_plan(None, batch=1, max_seq_len=4096, sparsity=True)
    codes = memory.memory_plan(None, batch=1, max_seq_len=4096, sparsity=True, score_rule="codes")
    sums = memory.memory_plan(None, batch=1, max_seq_len=4096, sparsity=True, compensation=True)
    plain = memory.memory_plan(None, batch=1, max_seq_len=4096)
    assert plain.summary_block_bytes == 0 and plain.summary_bytes == 0
    # docs/sparsity.md: a float32 word per channel of each (layer, KV head) for the bounds, one
    # more a channel for 16 keys' codes, two more for the sums.
    layers_heads_dims = plain.kv_block_bytes // (2 * 4 * plain.block_size)
    assert c.summary_block_bytes == 4 * layers_heads_dims
    assert codes.summary_block_bytes == 2 * c.summary_block_bytes
    assert sums.summary_block_bytes == 3 * c.summary_block_bytes
    assert codes.total_bytes - plain.total_bytes == codes.summary_bytes == 256 * codes.summary_block_bytes


def test_fit_verdicts_and_limits_follow_the_available_memory():
    need = memory.memory_plan(None, batch=4, max_seq_len=2048).required_bytes
    fits = memory.memory_plan(None, batch=4, max_seq_len=2048, available_bytes=need)
    short = memory.memory_plan(None, batch=4, max_seq_len=2048, available_bytes=need - 1)
    assert fits.fits is True and short.fits is False
    assert fits.max_batch >= 4 > short.max_batch
    assert fits.max_context >= 2048 > short.max_context
    none = memory.memory_plan(None, batch=4, max_seq_len=2048)
    assert none.fits is None and none.max_batch is None
    # The margin scales the requirement and nothing else.
    bare = memory.memory_plan(None, batch=4, max_seq_len=2048, margin=0.0)
    assert bare.total_bytes == fits.total_bytes and bare.required_bytes == bare.total_bytes
    assert fits.required_bytes == pytest.approx(1.1 * fits.total_bytes, abs=1)


@pytest.mark.parametrize("cache_mode", ["standard", "hierarchical"])
def test_the_limits_are_the_largest_plans_that_fit(cache_mode):
    # max_batch and max_context are what a plan of that batch or length says of itself: it fits,
    # one more sequence or block does not (the workspace and L2 grow with them).
    avail = memory.memory_plan(None, batch=4, max_seq_len=2048, cache_mode=cache_mode).required_bytes + (50 << 20)
    p = memory.memory_plan(None, batch=4, max_seq_len=2048, cache_mode=cache_mode, available_bytes=avail)
    kw = dict(cache_mode=cache_mode, available_bytes=avail)
    assert memory.memory_plan(None, batch=p.max_batch, max_seq_len=2048, **kw).fits
    assert not memory.memory_plan(None, batch=p.max_batch + 1, max_seq_len=2048, **kw).fits
    assert 2048 < p.max_context < 8192
    assert memory.memory_plan(None, batch=4, max_seq_len=p.max_context, **kw).fits
    assert not memory.memory_plan(None, batch=4, max_seq_len=p.max_context + 16, **kw).fits


def test_rope_tables_and_the_cuda_scratch_block_are_counted():
    cpu = memory.memory_plan(None, batch=2, max_seq_len=1024)
    gpu = memory.memory_plan(None, device="cuda", batch=2, max_seq_len=1024)
    head_dim = 64  # SmolLM2-135M
    assert cpu.rope_bytes == gpu.rope_bytes == 2 * 1024 * (head_dim // 2) * 4  # cos and sin, float32
    assert cpu.extra_blocks == 0 and gpu.extra_blocks == 1
    assert gpu.total_bytes == (gpu.weight_bytes + gpu.rope_bytes + (2 * 64 + 1) * gpu.kv_block_bytes
                               + gpu.workspace_bytes)


def test_cuda_plans_use_two_byte_weights_and_kv():
    cpu = memory.memory_plan(None, batch=2, max_seq_len=1024)
    gpu = memory.memory_plan(None, device="cuda", batch=2, max_seq_len=1024)
    assert gpu.dtype == "bfloat16"
    assert 2 * gpu.weight_bytes == cpu.weight_bytes and 2 * gpu.kv_block_bytes == cpu.kv_block_bytes
    assert gpu.workspace_bytes > 512 << 20  # K25Model's reserve for cuBLAS, graphs and the allocator


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="tpu"), "device"),
    (dict(dtype="bfloat16"), "needs the CUDA backend"),
    (dict(batch=0), "batch"),
    (dict(max_seq_len=1 << 20), "exceeds the model's context"),
    (dict(block_size=512), "block_size"),
    (dict(margin=-0.1), "margin"),
    (dict(score_rule="exact"), "score_rule"),
    (dict(device="cuda", sparsity=True, score_rule="channels"), "key codes or the Quest bound"),
    (dict(device="cuda", dtype="float32", sparsity=True, score_rule="codes"), "needs 16-bit KV"),
    (dict(available_bytes=-1), "available_bytes"),
])
def test_bad_plans_raise_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        memory.memory_plan(None, **kwargs)


@pytest.mark.parametrize("text, n", [("24GiB", 24 << 30), ("80 GB", 80 * 10 ** 9), ("512MiB", 512 << 20),
                                     ("1.5g", 1_500_000_000), ("123456", 123456)])
def test_sizes_parse(text, n):
    assert memory.parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "lots", "12 parsecs", "0", "-1GiB"])
def test_bad_sizes_raise(text):
    with pytest.raises(ConfigError, match="size"):
        memory.parse_bytes(text)


def test_cli_prints_the_plan_and_exits_1_when_it_does_not_fit():
    r = k25("mem", "--batch", "2", "--max-seq-len", "512", "--json", "--memory", "64GiB")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    plan = memory.memory_plan(None, batch=2, max_seq_len=512, available_bytes=64 << 30)
    assert d == json.loads(json.dumps(plan.as_dict()))
    small = k25("mem", "--batch", "2", "--max-seq-len", "512", "--memory", "100MiB")
    assert small.returncode == 1 and "does NOT fit" in small.stdout
    bad = k25("mem", "--memory", "plenty")
    assert bad.returncode == 2 and "not a size" in bad.stderr


def test_the_l2_tier_is_sized_as_the_engine_sizes_it():
    plan = memory.memory_plan(None, batch=2, max_seq_len=512, cache_mode="hierarchical")
    flat = memory.memory_plan(None, batch=2, max_seq_len=512)
    m = K25Model(K25Config(num_threads=1, max_seq_len=512, kv_cache_bytes=plan.kv_cache_bytes,
                           cache_mode="hierarchical", enable_async_offload=True))
    try:
        assert m.engine_config.l2_bytes == plan.l2_bytes > plan.kv_cache_bytes
    finally:
        m.close()
    # On the CPU the L2 pool is more of the same memory, so it counts in the total and in the limits.
    assert plan.total_bytes - flat.total_bytes == plan.l2_bytes and flat.l2_bytes == 0
    room = memory.memory_plan(None, batch=2, max_seq_len=512, cache_mode="hierarchical",
                              available_bytes=plan.required_bytes)
    assert room.fits and room.max_batch == 2


def test_an_untied_head_in_the_file_is_counted_whatever_the_flag(tmp_path):
    # A checkpoint that says tie_word_embeddings=true but ships lm_head.weight: the engine keeps the
    # head it finds (weight_loader.cpp), so the plan counts it.
    from safetensors.torch import load_file, save_file
    write_random_checkpoint(tmp_path, "qwen2")  # tied
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    tied = memory.memory_plan(str(tmp_path), max_seq_len=256)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(f), metadata={"format": "pt"})
    m = K25Model(K25Config(model_path=str(tmp_path), num_threads=1, max_seq_len=256, kv_cache_bytes=1 << 20))
    try:
        engine = m.stats()["weight_bytes"]
    finally:
        m.close()
    assert engine == memory.memory_plan(str(tmp_path), max_seq_len=256).weight_bytes > tied.weight_bytes
