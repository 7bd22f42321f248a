#include "model/cuda_glue.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <string>

#include "k25/status.h"
#include "k25_cuda.h"

namespace k25::cuda_glue {

namespace {

static_assert(sizeof(AttnWorkItem) == sizeof(cuda::AttnWork), "plan and kernel disagree on AttnWork");

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail(ErrorCode::kInternal, std::string("CUDA kernel ") + what + ": " + cudaGetErrorString(e));
}

cuda::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::DType::kF32;
    case at::kHalf: return cuda::DType::kF16;
    case at::kBFloat16: return cuda::DType::kBF16;
    default: fail(ErrorCode::kUnsupported, std::string("CUDA kernels take float32, float16 or bfloat16, not ") +
                                              std::string(c10::toString(t.scalar_type())));
  }
}

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
  auto i32 = at::TensorOptions().dtype(at::kInt);
  b.work = at::from_blob(const_cast<AttnWorkItem*>(plan.work.data()), {b.num_work, 7}, i32)
               .to(device, /*non_blocking=*/false, /*copy=*/true);
  if (b.num_merges > 0) {
    b.merges = at::from_blob(const_cast<int32_t*>(plan.merges.data()), {b.num_merges, 4}, i32).to(device, false, true);
    b.partials = at::empty({static_cast<int64_t>(plan.num_partials) * group * (head_dim + 2)},
                           at::TensorOptions().dtype(at::kFloat).device(device));
  }
  return b;
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
  ab.decode_splits = b.decode_splits;
  ab.num_seqs = b.num_seqs;
  cuda::paged_attention(dtype_of(qkv), qkv.data_ptr(), qkv.stride(0), out.data_ptr(), cache_of(kv, layout), layer,
                        ab, num_heads, static_cast<float>(scale), window, stream());
  check_launch("paged_attention");
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  need(logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.dim() == 2, "argmax input");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kInt));
  cuda::argmax_rows(logits.data_ptr<float>(), logits.size(0), static_cast<int32_t>(logits.size(1)),
                    out.data_ptr<int32_t>(), stream());
  check_launch("argmax_rows");
  return out;
}

}  // namespace k25::cuda_glue
