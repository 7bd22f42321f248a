// Tensor-core building blocks shared by the bf16 / fp16 attention kernels (prefill and
// decode): cp.async copies, ldmatrix loads, m16n8k16 mma.sync and the shared-memory
// swizzle of their tiles.
//
// mma.m16n8k16 fragments (lane = 4 * g + t, g = lane / 4, t = lane % 4; pairs of 16-bit
// elements packed low-first in one 32-bit register):
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..),
//                           a3 = (g + 8, 2t + 8..)
//   B (16 x 8, k x n):      b0 = (k = 2t..2t+1, n = g), b1 = (k = 2t + 8.., n = g)
//   C (16 x 8, fp32):       c0, c1 = (g, 2t), (g, 2t + 1); c2, c3 = (g + 8, 2t), (g + 8, 2t + 1)
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i, and register i of
// lane (g, t) receives row g, columns 2t..2t+1 of matrix i (with .trans: rows 2t..2t+1 of
// column g, i.e. the matrix transposed).
//
// Tiles in shared memory have rows of D elements (D / 8 chunks of 16 bytes); chunk c of row
// r is stored at chunk c ^ (r % 8), so the 8 row addresses of every ldmatrix phase and the
// cp.async writes of 8 consecutive rows fall in distinct banks.
//
// Also here: S = Q K^T on one swizzled K tile (the prefill and decode mma.sync kernels), and
// the output rows of the two prefill kernels (mma.sync and wgmma), whose accumulators share
// the C fragment's row layout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.cuh"

namespace k25::cuda {

// Byte offset of 16-byte chunk c of row r in a swizzled tile of kChunks chunks per row.
template <int kChunks>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  static_assert(kChunks >= 8, "the swizzle permutes 8 chunks of a row");
  return static_cast<uint32_t>((r * kChunks + (c ^ (r & 7))) * 16);
}

// smem_u32, cp_async16, cp_async_commit, cp_async_wait: common.cuh.

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b on one m16n8k16 tile (fp32 accumulators).
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to T, lo in the low half (the lower column of an mma fragment pair).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t u;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&u, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&u, &v, 4);
  }
  return u;
}

// S = Q K^T on one tile of NK keys (fp32; s[n] is the C fragment of keys 8n..8n + 7): qf[kd]
// is Q's A fragment of dims 16kd..16kd + 15, sk the tile's shared address (NK key rows of D
// elements, swizzled). B(k = dim, n = key) is K row-major, so the plain ldmatrix of 8 key
// rows x 8 dims is b0 / b1. Matrices: keys 16np + 0..7 at dims 16kd + 0..7 and + 8..15, then
// keys 16np + 8..15 likewise.
template <typename T, int D, int NK>
__device__ __forceinline__ void mma_qk(float (&s)[NK / 8][4], const uint32_t (&qf)[D / 16][4], uint32_t sk,
                                       int lane) {
  constexpr int CH = D / 8;
#pragma unroll
  for (int n = 0; n < NK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
  for (int np = 0; np < NK / 16; ++np) {
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd) {
      uint32_t b[4];
      ldsm_x4(b, sk + swz<CH>(16 * np + (lane & 7) + ((lane >> 4) << 3), 2 * kd + ((lane >> 3) & 1)));
      mma16816<T>(s[2 * np], qf[kd], b[0], b[1]);
      mma16816<T>(s[2 * np + 1], qf[kd], b[2], b[3]);
    }
  }
}

// ---- Output rows of the prefill kernels (prefill_attention.cu, prefill_attention_sm90.cu)
//
// Both end with every query row of a work item held by the four lanes of a quad, the way an
// mma C fragment holds a row: lane t has the column pairs (8j + 2t, 8j + 2t + 1), j < D / 8,
// the row's max m of raw scores and its softmax sum l (already summed over the quad). Which
// registers hold pair j differs (o[j][2h..] in m16n8k16 tiles, o[4j + 2h..] in a wgmma
// accumulator), so the row comes in as a callable pair(j) -> float2. Row r of an item is its
// token r / group at head r % group of the KV head's group.

// Split-KV: row r unnormalised, with its max in natural-log units (for the merge) and its sum,
// into the item's partial.
template <int D, typename Pair>
__device__ __forceinline__ void store_partial_row(const AttnBatch& batch, const AttnWork& w, int group, int r, int t,
                                                  Pair pair, float m, float l, float scale) {
  float* pr = batch.partials + (static_cast<int64_t>(w.partial) * group + r % group) * (D + kPartialPad);
#pragma unroll
  for (int j = 0; j < D / 8; ++j) *reinterpret_cast<float2*>(pr + 8 * j + 2 * t) = pair(j);
  if (t == 0) {
    pr[D] = l > 0.0f ? m * scale : -FLT_MAX;
    pr[D + 1] = l;
  }
}

// Row r normalised and rounded to T into shared memory (16-byte chunk c of row r at byte
// chunk(r, c) of smem), for store_staged_rows.
template <typename T, int D, typename Pair, typename Chunk>
__device__ __forceinline__ void stage_row(unsigned char* smem, Chunk chunk, int r, int t, Pair pair, float l) {
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const float2 v = pair(j);
    *reinterpret_cast<uint32_t*>(smem + chunk(r, j) + 4 * t) = pack2<T>(v.x * inv, v.y * inv);
  }
}

// A warp's 16 staged rows r0.. (those below rows) to out in whole 16-byte chunks, which is why
// the rows go through shared memory. q0: the sequence's first query token.
template <typename T, int D, typename Chunk>
__device__ __forceinline__ void store_staged_rows(T* out, const unsigned char* smem, Chunk chunk, const AttnWork& w,
                                                  int q0, int group, int num_heads, int r0, int rows, int lane) {
  constexpr int CH = D / 8;
#pragma unroll
  for (int e = lane; e < 16 * CH; e += 32) {
    const int r = r0 + e / CH, c = e % CH;
    if (r >= rows) break;
    const int token = q0 + w.q_begin + r / group, head = w.kv_head * group + r % group;
    *reinterpret_cast<int4*>(out + (static_cast<int64_t>(token) * num_heads + head) * D + c * 8) =
        *reinterpret_cast<const int4*>(smem + chunk(r, c));
  }
}

}  // namespace k25::cuda
