// Paged prefill attention for Hopper (sm_90a) on warpgroup MMA (wgmma.mma_async), bf16 / fp16,
// head_dim 128. Same work items, masks, numerics and output formats as prefill_attention.cu
// (the mma.sync kernel, which every other GPU, dtype and head size keeps using).
//
// Why a second kernel: on the H200 mma.sync tops out far below the tensor cores' rate (the
// mma.sync kernel reaches ~266 TFLOP/s on causal 16K against SDPA's ~650). wgmma reads its B
// operand (and optionally A) straight from shared memory through a descriptor, runs
// asynchronously to the issuing warps, and is what Hopper's full rate needs.
//
// Shape of a CTA (384 threads = 3 warpgroups, one CTA per work item of up to 128 rows):
//  - warpgroup 0, the producer: gathers Q once and then K/V tiles of kKeys = 128 keys row by
//    row through the block table with cp.async (16-token pages rule out one TMA box per tile)
//    into two rings (K and V) of kStages = 3 stages each, and hands each K tile and each V
//    tile to the consumers through its own mbarriers.
//    It gives most of its registers away (setmaxnreg) since it only computes addresses.
//  - warpgroups 1 and 2, the consumers: 64 rows each (wgmma's M). Per key tile:
//        S = Q K^T          (wgmma, A = Q and B = K from shared memory, fp32 accumulators)
//        online softmax on S in registers (exp2, scale * log2(e) folded in one FMA)
//        O += P V           (wgmma, A = P rounded to T from registers, B = V from shared memory)
//    and the S of tile j is issued together with the P V of tile j - 1, so the softmax of
//    tile j runs on the CUDA cores while the tensor cores do the P V product of tile j - 1
//    (FlashAttention-3's intra-warpgroup overlap). The two consumer warpgroups take turns
//    issuing their products (named barriers 1 and 2, FA3's ping-pong), so one's softmax
//    also runs under the other's matrix products.
//
// Shared memory (1024-byte aligned; 224 KB + barriers, one CTA per SM):
//   Q: 128 rows x 128 dims, then 3 K tiles, then 3 V tiles (each 128 keys x 128 dims).
// Every tile is stored as two 64-column halves ([half][row][64 elements], 128-byte rows) in
// the 128-byte swizzle that wgmma's descriptors describe: the 16-byte chunk c (0..7) of row r
// of a half sits at chunk c ^ (r % 8). The hardware applies the swizzle to address bits
// (bits 4-6 ^= bits 7-9), so every tile half starts at a multiple of 1024 bytes.
//
// Descriptors (64-bit; fields in 16-byte units): start address bits 0-13, leading byte offset
// (LBO) bits 16-29, stride byte offset (SBO) bits 32-45, swizzle mode bits 62-63 (1 = 128B).
//  - Q (A) and K (B) are K-major (the reduction dimension, head_dim, is contiguous): SBO =
//    1024 bytes between groups of 8 rows; LBO is unused for swizzled K-major layouts (set to
//    1). A k16 step inside a 64-column half advances the start address by 32 bytes (the
//    swizzle is applied after the address arithmetic, so this addresses logical chunks
//    2kk, 2kk + 1 of every row); steps 4..7 use the second half.
//  - V (B of P V) is [key][dim]: N = dim contiguous, i.e. MN-major, read with the transpose
//    bit (allowed for 16-bit types). In the MN-major canonical layout an atom is 64 N-elements
//    (128 bytes) x 8 K-rows; LBO = 16384 bytes is the stride between atoms along N (the two
//    dim halves), SBO = 1024 bytes the stride between groups of 8 keys, and a k16 step (16
//    keys) advances the start address by 2048 bytes. So V is stored exactly like K.
//
// Accumulator layout of m64nNk16 (fp32), per warp w of the warpgroup (rows 16w..16w+15),
// lane = 4g + t: d[4i + 0..1] = (row g, cols 8i + 2t, + 1), d[4i + 2..3] = (row g + 8, same
// cols). The register A operand (16-bit) of a k16 step: a0 = (g, 2t..2t+1), a1 = (g + 8,
// 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..) — so P's A fragment for keys
// 16kk..16kk+15 is S's d[8kk .. 8kk + 7] rounded pairwise, with no data movement.
//
// Synchronisation:
//  - Each producer thread publishes its copies of a tile with cp.async.mbarrier.arrive.noinc
//    on the K or V stage's "full" barrier (count 128, one arrival per producer thread): the barrier
//    completes once every copy has landed, and the producer never waits for its own copies,
//    so it runs up to kStages tiles ahead. cp.async writes through the generic proxy while
//    wgmma reads shared memory through the async proxy: every consumer thread issues
//    fence.proxy.async after its wait on a "full" barrier (and on Q's), before its wgmma.
//  - A consumer warp arrives on the stage's "empty" barrier (count 8, one per consumer warp)
//    once wgmma.wait_group says the products reading that stage are complete (for K: S of
//    that tile, mid-iteration; for V: P V, one iteration later); the producer
//    waits on it before refilling the stage. Every consumer warp waits for and releases
//    every tile in order, also the tiles its rows skip, so barrier phases never mix.
//  - The consumers' turns: see "Ping-pong" in the kernel (every consumer warpgroup takes
//    exactly num_tiles + 1 turns, so the named barriers' counts always match).
//  - wgmma.fence before each batch of wgmma (their accumulator and A registers were written
//    by ordinary instructions), commit_group after each product, wait_group before reading
//    accumulators. Empty asm statements that "modify" the accumulator arrays pin the
//    compiler's ordering of register reads/writes to these points.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define K25_SM90A 1
#endif

