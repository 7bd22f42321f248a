// CPU kernels exposed on torch tensors, for the kernel tests (tests/python/test_cpu_kernels.py).
// The only binding file that includes torch headers.
#include <torch/extension.h>

#include <cstring>

#include "bindings/bindings.h"
#include "engine/sampler.h"
#include "k25/status.h"
#include "ops/attention_plan.h"
#include "ops/block_sparsity.h"
#include "ops/cpu_kernels.h"
#include "ops/vec16.h"

#ifdef K25_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include "model/cuda_glue.h"
#include "model/llama_model.h"
#endif

namespace py = pybind11;

namespace k25::bindings {

namespace {

void check(const at::Tensor& t, at::ScalarType dt, const char* name) {
  if (t.scalar_type() != dt) throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": wrong dtype");
  if (t.device().type() != at::kCPU) throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": not on CPU");
}

void check_rows(const at::Tensor& t, const char* name) {
  check(t, at::kFloat, name);
  if (t.dim() != 2 || t.stride(1) != 1) {
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": need 2-D rows with unit inner stride");
  }
}

// The CPU kernels' view of one batch (tensors must outlive it).
cpu::AttentionBatch cpu_batch(const at::Tensor& qs, const at::Tensor& cl, const at::Tensor& bt) {
  check(qs, at::kInt, "query_start");
  check(cl, at::kInt, "context_lens");
  check(bt, at::kInt, "block_tables");
  cpu::AttentionBatch b;
  b.query_start = qs.data_ptr<int32_t>();
  b.context_lens = cl.data_ptr<int32_t>();
  b.block_tables = bt.data_ptr<int32_t>();
  b.max_blocks_per_seq = static_cast<int32_t>(bt.size(1));
  b.num_seqs = static_cast<int32_t>(cl.size(0));
  return b;
}

KVLayout layout_of(py::tuple l) {
  return KVLayout{l[0].cast<int32_t>(), l[1].cast<int32_t>(), l[2].cast<int32_t>(), l[3].cast<int32_t>()};
}

// A CPU pool (float32, or bfloat16: KVElem::kBF16) and its layout.
KVLayout pool_layout(const at::Tensor& kv, py::tuple layout) {
  if (kv.device().type() != at::kCPU) throw Error(ErrorCode::kInvalidArgument, "kv: not on CPU");
  if (kv.scalar_type() != at::kFloat && kv.scalar_type() != at::kBFloat16) {
    throw Error(ErrorCode::kInvalidArgument, "kv: the CPU pool is float32 or bfloat16");
  }
  if (!kv.is_contiguous()) throw Error(ErrorCode::kInvalidArgument, "kv: not contiguous");
  KVLayout L = layout_of(layout);
  if (kv.scalar_type() == at::kBFloat16) L.elem = KVElem::kBF16;
  return L;
}

