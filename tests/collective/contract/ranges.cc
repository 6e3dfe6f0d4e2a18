// The contract's range collectives (ZeRO's): reduce_scatter_ranges leaves in rank r's range of
// each tensor the reduction of that range (against the serial reference) and the riders' whole
// reductions on every rank; all_gather_ranges makes every rank's tensors whole from each rank's
// range. Tensors whose last ranges are cut short or empty (ShardSpec's padding) included, and
// both counted as the packed buffer they stand for.
#include "contract.h"

namespace tandem::testing::contract {
namespace {

using collective::CommunicationStats;
using collective::OpStats;

// Element counts of the tensors of one call: uneven, smaller than the group, empty.
constexpr std::int64_t kSizes[] = {7, 12, 1, 0, 5};

std::int64_t shard_of(std::int64_t elements, int size) { return (elements + size - 1) / size; }

// The tensors of one call, cut out of `all` (their values concatenated), and their shard sizes.
template <class T>
std::vector<Tensor> tensors_of(RankContext& ctx, const std::vector<T>& all, std::vector<std::int64_t>& shards) {
  std::vector<Tensor> tensors;
  std::int64_t at = 0;
  for (const std::int64_t n : kSizes) {
    tensors.push_back(ctx.tensor(std::vector<T>(all.begin() + at, all.begin() + at + n), Shape({n})));
    shards.push_back(shard_of(n, ctx.size()));
    at += n;
  }
  return tensors;
}

std::int64_t total_elements() {
  std::int64_t total = 0;
  for (const std::int64_t n : kSizes) total += n;
  return total;
}

template <class T>
void check_reduce_scatter_ranges(RankContext& ctx, ReduceOp op, int call, bool with_riders) {
  const bool fractional = ctx.traits().rank_order;
  const int r = ctx.rank();
  const std::int64_t total = total_elements();
  std::vector<std::int64_t> shards;
  std::vector<Tensor> tensors = tensors_of<T>(ctx, values<T>(total, r, call, fractional), shards);
  std::vector<Tensor> riders;
  if (with_riders) riders.push_back(ctx.tensor(values<T>(3, r, call + 1000, fractional), Shape({3})));
  ctx.comm().reduce_scatter_ranges(tensors, shards, riders, op);
  const std::vector<T> full = reference<T>(ctx.size(), total, op, call, fractional);
  const bool close = op == ReduceOp::kMean && !fractional;
  std::int64_t at = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::int64_t n = kSizes[i];
    const std::int64_t begin = std::min(n, r * shards[i]), end = std::min(n, (r + 1) * shards[i]);
    const std::vector<T> got = tensors[i].to_vector<T>();
    expect_equal(std::vector<T>(got.begin() + begin, got.begin() + end),
                 std::vector<T>(full.begin() + at + begin, full.begin() + at + end),
                 fmt::format("reduce_scatter_ranges {} of {}: tensor {} ({} elements), rank {}'s range",
                             reduce_op_name(op), graph::dtype_of<T>, i, n, r),
                 close);
    at += n;
  }
  if (with_riders) {
    expect_equal(riders[0].to_vector<T>(), reference<T>(ctx.size(), 3, op, call + 1000, fractional),
                 fmt::format("reduce_scatter_ranges {} of {}: the rider", reduce_op_name(op), graph::dtype_of<T>),
                 close);
  }
}

template <class T>
void check_all_gather_ranges(RankContext& ctx, int call) {
  const int r = ctx.rank();
  const std::int64_t total = total_elements();
  // Each rank's tensors hold its own values; only its range of each counts.
  std::vector<std::int64_t> shards;
  std::vector<Tensor> tensors = tensors_of<T>(ctx, values<T>(total, r, call, false), shards);
  ctx.comm().all_gather_ranges(tensors, shards);
  std::int64_t at = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::int64_t n = kSizes[i];
    std::vector<T> expected(static_cast<std::size_t>(n));
    for (int q = 0; q < ctx.size(); ++q) {
      const auto owner = values<T>(total, q, call, false);
      for (std::int64_t j = std::min(n, q * shards[i]); j < std::min(n, (q + 1) * shards[i]); ++j) {
        expected[static_cast<std::size_t>(j)] = owner[static_cast<std::size_t>(at + j)];
      }
    }
    expect_equal(tensors[i].to_vector<T>(), expected,
                 fmt::format("all_gather_ranges of {}: tensor {} ({} elements)", graph::dtype_of<T>, i, n));
    at += n;
  }
}

const Section& kRanges = add_section({
    .name = "ranges/values",
    .body =
        [](RankContext& ctx) {
          int call = 0;
          for (DType dtype : ctx.traits().reduce_dtypes) {
            for (ReduceOp op : kReduceOps) {
              graph::dispatch<ReducibleTypes>(dtype, "contract", [&]<class T>() {
                check_reduce_scatter_ranges<T>(ctx, op, ++call, /*with_riders=*/false);
                check_reduce_scatter_ranges<T>(ctx, op, ++call, /*with_riders=*/true);
              });
            }
            graph::dispatch<ReducibleTypes>(dtype, "contract", [&]<class T>() { check_all_gather_ranges<T>(ctx, ++call); });
          }
        },
});

// Counted as the packed buffers: n parts of (sum of the shard sizes + the riders) elements.
const Section& kRangeStats = add_section({
    .name = "ranges/stats",
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          const int n = ctx.size();
          const CommunicationStats before = c.stats();
          std::vector<std::int64_t> shards;
          std::vector<Tensor> tensors = tensors_of<float>(ctx, values<float>(total_elements(), 0, 1, false), shards);
          std::vector<Tensor> riders = {ctx.tensor(std::vector<float>(3, 1.0f), Shape({3}))};
          c.reduce_scatter_ranges(tensors, shards, riders, ReduceOp::kSum);
          c.all_gather_ranges(tensors, shards);
          CommunicationStats got = c.stats();
          got -= before;
          std::int64_t part = 0;
          for (const std::int64_t s : shards) part += s;
          const std::int64_t rs = n == 1 ? 0 : 4 * (part + 3) * n * (n - 1) / n;
          const std::int64_t ag = n == 1 ? 0 : 4 * part * n * (n - 1) / n;
          const OpStats rs_expected{.calls = 1, .bytes_sent = rs, .bytes_received = rs};
          const OpStats ag_expected{.calls = 1, .bytes_sent = ag, .bytes_received = ag};
          if (!(got.reduce_scatter == rs_expected) || !(got.all_gather == ag_expected)) {
            throw ContractViolation(fmt::format(
                "rank {} of {}: the range collectives counted reduce_scatter {} calls {} B, all_gather {} calls {} B; "
                "expected {} B and {} B",
                ctx.rank(), n, got.reduce_scatter.calls, got.reduce_scatter.bytes_sent, got.all_gather.calls,
                got.all_gather.bytes_sent, rs, ag));
          }
        },
});

}  // namespace

TEST_CASE("reduce_scatter_ranges / all_gather_ranges: each rank's ranges of its own tensors, riders whole") {
  check_contract(kRanges);
}

TEST_CASE("reduce_scatter_ranges / all_gather_ranges: counted as the packed buffers they stand for") {
  check_contract(kRangeStats);
}

}  // namespace tandem::testing::contract
