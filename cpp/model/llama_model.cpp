#include "model/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "k25/status.h"
#include "ops/attention_plan.h"
#include "ops/cpu_kernels.h"
#include "ops/parallel.h"

#ifdef K25_WITH_CUDA
#include "model/cuda_glue.h"
#endif

namespace k25 {

namespace {

// Inverse RoPE frequencies computed with the same float32 ops, in the same order, as
// Hugging Face transformers, so that cos/sin tables agree bit for bit.
at::Tensor rope_inv_freq(const ModelConfig& c, const at::Tensor& freq_factors) {
  const int64_t D = c.head_dim;
  at::Tensor expo = at::arange(0, D, 2, at::kLong).to(at::kFloat) / static_cast<double>(D);
  at::Tensor inv = at::reciprocal(at::pow(at::Scalar(c.rope.theta), expo)) * 1.0;
  const RopeConfig& r = c.rope;
  if (r.type == "linear") {
    inv = inv / r.factor;
  } else if (r.type == "llama3") {
    const double old_ctx = static_cast<double>(r.original_max_position);
    const double low_wavelen = old_ctx / r.low_freq_factor;
    const double high_wavelen = old_ctx / r.high_freq_factor;
    at::Tensor wavelen = at::reciprocal(inv) * (2 * M_PI);
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
    at::Tensor smooth = (at::reciprocal(wavelen) * old_ctx - r.low_freq_factor) /
                        (r.high_freq_factor - r.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
    at::Tensor medium = at::logical_not(wavelen < high_wavelen) * at::logical_not(wavelen > low_wavelen);
    inv = at::where(medium, smoothed, scaled);
  }
  if (freq_factors.defined()) inv = inv / freq_factors;
  return inv.contiguous();
}

// As transformers computes it: the norm in float32, the weight in the model dtype.
at::Tensor rms_norm_aten(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, true);
  return w * (xf * at::rsqrt(var + eps)).to(x.scalar_type());
}

// Up to this many rows, the CPU linear layers use cpu::linear_few_rows rather than BLAS:
// a layer and the lm_head of the default model ran 1.25x (1 row), 3.15x (4), 2.0x (8) and
// 1.4x (16) MKL's sgemm on an AVX2 host, and about even at 32 (bench/cpu_linear.py).
constexpr int64_t kFewRows = 16;

// y = x w^T (+ b), split by output features over the thread pool; each slice is one
// single-threaded call (k25's kernel for a few rows, BLAS otherwise) writing its columns of
// y in place.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (x.is_cuda()) {
#ifdef K25_WITH_CUDA
    // A decode step of a small batch: cuBLAS reads W below the bandwidth it could (~3.0
    // TB/s for the 8B shape's qkv and o at batch 1; see bench/gpu/NOTES.md).
    if (cuda_glue::gemv_supported(x, w, b)) return cuda_glue::gemv(x, w, b);
#endif
    return b.defined() ? at::addmm(b, x, w.t()) : at::mm(x, w.t());  // cuBLAS
  }
  const int64_t N = w.size(0);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  // Slices of output features: about one per thread, multiples of 16 (aligned), at least `least`.
  const auto grain = [&](int64_t least) {
    return std::max<int64_t>(least, (N / std::max(1, num_threads()) + 15) / 16 * 16);
  };
  if (x.size(0) <= kFewRows && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.stride(1) == 1 &&
      w.is_contiguous() && (!b.defined() || (b.scalar_type() == at::kFloat && b.is_contiguous()))) {
    // A decode step's few rows: k25's kernel reads each weight row once (cpu_linear.cpp).
    const int64_t M = x.size(0), K = x.size(1);
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    parallel_for(0, N, grain(16), [&](int64_t n0, int64_t n1) {
      cpu::linear_few_rows(xp, x.stride(0), wp, bp, yp, N, M, n0, n1, K);
    });
    return y;
  }
  // Slices of >= 64 rows keep each BLAS call efficient.
  parallel_for(0, N, grain(64), [&](int64_t n0, int64_t n1) {
    at::Tensor out = y.narrow(1, n0, n1 - n0);
    at::Tensor ws = w.narrow(0, n0, n1 - n0).t();
    if (b.defined()) {
      at::addmm_out(out, b.narrow(0, n0, n1 - n0), x, ws);
    } else {
      at::mm_out(out, x, ws);
    }
  });
  return y;
}

at::Tensor i32_view(const std::vector<int32_t>& v) {
  return at::from_blob(const_cast<int32_t*>(v.data()), {static_cast<int64_t>(v.size())}, at::kInt);
}

// A host vector as a tensor on `device` (a copy there, a view on the CPU).
template <typename T>
at::Tensor on_device(const std::vector<T>& v, at::ScalarType type, const at::Device& device,
                     std::vector<int64_t> shape = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(v.size())};
  at::Tensor t = at::from_blob(const_cast<T*>(v.data()), shape, type);
  return device.is_cpu() ? t : t.to(device, /*non_blocking=*/false, /*copy=*/true);
}

}  // namespace

