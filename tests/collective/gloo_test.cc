// What the Gloo communicator has beyond the Communicator contract (contract/ checks every
// collective and failure on it, in worker processes): its options, packs (bytes_per_pack), check
// mode (TANDEM_CHECK_COLLECTIVES: every rank compares a descriptor of every call), its meeting,
// and what it says when the store's server (the chief's process) dies.
//
// Threads of this process, each one rank, meeting through an in-memory store (gloo's TCP transport
// works between threads); the store's death needs real processes (this binary re-executed with
// --gloo-worker, meeting through a TCP store served by the test).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/worker_processes.h"
#include "contract/contract.h"
#include "on_ranks.h"
#include "tandem/collective/gloo.h"
#include "tandem/collective/store.h"
#include "tandem/collective/tcp_store.h"

using namespace tandem;
using namespace tandem::collective;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

using testing::error_as;
using testing::Group;
using testing::on_ranks;
using testing::require_no_errors;

constexpr std::string_view kWorkerFlag = "--gloo-worker";

// n gloo ranks on threads of this process, meeting through one in-memory store.
Group make_gloo_group(int n, GlooOptions base = {}, std::shared_ptr<Store> store = make_in_memory_store()) {
  Group group(static_cast<std::size_t>(n));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        GlooOptions options = base;
        options.rank = r;
        options.size = n;
        options.store = store;
        group[static_cast<std::size_t>(r)] = make_gloo_communicator(options);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  require_no_errors(errors);
  return group;
}

// Small integers (exact in any order), and the serial reference: the conformance suite's.
template <class T>
std::vector<T> values(std::int64_t n, int rank, int call) {
  return testing::contract::values<T>(n, rank, call, /*fractional=*/false);
}
template <class T>
std::vector<T> reference(int n, std::int64_t count, ReduceOp op, int call) {
  return testing::contract::reference<T>(n, count, op, call, /*fractional=*/false);
}

}  // namespace