namespace k25::cuda {

namespace {

constexpr int kD = 128;           // head_dim (the only size this kernel takes)
constexpr int kRows = 128;        // rows per CTA: 2 consumer warpgroups x 64
constexpr int kKeys = 128;        // keys per tile
constexpr int kStages = 3;        // depth of the K ring and of the V ring (separate barriers)
constexpr int kThreads = 384;     // producer warpgroup + 2 consumer warpgroups
static_assert(kRows == kPrefillRows, "one work item per CTA: the planner's rows per item");

constexpr uint32_t kHalfBytes = kRows * 128;             // 64 columns x 128 rows (= keys)
constexpr uint32_t kTileBytes = 2 * kHalfBytes;          // Q, one K or one V tile: 32 KB
constexpr uint32_t kKOff = kTileBytes;                   // Q at offset 0, then the K ring,
constexpr uint32_t kVOff = kKOff + kStages * kTileBytes; // then the V ring
constexpr uint32_t kBarOff = kVOff + kStages * kTileBytes;  // k_full[3], v_full[3], k_empty[3], v_empty[3], q_full
constexpr uint32_t kSmemBytes = kBarOff + 128 + 1024;    // + slack to align the base to 1024
static_assert(kKeys == kRows, "tiles of Q, K and V share one layout");
static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA on sm_90");

#ifdef K25_SM90A

constexpr int kProducerRegs = 56;   // setmaxnreg budgets: 128 * 56 + 256 * 224 = 64512,
constexpr int kConsumerRegs = 224;  // the 168 x 384 the launch bounds give the CTA
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLazyRescaleLog2 = 8.0f;  // see softmax: P < 2^8 between rescales

// Byte offset of 16-byte chunk c (0..15, 8 elements each) of row r in a swizzled tile.
__device__ __forceinline__ constexpr uint32_t tile_off(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * kHalfBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 16 : 0));
}
// Arrives (without raising the expected count: the barrier's count includes it) on an
// mbarrier once all of this thread's earlier cp.async copies have landed, so the producer
// never waits for its own copies.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Orders generic-proxy shared-memory accesses (the cp.async writes this thread has observed
// through a barrier, or its own stores) with its later / earlier async-proxy accesses (the
// wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Returns once the barrier's phase of the given parity has completed (acquire).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The compiler sees a wgmma as reading and writing its accumulators at the issuing
// instruction; these empty statements "modify" the registers so that no read or write of
// them is moved across a wait_group or a fence.
__device__ __forceinline__ void reg_fence(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void reg_fence(uint32_t (&a)[8][4]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
  }
}

// Shared-memory matrix descriptor: 128-byte swizzle, offsets in bytes.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

