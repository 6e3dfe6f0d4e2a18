// The Gloo communicator and the hierarchical group.
//
// Threads of this process, each one rank, meeting through an in-memory store (gloo's TCP transport
// works between threads): every collective and dtype against a serial reference for 1 to 4 ranks,
// multi-tensor spans, packs, argument errors, check mode, a rank that never arrives, abort, and the
// hierarchical group (2 workers x 2 replicas) against a flat reduction.
//
// Real processes (this binary re-executed with --gloo-worker, meeting through a TCP store served by
// the test): a rank killed with SIGKILL mid-collective, a rank that hangs, a mismatched collective
// in check mode, and the store's server dying.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/worker_processes.h"
#include "on_ranks.h"
#include "tandem/collective/communicator.h"
#include "tandem/collective/gloo.h"
#include "tandem/collective/hierarchical.h"
#include "tandem/collective/in_process.h"
#include "tandem/collective/store.h"
#include "tandem/collective/tcp_store.h"

extern char** environ;

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

// Small integers: every sum is exact in every dtype, so any reduction order gives the reference.
template <class T>
std::vector<T> values(std::int64_t n, int rank) {
  std::mt19937 rng(static_cast<unsigned>(1234 + rank));
  std::uniform_int_distribution<int> u(-100, 100);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<T>(u(rng));
  return v;
}

template <class T>
std::vector<T> reference(int n, std::int64_t count, ReduceOp op) {
  std::vector<T> out = values<T>(count, 0);
  for (int q = 1; q < n; ++q) {
    const auto v = values<T>(count, q);
    for (std::size_t i = 0; i < out.size(); ++i) {
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kMean: out[i] = static_cast<T>(out[i] + v[i]); break;
        case ReduceOp::kMax: out[i] = std::max(out[i], v[i]); break;
        case ReduceOp::kMin: out[i] = std::min(out[i], v[i]); break;
      }
    }
  }
  if (op == ReduceOp::kMean) {
    for (auto& x : out) x = static_cast<T>(x / static_cast<T>(n));
  }
  return out;
}

template <class T>
void check_all_reduce(Group& group, std::int64_t count) {
  const int n = static_cast<int>(group.size());
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin}) {
    CAPTURE(reduce_op_name(op));
    const auto expected = reference<T>(n, count, op);
    std::vector<std::vector<T>> results(static_cast<std::size_t>(n));
    require_no_errors(on_ranks(group, [&](Communicator& c) {
      Tensor t = Tensor::from_vector<T>(values<T>(count, c.rank()), {count});
      c.all_reduce(t, op);
      results[static_cast<std::size_t>(c.rank())] = t.to_vector<T>();
    }));
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(results[static_cast<std::size_t>(r)] == expected);
    }
  }
}

}  // namespace

TEST_CASE("all_reduce: every reduction and dtype, 2 to 4 ranks, against a serial reference") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    Group group = make_gloo_group(n);
    CHECK(group[0]->backend() == "gloo");
    CHECK(group[1]->rank() == 1);
    CHECK(group[1]->size() == n);
    check_all_reduce<float>(group, 1031);
    check_all_reduce<double>(group, 517);
    check_all_reduce<std::int32_t>(group, 64);
    check_all_reduce<std::int64_t>(group, 3);
    CHECK(group[0]->sequence_number() == 16);
  }
}

