// The in-process group: every collective against a serial reference, for 1, 2, 3, 4 and 8 ranks
// (one thread each), and the failure paths: mismatched calls, a rank that never arrives, abort.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "on_ranks.h"
#include "tandem/collective/in_process.h"
#include "tandem/graph/detail/low_precision_types.h"

using namespace tandem;
using namespace tandem::collective;
using namespace std::chrono_literals;

namespace {

using testing::Group;
using testing::error_as;
using testing::on_ranks;
using testing::require_no_errors;
constexpr int kRankCounts[] = {1, 2, 3, 4, 8};

template <class T>
std::vector<T> values(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> v(static_cast<std::size_t>(n));
  if constexpr (std::is_floating_point_v<T>) {
    std::uniform_real_distribution<T> u(-1, 1);
    for (auto& x : v) x = u(rng);
  } else {
    std::uniform_int_distribution<int> u(-1000, 1000);
    for (auto& x : v) x = static_cast<T>(u(rng));
  }
  return v;
}

// The serial reference: ((x0 op x1) op x2) ..., then / size for MEAN; the same order as the group.
template <class T>
std::vector<T> reference(const std::vector<std::vector<T>>& inputs, ReduceOp op) {
  std::vector<T> out = inputs[0];
  for (std::size_t q = 1; q < inputs.size(); ++q) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      const T a = out[i], b = inputs[q][i];
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kMean: out[i] = static_cast<T>(a + b); break;
        case ReduceOp::kMax: out[i] = a < b ? b : a; break;
        case ReduceOp::kMin: out[i] = b < a ? b : a; break;
      }
    }
  }
  if (op == ReduceOp::kMean) {
    for (auto& x : out) x = static_cast<T>(x / static_cast<T>(inputs.size()));
  }
  return out;
}

struct ReduceCase {
  DType dtype;
  ReduceOp op;
  std::int64_t elements;
};

template <class T>
void check_all_reduce_case(Group& group, const ReduceCase& c, std::uint64_t seed) {
  const int n = static_cast<int>(group.size());
  std::vector<std::vector<T>> inputs;
  for (int r = 0; r < n; ++r) inputs.push_back(values<T>(c.elements, seed * 100 + static_cast<std::uint64_t>(r)));
  const std::vector<T> expected = reference(inputs, c.op);
  std::vector<std::vector<T>> results(static_cast<std::size_t>(n));
  require_no_errors(on_ranks(group, [&](Communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    Tensor t = Tensor::from_vector<T>(inputs[r], {c.elements});
    comm.all_reduce(t, c.op);
    results[r] = t.to_vector<T>();
  }));
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    // Bitwise: the group reduces in rank order, like the reference, and every rank gets the same.
    CHECK(results[static_cast<std::size_t>(r)] == expected);
  }
}

}  // namespace

TEST_CASE("all_reduce SUM/MEAN/MAX/MIN of every numeric dtype (16-bit floats too) matches a serial reference") {
  for (int n : kRankCounts) {
    auto group = make_in_process_group(n);
    std::uint64_t seed = 1;
    for (DType dtype : {kFloat32, kFloat64, kInt32, kInt64, DType::kF16, DType::kBF16}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin}) {
        for (std::int64_t elements : {std::int64_t{0}, std::int64_t{1}, std::int64_t{n - 1}, std::int64_t{17},
                                      std::int64_t{1001}, std::int64_t{4099}}) {
          CAPTURE(n);
          CAPTURE(dtype_name(dtype));
          CAPTURE(reduce_op_name(op));
          CAPTURE(elements);
          const ReduceCase c{dtype, op, elements};
          using Reducible = graph::TypeList<float, double, std::int32_t, std::int64_t, graph::float16, graph::bfloat16>;
          graph::dispatch<Reducible>(dtype, "test", [&]<class T>() { check_all_reduce_case<T>(group, c, ++seed); });
        }
      }
    }
    // Sequence numbers count every call.
    for (auto& comm : group) CHECK(comm->sequence_number() == 6 * 4 * 6);
  }
}

