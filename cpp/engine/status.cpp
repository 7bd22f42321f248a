#include "k25/status.h"

namespace k25 {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "InvalidArgument";
    case ErrorCode::kCorruptFile: return "CorruptFile";
    case ErrorCode::kUnsupported: return "Unsupported";
    case ErrorCode::kNotFound: return "NotFound";
    case ErrorCode::kIOError: return "IOError";
    case ErrorCode::kResourceExhausted: return "ResourceExhausted";
    case ErrorCode::kNotImplemented: return "NotImplemented";
    case ErrorCode::kInternal: return "Internal";
  }
  return "Unknown";
}

}  // namespace k25
