// The contract's point-to-point calls (send, recv, send_recv in collective/communicator.h): a ring
// pass, neighbours exchanging both ways at once (the pipeline's send_forward_recv_backward),
// messages of one pair matched in order, several dtypes, -1 peers for the first and last stages;
// and their failures: bad peers, a message that does not fit the receiver's tensor, a sender that
// never comes, an abort while a rank waits in recv. The hierarchical group, which carries only
// some pairs, has its own section.
#include <thread>

#include "contract.h"

namespace tandem::testing::contract {
namespace {

using collective::CallOptions;

// The data sections need two ranks at least.
std::vector<int> pair_sizes(const Backend& b) {
  std::vector<int> sizes;
  for (const int n : b.traits.sizes) {
    if (n >= 2) sizes.push_back(n);
  }
  return sizes;
}

bool any_pair(const Backend& b) { return b.traits.point_to_point_any_pair; }

// The dtypes of the data sections, one run (param) each: 4-, 8- and 2-byte elements.
constexpr DType kDtypes[] = {kFloat32, kInt64, DType::kBF16};

std::vector<int> dtype_params(const Backend&, int) { return {0, 1, 2}; }

// Calls fn.template operator()<T>() with T the C++ type of the run's dtype.
template <class Fn>
void with_dtype(const RankContext& ctx, Fn&& fn) {
  graph::dispatch<graph::TypeList<float, std::int64_t, graph::bfloat16>>(
      kDtypes[ctx.param()], "point-to-point contract", [&]<class T>() { fn.template operator()<T>(); });
}

// What rank `from` sends in message `call` (fractional values: every bit must arrive).
template <class T>
Tensor message(const RankContext& ctx, std::int64_t n, int from, int call) {
  return ctx.tensor(values<T>(n, from, call, /*fractional=*/true), Shape({n}));
}

template <class T>
void expect_message(const Tensor& got, std::int64_t n, int from, int call, const std::string& what) {
  expect_equal(got.to_vector<T>(), values<T>(n, from, call, /*fractional=*/true), what);
}

// Large enough to go through the shared-memory group's smallest slot in many pieces.
constexpr std::int64_t kRingElements = 10007;

// A token passed around the ring with plain send and recv, in the order that cannot deadlock
// (rank 0 sends first and receives last; every other rank receives, then sends on), then every
// rank passing its own tensor to the next at once with send_recv.
const Section& kRing = add_section({
    .name = "point_to_point/ring",
    .applies = any_pair,
    .sizes = pair_sizes,
    .params = dtype_params,
    .body =
        [](RankContext& ctx) {
          with_dtype(ctx, [&]<class T>() {
            Communicator& c = ctx.comm();
            const int n = ctx.size(), r = ctx.rank();
            const int next = (r + 1) % n, previous = (r + n - 1) % n;
            const std::uint64_t collectives = c.sequence_number();
            Tensor token = Tensor::zeros(Shape({kRingElements}), kDtypes[ctx.param()], ctx.device());
            if (r == 0) {
              c.send(message<T>(ctx, kRingElements, 0, 1), next);
              c.recv(token, previous);
            } else {
              c.recv(token, previous);
              c.send(token, next);
            }
            expect_message<T>(token, kRingElements, 0, 1, fmt::format("the token rank {} received", r));
            Tensor mine = message<T>(ctx, kRingElements, r, 2);
            Tensor theirs = Tensor::zeros(Shape({kRingElements}), kDtypes[ctx.param()], ctx.device());
            c.send_recv(mine, next, theirs, previous);
            expect_message<T>(theirs, kRingElements, previous, 2, fmt::format("what rank {} sent on", previous));
            if (c.sequence_number() != collectives) {
              throw ContractViolation(fmt::format("point-to-point calls moved sequence_number() from {} to {}",
                                                  collectives, c.sequence_number()));
            }
            c.barrier();  // the collectives still meet: no point-to-point call took their place
          });
        },
});

// Neighbours exchanging both ways at once, with tensors too large for any socket or staging
// buffer (a send that waited for its recv would deadlock), pairs (0, 1), (2, 3), ... then
// (1, 2), (3, 4), ..., a rank without a partner passing -1 for both halves; then a pipeline's
// forward pass (send to the next stage, receive from the previous one: -1 at the ends) and its
// backward pass.
constexpr std::int64_t kExchangeElements = std::int64_t{1} << 20;

const Section& kExchange = add_section({
    .name = "point_to_point/exchange",
    .applies = any_pair,
    .sizes = pair_sizes,
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          const int n = ctx.size(), r = ctx.rank();
          int call = 10;
          for (const int offset : {0, 1}) {
            ++call;
            // This phase's partner: pairs start at even ranks, then at odd ones.
            const int partner = (r + offset) % 2 == 0 ? r + 1 : r - 1;
            const int peer = partner >= 0 && partner < n ? partner : -1;
            Tensor out = message<float>(ctx, kExchangeElements, r, call);
            Tensor in = Tensor::zeros(Shape({kExchangeElements}), kFloat32, ctx.device());
            c.send_recv(out, peer, in, peer);
            if (peer >= 0) expect_message<float>(in, kExchangeElements, peer, call, "the exchange");
          }
          const int next = r + 1 < n ? r + 1 : -1, previous = r - 1;
          ++call;
          Tensor activation = message<float>(ctx, 4096, r, call);
          Tensor input = Tensor::zeros(Shape({4096}), kFloat32, ctx.device());
          c.send_recv(activation, next, input, previous);
          if (previous >= 0) expect_message<float>(input, 4096, previous, call, "the forward activation");
          ++call;
          Tensor gradient = message<float>(ctx, 4096, r, call);
          Tensor output_gradient = Tensor::zeros(Shape({4096}), kFloat32, ctx.device());
          c.send_recv(gradient, previous, output_gradient, next);
          if (next >= 0) expect_message<float>(output_gradient, 4096, next, call, "the backward gradient");
          c.barrier();  // nobody leaves (some backends fail the group then) while a peer still receives
        },
});

// Messages of one pair arrive in the order they were sent, whatever their sizes (an empty one
// and a scalar included), and the pairs are independent: rank 0 sends to rank 1 while the last
// rank sends to rank 0.
const Section& kOrder = add_section({
    .name = "point_to_point/order",
    .applies = any_pair,
    .sizes = pair_sizes,
    .params = dtype_params,
    .body =
        [](RankContext& ctx) {
          with_dtype(ctx, [&]<class T>() {
            Communicator& c = ctx.comm();
            const int n = ctx.size(), r = ctx.rank();
            const std::vector<std::int64_t> counts = {5, 1, 0, 3000, 17, 1};
            if (r == 0) {
              for (std::size_t i = 0; i < counts.size(); ++i)
                c.send(message<T>(ctx, counts[i], 0, 20 + static_cast<int>(i)), 1);
            }
            if (r == 1) {
              for (std::size_t i = 0; i < counts.size(); ++i) {
                Tensor got = Tensor::zeros(Shape({counts[i]}), kDtypes[ctx.param()], ctx.device());
                c.recv(got, 0);
                expect_message<T>(got, counts[i], 0, 20 + static_cast<int>(i), fmt::format("message {} of rank 0", i));
              }
            }
            // A second pair: the last rank to rank 0 (for two ranks, the other direction of the first).
            if (r == n - 1) {
              for (int i = 0; i < 3; ++i) c.send(message<T>(ctx, 64, r, 30 + i), 0);
            }
            if (r == 0) {
              for (int i = 0; i < 3; ++i) {
                Tensor got = Tensor::zeros(Shape({8, 8}), kDtypes[ctx.param()], ctx.device());  // any shape
                c.recv(got, n - 1);
                expect_message<T>(got, 64, n - 1, 30 + i, fmt::format("message {} of rank {}", i, n - 1));
              }
            }
            c.barrier();
          });
        },
});

// --- failures --------------------------------------------------------------------------------------

constexpr auto kTimeout = std::chrono::milliseconds(1000);
constexpr auto kSlack = std::chrono::milliseconds(10s);
// "Promptly": far below kLongTimeout, the calls' own timeout.
constexpr auto kPrompt = std::chrono::milliseconds(10s);

std::vector<int> failure_size(const Backend& b) { return {b.traits.failure_size}; }

// Peers that are not another rank of the group: InvalidArgument on the calling rank, before
// anything is sent (the group stays usable: a barrier follows).
const Section& kBadPeer = add_section({
    .name = "point_to_point/bad_peer",
    .applies = any_pair,
    .sizes = failure_size,
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          const int n = ctx.size(), r = ctx.rank();
          Tensor t = ctx.tensor(std::vector<float>(4, 1.0f), {4});
          Tensor u = ctx.tensor(std::vector<float>(4, 0.0f), {4});
          ctx.step("send to self", [&] { c.send(t, r); });
          ctx.step("recv from self", [&] { c.recv(u, r); });
          ctx.step("send out of range", [&] { c.send(t, n); });
          ctx.step("recv from -1", [&] { c.recv(u, -1); });
          ctx.step("send_recv out of range", [&] { c.send_recv(t, -1, u, n + 3); });
          ctx.step("send_recv with itself", [&] { c.send_recv(t, r, u, -1); });
          ctx.step("send_recv with nobody", [&] { c.send_recv(t, -1, u, -1); });
          ctx.step("barrier", [&] { c.barrier({.timeout = kLongTimeout}); });
        },
    .verdict =
        [](const Run& run, const std::vector<Outcome>& outcomes) {
          for (const Outcome& o : outcomes) {
            CAPTURE(o.rank);
            check_step(o.step("send to self"), "InvalidArgument", {"send", "itself"});
            check_step(o.step("recv from self"), "InvalidArgument", {"recv", "itself"});
            check_step(o.step("send out of range"), "InvalidArgument",
                       {"send", fmt::format("{} is not a rank", run.size)});
            check_step(o.step("recv from -1"), "InvalidArgument", {"recv", "-1 is not a rank"});
            check_step(o.step("send_recv out of range"), "InvalidArgument",
                       {"send_recv", fmt::format("{} is not a rank", run.size + 3)});
            check_step(o.step("send_recv with itself"), "InvalidArgument", {"send_recv", "itself"});
            check_step(o.step("send_recv with nobody"), "none");
            check_step(o.step("barrier"), "none");
          }
        },
});

