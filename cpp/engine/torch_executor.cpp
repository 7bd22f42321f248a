#include "engine/torch_executor.h"

#include <ATen/Parallel.h>

#include <chrono>
#include <cstring>

#include "k25/status.h"
#include "model/llama_model.h"
#include "ops/parallel.h"
#include "ops/thread_pool.h"

#ifdef K25_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "model/cuda_glue.h"
#endif

// Weak: present with torch's OpenMP runtime and MKL; absent (null) in other builds.
extern "C" {
void omp_set_num_threads(int) __attribute__((weak));
// The C entry point; the lower-case symbol is the Fortran one (it takes a pointer).
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
}

namespace k25 {

namespace {

// ATen and BLAS calls of this thread run single-threaded: the engine's pool is its
// parallelism. Thread-local on purpose: at::set_num_threads(1) would change the default of
// every thread the host application starts later.
void single_threaded_here() {
  (void)at::get_num_threads();  // ATen's lazy per-thread init first, or it resets what follows
  if (omp_set_num_threads) omp_set_num_threads(1);
  if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(1);
}

at::ScalarType scalar_type(const std::string& dtype) {
  if (dtype == "float32") return at::kFloat;
  if (dtype == "bfloat16") return at::kBFloat16;
  if (dtype == "float16") return at::kHalf;
  fail(ErrorCode::kInvalidArgument, "dtype must be float32, bfloat16 or float16, not '" + dtype + "'");
}

at::Device torch_device(const DeviceSpec& spec) {
  if (spec.device == "cpu") return at::Device(at::kCPU);
  if (spec.device.rfind("cuda", 0) == 0) {
#ifdef K25_WITH_CUDA
    if (!cuda_glue::available()) fail(ErrorCode::kUnsupported, "device='cuda': no CUDA device is visible");
    return at::Device(spec.device);
#else
    fail(ErrorCode::kUnsupported, "device='cuda': this build of k25 has no CUDA backend (built with K25_CUDA=off "
                                  "or without a CUDA toolkit / CUDA torch)");
#endif
  }
  fail(ErrorCode::kInvalidArgument, "device must be 'cpu' or 'cuda[:N]', not '" + spec.device + "'");
}

}  // namespace

int32_t dtype_bytes(const std::string& dtype) { return dtype == "float32" ? 4 : 2; }

bool cuda_available() {
#ifdef K25_WITH_CUDA
  return cuda_glue::available();
#else
  return false;
#endif
}

void cuda_memory(int device, int64_t* free_bytes, int64_t* total_bytes) {
#ifdef K25_WITH_CUDA
  cuda_glue::device_memory(device, free_bytes, total_bytes);
#else
  fail(ErrorCode::kUnsupported, "this build of k25 has no CUDA backend");
#endif
}

int64_t device_allocated_bytes(const DeviceSpec& spec) {
#ifdef K25_WITH_CUDA
  if (spec.device != "cpu") {
    const at::Device d(spec.device);
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.has_index() ? d.index() : 0);
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
#endif
  return 0;
}

ModelHandle::ModelHandle(std::shared_ptr<LlamaModel> model, std::string path, std::string format,
                         double load_seconds, int32_t max_positions, DeviceSpec spec)
    : model_(std::move(model)),
      path_(std::move(path)),
      format_(std::move(format)),
      load_seconds_(load_seconds),
      max_positions_(max_positions),
      spec_(std::move(spec)) {}

const ModelConfig& ModelHandle::config() const { return model_->config(); }
int64_t ModelHandle::weight_bytes() const { return model_->weight_bytes(); }

std::shared_ptr<ModelHandle> load_model(const std::string& path, int32_t max_positions, int32_t num_threads,
                                        const DeviceSpec& spec) {
  const auto t0 = std::chrono::steady_clock::now();
  if (max_positions < 0) fail(ErrorCode::kInvalidArgument, "max_positions must not be negative");
  const at::Device device = torch_device(spec);
  const at::ScalarType dtype = scalar_type(spec.dtype);
  if (device.is_cpu() && dtype != at::kFloat) {
    fail(ErrorCode::kUnsupported, "the CPU backend computes in float32 (dtype='" + spec.dtype + "' needs CUDA)");
  }
  LoadedModel lm = load_llama_weights(path, num_threads);
  if (max_positions == 0) max_positions = std::min(kDefaultMaxPositions, lm.config.max_position_embeddings);
  auto model = std::make_shared<LlamaModel>(std::move(lm.config), std::move(lm.weights), max_positions);
  if (!device.is_cpu()) {
#ifdef K25_WITH_CUDA
    const int32_t group = model->config().num_heads / model->config().num_kv_heads;
    if (model->config().head_dim != 64 && model->config().head_dim != 128) {
      fail(ErrorCode::kUnsupported, "the CUDA backend supports head_dim 64 and 128, not " +
                                        std::to_string(model->config().head_dim));
    }
    if (group > 16) fail(ErrorCode::kUnsupported, "the CUDA backend supports up to 16 query heads per KV head");
    c10::cuda::CUDAGuard guard(device);
    model->to(device, dtype);
#endif
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return std::make_shared<ModelHandle>(std::move(model), lm.path, lm.format, dt, max_positions, spec);
}

int64_t kv_block_bytes(const ModelConfig& c, int32_t block_size, int32_t elem_bytes) {
  KVLayout L{c.num_layers, c.num_kv_heads, c.head_dim, block_size};
  return L.block_elems() * static_cast<int64_t>(elem_bytes);
}

namespace {

// Runs the model with ATen. CPU: float32, GEMMs split over k25's thread pool, host
// sampling. CUDA: the model dtype, cuBLAS GEMMs and cuda/ kernels on a stream of the
// engine thread; greedy rows are sampled on the device, other rows on the host.
class TorchExecutor : public ModelExecutor {
 public:
  TorchExecutor(std::shared_ptr<ModelHandle> model, int32_t block_size, int32_t num_blocks, bool fused,
                int32_t num_threads)
      : handle_(std::move(model)),
        model_(handle_->model().get()),
        fused_(fused),
        sampler_(handle_->config().vocab_size) {
    const ModelConfig& c = model_->config();
    const at::Device device = model_->device();
    layout_ = KVLayout{c.num_layers, c.num_kv_heads, c.head_dim, block_size};
    layout_.k_transposed = device.is_cpu();
    if (device.is_cpu()) {
      // Workers call ATen (slices of the GEMMs): single-threaded there, the pool is the
      // only source of parallelism.
      pool_ = std::make_unique<ThreadPool>(num_threads > 0 ? num_threads : 1, [] { single_threaded_here(); });
    }
    // Uninitialised on purpose: the kernels never read a slot before it is written
    // (masked keys are selected away, not multiplied by zero), and on the CPU pages are
    // touched only as blocks are first used.
#ifdef K25_WITH_CUDA
    std::unique_ptr<c10::cuda::CUDAGuard> guard;
    if (device.is_cuda()) guard = std::make_unique<c10::cuda::CUDAGuard>(device);
#endif
    kv_ = at::empty({static_cast<int64_t>(num_blocks) * layout_.block_elems()},
                    at::TensorOptions().dtype(model_->dtype()).device(device));
  }

  void prepare_thread() override {
    single_threaded_here();
    if (pool_) set_thread_pool(pool_.get());
  }
  int32_t vocab_size() const override { return model_->config().vocab_size; }
  int32_t max_positions() const override { return handle_->max_positions(); }

  void execute(const BatchMeta& meta, const std::vector<SampleRequest>& samples,
               std::vector<SampleResult>* results, const std::vector<LogitsCopy>& copies) override {
    if (model_->device().is_cpu()) return execute_on(meta, samples, results, copies);
#ifdef K25_WITH_CUDA
    c10::cuda::CUDAGuard guard(model_->device());
    if (!stream_) stream_ = std::make_unique<c10::cuda::CUDAStream>(c10::cuda::getStreamFromPool(false));
    c10::cuda::CUDAStreamGuard sg(*stream_);
    execute_on(meta, samples, results, copies);
#endif
  }

 private:
  static bool plain_greedy(const SampleRequest& s) {
    const SamplingParams& p = *s.input.params;
    return (p.temperature < kGreedyTemperature || p.top_k == 1) && p.logprobs < 0 && p.repetition_penalty == 1.0f &&
           p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f && s.input.banned == nullptr;
  }

  void execute_on(const BatchMeta& meta, const std::vector<SampleRequest>& samples,
                  std::vector<SampleResult>* results, const std::vector<LogitsCopy>& copies) {
    at::Tensor logits = model_->forward(meta, kv_, layout_, fused_);
    results->clear();
    results->resize(samples.size());
    bool all_greedy = copies.empty();
    for (const SampleRequest& s : samples) all_greedy = all_greedy && plain_greedy(s);
    if (logits.is_cuda() && all_greedy) {
#ifdef K25_WITH_CUDA
      // Only the sampled ids come back to the host.
      at::Tensor ids = cuda_glue::argmax_rows(logits.contiguous()).cpu();
      const int32_t* id = ids.data_ptr<int32_t>();
      for (size_t i = 0; i < samples.size(); ++i) (*results)[i].token = id[samples[i].logits_row];
      return;
#endif
    }
    // The host sampler handles every option (penalties, filters, logprobs).
    at::Tensor host = logits.is_cuda() ? logits.cpu() : logits;
    const int64_t V = host.size(1);
    float* base = host.data_ptr<float>();
    for (const LogitsCopy& c : copies) std::memcpy(c.dst, base + c.logits_row * V, sizeof(float) * V);
    for (size_t i = 0; i < samples.size(); ++i) {
      // One request's bad numbers (e.g. penalties that overflow) fail that request only.
      try {
        (*results)[i] = sampler_.sample(base + samples[i].logits_row * V, samples[i].input);
      } catch (const std::exception& e) {
        (*results)[i] = SampleResult{};
        (*results)[i].error = e.what();
      }
    }
  }

  std::shared_ptr<ModelHandle> handle_;
  const LlamaModel* model_;
  bool fused_;
  KVLayout layout_;
  at::Tensor kv_;
  Sampler sampler_;
  std::unique_ptr<ThreadPool> pool_;
#ifdef K25_WITH_CUDA
  std::unique_ptr<c10::cuda::CUDAStream> stream_;
#endif
};

}  // namespace

std::unique_ptr<ModelExecutor> make_executor(std::shared_ptr<ModelHandle> model, int32_t block_size,
                                             int32_t num_blocks, bool fused, int32_t num_threads) {
  if (num_blocks <= 0) fail(ErrorCode::kInvalidArgument, "the KV pool needs at least one block");
  return std::make_unique<TorchExecutor>(std::move(model), block_size, num_blocks, fused, num_threads);
}

}  // namespace k25