LlamaModel::LlamaModel(ModelConfig config, LlamaWeights weights, int32_t max_positions)
    : config_(std::move(config)), weights_(std::move(weights)) {
  at::Tensor inv = rope_inv_freq(config_, weights_.rope_freq_factors);
  at::Tensor pos = at::arange(0, max_positions, at::kLong).to(at::kFloat);
  at::Tensor freqs = at::outer(pos, inv);
  rope_cos_ = freqs.cos().contiguous();
  rope_sin_ = freqs.sin().contiguous();
}

void LlamaModel::to(at::Device device, at::ScalarType dtype) {
  auto move = [&](at::Tensor& t) {
    if (t.defined()) t = t.to(dtype).to(device);  // convert first: half the bytes to copy
  };
  const bool tied = weights_.lm_head.is_same(weights_.embed);
  move(weights_.embed);
  move(weights_.final_norm);
  if (tied) {
    weights_.lm_head = weights_.embed;
  } else {
    move(weights_.lm_head);
  }
  for (LayerWeights& l : weights_.layers) {
    for (at::Tensor* t : {&l.attn_norm, &l.wqkv, &l.bqkv, &l.wo, &l.bo, &l.ffn_norm, &l.w_gate_up, &l.w_down}) move(*t);
  }
  rope_cos_ = rope_cos_.to(device);
  rope_sin_ = rope_sin_.to(device);
}

int64_t LlamaModel::weight_bytes() const {
  auto b = [](const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; };
  int64_t n = b(weights_.embed) + b(weights_.final_norm);
  if (!weights_.lm_head.is_same(weights_.embed)) n += b(weights_.lm_head);
  for (const LayerWeights& l : weights_.layers) {
    n += b(l.attn_norm) + b(l.wqkv) + b(l.bqkv) + b(l.wo) + b(l.bo) + b(l.ffn_norm) +
         b(l.w_gate_up) + b(l.w_down);
  }
  return n;
}

int32_t cold_slot(const ColdRegion& region, const void* block) {
  const int64_t off = static_cast<const uint8_t*>(block) - region.host;
  if (region.slot_bytes <= 0 || off < 0 || off % region.slot_bytes != 0 || off / region.slot_bytes >= region.num_slots) {
    fail(ErrorCode::kInternal, "a cold block outside the mapped L2 pool");
  }
  return static_cast<int32_t>(off / region.slot_bytes);
}

std::vector<int32_t> cold_slot_tables(const BatchMeta& meta, const ColdRegion* region) {
  if (region == nullptr || region->device == nullptr || region->slot_bytes <= 0) {
    fail(ErrorCode::kInternal, "cold KV blocks on CUDA without a mapped L2 pool");
  }
  std::vector<int32_t> t = meta.block_tables;
  for (int32_t& id : t) {
    if (id > cold_block_id(0)) continue;  // a pool block, or -1 (none)
    const size_t j = static_cast<size_t>(cold_block_index(id));
    if (j >= meta.cold_blocks.size()) fail(ErrorCode::kInternal, "a cold block id past the step's cold list");
    id = cold_block_id(cold_slot(*region, meta.cold_blocks[j]));
  }
  return t;
}

void cold_entry_slots(const BatchMeta& meta, const ColdRegion& region, int32_t* out) {
  out[0] = static_cast<int32_t>(meta.cold_blocks.size());
  for (size_t j = 0; j < meta.cold_blocks.size(); ++j) out[j + 1] = cold_slot(region, meta.cold_blocks[j]);
}

// What a forward pass keeps between its layers (LlamaModel::Pass): the step's inputs, the
// residual stream and the layer buffers, and on CUDA the attention batch.
struct LlamaModel::Pass::State {
  State(const LlamaModel& model, const BatchMeta& meta, at::Tensor& kv, const KVLayout& layout, bool fused,
        const DeviceStep* prepared, SparseStep* sparse, const ColdRegion* cold)
      : m(model), c(model.config_), W(model.weights_), meta(meta), kv(kv), layout(layout), fused(fused),
        prepared(prepared), sparse(sparse), cold(cold), dev(model.device()), cuda(dev.is_cuda()),
        H(c.hidden_size), I(c.intermediate_size), D(c.head_dim), Hq(c.num_heads), Hkv(c.num_kv_heads),
        qkv_dim((Hq + 2 * Hkv) * D), eps(static_cast<float>(c.rms_norm_eps)),
        scale(1.0f / std::sqrt(static_cast<float>(D))) {}
  void begin();
  // Runs layer l, or its first part: false when that part started reads of cold blocks in
  // L3 that its attention needs (ColdLayerSource::need), and the next call runs the rest.
  bool layer(int32_t l);
  at::Tensor logits();
  // The CPU's select_blocks for layer l's rows q, through the selections kept across steps
  // (SparseStep::memory, by request id when the step names them).
  bool select(int32_t l, const float* q, LayerSelection* out) {
    const int64_t* ids = meta.named_ids();
    sparse->memory.lookup(ab, ids, l, sparse->params, &reuse);
    const bool any = select_blocks(q, qkv_dim, kv.data_ptr(), sparse->summaries, sparse->layout, layout, l, ab,
                                   Hq, scale, sparse->params, out, reuse.data());
    sparse->memory.store(ab, ids, l, Hkv, layout.block_size, sparse->params, *out);
    return any;
  }
  // The fused kernels of this device.
  void norm(const at::Tensor& in, const at::Tensor& w, at::Tensor& out) {
#ifdef K25_WITH_CUDA
    if (cuda) return cuda_glue::rms_norm(in, w, out, c.rms_norm_eps);
#endif
    cpu::rms_norm(in.data_ptr<float>(), in.stride(0), w.data_ptr<float>(), out.data_ptr<float>(), out.stride(0),
                  in.size(0), in.size(1), eps);
  }
  void add_norm(at::Tensor& hh, const at::Tensor& delta, const at::Tensor& w, at::Tensor& out) {
#ifdef K25_WITH_CUDA
    if (cuda) return cuda_glue::add_rms_norm(hh, delta, w, out, c.rms_norm_eps);
#endif
    cpu::add_rms_norm(hh.data_ptr<float>(), delta.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(),
                      hh.size(0), hh.size(1), eps);
  }