TEST_CASE("a group of one: every collective is local") {
  Group group = make_gloo_group(1);
  Communicator& c = *group[0];
  Tensor t = Tensor::from_vector<float>({1, 2, 3}, {3});
  c.all_reduce(t, ReduceOp::kMean);
  CHECK(t.to_vector<float>() == std::vector<float>{1, 2, 3});
  c.broadcast(t, 0);
  Tensor gathered = Tensor::zeros({3}, kFloat32);
  c.all_gather(t, gathered);
  CHECK(gathered.to_vector<float>() == std::vector<float>{1, 2, 3});
  Tensor part = Tensor::zeros({3}, kFloat32);
  c.reduce_scatter(t, part, ReduceOp::kSum);
  CHECK(part.to_vector<float>() == std::vector<float>{1, 2, 3});
  c.barrier();
  CHECK(c.sequence_number() == 5);
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
        const auto v = values<float>(18, c.rank());
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
        Tensor big = Tensor::from_vector<float>(values<float>(1000, c.rank()), {1000});
        c.all_reduce(big, ReduceOp::kMax);
        big_results[static_cast<std::size_t>(c.rank())] = big.to_vector<float>();
      }));
      for (int r = 0; r < 3; ++r) {
        CHECK(bucket_results[static_cast<std::size_t>(r)] == reference<float>(3, 18, ReduceOp::kSum));
        CHECK(big_results[static_cast<std::size_t>(r)] == reference<float>(3, 1000, ReduceOp::kMax));
      }
    }
  }
}

TEST_CASE("broadcast from each root, all_gather, reduce_scatter, barrier") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    Group group = make_gloo_group(n);
    for (int root = 0; root < n; ++root) {
      CAPTURE(root);
      std::vector<std::vector<std::uint8_t>> bytes(static_cast<std::size_t>(n));
      std::vector<std::vector<double>> doubles(static_cast<std::size_t>(n));
      require_no_errors(on_ranks(group, [&](Communicator& c) {
        Tensor b = Tensor::from_vector<std::uint8_t>(values<std::uint8_t>(33, c.rank()), {33});
        c.broadcast(b, root);
        bytes[static_cast<std::size_t>(c.rank())] = b.to_vector<std::uint8_t>();
        Tensor d = Tensor::from_vector<double>(values<double>(100, c.rank()), {10, 10});
        c.broadcast(d, root);
        doubles[static_cast<std::size_t>(c.rank())] = d.to_vector<double>();
      }));
      for (int r = 0; r < n; ++r) {
        CHECK(bytes[static_cast<std::size_t>(r)] == values<std::uint8_t>(33, root));
        CHECK(doubles[static_cast<std::size_t>(r)] == values<double>(100, root));
      }
    }

    std::vector<std::vector<std::int32_t>> gathered(static_cast<std::size_t>(n));
    std::vector<std::vector<float>> scattered(static_cast<std::size_t>(n)), means(static_cast<std::size_t>(n));
    std::vector<std::vector<std::int64_t>> scalars(static_cast<std::size_t>(n));
    require_no_errors(on_ranks(group, [&](Communicator& c) {
      Tensor in = Tensor::from_vector<std::int32_t>(values<std::int32_t>(4, c.rank()), {2, 2});
      Tensor out = Tensor::zeros({2 * n, 2}, kInt32);
      c.all_gather(in, out);
      gathered[static_cast<std::size_t>(c.rank())] = out.to_vector<std::int32_t>();
      Tensor scalar = Tensor::scalar<std::int64_t>(10 * c.rank());
      Tensor all = Tensor::zeros({n}, kInt64);
      c.all_gather(scalar, all);
      scalars[static_cast<std::size_t>(c.rank())] = all.to_vector<std::int64_t>();

      Tensor input = Tensor::from_vector<float>(values<float>(n * 6, c.rank()), {2 * n, 3});
      Tensor part = Tensor::zeros({2, 3}, kFloat32);
      c.reduce_scatter(input, part, ReduceOp::kSum);
      scattered[static_cast<std::size_t>(c.rank())] = part.to_vector<float>();
      c.reduce_scatter(input, part, ReduceOp::kMean);
      means[static_cast<std::size_t>(c.rank())] = part.to_vector<float>();
      // The input is left as it was.
      CHECK(input.to_vector<float>() == values<float>(n * 6, c.rank()));
      c.barrier();
    }));
    std::vector<std::int32_t> expected_gather;
    std::vector<std::int64_t> expected_scalars;
    for (int q = 0; q < n; ++q) {
      const auto v = values<std::int32_t>(4, q);
      expected_gather.insert(expected_gather.end(), v.begin(), v.end());
      expected_scalars.push_back(10 * q);
    }
    const auto sum = reference<float>(n, n * 6, ReduceOp::kSum);
    const auto mean = reference<float>(n, n * 6, ReduceOp::kMean);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(gathered[static_cast<std::size_t>(r)] == expected_gather);
      CHECK(scalars[static_cast<std::size_t>(r)] == expected_scalars);
      CHECK(scattered[static_cast<std::size_t>(r)] == std::vector<float>(sum.begin() + 6 * r, sum.begin() + 6 * r + 6));
      CHECK(means[static_cast<std::size_t>(r)] == std::vector<float>(mean.begin() + 6 * r, mean.begin() + 6 * r + 6));
    }
  }
}

