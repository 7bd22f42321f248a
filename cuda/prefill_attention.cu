// Paged attention for multi-token work items (prefill chunks) on tensor cores, bf16 / fp16.
//
// FlashAttention-2 tiling: one CTA per AttnWork item, up to kPrefillRows (128) query rows
// (the item's tokens x the GQA heads of its KV head, row r -> token r / group, head
// r % group) split over 8 warps of 16 rows each, so every row of the CTA shares the same
// K/V tiles; the more rows share a tile, the less K/V traffic per FLOP. Each warp keeps
// its Q rows as mma A fragments in registers for the whole item. Keys go
// through a ring of kStages shared-memory stages, kKeys = 64 keys (K and V) each, gathered
// row by row through the block table with cp.async (zero-filled outside the item's key
// range, so a slot nobody wrote is never read), kStages - 1 tiles in flight while one is
// computed. Per tile a warp forms S = Q K^T (16 x 64, fp32) with m16n8k16 mma.sync, runs
// the online softmax on it in registers (exp2, scale * log2(e) folded into one FMA),
// rounds P to the element type and accumulates O += P V (16 x D, fp32) with the same mma.
// Causal and window limits are per row; tiles outside all of a warp's rows are skipped
// and masks are applied only on tiles that cut through some row's range.
//
// Shared-memory rows are D elements (128 or 256 bytes), swizzled as mma.cuh describes (with
// the m16n8k16 and ldmatrix fragment layouts the comments below refer to).
#include <cstdint>

#include "common.cuh"
#include "mma.cuh"

namespace k25::cuda {

namespace {

constexpr int kWarps = kPrefillRows / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kKeys = 64;    // keys per tile
constexpr int kStages = 3;   // shared-memory ring depth
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kPrefillRows % 16 == 0 && kKeys % 16 == 0, "mma tiles are 16 rows and 16 keys");

template <int D>
struct Tiles {
  static constexpr int kChunks = D / 8;                        // 16-byte chunks per row
  static constexpr int kQBytes = kPrefillRows * D * 2;
  static constexpr int kKVBytes = kKeys * D * 2;               // one K or one V tile
  static constexpr int kStageBytes = 2 * kKVBytes;
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes;
  static constexpr int kLoadRows = kThreads / kChunks;         // key rows per CTA-wide pass
  static constexpr int kLoadIters = kKeys / kLoadRows;         // passes per tile
  // CTAs per SM the registers are budgeted for: 12 (D = 64) or 8 warps per SM, at most
  // about 168 or 232 registers a thread, which the kernel needs without spilling.
  static constexpr int kWarpsPerSm = D <= 64 ? 12 : 8;
  static constexpr int kMinBlocks = kWarpsPerSm >= kWarps ? kWarpsPerSm / kWarps : 1;
  static_assert(kChunks >= 8, "the swizzle permutes 8 chunks of a row");
  static_assert(kThreads % kChunks == 0 && kKeys % kLoadRows == 0, "whole rows per pass");
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, Tiles<D>::kMinBlocks)
    prefill_attention_kernel(const T* __restrict__ q, int64_t q_stride, T* __restrict__ out, KVCache kv, int layer,
                             AttnBatch batch, int num_heads, float scale, int window, int first_item) {
  using C = Tiles<D>;
  constexpr int CH = C::kChunks;
  constexpr int NT = kKeys / 8;  // 8-key column tiles of S
  constexpr int DT = D / 8;      // 8-wide column tiles of O
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t s_kv = s_q + C::kQBytes;

  const AttnWork w = batch.work[first_item + blockIdx.x];
  const int group = num_heads / kv.num_kv_heads;
  const int q0 = batch.query_start[w.seq];
  const int q_len = batch.query_start[w.seq + 1] - q0;
  const int first_pos = batch.context_lens[w.seq] - q_len + w.q_begin;  // position of row 0's token
  const int rows = (w.q_end - w.q_begin) * group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  // Keys row r may see: [lo, hi]. Both only grow with r (rows are in token order).
  auto limits = [&](int r, int& lo, int& hi) {
    const int pos = first_pos + r / group;
    lo = max(w.key_begin, window > 0 ? pos - window + 1 : 0);
    hi = min(w.key_end - 1, pos);
  };
  int key_lo, key_hi, unused;
  limits(0, key_lo, unused);
  limits(rows - 1, unused, key_hi);
  const int num_tiles = key_hi >= key_lo ? (key_hi - key_lo) / kKeys + 1 : 0;

  // Q rows past the item's are zero-filled: finite scores, results never stored.
  for (int e = tid; e < kPrefillRows * CH; e += kThreads) {
    const int r = e / CH, c = e % CH;
    const bool ok = r < rows;
    const T* src = q;
    if (ok) {
      const int token = q0 + w.q_begin + r / group, head = w.kv_head * group + r % group;
      src = q + static_cast<int64_t>(token) * q_stride + static_cast<int64_t>(head) * D + c * 8;
    }
    cp_async16(s_q + swz<CH>(r, c), src, ok);
  }
  cp_async_commit();

  const T* cache = static_cast<const T*>(kv.data);
  const int bs = kv.block_size;
  const int64_t head_elems = static_cast<int64_t>(bs) * D;
  const int64_t block_elems = static_cast<int64_t>(kv.num_layers) * 2 * kv.num_kv_heads * head_elems;
  const int64_t k_off = (static_cast<int64_t>(layer) * 2 * kv.num_kv_heads + w.kv_head) * head_elems;  // in a block
  const int64_t v_delta = static_cast<int64_t>(kv.num_kv_heads) * head_elems;
  const int* table = batch.block_tables + static_cast<int64_t>(w.seq) * batch.max_blocks;
  const bool pow2 = (bs & (bs - 1)) == 0;
  const int bs_shift = __ffs(bs) - 1;
  const int ld_row = tid / CH, ld_c = tid % CH;  // this thread copies chunk ld_c of rows ld_row + k * kLoadRows

  // Block ids of this thread's key rows for the next tile to copy: looked up one
  // iteration ahead so the table reads are in flight during a tile's compute.
  int blk[C::kLoadIters];
  auto lookup = [&](int tile) {
#pragma unroll
    for (int k = 0; k < C::kLoadIters; ++k) {
      const int p = key_lo + tile * kKeys + ld_row + k * C::kLoadRows;
      blk[k] = tile < num_tiles && p <= key_hi ? table[pow2 ? p >> bs_shift : p / bs] : 0;
    }
  };
  auto copy = [&](int tile) {
    if (tile < num_tiles) {
      const uint32_t st = s_kv + (tile % kStages) * C::kStageBytes;
#pragma unroll
      for (int k = 0; k < C::kLoadIters; ++k) {
        const int row = ld_row + k * C::kLoadRows;
        const int p = key_lo + tile * kKeys + row;
        const bool ok = p <= key_hi;  // past the last key: zero-filled, masked below
        const int slot = pow2 ? p & (bs - 1) : p % bs;
        const T* src = ok ? block_start<T>(kv, blk[k], block_elems) + k_off + static_cast<int64_t>(slot) * D + ld_c * 8
                          : cache;
        cp_async16(st + swz<CH>(row, ld_c), src, ok);
        cp_async16(st + C::kKVBytes + swz<CH>(row, ld_c), ok ? src + v_delta : cache, ok);
      }
    }
    cp_async_commit();  // empty groups too: the wait counts below assume one group per tile
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    lookup(s);
    copy(s);
  }
  lookup(kStages - 1);

  cp_async_wait<kStages - 1>();  // the Q group
  __syncthreads();
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kd = 0; kd < D / 16; ++kd) ldsm_x4(qf[kd], s_q + swz<CH>(warp * 16 + (lane & 15), 2 * kd + (lane >> 4)));