TEST_CASE("all_reduce of 1M elements") {
  for (int n : kRankCounts) {
    CAPTURE(n);
    auto group = make_in_process_group(n);
    check_all_reduce_case<float>(group, {kFloat32, ReduceOp::kSum, 1 << 20}, 7);
    check_all_reduce_case<float>(group, {kFloat32, ReduceOp::kMean, (1 << 20) + 3}, 8);
    check_all_reduce_case<std::int64_t>(group, {kInt64, ReduceOp::kMax, (1 << 20) - 5}, 9);
  }
}

TEST_CASE("all_reduce of a span reduces the tensors as one buffer, however each rank splits it") {
  // A gradient bucket: tensors of different sizes, some empty, some tiny.
  const std::vector<std::int64_t> sizes = {3, 0, 1000, 1, 17, 4096, 0, 65, 2, 333};
  std::int64_t total = 0;
  for (auto s : sizes) total += s;
  for (int n : kRankCounts) {
    CAPTURE(n);
    auto group = make_in_process_group(n);
    std::vector<std::vector<float>> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(values<float>(total, 50 + static_cast<std::uint64_t>(r)));
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean}) {
      CAPTURE(reduce_op_name(op));
      const auto expected = reference(inputs, op);
      std::vector<std::vector<float>> results(static_cast<std::size_t>(n));
      require_no_errors(on_ranks(group, [&](Communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        // Odd ranks hold the bucket as one tensor, even ranks as the ten: the logical buffer is the same.
        std::vector<Tensor> tensors;
        std::int64_t offset = 0;
        const auto slice = [&](std::int64_t count) {
          std::vector<float> part(inputs[r].begin() + offset, inputs[r].begin() + offset + count);
          offset += count;
          return Tensor::from_vector<float>(part, {count});
        };
        if (r % 2 == 1) {
          tensors.push_back(slice(total));
        } else {
          for (auto s : sizes) tensors.push_back(slice(s));
        }
        comm.all_reduce(std::span<Tensor>(tensors), op);
        for (const Tensor& t : tensors) {
          const auto v = t.to_vector<float>();
          results[r].insert(results[r].end(), v.begin(), v.end());
        }
      }));
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        CHECK(results[static_cast<std::size_t>(r)] == expected);
      }
    }
  }
}

TEST_CASE("broadcast from every root, any dtype") {
  for (int n : kRankCounts) {
    CAPTURE(n);
    auto group = make_in_process_group(n);
    for (int root = 0; root < n; ++root) {
      CAPTURE(root);
      for (std::int64_t elements : {0, 1, 5, 1000, 100003}) {
        CAPTURE(elements);
        std::vector<std::vector<float>> floats;
        std::vector<std::vector<std::uint8_t>> bytes;
        for (int r = 0; r < n; ++r) {
          floats.push_back(values<float>(elements, 300 + static_cast<std::uint64_t>(r)));
          std::vector<std::uint8_t> b(static_cast<std::size_t>(elements));
          for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::uint8_t>(i * 7 + static_cast<std::size_t>(r));
          bytes.push_back(b);
        }
        std::vector<std::vector<float>> got_floats(static_cast<std::size_t>(n));
        std::vector<std::vector<std::uint8_t>> got_bytes(static_cast<std::size_t>(n));
        require_no_errors(on_ranks(group, [&](Communicator& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          Tensor f = Tensor::from_vector<float>(floats[r], {elements});
          Tensor b = Tensor::from_vector<std::uint8_t>(bytes[r], {elements});
          comm.broadcast(f, root);
          comm.broadcast(b, root);
          got_floats[r] = f.to_vector<float>();
          got_bytes[r] = b.to_vector<std::uint8_t>();
        }));
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          CHECK(got_floats[static_cast<std::size_t>(r)] == floats[static_cast<std::size_t>(root)]);
          CHECK(got_bytes[static_cast<std::size_t>(r)] == bytes[static_cast<std::size_t>(root)]);
        }
      }
    }
  }
}

