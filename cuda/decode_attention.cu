// Paged attention for single-token (decode) queries: the memory-bound case.
//
// One CTA per (sequence, KV head, key range). A decode reads every cached key and value
// of its range once, so both kernels here are built around keeping many 16-byte loads in
// flight while spending as few instructions as possible per byte. The GQA group's query
// rows (up to kDecodeMaxGroup = 8) share every K/V load.
//
// bf16 / fp16 run on tensor cores (tc::decode_tc_kernel, described at its namespace);
// float32 keeps the CUDA-core kernel below.
//
// Split-KV: a CTA with a key range writes a partial (unnormalised accumulators, max, sum).
// With batch.split_counters set, both kernels also merge them: each split CTA counts itself
// on its merge's counter after its partial (fence, then atomicAdd), and the last one reads
// the merge's partials and writes the output (merge_in_cta, common.cuh: merge_kernel's
// arithmetic), so a decode-only batch needs no merge launch.
//
// CUDA-core kernel: a key row of D elements is spread over D / (16 / sizeof(T)) lanes, so
// one warp-wide load instruction covers 32 / that many keys, and each lane issues kLoads
// such loads for K and for V before it uses any of them.
//
// Per iteration a warp takes kKeysPerIter keys: every lane forms its partial dot products
// (kLoads keys x G rows over its 16 bytes of the head), and a transposing butterfly sums
// them over the key's lanes in about kLoads * G shuffles rather than kLoads * G * log2
// lanes. The scores go to a small per-warp shared buffer, every lane reads them back to
// update the rows' running max (so the max is uniform over the warp and needs no
// shuffles) and exponentiates only its own keys. Each lane keeps its rows' accumulator
// slice (G x 16 bytes of the head) and a partial softmax sum over its own keys; the
// lanes of one slice, then the warps, are combined once at the end.
#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"

namespace k25::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// One element (row r, channel d) of a decode item's result, from the warps' merged sum
// `a`, softmax sum `lsum` and max `mx` (log2 units): an unnormalised partial for a
// split-KV merge (max in natural-log units, as the merge works), or the output in T.
template <typename T, int D>
__device__ __forceinline__ void store_result(const AttnBatch& batch, const AttnWork& w, T* out, int token,
                                             int num_heads, int group, int r, int d, float a, float lsum, float mx) {
  if (w.partial >= 0) {
    float* pr = batch.partials + (static_cast<int64_t>(w.partial) * group + r) * (D + kPartialPad);
    pr[d] = a;
    if (d == 0) {
      pr[D] = lsum > 0.0f ? mx * kLn2 : -FLT_MAX;
      pr[D + 1] = lsum;
    }
  } else {
    out[static_cast<int64_t>(token) * num_heads * D + static_cast<int64_t>(w.kv_head * group + r) * D + d] =
        from_f<T>(lsum > 0.0f ? a / lsum : 0.0f);
  }
}
constexpr int kLoads = 4;   // K (and V) 16-byte pieces per lane per iteration
constexpr int kStages = 4;  // ring slots per warp (iterations of loads in flight + 1)
constexpr int kSlotVecs = 2 * kLoads * 32;  // 16-byte pieces per slot: K then V, by lane
constexpr size_t kRingBytes = static_cast<size_t>(kWarps) * kStages * kSlotVecs * 16;

template <typename T, int D, int G>
struct Cfg {
  static constexpr int kVec = 16 / sizeof(T);                 // elements per lane per key
  static constexpr int kLanesPerKey = D / kVec;               // lanes sharing one key
  static constexpr int kKeysPerLoad = 32 / kLanesPerKey;      // keys per warp-wide load
  static constexpr int kKeysPerIter = kKeysPerLoad * kLoads;  // keys per warp iteration
  static constexpr int kVals = kLoads * G;                    // partial dots per lane
  // After the butterfly each lane holds this many fully summed scores.
  static constexpr int kKept = kVals >= kLanesPerKey ? kVals / kLanesPerKey : 1;
  static_assert(kLanesPerKey <= 32 && 32 % kLanesPerKey == 0, "a key must fit one warp");
  static_assert((kVals & (kVals - 1)) == 0, "the butterfly halves a power of two");
};

// The 16 bytes of one load as floats (a template, so the element types the kernel is not
// instantiated for leave no unused overloads behind).
template <typename T>
__device__ __forceinline__ void to_floats(const int4& raw, float* f) {
  if constexpr (std::is_same_v<T, float>) {
    const float* p = reinterpret_cast<const float*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = p[i];
  } else {
    using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    const T2* p = reinterpret_cast<const T2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = to_f(p[i].x);
      f[2 * i + 1] = to_f(p[i].y);
    }
  }
}

