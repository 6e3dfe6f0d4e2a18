// The process's devices: created once, on first use, from the logical device configuration.
#include <sched.h>

#include <memory>
#include <mutex>
#include <thread>

#include "tandem/base/env.h"
#include "tandem/base/errors.h"
#include "tandem/base/log.h"
#include "tandem/devices/detail/cpu_device.h"
#include "tandem/devices/detail/cuda_device.h"
#include "tandem/devices/device.h"

namespace tandem::devices {
namespace {

// More logical CPU devices than this is a typo, not a configuration (the environment variable's
// range says the same).
constexpr int kMaxCpuDevices = static_cast<int>(env::kNumCpuDevices.max);

struct Registry {
  std::mutex mutex;
  bool created = false;
  std::optional<LogicalDeviceConfiguration> configured;
  // Whether the layout was somebody's choice when the devices were created (a configuration, or
  // TANDEM_NUM_CPU_DEVICES), rather than the default one device.
  bool layout_chosen = false;
  std::vector<std::unique_ptr<Device>> cpus;
  std::vector<std::unique_ptr<Device>> gpus;
  // GPU discovery, done once, before the CPU devices when a strategy asks (num_gpus).
  std::optional<detail::CudaDiscovery> discovery;
};

// Deliberately never destroyed: device threads must outlive every static destructor that might
// still free a tensor at exit.
Registry& registry() {
  static auto* instance = new Registry;
  return *instance;
}

void validate(const LogicalDeviceConfiguration& config) {
  TANDEM_REQUIRE(config.num_cpu_devices >= 1 && config.num_cpu_devices <= kMaxCpuDevices, InvalidArgument,
                 "LogicalDeviceConfiguration.num_cpu_devices is {}; expected 1 to {}", config.num_cpu_devices,
                 kMaxCpuDevices);
  TANDEM_REQUIRE(config.memory_limit_bytes >= 0, InvalidArgument,
                 "LogicalDeviceConfiguration.memory_limit_bytes is {}; expected 0 (no limit) or more",
                 config.memory_limit_bytes);
  TANDEM_REQUIRE(config.intra_op_threads_per_device >= 0, InvalidArgument,
                 "LogicalDeviceConfiguration.intra_op_threads_per_device is {}; expected 0 (auto) or more",
                 config.intra_op_threads_per_device);
}

// Called with the registry mutex held.
const detail::CudaDiscovery& discovered(Registry& r) {
  if (!r.discovery) r.discovery = detail::discover_cuda_devices();
  return *r.discovery;
}

// Called with the registry mutex held.
void create_devices(Registry& r) {
  if (r.created) return;
  LogicalDeviceConfiguration config;
  if (r.configured) {
    config = *r.configured;  // an explicit API call wins over the environment
  } else {
    if (auto n = env::find_int(env::kNumCpuDevices)) config.num_cpu_devices = static_cast<int>(*n);
    if (auto t = env::find_int(env::kIntraOpThreads)) config.intra_op_threads_per_device = static_cast<int>(*t);
  }
  validate(config);
  r.layout_chosen = r.configured.has_value() || env::is_set(env::kNumCpuDevices);
  const int threads = config.intra_op_threads_per_device > 0 ? config.intra_op_threads_per_device
                                                             : std::max(1, usable_cpu_cores() / config.num_cpu_devices);
  for (int i = 0; i < config.num_cpu_devices; ++i) {
    r.cpus.push_back(std::make_unique<detail::CpuDevice>(i, threads, config.memory_limit_bytes));
  }
  const auto& discovery = discovered(r);
  for (int i = 0; i < discovery.count; ++i) r.gpus.push_back(detail::make_cuda_device(i));
  r.created = true;
  logging::debug("devices: {} logical CPU device(s) of {} thread(s) each; {} GPU(s) ({})", config.num_cpu_devices,
                 threads, discovery.count, discovery.message);
}

Registry& created_registry() {
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  create_devices(r);
  return r;
}

}  // namespace

int usable_cpu_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

void set_logical_device_configuration(const LogicalDeviceConfiguration& config) {
  validate(config);
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  TANDEM_REQUIRE(!r.created, FailedPrecondition,
                 "set_logical_device_configuration: devices were already created ({} CPU device(s)); "
                 "configure them before the first tensor, graph or strategy is made",
                 r.cpus.size());
  r.configured = config;
}

int default_cpu_device_count() { return std::min(usable_cpu_cores(), kMaxDefaultCpuDevices); }

bool share_cpu_cores(int num_cpu_devices, int processes_on_machine, std::string_view requester) {
  TANDEM_REQUIRE(num_cpu_devices >= 1 && processes_on_machine >= 1, InvalidArgument,
                 "{}: asked for {} logical CPU device(s) in each of {} process(es); expected at least 1 of each",
                 requester, num_cpu_devices, processes_on_machine);
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  if (r.configured && !r.created) return false;  // set_logical_device_configuration's layout stands
  if (r.created) {
    // Made before the strategy from the defaults (one device): say why the strategy gets fewer
    // replicas than it asked for, since nothing else will.
    if (!r.layout_chosen && static_cast<int>(r.cpus.size()) < num_cpu_devices) {
      logging::warn(
          "{} asked for {} logical CPU devices, but the devices were created before it (the first tensor, graph or "
          "strategy creates them) as {} CPU device(s), which it uses; make the strategy first, or set "
          "TANDEM_NUM_CPU_DEVICES (or call devices::set_logical_device_configuration) before anything else",
          requester, num_cpu_devices, r.cpus.size());
    }
    return false;
  }
  LogicalDeviceConfiguration config{.num_cpu_devices = num_cpu_devices};
  if (auto n = env::find_int(env::kNumCpuDevices)) config.num_cpu_devices = static_cast<int>(*n);
  const auto t = env::find_int(env::kIntraOpThreads);
  config.intra_op_threads_per_device =
      t ? static_cast<int>(*t) : std::max(1, usable_cpu_cores() / (processes_on_machine * config.num_cpu_devices));
  validate(config);
  r.configured = config;
  return true;
}

std::vector<Device*> list_logical_devices(std::optional<DeviceType> type) {
  auto& r = created_registry();
  std::vector<Device*> out;
  if (!type || *type == DeviceType::kCPU) {
    for (auto& d : r.cpus) out.push_back(d.get());
  }
  if (!type || *type == DeviceType::kGPU) {
    for (auto& d : r.gpus) out.push_back(d.get());
  }
  return out;
}

Device& get_device(std::string_view name_text) {
  const DeviceName name = DeviceName::parse(name_text);
  auto& r = created_registry();
  auto& list = name.type == DeviceType::kCPU ? r.cpus : r.gpus;
  const bool local = name.job == "localhost" && name.replica == 0 && name.task == 0;
  if (local && name.index < static_cast<int>(list.size())) return *list[static_cast<std::size_t>(name.index)];
  std::string known;
  for (auto* d : list_logical_devices()) known += (known.empty() ? "" : ", ") + d->short_name();
  throw NotFound(fmt::format("no local device \"{}\" ({}); local devices: {}{}", name_text, name.full(), known,
                             name.type == DeviceType::kGPU ? fmt::format(" [GPUs: {}]", r.discovery->message) : ""));
}

Device& default_cpu_device() { return *created_registry().cpus.front(); }

int num_gpus() {
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  return discovered(r).count;
}

std::string gpu_discovery_message() {
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  return discovered(r).message;
}

#if !TANDEM_HAVE_CUDA
namespace detail {
CudaDiscovery discover_cuda_devices() { return {0, "tandem was built without CUDA"}; }
std::unique_ptr<Device> make_cuda_device(int index) {
  throw Unimplemented(fmt::format("GPU:{}: tandem was built without CUDA", index));
}
}  // namespace detail
#endif

}  // namespace tandem::devices
