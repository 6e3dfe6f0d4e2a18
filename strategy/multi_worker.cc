// MultiWorkerMirroredStrategy: the rendezvous, the two Gloo groups, and the worker's share of
// the data.
//
// Two cross-worker communicators, on separate Gloo connections, so that they never interleave:
//   data:    the gradient buckets and layer updates, issued by local replica 0 (possibly from its
//            communication thread while backward runs), inside the hierarchical group;
//   control: everything fit does between steps on the thread that called fit: variable
//            agreement at creation, the metric sums of steps with no gradient collective to ride
//            in (evaluation, micro-steps), the FILE and OFF policies' agreement on a batch when
//            no step carried it, BackupAndRestore's broadcast.
// A training step's log sums, moving statistics and next-batch agreement ride in its last
// gradient collective (the trainer and WorkerBatch::rider), so a step costs one collective.
#include "tandem/strategy/multi_worker.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "tandem/base/env.h"
#include "tandem/base/errors.h"
#include "tandem/collective/gloo.h"
#include "tandem/collective/hierarchical.h"
#include "tandem/collective/in_process.h"
#include "tandem/collective/nccl.h"
#include "tandem/collective/rendezvous.h"
#include "tandem/collective/shared_memory.h"
#include "tandem/collective/tcp_store.h"

namespace tandem::strategy {
namespace {

using Clock = std::chrono::steady_clock;

// How long the destructor waits for the other workers to arrive at the closing barrier: a
// worker that returns from its last collective must not close its connections while a slower
// peer still reads from them, but a job that failed must not linger.
constexpr auto kClosingBarrierTimeout = std::chrono::seconds(30);
// The variable descriptor compared across workers at creation: name, dtype and shape, as text.
constexpr std::size_t kDescriptorBytes = 256;
// The facts compared before fit (check_workers_agree), as text.
constexpr std::size_t kFactsBytes = 1024;

std::chrono::milliseconds collective_timeout(const CommunicationOptions& options) {
  if (options.timeout_seconds <= 0) return collective::kDefaultTimeout;
  return std::chrono::milliseconds(static_cast<std::int64_t>(options.timeout_seconds * 1000.0));
}

// A Gloo group's options: CommunicationOptions::deterministic picks the all-reduce's order.
collective::GlooOptions gloo_options(collective::GlooOptions options, const CommunicationOptions& communication) {
  options.bytes_per_pack = communication.bytes_per_pack;
  options.all_reduce_algorithm = communication.deterministic ? collective::GlooAllReduceAlgorithm::kRankOrdered
                                                             : collective::GlooAllReduceAlgorithm::kRing;
  return options;
}

// The options of one worker's communicator to the others (GlooOptions, SharedMemoryOptions,
// NcclProcessOptions): the five fields every cross-process backend takes, set in one place.
template <class Options>
Options member_options(int rank, int workers, std::shared_ptr<collective::Store> store,
                       std::chrono::milliseconds timeout, const std::vector<std::string>& labels) {
  Options options;
  options.rank = rank;
  options.size = workers;
  options.store = std::move(store);
  options.timeout = timeout;
  options.rank_labels = labels;
  return options;
}

// What is left until `deadline`, at least 1 ms: how long connecting a communicator may take
// within the start-up's deadline.
std::chrono::milliseconds time_left(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()));
}

std::chrono::milliseconds rendezvous_timeout(const MultiWorkerOptions& options) {
  if (options.rendezvous_timeout) return *options.rendezvous_timeout;
  // The variable's default is collective::kDefaultRendezvousTimeout's (a strategy test checks).
  return env::get_seconds(env::kRendezvousTimeout);
}

