#include "model/json.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <system_error>

#include "k25/status.h"

namespace k25 {

namespace {

class Parser {
 public:
  Parser(std::string_view text, const std::string& what) : s_(text), what_(what) {}

  Json parse_document() {
    skip_ws();
    Json v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) error("unexpected data after the top-level value");
    return v;
  }

 private:
  [[noreturn]] void error(const std::string& why) const { error_at(pos_, why); }
  [[noreturn]] void error_at(size_t at, const std::string& why) const {
    fail(ErrorCode::kCorruptFile,
         what_ + ": invalid JSON at byte " + std::to_string(at) + ": " + why);
  }

  bool at_end() const { return pos_ >= s_.size(); }
  unsigned char peek() const { return static_cast<unsigned char>(s_[pos_]); }

  void skip_ws() {
    while (!at_end()) {
      const char c = s_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
      ++pos_;
    }
  }

  void expect_literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) error("invalid literal");
    pos_ += lit.size();
  }

  Json parse_value(int depth) {
    if (at_end()) error("unexpected end of input, expected a value");
    switch (peek()) {
      case '{': return parse_object(depth + 1);
      case '[': return parse_array(depth + 1);
      case '"': return Json::from_string(parse_string());
      case 't': expect_literal("true"); return Json::from_bool(true);
      case 'f': expect_literal("false"); return Json::from_bool(false);
      case 'n': expect_literal("null"); return Json();
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return parse_number();
        error(std::string("unexpected character ") + describe(peek()));
    }
  }

  static std::string describe(unsigned char c) {
    if (c >= 0x20 && c < 0x7f) return std::string("'") + char(c) + "'";
    static const char* hex = "0123456789abcdef";
    return std::string("0x") + hex[c >> 4] + hex[c & 15];
  }

  void check_depth(int depth) {
    if (depth > Json::kMaxDepth)
      error("nesting deeper than " + std::to_string(Json::kMaxDepth) + " levels");
  }

  Json parse_array(int depth) {
    check_depth(depth);
    ++pos_;  // '['
    Json::Array out;
    skip_ws();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return Json::from_array(std::move(out));
    }
    for (;;) {
      skip_ws();
      out.push_back(parse_value(depth));
      skip_ws();
      if (at_end()) error("unexpected end of input inside an array");
      const unsigned char c = peek();
      ++pos_;
      if (c == ']') break;
      if (c != ',') error_at(pos_ - 1, "expected ',' or ']' in an array");
    }
    // Doubling growth can leave half the capacity unused; large headers are kept a while.
    out.shrink_to_fit();
    return Json::from_array(std::move(out));
  }

  Json parse_object(int depth) {
    check_depth(depth);
    ++pos_;  // '{'
    Json::Object out;
    skip_ws();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return Json::from_object(std::move(out));
    }
    for (;;) {
      skip_ws();
      if (at_end() || peek() != '"') error("expected a string key in an object");
      const size_t key_pos = pos_;
      std::string key = parse_string();
      skip_ws();
      if (at_end() || peek() != ':') error("expected ':' after an object key");
      ++pos_;
      skip_ws();
      Json value = parse_value(depth);
      out.emplace_back(std::move(key), std::move(value));
      key_positions_.push_back(key_pos);
      skip_ws();
      if (at_end()) error("unexpected end of input inside an object");
      const unsigned char c = peek();
      ++pos_;
      if (c == '}') break;
      if (c != ',') error_at(pos_ - 1, "expected ',' or '}' in an object");
    }
    check_unique_keys(out);
    out.shrink_to_fit();
    return Json::from_object(std::move(out));
  }

  // key_positions_ is a stack shared by all open objects; this object's keys are its tail.
  void check_unique_keys(const Json::Object& obj) {
    const size_t n = obj.size();
    const size_t base = key_positions_.size() - n;
    if (n > 1) {
      std::vector<size_t> order(n);
      for (size_t i = 0; i < n; ++i) order[i] = i;
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return obj[a].first != obj[b].first ? obj[a].first < obj[b].first : a < b;
      });
      for (size_t i = 1; i < n; ++i) {
        if (obj[order[i]].first == obj[order[i - 1]].first)
          error_at(key_positions_[base + order[i]], "duplicate object key " +
                                                        quote_for_message(obj[order[i]].first));
      }
    }
    key_positions_.resize(base);
  }

  unsigned hex4() {
    if (s_.size() - pos_ < 4) error("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const unsigned char c = peek();
      unsigned d;
      if (c >= '0' && c <= '9') d = c - '0';
      else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
      else error("invalid hex digit in a \\u escape");
      v = v * 16 + d;
      ++pos_;
    }
    return v;
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xc0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += char(0xe0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3f));
      out += char(0x80 | (cp & 0x3f));
    } else {
      out += char(0xf0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3f));
      out += char(0x80 | ((cp >> 6) & 0x3f));
      out += char(0x80 | (cp & 0x3f));
    }
  }

  std::string parse_string() {
    const size_t start = pos_;
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      // Copy the run of plain ASCII in one go; headers are mostly that.
      const size_t run_start = pos_;
      while (!at_end()) {
        const unsigned char c = peek();
        if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80) break;
        ++pos_;
      }
      out.append(s_.data() + run_start, pos_ - run_start);
      if (at_end()) error_at(start, "unterminated string");
      const unsigned char c = peek();
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) error("unescaped control character in a string");
      if (c >= 0x80) {
        const size_t n = utf8_sequence_length(s_, pos_);
        if (n == 0) error("invalid UTF-8 in a string");
        out.append(s_.data() + pos_, n);
        pos_ += n;
        continue;
      }
      ++pos_;  // backslash
      if (at_end()) error_at(start, "unterminated string");
      const unsigned char e = peek();
      ++pos_;
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          const size_t esc = pos_ - 2;
          uint32_t cp = hex4();
          if (cp >= 0xdc00 && cp <= 0xdfff) error_at(esc, "unpaired low surrogate");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (s_.size() - pos_ < 2 || s_[pos_] != '\\' || s_[pos_ + 1] != 'u')
              error_at(esc, "unpaired high surrogate");
            pos_ += 2;
            const uint32_t lo = hex4();
            if (lo < 0xdc00 || lo > 0xdfff) error_at(esc, "unpaired high surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          append_utf8(out, cp);
          break;
        }
        default:
          error_at(pos_ - 2, "invalid escape \\" + describe(e));
      }
    }
  }

  Json parse_number() {
    const size_t start = pos_;
    auto digit = [&] { return !at_end() && peek() >= '0' && peek() <= '9'; };
    if (peek() == '-') ++pos_;
    if (!digit()) error("expected a digit");
    if (peek() == '0') {
      ++pos_;
      if (digit()) error("leading zeros are not allowed");
    } else {
      while (digit()) ++pos_;
    }
    bool integral = true;
    if (!at_end() && peek() == '.') {
      integral = false;
      ++pos_;
      if (!digit()) error("expected a digit after '.'");
      while (digit()) ++pos_;
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      integral = false;
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (!digit()) error("expected a digit in the exponent");
      while (digit()) ++pos_;
    }
    const char* first = s_.data() + start;
    const char* last = s_.data() + pos_;
    if (integral) {
      int64_t i = 0;
      const auto r = std::from_chars(first, last, i);
      if (r.ec == std::errc() && r.ptr == last) return Json::from_int(i);
      // Too large for int64: fall through to a double, like most JSON readers.
    }
    double d = 0;
    const auto r = std::from_chars(first, last, d);
    if (r.ec == std::errc::result_out_of_range) {
      d = overflows(first, last) ? std::numeric_limits<double>::infinity() : 0.0;
      if (*first == '-') d = -d;
    } else if (r.ec != std::errc() || r.ptr != last) {
      error_at(start, "invalid number");
    }
    return Json::from_double(d);
  }

  // For a syntactically valid number that from_chars reported out of range: is its magnitude
  // huge (-> inf) rather than tiny (-> 0)? Decimal exponent of the leading nonzero digit.
  static bool overflows(const char* p, const char* end) {
    if (*p == '-') ++p;
    bool seen_nonzero = false, after_point = false;
    int64_t int_digits = 0, frac_zeros = 0;
    for (; p != end && *p != 'e' && *p != 'E'; ++p) {
      if (*p == '.') {
        after_point = true;
        continue;
      }
      if (!after_point) {
        if (seen_nonzero || *p != '0') {
          seen_nonzero = true;
          ++int_digits;
        }
      } else if (!seen_nonzero) {
        if (*p == '0') ++frac_zeros;
        else seen_nonzero = true;
      }
    }
    // Decimal exponent of the first nonzero digit (the value is not zero, or it would fit).
    const int64_t lead = int_digits > 0 ? int_digits - 1 : -(frac_zeros + 1);
    int64_t exp = 0;
    if (p != end) {
      ++p;
      bool neg = false;
      if (*p == '+' || *p == '-') neg = (*p++ == '-');
      for (; p != end; ++p) {
        if (exp < (int64_t(1) << 40)) exp = exp * 10 + (*p - '0');
      }
      if (neg) exp = -exp;
    }
    return lead + exp > 0;
  }

  std::string_view s_;
  const std::string& what_;
  size_t pos_ = 0;
  std::vector<size_t> key_positions_;
};

