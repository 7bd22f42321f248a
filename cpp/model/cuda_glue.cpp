#include "model/cuda_glue.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "k25/status.h"
#include "k25_cuda.h"

namespace k25::cuda_glue {

namespace {

static_assert(sizeof(AttnWorkItem) == sizeof(cuda::AttnWork), "plan and kernel disagree on AttnWork");

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail(ErrorCode::kInternal, std::string("CUDA kernel ") + what + ": " + cudaGetErrorString(e));
}

cuda::DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::DType::kF32;
    case at::kHalf: return cuda::DType::kF16;
    case at::kBFloat16: return cuda::DType::kBF16;
    default: fail(ErrorCode::kUnsupported, std::string("CUDA kernels take float32, float16 or bfloat16, not ") +
                                              std::string(c10::toString(t)));
  }
}

cuda::DType dtype_of(const at::Tensor& t) { return dtype_of(t.scalar_type()); }

void need(bool ok, const char* what) {
  if (!ok) fail(ErrorCode::kInvalidArgument, std::string("CUDA op: ") + what);
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

cuda::KVCache cache_of(const at::Tensor& kv, const KVLayout& L) {
  need(kv.is_cuda() && kv.is_contiguous(), "the KV pool must be a contiguous CUDA tensor");
  need(!L.k_transposed, "the CUDA KV layout keeps K as [block_size][head_dim]");
  cuda::KVCache c;
  c.data = kv.data_ptr();
  c.num_layers = L.num_layers;
  c.num_kv_heads = L.num_kv_heads;
  c.head_dim = L.head_dim;
  c.block_size = L.block_size;
  return c;
}

}  // namespace

bool available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

HostAllocator pinned_allocator() {
  HostAllocator a;
  a.allocate = [](size_t bytes) -> void* {
    void* p = nullptr;
    // Portable: any device's copies may use it. cudaHostAlloc memory is page-aligned, so
    // slots stay O_DIRECT buffers for L3.
    // Mapped: the attention kernels read cold blocks in place (device_address).
    if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return p;
  };
  a.release = [](void* p, size_t) { (void)cudaFreeHost(p); };
  a.kind = "pinned";
  return a;
}

bool cold_rows_fit(int64_t num_slots, int64_t slot_bytes, int64_t row_bytes) {
  return row_bytes > 0 && slot_bytes % row_bytes == 0 && num_slots * (slot_bytes / row_bytes) < (int64_t{1} << 31);
}

const void* device_address(const void* pinned) {
  void* d = nullptr;
  if (cudaHostGetDevicePointer(&d, const_cast<void*>(pinned), 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return d;
}

namespace {

class CudaBlockCopier : public BlockCopier {
 public:
  CudaBlockCopier(void* base, int64_t block_bytes, int32_t num_blocks, int device, TaskRunner* completions,
                  cudaStream_t compute)
      : base_(static_cast<uint8_t*>(base)), block_bytes_(block_bytes), num_blocks_(num_blocks), device_(device),
        completions_(completions), compute_(compute) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    if (cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&queued_, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      if (queued_ != nullptr) (void)cudaEventDestroy(queued_);
      if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
      fail(ErrorCode::kResourceExhausted, "cannot create the KV tiers' CUDA copy stream");
    }
  }
  ~CudaBlockCopier() override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
    (void)cudaEventDestroy(queued_);
    (void)cudaEventDestroy(copied_);
  }
  int64_t block_bytes() const override { return block_bytes_; }
  int32_t num_blocks() const override { return num_blocks_; }
  void copy_out(int32_t block, void* dst, Done done) override {
    copy(dst, base_ + static_cast<int64_t>(block) * block_bytes_, cudaMemcpyDeviceToHost, std::move(done));
  }
  void copy_in(const void* src, int32_t block, Done done) override {
    copy(base_ + static_cast<int64_t>(block) * block_bytes_, src, cudaMemcpyHostToDevice, std::move(done));
  }
  // A batch (a step's swap-outs, say: hundreds of blocks) waits for the compute stream once
  // and lands through one host callback instead of one per block.
  void begin_batch() override {
    if (batch_) fail(ErrorCode::kInternal, "tier copy batches do not nest");
    batch_ = std::make_unique<Batch>();
    batch_->runner = completions_;
    batch_owner_.store(std::this_thread::get_id());
  }
  void end_batch() override {
    batch_owner_.store(std::thread::id());
    std::unique_ptr<Batch> b = std::move(batch_);
    if (!b || b->dones.empty()) return;
    // No device guard: the stream names its device, and nothing here may throw once the
    // batch's copies are queued (a lost callback would leave its waiters waiting).
    Batch* x = b.release();
    if (cudaLaunchHostFunc(stream_, &CudaBlockCopier::batch_landed, x) != cudaSuccess) {
      (void)cudaGetLastError();
      // The copies are queued but nothing will say when they land: wait for them here.
      const bool ok = cudaStreamSynchronize(stream_) == cudaSuccess;
      (void)cudaGetLastError();
      finish(x, ok);
    }
  }
  bool order_compute_after_copies() override {
    if (cudaEventRecord(copied_, stream_) == cudaSuccess && cudaStreamWaitEvent(compute_, copied_, 0) == cudaSuccess) {
      return true;
    }
    (void)cudaGetLastError();
    return false;
  }

 private:
  struct Pending {
    Done done;
    TaskRunner* runner;
  };
  struct Batch {
    std::vector<Done> dones;
    TaskRunner* runner = nullptr;
    bool ordered = false;  // the copy stream waits for the compute stream's queued work
  };
  static void CUDART_CB landed(void* p) {
    auto* x = static_cast<Pending*>(p);
    x->runner->post([x] {
      x->done(true);
      delete x;
    });
  }
  static void CUDART_CB batch_landed(void* p) { finish(static_cast<Batch*>(p), true); }
  static void finish(Batch* x, bool ok) {
    x->runner->post([x, ok] {
      for (Done& d : x->dones) d(ok);
      delete x;
    });
  }
  // Behind everything the compute stream has queued so far: the engine does not wait for a
  // step that samples nothing (a prompt chunk before the last), so a copy out could read a
  // block a kernel in flight still writes, and a copy in overwrite one it still reads. (One
  // event for all copies: a wait takes the event as recorded at the call, and a record by
  // another thread in between only orders a copy later.)
  bool order_after_compute() {
    return cudaEventRecord(queued_, compute_) == cudaSuccess && cudaStreamWaitEvent(stream_, queued_, 0) == cudaSuccess;
  }
  void copy(void* dst, const void* src, cudaMemcpyKind kind, Done done) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    if (batch_owner_.load() == std::this_thread::get_id() && batch_) {
      Batch& b = *batch_;
      const bool ordered = b.ordered || order_after_compute();
      if (ordered && cudaMemcpyAsync(dst, src, static_cast<size_t>(block_bytes_), kind, stream_) == cudaSuccess) {
        b.ordered = true;
        b.dones.push_back(std::move(done));
        return;
      }
      (void)cudaGetLastError();
      completions_->post([done = std::move(done)] { done(false); });
      return;
    }
    auto* x = new Pending{std::move(done), completions_};
    if (!order_after_compute() ||
        cudaMemcpyAsync(dst, src, static_cast<size_t>(block_bytes_), kind, stream_) != cudaSuccess ||
        cudaLaunchHostFunc(stream_, &CudaBlockCopier::landed, x) != cudaSuccess) {
      (void)cudaGetLastError();
      completions_->post([x] {
        x->done(false);
        delete x;
      });
    }
  }

  uint8_t* base_;
  int64_t block_bytes_;
  int32_t num_blocks_;
  int device_;
  TaskRunner* completions_;
  cudaStream_t compute_;  // the engine's compute stream (the executor's)
  cudaStream_t stream_ = nullptr;
  cudaEvent_t queued_ = nullptr;
  cudaEvent_t copied_ = nullptr;  // order_compute_after_copies (the engine thread's only)
  // The open batch (begin_batch), only ever touched by its owner thread; other threads read
  // the owner to see that their copies are not in it.
  std::atomic<std::thread::id> batch_owner_{};
  std::unique_ptr<Batch> batch_;
};

}  // namespace

