// Architecture description of a Llama-family decoder, read from GGUF metadata or from a
// Hugging Face config.json. Plain C++ (no torch).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace k25 {

class GgufFile;
class Json;

struct RopeConfig {
  double theta = 10000.0;
  // "default", "linear" (positions / factor) or "llama3" (per-frequency scaling).
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

struct ModelConfig {
  std::string architecture;  // llama | mistral | qwen2 (as the loader understood it)
  std::string source_format; // gguf | safetensors
  int32_t vocab_size = 0;
  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  double rms_norm_eps = 1e-5;
  RopeConfig rope;
  int32_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;                     // q/k/v projections carry biases (Qwen2)
  bool o_bias = false;                       // the output projection carries a bias
  std::vector<int32_t> layer_sliding_window; // per layer, 0 = full attention
  int32_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;

  // Throws kCorruptFile / kUnsupported when the numbers cannot describe a working model.
  void validate() const;
};

ModelConfig model_config_from_gguf(const GgufFile& gguf);
// config.json of a Hugging Face checkpoint; `where` names it in error messages.
ModelConfig model_config_from_hf(const Json& config, const std::string& where);

// True when `path` is a file that starts with the GGUF magic.
bool is_gguf_file(const std::string& path);
// The directory holding config.json for a model path (a directory or a .safetensors
// file); throws kNotFound / kUnsupported for anything else.
std::string hf_model_dir(const std::string& path);
// The architecture of a model path without loading its weights.
ModelConfig read_model_config(const std::string& path);

}  // namespace k25