[[noreturn]] void wrong_kind(Json::Kind have, Json::Kind want) {
  fail(ErrorCode::kInvalidArgument, std::string("JSON value is ") + Json::kind_name(have) +
                                        ", expected " + Json::kind_name(want));
}

}  // namespace

size_t utf8_sequence_length(std::string_view s, size_t pos) {
  if (pos >= s.size()) return 0;
  const size_t left = s.size() - pos;
  auto b = [&](size_t i) { return static_cast<unsigned char>(s[pos + i]); };
  auto cont = [&](size_t i) { return i < left && (b(i) & 0xc0) == 0x80; };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) return cont(1) ? 2 : 0;
  if (c >= 0xe0 && c <= 0xef) {
    if (!cont(1) || !cont(2)) return 0;
    if (c == 0xe0 && b(1) < 0xa0) return 0;   // overlong
    if (c == 0xed && b(1) >= 0xa0) return 0;  // UTF-16 surrogate
    return 3;
  }
  if (c >= 0xf0 && c <= 0xf4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    if (c == 0xf0 && b(1) < 0x90) return 0;   // overlong
    if (c == 0xf4 && b(1) >= 0x90) return 0;  // above U+10FFFF
    return 4;
  }
  return 0;
}

std::string quote_for_message(std::string_view s, size_t max_bytes) {
  static const char* hex = "0123456789abcdef";
  std::string out = "'";
  size_t i = 0;
  while (i < s.size() && out.size() < max_bytes) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = utf8_sequence_length(s, i);
    if (n == 0 || c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
      ++i;
    } else {
      out.append(s.data() + i, n);
      i += n;
    }
  }
  out += "'";
  if (i < s.size()) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

