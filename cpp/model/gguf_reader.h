// GGUF (v2, v3) reader over a memory-mapped file.
//
// Everything in the file is validated up front, so that afterwards every tensor's data lies
// inside the mapping and every size is consistent: a truncated, corrupt or hostile file
// raises Error(kCorruptFile) (kUnsupported for a valid file k25 cannot handle) and never
// crashes or makes the reader allocate much more than the file's own size.
// Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian only).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "model/mapped_file.h"

namespace k25 {

// ggml tensor type ids as stored in GGUF files. Ids that ggml has retired (4, 5, 31-33,
// 36-38) are left out on purpose: files using them are rejected as unsupported.
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
  NVFP4 = 40,
  Q1_0 = 41,
};

struct GgmlTypeTraits {
  const char* name;    // as ggml/gguf-py spell it: "Q4_K", "BF16"
  int64_t block_size;  // elements per block (1 for plain types)
  int64_t type_size;   // bytes per block
};

// nullptr for an id k25 does not know.
const GgmlTypeTraits* ggml_type_traits(uint32_t id);
// The traits' name, or "type <id>" for an unknown id.
std::string ggml_type_name(uint32_t id);
inline std::string ggml_type_name(GgmlType t) { return ggml_type_name(static_cast<uint32_t>(t)); }

// The value types of GGUF metadata, with their ids in the file.
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

const char* gguf_value_type_name(GgufValueType t);  // "uint32", "string", ...

// One metadata value. Integers widen to 64 bits and float32 to double; type() keeps the id
// the file used so a writer can reproduce it.
class GgufValue {
 public:
  enum class Kind { kUint, kInt, kFloat, kBool, kString, kArray };

  GgufValue() = default;  // uint8 0
  static GgufValue make_uint(GgufValueType type, uint64_t v);
  static GgufValue make_int(GgufValueType type, int64_t v);
  static GgufValue make_float(GgufValueType type, double v);
  static GgufValue make_bool(bool v);
  static GgufValue make_string(std::string v);
  static GgufValue make_array(GgufValueType element_type, std::vector<GgufValue> elements);

  Kind kind() const { return static_cast<Kind>(value_.index()); }
  GgufValueType type() const { return type_; }
  // The declared element type of an array (meaningful even when it is empty).
  GgufValueType element_type() const { return element_type_; }
  bool is_uint() const { return kind() == Kind::kUint; }
  bool is_int() const { return kind() == Kind::kInt; }
  bool is_float() const { return kind() == Kind::kFloat; }
  bool is_bool() const { return kind() == Kind::kBool; }
  bool is_string() const { return kind() == Kind::kString; }
  bool is_array() const { return kind() == Kind::kArray; }
  bool is_integer() const { return is_uint() || is_int(); }
  bool is_number() const { return is_integer() || is_float(); }

  // Throw Error(kInvalidArgument) on the wrong kind. The integer accessors accept both
  // signednesses when the value fits (writers disagree about e.g. int32 vs uint32 for
  // counts); as_double accepts every numeric kind.
  uint64_t as_uint() const;
  int64_t as_int() const;
  double as_double() const;
  bool as_bool() const;
  const std::string& as_string() const;
  const std::vector<GgufValue>& array() const;

  // "uint32", "string", "array[string]" ...
  std::string type_name() const;

 private:
  GgufValueType type_ = GgufValueType::kUint8;
  GgufValueType element_type_ = GgufValueType::kUint8;
  // The order must match Kind.
  std::variant<uint64_t, int64_t, double, bool, std::string, std::vector<GgufValue>> value_;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> ne;  // ggml order: ne[0] is the contiguous (fastest) dim
  GgmlType type;
  uint64_t offset;        // absolute file offset of the data
  uint64_t nbytes;
  const uint8_t* data;    // inside the mapping; valid while the GgufFile lives
  int64_t numel() const;  // product of ne (1 for a 0-d tensor)
};

class GgufFile {
 public:
  // Limits that bound the reader's memory on hostile input; far above any real model.
  static constexpr uint32_t kMaxDims = 4;                 // GGML_MAX_DIMS
  // All metadata array elements together. Each costs sizeof(GgufValue) (~48 bytes), so this
  // caps the reader at ~400 MB however the file lies; real files hold ~1M (tokenizers).
  static constexpr uint64_t kMaxMetadataValues = 1u << 23;
  static constexpr int kMaxArrayNesting = 8;

  // Maps and validates the file. Missing -> kNotFound; bad magic, truncation or
  // inconsistency -> kCorruptFile; GGUF version other than 2/3 or an unknown tensor type ->
  // kUnsupported.
  static std::shared_ptr<GgufFile> open(const std::string& path);
  // Parses an already mapped file (kept alive by the GgufFile).
  static std::shared_ptr<GgufFile> parse(std::shared_ptr<const MappedFile> file);

  uint32_t version() const { return version_; }
  const std::string& path() const { return file_->path(); }
  const MappedFile& file() const { return *file_; }
  std::shared_ptr<const MappedFile> file_ptr() const { return file_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // absolute start of the data section

  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return metadata_; }
  const GgufValue* find(const std::string& key) const;

  // Typed getters. A missing key -> Error(kNotFound, "GGUF metadata key '<key>' is missing in
  // <path>"); a value of the wrong type -> Error(kInvalidArgument) naming the key.
  // get_float accepts any numeric type; get_uint/get_int any integer that fits.
  std::string get_string(const std::string& key) const;
  uint64_t get_uint(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  // As above but return `def` when the key is absent (a wrong type still throws).
  std::string get_string_or(const std::string& key, const std::string& def) const;
  uint64_t get_uint_or(const std::string& key, uint64_t def) const;
  int64_t get_int_or(const std::string& key, int64_t def) const;
  double get_float_or(const std::string& key, double def) const;
  bool get_bool_or(const std::string& key, bool def) const;

  // In file order.
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;

 private:
  GgufFile() = default;
  const GgufValue& require(const std::string& key) const;

  std::shared_ptr<const MappedFile> file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::unordered_map<std::string, size_t> metadata_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

}  // namespace k25
