// The KV tier mover on a fake L1 pool, for tests: state-machine properties, round trips
// through L2 and L3, and fault handling on real files.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <mutex>
#include <vector>

#include "bindings/bindings.h"
#include "k25/status.h"
#include "kv/tiers/async_file.h"
#include "kv/tiers/crc32c.h"
#include "kv/tiers/page_format.h"
#include "kv/tiers/predictor.h"
#include "kv/tiers/tier_manager.h"

namespace py = pybind11;

namespace k25::bindings {

namespace {

const char* tier_str(Tier t) { return t == Tier::kL1 ? "L1" : t == Tier::kL2 ? "L2" : "L3"; }

py::dict histogram_dict(const LatencyHistogram& h) {
  py::dict d;
  d["bounds"] = std::vector<double>(LatencyHistogram::kBounds.begin(), LatencyHistogram::kBounds.end());
  d["counts"] = std::vector<int64_t>(h.counts.begin(), h.counts.end());
  d["count"] = h.count;
  d["sum"] = h.sum;
  return d;
}

}  // namespace

py::dict predictor_counters_dict(const PredictorCounters& c) {
  py::dict d;
  d["steps"] = c.steps;
  d["reads_l1"] = c.reads_l1;
  d["reads_lower"] = c.reads_lower;
  d["reads_l2"] = c.reads_l2;
  d["reads_l3"] = c.reads_l3;
  d["hit_rate"] = c.hit_rate();
  d["promotions"] = c.promotions;
  d["exchanges"] = c.exchanges;
  d["promotions_read"] = c.promotions_read;
  d["entropy_holds"] = c.entropy_holds;
  d["access_entropy"] = c.mean_entropy();
  return d;
}

py::dict tier_stats_dict(const TierStats& s) {
  py::dict d;
  d["offloads"] = s.offloads;
  d["offloads_to_l2"] = s.offloads_to_l2;
  d["l2_blocks"] = s.l2_blocks;
  d["l3_blocks"] = s.l3_blocks;
  d["offloads_to_l3"] = s.offloads_to_l3;
  d["spills"] = s.spills;
  d["fetches"] = s.fetches;
  d["fetches_from_l2"] = s.fetches_from_l2;
  d["fetches_from_l3"] = s.fetches_from_l3;
  d["l3_slice_reads"] = s.l3_slice_reads;
  d["cancelled"] = s.cancelled;
  d["refused"] = s.refused;
  d["failures"] = s.failures();
  py::dict faults;
  for (int i = 2; i < kNumTierFaults; ++i) faults[tier_fault_name(static_cast<TierFault>(i))] = s.faults[i];
  d["faults"] = faults;
  d["bytes_to_l2"] = s.bytes_to_l2;
  d["bytes_from_l2"] = s.bytes_from_l2;
  d["bytes_to_l3"] = s.bytes_to_l3;
  d["bytes_from_l3"] = s.bytes_from_l3;
  d["offload_latency"] = histogram_dict(s.offload_latency);
  d["fetch_latency"] = histogram_dict(s.fetch_latency);
  d["spill_latency"] = histogram_dict(s.spill_latency);
  return d;
}

namespace {

// A TierManager over an L1 pool of its own; completions and log lines are collected in
// C++ (callbacks run on worker threads, which must not touch Python).
class TierHarness {
 public:
  TierHarness(int32_t num_l1_blocks, int64_t block_bytes, int64_t l2_bytes, const std::string& l3_path,
              int64_t l3_bytes, bool manual, const std::string& io_backend, int32_t staging, int32_t io_threads) {
    if (num_l1_blocks <= 0 || block_bytes <= 0) throw Error(ErrorCode::kInvalidArgument, "bad L1 sizes");
    l1_.assign(static_cast<size_t>(num_l1_blocks) * static_cast<size_t>(block_bytes), 0);
    TierConfig c;
    c.block_bytes = block_bytes;
    c.l2_bytes = l2_bytes;
    c.l2_staging_slots = staging;
    c.l3_path = l3_path;
    c.l3_bytes = l3_bytes;
    c.manual = manual;
    c.io_backend = io_backend;
    c.io_threads = io_threads;
    mgr_ = std::make_unique<TierManager>(c, num_l1_blocks, l1_.data(), [this](const std::string& line) {
      std::lock_guard<std::mutex> lk(mu_);
      logs_.push_back(line);
    });
  }