#ifdef K25_WITH_CUDA
void bind_cuda_ops(py::module_& m) {
  py::module_ cu = m.def_submodule("cuda_ops", "CUDA kernels on CUDA tensors (for tests)");
  cu.def("rms_norm", [](const at::Tensor& x, const at::Tensor& w, double eps) {
    at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
    cuda_glue::rms_norm(x, w, out, eps);
    return out;
  });
  cu.def("add_rms_norm", [](at::Tensor h, const at::Tensor& delta, const at::Tensor& w, double eps) {
    at::Tensor out = at::empty_like(h);
    cuda_glue::add_rms_norm(h, delta, w, out, eps);
    return out;
  });
  cu.def("silu_mul", [](const at::Tensor& gu) {
    at::Tensor out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
    cuda_glue::silu_mul(gu, out);
    return out;
  });
  cu.def("rope_write_kv", [](at::Tensor qkv, const at::Tensor& positions, const at::Tensor& slots, int32_t num_heads,
                             const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv, py::tuple layout,
                             int32_t layer) {
    KVLayout L = layout_of(layout);
    L.k_transposed = false;
    cuda_glue::rope_write_kv(qkv, positions, slots, num_heads, cos, sin, kv, L, layer);
  });
  cu.def("rope_inplace", [](at::Tensor qkv, const at::Tensor& positions, int32_t num_heads, int32_t num_kv_heads,
                            const at::Tensor& cos, const at::Tensor& sin) {
    cuda_glue::rope_inplace(qkv, positions, num_heads, num_kv_heads, cos, sin);
  });
  cu.def("write_kv", [](const at::Tensor& qkv, const at::Tensor& slots, int32_t num_heads, at::Tensor kv,
                        py::tuple layout, int32_t layer) {
    KVLayout L = layout_of(layout);
    L.k_transposed = false;
    cuda_glue::write_kv(qkv, slots, num_heads, kv, L, layer);
  });
  // query_start, context_lens, block_tables: int32 CPU tensors (the plan is made on the host).
  // One attention call prepared once (plan and device metadata) and run many times, so
  // tests and benchmarks time the kernels alone. The eager plan (decode_splits 0) splits for
  // `parallelism` workers (the CPU's soft rule: about 2 x parallelism items), or with wave > 0
  // to fit that many CTAs, as LlamaModel's eager steps do with decode_wave(...).
  struct AttentionCall {
    at::Tensor kv;
    KVLayout layout;
    int32_t layer = 0, num_heads = 0, window = 0, merges = 0, decode_tail = 0;
    double scale = 1.0;
    cuda_glue::DeviceBatch batch;
    // Dynamic block sparsity (select): the selection's buffers and the batch it returned.
    cuda_glue::SparseScratch scratch;
    cuda_glue::DeviceBatch sparse;
    at::Tensor run_batch(const at::Tensor& q, const cuda_glue::DeviceBatch& b) const {
      at::Tensor out = at::empty({q.size(0), static_cast<int64_t>(num_heads) * layout.head_dim}, q.options());
      cuda_glue::paged_attention(q, out, kv, layout, layer, b, num_heads, scale, window);
      return out;
    }
    at::Tensor run(const at::Tensor& q) const { return run_batch(q, batch); }
  };
  py::class_<AttentionCall>(cu, "AttentionCall")
      .def(py::init([](const at::Tensor& kv, py::tuple layout, int32_t layer, const at::Tensor& query_start,
                       const at::Tensor& context_lens, const at::Tensor& block_tables, int32_t num_heads,
                       double scale, int32_t window, int32_t parallelism, int32_t decode_splits, int32_t wave,
                       int32_t decode_tail) {
             AttentionCall c;
             c.kv = kv;
             c.layout = layout_of(layout);
             c.layout.k_transposed = false;
             c.layer = layer;
             c.num_heads = num_heads;
             c.scale = scale;
             c.window = window;
             at::Tensor qs = query_start.to(at::kCPU).contiguous(), cl = context_lens.to(at::kCPU).contiguous();
             at::Tensor bt = block_tables.contiguous();
             const int32_t num_seqs = static_cast<int32_t>(cl.size(0));
             const int32_t group = num_heads / c.layout.num_kv_heads;
             const at::Device dev = kv.device();
             if (decode_splits > 0) {
               // The CUDA-graph form: a decode-only batch whose work the kernels derive.
               if (qs.size(0) != num_seqs + 1 || qs[num_seqs].item<int32_t>() != num_seqs) {
                 throw Error(ErrorCode::kInvalidArgument, "decode_splits needs one query token per sequence");
               }
               cuda_glue::DeviceBatch& db = c.batch;
               db.query_start = qs.to(dev);
               db.context_lens = cl.to(dev);
               db.block_tables = bt.to(dev);
               db.max_blocks = static_cast<int32_t>(bt.size(1));
               db.decode_splits = decode_splits;
               db.num_seqs = num_seqs;
               // decode_tail < 0: the engine's rule (cuda_glue::decode_tail_for); 1 is no tail (0).
               if (decode_tail > 64) {
                 throw Error(ErrorCode::kInvalidArgument, "decode_tail is at most 64 (or -1: the engine's rule)");
               }
               db.decode_tail = decode_tail < 0 ? cuda_glue::decode_tail_for(kv.scalar_type(), c.layout.head_dim, group,
                                                                             num_seqs, c.layout.num_kv_heads,
                                                                             decode_splits)
                                                : (decode_tail >= 2 ? decode_tail : 0);
               c.decode_tail = db.decode_tail;
               db.partials = cuda_glue::derived_partials(num_seqs, c.layout.num_kv_heads, decode_splits, db.decode_tail,
                                                         group, c.layout.head_dim, dev);
               if (decode_splits > 1) {
                 db.split_counters = cuda_glue::derived_split_counters(num_seqs, c.layout.num_kv_heads, dev);
               }
               c.merges = decode_splits > 1 ? num_seqs * c.layout.num_kv_heads : 0;
             } else {
               AttentionPlanParams pp;
               pp.num_kv_heads = c.layout.num_kv_heads;
               pp.group = group;
               pp.max_rows = cuda_glue::attention_max_rows(kv.scalar_type());
               pp.parallelism = parallelism;
               pp.wave = wave;
               pp.sliding_window = window;
               pp.decode_first = true;
               const AttentionPlan plan = plan_attention(qs.data_ptr<int32_t>(), cl.data_ptr<int32_t>(), num_seqs, pp);
               c.batch = cuda_glue::make_batch(qs.to(dev), cl.to(dev), bt.to(dev), plan, group, c.layout.head_dim, dev);
               c.merges = static_cast<int32_t>(plan.merges.size() / 4);
             }
             return c;
           }),
           py::arg("kv"), py::arg("layout"), py::arg("layer"), py::arg("query_start"), py::arg("context_lens"),
           py::arg("block_tables"), py::arg("num_heads"), py::arg("scale"), py::arg("window"),
           py::arg("parallelism"), py::arg("decode_splits") = 0, py::arg("wave") = 0, py::arg("decode_tail") = -1)
      .def("run", &AttentionCall::run, py::arg("q"))
      .def_readonly("merges", &AttentionCall::merges)
      .def_readonly("decode_tail", &AttentionCall::decode_tail)
      // Recomputes the summaries of every block the batch's query tokens wrote.
      .def("update_summaries",
           [](AttentionCall& c, at::Tensor& summaries, bool key_codes) {
             cuda_glue::update_block_summaries(c.kv, c.layout, c.layer, summaries, c.batch, key_codes);
           },
           py::arg("summaries"), py::arg("key_codes") = false)
      // One selection over the batch; returns (head tables [S, Hkv, max_blocks], kept
      // lengths [S]); run_sparse then attends over them.
      .def("select",
           [](AttentionCall& c, const at::Tensor& q, const at::Tensor& summaries, at::Tensor& layer_stats,
              int32_t min_context, int32_t sink_blocks, int32_t recent_blocks, double min_ratio, double max_ratio,
              double mass_target, bool count_reads, bool key_codes, py::object reuse, py::object memory) {
             const int32_t S = static_cast<int32_t>(c.batch.context_lens.numel());
             // Selection reuse: reuse int32 [S] on the device (cuda::SparseSelect::reuse) and memory
             // (positions int32 [slots, num_layers, Hkv, stride], counts int32 [slots, num_layers]).
             if (reuse.is_none() != memory.is_none()) {
               throw Error(ErrorCode::kInvalidArgument, "reuse and memory go together");
             }
             cuda_glue::SparseMemory mem;
             cuda_glue::DeviceBatch batch = c.batch;
             if (!reuse.is_none()) {
               batch.reuse = reuse.cast<at::Tensor>();
               auto t = memory.cast<py::tuple>();
               mem.positions = t[0].cast<at::Tensor>();
               mem.counts = t[1].cast<at::Tensor>();
               // (Checked on the host, except inside a CUDA graph's capture, which allows no copy back.)
               if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
                 const at::Tensor r = batch.reuse.to(at::kCPU).to(at::kInt).contiguous();
                 for (int64_t i = 0; i < r.numel(); ++i) {
                   if (r.data_ptr<int32_t>()[i] >= 2 * mem.counts.size(0)) {
                     throw Error(ErrorCode::kInvalidArgument, "reuse names a slot past the memory's");
                   }
                 }
               }
             }
             if (!c.scratch.raw.defined() || c.scratch.reads.defined() != count_reads) {
               c.scratch = cuda_glue::make_sparse_scratch(S, c.batch.max_blocks, c.num_heads, c.layout.num_kv_heads,
                                                          c.kv.device(), count_reads);
             }
             if (count_reads) c.scratch.reads.zero_();
             SparsityParams p;
             p.min_context = min_context;
             p.sink_blocks = sink_blocks;
             p.recent_blocks = recent_blocks;
             p.min_ratio = static_cast<float>(min_ratio);
             p.max_ratio = static_cast<float>(max_ratio);
             p.mass_target = static_cast<float>(mass_target);
             p.score_channels = 0;
             p.key_codes = key_codes;
             c.sparse = cuda_glue::select_blocks(q, c.layout, c.layer, summaries, c.kv.numel() / c.layout.block_elems(),
                                                 batch, c.num_heads, c.scale, p, c.scratch, layer_stats, at::Tensor(),
                                                 reuse.is_none() ? nullptr : &mem);
             if (count_reads) {
               // and the block reads [S, max_blocks] the selection counted (SparseSelect::block_reads)
               return py::tuple(py::make_tuple(c.sparse.head_tables.narrow(0, 0, S), c.sparse.context_lens,
                                               c.scratch.reads.narrow(0, 0, S)));
             }
             return py::tuple(py::make_tuple(c.sparse.head_tables.narrow(0, 0, S), c.sparse.context_lens));
           },
           py::arg("q"), py::arg("summaries"), py::arg("layer_stats"), py::arg("min_context"),
           py::arg("sink_blocks"), py::arg("recent_blocks"), py::arg("min_ratio"), py::arg("max_ratio"),
           py::arg("mass_target"), py::arg("count_reads") = false, py::arg("key_codes") = false,
           py::arg("reuse") = py::none(), py::arg("memory") = py::none())
      // The last selection's raw scores [S, num_heads, 2, max_blocks] (the bound and the centre
      // estimate, or with key codes the block's log-mass twice), for tests; written for the
      // sequences that selected.
      .def("selection_raw",
           [](const AttentionCall& c) {
             if (!c.scratch.raw.defined()) throw Error(ErrorCode::kInvalidArgument, "no selection has run");
             const int64_t S = c.batch.context_lens.numel(), MB = c.batch.max_blocks;
             return c.scratch.raw.narrow(0, 0, S * c.num_heads * 2 * MB).view({S, c.num_heads, 2, MB});
           })
      .def("run_sparse", [](const AttentionCall& c, const at::Tensor& q) { return c.run_batch(q, c.sparse); });
  cu.def("make_block_summaries", [](int64_t num_blocks, py::tuple layout, const at::Tensor& like, bool key_codes) {
    return cuda_glue::make_block_summaries(num_blocks, layout_of(layout), like.scalar_type(), like.device(), key_codes);
  }, py::arg("num_blocks"), py::arg("layout"), py::arg("like"), py::arg("key_codes") = false);
  // CTAs of the decode kernel resident at once for this dtype, head_dim and GQA group: the
  // wave LlamaModel's eager plan splits to fit (AttentionPlanParams::wave).
  cu.def("decode_wave", [](const at::Tensor& like, int32_t head_dim, int32_t group) {
    return cuda_glue::decode_wave(like.scalar_type(), head_dim, group);
  });
  cu.def("decode_splits_for", [](const at::Tensor& like, int32_t head_dim, int32_t group, int32_t num_seqs,
                                 int32_t num_kv_heads) {
    return cuda_glue::decode_splits_for(like.scalar_type(), head_dim, group, num_seqs, num_kv_heads);
  });
  // The device sampler on rows of a CUDA float32 logits matrix (modified in place); each
  // row: (params, logits_row, seed, tokens, num_prompt_tokens, banned). The draw counter
  // is the output length, as in the engine.
  cu.def("sample", [](at::Tensor logits, const std::vector<py::tuple>& rows) {
    std::vector<std::vector<int32_t>> tokens(rows.size()), banned(rows.size());
    std::vector<SamplingParams> params(rows.size());
    std::vector<cuda_glue::SampleSpec> specs(rows.size());
    std::vector<int32_t> counts;
    for (size_t i = 0; i < rows.size(); ++i) {
      const py::tuple& r = rows[i];
      params[i] = r[0].cast<SamplingParams>();
      validate_sampling_params(params[i], static_cast<int32_t>(logits.size(1)));
      tokens[i] = r[3].cast<std::vector<int32_t>>();
      banned[i] = r[5].cast<std::vector<int32_t>>();
      const int32_t num_prompt = r[4].cast<int32_t>();
      for (int32_t t : tokens[i]) {
        if (t < 0 || t >= logits.size(1)) throw Error(ErrorCode::kInvalidArgument, "token out of range");
      }
      for (int32_t t : banned[i]) {
        if (t < 0 || t >= logits.size(1)) throw Error(ErrorCode::kInvalidArgument, "banned id out of range");
      }
      cuda_glue::SampleSpec& sp = specs[i];
      sp.params = &params[i];
      sp.logits_row = r[1].cast<int32_t>();
      sp.seed = r[2].cast<uint64_t>();
      sp.counter = tokens[i].size() - static_cast<size_t>(num_prompt);
      sp.banned = banned[i].empty() ? nullptr : &banned[i];
      cuda_glue::add_penalties(sp, tokens[i], num_prompt, counts);
    }
    py::list out;
    for (const cuda_glue::SampleOutput& o : cuda_glue::sample(logits, specs)) {
      py::list top;
      for (const auto& [id, lp] : o.top) top.append(py::make_tuple(id, lp));
      out.append(py::make_tuple(o.error ? -1 : o.token, o.logprob, top));
    }
    return out;
  });
  cu.def("argmax_rows", [](const at::Tensor& x) { return cuda_glue::argmax_rows(x); });
  cu.def(
      "gemv",
      [](const at::Tensor& x, const at::Tensor& w, std::optional<at::Tensor> b) {
        return cuda_glue::gemv(x, w, b ? *b : at::Tensor());
      },
      py::arg("x"), py::arg("w"), py::arg("b") = py::none());
  cu.def("gemv_supported", [](const at::Tensor& x, const at::Tensor& w, std::optional<at::Tensor> b) {
    return cuda_glue::gemv_supported(x, w, b ? *b : at::Tensor());
  }, py::arg("x"), py::arg("w"), py::arg("b") = py::none());
}
#endif

}  // namespace