// Rows [begin, begin + count) of every component: views, no copy.
data::Element slice_rows(const data::Element& batch, std::int64_t begin, std::int64_t count) {
  data::Element out;
  out.reserve(batch.size());
  for (const auto& component : batch) {
    const std::int64_t n = component.shape()[0];
    Shape shape = component.shape();
    shape[0] = count;
    const std::size_t row_bytes =
        static_cast<std::size_t>(component.shape().num_elements() / std::max<std::int64_t>(1, n)) *
        graph::dtype_size(component.dtype());
    out.emplace_back(shape, component.dtype(), component.buffer(),
                     component.byte_offset() + static_cast<std::size_t>(begin) * row_bytes);
  }
  return out;
}

// The rows of a global batch of n that replicas [first, first + count) of `replicas` get: the
// same rule as Strategy::split_batch (the first n % replicas replicas get one more), so that a
// worker's local split gives every replica exactly the rows it has in the global split.
std::pair<std::int64_t, std::int64_t> replica_rows(std::int64_t n, std::int64_t replicas, std::int64_t first,
                                                   std::int64_t count) {
  const auto rows_before = [&](std::int64_t r) { return r * (n / replicas) + std::min(r, n % replicas); };
  const std::int64_t begin = rows_before(first);
  return {begin, rows_before(first + count) - begin};
}

// The keys of one Gloo group under its own prefix, except the keys about the whole job
// (collective::is_job_wide_key: the store server's reports of lost ranks, the calls ranks failed
// in), which every group reads where they are written.
class GroupStore final : public collective::Store {
 public:
  GroupStore(std::shared_ptr<collective::Store> inner, std::string prefix)
      : inner_(std::move(inner)), prefixed_(collective::make_prefix_store(inner_, std::move(prefix))) {}
  void set(const std::string& key, const std::vector<char>& value) override { route(key).set(key, value); }
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return route(key).get(key, timeout);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    if (keys.empty()) return;
    route(keys.front()).wait(keys, timeout);
  }
  bool check(const std::string& key) override { return route(key).check(key); }
  std::int64_t add(const std::string& key, std::int64_t delta) override { return route(key).add(key, delta); }
  std::string address() const override { return inner_->address(); }

 private:
  collective::Store& route(const std::string& key) { return collective::is_job_wide_key(key) ? *inner_ : *prefixed_; }
  std::shared_ptr<collective::Store> inner_, prefixed_;
};

}  // namespace

// TF's default: every GPU of the worker. Several workers on one machine (tandem-run
// --nproc_per_node, torchrun) take one GPU each, by local rank. Without GPUs (or GPU kernels):
// CPU:0. A CUDA build has GPU kernels (ops/cuda/).
std::vector<std::string> default_worker_devices(const ClusterResolver& resolver) {
  const auto gpus =
      TANDEM_HAVE_CUDA ? devices::list_logical_devices(devices::DeviceType::kGPU) : std::vector<devices::Device*>{};
  if (gpus.empty()) return {"CPU:0"};
  if (resolver.local_world_size() > 1) {
    const auto index = static_cast<std::size_t>(resolver.local_rank()) % gpus.size();
    return {gpus[index]->short_name()};
  }
  std::vector<std::string> names;
  for (const auto* g : gpus) names.push_back(g->short_name());
  return names;
}

// The gradient group: local replicas in process, then across workers through Gloo.
class CollectiveAllReduce final : public CrossDeviceOps {
 public:
  // shared_memory: the workers' gradients meet in a segment of this machine's memory instead of
  // going through TCP (every worker must be on this machine).
  // first_connect_deadline: the start-up's deadline, which bounds connecting the first group
  // (groups rebuilt later connect within the collective timeout).
  CollectiveAllReduce(std::shared_ptr<collective::Store> store, int rank, int workers, std::vector<std::string> labels,
                      const CommunicationOptions& options, bool shared_memory, Clock::time_point first_connect_deadline)
      : store_(std::move(store)),
        rank_(rank),
        workers_(workers),
        labels_(std::move(labels)),
        options_(options),
        shared_memory_(shared_memory),
        first_connect_deadline_(first_connect_deadline) {}

  std::string name() const override { return "CollectiveAllReduce"; }

