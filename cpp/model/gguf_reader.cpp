#include "model/gguf_reader.h"

#include <cstring>
#include <limits>

#include "k25/status.h"
#include "model/json.h"

namespace k25 {

namespace {

// Indexed by type id; block_size 0 marks an id k25 does not know.
// Q8_1 is 36 bytes (two fp16 + 32 int8) as in ggml; gguf-py's table still says 40 from the
// days when its d and s were float32, but no file stores Q8_1 (it is a matmul scratch type).
constexpr GgmlTypeTraits kTraits[] = {
    {"F32", 1, 4},          // 0
    {"F16", 1, 2},          // 1
    {"Q4_0", 32, 18},       // 2
    {"Q4_1", 32, 20},       // 3
    {nullptr, 0, 0},        // 4 (Q4_2, removed)
    {nullptr, 0, 0},        // 5 (Q4_3, removed)
    {"Q5_0", 32, 22},       // 6
    {"Q5_1", 32, 24},       // 7
    {"Q8_0", 32, 34},       // 8
    {"Q8_1", 32, 36},       // 9
    {"Q2_K", 256, 84},      // 10
    {"Q3_K", 256, 110},     // 11
    {"Q4_K", 256, 144},     // 12
    {"Q5_K", 256, 176},     // 13
    {"Q6_K", 256, 210},     // 14
    {"Q8_K", 256, 292},     // 15
    {"IQ2_XXS", 256, 66},   // 16
    {"IQ2_XS", 256, 74},    // 17
    {"IQ3_XXS", 256, 98},   // 18
    {"IQ1_S", 256, 50},     // 19
    {"IQ4_NL", 32, 18},     // 20
    {"IQ3_S", 256, 110},    // 21
    {"IQ2_S", 256, 82},     // 22
    {"IQ4_XS", 256, 136},   // 23
    {"I8", 1, 1},           // 24
    {"I16", 1, 2},          // 25
    {"I32", 1, 4},          // 26
    {"I64", 1, 8},          // 27
    {"F64", 1, 8},          // 28
    {"IQ1_M", 256, 56},     // 29
    {"BF16", 1, 2},         // 30
    {nullptr, 0, 0},        // 31 (Q4_0_4_4, removed)
    {nullptr, 0, 0},        // 32 (Q4_0_4_8, removed)
    {nullptr, 0, 0},        // 33 (Q4_0_8_8, removed)
    {"TQ1_0", 256, 54},     // 34
    {"TQ2_0", 256, 66},     // 35
    {nullptr, 0, 0},        // 36 (IQ4_NL_4_4, removed)
    {nullptr, 0, 0},        // 37 (IQ4_NL_4_8, removed)
    {nullptr, 0, 0},        // 38 (IQ4_NL_8_8, removed)
    {"MXFP4", 32, 17},      // 39
    {"NVFP4", 64, 36},      // 40
    {"Q1_0", 128, 18},      // 41
};

uint64_t load_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Bounds-checked little-endian reads over the mapping.
class Reader {
 public:
  explicit Reader(const MappedFile& f) : base_(f.data()), size_(f.size()), path_(f.path()) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }
  const std::string& path() const { return path_; }

  void need(uint64_t n, const char* what = nullptr) const {
    if (n > size_ - pos_)
      fail(ErrorCode::kCorruptFile, path_ + " is truncated: needs " + std::to_string(n) +
                                        " bytes at offset " + std::to_string(pos_) +
                                        ", file has " + std::to_string(size_) +
                                        (what ? std::string(" (reading ") + what + ")" : ""));
  }

  uint64_t u(int n) {
    need(static_cast<uint64_t>(n));
    const uint64_t v = load_le(base_ + pos_, n);
    pos_ += static_cast<uint64_t>(n);
    return v;
  }
  uint32_t u32() { return static_cast<uint32_t>(u(4)); }
  uint64_t u64() { return u(8); }

  // The length is checked against the bytes left before anything is allocated.
  std::string str(const char* what) {
    const uint64_t len = u64();
    need(len, what);
    std::string s(reinterpret_cast<const char*>(base_ + pos_), static_cast<size_t>(len));
    pos_ += len;
    return s;
  }

 private:
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
  const std::string& path_;
};

// Smallest encoding of one value of the type, for sanity-checking array counts.
uint64_t min_encoded_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool: return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16: return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32: return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
    case GgufValueType::kString: return 8;  // the length prefix
    case GgufValueType::kArray: return 12;  // element type + count
  }
  return 1;
}