TEST_CASE("all_gather concatenates the inputs in rank order") {
  for (int n : kRankCounts) {
    CAPTURE(n);
    auto group = make_in_process_group(n);
    std::vector<std::vector<std::int64_t>> inputs;
    std::vector<std::int64_t> expected;
    for (int r = 0; r < n; ++r) {
      inputs.push_back(values<std::int64_t>(3 * 4, 400 + static_cast<std::uint64_t>(r)));
      expected.insert(expected.end(), inputs.back().begin(), inputs.back().end());
    }
    std::vector<std::vector<std::int64_t>> got(static_cast<std::size_t>(n));
    std::vector<float> scalars_got;
    require_no_errors(on_ranks(group, [&](Communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      Tensor input = Tensor::from_vector<std::int64_t>(inputs[r], {3, 4});
      Tensor output = Tensor::zeros({3 * n, 4}, kInt64);
      comm.all_gather(input, output);
      got[r] = output.to_vector<std::int64_t>();
      // A scalar per rank gathers into a vector.
      Tensor scalar = Tensor::scalar<float>(static_cast<float>(r) + 0.5f);
      Tensor all = Tensor::zeros({n}, kFloat32);
      comm.all_gather(scalar, all);
      if (r == 0) scalars_got = all.to_vector<float>();
    }));
    for (int r = 0; r < n; ++r) CHECK(got[static_cast<std::size_t>(r)] == expected);
    for (int r = 0; r < n; ++r) CHECK(scalars_got[static_cast<std::size_t>(r)] == static_cast<float>(r) + 0.5f);
  }
}

TEST_CASE("reduce_scatter gives rank r part r of the reduction") {
  for (int n : kRankCounts) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMean}) {
      CAPTURE(n);
      CAPTURE(reduce_op_name(op));
      const std::int64_t rows = 5, cols = 3;
      std::vector<std::vector<double>> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(values<double>(n * rows * cols, 500 + static_cast<std::uint64_t>(r)));
      const auto full = reference(inputs, op);
      auto group = make_in_process_group(n);
      std::vector<std::vector<double>> got(static_cast<std::size_t>(n));
      require_no_errors(on_ranks(group, [&](Communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        Tensor input = Tensor::from_vector<double>(inputs[r], {n * rows, cols});
        Tensor output = Tensor::zeros({rows, cols}, kFloat64);
        comm.reduce_scatter(input, output, op);
        got[r] = output.to_vector<double>();
      }));
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        const auto begin = full.begin() + r * rows * cols;
        CHECK(got[static_cast<std::size_t>(r)] == std::vector<double>(begin, begin + rows * cols));
      }
    }
  }
}

TEST_CASE("barrier returns only once every rank has called it") {
  for (int n : kRankCounts) {
    CAPTURE(n);
    auto group = make_in_process_group(n);
    std::atomic<int> arrived{0};
    std::atomic<int> early{0};
    require_no_errors(on_ranks(group, [&](Communicator& comm) {
      for (int round = 1; round <= 50; ++round) {
        if (comm.rank() == round % n) std::this_thread::sleep_for(100us);  // a different straggler each round
        arrived.fetch_add(1);
        comm.barrier();
        if (arrived.load() < round * n) early.fetch_add(1);
        comm.barrier();  // nobody starts the next round while another still checks this one
      }
    }));
    CHECK(early.load() == 0);
  }
}

TEST_CASE("1000 small all-reduces in a row stay in step") {
  for (int n : kRankCounts) {
    CAPTURE(n);
    auto group = make_in_process_group(n);
    std::atomic<int> wrong{0};
    require_no_errors(on_ranks(group, [&](Communicator& comm) {
      std::vector<Tensor> bucket = {Tensor::zeros({3}, kInt32), Tensor::zeros({20}, kInt32)};
      for (int round = 0; round < 1000; ++round) {
        for (Tensor& t : bucket) std::fill_n(t.data<std::int32_t>(), t.num_elements(), round + comm.rank());
        comm.all_reduce(std::span<Tensor>(bucket), ReduceOp::kSum);
        const int expected = n * round + n * (n - 1) / 2;
        for (Tensor& t : bucket) {
          const auto* p = t.data<std::int32_t>();
          if (std::any_of(p, p + t.num_elements(), [&](std::int32_t x) { return x != expected; })) wrong.fetch_add(1);
        }
      }
    }));
    CHECK(wrong.load() == 0);
    for (auto& comm : group) CHECK(comm->sequence_number() == 1000);
  }
}