  const LlamaModel& m;
  const ModelConfig& c;
  const LlamaWeights& W;
  const BatchMeta& meta;
  at::Tensor& kv;
  const KVLayout& layout;
  const bool fused;
  const DeviceStep* const prepared;
  SparseStep* const sparse;
  const ColdRegion* const cold;
  const at::Device dev;
  const bool cuda;
  const int64_t H, I, D;
  const int32_t Hq, Hkv;
  const int64_t qkv_dim;
  const float eps, scale;
  int64_t T = 0;
  at::Tensor ids, positions, slots;
  at::Tensor h, x, attn, act;  // the residual stream [T, H] and the layers' buffers
  cpu::AttentionBatch ab;
  std::vector<int32_t> cold_tables;
#ifdef K25_WITH_CUDA
  cuda_glue::DeviceBatch db;
  std::unique_ptr<cuda_glue::HostFence> fence;
  // Cold blocks gathered a layer ahead (DeviceStep::prefetch): its entries' slots, their pool.
  cuda_glue::ColdPrefetch* prefetch = nullptr;
  at::Tensor prefetch_slots;
  cuda_glue::ColdPool prefetch_l2;
  // Staged cold blocks with sparsity: the cold entries' summaries (entry j at block row j),
  // a pinned copy of one layer's block reads, and a split layer's selection (its tables
  // copied: a whole step of other sequences may run between the parts and select too).
  at::Tensor cold_summ, layer_reads;
  cuda_glue::DeviceBatch kept_db;
  std::vector<int32_t> staged_reads;  // the layers' reads, summed (Pass::staged_reads)
  void stage_cold_summaries();
  // Layer l's selection is in scratch.reads: what its attention reads of the cold entries.
  std::vector<uint8_t> staged_need();
#endif
  int32_t next = 0;  // the next layer to run
  // A layer split by selective cold reads: its rows after RoPE, and its selection's result.
  // Its selection stays here until the layer ends: a whole step of other sequences may run
  // between the parts, and it selects into SparseStep::layers too.
  at::Tensor qkv_kept;
  LayerSelection sel_kept;
  std::vector<ReusedSelection> reuse;  // select()'s
  bool split = false, selected = false;
};

LlamaModel::Pass::Pass(std::unique_ptr<State> s) : s_(std::move(s)) {}
LlamaModel::Pass::~Pass() = default;
int32_t LlamaModel::Pass::next_layer() const { return s_->next; }
int32_t LlamaModel::Pass::num_layers() const { return s_->c.num_layers; }

void LlamaModel::Pass::run_layer() {
  if (s_->next >= s_->c.num_layers) fail(ErrorCode::kInternal, "forward pass: every layer has run");
  if (s_->layer(s_->next)) ++s_->next;
}

const std::vector<int32_t>* LlamaModel::Pass::staged_reads() const {
#ifdef K25_WITH_CUDA
  if (!s_->staged_reads.empty()) return &s_->staged_reads;
#endif
  return nullptr;
}

at::Tensor LlamaModel::Pass::logits() {
  if (s_->next != s_->c.num_layers) fail(ErrorCode::kInternal, "forward pass: logits before the last layer");
  return s_->logits();
}

std::unique_ptr<LlamaModel::Pass> LlamaModel::begin(const BatchMeta& meta, at::Tensor& kv, const KVLayout& layout,
                                                    bool fused, const DeviceStep* prepared, SparseStep* sparse,
                                                    const ColdRegion* cold) const {
  auto s = std::make_unique<Pass::State>(*this, meta, kv, layout, fused, prepared, sparse, cold);
  s->begin();
  return std::unique_ptr<Pass>(new Pass(std::move(s)));
}

at::Tensor LlamaModel::forward(const BatchMeta& meta, at::Tensor& kv, const KVLayout& layout, bool fused,
                               const DeviceStep* prepared, SparseStep* sparse, const ColdRegion* cold) const {
  std::unique_ptr<Pass> pass = begin(meta, kv, layout, fused, prepared, sparse, cold);
  while (pass->next_layer() < pass->num_layers()) pass->run_layer();
  return pass->logits();
}

