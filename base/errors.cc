#include "tandem/base/errors.h"

namespace tandem {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "InvalidArgument";
    case ErrorCode::kFailedPrecondition: return "FailedPrecondition";
    case ErrorCode::kNotFound: return "NotFound";
    case ErrorCode::kAlreadyExists: return "AlreadyExists";
    case ErrorCode::kPermissionDenied: return "PermissionDenied";
    case ErrorCode::kUnauthenticated: return "Unauthenticated";
    case ErrorCode::kOutOfRange: return "OutOfRange";
    case ErrorCode::kDeadlineExceeded: return "DeadlineExceeded";
    case ErrorCode::kUnavailable: return "Unavailable";
    case ErrorCode::kResourceExhausted: return "ResourceExhausted";
    case ErrorCode::kDataLoss: return "DataLoss";
    case ErrorCode::kUnimplemented: return "Unimplemented";
    case ErrorCode::kInternal: return "Internal";
  }
  return "Unknown";
}

Error::Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}

namespace detail {
void throw_internal(const char* file, int line, const char* condition, const std::string& message) {
  throw Internal(
      fmt::format("{}:{}: internal invariant `{}` failed: {} (this is a tandem bug)", file, line, condition, message));
}
}  // namespace detail

}  // namespace tandem