TEST_CASE("barrier waits for the last rank") {
  Group group = make_gloo_group(3);
  std::atomic<bool> late_rank_arrived{false};
  std::vector<bool> waited(3, false);
  require_no_errors(on_ranks(group, [&](Communicator& c) {
    if (c.rank() == 2) {
      std::this_thread::sleep_for(200ms);
      late_rank_arrived = true;
    }
    c.barrier();
    waited[static_cast<std::size_t>(c.rank())] = late_rank_arrived.load();
  }));
  CHECK(waited == std::vector<bool>{true, true, true});
}

TEST_CASE("bad options and bad arguments") {
  auto store = make_in_memory_store();
  CHECK_THROWS_WITH_AS(make_gloo_communicator({.rank = 2, .size = 2, .store = store}), "make_gloo_communicator: rank 2 is not in [0, 2)",
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(make_gloo_communicator({.rank = 0, .size = 2}),
                       doctest::Contains("rank 0 has no store"), InvalidArgument);
  CHECK_THROWS_WITH_AS(make_gloo_communicator({.rank = 0, .size = 2, .store = store, .rank_labels = {"chief"}}),
                       doctest::Contains("1 rank labels for a group of 2"), InvalidArgument);

  // A rank whose own arguments are wrong throws InvalidArgument; its peers, already waiting in the
  // collective, fail at once (not at their timeout) with Unavailable naming it and the reason.
  Group group = make_gloo_group(3, GlooOptions{.timeout = 20s, .rank_labels = {"chief", "worker 1", "worker 2"}});
  const auto start = Clock::now();
  auto errors = on_ranks(group, [&](Communicator& c) {
    std::vector<Tensor> bucket = {Tensor::zeros({4}, kFloat32), Tensor::zeros({4}, c.rank() == 1 ? kInt32 : kFloat32)};
    c.all_reduce(std::span<Tensor>(bucket), ReduceOp::kSum);
  });
  CHECK(Clock::now() - start < 10s);
  CHECK(error_as<InvalidArgument>(errors[1]) ==
        "gloo all_reduce #0 (float32, 8 elements) on worker 1: tensor 1 of 2 has dtype int32, tensor 0 has float32; one "
        "all_reduce reduces one dtype");
  for (int r : {0, 2}) {
    CAPTURE(r);
    const std::string message = error_as<Unavailable>(errors[static_cast<std::size_t>(r)]);
    CHECK(message.find("worker 1 aborted the group: gloo all_reduce #0 (float32, 8 elements) on worker 1 had invalid "
                       "arguments: tensor 1 of 2 has dtype int32") != std::string::npos);
  }
  // The group is unusable afterwards, and says why.
  errors = on_ranks(group, [&](Communicator& c) { c.barrier(); });
  CHECK(error_as<Unavailable>(errors[1]).find("gloo barrier #1 on worker 1: the group was aborted by worker 1") == 0);

  Group fresh = make_gloo_group(2);
  errors = on_ranks(fresh, [&](Communicator& c) {
    Tensor t = Tensor::zeros({4}, DType::kU8);
    c.all_reduce(t, ReduceOp::kSum);
  });
  CHECK(error_as<InvalidArgument>(errors[0]).find("uint8 tensors cannot be reduced; gloo reduces float32, float64, float16, bfloat16, int32 and int64") !=
        std::string::npos);
  Group other = make_gloo_group(2);
  errors = on_ranks(other, [&](Communicator& c) {
    Tensor in = Tensor::zeros({3}, kFloat32);
    Tensor out = Tensor::zeros({5}, kFloat32);
    c.all_gather(in, out);
  });
  CHECK(error_as<InvalidArgument>(errors[0]) ==
        "gloo all_gather #0 (float32, 3 elements) on rank 0: output has shape (5,); gathering 2 inputs of shape (3,) "
        "needs (6,)");
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
  CHECK(error_as<InvalidArgument>(errors[1]) ==
        "collective mismatch at #1: worker 0 issued broadcast float32 x 4 from root 0 but worker 1 issued all_reduce MAX "
        "float32 x 4 (1 tensor)");
  errors = on_ranks(group, [&](Communicator& c) {
    Tensor t = c.rank() == 0 ? Tensor::zeros({2, 6}, kFloat32) : Tensor::zeros({3, 4}, kFloat32);
    c.all_reduce(t, ReduceOp::kSum);
  });
  CHECK(error_as<InvalidArgument>(errors[0]).ends_with("but worker 1 issued all_reduce SUM float32 x 12 (1 tensor) with tensors of other shapes"));
  // Agreeing calls still work: a mismatch leaves the group usable.
  require_no_errors(on_ranks(group, [&](Communicator& c) {
    Tensor t = Tensor::from_vector<float>({1, 2}, {2});
    c.all_reduce(t, ReduceOp::kSum);
    CHECK(t.to_vector<float>() == std::vector<float>{2, 4});
    c.barrier();
  }));
}

TEST_CASE("without check mode, mismatched collectives time out cleanly (gloo would abort the process)") {
  Group group = make_gloo_group(2, GlooOptions{.timeout = 500ms, .check_consistency = false});
  auto errors = on_ranks(group, [&](Communicator& c) {
    Tensor t = Tensor::zeros({c.rank() == 0 ? 1000 : 1200}, kFloat32);
    c.all_reduce(t, ReduceOp::kSum);
  });
  CHECK(error_as<DeadlineExceeded>(errors[0]) ==
        "gloo all_reduce #0 (float32, 1000 elements) on rank 0: timed out after 500 ms, though every rank reached it (a "
        "stalled network, or ranks issuing different collectives: TANDEM_CHECK_COLLECTIVES=1 checks)");
  CHECK(error_as<DeadlineExceeded>(errors[1]).starts_with("gloo all_reduce #0 (float32, 1200 elements) on rank 1: timed out"));
}

TEST_CASE("a rank that never connects, and one that never reaches a collective, are named") {
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

  Group group = make_gloo_group(3, GlooOptions{.timeout = 1s});
  const auto start = Clock::now();
  auto result = on_ranks(group, [&](Communicator& c) {
    Tensor t = Tensor::zeros({100000}, kFloat32);
    c.all_reduce(t, ReduceOp::kSum);
    if (c.rank() == 2) return;  // rank 2 skips the second all_reduce: it "hangs"
    c.all_reduce(t, ReduceOp::kSum);
  });
  CHECK(Clock::now() - start < 5s);
  for (int r : {0, 1}) {
    CAPTURE(r);
    CHECK(error_as<DeadlineExceeded>(result[static_cast<std::size_t>(r)]) ==
          fmt::format("gloo all_reduce #1 (float32, 100000 elements) on rank {}: timed out after 1 s waiting for rank 2 "
                      "of 3, which never reached it",
                      r));
  }
}

TEST_CASE("abort ends the pending calls of every rank promptly") {
  Group group = make_gloo_group(3, GlooOptions{.timeout = 30s});
  const auto start = Clock::now();
  std::thread aborter([&] {
    std::this_thread::sleep_for(300ms);
    group[0]->abort("replica 3 failed: boom");
  });
  auto errors = on_ranks(group, [&](Communicator& c) {
    if (c.rank() == 2) return;  // never arrives: ranks 0 and 1 wait in the all_reduce
    Tensor t = Tensor::zeros({1000}, kFloat32);
    c.all_reduce(t, ReduceOp::kSum);
  });
  aborter.join();
  CHECK(Clock::now() - start < 10s);
  CHECK(error_as<Unavailable>(errors[0]) ==
        "gloo all_reduce #0 (float32, 1000 elements) on rank 0: the group was aborted: replica 3 failed: boom");
  CHECK(error_as<Unavailable>(errors[1]) ==
        "gloo all_reduce #0 (float32, 1000 elements) on rank 1: rank 0 aborted the group: replica 3 failed: boom");
  CHECK_THROWS_WITH_AS(group[0]->barrier(),
                       "gloo barrier #1 on rank 0: the group was aborted by rank 0: replica 3 failed: boom", Unavailable);
}

// --- the hierarchical group ---------------------------------------------------------------------

namespace {

// workers x replicas hierarchical ranks, one thread each; returns them in global rank order.
Group make_hierarchical(int workers, const std::vector<int>& replicas_per_worker,
                        std::vector<std::exception_ptr>* creation_errors = nullptr) {
  auto store = make_in_memory_store();
  std::vector<Group> per_worker(static_cast<std::size_t>(workers));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(workers));
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        auto cross = make_gloo_communicator({.rank = w, .size = workers, .store = store, .timeout = 20s});
        per_worker[static_cast<std::size_t>(w)] =
            make_hierarchical_group(make_in_process_group(replicas_per_worker[static_cast<std::size_t>(w)]), std::move(cross));
      } catch (...) {
        errors[static_cast<std::size_t>(w)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (creation_errors != nullptr) {
    *creation_errors = errors;
    return {};
  }
  require_no_errors(errors);
  Group all;
  for (auto& g : per_worker) {
    for (auto& c : g) all.push_back(std::move(c));
  }
  return all;
}

}  // namespace

TEST_CASE("hierarchical group (2 workers x 2 replicas) equals a flat reduction") {
  Group group = make_hierarchical(2, {2, 2});
  REQUIRE(group.size() == 4);
  for (int r = 0; r < 4; ++r) {
    CHECK(group[static_cast<std::size_t>(r)]->rank() == r);
    CHECK(group[static_cast<std::size_t>(r)]->size() == 4);
    CHECK(group[static_cast<std::size_t>(r)]->backend() == "hierarchical");
  }
  check_all_reduce<float>(group, 1031);
  check_all_reduce<std::int64_t>(group, 10);

  std::vector<std::vector<double>> broadcasts(4), gathered(4), scattered(4), bucket_sums(4);
  require_no_errors(on_ranks(group, [&](Communicator& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    Tensor b = Tensor::from_vector<double>(values<double>(7, c.rank()), {7});
    c.broadcast(b, 3);  // root on worker 1, replica 1
    broadcasts[r] = b.to_vector<double>();
    Tensor in = Tensor::from_vector<double>(values<double>(3, c.rank()), {3});
    Tensor out = Tensor::zeros({12}, kFloat64);
    c.all_gather(in, out);
    gathered[r] = out.to_vector<double>();
    Tensor input = Tensor::from_vector<double>(values<double>(8, c.rank()), {8});
    Tensor part = Tensor::zeros({2}, kFloat64);
    c.reduce_scatter(input, part, ReduceOp::kMean);
    scattered[r] = part.to_vector<double>();
    const auto v = values<double>(5, c.rank());
    std::vector<Tensor> bucket = {Tensor::from_vector<double>({v.begin(), v.begin() + 2}, {2}),
                                  Tensor::from_vector<double>({v.begin() + 2, v.end()}, {3})};
    c.all_reduce(std::span<Tensor>(bucket), ReduceOp::kSum);
    bucket_sums[r] = bucket[0].to_vector<double>();
    const auto rest = bucket[1].to_vector<double>();
    bucket_sums[r].insert(bucket_sums[r].end(), rest.begin(), rest.end());
    c.barrier();
  }));
  std::vector<double> expected_gather;
  for (int q = 0; q < 4; ++q) {
    const auto v = values<double>(3, q);
    expected_gather.insert(expected_gather.end(), v.begin(), v.end());
  }
  const auto mean = reference<double>(4, 8, ReduceOp::kMean);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(broadcasts[static_cast<std::size_t>(r)] == values<double>(7, 3));
    CHECK(gathered[static_cast<std::size_t>(r)] == expected_gather);
    CHECK(scattered[static_cast<std::size_t>(r)] == std::vector<double>(mean.begin() + 2 * r, mean.begin() + 2 * r + 2));
    CHECK(bucket_sums[static_cast<std::size_t>(r)] == reference<double>(4, 5, ReduceOp::kSum));
  }
}

