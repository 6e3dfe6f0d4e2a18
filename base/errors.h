// tandem/base/errors.h — the error types every module throws, and the check macros.
//
// User mistakes (a bad shape, an unknown op, a malformed device name, a corrupt file) throw one of
// the typed errors below. The message names the thing involved (layer, op, node, tensor, file,
// rank) and what was expected, e.g.
//   MatMul "dense_1/matmul": inner dimensions differ: a is (128, 28), b is (784, 128)
// Internal invariants use TANDEM_ASSERT, which throws tandem::Internal with file:line: it marks a
// bug in tandem, never a user mistake. Library code never calls exit() or abort().
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace tandem {

// The canonical error codes (the same set as absl/TensorFlow status codes we use).
enum class ErrorCode {
  kInvalidArgument,     // the caller passed something malformed or inconsistent
  kFailedPrecondition,  // the call is valid, but not in the current state
  kNotFound,            // a named thing (device, node, file, tensor) does not exist
  kAlreadyExists,       // creating something whose name is taken
  kPermissionDenied,    // the caller is known but may not do this (write another rank's key)
  kUnauthenticated,     // the caller could not prove who it is (a store's secret differs)
  kOutOfRange,          // iterating past the end (a dataset, a file)
  kDeadlineExceeded,    // a wait ran past its timeout
  kUnavailable,         // a peer or a device went away
  kResourceExhausted,   // out of memory or another bounded resource
  kDataLoss,            // a file or message is corrupt or truncated
  kUnimplemented,       // not supported (yet) for this op, dtype or device
  kInternal,            // a bug in tandem: an invariant did not hold
};

std::string_view error_code_name(ErrorCode code);

// Base of every error tandem throws. what() is the full message; code() the category.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

#define TANDEM_DEFINE_ERROR(Name, code_value) \
  class Name : public Error { \
   public: \
    explicit Name(const std::string& message) : Error(code_value, message) {} \
  };
TANDEM_DEFINE_ERROR(InvalidArgument, ErrorCode::kInvalidArgument)
TANDEM_DEFINE_ERROR(FailedPrecondition, ErrorCode::kFailedPrecondition)
TANDEM_DEFINE_ERROR(NotFound, ErrorCode::kNotFound)
TANDEM_DEFINE_ERROR(AlreadyExists, ErrorCode::kAlreadyExists)
TANDEM_DEFINE_ERROR(PermissionDenied, ErrorCode::kPermissionDenied)
TANDEM_DEFINE_ERROR(Unauthenticated, ErrorCode::kUnauthenticated)
TANDEM_DEFINE_ERROR(OutOfRange, ErrorCode::kOutOfRange)
TANDEM_DEFINE_ERROR(DeadlineExceeded, ErrorCode::kDeadlineExceeded)
TANDEM_DEFINE_ERROR(Unavailable, ErrorCode::kUnavailable)
TANDEM_DEFINE_ERROR(ResourceExhausted, ErrorCode::kResourceExhausted)
TANDEM_DEFINE_ERROR(DataLoss, ErrorCode::kDataLoss)
TANDEM_DEFINE_ERROR(Unimplemented, ErrorCode::kUnimplemented)
TANDEM_DEFINE_ERROR(Internal, ErrorCode::kInternal)
#undef TANDEM_DEFINE_ERROR

namespace detail {
[[noreturn]] void throw_internal(const char* file, int line, const char* condition, const std::string& message);
}  // namespace detail

}  // namespace tandem

// TANDEM_REQUIRE(cond, ErrorType, "format {}", args...): throws tandem::ErrorType with the
// formatted message when cond is false. For checks of user input.
#define TANDEM_REQUIRE(cond, ErrorType, ...) \
  do { \
    if (!(cond)) [[unlikely]] { \
      throw ::tandem::ErrorType(::fmt::format(__VA_ARGS__)); \
    } \
  } while (0)

// TANDEM_ASSERT(cond, "format {}", args...): an internal invariant. Failure is a tandem bug; the
// thrown tandem::Internal carries file:line and the failed condition.
#define TANDEM_ASSERT(cond, ...) \
  do { \
    if (!(cond)) [[unlikely]] { \
      ::tandem::detail::throw_internal(__FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
    } \
  } while (0)
