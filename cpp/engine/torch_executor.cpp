#include "engine/torch_executor.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <string>

#include "k25/status.h"
#include "kv/tiers/page_format.h"
#include "kv/tiers/tier_manager.h"
#include "model/llama_model.h"
#include "ops/parallel.h"
#include "ops/thread_pool.h"

#ifdef K25_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "k25_cuda.h"
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

int32_t dtype_bytes(const std::string& dtype) {
  if (dtype == "float32") return 4;
  if (dtype == "bfloat16" || dtype == "float16") return 2;
  fail(ErrorCode::kInvalidArgument, "dtype must be float32, bfloat16 or float16, not '" + dtype + "'");
}

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
  const at::ScalarType dtype = scalar_type_of(spec.dtype);
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
// engine thread; sampling on the device (argmax when every row is plain greedy, else the
// device sampler), except for steps that also copy full logits out (score()).
class TorchExecutor : public ModelExecutor {
 public:
  TorchExecutor(std::shared_ptr<ModelHandle> model, int32_t block_size, int32_t num_blocks, bool fused,
                int32_t num_threads, const SparsityParams* sparsity, const std::string& kv_dtype)
      : handle_(std::move(model)),
        model_(handle_->model().get()),
        fused_(fused),
        sampler_(handle_->config().vocab_size) {
    const ModelConfig& c = model_->config();
    const at::Device device = model_->device();
    layout_ = KVLayout{c.num_layers, c.num_kv_heads, c.head_dim, block_size};
    layout_.k_transposed = device.is_cpu();
    const bool bf16_pool = device.is_cpu() && kv_dtype == "bfloat16";
    if (bf16_pool) layout_.elem = KVElem::kBF16;
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
    // One block more than the scheduler owns: the scratch block that padded rows of a
    // CUDA-graph batch write to and read from.
    num_blocks_ = num_blocks;
    kv_ = at::empty({static_cast<int64_t>(num_blocks + (device.is_cuda() ? 1 : 0)) * layout_.block_elems()},
                    at::TensorOptions().dtype(bf16_pool ? at::kBFloat16 : model_->dtype()).device(device));
    if (sparsity) {
      if (!fused_) {
        fail(ErrorCode::kUnsupported, "dynamic sparsity needs kernel fusion (the unfused path has no sparse "
                                      "attention)");
      }
      sparse_ = std::make_unique<SparseStep>();
      sparse_->params = *sparsity;
      sparse_->layout = SummaryLayout::of(layout_, sparsity->key_codes, sparsity->compensation);
      sparse_->layers.resize(c.num_layers);
      stats_.resize(c.num_layers);
      if (device.is_cpu()) {
        summaries_ = at::empty({static_cast<int64_t>(num_blocks) * sparse_->layout.block_elems()},
                               at::TensorOptions().dtype(at::kFloat));
        sparse_->summaries = summaries_.data_ptr<float>();
      } else {
#ifdef K25_WITH_CUDA
        if (sparsity->score_channels != 0 || sparsity->compensation) {
          fail(ErrorCode::kUnsupported, "on CUDA, dynamic sparsity ranks blocks by the Quest bound or the key "
                                        "codes: set sparsity_score_channels=0 and sparsity_compensation=False");
        }
        // The device selection's limits (cuda/block_sparsity.cu), checked here so that a model
        // outside them fails at construction rather than at its first decode step.
        if ((c.head_dim != 64 && c.head_dim != 128) || c.num_kv_heads > cuda::kMaxSparseKvHeads ||
            c.num_heads > cuda::kMaxSparseHeads) {
          fail(ErrorCode::kUnsupported, "dynamic sparsity on CUDA supports head_dim 64 or 128, up to 16 KV heads "
                                        "and 128 query heads; this model has head_dim " +
                                            std::to_string(c.head_dim) + ", " + std::to_string(c.num_kv_heads) +
                                            " KV heads, " + std::to_string(c.num_heads) + " query heads");
        }
        // The scratch block of padded graph rows has a summary too.
        sparse_->device_summaries = cuda_glue::make_block_summaries(num_blocks + 1, layout_, model_->dtype(), device,
                                                                    sparsity->key_codes);
        const auto f64 = at::TensorOptions().dtype(at::kDouble);
        // blocks, kept blocks, selections, entropy bits, reused selections (cuda_glue::select_blocks)
        sparse_->layer_stats = at::zeros({c.num_layers, 5}, f64.device(device));
        sparse_->host_stats = at::zeros({c.num_layers, 5}, f64.pinned_memory(true));
#endif
      }
    }
#ifdef K25_WITH_CUDA
    const char* off = std::getenv("K25_DISABLE_CUDA_GRAPHS");
    use_graphs_ = device.is_cuda() && fused_ && !(off && std::string(off) == "1");
#endif
    // Pipelined decode runs on CUDA graph steps; K25_ASYNC_SCHEDULING=1 also runs it, step
    // by step, everywhere else (the engine's side of it is then exercised on the CPU).
    const char* pipe = std::getenv("K25_ASYNC_SCHEDULING");
    emulate_async_ = pipe && std::string(pipe) == "1";
    // Selective cold reads (cold_read_plan) by default with the rules that read only the
    // summaries (the bound, the key codes): with the channel estimate every block's K half is
    // read anyway, and the V halves apart from it make more reads than whole layers do, which
    // costs more on a disk bound by its reads per second than the bytes saved (bench/RESULTS.md).
    // K25_L3_SELECTIVE=1: with the channel estimate too; 0: never (whole layers ahead). For
    // measurement: bench/cpu_long_context.py --l3-whole.
    const char* sel = std::getenv("K25_L3_SELECTIVE");
    const std::string sel_mode = sel ? sel : "";
    selective_cold_ = sel_mode == "1" || (sel_mode != "0" && sparse_ && (sparse_->params.score_channels == 0 ||
                                                                          sparse_->params.key_codes));
  }

#ifdef K25_WITH_CUDA
  ~TorchExecutor() override {
    // Steps launched without waiting may still be writing the KV pool and staging buffers.
    if (stream_) stream_->synchronize();
    release_stage();
  }
#endif

  // CUDA graphs of decode steps: captured here, one per batch-size bucket up to the
  // engine's max_batch_size (a first capture inside a request's decode would add its
  // time, ~70 ms for the 8B shape, to that request).
  void warm_up(int32_t max_batch_size) override {
#ifdef K25_WITH_CUDA
    grow_cold_summaries();  // before any graph captures the summaries' address
    if (sparse_ && kv_.is_cuda() && sparse_->params.selection_interval > 1 && !reuse_slots_) {
      // Selection reuse: a slot of kept selections per row of the largest step (before any
      // graph captures their address; K25Model's pool sizing sets the same bytes aside).
      c10::cuda::CUDAGuard guard(model_->device());
      c10::cuda::CUDAStreamGuard sg(engine_stream());
      const int32_t slots = std::max(max_batch_size, bucket_for(max_batch_size));
      sparse_->device_memory = cuda_glue::make_sparse_memory(slots, layout_, graph_blocks(), model_->device());
      reuse_slots_ = std::make_unique<ReuseSlots>(slots, graph_blocks());
    }
    if (!use_graphs_) return;
    c10::cuda::CUDAGuard guard(model_->device());
    c10::cuda::CUDAStreamGuard sg(engine_stream());
    // The largest bucket to capture sizes the sparse selection's scratch (graphs keep its
    // addresses, so it is allocated once, before the first capture).
    sparse_bucket_ = bucket_for(max_batch_size);
    // Eager steps may hold up to max_batch_size sequences, beyond the largest bucket.
    ensure_sparse_scratch(std::max(max_batch_size, sparse_bucket_), graph_blocks());
    for (int32_t b : kBuckets) {
      graph_for(b);
      if (b >= max_batch_size) break;
    }
    stream_->synchronize();
#else
    (void)max_batch_size;
#endif
  }

