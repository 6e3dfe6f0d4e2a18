#include <doctest/doctest.h>

#include "tandem/base/errors.h"

using namespace tandem;

TEST_CASE("TANDEM_REQUIRE throws the named error type with the formatted message") {
  const auto check = [](int features) {
    TANDEM_REQUIRE(features == 784, InvalidArgument, "Dense \"{}\": input has {} features, kernel expects {}",
                   "dense_1", features, 784);
  };
  CHECK_NOTHROW(check(784));
  try {
    check(28);
    FAIL("expected InvalidArgument");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()) == "Dense \"dense_1\": input has 28 features, kernel expects 784");
    CHECK(e.code() == ErrorCode::kInvalidArgument);
  }
}

TEST_CASE("every error is a tandem::Error with its code") {
  CHECK_THROWS_AS(throw DeadlineExceeded("x"), Error);
  CHECK(DataLoss("x").code() == ErrorCode::kDataLoss);
  CHECK(error_code_name(ErrorCode::kUnavailable) == "Unavailable");
  CHECK(Unauthenticated("x").code() == ErrorCode::kUnauthenticated);
  CHECK(error_code_name(PermissionDenied("x").code()) == "PermissionDenied");
}

TEST_CASE("TANDEM_ASSERT marks an internal bug with file and line") {
  try {
    TANDEM_ASSERT(1 + 1 == 3, "arithmetic is {}", "broken");
    FAIL("expected Internal");
  } catch (const Internal& e) {
    const std::string what = e.what();
    CHECK(what.find("errors_test.cc:") != std::string::npos);
    CHECK(what.find("1 + 1 == 3") != std::string::npos);
    CHECK(what.find("arithmetic is broken") != std::string::npos);
  }
}
