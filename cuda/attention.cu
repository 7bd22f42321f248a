// Paged attention for mixed prefill chunks and decodes (and its split-KV merge: for
// partials of the tiled kernels; the decode kernels merge their own, see AttnBatch::
// split_counters, and merge_kernel is launched only for what they leave).
//
// One CTA per AttnWork item: up to kAttnMaxRows query rows (the GQA heads of one KV head
// for a few tokens of one sequence) against a range of keys. K and V are staged through
// shared memory 32 keys at a time, so each is read from device memory once per CTA
// rather than once per row; each warp owns rows and keeps their online-softmax state
// (max, sum, accumulator slice) in registers. Arithmetic is float32 on CUDA cores.
#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common.cuh"

namespace k25::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeys = 32;                              // keys per shared-memory tile
constexpr int kRowsPerWarp = kAttnMaxRows / kWarps;

__device__ __forceinline__ int64_t head_offset(const KVCache& kv, int64_t block, int layer, int which, int head) {
  const int64_t head_elems = static_cast<int64_t>(kv.block_size) * kv.head_dim;
  return ((block * kv.num_layers + layer) * 2 + which) * kv.num_kv_heads * head_elems + head * head_elems;
}

template <typename T, int D>
struct Smem {
  // K rows padded by one 4-byte word: lane j reads row j at a bank of its own.
  static constexpr int kPad = 4 / sizeof(T);
  float q[kAttnMaxRows][D];
  T k[kKeys][D + kPad];
  T v[kKeys][D];
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_kernel(const T* q, int64_t q_stride, T* out, KVCache kv,
                                                             int layer, AttnBatch batch, int num_heads, float scale,
                                                             int window) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int kSlice = D / 32;  // accumulator elements per lane
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem<T, D>& sm = *reinterpret_cast<Smem<T, D>*>(smem_raw);

  const AttnWork w = attn_work(batch, kv.num_kv_heads, window, blockIdx.x);
  if (w.partial == kNoWork) return;
  const int group = num_heads / kv.num_kv_heads;
  const int q0 = batch.query_start[w.seq];
  const int q_len = batch.query_start[w.seq + 1] - q0;
  const int first_pos = batch.context_lens[w.seq] - q_len;
  const int* table = table_of(batch, w.seq, w.kv_head, kv.num_kv_heads);
  const int rows = (w.q_end - w.q_begin) * group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Stage the queries (pre-scaled) in shared memory as float.
  for (int e = threadIdx.x; e < rows * D; e += kThreads) {
    const int r = e / D, d = e % D;
    const int token = q0 + w.q_begin + r / group, head = w.kv_head * group + r % group;
    sm.q[r][d] = to_f(q[static_cast<int64_t>(token) * q_stride + static_cast<int64_t>(head) * D + d]) * scale;
  }

  // Per row: the keys it may see, within this item's key range.
  int lo[kRowsPerWarp], hi[kRowsPerWarp];
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kSlice];
  int key_lo = INT_MAX, key_hi = -1;  // union over the CTA's rows
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    m[i] = -FLT_MAX;
    l[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < kSlice; ++j) acc[i][j] = 0.0f;
    lo[i] = 1;
    hi[i] = 0;
    if (r < rows) {
      const int pos = first_pos + w.q_begin + r / group;
      lo[i] = max(window > 0 ? max(0, pos - window + 1) : 0, w.key_begin);
      hi[i] = min(pos, w.key_end - 1);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int pos = first_pos + w.q_begin + r / group;
    key_lo = min(key_lo, max(window > 0 ? max(0, pos - window + 1) : 0, w.key_begin));
    key_hi = max(key_hi, min(pos, w.key_end - 1));
  }

  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  for (int tile = key_lo - key_lo % kKeys; tile <= key_hi; tile += kKeys) {
    __syncthreads();  // the previous tile is consumed (and the queries are staged)
    for (int e = threadIdx.x; e < kKeys * (D / kVec); e += kThreads) {
      const int j = e / (D / kVec), c = (e % (D / kVec)) * kVec;
      const int p = tile + j;
      if (p < key_lo || p > key_hi) continue;  // never read slots nobody wrote
      const int off = p % kv.block_size;
      // The block's start (a pool block or a cold one in L2), then the head's K / V rows in it.
      const T* blk = block_start<T>(kv, table[p / kv.block_size], head_offset(kv, 1, 0, 0, 0));
      const int4 kk = *reinterpret_cast<const int4*>(blk + head_offset(kv, 0, layer, 0, w.kv_head) +
                                                      static_cast<int64_t>(off) * D + c);
      const int4 vv = *reinterpret_cast<const int4*>(blk + head_offset(kv, 0, layer, 1, w.kv_head) +
                                                      static_cast<int64_t>(off) * D + c);
      *reinterpret_cast<int4*>(&sm.v[j][c]) = vv;
      const T* ks = reinterpret_cast<const T*>(&kk);  // padded K rows are not 16-byte aligned
#pragma unroll
      for (int x = 0; x < kVec; ++x) sm.k[j][c + x] = ks[x];
    }
    __syncthreads();
    const int p = tile + lane;  // this lane's key
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + i * kWarps;
      if (r >= rows) break;
      if (tile > hi[i] || tile + kKeys <= lo[i]) continue;
      float s = 0.0f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) s += sm.q[r][d] * to_f(sm.k[lane][d]);
      const bool valid = p >= lo[i] && p <= hi[i];
      s = valid ? s : -FLT_MAX;
      const float m_new = fmaxf(m[i], warp_max(s));
      const float pr = valid ? __expf(s - m_new) : 0.0f;
      const float alpha = __expf(m[i] - m_new);
      l[i] = l[i] * alpha + warp_sum(pr);
      m[i] = m_new;
