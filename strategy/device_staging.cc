#include "tandem/strategy/detail/device_staging.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "tandem/base/errors.h"
#include "tandem/graph/tensor.h"

namespace tandem::strategy::detail {
namespace {

using graph::Buffer;
using graph::Tensor;

// Where each component starts inside a device's staging memory: the alignment the device
// allocator gives a tensor of its own, so that kernels read staged inputs as fast as others.
constexpr std::size_t kComponentAlignmentBytes = devices::kDefaultAlignmentBytes;

std::size_t aligned(std::size_t bytes) {
  return (bytes + kComponentAlignmentBytes - 1) / kComponentAlignmentBytes * kComponentAlignmentBytes;
}

// One batch's buffers on one device.
struct DeviceBuffers {
  devices::PinnedHostBuffer host;          // the shard, packed
  std::shared_ptr<Buffer> device_memory;   // its copy on the device
  std::unique_ptr<devices::Event> copied;  // on the input stream, after the copies
  std::unique_ptr<devices::Event> read;    // on the compute stream, when the caller dropped the batch
  bool read_recorded = false;
};
struct Slot {
  std::vector<DeviceBuffers> per_device;
};

// What the thread hands to next(): a staged batch, the source's end, or an error.
struct Staged {
  std::optional<Strategy::WorkerBatch> batch;
  Slot* slot = nullptr;
  std::exception_ptr error;
};

class Stager : public std::enable_shared_from_this<Stager> {
 public:
  Stager(std::unique_ptr<Strategy::WorkerIterator> source, std::vector<devices::Device*> devices, SplitBatch split,
         StagingOptions options)
      : source_(std::move(source)),
        devices_(std::move(devices)),
        split_(std::move(split)),
        options_(std::move(options)) {}

  ~Stager() { stop(); }