  std::vector<std::unique_ptr<collective::Communicator>> make_group(
      const std::vector<devices::Device*>& devices) const override {
    const bool gpus = std::all_of(devices.begin(), devices.end(),
                                  [](const devices::Device* d) { return d->type() == devices::DeviceType::kGPU; });
    const bool cpus = std::all_of(devices.begin(), devices.end(),
                                  [](const devices::Device* d) { return d->type() == devices::DeviceType::kCPU; });
    TANDEM_REQUIRE(gpus || cpus, InvalidArgument,
                   "MultiWorkerMirroredStrategy: the local devices mix CPUs and GPUs; give one kind");
    // Every (re)built group gets its own keys: after an abort, the new connections must not meet
    // the old ones' addresses in the store.
    const int generation = generation_++;
    auto group_store = std::make_shared<GroupStore>(store_, fmt::format("data/{}/", generation));
    const auto connect_timeout = generation == 0 ? time_left(first_connect_deadline_) : collective_timeout(options_);
    if (gpus) return make_gpu_group(devices, std::move(group_store));
    TANDEM_REQUIRE(options_.implementation != CommunicationImplementation::kNccl, InvalidArgument,
                   "MultiWorkerMirroredStrategy: CommunicationImplementation::kNccl needs GPU replicas; this worker's "
                   "devices are CPUs (use kAuto, kRing or kSharedMemory)");
    std::unique_ptr<collective::Communicator> cross;
    if (shared_memory_) {
      auto shm = member_options<collective::SharedMemoryOptions>(rank_, workers_, std::move(group_store),
                                                                 collective_timeout(options_), labels_);
      shm.connect_timeout = connect_timeout;
      cross = collective::make_shared_memory_communicator(std::move(shm));
    } else {
      auto gloo = gloo_options(member_options<collective::GlooOptions>(rank_, workers_, std::move(group_store),
                                                                       collective_timeout(options_), labels_),
                               options_);
      gloo.connect_timeout = connect_timeout;
      gloo.group_name = "gradient";
      cross = collective::make_gloo_communicator(std::move(gloo));
    }
    if (devices.size() == 1) {
      std::vector<std::unique_ptr<collective::Communicator>> group;
      group.push_back(std::move(cross));
      return group;
    }
    return collective::make_hierarchical_group(collective::make_in_process_group(static_cast<int>(devices.size())),
                                               std::move(cross));
  }

 private:
  // GPU replicas: NCCL between the workers (one process communicator per worker, on its first
  // GPU, the unique id through the rendezvous store), and NCCL among a worker's own GPUs.
  std::vector<std::unique_ptr<collective::Communicator>> make_gpu_group(const std::vector<devices::Device*>& devices,
                                                                        std::shared_ptr<GroupStore> group_store) const {
    const auto implementation = options_.implementation;
    TANDEM_REQUIRE(
        implementation == CommunicationImplementation::kAuto || implementation == CommunicationImplementation::kNccl,
        InvalidArgument,
        "MultiWorkerMirroredStrategy: GPU replicas exchange gradients through NCCL; "
        "CommunicationImplementation {} reduces host memory only (use kAuto or kNccl)",
        implementation == CommunicationImplementation::kRing ? "kRing" : "kSharedMemory");
    auto nccl = member_options<collective::NcclProcessOptions>(rank_, workers_, std::move(group_store),
                                                               collective_timeout(options_), labels_);
    nccl.cuda_device = devices.front()->index();
    auto cross = collective::make_nccl_process_communicator(std::move(nccl));
    if (devices.size() == 1) {
      std::vector<std::unique_ptr<collective::Communicator>> group;
      group.push_back(std::move(cross));
      return group;
    }
    std::vector<int> ordinals;
    for (const auto* d : devices) ordinals.push_back(d->index());
    return collective::make_hierarchical_group(collective::make_nccl_group(ordinals), std::move(cross));
  }