#define K25_D8(i)                                                                                      \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define K25_D64 K25_D8(0), K25_D8(8), K25_D8(16), K25_D8(24), K25_D8(32), K25_D8(40), K25_D8(48), K25_D8(56)
#define K25_DREGS                                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x 128, fp32) = [d +] A (64 x 16, shared, K-major) * B (16 x 128, shared, K-major).
#define K25_WGMMA_SS(TY)                                                                  \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                        \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " K25_DREGS              \
      ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                   \
      : K25_D64                                                                           \
      : "l"(da), "l"(db), "r"(accumulate))
template <typename T>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    K25_WGMMA_SS("bf16");
  } else {
    K25_WGMMA_SS("f16");
  }
}

// d (64 x 128, fp32) += A (64 x 16, registers) * B (16 x 128, shared, MN-major: transposed).
#define K25_WGMMA_RS(TY)                                                                  \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                        \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " K25_DREGS              \
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                     \
      : K25_D64                                                                           \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))
template <typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    K25_WGMMA_RS("bf16");
  } else {
    K25_WGMMA_RS("f16");
  }
}


// 2^x on the SFU (what exp2f becomes under --use_fast_math, independent of the flag); -inf -> 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

#endif  // K25_SM90A

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_sm90_kernel(const T* __restrict__ q, int64_t q_stride, T* __restrict__ out, KVCache kv, int layer,
                        AttnBatch batch, int num_heads, float scale, int window, int first_item) {
#ifdef K25_SM90A
  extern __shared__ unsigned char smem_raw[];
  // wgmma's swizzle works on absolute address bits: every tile half starts 1024-aligned.
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const uint32_t s_q = base, s_k = base + kKOff, s_v = base + kVOff;
  auto k_full = [&](int s) { return base + kBarOff + 8u * s; };
  auto v_full = [&](int s) { return base + kBarOff + 8u * (kStages + s); };
  auto k_empty = [&](int s) { return base + kBarOff + 8u * (2 * kStages + s); };
  auto v_empty = [&](int s) { return base + kBarOff + 8u * (3 * kStages + s); };
  const uint32_t q_bar = base + kBarOff + 8u * (4 * kStages);

  const AttnWork w = batch.work[first_item + blockIdx.x];
  const int group = num_heads / kv.num_kv_heads;
  const int q0 = batch.query_start[w.seq];
  const int q_len = batch.query_start[w.seq + 1] - q0;
  const int first_pos = batch.context_lens[w.seq] - q_len + w.q_begin;  // position of row 0's token
  const int rows = (w.q_end - w.q_begin) * group;
  // warp through a shuffle from lane 0: the compiler then knows it is warp-uniform (as
  // CUTLASS's canonical_warp_idx_sync does), and so are the consumer's tile loop and stage
  // indices derived from it below, which keeps the wgmma descriptors' arithmetic on the
  // uniform datapath instead of vector registers copied over (R2UR) before every wgmma: the
  // loop went from ~594 to ~449 instructions a warp and tile (SASS, ncu).
  const int tid = threadIdx.x, warp = __shfl_sync(0xffffffffu, tid / 32, 0), lane = tid % 32;

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

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full(s), 128);  // every producer thread publishes its own copies
      mbar_init(v_full(s), 128);
      mbar_init(k_empty(s), 8);   // every consumer warp releases
      mbar_init(v_empty(s), 8);
    }
    mbar_init(q_bar, 128);
  }
  __syncthreads();

  if (warp < 4) {
    // ---------------- producer warpgroup ----------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    // Thread p copies chunk c = p % 16 of rows r0 + 8k (k = 0..15) of every tile: all its rows
    // share r % 8 = r0, so its destinations are one offset plus k * 1024.
    const int c = tid & 15, r0 = tid >> 4;
    const uint32_t dst0 = tile_off(r0, c);
    for (int k = 0; k < kRows / 8; ++k) {
      const int r = r0 + 8 * k;
      const bool ok = r < rows;  // rows past the item: zero-filled, finite, never stored
      const T* src = q;
      if (ok) {
        const int token = q0 + w.q_begin + r / group, head = w.kv_head * group + r % group;
        src = q + static_cast<int64_t>(token) * q_stride + static_cast<int64_t>(head) * kD + c * 8;
      }
      cp_async16(s_q + dst0 + 1024u * k, src, ok);
    }
    cp_async_arrive(q_bar);

    // K/V addressing. A key's K row lives at k_base + row * kD and its V row at v_base + row * kD,
    // where row = block * rows_per_block + slot counts 256-byte rows of
    // the whole cache (32 bits cover a cache of up to 2^32 * 256 bytes = 1 TB).
    //
    // The block table is read one tile ahead and once per key, not once per copy: lane L of
    // producer warp w looks up row 2w + (L & 1) + 8 (L >> 1) of the tile, which are exactly
    // the 32 rows the warp copies (rows r0 + 8k, r0 = 2w or 2w + 1), and a copying thread
    // takes row r0 + 8k's value from lane 2k + (r0 & 1) by shuffle. The previous form looked
    // up the table right before each cp.async (a dependent L1 round trip per row, with a
    // 64-bit multiply chain and a branch around it: ~40 instructions and ~40+ cycles of
    // latency per row, serialised, 16 rows per tile), which left the producer too slow to
    // keep the ring full (profile: long-scoreboard stalls the top reason, tensor pipe 33%).
    const T* cache = static_cast<const T*>(kv.data);
    const int bs = kv.block_size;
    const int64_t head_elems = static_cast<int64_t>(bs) * kD;
    const uint32_t rows_per_block = static_cast<uint32_t>(kv.num_layers) * 2u * kv.num_kv_heads * bs;
    const T* k_base = cache + (static_cast<int64_t>(layer) * 2 * kv.num_kv_heads + w.kv_head) * head_elems + c * 8;
    const T* v_base = k_base + static_cast<int64_t>(kv.num_kv_heads) * head_elems;
    // Byte pointers, so that a row's address is one IMAD.WIDE.U32 (row * 256 + base).
    const char* k_bytes = reinterpret_cast<const char*>(k_base);
    const char* v_bytes = reinterpret_cast<const char*>(v_base);
    // Cold blocks (KVCache): the same offsets from the L2 pool's start, rows marked kColdRow.
    const int64_t kv_delta = static_cast<int64_t>(reinterpret_cast<uintptr_t>(kv.cold_data) -
                                                  reinterpret_cast<uintptr_t>(kv.data));
    const uint32_t cold_rows = static_cast<uint32_t>(kv.cold_block_elems / kD);
    const int* table = batch.block_tables + static_cast<int64_t>(w.seq) * batch.max_blocks;
    const bool pow2 = (bs & (bs - 1)) == 0;
    const int bs_shift = __ffs(bs) - 1;
    const int hi = r0 & 1;
    const int look_row = 2 * (warp & 3) + (lane & 1) + 8 * (lane >> 1);
    // This lane's row of tile i (0 past the last key: a valid address; such copies read
    // nothing and zero-fill).
    auto lookup = [&](int i) -> uint32_t {
      const int p = key_lo + i * kKeys + look_row;
      uint32_t row = 0;
      if (i < num_tiles && p <= key_hi) {
        const int blk = __ldg(table + (pow2 ? p >> bs_shift : p / bs));
        const int slot = pow2 ? p & (bs - 1) : p % bs;
        row = is_cold_block(blk) ? kColdRow | (static_cast<uint32_t>(cold_slot_of(blk)) * cold_rows + slot)
                                 : static_cast<uint32_t>(blk) * rows_per_block + static_cast<uint32_t>(slot);
      }
      return row;
    };
    // Copies rows (this lane's looked-up row of) tile i into the tile at smem address dst.
    auto copy_tile = [&](uint32_t look, int i, uint32_t dst, const char* src_bytes) {
      const int room = key_hi - (key_lo + i * kKeys + r0);  // row r0 + 8k holds a key iff 8k <= room
#pragma unroll
      for (int k = 0; k < kKeys / 8; ++k) {
        const uint32_t row = __shfl_sync(0xffffffffu, look, 2 * k + hi);
        const bool ok = 8 * k <= room;  // past the last key: zero-filled (never a slot nobody wrote)
        const char* src = (row & kColdRow) ? src_bytes + kv_delta : src_bytes;
        cp_async16(dst + 1024u * k, src + static_cast<uint64_t>(row & ~kColdRow) * (kD * sizeof(T)), ok);
      }
    };
    // K and V go through separate rings (FA3's layout): a consumer is done with K of tile j
    // as soon as S = Q K^T of tile j is complete (middle of its iteration j), with V of tile
    // j only after P V (its iteration j + 1). With one barrier per K+V stage a stage stayed
    // busy until the end of iteration j + 1, which left 3 stages only half an iteration of
    // lead for the next load. Here step i copies K of tile i, then V of tile i - 1 (V of a
    // tile is needed one iteration after its K): each has ~2 iterations of lead.
    uint32_t look_prev = 0, look = lookup(0);
    for (int i = 0; i <= num_tiles; ++i) {
      const uint32_t look_next = lookup(i + 1);  // consumed next step: its latency is hidden
      if (i < num_tiles) {
        const int s = i % kStages;
        if (i >= kStages) mbar_wait(k_empty(s), (i / kStages - 1) & 1);  // consumers done with K of tile i - 3
        copy_tile(look, i, s_k + s * kTileBytes + dst0, k_bytes);
        cp_async_arrive(k_full(s));  // K of tile i is published when it has landed
      }
      if (i > 0) {
        const int v = i - 1, s = v % kStages;
        if (v >= kStages) mbar_wait(v_empty(s), (v / kStages - 1) & 1);
        copy_tile(look_prev, v, s_v + s * kTileBytes + dst0, v_bytes);
        cp_async_arrive(v_full(s));
      }
      look_prev = look;
      look = look_next;
    }
    cp_async_wait_all();  // no copy outlives its thread
    return;
  }

  // ---------------- consumer warpgroups ----------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int wg = warp / 4 - 1, wl = warp % 4;  // consumer warpgroup (rows 64 wg ..), warp in it
  const int g = lane / 4, t = lane % 4;
  const int row0 = 64 * wg + 16 * wl + g;  // this thread's rows: row0 and row0 + 8

  int rlo[2], rhi[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (row0 + 8 * i < rows) {
      limits(row0 + 8 * i, rlo[i], rhi[i]);
    } else {
      rlo[i] = 1;
      rhi[i] = 0;
    }
  }
  // The warpgroup's tiles: from its first row's lowest key to its last valid row's highest.
  // The wgmma are warpgroup-wide, so skipping and masking are decided per warpgroup.
  int lo_first = 0, hi_first = -1, lo_last = 0, hi_last = -1;
  const bool has_rows = 64 * wg < rows;
  if (has_rows) {
    limits(64 * wg, lo_first, hi_first);
    limits(min(64 * wg + 63, rows - 1), lo_last, hi_last);
  }
  int j_first = num_tiles, j_last = num_tiles - 1;
  if (has_rows && hi_last >= lo_first) {  // lo_first >= key_lo and hi_last <= key_hi
    j_first = (lo_first - key_lo) / kKeys;
    j_last = (hi_last - key_lo) / kKeys;
  }
  // Warp-uniform by construction (one warpgroup's range); the shuffles tell the compiler.
  j_first = __shfl_sync(0xffffffffu, j_first, 0);
  j_last = __shfl_sync(0xffffffffu, j_last, 0);

  const uint64_t desc_q = make_desc(s_q + wg * 64 * 128, 16, 1024);
  auto desc_k = [&](int s) { return make_desc(s_k + s * kTileBytes, 16, 1024); };
  auto desc_v = [&](int s) { return make_desc(s_v + s * kTileBytes, kHalfBytes, 1024); };
  // K / V of tile j has landed. Before this thread's wgmma read it, a fence_proxy_async
  // must order those generic-proxy writes before the async-proxy reads (one fence after
  // the waits of a step covers them all).
  auto wait_k = [&](int j) { mbar_wait(k_full(j % kStages), (j / kStages) & 1); };
  auto wait_v = [&](int j) { mbar_wait(v_full(j % kStages), (j / kStages) & 1); };
  auto release_k = [&](int j) {
    if (lane == 0) mbar_arrive(k_empty(j % kStages));
  };
  auto release_v = [&](int j) {
    if (lane == 0) mbar_arrive(v_empty(j % kStages));
  };
  // A tile this warpgroup's rows do not see: taken and given back in order (barrier phases
  // must not mix), without reading it.
  auto skip_tile = [&](int j) {
    wait_k(j);
    release_k(j);
    wait_v(j);
    release_v(j);
  };

  float o[64], sc[64];  // O (64 x 128 per warpgroup) and S, in the accumulator layout
  uint32_t pf[8][4];    // P as the A fragments of the 8 k16 steps of P V
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = sc[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) pf[i][0] = pf[i][1] = pf[i][2] = pf[i][3] = 0u;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // max of raw scores; this thread's sum
  const float sl2 = scale * kLog2e;

  // S = Q K^T over the 8 k16 steps of head_dim: steps 0-3 in the first 64-column half
  // (+32 bytes each), 4-7 in the second.
  auto issue_qk = [&](int s) {
    const uint64_t dk = desc_k(s);
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint64_t off = ((kk >> 2) * kHalfBytes + (kk & 3) * 32) >> 4;
      wgmma_ss<T>(sc, desc_q + off, dk + off, kk > 0);
    }
  };
  // O += P V over the 8 k16 steps of the tile's keys (2048 bytes = 16 key rows each).
  auto issue_pv = [&](int s) {
    const uint64_t dv = desc_v(s);
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) wgmma_rs<T>(o, pf[kk], dv + ((kk * 2048) >> 4));
  };
  // Masks and the online softmax of tile j on sc (exponentials left in sc); alpha: the
  // factor O must be rescaled by.
  auto softmax = [&](int j, float (&alpha)[2]) {
    const int tb = key_lo + j * kKeys, te = tb + kKeys - 1;
    if (tb < lo_last || te > hi_first) {  // the tile cuts through some row's key range
      // Element e of column group i is key tb + 2t + (8i + (e & 1)): compare the constant
      // part against each row's limits shifted once, so the unrolled loop needs no per-key
      // index registers.
      const int base_key = tb + 2 * t;
      const int clo[2] = {rlo[0] - base_key, rlo[1] - base_key};
      const int chi[2] = {rhi[0] - base_key, rhi[1] - base_key};
#pragma unroll
      for (int i = 0; i < 16; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * i + (e & 1);
          if (col < clo[e >> 1] || col > chi[e >> 1]) sc[4 * i + e] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // row g (h = 0) and row g + 8; a row's four lanes share it
      // Max over the row's 32 values as a tree (depth 5 instead of a chain of 17 dependent
      // FMNMX; the same 32 instructions, and max is exact, so the result is identical).
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = fmaxf(sc[4 * i + 2 * h], sc[4 * i + 2 * h + 1]);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = fmaxf(v[i], v[i + 8]);
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = fmaxf(v[i], v[i + 4]);
      v[0] = fmaxf(fmaxf(v[0], v[2]), fmaxf(v[1], v[3]));
      float tmax = v[0];
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
      // Lazy rescaling (as in FlashAttention-4): the max that the exponentials are taken
      // against moves only when the tile's max exceeds it by more than 2^kLazyRescaleLog2 in
      // the exponent's units, so P stays below 2^kLazyRescaleLog2 (exact in fp32 and in the
      // 16-bit P, whose relative precision does not depend on the magnitude) and, past the
      // first tiles, no row moves and O is not rescaled at all. A row with no key yet keeps
      // max -inf and moves at its first finite score (-inf + x is -inf).
      const float mold = m[h];
      const float mnew = tmax * sl2 > fmaf(mold, sl2, kLazyRescaleLog2) ? tmax : mold;
      const float mb = mnew == -INFINITY ? 0.0f : mnew * sl2;  // exp2 then gives 0, not NaN
      // Exactly 1 for a row that did not move, by selection: exp2 of mold * sl2 - mb would be
      // exp2 of a rounding residue once the compiler contracts it into an FMA.
      alpha[h] = mnew == mold ? 1.0f : fast_exp2(mold * sl2 - mb);
      m[h] = mnew;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          sc[4 * i + e] = fast_exp2(fmaf(sc[4 * i + e], sl2, -mb));
          sum += sc[4 * i + e];
        }
      }
      l[h] = l[h] * alpha[h] + sum;
    }
  };
  auto to_p = [&]() {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
      for (int x = 0; x < 4; ++x) pf[kk][x] = pack2<T>(sc[8 * kk + 2 * x], sc[8 * kk + 2 * x + 1]);
    }
  };

  // Ping-pong between the two consumer warpgroups (FlashAttention-3's inter-warpgroup
  // schedule): the matrix products of a step are issued in turns, warpgroup 0 then 1, each
  // waiting on its own named barrier for the other's "issued" signal. The tensor cores
  // then run one warpgroup's Q K^T and P V while the other does its softmax, instead of
  // both warpgroups' products interleaving, both S arriving late and the two softmaxes
  // running at the same time (competing for the same issue slots and MUFU) with the
  // tensor cores idle. The profile's 33% tensor-pipe use came with no ordering at all.
  //
  // Rounds: every consumer warpgroup goes through exactly num_tiles + 1 of them (round r
  // issues S of tile r and / or P V of tile r - 1; rounds with nothing of its own to issue,
  // the tiles its rows skip, still take and pass the turn), so the two barriers' counts
  // always match: barrier 1 + wg gets 128 arrivals from the other warpgroup and 128 from
  // this one's bar.sync per round. Warpgroup 0 gives itself the first turn; warpgroup 1's
  // last round signals nobody. No round waits for anything of the other warpgroup's later
  // rounds (the K / V waits before a round need only releases from rounds <= r - 2), so the
  // turns cannot deadlock with the producer's rings.
  const uint32_t my_turn = 1 + wg, other_turn = 2 - wg;  // named barriers 1, 2 (0 is __syncthreads)
  auto take_turn = [&]() { asm volatile("bar.sync %0, 256;\n" ::"r"(my_turn) : "memory"); };
  auto pass_turn = [&](int r) {
    if (wg == 0 || r < num_tiles) asm volatile("bar.arrive %0, 256;\n" ::"r"(other_turn) : "memory");
  };
  auto empty_round = [&](int r) {
    take_turn();
    pass_turn(r);
  };
  if (wg == 0) asm volatile("bar.arrive 1, 256;\n" ::: "memory");

  mbar_wait(q_bar, 0);  // also before the epilogue reuses Q's rows: the copies have landed
  fence_proxy_async();
  int j = 0;
  for (; j < j_first; ++j) {  // tiles before this warpgroup's rows (sliding window)
    skip_tile(j);
    empty_round(j);
  }
  if (j_first <= j_last) {
    float alpha[2] = {1.0f, 1.0f};  // set by each softmax before rescale_o reads it
    // alpha is exactly 1 for a row whose max did not move (softmax's lazy rescaling), which
    // past the first tiles is every row: skip the 64 multiplies when that holds for the
    // whole warp (multiplying by 1 changes nothing).
    auto rescale_o = [&]() {
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          o[4 * i] *= alpha[0];
          o[4 * i + 1] *= alpha[0];
          o[4 * i + 2] *= alpha[1];
          o[4 * i + 3] *= alpha[1];
        }
      }
    };
    wait_k(j_first);
    fence_proxy_async();
    reg_fence(sc);
    take_turn();  // round j_first
    wgmma_fence();
    issue_qk(j_first % kStages);
    wgmma_commit();
    pass_turn(j_first);
    wgmma_wait<0>();
    reg_fence(sc);
    release_k(j_first);
    softmax(j_first, alpha);
    to_p();
    if (j_first < j_last) wait_k(j_first + 1);
    wait_v(j_first);
    fence_proxy_async();
    // Each step: O (complete up to tile j - 2) is rescaled to tile j - 1's max, then S of
    // tile j and O += P V of tile j - 1 are issued together; K of tile j is given back as
    // soon as S is in, and the softmax of tile j runs while the tensor cores do P V. K of
    // tile j + 1 and V of tile j (the next step's operands) are waited for between the
    // softmax and the wait for P V: besides being needed next, the spin loops are a block
    // boundary that keeps ptxas from hoisting that wait above the softmax (it does so
    // within a block, which would serialise the softmax behind P V).
    for (j = j_first + 1; j <= j_last; ++j) {
      rescale_o();
      reg_fence(sc);
      reg_fence(o);
      reg_fence(pf);
      take_turn();  // round j
      wgmma_fence();
      issue_qk(j % kStages);  // S of tile j ...
      wgmma_commit();
      issue_pv((j - 1) % kStages);  // ... while O += P V of tile j - 1
      wgmma_commit();
      pass_turn(j);
      wgmma_wait<1>();  // S is in: K of tile j is free
      reg_fence(sc);
      release_k(j);
      softmax(j, alpha);
      reg_fence(sc);
      if (j < j_last) wait_k(j + 1);
      wait_v(j);
      fence_proxy_async();
      wgmma_wait<0>();  // P V of tile j - 1 is in: its V stage is free, and so are pf and o
      reg_fence(o);
      reg_fence(pf);
      release_v(j - 1);
      to_p();
    }
    rescale_o();
    reg_fence(o);
    reg_fence(pf);
    take_turn();  // round j_last + 1
    wgmma_fence();
    issue_pv(j_last % kStages);
    wgmma_commit();
    pass_turn(j_last + 1);
    wgmma_wait<0>();
    reg_fence(o);
    release_v(j_last);
    j = j_last + 1;
  } else {
    empty_round(j);  // round j_first = num_tiles: no tile of its own at all
  }
  // Tiles past this warpgroup's rows (causal): round r + 1 goes with skipped tile r.
  for (; j < num_tiles; ++j) {
    skip_tile(j);
    empty_round(j + 1);
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  auto chunk = [](int r, int c) { return tile_off(r, c); };
  if (w.partial >= 0) {
    // Split-KV (single-token items of a group past the decode kernel's).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + 8 * h;
      if (r >= rows) continue;
      store_partial_row<kD>(batch, w, group, r, t,
                            [&](int i) { return make_float2(o[4 * i + 2 * h], o[4 * i + 2 * h + 1]); }, m[h], l[h],
                            scale);
    }
    return;
  }
  // Normalised rows go through this warp's own 16 Q rows in shared memory (read only by its
  // warpgroup's wgmma, all complete).
  fence_proxy_async();  // async-proxy reads of these bytes before the generic writes below
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    stage_row<T, kD>(smem, chunk, row0 + 8 * h, t,
                     [&](int i) { return make_float2(o[4 * i + 2 * h], o[4 * i + 2 * h + 1]); }, l[h]);
  }
  __syncwarp();
  store_staged_rows<T, kD>(out, smem, chunk, w, q0, group, num_heads, 64 * wg + 16 * wl, rows, lane);
