// Input batches staged on devices ahead of their step (strategy/detail/device_staging.h), on fake
// GPUs whose input-stream copies only run when an event recorded after them is waited for: a
// batch handed out before its copy was waited for, or a buffer refilled while a held batch still
// uses it, shows up as wrong values.
#include <doctest/doctest.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>

#include "tandem/keras_like/keras.h"
#include "tandem/strategy/detail/device_staging.h"

using namespace tandem;

namespace {

class DeferredGpu;

// The input stream of a DeferredGpu: copies wait in a queue.
class QueueStream final : public devices::Stream {
 public:
  void synchronize() override;
  void* native_handle() const override { return nullptr; }
  DeferredGpu* device = nullptr;
};

// A device of type GPU over host memory whose input-stream copies run late: when an event
// recorded after them is waited for or synchronised, or the device is synchronised. Compute work
// runs inline (tests read results with copy_to_host).
class DeferredGpu final : public devices::Device {
 public:
  explicit DeferredGpu(int index) : Device(make_name(index)), allocator_("GPU (deferred copies)") {
    input_.device = this;
  }
  devices::Allocator& allocator() override { return allocator_; }
  devices::Stream& compute_stream() override { return devices::default_cpu_device().compute_stream(); }
  devices::Stream& input_stream() override { return input_; }
  bool host_accessible() const override { return false; }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_on_device(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void fill_zero(void* dst, std::size_t bytes) override { std::memset(dst, 0, bytes); }
  void synchronize() override { run_copies(queued()); }

  void copy_from_host_async(void* dst, const void* src, std::size_t bytes, devices::Stream& stream) override {
    if (&stream != &input_) return copy_from_host(dst, src, bytes);
    std::lock_guard lock(mutex_);
    pending_.push_back([=] { std::memcpy(dst, src, bytes); });
    ++queued_;
  }
  void* allocate_pinned_host(std::size_t bytes) override {
    pinned_allocations.fetch_add(1);
    return Device::allocate_pinned_host(bytes);
  }

  std::unique_ptr<devices::Event> create_event() override;

  std::int64_t queued() {
    std::lock_guard lock(mutex_);
    return queued_;
  }
  // Runs the queued copies up to the `position`-th.
  void run_copies(std::int64_t position) {
    std::lock_guard lock(mutex_);
    while (done_ < position && !pending_.empty()) {
      pending_.front()();
      pending_.pop_front();
      ++done_;
    }
  }

  std::atomic<int> pinned_allocations{0};

 private:
  static devices::DeviceName make_name(int index) {
    devices::DeviceName name;
    name.type = devices::DeviceType::kGPU;
    name.index = 40 + index;
    return name;
  }
  devices::CpuAllocator allocator_;
  QueueStream input_;
  std::mutex mutex_;
  std::deque<std::function<void()>> pending_;
  std::int64_t queued_ = 0, done_ = 0;
};

void QueueStream::synchronize() { device->run_copies(device->queued()); }

class DeferredEvent final : public devices::Event {
 public:
  explicit DeferredEvent(DeferredGpu& device) : device_(device) {}
  void record(devices::Stream& stream) override {
    if (&stream == &device_.input_stream()) position_ = device_.queued();
  }
  void wait(devices::Stream& /*stream*/) override { device_.run_copies(position_); }
  void synchronize() override { device_.run_copies(position_); }
  bool done() override { return false; }

 private:
  DeferredGpu& device_;
  std::int64_t position_ = 0;
};

std::unique_ptr<devices::Event> DeferredGpu::create_event() { return std::make_unique<DeferredEvent>(*this); }

// A WorkerIterator over a dataset's batches, as Strategy::worker_batches gives on one worker.
class BatchSource final : public Strategy::WorkerIterator {
 public:
  explicit BatchSource(const data::Dataset& dataset) : it_(dataset.iterate()) {}
  std::optional<Strategy::WorkerBatch> next() override {
    auto element = it_->next();
    if (!element) return std::nullopt;
    const std::int64_t rows = element->front().shape()[0];
    return Strategy::WorkerBatch{std::move(*element), rows};
  }

 private:
  std::unique_ptr<data::Iterator> it_;
};

// 23 examples: x[i] = (i, i + 0.5, -i), y[i] = 10 i; batches of 5 (the last of 3).
data::Dataset make_dataset(std::int64_t batch = 5) {
  std::vector<float> xs;
  std::vector<std::int64_t> ys;
  for (int i = 0; i < 23; ++i) {
    xs.insert(xs.end(), {static_cast<float>(i), i + 0.5f, static_cast<float>(-i)});
    ys.push_back(10 * i);
  }
  return data::Dataset::from_tensor_slices({Tensor::from_vector(xs, {23, 3}), Tensor::from_vector(ys, {23})})
      .batch(batch);
}

struct Fixture {
  DeferredGpu gpu0{0}, gpu1{1};
  std::vector<devices::Device*> devices{&gpu0, &gpu1};
  // Splits batches as a strategy of two replicas does (its devices are CPUs: the split depends on
  // the replica count only; CTest runs this suite with two logical CPU devices).
  MirroredStrategy two{std::vector<std::string>{"CPU:0", "CPU:1"}};

