// The contract's all_reduce: every dtype and reduction against the serial reference, large
// buffers, a span of tensors reduced as one buffer, and many small calls in a row.
#include <algorithm>

#include "contract.h"

namespace tandem::testing::contract {
namespace {

// Element counts below, at and well above one 4 KiB piece of the shared-memory segment; 0 and 1.
constexpr std::int64_t kCounts[] = {0, 1, 17, 1031, 10007};

template <class T>
void check_all_reduce(RankContext& ctx, std::int64_t count, ReduceOp op, int call, Digest& digest) {
  const bool fractional = ctx.traits().rank_order;
  Tensor t = ctx.tensor(values<T>(count, ctx.rank(), call, fractional), {count});
  ctx.comm().all_reduce(t, op);
  const std::vector<T> got = t.to_vector<T>();
  expect_equal(got, reference<T>(ctx.size(), count, op, call, fractional),
               fmt::format("all_reduce {} of {} x {}", reduce_op_name(op), graph::dtype_of<T>, count),
               op == ReduceOp::kMean && !fractional);
  digest.add(got);
}

const Section& kValues = add_section({
    .name = "all_reduce/values",
    .body =
        [](RankContext& ctx) {
          Digest digest;
          int call = 0;
          for (DType dtype : ctx.traits().reduce_dtypes) {
            for (ReduceOp op : kReduceOps) {
              for (std::int64_t count : kCounts) {
                graph::dispatch<ReducibleTypes>(
                    dtype, "contract", [&]<class T>() { check_all_reduce<T>(ctx, count, op, ++call, digest); });
              }
            }
          }
          // Sequence numbers count every call.
          if (ctx.comm().sequence_number() != static_cast<std::uint64_t>(call)) {
            throw ContractViolation(
                fmt::format("sequence_number() is {} after {} calls", ctx.comm().sequence_number(), call));
          }
          ctx.note(digest.text());
        },
});

const Section& kLarge = add_section({
    .name = "all_reduce/large",
    .body =
        [](RankContext& ctx) {
          Digest digest;
          check_all_reduce<float>(ctx, (1 << 20) + 3, ReduceOp::kSum, 1, digest);
          check_all_reduce<float>(ctx, (1 << 20) + 3, ReduceOp::kMean, 2, digest);
          check_all_reduce<std::int64_t>(ctx, (1 << 20) - 5, ReduceOp::kMax, 3, digest);
          ctx.note(digest.text());
        },
});

// A gradient bucket: tensors of different sizes, some empty, some tiny. Every rank holds it as
// these tensors; where the backend flattens the span, odd ranks hold it as one tensor instead.
const std::vector<std::int64_t> kBucket = {3, 0, 1000, 1, 17, 4096, 0, 65, 2, 333};

const Section& kSpan = add_section({
    .name = "all_reduce/span",
    .body =
        [](RankContext& ctx) {
          std::int64_t total = 0;
          for (auto s : kBucket) total += s;
          const bool fractional = ctx.traits().rank_order;
          const bool whole = ctx.traits().flat_span && ctx.rank() % 2 == 1;
          const std::vector<std::int64_t> sizes = whole ? std::vector<std::int64_t>{total} : kBucket;
          Digest digest;
          int call = 0;
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax}) {
            const auto mine = values<float>(total, ctx.rank(), ++call, fractional);
            std::vector<Tensor> tensors;
            std::int64_t at = 0;
            for (std::int64_t s : sizes) {
              tensors.push_back(ctx.tensor(std::vector<float>(mine.begin() + at, mine.begin() + at + s), {s}));
              at += s;
            }
            ctx.comm().all_reduce(std::span<Tensor>(tensors), op);
            std::vector<float> got;
            for (const Tensor& t : tensors) {
              const auto part = t.to_vector<float>();
              got.insert(got.end(), part.begin(), part.end());
            }
            expect_equal(got, reference<float>(ctx.size(), total, op, call, fractional),
                         fmt::format("all_reduce {} of a span of {} tensors", reduce_op_name(op), tensors.size()),
                         op == ReduceOp::kMean && !fractional);
            digest.add(got);
          }
          ctx.note(digest.text());
        },
});

// A training run's pattern: many small bucket all-reduces in a row, every one in step.
const Section& kInStep = add_section({
    .name = "all_reduce/in_step",
    .body =
        [](RankContext& ctx) {
          constexpr int kRounds = 100;
          const int n = ctx.size();
          for (int round = 0; round < kRounds; ++round) {
            std::vector<Tensor> bucket = {ctx.tensor(std::vector<std::int32_t>(3, round + ctx.rank()), {3}),
                                          ctx.tensor(std::vector<std::int32_t>(20, round + ctx.rank()), {20})};
            ctx.comm().all_reduce(std::span<Tensor>(bucket), ReduceOp::kSum);
            const std::int32_t expected = n * round + n * (n - 1) / 2;
            for (const Tensor& t : bucket) {
              const auto got = t.to_vector<std::int32_t>();
              if (std::any_of(got.begin(), got.end(), [&](std::int32_t x) { return x != expected; })) {
                throw ContractViolation(fmt::format("round {}: a sum is not {}", round, expected));
              }
            }
          }
          if (ctx.comm().sequence_number() != kRounds) {
            throw ContractViolation(
                fmt::format("sequence_number() is {} after {} calls", ctx.comm().sequence_number(), kRounds));
          }
        },
});

}  // namespace

TEST_CASE(
    "all_reduce: SUM, MEAN, MAX and MIN of every dtype equal the serial reference, bitwise the same on every rank") {
  check_contract(kValues);
}

TEST_CASE("all_reduce: a million elements") { check_contract(kLarge); }

TEST_CASE("all_reduce: a span of tensors is reduced as one buffer") { check_contract(kSpan); }

TEST_CASE("all_reduce: many small calls in a row stay in step") { check_contract(kInStep); }

}  // namespace tandem::testing::contract