// Sums N values over the lanes that differ in the bits below 2 * O. Each step sends half of
// the values still held and keeps the other half, so the work halves as the sums complete;
// `first` becomes the index of the first value this lane ends with.
template <int N, int O>
__device__ __forceinline__ void butterfly(float* s, int lane, int& first) {
  if constexpr (O >= 1) {
    if constexpr (N > 1) {
      constexpr int H = N / 2;
      const bool up = (lane & O) != 0;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        const float send = up ? s[i] : s[i + H];
        const float keep = up ? s[i + H] : s[i];
        s[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
      }
      if (up) first += H;
      butterfly<H, O / 2>(s, lane, first);
    } else {
      s[0] += __shfl_xor_sync(0xffffffffu, s[0], O);
      butterfly<1, O / 2>(s, lane, first);
    }
  }
}

template <typename T, int D, int G>
struct DecodeSmem {
  __align__(16) float scores[kWarps][Cfg<T, D, G>::kKeysPerIter][G];
  float acc[kWarps][G][D];
  float m[kWarps][G], l[kWarps][G];
};

template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(const T* q, int64_t q_stride, T* out, KVCache kv,
                                                                    int layer, AttnBatch batch, int num_heads,
                                                                    float scale, int window) {
  using C = Cfg<T, D, G>;
  constexpr int kVec = C::kVec, LPK = C::kLanesPerKey, KPL = C::kKeysPerLoad, KPI = C::kKeysPerIter;
  __shared__ DecodeSmem<T, D, G> sm;
  extern __shared__ __align__(16) unsigned char ring_raw[];

  SplitMerge split;  // the merge this CTA's partial takes part in: read early, used at the end
  const AttnWork w = attn_work(batch, kv.num_kv_heads, window, blockIdx.x, &split);
  if (w.partial == kNoWork) return;  // uniform over the CTA: before any barrier
  const int group = num_heads / kv.num_kv_heads;
  const int token = batch.query_start[w.seq];
  const int ctx = batch.context_lens[w.seq];
  const int lo = max(window > 0 ? max(0, ctx - window) : 0, w.key_begin);
  const int hi = min(ctx - 1, w.key_end - 1);
  const int* table = table_of(batch, w.seq, w.kv_head, kv.num_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slice = lane % LPK;  // which 16 bytes of the head this lane holds
  const int sub = lane / LPK;    // which key of a warp-wide load

  // This lane's slice of the group's query rows, pre-scaled.
  float qf[G][kVec];
#pragma unroll
  for (int r = 0; r < G; ++r) {
    if (r < group) {
      const int4 raw = *reinterpret_cast<const int4*>(q + static_cast<int64_t>(token) * q_stride +
                                                      static_cast<int64_t>(w.kv_head * group + r) * D + slice * kVec);
      to_floats<T>(raw, qf[r]);
#pragma unroll
      for (int x = 0; x < kVec; ++x) qf[r][x] *= scale * kLog2e;  // scores in log2 units: exp2
    } else {
#pragma unroll
      for (int x = 0; x < kVec; ++x) qf[r][x] = 0.0f;
    }
  }

  float m[G], l[G], acc[G][kVec];
#pragma unroll
  for (int r = 0; r < G; ++r) {
    m[r] = -FLT_MAX;
    l[r] = 0.0f;
#pragma unroll
    for (int x = 0; x < kVec; ++x) acc[r][x] = 0.0f;
  }

  const T* cache = static_cast<const T*>(kv.data);
  const int64_t head_elems = static_cast<int64_t>(kv.block_size) * D;
  const int64_t block_elems = static_cast<int64_t>(kv.num_layers) * 2 * kv.num_kv_heads * head_elems;
  const int64_t k_base = (static_cast<int64_t>(layer) * 2 * kv.num_kv_heads + w.kv_head) * head_elems + slice * kVec;
  const int64_t v_base = k_base + kv.num_kv_heads * head_elems;

  // K/V move through a per-warp ring of kStages shared-memory slots with cp.async, so
  // kStages - 1 iterations of loads are in flight while one is computed. Each lane reads
  // back only the 16-byte pieces it copied itself: waiting on its own copy groups is
  // enough, no barrier.
  int4* ring = reinterpret_cast<int4*>(ring_raw) + warp * kStages * kSlotVecs;
  const bool pow2 = (kv.block_size & (kv.block_size - 1)) == 0;  // the usual case: shifts, not divisions
  const int bs_shift = __ffs(kv.block_size) - 1;
  const int stride = kWarps * KPI;
  const int first_base = lo + warp * KPI;
  const int iters = first_base <= hi ? (hi - first_base) / stride + 1 : 0;
  auto issue = [&](int it) {
    int4* slot = ring + (it % kStages) * kSlotVecs;
    const int base = first_base + it * stride;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int p = base + k * KPL + sub;
      const bool ok = it < iters && p <= hi;
      const int blk = pow2 ? p >> bs_shift : p / kv.block_size;
      const int64_t in_block = static_cast<int64_t>(p - blk * kv.block_size) * D;
      const T* row = ok ? block_start<T>(kv, table[blk], block_elems) + in_block : cache;
      cp_async16(smem_u32(slot + k * 32 + lane), row + k_base, ok);
      cp_async16(smem_u32(slot + (kLoads + k) * 32 + lane), row + v_base, ok);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int it = 0; it < kStages - 1; ++it) issue(it);

  for (int it = 0; it < iters; ++it) {
    issue(it + kStages - 1);  // refills the slot consumed by the previous iteration
    cp_async_wait<kStages - 1>();
    const int4* slot = ring + (it % kStages) * kSlotVecs;
    const int base = first_base + it * stride;
    int4 kr[kLoads], vr[kLoads];
    bool valid[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      valid[k] = base + k * KPL + sub <= hi;
      kr[k] = slot[k * 32 + lane];
      vr[k] = slot[(kLoads + k) * 32 + lane];
    }
    // Partial dot products, index k * G + r.
    float s[C::kVals];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      float kf[kVec];
      to_floats<T>(kr[k], kf);
#pragma unroll
      for (int r = 0; r < G; ++r) {
        float d = 0.0f;
#pragma unroll
        for (int x = 0; x < kVec; ++x) d = fmaf(qf[r][x], kf[x], d);
        s[k * G + r] = d;
      }
    }
    // Transposing butterfly over the key's lanes.
    int first = 0;
    butterfly<C::kVals, LPK / 2>(s, lane, first);
    // s[0 .. kKept) now hold the sums of indices first .. first + kKept.
#pragma unroll
    for (int j = 0; j < C::kKept; ++j) {
      const int idx = first + j, k = idx / G, r = idx % G;
      const int p = base + k * KPL + sub;
      sm.scores[warp][k * KPL + sub][r] = p <= hi ? s[j] : -FLT_MAX;
    }
    __syncwarp();
    // Every lane: the rows' new max over the iteration's keys (row-adjacent reads, which
    // the compiler merges into vector loads).
    float mx[G], alpha[G];
#pragma unroll
    for (int r = 0; r < G; ++r) mx[r] = m[r];
#pragma unroll
    for (int key = 0; key < KPI; ++key) {
#pragma unroll
      for (int r = 0; r < G; ++r) mx[r] = fmaxf(mx[r], sm.scores[warp][key][r]);
    }
#pragma unroll
    for (int r = 0; r < G; ++r) {
      alpha[r] = exp2f(m[r] - mx[r]);
      m[r] = mx[r];
      l[r] *= alpha[r];
#pragma unroll
      for (int x = 0; x < kVec; ++x) acc[r][x] *= alpha[r];
    }
    // Own keys: probabilities and the V accumulation.
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      float vf[kVec];
      to_floats<T>(vr[k], vf);
#pragma unroll
      for (int r = 0; r < G; ++r) {
        const float pr = valid[k] ? exp2f(sm.scores[warp][k * KPL + sub][r] - m[r]) : 0.0f;
        l[r] += pr;
#pragma unroll
        for (int x = 0; x < kVec; ++x) acc[r][x] = fmaf(pr, vf[x], acc[r][x]);
      }
    }
    __syncwarp();  // the score buffer is reused by the next iteration
  }

  cp_async_wait<0>();  // no copy may land after the kernel's shared memory is reused

  // Lanes holding the same slice of different keys share m: add them up.
