// Layout of the paged KV storage on the CPU backend.
//
// One allocation indexed by block id: [num_blocks][num_layers][K, V][num_kv_heads][...].
// A block id names the same slots in every layer, and one block across all layers is
// contiguous, so a tier move copies a block in one transfer. Within a block and head,
// V is [block_size][head_dim]. K is the same on CUDA; on the CPU it is stored transposed
// ([head_dim][block_size]) so that q·K over a block is a run of vector FMAs with no
// horizontal sums (k_transposed).
#pragma once

#include <cstdint>
#include <type_traits>

namespace k25 {

// The CPU pool's element type (on CUDA the pool tensor's dtype says it and this stays kF32):
// float32, or bfloat16 (kv_cache_dtype="bfloat16": half the bytes; keys and values rounded to
// nearest-even as they are written, read back exactly).
enum class KVElem : int32_t { kF32 = 0, kBF16 = 1 };

struct KVLayout {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 0;
  bool k_transposed = true;
  KVElem elem = KVElem::kF32;

  int64_t head_elems() const { return static_cast<int64_t>(block_size) * head_dim; }
  int64_t layer_elems() const { return 2 * num_kv_heads * head_elems(); }
  int64_t block_elems() const { return num_layers * layer_elems(); }
  // Where a layer's K (V) head starts within one block.
  int64_t k_in_block(int32_t layer, int32_t head) const { return layer * layer_elems() + head * head_elems(); }
  int64_t v_in_block(int32_t layer, int32_t head) const { return k_in_block(layer, head) + num_kv_heads * head_elems(); }
  int64_t k_offset(int64_t block, int32_t layer, int32_t head) const {
    return block * block_elems() + k_in_block(layer, head);
  }
  int64_t v_offset(int64_t block, int32_t layer, int32_t head) const {
    return k_offset(block, layer, head) + num_kv_heads * head_elems();
  }
  int64_t elem_bytes() const { return elem == KVElem::kBF16 ? 2 : 4; }
};

// Calls f with the pool as a pointer to its element, float or uint16_t (bfloat16's bits),
// const as `pool` is: the CPU kernels' one dispatch on KVLayout::elem to their templates.
template <typename V, typename F>
decltype(auto) with_elem(const KVLayout& L, V* pool, F&& f) {
  using F32 = std::conditional_t<std::is_const_v<V>, const float, float>;
  using B16 = std::conditional_t<std::is_const_v<V>, const uint16_t, uint16_t>;
  if (L.elem == KVElem::kBF16) return f(static_cast<B16*>(pool));
  return f(static_cast<F32*>(pool));
}

// Cold blocks (a sequence longer than the primary pool, tiered KV on the CPU): a block that
// lives in L2 host memory is named in a block table by a negative id, cold_block_id(j),
// meaning entry j of the step's cold-block pointer list; the attention kernel reads it in
// place (its bytes have the pool's block layout). -1 stays "no block".
constexpr int32_t cold_block_id(int32_t j) { return -2 - j; }
constexpr int32_t cold_block_index(int32_t id) { return -2 - id; }

}  // namespace k25
