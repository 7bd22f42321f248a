#include "engine/cpu_executor.h"

#include <chrono>
#include <cstring>

#include <ATen/Parallel.h>

#include "k25/status.h"
#include "model/llama_model.h"
#include "ops/parallel.h"
#include "ops/thread_pool.h"

namespace k25 {

ModelHandle::ModelHandle(std::shared_ptr<LlamaModel> model, std::string path, std::string format,
                         double load_seconds, int32_t max_positions)
    : model_(std::move(model)),
      path_(std::move(path)),
      format_(std::move(format)),
      load_seconds_(load_seconds),
      max_positions_(max_positions) {}

const ModelConfig& ModelHandle::config() const { return model_->config(); }
int64_t ModelHandle::weight_bytes() const { return model_->weight_bytes(); }

std::shared_ptr<ModelHandle> load_model(const std::string& path, int32_t max_positions, int32_t num_threads) {
  const auto t0 = std::chrono::steady_clock::now();
  if (max_positions < 0) fail(ErrorCode::kInvalidArgument, "max_positions must not be negative");
  LoadedModel lm = load_llama_weights(path, num_threads);
  if (max_positions == 0) max_positions = std::min(kDefaultMaxPositions, lm.config.max_position_embeddings);
  auto model = std::make_shared<LlamaModel>(std::move(lm.config), std::move(lm.weights), max_positions);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return std::make_shared<ModelHandle>(std::move(model), lm.path, lm.format, dt, max_positions);
}

int64_t kv_block_bytes(const ModelConfig& c, int32_t block_size) {
  KVLayout L{c.num_layers, c.num_kv_heads, c.head_dim, block_size};
  return L.block_elems() * static_cast<int64_t>(sizeof(float));
}

namespace {

class CpuExecutor : public ModelExecutor {
 public:
  CpuExecutor(std::shared_ptr<ModelHandle> model, int32_t block_size, int32_t num_blocks, bool fused,
              int32_t num_threads)
      : handle_(std::move(model)),
        model_(handle_->model().get()),
        fused_(fused),
        threads_(num_threads),
        sampler_(handle_->config().vocab_size),
        // Workers call ATen (slices of the GEMMs): single-threaded there, the pool is
        // the only source of parallelism.
        pool_(std::make_unique<ThreadPool>(num_threads > 0 ? num_threads : 1, [] { at::set_num_threads(1); })) {
    const ModelConfig& c = model_->config();
    layout_ = KVLayout{c.num_layers, c.num_kv_heads, c.head_dim, block_size};
    // Uninitialised on purpose: pages are touched as blocks are first written, and the
    // kernels never read a slot before it is written (masked rows are skipped, not
    // multiplied by zero).
    kv_ = at::empty({static_cast<int64_t>(num_blocks) * layout_.block_elems()}, at::kFloat);
  }

  void prepare_thread() override {
    at::set_num_threads(1);
    set_thread_pool(pool_.get());
  }
  int32_t vocab_size() const override { return model_->config().vocab_size; }

  void execute(const BatchMeta& meta, const std::vector<SampleRequest>& samples,
               std::vector<SampleResult>* results, const std::vector<LogitsCopy>& copies) override {
    at::Tensor logits = model_->forward(meta, kv_.data_ptr<float>(), layout_, fused_);
    const int64_t V = logits.size(1);
    float* base = logits.data_ptr<float>();
    for (const LogitsCopy& c : copies) std::memcpy(c.dst, base + c.logits_row * V, sizeof(float) * V);
    results->clear();
    results->reserve(samples.size());
    for (const SampleRequest& s : samples) results->push_back(sampler_.sample(base + s.logits_row * V, s.input));
  }

 private:
  std::shared_ptr<ModelHandle> handle_;
  const LlamaModel* model_;
  bool fused_;
  int32_t threads_;
  KVLayout layout_;
  at::Tensor kv_;
  Sampler sampler_;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace

std::unique_ptr<ModelExecutor> make_cpu_executor(std::shared_ptr<ModelHandle> model, int32_t block_size,
                                                 int32_t num_blocks, bool fused, int32_t num_threads) {
  if (num_blocks <= 0) fail(ErrorCode::kInvalidArgument, "the KV pool needs at least one block");
  return std::make_unique<CpuExecutor>(std::move(model), block_size, num_blocks, fused, num_threads);
}

}  // namespace k25