  std::shared_ptr<collective::Store> store_;
  int rank_;
  int workers_;
  std::vector<std::string> labels_;
  CommunicationOptions options_;
  bool shared_memory_;
  Clock::time_point first_connect_deadline_;
  mutable int generation_ = 0;
};

struct MultiWorkerMirroredStrategy::Impl {
  MultiWorkerOptions options;
  std::shared_ptr<ClusterResolver> resolver;
  int rank = 0;
  int workers = 1;
  int local_replicas = 1;
  std::vector<std::string> labels;
  std::vector<devices::Device*> devices;
  collective::Rendezvous rendezvous;
  std::unique_ptr<collective::Communicator> control;  // null on a single worker
  std::shared_ptr<CrossDeviceOps> cross_device_ops;
  AutoShardPolicy policy = AutoShardPolicy::kAuto;
  Clock::time_point connect_deadline{};

  static std::unique_ptr<Impl> connect(MultiWorkerOptions options);
  std::string label(int r) const {
    return labels.empty() ? fmt::format("rank {}", r) : labels[static_cast<std::size_t>(r)];
  }
  collective::CallOptions call_options() const {
    return {.timeout = collective_timeout(options.communication_options)};
  }
  // Every worker's `mine` (up to `bytes` - 1 bytes of it), gathered through the control group.
  std::vector<std::string> gather_text(const std::string& mine, std::size_t bytes) const {
    const auto words = static_cast<std::int64_t>(bytes / 8);
    Tensor descriptor = Tensor::zeros({words}, DType::kI64);
    std::memcpy(descriptor.raw_data(), mine.data(), std::min(mine.size(), bytes - 1));
    Tensor all = Tensor::zeros({workers * words}, DType::kI64);
    control->all_gather(descriptor, all, call_options());
    std::vector<std::string> texts;
    for (int r = 0; r < workers; ++r) {
      const char* p = static_cast<const char*>(all.raw_data()) + static_cast<std::size_t>(r) * bytes;
      texts.emplace_back(p, strnlen(p, bytes));
    }
    return texts;
  }
};

