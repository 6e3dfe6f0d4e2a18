// The contract's reduce_scatter: rank r receives part r of the reduction (against the serial
// reference) for every dtype and reduction; the input is left as it was.
#include "contract.h"

namespace tandem::testing::contract {
namespace {

template <class T>
void check_reduce_scatter(RankContext& ctx, std::int64_t rows, std::int64_t cols, ReduceOp op, int call) {
  const bool fractional = ctx.traits().rank_order;
  const std::int64_t part = rows * cols;
  const std::int64_t total = part * ctx.size();
  const std::vector<T> mine = values<T>(total, ctx.rank(), call, fractional);
  Tensor input = ctx.tensor(mine, {rows * ctx.size(), cols});
  Tensor output = ctx.tensor(std::vector<T>(static_cast<std::size_t>(part)), {rows, cols});
  ctx.comm().reduce_scatter(input, output, op);
  const std::vector<T> full = reference<T>(ctx.size(), total, op, call, fractional);
  const std::vector<T> got = output.to_vector<T>();
  const std::string what =
      fmt::format("reduce_scatter {} of {} ({}, {})", reduce_op_name(op), graph::dtype_of<T>, rows * ctx.size(), cols);
  expect_equal(got, std::vector<T>(full.begin() + part * ctx.rank(), full.begin() + part * (ctx.rank() + 1)), what,
               op == ReduceOp::kMean && !fractional);
  expect_equal(input.to_vector<T>(), mine, what + ": its input");
}

const Section& kParts = add_section({
    .name = "reduce_scatter/parts",
    .body =
        [](RankContext& ctx) {
          // (Each rank receives another part: no digest to compare.)
          int call = 0;
          for (DType dtype : ctx.traits().reduce_dtypes) {
            for (ReduceOp op : kReduceOps) {
              graph::dispatch<ReducibleTypes>(dtype, "contract",
                                              [&]<class T>() { check_reduce_scatter<T>(ctx, 5, 3, op, ++call); });
            }
          }
          // Parts larger than one piece of the shared-memory segment.
          check_reduce_scatter<float>(ctx, 1100, 1, ReduceOp::kSum, ++call);
        },
});

}  // namespace

TEST_CASE("reduce_scatter: rank r receives part r of the reduction, every dtype and reduction") {
  check_contract(kParts);
}

}  // namespace tandem::testing::contract
