// The contract of abort(). Two ways a group is aborted while ranks wait in a collective:
//   param 0: rank 0 aborts while every other rank waits for it in an all_reduce;
//   param 1: rank 0's second thread aborts while rank 0 itself waits in the all_reduce, which
//            cannot complete because the last rank stays away.
// The waiting calls throw Unavailable with the reason promptly (not at their timeout), and every
// later call, on every rank, throws Unavailable with the reason too.
#include <thread>

#include "contract.h"

namespace tandem::testing::contract {
namespace {

constexpr std::string_view kReason = "contract: replica 0 lost its device";
// "Promptly": far below kLongTimeout, the calls' own timeout.
constexpr auto kPrompt = std::chrono::milliseconds(10s);

void abort_soon(Communicator& c) {
  std::this_thread::sleep_for(200ms);
  c.abort(std::string(kReason));
}

const Section& kAbort = add_section({
    .name = "failure/abort",
    .sizes = [](const Backend& b) { return std::vector<int>{b.traits.failure_size}; },
    .params =
        [](const Backend& b, int) {
          return b.traits.abort_reaches_waiting_ranks ? std::vector<int>{0, 1} : std::vector<int>{0};
        },
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          ctx.step("warm-up", [&] { c.barrier(); });
          const auto pending = [&] {
            ctx.step("pending", [&] {
              Tensor t = ctx.tensor(std::vector<float>(1 << 16, 1.0f), {1 << 16});
              c.all_reduce(t, ReduceOp::kSum, {.timeout = kLongTimeout});
            });
          };
          if (ctx.param() == 0 && ctx.rank() == 0) {
            abort_soon(c);
          } else if (ctx.param() == 1 && ctx.rank() == ctx.size() - 1) {
            ctx.hold();  // stays away: the others' all_reduce cannot complete
          } else if (ctx.rank() == 0) {
            std::thread aborter([&] { abort_soon(c); });
            pending();
            aborter.join();
          } else {
            pending();
          }
          ctx.step("later", [&] { c.barrier({.timeout = kLongTimeout}); });
        },
    .verdict =
        [](const Run& run, const std::vector<Outcome>& outcomes) {
          for (const Outcome& o : outcomes) {
            CAPTURE(o.rank);
            check_step(o.step("warm-up"), "none");
            std::vector<std::string> steps = {"later"};
            const bool away = run.param == 0 ? o.rank == 0 : o.rank == run.size - 1;
            if (!away) steps.push_back("pending");
            for (const std::string& name : steps) {
              const Step& step = o.step(name);
              check_step(step, "Unavailable", {std::string(kReason)});
              CHECK(step.ms < kPrompt.count());
            }
          }
        },
});

}  // namespace

TEST_CASE("failure: abort ends pending calls promptly and fails later ones, with its reason, on every rank") {
  check_contract(kAbort);
}

}  // namespace tandem::testing::contract