bool known_value_type(uint32_t id) { return id <= 12; }

class MetadataParser {
 public:
  explicit MetadataParser(Reader& r) : r_(r) {}

  GgufValue value(uint32_t type_id, const std::string& key, int nesting) {
    if (!known_value_type(type_id))
      fail(ErrorCode::kCorruptFile, r_.path() + ": metadata key " + quote_for_message(key) +
                                        " has unknown value type " + std::to_string(type_id) +
                                        " at offset " + std::to_string(r_.pos() - 4));
    const auto t = static_cast<GgufValueType>(type_id);
    switch (t) {
      case GgufValueType::kUint8: return GgufValue::make_uint(t, r_.u(1));
      case GgufValueType::kUint16: return GgufValue::make_uint(t, r_.u(2));
      case GgufValueType::kUint32: return GgufValue::make_uint(t, r_.u(4));
      case GgufValueType::kUint64: return GgufValue::make_uint(t, r_.u(8));
      case GgufValueType::kInt8: return GgufValue::make_int(t, int8_t(uint8_t(r_.u(1))));
      case GgufValueType::kInt16: return GgufValue::make_int(t, int16_t(uint16_t(r_.u(2))));
      case GgufValueType::kInt32: return GgufValue::make_int(t, int32_t(uint32_t(r_.u(4))));
      case GgufValueType::kInt64: return GgufValue::make_int(t, int64_t(r_.u(8)));
      case GgufValueType::kFloat32: {
        const uint32_t bits = static_cast<uint32_t>(r_.u(4));
        float f;
        std::memcpy(&f, &bits, 4);
        return GgufValue::make_float(t, f);
      }
      case GgufValueType::kFloat64: {
        const uint64_t bits = r_.u(8);
        double d;
        std::memcpy(&d, &bits, 8);
        return GgufValue::make_float(t, d);
      }
      case GgufValueType::kBool: {
        const uint64_t at = r_.pos();
        const uint64_t b = r_.u(1);
        if (b > 1)
          fail(ErrorCode::kCorruptFile, r_.path() + ": metadata key " + quote_for_message(key) +
                                            " has bool byte " + std::to_string(b) +
                                            " at offset " + std::to_string(at));
        return GgufValue::make_bool(b != 0);
      }
      case GgufValueType::kString: return GgufValue::make_string(r_.str("string value"));
      case GgufValueType::kArray: return array(key, nesting + 1);
    }
    fail(ErrorCode::kInternal, "unreachable GGUF value type");
  }

 private:
  GgufValue array(const std::string& key, int nesting) {
    if (nesting > GgufFile::kMaxArrayNesting)
      fail(ErrorCode::kCorruptFile, r_.path() + ": metadata key " + quote_for_message(key) +
                                        " nests arrays deeper than " +
                                        std::to_string(GgufFile::kMaxArrayNesting));
    const uint32_t elem_id = r_.u32();
    if (!known_value_type(elem_id))
      fail(ErrorCode::kCorruptFile, r_.path() + ": metadata key " + quote_for_message(key) +
                                        " is an array of unknown value type " +
                                        std::to_string(elem_id));
    const auto elem = static_cast<GgufValueType>(elem_id);
    const uint64_t at = r_.pos();
    const uint64_t count = r_.u64();
    // Check against the bytes left before allocating anything for the elements.
    if (count > r_.remaining() / min_encoded_size(elem))
      fail(ErrorCode::kCorruptFile,
           r_.path() + ": metadata key " + quote_for_message(key) + " claims an array of " +
               std::to_string(count) + " " + gguf_value_type_name(elem) + " at offset " +
               std::to_string(at) + " but only " + std::to_string(r_.remaining()) +
               " bytes remain");
    values_ += count;
    if (values_ > GgufFile::kMaxMetadataValues)
      fail(ErrorCode::kUnsupported, r_.path() + ": metadata holds more than " +
                                        std::to_string(GgufFile::kMaxMetadataValues) +
                                        " array elements");
    std::vector<GgufValue> items;
    items.reserve(static_cast<size_t>(count));
    for (uint64_t i = 0; i < count; ++i) items.push_back(value(elem_id, key, nesting));
    return GgufValue::make_array(elem, std::move(items));
  }

  Reader& r_;
  uint64_t values_ = 0;
};

[[noreturn]] void wrong_type(const GgufValue& v, const char* want) {
  fail(ErrorCode::kInvalidArgument,
       "GGUF value has type " + v.type_name() + ", expected " + want);
}

bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

}  // namespace

const GgmlTypeTraits* ggml_type_traits(uint32_t id) {
  if (id >= sizeof(kTraits) / sizeof(kTraits[0]) || kTraits[id].block_size == 0) return nullptr;
  return &kTraits[id];
}

std::string ggml_type_name(uint32_t id) {
  const GgmlTypeTraits* t = ggml_type_traits(id);
  return t ? std::string(t->name) : "type " + std::to_string(id);
}

const char* gguf_value_type_name(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8: return "uint8";
    case GgufValueType::kInt8: return "int8";
    case GgufValueType::kUint16: return "uint16";
    case GgufValueType::kInt16: return "int16";
    case GgufValueType::kUint32: return "uint32";
    case GgufValueType::kInt32: return "int32";
    case GgufValueType::kFloat32: return "float32";
    case GgufValueType::kBool: return "bool";
    case GgufValueType::kString: return "string";
    case GgufValueType::kArray: return "array";
    case GgufValueType::kUint64: return "uint64";
    case GgufValueType::kInt64: return "int64";
    case GgufValueType::kFloat64: return "float64";
  }
  return "unknown";
}

// ---- GgufValue

GgufValue GgufValue::make_uint(GgufValueType type, uint64_t v) {
  GgufValue g;
  g.type_ = type;
  g.value_ = v;
  return g;
}
GgufValue GgufValue::make_int(GgufValueType type, int64_t v) {
  GgufValue g;
  g.type_ = type;
  g.value_ = v;
  return g;
}
GgufValue GgufValue::make_float(GgufValueType type, double v) {
  GgufValue g;
  g.type_ = type;
  g.value_ = v;
  return g;
}
GgufValue GgufValue::make_bool(bool v) {
  GgufValue g;
  g.type_ = GgufValueType::kBool;
  g.value_ = v;
  return g;
}
GgufValue GgufValue::make_string(std::string v) {
  GgufValue g;
  g.type_ = GgufValueType::kString;
  g.value_ = std::move(v);
  return g;
}
GgufValue GgufValue::make_array(GgufValueType element_type, std::vector<GgufValue> elements) {
  GgufValue g;
  g.type_ = GgufValueType::kArray;
  g.element_type_ = element_type;
  g.value_ = std::move(elements);
  return g;
}

uint64_t GgufValue::as_uint() const {
  if (is_uint()) return std::get<uint64_t>(value_);
  if (is_int()) {
    const int64_t i = std::get<int64_t>(value_);
    if (i < 0)
      fail(ErrorCode::kInvalidArgument,
           "GGUF value " + std::to_string(i) + " is negative, expected an unsigned integer");
    return static_cast<uint64_t>(i);
  }
  wrong_type(*this, "an unsigned integer");
}

int64_t GgufValue::as_int() const {
  if (is_int()) return std::get<int64_t>(value_);
  if (is_uint()) {
    const uint64_t u = std::get<uint64_t>(value_);
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(ErrorCode::kInvalidArgument,
           "GGUF value " + std::to_string(u) + " does not fit a signed 64-bit integer");
    return static_cast<int64_t>(u);
  }
  wrong_type(*this, "an integer");
}

double GgufValue::as_double() const {
  if (is_float()) return std::get<double>(value_);
  if (is_uint()) return static_cast<double>(std::get<uint64_t>(value_));
  if (is_int()) return static_cast<double>(std::get<int64_t>(value_));
  wrong_type(*this, "a number");
}

bool GgufValue::as_bool() const {
  if (!is_bool()) wrong_type(*this, "a bool");
  return std::get<bool>(value_);
}

const std::string& GgufValue::as_string() const {
  if (!is_string()) wrong_type(*this, "a string");
  return std::get<std::string>(value_);
}

const std::vector<GgufValue>& GgufValue::array() const {
  if (!is_array()) wrong_type(*this, "an array");
  return std::get<std::vector<GgufValue>>(value_);
}

std::string GgufValue::type_name() const {
  if (!is_array()) return gguf_value_type_name(type_);
  std::string inner = gguf_value_type_name(element_type_);
  const auto& a = std::get<std::vector<GgufValue>>(value_);
  if (element_type_ == GgufValueType::kArray && !a.empty()) inner = a.front().type_name();
  return "array[" + inner + "]";
}

// ---- GgufTensorInfo

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (uint64_t d : ne) n *= static_cast<int64_t>(d);  // validated not to overflow at load
  return n;
}