  // This thread's rows (g and g + 8 of the warp); rows past the item see no key.
  int rlo[2], rhi[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + g + 8 * i;
    if (r < rows) {
      limits(r, rlo[i], rhi[i]);
    } else {
      rlo[i] = 1;
      rhi[i] = 0;
    }
  }
  // The warp's range: its first row has the smallest limits, its last valid row the largest.
  const bool active = warp * 16 < rows;
  int lo_first, hi_first, lo_last, hi_last;
  limits(warp * 16, lo_first, hi_first);
  limits(min(warp * 16 + 15, rows - 1), lo_last, hi_last);

  const float sl2 = scale * kLog2e;
  float o[DT][4];
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // max of raw scores; this thread's sum

  for (int i = 0; i < num_tiles; ++i) {
    cp_async_wait<kStages - 2>();  // tile i has landed (this thread's copies)
    __syncthreads();               // everyone's copies of tile i; everyone is done with tile i - 1
    copy(i + kStages - 1);         // into the stage of tile i - 1
    lookup(i + kStages);
    const int tb = key_lo + i * kKeys, te = tb + kKeys - 1;
    if (!active || tb > hi_last || te < lo_first) continue;  // no row of this warp sees these keys
    const uint32_t sk = s_kv + (i % kStages) * C::kStageBytes, sv = sk + C::kKVBytes;

    float s[NT][4];
    mma_qk<T, D, kKeys>(s, qf, sk, lane);
    if (tb < lo_last || te > hi_first) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = tb + 8 * j + 2 * t + (e & 1);
          if (key < rlo[e >> 1] || key > rhi[e >> 1]) s[j][e] = -INFINITY;
        }
      }
    }
    // Online softmax; a row's four lanes (same g) share its max.
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      float mx = m[i2];
#pragma unroll
      for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * i2], s[j][2 * i2 + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // A row with no key yet keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
      const float base = mx == -INFINITY ? 0.0f : mx * sl2;
      const float alpha = exp2f(m[i2] * sl2 - base);
      m[i2] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 2 * i2; e < 2 * i2 + 2; ++e) {
          s[j][e] = exp2f(fmaf(s[j][e], sl2, -base));
          sum += s[j][e];
        }
      }
      l[i2] = l[i2] * alpha + sum;
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        o[j][2 * i2] *= alpha;
        o[j][2 * i2 + 1] *= alpha;
      }
    }
    // O += P V. P's A fragment for keys 16kk..16kk+15 is S tiles 2kk (a0, a1) and 2kk + 1
    // (a2, a3), as the C and A layouts line up. B(k = key, n = dim) is V row-major read
    // transposed: matrices keys 16kk + 0..7 and + 8..15 at dims 16jp + 0..7, then the same
    // keys at dims 16jp + 8..15.
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
      const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int jp = 0; jp < D / 16; ++jp) {
        uint32_t b[4];
        ldsm_x4_trans(b, sv + swz<CH>(16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3), 2 * jp + (lane >> 4)));
        mma16816<T>(o[2 * jp], a, b[0], b[1]);
        mma16816<T>(o[2 * jp + 1], a, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can be pending; none may outlive the CTA

#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    l[i2] += __shfl_xor_sync(0xffffffffu, l[i2], 1);
    l[i2] += __shfl_xor_sync(0xffffffffu, l[i2], 2);
  }
  auto chunk = [](int r, int c) { return swz<CH>(r, c); };
  if (w.partial >= 0) {
    // Split-KV (single-token items whose group exceeds the decode kernel's).
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      const int r = warp * 16 + g + 8 * i2;
      if (r >= rows) continue;
      store_partial_row<D>(batch, w, group, r, t, [&](int j) { return make_float2(o[j][2 * i2], o[j][2 * i2 + 1]); },
                           m[i2], l[i2], scale);
    }
    return;
  }
  // Normalised rows go through the warp's own Q rows in shared memory (read only by this
  // warp, into registers, long ago).
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    stage_row<T, D>(smem, chunk, warp * 16 + g + 8 * i2, t,
                    [&](int j) { return make_float2(o[j][2 * i2], o[j][2 * i2 + 1]); }, l[i2]);
  }
  __syncwarp();
  store_staged_rows<T, D>(out, smem, chunk, w, q0, group, num_heads, warp * 16, rows, lane);
}

