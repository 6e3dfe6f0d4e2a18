// The contract's accounting: every communicator counts its calls per op, and the bytes this rank
// sent and received by nccl-tests' bus-bandwidth formula (CommunicationStats in
// collective/communicator.h), rounded down once over each op's calls; reset_stats() zeroes them.
#include "contract.h"

namespace tandem::testing::contract {
namespace {

using collective::CommunicationStats;
using collective::OpStats;

// floor(bytes x numerator / n), or 0 for one rank: the ring's bytes for a buffer of `bytes`.
std::int64_t ring_bytes(std::int64_t bytes, std::int64_t numerator, int n) {
  return n == 1 ? 0 : bytes * numerator / n;
}

std::string describe(const OpStats& s) {
  return fmt::format("{} calls, {} B sent, {} B received", s.calls, s.bytes_sent, s.bytes_received);
}

void expect_op(std::string_view op, const OpStats& got, const OpStats& expected, const RankContext& ctx) {
  if (got == expected) return;
  throw ContractViolation(fmt::format("rank {} of {}: {} counted {}; expected {}", ctx.rank(), ctx.size(), op,
                                      describe(got), describe(expected)));
}

// Every op called a known number of times with known buffers, then the counters compared with
// the formula computed here from those buffers' bytes.
const Section& kFormula = add_section({
    .name = "stats/formula",
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          const int n = ctx.size();
          if (c.stats() != CommunicationStats{}) {
            throw ContractViolation(fmt::format("a new communicator's stats are not zero: {}", c.stats().to_string()));
          }
          // all_reduce: a span of two float32 tensors (5 + 3 elements, 32 B) and 5 float32 (20 B),
          // twice each, and one int64 scalar (8 B): 112 B, which for 3 ranks counts 112 x 4 / 3
          // rounded down once (149), not each call rounded (2 x 42 + 2 x 26 + 10 = 146).
          for (int i = 0; i < 2; ++i) {
            std::vector<Tensor> span = {ctx.tensor(std::vector<float>(5, 1.0f), Shape({5})),
                                        ctx.tensor(std::vector<float>(3, 1.0f), Shape({3}))};
            c.all_reduce(span, ReduceOp::kSum);
            Tensor odd = ctx.tensor(std::vector<float>(5, 1.0f), Shape({5}));
            c.all_reduce(odd, ReduceOp::kMax);
          }
          Tensor scalar = ctx.tensor(std::vector<std::int64_t>{1}, Shape());
          c.all_reduce(scalar, ReduceOp::kSum);
          const std::int64_t all_reduce_bytes = 2 * 32 + 2 * 20 + 8;
          // reduce_scatter: float32 (n x 3, 2) into (3, 2): 24n B of input.
          Tensor rs_in = ctx.tensor(std::vector<float>(static_cast<std::size_t>(n * 6), 1.0f), Shape({n * 3, 2}));
          Tensor rs_out = ctx.tensor(std::vector<float>(6), Shape({3, 2}));
          c.reduce_scatter(rs_in, rs_out, ReduceOp::kSum);
          const std::int64_t reduce_scatter_bytes = 24 * n;
          // all_gather: float64 (2) into (2n), twice: 16n B of output each.
          for (int i = 0; i < 2; ++i) {
            Tensor ag_in = ctx.tensor(std::vector<double>(2, 1.0), Shape({2}));
            Tensor ag_out = ctx.tensor(std::vector<double>(static_cast<std::size_t>(2 * n)), Shape({2 * n}));
            c.all_gather(ag_in, ag_out);
          }
          const std::int64_t all_gather_bytes = 2 * 16 * n;
          // broadcast: int32 (5), 20 B, from rank 0 and from the last rank.
          std::int64_t broadcast_sent = 0;
          std::int64_t broadcast_received = 0;
          for (const int root : {0, n - 1}) {
            Tensor b = ctx.tensor(std::vector<std::int32_t>(5, 1), Shape({5}));
            c.broadcast(b, root);
            (root == ctx.rank() ? broadcast_sent : broadcast_received) += 20;
          }
          c.barrier();
          c.barrier();
          c.barrier();

          const CommunicationStats got = c.stats();
          const std::int64_t ar = ring_bytes(all_reduce_bytes, 2 * (n - 1), n);
          const std::int64_t rs = ring_bytes(reduce_scatter_bytes, n - 1, n);
          const std::int64_t ag = ring_bytes(all_gather_bytes, n - 1, n);
          const OpStats bc{.calls = 2,
                           .bytes_sent = n == 1 ? 0 : broadcast_sent,
                           .bytes_received = n == 1 ? 0 : broadcast_received};
          expect_op("all_reduce", got.all_reduce, {.calls = 5, .bytes_sent = ar, .bytes_received = ar}, ctx);
          expect_op("reduce_scatter", got.reduce_scatter, {.calls = 1, .bytes_sent = rs, .bytes_received = rs}, ctx);
          expect_op("all_gather", got.all_gather, {.calls = 2, .bytes_sent = ag, .bytes_received = ag}, ctx);
          expect_op("broadcast", got.broadcast, bc, ctx);
          expect_op("barrier", got.barrier, {.calls = 3}, ctx);
          expect_op("send", got.send, {}, ctx);
          expect_op("recv", got.recv, {}, ctx);
          expect_op("total", got.total(),
                    {.calls = 13,
                     .bytes_sent = ar + rs + ag + bc.bytes_sent,
                     .bytes_received = ar + rs + ag + bc.bytes_received},
                    ctx);

          c.reset_stats();
          if (c.stats() != CommunicationStats{}) {
            throw ContractViolation(fmt::format("stats after reset_stats(): {}", c.stats().to_string()));
          }
          c.all_reduce(scalar, ReduceOp::kSum);
          const std::int64_t one = ring_bytes(8, 2 * (n - 1), n);
          expect_op("all_reduce after reset_stats()", c.stats().all_reduce,
                    {.calls = 1, .bytes_sent = one, .bytes_received = one}, ctx);
        },
});

// Point-to-point calls count the bytes themselves (no ring factor): rank 0 sends rank 1 a float32
// (3) with send (12 B) and an int64 (5) with send_recv (40 B) while receiving a bfloat16 (7) from
// it (14 B); rank 1 mirrors it. Other ranks pass -1 for both halves: nothing is counted.
const Section& kPointToPoint = add_section({
    .name = "stats/point_to_point",
    .applies = [](const Backend& b) { return b.traits.point_to_point_any_pair; },
    .sizes =
        [](const Backend& b) {
          std::vector<int> sizes;
          for (const int n : b.traits.sizes) {
            if (n >= 2) sizes.push_back(n);
          }
          return sizes;
        },
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          const int r = ctx.rank();
          const int peer = r == 0 ? 1 : r == 1 ? 0 : -1;
          Tensor f = ctx.tensor(std::vector<float>(3, 1.0f), Shape({3}));
          Tensor i = ctx.tensor(std::vector<std::int64_t>(5, 1), Shape({5}));
          Tensor b = ctx.tensor(std::vector<graph::bfloat16>(7, graph::bfloat16(1.0f)), Shape({7}));
          if (r == 0) c.send(f, 1);
          if (r == 1) c.recv(f, 0);
          c.send_recv(r == 0 ? i : b, peer, r == 0 ? b : i, peer);
          const CommunicationStats got = c.stats();
          const OpStats none;
          const OpStats sent = r == 0 ? OpStats{.calls = 2, .bytes_sent = 52} : OpStats{.calls = 1, .bytes_sent = 14};
          const OpStats received =
              r == 0 ? OpStats{.calls = 1, .bytes_received = 14} : OpStats{.calls = 2, .bytes_received = 52};
          expect_op("send", got.send, peer < 0 ? none : sent, ctx);
          expect_op("recv", got.recv, peer < 0 ? none : received, ctx);
          expect_op("all_reduce", got.all_reduce, none, ctx);
          expect_op("barrier", got.barrier, none, ctx);
          expect_op("total", got.total(),
                    peer < 0
                        ? none
                        : OpStats{.calls = 3, .bytes_sent = sent.bytes_sent, .bytes_received = received.bytes_received},
                    ctx);
          const std::string text = got.to_string();
          if (peer >= 0 && (text.find("send: ") == std::string::npos || text.find("recv: ") == std::string::npos)) {
            throw ContractViolation(fmt::format("to_string() leaves out send or recv: {}", text));
          }
          c.barrier();  // nobody leaves (some backends fail the group then) while a peer still receives
        },
});

}  // namespace

TEST_CASE("stats: calls and ring bytes per op, by the formula") { check_contract(kFormula); }
TEST_CASE("stats: point-to-point calls count their bytes as they are") { check_contract(kPointToPoint); }

}  // namespace tandem::testing::contract