void bind_ops(py::module_& m) {
  // Host bytes of one block's key summaries on the CPU backend (the float32 rows of
  // SummaryLayout: bounds, key codes, sums for compensation), for the memory calculator.
  m.def("cpu_summary_bytes", [](py::tuple layout, bool key_codes, bool sums) {
    return SummaryLayout::of(layout_of(layout), key_codes, sums).block_elems() * static_cast<int64_t>(sizeof(float));
  }, py::arg("layout"), py::arg("key_codes"), py::arg("sums"));
#ifdef K25_WITH_CUDA
  bind_cuda_ops(m);
  // Device bytes of dynamic sparsity for the pool's sizing (K25Model, gpu_memory_utilization):
  // one block's key summaries and the selection's scratch, from the allocations' own sizes.
  m.def("cuda_sparsity_bytes", [](py::tuple layout, const std::string& dtype, int32_t num_heads, int32_t num_seqs,
                                  int32_t max_blocks, bool count_reads, bool key_codes) {
    const at::ScalarType t = scalar_type_of(dtype);
    const KVLayout L = layout_of(layout);
    return py::make_tuple(cuda_glue::block_summary_bytes(L, t, key_codes),
                          cuda_glue::sparse_scratch_bytes(num_seqs, max_blocks, num_heads, L.num_kv_heads, count_reads));
  }, py::arg("layout"), py::arg("dtype"), py::arg("num_heads"), py::arg("num_seqs"), py::arg("max_blocks"),
     py::arg("count_reads"), py::arg("key_codes") = false);
  // Device bytes of the kept selections (sparsity_selection_interval > 1): `slots` rows of
  // `stride` blocks (cuda_glue::make_sparse_memory).
  m.def("cuda_sparse_memory_bytes", [](py::tuple layout, int32_t slots, int32_t stride) {
    return cuda_glue::sparse_memory_bytes(slots, layout_of(layout), stride);
  }, py::arg("layout"), py::arg("slots"), py::arg("stride"));
#endif
  py::module_ ops = m.def_submodule("ops", "CPU kernels on float32 tensors (for tests)");
  // The 16-lane exp and log of ops/vec16.h, elementwise (for their accuracy tests).
  auto lanes16 = [](const at::Tensor& x, float pad, cpu::v16 (*fn)(cpu::v16)) {
    check(x, at::kFloat, "x");
    at::Tensor in = x.contiguous();
    at::Tensor out = at::empty_like(in);
    const float* src = in.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    for (int64_t i = 0; i < in.numel(); i += 16) {
      cpu::v16 v = cpu::v16{} + pad;
      const int64_t n = std::min<int64_t>(16, in.numel() - i);
      for (int64_t t = 0; t < n; ++t) v[t] = src[i + t];
      v = fn(v);
      for (int64_t t = 0; t < n; ++t) dst[i + t] = v[t];
    }
    return out;
  };
  ops.def("vexp16", [=](const at::Tensor& x) { return lanes16(x, 0.0f, cpu::vexp16); });
  ops.def("vlog16", [=](const at::Tensor& x) { return lanes16(x, 1.0f, cpu::vlog16); });
  ops.def("vexp8d", [](const at::Tensor& x) {
    check(x, at::kDouble, "x");
    at::Tensor in = x.contiguous();
    at::Tensor out = at::empty_like(in);
    const double* src = in.data_ptr<double>();
    double* dst = out.data_ptr<double>();
    for (int64_t i = 0; i < in.numel(); i += 8) {
      cpu::v8d v{};
      const int64_t n = std::min<int64_t>(8, in.numel() - i);
      for (int64_t t = 0; t < n; ++t) v[t] = src[i + t];
      v = cpu::vexp8d(v);
      for (int64_t t = 0; t < n; ++t) dst[i + t] = v[t];
    }
    return out;
  });
  ops.def("linear_few_rows", [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
    check_rows(x, "x");
    check_rows(w, "w");
    if (!w.is_contiguous() || w.size(1) != x.size(1)) {
      throw Error(ErrorCode::kInvalidArgument, "w must be contiguous [N, K] with x's K");
    }
    const int64_t N = w.size(0);
    at::Tensor bc;
    if (b) {
      check(*b, at::kFloat, "b");
      bc = b->contiguous();
      if (bc.numel() != N) throw Error(ErrorCode::kInvalidArgument, "b must have N elements");
    }
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    cpu::linear_few_rows(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), b ? bc.data_ptr<float>() : nullptr,
                         y.data_ptr<float>(), N, x.size(0), 0, N, x.size(1));
    return y;
  }, py::arg("x"), py::arg("w"), py::arg("b") = py::none());
  ops.def("rms_norm", [](const at::Tensor& x, const at::Tensor& w, double eps) {
    check_rows(x, "x");
    check(w, at::kFloat, "w");
    at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
    cpu::rms_norm(x.data_ptr<float>(), x.stride(0), w.contiguous().data_ptr<float>(), out.data_ptr<float>(),
                  out.stride(0), x.size(0), x.size(1), static_cast<float>(eps));
    return out;
  });
  ops.def("add_rms_norm", [](at::Tensor h, const at::Tensor& delta, const at::Tensor& w, double eps) {
    check_rows(h, "h");
    if (!h.is_contiguous() || !delta.is_contiguous() || !h.sizes().equals(delta.sizes())) {
      throw Error(ErrorCode::kInvalidArgument, "h and delta must be contiguous and of one shape");
    }
    at::Tensor out = at::empty_like(h);
    cpu::add_rms_norm(h.data_ptr<float>(), delta.data_ptr<float>(), w.contiguous().data_ptr<float>(),
                      out.data_ptr<float>(), h.size(0), h.size(1), static_cast<float>(eps));
    return out;
  });
  ops.def("silu_mul", [](const at::Tensor& gu) {
    check_rows(gu, "gu");
    at::Tensor c = gu.contiguous();
    at::Tensor out = at::empty({c.size(0), c.size(1) / 2}, c.options());
    cpu::silu_mul(c.data_ptr<float>(), out.data_ptr<float>(), c.size(0), c.size(1) / 2);
    return out;
  });
  ops.def("rope_inplace", [](at::Tensor qkv, const at::Tensor& positions, int32_t num_heads, int32_t num_kv_heads,
                             int32_t head_dim, const at::Tensor& cos, const at::Tensor& sin) {
    check_rows(qkv, "qkv");
    check(positions, at::kInt, "positions");
    cpu::rope_inplace(qkv.data_ptr<float>(), qkv.stride(0), positions.contiguous().data_ptr<int32_t>(),
                      qkv.size(0), num_heads, num_kv_heads, head_dim, cos.contiguous().data_ptr<float>(),
                      sin.contiguous().data_ptr<float>());
  });
  ops.def("write_kv", [](const at::Tensor& qkv, const at::Tensor& slots, int32_t num_heads, at::Tensor kv,
                         py::tuple layout, int32_t layer) {
    check_rows(qkv, "qkv");
    check(slots, at::kLong, "slot_mapping");
    const KVLayout L = pool_layout(kv, layout);
    cpu::write_kv(qkv.data_ptr<float>(), qkv.stride(0), slots.contiguous().data_ptr<int64_t>(), qkv.size(0),
                  num_heads, kv.data_ptr(), L, layer);
  });
  ops.def("rope_write_kv", [](at::Tensor qkv, const at::Tensor& positions, const at::Tensor& slots, int32_t num_heads,
                              const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv, py::tuple layout,
                              int32_t layer) {
    check_rows(qkv, "qkv");
    check(positions, at::kInt, "positions");
    check(slots, at::kLong, "slot_mapping");
    const KVLayout L = pool_layout(kv, layout);
    cpu::rope_write_kv(qkv.data_ptr<float>(), qkv.stride(0), positions.contiguous().data_ptr<int32_t>(),
                       slots.contiguous().data_ptr<int64_t>(), qkv.size(0), num_heads,
                       cos.contiguous().data_ptr<float>(), sin.contiguous().data_ptr<float>(), kv.data_ptr(), L,
                       layer);
  });
  ops.def("paged_attention", [](const at::Tensor& q, const at::Tensor& kv, py::tuple layout, int32_t layer,
                                const at::Tensor& query_start, const at::Tensor& context_lens,
                                const at::Tensor& block_tables, int32_t num_heads, double scale,
                                int32_t sliding_window) {
    check_rows(q, "q");
    const KVLayout L = pool_layout(kv, layout);
    at::Tensor qs = query_start.contiguous(), cl = context_lens.contiguous(), bt = block_tables.contiguous();
    const cpu::AttentionBatch b = cpu_batch(qs, cl, bt);
    at::Tensor out = at::empty({q.size(0), static_cast<int64_t>(num_heads) * L.head_dim}, q.options());
    {
      py::gil_scoped_release release;
      cpu::paged_attention(q.data_ptr<float>(), q.stride(0), out.data_ptr<float>(), kv.data_ptr(), L, layer, b,
                           num_heads, static_cast<float>(scale), sliding_window);
    }
    return out;
  });

  // The attention work list that the CPU and CUDA launchers plan (ops/attention_plan.h): (work
  // [n, 8] int32 rows seq, kv_head, q_begin, q_end, key_begin, key_end, partial, merge; merges
  // [m, 4] rows seq, kv_head, first partial, count; num_decode).
  ops.def("plan_attention", [](const at::Tensor& query_start, const at::Tensor& context_lens, int32_t num_kv_heads,
                               int32_t group, int32_t max_rows, int32_t parallelism, int32_t wave,
                               int32_t min_split_keys, int32_t sliding_window) {
    check(query_start, at::kInt, "query_start");
    check(context_lens, at::kInt, "context_lens");
    at::Tensor qs = query_start.contiguous(), cl = context_lens.contiguous();
    if (qs.dim() != 1 || cl.dim() != 1 || qs.size(0) != cl.size(0) + 1) {
      throw Error(ErrorCode::kInvalidArgument, "need query_start [S + 1] and context_lens [S]");
    }
    if (num_kv_heads < 1 || group < 1 || max_rows < 1) {
      throw Error(ErrorCode::kInvalidArgument, "plan_attention: num_kv_heads, group and max_rows must be >= 1");
    }
    AttentionPlanParams pp;
    pp.num_kv_heads = num_kv_heads;
    pp.group = group;
    pp.max_rows = max_rows;
    pp.parallelism = parallelism;
    pp.wave = wave;
    pp.min_split_keys = min_split_keys;
    pp.sliding_window = sliding_window;
    pp.decode_first = true;
    const AttentionPlan plan =
        plan_attention(qs.data_ptr<int32_t>(), cl.data_ptr<int32_t>(), static_cast<int32_t>(cl.size(0)), pp);
    static_assert(sizeof(AttnWorkItem) == 8 * sizeof(int32_t), "work rows of 8 ints");
    const auto n = static_cast<int64_t>(plan.work.size());
    at::Tensor work = at::empty({n, 8}, at::kInt);
    at::Tensor merges = at::empty({static_cast<int64_t>(plan.merges.size()) / 4, 4}, at::kInt);
    std::memcpy(work.data_ptr<int32_t>(), plan.work.data(), n * sizeof(AttnWorkItem));
    std::memcpy(merges.data_ptr<int32_t>(), plan.merges.data(), plan.merges.size() * sizeof(int32_t));
    return py::make_tuple(work, merges, plan.num_decode);
  }, py::arg("query_start"), py::arg("context_lens"), py::arg("num_kv_heads"), py::arg("group"), py::arg("max_rows"),
     py::arg("parallelism"), py::arg("wave"), py::arg("min_split_keys"), py::arg("sliding_window"));

  // Dynamic sparsity (ops/block_sparsity.h). summaries: float32 [blocks, layers, kv heads, fields,
  // head_dim]: the packed bfloat16 min and max words; with key_codes the codes' ceil(block_size / 16)
  // fields; then, optionally, the key and value sums used by compensation.
  auto summary_layout = [](const at::Tensor& summaries, const KVLayout& L, bool key_codes) {
    check(summaries, at::kFloat, "summaries");
    const SummaryLayout plain = SummaryLayout::of(L, key_codes, false), sums = SummaryLayout::of(L, key_codes, true);
    const bool with_sums = summaries.dim() == 5 && summaries.size(3) == sums.fields;
    if (!summaries.is_contiguous() || summaries.dim() != 5 || summaries.size(1) != L.num_layers ||
        summaries.size(2) != L.num_kv_heads || (summaries.size(3) != plain.fields && !with_sums) ||
        summaries.size(4) != L.head_dim) {
      throw Error(ErrorCode::kInvalidArgument,
                  "summaries must be contiguous [blocks, layers, kv_heads, fields, head_dim] with fields " +
                      std::to_string(plain.fields) + " or " + std::to_string(sums.fields) + " (with sums)");
    }
    return with_sums ? sums : plain;
  };
  ops.def("update_key_summaries", [=](const at::Tensor& kv, py::tuple layout, at::Tensor summaries, int32_t layer,
                                      const at::Tensor& query_start, const at::Tensor& context_lens,
                                      const at::Tensor& block_tables, bool key_codes) {
    const KVLayout L = pool_layout(kv, layout);
    const SummaryLayout S = summary_layout(summaries, L, key_codes);
    at::Tensor qs = query_start.contiguous(), cl = context_lens.contiguous(), bt = block_tables.contiguous();
    const cpu::AttentionBatch b = cpu_batch(qs, cl, bt);
    py::gil_scoped_release release;
    update_key_summaries(kv.data_ptr(), L, summaries.data_ptr<float>(), S, layer, b);
  }, py::arg("kv"), py::arg("layout"), py::arg("summaries"), py::arg("layer"), py::arg("query_start"),
     py::arg("context_lens"), py::arg("block_tables"), py::arg("key_codes") = false);
  ops.def(
      "sparse_attention",
      [=](const at::Tensor& q, const at::Tensor& kv, py::tuple layout, int32_t layer, const at::Tensor& query_start,
          const at::Tensor& context_lens, const at::Tensor& block_tables, const at::Tensor& summaries,
          int32_t num_heads, double scale, int32_t min_context, int32_t recent_blocks, int32_t sink_blocks,
          double max_ratio, double mass_target, bool compensation, int32_t score_channels, bool key_codes,
          bool info, py::object reuse) -> py::object {
        check_rows(q, "q");
        const KVLayout L = pool_layout(kv, layout);
        const SummaryLayout S = summary_layout(summaries, L, key_codes);
        at::Tensor qs = query_start.contiguous(), cl = context_lens.contiguous(), bt = block_tables.contiguous();
        const cpu::AttentionBatch b = cpu_batch(qs, cl, bt);
        SparsityParams p;
        p.min_context = min_context;
        p.recent_blocks = recent_blocks;
        p.sink_blocks = sink_blocks;
        p.max_ratio = static_cast<float>(max_ratio);
        p.mass_target = static_cast<float>(mass_target);
        p.compensation = compensation;
        if (score_channels < 0) throw Error(ErrorCode::kInvalidArgument, "score_channels must be >= 0");
        p.score_channels = score_channels;
        p.key_codes = key_codes;
        if (compensation && !S.has_sums()) {
          throw Error(ErrorCode::kInvalidArgument, "compensation needs summaries with sums (fields " +
                                                       std::to_string(SummaryLayout::of(L, key_codes, true).fields) +
                                                       ")");
        }
        // reuse: None, or per sequence None or an earlier selection's kept positions [Hkv][count]
        // (select_blocks' ReusedSelection; the info dict's "positions" of that call, cut at -1):
        // lists of ints, or an int32 tensor [Hkv, count].
        std::vector<std::vector<int32_t>> reuse_rows;
        std::vector<ReusedSelection> reused;
        if (!reuse.is_none()) {
          py::list rl = reuse.cast<py::list>();
          if (static_cast<int32_t>(rl.size()) != b.num_seqs) {
            throw Error(ErrorCode::kInvalidArgument, "reuse needs one entry per sequence");
          }
          reuse_rows.resize(rl.size());
          reused.resize(rl.size());
          for (size_t i = 0; i < rl.size(); ++i) {
            if (rl[i].is_none()) continue;
            int32_t count = 0;  // kept positions per KV head
            if (THPVariable_Check(rl[i].ptr())) {
              // [Hkv, count] int32: the rows as they lie (no conversion of Python ints, which a
              // timing loop would otherwise count: ~12 us for 309 of them on this box).
              const at::Tensor t = rl[i].cast<at::Tensor>();
              if (t.scalar_type() != at::kInt || !t.device().is_cpu() || t.dim() != 2 ||
                  t.size(0) != L.num_kv_heads || t.size(1) == 0) {
                throw Error(ErrorCode::kInvalidArgument,
                            "a reused selection as a tensor is int32 [num_kv_heads, count > 0] on the CPU");
              }
              const at::Tensor c = t.contiguous();
              reuse_rows[i].assign(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.numel());
              count = static_cast<int32_t>(t.size(1));
            } else {
              auto heads = rl[i].cast<std::vector<std::vector<int32_t>>>();
              if (static_cast<int32_t>(heads.size()) != L.num_kv_heads || heads[0].empty()) {
                throw Error(ErrorCode::kInvalidArgument, "a reused selection has one non-empty row per KV head");
              }
              for (const auto& h : heads) {
                if (h.size() != heads[0].size()) {
                  throw Error(ErrorCode::kInvalidArgument, "a reused selection's rows have one length");
                }
                reuse_rows[i].insert(reuse_rows[i].end(), h.begin(), h.end());
              }
              count = static_cast<int32_t>(heads[0].size());
            }
            reused[i] = ReusedSelection{reuse_rows[i].data(), count};
          }
        }
        // info=False (timing): the selection's buffers persist across calls, as the engine's
        // per-layer selections do, and no Python lists are built.
        thread_local LayerSelection kept_sel;
        thread_local std::vector<float> kept_lse;
        LayerSelection fresh_sel;
        std::vector<float> fresh_lse;
        LayerSelection& sel = info ? fresh_sel : kept_sel;
        std::vector<float>& lse = info ? fresh_lse : kept_lse;
        at::Tensor out = at::empty({q.size(0), static_cast<int64_t>(num_heads) * L.head_dim}, q.options());
        {
          py::gil_scoped_release release;
          sparse_decode_attention(q.data_ptr<float>(), q.stride(0), out.data_ptr<float>(), kv.data_ptr(), L,
                                  layer, b, summaries.data_ptr<float>(), S, num_heads, static_cast<float>(scale), p,
                                  &sel, &lse, reused.empty() ? nullptr : reused.data());
        }
        if (!info) return py::cast(out);
        py::dict d;
        d["context_lens"] = sel.context_lens;
        d["sparse"] = std::vector<int32_t>(sel.sparse.begin(), sel.sparse.end());
        d["head_tables"] = sel.head_tables;
        d["blocks_total"] = sel.blocks_total;
        d["blocks_kept"] = sel.blocks_kept;
        d["selections"] = sel.selections;
        d["reused_selections"] = sel.reused_selections;
        d["reused"] = std::vector<int32_t>(sel.reused.begin(), sel.reused.end());
        d["positions"] = sel.positions;
        d["entropy_bits"] = sel.entropy_bits;
        d["top_blocks"] = sel.top_blocks;
        return py::make_tuple(out, d);
      },
      py::arg("q"), py::arg("kv"), py::arg("layout"), py::arg("layer"), py::arg("query_start"),
      py::arg("context_lens"), py::arg("block_tables"), py::arg("summaries"), py::arg("num_heads"), py::arg("scale"),
      py::arg("min_context") = 2048, py::arg("recent_blocks") = 2, py::arg("sink_blocks") = 1,
      py::arg("max_ratio") = 0.6, py::arg("mass_target") = 0.95, py::arg("compensation") = false,
      py::arg("score_channels") = 8, py::arg("key_codes") = false, py::arg("info") = true,
      py::arg("reuse") = py::none());
}

}  // namespace k25::bindings