#pragma unroll
  for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
    for (int r = 0; r < G; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], o);
#pragma unroll
      for (int x = 0; x < kVec; ++x) acc[r][x] += __shfl_xor_sync(0xffffffffu, acc[r][x], o);
    }
  }
  if (sub == 0) {
#pragma unroll
    for (int r = 0; r < G; ++r) {
#pragma unroll
      for (int x = 0; x < kVec; ++x) sm.acc[warp][r][slice * kVec + x] = acc[r][x];
      if (slice == 0) {
        sm.m[warp][r] = m[r];
        sm.l[warp][r] = l[r];
      }
    }
  }
  __syncthreads();
  // The warps' results, rescaled to their common max.
  for (int e = threadIdx.x; e < group * D; e += kThreads) {
    const int r = e / D, d = e % D;
    float mx = -FLT_MAX;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) mx = fmaxf(mx, sm.m[i][r]);
    float lsum = 0.0f, a = 0.0f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) {
      const float f = sm.l[i][r] > 0.0f ? exp2f(sm.m[i][r] - mx) : 0.0f;
      lsum += sm.l[i][r] * f;
      a += sm.acc[i][r][d] * f;
    }
    store_result<T, D>(batch, w, out, token, num_heads, group, r, d, a, lsum, mx);
  }
  // Split-KV: the merge's last CTA merges it here (the ring is free: every copy has landed).
  if (split.counter >= 0) {
    merge_in_cta<T, D, kThreads, static_cast<int>(kRingBytes)>(batch, split, group, group,
                                 out + static_cast<int64_t>(token) * num_heads * D +
                                     static_cast<int64_t>(w.kv_head * group) * D,
                                 reinterpret_cast<float*>(ring_raw));
  }
}