TEST_CASE("bad options, and dtypes gloo cannot reduce") {
  auto store = make_in_memory_store();
  CHECK_THROWS_WITH_AS(make_gloo_communicator({.rank = 2, .size = 2, .store = store}),
                       "make_gloo_communicator: rank 2 is not in [0, 2)", InvalidArgument);
  CHECK_THROWS_WITH_AS(make_gloo_communicator({.rank = 0, .size = 2}), doctest::Contains("rank 0 has no store"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(make_gloo_communicator({.rank = 0, .size = 2, .store = store, .rank_labels = {"chief"}}),
                       doctest::Contains("1 rank labels for a group of 2"), InvalidArgument);

  Group fresh = make_gloo_group(2);
  const auto errors = on_ranks(fresh, [&](Communicator& c) {
    Tensor t = Tensor::zeros({4}, DType::kU8);
    c.all_reduce(t, ReduceOp::kSum);
  });
  CHECK(error_as<InvalidArgument>(errors[0]).find(
            "uint8 tensors cannot be reduced; gloo reduces float32, float64, float16, bfloat16, int32 and int64") !=
        std::string::npos);
}

TEST_CASE("all_reduce of a span is one logical buffer; packs split it") {
  for (std::int64_t bytes_per_pack : {std::int64_t{0}, std::int64_t{40}, std::int64_t{4096}}) {
    CAPTURE(bytes_per_pack);
    Group group = make_gloo_group(3, GlooOptions{.bytes_per_pack = bytes_per_pack});
    // 3 tensors (6 + 5 + 7 = 18 floats) and one big tensor of 1000 (100 packs of 10 at 40 bytes:
    // more packs than the setup cache holds).
    std::vector<std::vector<float>> bucket_results(3), big_results(3);
    for (int step = 0; step < 2; ++step) {  // twice: the second reuses cached setups
      require_no_errors(on_ranks(group, [&](Communicator& c) {
        const auto v = values<float>(18, c.rank(), 1);
        std::vector<Tensor> bucket = {
            Tensor::from_vector<float>({v.begin(), v.begin() + 6}, {2, 3}),
            Tensor::from_vector<float>({v.begin() + 6, v.begin() + 11}, {5}),
            Tensor::from_vector<float>({v.begin() + 11, v.end()}, {7, 1}),
        };
        c.all_reduce(std::span<Tensor>(bucket), ReduceOp::kSum);
        std::vector<float> flat;
        for (const Tensor& t : bucket) {
          const auto part = t.to_vector<float>();
          flat.insert(flat.end(), part.begin(), part.end());
        }
        bucket_results[static_cast<std::size_t>(c.rank())] = flat;
        Tensor big = Tensor::from_vector<float>(values<float>(1000, c.rank(), 2), {1000});
        c.all_reduce(big, ReduceOp::kMax);
        big_results[static_cast<std::size_t>(c.rank())] = big.to_vector<float>();
      }));
      for (int r = 0; r < 3; ++r) {
        CHECK(bucket_results[static_cast<std::size_t>(r)] == reference<float>(3, 18, ReduceOp::kSum, 1));
        CHECK(big_results[static_cast<std::size_t>(r)] == reference<float>(3, 1000, ReduceOp::kMax, 2));
      }
    }
  }
}

TEST_CASE("check mode: a mismatched collective throws InvalidArgument with both sides on every rank") {
  Group group = make_gloo_group(2, GlooOptions{.rank_labels = {"worker 0", "worker 1"}, .check_consistency = true});
  auto errors = on_ranks(group, [&](Communicator& c) {
    std::vector<Tensor> bucket = {Tensor::zeros({1000}, kFloat32), Tensor::zeros({c.rank() == 0 ? 90 : 100}, kFloat32),
                                  Tensor::zeros({200}, kFloat32)};
    c.all_reduce(std::span<Tensor>(bucket), ReduceOp::kSum);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(error_as<InvalidArgument>(errors[static_cast<std::size_t>(r)]) ==
          "collective mismatch at #0: worker 0 issued all_reduce SUM float32 x 1290 (3 tensors) but worker 1 issued "
          "all_reduce SUM float32 x 1300 (3 tensors)");
  }
  // Different operations, different roots, same counts but other shapes.
  errors = on_ranks(group, [&](Communicator& c) {
    Tensor t = Tensor::zeros({4}, kFloat32);
    if (c.rank() == 0) {
      c.broadcast(t, 0);
    } else {
      c.all_reduce(t, ReduceOp::kMax);
    }
  });
  CHECK(
      error_as<InvalidArgument>(errors[1]) ==
      "collective mismatch at #1: worker 0 issued broadcast float32 x 4 from root 0 but worker 1 issued all_reduce MAX "
      "float32 x 4 (1 tensor)");
  errors = on_ranks(group, [&](Communicator& c) {
    Tensor t = c.rank() == 0 ? Tensor::zeros({2, 6}, kFloat32) : Tensor::zeros({3, 4}, kFloat32);
    c.all_reduce(t, ReduceOp::kSum);
  });
  CHECK(error_as<InvalidArgument>(errors[0]).ends_with(
      "but worker 1 issued all_reduce SUM float32 x 12 (1 tensor) with tensors of other shapes"));
  // Agreeing calls still work: a mismatch leaves the group usable.
  require_no_errors(on_ranks(group, [&](Communicator& c) {
    Tensor t = Tensor::from_vector<float>({1, 2}, {2});
    c.all_reduce(t, ReduceOp::kSum);
    CHECK(t.to_vector<float>() == std::vector<float>{2, 4});
    c.barrier();
  }));
}

TEST_CASE("a rank that never connects is named") {
  auto store = make_in_memory_store();
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        make_gloo_communicator({.rank = r, .size = 3, .store = store, .timeout = 300ms});
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(error_as<DeadlineExceeded>(errors[0]) ==
        "make_gloo_communicator on rank 0 of 3: rank 2 of 3 did not arrive at the store in-memory within 300 ms");
}

// --- real processes -----------------------------------------------------------------------------

namespace {

// A worker process: connects to the store, makes its communicator, all-reduces until a call fails
// (the test kills rank 0 and the store's server once every rank has done a few) and writes
// "<error type>\n<message>" to its result file.
int worker_main(int argc, char** argv) {
  if (argc != 7) return 2;
  const int rank = std::atoi(argv[4]);
  const int size = std::atoi(argv[5]);
  std::string type = "none", message;
  try {
    auto store = connect_tcp_store(argv[3], {.connect_timeout = 20s, .rank = rank});
    auto comm = make_gloo_communicator({.rank = rank, .size = size, .store = store, .timeout = 3s});
    Tensor t = Tensor::zeros({1 << 18}, kFloat32);
    for (int i = 0;; ++i) {
      if (i == 3) store->set(fmt::format("ready/{}", rank), {'1'});
      comm->all_reduce(t, ReduceOp::kSum);
    }
  } catch (const Error& e) {
    type = std::string(error_code_name(e.code()));
    message = e.what();
  } catch (const std::exception& e) {
    type = "other";
    message = e.what();
  }
  std::ofstream(argv[6]) << type << "\n" << message << "\n";
  return 0;
}

}  // namespace

TEST_CASE("processes: when the store's server dies with a rank, the others say the store is unreachable") {
  testing::WorkerProcesses workers({.flag = std::string(kWorkerFlag), .scenario = "store", .size = 2});
  workers.store().wait({"ready/0", "ready/1"}, 30s);
  workers.stop_server();  // the chief's process would take its server down with it
  workers.kill(0);
  workers.wait_exit(1, Clock::now() + 20s, 20s);
  std::ifstream in(workers.result_path(1));
  std::string type, message;
  std::getline(in, type);
  std::getline(in, message);
  CAPTURE(message);
  CHECK(type == "Unavailable");
  CHECK(message.find("is unreachable too: the process serving it (tandem-run on the first node, else rank 0) has "
                     "died or stopped, or the network to it is cut") != std::string::npos);
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == kWorkerFlag) return worker_main(argc, argv);
  return doctest::Context(argc, argv).run();
}

TEST_CASE("ranks waiting in different groups of one job: each names where the other was") {
  // A job's control and gradient groups share its store: when rank 0 all-reduces gradients while
  // rank 1 sums metrics in the control group, both time out, and each must say that the other was
  // busy elsewhere rather than blame it for never arriving.
  auto store = make_in_memory_store();
  Group gradient = make_gloo_group(2, GlooOptions{.timeout = 1s, .group_name = "gradient"}, store);
  Group control = make_gloo_group(2, GlooOptions{.timeout = 1s, .group_name = "control"}, store);
  std::vector<std::string> errors(2);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      Communicator& c = r == 0 ? *gradient[0] : *control[1];
      Tensor t = Tensor::zeros({4}, DType::kF32);
      try {
        c.all_reduce(t, ReduceOp::kSum);
      } catch (const DeadlineExceeded& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  // The timeout, plus at most the bounded diagnosis.
  CHECK(std::chrono::steady_clock::now() - start < 1s + kFailureReportGrace + 2s);
  CHECK_MESSAGE(errors[0].starts_with("gloo all_reduce #0 (float32, 4 elements) on rank 0 in the gradient group: timed "
                                      "out after 1"),
                errors[0]);
  CHECK_MESSAGE(errors[0].find("rank 1 never reached it, and failed in another call instead: gloo all_reduce #0 "
                               "(float32, 4 elements) on rank 1 in the control group") != std::string::npos,
                errors[0]);
  CHECK_MESSAGE(errors[1].find("rank 0 never reached it, and failed in another call instead: gloo all_reduce #0 "
                               "(float32, 4 elements) on rank 0 in the gradient group") != std::string::npos,
                errors[1]);
}
