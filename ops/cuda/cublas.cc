#include "tandem/ops/cuda/cublas.h"

#include <cublas_v2.h>

#include <map>
#include <mutex>

#include "tandem/base/detail/shared_library.h"
#include "tandem/base/errors.h"
#include "tandem/devices/detail/cuda_check.h"
#include "tandem/ops/cuda/element_math.h"
#include "tandem/ops/math_ops.h"

namespace tandem::ops::cuda {
namespace {

struct CublasApi {
  decltype(&::cublasCreate_v2) create = nullptr;
  decltype(&::cublasSetStream_v2) set_stream = nullptr;
  // cublasGemmEx is overloaded in C++ (a deprecated cudaDataType compute type): name the C one.
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                    const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                                    cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
  GemmEx gemm_ex = nullptr;
  using GemmStridedBatchedEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                                  const void*, const void*, cudaDataType, int, long long, const void*,
                                                  cudaDataType, int, long long, const void*, void*, cudaDataType, int,
                                                  long long, int, cublasComputeType_t, cublasGemmAlgo_t);
  GemmStridedBatchedEx gemm_strided_batched_ex = nullptr;
  decltype(&::cublasGetStatusName) status_name = nullptr;
  std::string problem;  // empty when loaded
};

const CublasApi& cublas() {
  static const CublasApi api = [] {
    CublasApi a;
    const auto library = tandem::detail::open_first_library({"libcublas.so.13", "libcublas.so.12", "libcublas.so"});
    if (library.handle == nullptr) {
      a.problem = fmt::format("libcublas could not be loaded ({}); it comes with the CUDA toolkit", library.tried);
      return a;
    }
    const auto load = [&]<class Fn>(Fn& fn, const char* name) {
      tandem::detail::load_symbol(library, fn, name, "libcublas", &a.problem);
    };
    load(a.create, "cublasCreate_v2");
    load(a.set_stream, "cublasSetStream_v2");
    load(a.gemm_ex, "cublasGemmEx");
    load(a.gemm_strided_batched_ex, "cublasGemmStridedBatchedEx");
    load(a.status_name, "cublasGetStatusName");
    return a;
  }();
  return api;
}

#define TANDEM_CUBLAS_CHECK(expr, device_name) \
  do { \
    const cublasStatus_t tandem_cublas_status = (expr); \
    if (tandem_cublas_status != CUBLAS_STATUS_SUCCESS) [[unlikely]] { \
      throw ::tandem::Internal(::fmt::format("{}:{}: cuBLAS call `{}` failed on {}: {}", __FILE__, __LINE__, #expr, \
                                             (device_name), cublas().status_name(tandem_cublas_status))); \
    } \
  } while (0)

// One handle per device, made on first use with that device current. A device's kernels are
// queued by one replica thread at a time, so a handle is never used concurrently.
cublasHandle_t handle_for(int device, const std::string& name) {
  static std::mutex mutex;
  static std::map<int, cublasHandle_t> handles;
  std::lock_guard lock(mutex);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  devices::detail::ScopedCudaDevice guard(device, name);
  cublasHandle_t h = nullptr;
  TANDEM_CUBLAS_CHECK(cublas().create(&h), name);
  handles.emplace(device, h);
  return h;
}

}  // namespace

void gemm(int device, const std::string& device_name, cudaStream_t stream, const GemmCall& call) {
  const auto& api = cublas();
  TANDEM_REQUIRE(api.problem.empty(), FailedPrecondition, "MatMul on {} needs cuBLAS: {}", device_name, api.problem);
  cublasHandle_t h = handle_for(device, device_name);
  devices::detail::ScopedCudaDevice guard(device, device_name);
  TANDEM_CUBLAS_CHECK(api.set_stream(h, stream), device_name);
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T (element_math.h).
  const ColumnMajorGemm cm =
      column_major_gemm(call.transpose_a, call.transpose_b, call.m, call.n, call.k, call.lda, call.ldb);
  const cublasOperation_t op_b = cm.transpose_first ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = cm.transpose_second ? CUBLAS_OP_T : CUBLAS_OP_N;
  const auto m = static_cast<int>(cm.m), n = static_cast<int>(cm.n), k = static_cast<int>(cm.k);
  const auto ld_b = static_cast<int>(cm.ld_first), ld_a = static_cast<int>(cm.ld_second),
             ld_c = static_cast<int>(cm.ldc);
  // Column-major, the batch strides stay those of the row-major operands (B is cuBLAS's first).
  const auto run = [&](const void* alpha, const void* beta, cudaDataType type, cublasComputeType_t compute) {
    if (call.batch == 1) {
      TANDEM_CUBLAS_CHECK(api.gemm_ex(h, op_b, op_a, m, n, k, alpha, call.b, type, ld_b, call.a, type, ld_a, beta,
                                      call.c, type, ld_c, compute, CUBLAS_GEMM_DEFAULT),
                          device_name);
      return;
    }
    TANDEM_CUBLAS_CHECK(
        api.gemm_strided_batched_ex(h, op_b, op_a, m, n, k, alpha, call.b, type, ld_b, call.stride_b, call.a, type,
                                    ld_a, call.stride_a, beta, call.c, type, ld_c, call.m * call.n,
                                    static_cast<int>(call.batch), compute, CUBLAS_GEMM_DEFAULT),
        device_name);
  };
  if (call.dtype == graph::DType::kF64) {
    const double one = 1.0, zero = 0.0;
    run(&one, &zero, CUDA_R_64F, CUBLAS_COMPUTE_64F);
    return;
  }
  cudaDataType_t type = CUDA_R_32F;
  cublasComputeType_t compute = tensor_float_32_execution_enabled() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  if (call.dtype == graph::DType::kF16) {
    type = CUDA_R_16F;
    compute = CUBLAS_COMPUTE_32F;
  } else if (call.dtype == graph::DType::kBF16) {
    type = CUDA_R_16BF;
    compute = CUBLAS_COMPUTE_32F;
  }
  const float one = 1.0f, zero = 0.0f;
  run(&one, &zero, type, compute);
}

}  // namespace tandem::ops::cuda