// CTAs of `kernel` the device runs at once (its SMs x the CTAs per SM at this block size and
// dynamic shared memory): one wave. The caller sets the kernel's attributes first.
template <typename Kernel>
int ctas_per_wave(Kernel kernel, int threads, size_t smem_bytes) {
  int device = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes);
  return std::max(1, sms * per_sm);
}

template <typename T, int D, int G>
void configure() {
  cudaFuncSetAttribute(decode_attention_kernel<T, D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(kRingBytes));
}

template <typename T, int D, int G>
void launch(const void* q, int64_t q_stride, void* out, KVCache kv, int layer, const AttnBatch& b, int num_heads,
            float scale, int window, int num_items, cudaStream_t stream) {
  static bool configured = false;  // per instantiation; raising the limit is idempotent
  if (!configured) {
    configure<T, D, G>();
    configured = true;
  }
  decode_attention_kernel<T, D, G><<<num_items, kThreads, kRingBytes, stream>>>(
      static_cast<const T*>(q), q_stride, static_cast<T*>(out), kv, layer, b, num_heads, scale, window);
}

template <typename T, int D, int G>
int wave() {
  static int blocks = 0;
  if (blocks == 0) {
    configure<T, D, G>();
    blocks = ctas_per_wave(decode_attention_kernel<T, D, G>, kThreads, kRingBytes);
  }
  return blocks;
}

template <typename T, int D>
void launch_group(const void* q, int64_t q_stride, void* out, KVCache kv, int layer, const AttnBatch& b,
                  int num_heads, float scale, int window, int num_items, cudaStream_t stream) {
  const int group = num_heads / kv.num_kv_heads;
  if (group <= 1) {
    launch<T, D, 1>(q, q_stride, out, kv, layer, b, num_heads, scale, window, num_items, stream);
  } else if (group <= 2) {
    launch<T, D, 2>(q, q_stride, out, kv, layer, b, num_heads, scale, window, num_items, stream);
  } else if (group <= 4) {
    launch<T, D, 4>(q, q_stride, out, kv, layer, b, num_heads, scale, window, num_items, stream);
  } else {
    launch<T, D, 8>(q, q_stride, out, kv, layer, b, num_heads, scale, window, num_items, stream);
  }
}

template <typename T, int D>
int wave_group(int group) {
  if (group <= 1) return wave<T, D, 1>();
  if (group <= 2) return wave<T, D, 2>();
  if (group <= 4) return wave<T, D, 4>();
  return wave<T, D, 8>();
}

