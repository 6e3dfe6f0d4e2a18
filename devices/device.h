// tandem/devices/device.h — where tensors live and kernels run.
//
// A Device is one place that holds memory and runs kernels: a CPU logical device or a CUDA GPU.
// Devices are created once per process, on first use, and live until the process ends; callers
// hold plain references. Names follow TensorFlow:
//   full   /job:localhost/replica:0/task:0/device:CPU:0
//   short  CPU:0     (also accepted: /device:CPU:0, /cpu:0, gpu:1)
//
// Logical CPU devices. Like TF's tf.config.set_logical_device_configuration, one physical CPU can
// be split into N logical devices, so that a MirroredStrategy runs N replicas on one machine
// without a GPU. Each logical device owns its share of the cores (cores / N intra-op threads, at
// least one), so N replicas never oversubscribe the machine. Configure before the first device
// is used, with set_logical_device_configuration() or the environment:
//   TANDEM_NUM_CPU_DEVICES=4      four logical CPU devices
//   TANDEM_INTRA_OP_THREADS=1     threads per logical CPU device (default: cores / devices)
// Otherwise one device takes every core, unless a strategy made before the first device asks for
// a layout of its own (share_cpu_cores: MirroredStrategy's default on a machine without GPUs, one
// device per core; MultiWorkerMirroredStrategy, the workers' share of the cores).
//
// GPUs are discovered at run time. No CUDA driver, no device, or a build without CUDA all mean
// zero GPUs, never a crash; gpu_discovery_message() says which.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/base/function_ref.h"
#include "tandem/devices/allocator.h"
#include "tandem/devices/device_name.h"

namespace tandem::devices {

// An ordered queue of device work. On a CPU device work runs inline on the calling thread, so
// synchronize() returns at once; on a GPU it wraps a cudaStream_t.
class Stream {
 public:
  virtual ~Stream() = default;
  // Blocks the calling thread until everything queued so far has finished.
  virtual void synchronize() = 0;
  // The backend's handle (cudaStream_t on GPUs), nullptr on CPU.
  virtual void* native_handle() const = 0;
};

class Device;

// A point in a stream's work (cudaEvent_t): record it on one stream, make another wait for it, or
// block the host until it is reached. On CPU devices streams run inline, so every recorded event
// is already reached.
class Event {
 public:
  virtual ~Event() = default;
  // Captures the work queued on `stream` so far. Callers: the thread that owns the stream.
  virtual void record(Stream& stream) = 0;
  // Work queued on `stream` from now on starts after the recorded point. Does not block the host.
  virtual void wait(Stream& stream) = 0;
  // Blocks the calling thread until the recorded point is reached.
  virtual void synchronize() = 0;
  // Whether the recorded point has been reached (never blocks).
  virtual bool done() = 0;
};

// Device work recorded once and replayed (a CUDA graph): see Device::capture.
class CapturedWork {
 public:
  virtual ~CapturedWork() = default;
  // Queues the recorded work again, on the stream it was recorded from. Does not block. Callers:
  // the thread that owns that stream.
  virtual void replay() = 0;
};

// Page-locked host memory for a device's asynchronous copies (cudaHostAlloc on GPUs, ordinary
// aligned memory on CPUs): a copy from it overlaps compute, where one from pageable memory is
// staged by the driver and blocks. Freed when the buffer goes away; the caller makes sure no copy
// still reads it (synchronize an Event recorded after the copy).
class PinnedHostBuffer {
 public:
  PinnedHostBuffer() = default;
  PinnedHostBuffer(Device& device, std::size_t bytes);
  ~PinnedHostBuffer();
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const DeviceName& name() const { return name_; }
  DeviceType type() const { return name_.type; }
  int index() const { return name_.index; }
  // "/job:localhost/replica:0/task:0/device:CPU:0"
  std::string full_name() const { return name_.full(); }
  // "CPU:0"
  std::string short_name() const { return name_.short_form(); }

  virtual Allocator& allocator() = 0;
  // Kernels run in order on the compute stream. Collectives run on the communication stream,
  // made to wait (with an Event) for the compute work that produced their inputs, so that
  // all-reduces overlap backward. On CPU devices both are the same inline stream.
  virtual Stream& compute_stream() = 0;
  virtual Stream& communication_stream() { return compute_stream(); }
  // Host-to-device copies of input batches staged ahead of their step (strategy's
  // fetch_to_device), so that they overlap the kernels of the step before; the compute stream
  // waits for them with an Event.
  virtual Stream& input_stream() { return compute_stream(); }
  virtual std::unique_ptr<Event> create_event();
  // Records the device work `work` queues on the compute stream, without running it, for replay
  // (CUDA graphs: cudaStreamBeginCapture ... cudaGraphInstantiate). Returns null, with the reason
  // in *why, where the device cannot capture (CPUs) or when `work` did something a capture cannot
  // hold (it synchronised, or threw): the device stays usable, and the caller runs the work
  // normally instead. Callers: the thread that owns the compute stream.
  virtual std::unique_ptr<CapturedWork> capture(FunctionRef<void()> work, std::string* why);
  // True when the host can read and write this device's memory directly (CPU devices).
  virtual bool host_accessible() const = 0;

