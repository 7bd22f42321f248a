// The block pool and a model-free scheduler harness, for property tests of the policy.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "k25/status.h"

namespace py = pybind11;

namespace k25::bindings {

namespace {

// Drives the real Scheduler the way the engine does, with a fake model: every emitting
// sequence appends token 0 and finishes after max_new tokens.
class SchedulerSim {
 public:
  explicit SchedulerSim(const EngineConfig& cfg) : pool_(cfg.num_kv_blocks), sched_(cfg, &pool_) {}

  int64_t add(int32_t prompt_len, int32_t max_new, int32_t priority) {
    if (prompt_len <= 0 || max_new <= 0) throw Error(ErrorCode::kInvalidArgument, "lengths must be positive");
    const int64_t total = static_cast<int64_t>(prompt_len) + max_new;
    if (blocks_for_tokens(total, sched_.config().block_size) > pool_.num_total()) {
      throw Error(ErrorCode::kResourceExhausted, "request can never fit the pool");
    }
    auto s = std::make_unique<Sequence>();
    s->id = next_id_++;
    s->arrival = static_cast<uint64_t>(s->id);
    s->priority = static_cast<Priority>(priority);
    s->tokens.assign(prompt_len, 0);
    s->num_prompt_tokens = prompt_len;
    s->max_total_tokens = static_cast<int32_t>(total);
    s->params.max_new_tokens = max_new;
    const int64_t id = s->id;
    sched_.add(std::move(s));
    return id;
  }

  py::dict step() {
    StepPlan plan = sched_.schedule();
    py::list seqs;
    for (const ScheduledSeq& s : plan.seqs) {
      seqs.append(py::make_tuple(s.seq->id, s.seq->num_computed, s.num_new_tokens, s.emits,
                                 static_cast<int>(s.seq->priority)));
    }
    sched_.complete_step(plan);
    py::list finished;
    for (const ScheduledSeq& s : plan.seqs) {
      if (!s.emits) continue;
      Sequence* q = s.seq;
      q->tokens.push_back(0);
      if (q->num_output_tokens() >= q->params.max_new_tokens || q->num_tokens() >= q->max_total_tokens) {
        sched_.finish(q, FinishReason::kLength);
        finished.append(q->id);
      }
    }
    for (py::handle h : finished) sched_.release(h.cast<int64_t>());
    py::dict out;
    out["seqs"] = seqs;
    out["preempted"] = plan.preempted;
    out["finished"] = finished;
    out["num_tokens"] = plan.num_tokens;
    return out;
  }

  bool abort(int64_t id) {
    Sequence* s = sched_.find(id);
    if (!s) return false;
    sched_.finish(s, FinishReason::kAbort);
    sched_.release(id);
    return true;
  }

  BlockPool pool_;
  Scheduler sched_;
  int64_t next_id_ = 1;
};

}  // namespace

void bind_scheduler(py::module_& m) {
  py::class_<Sampler>(m, "Sampler", "The engine's sampler on one logits row (for tests).")
      .def(py::init<int32_t>())
      .def("sample",
           [](Sampler& s, py::array_t<float, py::array::c_style | py::array::forcecast> logits,
              const SamplingParams& p, std::vector<int32_t> tokens, int32_t num_prompt_tokens, uint64_t seed,
              std::vector<int32_t> banned) {
             if (logits.ndim() != 1 || logits.shape(0) != s.vocab_size()) {
               throw Error(ErrorCode::kInvalidArgument, "logits must be 1-D with vocab_size entries");
             }
             for (int32_t t : banned) {
               if (t < 0 || t >= logits.shape(0)) throw Error(ErrorCode::kInvalidArgument, "banned id out of range");
             }
             validate_sampling_params(p, s.vocab_size());
             for (int32_t t : tokens) {
               if (t < 0 || t >= logits.shape(0)) throw Error(ErrorCode::kInvalidArgument, "token out of range");
             }
             std::vector<float> row(logits.data(), logits.data() + logits.shape(0));
             SampleInput in;
             in.params = &p;
             in.tokens = &tokens;
             in.num_prompt_tokens = num_prompt_tokens;
             in.seed = seed;
             in.banned = banned.empty() ? nullptr : &banned;
             SampleResult r = s.sample(row.data(), in);
             py::list top;
             for (const TokenLogprob& t : r.top) top.append(py::make_tuple(t.token, t.logprob));
             return py::make_tuple(r.token, r.logprob, top);
           },
           py::arg("logits"), py::arg("params"), py::arg("tokens"), py::arg("num_prompt_tokens"), py::arg("seed"),
           py::arg("banned") = std::vector<int32_t>{});
  m.def("validate_sampling_params", &validate_sampling_params);

  py::class_<BlockPool>(m, "BlockPool")
      .def(py::init<int32_t>())
      .def_property_readonly("num_total", &BlockPool::num_total)
      .def_property_readonly("num_free", &BlockPool::num_free)
      .def_property_readonly("num_used", &BlockPool::num_used)
      .def("allocate", &BlockPool::allocate)
      .def("incref", &BlockPool::incref)
      .def("decref", &BlockPool::decref)
      .def("refcount", &BlockPool::refcount)
      .def_property_readonly("num_cached", &BlockPool::num_cached)
      .def("register_block",
           [](BlockPool& p, int32_t block, uint64_t hash, uint64_t parent, const std::vector<int32_t>& tokens) {
             return p.register_block(block, hash, parent, tokens.data(), static_cast<int32_t>(tokens.size()));
           })
      .def("match_prefix",
           [](const BlockPool& p, const std::vector<int32_t>& tokens, int32_t block_size) {
             if (block_size <= 0) throw Error(ErrorCode::kInvalidArgument, "block_size must be positive");
             std::vector<uint64_t> hashes;
             std::vector<int32_t> blocks = p.match_prefix(
                 tokens.data(), static_cast<int32_t>(tokens.size()) / block_size, block_size, &hashes);
             return py::make_tuple(blocks, hashes);
           })
      .def("acquire", &BlockPool::acquire)
      .def("check_invariants", &BlockPool::check_invariants);
  m.def("block_chain_hash", [](uint64_t parent, const std::vector<int32_t>& tokens) {
    return block_chain_hash(parent, tokens.data(), static_cast<int32_t>(tokens.size()));
  });

  py::class_<SchedulerSim>(m, "SchedulerSim")
      .def(py::init<const EngineConfig&>())
      .def("add", &SchedulerSim::add, py::arg("prompt_len"), py::arg("max_new_tokens"), py::arg("priority") = 1)
      .def("step", &SchedulerSim::step)
      .def("abort", &SchedulerSim::abort)
      .def("check_invariants", [](const SchedulerSim& s) { s.sched_.check_invariants(); })
      .def_property_readonly("num_running", [](const SchedulerSim& s) { return s.sched_.num_running(); })
      .def_property_readonly("num_waiting", [](const SchedulerSim& s) { return s.sched_.num_waiting(); })
      .def_property_readonly("num_preemptions", [](const SchedulerSim& s) { return s.sched_.num_preemptions(); })
      .def_property_readonly("blocks_free", [](const SchedulerSim& s) { return s.pool_.num_free(); })
      .def_property_readonly("blocks_total", [](const SchedulerSim& s) { return s.pool_.num_total(); })
      .def_property_readonly("prefix_hit_tokens", [](const SchedulerSim& s) { return s.sched_.prefix_hit_tokens(); })
      .def("has_unfinished", [](const SchedulerSim& s) { return s.sched_.has_unfinished(); });
}

}  // namespace k25::bindings