// A message that does not fit the receiver's tensor (dtype, then element count): the receiver
// throws InvalidArgument naming both ranks, dtypes and counts; the message is dropped and the
// pair goes on (the next message arrives whole). Not for backends that cannot tell (NCCL).
const Section& kMismatch = add_section({
    .name = "point_to_point/mismatch",
    .applies = [](const Backend& b) { return any_pair(b) && b.traits.mismatch != MismatchReport::kUnchecked; },
    .sizes = [](const Backend&) { return std::vector<int>{2}; },
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          const CallOptions options{.timeout = kLongTimeout};
          if (ctx.rank() == 0) {
            c.send(message<float>(ctx, 8, 0, 40), 1, options);
            c.send(message<float>(ctx, 8, 0, 41), 1, options);
            c.send(message<float>(ctx, 8, 0, 42), 1, options);
            ctx.step("barrier", [&] { c.barrier(options); });
            return;
          }
          Tensor ints = Tensor::zeros(Shape({8}), kInt64, ctx.device());
          ctx.step("dtype", [&] { c.recv(ints, 0, options); });
          Tensor short_one = Tensor::zeros(Shape({6}), kFloat32, ctx.device());
          ctx.step("count", [&] { c.recv(short_one, 0, options); });
          ctx.step("next", [&] {
            Tensor fits = Tensor::zeros(Shape({2, 4}), kFloat32, ctx.device());
            c.recv(fits, 0, options);
            expect_message<float>(fits, 8, 0, 42, "the message after two dropped ones");
          });
          ctx.step("barrier", [&] { c.barrier(options); });
        },
    .verdict =
        [](const Run&, const std::vector<Outcome>& outcomes) {
          for (const Outcome& o : outcomes) {
            CAPTURE(o.rank);
            check_step(o.step("body"), "none");
            check_step(o.step("barrier"), "none");
            if (o.rank != 1) continue;
            check_step(o.step("dtype"), "InvalidArgument", {"recv", "rank 0", "rank 1", "float32", "int64", "8"});
            check_step(o.step("count"), "InvalidArgument", {"recv", "rank 0", "rank 1", "8", "6"});
            check_step(o.step("next"), "none");
          }
        },
});