#else
  // Built for another architecture: the host never launches this (see usable()).
  __trap();
#endif
}

// The binary holds an sm_90a build of the kernel (not one JIT-compiled from older PTX, whose
// body is empty), checked once per instantiation.
template <typename T>
bool usable() {
  static const bool ok = [] {
    cudaFuncAttributes a{};
    if (cudaFuncGetAttributes(&a, prefill_sm90_kernel<T>) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    if (a.ptxVersion < 90 || a.binaryVersion < 90) return false;
    if (cudaFuncSetAttribute(prefill_sm90_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kSmemBytes)) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  }();
  return ok;
}

bool is_sm90_device() {
  static int cached[32] = {};  // per device: 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (dev < 0 || dev >= 32) return false;
  if (cached[dev] == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    cached[dev] = major == 9 && minor == 0 ? 1 : 2;
  }
  return cached[dev] == 1;
}

template <typename T>
bool launch(const void* q, int64_t q_stride, void* out, KVCache kv, int layer, const AttnBatch& b, int num_heads,
            float scale, int window, int first_item, int num_items, cudaStream_t stream) {
  if (!usable<T>()) return false;
  prefill_sm90_kernel<T><<<num_items, kThreads, kSmemBytes, stream>>>(
      static_cast<const T*>(q), q_stride, static_cast<T*>(out), kv, layer, b, num_heads, scale, window, first_item);
  return true;
}

}  // namespace

bool prefill_attention_sm90(DType t, const void* q, int64_t q_stride, void* out, KVCache kv, int32_t layer,
                            const AttnBatch& batch, int32_t num_heads, float scale, int32_t window,
                            int32_t first_item, int32_t num_items, cudaStream_t stream) {
  if (kv.head_dim != kD || (t != DType::kBF16 && t != DType::kF16)) return false;
  // K25_PREFILL_ATTENTION=mma forces the mma.sync kernel (tests compare the two).
  if (const char* e = std::getenv("K25_PREFILL_ATTENTION"); e != nullptr && std::strcmp(e, "mma") == 0) return false;
  if (!is_sm90_device()) return false;
  if (num_items <= 0) return true;
  if (t == DType::kBF16) {
    return launch<__nv_bfloat16>(q, q_stride, out, kv, layer, batch, num_heads, scale, window, first_item, num_items,
                                 stream);
  }
  return launch<__half>(q, q_stride, out, kv, layer, batch, num_heads, scale, window, first_item, num_items, stream);
}

}  // namespace k25::cuda