#pragma unroll
      for (int j = 0; j < kSlice; ++j) acc[i][j] *= alpha;
      const int jmax = min(kKeys, hi[i] - tile + 1);
      for (int j = max(0, lo[i] - tile); j < jmax; ++j) {
        const float pj = __shfl_sync(0xffffffffu, pr, j);
#pragma unroll
        for (int x = 0; x < kSlice; ++x) acc[i][x] += pj * to_f(sm.v[j][lane + 32 * x]);
      }
    }
  }

  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    if (r >= rows) break;
    const int token = q0 + w.q_begin + r / group, head = w.kv_head * group + r % group;
    if (w.partial >= 0) {
      float* pr = batch.partials + (static_cast<int64_t>(w.partial) * group + r % group) * (D + kPartialPad);
#pragma unroll
      for (int x = 0; x < kSlice; ++x) pr[lane + 32 * x] = acc[i][x];
      if (lane == 0) {
        pr[D] = l[i] > 0.0f ? m[i] : -FLT_MAX;
        pr[D + 1] = l[i];
      }
    } else {
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      T* o = out + static_cast<int64_t>(token) * num_heads * D + static_cast<int64_t>(head) * D;
#pragma unroll
      for (int x = 0; x < kSlice; ++x) o[lane + 32 * x] = from_f<T>(acc[i][x] * inv);
    }
  }
}

// One warp per (merge group, GQA head): rescales the partials to their common max.
template <typename T, int D>
__global__ void merge_kernel(T* out, AttnBatch batch, int num_heads, int group, int window) {
  constexpr int kSlice = D / 32;
  const int mi = blockIdx.x, r = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (r >= group) return;
  int seq, kv_head, first, count;
  if (batch.decode_splits > 0) {
    const int hkv = num_heads / group;
    seq = mi / hkv;
    kv_head = mi % hkv;
    const DerivedItem d = derived_item(batch, window, hkv, 0, seq, kv_head);  // whole warps: r is the warp
    first = d.first;
    count = d.count;
    if (count == 1) return;  // the single range wrote the output itself
  } else {
    const int* mg = batch.merge + 4 * mi;
    seq = mg[0];
    kv_head = mg[1];
    first = mg[2];
    count = mg[3];
  }
  float m = -FLT_MAX;
  for (int k = 0; k < count; ++k) {
    const float* pr = batch.partials + (static_cast<int64_t>(first + k) * group + r) * (D + kPartialPad);
    if (pr[D + 1] > 0.0f) m = fmaxf(m, pr[D]);
  }
  // Explicit fmaf (what contraction made of `l += pr * f` anyway): merge_in_cta (common.cuh),
  // the decode kernels' own merge, repeats this arithmetic in this order, bit for bit.
  float l = 0.0f, acc[kSlice] = {};
  for (int k = 0; k < count; ++k) {
    const float* pr = batch.partials + (static_cast<int64_t>(first + k) * group + r) * (D + kPartialPad);
    if (!(pr[D + 1] > 0.0f)) continue;
    const float f = __expf(pr[D] - m);
    l = fmaf(pr[D + 1], f, l);
#pragma unroll
    for (int x = 0; x < kSlice; ++x) acc[x] = fmaf(pr[lane + 32 * x], f, acc[x]);
  }
  const int token = batch.query_start[seq];
  T* o = out + static_cast<int64_t>(token) * num_heads * D + static_cast<int64_t>(kv_head * group + r) * D;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int x = 0; x < kSlice; ++x) o[lane + 32 * x] = from_f<T>(acc[x] * inv);
}