Json Json::from_bool(bool b) {
  Json j;
  j.value_ = b;
  return j;
}
Json Json::from_int(int64_t i) {
  Json j;
  j.value_ = i;
  return j;
}
Json Json::from_double(double d) {
  Json j;
  j.value_ = d;
  return j;
}
Json Json::from_string(std::string s) {
  Json j;
  j.value_ = std::move(s);
  return j;
}
Json Json::from_array(Array a) {
  Json j;
  j.value_ = std::move(a);
  return j;
}
Json Json::from_object(Object o) {
  Json j;
  j.value_ = std::move(o);
  return j;
}

Json Json::parse(std::string_view text, const std::string& what) {
  return Parser(text, what).parse_document();
}

const char* Json::kind_name(Kind k) {
  switch (k) {
    case Kind::kNull: return "null";
    case Kind::kBool: return "a bool";
    case Kind::kInt: return "an integer";
    case Kind::kDouble: return "a floating-point number";
    case Kind::kString: return "a string";
    case Kind::kArray: return "an array";
    case Kind::kObject: return "an object";
  }
  return "?";
}

bool Json::as_bool() const {
  if (!is_bool()) wrong_kind(kind(), Kind::kBool);
  return std::get<bool>(value_);
}

int64_t Json::as_int() const {
  if (!is_int()) wrong_kind(kind(), Kind::kInt);
  return std::get<int64_t>(value_);
}

double Json::as_double() const {
  if (is_int()) return static_cast<double>(std::get<int64_t>(value_));
  if (!is_double()) wrong_kind(kind(), Kind::kDouble);
  return std::get<double>(value_);
}

const std::string& Json::as_string() const {
  if (!is_string()) wrong_kind(kind(), Kind::kString);
  return std::get<std::string>(value_);
}

const Json::Array& Json::elements() const {
  if (!is_array()) wrong_kind(kind(), Kind::kArray);
  return std::get<Array>(value_);
}

const Json::Object& Json::items() const {
  if (!is_object()) wrong_kind(kind(), Kind::kObject);
  return std::get<Object>(value_);
}

size_t Json::size() const {
  if (is_array()) return std::get<Array>(value_).size();
  if (is_object()) return std::get<Object>(value_).size();
  return 0;
}

const Json& Json::operator[](size_t i) const {
  const Array& a = elements();
  if (i >= a.size())
    fail(ErrorCode::kInvalidArgument, "JSON array index " + std::to_string(i) +
                                          " is out of range (size " + std::to_string(a.size()) +
                                          ")");
  return a[i];
}

const Json* Json::find(std::string_view key) const {
  if (!is_object()) return nullptr;
  for (const auto& kv : std::get<Object>(value_)) {
    if (kv.first == key) return &kv.second;
  }
  return nullptr;
}

}  // namespace k25