  std::optional<Strategy::WorkerBatch> next() {
    if (finished_) return std::nullopt;
    start();
    Staged staged;
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return !ready_.empty(); });
      staged = std::move(ready_.front());
      ready_.pop_front();
    }
    changed_.notify_all();
    if (staged.error) {
      finished_ = true;
      std::rethrow_exception(staged.error);
    }
    if (!staged.batch) {
      finished_ = true;
      return std::nullopt;
    }
    Slot* slot = staged.slot;
    for (std::size_t d = 0; d < devices_.size(); ++d) {
      slot->per_device[d].copied->wait(devices_[d]->compute_stream());
    }
    // The handle's deleter gives the slot back; it keeps the stager (and so the buffers) alive
    // when the caller holds a batch longer than the iterator.
    staged.batch->staging = std::shared_ptr<const void>(
        slot, [self = shared_from_this()](const void* s) { self->release(static_cast<Slot*>(const_cast<void*>(s))); });
    return std::move(staged.batch);
  }

  bool started() const { return started_; }
  // Before the first next(): the source skips, without staging what it skips.
  std::int64_t skip_in_source(std::int64_t n) { return source_->skip(n); }

  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    if (!thread_.joinable()) return;
    thread_.join();
    // Batches staged but never taken may still be copying: the buffers must not be freed (and
    // their device memory reused) under a running copy.
    for (auto* device : devices_) device->input_stream().synchronize();
  }

 private:
  void start() {
    if (started_) return;
    started_ = true;
    thread_ = std::thread([this] { stage_loop(); });
  }

  void release(Slot* slot) {
    // Recorded now, from the caller's thread, after the work that reads the batch was queued.
    for (std::size_t d = 0; d < devices_.size(); ++d) {
      auto& buffers = slot->per_device[d];
      buffers.read->record(devices_[d]->compute_stream());
      buffers.read_recorded = true;
    }
    {
      std::lock_guard lock(mutex_);
      free_.push_back(slot);
    }
    changed_.notify_all();
  }

  void stage_loop() {
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock,
                      [&] { return stopping_ || ready_.size() < static_cast<std::size_t>(options_.batches_ahead); });
        if (stopping_) return;
      }
      Staged staged;
      try {
        staged.batch = source_->next();
        if (staged.batch) {
          staged.slot = take_slot();
          fill(*staged.slot, *staged.batch);
        }
      } catch (...) {
        staged.error = std::current_exception();
      }
      const bool last = !staged.batch || staged.error;
      {
        std::lock_guard lock(mutex_);
        ready_.push_back(std::move(staged));
      }
      changed_.notify_all();
      if (last) return;
    }
  }

  Slot* take_slot() {
    Slot* slot = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        slot = free_.back();
        free_.pop_back();
      } else {
        slots_.push_back(std::make_unique<Slot>());
        slot = slots_.back().get();
      }
    }
    if (slot->per_device.empty()) {
      slot->per_device.resize(devices_.size());
      for (std::size_t d = 0; d < devices_.size(); ++d) {
        slot->per_device[d].copied = devices_[d]->create_event();
        slot->per_device[d].read = devices_[d]->create_event();
      }
    }
    // The device may still be reading this slot for the step that last used it (and copying
    // into it before that): wait for that step's work before anything is overwritten.
    for (auto& buffers : slot->per_device) {
      if (buffers.read_recorded) buffers.read->synchronize();
      buffers.read_recorded = false;
    }
    return slot;
  }

  void fill(Slot& slot, Strategy::WorkerBatch& batch) {
    auto shards = split_(batch.local);
    TANDEM_REQUIRE(shards.size() == devices_.size(), Internal, "{}: a batch split into {} shards for {} devices",
                   options_.owner, shards.size(), devices_.size());
    for (std::size_t d = 0; d < devices_.size(); ++d) {
      devices::Device& device = *devices_[d];
      DeviceBuffers& buffers = slot.per_device[d];
      std::size_t bytes = 0;
      for (const Tensor& component : shards[d]) bytes += aligned(component.nbytes());
      // Grows to the largest batch seen; the last, short batch reuses it. An empty shard still
      // gets a buffer: its tensors are views of one.
      if (buffers.device_memory == nullptr || buffers.host.bytes() < bytes) {
        const std::size_t capacity = std::max(bytes, kComponentAlignmentBytes);
        buffers.host = devices::PinnedHostBuffer(device, capacity);
        buffers.device_memory = std::make_shared<Buffer>(device, capacity);
      }
      auto* host = static_cast<std::byte*>(buffers.host.data());
      data::Element on_device;
      std::size_t offset = 0;
      for (const Tensor& component : shards[d]) {
        const Tensor source =
            component.device().host_accessible() ? component : component.to(devices::default_cpu_device());
        if (source.nbytes() > 0) std::memcpy(host + offset, source.raw_data(), source.nbytes());
        on_device.emplace_back(source.shape(), source.dtype(), buffers.device_memory, offset);
        offset += aligned(source.nbytes());
      }
      if (offset > 0) {
        device.copy_from_host_async(buffers.device_memory->data(), host, offset, device.input_stream());
      }
      buffers.copied->record(device.input_stream());
      batch.replica_shards.push_back(std::move(on_device));
    }
  }

  std::unique_ptr<Strategy::WorkerIterator> source_;
  std::vector<devices::Device*> devices_;
  SplitBatch split_;
  StagingOptions options_;

  // Caller's thread only.
  bool started_ = false;
  bool finished_ = false;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Staged> ready_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<Slot*> free_;
  bool stopping_ = false;
  std::thread thread_;
};

class StagingIterator final : public Strategy::WorkerIterator {
 public:
  explicit StagingIterator(std::shared_ptr<Stager> stager) : stager_(std::move(stager)) {}
  ~StagingIterator() override { stager_->stop(); }
  std::optional<Strategy::WorkerBatch> next() override { return stager_->next(); }
  // Once staging has started, staged batches go first: WorkerIterator::skip takes them by next().
  std::int64_t skip(std::int64_t n) override {
    return stager_->started() ? WorkerIterator::skip(n) : stager_->skip_in_source(n);
  }

 private:
  std::shared_ptr<Stager> stager_;
};

}  // namespace

std::unique_ptr<Strategy::WorkerIterator> stage_on_devices(std::unique_ptr<Strategy::WorkerIterator> source,
                                                           std::vector<devices::Device*> devices, SplitBatch split,
                                                           StagingOptions options) {
  TANDEM_REQUIRE(source != nullptr && !devices.empty() && split, InvalidArgument,
                 "{}: staging batches on devices needs a source, devices and a split", options.owner);
  TANDEM_REQUIRE(options.batches_ahead >= 1, InvalidArgument, "{}: batches staged ahead must be at least 1; got {}",
                 options.owner, options.batches_ahead);
  return std::make_unique<StagingIterator>(
      std::make_shared<Stager>(std::move(source), std::move(devices), std::move(split), std::move(options)));
}

}  // namespace tandem::strategy::detail
