// Loading a model and running it with ATen on the CPU or a CUDA device, behind
// torch-free declarations so that the engine and the bindings do not include ATen.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/executor.h"
#include "model/model_config.h"
#include "ops/block_sparsity.h"
#include "ops/kv_layout.h"

namespace k25 {

class LlamaModel;

// Where and in what precision a model runs.
struct DeviceSpec {
  std::string device = "cpu";   // "cpu" or "cuda[:N]"
  std::string dtype = "float32";  // float32 | bfloat16 | float16 (CUDA); float32 (CPU)
};

// A loaded model (weights in memory), shareable between an engine and its owner.
class ModelHandle {
 public:
  ModelHandle(std::shared_ptr<LlamaModel> model, std::string path, std::string format, double load_seconds,
              int32_t max_positions, DeviceSpec spec);
  const ModelConfig& config() const;
  const std::string& path() const { return path_; }
  const std::string& format() const { return format_; }
  const DeviceSpec& spec() const { return spec_; }
  int64_t weight_bytes() const;
  int32_t max_positions() const { return max_positions_; }
  double load_seconds() const { return load_seconds_; }
  const std::shared_ptr<LlamaModel>& model() const { return model_; }

 private:
  std::shared_ptr<LlamaModel> model_;
  std::string path_;
  std::string format_;
  double load_seconds_;
  int32_t max_positions_ = 0;
  DeviceSpec spec_;
};

// Longest sequence when the caller does not choose (capped by the model's context length).
constexpr int32_t kDefaultMaxPositions = 8192;

// Loads a GGUF file or HF directory; sequences may reach max_positions tokens (0: the
// default above).
std::shared_ptr<ModelHandle> load_model(const std::string& path, int32_t max_positions, int32_t num_threads,
                                        const DeviceSpec& spec = {});

// Bytes of one KV block (all layers, K and V) with elements of `elem_bytes`.
int64_t kv_block_bytes(const ModelConfig& config, int32_t block_size, int32_t elem_bytes = 4);
int32_t dtype_bytes(const std::string& dtype);

// sparsity: nullptr, or the dynamic-sparsity rule (CPU fused path only). kv_dtype: as
// EngineConfig::kv_cache_dtype.
std::unique_ptr<ModelExecutor> make_executor(std::shared_ptr<ModelHandle> model, int32_t block_size,
                                             int32_t num_blocks, bool fused, int32_t num_threads,
                                             const SparsityParams* sparsity = nullptr,
                                             const std::string& kv_dtype = "");
// The KV pool's dtype for a model of compute dtype `model_dtype` on `device` and a requested
// kv_cache_dtype ("" or "auto": the compute dtype); a kError for a combination the backend lacks.
std::string resolve_kv_dtype(const std::string& model_dtype, const std::string& device, const std::string& kv_dtype);

// CUDA: built in and a device visible; free and total bytes of a device.
bool cuda_available();
void cuda_memory(int device, int64_t* free_bytes, int64_t* total_bytes);
// Bytes the process holds on the device through the caching allocator (0 on the CPU).
int64_t device_allocated_bytes(const DeviceSpec& spec);

}  // namespace k25