TEST_CASE("hierarchical group: mismatched replica counts, and failures reach every replica") {
  std::vector<std::exception_ptr> errors;
  make_hierarchical(2, {2, 3}, &errors);
  for (int w = 0; w < 2; ++w) {
    CHECK(error_as<InvalidArgument>(errors[static_cast<std::size_t>(w)]) ==
          "make_hierarchical_group: worker 0 has 2 local replicas but worker 1 has 3; every worker needs the same "
          "number");
  }

  // Replica 1 of worker 1 aborts while everyone else waits in an all_reduce: every replica of both
  // workers fails promptly with the reason.
  Group group = make_hierarchical(2, {2, 2});
  const auto start = Clock::now();
  auto result = on_ranks(group, [&](Communicator& c) {
    if (c.rank() == 3) {
      std::this_thread::sleep_for(300ms);
      c.abort("replica 3 failed: boom");
      return;
    }
    Tensor t = Tensor::zeros({1000}, kFloat32);
    c.all_reduce(t, ReduceOp::kSum);
  });
  CHECK(Clock::now() - start < 10s);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(error_as<Unavailable>(result[static_cast<std::size_t>(r)]).find("replica 3 failed: boom") != std::string::npos);
  }
}

// --- real processes -----------------------------------------------------------------------------