void LlamaModel::Pass::State::begin() {
  if (prepared && !(cuda && fused)) fail(ErrorCode::kInternal, "prepared inputs are for the fused CUDA path");
  if (sparse && !fused) fail(ErrorCode::kUnsupported, "dynamic sparsity runs on the fused kernels only");
#ifdef K25_WITH_CUDA
  if (sparse && cuda && !(sparse->device_summaries.defined() && sparse->scratch.raw.defined())) {
    fail(ErrorCode::kInternal, "CUDA sparsity without its device summaries or scratch");
  }
#endif
  T = prepared ? prepared->ids.size(0) : meta.num_tokens();
  // Sequences are ordered by priority, not length: check every position.
  if (!prepared && *std::max_element(meta.positions.begin(), meta.positions.end()) >= m.rope_cos_.size(0)) {
    fail(ErrorCode::kInvalidArgument, "position beyond the RoPE table (max_seq_len)");
  }
  if (kv.device() != dev) fail(ErrorCode::kInternal, "the KV pool is not on the model's device");
  if (!cuda && kv.scalar_type() != (layout.elem == KVElem::kBF16 ? at::kBFloat16 : at::kFloat)) {
    fail(ErrorCode::kInternal, "the CPU KV pool's dtype is not its layout's element");
  }
  if (sparse && !cuda) sparse->memory.begin_step();

  // The step's metadata on the device.
  ids = prepared ? prepared->ids : on_device(meta.token_ids, at::kInt, dev);
  positions = prepared ? prepared->positions : on_device(meta.positions, at::kInt, dev);
  slots = prepared ? prepared->slots : on_device(meta.slot_mapping, at::kLong, dev);
  h = at::index_select(W.embed, 0, ids);  // residual stream [T, H]
  x = at::empty({T, H}, h.options());
  attn = at::empty({T, Hq * D}, h.options());
  act = at::empty({T, I}, h.options());

  ab = cpu_attention_batch(meta);
  // Cold blocks (a sequence longer than the KV pool): the CPU kernels read them by pointer;
  // the CUDA kernels by slot of the mapped L2 pool (cold_tables below; with sparsity the
  // device selection finds their summaries by slot too, TorchExecutor::keep_cold_summaries).
  if (!meta.cold_blocks.empty()) {
    if (!fused) {
      fail(ErrorCode::kUnsupported, "cold KV blocks (a sequence longer than the KV pool) need the fused kernels");
    }
    if (!cuda && sparse &&
        (meta.cold_summaries.size() != meta.cold_blocks.size() ||
         std::find(meta.cold_summaries.begin(), meta.cold_summaries.end(), nullptr) != meta.cold_summaries.end())) {
      fail(ErrorCode::kInternal, "cold blocks without their key summaries");
    }
    ab.cold_blocks = meta.cold_blocks.data();
    ab.cold_summaries = sparse ? meta.cold_summaries.data() : nullptr;
    // Staged (cold blocks in L3 on CUDA): the tables keep entry ids, and each layer's launch
    // gets that layer's staging region as its cold pool (below).
#ifdef K25_WITH_CUDA
    // Gathered a layer ahead (the executor's choice, ColdRegion::prefetch): the tables keep
    // entry ids. Else read in place: the tables name L2 slots.
    if (cuda && !prepared && !meta.cold_layers && cold != nullptr && cold->prefetch != nullptr) {
      prefetch = cold->prefetch;
      std::vector<int32_t> s(static_cast<size_t>(prefetch->capacity()) + 1, 0);
      cold_entry_slots(meta, *cold, s.data());
      prefetch_slots = on_device(s, at::kInt, dev);
      prefetch_l2 = {cold->device, cold->slot_bytes, cold->num_slots};
    }
    if (cuda && !meta.cold_layers && prefetch == nullptr) cold_tables = cold_slot_tables(meta, cold);
#endif
    if (cuda && meta.cold_layers && prepared) {
      fail(ErrorCode::kUnsupported, "cold KV blocks in L3 on CUDA: eager steps only");
    }
  }
#ifdef K25_WITH_CUDA
  if (prepared) {
    db = prepared->batch;
    prefetch = prepared->prefetch;
    prefetch_slots = prepared->cold_slots;
    prefetch_l2 = prepared->cold_l2;
  } else if (cuda && fused) {
    AttentionPlanParams pp;
    pp.num_kv_heads = Hkv;
    pp.group = Hq / Hkv;
    pp.max_rows = cuda_glue::attention_max_rows(h.scalar_type());
    pp.wave = cuda_glue::decode_wave(h.scalar_type(), static_cast<int32_t>(D), Hq / Hkv);
    pp.min_split_keys = 256;
    pp.decode_first = true;
    int32_t window = 0;
    for (int32_t w : c.layer_sliding_window) window = std::max(window, w);
    // One plan for all layers; a window only shortens key ranges, so plan without it
    // unless every layer has the same one.
    bool uniform = true;
    for (int32_t w : c.layer_sliding_window) uniform = uniform && w == c.layer_sliding_window[0];
    pp.sliding_window = uniform ? window : 0;
    const AttentionPlan plan = plan_attention(meta.query_start.data(), meta.context_lens.data(), meta.num_seqs(), pp);
    db = cuda_glue::make_batch(on_device(meta.query_start, at::kInt, dev), on_device(meta.context_lens, at::kInt, dev),
                               on_device(cold_tables.empty() ? meta.block_tables : cold_tables, at::kInt, dev,
                                         {meta.num_seqs(), meta.max_blocks_per_seq}),
                               plan, Hq / Hkv, static_cast<int32_t>(D), dev);
    if (!cold_tables.empty()) db.cold = {cold->device, cold->slot_bytes, cold->num_slots};
    if (sparse && !sparse->reuse_rows.empty()) {
      if (static_cast<int32_t>(sparse->reuse_rows.size()) != meta.num_seqs()) {
        fail(ErrorCode::kInternal, "selection reuse modes for another batch");
      }
      db.reuse = on_device(sparse->reuse_rows, at::kInt, dev);
    }
  }
  // The step's block reads, counted by the selections of every layer (SparseScratch::reads).
  if (sparse && cuda && sparse->scratch.reads.defined()) sparse->scratch.reads.zero_();
  if (cuda && meta.cold_layers) fence = std::make_unique<cuda_glue::HostFence>();
  if (cuda && meta.cold_layers && sparse) stage_cold_summaries();
  if (prefetch) {
    prefetch->begin_step();
    prefetch->gather(0, prefetch_l2, prefetch_slots);
  }
#endif
  if (fused) norm(h, W.layers[0].attn_norm, x);
}

