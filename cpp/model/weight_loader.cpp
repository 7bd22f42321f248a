// Builds float32 LlamaWeights from a GGUF file or a Hugging Face safetensors directory.
//
// Tensor names are data (kNames); each role maps to its GGUF and HF name. Fused weights
// (q|k|v, gate|up) are assembled by converting each source straight into its rows of the
// destination, on several threads.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>

#include "k25/status.h"
#include "model/dequant.h"
#include "model/gguf_reader.h"
#include "model/json.h"
#include "model/llama_model.h"
#include "model/safetensors_reader.h"

namespace k25 {

namespace {

namespace fs = std::filesystem;

enum class Role { kEmbed, kFinalNorm, kLmHead, kRopeFreqs, kAttnNorm, kQ, kK, kV, kO, kQBias, kKBias, kVBias,
                  kOBias, kFfnNorm, kGate, kUp, kDown };

struct TensorName {
  Role role;
  const char* gguf;  // "{}" is the layer index
  const char* hf;
};

constexpr TensorName kNames[] = {
    {Role::kEmbed, "token_embd.weight", "model.embed_tokens.weight"},
    {Role::kFinalNorm, "output_norm.weight", "model.norm.weight"},
    {Role::kLmHead, "output.weight", "lm_head.weight"},
    {Role::kRopeFreqs, "rope_freqs.weight", ""},
    {Role::kAttnNorm, "blk.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"},
    {Role::kQ, "blk.{}.attn_q.weight", "model.layers.{}.self_attn.q_proj.weight"},
    {Role::kK, "blk.{}.attn_k.weight", "model.layers.{}.self_attn.k_proj.weight"},
    {Role::kV, "blk.{}.attn_v.weight", "model.layers.{}.self_attn.v_proj.weight"},
    {Role::kO, "blk.{}.attn_output.weight", "model.layers.{}.self_attn.o_proj.weight"},
    {Role::kQBias, "blk.{}.attn_q.bias", "model.layers.{}.self_attn.q_proj.bias"},
    {Role::kKBias, "blk.{}.attn_k.bias", "model.layers.{}.self_attn.k_proj.bias"},
    {Role::kVBias, "blk.{}.attn_v.bias", "model.layers.{}.self_attn.v_proj.bias"},
    {Role::kOBias, "blk.{}.attn_output.bias", "model.layers.{}.self_attn.o_proj.bias"},
    {Role::kFfnNorm, "blk.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight"},
    {Role::kGate, "blk.{}.ffn_gate.weight", "model.layers.{}.mlp.gate_proj.weight"},
    {Role::kUp, "blk.{}.ffn_up.weight", "model.layers.{}.mlp.up_proj.weight"},
    {Role::kDown, "blk.{}.ffn_down.weight", "model.layers.{}.mlp.down_proj.weight"},
};

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// A checkpoint seen as named tensors that can be converted to float32 row by row.
class Source {
 public:
  virtual ~Source() = default;
  virtual bool has(const std::string& name) const = 0;
  // Shape in PyTorch order (row-major, last dim contiguous).
  virtual std::vector<int64_t> shape(const std::string& name) const = 0;
  // Converts source rows [r0, r1) of a 1-D/2-D tensor to float32 rows dst[map(r)].
  virtual void convert_rows(const std::string& name, int64_t r0, int64_t r1, float* dst,
                            const std::function<int64_t(int64_t)>& map) const = 0;
  virtual std::string name_for(Role role, int32_t layer) const = 0;
  virtual std::string where() const = 0;
};

std::string format_name(const char* pattern, int32_t layer) {
  std::string s(pattern);
  size_t p = s.find("{}");
  if (p != std::string::npos) s.replace(p, 2, std::to_string(layer));
  return s;
}

class GgufSource : public Source {
 public:
  explicit GgufSource(std::shared_ptr<GgufFile> f, std::string path) : f_(std::move(f)), path_(std::move(path)) {}
  bool has(const std::string& n) const override { return f_->find_tensor(n) != nullptr; }
  std::vector<int64_t> shape(const std::string& n) const override {
    const GgufTensorInfo* t = get(n);
    std::vector<int64_t> s(t->ne.rbegin(), t->ne.rend());
    return s;
  }
  void convert_rows(const std::string& n, int64_t r0, int64_t r1, float* dst,
                    const std::function<int64_t(int64_t)>& map) const override {
    const GgufTensorInfo* t = get(n);
    const int64_t K = static_cast<int64_t>(t->ne[0]);
    const GgmlTypeTraits* tr = ggml_type_traits(static_cast<uint32_t>(t->type));
    const int64_t row_bytes = K / tr->block_size * tr->type_size;
    for (int64_t r = r0; r < r1; ++r) {
      dequantize_to_f32(t->type, t->data + r * row_bytes, dst + map(r) * K, K);
    }
  }
  std::string name_for(Role role, int32_t layer) const override {
    for (const TensorName& tn : kNames) {
      if (tn.role == role) return format_name(tn.gguf, layer);
    }
    return "";
  }
  std::string where() const override { return path_; }