template <typename T, int D>
void launch(const void* q, int64_t q_stride, void* out, KVCache kv, int layer, const AttnBatch& b, int num_heads,
            float scale, int window, cudaStream_t stream) {
  const size_t smem = sizeof(Smem<T, D>);
  static bool configured = false;  // per instantiation; raising the limit is idempotent
  if (!configured) {
    cudaFuncSetAttribute(attention_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    configured = true;
  }
  const int group = num_heads / kv.num_kv_heads;
  const int tail = b.tail_items();
  const int num_items = b.decode_splits > 0 ? b.num_seqs * kv.num_kv_heads * (b.decode_splits + tail) : b.num_work;
  // Single-token items go to the decode kernel when it covers the group size.
  const int num_decode = group > kDecodeMaxGroup ? 0 : (b.decode_splits > 0 ? num_items : b.num_decode_work);
  const int num_merges =
      b.decode_splits > 0 ? (b.decode_splits > 1 ? b.num_seqs * kv.num_kv_heads : 0) : b.num_merges;
  // Merges the decode kernel does itself (AttnBatch::split_counters): a work list's first
  // num_decode_merges, or every derived one; merge_kernel takes the rest.
  // K25_SPLIT_MERGE=kernel (read at every call) leaves them all to merge_kernel: tests
  // compare the two paths bit for bit.
  const char* env = std::getenv("K25_SPLIT_MERGE");
  const bool merge_launch_only = env != nullptr && std::strcmp(env, "kernel") == 0;
  int fused = 0;
  if (num_decode > 0 && b.split_counters != nullptr && !merge_launch_only) {
    fused = b.decode_splits > 0 ? (b.decode_splits + tail <= kMaxFusedSplits ? num_merges : 0)
                                : std::min(b.num_decode_merges, num_merges);
  }
  if (num_decode > 0) {
    AttnBatch db = b;
    if (fused == 0) db.split_counters = nullptr;  // the decode kernel writes partials only
    decode_attention(dtype_of<T>(), q, q_stride, out, kv, layer, db, num_heads, scale, window, num_decode, stream);
  }
  // A work list's other items (prefill chunks) take tensor cores in bf16 / fp16; float32
  // and the device-derived form keep the CUDA-core kernel.
  const bool tensor_cores = !std::is_same_v<T, float> && b.decode_splits <= 0;
  if (num_items > num_decode && tensor_cores) {
    prefill_attention(dtype_of<T>(), q, q_stride, out, kv, layer, b, num_heads, scale, window, num_decode,
                      num_items - num_decode, stream);
  } else if (num_items > num_decode) {
    AttnBatch rest = b;
    if (b.decode_splits <= 0) {
      rest.work = b.work + num_decode;
      rest.num_work = b.num_work - num_decode;
    }
    attention_kernel<T, D><<<num_items - num_decode, kThreads, smem, stream>>>(
        static_cast<const T*>(q), q_stride, static_cast<T*>(out), kv, layer, rest, num_heads, scale, window);
  }
  if (num_merges > fused) {  // derived splits: fused is all or nothing
    AttnBatch mb = b;
    if (b.decode_splits <= 0) mb.merge = b.merge + 4 * fused;
    merge_kernel<T, D><<<num_merges - fused, 32 * group, 0, stream>>>(static_cast<T*>(out), mb, num_heads, group,
                                                                      window);
  }
}

}  // namespace

void paged_attention(DType t, const void* q, int64_t q_stride, void* out, KVCache kv, int32_t layer,
                     const AttnBatch& batch, int32_t num_heads, float scale, int32_t window, cudaStream_t stream) {
  switch (kv.head_dim) {
    case 64:
      K25_DISPATCH_DTYPE(t, launch<T, 64>(q, q_stride, out, kv, layer, batch, num_heads, scale, window, stream));
      break;
    case 128:
      K25_DISPATCH_DTYPE(t, launch<T, 128>(q, q_stride, out, kv, layer, batch, num_heads, scale, window, stream));
      break;
    default:
      break;  // rejected by the launcher's caller (supported head dims: 64, 128)
  }
}

}  // namespace k25::cuda
