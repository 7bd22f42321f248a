#include "bindings/bindings.h"

namespace k25::bindings {

void bind_model_files(pybind11::module_& m) {}

}  // namespace k25::bindings
