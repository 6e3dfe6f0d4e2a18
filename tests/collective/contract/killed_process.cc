// The contract for backends whose ranks are processes: a rank killed in the middle of a run of
// collectives is named by every other rank ("lost rank 2 of 3: its process died"), long before
// the calls' timeout. Rank 0 is killed too: it may own shared state (the shared-memory segment,
// NCCL's unique id).
#include <thread>

#include "contract.h"

namespace tandem::testing::contract {
namespace {

constexpr auto kPrompt = std::chrono::milliseconds(15s);

const Section& kKilled = add_section({
    .name = "failure/killed_process",
    .applies = [](const Backend& b) { return b.processes(); },
    .sizes = [](const Backend& b) { return std::vector<int>{b.traits.failure_size}; },
    // The victim: the last rank, and rank 0.
    .params =
        [](const Backend&, int size) {
          return std::vector<int>{size - 1, 0};
        },
    .body =
        [](RankContext& ctx) {
          ctx.step("warm-up", [&] { ctx.comm().barrier(); });
          Tensor t = ctx.tensor(std::vector<float>(1 << 16, 1.0f), {1 << 16});
          const auto call = [&] { ctx.comm().all_reduce(t, ReduceOp::kSum, {.timeout = kLongTimeout}); };
          // All-reduces until one fails: that one is recorded as "call".
          for (int i = 0;; ++i) {
            if (i == 3) ctx.ready();  // the driver kills the victim once every rank is here
            if (!ctx.step("call", call, /*record_success=*/false)) break;
          }
        },
    .verdict =
        [](const Run& run, const std::vector<Outcome>& outcomes) {
          const std::string lost = fmt::format("lost {}: its process died", ranks_named({run.param}, run.size));
          for (const Outcome& o : outcomes) {
            if (o.rank == run.param) continue;
            CAPTURE(o.rank);
            const Step& call = o.step("call");
            check_step(call, "Unavailable", {lost});
            CHECK(call.ms < kPrompt.count());
          }
        },
    .drive =
        [](const Run& run, Workers& workers) {
          std::vector<std::string> ready;
          for (int r = 0; r < run.size; ++r) ready.push_back(fmt::format("contract/ready/{}", r));
          workers.store().wait(ready, std::chrono::duration_cast<std::chrono::milliseconds>(kRunLimit));
          std::this_thread::sleep_for(100ms);  // every rank is inside an all_reduce, or about to be
          workers.kill(run.param);
        },
});

}  // namespace

TEST_CASE("failure: a killed process is named by the other ranks, promptly") { check_contract(kKilled); }

}  // namespace tandem::testing::contract
