#include "model/model_config.h"

#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "k25/status.h"
#include "model/gguf_reader.h"
#include "model/json.h"

namespace k25 {

namespace {

[[noreturn]] void unsupported(const std::string& m) { fail(ErrorCode::kUnsupported, m); }

}  // namespace

void ModelConfig::validate() const {
  auto bad = [this](const std::string& m) {
    fail(ErrorCode::kCorruptFile, "model config (" + source_format + "): " + m);
  };
  if (vocab_size <= 0) bad("vocab_size must be positive");
  if (hidden_size <= 0 || intermediate_size <= 0 || num_layers <= 0) bad("sizes must be positive");
  if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) {
    bad("num_attention_heads (" + std::to_string(num_heads) +
        ") must be a positive multiple of num_key_value_heads (" + std::to_string(num_kv_heads) + ")");
  }
  if (head_dim <= 0 || head_dim % 2 != 0) bad("head_dim must be positive and even");
  if (!(rms_norm_eps > 0)) bad("rms_norm_eps must be positive");
  if (!(rope.theta > 0)) bad("rope theta must be positive");
  if (static_cast<int32_t>(layer_sliding_window.size()) != num_layers) bad("per-layer window list");
  if (max_position_embeddings <= 0) bad("the context length must be positive");
  if (!(rope.factor > 0)) bad("rope scaling factor must be positive");
  if (hidden_size > (1 << 20) || intermediate_size > (1 << 22) || num_layers > 4096 ||
      vocab_size > (1 << 24) || head_dim > 1024) {
    bad("sizes are implausibly large");
  }
}

namespace {

// GGUF stores sizes as 64-bit; anything past int32 cannot describe a real model.
int32_t gguf_i32(uint64_t v, const std::string& key) {
  if (v > static_cast<uint64_t>(INT32_MAX)) fail(ErrorCode::kCorruptFile, "GGUF: " + key + " is out of range");
  return static_cast<int32_t>(v);
}

}  // namespace

ModelConfig model_config_from_gguf(const GgufFile& g) {
  ModelConfig c;
  c.source_format = "gguf";
  const std::string arch = g.get_string("general.architecture");
  if (arch != "llama" && arch != "qwen2") {
    unsupported("GGUF architecture '" + arch + "' is not supported (supported: llama, qwen2)");
  }
  c.architecture = arch;
  const std::string a = arch + ".";
  c.num_layers = gguf_i32(g.get_uint(a + "block_count"), "block_count");
  c.hidden_size = gguf_i32(g.get_uint(a + "embedding_length"), "embedding_length");
  c.intermediate_size = gguf_i32(g.get_uint(a + "feed_forward_length"), "feed_forward_length");
  c.num_heads = gguf_i32(g.get_uint(a + "attention.head_count"), "attention.head_count");
  c.num_kv_heads = gguf_i32(g.get_uint_or(a + "attention.head_count_kv", c.num_heads), "attention.head_count_kv");
  c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;
  c.head_dim = gguf_i32(g.get_uint_or(a + "attention.key_length", c.head_dim), "attention.key_length");
  if (g.get_uint_or(a + "attention.value_length", c.head_dim) != static_cast<uint64_t>(c.head_dim)) {
    unsupported("GGUF: key and value head sizes differ");
  }
  c.rms_norm_eps = g.get_float(a + "attention.layer_norm_rms_epsilon");
  c.rope.theta = g.get_float_or(a + "rope.freq_base", 10000.0);
  const uint64_t rot = g.get_uint_or(a + "rope.dimension_count", c.head_dim);
  if (rot != static_cast<uint64_t>(c.head_dim)) unsupported("GGUF: partial rotary embeddings are not supported");
  const std::string scaling = g.get_string_or(a + "rope.scaling.type", "none");
  if (scaling == "linear") {
    c.rope.type = "linear";
    c.rope.factor = g.get_float(a + "rope.scaling.factor");
  } else if (scaling != "none") {
    unsupported("GGUF: rope scaling '" + scaling + "' is not supported (none, linear)");
  }
  c.max_position_embeddings = gguf_i32(g.get_uint_or(a + "context_length", 4096), "context_length");
  if (const GgufValue* v = g.find(a + "vocab_size")) {
    c.vocab_size = gguf_i32(v->as_uint(), "vocab_size");
  } else if (const GgufTensorInfo* t = g.find_tensor("token_embd.weight")) {
    c.vocab_size = t->ne.size() == 2 ? static_cast<int32_t>(t->ne[1]) : 0;
  }
  c.tie_word_embeddings = g.find_tensor("output.weight") == nullptr;
  c.qkv_bias = g.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.o_bias = g.find_tensor("blk.0.attn_output.bias") != nullptr;
  c.layer_sliding_window.assign(c.num_layers > 0 ? c.num_layers : 0, 0);
  if (const GgufValue* v = g.find(a + "attention.sliding_window")) {
    c.layer_sliding_window.assign(c.num_layers, static_cast<int32_t>(v->as_uint()));
  }
  c.bos_token_id = static_cast<int32_t>(g.get_int_or("tokenizer.ggml.bos_token_id", -1));
  const int64_t eos = g.get_int_or("tokenizer.ggml.eos_token_id", -1);
  if (eos >= 0) c.eos_token_ids.push_back(static_cast<int32_t>(eos));
  c.validate();
  return c;
}

