// The test case every op test uses (after ggml's test-backend-ops): describe the op once, with a
// float64 reference written as plain loops, and run_op_case checks
//   1. the float64 kernel against the reference (tight tolerance),
//   2. the float32 kernel against the reference (float32 tolerance),
//   3. the float16 and bfloat16 forward passes against the reference computed on the inputs
//      rounded to that type (so the tolerance measures the kernel, not the input rounding),
//   4. the gradient of every differentiable input, from autodiff, against central finite
//      differences of a random projection of the outputs, in float64,
// on random inputs that are never zero and that keep away from the op's kinks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tandem/graph/autodiff.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/graph.h"
#include "tandem/ops/ops.h"

namespace tandem::testing {

using graph::DType;
using graph::Output;
using graph::Shape;

// A host tensor of doubles: what references read and write.
struct RefTensor {
  Shape shape;
  std::vector<double> values;

  RefTensor() = default;
  explicit RefTensor(const Shape& s, double fill = 0.0)
      : shape(s), values(static_cast<std::size_t>(s.num_elements()), fill) {}
  std::int64_t size() const { return static_cast<std::int64_t>(values.size()); }
  double& operator[](std::int64_t i) { return values[static_cast<std::size_t>(i)]; }
  double operator[](std::int64_t i) const { return values[static_cast<std::size_t>(i)]; }
  // Row-major element access by index (as many indices as the rank).
  double& at(std::initializer_list<std::int64_t> index);
  double at(std::initializer_list<std::int64_t> index) const;
  std::int64_t offset(std::initializer_list<std::int64_t> index) const;
};

struct InputSpec {
  enum class Kind {
    kFloat,   // random in ±[min_abs, max_abs] (or [min_abs, max_abs] when positive)
    kIndex,   // random integers in [0, index_limit), as index_dtype
    kValues,  // exactly `values` (as float, or index_dtype when integral is set)
  };
  Shape shape;
  Kind kind = Kind::kFloat;
  double min_abs = 0.1;
  double max_abs = 2.0;
  bool positive = false;
  bool differentiable = true;  // check the gradient for this input (float inputs only)
  std::int64_t index_limit = 10;
  DType index_dtype = DType::kI64;
  bool integral = false;       // kValues given as integers of index_dtype
  bool distinct = false;       // float values pairwise at least 1e-3 apart (max, argmax, pooling)
  std::vector<double> values;  // for kValues

  static InputSpec floats(const Shape& s) { return InputSpec{.shape = s}; }
  static InputSpec positive_floats(const Shape& s, double lo = 0.1, double hi = 2.0) {
    return InputSpec{.shape = s, .min_abs = lo, .max_abs = hi, .positive = true};
  }
  static InputSpec indices(const Shape& s, std::int64_t limit, DType dtype = DType::kI64) {
    return InputSpec{
        .shape = s, .kind = Kind::kIndex, .differentiable = false, .index_limit = limit, .index_dtype = dtype};
  }
  InputSpec no_gradient() const {
    InputSpec copy = *this;
    copy.differentiable = false;
    return copy;
  }
  InputSpec with_distinct() const {
    InputSpec copy = *this;
    copy.distinct = true;
    return copy;
  }
};

struct OpCase {
  std::string name;
  std::vector<InputSpec> inputs;
  // Builds the op from placeholders for the inputs (in order); returns the outputs to check.
  std::function<std::vector<Output>(const std::vector<Output>& inputs)> build;
  // The float64 reference: the expected value of every output build() returns.
  std::function<std::vector<RefTensor>(const std::vector<RefTensor>& inputs)> reference;
  // Outputs included in the gradient check's projection (default: the first). Outputs that are
  // gradients themselves (a fused loss's backprop) or integer outputs are left out.
  std::vector<int> gradient_outputs{0};
  bool check_gradient = true;
  double f64_tolerance = 1e-10;  // |got - want| <= tol * (1 + |want|)
  double f32_tolerance = 2e-5;
  // 16-bit passes: the output is rounded once (bfloat16 keeps 8 significant bits, 2^-9 relative
  // error; float16 11 bits, 2^-12), plus the float32 computation's error.
  bool check_low_precision = true;
  double bf16_tolerance = 8e-3;
  double f16_tolerance = 1e-3;
  double gradient_tolerance = 1e-6;
  double finite_difference_step = 1e-6;
  // Gradient check of at most this many elements per input (sampled), to bound the run time.
  int max_checked_elements = 64;
};

// Runs the three checks with doctest's CHECK; failures name the case, output and element.
void run_op_case(const OpCase& test_case);

// Reads a tensor of any dtype into a RefTensor.
RefTensor to_ref(const graph::Tensor& t);

}  // namespace tandem::testing
