// CPU kernels exposed on torch tensors, for the kernel tests (tests/python/test_cpu_kernels.py).
// The only binding file that includes torch headers.
#include <torch/extension.h>

#include "bindings/bindings.h"
#include "k25/status.h"
#include "ops/attention_plan.h"
#include "ops/cpu_kernels.h"

#ifdef K25_WITH_CUDA
#include "model/cuda_glue.h"
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

KVLayout layout_of(py::tuple l) {
  return KVLayout{l[0].cast<int32_t>(), l[1].cast<int32_t>(), l[2].cast<int32_t>(), l[3].cast<int32_t>()};
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
  cu.def("paged_attention", [](const at::Tensor& q, const at::Tensor& kv, py::tuple layout, int32_t layer,
                               const at::Tensor& query_start, const at::Tensor& context_lens,
                               const at::Tensor& block_tables, int32_t num_heads, double scale, int32_t window,
                               int32_t parallelism) {
    KVLayout L = layout_of(layout);
    L.k_transposed = false;
    at::Tensor qs = query_start.contiguous(), cl = context_lens.contiguous(), bt = block_tables.contiguous();
    AttentionPlanParams pp;
    pp.num_kv_heads = L.num_kv_heads;
    pp.group = num_heads / L.num_kv_heads;
    pp.max_rows = 16;
    pp.parallelism = parallelism;
    pp.sliding_window = window;
    const AttentionPlan plan =
        plan_attention(qs.data_ptr<int32_t>(), cl.data_ptr<int32_t>(), static_cast<int32_t>(cl.size(0)), pp);
    const at::Device dev = q.device();
    cuda_glue::DeviceBatch db = cuda_glue::make_batch(qs.to(dev), cl.to(dev), bt.to(dev), plan, pp.group,
                                                      L.head_dim, dev);
    at::Tensor out = at::empty({q.size(0), static_cast<int64_t>(num_heads) * L.head_dim}, q.options());
    cuda_glue::paged_attention(q, out, kv, L, layer, db, num_heads, scale, window);
    return py::make_tuple(out, static_cast<int>(plan.merges.size() / 4));
  });
  cu.def("argmax_rows", [](const at::Tensor& x) { return cuda_glue::argmax_rows(x); });
}
#endif

}  // namespace

void bind_ops(py::module_& m) {
#ifdef K25_WITH_CUDA
  bind_cuda_ops(m);
#endif
  py::module_ ops = m.def_submodule("ops", "CPU kernels on float32 tensors (for tests)");
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
    check(kv, at::kFloat, "kv");
    cpu::write_kv(qkv.data_ptr<float>(), qkv.stride(0), slots.contiguous().data_ptr<int64_t>(), qkv.size(0),
                  num_heads, kv.data_ptr<float>(), layout_of(layout), layer);
  });
  ops.def("rope_write_kv", [](at::Tensor qkv, const at::Tensor& positions, const at::Tensor& slots, int32_t num_heads,
                              const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv, py::tuple layout,
                              int32_t layer) {
    check_rows(qkv, "qkv");
    check(positions, at::kInt, "positions");
    check(slots, at::kLong, "slot_mapping");
    check(kv, at::kFloat, "kv");
    cpu::rope_write_kv(qkv.data_ptr<float>(), qkv.stride(0), positions.contiguous().data_ptr<int32_t>(),
                       slots.contiguous().data_ptr<int64_t>(), qkv.size(0), num_heads,
                       cos.contiguous().data_ptr<float>(), sin.contiguous().data_ptr<float>(), kv.data_ptr<float>(),
                       layout_of(layout), layer);
  });
  ops.def("paged_attention", [](const at::Tensor& q, const at::Tensor& kv, py::tuple layout, int32_t layer,
                                const at::Tensor& query_start, const at::Tensor& context_lens,
                                const at::Tensor& block_tables, int32_t num_heads, double scale,
                                int32_t sliding_window) {
    check_rows(q, "q");
    check(kv, at::kFloat, "kv");
    check(query_start, at::kInt, "query_start");
    check(context_lens, at::kInt, "context_lens");
    check(block_tables, at::kInt, "block_tables");
    KVLayout L = layout_of(layout);
    at::Tensor qs = query_start.contiguous(), cl = context_lens.contiguous(), bt = block_tables.contiguous();
    cpu::AttentionBatch b;
    b.query_start = qs.data_ptr<int32_t>();
    b.context_lens = cl.data_ptr<int32_t>();
    b.block_tables = bt.data_ptr<int32_t>();
    b.max_blocks_per_seq = static_cast<int32_t>(bt.size(1));
    b.num_seqs = static_cast<int32_t>(cl.size(0));
    at::Tensor out = at::empty({q.size(0), static_cast<int64_t>(num_heads) * L.head_dim}, q.options());
    {
      py::gil_scoped_release release;
      cpu::paged_attention(q.data_ptr<float>(), q.stride(0), out.data_ptr<float>(), kv.data_ptr<float>(), L, layer, b,
                           num_heads, static_cast<float>(scale), sliding_window);
    }
    return out;
  });
}

}  // namespace k25::bindings