// A recv whose sender never comes: DeadlineExceeded at its timeout (not before), naming the op,
// the peer and the pair's message number (#1: one message of the pair came before).
const Section& kNoSender = add_section({
    .name = "point_to_point/no_sender",
    .applies = any_pair,
    .sizes = failure_size,
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          const int last = ctx.size() - 1;
          if (ctx.rank() == 0) {
            c.send(message<float>(ctx, 16, 0, 50), last, {.timeout = kLongTimeout});
            ctx.hold();  // the second message never comes
          } else if (ctx.rank() == last) {
            Tensor t = Tensor::zeros(Shape({16}), kFloat32, ctx.device());
            c.recv(t, 0, {.timeout = kLongTimeout});
            ctx.step("recv", [&] { c.recv(t, 0, {.timeout = kTimeout}); });
          } else {
            ctx.hold();  // in the group until the others are done
          }
        },
    .verdict =
        [](const Run& run, const std::vector<Outcome>& outcomes) {
          for (const Outcome& o : outcomes) {
            CAPTURE(o.rank);
            check_step(o.step("body"), "none");
            if (o.rank != run.size - 1) continue;
            const Step& step = o.step("recv");
            check_step(step, "DeadlineExceeded", {"recv #1", "rank 0"});
            CHECK(step.ms >= (kTimeout - 50ms).count());
            CHECK(step.ms < (kTimeout + kSlack).count());
          }
        },
});

