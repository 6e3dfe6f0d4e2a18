// The contract's all_gather: every rank's input concatenated along dimension 0 in rank order, any
// dtype; a scalar per rank gathers into a vector.
#include "contract.h"

namespace tandem::testing::contract {
namespace {

// Gathers rank-specific inputs of shape `shape` into (size x shape[0], ...) and checks the order.
template <class T>
void check_all_gather(RankContext& ctx, const Shape& shape, int call, Digest& digest) {
  const std::int64_t n = shape.num_elements();
  Shape out_shape = shape.rank() > 0 ? shape : Shape({1});
  out_shape[0] *= ctx.size();
  Tensor input = ctx.tensor(values<T>(n, ctx.rank(), call, /*fractional=*/true), shape);
  Tensor output = ctx.tensor(std::vector<T>(static_cast<std::size_t>(n * ctx.size())), out_shape);
  ctx.comm().all_gather(input, output);
  std::vector<T> expected;
  for (int q = 0; q < ctx.size(); ++q) {
    const auto v = values<T>(n, q, call, /*fractional=*/true);
    expected.insert(expected.end(), v.begin(), v.end());
  }
  const std::vector<T> got = output.to_vector<T>();
  expect_equal(got, expected, fmt::format("all_gather of {} {}", graph::dtype_of<T>, shape));
  digest.add(got);
}

const Section& kRankOrder = add_section({
    .name = "all_gather/rank_order",
    .body =
        [](RankContext& ctx) {
          Digest digest;
          check_all_gather<std::int64_t>(ctx, Shape({3, 4}), 1, digest);
          check_all_gather<float>(ctx, Shape(), 2, digest);
          check_all_gather<float>(ctx, Shape({1500, 2}), 3, digest);
          check_all_gather<std::uint8_t>(ctx, Shape({5}), 4, digest);
          check_all_gather<graph::float16>(ctx, Shape({2, 3}), 5, digest);
          check_all_gather<double>(ctx, Shape({0, 4}), 6, digest);
          ctx.note(digest.text());
        },
});

}  // namespace

TEST_CASE("all_gather: every rank's input in rank order, any dtype") { check_contract(kRankOrder); }

}  // namespace tandem::testing::contract