// ---- Tensor-core kernel (bf16 / fp16, D = 64 or 128) ----
//
// The CUDA-core kernel is issue-bound (about 650 instructions per 4 KB of K/V per warp:
// FMAs, conversions, butterflies), so here the dot products and P V run on m16n8k16
// mma.sync (mma.cuh) and the per-byte work is a few copies, ldmatrix loads and mmas.
//
// The GQA group's query heads are the 16 mma rows: group <= 8 uses rows 0..7 (rows past
// the group have zero q; they are computed and never stored) and rows 8..15 are constant
// zero registers in the A fragments. Half the tensor work is wasted, which costs nothing
// that matters: per 8 KB of K/V a warp issues 32 mmas, far below the tensor pipe's rate
// at HBM speed. S = Q K^T takes K through plain ldmatrix (keys are the n columns), P is
// rounded to T and reused in registers as the A operand of O += P V (the C and A layouts
// line up), V through ldmatrix.trans; the online softmax (FA2) runs per row in registers,
// the row's four lanes (same g) sharing its max by two shuffles.
//
// Each of the 4 warps walks its own tiles, tile i of the item going to warp i % 4 (at a
// ragged end the warps differ by at most one tile), through its own ring of kStages
// shared-memory slots filled with cp.async by its own lanes: no CTA barrier until the
// final merge, so the warps drift freely and a slow tile stalls one warp only. A tile is
// 8 KB of K + V (16 keys at D = 128, 32 at D = 64): 3 slots x 4 warps = 96 KB a CTA, two
// CTAs (8 warps) per SM on sm_90, with 2 tiles = 16 KB a warp, 128 KB an SM, in flight
// while one is computed: several times the ~35 KB an SM needs in flight to stream its
// share of 4.3 TB/s at about a microsecond of loaded latency. Smaller tiles than the
// prefill's keep the ring deep at two CTAs per SM (tails of one CTA overlap the other's
// streaming); the per-tile softmax cost they add is small next to the mmas.
//
// Keys are gathered through the block table row by row, so a tile may start anywhere in
// a block and span several blocks (any block_size). Lane j looks up key j of a tile one
// tile ahead (its table read is in flight during a tile's compute) and the copying lanes
// fetch the row index by shuffle. Keys past the range are zero-filled (a stale slot may
// hold NaN; 0 x NaN would poison the sums) and their scores masked to -inf.
//
// At the end each warp leaves (max, sum, accumulators) of its rows in its own ring and the
// CTA combines the four, exactly as the CUDA-core kernel does, in the same output format.
namespace tc {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 3;         // ring slots per warp: kStages - 1 tiles in flight while one is computed
constexpr int kStageBytes = 8192;  // K + V of one warp tile
constexpr int kWarpBytes = kStages * kStageBytes;
constexpr int kSmemBytes = kWarps * kWarpBytes;
constexpr int kRows = kDecodeMaxGroup;  // query rows used of the 16 (the rest are zero)
static_assert(kRows <= 8, "rows g + 8 of the mma tile are the constant-zero half");

template <int D>
struct Shape {
  static constexpr int kChunks = D / 8;                 // 16-byte chunks per K/V row
  static constexpr int kKeys = kStageBytes / (4 * D);   // keys per tile (K and V, 2 bytes each)
  static constexpr int kTileBytes = kKeys * D * 2;      // the K (or the V) half of a slot
  static constexpr int kRowsPerCopy = 32 / kChunks;     // key rows per warp-wide cp.async
  static constexpr int kCopies = kKeys / kRowsPerCopy;  // cp.async per lane for a tile's K (and V)
  static_assert(kKeys % 16 == 0 && kKeys <= 32, "whole mma k-steps of keys; one lane looks up each key");
  static_assert(32 % kChunks == 0, "whole rows per warp-wide copy");
  // The final merge leaves [kRows][D] accumulators, then kRows maxima and sums, in a ring.
  static_assert(kRows * (D + 2) * 4 <= kWarpBytes, "a warp's merge data fits its ring");
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2)
    decode_tc_kernel(const T* __restrict__ q, int64_t q_stride, T* __restrict__ out, KVCache kv, int layer,
                     AttnBatch batch, int num_heads, float scale, int window) {
  using S = Shape<D>;
  constexpr int CH = S::kChunks, NK = S::kKeys;
  constexpr int NT = NK / 8;  // 8-key column tiles of S
  constexpr int DT = D / 8;   // 8-wide column tiles of O
  extern __shared__ __align__(128) unsigned char smem[];

  // Launched with launch_pdl. In a dense batch (no per-head tables) the work item, the lengths
  // and the first tiles' table entries are read before pdl_wait, so these dependent loads
  // overlap the kernel before (RoPE and the cache write) instead of following it. The
  // precondition: the launch right before writes none of them. Sound in the engine because:
  // the host wrote the lengths, tables and work list before the step (a graph's inputs, the
  // eager plan's upload, both copies on the stream); every launch before the one right before
  // has completed (each of our PDL kernels triggers its dependents only after its own pdl_wait,
  // and a launch without the attribute starts after everything before it); and the one right
  // before (RoPE, or the summary update in a sparse model's window layer) writes q, the step's
  // K/V slots or summaries, which this kernel reads only after the wait. With per-head
  // tables (dynamic sparsity) the selection right before wrote the tables and the kept
  // lengths: wait first. (Issuing the first tiles' copies before the wait too, where they end
  // before the step's own key, measured no better in a RoPE-then-attention chain: RESULTS.)
  const bool early = batch.head_tables == nullptr;
  if (!early) {
    pdl_wait();
    pdl_trigger();
  }
  SplitMerge split;  // the merge this CTA's partial takes part in: read early, used at the end
  const AttnWork w = attn_work(batch, kv.num_kv_heads, window, blockIdx.x, &split);
  if (w.partial == kNoWork) {  // uniform over the CTA: before any barrier
    // Still wait: the grid then completes after the launch before it, as the next kernel's
    // pdl_wait assumes of every launch before it.
    if (early) pdl_wait();
    return;
  }
  const int group = num_heads / kv.num_kv_heads;  // <= kDecodeMaxGroup: the caller's rule
  const int rows = min(group, kRows);
  const int token = batch.query_start[w.seq];
  const int ctx = batch.context_lens[w.seq];
  const int lo = max(window > 0 ? max(0, ctx - window) : 0, w.key_begin);
  const int hi = min(ctx - 1, w.key_end - 1);
  const int num_tiles = hi >= lo ? (hi - lo) / NK + 1 : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int my_tiles = num_tiles > warp ? (num_tiles - 1 - warp) / kWarps + 1 : 0;
  // First key of this warp's j-th tile; every tile's first key is in range.
  auto tile_base = [&](int j) { return lo + (warp + j * kWarps) * NK; };

  // Cache addresses in rows of D elements from the pool's start: 31 bits hold any pool
  // (2^31 rows of at least 128 bytes are 256 GB; the glue checks), and one wide multiply-add
  // makes the pointer.
  const T* cache = static_cast<const T*>(kv.data);
  const int bs = kv.block_size;
  const uint32_t block_rows = static_cast<uint32_t>(kv.num_layers) * 2 * kv.num_kv_heads * bs;
  // Cold blocks (KVCache): rows from the L2 pool's start, marked with kColdRow.
  const T* cold = static_cast<const T*>(kv.cold_data);
  const uint32_t cold_rows = static_cast<uint32_t>(kv.cold_block_elems / D);
  const uint32_t k_row0 = (static_cast<uint32_t>(layer) * 2 * kv.num_kv_heads + w.kv_head) * bs;
  const int64_t v_delta = static_cast<int64_t>(kv.num_kv_heads) * bs * D;  // K row -> its V row, in elements
  const int* table = table_of(batch, w.seq, w.kv_head, kv.num_kv_heads);
  const bool pow2 = (bs & (bs - 1)) == 0;  // the usual case: shifts, not divisions
  const int bs_shift = __ffs(bs) - 1;

  // Lane j < NK: the K row of key j of the warp's j-th tile (0 where there is none).
  auto lookup = [&](int j) -> uint32_t {
    const int p = tile_base(j) + lane;
    if (j >= my_tiles || lane >= NK || p > hi) return 0;
    const int blk = pow2 ? p >> bs_shift : p / bs;
    const int id = table[blk];
    const uint32_t in_block = k_row0 + static_cast<uint32_t>(p - blk * bs);
    return is_cold_block(id) ? kColdRow | (static_cast<uint32_t>(cold_slot_of(id)) * cold_rows + in_block)
                             : static_cast<uint32_t>(id) * block_rows + in_block;
  };
  // Tile j into slot j % kStages: lane copies chunk cc of key rows cr + i * kRowsPerCopy.
  // One commit group per tile, empty past the warp's last: the waits count tiles.
  const uint32_t ring = smem_u32(smem) + warp * kWarpBytes;
  const int cc = lane % CH, cr = lane / CH;
  auto copy = [&](int j, uint32_t key_rows) {
    if (j < my_tiles) {  // uniform over the warp: the shuffles see every lane
      const uint32_t st = ring + (static_cast<unsigned>(j) % kStages) * kStageBytes;
      const int base = tile_base(j);
#pragma unroll
      for (int i = 0; i < S::kCopies; ++i) {
        const int r = cr + i * S::kRowsPerCopy;
        const uint32_t row = __shfl_sync(0xffffffffu, key_rows, r);
        const bool ok = base + r <= hi;  // else row is 0: a valid address, not read
        const T* src = ((row & kColdRow) ? cold : cache) + static_cast<uint64_t>(row & ~kColdRow) * D + cc * 8;
        cp_async16(st + swz<CH>(r, cc), src, ok);
        cp_async16(st + S::kTileBytes + swz<CH>(r, cc), src + v_delta, ok);
      }
    }
    cp_async_commit();
  };

  // The first kStages - 1 tiles, with all their table reads issued before the first copy.
  uint32_t first_rows[kStages - 1];
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) first_rows[j] = lookup(j);
  uint32_t next = lookup(kStages - 1);
  if (early) {
    pdl_wait();  // q and the step's K/V slots are written now
    pdl_trigger();
  }
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) copy(j, first_rows[j]);

  // Q's A fragments: row g at dims 16kd + 2t.. (a0) and 16kd + 8 + 2t.. (a2); rows past the
  // group and rows g + 8 (a1, a3) are zero.
  uint32_t qf[D / 16][4];
  {
    const bool real = g < rows;
    const int head = w.kv_head * group + (real ? g : 0);
    const T* qr = q + static_cast<int64_t>(token) * q_stride + static_cast<int64_t>(head) * D + 2 * t;
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd) {
      qf[kd][0] = real ? *reinterpret_cast<const uint32_t*>(qr + 16 * kd) : 0u;
      qf[kd][2] = real ? *reinterpret_cast<const uint32_t*>(qr + 16 * kd + 8) : 0u;
      qf[kd][1] = qf[kd][3] = 0u;
    }
  }

  const float sl2 = scale * kLog2e;  // scores in log2 units: exp2
  float o[DT][4];
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float mb = -INFINITY, l = 0.0f;  // row g: max score so far (log2 units); this lane's share of the sum

  for (int j = 0; j < my_tiles; ++j) {
    copy(j + kStages - 1, next);   // into the slot of tile j - 1, released by the __syncwarp below
    next = lookup(j + kStages);
    cp_async_wait<kStages - 1>();  // tile j has landed (this lane's copies) ...
    __syncwarp();                  // ... and every lane's
    const uint32_t sk = ring + (static_cast<unsigned>(j) % kStages) * kStageBytes, sv = sk + S::kTileBytes;
    const int base = tile_base(j);

    // S = Q K^T (rows g + 8 stay zero and are ignored).
    float s[NT][4];
    mma_qk<T, D, NK>(s, qf, sk, lane);
    if (base + NK - 1 > hi) {  // the item's last tile: keys past the range
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (base + 8 * n + 2 * t > hi) s[n][0] = -INFINITY;
        if (base + 8 * n + 2 * t + 1 > hi) s[n][1] = -INFINITY;
      }
    }
    // Online softmax of row g. The tile's first key is in range, so the new max is finite
    // and the first tile's alpha is exp2(-inf) = 0.
    float mx = fmaxf(s[0][0], s[0][1]);