bool LlamaModel::Pass::State::layer(int32_t l) {
  const LayerWeights& L = W.layers[l];
  const bool second = split;  // the rest of a layer split below
  split = false;
#ifdef K25_WITH_CUDA
  // The next layer's cold slices cross the bus while this layer's GEMMs run.
  if (prefetch && l + 1 < c.num_layers) prefetch->gather(l + 1, prefetch_l2, prefetch_slots);
#endif
  if (!fused) x = rms_norm_aten(h, L.attn_norm, c.rms_norm_eps);
  at::Tensor qkv = second ? std::move(qkv_kept) : linear(x, L.wqkv, L.bqkv);
  const int32_t window = c.layer_sliding_window[l];
  if (fused && cuda) {
#ifdef K25_WITH_CUDA
    ColdLayerSource* const cl = meta.cold_layers;
    if (!second) {
      cuda_glue::rope_write_kv(qkv, positions, slots, Hq, m.rope_cos_, m.rope_sin_, kv, layout, l);
      if (sparse) cuda_glue::update_block_summaries(kv, layout, l, sparse->device_summaries, db, sparse->params.key_codes);
      // The device is done with layer l - 1's staging buffer before it is refilled (with
      // layer l + 1's slices, while this layer runs).
      if (cl && l > 0) fence->wait((l - 1) % 2);
    }
    if (cl) {
      // (The second part: waits for the reads its first part started.)
      const ColdLayerSource::Region r = cl->layer_region(l);
      db.cold = {r.device, r.stride, r.count};
    }
    if (prefetch) db.cold = prefetch->ready(l);
    if (sparse && window == 0) {
      cuda_glue::DeviceBatch kept;
      if (second) {
        kept = std::move(kept_db);
        kept_db = {};
      } else {
        // Staged: each layer's reads are counted apart (zeroed first, copied back after).
        if (cl) sparse->scratch.reads.zero_();
        kept = cuda_glue::select_blocks(qkv, layout, l, sparse->device_summaries, kv.numel() / layout.block_elems(),
                                        db, Hq, scale, sparse->params, sparse->scratch, sparse->layer_stats,
                                        cl ? cold_summ : at::Tensor(),
                                        sparse->device_memory.counts.defined() ? &sparse->device_memory : nullptr);
        // Selective: the cold entries the kept tables name are read now, unless read ahead.
        if (cl && cl->need(l, staged_need())) {
          kept_db = kept;
          kept_db.head_tables = kept.head_tables.clone();
          kept_db.context_lens = kept.context_lens.clone();
          qkv_kept = qkv;
          split = true;
          return false;
        }
      }
      cuda_glue::paged_attention(qkv, attn, kv, layout, l, kept, Hq, scale, window);
    } else {
      cuda_glue::paged_attention(qkv, attn, kv, layout, l, db, Hq, scale, window);
    }
    if (meta.cold_layers) fence->record(l % 2);
    if (prefetch) prefetch->attended(l);
#endif
  } else if (fused) {
    float* q = qkv.data_ptr<float>();
    ColdLayerSource* const cl = meta.cold_layers;
    if (!second) {
      cpu::rope_write_kv(q, qkv_dim, meta.positions.data(), meta.slot_mapping.data(), T, Hq,
                         m.rope_cos_.data_ptr<float>(), m.rope_sin_.data_ptr<float>(), kv.data_ptr(), layout, l);
    }
    // Cold blocks in L3: this layer's K and V of each, read while the layers before ran
    // (selective: what the selection reads; the rest of what attention reads is read after it).
    if (cl) ab.cold_blocks = cl->layer(l);
    if (sparse && !second) {
      // Summaries follow every write (prefill too); selection is for decodes of layers
      // without a sliding window.
      update_key_summaries(kv.data_ptr(), layout, sparse->summaries, sparse->layout, l, ab);
    }
    if (cl && cl->selective() && !second) {
      selected = sparse && window == 0 && select(l, q, &sel_kept);
      std::vector<uint8_t> need(meta.cold_blocks.size(), 0);
      cold_entries_read(ab, layout.block_size, Hkv, selected, sel_kept, &need);
      if (cl->need(l, need)) {
        qkv_kept = qkv;
        split = true;
        return false;
      }
      ab.cold_blocks = cl->layer(l);
    }
    if (sparse && window == 0) {
      // Selected above (or in the first part) with selective cold reads, else here.
      if (!(cl && cl->selective())) selected = select(l, q, &sel_kept);
      attend_selected(q, qkv_dim, attn.data_ptr<float>(), kv.data_ptr(), layout, l, ab, sparse->summaries,
                      sparse->layout, Hq, scale, sparse->params, selected, sel_kept, &sparse->lse);
      std::swap(sparse->layers[l], sel_kept);  // this layer's selection, for the stats and block_reads
    } else {
      if (sparse) {
        LayerSelection& sel = sparse->layers[l];
        sel.blocks_total = sel.blocks_kept = sel.selections = sel.reused_selections = 0;
      }
      cpu::paged_attention(q, qkv_dim, attn.data_ptr<float>(), kv.data_ptr(), layout, l, ab, Hq, scale,
                           window);
    }
  } else {
    // RoPE as transformers writes it: x * cos + rotate_half(x) * sin, in the model dtype.
    at::Tensor cos = at::index_select(m.rope_cos_, 0, positions);
    at::Tensor sin = at::index_select(m.rope_sin_, 0, positions);
    cos = at::cat({cos, cos}, -1).unsqueeze(1).to(h.scalar_type());
    sin = at::cat({sin, sin}, -1).unsqueeze(1).to(h.scalar_type());
    at::Tensor qk = qkv.narrow(1, 0, (Hq + Hkv) * D).view({T, Hq + Hkv, D});
    at::Tensor rot = at::cat({-qk.narrow(2, D / 2, D / 2), qk.narrow(2, 0, D / 2)}, -1);
    qk.copy_(qk * cos + rot * sin);
#ifdef K25_WITH_CUDA
    if (cuda) cuda_glue::write_kv(qkv, slots, Hq, kv, layout, l);
#endif
    if (!cuda) cpu::write_kv(qkv.data_ptr<float>(), qkv_dim, meta.slot_mapping.data(), T, Hq, kv.data_ptr(),
                             layout, l);
    m.attention_unfused(qkv, meta, kv, layout, l, attn);
  }
  at::Tensor o = linear(attn, L.wo, L.bo);
  if (fused) {
    add_norm(h, o, L.ffn_norm, x);
  } else {
    h = h + o;
    x = rms_norm_aten(h, L.ffn_norm, c.rms_norm_eps);
  }
  at::Tensor gu = linear(x, L.w_gate_up, at::Tensor());
  if (fused && cuda) {
#ifdef K25_WITH_CUDA
    cuda_glue::silu_mul(gu, act);
#endif
  } else if (fused) {
    cpu::silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), T, I);
  } else {
    act = at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
  }
  at::Tensor d = linear(act, L.w_down, at::Tensor());
  if (fused && l + 1 < c.num_layers) {
    add_norm(h, d, W.layers[l + 1].attn_norm, x);
  } else if (fused) {
    h.add_(d);
  } else {
    h = h + d;
  }
  return true;
}

