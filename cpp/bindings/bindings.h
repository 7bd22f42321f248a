// One function per binding file; module.cpp calls them all.
#pragma once

#include <pybind11/pybind11.h>

namespace k25::bindings {

void bind_model_files(pybind11::module_& m);  // bind_model_files.cpp: GGUF/safetensors readers

}  // namespace k25::bindings
