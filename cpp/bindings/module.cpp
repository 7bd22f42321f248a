// k25._C: the Python extension. Thin: converts types, releases the GIL around work.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "k25/status.h"

namespace py = pybind11;

namespace {

void translate_k25_error(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const k25::Error& e) {
    py::object errors = py::module_::import("k25.errors");
    py::object cls = errors.attr("BY_CODE")[py::str(k25::error_code_name(e.code()))];
    // Messages quote names read from files; never let bad UTF-8 replace the real error.
    const std::string msg = e.what();
    py::object text = py::reinterpret_steal<py::object>(
        PyUnicode_DecodeUTF8(msg.data(), static_cast<Py_ssize_t>(msg.size()), "replace"));
    PyErr_SetObject(cls.ptr(), text.ptr());
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "k25 C++ core";
  py::register_exception_translator(&translate_k25_error);
  k25::bindings::bind_model_files(m);
  k25::bindings::bind_engine(m);
  k25::bindings::bind_scheduler(m);
  k25::bindings::bind_ops(m);
  k25::bindings::bind_tiers(m);
}