TEST_CASE("mismatched calls are InvalidArgument on every rank, naming both sides; the group stays usable") {
  auto group = make_in_process_group(4);
  SUBCASE("element counts") {
    const auto errors = on_ranks(group, [&](Communicator& comm) {
      Tensor t = Tensor::zeros({comm.rank() == 1 ? 1000 : 1024}, kFloat32);
      comm.all_reduce(t, ReduceOp::kSum);
    });
    for (const auto& e : errors) {
      CHECK(error_as<InvalidArgument>(e) == "all_reduce #0: rank 0 has 1024 float32 elements, rank 1 has 1000");
    }
  }
  SUBCASE("dtypes") {
    const auto errors = on_ranks(group, [&](Communicator& comm) {
      Tensor t = Tensor::zeros({8}, comm.rank() == 2 ? kInt32 : kFloat32);
      comm.all_reduce(t, ReduceOp::kSum);
    });
    for (const auto& e : errors) {
      CHECK(error_as<InvalidArgument>(e) == "all_reduce #0: rank 0 has 8 float32 elements, rank 2 has 8 int32 elements");
    }
  }
  SUBCASE("operations") {
    const auto errors = on_ranks(group, [&](Communicator& comm) {
      Tensor t = Tensor::zeros({8}, kFloat32);
      if (comm.rank() == 3) {
        comm.broadcast(t, 0);
      } else {
        comm.all_reduce(t, ReduceOp::kSum);
      }
    });
    CHECK(error_as<InvalidArgument>(errors[0]) == "all_reduce #0: rank 0 issued all_reduce #0, rank 3 issued broadcast #0");
    CHECK(error_as<InvalidArgument>(errors[3]) == "broadcast #0: rank 0 issued all_reduce #0, rank 3 issued broadcast #0");
  }
  SUBCASE("reduce ops and roots") {
    auto errors = on_ranks(group, [&](Communicator& comm) {
      Tensor t = Tensor::zeros({8}, kFloat32);
      comm.all_reduce(t, comm.rank() == 2 ? ReduceOp::kMax : ReduceOp::kSum);
    });
    for (const auto& e : errors) CHECK(error_as<InvalidArgument>(e) == "all_reduce #0: rank 0 reduces with SUM, rank 2 with MAX");
    errors = on_ranks(group, [&](Communicator& comm) {
      Tensor t = Tensor::zeros({8}, kFloat32);
      comm.broadcast(t, comm.rank() == 1 ? 1 : 0);
    });
    for (const auto& e : errors) CHECK(error_as<InvalidArgument>(e) == "broadcast #1: rank 0 broadcasts from root 0, rank 1 from root 1");
  }
  SUBCASE("one rank's bad arguments") {
    const auto errors = on_ranks(group, [&](Communicator& comm) {
      Tensor t = Tensor::zeros({8}, kFloat32);
      comm.broadcast(t, comm.rank() == 2 ? 7 : 0);
    });
    for (const auto& e : errors) {
      CHECK(error_as<InvalidArgument>(e) == "broadcast #0: rank 2: root 7 is not a rank of this group of 4");
    }
    const auto more = on_ranks(group, [&](Communicator& comm) {
      Tensor t = Tensor::zeros({8}, kUInt8);
      comm.all_reduce(t, ReduceOp::kSum);
    });
    CHECK(error_as<InvalidArgument>(more[0]).find("rank 0: uint8 tensors cannot be reduced") != std::string::npos);
    const auto shapes = on_ranks(group, [&](Communicator& comm) {
      Tensor in = Tensor::zeros({2, 3}, kFloat32);
      Tensor out = Tensor::zeros({comm.rank() == 3 ? 7 : 8, 3}, kFloat32);
      comm.all_gather(in, out);
    });
    CHECK(error_as<InvalidArgument>(shapes[0]) ==
          "all_gather #2: rank 3: output has shape (7, 3); gathering 4 inputs of shape (2, 3) needs (8, 3)");
  }
  // A disagreement is the caller's mistake, not a failure of the group: the next collective works.
  std::atomic<bool> usable{true};
  require_no_errors(on_ranks(group, [&](Communicator& comm) {
    Tensor t = Tensor::filled<float>({4}, 1.0f);
    comm.all_reduce(t, ReduceOp::kSum, {.timeout = 5s});
    if (t.to_vector<float>() != std::vector<float>(4, 4.0f)) usable = false;
  }));
  CHECK(usable.load());
}