#ifdef K25_WITH_CUDA
void LlamaModel::Pass::State::stage_cold_summaries() {
  // Entry j's rows at block j of cold_summ: an L3 block's from the host copy it took down
  // (TorchExecutor::cold_l3_summaries), an L2 block's from its slot's rows on the device.
  const at::Tensor& sm = sparse->device_summaries;
  const int64_t per = cuda_glue::block_summary_bytes(layout, kv.scalar_type(), sparse->params.key_codes);
  const int64_t n = static_cast<int64_t>(meta.cold_blocks.size());
  const int64_t pool_blocks = kv.numel() / layout.block_elems();
  if (static_cast<int64_t>(meta.cold_summaries.size()) != n) {
    fail(ErrorCode::kInternal, "staged cold blocks without their key summaries");
  }
  if (!sparse->scratch.reads.defined()) fail(ErrorCode::kInternal, "staged cold blocks without counted block reads");
  at::Tensor host = at::empty({std::max<int64_t>(n, 1), per}, sm.options().device(at::kCPU).pinned_memory(true));
  std::vector<int64_t> entries, rows;
  const int64_t row_bytes = per * static_cast<int64_t>(sm.element_size());
  for (int64_t j = 0; j < n; ++j) {
    if (meta.cold_blocks[j] != nullptr) {
      entries.push_back(j);
      rows.push_back(pool_blocks + cold_slot(*cold, meta.cold_blocks[j]));
    } else if (meta.cold_summaries[j] != nullptr) {
      std::memcpy(static_cast<uint8_t*>(host.data_ptr()) + j * row_bytes, meta.cold_summaries[j],
                  static_cast<size_t>(row_bytes));
    } else {
      fail(ErrorCode::kInternal, "a cold block in L3 without its key summaries");
    }
  }
  if (!rows.empty() && sm.numel() < (*std::max_element(rows.begin(), rows.end()) + 1) * per) {
    fail(ErrorCode::kInternal, "no summary rows for the L2 slots");
  }
  cold_summ = host.to(dev, /*non_blocking=*/true);
  if (!entries.empty()) {
    cold_summ.index_copy_(0, on_device(entries, at::kLong, dev), sm.view({-1, per}).index_select(0, on_device(rows, at::kLong, dev)));
  }
  const int32_t S = meta.num_seqs();
  const at::Tensor& reads = sparse->scratch.reads;
  layer_reads = at::empty({S, reads.size(1)}, reads.options().device(at::kCPU).pinned_memory(true));
  staged_reads.assign(static_cast<size_t>(S) * static_cast<size_t>(reads.size(1)), 0);
}