namespace {

// A worker process: connects to the store, makes its communicator, runs the scenario and writes
// "<error type>\n<message>\n<milliseconds the failing call took>" to its result file.
int worker_main(int argc, char** argv) {
  if (argc != 7) return 2;
  const std::string scenario = argv[2];
  const std::string address = argv[3];
  const int rank = std::atoi(argv[4]);
  const int size = std::atoi(argv[5]);
  const std::string result_path = argv[6];
  std::string type = "none", message;
  long long call_ms = 0;
  try {
    auto store = connect_tcp_store(address, {.connect_timeout = 20s, .rank = rank});
    GlooOptions options{.rank = rank, .size = size, .store = store, .timeout = 3s};
    if (scenario == "hang") options.timeout = 1s;
    if (scenario == "mismatch") {
      options.rank_labels = {"worker 0", "worker 1"};
      options.check_consistency = true;
    }
    auto comm = make_gloo_communicator(options);
    Tensor t = Tensor::zeros({1 << 18}, kFloat32);
    // all_reduce(t); if it throws, call_ms is how long it took to fail.
    const auto timed_all_reduce = [&] {
      const auto start = Clock::now();
      try {
        comm->all_reduce(t, ReduceOp::kSum);
      } catch (...) {
        call_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
        throw;
      }
    };
    if (scenario == "kill" || scenario == "store") {
      // Reduce until something fails; the test kills a rank once every rank has done a few.
      for (int i = 0;; ++i) {
        if (i == 3) store->set(fmt::format("ready/{}", rank), {'1'});
        timed_all_reduce();
      }
    } else if (scenario == "hang") {
      comm->all_reduce(t, ReduceOp::kSum);
      if (rank == 2) std::this_thread::sleep_for(60s);  // the test kills it
      timed_all_reduce();
    } else if (scenario == "mismatch") {
      std::vector<Tensor> bucket = {Tensor::zeros({1000}, kFloat32), Tensor::zeros({rank == 0 ? 90 : 100}, kFloat32),
                                    Tensor::zeros({200}, kFloat32)};
      comm->all_reduce(std::span<Tensor>(bucket), ReduceOp::kSum);
    }
  } catch (const DeadlineExceeded& e) {
    type = "DeadlineExceeded";
    message = e.what();
  } catch (const Unavailable& e) {
    type = "Unavailable";
    message = e.what();
  } catch (const InvalidArgument& e) {
    type = "InvalidArgument";
    message = e.what();
  } catch (const std::exception& e) {
    type = "other";
    message = e.what();
  }
  std::ofstream(result_path) << type << "\n" << message << "\n" << call_ms << "\n";
  return 0;
}

struct Outcome {
  std::string type;
  std::string message;
  long long call_ms = 0;
};

// `size` worker processes of `scenario` (testing::WorkerProcesses) and their outcomes: three
// lines per result file (type, message, milliseconds the call took).
class Job {
 public:
  Job(std::string scenario, int size)
      : workers_({.flag = std::string(kWorkerFlag), .scenario = std::move(scenario), .size = size}) {}

