// k25 error type.
//
// Every failure that a user can cause (bad file, bad config, bad request) is thrown as
// k25::Error with a code; the Python bindings map each code to a class in k25.errors, and
// a C++ host catches k25::Error. Nothing in the engine calls abort() on bad input.
#pragma once

#include <stdexcept>
#include <string>

namespace k25 {

enum class ErrorCode {
  kInvalidArgument,    // a bad config value or request field
  kCorruptFile,        // a model file that is truncated or inconsistent
  kUnsupported,        // a valid file or option this build cannot handle (arch, dtype)
  kNotFound,           // a file, tensor or key that is missing
  kIOError,            // the OS refused a read/write/mmap
  kResourceExhausted,  // a request that can never fit (KV pool, max_seq_len)
  kNotImplemented,     // an option that is named but not built yet
  kInternal,           // a bug: an invariant of the engine broke
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

[[noreturn]] inline void fail(ErrorCode code, const std::string& message) {
  throw Error(code, message);
}

}  // namespace k25
