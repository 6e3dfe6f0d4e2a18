// tandem/ops/cuda/cudnn.h — convolution and pooling on GPUs through cuDNN, loaded with dlopen.
//
// Like cuBLAS and NCCL, libcudnn is loaded at first use rather than linked: a CUDA build starts
// where cuDNN is missing (PyTorch's pip wheel `nvidia-cudnn-cu13` is often the only copy on a GPU
// machine), and then every convolution and pooling runs on tandem's own kernels (im2col + cuBLAS,
// ops/cuda/kernels.cu). Which case goes where is decided by ops/detail/cudnn_plan.h.
//
// The library tried first is $TANDEM_CUDNN_LIBRARY (a path), then libcudnn.so.9, libcudnn.so.
// TANDEM_CUDNN=0 turns cuDNN off for the process. Builds without cudnn.h (or without CUDA) compile
// cudnn_unavailable.cc instead, where cudnn_status() says why.
//
// This header has no CUDA type in it (the stream is CUstream_st*, which is cudaStream_t), so that
// programs of every build can print cudnn_status().
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "tandem/ops/detail/cudnn_plan.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace tandem::ops::cuda {

// "loaded (version 91900, libcudnn.so.9)", or why cuDNN is not used in this process.
std::string cudnn_status();
// Whether convolution and pooling may use cuDNN (loaded, version 9, not turned off).
bool cudnn_enabled();

// How many conv/pool kernel runs took each path since the process started (a CUDA graph's
// replays do not run kernels, so they are not counted). Which path a kernel takes is fixed per
// node once its geometry is known, so these show what a model used.
struct CudnnPathCounts {
  std::uint64_t cudnn = 0;     // through cuDNN
  std::uint64_t fallback = 0;  // through tandem's kernels (the plan, the dtype or cuDNN said no)
};
CudnnPathCounts cudnn_path_counts();
void count_cudnn_path(bool used_cudnn);

// Where a call runs: CUDA device ordinal, its name for messages, and the stream.
struct CudnnTarget {
  int device = 0;
  std::string device_name;
  CUstream_st* stream = nullptr;
};

enum class CudnnConvDirection : std::uint8_t { kForward, kBackwardData, kBackwardFilter };

// Picks the algorithm for a convolution plan (plan.use_cudnn) once per (plan, direction, device)
// with cuDNN's heuristics (the _v7 Get functions: the Find functions run and time candidates,
// which synchronises the device) and caches it. Only deterministic algorithms are taken, so runs
// repeat bit for bit as they do on tandem's kernels; strict float32 (no TF32) takes no FFT or
// Winograd algorithm, which lose a few bits; and the workspace must be at most
// kMaxCudnnWorkspaceBytes. Returns the workspace the call needs, or nullopt when no algorithm
// qualifies (the caller then uses tandem's kernels; the answer is cached too).
inline constexpr std::size_t kMaxCudnnWorkspaceBytes = std::size_t{256} << 20;
std::optional<std::size_t> cudnn_conv_prepare(const CudnnTarget& target, CudnnConvDirection direction,
                                              const detail::CudnnPlan& plan);

// Runs the prepared convolution with the algorithm cached for it, writing (beta = 0) its output:
//   kForward:        in = x (NHWC), filter = KRSC filter, out = y (NHWC)
//   kBackwardData:   in = dy,       filter = KRSC filter, out = dx
//   kBackwardFilter: in = x,        filter = dy,          out = KRSC filter gradient
// `workspace` is device memory of at least the prepared size (the node's scratch memory, so that
// its address is the same at every run of a captured CUDA graph).
void cudnn_conv(const CudnnTarget& target, CudnnConvDirection direction, const detail::CudnnPlan& plan, const void* in,
                const void* filter, void* out, void* workspace, std::size_t workspace_bytes);

// Pooling forward (plan of kMaxPool2D or kAvgPool2D): y from x.
void cudnn_pool_forward(const CudnnTarget& target, const detail::CudnnPlan& plan, const void* x, void* y);
// Average pooling's gradient (plan of kAvgPool2DGrad): dx from dy. cuDNN's interface also takes
// the forward input and output, which average pooling does not read; x_like and dy stand in.
void cudnn_avg_pool_backward(const CudnnTarget& target, const detail::CudnnPlan& plan, const void* x_like,
                             const void* dy, void* dx);

}  // namespace tandem::ops::cuda
