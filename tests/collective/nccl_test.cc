// The NCCL group, on real GPUs. One GPU: a group of one (NCCL's init, every collective, the
// argument checks). Two or more: a two-rank group, one thread per rank, against host references,
// and the failure paths (a rank that never arrives, abort). Where no GPU is usable, or the build
// has no NCCL, the program exits 77, which CTest reports as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "on_ranks.h"
#include "tandem/collective/nccl.h"
#include "tandem/devices/device.h"

using namespace tandem;
using namespace tandem::collective;
using namespace std::chrono_literals;

namespace {

constexpr int kSkipped = 77;  // CTest's SKIP_RETURN_CODE for this suite

using testing::Group;
using testing::error_as;
using testing::on_ranks;
using testing::require_no_errors;

devices::Device& gpu(int i) { return devices::get_device("GPU:" + std::to_string(i)); }

std::vector<float> ramp(std::int64_t n, float scale, float offset) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 1000) * scale + offset;
  return v;
}

}  // namespace

TEST_CASE("make_nccl_group checks its devices") {
  CHECK(nccl_available());
  CHECK_THROWS_AS(make_nccl_group({}), InvalidArgument);
  CHECK_THROWS_WITH_AS(make_nccl_group({devices::num_gpus()}), doctest::Contains("there is no CUDA device"),
                       InvalidArgument);
  if (devices::num_gpus() >= 2) CHECK_THROWS_WITH_AS(make_nccl_group({1, 1}), doctest::Contains("listed twice"), InvalidArgument);
}

TEST_CASE("a group of one GPU: every collective, and the argument checks") {
  auto group = make_nccl_group({0});
  Communicator& comm = *group[0];
  CHECK(comm.backend() == "nccl");
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  const auto values = ramp(1 << 20, 0.5f, -3.0f);
  Tensor t = Tensor::from_vector<float>(values, {1 << 20}, gpu(0));
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin}) {
    comm.all_reduce(t, op);
    CHECK(t.to_vector<float>() == values);
  }
  std::vector<Tensor> bucket = {Tensor::from_vector<float>({1, 2, 3}, {3}, gpu(0)),
                                Tensor::from_vector<float>({4}, {1}, gpu(0))};
  comm.all_reduce(std::span<Tensor>(bucket), ReduceOp::kSum);
  CHECK(bucket[0].to_vector<float>() == std::vector<float>{1, 2, 3});
  comm.broadcast(t, 0);
  Tensor gathered = Tensor::zeros({1 << 20}, kFloat32, gpu(0));
  comm.all_gather(t, gathered);
  CHECK(gathered.to_vector<float>() == values);
  Tensor scattered = Tensor::zeros({1 << 20}, kFloat32, gpu(0));
  comm.reduce_scatter(t, scattered, ReduceOp::kSum);
  CHECK(scattered.to_vector<float>() == values);
  comm.barrier();
  CHECK(comm.sequence_number() == 9);

  // A tensor in host memory is refused, and (the rank never issued the collective) fails the group.
  Tensor host = Tensor::zeros({4}, kFloat32);
  CHECK_THROWS_WITH_AS(comm.all_reduce(host, ReduceOp::kSum),
                       "all_reduce #9 on rank 0 of 1 (GPU:0): tensor 0 of 1 is on CPU:0; this rank's communicator runs on GPU:0",
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(comm.barrier(), doctest::Contains("barrier #10: the group failed"), Unavailable);
}