  // Copies. Callers: any thread that owns the memory involved. Copies that touch host memory
  // block until they are complete (the host side may be freed or read at once). Copies within the
  // device and fill_zero are queued on the compute stream and return at once on GPUs, ordered
  // like kernels: a later kernel or host read (copy_to_host) sees their result, and they can be
  // recorded in a CUDA graph.
  virtual void copy_from_host(void* device_dst, const void* host_src, std::size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* device_src, std::size_t bytes) = 0;
  virtual void copy_on_device(void* device_dst, const void* device_src, std::size_t bytes) = 0;
  virtual void fill_zero(void* device_dst, std::size_t bytes) = 0;

  // A host-to-device copy queued on `stream`, returning at once on GPUs (immediately done on
  // CPUs). The source must stay unchanged until the copy has run: record an Event after it.
  // From a PinnedHostBuffer the copy overlaps kernels on other streams (the input pipeline's
  // next batch while this one computes). Callers: the thread that owns `stream`.
  virtual void copy_from_host_async(void* device_dst, const void* host_src, std::size_t bytes, Stream& stream);
  // A device-to-host copy queued on `stream`, returning at once on GPUs (done at once on CPUs):
  // several small reads then cost one synchronisation instead of one each. The destination must
  // stay valid, and is not to be read, until the copy has run (synchronize the stream or an
  // Event recorded after it); into a PinnedHostBuffer the copy is direct.
  virtual void copy_to_host_async(void* host_dst, const void* device_src, std::size_t bytes, Stream& stream);
  // Page-locked host memory; use PinnedHostBuffer rather than these.
  virtual void* allocate_pinned_host(std::size_t bytes);
  virtual void free_pinned_host(void* pointer, std::size_t bytes) noexcept;

  // Blocks until all work queued on this device's streams has finished.
  virtual void synchronize() = 0;

  // Intra-op parallelism (CPU devices). parallel_for splits [0, n) into chunks of at least
  // min_grain items and calls fn(begin, end) for each, on this device's threads, the calling
  // thread included; it returns when every chunk is done and rethrows the first exception a
  // chunk threw. A nested or concurrent call on the same device runs inline on its caller.
  // On devices without host threads (GPUs) it runs inline.
  virtual int intra_op_threads() const { return 1; }
  virtual void parallel_for(std::int64_t n, std::int64_t min_grain, FunctionRef<void(std::int64_t, std::int64_t)> fn);

 protected:
  explicit Device(DeviceName name) : name_(std::move(name)) {}

 private:
  DeviceName name_;
};

// How the process's CPU is divided into logical devices. Set before the first device is used.
struct LogicalDeviceConfiguration {
  int num_cpu_devices = 1;
  int intra_op_threads_per_device = 0;  // 0: the usable cores divided among the CPU devices
  // The most bytes each CPU device may hold at once (TF's LogicalDeviceConfiguration.memory_limit,
  // in bytes here): an allocation past it throws ResourceExhausted naming the device, the request
  // and the limit. 0: no limit. It lets one machine stand for devices of a given memory size (a
  // model that fits sharded across replicas but not replicated on each).
  std::int64_t memory_limit_bytes = 0;
};

// Fixes the CPU device layout. Throws FailedPrecondition once devices have been created
// (TF raises the same), InvalidArgument for counts below 1.
void set_logical_device_configuration(const LogicalDeviceConfiguration& config);

// How many logical CPU devices MirroredStrategy's default makes on a machine without GPUs: one per
// usable core, up to this many (beyond it, more replicas add synchronisation and little speed for
// the models a CPU trains; the cores are then shared out among the devices).
inline constexpr int kMaxDefaultCpuDevices = 8;
// min(usable_cpu_cores(), kMaxDefaultCpuDevices).
int default_cpu_device_count();

// A strategy's request for a CPU layout, applied only when nobody chose one: `num_cpu_devices`
// devices (TANDEM_NUM_CPU_DEVICES wins when set), each with this process's share of the usable
// cores, split among `processes_on_machine` processes (TANDEM_INTRA_OP_THREADS wins when set).
// Does nothing once the layout is fixed: set_logical_device_configuration was called, or the
// devices exist (the first tensor, graph or strategy creates them). Then, when they were created
// from the defaults and give fewer CPU devices than asked, it logs a warning naming `requester`
// and how to get the layout. Returns whether the request took effect. Throws InvalidArgument for
// counts below 1. Callers: strategy constructors, before they look their devices up.
bool share_cpu_cores(int num_cpu_devices, int processes_on_machine, std::string_view requester);

// All local devices, CPUs first, then GPUs; or only those of `type`. Creates them on first call.
std::vector<Device*> list_logical_devices(std::optional<DeviceType> type = std::nullopt);

// The local device with this name (any accepted form). Throws InvalidArgument for a malformed
// name and NotFound for a well-formed name that is not a local device (the message lists them).
Device& get_device(std::string_view name);

// The first CPU device: where tensors go when no device is given.
Device& default_cpu_device();

// GPUs found (zero without CUDA). Unlike the functions above it leaves the CPU layout open, so a
// strategy can ask whether there are GPUs before it asks for a CPU layout.
int num_gpus();
// Why the GPU count is what it is: "2 CUDA devices", "no CUDA driver (…)", "built without CUDA".
std::string gpu_discovery_message();

// Cores this process may run on (its CPU affinity mask), at least 1.
int usable_cpu_cores();

}  // namespace tandem::devices
