#include "tandem/devices/device.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "tandem/base/errors.h"

namespace tandem::devices {
namespace {

// Streams on CPU devices run inline: a recorded point has always been reached.
class InlineEvent final : public Event {
 public:
  void record(Stream& /*stream*/) override {}
  void wait(Stream& /*stream*/) override {}
  void synchronize() override {}
  bool done() override { return true; }
};

}  // namespace

void Device::parallel_for(std::int64_t n, std::int64_t /*min_grain*/,
                          FunctionRef<void(std::int64_t, std::int64_t)> fn) {
  if (n > 0) fn(0, n);
}

std::unique_ptr<Event> Device::create_event() { return std::make_unique<InlineEvent>(); }

std::unique_ptr<CapturedWork> Device::capture(FunctionRef<void()> /*work*/, std::string* why) {
  if (why != nullptr) *why = fmt::format("{} runs its work inline; there is nothing to capture", short_name());
  return nullptr;
}

void Device::copy_from_host_async(void* device_dst, const void* host_src, std::size_t bytes, Stream& /*stream*/) {
  copy_from_host(device_dst, host_src, bytes);
}

void Device::copy_to_host_async(void* host_dst, const void* device_src, std::size_t bytes, Stream& /*stream*/) {
  copy_to_host(host_dst, device_src, bytes);
}

void* Device::allocate_pinned_host(std::size_t bytes) {
  const std::size_t rounded =
      (std::max<std::size_t>(bytes, 1) + kDefaultAlignmentBytes - 1) / kDefaultAlignmentBytes * kDefaultAlignmentBytes;
  void* pointer = std::aligned_alloc(kDefaultAlignmentBytes, rounded);
  TANDEM_REQUIRE(pointer != nullptr, ResourceExhausted, "{}: out of host memory allocating {} bytes of staging memory",
                 short_name(), bytes);
  return pointer;
}

void Device::free_pinned_host(void* pointer, std::size_t /*bytes*/) noexcept { std::free(pointer); }

PinnedHostBuffer::PinnedHostBuffer(Device& device, std::size_t bytes)
    : device_(&device), data_(device.allocate_pinned_host(bytes)), bytes_(bytes) {}

PinnedHostBuffer::~PinnedHostBuffer() {
  if (device_ != nullptr) device_->free_pinned_host(data_, bytes_);
}

PinnedHostBuffer::PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& other) noexcept {
  if (this != &other) {
    if (device_ != nullptr) device_->free_pinned_host(data_, bytes_);
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

}  // namespace tandem::devices