#pragma unroll
    for (int n = 1; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][0], s[n][1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mb_new = fmaxf(mb, mx * sl2);
    const float alpha = exp2f(mb - mb_new);
    mb = mb_new;
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      s[n][0] = exp2f(fmaf(s[n][0], sl2, -mb_new));
      s[n][1] = exp2f(fmaf(s[n][1], sl2, -mb_new));
      sum += s[n][0] + s[n][1];
    }
    l = fmaf(l, alpha, sum);
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      o[d][0] *= alpha;
      o[d][1] *= alpha;
    }
    // O += P V. P's A fragment for keys 16kk..16kk+15 is S tiles 2kk (a0) and 2kk + 1 (a2),
    // rows g + 8 zero. B(k = key, n = dim) is V row-major read transposed: matrices keys
    // 16kk + 0..7 and + 8..15 at dims 16jp + 0..7, then the same keys at dims 16jp + 8..15.
#pragma unroll
    for (int kk = 0; kk < NK / 16; ++kk) {
      const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), 0u, pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             0u};
#pragma unroll
      for (int jp = 0; jp < D / 16; ++jp) {
        uint32_t b[4];
        ldsm_x4_trans(b, sv + swz<CH>(16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3), 2 * jp + (lane >> 4)));
        mma16816<T>(o[2 * jp], a, b[0], b[1]);
        mma16816<T>(o[2 * jp + 1], a, b[2], b[3]);
      }
    }
    __syncwarp();  // every lane is done with slot j % kStages before the next copy refills it
  }
  cp_async_wait<0>();  // only empty groups can be pending; none may land in the merge data
  __syncwarp();

  // The warp's rows into its own ring: [kRows][D] accumulators, kRows maxima, kRows sums.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  float* red = reinterpret_cast<float*>(smem + warp * kWarpBytes);
  if (g < rows) {
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      *reinterpret_cast<float2*>(red + g * D + 8 * d + 2 * t) = make_float2(o[d][0], o[d][1]);
    }
    if (t == 0) {
      red[kRows * D + g] = mb;
      red[kRows * D + kRows + g] = l;
    }
  }
  __syncthreads();
  // The warps' results, rescaled to their common max; a warp without keys has sum 0.
  for (int e = threadIdx.x; e < rows * D; e += kThreads) {
    const int r = e / D, d = e % D;
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) {
      const float* ri = reinterpret_cast<const float*>(smem + i * kWarpBytes);
      if (ri[kRows * D + kRows + r] > 0.0f) mx = fmaxf(mx, ri[kRows * D + r]);
    }
    float lsum = 0.0f, a = 0.0f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) {
      const float* ri = reinterpret_cast<const float*>(smem + i * kWarpBytes);
      const float li = ri[kRows * D + kRows + r];
      if (li > 0.0f) {
        const float f = exp2f(ri[kRows * D + r] - mx);
        lsum += li * f;
        a += ri[r * D + d] * f;
      }
    }
    store_result<T, D>(batch, w, out, token, num_heads, group, r, d, a, lsum, mx);
  }
  // Split-KV: the merge's last CTA merges it here (its first barrier ends the reads above
  // of the rings, which become the merge's scratch).
  if (split.counter >= 0) {
    merge_in_cta<T, D, kThreads, kSmemBytes>(batch, split, group, rows,
                                 out + static_cast<int64_t>(token) * num_heads * D +
                                     static_cast<int64_t>(w.kv_head * group) * D,
                                 reinterpret_cast<float*>(smem));
  }
}