// abort() while a rank waits in recv: param 0: the sender aborts the group; param 1: the
// receiver's second thread does. The recv throws Unavailable promptly, and so do later calls.
constexpr std::string_view kReason = "contract: stage 0 lost its device";

const Section& kAbort = add_section({
    .name = "point_to_point/abort",
    .applies = [](const Backend& b) { return any_pair(b) && b.traits.abort_reaches_waiting_ranks; },
    .sizes = [](const Backend&) { return std::vector<int>{2}; },
    .params =
        [](const Backend&, int) {
          return std::vector<int>{0, 1};
        },
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          ctx.step("warm-up", [&] { c.barrier(); });
          const auto abort_soon = [&] {
            std::this_thread::sleep_for(200ms);
            c.abort(std::string(kReason));
          };
          Tensor t = Tensor::zeros(Shape({1024}), kFloat32, ctx.device());
          if (ctx.rank() == 0 && ctx.param() == 0) {
            abort_soon();
          } else if (ctx.rank() == 0) {
            ctx.hold();  // never sends
          } else if (ctx.param() == 0) {
            ctx.step("pending", [&] { c.recv(t, 0, {.timeout = kLongTimeout}); });
          } else {
            std::thread aborter(abort_soon);
            ctx.step("pending", [&] { c.recv(t, 0, {.timeout = kLongTimeout}); });
            aborter.join();
          }
          if (ctx.rank() == 1) ctx.step("later", [&] { c.send(t, 0, {.timeout = kLongTimeout}); });
        },
    .verdict =
        [](const Run& run, const std::vector<Outcome>& outcomes) {
          for (const Outcome& o : outcomes) {
            CAPTURE(o.rank);
            check_step(o.step("warm-up"), "none");
            if (o.rank != 1) continue;
            for (const std::string name : {"pending", "later"}) {
              const Step& step = o.step(name);
              // The aborting rank's own calls always carry the reason; a peer's where the backend
              // learns it (every backend here but NCCL).
              if (run.param == 1 || run.backend.traits.backend != "nccl") {
                check_step(step, "Unavailable", {std::string(kReason)});
              } else {
                check_step(step, "Unavailable");
              }
              CHECK(step.ms < kPrompt.count());
            }
          }
        },
});

// A process killed while its neighbours pass tensors around the ring with send_recv (too large for
// any buffer: each waits for its peer): the ranks that send to it and receive from it name it
// ("lost rank 2 of 3: its process died"), long before the calls' timeout. The victim: the last
// rank, then rank 0.
constexpr auto kKilledPrompt = std::chrono::milliseconds(15s);