TEST_CASE("a rank that never arrives: the others get DeadlineExceeded naming it, then the group is unusable") {
  auto group = make_in_process_group(4);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::exception_ptr> errors(4);
  std::vector<std::thread> threads;
  for (int r : {0, 1, 2}) {  // rank 3 never calls
    threads.emplace_back([&, r] {
      try {
        Tensor t = Tensor::zeros({16}, kFloat32);
        group[static_cast<std::size_t>(r)]->all_reduce(t, ReduceOp::kSum, {.timeout = 200ms});
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  for (int r : {0, 1, 2}) {
    CAPTURE(r);
    CHECK(error_as<DeadlineExceeded>(errors[static_cast<std::size_t>(r)]) ==
          "all_reduce #0: rank 3 of 4 did not arrive within 200 ms");
  }
  CHECK(elapsed >= 200ms);
  CHECK(elapsed < 1s);
  // The late rank, and every later call, find the group failed.
  Tensor t = Tensor::zeros({16}, kFloat32);
  CHECK_THROWS_WITH_AS(group[3]->all_reduce(t, ReduceOp::kSum),
                       "all_reduce #0: the group failed at all_reduce #0: rank 3 of 4 did not arrive within 200 ms",
                       Unavailable);
  CHECK_THROWS_AS(group[0]->barrier(), Unavailable);
}

TEST_CASE("two ranks that never arrive are both named") {
  auto group = make_in_process_group(4);
  std::vector<std::exception_ptr> errors(4);
  std::vector<std::thread> threads;
  for (int r : {0, 2}) {
    threads.emplace_back([&, r] {
      try {
        group[static_cast<std::size_t>(r)]->barrier({.timeout = 100ms});
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(error_as<DeadlineExceeded>(errors[0]) == "barrier #0: ranks 1, 3 of 4 did not arrive within 100 ms");
  CHECK(error_as<DeadlineExceeded>(errors[2]) == "barrier #0: ranks 1, 3 of 4 did not arrive within 100 ms");
}

TEST_CASE("abort from one rank: the others' pending calls throw Unavailable with the reason, promptly") {
  auto group = make_in_process_group(4);
  const auto start = std::chrono::steady_clock::now();
  std::vector<double> seconds(4, 0);
  const auto errors = on_ranks(group, [&](Communicator& comm) {
    if (comm.rank() == 0) {
      std::this_thread::sleep_for(50ms);
      comm.abort("replica 0 lost its device");
      return;
    }
    Tensor t = Tensor::zeros({1 << 16}, kFloat32);
    try {
      comm.all_reduce(t, ReduceOp::kSum);  // the default timeout: minutes
    } catch (...) {
      seconds[static_cast<std::size_t>(comm.rank())] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      throw;
    }
  });
  CHECK(errors[0] == nullptr);
  for (int r : {1, 2, 3}) {
    CAPTURE(r);
    CHECK(error_as<Unavailable>(errors[static_cast<std::size_t>(r)]) ==
          "all_reduce #0: the group was aborted: replica 0 lost its device");
    CHECK(seconds[static_cast<std::size_t>(r)] < 1.0);
  }
  Tensor t = Tensor::zeros({4}, kFloat32);
  CHECK_THROWS_WITH_AS(group[0]->broadcast(t, 0), "broadcast #0: the group was aborted: replica 0 lost its device",
                       Unavailable);
  CHECK_THROWS_WITH_AS(group[2]->barrier(), "barrier #1: the group was aborted: replica 0 lost its device",
                       Unavailable);
}

TEST_CASE("group basics") {
  CHECK_THROWS_AS(make_in_process_group(0), InvalidArgument);
  auto group = make_in_process_group(3);
  for (int r = 0; r < 3; ++r) {
    CHECK(group[static_cast<std::size_t>(r)]->rank() == r);
    CHECK(group[static_cast<std::size_t>(r)]->size() == 3);
    CHECK(group[static_cast<std::size_t>(r)]->backend() == "in-process");
    CHECK(group[static_cast<std::size_t>(r)]->sequence_number() == 0);
  }
  CHECK(reduce_op_name(ReduceOp::kMean) == "MEAN");
  // A group of one needs no peers.
  auto solo = make_in_process_group(1);
  Tensor t = Tensor::from_vector<float>({1, 2, 3}, {3});
  solo[0]->all_reduce(t, ReduceOp::kMean);
  solo[0]->barrier();
  CHECK(t.to_vector<float>() == std::vector<float>{1, 2, 3});
  CHECK(solo[0]->sequence_number() == 2);
}