std::unique_ptr<BlockCopier> make_cuda_block_copier(void* base, int64_t block_bytes, int32_t num_blocks, int device,
                                                    TaskRunner* completions, cudaStream_t compute) {
  return std::make_unique<CudaBlockCopier>(base, block_bytes, num_blocks, device, completions, compute);
}

void device_memory(int device, int64_t* free_bytes, int64_t* total_bytes) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  size_t f = 0, t = 0;
  if (cudaMemGetInfo(&f, &t) != cudaSuccess) fail(ErrorCode::kInternal, "cudaMemGetInfo failed");
  *free_bytes = static_cast<int64_t>(f);
  *total_bytes = static_cast<int64_t>(t);
}

DeviceBatch make_batch(const at::Tensor& query_start, const at::Tensor& context_lens, const at::Tensor& block_tables,
                       const AttentionPlan& plan, int32_t group, int32_t head_dim, const at::Device& device) {
  DeviceBatch b;
  b.query_start = query_start;
  b.context_lens = context_lens;
  b.block_tables = block_tables;
  b.max_blocks = static_cast<int32_t>(block_tables.size(1));
  b.num_work = static_cast<int32_t>(plan.work.size());
  b.num_merges = static_cast<int32_t>(plan.merges.size() / 4);
  b.num_decode_work = plan.num_decode;
  auto i32 = at::TensorOptions().dtype(at::kInt);
  if (b.num_merges == 0) {
    b.work = at::from_blob(const_cast<AttnWorkItem*>(plan.work.data()), {b.num_work, 8}, i32)
                 .to(device, /*non_blocking=*/false, /*copy=*/true);
    return b;
  }
  // Which merges the decode kernel does itself: all of whose pieces it runs (the planner
  // splits single-token items only, and puts them first: all of a batch's merges or none).
  const int32_t M = b.num_merges;
  const bool decode_kernel = group <= cuda::kDecodeMaxGroup;
  std::vector<int32_t> pieces(M, 0), in_decode(M, 0);
  for (int32_t i = 0; i < b.num_work; ++i) {
    const AttnWorkItem& w = plan.work[i];
    if (w.partial < 0 || w.merge < 0 || w.merge >= M) continue;
    ++pieces[w.merge];
    if (decode_kernel && i < plan.num_decode) ++in_decode[w.merge];
  }
  std::vector<int32_t> order, renumber(M, -1);  // new position of each merge; -1: merge_kernel's
  for (int32_t m = 0; m < M; ++m) {
    const int32_t count = plan.merges[4 * m + 3];
    if (in_decode[m] == count && pieces[m] == count && count <= cuda::kMaxFusedSplits) {
      renumber[m] = static_cast<int32_t>(order.size());
      order.push_back(m);
    }
  }
  b.num_decode_merges = static_cast<int32_t>(order.size());
  for (int32_t m = 0; m < M; ++m) {
    if (renumber[m] < 0) order.push_back(m);
  }
  std::vector<int32_t> merges(4 * static_cast<size_t>(M));
  for (int32_t j = 0; j < M; ++j) std::copy_n(plan.merges.begin() + 4 * order[j], 4, merges.begin() + 4 * j);
  std::vector<AttnWorkItem> work(plan.work);
  for (AttnWorkItem& w : work) w.merge = w.partial >= 0 && w.merge >= 0 && w.merge < M ? renumber[w.merge] : -1;
  b.work = at::from_blob(work.data(), {b.num_work, 8}, i32).to(device, /*non_blocking=*/false, /*copy=*/true);
  b.merges = at::from_blob(merges.data(), {M, 4}, i32).to(device, false, true);
  b.partials = at::empty({static_cast<int64_t>(plan.num_partials) * group * partial_row_floats(head_dim)},
                         at::TensorOptions().dtype(at::kFloat).device(device));
  if (b.num_decode_merges > 0) b.split_counters = at::zeros({b.num_decode_merges}, i32.device(device));
  return b;
}

at::Tensor derived_split_counters(int32_t num_seqs, int32_t num_kv_heads, const at::Device& device) {
  return at::zeros({static_cast<int64_t>(num_seqs) * num_kv_heads},
                   at::TensorOptions().dtype(at::kInt).device(device));
}

