"""The k25 command line, run as a real subprocess and compared with the Python API."""
import json
import subprocess
import sys

import gguf
import pytest

from oracles import default_gguf, write_random_checkpoint


def k25(*args, stdin=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "k25.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def test_info_reports_the_gguf_metadata():
    r = k25("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    reader = gguf.GGUFReader(str(default_gguf()))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert info["num_layers"] == meta["llama.block_count"]
    assert info["hidden_size"] == meta["llama.embedding_length"]
    assert info["num_heads"] == meta["llama.attention.head_count"]
    assert info["num_kv_heads"] == meta["llama.attention.head_count_kv"]
    assert info["max_position_embeddings"] == meta["llama.context_length"]
    types = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    assert info["tensor_types"] == types
    assert info["parameters"] == sum(int(t.n_elements) for t in reader.tensors)
    human = k25("info")
    assert human.returncode == 0 and "layers=30" in human.stdout and "Q4_1" in human.stdout


def test_info_on_a_safetensors_checkpoint(tmp_path):
    write_random_checkpoint(tmp_path, "qwen2")
    r = k25("info", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert info["architecture"] == "qwen2" and info["qkv_bias"] is True
    assert info["num_layers"] == cfg["num_hidden_layers"]
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        assert info["tensor_types"] == {"F32": len(list(f.keys()))}
        # Every tensor of the file, the QKV biases included, is a parameter the engine loads.
        assert info["parameters"] == sum(f.get_tensor(k).size for k in f.keys())


def test_generate_streams_the_same_text_as_the_api(default_model):
    prompt = "The three primary colours are"
    r = k25("generate", prompt, "--raw", "--temperature", "0", "--max-new-tokens", "12", "--threads", "2")
    assert r.returncode == 0, r.stderr
    expect = default_model.generate(prompt, max_new_tokens=12, temperature=0.0)[0].text
    assert r.stdout == expect + "\n"

    r = k25("generate", "Name a fruit.", "--temperature", "0", "--max-new-tokens", "16", "--threads", "2")
    assert r.returncode == 0, r.stderr
    chat = default_model.chat([{"role": "user", "content": "Name a fruit."}], max_new_tokens=16, temperature=0.0)
    assert r.stdout == chat.text + "\n"


def test_chat_keeps_the_conversation(default_model):
    lines = "My name is Ada.\nWhat is my name?\n"
    r = k25("chat", "--temperature", "0", "--max-new-tokens", "20", "--threads", "2", stdin=lines)
    assert r.returncode == 0, r.stderr
    history = [{"role": "user", "content": "My name is Ada."}]
    first = default_model.chat(history, max_new_tokens=20, temperature=0.0).text
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "What is my name?"}]
    second = default_model.chat(history, max_new_tokens=20, temperature=0.0).text
    assert r.stdout == first + "\n" + second + "\n"


def test_errors_exit_with_a_message(tmp_path):
    r = k25("generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    r = k25("info", str(bad))
    assert r.returncode == 2 and "k25: error:" in r.stderr and "Traceback" not in r.stderr
