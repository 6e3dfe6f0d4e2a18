// CUDA kernels of the gather, scatter-add and block-copy ops (host entry points: array_launchers.h).
//
// Gather and the block copies move elements as unsigned integers of their width, so every dtype
// takes the same kernel. The scatter-add (UnsortedSegmentSum, Gather's gradient) is deterministic
// like the CPU kernel: instead of atomic adds, whose order changes from run to run, the ids are
// sorted stably with their positions (CUB's radix sort), each output row finds its run of sorted
// positions by binary search, and each output element adds its rows in the order of i. The sums
// are then bitwise those of the CPU kernel (the same additions in the same order, 16-bit types in
// float rounded once).
#include <cub/device/device_radix_sort.cuh>

#include <cstddef>
#include <cstdint>

#include "tandem/ops/cuda/array_launchers.h"
#include "tandem/ops/cuda/device_common.cuh"

namespace tandem::ops::cuda {
namespace {

// f(static_cast<E*>(nullptr)) for the unsigned integer type of `bytes` bytes.
template <class F>
void with_element_bytes(int bytes, F&& f) {
  switch (bytes) {
    case 1: f(static_cast<std::uint8_t*>(nullptr)); break;
    case 2: f(static_cast<std::uint16_t*>(nullptr)); break;
    case 4: f(static_cast<std::uint32_t*>(nullptr)); break;
    case 8: f(static_cast<std::uint64_t*>(nullptr)); break;
    default: break;  // every dtype has one of these widths
  }
}

template <class F>
void with_index_type(ElementType type, F&& f) {
  if (type == ElementType::kI32) {
    f(static_cast<std::int32_t*>(nullptr));
  } else {
    f(static_cast<std::int64_t*>(nullptr));
  }
}

__device__ __forceinline__ void report_bad_id(std::int64_t position, unsigned long long* bad, int* fault) {
  atomicMin(bad, static_cast<unsigned long long>(position));
  if (fault != nullptr) *fault = 1;
}

template <class E, class I>
__global__ void gather_kernel(const E* params, const I* ids, E* out, std::int64_t n, std::int64_t rows,
                              std::int64_t width, unsigned long long* bad, int* fault) {
  TANDEM_GRID_STRIDE(e, n * width) {
    const std::int64_t i = e / width, j = e - i * width;
    const auto id = static_cast<std::int64_t>(ids[i]);
    if (id < 0 || id >= rows) {
      out[e] = E(0);
      if (j == 0) report_bad_id(i, bad, fault);
    } else {
      out[e] = params[id * width + j];
    }
  }
}

// Sort keys: the id, or `segments` (sorting last, summed nowhere) for a bad one.
template <class I>
__global__ void segment_keys_kernel(const I* ids, std::uint32_t* keys, std::int32_t* positions, std::int64_t n,
                                    std::int64_t segments, unsigned long long* bad, int* fault) {
  TANDEM_GRID_STRIDE(i, n) {
    const auto id = static_cast<std::int64_t>(ids[i]);
    const bool ok = id >= 0 && id < segments;
    keys[i] = static_cast<std::uint32_t>(ok ? id : segments);
    positions[i] = static_cast<std::int32_t>(i);
    if (!ok) report_bad_id(i, bad, fault);
  }
}

// starts[s] = the first sorted position whose key is s or more (so segment s is [starts[s], starts[s + 1])).
__global__ void segment_starts_kernel(const std::uint32_t* sorted, std::int64_t n, std::int64_t segments,
                                      std::int32_t* starts) {
  TANDEM_GRID_STRIDE(s, segments + 1) {
    std::int64_t lo = 0, hi = n;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi) / 2;
      if (static_cast<std::int64_t>(sorted[mid]) < s) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    starts[s] = static_cast<std::int32_t>(lo);
  }
}

template <class T>
__global__ void segment_sum_kernel(const T* data, const std::int32_t* positions, const std::int32_t* starts, T* out,
                                   std::int64_t segments, std::int64_t width) {
  TANDEM_GRID_STRIDE(e, segments * width) {
    const std::int64_t s = e / width, j = e - s * width;
    compute_t<T> sum = compute_t<T>(0);
    for (std::int32_t p = starts[s]; p < starts[s + 1]; ++p) sum += load(data, positions[p] * width + j);
    store(out, e, sum);
  }
}

template <class E>
__global__ void block_copy_kernel(detail::BlockCopy copy, const E* src, E* dst) {
  TANDEM_GRID_STRIDE(e, copy.elements()) {
    const std::int64_t r = e / copy.run, j = e - r * copy.run;
    dst[copy.dst_offset(r) + j] = src[copy.src_offset(r) + j];
  }
}

// dst[m, i, j] = src[m, i, j] where j <= i, else 0 (all bits 0: +0 in every float type).
template <class E>
__global__ void lower_triangle_kernel(const E* src, E* dst, std::int64_t elements, std::int64_t rows,
                                      std::int64_t cols) {
  TANDEM_GRID_STRIDE(e, elements) {
    const std::int64_t j = e % cols, i = e / cols % rows;
    dst[e] = j <= i ? src[e] : E(0);
  }
}

// The scratch memory of the scatter-add: sort keys and positions in and out, the segment starts,
// then CUB's own temporary storage; each part aligned to 256 bytes.
struct SegmentScratch {
  std::uint32_t* keys_in;
  std::uint32_t* keys_out;
  std::int32_t* positions_in;
  std::int32_t* positions_out;
  std::int32_t* starts;
  void* sort_storage;
  std::size_t sort_bytes;
  std::size_t total;
};

constexpr std::size_t align_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// The bits a key takes: ids in [0, segments] (segments marks a bad id).
int key_bits(std::int64_t segments) {
  int bits = 1;
  while (bits < 32 && (std::int64_t{1} << bits) <= segments) ++bits;
  return bits;
}

SegmentScratch segment_scratch(void* base, std::int64_t n, std::int64_t segments) {
  SegmentScratch s{};
  auto* p = static_cast<char*>(base);
  std::size_t offset = 0;
  const auto take = [&](std::size_t bytes) {
    char* at = p == nullptr ? nullptr : p + offset;
    offset += align_up(bytes);
    return at;
  };
  const auto keys = static_cast<std::size_t>(n) * sizeof(std::uint32_t);
  const auto positions = static_cast<std::size_t>(n) * sizeof(std::int32_t);
  s.keys_in = reinterpret_cast<std::uint32_t*>(take(keys));
  s.keys_out = reinterpret_cast<std::uint32_t*>(take(keys));
  s.positions_in = reinterpret_cast<std::int32_t*>(take(positions));
  s.positions_out = reinterpret_cast<std::int32_t*>(take(positions));
  s.starts = reinterpret_cast<std::int32_t*>(take(static_cast<std::size_t>(segments + 1) * sizeof(std::int32_t)));
  // Asked with null storage, CUB only reports the bytes it needs.
  cub::DeviceRadixSort::SortPairs(nullptr, s.sort_bytes, s.keys_in, s.keys_out, s.positions_in, s.positions_out,
                                  static_cast<int>(n), 0, key_bits(segments));
  s.sort_storage = take(s.sort_bytes);
  s.total = offset;
  return s;
}

}  // namespace