at::Tensor derived_partials(int32_t num_seqs, int32_t num_kv_heads, int32_t splits, int32_t tail, int32_t group,
                            int32_t head_dim, const at::Device& device) {
  return at::empty({static_cast<int64_t>(num_seqs) * num_kv_heads * (splits + tail) * group *
                    partial_row_floats(head_dim)},
                   at::TensorOptions().dtype(at::kFloat).device(device));
}

void rms_norm(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  need(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous() && w.is_contiguous(), "rms_norm layouts");
  cuda::rms_norm(dtype_of(x), x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0), x.size(0),
                 static_cast<int32_t>(x.size(1)), static_cast<float>(eps), stream());
  check_launch("rms_norm");
}

void add_rms_norm(at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, at::Tensor& out, double eps) {
  need(h.is_contiguous() && delta.is_contiguous() && out.is_contiguous() && h.sizes().equals(delta.sizes()),
       "add_rms_norm layouts");
  cuda::add_rms_norm(dtype_of(h), h.data_ptr(), delta.data_ptr(), w.data_ptr(), out.data_ptr(), h.size(0),
                     static_cast<int32_t>(h.size(1)), static_cast<float>(eps), stream());
  check_launch("add_rms_norm");
}

bool gemv_supported(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const char* env = std::getenv("K25_GEMV");
  if (env && std::string(env) == "0") return false;
  const at::ScalarType t = x.scalar_type();
  if ((t != at::kBFloat16 && t != at::kHalf) || w.scalar_type() != t || (b.defined() && b.scalar_type() != t)) {
    return false;
  }
  if (x.dim() != 2 || w.dim() != 2 || x.size(0) < 1 || x.size(0) > cuda::kGemvMaxRows || x.size(1) != w.size(1)) {
    return false;
  }
  auto aligned = [](const at::Tensor& a) { return reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0; };
  const int64_t K = x.size(1);
  return K % 8 == 0 && x.stride(1) == 1 && x.stride(0) % 8 == 0 && w.is_contiguous() && aligned(x) && aligned(w) &&
         (!b.defined() || (b.dim() == 1 && b.size(0) == w.size(0) && b.is_contiguous())) &&
         w.size(0) <= std::numeric_limits<int32_t>::max() && K <= std::numeric_limits<int32_t>::max();
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  need(x.is_cuda() && w.device() == x.device(), "gemv: tensors on one CUDA device");
  need(gemv_supported(x, w, b), "gemv: bf16/fp16, one row, K % 8 == 0, aligned contiguous rows");
  const int64_t N = w.size(0);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  cuda::gemv(dtype_of(x), x.data_ptr(), x.stride(0), w.data_ptr(), b.defined() ? b.data_ptr() : nullptr,
             y.data_ptr(), N, static_cast<int32_t>(x.size(0)), static_cast<int32_t>(N),
             static_cast<int32_t>(x.size(1)), stream());
  check_launch("gemv");
  return y;
}

void silu_mul(const at::Tensor& gu, at::Tensor& out) {
  need(gu.is_contiguous() && out.is_contiguous(), "silu_mul layouts");
  cuda::silu_mul(dtype_of(gu), gu.data_ptr(), out.data_ptr(), gu.size(0), static_cast<int32_t>(gu.size(1) / 2),
                 stream());
  check_launch("silu_mul");
}

void rope_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& slots, int32_t num_heads,
                   const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv, const KVLayout& layout,
                   int32_t layer) {
  need(qkv.stride(1) == 1 && positions.scalar_type() == at::kInt && slots.scalar_type() == at::kLong,
       "rope_write_kv inputs");
  need(kv.scalar_type() == qkv.scalar_type(), "KV pool and activations must share a dtype");
  cuda::rope_write_kv(dtype_of(qkv), qkv.data_ptr(), qkv.stride(0), positions.data_ptr<int32_t>(),
                      slots.data_ptr<int64_t>(), qkv.size(0), num_heads, cos.data_ptr<float>(), sin.data_ptr<float>(),
                      cache_of(kv, layout), layer, stream());
  check_launch("rope_write_kv");
}

void rope_inplace(at::Tensor& qkv, const at::Tensor& positions, int32_t num_heads, int32_t num_kv_heads,
                  const at::Tensor& cos, const at::Tensor& sin) {
  need(qkv.stride(1) == 1 && positions.scalar_type() == at::kInt, "rope_inplace inputs");
  const int32_t head_dim = static_cast<int32_t>(cos.size(1) * 2);
  cuda::rope_inplace(dtype_of(qkv), qkv.data_ptr(), qkv.stride(0), positions.data_ptr<int32_t>(), qkv.size(0),
                     num_heads, num_kv_heads, head_dim, cos.data_ptr<float>(), sin.data_ptr<float>(), stream());
  check_launch("rope_inplace");
}

void write_kv(const at::Tensor& qkv, const at::Tensor& slots, int32_t num_heads, at::Tensor& kv,
              const KVLayout& layout, int32_t layer) {
  need(qkv.stride(1) == 1 && slots.scalar_type() == at::kLong, "write_kv inputs");
  need(kv.scalar_type() == qkv.scalar_type(), "KV pool and activations must share a dtype");
  cuda::write_kv(dtype_of(qkv), qkv.data_ptr(), qkv.stride(0), slots.data_ptr<int64_t>(), qkv.size(0), num_heads,
                 cache_of(kv, layout), layer, stream());
  check_launch("write_kv");
}

