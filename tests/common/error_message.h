// The message of the error a piece of code throws, for tests that check what an error says.
#pragma once

#include <doctest/doctest.h>

#include <exception>
#include <string>

#include "tandem/base/errors.h"

namespace tandem::testing {

// The what() of the Error (InvalidArgument unless told) that fn throws; "" and a failed check
// when it throws nothing or something else.
template <class Error = InvalidArgument, class Fn>
std::string error_message(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL_CHECK("threw something else: " << std::string(e.what()));
    return {};
  }
  FAIL_CHECK("threw nothing");
  return {};
}

}  // namespace tandem::testing