 private:
  const GgufTensorInfo* get(const std::string& n) const {
    const GgufTensorInfo* t = f_->find_tensor(n);
    if (!t) fail(ErrorCode::kNotFound, "tensor '" + n + "' is missing from " + path_);
    return t;
  }
  std::shared_ptr<GgufFile> f_;
  std::string path_;
};

class SafetensorsSource : public Source {
 public:
  SafetensorsSource(std::shared_ptr<SafetensorsCheckpoint> c, std::string path)
      : c_(std::move(c)), path_(std::move(path)) {}
  bool has(const std::string& n) const override { return c_->find(n) != nullptr; }
  std::vector<int64_t> shape(const std::string& n) const override { return get(n)->shape; }
  void convert_rows(const std::string& n, int64_t r0, int64_t r1, float* dst,
                    const std::function<int64_t(int64_t)>& map) const override {
    const TensorView* t = get(n);
    const int64_t K = t->shape.back();  // 1-D tensors are one row
    const int64_t es = static_cast<int64_t>(dtype_size(t->dtype));
    for (int64_t r = r0; r < r1; ++r) convert_to_f32(t->dtype, t->data + r * K * es, dst + map(r) * K, K);
  }
  std::string name_for(Role role, int32_t layer) const override {
    for (const TensorName& tn : kNames) {
      if (tn.role == role) return format_name(tn.hf, layer);
    }
    return "";
  }
  std::string where() const override { return path_; }

 private:
  const TensorView* get(const std::string& n) const {
    const TensorView* t = c_->find(n);
    if (!t) fail(ErrorCode::kNotFound, "tensor '" + n + "' is missing from " + path_);
    return t;
  }
  std::shared_ptr<SafetensorsCheckpoint> c_;
  std::string path_;
};

// Conversion jobs, run on a few threads; the first error wins and is rethrown.
class JobList {
 public:
  void add(std::function<void()> job) { jobs_.push_back(std::move(job)); }
  void run(int32_t threads) {
    std::atomic<size_t> next{0};
    std::exception_ptr err;
    std::mutex mu;
    auto worker = [&] {
      while (true) {
        size_t i = next.fetch_add(1);
        if (i >= jobs_.size()) return;
        try {
          jobs_[i]();
        } catch (...) {
          std::lock_guard<std::mutex> lk(mu);
          if (!err) err = std::current_exception();
          next = jobs_.size();
        }
      }
    };
    std::vector<std::thread> pool;
    for (int32_t t = 1; t < threads; ++t) {
      try {
        pool.emplace_back(worker);
      } catch (const std::system_error&) {
        break;  // fewer threads than asked: the ones we have do all the jobs
      }
    }
    worker();
    for (auto& th : pool) th.join();
    if (err) std::rethrow_exception(err);
  }

 private:
  std::vector<std::function<void()>> jobs_;
};

class Builder {
 public:
  Builder(const Source& src, const ModelConfig& cfg) : src_(src), cfg_(cfg) {}

  // Allocates dst rows [row_offset, row_offset + rows of the source) and queues the
  // conversion. `perm_heads` > 0 undoes llama.cpp's interleaving of q/k rows for RoPE.
  void fill(at::Tensor& dst, int64_t row_offset, Role role, int32_t layer, std::vector<int64_t> expect,
            int32_t perm_heads = 0) {
    const std::string name = src_.name_for(role, layer);
    std::vector<int64_t> got = src_.shape(name);
    if (got != expect) {
      fail(ErrorCode::kCorruptFile, "tensor '" + name + "' in " + src_.where() + " has shape " + shape_str(got) +
                                        ", expected " + shape_str(expect));
    }
    float* base = dst.data_ptr<float>();
    const int64_t rows = expect.size() == 2 ? expect[0] : 1;
    const int64_t K = expect.size() == 2 ? expect[1] : expect[0];
    float* out = base + row_offset * K;
    std::function<int64_t(int64_t)> map = [](int64_t r) { return r; };
    if (perm_heads > 0) {
      const int64_t hd = rows / perm_heads, half = hd / 2;
      // GGUF row h*hd + 2j + i holds HF row h*hd + i*half + j.
      map = [hd, half](int64_t r) {
        const int64_t h = r / hd, w = r % hd;
        return h * hd + (w % 2) * half + w / 2;
      };
    }
    if (expect.size() == 1) {
      jobs_.add([this, name, out, map] { src_.convert_rows(name, 0, 1, out, map); });
      return;
    }
    const int64_t chunk = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, K));  // ~4 MB of output
    for (int64_t r = 0; r < rows; r += chunk) {
      const int64_t r1 = std::min(rows, r + chunk);
      jobs_.add([this, name, out, map, r, r1] { src_.convert_rows(name, r, r1, out, map); });
    }
  }
  void run(int32_t threads) { jobs_.run(threads); }