void paged_attention(const at::Tensor& qkv, at::Tensor& out, const at::Tensor& kv, const KVLayout& layout,
                     int32_t layer, const DeviceBatch& b, int32_t num_heads, double scale, int32_t window) {
  need(layout.head_dim == 64 || layout.head_dim == 128, "CUDA attention supports head_dim 64 and 128");
  need(qkv.stride(1) == 1 && out.is_contiguous(), "attention layouts");
  need(kv.scalar_type() == qkv.scalar_type() && out.scalar_type() == qkv.scalar_type(), "attention dtypes");
  cuda::AttnBatch ab;
  ab.query_start = b.query_start.data_ptr<int32_t>();
  ab.context_lens = b.context_lens.data_ptr<int32_t>();
  ab.block_tables = b.block_tables.data_ptr<int32_t>();
  ab.max_blocks = b.max_blocks;
  ab.work = b.work.defined() ? reinterpret_cast<const cuda::AttnWork*>(b.work.data_ptr<int32_t>()) : nullptr;
  ab.num_work = b.num_work;
  ab.partials = b.partials.defined() ? b.partials.data_ptr<float>() : nullptr;
  ab.merge = b.merges.defined() ? b.merges.data_ptr<int32_t>() : nullptr;
  ab.num_merges = b.num_merges;
  ab.num_decode_work = b.num_decode_work;
  ab.decode_splits = b.decode_splits;
  ab.decode_tail = b.decode_tail;  // the kernels read it through AttnBatch::tail_items()
  ab.num_seqs = b.num_seqs;
  ab.min_split_keys = b.min_split_keys;
  if (b.split_counters.defined()) {
    const int64_t need_counters =
        b.decode_splits > 0 ? static_cast<int64_t>(b.num_seqs) * layout.num_kv_heads : b.num_decode_merges;
    need(b.split_counters.scalar_type() == at::kInt && b.split_counters.numel() >= need_counters,
         "split counters: int32, one per merge done in the decode kernel");
    ab.split_counters = b.split_counters.data_ptr<int32_t>();
    ab.num_decode_merges = b.num_decode_merges;
  }
  if (b.head_tables.defined()) {
    need(b.head_tables.scalar_type() == at::kInt &&
             b.head_tables.numel() >= b.context_lens.numel() * layout.num_kv_heads * b.max_blocks,
         "head tables: int32 [sequences, kv heads, max_blocks]");
    ab.head_tables = b.head_tables.data_ptr<int32_t>();
  }
  cuda::KVCache cache = cache_of(kv, layout);
  // Key rows are 31-bit indices in some kernels (kColdRow marks the L2 pool's): both pools
  // must have fewer than 2^31 rows of head_dim elements.
  const int64_t row_bytes = static_cast<int64_t>(layout.head_dim) * kv.element_size();
  need(kv.numel() / layout.head_dim < (int64_t{1} << 31), "the KV pool has 2^31 rows or more");
  if (b.cold.data != nullptr) {
    need(cold_rows_fit(b.cold.num_slots, b.cold.slot_bytes, row_bytes), "the L2 pool's slots for cold blocks");
    cache.cold_data = b.cold.data;
    cache.cold_block_elems = b.cold.slot_bytes / kv.element_size();
  }
  cuda::paged_attention(dtype_of(qkv), qkv.data_ptr(), qkv.stride(0), out.data_ptr(), cache, layer, ab, num_heads,
                        static_cast<float>(scale), window, stream());
  check_launch("paged_attention");
}

namespace {
// Key-code tiles of a summary row (0 without key codes), rejecting key codes for float32 KV.
int32_t code_tiles_of(const KVLayout& layout, at::ScalarType kv_dtype, bool key_codes) {
  if (!key_codes) return 0;
  if (kv_dtype == at::kFloat) {
    fail(ErrorCode::kUnsupported, "the key-code estimate on CUDA needs 16-bit KV (dtype bfloat16 or float16); "
                                  "float32 KV ranks by the Quest bound");
  }
  return cuda::key_code_tiles(layout.block_size);
}
}  // namespace

int64_t block_summary_bytes(const KVLayout& layout, at::ScalarType kv_dtype, bool key_codes) {
  return static_cast<int64_t>(layout.num_layers) * layout.num_kv_heads *
         cuda::summary_row_bytes(dtype_of(kv_dtype), layout.head_dim, code_tiles_of(layout, kv_dtype, key_codes));
}

at::Tensor make_block_summaries(int64_t num_blocks, const KVLayout& layout, at::ScalarType kv_dtype,
                                const at::Device& device, bool key_codes) {
  const int64_t n = num_blocks * block_summary_bytes(layout, kv_dtype, key_codes);
  return at::zeros({n}, at::TensorOptions().dtype(at::kByte).device(device));
}

void update_block_summaries(const at::Tensor& kv, const KVLayout& layout, int32_t layer, at::Tensor& summaries,
                            const DeviceBatch& b, bool key_codes) {
  need(summaries.scalar_type() == at::kByte && summaries.is_cuda() && summaries.is_contiguous() &&
           summaries.numel() % block_summary_bytes(layout, kv.scalar_type(), key_codes) == 0,
       "block summaries: a contiguous CUDA byte tensor of make_block_summaries' rows");
  need(!key_codes || layout.head_dim == 64 || layout.head_dim == 128, "key codes on CUDA support head_dim 64 and 128");
  cuda::update_block_summaries(dtype_of(kv), cache_of(kv, layout), layer, summaries.data_ptr(),
                               b.query_start.data_ptr<int32_t>(), b.context_lens.data_ptr<int32_t>(),
                               b.block_tables.data_ptr<int32_t>(), b.max_blocks,
                               static_cast<int32_t>(b.context_lens.numel()),
                               code_tiles_of(layout, kv.scalar_type(), key_codes), stream());
  check_launch("update_block_summaries");
}

namespace {

// Byte offsets of the zero-at-rest parts of SparseScratch::zeroed (8-byte aligned).
struct ZeroedParts {
  int64_t maxima, mass_hist, est_hist, score_hist, head_mass, head_mlogm, bytes;
  ZeroedParts(int64_t S, int64_t Hq, int64_t Hkv) {
    // Every part 16-byte aligned (not 8): the count kernel loads histograms 16 bytes at a time (with
    // 8-byte alignment, an odd S * Hq, e.g. one sequence of the default model's 9 heads in an
    // eager step's scratch, misaligned them).
    auto up16 = [](int64_t x) { return (x + 15) / 16 * 16; };
    const int64_t bins = cuda::kSparsityBins;
    maxima = 0;
    mass_hist = up16(maxima + S * Hq * 2 * 4);
    est_hist = up16(mass_hist + S * Hkv * bins * 8);
    score_hist = up16(est_hist + S * Hkv * bins * 4);
    head_mass = up16(score_hist + S * Hkv * bins * 4);
    head_mlogm = up16(head_mass + S * Hkv * 2 * 8);
    bytes = head_mlogm + S * Hkv * 8;
  }
};

// Element counts of SparseScratch's device tensors (4 bytes each; `zeroed` in 8-byte words).
struct ScratchSizes {
  int64_t raw, score, select, head_tables, context_lens, zeroed_words, reads;
  ScratchSizes(int64_t S, int64_t MB, int64_t Hq, int64_t Hkv, bool count_reads)
      : raw(S * Hq * 2 * MB),
        score(S * Hkv * MB),
        select(S * Hkv * 4),
        head_tables(S * Hkv * MB),
        context_lens(S),
        zeroed_words(ZeroedParts(S, Hq, Hkv).bytes / 8),
        reads(count_reads ? S * MB : 0) {}
  int64_t bytes() const { return 4 * (raw + score + select + head_tables + context_lens + reads) + 8 * zeroed_words; }
};

}  // namespace