  Store& store() { return workers_.store(); }
  void kill(int rank) { workers_.kill(rank); }
  void stop_server() { workers_.stop_server(); }

  // Waits (up to `limit`) for the ranks' processes to exit and reads their outcomes.
  std::vector<Outcome> wait(const std::vector<int>& ranks, std::chrono::seconds limit) {
    const auto deadline = Clock::now() + limit;
    std::vector<Outcome> outcomes;
    for (int r : ranks) {
      workers_.wait_exit(r, deadline, limit);
      std::ifstream in(workers_.result_path(r));
      Outcome o;
      std::getline(in, o.type);
      std::getline(in, o.message);
      in >> o.call_ms;
      outcomes.push_back(o);
    }
    return outcomes;
  }

 private:
  testing::WorkerProcesses workers_;
};

void wait_for_keys(Store& store, int size) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(fmt::format("ready/{}", r));
  store.wait(keys, 30s);
}

}  // namespace

TEST_CASE("processes: a rank killed mid-collective is named by the others, within the timeout") {
  Job job("kill", 3);
  wait_for_keys(job.store(), 3);
  job.kill(2);
  for (const Outcome& o : job.wait({0, 1}, 20s)) {
    CAPTURE(o.message);
    CHECK(o.type == "Unavailable");
    CHECK(o.message.find("lost rank 2 of 3: its process died") != std::string::npos);
    CHECK(o.call_ms < 3000);
  }
}