std::vector<uint8_t> LlamaModel::Pass::State::staged_need() {
  const int32_t S = meta.num_seqs(), MB = meta.max_blocks_per_seq, bs = layout.block_size;
  const int64_t stride = layer_reads.size(1);
  if (sparse->scratch.reads.size(1) != stride) {
    fail(ErrorCode::kInternal, "the sparse scratch changed its width during a staged step");
  }
  at::Tensor dev_reads = sparse->scratch.reads.narrow(0, 0, S);
  cuda_glue::copy_to_host_async(dev_reads, layer_reads);
  cuda_glue::synchronize_stream();  // one wait a layer: the lane's steps are eager and disk-bound
  const int32_t* c = layer_reads.data_ptr<int32_t>();
  std::vector<uint8_t> need(meta.cold_blocks.size(), 0);
  for (int32_t s = 0; s < S; ++s) {
    const bool one = meta.query_start[s + 1] - meta.query_start[s] == 1;  // else not counted: reads every block
    const int32_t nb = std::min<int32_t>((meta.context_lens[s] + bs - 1) / bs, MB);
    for (int32_t b = 0; b < nb; ++b) {
      const int32_t k = c[static_cast<int64_t>(s) * stride + b];
      staged_reads[static_cast<size_t>(s * stride + b)] += k;
      const int32_t id = meta.block_tables[static_cast<size_t>(s) * MB + b];
      if (id <= cold_block_id(0) && (!one || k > 0)) need[static_cast<size_t>(cold_block_index(id))] = 1;
    }
  }
  return need;
}
#endif

at::Tensor LlamaModel::Pass::State::logits() {
#ifdef K25_WITH_CUDA
  if (sparse && cuda) cuda_glue::copy_to_host_async(sparse->layer_stats, sparse->host_stats);
  if (sparse && cuda && sparse->scratch.reads.defined() && !prepared) {
    // Lands before the sampled ids, which the host waits for (TorchExecutor::block_reads).
    // A graph step's copy is the replay's (TorchExecutor::copy_reads), not the graph's, so
    // that two steps in flight copy to two places.
    const int64_t S = db.context_lens.numel();
    at::Tensor host = sparse->scratch.host_reads.narrow(0, 0, S);
    cuda_glue::copy_to_host_async(sparse->scratch.reads.narrow(0, 0, S), host);
  }
#endif
  const at::Tensor logits_rows = prepared ? prepared->logits_rows : on_device(meta.logits_rows, at::kInt, dev);
  if (logits_rows.numel() == 0) return at::empty({0, c.vocab_size}, h.options().dtype(at::kFloat));
  // A prepared (CUDA-graph) decode step wants every row's logits, in order.
  at::Tensor rows = prepared ? h : at::index_select(h, 0, logits_rows);
  at::Tensor xr;
  if (fused) {
    xr = at::empty_like(rows);
    norm(rows, W.final_norm, xr);
  } else {
    xr = rms_norm_aten(rows, W.final_norm, c.rms_norm_eps);
  }
  return linear(xr, W.lm_head, at::Tensor()).to(at::kFloat);
}