  void prepare_thread() override {
    single_threaded_here();
    if (pool_) set_thread_pool(pool_.get());
  }
  int32_t vocab_size() const override { return model_->config().vocab_size; }
  std::vector<LayerSparsityStats> sparsity_stats() const override {
#ifdef K25_WITH_CUDA
    if (sparse_ && sparse_->host_stats.defined()) {
      // The device's running sums as of the latest forward whose copy has landed. The
      // device selection keeps no top blocks (docs/sparsity.md "CUDA").
      std::vector<LayerSparsityStats> out(stats_.size());
      const double* h = sparse_->host_stats.data_ptr<double>();
      for (size_t l = 0; l < out.size(); ++l) {
        out[l].blocks_total = std::llround(h[5 * l]);
        out[l].blocks_skipped = std::llround(h[5 * l] - h[5 * l + 1]);
        out[l].selections = std::llround(h[5 * l + 2]);
        out[l].entropy_bits = h[5 * l + 3];
        out[l].reused_selections = std::llround(h[5 * l + 4]);
      }
      return out;
    }
#endif
    return stats_;
  }
  void* kv_host_base() override { return kv_.is_cpu() ? kv_.data_ptr() : nullptr; }
  bool configure_tiers(TierConfig* config) override {
    tiers_ = true;
#ifdef K25_WITH_CUDA
    if (!kv_.is_cuda()) return false;
    // L2 in pinned host memory, mapped: its allocation is also where the attention kernels
    // read cold blocks (cold_, passed to every eager forward).
    HostAllocator pinned = cuda_glue::pinned_allocator();
    std::shared_ptr<ColdRegion> cold = cold_;
    const int64_t slot_bytes = page_bytes_for(kv_block_bytes());
    const int64_t row_bytes = static_cast<int64_t>(layout_.head_dim) * kv_.element_size();
    config->l2_allocator = pinned;
    config->l2_allocator.allocate = [alloc = pinned.allocate, cold, slot_bytes, row_bytes](size_t bytes) -> void* {
      void* p = alloc(bytes);
      if (p == nullptr) return p;
      const int64_t slots = static_cast<int64_t>(bytes) / slot_bytes;
      const void* device = cuda_glue::device_address(p);
      // The kernels name an L2 row in 31 bits (kColdRow): a pool past that, or one the device
      // cannot address, still serves swaps and prefix spills, but no cold blocks.
      if (device != nullptr && cuda_glue::cold_rows_fit(slots, slot_bytes, row_bytes)) {
        *cold = ColdRegion{static_cast<const uint8_t*>(p), device, slot_bytes, static_cast<int32_t>(slots)};
      }
      return p;
    };
    config->l2_allocator.release = [release = pinned.release, cold](void* p, size_t bytes) {
      if (cold->host == p) *cold = ColdRegion{};
      release(p, bytes);
    };
    void* base = kv_.data_ptr();
    const int64_t bytes = kv_block_bytes();
    const int32_t blocks = static_cast<int32_t>(kv_.numel() / layout_.block_elems());
    const int device = kv_.device().index();
    c10::cuda::CUDAGuard guard(kv_.device());  // engine_stream() is made on the current device
    cudaStream_t compute = engine_stream().stream();
    config->make_copier = [base, bytes, blocks, device, compute](TaskRunner* completions) {
      return cuda_glue::make_cuda_block_copier(base, bytes, blocks, device, completions, compute);
    };
    return true;
#else
    (void)config;
    return false;
#endif
  }
  int64_t cold_gathered() const override { return cold_gathered_.load(); }
  int64_t max_async_cold_blocks() const override {
#ifdef K25_WITH_CUDA
    const int32_t n = prefetch_capacity();
    if (n > 0) return n;
#endif
    return INT64_MAX;
  }
  int64_t kv_block_bytes() const override { return layout_.block_elems() * static_cast<int64_t>(kv_.element_size()); }
  std::string kv_dtype() const override {
    switch (kv_.scalar_type()) {
      case at::kFloat: return "float32";
      case at::kBFloat16: return "bfloat16";
      case at::kHalf: return "float16";
      default: return "";
    }
  }
  int32_t max_positions() const override { return handle_->max_positions(); }

  // A layered step (the engine's L3 lane): eager, on the engine stream; each layer's
  // selection statistics are taken as it runs (a whole step between two layers reuses
  // SparseStep::layers).
  class Layered : public LayeredStep {
   public:
    Layered(TorchExecutor* ex, const BatchMeta& meta, const std::vector<SampleRequest>& samples)
        : ex_(ex), samples_(samples) {
      for (int32_t p : meta.prev_rows) {
        if (p >= 0) fail(ErrorCode::kInternal, "ids from a previous step are for launch_async");
      }
#ifdef K25_WITH_CUDA
      std::unique_ptr<c10::cuda::CUDAGuard> guard;
      std::unique_ptr<c10::cuda::CUDAStreamGuard> sg;
      if (ex_->kv_.is_cuda()) {
        if (!ex_->pending_.empty()) fail(ErrorCode::kInternal, "a layered step while launched steps are in flight");
        guard = std::make_unique<c10::cuda::CUDAGuard>(ex_->kv_.device());
        sg = std::make_unique<c10::cuda::CUDAStreamGuard>(ex_->engine_stream());
        ex_->ensure_sparse_scratch(meta.num_seqs(), meta.max_blocks_per_seq);
        // The lane's steps keep no selections (its layers interleave with whole steps, whose
        // rows may take any slot): they select every step.
        if (ex_->sparse_) ex_->sparse_->reuse_rows.clear();
      }
#endif
      pass_ = ex_->model_->begin(meta, ex_->kv_, ex_->layout_, ex_->fused_, nullptr, ex_->sparse_.get(),
                                 ex_->cold_.get());
    }
    ~Layered() override {
#ifdef K25_WITH_CUDA
      // Launched layers may still read the staging buffers the next lane refills.
      // A destructor must not throw: after a sticky device error the synchronize does, and the
      // step's failure has been (or will be) reported by the call that saw it.
      try {
        if (ex_->kv_.is_cuda() && pass_ && pass_->next_layer() < pass_->num_layers()) ex_->engine_stream().synchronize();
      } catch (const std::exception&) {
      }
#endif
    }
    int32_t next_layer() const override { return pass_->next_layer(); }
    int32_t num_layers() const override { return pass_->num_layers(); }
    void run_layer() override {
      const int32_t l = pass_->next_layer();
#ifdef K25_WITH_CUDA
      if (ex_->kv_.is_cuda()) {
        c10::cuda::CUDAGuard guard(ex_->kv_.device());
        c10::cuda::CUDAStreamGuard sg(ex_->engine_stream());
        pass_->run_layer();
        return;
      }
#endif
      pass_->run_layer();
      if (pass_->next_layer() == l) return;  // its first part (selective cold reads): the rest next call
      ex_->add_layer_stats(static_cast<size_t>(l));
      // Kept for block_reads: a whole step between two layers overwrites SparseStep::layers.
      if (ex_->sparse_) layers_.push_back(ex_->sparse_->layers[l]);
    }
    bool block_reads(const BatchMeta& meta, BlockReads* out) const override {
      if (pass_->next_layer() < pass_->num_layers()) return false;
#ifdef K25_WITH_CUDA
      // On CUDA the device selections' counts, taken a layer at a time (staged steps).
      if (ex_->sparse_ && ex_->kv_.is_cuda()) {
        const std::vector<int32_t>* r = pass_->staged_reads();
        return r != nullptr && ex_->device_block_reads(meta, r->data(), out);
      }
#endif
      return ex_->reads_of(meta, ex_->sparse_ && ex_->kv_.is_cpu() ? &layers_ : nullptr, out);
    }
    void finish(std::vector<SampleResult>* results, const std::vector<LogitsCopy>& copies) override {
#ifdef K25_WITH_CUDA
      std::unique_ptr<c10::cuda::CUDAGuard> guard;
      std::unique_ptr<c10::cuda::CUDAStreamGuard> sg;
      if (ex_->kv_.is_cuda()) {
        guard = std::make_unique<c10::cuda::CUDAGuard>(ex_->kv_.device());
        sg = std::make_unique<c10::cuda::CUDAStreamGuard>(ex_->engine_stream());
      }
#endif
      at::Tensor logits = pass_->logits();
      ex_->sample_logits(logits, samples_, results, copies);
    }