std::unique_ptr<MultiWorkerMirroredStrategy::Impl> MultiWorkerMirroredStrategy::Impl::connect(
    MultiWorkerOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->resolver =
      options.cluster_resolver ? options.cluster_resolver : std::shared_ptr<ClusterResolver>(resolve_cluster());
  const ClusterResolver& resolver = *impl->resolver;
  TANDEM_REQUIRE(resolver.rank() >= 0, InvalidArgument,
                 "MultiWorkerMirroredStrategy: this process is the {} task {} of the cluster ({}), which does not "
                 "train; run evaluation in its own program with OneDeviceStrategy",
                 resolver.task_type(), resolver.task_id(), resolver.kind());
  TANDEM_REQUIRE(options.communication_options.bytes_per_pack >= 0, InvalidArgument,
                 "MultiWorkerMirroredStrategy: bytes_per_pack is {}; expected 0 (one pack) or more",
                 options.communication_options.bytes_per_pack);
  impl->rank = resolver.rank();
  impl->workers = resolver.num_workers();
  for (int r = 0; r < impl->workers; ++r) impl->labels.push_back(resolver.task_label(r));

  // Workers sharing a machine share its cores: the CPU devices this worker names get its part,
  // unless the user chose a layout or the devices exist already (devices::share_cpu_cores).
  const std::vector<std::string> names =
      options.local_devices.empty() ? default_worker_devices(resolver) : options.local_devices;
  int cpu_devices = 1;
  for (const auto& name : names) {
    const auto parsed = devices::DeviceName::parse(name);
    if (parsed.type == devices::DeviceType::kCPU) cpu_devices = std::max(cpu_devices, parsed.index + 1);
  }
  devices::share_cpu_cores(cpu_devices, resolver.local_world_size(), "MultiWorkerMirroredStrategy");
  for (const auto& name : names) {
    devices::Device* d = &devices::get_device(name);
    for (auto* seen : impl->devices) {
      TANDEM_REQUIRE(seen != d, InvalidArgument, "MultiWorkerMirroredStrategy: device {} is listed twice",
                     d->short_name());
    }
    impl->devices.push_back(d);
  }
  impl->local_replicas = static_cast<int>(impl->devices.size());
  // Refused before any connection: a worker that failed later, while another still connects,
  // would leave that one with a closed connection to report instead of the reason.
  const bool cpus = std::all_of(impl->devices.begin(), impl->devices.end(),
                                [](const devices::Device* d) { return d->type() == devices::DeviceType::kCPU; });
  TANDEM_REQUIRE(impl->workers == 1 || !cpus ||
                     options.communication_options.implementation != CommunicationImplementation::kNccl,
                 InvalidArgument,
                 "MultiWorkerMirroredStrategy: CommunicationImplementation::kNccl needs GPU replicas; this worker's "
                 "devices are CPUs (use kAuto, kRing or kSharedMemory)");

  if (impl->workers > 1) {
    collective::RendezvousOptions rv;
    rv.address = resolver.rendezvous_address();
    rv.rank = impl->rank;
    rv.world_size = impl->workers;
    rv.task_labels = impl->labels;
    for (int r = 0; r < impl->workers; ++r) rv.task_addresses.push_back(resolver.expected_address(r));
    rv.timeout = rendezvous_timeout(options);
    rv.run_id = std::to_string(resolver.restart_count());
    rv.store_served_by_launcher = env::get_bool(env::kLauncherStore);
    // Connecting the communicators is part of the start-up: it ends by the rendezvous deadline,
    // not the collective timeout.
    impl->connect_deadline = Clock::now() + rv.timeout;
    impl->rendezvous = collective::rendezvous(rv);

    auto control =
        gloo_options(member_options<collective::GlooOptions>(
                         impl->rank, impl->workers, std::make_shared<GroupStore>(impl->rendezvous.store, "control/"),
                         collective_timeout(options.communication_options), impl->labels),
                     options.communication_options);
    control.connect_timeout = time_left(impl->connect_deadline);
    control.group_name = "control";
    impl->control = collective::make_gloo_communicator(std::move(control));
    // Workers that all share this machine exchange gradients through its memory (TCP over
    // loopback costs a kernel copy of every byte, twice): AUTO picks shared memory then.
    const auto implementation = options.communication_options.implementation;
    const bool all_local = resolver.local_world_size() == impl->workers;
    TANDEM_REQUIRE(implementation != CommunicationImplementation::kSharedMemory || all_local, InvalidArgument,
                   "MultiWorkerMirroredStrategy: CommunicationImplementation::kSharedMemory needs every worker on "
                   "this machine; {} of the {} workers are ({}: hosts as the cluster spec spells them)",
                   resolver.local_world_size(), impl->workers, resolver.kind());
    const bool shared_memory = implementation == CommunicationImplementation::kSharedMemory ||
                               (implementation == CommunicationImplementation::kAuto && all_local);
    impl->cross_device_ops =
        std::make_shared<CollectiveAllReduce>(impl->rendezvous.store, impl->rank, impl->workers, impl->labels,
                                              options.communication_options, shared_memory, impl->connect_deadline);
  } else {
    // One worker is MirroredStrategy over its devices: NCCL for GPUs, else the in-process sum.
    impl->cross_device_ops = choose_cross_device_ops(impl->devices);
  }
  impl->policy = options.auto_shard_policy;
  impl->options = std::move(options);
  return impl;
}

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(MultiWorkerOptions options)
    : MultiWorkerMirroredStrategy("MultiWorkerMirroredStrategy", std::move(options)) {}

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(std::string kind, MultiWorkerOptions options)
    : MultiWorkerMirroredStrategy(std::move(kind), options, Impl::connect(options)) {}

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(std::shared_ptr<ClusterResolver> cluster_resolver,
                                                         CommunicationOptions communication_options)
    : MultiWorkerMirroredStrategy(MultiWorkerOptions{.cluster_resolver = std::move(cluster_resolver),
                                                     .communication_options = communication_options}) {}

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(std::string kind, MultiWorkerOptions options,
                                                         std::unique_ptr<Impl> impl)
    : Strategy(std::move(kind), impl->devices, impl->cross_device_ops, options.distribution),
      impl_(std::move(impl)) {
  // The gradient group connects now, on every worker together, so that a problem shows up here
  // rather than in the middle of the first step.
  if (impl_->workers > 1) communicator(0);
}

