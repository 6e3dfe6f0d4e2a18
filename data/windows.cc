// text_windows and split_tokens (data/text.h): next-token windows as a row-mode source.
//
// The windows are not materialised: 1.46 million windows of 128 tokens would be 1.5 GB as
// (input, target) arrays, and 1.46 million Elements in a shuffle buffer some hundreds of MB.
// Instead the dataset is a SliceSource whose rows overlap: component 0 is the token array,
// component 1 the same array one token on (the targets), each row `length` tokens long and
// `stride` tokens after the previous one. Everything downstream works on window numbers
// (dataset_node.h's row mode), and batch copies each window from the one token array.
#include <cmath>
#include <memory>

#include "tandem/base/errors.h"
#include "tandem/data/detail/dataset_node.h"
#include "tandem/data/text.h"

namespace tandem::data {
namespace {

// The tokens must be on the host: the windows are views of them, and batch memcpys from them.
void check_token_array(const Tensor& tokens, std::string_view where) {
  TANDEM_REQUIRE(tokens.defined(), InvalidArgument, "{}: the tokens tensor is undefined", where);
  TANDEM_REQUIRE(tokens.device().host_accessible(), InvalidArgument,
                 "{}: the tokens are on {}, which the host cannot read; copy them with "
                 ".to(devices::default_cpu_device())",
                 where, tokens.device().short_name());
}

}  // namespace

Dataset text_windows(const Tensor& tokens, const WindowOptions& options) {
  constexpr std::string_view kWhere = "text_windows";
  check_token_array(tokens, kWhere);
  TANDEM_REQUIRE(tokens.dtype() == DType::kI32 && tokens.shape().rank() == 1, InvalidArgument,
                 "{}: the tokens are {} {}; expected int32 of rank 1 (Vocabulary::encode's ids)", kWhere,
                 tokens.dtype(), tokens.shape());
  TANDEM_REQUIRE(options.length >= 1, InvalidArgument, "{}: length is {}; expected at least 1", kWhere, options.length);
  TANDEM_REQUIRE(options.stride >= 1, InvalidArgument, "{}: stride is {}; expected at least 1", kWhere, options.stride);
  const std::int64_t n = tokens.shape()[0];
  TANDEM_REQUIRE(n >= options.length + 1, InvalidArgument,
                 "{}: {} tokens make no window of length {}: a window needs length + 1 = {} tokens (its inputs "
                 "and the next token of the last)",
                 kWhere, n, options.length, options.length + 1);

  auto source = std::make_shared<detail::SliceSource>();
  source->rows = (n - options.length - 1) / options.stride + 1;
  // The inputs read tokens [0, n - 1) and the targets [1, n): views of the same buffer.
  const Shape view{n - 1};
  source->components = {Tensor(view, DType::kI32, tokens.buffer(), tokens.byte_offset()),
                        Tensor(view, DType::kI32, tokens.buffer(), tokens.byte_offset() + sizeof(std::int32_t))};
  const graph::TensorSpec row{DType::kI32, Shape{options.length}};
  const auto row_bytes = static_cast<std::size_t>(options.length) * sizeof(std::int32_t);
  const auto stride_bytes = static_cast<std::size_t>(options.stride) * sizeof(std::int32_t);
  source->row_specs = {row, row};
  source->row_bytes = {row_bytes, row_bytes};
  source->row_stride_bytes = {stride_bytes, stride_bytes};
  return Dataset(detail::make_slices_node(std::move(source), "text_windows"));
}

std::pair<Tensor, Tensor> split_tokens(const Tensor& tokens, double train_fraction) {
  constexpr std::string_view kWhere = "split_tokens";
  check_token_array(tokens, kWhere);
  TANDEM_REQUIRE(tokens.shape().rank() >= 1, InvalidArgument, "{}: the tokens are a scalar; expected rank 1 or more",
                 kWhere);
  TANDEM_REQUIRE(std::isfinite(train_fraction) && train_fraction >= 0.0 && train_fraction <= 1.0, InvalidArgument,
                 "{}: train_fraction is {}; expected 0 to 1", kWhere, train_fraction);
  const std::int64_t n = tokens.shape()[0];
  // Python's int(0.9 * len(data)): the double product, truncated.
  const auto first = static_cast<std::int64_t>(train_fraction * static_cast<double>(n));
  const std::size_t row_bytes = n == 0 ? 0 : tokens.nbytes() / static_cast<std::size_t>(n);
  const auto part = [&](std::int64_t begin, std::int64_t rows) {
    Shape shape = tokens.shape();
    shape[0] = rows;
    return Tensor(shape, tokens.dtype(), tokens.buffer(),
                  tokens.byte_offset() + static_cast<std::size_t>(begin) * row_bytes);
  };
  return {part(0, first), part(first, n - first)};
}

}  // namespace tandem::data
