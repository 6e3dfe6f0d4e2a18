// tandem/ops/cuda/array_launchers.h — host entry points of the gather, scatter-add and block-copy
// kernels (ops/cuda/array_kernels.cu), called by ops/cuda/array_cuda_kernels.cc.
//
// Like launchers.h: CUDA's and tandem's CUDA-free headers only; every launcher queues work on
// `stream` and returns at once; nothing throws (shapes were validated by the shape functions, ids
// are checked on the device and reported through `bad`, see kernel_util.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tandem/ops/cuda/launchers.h"
#include "tandem/ops/detail/block_copy.h"

namespace tandem::ops::cuda {

// Gather: out[i, :] = params[ids[i], :] for n rows of `width` elements of `element_bytes` bytes (1,
// 2, 4 or 8: any dtype). An id outside [0, rows) gives a row of zeros, lowers *bad (device, preset
// to n) to its position and sets *fault (may be null) to 1.
void gather(int element_bytes, ElementType index_type, const void* params, const void* ids, void* out, std::int64_t n,
            std::int64_t rows, std::int64_t width, unsigned long long* bad, int* fault, cudaStream_t stream);

// UnsortedSegmentSum: out[s, :] = sum of data[i, :] over i with ids[i] == s, for n rows of `width`
// and `segments` output rows; ids outside [0, segments) are reported like gather's and left out.
// Deterministic: the ids are sorted stably (CUB's radix sort) so each output element adds its rows
// in the order of i, with no atomics on values. `scratch` holds segment_sum_scratch_bytes(n,
// segments) bytes of device memory (n < 2^31).
std::size_t segment_sum_scratch_bytes(std::int64_t n, std::int64_t segments);
void unsorted_segment_sum(ElementType type, ElementType index_type, const void* data, const void* ids, void* out,
                          std::int64_t n, std::int64_t segments, std::int64_t width, void* scratch,
                          unsigned long long* bad, int* fault, cudaStream_t stream);

// Slice, SliceGrad, Concat: the block copy of ops/detail/block_copy.h, one thread per element.
void block_copy(int element_bytes, const detail::BlockCopy& copy, const void* src, void* dst, cudaStream_t stream);

// BatchMatMul's triangles: dst = src with every entry (i, j) of its `matrices` matrices of rows x
// cols for which j > i set to 0 (in place when dst == src).
void lower_triangle(int element_bytes, const void* src, void* dst, std::int64_t matrices, std::int64_t rows,
                    std::int64_t cols, cudaStream_t stream);

}  // namespace tandem::ops::cuda