int64_t sparse_scratch_bytes(int32_t num_seqs, int32_t max_blocks, int32_t num_heads, int32_t num_kv_heads,
                             bool count_reads) {
  return ScratchSizes(num_seqs, max_blocks, num_heads, num_kv_heads, count_reads).bytes();
}

SparseScratch make_sparse_scratch(int32_t num_seqs, int32_t max_blocks, int32_t num_heads, int32_t num_kv_heads,
                                  const at::Device& device, bool count_reads) {
  const auto i32 = at::TensorOptions().dtype(at::kInt).device(device);
  const int64_t S = num_seqs, MB = max_blocks;
  const ScratchSizes n(S, MB, num_heads, num_kv_heads, count_reads);
  SparseScratch x;
  x.raw = at::empty({n.raw}, i32.dtype(at::kFloat));
  x.score = at::empty({n.score}, i32.dtype(at::kFloat));
  x.select = at::empty({n.select}, i32);
  x.head_tables = at::empty({n.head_tables}, i32).view({S, num_kv_heads, MB});
  x.context_lens = at::empty({n.context_lens}, i32);
  x.zeroed = at::zeros({n.zeroed_words}, i32.dtype(at::kLong));
  if (count_reads) {
    x.reads = at::zeros({n.reads}, i32).view({S, MB});
    x.host_reads = at::zeros(x.reads.sizes(), at::TensorOptions().dtype(at::kInt).pinned_memory(true));  // its mirror
  }
  x.num_seqs = num_seqs;
  x.max_blocks = max_blocks;
  x.num_heads = num_heads;
  x.num_kv_heads = num_kv_heads;
  return x;
}

SparseMemory make_sparse_memory(int32_t slots, const KVLayout& layout, int32_t stride, const at::Device& device) {
  const auto i32 = at::TensorOptions().dtype(at::kInt).device(device);
  SparseMemory m;
  m.positions = at::empty({slots, layout.num_layers, layout.num_kv_heads, stride}, i32);
  m.counts = at::zeros({slots, layout.num_layers}, i32);
  return m;
}

int64_t sparse_memory_bytes(int32_t slots, const KVLayout& layout, int32_t stride) {
  const int64_t per_layer = static_cast<int64_t>(layout.num_kv_heads) * stride + 1;  // positions, count
  return 4 * static_cast<int64_t>(slots) * layout.num_layers * per_layer;
}

DeviceBatch select_blocks(const at::Tensor& qkv, const KVLayout& layout, int32_t layer, const at::Tensor& summaries,
                          int64_t pool_blocks, const DeviceBatch& b, int32_t num_heads, double scale,
                          const SparsityParams& p, SparseScratch& x, at::Tensor& layer_stats,
                          const at::Tensor& cold_summaries, const SparseMemory* memory) {
  const int32_t S = static_cast<int32_t>(b.context_lens.numel());
  need(layout.head_dim == 64 || layout.head_dim == 128, "CUDA block selection supports head_dim 64 and 128");
  need(layout.num_kv_heads <= cuda::kMaxSparseKvHeads && num_heads <= cuda::kMaxSparseHeads,
       "CUDA block selection supports up to 16 KV heads and 128 query heads");
  need(p.score_channels == 0 && !p.compensation,
       "CUDA block selection ranks by the Quest bound or the key codes (score_channels 0, no compensation)");
  need(S <= x.num_seqs && b.max_blocks <= x.max_blocks && num_heads == x.num_heads &&
           layout.num_kv_heads == x.num_kv_heads,
       "sparse scratch smaller than the batch");
  need(summaries.scalar_type() == at::kByte && qkv.stride(1) == 1, "selection inputs");
  const int64_t width = layer_stats.dim() == 2 ? layer_stats.size(1) : 0;
  need(layer_stats.scalar_type() == at::kDouble && layer_stats.is_contiguous() && (width == 4 || width == 5) &&
           layer_stats.size(0) > layer,
       "layer stats: float64 [num_layers, 4 or 5]");
  const ZeroedParts zp(x.num_seqs, x.num_heads, x.num_kv_heads);
  uint8_t* z = static_cast<uint8_t*>(x.zeroed.data_ptr());
  cuda::SparseSelect a;
  a.query_start = b.query_start.data_ptr<int32_t>();
  a.context_lens = b.context_lens.data_ptr<int32_t>();
  a.block_tables = b.block_tables.data_ptr<int32_t>();
  // Rows of the batch's width (the scratch holds at least that many).
  a.max_blocks = b.max_blocks;
  a.num_seqs = S;
  a.num_heads = num_heads;
  a.num_kv_heads = layout.num_kv_heads;
  a.block_size = layout.block_size;
  a.num_layers = layout.num_layers;
  a.layer = layer;
  a.scale = static_cast<float>(scale);
  a.min_context = p.min_context;
  a.sink_blocks = p.sink_blocks;
  a.recent_blocks = p.recent_blocks;
  a.min_ratio = p.min_ratio;
  a.max_ratio = p.max_ratio;
  a.mass_target = p.mass_target;
  a.raw = x.raw.data_ptr<float>();
  a.maxima = reinterpret_cast<uint32_t*>(z + zp.maxima);
  a.score = x.score.data_ptr<float>();
  a.mass_hist = reinterpret_cast<unsigned long long*>(z + zp.mass_hist);
  a.est_hist = reinterpret_cast<int32_t*>(z + zp.est_hist);
  a.score_hist = reinterpret_cast<int32_t*>(z + zp.score_hist);
  a.head_mass = reinterpret_cast<unsigned long long*>(z + zp.head_mass);
  a.head_mlogm = reinterpret_cast<double*>(z + zp.head_mlogm);
  a.select = x.select.data_ptr<int32_t>();
  a.head_tables = x.head_tables.data_ptr<int32_t>();
  a.context_lens_out = x.context_lens.data_ptr<int32_t>();
  a.layer_stats = layer_stats.data_ptr<double>() + width * layer;
  if (width == 5) a.reused_stats = a.layer_stats + 4;
  if (b.reuse.defined()) {
    need(memory != nullptr && memory->positions.dim() == 4 && memory->counts.dim() == 2 &&
             memory->positions.size(1) == layout.num_layers && memory->positions.size(2) == layout.num_kv_heads &&
             memory->positions.size(3) >= b.max_blocks && memory->counts.size(0) == memory->positions.size(0) &&
             memory->counts.size(1) == layout.num_layers && memory->positions.scalar_type() == at::kInt &&
             memory->counts.scalar_type() == at::kInt && memory->positions.is_contiguous() &&
             memory->counts.is_contiguous(),
         "selection reuse needs a SparseMemory as wide as the batch's block tables");
    need(b.reuse.scalar_type() == at::kInt && b.reuse.numel() >= S && b.reuse.is_cuda(),
         "selection reuse: int32 [S] on the device");
    // A kept selection's heads all end at the sequence's last block then (a recent block).
    need(p.recent_blocks >= 1, "selection reuse needs recent_blocks >= 1");
    a.reuse = b.reuse.data_ptr<int32_t>();
    a.kept_positions = memory->positions.data_ptr<int32_t>();
    a.kept_counts = memory->counts.data_ptr<int32_t>();
    a.kept_stride = static_cast<int32_t>(memory->positions.size(3));
  }
  a.code_tiles = code_tiles_of(layout, qkv.scalar_type(), p.key_codes);
  if (x.reads.defined()) {
    a.block_reads = x.reads.data_ptr<int32_t>();
    a.reads_stride = x.max_blocks;
  }
  if (cold_summaries.defined()) {
    need(cold_summaries.is_cuda() && cold_summaries.is_contiguous() &&
             cold_summaries.scalar_type() == at::kByte &&
             cold_summaries.numel() >= b.cold.num_slots * block_summary_bytes(layout, qkv.scalar_type(), p.key_codes),
         "staged cold entries' summaries: a row per entry, bytes");
    a.cold_summaries = cold_summaries.data_ptr();
  } else if (b.cold.data != nullptr) {
    const int64_t per_block = block_summary_bytes(layout, qkv.scalar_type(), p.key_codes);
    need(summaries.numel() >= (pool_blocks + b.cold.num_slots) * per_block && pool_blocks + b.cold.num_slots <= INT32_MAX,
         "block summaries without rows for the L2 slots (cold blocks)");
    a.cold_summary_base = static_cast<int32_t>(pool_blocks);
  }
  cuda::select_blocks(dtype_of(qkv), qkv.data_ptr(), qkv.stride(0), summaries.data_ptr(), layout.head_dim, a,
                      stream());
  check_launch("select_blocks");
  DeviceBatch out = b;
  out.head_tables = x.head_tables;  // rows of b.max_blocks, as the kernels index them
  out.context_lens = x.context_lens.narrow(0, 0, S);
  return out;
}

