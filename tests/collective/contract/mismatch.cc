// The contract when the ranks' calls disagree (count, dtype, operation, reduction, root), and
// when one rank's own arguments are wrong (a root outside the group, an output of the wrong
// shape). Depending on the backend (Traits::mismatch): every rank throws InvalidArgument naming
// both sides and the group stays usable; or the calls are not compared, but no rank waits past its
// timeout; or (backends whose mismatched calls are not run) only a rank's own bad arguments are
// tried. In every case the rank with bad arguments throws InvalidArgument saying what is wrong.
#include "contract.h"

namespace tandem::testing::contract {
namespace {

constexpr auto kTimeout = std::chrono::milliseconds(1000);
constexpr auto kSlack = std::chrono::milliseconds(10s);

enum Kind { kCount, kDtype, kOperation, kReduction, kRoot, kBadRoot, kBadShape };

// The last rank is the odd one out.
bool odd(const RankContext& ctx) { return ctx.rank() == ctx.size() - 1; }

void disagree(RankContext& ctx) {
  Communicator& c = ctx.comm();
  const int n = ctx.size();
  const collective::CallOptions options{.timeout = kTimeout};
  Tensor t = ctx.tensor(std::vector<float>(8, 1.0f), {8});
  switch (ctx.param()) {
    case kCount: {
      const std::int64_t count = odd(ctx) ? 1000 : 1024;
      Tensor big = ctx.tensor(std::vector<float>(static_cast<std::size_t>(count), 1.0f), {count});
      return c.all_reduce(big, ReduceOp::kSum, options);
    }
    case kDtype: {
      if (!odd(ctx)) return c.all_reduce(t, ReduceOp::kSum, options);
      Tensor ints = ctx.tensor(std::vector<std::int32_t>(8, 1), {8});
      return c.all_reduce(ints, ReduceOp::kSum, options);
    }
    case kOperation:
      if (odd(ctx)) return c.broadcast(t, 0, options);
      return c.all_reduce(t, ReduceOp::kSum, options);
    case kReduction: return c.all_reduce(t, odd(ctx) ? ReduceOp::kMax : ReduceOp::kSum, options);
    case kRoot: return c.broadcast(t, odd(ctx) ? 1 : 0, options);
    case kBadRoot: return c.broadcast(t, odd(ctx) ? n : 0, options);
    case kBadShape: {
      Tensor in = ctx.tensor(std::vector<float>(6, 1.0f), {2, 3});
      const std::int64_t rows = odd(ctx) ? 2 * n - 1 : 2 * n;
      Tensor out = ctx.tensor(std::vector<float>(static_cast<std::size_t>(rows * 3)), {rows, 3});
      return c.all_gather(in, out, options);
    }
  }
}

// What the messages must contain: both sides of a disagreement, or the bad argument.
std::vector<std::string> tokens(Kind kind, int size) {
  switch (kind) {
    case kCount: return {"1024", "1000"};
    case kDtype: return {"float32", "int32"};
    case kOperation: return {"all_reduce", "broadcast"};
    case kReduction: return {"SUM", "MAX"};
    case kRoot: return {"root 0", "root 1"};
    case kBadRoot: return {fmt::format("root {}", size)};
    case kBadShape: return {fmt::format("({}, 3)", 2 * size - 1)};
  }
  return {};
}

const Section& kMismatch = add_section({
    .name = "failure/mismatch",
    .sizes = [](const Backend& b) { return std::vector<int>{b.traits.failure_size}; },
    .params =
        [](const Backend& b, int) {
          if (b.traits.mismatch == MismatchReport::kUnchecked) return std::vector<int>{kBadRoot, kBadShape};
          return std::vector<int>{kCount, kDtype, kOperation, kReduction, kRoot, kBadRoot, kBadShape};
        },
    .body =
        [](RankContext& ctx) {
          ctx.step("warm-up", [&] { ctx.comm().barrier(); });
          ctx.step("call", [&] { disagree(ctx); });
          if (ctx.traits().mismatch != MismatchReport::kInvalidArgument) return;
          // The group stays usable.
          ctx.step("after", [&] {
            Tensor t = ctx.tensor(std::vector<float>(5, 1.0f), {5});
            ctx.comm().all_reduce(t, ReduceOp::kSum, {.timeout = kLongTimeout});
            expect_equal(t.to_vector<float>(), std::vector<float>(5, static_cast<float>(ctx.size())), "the sum after");
          });
        },
    .verdict =
        [](const Run& run, const std::vector<Outcome>& outcomes) {
          const auto kind = static_cast<Kind>(run.param);
          const bool bad_arguments = kind == kBadRoot || kind == kBadShape;
          const std::string odd_rank = fmt::format("rank {}", run.size - 1);
          for (const Outcome& o : outcomes) {
            CAPTURE(o.rank);
            check_step(o.step("warm-up"), "none");
            const Step& call = o.step("call");
            INFO(call.type << ": " << call.message);
            CHECK(call.ms < (kTimeout + kSlack).count());
            std::vector<std::string> parts = tokens(kind, run.size);
            if (run.backend.traits.mismatch == MismatchReport::kInvalidArgument) {
              parts.push_back(odd_rank);
              if (!bad_arguments) parts.push_back("rank 0");
              check_step(call, "InvalidArgument", parts);
              check_step(o.step("after"), "none");
            } else if (bad_arguments && o.rank == run.size - 1) {
              check_step(call, "InvalidArgument", parts);
            }
          }
        },
});

}  // namespace

TEST_CASE("failure: mismatched calls and one rank's bad arguments are reported, and no rank waits past its timeout") {
  check_contract(kMismatch);
}

}  // namespace tandem::testing::contract
