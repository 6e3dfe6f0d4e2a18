// The CUDA device: memory from a caching allocator over cudaMalloc, a compute and a communication
// stream (non-blocking), events between them, page-locked staging memory and asynchronous
// host-to-device copies. Blocking copies run on the compute stream, so they see its kernels' results.
#include "tandem/devices/detail/cuda_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "tandem/base/errors.h"
#include "tandem/devices/detail/caching_allocator.h"
#include "tandem/devices/detail/cuda_check.h"

namespace tandem::devices::detail {
namespace {

DeviceName gpu_name(int index) {
  DeviceName name;
  name.type = DeviceType::kGPU;
  name.index = index;
  return name;
}

// cudaMalloc / cudaFree under the caching allocator. cudaMalloc's out-of-memory error is
// cleared (it is not sticky) and reported as nullptr, so the cache can be flushed and retried.
class CudaRawMemory final : public RawDeviceMemory {
 public:
  CudaRawMemory(int index, std::string name) : index_(index), name_(std::move(name)) {}
  void* allocate(std::size_t bytes) override {
    ScopedCudaDevice guard(index_, name_);
    void* pointer = nullptr;
    const cudaError_t status = cudaMalloc(&pointer, bytes);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;
    }
    TANDEM_CUDA_CHECK(status, name_);
    return pointer;
  }
  void free(void* pointer, std::size_t /*bytes*/) noexcept override {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(index_);
    cudaFree(pointer);
    cudaSetDevice(previous);
  }
  std::pair<std::size_t, std::size_t> memory_info() override {
    ScopedCudaDevice guard(index_, name_);
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) cudaGetLastError();
    return {free_bytes, total_bytes};
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

cudaStream_t native(Stream& stream) { return static_cast<cudaStream_t>(stream.native_handle()); }

// Timing off: an event without timing is a lighter synchronisation object.
class CudaEvent final : public Event {
 public:
  CudaEvent(int index, std::string name) : index_(index), name_(std::move(name)) {
    ScopedCudaDevice guard(index_, name_);
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), name_);
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  void record(Stream& stream) override {
    ScopedCudaDevice guard(index_, name_);
    TANDEM_CUDA_CHECK(cudaEventRecord(event_, native(stream)), name_);
  }
  void wait(Stream& stream) override {
    ScopedCudaDevice guard(index_, name_);
    TANDEM_CUDA_CHECK(cudaStreamWaitEvent(native(stream), event_, 0), name_);
  }
  void synchronize() override { TANDEM_CUDA_CHECK(cudaEventSynchronize(event_), name_); }
  bool done() override {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    TANDEM_CUDA_CHECK(status, name_);
    return true;
  }

 private:
  int index_;
  std::string name_;
  cudaEvent_t event_ = nullptr;
};

class CudaGraphWork final : public CapturedWork {
 public:
  CudaGraphWork(int index, std::string name, cudaGraph_t graph, cudaGraphExec_t exec, cudaStream_t stream)
      : index_(index), name_(std::move(name)), graph_(graph), exec_(exec), stream_(stream) {}
  ~CudaGraphWork() override {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  void replay() override {
    ScopedCudaDevice guard(index_, name_);
    TANDEM_CUDA_CHECK(cudaGraphLaunch(exec_, stream_), name_);
  }

 private:
  int index_;
  std::string name_;
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int index)
      : Device(gpu_name(index)),
        allocator_(gpu_name(index).short_form(), std::make_unique<CudaRawMemory>(index, gpu_name(index).short_form())),
        compute_(index, gpu_name(index).short_form()),
        communication_(index, gpu_name(index).short_form()),
        input_(index, gpu_name(index).short_form()) {}