MultiWorkerMirroredStrategy::~MultiWorkerMirroredStrategy() {
  // Destroyed while an error propagates (a collective failed, a peer is frozen or gone): waiting
  // for the peers would only delay the report, by up to the collective timeout.
  if (impl_->control == nullptr || std::uncaught_exceptions() > 0) return;
  try {
    impl_->control->barrier({.timeout = std::min<std::chrono::milliseconds>(
                                 kClosingBarrierTimeout, collective_timeout(impl_->options.communication_options))});
  } catch (const std::exception&) {
    // A peer is gone already (the job failed): nothing to wait for.
  }
}

int MultiWorkerMirroredStrategy::num_replicas_in_sync() const { return impl_->workers * impl_->local_replicas; }
int MultiWorkerMirroredStrategy::num_workers() const { return impl_->workers; }
int MultiWorkerMirroredStrategy::worker_rank() const { return impl_->rank; }
int MultiWorkerMirroredStrategy::workers_on_this_machine() const { return impl_->resolver->local_world_size(); }
bool MultiWorkerMirroredStrategy::should_log() const { return impl_->rank == 0 || impl_->options.log_on_all_workers; }
const ClusterResolver& MultiWorkerMirroredStrategy::cluster_resolver() const { return *impl_->resolver; }
AutoShardPolicy MultiWorkerMirroredStrategy::auto_shard_policy() const { return impl_->policy; }

void MultiWorkerMirroredStrategy::agree_on_variable(VariableOptions& options) {
  if (impl_->control == nullptr) return;
  auto& control = *impl_->control;
  // 1. Every worker must be creating the same variable: compare descriptors, naming both sides.
  const std::string mine =
      fmt::format("\"{}\" {} {}", options.name, options.initial_value.dtype(), options.initial_value.shape());
  const std::vector<std::string> all = impl_->gather_text(mine, kDescriptorBytes);
  const std::string& chief = all[0];
  for (int r = 1; r < impl_->workers; ++r) {
    const std::string& theirs = all[static_cast<std::size_t>(r)];
    TANDEM_REQUIRE(theirs == chief, InvalidArgument,
                   "MultiWorkerMirroredStrategy: {} creates variable {} where {} creates {}: every worker must build "
                   "the same model (same layers, in the same order)",
                   impl_->label(r), theirs, impl_->label(0), chief);
  }
  // 2. The chief's initial value everywhere (initializers may draw different numbers elsewhere).
  const DType dtype = options.initial_value.dtype();
  if (dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kI32 || dtype == DType::kI64) {
    Tensor value = options.initial_value.to(devices::default_cpu_device()).clone();
    control.broadcast(value, 0, impl_->call_options());
    options.initial_value = value;
  }
}

