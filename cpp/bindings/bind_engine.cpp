// Bindings of the engine: model loading, EngineConfig, SamplingParams, Engine, outputs.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "engine/torch_executor.h"
#include "k25/engine.h"
#include "k25/status.h"
#include "kv/tiers/tier_stats.h"
#include "ops/parallel.h"

namespace py = pybind11;

namespace k25::bindings {

namespace {

py::dict config_dict(const ModelConfig& c) {
  py::dict d;
  d["architecture"] = c.architecture;
  d["source_format"] = c.source_format;
  d["vocab_size"] = c.vocab_size;
  d["hidden_size"] = c.hidden_size;
  d["intermediate_size"] = c.intermediate_size;
  d["num_layers"] = c.num_layers;
  d["num_heads"] = c.num_heads;
  d["num_kv_heads"] = c.num_kv_heads;
  d["head_dim"] = c.head_dim;
  d["rms_norm_eps"] = c.rms_norm_eps;
  d["rope_theta"] = c.rope.theta;
  d["rope_type"] = c.rope.type;
  d["rope_factor"] = c.rope.factor;
  d["max_position_embeddings"] = c.max_position_embeddings;
  d["tie_word_embeddings"] = c.tie_word_embeddings;
  d["qkv_bias"] = c.qkv_bias;
  d["o_bias"] = c.o_bias;
  d["layer_sliding_window"] = c.layer_sliding_window;
  d["bos_token_id"] = c.bos_token_id;
  d["eos_token_ids"] = c.eos_token_ids;
  return d;
}

py::dict stats_dict(const EngineStats& s) {
  py::dict d;
  d["steps"] = s.steps;
  d["pipelined_steps"] = s.pipelined_steps;
  d["lane_steps"] = s.lane_steps;
  d["lane_deferred_aborts"] = s.lane_deferred_aborts;
  d["lane_deferred_starts"] = s.lane_deferred_starts;
  d["l3_halves_read"] = s.l3_halves_read;
  d["l3_halves_skipped"] = s.l3_halves_skipped;
  d["l3_halves_late"] = s.l3_halves_late;
  d["prefill_tokens"] = s.prefill_tokens;
  d["decode_tokens"] = s.decode_tokens;
  d["generated_tokens"] = s.generated_tokens;
  d["preemptions"] = s.preemptions;
  d["requests_added"] = s.requests_added;
  d["requests_finished"] = s.requests_finished;
  d["requests_aborted"] = s.requests_aborted;
  d["requests_failed"] = s.requests_failed;
  d["running"] = s.running;
  d["waiting"] = s.waiting;
  d["blocks_total"] = s.blocks_total;
  d["blocks_used"] = s.blocks_used;
  d["blocks_free"] = s.blocks_free;
  d["prefix_cache_queries"] = s.prefix_cache_queries;
  d["prefix_cache_hits"] = s.prefix_cache_hits;
  d["prefix_cached_blocks"] = s.prefix_cached_blocks;
  d["swap_declined"] = s.swap_declined;
  d["recompute_s_per_token"] = s.recompute_s_per_token;
  d["swap_s_per_block"] = s.swap_s_per_block;
  d["prefix_cache_tier_hits"] = s.prefix_cache_tier_hits;
  d["prefix_spilled_blocks"] = s.prefix_spilled_blocks;
  d["prefix_tier_blocks"] = s.prefix_tier_blocks;
  d["cold_blocks"] = s.cold_blocks;
  d["cold_demotes"] = s.cold_demotes;
  d["cold_gathered"] = s.cold_gathered;
  d["cold_promotions"] = s.cold_promotions;
  d["predictor"] = predictor_counters_dict(s.predictor);
  d["block_size"] = s.block_size;
  d["busy_time_s"] = s.busy_time_s;
  d["last_step_s"] = s.last_step_s;
  d["last_step_tokens"] = s.last_step_tokens;
  py::list layers;
  for (const LayerSparsityStats& l : s.sparsity_layers) {
    py::dict ld;
    ld["blocks_total"] = l.blocks_total;
    ld["blocks_skipped"] = l.blocks_skipped;
    ld["selections"] = l.selections;
    ld["reused_selections"] = l.reused_selections;
    ld["ratio"] = l.blocks_total > 0 ? static_cast<double>(l.blocks_skipped) / l.blocks_total : 0.0;
    ld["mean_entropy_bits"] = l.selections > 0 ? l.entropy_bits / l.selections : 0.0;
    ld["top_blocks"] = l.top_blocks;
    layers.append(ld);
  }
  d["sparsity_layers"] = layers;
  d["swap_outs"] = s.swap_outs;
  d["swap_ins"] = s.swap_ins;
  d["swap_fallbacks"] = s.swap_fallbacks;
  return d;
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<ModelHandle, std::shared_ptr<ModelHandle>>(m, "ModelHandle")
      .def_property_readonly("config", [](const ModelHandle& h) { return config_dict(h.config()); })
      .def_property_readonly("path", &ModelHandle::path)
      .def_property_readonly("format", &ModelHandle::format)
      .def_property_readonly("weight_bytes", &ModelHandle::weight_bytes)
      .def_property_readonly("load_seconds", &ModelHandle::load_seconds)
      .def_property_readonly("max_positions", &ModelHandle::max_positions)
      .def_property_readonly("device", [](const ModelHandle& h) { return h.spec().device; })
      .def_property_readonly("dtype", [](const ModelHandle& h) { return h.spec().dtype; })
      .def_property_readonly("device_allocated_bytes",
                             [](const ModelHandle& h) { return device_allocated_bytes(h.spec()); })
      .def("kv_block_bytes", [](const ModelHandle& h, int32_t bs, const std::string& kv_dtype) {
        return kv_block_bytes(h.config(), bs, dtype_bytes(resolve_kv_dtype(h.spec().dtype, h.spec().device, kv_dtype)));
      }, py::arg("block_size"), py::arg("kv_dtype") = "");

  m.def("read_model_config", [](const std::string& path) {
          ModelConfig c;
          {
            py::gil_scoped_release release;
            c = read_model_config(path);
          }
          return config_dict(c);
        }, py::arg("path"), "The architecture of a GGUF file or HF directory, without loading weights.");
  m.def("kv_bytes_per_token", [](const std::string& path, const std::string& dtype) {
          return kv_block_bytes(read_model_config(path), 1, dtype_bytes(dtype));
        }, py::arg("path"), py::arg("dtype") = "float32", "KV bytes one token takes (all layers, K and V).");
  // The context a model gets when max_seq_len is not given: min(this, its trained context).
  m.attr("DEFAULT_MAX_POSITIONS") = kDefaultMaxPositions;
  m.def("cuda_available", &cuda_available, "Built with CUDA and a device is visible.");
  m.def("cuda_memory", [](int device) {
          int64_t f = 0, t = 0;
          cuda_memory(device, &f, &t);
          return py::make_tuple(f, t);
        }, py::arg("device") = 0, "(free, total) bytes of a CUDA device.");

  m.def("set_num_threads", &set_num_threads, py::arg("n"),
        "Threads of the default pool (kernels called outside an engine). Engines have their own.");
  m.def("get_num_threads", &num_threads);

  m.def("load_model",
        [](const std::string& path, int32_t max_positions, int32_t num_threads, const std::string& device,
           const std::string& dtype) {
          py::gil_scoped_release release;
          return load_model(path, max_positions, num_threads, DeviceSpec{device, dtype});
        },
        py::arg("path"), py::arg("max_positions"), py::arg("num_threads") = 0, py::arg("device") = "cpu",
        py::arg("dtype") = "float32", "Loads a GGUF file or a Hugging Face directory onto a device.");

  py::class_<EngineConfig>(m, "EngineConfig")
      .def(py::init<>())
      .def_readwrite("max_batch_size", &EngineConfig::max_batch_size)
      .def_readwrite("max_num_batched_tokens", &EngineConfig::max_num_batched_tokens)
      .def_readwrite("prefill_chunk_size", &EngineConfig::prefill_chunk_size)
      .def_readwrite("block_size", &EngineConfig::block_size)
      .def_readwrite("num_kv_blocks", &EngineConfig::num_kv_blocks)
      .def_readwrite("max_seq_len", &EngineConfig::max_seq_len)
      .def_readwrite("decode_max_tokens", &EngineConfig::decode_max_tokens)
      .def_readwrite("num_threads", &EngineConfig::num_threads)
      .def_readwrite("kv_cache_dtype", &EngineConfig::kv_cache_dtype)
      .def_readwrite("admission_watermark", &EngineConfig::admission_watermark)
      .def_readwrite("enable_prefix_caching", &EngineConfig::enable_prefix_caching)
      .def_readwrite("batching_window_ms", &EngineConfig::batching_window_ms)
      .def_readwrite("enable_dynamic_sparsity", &EngineConfig::enable_dynamic_sparsity)
      .def_readwrite("max_sparsity_ratio", &EngineConfig::max_sparsity_ratio)
      .def_readwrite("sparsity_min_context", &EngineConfig::sparsity_min_context)
      .def_readwrite("sparsity_recent_blocks", &EngineConfig::sparsity_recent_blocks)
      .def_readwrite("sparsity_sink_blocks", &EngineConfig::sparsity_sink_blocks)
      .def_readwrite("sparsity_mass_target", &EngineConfig::sparsity_mass_target)
      .def_readwrite("sparsity_score_channels", &EngineConfig::sparsity_score_channels)
      .def_readwrite("sparsity_key_codes", &EngineConfig::sparsity_key_codes)
      .def_readwrite("sparsity_compensation", &EngineConfig::sparsity_compensation)
      .def_readwrite("sparsity_selection_interval", &EngineConfig::sparsity_selection_interval)
      .def_readwrite("swap_preempted", &EngineConfig::swap_preempted)
      .def_readwrite("l2_bytes", &EngineConfig::l2_bytes)
      .def_readwrite("l3_path", &EngineConfig::l3_path)
      .def_readwrite("l3_bytes", &EngineConfig::l3_bytes)
      .def_readwrite("predictor_decay", &EngineConfig::predictor_decay)
      .def_readwrite("predictor_promote_heat", &EngineConfig::predictor_promote_heat)
      .def_readwrite("predictor_margin", &EngineConfig::predictor_margin)
      .def_readwrite("predictor_max_moves", &EngineConfig::predictor_max_moves)
      .def_readwrite("predictor_free_watermark", &EngineConfig::predictor_free_watermark)
      .def_readwrite("predictor_max_entropy", &EngineConfig::predictor_max_entropy);

  py::class_<SamplingParams>(m, "SamplingParams")
      .def(py::init<>())
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("min_p", &SamplingParams::min_p)
      .def_readwrite("repetition_penalty", &SamplingParams::repetition_penalty)
      .def_readwrite("presence_penalty", &SamplingParams::presence_penalty)
      .def_readwrite("frequency_penalty", &SamplingParams::frequency_penalty)
      .def_readwrite("has_seed", &SamplingParams::has_seed)
      .def_readwrite("seed", &SamplingParams::seed)
      .def_readwrite("max_new_tokens", &SamplingParams::max_new_tokens)
      .def_readwrite("min_new_tokens", &SamplingParams::min_new_tokens)
      .def_readwrite("stop_token_ids", &SamplingParams::stop_token_ids)
      .def_readwrite("stop", &SamplingParams::stop)
      .def_readwrite("ignore_eos", &SamplingParams::ignore_eos)
      .def_readwrite("logprobs", &SamplingParams::logprobs);

  py::class_<RequestOutput>(m, "RequestOutput")
      .def_readonly("id", &RequestOutput::id)
      .def_readonly("new_token_ids", &RequestOutput::new_token_ids)
      .def_property_readonly("new_logprobs",
                             [](const RequestOutput& o) {
                               py::list out;
                               for (const TokenLogprobOut& t : o.new_logprobs) {
                                 out.append(py::make_tuple(t.token, t.logprob, t.top));
                               }
                               return out;
                             })
      .def_readonly("finished", &RequestOutput::finished)
      .def_readonly("finish_reason", &RequestOutput::finish_reason)
      .def_readonly("stop_string", &RequestOutput::stop_string)
      .def_readonly("error", &RequestOutput::error)
      .def_readonly("num_prompt_tokens", &RequestOutput::num_prompt_tokens)
      .def_readonly("num_output_tokens", &RequestOutput::num_output_tokens)
      .def_readonly("num_preemptions", &RequestOutput::num_preemptions)
      .def_readonly("queue_time_s", &RequestOutput::queue_time_s)
      .def_readonly("prefill_chunks", &RequestOutput::prefill_chunks)
      .def_readonly("prefill_time_s", &RequestOutput::prefill_time_s)
      .def("take_prompt_logits", [](RequestOutput& o, int64_t vocab) -> py::object {
        if (o.prompt_logits.empty()) return py::none();
        if (vocab <= 0 || o.prompt_logits.size() % static_cast<size_t>(vocab) != 0) {
          throw Error(ErrorCode::kInvalidArgument, "take_prompt_logits: vocab does not divide the logits");
        }
        auto* owned = new std::vector<float>(std::move(o.prompt_logits));
        py::capsule free_it(owned, [](void* p) { delete static_cast<std::vector<float>*>(p); });
        const int64_t rows = static_cast<int64_t>(owned->size()) / vocab;
        return py::array_t<float>({rows, vocab}, owned->data(), free_it);
      });

  py::class_<Engine>(m, "Engine")
      .def(py::init([](std::shared_ptr<ModelHandle> model, const EngineConfig& cfg, bool fused,
                       std::vector<py::bytes> token_bytes, std::vector<int32_t> eos) {
             std::vector<std::string> tb;
             tb.reserve(token_bytes.size());
             for (const py::bytes& b : token_bytes) tb.emplace_back(b);
             py::gil_scoped_release release;
             SparsityParams sp;
             sp.min_context = cfg.sparsity_min_context;
             sp.recent_blocks = cfg.sparsity_recent_blocks;
             sp.sink_blocks = cfg.sparsity_sink_blocks;
             sp.max_ratio = cfg.max_sparsity_ratio;
             sp.mass_target = cfg.sparsity_mass_target;
             sp.score_channels = cfg.sparsity_score_channels;
             sp.key_codes = cfg.sparsity_key_codes;
             sp.compensation = cfg.sparsity_compensation;
             sp.selection_interval = cfg.sparsity_selection_interval;
             auto exec = make_executor(model, cfg.block_size, cfg.num_kv_blocks, fused, cfg.num_threads,
                                       cfg.enable_dynamic_sparsity ? &sp : nullptr, cfg.kv_cache_dtype);
             return std::make_unique<Engine>(cfg, std::move(exec), std::move(tb), std::move(eos));
           }),
           py::arg("model"), py::arg("config"), py::arg("fused"), py::arg("token_bytes"), py::arg("eos_token_ids"))
      .def("add_request",
           [](Engine& e, std::vector<int32_t> prompt, const SamplingParams& p, int32_t priority, bool want_logits,
              int32_t single_token_from) {
             if (priority < 0 || priority > 2) throw Error(ErrorCode::kInvalidArgument, "priority must be 0, 1 or 2");
             RequestSpec spec;
             spec.prompt = std::move(prompt);
             spec.params = p;
             spec.priority = static_cast<Priority>(priority);
             spec.want_prompt_logits = want_logits;
             spec.single_token_from = single_token_from;
             py::gil_scoped_release release;
             return e.add_request(std::move(spec));
           },
           py::arg("prompt"), py::arg("params"), py::arg("priority") = 1, py::arg("want_prompt_logits") = false,
           py::arg("single_token_from") = -1)
      .def("add_requests",
           [](Engine& e, std::vector<std::vector<int32_t>> prompts, const SamplingParams& p, int32_t priority) {
             if (priority < 0 || priority > 2) throw Error(ErrorCode::kInvalidArgument, "priority must be 0, 1 or 2");
             std::vector<RequestSpec> specs(prompts.size());
             for (size_t i = 0; i < prompts.size(); ++i) {
               specs[i].prompt = std::move(prompts[i]);
               specs[i].params = p;
               specs[i].priority = static_cast<Priority>(priority);
             }
             py::gil_scoped_release release;
             return e.add_requests(std::move(specs));
           },
           py::arg("prompts"), py::arg("params"), py::arg("priority") = 1)
      .def("abort", &Engine::abort, py::call_guard<py::gil_scoped_release>())
      .def("wait_outputs", &Engine::wait_outputs, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const Engine& e) { return stats_dict(e.stats()); })
      .def("corrupt_next_l3_writes_for_test", &Engine::corrupt_next_l3_writes_for_test, py::arg("n"))
      .def("delay_l3_reads_for_test", &Engine::delay_l3_reads_for_test, py::arg("seconds"),
           py::call_guard<py::gil_scoped_release>())
      .def("delay_l3_writes_for_test", &Engine::delay_l3_writes_for_test, py::arg("seconds"),
           py::call_guard<py::gil_scoped_release>())
      .def("delay_tier_copies_in_for_test", &Engine::delay_tier_copies_in_for_test, py::arg("seconds"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_swap_cost_for_test", &Engine::set_swap_cost_for_test, py::arg("s_per_block"))
      .def("fail_next_kv_release_for_test", &Engine::fail_next_kv_release_for_test)
      .def("tier_stats", [](const Engine& e) -> py::object {
        TierStats t;
        if (!e.tier_stats(&t)) return py::none();
        return tier_stats_dict(t);
      })
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def("drain_kv_events", [](Engine& e) {
        py::list out;
        for (const KVEvent& ev : e.drain_kv_events()) out.append(py::make_tuple(ev.request_id, ev.blocks, ev.reason));
        return out;
      });
}

}  // namespace k25::bindings