void synchronize_stream() {
  const cudaError_t e = cudaStreamSynchronize(stream());
  if (e != cudaSuccess) fail(ErrorCode::kInternal, std::string("stream synchronize: ") + cudaGetErrorString(e));
}

void copy_to_host_async(const at::Tensor& src, at::Tensor& dst) {
  need(src.is_cuda() && src.is_contiguous() && dst.is_cpu() && dst.is_pinned() && dst.is_contiguous() &&
           src.nbytes() == dst.nbytes(),
       "copy_to_host_async: a contiguous device tensor into pinned host memory of its size");
  const cudaError_t e = cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), cudaMemcpyDeviceToHost, stream());
  if (e != cudaSuccess) fail(ErrorCode::kInternal, std::string("copy_to_host_async: ") + cudaGetErrorString(e));
}

int32_t decode_wave(at::ScalarType dtype, int32_t head_dim, int32_t group) {
  return cuda::decode_attention_wave(dtype_of(dtype), head_dim, group);
}

int32_t attention_max_rows(at::ScalarType dtype) {
  return dtype_of(dtype) == cuda::DType::kF32 ? cuda::kAttnMaxRows : cuda::kPrefillRows;
}

int32_t partial_row_floats(int32_t head_dim) { return head_dim + cuda::kPartialPad; }

int32_t decode_splits_for(at::ScalarType dtype, int32_t head_dim, int32_t group, int32_t num_seqs,
                          int32_t num_kv_heads) {
  const int32_t per_split = std::max(1, num_seqs * num_kv_heads);
  return std::max(1, std::min(64, decode_wave(dtype, head_dim, group) / per_split));
}

int32_t decode_tail_for(at::ScalarType dtype, int32_t head_dim, int32_t group, int32_t num_seqs,
                        int32_t num_kv_heads, int32_t splits) {
  static const bool off = [] {
    const char* env = std::getenv("K25_DECODE_TAIL");
    return env != nullptr && std::string(env) == "0";
  }();
  if (off || splits < 2 || num_seqs < 2) return 0;
  // H100, decode probe: a tail of ~a wave of CTAs evened out the end by 0.9-1.3% at B4-B16;
  // a batch of one (too few tail CTAs to keep the memory busy) and unsplit rows (merges where
  // there were none) lost (bench/RESULTS.md, 2026-12-07). The long ranges must fill three
  // quarters of the wave or more (decode_splits_for's fill from two thirds to all of it), or the
  // "tail" runs beside them from the start: B8 @ 32K with 2 splits (half a wave) lost 10%.
  const int32_t pairs = std::max(1, num_seqs * num_kv_heads), wave = decode_wave(dtype, head_dim, group);
  if (4LL * pairs * splits < 3LL * wave) return 0;
  return std::max(2, std::min(64, wave / pairs));
}