const Section& kKilled = add_section({
    .name = "point_to_point/killed_process",
    .applies = [](const Backend& b) { return b.processes() && any_pair(b); },
    .sizes = failure_size,
    .params =
        [](const Backend&, int size) {
          return std::vector<int>{size - 1, 0};
        },
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          const int n = ctx.size(), r = ctx.rank();
          ctx.step("warm-up", [&] { c.barrier(); });
          Tensor out = message<float>(ctx, 1 << 16, r, 70);
          Tensor in = Tensor::zeros(Shape({1 << 16}), kFloat32, ctx.device());
          const auto pass = [&] { c.send_recv(out, (r + 1) % n, in, (r + n - 1) % n, {.timeout = kLongTimeout}); };
          // Passes until one fails: that one is recorded as "call".
          for (int i = 0;; ++i) {
            if (i == 3) ctx.ready();  // the driver kills the victim once every rank is here
            if (!ctx.step("call", pass, /*record_success=*/false)) break;
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
            CHECK(call.ms < kKilledPrompt.count());
          }
        },
    .drive =
        [](const Run& run, Workers& workers) {
          std::vector<std::string> ready;
          for (int r = 0; r < run.size; ++r) ready.push_back(fmt::format("contract/ready/{}", r));
          workers.store().wait(ready, std::chrono::duration_cast<std::chrono::milliseconds>(kRunLimit));
          std::this_thread::sleep_for(100ms);  // every rank is inside a send_recv, or about to be
          workers.kill(run.param);
        },
});

// --- the hierarchical group --------------------------------------------------------------------------

// Two workers of two replicas (ranks 0, 1 on worker 0; 2, 3 on worker 1): replicas of one worker
// talk through the local group, the workers' replicas 0 through the cross-worker communicator,
// and any other pair is Unimplemented on both sides, before anything is sent.
const Section& kHierarchical = add_section({
    .name = "point_to_point/hierarchical",
    .applies = [](const Backend& b) { return !any_pair(b); },
    .sizes = [](const Backend&) { return std::vector<int>{4}; },
    .body =
        [](RankContext& ctx) {
          Communicator& c = ctx.comm();
          const int r = ctx.rank();
          // Within a worker: 0 <-> 1, 2 <-> 3, both ways at once.
          const int local_peer = r ^ 1;
          Tensor in = Tensor::zeros(Shape({300}), kFloat32, ctx.device());
          c.send_recv(message<float>(ctx, 300, r, 60), local_peer, in, local_peer);
          expect_message<float>(in, 300, local_peer, 60, "the local exchange");
          // Across workers, replicas 0: 0 -> 2, then 2 -> 0.
          if (r == 0) {
            c.send(message<float>(ctx, 300, 0, 61), 2);
            c.recv(in, 2);
            expect_message<float>(in, 300, 2, 62, "rank 2's reply");
          } else if (r == 2) {
            c.recv(in, 0);
            expect_message<float>(in, 300, 0, 61, "rank 0's message");
            c.send(message<float>(ctx, 300, 2, 62), 0);
          } else {
            // (Both sides throw at once, before anything is sent.)
            // Across workers, not replicas 0: 1 -> 3.
            ctx.step("unsupported", [&] {
              if (r == 1) c.send(in, 3);
              if (r == 3) c.recv(in, 1);
            });
          }
        },
    .verdict =
        [](const Run&, const std::vector<Outcome>& outcomes) {
          for (const Outcome& o : outcomes) {
            CAPTURE(o.rank);
            check_step(o.step("body"), "none");
            if (o.rank == 1) check_step(o.step("unsupported"), "Unimplemented", {"hierarchical", "send", "rank 3"});
            if (o.rank == 3) check_step(o.step("unsupported"), "Unimplemented", {"hierarchical", "recv", "rank 1"});
          }
        },
});

}  // namespace

TEST_CASE("point_to_point: a ring pass, with send and recv and with send_recv, in several dtypes") {
  check_contract(kRing);
}
TEST_CASE("point_to_point: neighbours exchange both ways at once; -1 peers at the pipeline's ends") {
  check_contract(kExchange);
}
TEST_CASE("point_to_point: the messages of one pair match in order") { check_contract(kOrder); }
TEST_CASE("point_to_point: a peer that is this rank or outside the group is InvalidArgument") {
  check_contract(kBadPeer);
}
TEST_CASE("point_to_point: a message that does not fit the receiver's tensor is InvalidArgument; the pair goes on") {
  check_contract(kMismatch);
}
TEST_CASE("point_to_point: a recv whose sender never comes is DeadlineExceeded naming recv, the peer and the number") {
  check_contract(kNoSender);
}
TEST_CASE("point_to_point: abort ends a pending recv promptly, and later calls") { check_contract(kAbort); }
TEST_CASE("point_to_point: a killed process is named by its neighbours, promptly") { check_contract(kKilled); }
TEST_CASE("point_to_point: the hierarchical group carries pairs within a worker and between replicas 0") {
  check_contract(kHierarchical);
}

}  // namespace tandem::testing::contract