template <typename T, int D>
void configure() {
  cudaFuncSetAttribute(decode_tc_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  // All of the unified L1 / shared memory as shared (the K/V copies bypass L1 anyway), so
  // two CTAs fit on an SM.
  cudaFuncSetAttribute(decode_tc_kernel<T, D>, cudaFuncAttributePreferredSharedMemoryCarveout,
                       cudaSharedmemCarveoutMaxShared);
}

template <typename T, int D>
void launch(const void* q, int64_t q_stride, void* out, KVCache kv, int layer, const AttnBatch& b, int num_heads,
            float scale, int window, int num_items, cudaStream_t stream) {
  static bool configured = false;  // per instantiation; the attributes are idempotent
  if (!configured) {
    configure<T, D>();
    configured = true;
  }
  launch_pdl(decode_tc_kernel<T, D>, num_items, kThreads, kSmemBytes, stream, static_cast<const T*>(q), q_stride,
             static_cast<T*>(out), kv, layer, b, num_heads, scale, window);
}

// One kernel serves every group (the rows are runtime), so one occupancy for all.
template <typename T, int D>
int wave() {
  static int blocks = 0;
  if (blocks == 0) {
    configure<T, D>();
    blocks = ctas_per_wave(decode_tc_kernel<T, D>, kThreads, kSmemBytes);
  }
  return blocks;
}

}  // namespace tc

}  // namespace

