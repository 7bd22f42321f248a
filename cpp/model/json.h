// A small strict JSON reader for model metadata (safetensors headers, config.json, index files).
//
// Strict means RFC 8259 and nothing more: no comments, trailing commas, NaN literals or
// single quotes; strings must be valid UTF-8; duplicate object keys are rejected (a header
// that names a tensor twice is ambiguous). Objects keep their insertion order because
// safetensors headers and config files are easier to debug when listed as written.
// Nesting is limited to kMaxDepth so hostile input cannot exhaust the stack.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace k25 {

class Json {
 public:
  enum class Kind { kNull, kBool, kInt, kDouble, kString, kArray, kObject };
  using Array = std::vector<Json>;
  using Object = std::vector<std::pair<std::string, Json>>;

  static constexpr int kMaxDepth = 256;

  Json() = default;  // null
  static Json from_bool(bool b);
  static Json from_int(int64_t i);
  static Json from_double(double d);
  static Json from_string(std::string s);
  static Json from_array(Array a);
  static Json from_object(Object o);

  // Throws Error(kCorruptFile, "<what>: invalid JSON at byte N: <reason>") on any syntax
  // error. Integers without fraction/exponent that fit int64 are kInt, other numbers kDouble
  // (out-of-range magnitudes become +-inf or +-0, as Python's json module does).
  static Json parse(std::string_view text, const std::string& what);

  Kind kind() const { return static_cast<Kind>(value_.index()); }
  bool is_null() const { return kind() == Kind::kNull; }
  bool is_bool() const { return kind() == Kind::kBool; }
  bool is_int() const { return kind() == Kind::kInt; }
  bool is_double() const { return kind() == Kind::kDouble; }
  bool is_number() const { return is_int() || is_double(); }
  bool is_string() const { return kind() == Kind::kString; }
  bool is_array() const { return kind() == Kind::kArray; }
  bool is_object() const { return kind() == Kind::kObject; }

  // The as_* accessors throw Error(kInvalidArgument) on the wrong kind.
  bool as_bool() const;
  int64_t as_int() const;
  double as_double() const;  // an int converts (exactly when |i| <= 2^53)
  const std::string& as_string() const;
  const Array& elements() const;
  const Object& items() const;

  // Elements of an array or members of an object; 0 for scalars.
  size_t size() const;
  // Array element i; throws kInvalidArgument if not an array or out of range.
  const Json& operator[](size_t i) const;
  // Member by key (linear scan, first match); nullptr if absent or not an object.
  const Json* find(std::string_view key) const;

  static const char* kind_name(Kind k);

 private:
  // The order must match Kind.
  std::variant<std::monostate, bool, int64_t, double, std::string, Array, Object> value_;
};

// Length of the well-formed UTF-8 sequence starting at s[pos] (1 for ASCII), or 0 if the
// bytes there are not valid UTF-8 (overlong forms, surrogates and > U+10FFFF are invalid).
size_t utf8_sequence_length(std::string_view s, size_t pos);

// Names read from model files go into error messages, which Python decodes as UTF-8 and
// people read: this quotes s with invalid bytes and control characters as \xNN and cuts it
// to about max_bytes, so a hostile name can neither break the message nor bloat it.
std::string quote_for_message(std::string_view s, size_t max_bytes = 200);

}  // namespace k25
