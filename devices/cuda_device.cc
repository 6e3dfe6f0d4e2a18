// The CUDA device: cudaMalloc'd memory, one non-blocking compute stream, synchronous copies.
// A caching allocator, a communication stream and asynchronous copies come with the GPU backend.
#include "tandem/devices/detail/cuda_device.h"

#include <cuda_runtime_api.h>

#include "tandem/base/errors.h"
#include "tandem/devices/detail/cuda_check.h"

namespace tandem::devices::detail {
namespace {

DeviceName gpu_name(int index) {
  DeviceName name;
  name.type = DeviceType::kGPU;
  name.index = index;
  return name;
}

class CudaAllocator final : public Allocator {
 public:
  CudaAllocator(int index, std::string name) : index_(index), name_(std::move(name)) {}
  void* allocate(std::size_t bytes, std::size_t /*alignment: cudaMalloc gives 256*/) override {
    ScopedCudaDevice guard(index_, name_);
    void* pointer = nullptr;
    const cudaError_t status = cudaMalloc(&pointer, bytes == 0 ? 1 : bytes);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the sticky-free error so later calls work
      std::size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      throw ResourceExhausted(fmt::format("{}: out of GPU memory allocating {} bytes ({} free of {})", name_,
                                          bytes, free_bytes, total_bytes));
    }
    TANDEM_CUDA_CHECK(status, name_);
    record_allocation(bytes);
    return pointer;
  }
  void deallocate(void* pointer, std::size_t bytes) noexcept override {
    if (pointer == nullptr) return;
    cudaFree(pointer);
    record_deallocation(bytes);
  }

 private:
  int index_;
  std::string name_;
};

class CudaStream final : public Stream {
 public:
  CudaStream(int index, std::string name) : index_(index), name_(std::move(name)) {
    ScopedCudaDevice guard(index_, name_);
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), name_);
  }
  ~CudaStream() override { cudaStreamDestroy(stream_); }
  void synchronize() override { TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_), name_); }
  void* native_handle() const override { return stream_; }
  cudaStream_t get() const { return stream_; }

 private:
  int index_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int index)
      : Device(gpu_name(index)),
        allocator_(index, gpu_name(index).short_form()),
        stream_(index, gpu_name(index).short_form()) {}

  Allocator& allocator() override { return allocator_; }
  Stream& compute_stream() override { return stream_; }
  bool host_accessible() const override { return false; }

  void copy_from_host(void* device_dst, const void* host_src, std::size_t bytes) override {
    copy(device_dst, host_src, bytes, cudaMemcpyHostToDevice);
  }
  void copy_to_host(void* host_dst, const void* device_src, std::size_t bytes) override {
    copy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost);
  }
  void copy_on_device(void* device_dst, const void* device_src, std::size_t bytes) override {
    copy(device_dst, device_src, bytes, cudaMemcpyDeviceToDevice);
  }
  void fill_zero(void* device_dst, std::size_t bytes) override {
    if (bytes == 0) return;
    ScopedCudaDevice guard(index(), short_name());
    TANDEM_CUDA_CHECK(cudaMemsetAsync(device_dst, 0, bytes, stream_.get()), short_name());
    stream_.synchronize();
  }
  void synchronize() override {
    ScopedCudaDevice guard(index(), short_name());
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize(), short_name());
  }

 private:
  void copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return;
    ScopedCudaDevice guard(index(), short_name());
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream_.get()), short_name());
    stream_.synchronize();
  }

  CudaAllocator allocator_;
  CudaStream stream_;
};

}  // namespace

CudaDiscovery discover_cuda_devices() {
  CudaDiscovery result;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    const bool no_driver = status == cudaErrorInsufficientDriver || status == cudaErrorNoDevice ||
                           status == cudaErrorInitializationError;
    result.message = fmt::format("{} ({}: {})", no_driver ? "no usable CUDA driver or device" : "CUDA unavailable",
                                 cudaGetErrorName(status), cudaGetErrorString(status));
    return result;
  }
  result.count = count;
  std::string names;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) == cudaSuccess) {
      names += fmt::format("{}{} (sm_{}{})", i == 0 ? "" : ", ", prop.name, prop.major, prop.minor);
    }
  }
  result.message = fmt::format("{} CUDA device(s){}{}", count, count > 0 ? ": " : "", names);
  return result;
}

std::unique_ptr<Device> make_cuda_device(int index) { return std::make_unique<CudaDevice>(index); }

}  // namespace tandem::devices::detail