  // The mover first: draining it runs callbacks that use the members below.
  ~TierHarness() { mgr_.reset(); }

  TierManager& mgr() {
    if (!mgr_) throw Error(ErrorCode::kInvalidArgument, "the tier harness is closed");
    return *mgr_;
  }

  TierCallback record() {
    return [this](const TierResult& r) {
      std::lock_guard<std::mutex> lk(mu_);
      done_.push_back(r);
    };
  }

  py::list take_completions() {
    std::vector<TierResult> got;
    {
      std::lock_guard<std::mutex> lk(mu_);
      got.swap(done_);
    }
    py::list out;
    for (const TierResult& r : got) {
      py::dict d;
      d["key"] = r.key;
      d["op"] = tier_op_name(r.op);
      d["tier"] = tier_str(r.tier);
      d["l1_block"] = r.l1_block;
      d["ok"] = r.ok;
      d["cancelled"] = r.cancelled;
      d["fault"] = tier_fault_name(r.fault);
      d["code"] = r.ok || r.cancelled ? "" : error_code_name(r.code);
      d["message"] = r.message;
      out.append(d);
    }
    return out;
  }

  std::vector<std::string> take_logs() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::string> out;
    out.swap(logs_);
    return out;
  }

  std::vector<uint8_t> l1_;
  std::unique_ptr<TierManager> mgr_;
  std::mutex mu_;
  std::vector<TierResult> done_;
  std::vector<std::string> logs_;
  int64_t copied_ = 0;
};

py::object entry_dict(const std::optional<TierEntry>& e) {
  if (!e) return py::none();
  py::dict d;
  d["state"] = block_state_name(e->state);
  d["via"] = tier_str(e->via);
  d["l1_block"] = e->l1_block;
  d["l2_slot"] = e->l2_slot;
  d["l3_page"] = e->l3_page;
  d["free_requested"] = e->free_requested;
  return d;
}

}  // namespace