template <typename T, int D>
void launch(const void* q, int64_t q_stride, void* out, KVCache kv, int layer, const AttnBatch& b, int num_heads,
            float scale, int window, int first_item, int num_items, cudaStream_t stream) {
  constexpr int smem = Tiles<D>::kSmemBytes;
  static bool configured = false;  // per instantiation; raising the limit is idempotent
  if (!configured) {
    cudaFuncSetAttribute(prefill_attention_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    configured = true;
  }
  prefill_attention_kernel<T, D><<<num_items, kThreads, smem, stream>>>(
      static_cast<const T*>(q), q_stride, static_cast<T*>(out), kv, layer, b, num_heads, scale, window, first_item);
}

template <int D>
void launch_dtype(DType t, const void* q, int64_t q_stride, void* out, KVCache kv, int layer, const AttnBatch& b,
                  int num_heads, float scale, int window, int first_item, int num_items, cudaStream_t stream) {
  if (t == DType::kBF16) {
    launch<__nv_bfloat16, D>(q, q_stride, out, kv, layer, b, num_heads, scale, window, first_item, num_items, stream);
  } else if (t == DType::kF16) {
    launch<__half, D>(q, q_stride, out, kv, layer, b, num_heads, scale, window, first_item, num_items, stream);
  }
}

}  // namespace

void prefill_attention(DType t, const void* q, int64_t q_stride, void* out, KVCache kv, int32_t layer,
                       const AttnBatch& batch, int32_t num_heads, float scale, int32_t window, int32_t first_item,
                       int32_t num_items, cudaStream_t stream) {
  if (num_items <= 0) return;
  // Hopper: the wgmma kernel, where it covers the case (bf16 / fp16, head_dim 128).
  if (prefill_attention_sm90(t, q, q_stride, out, kv, layer, batch, num_heads, scale, window, first_item, num_items,
                             stream)) {
    return;
  }
  switch (kv.head_dim) {
    case 64:
      launch_dtype<64>(t, q, q_stride, out, kv, layer, batch, num_heads, scale, window, first_item, num_items,
                       stream);
      break;
    case 128:
      launch_dtype<128>(t, q, q_stride, out, kv, layer, batch, num_heads, scale, window, first_item, num_items,
                        stream);
      break;
    default:
      break;  // rejected by the launcher's caller (supported head dims: 64, 128)
  }
}

}  // namespace k25::cuda