   private:
    TorchExecutor* ex_;
    const std::vector<SampleRequest>& samples_;
    std::unique_ptr<LlamaModel::Pass> pass_;
    std::vector<LayerSelection> layers_;  // CPU selections: layer l's at [l]
  };

  std::unique_ptr<LayeredStep> begin_layered(const BatchMeta& meta, const std::vector<SampleRequest>& samples) override {
    return std::make_unique<Layered>(this, meta, samples);
  }

  void execute(const BatchMeta& meta, const std::vector<SampleRequest>& samples,
               std::vector<SampleResult>* results, const std::vector<LogitsCopy>& copies) override {
    for (int32_t p : meta.prev_rows) {
      if (p >= 0) fail(ErrorCode::kInternal, "ids from a previous step are for launch_async");
    }
    if (model_->device().is_cpu()) return execute_on(meta, samples, results, copies);
#ifdef K25_WITH_CUDA
    c10::cuda::CUDAGuard guard(model_->device());
    c10::cuda::CUDAStreamGuard sg(engine_stream());
    if (!pending_.empty()) fail(ErrorCode::kInternal, "a synchronous step while launched steps are in flight");
    if (use_graphs_ && graph_eligible(meta, copies)) return execute_graph(meta, samples, results);
    execute_on(meta, samples, results, copies);
#endif
  }

  bool supports_async() const override { return graph_async() || emulate_async_; }
  void refresh_fetched_kv(const BatchMeta& runs) override {
    if (!sparse_) return;
#ifdef K25_WITH_CUDA
    if (kv_.is_cuda()) {
      c10::cuda::CUDAGuard guard(model_->device());
      c10::cuda::CUDAStreamGuard sg(engine_stream());
      const auto i32 = at::TensorOptions().dtype(at::kInt);
      // Pinned and asynchronous: a pageable upload synchronizes the stream, i.e. makes the host
      // wait for a pipelined step in flight (the caching host allocator keeps the pinned
      // buffers until their copies are done).
      auto up = [&](const std::vector<int32_t>& v) {
        return at::tensor(at::ArrayRef<int32_t>(v), i32).pin_memory().to(model_->device(), /*non_blocking=*/true);
      };
      cuda_glue::DeviceBatch b;
      b.query_start = up(runs.query_start);
      b.context_lens = up(runs.context_lens);
      b.block_tables = up(runs.block_tables);
      b.max_blocks = runs.max_blocks_per_seq;
      for (int32_t l = 0; l < layout_.num_layers; ++l) {
        cuda_glue::update_block_summaries(kv_, layout_, l, sparse_->device_summaries, b, sparse_->params.key_codes);
      }
      return;
    }
#endif
    // The fetched blocks' summaries were another block's (or stale): fold their keys in
    // again, as the step that wrote them did.
    const cpu::AttentionBatch ab = cpu_attention_batch(runs);
    for (int32_t l = 0; l < layout_.num_layers; ++l) {
      update_key_summaries(kv_.data_ptr(), layout_, sparse_->summaries, sparse_->layout, l, ab);
    }
  }
  // The CPU fused kernels (dense and sparse) read cold blocks in host memory; the CUDA
  // kernels and the unfused path (index_select on the pool) do not.
  // On CUDA (the L2 pool mapped), the device kernels read them in place over the bus, and the
  // device selection finds their summaries in rows past the pool's (keep_cold_summaries).
  bool supports_cold_blocks() const override { return fused_ && (kv_.is_cpu() || cold_->device != nullptr); }
  // The CPU fused kernels read an L3 block's layer from a buffer the ColdLayerSource filled;
  // on CUDA every cold block of such a step is staged a layer at a time in mapped pinned
  // memory (cold_stage), and the device selection ranks them by summary rows the step
  // uploads for its cold entries (LlamaModel's stage_cold_summaries).
  int32_t cold_l3_slices() const override {
    if (!fused_) return 0;
    return cold_halves() ? 2 * layout_.num_layers : layout_.num_layers;
  }
  // Selective cold reads (ColdReadPlan, selective_cold_): on the CPU with halves of whole
  // 4096-byte units (O_DIRECT reads them in place, K then V); on CUDA by whole layer slices
  // (its rule, the bound, reads no keys to select).
  bool cold_halves() const {
    return kv_.is_cpu() && sparse_ && selective_cold_ && (kv_block_bytes() / (2 * layout_.num_layers)) % 4096 == 0;
  }
  bool cold_selective() const { return sparse_ && selective_cold_ && (kv_.is_cuda() || cold_halves()); }
  ColdReadPlan cold_read_plan(const BatchMeta& meta) const override {
    ColdReadPlan p;
    if (!cold_selective()) return p;
    p.selective = true;
    p.halves = cold_halves();
    // The channel estimate reads keys; the bound and the key codes only the summaries.
    p.keys_ahead = p.halves && sparse_->params.score_channels > 0 && !sparse_->params.key_codes;
    for (int32_t w : model_->config().layer_sliding_window) p.layers.push_back(w == 0);
    // Rows that select nothing read all their cold blocks (select_blocks' eligibility).
    p.whole.assign(meta.cold_blocks.size(), 0);
    const int32_t MB = meta.max_blocks_per_seq;
    for (int32_t s = 0; s < meta.num_seqs(); ++s) {
      const bool selects =
          meta.query_start[s + 1] - meta.query_start[s] == 1 && meta.context_lens[s] > sparse_->params.min_context;
      if (selects) continue;
      for (int32_t b = 0; b < MB; ++b) {
        const int32_t id = meta.block_tables[static_cast<size_t>(s) * MB + b];
        if (id <= cold_block_id(0)) p.whole[static_cast<size_t>(cold_block_index(id))] = 1;
      }
    }
    return p;
  }
  bool stages_cold_blocks() const override { return kv_.is_cuda(); }
  ColdStage cold_stage(int64_t bytes) override {
    ColdStage st;
#ifdef K25_WITH_CUDA
    if (!kv_.is_cuda()) return st;
    // The last step that read these buffers may still be running (a step that samples
    // nothing is not waited for).
    c10::cuda::CUDAGuard guard(kv_.device());
    engine_stream().synchronize();
    if (bytes > stage_bytes_) {
      const int64_t want = std::max<int64_t>(bytes, 2 * stage_bytes_);
      release_stage();
      HostAllocator pinned = cuda_glue::pinned_allocator();
      stage_bytes_ = want;  // (what release_stage gives back)
      for (int i = 0; i < 2; ++i) {
        stage_host_[i] = static_cast<uint8_t*>(pinned.allocate(static_cast<size_t>(want)));
        stage_dev_[i] = stage_host_[i] ? cuda_glue::device_address(stage_host_[i]) : nullptr;
        if (!stage_dev_[i]) {
          release_stage();
          return st;  // ColdL3Reads reports it
        }
      }
    }
    for (int i = 0; i < 2; ++i) {
      st.host[i] = stage_host_[i];
      st.device[i] = stage_dev_[i];
    }
#else
    (void)bytes;
#endif
    return st;
  }
  bool block_reads(const BatchMeta& meta, BlockReads* out) const override {
#ifdef K25_WITH_CUDA
    if (sparse_) return reads_counted(meta, sparse_->scratch.host_reads, out);
#endif
    return reads_of(meta, sparse_ ? &sparse_->layers : nullptr, out);
  }
  // block_reads for a step whose device selection counted its reads into `counts` (pinned;
  // undefined: none were counted), or without a device selection, reads_of.
  bool reads_counted(const BatchMeta& meta, const at::Tensor& counts, BlockReads* out) const {
    if (kv_.is_cpu() || !sparse_) return reads_of(meta, sparse_ ? &sparse_->layers : nullptr, out);
    return counts.defined() && device_block_reads(meta, counts.data_ptr<int32_t>(), out);
  }
  bool collected_block_reads(BlockReads* out) const override {
    if (!collected_reads_) return false;
    *out = *collected_reads_;
    return true;
  }
  // block_reads from the head tables of the CPU's selections `layers` (null: every block).
  bool reads_of(const BatchMeta& meta, const std::vector<LayerSelection>* layers, BlockReads* out) const {
    const int32_t S = meta.num_seqs(), H = layout_.num_kv_heads, L = layout_.num_layers, bs = layout_.block_size;
    const int32_t MB = meta.max_blocks_per_seq;
    out->passes = L * H;
    out->reads.assign(S, {});
    out->sparse.assign(S, 0);
    for (int32_t s = 0; s < S; ++s) {
      if (meta.query_start[s + 1] - meta.query_start[s] != 1) continue;  // decode rows only
      const int32_t nb = (meta.context_lens[s] + bs - 1) / bs;
      std::vector<int32_t>& r = out->reads[s];
      r.assign(nb, 0);
      const int32_t* row = meta.block_tables.data() + static_cast<int64_t>(s) * MB;
      for (int32_t l = 0; l < L; ++l) {
        const LayerSelection* sel = layers ? &(*layers)[l] : nullptr;
        // A layer that ran no selection this step (sliding window, prefill) read every block.
        const bool selected = sel && sel->selections + sel->reused_selections > 0 &&
                              static_cast<int32_t>(sel->sparse.size()) == S &&
                              sel->sparse[s] && sel->max_blocks == MB;
        if (!selected) {
          for (int32_t b = 0; b < nb; ++b) r[b] += H;
          continue;
        }
        out->sparse[s] = 1;
        for (int32_t h = 0; h < H; ++h) {
          // Kept blocks in position order, then -1 (cold ids are <= -2).
          const int32_t* kept = sel->head_tables.data() + (static_cast<int64_t>(s) * H + h) * MB;
          int32_t k = 0;
          for (int32_t b = 0; b < nb && k < MB && kept[k] != -1; ++b) {
            if (row[b] == kept[k]) {
              ++r[b];
              ++k;
            }
          }
        }
      }
    }
    return true;
  }
  // The device selection's count of the step's reads (SparseScratch::reads) at `counted`: its
  // host copy landed before the sampled ids this step waited for. Layers with a sliding
  // window ran no selection: they read every block.
  bool device_block_reads(const BatchMeta& meta, const int32_t* counted, BlockReads* out) const {
#ifdef K25_WITH_CUDA
    const cuda_glue::SparseScratch& x = sparse_->scratch;
    const int32_t S = meta.num_seqs(), H = layout_.num_kv_heads, bs = layout_.block_size;
    if (S > x.num_seqs) return false;
    // A step that sampled nothing (prompt chunks only) was not waited for, so its copy of the
    // counts may not have landed; its rows are prompt chunks anyway, except a 1-token chunk.
    if (meta.logits_rows.empty()) return false;
    int32_t windowed = 0;
    for (int32_t w : model_->config().layer_sliding_window) windowed += w != 0;
    out->passes = layout_.num_layers * H;
    out->reads.assign(S, {});
    out->sparse.assign(S, 0);
    for (int32_t s = 0; s < S; ++s) {
      if (meta.query_start[s + 1] - meta.query_start[s] != 1) continue;  // decode rows only
      const int32_t nb = std::min((meta.context_lens[s] + bs - 1) / bs, x.max_blocks);
      std::vector<int32_t>& r = out->reads[s];
      r.assign(nb, windowed * H);
      for (int32_t b = 0; b < nb; ++b) r[b] += counted[static_cast<int64_t>(s) * x.max_blocks + b];
      out->sparse[s] = meta.context_lens[s] > sparse_->params.min_context;
    }
    return true;
#else
    (void)meta;
    (void)counted;
    (void)out;
    return false;
#endif
  }
  std::vector<float> block_summaries(int32_t block) const override {
    if (!sparse_ || sparse_->summaries == nullptr) return {};  // on CUDA: keep_cold_summaries
    const int64_t n = sparse_->layout.block_elems();
    const float* p = sparse_->summaries + static_cast<int64_t>(block) * n;
    return std::vector<float>(p, p + n);
  }
  // Dynamic sparsity on CUDA with cold blocks: the block summaries get one row set per L2
  // slot after the pool's blocks and the graphs' scratch block (cuda_glue::select_blocks
  // finds slot s at row num_blocks_ + 1 + s, its pool_blocks + s); a block that goes cold has
  // its rows copied there.
  void keep_cold_summaries(int32_t block, const void* cold_data) override {
#ifdef K25_WITH_CUDA
    if (!sparse_ || !kv_.is_cuda() || cold_->device == nullptr) return;
    grow_cold_summaries();
    const int64_t slot = cold_slot(*cold_, cold_data);
    const int64_t per = cuda_glue::block_summary_bytes(layout_, model_->dtype(), sparse_->params.key_codes);
    c10::cuda::CUDAGuard guard(model_->device());
    c10::cuda::CUDAStreamGuard sg(engine_stream());  // before the step that rewrites the block's rows
    at::Tensor& sm = sparse_->device_summaries;
    sm.narrow(0, (num_blocks_ + 1 + slot) * per, per).copy_(sm.narrow(0, block * per, per));
#else
    (void)block;
    (void)cold_data;
#endif
  }
  // A block that went to L3 on CUDA: its device rows, copied to the host (a wait: the steps
  // that demote to L3 are not pipelined anyway), for the staged steps that read it.
  std::vector<float> cold_l3_summaries(int32_t block) override {
#ifdef K25_WITH_CUDA
    if (!sparse_ || !kv_.is_cuda()) return {};
    const int64_t per = cuda_glue::block_summary_bytes(layout_, model_->dtype(), sparse_->params.key_codes);
    c10::cuda::CUDAGuard guard(model_->device());
    c10::cuda::CUDAStreamGuard sg(engine_stream());  // after the writes of the block's rows
    const at::Tensor row = sparse_->device_summaries.narrow(0, static_cast<int64_t>(block) * per, per);
    std::vector<float> out(static_cast<size_t>((row.nbytes() + sizeof(float) - 1) / sizeof(float)));
    at::Tensor host = at::from_blob(out.data(), {per}, row.options().device(at::kCPU));
    host.copy_(row);
    return out;
#else
    (void)block;
    return {};
#endif
  }
  int32_t max_async_batch() const override { return 128; }

