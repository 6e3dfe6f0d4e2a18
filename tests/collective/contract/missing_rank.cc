// The contract when ranks do not arrive: the others' call throws DeadlineExceeded at its timeout
// (not before), naming the call and the missing ranks; the group is then failed, so the late
// ranks' next call throws too.
#include "contract.h"

namespace tandem::testing::contract {
namespace {

constexpr auto kTimeout = std::chrono::milliseconds(1000);
// How long past its timeout a call may take to say so (reading the peers' reports, polling).
constexpr auto kSlack = std::chrono::milliseconds(10s);

// The missing ranks: the last `count`.
std::vector<int> missing_ranks(int size, int count) {
  std::vector<int> ranks;
  for (int r = size - count; r < size; ++r) ranks.push_back(r);
  return ranks;
}

const Section& kMissing = add_section({
    .name = "failure/missing_rank",
    .sizes = [](const Backend& b) { return std::vector<int>{b.traits.failure_size}; },
    // One missing rank, and two where a group has room for them.
    .params =
        [](const Backend&, int size) {
          return size >= 3 ? std::vector<int>{1, 2} : std::vector<int>{1};
        },
    .body =
        [](RankContext& ctx) {
          // A call every rank completes first: NCCL connects the peers in the first one.
          ctx.step("warm-up", [&] { ctx.comm().barrier(); });
          if (ctx.rank() >= ctx.size() - ctx.param()) {
            ctx.hold();
            ctx.step("later", [&] { ctx.comm().barrier({.timeout = kTimeout}); });
            return;
          }
          ctx.step("call", [&] {
            Tensor t = ctx.tensor(std::vector<float>(1024, 1.0f), {1024});
            ctx.comm().all_reduce(t, ReduceOp::kSum, {.timeout = kTimeout});
          });
        },
    .verdict =
        [](const Run& run, const std::vector<Outcome>& outcomes) {
          const std::vector<int> missing = missing_ranks(run.size, run.param);
          for (const Outcome& o : outcomes) {
            CAPTURE(o.rank);
            check_step(o.step("warm-up"), "none");
            const bool is_missing = o.rank >= run.size - run.param;
            const Step& step = o.step(is_missing ? "later" : "call");
            INFO(step.type << ": " << step.message);
            CHECK(step.type != "none");
            CHECK(step.ms < (kTimeout + kSlack).count());
            if (is_missing) continue;
            CHECK(step.ms >= (kTimeout - 50ms).count());
            if (run.backend.traits.names_missing_rank) {
              check_step(step, "DeadlineExceeded", {"all_reduce #1", ranks_named(missing, run.size)});
            }
          }
        },
});

}  // namespace

TEST_CASE("failure: ranks that never arrive are named in the others' DeadlineExceeded; the group is then failed") {
  check_contract(kMissing);
}

}  // namespace tandem::testing::contract
