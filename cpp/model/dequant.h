// Conversion of raw model-file tensor data to float32.
//
// Results are bit-identical to gguf-py's gguf.quants.dequantize (and to numpy's float16 /
// bfloat16 widening), which compute in float32: Q8_0 = d*q, Q4_0 = d*(q-8), Q4_1 = d*q + m,
// with the low nibbles of a Q4 block holding elements 0..15 and the high nibbles 16..31.
// Sources may be unaligned (safetensors offsets are arbitrary); dst must hold n floats.
#pragma once

#include <cstdint>

#include "model/gguf_reader.h"
#include "model/safetensors_reader.h"

namespace k25 {

// Whether dequantize_to_f32 handles the type (F32, F16, BF16, Q8_0, Q4_0, Q4_1 for now).
bool can_dequantize(GgmlType type);

// n elements, a multiple of the type's block size (else kInvalidArgument); a type without a
// converter -> Error(kUnsupported) naming it. Single-threaded.
void dequantize_to_f32(GgmlType type, const void* src, float* dst, int64_t n);

// The same split over threads at block boundaries. n_threads <= 0 picks
// min(hardware threads, 8); small inputs run on the calling thread. All argument errors are
// raised before any thread starts.
void dequantize_to_f32_parallel(GgmlType type, const void* src, float* dst, int64_t n,
                                int n_threads = 0);

// safetensors data: F32, F16, BF16 (others -> kUnsupported). Single-threaded.
void convert_to_f32(DType dtype, const void* src, float* dst, int64_t n);
void convert_to_f32_parallel(DType dtype, const void* src, float* dst, int64_t n,
                             int n_threads = 0);

}  // namespace k25