void add_penalties(SampleSpec& spec, const std::vector<int32_t>& tokens, int32_t num_prompt_tokens,
                   std::vector<int32_t>& counts) {
  const SamplingParams& p = *spec.params;
  const bool rep = p.repetition_penalty != 1.0f;
  if (!rep && p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f) return;
  // counts holds 1 + the output count of a token seen (0: not seen).
  const size_t prompt = static_cast<size_t>(std::max(0, num_prompt_tokens));
  for (size_t j = rep ? 0 : prompt; j < tokens.size(); ++j) {
    const int32_t t = tokens[j];
    if (t < 0) continue;
    if (static_cast<size_t>(t) >= counts.size()) counts.resize(static_cast<size_t>(t) + 1, 0);
    int32_t& c = counts[t];
    if (c == 0) {
      spec.penalties.emplace_back(t, 0);
      c = 1;
    }
    if (j >= prompt) ++c;
  }
  for (auto& [token, count] : spec.penalties) {
    count = counts[token] - 1;
    counts[token] = 0;
  }
}

std::vector<SampleOutput> sample(at::Tensor& logits, const std::vector<SampleSpec>& specs) {
  at::Tensor back = sample_launch(logits, specs, nullptr).cpu();  // waits for the kernel: the only copy down
  return sample_read(back.data_ptr<uint8_t>(), static_cast<int32_t>(specs.size()),
                     static_cast<int32_t>(logits.size(1)));
}

std::vector<SampleOutput> sample_read(const uint8_t* host_outs, int32_t R, int32_t V) {
  const auto* o = reinterpret_cast<const cuda::SampleOut*>(host_outs);
  std::vector<SampleOutput> result(R);
  for (int32_t i = 0; i < R; ++i) {
    result[i].token = o[i].token;
    result[i].error = o[i].error != 0 || o[i].token < 0 || o[i].token >= V;
    result[i].logprob = o[i].logprob;
    for (int32_t j = 0; j < o[i].num_top; ++j) result[i].top.emplace_back(o[i].top_ids[j], o[i].top_logprobs[j]);
  }
  return result;
}

at::Tensor sample_launch(at::Tensor& logits, const std::vector<SampleSpec>& specs, at::Tensor* ids_out) {
  need(logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.dim() == 2, "sample input");
  const int32_t R = static_cast<int32_t>(specs.size());
  const int32_t V = static_cast<int32_t>(logits.size(1));
  std::vector<cuda::SampleRow> rows(R);
  std::vector<cuda::PenaltyEntry> pens;
  std::vector<int32_t> bans;
  for (int32_t i = 0; i < R; ++i) {
    const SampleSpec& sp = specs[i];
    const SamplingParams& p = *sp.params;
    need(sp.logits_row >= 0 && sp.logits_row < logits.size(0), "sample row out of range");
    cuda::SampleRow& r = rows[i];
    r.temperature = p.temperature;
    r.top_p = p.top_p;
    r.min_p = p.min_p;
    r.repetition_penalty = p.repetition_penalty;
    r.presence_penalty = p.presence_penalty;
    r.frequency_penalty = p.frequency_penalty;
    r.top_k = p.top_k;
    r.logprobs = std::min(p.logprobs, cuda::kMaxTopLogprobs);
    r.logits_row = sp.logits_row;
    r.seed = sp.seed;
    r.counter = sp.counter;
    r.pen_begin = static_cast<int32_t>(pens.size());
    for (const auto& [token, count] : sp.penalties) pens.push_back({token, count, 0.0f});
    r.pen_count = static_cast<int32_t>(pens.size()) - r.pen_begin;
    r.ban_begin = static_cast<int32_t>(bans.size());
    if (sp.banned) bans.insert(bans.end(), sp.banned->begin(), sp.banned->end());
    r.ban_count = static_cast<int32_t>(bans.size()) - r.ban_begin;
  }
  // One pinned upload: rows | penalty entries | bans, each 16-byte aligned.
  auto align = [](size_t n) { return (n + 15) / 16 * 16; };
  const size_t rows_b = align(sizeof(cuda::SampleRow) * R), pens_b = align(sizeof(cuda::PenaltyEntry) * pens.size());
  const size_t bans_b = align(sizeof(int32_t) * bans.size());
  at::Tensor host = at::empty({static_cast<int64_t>(rows_b + pens_b + bans_b)},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  uint8_t* h = host.data_ptr<uint8_t>();
  std::memcpy(h, rows.data(), sizeof(cuda::SampleRow) * R);
  if (!pens.empty()) std::memcpy(h + rows_b, pens.data(), sizeof(cuda::PenaltyEntry) * pens.size());
  if (!bans.empty()) std::memcpy(h + rows_b + pens_b, bans.data(), sizeof(int32_t) * bans.size());
  at::Tensor dev = host.to(logits.device(), /*non_blocking=*/true);
  uint8_t* d = dev.data_ptr<uint8_t>();
  at::Tensor scratch = at::empty({static_cast<int64_t>(R) * V}, logits.options());
  at::Tensor outs = at::empty({static_cast<int64_t>(R * sizeof(cuda::SampleOut))}, dev.options());
  cuda::sample_rows(logits.data_ptr<float>(), V, V, reinterpret_cast<const cuda::SampleRow*>(d), R,
                    reinterpret_cast<cuda::PenaltyEntry*>(d + rows_b), reinterpret_cast<const int32_t*>(d + rows_b + pens_b),
                    scratch.data_ptr<float>(), reinterpret_cast<cuda::SampleOut*>(outs.data_ptr<uint8_t>()), stream());
  check_launch("sample_rows");
  if (ids_out) {
    need(ids_out->scalar_type() == at::kInt && ids_out->is_contiguous() && ids_out->numel() >= logits.size(0),
         "sampled ids output");
    cuda::scatter_sampled_ids(reinterpret_cast<const cuda::SampleOut*>(outs.data_ptr<uint8_t>()),
                              reinterpret_cast<const cuda::SampleRow*>(d), R, ids_out->data_ptr<int32_t>(), stream());
    check_launch("scatter_sampled_ids");
  }
  return outs;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kInt));
  argmax_rows_into(logits, out);
  return out;
}

void take_previous_ids(at::Tensor& ids, const at::Tensor& prev_rows, const at::Tensor& last_ids, int32_t vocab) {
  need(ids.scalar_type() == at::kInt && prev_rows.scalar_type() == at::kInt && last_ids.scalar_type() == at::kInt &&
           ids.is_contiguous() && prev_rows.is_contiguous() && last_ids.is_contiguous() &&
           ids.numel() == prev_rows.numel() && ids.is_cuda(),
       "take_previous_ids inputs");
  cuda::take_previous_ids(ids.data_ptr<int32_t>(), prev_rows.data_ptr<int32_t>(), last_ids.data_ptr<int32_t>(),
                          static_cast<int32_t>(ids.numel()), vocab, stream());
  check_launch("take_previous_ids");
}

