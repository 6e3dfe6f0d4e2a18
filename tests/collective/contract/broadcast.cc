// The contract's broadcast: from every root, tensors of any dtype (bytes are moved, not reduced),
// of any shape, scalars and empty tensors included.
#include "contract.h"

namespace tandem::testing::contract {
namespace {

// Broadcasts rank-specific values of shape `shape` from `root` and checks that every rank holds
// root's.
template <class T>
void check_broadcast(RankContext& ctx, const Shape& shape, int root, int call, Digest& digest) {
  const std::int64_t n = shape.num_elements();
  Tensor t = ctx.tensor(values<T>(n, ctx.rank(), call, /*fractional=*/true), shape);
  ctx.comm().broadcast(t, root);
  const std::vector<T> got = t.to_vector<T>();
  expect_equal(got, values<T>(n, root, call, /*fractional=*/true),
               fmt::format("broadcast of {} {} from root {}", graph::dtype_of<T>, shape, root));
  digest.add(got);
}

const Section& kEveryRoot = add_section({
    .name = "broadcast/every_root",
    .body =
        [](RankContext& ctx) {
          Digest digest;
          int call = 0;
          for (int root = 0; root < ctx.size(); ++root) {
            check_broadcast<float>(ctx, Shape({50, 100}), root, ++call, digest);
            check_broadcast<std::uint8_t>(ctx, Shape({9001}), root, ++call, digest);
            check_broadcast<double>(ctx, Shape({0}), root, ++call, digest);
            check_broadcast<std::int64_t>(ctx, Shape(), root, ++call, digest);
            check_broadcast<graph::bfloat16>(ctx, Shape({3, 7}), root, ++call, digest);
          }
          ctx.note(digest.text());
        },
});

}  // namespace

TEST_CASE("broadcast: from every root, any dtype and shape") { check_contract(kEveryRoot); }

}  // namespace tandem::testing::contract
