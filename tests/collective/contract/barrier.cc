// The contract's barrier, and what every communicator says about itself: its rank, size and
// backend, and sequence numbers that count every call.
#include <thread>

#include "contract.h"

namespace tandem::testing::contract {
namespace {

const Section& kIdentity = add_section({
    .name = "group/identity",
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          if (c.rank() != ctx.rank() || c.size() != ctx.size() || c.backend() != ctx.traits().backend ||
              c.sequence_number() != 0) {
            throw ContractViolation(fmt::format(
                "rank {} of {}, backend \"{}\", sequence number {}; expected rank {} of "
                "{}, \"{}\", 0",
                c.rank(), c.size(), c.backend(), c.sequence_number(), ctx.rank(), ctx.size(), ctx.traits().backend));
          }
          c.barrier();
          if (c.sequence_number() != 1) {
            throw ContractViolation(fmt::format("sequence number {} after one call", c.sequence_number()));
          }
        },
});

// Every round, each rank records its arrival in the run's store, then calls barrier, then looks
// for every rank's arrival; a different rank comes late each round.
const Section& kWaits = add_section({
    .name = "barrier/waits",
    .body =
        [](RankContext& ctx) {
          constexpr int kRounds = 8;
          for (int round = 0; round < kRounds; ++round) {
            if (ctx.rank() == round % ctx.size()) std::this_thread::sleep_for(20ms);
            ctx.store().set(fmt::format("barrier/{}/{}", round, ctx.rank()), {'1'});
            ctx.comm().barrier();
            for (int q = 0; q < ctx.size(); ++q) {
              if (!ctx.store().check(fmt::format("barrier/{}/{}", round, q))) {
                throw ContractViolation(fmt::format("round {}: barrier returned before rank {} called it", round, q));
              }
            }
          }
        },
});

}  // namespace

TEST_CASE("group: rank, size, backend and sequence numbers") { check_contract(kIdentity); }

TEST_CASE("barrier: returns only once every rank has called it") { check_contract(kWaits); }

}  // namespace tandem::testing::contract
