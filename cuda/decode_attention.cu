// Paged attention for single-token (decode) queries: the memory-bound case.
//
// One CTA per (sequence, KV head, key range). A decode reads every cached key and value
// of its range once, so the kernel is built around keeping many 16-byte loads in flight:
// a key row of D elements is spread over D / (16 / sizeof(T)) lanes (16 for bf16 with
// D = 128), so one warp-wide load instruction covers 32 / that many keys, and each lane
// issues kLoads such loads for K and for V before it uses any of them. The GQA group's
// query rows (up to G = 8) share every K/V load.
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

#include "common.cuh"

namespace k25::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
constexpr int kLoads = 4;   // K (and V) 16-byte pieces per lane per iteration
constexpr int kStages = 4;  // ring slots per warp (iterations of loads in flight + 1)
constexpr int kSlotVecs = 2 * kLoads * 32;  // 16-byte pieces per slot: K then V, by lane
constexpr size_t kRingBytes = static_cast<size_t>(kWarps) * kStages * kSlotVecs * 16;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

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

__device__ __forceinline__ void to_floats(const int4& raw, float* f, float) {
  const float* p = reinterpret_cast<const float*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = p[i];
}
__device__ __forceinline__ void to_floats(const int4& raw, float* f, __half) {
  const __half2* p = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void to_floats(const int4& raw, float* f, __nv_bfloat16) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
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

  const AttnWork w = attn_work(batch, kv.num_kv_heads, window, blockIdx.x);
  if (w.partial == kNoWork) return;  // uniform over the CTA: before any barrier
  const int group = num_heads / kv.num_kv_heads;
  const int token = batch.query_start[w.seq];
  const int ctx = batch.context_lens[w.seq];
  const int lo = max(window > 0 ? max(0, ctx - window) : 0, w.key_begin);
  const int hi = min(ctx - 1, w.key_end - 1);
  const int* table = batch.block_tables + static_cast<int64_t>(w.seq) * batch.max_blocks;
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
      to_floats(raw, qf[r], T{});
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
      const int64_t off = ok ? table[blk] * block_elems + static_cast<int64_t>(p - blk * kv.block_size) * D : 0;
      cp_async16(slot + k * 32 + lane, cache + k_base + off, ok);
      cp_async16(slot + (kLoads + k) * 32 + lane, cache + v_base + off, ok);
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
      to_floats(kr[k], kf, T{});
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
      to_floats(vr[k], vf, T{});
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
    if (w.partial >= 0) {
      float* pr = batch.partials + (static_cast<int64_t>(w.partial) * group + r) * (D + 2);
      pr[d] = a;
      if (d == 0) {
        pr[D] = lsum > 0.0f ? mx * kLn2 : -FLT_MAX;  // the merge works in natural-log units
        pr[D + 1] = lsum;
      }
    } else {
      out[static_cast<int64_t>(token) * num_heads * D + static_cast<int64_t>(w.kv_head * group + r) * D + d] =
          from_f<T>(lsum > 0.0f ? a / lsum : 0.0f);
    }
  }
}

template <typename T, int D, int G>
void launch(const void* q, int64_t q_stride, void* out, KVCache kv, int layer, const AttnBatch& b, int num_heads,
            float scale, int window, int num_items, cudaStream_t stream) {
  static bool configured = false;  // per instantiation; raising the limit is idempotent
  if (!configured) {
    cudaFuncSetAttribute(decode_attention_kernel<T, D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(kRingBytes));
    configured = true;
  }
  decode_attention_kernel<T, D, G><<<num_items, kThreads, kRingBytes, stream>>>(
      static_cast<const T*>(q), q_stride, static_cast<T*>(out), kv, layer, b, num_heads, scale, window);
}

template <typename T, int D, int G>
int wave() {
  static int blocks = 0;
  if (blocks == 0) {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaFuncSetAttribute(decode_attention_kernel<T, D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(kRingBytes));
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_attention_kernel<T, D, G>, kThreads, kRingBytes);
    blocks = std::max(1, sms * per_sm);
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

}  // namespace

int32_t decode_attention_wave(DType t, int32_t head_dim, int32_t group) {
  int n = 0;
  if (head_dim == 64) {
    K25_DISPATCH_DTYPE(t, n = wave_group<T, 64>(group));
  } else if (head_dim == 128) {
    K25_DISPATCH_DTYPE(t, n = wave_group<T, 128>(group));
  }
  return n > 0 ? n : 1;
}

void decode_attention(DType t, const void* q, int64_t q_stride, void* out, KVCache kv, int32_t layer,
                      const AttnBatch& batch, int32_t num_heads, float scale, int32_t window, int32_t num_items,
                      cudaStream_t stream) {
  if (num_items <= 0) return;
  switch (kv.head_dim) {
    case 64:
      K25_DISPATCH_DTYPE(t, launch_group<T, 64>(q, q_stride, out, kv, layer, batch, num_heads, scale, window,
                                                num_items, stream));
      break;
    case 128:
      K25_DISPATCH_DTYPE(t, launch_group<T, 128>(q, q_stride, out, kv, layer, batch, num_heads, scale, window,
                                                 num_items, stream));
      break;
    default:
      break;  // rejected by the launcher's caller (supported head dims: 64, 128)
  }
}

}  // namespace k25::cuda