namespace {

const Json& need(const Json& obj, const std::string& key, const std::string& where) {
  const Json* v = obj.find(key);
  if (!v || v->is_null()) fail(ErrorCode::kCorruptFile, where + ": config.json has no '" + key + "'");
  return *v;
}

int32_t get_int(const Json& obj, const std::string& key, const std::string& where) {
  const Json& v = need(obj, key, where);
  if (!v.is_int()) fail(ErrorCode::kCorruptFile, where + ": config.json '" + key + "' must be an integer");
  return static_cast<int32_t>(v.as_int());
}

int32_t get_int_or(const Json& obj, const std::string& key, int32_t dflt, const std::string& where) {
  const Json* v = obj.find(key);
  if (!v || v->is_null()) return dflt;
  if (!v->is_int()) fail(ErrorCode::kCorruptFile, where + ": config.json '" + key + "' must be an integer");
  return static_cast<int32_t>(v->as_int());
}

double get_num_or(const Json& obj, const std::string& key, double dflt, const std::string& where) {
  const Json* v = obj.find(key);
  if (!v || v->is_null()) return dflt;
  if (!v->is_number()) fail(ErrorCode::kCorruptFile, where + ": config.json '" + key + "' must be a number");
  return v->as_double();
}

bool get_bool_or(const Json& obj, const std::string& key, bool dflt, const std::string& where) {
  const Json* v = obj.find(key);
  if (!v || v->is_null()) return dflt;
  if (!v->is_bool()) fail(ErrorCode::kCorruptFile, where + ": config.json '" + key + "' must be true or false");
  return v->as_bool();
}

std::vector<int32_t> int_or_list(const Json* v) {
  std::vector<int32_t> out;
  if (!v || v->is_null()) return out;
  if (v->is_int()) {
    out.push_back(static_cast<int32_t>(v->as_int()));
  } else if (v->is_array()) {
    for (size_t i = 0; i < v->size(); ++i) {
      if ((*v)[i].is_int()) out.push_back(static_cast<int32_t>((*v)[i].as_int()));
    }
  }
  return out;
}

}  // namespace