  void launch_async(const BatchMeta& meta, const std::vector<SampleRequest>& samples) override {
    if (!graph_async()) return launch_emulated(meta, samples);
#ifdef K25_WITH_CUDA
    c10::cuda::CUDAGuard guard(model_->device());
    c10::cuda::CUDAStreamGuard sg(engine_stream());
    if (!use_graphs_ || !graph_eligible(meta, {})) fail(ErrorCode::kInternal, "launch_async needs a graph decode step");
    if (pending_.size() >= 2) fail(ErrorCode::kInternal, "more than two steps in flight");
    bool all_greedy = true;
    for (const SampleRequest& s : samples) {
      if (reads_token_history(*s.input.params)) {
        fail(ErrorCode::kInternal, "launch_async: penalties need the token history");
      }
      all_greedy = all_greedy && plain_greedy(s);
    }
    const int slot = next_slot_;
    AsyncSlot& a = slots_[slot];
    // With tiers, what the step read goes to the predictor when it is collected (made before
    // the launch: nothing after it may throw).
    a.meta.reset();
    if (tiers_) a.meta = std::make_unique<BatchMeta>(meta);
    DecodeGraph& g = replay_graph(meta, &a.reads_host);
    // The sampled ids are in last_ids_ (the graph's argmax, or the sampler's ids written
    // over them), where the next step's graph reads them on the device; they (or the
    // sampler's outputs) go down to this step's pinned slot, a copy ordered before the
    // next step overwrites them.
    next_slot_ ^= 1;
    a.rows.clear();
    for (const SampleRequest& s : samples) a.rows.push_back(s.logits_row);
    a.sampled = !all_greedy;
    if (all_greedy) {
      if (!a.host.defined()) a.host = at::empty({kBuckets[7]}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
      const int32_t B = meta.num_seqs();
      a.host.narrow(0, 0, B).copy_(g.argmax.narrow(0, 0, B), /*non_blocking=*/true);
    } else {
      const std::vector<cuda_glue::SampleSpec> specs = sample_specs(samples);
      const at::Tensor outs = cuda_glue::sample_launch(g.logits, specs, &last_ids_);
      a.outs = at::empty(outs.sizes(), outs.options().device(at::kCPU).pinned_memory(true));
      a.outs.copy_(outs, /*non_blocking=*/true);
    }
    a.done.record(*stream_);
    pending_.push_back(slot);
#endif
  }

  void collect_async(std::vector<SampleResult>* results) override {
    if (!graph_async()) {
      if (emulated_.empty()) fail(ErrorCode::kInternal, "collect_async without a launched step");
      *results = std::move(emulated_.front());
      emulated_.pop_front();
      collected_reads_ = std::move(emulated_reads_.front());
      emulated_reads_.pop_front();
      return;
    }
#ifdef K25_WITH_CUDA
    if (pending_.empty()) fail(ErrorCode::kInternal, "collect_async without a launched step");
    AsyncSlot& a = slots_[pending_.front()];
    pending_.pop_front();
    a.done.synchronize();
    collected_reads_.reset();
    if (a.meta) {
      auto r = std::make_shared<BlockReads>();
      if (reads_counted(*a.meta, a.reads_host, r.get())) collected_reads_ = std::move(r);
    }
    results->clear();
    if (a.sampled) {
      to_results(cuda_glue::sample_read(a.outs.data_ptr<uint8_t>(), static_cast<int32_t>(a.rows.size()),
                                        model_->config().vocab_size),
                 results);
      return;
    }
    const int32_t* id = a.host.data_ptr<int32_t>();
    results->resize(a.rows.size());
    for (size_t i = 0; i < a.rows.size(); ++i) set_greedy((*results)[i], id[a.rows[i]]);
#endif
  }

 private:
#ifdef K25_WITH_CUDA
  // The stream of every step (made on first use, on the current device).
  c10::cuda::CUDAStream& engine_stream() {
    if (!stream_) stream_ = std::make_unique<c10::cuda::CUDAStream>(c10::cuda::getStreamFromPool(false));
    return *stream_;
  }
#endif

  bool graph_async() const {
#ifdef K25_WITH_CUDA
    return use_graphs_;
#else
    return false;
#endif
  }

  // launch_async without CUDA graphs: the step runs at once (ids of the previous step taken
  // from its results) and its results wait for collect_async.
  void launch_emulated(const BatchMeta& meta, const std::vector<SampleRequest>& samples) {
    if (emulated_.size() >= 2) fail(ErrorCode::kInternal, "more than two steps in flight");
    BatchMeta m = meta;
    for (size_t r = 0; r < m.prev_rows.size(); ++r) {
      if (m.prev_rows[r] < 0) continue;
      if (m.prev_rows[r] >= static_cast<int32_t>(emulated_ids_.size())) fail(ErrorCode::kInternal, "bad prev_rows");
      m.token_ids[r] = emulated_ids_[m.prev_rows[r]];
    }
    m.prev_rows.clear();
    std::vector<SampleResult> results;
    execute(m, samples, &results, {});
    emulated_ids_.assign(m.logits_rows.size(), 0);
    for (size_t i = 0; i < samples.size(); ++i) emulated_ids_[samples[i].logits_row] = results[i].token;
    auto reads = std::make_shared<BlockReads>();
    // (Every step's: this mode is for tests, and a CPU pool's tiers do not pass configure_tiers.)
    emulated_reads_.push_back(block_reads(m, reads.get()) ? std::move(reads) : nullptr);
    emulated_.push_back(std::move(results));
  }

  // A device argmax: INT_MAX when the row has no finite logit (the host sampler's error).
  void set_greedy(SampleResult& r, int32_t id) const {
    if (id >= 0 && id < model_->config().vocab_size) {
      r.token = id;
    } else {
      r.token = -1;
      r.error = "no finite logit";
    }
  }

  static bool plain_greedy(const SampleRequest& s) {
    const SamplingParams& p = *s.input.params;
    return (p.temperature < kGreedyTemperature || p.top_k == 1) && p.logprobs < 0 && !reads_token_history(p) &&
           s.input.banned == nullptr;
  }

  void execute_on(const BatchMeta& meta, const std::vector<SampleRequest>& samples,
                  std::vector<SampleResult>* results, const std::vector<LogitsCopy>& copies) {
#ifdef K25_WITH_CUDA
    ensure_sparse_scratch(meta.num_seqs(), meta.max_blocks_per_seq);
    // A dense step's cold entries are gathered a layer ahead when the buffers hold them, else
    // read in place (ColdRegion::prefetch tells LlamaModel).
    cuda_glue::ColdPrefetch* pf = nullptr;
    if (!meta.cold_blocks.empty() && meta.cold_layers == nullptr) {
      const int64_t n = static_cast<int64_t>(meta.cold_blocks.size());
      pf = cold_prefetch();
      if (pf != nullptr && n > pf->capacity()) pf = nullptr;
      if (pf != nullptr) cold_gathered_ += n;
    }
    cold_->prefetch = pf;
    if (reuse_slots_) reuse_modes(meta, &sparse_->reuse_rows);
#endif
    at::Tensor logits = model_->forward(meta, kv_, layout_, fused_, nullptr, sparse_.get(), cold_.get());
#ifdef K25_WITH_CUDA
    if (sparse_) sparse_->reuse_rows.clear();
#endif
    for (size_t l = 0; l < stats_.size(); ++l) add_layer_stats(l);
    sample_logits(logits, samples, results, copies);
  }

  // The CPU fused path's selection of layer l in the step that just ran it, into the stats.
  void add_layer_stats(size_t l) {
    if (!sparse_ || l >= stats_.size()) return;
    const LayerSelection& sel = sparse_->layers[l];
    if (sel.selections == 0 && sel.reused_selections == 0) return;
    LayerSparsityStats& st = stats_[l];
    st.blocks_total += sel.blocks_total;
    st.blocks_skipped += sel.blocks_total - sel.blocks_kept;
    st.selections += sel.selections;
    st.reused_selections += sel.reused_selections;
    st.entropy_bits += sel.entropy_bits;
    if (sel.selections > 0) st.top_blocks = sel.top_blocks;
  }

  // A step's logits into its results (on the device where it can) and copies.
  void sample_logits(const at::Tensor& logits, const std::vector<SampleRequest>& samples,
                     std::vector<SampleResult>* results, const std::vector<LogitsCopy>& copies) {
    results->clear();
    results->resize(samples.size());
    bool all_greedy = copies.empty();
    for (const SampleRequest& s : samples) all_greedy = all_greedy && plain_greedy(s);
    if (logits.is_cuda() && all_greedy) {
#ifdef K25_WITH_CUDA
      // Only the sampled ids come back to the host.
      at::Tensor ids = cuda_glue::argmax_rows(logits.contiguous()).cpu();
      const int32_t* id = ids.data_ptr<int32_t>();
      for (size_t i = 0; i < samples.size(); ++i) set_greedy((*results)[i], id[samples[i].logits_row]);
      return;
#endif
    }
#ifdef K25_WITH_CUDA
    if (logits.is_cuda() && copies.empty()) {
      at::Tensor l = logits.contiguous();
      return sample_on_device(l, samples, results);
    }
#endif
    // The host sampler handles every option (penalties, filters, logprobs).
    at::Tensor host = logits.is_cuda() ? logits.cpu() : logits;
    const int64_t V = host.size(1);
    const float* base = host.data_ptr<float>();
    for (const LogitsCopy& c : copies) std::memcpy(c.dst, base + c.logits_row * V, sizeof(float) * V);
    sample_on_host(host, samples, results);
  }

  // Samples every request from host float32 logits [rows, vocab] (modified in place).
  void sample_on_host(at::Tensor& host, const std::vector<SampleRequest>& samples,
                      std::vector<SampleResult>* results) {
    const int64_t V = host.size(1);
    float* base = host.data_ptr<float>();
    results->resize(samples.size());
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

#ifdef K25_WITH_CUDA
  // ---- CUDA graphs for decode steps -------------------------------------------------
  // Decode-only batches of up to the largest bucket run as a graph captured once per
  // batch-size bucket (padded to it); attention work is derived on the device, so one
  // capture serves every context length. Prefill and mixed steps run eagerly.
  static constexpr int32_t kBuckets[] = {1, 2, 4, 8, 16, 32, 64, 128};
  // The smallest bucket that holds n sequences (the largest bucket when none does).
  static int32_t bucket_for(int32_t n) {
    for (int32_t b : kBuckets) {
      if (b >= n) return b;
    }
    return kBuckets[7];
  }
  struct DecodeGraph {
    DeviceStep step;
    // [ids | positions | context_lens | prev_rows | block_tables | gathered cold entries |
    // selection reuse modes] int32, one upload
    at::Tensor ints;
    int64_t reuse_at = -1;  // where the reuse modes start in ints (-1: none)
    at::Tensor prev_rows;  // view of ints: BatchMeta::prev_rows, -1 for host ids
    at::Tensor slots;    // int64
    at::Tensor logits;   // float32 [bucket, vocab], written by the graph
    at::Tensor argmax;   // int32 [bucket]: a view of last_ids_
    at::Tensor host_ints, host_slots;  // pinned staging
    at::cuda::CUDAEvent uploaded;      // the staging buffers' last upload is done after it
    std::unique_ptr<at::cuda::CUDAGraph> graph;
  };
  struct AsyncSlot {
    at::Tensor host;  // pinned int32 [max bucket]: a launched greedy step's ids
    at::Tensor outs;  // pinned: a launched sampled step's sampler outputs
    bool sampled = false;
    at::cuda::CUDAEvent done;
    std::vector<int32_t> rows;  // per sample, its logits row
    at::Tensor reads_host;             // pinned: the step's selection read counts (copy_reads)
    std::unique_ptr<BatchMeta> meta;   // with tiers: the step's, for collected_block_reads
  };

  // The summaries' rows for the L2 slots (keep_cold_summaries), once the L2 pool exists.
  void grow_cold_summaries() {
    if (!sparse_ || !kv_.is_cuda() || cold_->device == nullptr) return;
    const int64_t rows = static_cast<int64_t>(num_blocks_) + 1 + cold_->num_slots;
    at::Tensor& sm = sparse_->device_summaries;
    if (sm.numel() >= rows * cuda_glue::block_summary_bytes(layout_, model_->dtype(), sparse_->params.key_codes)) return;
    if (!graphs_.empty()) fail(ErrorCode::kInternal, "the block summaries cannot grow under captured CUDA graphs");
    c10::cuda::CUDAGuard guard(model_->device());
    c10::cuda::CUDAStreamGuard sg(engine_stream());  // ordered with every summary update
    at::Tensor grown = cuda_glue::make_block_summaries(rows, layout_, model_->dtype(), model_->device(),
                                                          sparse_->params.key_codes);
    grown.narrow(0, 0, sm.numel()).copy_(sm);
    sm = grown;
  }

  // Cold blocks gathered a layer ahead (cuda_glue::ColdPrefetch, docs/offload.md "Cold blocks
  // on CUDA"): for dense attention with a mapped L2 pool. Entries per step: as many as two
  // buffers of kPrefetchBytes in all hold, at most the L2 pool's slots; a step with more reads
  // its cold blocks in place, eagerly. K25_COLD_PREFETCH=0 turns it off, =N caps the entries
  // (tests and benches).
  static constexpr int64_t kPrefetchBytes = int64_t{32} << 20;
  int32_t prefetch_capacity() const {
    if (!kv_.is_cuda() || !fused_ || sparse_ || cold_->device == nullptr) return 0;
    const int64_t slice = kv_block_bytes() / layout_.num_layers;
    if (slice % 16 != 0 || cold_->slot_bytes % 16 != 0) return 0;
    int64_t n = std::min<int64_t>(cold_->num_slots, kPrefetchBytes / (2 * slice));
    const char* env = std::getenv("K25_COLD_PREFETCH");
    if (env != nullptr && *env != '\0') n = std::min<int64_t>(n, std::max(0, std::atoi(env)));
    return static_cast<int32_t>(n);
  }
  cuda_glue::ColdPrefetch* cold_prefetch() {
    if (prefetch_) return prefetch_.get();
    const int32_t capacity = prefetch_capacity();
    if (capacity <= 0) return nullptr;
    c10::cuda::CUDAGuard guard(model_->device());
    prefetch_ = std::make_unique<cuda_glue::ColdPrefetch>(kv_block_bytes() / layout_.num_layers, capacity,
                                                          model_->device());
    return prefetch_.get();
  }

  int32_t graph_blocks() const {
    return (handle_->max_positions() + layout_.block_size - 1) / layout_.block_size;
  }

  bool graph_eligible(const BatchMeta& meta, const std::vector<LogitsCopy>& copies) const {
    // Cold blocks: the graphs' batches carry the L2 pool (graph_for), when there is one.
    // Cold blocks in L3 are read layer by layer on the host, between the layers' kernels: eager.
    // Gathered cold entries: at most the buffers' capacity (the graphs' layers read them there).
    const int32_t gather = prefetch_capacity();
    return meta.is_decode_only() && copies.empty() && (meta.cold_blocks.empty() || cold_->device != nullptr) &&
           (gather == 0 || static_cast<int64_t>(meta.cold_blocks.size()) <= gather) &&
           meta.cold_layers == nullptr &&
           meta.num_seqs() <= kBuckets[7] &&
           meta.max_blocks_per_seq <= graph_blocks() &&
           static_cast<int32_t>(meta.logits_rows.size()) == meta.num_seqs();
  }

  // The sparse selection's scratch, for num_seqs sequences of max_blocks blocks: grown
  // only before any graph has captured its addresses.
  void ensure_sparse_scratch(int32_t num_seqs, int32_t max_blocks) {
    if (!sparse_ || kv_.is_cpu()) return;
    cuda_glue::SparseScratch& x = sparse_->scratch;
    // With tiers (the L2 pool mapped) the selections count their block reads for the predictor.
    const bool count_reads = cold_->device != nullptr;
    if (x.raw.defined() && x.num_seqs >= num_seqs && x.max_blocks >= max_blocks &&
        x.reads.defined() == count_reads) {
      return;
    }
    if (!graphs_.empty()) fail(ErrorCode::kInternal, "the sparse scratch cannot grow under captured CUDA graphs");
    const ModelConfig& c = model_->config();
    // Rows as wide as any sequence can need (as the graphs' are), so that the width never
    // changes once made: a lane step's per-layer read counts (LlamaModel's staged_need) keep
    // its stride while eager steps of other sequences run between its layers.
    const int32_t width = std::max({max_blocks, x.max_blocks, graph_blocks()});
    x = cuda_glue::make_sparse_scratch(std::max(num_seqs, x.num_seqs), width, c.num_heads, c.num_kv_heads,
                                       model_->device(), count_reads);
  }

  DecodeGraph& graph_for(int32_t bucket) {
    if (graphs_.count(bucket) == 0) ensure_sparse_scratch(std::max(bucket, sparse_bucket_), graph_blocks());
    DecodeGraph& g = graphs_[bucket];
    if (g.graph) return g;
    const at::Device dev = model_->device();
    const int32_t MB = graph_blocks();
    const auto i32 = at::TensorOptions().dtype(at::kInt);
    // The ids each step samples, shared by every bucket: a step's graph reads the previous
    // step's from here (pipelined decode) before its own argmax overwrites them.
    if (!last_ids_.defined()) last_ids_ = at::full({kBuckets[7]}, -1, i32.device(dev));
    // Gathered cold entries: [count, slot...] after the tables.
    cuda_glue::ColdPrefetch* pf = cold_prefetch();
    const int64_t gather_ints = pf ? 1 + pf->capacity() : 0;
    // Selection reuse: the rows' modes last (cuda::SparseSelect::reuse).
    const bool reuse = sparse_ && sparse_->device_memory.counts.defined();
    g.reuse_at = reuse ? bucket * 4 + bucket * MB + gather_ints : -1;
    g.ints = at::empty({bucket * 4 + bucket * MB + gather_ints + (reuse ? bucket : 0)}, i32.device(dev));
    g.slots = at::empty({bucket}, at::TensorOptions().dtype(at::kLong).device(dev));
    g.host_ints = at::empty({g.ints.numel()}, i32.pinned_memory(true));
    g.host_slots = at::empty({bucket}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    g.step.ids = g.ints.narrow(0, 0, bucket);
    g.step.positions = g.ints.narrow(0, bucket, bucket);
    g.step.slots = g.slots;
    g.step.logits_rows = at::arange(bucket, i32.device(dev));
    cuda_glue::DeviceBatch& b = g.step.batch;
    b.query_start = at::arange(bucket + 1, i32.device(dev));
    b.context_lens = g.ints.narrow(0, 2 * bucket, bucket);
    g.prev_rows = g.ints.narrow(0, 3 * bucket, bucket);
    b.block_tables = g.ints.narrow(0, 4 * bucket, bucket * MB).view({bucket, MB});
    b.max_blocks = MB;
    b.num_seqs = bucket;
    if (reuse) b.reuse = g.ints.narrow(0, g.reuse_at, bucket);
    // The tiers (and so the L2 pool) exist before warm_up captures: replays then read cold
    // blocks as eager steps do (replay_graph stages their slot ids).
    if (cold_->device != nullptr) b.cold = {cold_->device, cold_->slot_bytes, cold_->num_slots};
    if (pf) {
      g.step.prefetch = pf;
      g.step.cold_slots = g.ints.narrow(0, bucket * 4 + bucket * MB, gather_ints);
      g.step.cold_l2 = b.cold;
      g.host_ints.data_ptr<int32_t>()[bucket * 4 + bucket * MB] = 0;  // no entries while warming up and capturing
    }
    const ModelConfig& c = model_->config();
    // Enough key ranges per (sequence, KV head) to fill one wave of the decode kernel.
    b.decode_splits = cuda_glue::decode_splits_for(model_->dtype(), c.head_dim, c.num_heads / c.num_kv_heads, bucket,
                                                   c.num_kv_heads);
    // K25_MIN_SPLIT_KEYS (a bench switch, read at capture): keys per derived split.
    if (const char* mk = std::getenv("K25_MIN_SPLIT_KEYS")) b.min_split_keys = std::max(16, std::atoi(mk));
    b.decode_tail = cuda_glue::decode_tail_for(model_->dtype(), c.head_dim, c.num_heads / c.num_kv_heads, bucket,
                                               c.num_kv_heads, b.decode_splits);
    if (b.decode_splits > 1) {
      b.partials = cuda_glue::derived_partials(bucket, c.num_kv_heads, b.decode_splits, b.decode_tail,
                                               c.num_heads / c.num_kv_heads, c.head_dim, dev);
      // Zero at rest: the decode kernel's merging CTAs set them back, so replays need no memset.
      b.split_counters = cuda_glue::derived_split_counters(bucket, c.num_kv_heads, dev);
    }
    // Padding everywhere: run twice eagerly (lazy initialisation of cuBLAS and kernels),
    // then capture.
    stage_padding(g, bucket, 0);
    upload(g);
    BatchMeta none;
    g.argmax = last_ids_.narrow(0, 0, bucket);
    auto body = [&] {
      cuda_glue::take_previous_ids(g.step.ids, g.prev_rows, last_ids_, model_->config().vocab_size);
      g.logits = model_->forward(none, kv_, layout_, true, &g.step, sparse_.get());
      cuda_glue::argmax_rows_into(g.logits, g.argmax);
    };
    // The warm-up runs write last_ids_: keep the ids a step in flight left there for the
    // next step (a new bucket can be captured between two pipelined steps).
    const at::Tensor saved = last_ids_.clone();
    for (int i = 0; i < 2; ++i) body();
    g.graph = std::make_unique<at::cuda::CUDAGraph>();
    g.graph->capture_begin();
    body();
    g.graph->capture_end();
    last_ids_.copy_(saved);
    return g;
  }

  // Rows [from, bucket) become padding: token 0 at position 0 in the scratch block.
  void stage_padding(DecodeGraph& g, int32_t bucket, int32_t from) {
    const int32_t MB = graph_blocks();
    int32_t* h = g.host_ints.data_ptr<int32_t>();
    int64_t* hs = g.host_slots.data_ptr<int64_t>();
    const int32_t scratch = num_blocks_;
    for (int32_t r = from; r < bucket; ++r) {
      h[r] = 0;
      h[bucket + r] = 0;
      h[2 * bucket + r] = 1;
      h[3 * bucket + r] = -1;
      std::fill(h + 4 * bucket + r * MB, h + 4 * bucket + (r + 1) * MB, scratch);
      hs[r] = static_cast<int64_t>(scratch) * layout_.block_size;
      if (g.reuse_at >= 0) h[g.reuse_at + r] = -1;
    }
  }

  void upload(DecodeGraph& g) {
    g.ints.copy_(g.host_ints, /*non_blocking=*/true);
    g.slots.copy_(g.host_slots, /*non_blocking=*/true);
    g.uploaded.record(*stream_);
  }

  // Where a graph step's selection read counts go (copy_reads): pinned, the counts' shape;
  // made before the replay, since nothing after a launch may throw. Graphs do not capture
  // this copy, so that two steps in flight copy to two places (AsyncSlot::reads_host).
  bool reads_buffer(at::Tensor* dst) {
    if (dst == nullptr || !sparse_ || !sparse_->scratch.reads.defined()) return false;
    const at::Tensor& reads = sparse_->scratch.reads;
    if (!dst->defined() || dst->sizes() != reads.sizes()) {
      *dst = at::zeros(reads.sizes(), reads.options().device(at::kCPU).pinned_memory(true));
    }
    return true;
  }
  // The counts of the graph step just replayed, behind it on the stream (a cudaMemcpyAsync).
  void copy_reads(int32_t B, at::Tensor& dst) {
    at::Tensor d = dst.narrow(0, 0, B);
    cuda_glue::copy_to_host_async(sparse_->scratch.reads.narrow(0, 0, B), d);
  }

  // Stages a decode-only step into its bucket's graph inputs and replays the graph (on the
  // current stream, without waiting for it); with tiers and sparsity, the step's read counts
  // follow it to reads_dst.
  DecodeGraph& replay_graph(const BatchMeta& meta, at::Tensor* reads_dst) {
    const int32_t B = meta.num_seqs();
    const int32_t bucket = bucket_for(B);  // graph_eligible: B is at most the largest bucket
    if (*std::max_element(meta.positions.begin(), meta.positions.end()) >= handle_->max_positions()) {
      fail(ErrorCode::kInvalidArgument, "position beyond the RoPE table (max_seq_len)");
    }
    DecodeGraph& g = graph_for(bucket);
    // The previous upload from the staging buffers must be done before they change (an
    // event, not a stream sync: a pipelined step is staged while the previous one runs).
    g.uploaded.synchronize();
    const int32_t MB = graph_blocks();
    int32_t* h = g.host_ints.data_ptr<int32_t>();
    int64_t* hs = g.host_slots.data_ptr<int64_t>();
    const bool prev = !meta.prev_rows.empty();
    std::vector<int32_t> cold_tables;
    const int32_t* tables = meta.block_tables.data();
    int32_t* gathered = g.step.prefetch ? h + 4 * bucket + bucket * MB : nullptr;  // [count, slot...]
    if (gathered) gathered[0] = 0;
    if (!meta.cold_blocks.empty() && gathered) {
      // The tables keep entry ids; the entries' slots go to the graph's gathers.
      const int64_t n = static_cast<int64_t>(meta.cold_blocks.size());
      if (n > g.step.prefetch->capacity()) fail(ErrorCode::kInternal, "more cold entries than the graphs gather");
      cold_entry_slots(meta, *cold_, gathered);
      cold_gathered_ += n;
    } else if (!meta.cold_blocks.empty()) {
      cold_tables = cold_slot_tables(meta, cold_.get());
      tables = cold_tables.data();
    }
    for (int32_t r = 0; r < B; ++r) {
      h[r] = meta.token_ids[r];
      h[bucket + r] = meta.positions[r];
      h[2 * bucket + r] = meta.context_lens[r];
      h[3 * bucket + r] = prev ? meta.prev_rows[r] : -1;
      int32_t* row = h + 4 * bucket + r * MB;
      const int32_t* src = tables + static_cast<int64_t>(r) * meta.max_blocks_per_seq;
      std::copy(src, src + meta.max_blocks_per_seq, row);
      std::fill(row + meta.max_blocks_per_seq, row + MB, num_blocks_);  // never read
      hs[r] = meta.slot_mapping[r];
    }
    if (g.reuse_at >= 0) {
      std::vector<int32_t> modes;
      reuse_modes(meta, &modes);
      std::copy(modes.begin(), modes.end(), h + g.reuse_at);
    }
    stage_padding(g, bucket, B);
    const bool reads = reads_buffer(reads_dst);
    upload(g);
    g.graph->replay();
    if (reads) copy_reads(B, *reads_dst);
    return g;
  }

  void execute_graph(const BatchMeta& meta, const std::vector<SampleRequest>& samples,
                     std::vector<SampleResult>* results) {
    DecodeGraph& g = replay_graph(meta, sparse_ ? &sparse_->scratch.host_reads : nullptr);
    results->clear();
    results->resize(samples.size());
    bool all_greedy = true;
    for (const SampleRequest& s : samples) all_greedy = all_greedy && plain_greedy(s);
    if (all_greedy) {
      at::Tensor ids = g.argmax.cpu();
      const int32_t* id = ids.data_ptr<int32_t>();
      for (size_t i = 0; i < samples.size(); ++i) set_greedy((*results)[i], id[samples[i].logits_row]);
      return;
    }
    sample_on_device(g.logits, samples, results);
  }

  // Samples every request on the device: the host sampler's rules (cuda/sample.cu); the
  // host builds each row's penalty list (distinct tokens with their output counts).
  void sample_on_device(at::Tensor& logits, const std::vector<SampleRequest>& samples,
                        std::vector<SampleResult>* results) {
    to_results(cuda_glue::sample(logits, sample_specs(samples)), results);
  }

  std::vector<cuda_glue::SampleSpec> sample_specs(const std::vector<SampleRequest>& samples) {
    std::vector<cuda_glue::SampleSpec> specs(samples.size());
    for (size_t i = 0; i < samples.size(); ++i) {
      const SampleInput& in = samples[i].input;
      cuda_glue::SampleSpec& sp = specs[i];
      sp.params = in.params;
      sp.logits_row = samples[i].logits_row;
      sp.seed = in.seed;
      sp.counter = static_cast<uint64_t>(in.tokens->size() - in.num_prompt_tokens);
      sp.banned = in.banned;
      cuda_glue::add_penalties(sp, *in.tokens, in.num_prompt_tokens, counts_);
    }
    return specs;
  }

  static void to_results(const std::vector<cuda_glue::SampleOutput>& outs, std::vector<SampleResult>* results) {
    results->clear();
    results->resize(outs.size());
    for (size_t i = 0; i < outs.size(); ++i) {
      SampleResult& r = (*results)[i];
      if (outs[i].error) {
        r.error = "sampler: no finite logit";
        continue;
      }
      r.token = outs[i].token;
      r.logprob = outs[i].logprob;
      for (const auto& [id, lp] : outs[i].top) r.top.push_back({id, lp});
    }
  }

  bool use_graphs_ = false;
  int32_t sparse_bucket_ = kBuckets[7];  // the largest bucket warm_up captures
  std::map<int32_t, DecodeGraph> graphs_;
  at::Tensor last_ids_;  // int32 [max bucket] on the device: the latest graph step's argmax
  AsyncSlot slots_[2];
  int next_slot_ = 0;
  std::deque<int> pending_;  // launched, not yet collected steps (slot indices, oldest first)
#endif

  std::shared_ptr<ModelHandle> handle_;
  const LlamaModel* model_;
  // Where cold blocks lie for the CUDA kernels: the L2 pool's allocation (configure_tiers).
  std::shared_ptr<ColdRegion> cold_ = std::make_shared<ColdRegion>();
  // Staging for steps with cold blocks in L3 (cold_stage): two pinned, mapped buffers.
  uint8_t* stage_host_[2] = {nullptr, nullptr};
  const void* stage_dev_[2] = {nullptr, nullptr};
  int64_t stage_bytes_ = 0;
  void release_stage() {
#ifdef K25_WITH_CUDA
    HostAllocator pinned = cuda_glue::pinned_allocator();
    for (int i = 0; i < 2; ++i) {
      if (stage_host_[i]) pinned.release(stage_host_[i], static_cast<size_t>(stage_bytes_));
      stage_host_[i] = nullptr;
      stage_dev_[i] = nullptr;
    }
#endif
    stage_bytes_ = 0;
  }
  bool fused_;
  int32_t num_blocks_ = 0;
  KVLayout layout_;
  at::Tensor kv_;
  Sampler sampler_;
  std::vector<int32_t> counts_;  // scratch of sample_on_device, all zero between calls
  std::unique_ptr<SparseStep> sparse_;   // dynamic sparsity, when on
#ifdef K25_WITH_CUDA
  std::unique_ptr<ReuseSlots> reuse_slots_;  // selection reuse on CUDA (warm_up), when on
  // The rows' cuda::SparseSelect::reuse modes for a step of `meta` (ReuseSlots::modes).
  void reuse_modes(const BatchMeta& meta, std::vector<int32_t>* out) {
    reuse_slots_->modes(cpu_attention_batch(meta), meta.named_ids(), sparse_->params, layout_.block_size, out);
  }
#endif
  bool selective_cold_ = false;         // K25_L3_SELECTIVE, the selection's rule (cold_read_plan)
  at::Tensor summaries_;                 // its key summaries (see ops/block_sparsity.h)
  std::vector<LayerSparsityStats> stats_;
  std::unique_ptr<ThreadPool> pool_;
  bool tiers_ = false;                              // configure_tiers ran (a device pool with tiers)
  bool emulate_async_ = false;                      // K25_ASYNC_SCHEDULING=1 without graphs
  std::deque<std::vector<SampleResult>> emulated_;  // their results, oldest first
  std::vector<int32_t> emulated_ids_;               // the last one's ids by logits row
  std::deque<std::shared_ptr<BlockReads>> emulated_reads_;  // their block reads (null: none)
  std::shared_ptr<BlockReads> collected_reads_;   // the last collected step's (collected_block_reads)
#ifdef K25_WITH_CUDA
  std::unique_ptr<c10::cuda::CUDAStream> stream_;
  // Cold blocks gathered a layer ahead (cold_prefetch()); made at the first graph capture or
  // step with cold blocks (a graph captured before it reads cold blocks in place).
  std::unique_ptr<cuda_glue::ColdPrefetch> prefetch_;
#endif
  std::atomic<int64_t> cold_gathered_{0};  // cold entries gathered a layer ahead, summed over steps
};

}  // namespace

std::unique_ptr<ModelExecutor> make_executor(std::shared_ptr<ModelHandle> model, int32_t block_size,
                                             int32_t num_blocks, bool fused, int32_t num_threads,
                                             const SparsityParams* sparsity, const std::string& kv_dtype) {
  if (num_blocks <= 0) fail(ErrorCode::kInvalidArgument, "the KV pool needs at least one block");
  const std::string kv = resolve_kv_dtype(model->spec().dtype, model->spec().device, kv_dtype);
  return std::make_unique<TorchExecutor>(std::move(model), block_size, num_blocks, fused, num_threads, sparsity, kv);
}

std::string resolve_kv_dtype(const std::string& model_dtype, const std::string& device, const std::string& kv_dtype) {
  if (kv_dtype.empty() || kv_dtype == "auto" || kv_dtype == model_dtype) return model_dtype;
  if (kv_dtype == "bfloat16" && model_dtype == "float32" && device.rfind("cpu", 0) == 0) return kv_dtype;
  fail(ErrorCode::kUnsupported, "kv_cache_dtype='" + kv_dtype + "' is not implemented for " + model_dtype +
                                    " compute on " + device + ": KV is kept in the compute dtype, or in bfloat16 "
                                    "with float32 compute on the CPU");
}

}  // namespace k25