void gather(int element_bytes, ElementType index_type, const void* params, const void* ids, void* out, std::int64_t n,
            std::int64_t rows, std::int64_t width, unsigned long long* bad, int* fault, cudaStream_t stream) {
  if (n * width == 0) return;
  with_element_bytes(element_bytes, [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    with_index_type(index_type, [&](auto* index_tag) {
      using I = std::remove_pointer_t<decltype(index_tag)>;
      gather_kernel<E, I><<<blocks_for(n * width), kThreads, 0, stream>>>(
          static_cast<const E*>(params), static_cast<const I*>(ids), static_cast<E*>(out), n, rows, width, bad, fault);
    });
  });
}

std::size_t segment_sum_scratch_bytes(std::int64_t n, std::int64_t segments) {
  return segment_scratch(nullptr, n, segments).total;
}

void unsorted_segment_sum(ElementType type, ElementType index_type, const void* data, const void* ids, void* out,
                          std::int64_t n, std::int64_t segments, std::int64_t width, void* scratch,
                          unsigned long long* bad, int* fault, cudaStream_t stream) {
  if (segments * width == 0) return;
  SegmentScratch s = segment_scratch(scratch, n, segments);
  if (n > 0) {
    with_index_type(index_type, [&](auto* index_tag) {
      using I = std::remove_pointer_t<decltype(index_tag)>;
      segment_keys_kernel<I><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const I*>(ids), s.keys_in,
                                                                     s.positions_in, n, segments, bad, fault);
    });
    cub::DeviceRadixSort::SortPairs(s.sort_storage, s.sort_bytes, s.keys_in, s.keys_out, s.positions_in,
                                    s.positions_out, static_cast<int>(n), 0, key_bits(segments), stream);
  }
  segment_starts_kernel<<<blocks_for(segments + 1), kThreads, 0, stream>>>(s.keys_out, n, segments, s.starts);
  with_numeric_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    segment_sum_kernel<T><<<blocks_for(segments * width), kThreads, 0, stream>>>(
        static_cast<const T*>(data), s.positions_out, s.starts, static_cast<T*>(out), segments, width);
  });
}

void block_copy(int element_bytes, const detail::BlockCopy& copy, const void* src, void* dst, cudaStream_t stream) {
  if (copy.elements() == 0) return;
  with_element_bytes(element_bytes, [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    block_copy_kernel<E>
        <<<blocks_for(copy.elements()), kThreads, 0, stream>>>(copy, static_cast<const E*>(src), static_cast<E*>(dst));
  });
}

void lower_triangle(int element_bytes, const void* src, void* dst, std::int64_t matrices, std::int64_t rows,
                    std::int64_t cols, cudaStream_t stream) {
  const std::int64_t elements = matrices * rows * cols;
  if (elements == 0) return;
  with_element_bytes(element_bytes, [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    lower_triangle_kernel<E><<<blocks_for(elements), kThreads, 0, stream>>>(static_cast<const E*>(src),
                                                                            static_cast<E*>(dst), elements, rows, cols);
  });
}

}  // namespace tandem::ops::cuda
