// Python access to the model-file readers: inspection (metadata, tensor lists) and float32
// copies of single tensors, used by tests and tools. The engine itself loads through C++.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "k25/status.h"
#include "model/dequant.h"
#include "model/gguf_reader.h"
#include "model/half.h"
#include "model/json.h"
#include "model/safetensors_reader.h"

namespace py = pybind11;

namespace k25::bindings {

namespace {

// Metadata strings are usually UTF-8, but nothing in GGUF enforces it (some tokenizers
// store raw byte tokens); those come back as bytes rather than failing the whole read.
py::object to_py_string(const std::string& s) {
  PyObject* u = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "strict");
  if (u != nullptr) return py::reinterpret_steal<py::object>(u);
  PyErr_Clear();
  return py::bytes(s);
}

// Built by hand rather than through pybind11/stl.h, whose casters would then differ between
// this and the other binding files (an ODR hazard pybind11 warns about).
template <typename T>
py::list to_py_list(const std::vector<T>& v) {
  py::list out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = py::cast(v[i]);
  return out;
}

py::object to_py(const GgufValue& v) {
  switch (v.kind()) {
    case GgufValue::Kind::kUint: return py::int_(v.as_uint());
    case GgufValue::Kind::kInt: return py::int_(v.as_int());
    case GgufValue::Kind::kFloat: return py::float_(v.as_double());
    case GgufValue::Kind::kBool: return py::bool_(v.as_bool());
    case GgufValue::Kind::kString: return to_py_string(v.as_string());
    case GgufValue::Kind::kArray: {
      const auto& a = v.array();
      py::list out(a.size());
      for (size_t i = 0; i < a.size(); ++i) out[i] = to_py(a[i]);
      return out;
    }
  }
  return py::none();
}

py::object to_py(const Json& j) {
  switch (j.kind()) {
    case Json::Kind::kNull: return py::none();
    case Json::Kind::kBool: return py::bool_(j.as_bool());
    case Json::Kind::kInt: return py::int_(j.as_int());
    case Json::Kind::kDouble: return py::float_(j.as_double());
    case Json::Kind::kString: return py::str(j.as_string());
    case Json::Kind::kArray: {
      py::list out(j.size());
      for (size_t i = 0; i < j.size(); ++i) out[i] = to_py(j[i]);
      return out;
    }
    case Json::Kind::kObject: {
      py::dict out;
      for (const auto& [k, v] : j.items()) out[py::str(k)] = to_py(v);
      return out;
    }
  }
  return py::none();
}

std::shared_ptr<GgufFile> open_gguf(const std::string& path) {
  py::gil_scoped_release nogil;
  return GgufFile::open(path);
}

std::shared_ptr<SafetensorsCheckpoint> open_safetensors(const std::string& path) {
  py::gil_scoped_release nogil;
  return SafetensorsCheckpoint::open(path);
}

py::dict read_gguf(const std::string& path) {
  const auto g = open_gguf(path);
  py::dict metadata;
  for (const auto& [key, value] : g->metadata()) metadata[to_py_string(key)] = to_py(value);
  py::list tensors;
  for (const auto& t : g->tensors()) {
    py::dict d;
    d["name"] = to_py_string(t.name);
    d["type"] = ggml_type_name(t.type);
    d["type_id"] = static_cast<uint32_t>(t.type);
    d["shape"] = to_py_list(t.ne);
    d["offset"] = t.offset;
    d["nbytes"] = t.nbytes;
    tensors.append(std::move(d));
  }
  py::dict out;
  out["version"] = g->version();
  out["alignment"] = g->alignment();
  out["data_offset"] = g->data_offset();
  out["metadata"] = std::move(metadata);
  out["tensors"] = std::move(tensors);
  return out;
}

py::array_t<float> dequantize_gguf_tensor(const std::string& path, const std::string& name) {
  const auto g = open_gguf(path);
  const GgufTensorInfo* t = g->find_tensor(name);
  if (t == nullptr) fail(ErrorCode::kNotFound, "tensor '" + name + "' is not in " + path);
  if (!can_dequantize(t->type))
    fail(ErrorCode::kUnsupported, "tensor '" + name + "' in " + path + " has type " +
                                      ggml_type_name(t->type) +
                                      ", which k25 cannot dequantize yet");
  // numpy lists the slowest dimension first, ggml the fastest.
  std::vector<py::ssize_t> shape(t->ne.rbegin(), t->ne.rend());
  py::array_t<float> out(shape);
  float* dst = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    dequantize_to_f32_parallel(t->type, t->data, dst, t->numel());
  }
  return out;
}