  std::unique_ptr<Strategy::WorkerIterator> staged(const data::Dataset& dataset, int ahead = 2) {
    return strategy::detail::stage_on_devices(std::make_unique<BatchSource>(dataset), devices,
                                              [this](const data::Element& b) { return two.split_batch(b); },
                                              {.batches_ahead = ahead, .owner = "test"});
  }
};

// Checks that a staged batch's shards hold the host batch's rows, on the right devices.
void check_batch(const Strategy::WorkerBatch& batch, const Fixture& f, std::int64_t first_row) {
  const auto& devices = f.devices;
  REQUIRE(batch.replica_shards.size() == devices.size());
  REQUIRE(batch.staging != nullptr);
  const auto want = f.two.split_batch(batch.local);
  std::int64_t row = first_row;
  for (std::size_t d = 0; d < devices.size(); ++d) {
    const auto& shard = batch.replica_shards[d];
    REQUIRE(shard.size() == 2);
    for (std::size_t c = 0; c < 2; ++c) {
      CHECK(&shard[c].device() == devices[d]);
      CHECK(shard[c].shape() == want[d][c].shape());
      CHECK(shard[c].dtype() == want[d][c].dtype());
    }
    const auto x = shard[0].to(devices::default_cpu_device()).to_vector<float>();
    const auto y = shard[1].to(devices::default_cpu_device()).to_vector<std::int64_t>();
    for (std::size_t i = 0; i < y.size(); ++i, ++row) {
      CHECK(y[i] == 10 * row);
      CHECK(x[3 * i] == static_cast<float>(row));
      CHECK(x[3 * i + 2] == static_cast<float>(-row));
    }
  }
}

}  // namespace

TEST_CASE("staged batches arrive whole, in order, on their devices, after their copies ran") {
  Fixture f;
  auto it = f.staged(make_dataset());
  std::int64_t row = 0;
  int batches = 0;
  while (auto batch = it->next()) {  // as fit does: each batch dropped before the next is taken
    check_batch(*batch, f, row);
    row += batch->local.front().shape()[0];
    ++batches;
  }
  CHECK(batches == 5);
  CHECK(row == 23);
  CHECK_FALSE(it->next().has_value());
  // Buffers are reused: at most batches_ahead waiting, one being filled, one held.
  CHECK(f.gpu0.pinned_allocations.load() <= 4);
  CHECK(f.gpu1.pinned_allocations.load() <= 4);
}

TEST_CASE("batches held by the caller keep their buffers: nothing is overwritten under them") {
  Fixture f;
  auto it = f.staged(make_dataset(2), 1);  // 12 batches, one staged ahead
  std::vector<Strategy::WorkerBatch> held;
  while (auto batch = it->next()) held.push_back(std::move(*batch));
  REQUIRE(held.size() == 12);
  std::int64_t row = 0;
  for (const auto& batch : held) {
    check_batch(batch, f, row);
    row += batch.local.front().shape()[0];
  }
  // Dropping them frees the buffers for reuse; the iterator may go first.
  it.reset();
  held.clear();
}

TEST_CASE("a batch with fewer rows than devices gives empty shards") {
  Fixture f;
  auto one_row = data::Dataset::from_tensor_slices({Tensor::from_vector(std::vector<float>{1, 2, 3}, {1, 3}),
                                                    Tensor::from_vector(std::vector<std::int64_t>{0}, {1})})
                     .batch(4);
  auto it = f.staged(one_row);
  auto batch = it->next();
  REQUIRE(batch.has_value());
  REQUIRE(batch->replica_shards.size() == 2);
  CHECK(batch->replica_shards[0][0].shape() == Shape{1, 3});
  CHECK(batch->replica_shards[1][0].shape() == Shape{0, 3});
  CHECK(batch->replica_shards[0][0].to(devices::default_cpu_device()).to_vector<float>() ==
        std::vector<float>{1, 2, 3});
  batch.reset();
  CHECK_FALSE(it->next().has_value());
}

TEST_CASE("the source's error reaches next() for the batch it broke; earlier batches are unharmed") {
  Fixture f;
  int calls = 0;
  auto failing = make_dataset().map([&calls](const data::Element& e) {
    if (++calls == 3) throw InvalidArgument("a bad record in batch 3");
    return e;
  });
  auto it = f.staged(failing);
  std::int64_t row = 0;
  for (int b = 0; b < 2; ++b) {
    auto batch = it->next();
    REQUIRE(batch.has_value());
    check_batch(*batch, f, row);
    row += 5;
  }
  CHECK_THROWS_WITH_AS(it->next(), doctest::Contains("a bad record in batch 3"), InvalidArgument);
  CHECK_FALSE(it->next().has_value());
}

TEST_CASE("skip before the first batch skips in the source; stopping early joins the thread") {
  Fixture f;
  {
    auto it = f.staged(make_dataset());
    CHECK(it->skip(3) == 3);
    auto batch = it->next();
    REQUIRE(batch.has_value());
    check_batch(*batch, f, 15);
  }
  {
    auto it = f.staged(make_dataset(1), 2);  // 23 batches; the thread fills its queue and waits
    auto batch = it->next();
    REQUIRE(batch.has_value());
    CHECK(it->skip(2) == 2);  // after staging started: through next()
    auto third = it->next();
    REQUIRE(third.has_value());
    check_batch(*third, f, 3);
  }  // destroyed with batches queued and the thread waiting: returns
  CHECK_THROWS_AS(f.staged(make_dataset(), 0), InvalidArgument);
}
