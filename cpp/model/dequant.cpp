#include "model/dequant.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "k25/status.h"
#include "model/half.h"

// The reference computes d*q and then adds m as two float32 roundings; a fused multiply-add
// (which -march=native makes available and GCC uses by default) rounds once. For the block
// formats here d*q happens to be exact, so both agree, but that stops being true as soon as
// a format scales twice (K-quants: d * scale * q), so contraction is off for this file.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace k25 {

namespace {

// Model files are little-endian and the kernels read them in host order.
static_assert(std::endian::native == std::endian::little, "k25 needs a little-endian host");

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Each kernel converts blocks [b0, b1) of src into dst (both indexed from the tensor start).

void copy_f32(const uint8_t* src, float* dst, int64_t b0, int64_t b1) {
  std::memcpy(dst + b0, src + b0 * 4, static_cast<size_t>(b1 - b0) * 4);
}

void f16_to_f32(const uint8_t* __restrict src, float* __restrict dst, int64_t b0, int64_t b1) {
  for (int64_t i = b0; i < b1; ++i) dst[i] = fp16_to_fp32(load_u16(src + 2 * i));
}

void bf16_to_f32(const uint8_t* __restrict src, float* __restrict dst, int64_t b0, int64_t b1) {
  for (int64_t i = b0; i < b1; ++i) dst[i] = bf16_to_fp32(load_u16(src + 2 * i));
}

constexpr int kQK = 32;  // elements per Q4_0 / Q4_1 / Q8_0 block

void q8_0_to_f32(const uint8_t* __restrict src, float* __restrict dst, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = src + b * 34;
    const float d = fp16_to_fp32(load_u16(blk));
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    float* y = dst + b * kQK;
    for (int j = 0; j < kQK; ++j) y[j] = float(q[j]) * d;
  }
}

void q4_0_to_f32(const uint8_t* __restrict src, float* __restrict dst, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = src + b * 18;
    const float d = fp16_to_fp32(load_u16(blk));
    const uint8_t* q = blk + 2;
    float* y = dst + b * kQK;
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * float(int(q[j] & 0x0f) - 8);
      y[j + kQK / 2] = d * float(int(q[j] >> 4) - 8);
    }
  }
}

void q4_1_to_f32(const uint8_t* __restrict src, float* __restrict dst, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = src + b * 20;
    const float d = fp16_to_fp32(load_u16(blk));
    const float m = fp16_to_fp32(load_u16(blk + 2));
    const uint8_t* q = blk + 4;
    float* y = dst + b * kQK;
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * float(q[j] & 0x0f) + m;
      y[j + kQK / 2] = d * float(q[j] >> 4) + m;
    }
  }
}

using Kernel = void (*)(const uint8_t*, float*, int64_t, int64_t);

struct Plan {
  Kernel kernel;
  int64_t block_size;
  int64_t n_blocks;
};

Kernel gguf_kernel(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return copy_f32;
    case GgmlType::F16: return f16_to_f32;
    case GgmlType::BF16: return bf16_to_f32;
    case GgmlType::Q8_0: return q8_0_to_f32;
    case GgmlType::Q4_0: return q4_0_to_f32;
    case GgmlType::Q4_1: return q4_1_to_f32;
    default: return nullptr;
  }
}

Plan plan_gguf(GgmlType type, int64_t n) {
  const Kernel k = gguf_kernel(type);
  if (k == nullptr)
    fail(ErrorCode::kUnsupported,
         "dequantizing GGML type " + ggml_type_name(type) + " to float32 is not supported yet");
  const int64_t bs = ggml_type_traits(static_cast<uint32_t>(type))->block_size;
  if (n < 0 || n % bs != 0)
    fail(ErrorCode::kInvalidArgument, "cannot dequantize " + std::to_string(n) + " " +
                                          ggml_type_name(type) +
                                          " elements: not a multiple of the block size " +
                                          std::to_string(bs));
  return {k, bs, n / bs};
}

Plan plan_dtype(DType dtype, int64_t n) {
  Kernel k = nullptr;
  switch (dtype) {
    case DType::kF32: k = copy_f32; break;
    case DType::kF16: k = f16_to_f32; break;
    case DType::kBF16: k = bf16_to_f32; break;
    default:
      fail(ErrorCode::kUnsupported, std::string("converting safetensors dtype ") +
                                        dtype_name(dtype) + " to float32 is not supported");
  }
  if (n < 0) fail(ErrorCode::kInvalidArgument, "negative element count");
  return {k, 1, n};
}

// Below this many output elements per thread, starting a thread costs more than it saves.
constexpr int64_t kMinElementsPerThread = int64_t(1) << 20;
constexpr int kMaxThreads = 8;

void run_parallel(const Plan& p, const void* src, float* dst, int n_threads) {
  const auto* s = static_cast<const uint8_t*>(src);
  if (n_threads <= 0) {
    const unsigned hw = std::thread::hardware_concurrency();
    n_threads = hw == 0 ? 1 : static_cast<int>(std::min<unsigned>(hw, kMaxThreads));
  }
  const int64_t n = p.n_blocks * p.block_size;
  const int64_t by_size = std::max<int64_t>(1, n / kMinElementsPerThread);
  const int64_t t = std::min<int64_t>({int64_t(n_threads), int64_t(kMaxThreads), by_size});
  if (t <= 1) {
    p.kernel(s, dst, 0, p.n_blocks);
    return;
  }
  const int64_t per = (p.n_blocks + t - 1) / t;
  std::vector<std::thread> workers;
  int64_t next = per;  // the calling thread takes [0, per)
  for (int64_t i = 1; i < t && next < p.n_blocks; ++i, next += per) {
    const int64_t b0 = next, b1 = std::min(p.n_blocks, next + per);
    try {
      workers.emplace_back([&p, s, dst, b0, b1] { p.kernel(s, dst, b0, b1); });
    } catch (const std::system_error&) {
      break;  // out of threads: the calling thread does the rest below
    }
  }
  p.kernel(s, dst, 0, std::min(per, p.n_blocks));
  if (next < p.n_blocks) p.kernel(s, dst, next, p.n_blocks);
  for (auto& w : workers) w.join();
}

}  // namespace

bool can_dequantize(GgmlType type) { return gguf_kernel(type) != nullptr; }

void dequantize_to_f32(GgmlType type, const void* src, float* dst, int64_t n) {
  const Plan p = plan_gguf(type, n);
  p.kernel(static_cast<const uint8_t*>(src), dst, 0, p.n_blocks);
}

void dequantize_to_f32_parallel(GgmlType type, const void* src, float* dst, int64_t n,
                                int n_threads) {
  run_parallel(plan_gguf(type, n), src, dst, n_threads);
}

void convert_to_f32(DType dtype, const void* src, float* dst, int64_t n) {
  const Plan p = plan_dtype(dtype, n);
  p.kernel(static_cast<const uint8_t*>(src), dst, 0, p.n_blocks);
}

void convert_to_f32_parallel(DType dtype, const void* src, float* dst, int64_t n,
                             int n_threads) {
  run_parallel(plan_dtype(dtype, n), src, dst, n_threads);
}

}  // namespace k25
