// cuDNN 9 through its legacy (descriptor) API, loaded with dlopen: see cudnn.h. Compiled when
// CMake found cudnn.h (cuDNN 9); cudnn_unavailable.cc replaces it otherwise.
#include "tandem/ops/cuda/cudnn.h"

#include <cudnn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <string_view>
#include <vector>

#include "tandem/base/detail/shared_library.h"
#include "tandem/base/env.h"
#include "tandem/base/errors.h"
#include "tandem/devices/detail/cuda_check.h"

static_assert(CUDNN_MAJOR == 9, "ops/cuda/cudnn.cc is written for cuDNN 9's legacy API");

namespace tandem::ops::cuda {
namespace {

using detail::CudnnDataType;
using detail::CudnnMathType;
using detail::CudnnPlan;
using detail::CudnnPoolingMode;
using detail::CudnnWindowOp;

// The plan's enums carry cuDNN's values, so that the plan needs no cuDNN header.
static_assert(static_cast<int>(CudnnDataType::kFloat) == CUDNN_DATA_FLOAT);
static_assert(static_cast<int>(CudnnDataType::kDouble) == CUDNN_DATA_DOUBLE);
static_assert(static_cast<int>(CudnnDataType::kHalf) == CUDNN_DATA_HALF);
static_assert(static_cast<int>(CudnnDataType::kBFloat16) == CUDNN_DATA_BFLOAT16);
static_assert(static_cast<int>(CudnnMathType::kDefault) == CUDNN_DEFAULT_MATH);
static_assert(static_cast<int>(CudnnMathType::kTensorOp) == CUDNN_TENSOR_OP_MATH);
static_assert(static_cast<int>(CudnnMathType::kFma) == CUDNN_FMA_MATH);
static_assert(static_cast<int>(CudnnPoolingMode::kMax) == CUDNN_POOLING_MAX);
static_assert(static_cast<int>(CudnnPoolingMode::kAverageExcludePadding) ==
              CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING);

struct CudnnApi {
  decltype(&::cudnnGetVersion) get_version = nullptr;
  decltype(&::cudnnGetErrorString) error_string = nullptr;
  decltype(&::cudnnCreate) create = nullptr;
  decltype(&::cudnnSetStream) set_stream = nullptr;
  decltype(&::cudnnCreateTensorDescriptor) create_tensor = nullptr;
  decltype(&::cudnnSetTensor4dDescriptorEx) set_tensor_4d = nullptr;
  decltype(&::cudnnCreateFilterDescriptor) create_filter = nullptr;
  decltype(&::cudnnSetFilter4dDescriptor) set_filter_4d = nullptr;
  decltype(&::cudnnCreateConvolutionDescriptor) create_convolution = nullptr;
  decltype(&::cudnnSetConvolution2dDescriptor) set_convolution_2d = nullptr;
  decltype(&::cudnnSetConvolutionMathType) set_math_type = nullptr;
  decltype(&::cudnnGetConvolutionForwardAlgorithmMaxCount) forward_algorithm_count = nullptr;
  decltype(&::cudnnGetConvolutionForwardAlgorithm_v7) forward_algorithms = nullptr;
  decltype(&::cudnnGetConvolutionForwardWorkspaceSize) forward_workspace = nullptr;
  decltype(&::cudnnConvolutionForward) forward = nullptr;
  decltype(&::cudnnGetConvolutionBackwardDataAlgorithmMaxCount) backward_data_algorithm_count = nullptr;
  decltype(&::cudnnGetConvolutionBackwardDataAlgorithm_v7) backward_data_algorithms = nullptr;
  decltype(&::cudnnGetConvolutionBackwardDataWorkspaceSize) backward_data_workspace = nullptr;
  decltype(&::cudnnConvolutionBackwardData) backward_data = nullptr;
  decltype(&::cudnnGetConvolutionBackwardFilterAlgorithmMaxCount) backward_filter_algorithm_count = nullptr;
  decltype(&::cudnnGetConvolutionBackwardFilterAlgorithm_v7) backward_filter_algorithms = nullptr;
  decltype(&::cudnnGetConvolutionBackwardFilterWorkspaceSize) backward_filter_workspace = nullptr;
  decltype(&::cudnnConvolutionBackwardFilter) backward_filter = nullptr;
  decltype(&::cudnnCreatePoolingDescriptor) create_pooling = nullptr;
  decltype(&::cudnnSetPooling2dDescriptor) set_pooling_2d = nullptr;
  decltype(&::cudnnPoolingForward) pooling_forward = nullptr;
  decltype(&::cudnnPoolingBackward) pooling_backward = nullptr;
  std::size_t version = 0;
  std::string library;  // the name or path that loaded
  std::string problem;  // empty when usable
};

const CudnnApi& cudnn() {
  static const CudnnApi api = [] {
    CudnnApi a;
    if (!env::get_bool(env::kCudnn)) {
      a.problem = "turned off by TANDEM_CUDNN=0";
      return a;
    }
    const std::string path = env::get_string(env::kCudnnLibrary);
    const auto library = tandem::detail::open_first_library({path, "libcudnn.so.9", "libcudnn.so"});
    if (library.handle == nullptr) {
      a.problem = fmt::format(
          "libcudnn could not be loaded ({}); install cuDNN 9, or point TANDEM_CUDNN_LIBRARY or "
          "LD_LIBRARY_PATH at PyTorch's (site-packages/nvidia/cudnn/lib)",
          library.tried);
      return a;
    }
    a.library = library.name;
    const auto load = [&]<class Fn>(Fn& fn, const char* name) {
      tandem::detail::load_symbol(library, fn, name, a.library, &a.problem);
    };
    load(a.get_version, "cudnnGetVersion");
    load(a.error_string, "cudnnGetErrorString");
    load(a.create, "cudnnCreate");
    load(a.set_stream, "cudnnSetStream");
    load(a.create_tensor, "cudnnCreateTensorDescriptor");
    load(a.set_tensor_4d, "cudnnSetTensor4dDescriptorEx");
    load(a.create_filter, "cudnnCreateFilterDescriptor");
    load(a.set_filter_4d, "cudnnSetFilter4dDescriptor");
    load(a.create_convolution, "cudnnCreateConvolutionDescriptor");
    load(a.set_convolution_2d, "cudnnSetConvolution2dDescriptor");
    load(a.set_math_type, "cudnnSetConvolutionMathType");
    load(a.forward_algorithm_count, "cudnnGetConvolutionForwardAlgorithmMaxCount");
    load(a.forward_algorithms, "cudnnGetConvolutionForwardAlgorithm_v7");
    load(a.forward_workspace, "cudnnGetConvolutionForwardWorkspaceSize");
    load(a.forward, "cudnnConvolutionForward");
    load(a.backward_data_algorithm_count, "cudnnGetConvolutionBackwardDataAlgorithmMaxCount");
    load(a.backward_data_algorithms, "cudnnGetConvolutionBackwardDataAlgorithm_v7");
    load(a.backward_data_workspace, "cudnnGetConvolutionBackwardDataWorkspaceSize");
    load(a.backward_data, "cudnnConvolutionBackwardData");
    load(a.backward_filter_algorithm_count, "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount");
    load(a.backward_filter_algorithms, "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
    load(a.backward_filter_workspace, "cudnnGetConvolutionBackwardFilterWorkspaceSize");
    load(a.backward_filter, "cudnnConvolutionBackwardFilter");
    load(a.create_pooling, "cudnnCreatePoolingDescriptor");
    load(a.set_pooling_2d, "cudnnSetPooling2dDescriptor");
    load(a.pooling_forward, "cudnnPoolingForward");
    load(a.pooling_backward, "cudnnPoolingBackward");
    if (!a.problem.empty()) return a;
    // cuDNN 9 numbers its versions major * 10000 + minor * 100 + patch. Another major version
    // may lay out the structs declared in the header we were built with differently.
    a.version = a.get_version();
    if (a.version / 10000 != CUDNN_MAJOR) {
      a.problem =
          fmt::format("{} is version {}; this build of tandem uses cuDNN {}'s API", a.library, a.version, CUDNN_MAJOR);
    }
    return a;
  }();
  return api;
}

#define TANDEM_CUDNN_CHECK(expr, device_name) \
  do { \
    const cudnnStatus_t tandem_cudnn_status = (expr); \
    if (tandem_cudnn_status != CUDNN_STATUS_SUCCESS) [[unlikely]] { \
      throw ::tandem::Internal(::fmt::format("{}:{}: cuDNN call `{}` failed on {}: {}", __FILE__, __LINE__, #expr, \
                                             (device_name), cudnn().error_string(tandem_cudnn_status))); \
    } \
  } while (0)

std::atomic<std::uint64_t> cudnn_runs{0};
std::atomic<std::uint64_t> fallback_runs{0};

// One handle per device, made on first use with that device current. A device's kernels are
// queued by one replica thread at a time, so a handle is never used concurrently.
cudnnHandle_t handle_for(const CudnnTarget& target) {
  static std::mutex mutex;
  static std::map<int, cudnnHandle_t> handles;
  std::lock_guard lock(mutex);
  auto it = handles.find(target.device);
  if (it != handles.end()) return it->second;
  devices::detail::ScopedCudaDevice guard(target.device, target.device_name);
  cudnnHandle_t h = nullptr;
  TANDEM_CUDNN_CHECK(cudnn().create(&h), target.device_name);
  handles.emplace(target.device, h);
  return h;
}

// The handle of the target's device, bound to its stream (cuDNN queues on the handle's stream).
cudnnHandle_t bound_handle(const CudnnTarget& target) {
  const auto& api = cudnn();
  TANDEM_REQUIRE(api.problem.empty(), FailedPrecondition, "convolution or pooling through cuDNN on {}: {}",
                 target.device_name, api.problem);
  cudnnHandle_t h = handle_for(target);
  TANDEM_CUDNN_CHECK(api.set_stream(h, target.stream), target.device_name);
  return h;
}

// Every number of a plan, as a map key.
using PlanKey = std::array<int, 32>;
PlanKey plan_key(const CudnnPlan& p) {
  return {static_cast<int>(p.op),
          static_cast<int>(p.data_type),
          static_cast<int>(p.compute_type),
          static_cast<int>(p.math_type),
          p.x.n,
          p.x.c,
          p.x.h,
          p.x.w,
          p.x.n_stride,
          p.x.c_stride,
          p.x.h_stride,
          p.x.w_stride,
          p.y.n,
          p.y.c,
          p.y.h,
          p.y.w,
          p.y.n_stride,
          p.y.c_stride,
          p.y.h_stride,
          p.y.w_stride,
          p.filter.k,
          p.filter.c,
          p.filter.h,
          p.filter.w,
          static_cast<int>(p.pooling_mode),
          p.window_h,
          p.window_w,
          p.pad_h,
          p.pad_w,
          p.stride_h,
          p.stride_w,
          p.dilation_h * 65536 + p.dilation_w};
}

cudnnTensorDescriptor_t tensor_descriptor(const detail::CudnnTensor4d& t, CudnnDataType type,
                                          const std::string& device_name) {
  cudnnTensorDescriptor_t d = nullptr;
  TANDEM_CUDNN_CHECK(cudnn().create_tensor(&d), device_name);
  TANDEM_CUDNN_CHECK(cudnn().set_tensor_4d(d, static_cast<cudnnDataType_t>(type), t.n, t.c, t.h, t.w, t.n_stride,
                                           t.c_stride, t.h_stride, t.w_stride),
                     device_name);
  return d;
}

// Descriptors are made once per plan and kept for the life of the process, like the handles:
// they are host objects of a few hundred bytes, and a model has a handful of distinct shapes.
struct ConvEntry {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t filter = nullptr;
  cudnnConvolutionDescriptor_t convolution = nullptr;  // math type set to the chosen algorithm's
  bool usable = false;                                 // a qualifying algorithm was found
  int algorithm = 0;                                   // cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t
  std::size_t workspace_bytes = 0;
};

struct ConvKey {
  PlanKey plan;
  int device = 0;
  CudnnConvDirection direction = CudnnConvDirection::kForward;
  auto operator<=>(const ConvKey&) const = default;
};

// Whether an algorithm's math type keeps the precision the plan asked for: float32 without TF32
// takes only FMA kernels (what PyTorch asserts too), and float32 never takes the conversion to
// float16 that CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION permits.
bool keeps_precision(const CudnnPlan& plan, cudnnMathType_t math) {
  if (plan.data_type != CudnnDataType::kFloat) return true;
  if (plan.math_type == CudnnMathType::kFma) return math == CUDNN_FMA_MATH;
  return math != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
}

// FFT and Winograd algorithms compute in a transformed domain and lose a few bits against a
// direct sum: float32 without TF32 promises float32 accuracy (what tandem's GEMM path and the CPU
// kernels give, up to summation order), so it takes only the GEMM and direct algorithms.
bool transform_domain(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_FFT || a == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
}
bool transform_domain(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
bool transform_domain(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

// The first of cuDNN's heuristic candidates (best first) that succeeded, is deterministic, keeps
// the precision and fits the workspace cap. `workspace(algo, &bytes)` asks for its exact size.
template <class Perf, class WorkspaceFn>
void choose_algorithm(ConvEntry& entry, const CudnnPlan& plan, const std::vector<Perf>& candidates, int returned,
                      const std::string& device_name, WorkspaceFn&& workspace) {
  for (int i = 0; i < returned; ++i) {
    const Perf& p = candidates[static_cast<std::size_t>(i)];
    if (p.status != CUDNN_STATUS_SUCCESS || p.determinism != CUDNN_DETERMINISTIC ||
        !keeps_precision(plan, p.mathType) || (plan.math_type == CudnnMathType::kFma && transform_domain(p.algo))) {
      continue;
    }
    // cuDNN picks kernels by algorithm and math type together: the descriptor carries the
    // candidate's math type from here on.
    TANDEM_CUDNN_CHECK(cudnn().set_math_type(entry.convolution, p.mathType), device_name);
    std::size_t bytes = 0;
    workspace(p.algo, &bytes);
    if (bytes > kMaxCudnnWorkspaceBytes) continue;
    entry.usable = true;
    entry.algorithm = static_cast<int>(p.algo);
    entry.workspace_bytes = bytes;
    return;
  }
}

std::mutex conv_mutex;
std::map<ConvKey, ConvEntry> conv_entries;  // never erased: references stay valid

const ConvEntry& conv_entry(const CudnnTarget& target, CudnnConvDirection direction, const CudnnPlan& plan) {
  TANDEM_ASSERT(plan.use_cudnn && plan.op == CudnnWindowOp::kConv2D,
                "cuDNN convolution on {} without a convolution plan", target.device_name);
  const ConvKey key{plan_key(plan), target.device, direction};
  std::lock_guard lock(conv_mutex);
  if (auto it = conv_entries.find(key); it != conv_entries.end()) return it->second;

  const auto& api = cudnn();
  const std::string& name = target.device_name;
  cudnnHandle_t h = bound_handle(target);
  devices::detail::ScopedCudaDevice guard(target.device, name);
  ConvEntry e;
  e.x = tensor_descriptor(plan.x, plan.data_type, name);
  e.y = tensor_descriptor(plan.y, plan.data_type, name);
  TANDEM_CUDNN_CHECK(api.create_filter(&e.filter), name);
  TANDEM_CUDNN_CHECK(api.set_filter_4d(e.filter, static_cast<cudnnDataType_t>(plan.data_type), CUDNN_TENSOR_NHWC,
                                       plan.filter.k, plan.filter.c, plan.filter.h, plan.filter.w),
                     name);
  TANDEM_CUDNN_CHECK(api.create_convolution(&e.convolution), name);
  TANDEM_CUDNN_CHECK(
      api.set_convolution_2d(e.convolution, plan.pad_h, plan.pad_w, plan.stride_h, plan.stride_w, plan.dilation_h,
                             plan.dilation_w, CUDNN_CROSS_CORRELATION, static_cast<cudnnDataType_t>(plan.compute_type)),
      name);
  TANDEM_CUDNN_CHECK(api.set_math_type(e.convolution, static_cast<cudnnMathType_t>(plan.math_type)), name);

  int count = 0, returned = 0;
  switch (direction) {
    case CudnnConvDirection::kForward: {
      TANDEM_CUDNN_CHECK(api.forward_algorithm_count(h, &count), name);
      std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(static_cast<std::size_t>(std::max(count, 1)));
      TANDEM_CUDNN_CHECK(api.forward_algorithms(h, e.x, e.filter, e.convolution, e.y, count, &returned, perf.data()),
                         name);
      choose_algorithm(e, plan, perf, returned, name, [&](cudnnConvolutionFwdAlgo_t algo, std::size_t* bytes) {
        TANDEM_CUDNN_CHECK(api.forward_workspace(h, e.x, e.filter, e.convolution, e.y, algo, bytes), name);
      });
      break;
    }
    case CudnnConvDirection::kBackwardData: {
      TANDEM_CUDNN_CHECK(api.backward_data_algorithm_count(h, &count), name);
      std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(static_cast<std::size_t>(std::max(count, 1)));
      TANDEM_CUDNN_CHECK(
          api.backward_data_algorithms(h, e.filter, e.y, e.convolution, e.x, count, &returned, perf.data()), name);
      choose_algorithm(e, plan, perf, returned, name, [&](cudnnConvolutionBwdDataAlgo_t algo, std::size_t* bytes) {
        TANDEM_CUDNN_CHECK(api.backward_data_workspace(h, e.filter, e.y, e.convolution, e.x, algo, bytes), name);
      });
      break;
    }
    case CudnnConvDirection::kBackwardFilter: {
      TANDEM_CUDNN_CHECK(api.backward_filter_algorithm_count(h, &count), name);
      std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(static_cast<std::size_t>(std::max(count, 1)));
      TANDEM_CUDNN_CHECK(
          api.backward_filter_algorithms(h, e.x, e.y, e.convolution, e.filter, count, &returned, perf.data()), name);
      choose_algorithm(e, plan, perf, returned, name, [&](cudnnConvolutionBwdFilterAlgo_t algo, std::size_t* bytes) {
        TANDEM_CUDNN_CHECK(api.backward_filter_workspace(h, e.x, e.y, e.convolution, e.filter, algo, bytes), name);
      });
      break;
    }
  }
  return conv_entries.emplace(key, e).first->second;
}

struct PoolEntry {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnPoolingDescriptor_t pooling = nullptr;
};

// Pooling descriptors depend on the plan only (they are host objects, valid on every device).
const PoolEntry& pool_entry(const CudnnTarget& target, const CudnnPlan& plan) {
  TANDEM_ASSERT(plan.use_cudnn && plan.op != CudnnWindowOp::kConv2D, "cuDNN pooling on {} without a pooling plan",
                target.device_name);
  static std::mutex mutex;
  static std::map<PlanKey, PoolEntry> entries;  // never erased
  const PlanKey key = plan_key(plan);
  std::lock_guard lock(mutex);
  if (auto it = entries.find(key); it != entries.end()) return it->second;
  const auto& api = cudnn();
  const std::string& name = target.device_name;
  PoolEntry e;
  e.x = tensor_descriptor(plan.x, plan.data_type, name);
  e.y = tensor_descriptor(plan.y, plan.data_type, name);
  TANDEM_CUDNN_CHECK(api.create_pooling(&e.pooling), name);
  // NaNs do not win a max window, as in tandem's kernels (a strict > comparison).
  TANDEM_CUDNN_CHECK(
      api.set_pooling_2d(e.pooling, static_cast<cudnnPoolingMode_t>(plan.pooling_mode), CUDNN_NOT_PROPAGATE_NAN,
                         plan.window_h, plan.window_w, plan.pad_h, plan.pad_w, plan.stride_h, plan.stride_w),
      name);
  return entries.emplace(key, e).first->second;
}

// alpha = 1, beta = 0: float for float and 16-bit data (the plans never carry double).
constexpr float kOne = 1.0f;
constexpr float kZero = 0.0f;

}  // namespace

std::string cudnn_status() {
  const auto& api = cudnn();
  if (!api.problem.empty()) return api.problem;
  return fmt::format("loaded (version {}, {})", api.version, api.library);
}

bool cudnn_enabled() { return cudnn().problem.empty(); }

CudnnPathCounts cudnn_path_counts() { return {cudnn_runs.load(), fallback_runs.load()}; }

void count_cudnn_path(bool used_cudnn) {
  (used_cudnn ? cudnn_runs : fallback_runs).fetch_add(1, std::memory_order_relaxed);
}

std::optional<std::size_t> cudnn_conv_prepare(const CudnnTarget& target, CudnnConvDirection direction,
                                              const CudnnPlan& plan) {
  const ConvEntry& e = conv_entry(target, direction, plan);
  if (!e.usable) return std::nullopt;
  return e.workspace_bytes;
}

void cudnn_conv(const CudnnTarget& target, CudnnConvDirection direction, const CudnnPlan& plan, const void* in,
                const void* filter, void* out, void* workspace, std::size_t workspace_bytes) {
  const ConvEntry& e = conv_entry(target, direction, plan);
  TANDEM_ASSERT(e.usable && workspace_bytes >= e.workspace_bytes,
                "cuDNN convolution on {}: not prepared, or a workspace of {} bytes where {} are needed",
                target.device_name, workspace_bytes, e.workspace_bytes);
  const auto& api = cudnn();
  const std::string& name = target.device_name;
  cudnnHandle_t h = bound_handle(target);
  devices::detail::ScopedCudaDevice guard(target.device, name);
  switch (direction) {
    case CudnnConvDirection::kForward:
      TANDEM_CUDNN_CHECK(api.forward(h, &kOne, e.x, in, e.filter, filter, e.convolution,
                                     static_cast<cudnnConvolutionFwdAlgo_t>(e.algorithm), workspace, workspace_bytes,
                                     &kZero, e.y, out),
                         name);
      break;
    case CudnnConvDirection::kBackwardData:
      TANDEM_CUDNN_CHECK(api.backward_data(h, &kOne, e.filter, filter, e.y, in, e.convolution,
                                           static_cast<cudnnConvolutionBwdDataAlgo_t>(e.algorithm), workspace,
                                           workspace_bytes, &kZero, e.x, out),
                         name);
      break;
    case CudnnConvDirection::kBackwardFilter:
      TANDEM_CUDNN_CHECK(api.backward_filter(h, &kOne, e.x, in, e.y, filter, e.convolution,
                                             static_cast<cudnnConvolutionBwdFilterAlgo_t>(e.algorithm), workspace,
                                             workspace_bytes, &kZero, e.filter, out),
                         name);
      break;
  }
}

void cudnn_pool_forward(const CudnnTarget& target, const CudnnPlan& plan, const void* x, void* y) {
  const PoolEntry& e = pool_entry(target, plan);
  cudnnHandle_t h = bound_handle(target);
  devices::detail::ScopedCudaDevice guard(target.device, target.device_name);
  TANDEM_CUDNN_CHECK(cudnn().pooling_forward(h, e.pooling, &kOne, e.x, x, &kZero, e.y, y), target.device_name);
}

void cudnn_avg_pool_backward(const CudnnTarget& target, const CudnnPlan& plan, const void* x_like, const void* dy,
                             void* dx) {
  TANDEM_ASSERT(plan.pooling_mode == CudnnPoolingMode::kAverageExcludePadding,
                "cuDNN's pooling gradient on {} is used for average pooling only", target.device_name);
  const PoolEntry& e = pool_entry(target, plan);
  cudnnHandle_t h = bound_handle(target);
  devices::detail::ScopedCudaDevice guard(target.device, target.device_name);
  TANDEM_CUDNN_CHECK(cudnn().pooling_backward(h, e.pooling, &kOne, e.y, dy, e.y, dy, e.x, x_like, &kZero, e.x, dx),
                     target.device_name);
}

}  // namespace tandem::ops::cuda