int32_t decode_attention_wave(DType t, int32_t head_dim, int32_t group) {
  int n = 0;
  if (head_dim == 64) {
    n = t == DType::kBF16  ? tc::wave<__nv_bfloat16, 64>()
        : t == DType::kF16 ? tc::wave<__half, 64>()
                           : wave_group<float, 64>(group);
  } else if (head_dim == 128) {
    n = t == DType::kBF16  ? tc::wave<__nv_bfloat16, 128>()
        : t == DType::kF16 ? tc::wave<__half, 128>()
                           : wave_group<float, 128>(group);
  }
  return n > 0 ? n : 1;
}

void decode_attention(DType t, const void* q, int64_t q_stride, void* out, KVCache kv, int32_t layer,
                      const AttnBatch& batch, int32_t num_heads, float scale, int32_t window, int32_t num_items,
                      cudaStream_t stream) {
  if (num_items <= 0) return;
  // bf16 / fp16 on tensor cores; float32 on the CUDA-core kernel.
  switch (kv.head_dim) {
    case 64:
      if (t == DType::kBF16) {
        tc::launch<__nv_bfloat16, 64>(q, q_stride, out, kv, layer, batch, num_heads, scale, window, num_items, stream);
      } else if (t == DType::kF16) {
        tc::launch<__half, 64>(q, q_stride, out, kv, layer, batch, num_heads, scale, window, num_items, stream);
      } else {
        launch_group<float, 64>(q, q_stride, out, kv, layer, batch, num_heads, scale, window, num_items, stream);
      }
      break;
    case 128:
      if (t == DType::kBF16) {
        tc::launch<__nv_bfloat16, 128>(q, q_stride, out, kv, layer, batch, num_heads, scale, window, num_items,
                                       stream);
      } else if (t == DType::kF16) {
        tc::launch<__half, 128>(q, q_stride, out, kv, layer, batch, num_heads, scale, window, num_items, stream);
      } else {
        launch_group<float, 128>(q, q_stride, out, kv, layer, batch, num_heads, scale, window, num_items, stream);
      }
      break;
    default:
      break;  // rejected by the launcher's caller (supported head dims: 64, 128)
  }
}

}  // namespace k25::cuda