TEST_CASE("processes: a rank that hangs is named in the others' DeadlineExceeded") {
  Job job("hang", 3);
  const auto outcomes = job.wait({0, 1}, 20s);
  for (std::size_t i = 0; i < outcomes.size(); ++i) {
    const Outcome& o = outcomes[i];
    CAPTURE(o.message);
    CHECK(o.type == "DeadlineExceeded");
    CHECK(o.message == fmt::format("gloo all_reduce #1 (float32, 262144 elements) on rank {}: timed out after 1 s "
                                   "waiting for rank 2 of 3, which never reached it",
                                   i));
    CHECK(o.call_ms < 1000 + 3000);
  }
}

TEST_CASE("processes: a mismatched collective in check mode throws InvalidArgument with both sides on every rank") {
  Job job("mismatch", 2);
  for (const Outcome& o : job.wait({0, 1}, 20s)) {
    CHECK(o.type == "InvalidArgument");
    CHECK(o.message ==
          "collective mismatch at #0: worker 0 issued all_reduce SUM float32 x 1290 (3 tensors) but worker 1 issued "
          "all_reduce SUM float32 x 1300 (3 tensors)");
  }
}

TEST_CASE("processes: when the store's server dies with a rank, the others say the store is unreachable") {
  Job job("store", 2);
  wait_for_keys(job.store(), 2);
  job.stop_server();  // the chief's process would take its server down with it
  job.kill(0);
  for (const Outcome& o : job.wait({1}, 20s)) {
    CAPTURE(o.message);
    CHECK(o.type == "Unavailable");
    CHECK(o.message.find("is unreachable too, so the process serving it (rank 0 in a tandem job, the chief) has "
                         "probably died") != std::string::npos);
  }
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == kWorkerFlag) return worker_main(argc, argv);
  return doctest::Context(argc, argv).run();
}