// ---- GgufFile

std::shared_ptr<GgufFile> GgufFile::open(const std::string& path) {
  return parse(MappedFile::open(path));
}

std::shared_ptr<GgufFile> GgufFile::parse(std::shared_ptr<const MappedFile> file) {
  std::shared_ptr<GgufFile> g(new GgufFile());
  g->file_ = std::move(file);
  const MappedFile& f = *g->file_;
  const std::string& path = f.path();
  Reader r(f);

  if (f.size() < 4 || std::memcmp(f.data(), "GGUF", 4) != 0)
    fail(ErrorCode::kCorruptFile, path + ": not a GGUF file (it does not start with 'GGUF')");
  r.u32();
  g->version_ = r.u32();
  if (g->version_ != 2 && g->version_ != 3)
    fail(ErrorCode::kUnsupported, path + ": GGUF version " + std::to_string(g->version_) +
                                      " is not supported (k25 reads versions 2 and 3)");
  const uint64_t n_tensors = r.u64();
  const uint64_t n_kv = r.u64();
  // Every key/value needs at least 8 (key length) + 4 (type) + 1 bytes, a tensor info at
  // least 8 + 4 + 4 + 8; reject absurd counts before reserving anything.
  if (n_kv > r.remaining() / 13)
    fail(ErrorCode::kCorruptFile, path + ": header claims " + std::to_string(n_kv) +
                                      " metadata entries, more than the file can hold");
  if (n_tensors > r.remaining() / 24)
    fail(ErrorCode::kCorruptFile, path + ": header claims " + std::to_string(n_tensors) +
                                      " tensors, more than the file can hold");

  MetadataParser mp(r);
  g->metadata_.reserve(static_cast<size_t>(n_kv));
  for (uint64_t i = 0; i < n_kv; ++i) {
    const uint64_t at = r.pos();
    std::string key = r.str("metadata key");
    const uint32_t type_id = r.u32();
    GgufValue v = mp.value(type_id, key, 0);
    if (!g->metadata_index_.emplace(key, g->metadata_.size()).second)
      fail(ErrorCode::kCorruptFile, path + ": duplicate metadata key " + quote_for_message(key) +
                                        " at offset " + std::to_string(at));
    g->metadata_.emplace_back(std::move(key), std::move(v));
  }

  if (const GgufValue* a = g->find("general.alignment")) {
    if (!a->is_integer())
      fail(ErrorCode::kCorruptFile,
           path + ": general.alignment has type " + a->type_name() + ", expected uint32");
    const bool neg = a->is_int() && a->as_int() < 0;
    const uint64_t al = neg ? 0 : a->as_uint();
    // Bounded so that aligning offsets below can never overflow.
    if (al == 0 || (al & (al - 1)) != 0 || al > (uint64_t(1) << 30))
      fail(ErrorCode::kCorruptFile, path + ": general.alignment " +
                                        (neg ? std::to_string(a->as_int()) : std::to_string(al)) +
                                        " is not a power of two up to 2^30");
    g->alignment_ = al;
  }

  g->tensors_.reserve(static_cast<size_t>(n_tensors));
  std::vector<uint64_t> rel_offsets;
  rel_offsets.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    t.name = r.str("tensor name");
    auto bad = [&](ErrorCode code, const std::string& what) {
      fail(code, path + ": tensor " + quote_for_message(t.name) + " " + what);
    };
    const uint64_t dims_at = r.pos();
    const uint32_t n_dims = r.u32();
    if (n_dims > kMaxDims)
      bad(ErrorCode::kCorruptFile, "has " + std::to_string(n_dims) + " dimensions at offset " +
                                       std::to_string(dims_at) + " (at most " +
                                       std::to_string(kMaxDims) + ")");
    uint64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t n = r.u64();
      if (n == 0 || n > uint64_t(std::numeric_limits<int64_t>::max()) ||
          !checked_mul(numel, n, &numel) ||
          numel > uint64_t(std::numeric_limits<int64_t>::max()))
        bad(ErrorCode::kCorruptFile, "has invalid dimension ne[" + std::to_string(d) +
                                         "] = " + std::to_string(n) +
                                         (n == 0 ? "" : " (element count overflows)"));
      t.ne.push_back(n);
    }
    const uint32_t type_id = r.u32();
    const GgmlTypeTraits* tr = ggml_type_traits(type_id);
    if (tr == nullptr)
      bad(ErrorCode::kUnsupported,
          "has GGML type id " + std::to_string(type_id) + ", which k25 does not know");
    t.type = static_cast<GgmlType>(type_id);
    const uint64_t row = t.ne.empty() ? 1 : t.ne[0];
    if (row % uint64_t(tr->block_size) != 0)
      bad(ErrorCode::kCorruptFile, "has rows of " + std::to_string(row) +
                                       " elements, not a multiple of the " + tr->name +
                                       " block size " + std::to_string(tr->block_size));
    // numel < 2^63 and type_size <= 292 per block of >= 1 element: cannot overflow uint64.
    t.nbytes = numel / uint64_t(tr->block_size) * uint64_t(tr->type_size);
    rel_offsets.push_back(r.u64());
    if (!g->tensor_index_.emplace(t.name, g->tensors_.size()).second)
      bad(ErrorCode::kCorruptFile, "appears twice");
    g->tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment after the tensor infos.
  const uint64_t al = g->alignment_;
  const uint64_t size = f.size();
  g->data_offset_ = (r.pos() + al - 1) / al * al;  // pos <= size < 2^63, al <= 2^30
  for (size_t i = 0; i < g->tensors_.size(); ++i) {
    GgufTensorInfo& t = g->tensors_[i];
    const uint64_t rel = rel_offsets[i];
    if (rel % al != 0)
      fail(ErrorCode::kCorruptFile, path + ": tensor " + quote_for_message(t.name) +
                                        " has data offset " + std::to_string(rel) +
                                        ", not a multiple of the alignment " + std::to_string(al));
    if (g->data_offset_ > size || rel > size - g->data_offset_ ||
        t.nbytes > size - g->data_offset_ - rel) {
      // rel is unchecked file data, so the absolute offset may not even fit 64 bits.
      const std::string at = rel > size ? std::to_string(g->data_offset_) + " + " +
                                              std::to_string(rel)
                                        : std::to_string(g->data_offset_ + rel);
      fail(ErrorCode::kCorruptFile, path + " is truncated: needs " + std::to_string(t.nbytes) +
                                        " bytes at offset " + at + ", file has " +
                                        std::to_string(size) + " (data of tensor " +
                                        quote_for_message(t.name) + ")");
    }
    t.offset = g->data_offset_ + rel;
    t.data = f.data() + t.offset;
  }
  return g;
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = metadata_index_.find(key);
  return it == metadata_index_.end() ? nullptr : &metadata_[it->second].second;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufValue& GgufFile::require(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr)
    fail(ErrorCode::kNotFound,
         "GGUF metadata key " + quote_for_message(key) + " is missing in " + path());
  return *v;
}

