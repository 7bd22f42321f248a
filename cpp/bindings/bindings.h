// One function per binding file; module.cpp calls them all.
#pragma once

#include <pybind11/pybind11.h>

namespace k25 {
struct TierStats;
struct PredictorCounters;
}

namespace k25::bindings {

pybind11::dict tier_stats_dict(const TierStats& s);  // bind_tiers.cpp
pybind11::dict predictor_counters_dict(const PredictorCounters& c);  // bind_tiers.cpp

void bind_model_files(pybind11::module_& m);  // bind_model_files.cpp: GGUF/safetensors readers
void bind_engine(pybind11::module_& m);       // bind_engine.cpp: model loading, Engine
void bind_scheduler(pybind11::module_& m);    // bind_scheduler.cpp: BlockPool, scheduler harness
void bind_ops(pybind11::module_& m);          // bind_ops.cpp: CPU kernels on torch tensors
void bind_tiers(pybind11::module_& m);        // bind_tiers.cpp: KV tier mover harness, crc32c

}  // namespace k25::bindings