ModelConfig model_config_from_hf(const Json& j, const std::string& where) {
  if (!j.is_object()) fail(ErrorCode::kCorruptFile, where + ": config.json is not an object");
  ModelConfig c;
  c.source_format = "safetensors";
  const Json* mt = j.find("model_type");
  const std::string model_type = mt && mt->is_string() ? mt->as_string() : "";
  if (model_type != "llama" && model_type != "mistral" && model_type != "qwen2") {
    unsupported(where + ": model_type '" + model_type +
                "' is not supported (supported: llama, mistral, qwen2)");
  }
  c.architecture = model_type;
  if (const Json* act = j.find("hidden_act"); act && act->is_string() && act->as_string() != "silu") {
    unsupported(where + ": hidden_act '" + act->as_string() + "' is not supported (silu)");
  }
  if (get_bool_or(j, "mlp_bias", false, where)) unsupported(where + ": mlp_bias is not supported");
  c.vocab_size = get_int(j, "vocab_size", where);
  c.hidden_size = get_int(j, "hidden_size", where);
  c.intermediate_size = get_int(j, "intermediate_size", where);
  c.num_layers = get_int(j, "num_hidden_layers", where);
  c.num_heads = get_int(j, "num_attention_heads", where);
  c.num_kv_heads = get_int_or(j, "num_key_value_heads", c.num_heads, where);
  c.head_dim = get_int_or(j, "head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0, where);
  c.rms_norm_eps = get_num_or(j, "rms_norm_eps", 1e-6, where);
  c.max_position_embeddings = get_int_or(j, "max_position_embeddings", 4096, where);
  c.tie_word_embeddings = get_bool_or(j, "tie_word_embeddings", false, where);
  if (model_type == "qwen2") {
    c.qkv_bias = true;
  } else if (get_bool_or(j, "attention_bias", false, where)) {
    c.qkv_bias = c.o_bias = true;
  }
  if (const Json* pr = j.find("partial_rotary_factor"); pr && pr->is_number() && pr->as_double() != 1.0) {
    unsupported(where + ": partial rotary embeddings are not supported");
  }

  // RoPE: transformers >= 5 writes rope_parameters (with rope_theta inside); older
  // checkpoints write rope_theta and rope_scaling at the top level.
  const Json* rp = j.find("rope_parameters");
  if (rp && rp->is_object()) {
    c.rope.theta = get_num_or(*rp, "rope_theta", get_num_or(j, "rope_theta", 10000.0, where), where);
  } else {
    c.rope.theta = get_num_or(j, "rope_theta", 10000.0, where);
    rp = j.find("rope_scaling");
  }
  if (rp && rp->is_object()) {
    const Json* t = rp->find("rope_type");
    if (!t) t = rp->find("type");
    const std::string type = t && t->is_string() ? t->as_string() : "default";
    if (type == "linear") {
      c.rope.type = "linear";
      c.rope.factor = get_num_or(*rp, "factor", 1.0, where);
    } else if (type == "llama3") {
      c.rope.type = "llama3";
      c.rope.factor = get_num_or(*rp, "factor", 8.0, where);
      c.rope.low_freq_factor = get_num_or(*rp, "low_freq_factor", 1.0, where);
      c.rope.high_freq_factor = get_num_or(*rp, "high_freq_factor", 4.0, where);
      c.rope.original_max_position = get_int_or(*rp, "original_max_position_embeddings", 8192, where);
      if (!(c.rope.high_freq_factor > c.rope.low_freq_factor)) {
        fail(ErrorCode::kCorruptFile, where + ": llama3 rope needs high_freq_factor > low_freq_factor");
      }
    } else if (type != "default") {
      unsupported(where + ": rope type '" + type + "' is not supported (default, linear, llama3)");
    }
    if (!(c.rope.factor > 0)) fail(ErrorCode::kCorruptFile, where + ": rope factor must be positive");
  }

  // Sliding-window attention: Mistral applies it to every layer; Qwen2 names each
  // layer's kind in layer_types (or uses max_window_layers with use_sliding_window).
  c.layer_sliding_window.assign(c.num_layers > 0 ? c.num_layers : 0, 0);
  const int32_t window = get_int_or(j, "sliding_window", 0, where);
  if (model_type == "mistral" && window > 0) {
    c.layer_sliding_window.assign(c.num_layers, window);
  } else if (model_type == "qwen2" && get_bool_or(j, "use_sliding_window", false, where) && window > 0) {
    const Json* lt = j.find("layer_types");
    if (lt && lt->is_array() && static_cast<int32_t>(lt->size()) == c.num_layers) {
      for (int32_t i = 0; i < c.num_layers; ++i) {
        if ((*lt)[i].is_string() && (*lt)[i].as_string() == "sliding_attention") c.layer_sliding_window[i] = window;
      }
    } else {
      const int32_t from = get_int_or(j, "max_window_layers", c.num_layers, where);
      for (int32_t i = from; i < c.num_layers; ++i) c.layer_sliding_window[i] = window;
    }
  }
  std::vector<int32_t> bos = int_or_list(j.find("bos_token_id"));
  c.bos_token_id = bos.empty() ? -1 : bos[0];
  c.eos_token_ids = int_or_list(j.find("eos_token_id"));
  c.validate();
  return c;
}

bool is_gguf_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return false;
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {0, 0, 0, 0};
  f.read(magic, 4);
  return f.gcount() == 4 && std::memcmp(magic, "GGUF", 4) == 0;
}

std::string hf_model_dir(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(ErrorCode::kNotFound, "model path does not exist: " + path);
  if (fs::is_directory(path, ec)) return path;
  if (fs::path(path).extension() == ".safetensors") return fs::path(path).parent_path().string();
  fail(ErrorCode::kUnsupported, path + " is neither a GGUF file nor a Hugging Face model directory");
}

ModelConfig read_model_config(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(ErrorCode::kNotFound, "model path does not exist: " + path);
  if (is_gguf_file(path)) return model_config_from_gguf(*GgufFile::open(path));
  const fs::path cfg = fs::path(hf_model_dir(path)) / "config.json";
  std::ifstream f(cfg, std::ios::binary);
  if (!f) fail(ErrorCode::kNotFound, "no config.json in " + cfg.parent_path().string());
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return model_config_from_hf(Json::parse(text, cfg.string()), cfg.parent_path().string());
}

}  // namespace k25