 private:
  const Source& src_;
  const ModelConfig& cfg_;
  JobList jobs_;
};

at::Tensor empty_f32(std::vector<int64_t> shape) { return at::empty(shape, at::kFloat); }

LlamaWeights build_weights(const Source& src, const ModelConfig& c, bool unpermute_qk, int32_t threads) {
  const int64_t V = c.vocab_size, H = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads;
  LlamaWeights w;
  Builder b(src, c);
  w.embed = empty_f32({V, H});
  b.fill(w.embed, 0, Role::kEmbed, 0, {V, H});
  w.final_norm = empty_f32({H});
  b.fill(w.final_norm, 0, Role::kFinalNorm, 0, {H});
  if (src.has(src.name_for(Role::kLmHead, 0))) {
    w.lm_head = empty_f32({V, H});
    b.fill(w.lm_head, 0, Role::kLmHead, 0, {V, H});
  } else if (c.tie_word_embeddings || c.source_format == "gguf") {
    w.lm_head = w.embed;
  } else {
    fail(ErrorCode::kNotFound, "tensor 'lm_head.weight' is missing from " + src.where() +
                                   " and tie_word_embeddings is false");
  }
  const std::string freqs = src.name_for(Role::kRopeFreqs, 0);
  if (!freqs.empty() && src.has(freqs)) {
    w.rope_freq_factors = empty_f32({D / 2});
    b.fill(w.rope_freq_factors, 0, Role::kRopeFreqs, 0, {D / 2});
  }
  const int32_t pq = unpermute_qk ? static_cast<int32_t>(Hq) : 0;
  const int32_t pk = unpermute_qk ? static_cast<int32_t>(Hkv) : 0;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    LayerWeights L;
    L.attn_norm = empty_f32({H});
    b.fill(L.attn_norm, 0, Role::kAttnNorm, l, {H});
    L.wqkv = empty_f32({(Hq + 2 * Hkv) * D, H});
    b.fill(L.wqkv, 0, Role::kQ, l, {Hq * D, H}, pq);
    b.fill(L.wqkv, Hq * D, Role::kK, l, {Hkv * D, H}, pk);
    b.fill(L.wqkv, (Hq + Hkv) * D, Role::kV, l, {Hkv * D, H});
    if (c.qkv_bias) {
      L.bqkv = empty_f32({(Hq + 2 * Hkv) * D});
      at::Tensor bq = L.bqkv.narrow(0, 0, Hq * D), bk = L.bqkv.narrow(0, Hq * D, Hkv * D),
                 bv = L.bqkv.narrow(0, (Hq + Hkv) * D, Hkv * D);
      // 1-D fills write at the view's data pointer.
      b.fill(bq, 0, Role::kQBias, l, {Hq * D});
      b.fill(bk, 0, Role::kKBias, l, {Hkv * D});
      b.fill(bv, 0, Role::kVBias, l, {Hkv * D});
      if (unpermute_qk) fail(ErrorCode::kUnsupported, "GGUF llama with q/k biases is not supported");
    }
    L.wo = empty_f32({H, Hq * D});
    b.fill(L.wo, 0, Role::kO, l, {H, Hq * D});
    if (c.o_bias) {
      L.bo = empty_f32({H});
      b.fill(L.bo, 0, Role::kOBias, l, {H});
    }
    L.ffn_norm = empty_f32({H});
    b.fill(L.ffn_norm, 0, Role::kFfnNorm, l, {H});
    L.w_gate_up = empty_f32({2 * I, H});
    b.fill(L.w_gate_up, 0, Role::kGate, l, {I, H});
    b.fill(L.w_gate_up, I, Role::kUp, l, {I, H});
    L.w_down = empty_f32({H, I});
    b.fill(L.w_down, 0, Role::kDown, l, {H, I});
    w.layers.push_back(std::move(L));
  }
  b.run(threads);
  return w;
}

}  // namespace

LoadedModel load_llama_weights(const std::string& path, int32_t num_threads) {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(ErrorCode::kNotFound, "model path does not exist: " + path);
  const int32_t threads = num_threads > 0 ? num_threads : std::max(1u, std::thread::hardware_concurrency());
  LoadedModel out;
  out.path = path;
  if (!fs::is_directory(path) && is_gguf_file(path)) {
    std::shared_ptr<GgufFile> g = GgufFile::open(path);
    out.config = model_config_from_gguf(*g);
    out.format = "gguf";
    GgufSource src(g, path);
    // llama.cpp's converter interleaves q/k rows of "llama" models for its RoPE kernel.
    out.weights = build_weights(src, out.config, out.config.architecture == "llama", threads);
    return out;
  }
  out.config = read_model_config(path);
  out.format = "safetensors";
  std::shared_ptr<SafetensorsCheckpoint> ck = SafetensorsCheckpoint::open(path);
  SafetensorsSource src(ck, path);
  out.weights = build_weights(src, out.config, false, threads);
  return out;
}

}  // namespace k25