void argmax_rows_into(const at::Tensor& logits, at::Tensor& out) {
  need(logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.dim() == 2, "argmax input");
  need(out.scalar_type() == at::kInt && out.is_contiguous() && out.numel() == logits.size(0), "argmax output");
  const int32_t n = static_cast<int32_t>(logits.size(1));
  at::Tensor scratch = at::empty({logits.size(0) * cuda::argmax_chunks(n)}, logits.options().dtype(at::kLong));
  cuda::argmax_rows(logits.data_ptr<float>(), logits.size(0), n, out.data_ptr<int32_t>(), scratch.data_ptr(),
                    stream());
  check_launch("argmax_rows");
}

namespace {
void* new_event(const char* what) {
  cudaEvent_t ev = nullptr;
  if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
    (void)cudaGetLastError();
    fail(ErrorCode::kInternal, std::string(what) + ": cudaEventCreate failed");
  }
  return ev;
}
void cuda_call(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    fail(ErrorCode::kInternal, std::string("ColdPrefetch: ") + what + " failed: " + cudaGetErrorString(e));
  }
}
}  // namespace

ColdPrefetch::ColdPrefetch(int64_t slice_bytes, int32_t capacity, const at::Device& device)
    : slice_bytes_(slice_bytes), capacity_(capacity) {
  need(slice_bytes > 0 && slice_bytes % 16 == 0 && capacity > 0, "cold prefetch: 16-byte slices, capacity > 0");
  c10::cuda::CUDAGuard guard(device);
  buffer_ = at::empty({2 * capacity * slice_bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  cudaStream_t side = nullptr;
  cuda_call(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate");
  side_ = side;
  try {
    forked_ = new_event("ColdPrefetch");
    for (int i = 0; i < 2; ++i) {
      gathered_[i] = new_event("ColdPrefetch");
      read_[i] = new_event("ColdPrefetch");
    }
  } catch (...) {
    release();
    throw;
  }
}

ColdPrefetch::~ColdPrefetch() { release(); }

void ColdPrefetch::release() {
  for (void* e : {forked_, gathered_[0], gathered_[1], read_[0], read_[1]}) {
    if (e) (void)cudaEventDestroy(static_cast<cudaEvent_t>(e));
  }
  forked_ = gathered_[0] = gathered_[1] = read_[0] = read_[1] = nullptr;
  if (side_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(side_));
  side_ = nullptr;
}

void ColdPrefetch::begin_step() {
  // The side stream's first gather of this step refills the buffers the previous step's last
  // layers read: it starts after everything enqueued so far.
  cuda_call(cudaEventRecord(static_cast<cudaEvent_t>(forked_), stream()), "cudaEventRecord");
  cuda_call(cudaStreamWaitEvent(static_cast<cudaStream_t>(side_), static_cast<cudaEvent_t>(forked_), 0),
            "cudaStreamWaitEvent");
}

void ColdPrefetch::gather(int32_t layer, const ColdPool& l2, const at::Tensor& slots) {
  need(slots.is_cuda() && slots.scalar_type() == at::kInt && slots.numel() >= 1 + capacity_,
       "cold prefetch slots: int32 [1 + capacity] on the device");
  need(l2.data != nullptr && l2.slot_bytes % 16 == 0, "cold prefetch: a mapped L2 pool of 16-byte slots");
  cudaStream_t side = static_cast<cudaStream_t>(side_);
  const int p = layer % 2;
  if (layer >= 2) cuda_call(cudaStreamWaitEvent(side, static_cast<cudaEvent_t>(read_[p]), 0), "cudaStreamWaitEvent");
  uint8_t* dst = buffer_.data_ptr<uint8_t>() + p * capacity_ * slice_bytes_;
  cuda::gather_cold_layer(dst, l2.data, l2.slot_bytes, layer * slice_bytes_, slice_bytes_, slots.data_ptr<int32_t>(),
                          capacity_, side);
  check_launch("gather_cold_layer");
  cuda_call(cudaEventRecord(static_cast<cudaEvent_t>(gathered_[p]), side), "cudaEventRecord");
}

ColdPool ColdPrefetch::ready(int32_t layer) {
  const int p = layer % 2;
  cuda_call(cudaStreamWaitEvent(stream(), static_cast<cudaEvent_t>(gathered_[p]), 0), "cudaStreamWaitEvent");
  // Placed so that entry j's layer-l bytes lie at the kernels' own offset for layer l.
  const uint8_t* base = buffer_.data_ptr<uint8_t>() + p * capacity_ * slice_bytes_ - layer * slice_bytes_;
  return {base, slice_bytes_, capacity_};
}

void ColdPrefetch::attended(int32_t layer) {
  cuda_call(cudaEventRecord(static_cast<cudaEvent_t>(read_[layer % 2]), stream()), "cudaEventRecord");
}

HostFence::HostFence() {
  for (void*& e : ev_) {
    cudaEvent_t ev = nullptr;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      for (void* made : ev_) {
        if (made) (void)cudaEventDestroy(static_cast<cudaEvent_t>(made));
      }
      fail(ErrorCode::kInternal, "HostFence: cudaEventCreate failed");
    }
    e = ev;
  }
}

HostFence::~HostFence() {
  for (void* e : ev_) {
    if (e) (void)cudaEventDestroy(static_cast<cudaEvent_t>(e));
  }
}

void HostFence::record(int i) {
  if (cudaEventRecord(static_cast<cudaEvent_t>(ev_[i]), stream()) != cudaSuccess) {
    (void)cudaGetLastError();
    fail(ErrorCode::kInternal, "HostFence: cudaEventRecord failed");
  }
  recorded_[i] = true;
}

void HostFence::wait(int i) {
  if (!recorded_[i]) return;
  if (cudaEventSynchronize(static_cast<cudaEvent_t>(ev_[i])) != cudaSuccess) {
    (void)cudaGetLastError();
    fail(ErrorCode::kInternal, "HostFence: cudaEventSynchronize failed");
  }
}

}  // namespace k25::cuda_glue