void MultiWorkerMirroredStrategy::check_workers_agree(std::string_view what,
                                                      const std::vector<std::pair<std::string, std::string>>& facts) {
  if (impl_->control == nullptr) return;
  // One line per fact; the values, not their names, differ between workers.
  std::string mine;
  for (const auto& [name, value] : facts) mine += fmt::format("{}\n", value);
  const std::vector<std::string> all = impl_->gather_text(mine, kFactsBytes);
  for (int r = 1; r < impl_->workers; ++r) {
    const std::string& theirs = all[static_cast<std::size_t>(r)];
    if (theirs == all[0]) continue;
    const auto line = [](const std::string& text, std::size_t i) {
      std::size_t begin = 0;
      for (; i > 0 && begin != std::string::npos; --i) begin = text.find('\n', begin) + 1;
      const std::size_t end = text.find('\n', begin);
      return text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    };
    std::size_t k = 0;
    while (k + 1 < facts.size() && line(theirs, k) == line(all[0], k)) ++k;
    throw InvalidArgument(fmt::format(
        "MultiWorkerMirroredStrategy: {} on {} has {} {} where {} has {}: every worker must run the same {} (the same "
        "program with the same dataset, batch size and options)",
        what, impl_->label(r), facts[k].first, line(theirs, k), impl_->label(0), line(all[0], k), what));
  }
}

void MultiWorkerMirroredStrategy::sum_across_workers(std::span<double> values) {
  if (impl_->control == nullptr || values.empty()) return;
  Tensor t = Tensor::empty({static_cast<std::int64_t>(values.size())}, DType::kF64);
  std::memcpy(t.raw_data(), values.data(), values.size_bytes());
  impl_->control->all_reduce(t, collective::ReduceOp::kSum, impl_->call_options());
  std::memcpy(values.data(), t.raw_data(), values.size_bytes());
}

MultiWorkerMirroredStrategy::CollectiveCounts MultiWorkerMirroredStrategy::collective_counts() {
  if (impl_->control == nullptr) return {};
  return {.data = communicator(0).sequence_number(), .control = impl_->control->sequence_number()};
}

MultiWorkerMirroredStrategy::CrossWorkerStats MultiWorkerMirroredStrategy::cross_worker_stats_per_communicator() {
  if (impl_->control == nullptr) return {};
  // A group of several local replicas is hierarchical (its cross-worker member counts); a group
  // of one local replica (one device per worker, or ModelParallel's groups along the batch axis
  // with one device of each worker) is the cross-worker communicator itself.
  auto& data = communicator(0);
  return {.data = data.backend() == "hierarchical" ? collective::cross_worker_stats(data) : data.stats(),
          .control = impl_->control->stats()};
}

collective::CommunicationStats MultiWorkerMirroredStrategy::cross_worker_stats() {
  auto [stats, control] = cross_worker_stats_per_communicator();
  stats += control;
  return stats;
}

void MultiWorkerMirroredStrategy::broadcast_from_chief(std::span<Tensor> host_values) {
  if (impl_->control == nullptr) return;
  for (auto& value : host_values) impl_->control->broadcast(value, 0, impl_->call_options());
}

namespace {

// DATA: every worker runs the whole pipeline and keeps its replicas' rows of each global batch.
class DataShardIterator final : public Strategy::WorkerIterator {
 public:
  // The worker's local data shards [first, first + local) of `shards` in sync (Strategy::data_shard:
  // one per replica, unless replicas share their rows).
  DataShardIterator(std::unique_ptr<data::Iterator> it, int shards, int first, int local)
      : iterator_(std::move(it)), shards_(shards), first_(first), local_(local) {}
  std::optional<Strategy::WorkerBatch> next() override {
    auto element = iterator_->next();
    if (!element) return std::nullopt;
    const std::int64_t n = element->empty() || element->front().shape().rank() == 0 ? 0 : element->front().shape()[0];
    const auto [begin, count] = replica_rows(n, shards_, first_, local_);
    return Strategy::WorkerBatch{slice_rows(*element, begin, count), n};
  }