namespace {

// Re-throws a GgufValue type error with the key and file it came from.
template <typename F>
auto with_key(const std::string& key, const std::string& path, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument) throw;
    fail(ErrorCode::kInvalidArgument,
         "GGUF metadata key " + quote_for_message(key) + " in " + path + ": " + e.what());
  }
}

}  // namespace

std::string GgufFile::get_string(const std::string& key) const {
  const GgufValue& v = require(key);
  return with_key(key, path(), [&] { return v.as_string(); });
}
uint64_t GgufFile::get_uint(const std::string& key) const {
  const GgufValue& v = require(key);
  return with_key(key, path(), [&] { return v.as_uint(); });
}
int64_t GgufFile::get_int(const std::string& key) const {
  const GgufValue& v = require(key);
  return with_key(key, path(), [&] { return v.as_int(); });
}
double GgufFile::get_float(const std::string& key) const {
  const GgufValue& v = require(key);
  return with_key(key, path(), [&] { return v.as_double(); });
}
bool GgufFile::get_bool(const std::string& key) const {
  const GgufValue& v = require(key);
  return with_key(key, path(), [&] { return v.as_bool(); });
}

std::string GgufFile::get_string_or(const std::string& key, const std::string& def) const {
  return find(key) ? get_string(key) : def;
}
uint64_t GgufFile::get_uint_or(const std::string& key, uint64_t def) const {
  return find(key) ? get_uint(key) : def;
}
int64_t GgufFile::get_int_or(const std::string& key, int64_t def) const {
  return find(key) ? get_int(key) : def;
}
double GgufFile::get_float_or(const std::string& key, double def) const {
  return find(key) ? get_float(key) : def;
}
bool GgufFile::get_bool_or(const std::string& key, bool def) const {
  return find(key) ? get_bool(key) : def;
}

}  // namespace k25
