// tandem/ops/cpu/conv_scratch.h — per-thread scratch memory for the convolution kernels.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "tandem/base/errors.h"

namespace tandem::ops::cpu {

// A buffer that grows to the largest request and is kept: kernels run every step with the same
// shapes, so after the first step nothing is allocated. Declare one thread_local instance per
// purpose: the executor's thread also runs chunks of its own parallel_for, so two purposes that
// are live at once must not share a buffer.
class ScratchBuffer {
 public:
  template <class T>
  T* get(std::int64_t count) {
    const auto bytes = static_cast<std::size_t>(std::max<std::int64_t>(count, 1)) * sizeof(T);
    if (bytes > capacity_) {
      const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
      data_.reset(static_cast<std::byte*>(std::aligned_alloc(kAlignment, rounded)));
      TANDEM_REQUIRE(data_ != nullptr, ResourceExhausted, "convolution scratch: cannot allocate {} bytes", rounded);
      capacity_ = rounded;
    }
    return reinterpret_cast<T*>(data_.get());
  }

 private:
  static constexpr std::size_t kAlignment = 64;  // a cache line, and an AVX-512 register
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  std::size_t capacity_ = 0;
};

}  // namespace tandem::ops::cpu