 private:
  std::unique_ptr<data::Iterator> iterator_;
  int shards_, first_, local_;
};

// FILE and OFF: each worker's batches are its own; the workers agree before every step on the
// global batch's size and on whether all of them still have data (the first to run out ends the
// epoch for every worker, so that all run the same number of steps). The iterator reads one batch
// ahead, so that the agreement on batch t + 1 rides in step t's gradient collective
// (WorkerBatch::rider); the first batch of a pass, and any batch after a step that carried
// nothing, take a control all-reduce. With batches staged on the devices ahead of their steps
// (another thread calls next() early) nothing rides: every agreement is a control all-reduce.
class OwnBatchIterator final : public Strategy::WorkerIterator {
 public:
  OwnBatchIterator(std::unique_ptr<data::Iterator> it, Strategy& strategy, bool ride_in_steps)
      : iterator_(std::move(it)), strategy_(strategy), ride_in_steps_(ride_in_steps) {}
  std::optional<Strategy::WorkerBatch> next() override {
    if (ended_) return std::nullopt;
    if (!started_) {
      started_ = true;
      ahead_ = iterator_->next();
    }
    // [global rows, workers with a batch] of the batch ahead: summed by the step before, or now.
    std::vector<double> agreed;
    if (rider_ != nullptr && rider_->summed) {
      agreed = rider_->values;
    } else {
      agreed = agreement_of(ahead_);
      strategy_.sum_across_workers(agreed);
    }
    if (static_cast<int>(agreed[1]) < strategy_.num_workers()) {
      ended_ = true;
      return std::nullopt;
    }
    Strategy::WorkerBatch batch{std::move(*ahead_), static_cast<std::int64_t>(agreed[0])};
    ahead_ = iterator_->next();
    rider_.reset();
    if (ride_in_steps_) {
      rider_ = std::make_shared<Strategy::StepRider>(Strategy::StepRider{.values = agreement_of(ahead_)});
      batch.rider = rider_;
    }
    return batch;
  }

 private:
  static std::vector<double> agreement_of(const std::optional<data::Element>& element) {
    const std::int64_t rows =
        !element || element->empty() || element->front().shape().rank() == 0 ? 0 : element->front().shape()[0];
    return {static_cast<double>(rows), element ? 1.0 : 0.0};
  }

  std::unique_ptr<data::Iterator> iterator_;
  Strategy& strategy_;
  bool ride_in_steps_;
  bool started_ = false;
  bool ended_ = false;
  std::optional<data::Element> ahead_;          // the next batch, read one step early
  std::shared_ptr<Strategy::StepRider> rider_;  // the agreement on ahead_, if a step may carry it
};

}  // namespace

std::unique_ptr<Strategy::WorkerIterator> MultiWorkerMirroredStrategy::worker_batches(
    const data::Dataset& dataset, const data::IterateOptions& options) const {
  if (impl_->workers == 1) return Strategy::worker_batches(dataset, options);
  AutoShardPolicy policy = impl_->policy;
  if (policy == AutoShardPolicy::kAuto)
    policy = dataset.reads_files() ? AutoShardPolicy::kFile : AutoShardPolicy::kData;
  auto& self = const_cast<MultiWorkerMirroredStrategy&>(*this);  // agreement is a collective
  switch (policy) {
    case AutoShardPolicy::kData:
      return std::make_unique<DataShardIterator>(dataset.iterate(options), data_shards_in_sync(),
                                                 first_local_data_shard(), local_data_shards());
    case AutoShardPolicy::kFile: {
      TANDEM_REQUIRE(dataset.reads_files(), InvalidArgument,
                     "MultiWorkerMirroredStrategy: AutoShardPolicy::kFile needs a dataset that reads files "
                     "(Dataset::from_files); this one does not. Use kData or kAuto");
      data::IterateOptions sharded = options;
      sharded.file_shards = impl_->workers;
      sharded.file_shard_index = impl_->rank;
      return std::make_unique<OwnBatchIterator>(dataset.iterate(sharded), self, !fetches_to_device());
    }
    case AutoShardPolicy::kOff:
    case AutoShardPolicy::kAuto: break;
  }
  return std::make_unique<OwnBatchIterator>(dataset.iterate(options), self, !fetches_to_device());
}

}  // namespace tandem::strategy
