// Checks shared by the layer suites (layers_test.cc, transformer_layers_test.cc).
#pragma once

#include <doctest/doctest.h>

#include <cmath>

#include "ops/op_test_harness.h"

namespace tandem::testing {

// A layer's output against a reference: every element finite and |got - want| <= tolerance *
// (1 + |want|). Reports the first five elements outside.
inline void check_close(const RefTensor& got, const RefTensor& want, double tolerance = 2e-5) {
  REQUIRE_MESSAGE(got.shape == want.shape, "shape ", got.shape.to_string(), " vs reference ", want.shape.to_string());
  int failures = 0;
  for (std::int64_t i = 0; i < got.size(); ++i) {
    const bool ok = std::isfinite(got[i]) && std::abs(got[i] - want[i]) <= tolerance * (1.0 + std::abs(want[i]));
    if (!ok && failures++ < 5) CHECK_MESSAGE(ok, "element ", i, ": got ", got[i], ", reference ", want[i]);
  }
  CHECK_MESSAGE(failures == 0, failures, " element(s) outside tolerance ", tolerance);
}

}  // namespace tandem::testing