  Allocator& allocator() override { return allocator_; }
  Stream& compute_stream() override { return compute_; }
  Stream& communication_stream() override { return communication_; }
  Stream& input_stream() override { return input_; }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(index(), short_name()); }
  // Relaxed mode: the caching allocator may still call cudaMalloc on a cache miss while recording
  // (an allocation is not stream work, so the graph does not hold it).
  std::unique_ptr<CapturedWork> capture(FunctionRef<void()> work, std::string* why) override {
    ScopedCudaDevice guard(index(), short_name());
    const cudaStream_t stream = compute_.get();
    TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), short_name());
    std::string failure;
    try {
      work();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    if (failure.empty() && ended != cudaSuccess) {
      failure = fmt::format("cudaStreamEndCapture: {} ({})", cudaGetErrorName(ended), cudaGetErrorString(ended));
    }
    cudaGraphExec_t exec = nullptr;
    if (failure.empty()) {
      const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
      if (made != cudaSuccess) {
        failure = fmt::format("cudaGraphInstantiate: {} ({})", cudaGetErrorName(made), cudaGetErrorString(made));
      }
    }
    if (!failure.empty()) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      cudaGetLastError();  // a failed capture leaves an error set: clear it, the device is fine
      if (why != nullptr) *why = failure;
      return nullptr;
    }
    return std::make_unique<CudaGraphWork>(index(), short_name(), graph, exec, stream);
  }
  bool host_accessible() const override { return false; }

  void copy_from_host(void* device_dst, const void* host_src, std::size_t bytes) override {
    copy(device_dst, host_src, bytes, cudaMemcpyHostToDevice);
  }
  void copy_to_host(void* host_dst, const void* device_src, std::size_t bytes) override {
    copy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost);
  }
  // Ordered on the compute stream like a kernel, without waiting: nothing on the host depends on
  // it until a copy to the host, which synchronises.
  void copy_on_device(void* device_dst, const void* device_src, std::size_t bytes) override {
    if (bytes == 0) return;
    ScopedCudaDevice guard(index(), short_name());
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(device_dst, device_src, bytes, cudaMemcpyDeviceToDevice, compute_.get()),
                      short_name());
  }
  void copy_from_host_async(void* device_dst, const void* host_src, std::size_t bytes, Stream& stream) override {
    if (bytes == 0) return;
    ScopedCudaDevice guard(index(), short_name());
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, native(stream)),
                      short_name());
  }
  void copy_to_host_async(void* host_dst, const void* device_src, std::size_t bytes, Stream& stream) override {
    if (bytes == 0) return;
    ScopedCudaDevice guard(index(), short_name());
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, native(stream)),
                      short_name());
  }
  void* allocate_pinned_host(std::size_t bytes) override {
    ScopedCudaDevice guard(index(), short_name());
    void* pointer = nullptr;
    const cudaError_t status = cudaHostAlloc(&pointer, std::max<std::size_t>(bytes, 1), cudaHostAllocPortable);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw ResourceExhausted(
          fmt::format("{}: out of page-locked host memory allocating {} bytes", short_name(), bytes));
    }
    TANDEM_CUDA_CHECK(status, short_name());
    return pointer;
  }
  void free_pinned_host(void* pointer, std::size_t /*bytes*/) noexcept override {
    if (pointer != nullptr) cudaFreeHost(pointer);
  }
  void fill_zero(void* device_dst, std::size_t bytes) override {
    if (bytes == 0) return;
    ScopedCudaDevice guard(index(), short_name());
    TANDEM_CUDA_CHECK(cudaMemsetAsync(device_dst, 0, bytes, compute_.get()), short_name());
  }
  void synchronize() override {
    ScopedCudaDevice guard(index(), short_name());
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize(), short_name());
  }

 private:
  void copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return;
    ScopedCudaDevice guard(index(), short_name());
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, compute_.get()), short_name());
    compute_.synchronize();
  }

  CachingAllocator allocator_;
  CudaStream compute_;
  CudaStream communication_;
  CudaStream input_;
};

}  // namespace

CudaDiscovery discover_cuda_devices() {
  CudaDiscovery result;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    const bool no_driver =
        status == cudaErrorInsufficientDriver || status == cudaErrorNoDevice || status == cudaErrorInitializationError;
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