void LlamaModel::attention_unfused(const at::Tensor& qkv, const BatchMeta& meta, const at::Tensor& kv,
                                   const KVLayout& layout, int32_t layer, at::Tensor& out) const {
  const ModelConfig& c = config_;
  const int64_t D = c.head_dim, Hq = c.num_heads, Hkv = c.num_kv_heads, bs = layout.block_size;
  const int32_t window = c.layer_sliding_window[layer];
  const int64_t num_blocks = kv.numel() / layout.block_elems();
  const auto dev = kv.device();
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  // Index lists go up through pinned memory without a stream sync: a synchronous upload
  // per layer would drain the device queue each time and measure the host, not the ops.
  auto upload = [&](const std::vector<int64_t>& v) {
    at::Tensor h = at::tensor(v, i64);
    return kv.is_cuda() ? h.pin_memory().to(dev, /*non_blocking=*/true) : h;
  };
  // [blocks, layers, K/V, heads, bs * D]
  at::Tensor pool = kv.view({num_blocks, layout.num_layers, 2, Hkv, bs * D}).select(1, layer);
  // Blocks [n, 2, Hkv, bs * D] -> K and V as [n, Hkv, bs, D] views, in the compute dtype (a
  // bfloat16 CPU pool is read back exactly).
  auto split_kv = [&](const at::Tensor& gathered, int64_t n) {
    const at::Tensor blocks = gathered.to(qkv.scalar_type());
    at::Tensor k = layout.k_transposed ? blocks.select(1, 0).view({n, Hkv, D, bs}).transpose(2, 3)
                                       : blocks.select(1, 0).view({n, Hkv, bs, D});
    return std::make_pair(k, blocks.select(1, 1).view({n, Hkv, bs, D}));
  };
  // Single-token queries (decodes) go through one padded SDPA call for all of them: plain
  // ops, but not one small launch sequence per sequence (that measured the host, not the
  // kernels). Keys past a sequence's context are masked and zeroed (never-written slots may
  // hold anything).
  std::vector<int64_t> dec;
  int64_t nb_max = 0;
  for (int32_t s = 0; s < meta.num_seqs(); ++s) {
    if (meta.query_start[s + 1] - meta.query_start[s] != 1) continue;
    dec.push_back(s);
    nb_max = std::max<int64_t>(nb_max, (meta.context_lens[s] + bs - 1) / bs);
  }
  if (!dec.empty()) {
    const int64_t S = static_cast<int64_t>(dec.size()), L = nb_max * bs;
    // One upload: [block table S x nb_max | query rows S | context lengths S].
    std::vector<int64_t> ints(S * nb_max + 2 * S);
    for (int64_t i = 0; i < S; ++i) {
      const int32_t s = static_cast<int32_t>(dec[i]);
      const int32_t* bt = meta.block_tables.data() + static_cast<int64_t>(s) * meta.max_blocks_per_seq;
      const int64_t nb = (meta.context_lens[s] + bs - 1) / bs;
      for (int64_t j = 0; j < nb_max; ++j) ints[i * nb_max + j] = bt[j < nb ? j : 0];
      ints[S * nb_max + i] = meta.query_start[s];
      ints[S * nb_max + S + i] = meta.context_lens[s];
    }
    at::Tensor d_ints = upload(ints);
    at::Tensor r = d_ints.narrow(0, S * nb_max, S);
    auto [kb, vb] = split_kv(at::index_select(pool, 0, d_ints.narrow(0, 0, S * nb_max)), S * nb_max);
    // [S, Hkv, L, D]
    at::Tensor k = kb.view({S, nb_max, Hkv, bs, D}).permute({0, 2, 1, 3, 4}).reshape({S, Hkv, L, D});
    at::Tensor v = vb.view({S, nb_max, Hkv, bs, D}).permute({0, 2, 1, 3, 4}).reshape({S, Hkv, L, D});
    at::Tensor kpos = at::arange(0, L, i64.device(dev)).unsqueeze(0);    // [1, L]
    at::Tensor ctx = d_ints.narrow(0, S * nb_max + S, S).unsqueeze(1);    // [S, 1]
    at::Tensor valid = kpos < ctx;
    if (window > 0) valid = at::logical_and(valid, kpos >= ctx - window);
    at::Tensor keep = valid.view({S, 1, L, 1});
    k = at::where(keep, k, at::zeros({}, k.options())).repeat_interleave(Hq / Hkv, 1);
    v = at::where(keep, v, at::zeros({}, v.options())).repeat_interleave(Hq / Hkv, 1);
    at::Tensor q = qkv.index_select(0, r).narrow(1, 0, Hq * D).reshape({S, Hq, 1, D});
    at::Tensor o = at::scaled_dot_product_attention(q, k, v, valid.view({S, 1, 1, L}));  // [S, Hq, 1, D]
    out.index_copy_(0, r, o.reshape({S, Hq * D}).to(out.scalar_type()));
  }
  for (int32_t s = 0; s < meta.num_seqs(); ++s) {
    const int64_t q0 = meta.query_start[s], q_len = meta.query_start[s + 1] - q0;
    if (q_len == 1) continue;
    const int64_t ctx = meta.context_lens[s];
    const int64_t nb = (ctx + bs - 1) / bs;
    std::vector<int64_t> table(meta.block_tables.begin() + static_cast<int64_t>(s) * meta.max_blocks_per_seq,
                               meta.block_tables.begin() + static_cast<int64_t>(s) * meta.max_blocks_per_seq + nb);
    auto [kb, vb] = split_kv(at::index_select(pool, 0, upload(table)), nb);
    // [Hkv, nb * bs, D]
    at::Tensor k = kb.permute({1, 0, 2, 3}).reshape({Hkv, nb * bs, D});
    at::Tensor v = vb.permute({1, 0, 2, 3}).reshape({Hkv, nb * bs, D});
    k = k.narrow(1, 0, ctx).repeat_interleave(Hq / Hkv, 0);
    v = v.narrow(1, 0, ctx).repeat_interleave(Hq / Hkv, 0);
    at::Tensor q = qkv.narrow(0, q0, q_len).narrow(1, 0, Hq * D).reshape({q_len, Hq, D}).transpose(0, 1);
    at::Tensor qpos = at::arange(ctx - q_len, ctx, i64.device(dev)).unsqueeze(1);
    at::Tensor kpos = at::arange(0, ctx, i64.device(dev)).unsqueeze(0);
    at::Tensor mask = kpos <= qpos;
    if (window > 0) mask = at::logical_and(mask, kpos > qpos - window);
    at::Tensor o = at::scaled_dot_product_attention(q, k, v, mask);  // [Hq, q_len, D]
    out.narrow(0, q0, q_len).copy_(o.transpose(0, 1).reshape({q_len, Hq * D}));
  }
}

at::ScalarType scalar_type_of(const std::string& dtype) {
  if (dtype == "float32") return at::kFloat;
  if (dtype == "bfloat16") return at::kBFloat16;
  if (dtype == "float16") return at::kHalf;
  fail(ErrorCode::kInvalidArgument, "dtype must be float32, bfloat16 or float16, not '" + dtype + "'");
}

}  // namespace k25