void bind_tiers(py::module_& m) {
  m.def("crc32c", [](py::bytes b, uint32_t crc) {
          std::string s = b;
          return crc32c(s.data(), s.size(), crc);
        }, py::arg("data"), py::arg("crc") = 0u, "CRC32C (Castagnoli) as used by L3 page trailers.");
  m.def("crc32c_portable", [](py::bytes b, uint32_t crc) {
          std::string s = b;
          return crc32c_portable(s.data(), s.size(), crc);
        }, py::arg("data"), py::arg("crc") = 0u);
  py::class_<BlockPredictor>(m, "BlockPredictor", "The tier predictor of cold blocks (tests; predictor.h).")
      .def(py::init([](double decay, double promote_heat, double margin, int32_t max_moves, double free_watermark,
                       double max_entropy) {
             PredictorConfig c;
             c.decay = decay;
             c.promote_heat = promote_heat;
             c.margin = margin;
             c.max_moves = max_moves;
             c.free_watermark = free_watermark;
             c.max_entropy = max_entropy;
             return BlockPredictor(c);
           }),
           py::arg("decay") = 0.75, py::arg("promote_heat") = 0.5, py::arg("margin") = 0.25, py::arg("max_moves") = 2,
           py::arg("free_watermark") = 0.1, py::arg("max_entropy") = 0.95)
      .def("observe",
           [](BlockPredictor& p, int64_t seq, const std::vector<int32_t>& reads, const std::vector<int32_t>& cold,
              int32_t passes, bool sparse, int64_t step) {
             // cold[b]: where block b was read, 0 (False) L1, 1 (True) L2, 2 L3.
             if (reads.size() != cold.size()) throw Error(ErrorCode::kInvalidArgument, "reads and cold differ in length");
             for (int32_t r : reads) {
               if (r < 0 || r > passes) throw Error(ErrorCode::kInvalidArgument, "reads must be in [0, passes]");
             }
             for (int32_t t : cold) {
               if (t < 0 || t > 2) throw Error(ErrorCode::kInvalidArgument, "cold must be 0 (L1), 1 (L2) or 2 (L3)");
             }
             std::vector<uint8_t> c(cold.begin(), cold.end());
             p.observe(seq, reads.data(), c.data(), static_cast<int32_t>(reads.size()), passes, sparse, step);
           },
           py::arg("seq"), py::arg("reads"), py::arg("cold"), py::arg("passes"), py::arg("sparse") = true,
           py::arg("step") = INT64_MAX)
      .def("begin_plan", &BlockPredictor::begin_plan, py::arg("step"))
      .def("entropy", &BlockPredictor::entropy, py::arg("seq"))
      .def("order_for_demotion",
           [](const BlockPredictor& p, int64_t seq, std::vector<int32_t> positions) {
             p.order_for_demotion(seq, &positions);
             return positions;
           })
      .def("decide",
           [](BlockPredictor& p, int64_t seq, const std::vector<int32_t>& cold,
              const std::vector<int32_t>& resident, int32_t free_blocks) {
             py::list out;
             for (const BlockPredictor::Move& m : p.decide(seq, cold, resident, free_blocks)) {
               out.append(py::make_tuple(m.promote, m.demote));
             }
             return out;
           },
           py::arg("seq"), py::arg("cold"), py::arg("resident"), py::arg("free_blocks"))
      .def("moved", [](BlockPredictor& p, int64_t seq, int32_t promote,
                       int32_t demote) { p.moved(seq, BlockPredictor::Move{promote, demote}); })
      .def("forget", &BlockPredictor::forget)
      .def("heat", &BlockPredictor::heat)
      .def("free_blocks_above_watermark", &BlockPredictor::free_blocks_above_watermark)
      .def_property_readonly("counters", [](const BlockPredictor& p) { return predictor_counters_dict(p.counters()); });

  m.def("kv_page_bytes", &page_bytes_for, py::arg("block_bytes"), "Bytes of one L2 slot / L3 page.");
  m.def("refuse_uring_submits_for_test", &refuse_uring_submits_for_test, py::arg("on"),
        "Tests: while on, every io_uring submission is refused with EAGAIN (process-wide).");

  py::class_<TierHarness>(m, "TierHarness", "The KV tier mover over a private L1 pool (tests).")
      .def(py::init<int32_t, int64_t, int64_t, const std::string&, int64_t, bool, const std::string&, int32_t,
                    int32_t>(),
           py::arg("num_l1_blocks"), py::arg("block_bytes"), py::arg("l2_bytes"), py::arg("l3_path") = "",
           py::arg("l3_bytes") = 0, py::arg("manual") = false, py::arg("io_backend") = "auto",
           py::arg("staging_slots") = 2, py::arg("io_threads") = 2, py::call_guard<py::gil_scoped_release>())
      .def("l1", [](py::object self) {
             TierHarness& h = self.cast<TierHarness&>();
             const int64_t bb = h.mgr().block_bytes();
             const int64_t n = static_cast<int64_t>(h.l1_.size()) / bb;
             return py::array_t<uint8_t>({n, bb}, h.l1_.data(), self);  // a view; keeps the harness alive
           })
      .def("demote",
           [](TierHarness& h, int32_t b) {
             return h.mgr().demote(b, h.record(), [&h](uint64_t) {
               std::lock_guard<std::mutex> lk(h.mu_);
               ++h.copied_;
             });
           })
      .def_property_readonly("num_copied", [](TierHarness& h) {
        std::lock_guard<std::mutex> lk(h.mu_);
        return h.copied_;
      }, "Demotes whose L1 source has been copied out.")
      .def("spill", [](TierHarness& h, uint64_t k) { return h.mgr().spill(k, h.record()); })
      .def("fetch", [](TierHarness& h, uint64_t k, int32_t b) { return h.mgr().fetch(k, b, h.record()); })
      .def("copy_up", [](TierHarness& h, uint64_t k, int32_t b) { return h.mgr().copy_up(k, b, h.record()); })
      .def("l2_data", [](TierHarness& h, uint64_t k) {
        const uint8_t* p = h.mgr().l2_data(k);
        if (!p) return py::object(py::none());
        return py::object(py::bytes(reinterpret_cast<const char*>(p), static_cast<size_t>(h.mgr().block_bytes())));
      })
      .def("free", [](TierHarness& h, uint64_t k) { h.mgr().free(k); })
      .def("num_pending", [](TierHarness& h) { return h.mgr().num_pending(); })
      .def("run_pending", [](TierHarness& h, size_t i) { return h.mgr().run_pending(i); },
           py::call_guard<py::gil_scoped_release>())
      .def("drain", [](TierHarness& h) { h.mgr().drain(); }, py::call_guard<py::gil_scoped_release>())
      .def("close", [](TierHarness& h) { h.mgr_.reset(); }, py::call_guard<py::gil_scoped_release>(),
           "Shuts the mover down (waits for transfers in flight).")
      .def("completions", &TierHarness::take_completions)
      .def("logs", &TierHarness::take_logs)
      .def("entry", [](TierHarness& h, uint64_t k) { return entry_dict(h.mgr().map().entry(k)); })
      .def("keys", [](TierHarness& h) { return h.mgr().map().keys(); })
      .def("l1_user", [](TierHarness& h, int32_t b) { return h.mgr().map().l1_user(b); })
      .def("counts", [](TierHarness& h) {
        const TierCounts c = h.mgr().map().counts();
        py::dict d;
        d["demoting"] = c.demoting;
        d["in_l2"] = c.in_l2;
        d["spilling"] = c.spilling;
        d["in_l3"] = c.in_l3;
        d["fetching"] = c.fetching;
        d["copying_up"] = c.copying_up;
        d["in_flight"] = c.in_flight();
        d["l2_slots_used"] = c.l2_slots_used;
        d["l2_residents"] = c.l2_residents;
        d["l3_pages_used"] = c.l3_pages_used;
        return d;
      })
      .def("stats", [](TierHarness& h) { return tier_stats_dict(h.mgr().stats()); })
      .def("in_flight", [](TierHarness& h) { return h.mgr().in_flight(); })
      .def("check_invariants", [](TierHarness& h) { h.mgr().map().check_invariants(); })
      .def("l3_offset", [](TierHarness& h, uint64_t k) { return h.mgr().l3_offset(k); })
      .def_property_readonly("page_bytes", [](TierHarness& h) { return h.mgr().page_bytes(); })
      .def_property_readonly("l2_slots", [](TierHarness& h) { return h.mgr().map().num_l2_slots(); })
      .def_property_readonly("l2_capacity", [](TierHarness& h) { return h.mgr().map().l2_capacity(); })
      .def_property_readonly("l3_pages", [](TierHarness& h) { return h.mgr().map().num_l3_pages(); })
      .def_property_readonly("io_backend", [](TierHarness& h) -> std::string {
        return h.mgr().l3() ? h.mgr().l3()->backend() : "";
      })
      .def_property_readonly("direct_io", [](TierHarness& h) { return h.mgr().l3() && h.mgr().l3()->direct_io(); });
}

}  // namespace k25::bindings