py::dict read_safetensors(const std::string& path) {
  const auto ck = open_safetensors(path);
  py::list tensors;
  for (const auto& t : ck->tensors()) {
    py::dict d;
    d["name"] = t.name;
    d["dtype"] = dtype_name(t.dtype);
    d["shape"] = to_py_list(t.shape);
    d["nbytes"] = t.nbytes;
    tensors.append(std::move(d));
  }
  py::dict metadata;
  for (const auto& [k, v] : ck->metadata()) metadata[py::str(k)] = py::str(v);
  py::dict out;
  out["tensors"] = std::move(tensors);
  out["metadata"] = std::move(metadata);
  out["files"] = to_py_list(ck->files());
  return out;
}

py::array_t<float> load_safetensors_tensor_f32(const std::string& path, const std::string& name) {
  const auto ck = open_safetensors(path);
  const TensorView* t = ck->find(name);
  if (t == nullptr) fail(ErrorCode::kNotFound, "tensor '" + name + "' is not in " + path);
  if (t->dtype != DType::kF32 && t->dtype != DType::kF16 && t->dtype != DType::kBF16)
    fail(ErrorCode::kUnsupported, "tensor '" + name + "' in " + path + " has dtype " +
                                      dtype_name(t->dtype) + ", which k25 cannot convert to F32");
  std::vector<py::ssize_t> shape(t->shape.begin(), t->shape.end());
  py::array_t<float> out(shape);
  float* dst = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    convert_to_f32_parallel(t->dtype, t->data, dst, t->numel());
  }
  return out;
}

py::object parse_json(const py::object& text) {
  std::string s;
  if (py::isinstance<py::bytes>(text)) {
    s = text.cast<std::string>();
  } else if (py::isinstance<py::str>(text)) {
    s = text.cast<std::string>();
  } else {
    throw py::type_error("parse_json expects str or bytes");
  }
  Json j;
  {
    py::gil_scoped_release nogil;
    j = Json::parse(s, "parse_json input");
  }
  return to_py(j);
}

// Test hooks for the scalar float32 -> 16-bit conversions (the widening direction is covered
// by dequantize_gguf_tensor on F16/BF16 tensors).
using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

template <uint16_t (*Convert)(float)>
py::array_t<uint16_t> narrow_bits(const F32Array& in) {
  py::array_t<uint16_t> out(in.size());
  const float* src = in.data();
  uint16_t* dst = out.mutable_data();
  const py::ssize_t n = in.size();
  {
    py::gil_scoped_release nogil;
    for (py::ssize_t i = 0; i < n; ++i) dst[i] = Convert(src[i]);
  }
  return out;
}

}  // namespace

void bind_model_files(py::module_& m) {
  m.def("read_gguf", &read_gguf, py::arg("path"),
        "Parse and validate a GGUF file: {'version', 'alignment', 'data_offset', 'metadata', "
        "'tensors': [{name, type, type_id, shape (ggml order), offset, nbytes}]}.");
  m.def("dequantize_gguf_tensor", &dequantize_gguf_tensor, py::arg("path"), py::arg("name"),
        "One GGUF tensor as a float32 numpy array in numpy order (reversed ggml ne).");
  m.def("read_safetensors", &read_safetensors, py::arg("path"),
        "Parse and validate a safetensors file or checkpoint directory: "
        "{'tensors': [{name, dtype, shape, nbytes}], 'metadata', 'files'}.");
  m.def("load_safetensors_tensor_f32", &load_safetensors_tensor_f32, py::arg("path"),
        py::arg("name"), "One F32/F16/BF16 safetensors tensor as a float32 numpy array.");
  m.def("parse_json", &parse_json, py::arg("text"),
        "Parse JSON with k25's strict parser (for tests): dict/list/str/int/float/bool/None.");
  m.def("_fp32_to_fp16_bits", &narrow_bits<&fp32_to_fp16>, py::arg("values"),
        "Test hook: float32 values -> IEEE half bit patterns (flat uint16 array).");
  m.def("_fp32_to_bf16_bits", &narrow_bits<&fp32_to_bf16>, py::arg("values"),
        "Test hook: float32 values -> bfloat16 bit patterns (flat uint16 array).");
}

}  // namespace k25::bindings