TEST_CASE("two GPUs: every collective against host references") {
  if (devices::num_gpus() < 2) return;
  auto group = make_nccl_group({0, 1});
  const std::int64_t n = (1 << 20) + 3;
  std::vector<std::vector<float>> inputs = {ramp(n, 0.25f, 1.0f), ramp(n, -0.5f, 2.0f)};
  std::vector<float> sum(static_cast<std::size_t>(n)), mean(sum.size()), max(sum.size());
  for (std::size_t i = 0; i < sum.size(); ++i) {
    sum[i] = inputs[0][i] + inputs[1][i];
    mean[i] = sum[i] / 2;
    max[i] = std::max(inputs[0][i], inputs[1][i]);
  }
  std::vector<std::vector<float>> got_sum(2), got_mean(2), got_max(2), got_bcast(2), got_gather(2), got_scatter(2);
  require_no_errors(on_ranks(group, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto ru = static_cast<std::size_t>(r);
    Tensor t = Tensor::from_vector<float>(inputs[ru], {n}, gpu(r));
    comm.all_reduce(t, ReduceOp::kSum);
    got_sum[ru] = t.to_vector<float>();
    t = Tensor::from_vector<float>(inputs[ru], {n}, gpu(r));
    comm.all_reduce(t, ReduceOp::kMean);
    got_mean[ru] = t.to_vector<float>();
    // A bucket: the same values split into three tensors.
    std::vector<Tensor> bucket = {Tensor::from_vector<float>({inputs[ru].begin(), inputs[ru].begin() + 10}, {10}, gpu(r)),
                                  Tensor::from_vector<float>({inputs[ru].begin() + 10, inputs[ru].end()}, {n - 10}, gpu(r))};
    comm.all_reduce(std::span<Tensor>(bucket), ReduceOp::kMax);
    got_max[ru] = bucket[0].to_vector<float>();
    const auto rest = bucket[1].to_vector<float>();
    got_max[ru].insert(got_max[ru].end(), rest.begin(), rest.end());
    t = Tensor::from_vector<float>(inputs[ru], {n}, gpu(r));
    comm.broadcast(t, 1);
    got_bcast[ru] = t.to_vector<float>();
    Tensor in = Tensor::from_vector<float>({static_cast<float>(r), static_cast<float>(10 + r)}, {1, 2}, gpu(r));
    Tensor out = Tensor::zeros({2, 2}, kFloat32, gpu(r));
    comm.all_gather(in, out);
    got_gather[ru] = out.to_vector<float>();
    Tensor big = Tensor::from_vector<float>({1, 2, 3, 4}, {4}, gpu(r));
    Tensor half = Tensor::zeros({2}, kFloat32, gpu(r));
    comm.reduce_scatter(big, half, ReduceOp::kSum);
    got_scatter[ru] = half.to_vector<float>();
    for (int i = 0; i < 100; ++i) comm.barrier();
  }));
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(got_sum[r] == sum);
    CHECK(got_mean[r] == mean);
    CHECK(got_max[r] == max);
    CHECK(got_bcast[r] == inputs[1]);
    CHECK(got_gather[r] == std::vector<float>{0, 10, 1, 11});
    CHECK(got_scatter[r] == (r == 0 ? std::vector<float>{2, 4} : std::vector<float>{6, 8}));
  }
}

TEST_CASE("two GPUs: a rank that never arrives is named, and abort stops a waiting rank") {
  if (devices::num_gpus() < 2) return;
  // NCCL connects peers on their first collective, inside the call that enqueues it, where no
  // timeout reaches: a collective both ranks complete comes first.
  const auto warm_up = [](Group& group) {
    require_no_errors(on_ranks(group, [&](Communicator& comm) {
      Tensor t = Tensor::zeros({1024}, kFloat32, gpu(comm.rank()));
      comm.all_reduce(t, ReduceOp::kSum);
    }));
  };
  {
    auto group = make_nccl_group({0, 1});
    warm_up(group);
    Tensor t = Tensor::zeros({1024}, kFloat32, gpu(0));
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH_AS(group[0]->all_reduce(t, ReduceOp::kSum, {.timeout = 300ms}),
                         "all_reduce #1: rank 1 of 2 did not arrive within 300 ms", DeadlineExceeded);
    CHECK(std::chrono::steady_clock::now() - start < 5s);
    Tensor t1 = Tensor::zeros({1024}, kFloat32, gpu(1));
    CHECK_THROWS_AS(group[1]->all_reduce(t1, ReduceOp::kSum), Unavailable);
  }
  {
    auto group = make_nccl_group({0, 1});
    warm_up(group);
    const auto errors = on_ranks(group, [&](Communicator& comm) {
      if (comm.rank() == 0) {
        std::this_thread::sleep_for(100ms);
        comm.abort("replica 0 stopped");
        return;
      }
      Tensor t = Tensor::zeros({1024}, kFloat32, gpu(1));
      comm.all_reduce(t, ReduceOp::kSum);
    });
    CHECK(errors[0] == nullptr);
    CHECK(error_as<Unavailable>(errors[1]) == "all_reduce #1: the group was aborted: replica 0 stopped");
  }
}

int main(int argc, char** argv) {
  if (devices::num_gpus() == 0) {
    std::printf("skipped: no GPU (%s)\n", devices::gpu_discovery_message().c_str());
    return kSkipped;
  }
  try {
    make_nccl_group({0});
  } catch (const Unimplemented& e) {
    std::printf("skipped: %s\n", e.what());
    return kSkipped;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
