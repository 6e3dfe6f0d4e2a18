#include "tandem/strategy/strategy.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <set>
#include <thread>
#include <vector>

#include "tandem/base/errors.h"
#include "tandem/base/spin.h"
#include "tandem/strategy/detail/device_staging.h"

namespace tandem::strategy {
namespace {

thread_local std::vector<Strategy*> tls_scope_stack;
std::atomic<int> g_strategy_count{0};
// The strategy code with no scope gets instead of the default one (set_global_strategy).
std::atomic<Strategy*> g_global_strategy{nullptr};

// Whether ops/ has CUDA kernels: CUDA builds register them (ops/cuda/).
constexpr bool kGpuKernelsBuilt = TANDEM_HAVE_CUDA != 0;
// Replica threads poll this long for the next step before they sleep: longer than the gap
// between two training steps, short enough that an idle strategy is idle.
constexpr auto kReplicaSpin = std::chrono::milliseconds(5);

std::string describe(const std::string& kind, const std::vector<devices::Device*>& devices) {
  std::string names;
  for (auto* d : devices) names += fmt::format("{}{}", names.empty() ? "" : ", ", d->short_name());
  return fmt::format("{}#{} ({})", kind, ++g_strategy_count, names);
}

class DefaultStrategy final : public Strategy {
 public:
  DefaultStrategy()
      : Strategy("DefaultStrategy", {&devices::default_cpu_device()}, std::make_shared<InProcessAllReduce>(), {}) {}
};

}  // namespace

std::vector<devices::Device*> mirrored_devices(const std::vector<std::string>& names) {
  std::vector<devices::Device*> out;
  if (names.empty()) {
    // GPUs count only when this build can run a model on them: a build without CUDA on a
    // machine with GPUs trains on its CPU devices rather than failing at the first op.
    if (kGpuKernelsBuilt && devices::num_gpus() > 0) return devices::list_logical_devices(devices::DeviceType::kGPU);
    // Without GPUs, one replica per core (TF takes the one CPU device; see docs/ARCHITECTURE.md's
    // departures): `MirroredStrategy strategy;` then replicates on the machine it is written on,
    // with the results of one device. Unless the user chose a layout, or the devices exist
    // already (devices::share_cpu_cores warns then).
    devices::share_cpu_cores(devices::default_cpu_device_count(), 1, "MirroredStrategy");
    return devices::list_logical_devices(devices::DeviceType::kCPU);
  }
  for (const auto& name : names) {
    devices::Device* d = &devices::get_device(name);  // NotFound lists the local devices
    for (auto* seen : out) {
      TANDEM_REQUIRE(seen != d, InvalidArgument, "MirroredStrategy: device {} is listed twice", d->short_name());
    }
    out.push_back(d);
  }
  return out;
}

// One thread per replica after the first (which runs on the caller). Replica r always runs on
// the same thread: replicas wait for each other inside collectives, so they must run at once.
struct Strategy::ReplicaThreads {
  // Polling only pays when every replica thread has a core: with more replicas than cores, a
  // polling thread takes the core from the replica it waits for (a step then costs scheduler
  // time slices, milliseconds; 3 replicas on 2 cores measured 150x slower with polling).
  explicit ReplicaThreads(int replicas) : spin(spin_budget(kReplicaSpin, replicas, devices::usable_cpu_cores())) {
    for (int r = 1; r < replicas; ++r) workers.emplace_back([this, r] { loop(r); });
  }
  ~ReplicaThreads() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    ready.notify_all();
    for (auto& w : workers) w.join();
  }

  void run(const std::function<void(int)>& fn) {
    {
      std::lock_guard lock(mutex);
      body = &fn;
      remaining.store(static_cast<int>(workers.size()), std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_release);
    }
    ready.notify_all();
    fn(0);
    const auto done = [&] { return remaining.load(std::memory_order_acquire) == 0; };
    if (!poll_for(spin, done)) {
      std::unique_lock lock(mutex);
      finished.wait(lock, done);
    }
  }

  void loop(int replica) {
    std::uint64_t seen = 0;
    while (true) {
      poll_for(spin, [&] { return generation.load(std::memory_order_acquire) != seen; });
      const std::function<void(int)>* fn = nullptr;
      {
        std::unique_lock lock(mutex);
        ready.wait(lock, [&] { return stopping || generation.load(std::memory_order_relaxed) != seen; });
        if (stopping) return;
        seen = generation.load(std::memory_order_relaxed);
        fn = body;
      }
      (*fn)(replica);  // fn catches everything (see Strategy::run)
      if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lock(mutex);
        finished.notify_all();
      }
    }
  }

  const std::chrono::microseconds spin;
  std::vector<std::thread> workers;
  std::mutex mutex;
  std::condition_variable ready, finished;
  const std::function<void(int)>* body = nullptr;
  std::atomic<std::uint64_t> generation{0};
  std::atomic<int> remaining{0};
  bool stopping = false;
};

Strategy::Strategy(std::string kind, std::vector<devices::Device*> devices,
                   std::shared_ptr<CrossDeviceOps> cross_device_ops, DistributionOptions distribution)
    : name_(describe(kind, devices)),
      devices_(std::move(devices)),
      cross_device_ops_(std::move(cross_device_ops)),
      distribution_(distribution) {
  TANDEM_REQUIRE(!devices_.empty(), InvalidArgument, "{} has no devices", kind);
  TANDEM_REQUIRE(
      distribution_.first_bucket_bytes > 0 && distribution_.bucket_bytes > 0 && distribution_.reduce_bucket_bytes > 0,
      InvalidArgument, "{}: bucket sizes must be positive (got {}, {} and {} bytes)", name_,
      distribution_.first_bucket_bytes, distribution_.bucket_bytes, distribution_.reduce_bucket_bytes);
  TANDEM_REQUIRE(distribution_.device_prefetch_batches >= 1, InvalidArgument,
                 "{}: device_prefetch_batches must be at least 1; got {}", name_,
                 distribution_.device_prefetch_batches);
  // Stage 3's gathers run between an executor's kernels on the host path; a GPU replica records
  // its steps as CUDA graphs and has no such path yet: refused before any variable exists.
  for (const auto* device : devices_) {
    TANDEM_REQUIRE(distribution_.zero != ZeroStage::k3 || device->host_accessible(), Unimplemented,
                   "{}: ZeRO stage 3 (sharded parameters) runs on CPU devices only so far; {} is not one. Use "
                   "DistributionOptions::zero = k1 or k2 there",
                   name_, device->short_name());
  }
  TANDEM_REQUIRE(distribution_.zero == ZeroStage::k0 || !distribution_.gradient_all_reduce_dtype, InvalidArgument,
                 "{}: gradient_all_reduce_dtype (compressed all-reduce) cannot be combined with ZeRO stage {}: the "
                 "sharded optimizer's results would no longer equal unsharded training",
                 name_, static_cast<int>(distribution_.zero));
  if (cross_device_ops_ == nullptr) cross_device_ops_ = choose_cross_device_ops(devices_);
}

Strategy::~Strategy() = default;

VariablePlan Strategy::variable_plan(const Variable& variable) const {
  if (distribution_.zero >= ZeroStage::k1 && variable.trainable()) {
    return {.reduction = VariablePlan::Reduction::kReduceScatter};
  }
  return {};
}

std::optional<ShardSpec> Strategy::zero_shard_spec(const Variable& variable) const {
  if (variable_plan(variable).reduction != VariablePlan::Reduction::kReduceScatter) return std::nullopt;
  return ShardSpec::even(variable.graph_shape(), data_shards_in_sync());
}

void Strategy::check_replicas_agree(std::span<const std::shared_ptr<Variable>> variables) const {
  for (const auto& v : variables) {
    // Reduce-scattered variables are whole again on every replica after the all-gather.
    if (variable_plan(*v).reduction != VariablePlan::Reduction::kNone) v->check_copies_equal();
  }
}

std::unique_ptr<GradientReducer> Strategy::make_gradient_reducer(std::vector<GradientSource> gradients,
                                                                 GradientReducerOptions options) {
  return std::make_unique<GradientReducer>(*this, std::move(gradients), std::move(options));
}

Strategy::Scope::Scope(Strategy& strategy) {
  for (const Strategy* active : tls_scope_stack) {
    TANDEM_REQUIRE(active == &strategy, FailedPrecondition,
                   "cannot enter the scope of {} inside the scope of {}: mixing different strategies is not "
                   "supported; close the first scope before opening the second",
                   strategy.name(), active->name());
  }
  tls_scope_stack.push_back(&strategy);
}

Strategy::Scope::~Scope() { tls_scope_stack.pop_back(); }

Strategy::Scope Strategy::scope() { return Scope(*this); }

std::shared_ptr<Variable> Strategy::create_variable(VariableOptions options) {
  TANDEM_REQUIRE(options.initial_value.defined(), InvalidArgument, "variable \"{}\": no initial value", options.name);
  agree_on_variable(options);
  if (options.sharded && distribution_.zero >= ZeroStage::k1) return create_sharded_variable(std::move(options));
  // Stage 3 shards the parameters themselves: the trainable floating-point on-write variables.
  if (distribution_.zero == ZeroStage::k3 && options.trainable &&
      options.synchronization != VariableSynchronization::kOnRead &&
      graph::is_floating(options.initial_value.dtype())) {
    return create_sharded_variable(std::move(options));
  }
  std::vector<Tensor> copies;
  copies.reserve(devices_.size());
  if (options.tensor_split) {
    // Tensor parallelism: each copy is its replica's piece.
    const TensorSplit& split = *options.tensor_split;
    TANDEM_REQUIRE(options.initial_value.shape() == split.global_shape, InvalidArgument,
                   "{}: variable \"{}\" of shape {} with a tensor split of shape {}", name_, options.name,
                   options.initial_value.shape(), split.global_shape);
    for (std::size_t r = 0; r < devices_.size(); ++r) {
      const int p = split.piece_of_replica[static_cast<std::size_t>(global_replica_index(static_cast<int>(r)))];
      Tensor copy = Tensor::empty(p < 0 ? Shape{0} : split.piece_shape(), options.initial_value.dtype(), *devices_[r]);
      if (p >= 0) copy.copy_from(split.piece(options.initial_value, p));
      copies.push_back(std::move(copy));
    }
    return std::make_shared<MirroredVariable>(*this, std::move(options), std::move(copies));
  }
  for (auto* device : devices_) {
    Tensor copy = Tensor::empty(options.initial_value.shape(), options.initial_value.dtype(), *device);
    copy.copy_from(options.initial_value);
    copies.push_back(std::move(copy));
  }
  if (options.synchronization == VariableSynchronization::kOnRead) {
    return std::make_shared<SyncOnReadVariable>(*this, std::move(options), std::move(copies));
  }
  return std::make_shared<MirroredVariable>(*this, std::move(options), std::move(copies));
}

// Each local replica's copy is its shard of the value flattened, zero-padded (ShardSpec).
std::shared_ptr<Variable> Strategy::create_sharded_variable(VariableOptions options) {
  TANDEM_REQUIRE(options.synchronization != VariableSynchronization::kOnRead, InvalidArgument,
                 "{}: variable \"{}\" is sharded and synchronised on read; only on-write variables shard", name_,
                 options.name);
  const Tensor& initial = options.initial_value;
  // The shards are the data-parallel replicas' (data_shards_in_sync, data_shard): every replica
  // in sync under data parallelism; under ModelParallel the replicas along the batch axis, each
  // sharding its tensor-parallel piece or its pipeline stage's weight (a split variable).
  const TensorSplit* split = options.tensor_split ? &*options.tensor_split : nullptr;
  TANDEM_REQUIRE(!split || initial.shape() == split->global_shape, InvalidArgument,
                 "{}: variable \"{}\" of shape {} with a tensor split of shape {}", name_, options.name,
                 initial.shape(), split ? split->global_shape : Shape{});
  const ShardSpec spec = ShardSpec::even(split ? split->piece_shape() : initial.shape(), data_shards_in_sync());
  std::vector<Tensor> copies;
  copies.reserve(devices_.size());
  for (std::size_t r = 0; r < devices_.size(); ++r) {
    const int s = data_shard(static_cast<int>(r));
    const int piece =
        split ? split->piece_of_replica[static_cast<std::size_t>(global_replica_index(static_cast<int>(r)))] : 0;
    if (piece < 0) {  // a replica that holds none of it (another pipeline stage's weight)
      copies.push_back(Tensor::empty({0}, initial.dtype(), *devices_[r]));
      continue;
    }
    const Tensor whole = split ? split->piece(initial, piece) : initial;
    Tensor copy = Tensor::zeros({spec.shard_elements}, initial.dtype(), *devices_[r]);
    const std::int64_t b = spec.begin(s), e = spec.end(s);
    if (e > b) flat_view(copy, 0, e - b).copy_from(flat_view(whole, b, e - b));
    copies.push_back(std::move(copy));
  }
  return std::make_shared<MirroredVariable>(*this, std::move(options), std::move(copies), spec);
}

collective::Communicator& Strategy::communicator(int replica) {
  std::lock_guard lock(group_mutex_);
  // An aborted group is not rebuilt here but at the start of the next run(): a replica of the
  // failed run that asks now must get the aborted group (and fail at once), not a fresh group in
  // which it would wait for peers that have given up.
  if (group_.empty()) group_ = make_replica_group();
  TANDEM_REQUIRE(replica >= 0 && replica < static_cast<int>(group_.size()), InvalidArgument,
                 "{} has {} replicas; asked for the communicator of replica {}", name_, group_.size(), replica);
  return *group_[static_cast<std::size_t>(replica)];
}

std::vector<std::unique_ptr<collective::Communicator>> Strategy::make_replica_group() {
  return cross_device_ops_->make_group(devices_);
}

void Strategy::remake_replica_group() {
  std::lock_guard lock(group_mutex_);
  if (!group_.empty()) retired_groups_.push_back(std::move(group_));
  group_ = make_replica_group();
  group_aborted_ = false;
}

void Strategy::abort_collectives(const std::string& reason) {
  {
    std::lock_guard lock(group_mutex_);
    for (auto& c : group_) c->abort(reason);
    if (!group_.empty()) group_aborted_ = true;
  }
  abort_other_collectives(reason);
}

int Strategy::local_data_shards() const {
  std::set<int> shards;
  for (int r = 0; r < static_cast<int>(devices_.size()); ++r) shards.insert(data_shard(r));
  return static_cast<int>(shards.size());
}

int Strategy::first_local_data_shard() const {
  int first = data_shard(0);
  for (int r = 1; r < static_cast<int>(devices_.size()); ++r) first = std::min(first, data_shard(r));
  return first;
}

void Strategy::run(const std::function<void(ReplicaContext&)>& fn) {
  if (devices_.size() == 1) {
    ReplicaContext context(*this, 0);
    fn(context);
    return;
  }
  {
    // Create the group before the replicas start, so that none of them races to create it; a
    // group aborted by a failed run is replaced (its ranks may be half-way through a collective).
    std::lock_guard lock(group_mutex_);
    if (group_aborted_) {
      retired_groups_.push_back(std::move(group_));
      group_.clear();
      group_aborted_ = false;
    }
    if (group_.empty()) group_ = make_replica_group();
  }
  if (threads_ == nullptr) threads_ = std::make_unique<ReplicaThreads>(static_cast<int>(devices_.size()));
  std::mutex error_mutex;
  std::exception_ptr first_error;
  const std::function<void(int)> body = [&](int replica) {
    try {
      ReplicaContext context(*this, replica);
      fn(context);
    } catch (...) {
      bool first = false;
      std::string what = "unknown error";
      try {
        throw;
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      {
        std::lock_guard lock(error_mutex);
        if (!first_error) {
          first_error = std::current_exception();
          first = true;
        }
      }
      // The other replicas may be waiting for this one inside a collective: fail them now.
      if (first)
        abort_collectives(fmt::format("replica {} on {} failed: {}", replica,
                                      devices_[static_cast<std::size_t>(replica)]->short_name(), what));
    }
  };
  threads_->run(body);
  if (first_error) std::rethrow_exception(first_error);
}

Tensor Strategy::reduce(ReduceOp op, const std::vector<Tensor>& per_replica) const {
  TANDEM_REQUIRE(!per_replica.empty(), InvalidArgument, "{}: reduce of no values", name_);
  return reduce_on_host(op, per_replica, name_ + ": reduce");
}

std::vector<data::Element> Strategy::split_batch(const data::Element& global_batch) const {
  const auto replicas = static_cast<std::int64_t>(local_data_shards());
  std::vector<data::Element> shards(static_cast<std::size_t>(replicas));
  if (global_batch.empty()) return std::vector<data::Element>(devices_.size());
  const std::int64_t n = global_batch.front().shape().rank() > 0 ? global_batch.front().shape()[0] : 1;
  for (const auto& component : global_batch) {
    TANDEM_REQUIRE(component.shape().rank() > 0 && component.shape()[0] == n, InvalidArgument,
                   "{}: a batch's components must share their first dimension to be split; got {} and {}", name_,
                   global_batch.front().shape(), component.shape());
  }
  std::int64_t offset = 0;
  for (std::int64_t r = 0; r < replicas; ++r) {
    const std::int64_t rows = n / replicas + (r < n % replicas ? 1 : 0);
    for (const auto& component : global_batch) {
      Shape shape = component.shape();
      shape[0] = rows;
      const std::size_t row_bytes =
          static_cast<std::size_t>(component.shape().num_elements() / std::max<std::int64_t>(1, n)) *
          graph::dtype_size(component.dtype());
      shards[static_cast<std::size_t>(r)].push_back(
          Tensor(shape, component.dtype(), component.buffer(),
                 component.byte_offset() + static_cast<std::size_t>(offset) * row_bytes));
    }
    offset += rows;
  }
  if (shards.size() == devices_.size()) return shards;
  // Replicas that share a shard get the same views.
  std::vector<data::Element> per_replica;
  const int first = first_local_data_shard();
  for (int r = 0; r < static_cast<int>(devices_.size()); ++r)
    per_replica.push_back(shards[static_cast<std::size_t>(data_shard(r) - first)]);
  return per_replica;
}

std::optional<std::vector<data::Element>> Strategy::DistributedIterator::next() {
  auto element = iterator_->next();
  if (!element) return std::nullopt;
  return strategy_.split_batch(*element);
}

std::int64_t Strategy::WorkerIterator::skip(std::int64_t n) {
  std::int64_t skipped = 0;
  while (skipped < n && next()) ++skipped;
  return skipped;
}

namespace {
// One worker: every global batch is this worker's.
class WholeBatchIterator final : public Strategy::WorkerIterator {
 public:
  explicit WholeBatchIterator(std::unique_ptr<data::Iterator> it) : iterator_(std::move(it)) {}
  std::optional<Strategy::WorkerBatch> next() override {
    auto element = iterator_->next();
    if (!element) return std::nullopt;
    const std::int64_t rows =
        element->empty() || element->front().shape().rank() == 0 ? 0 : element->front().shape()[0];
    return Strategy::WorkerBatch{std::move(*element), rows};
  }

 private:
  std::unique_ptr<data::Iterator> iterator_;
};
}  // namespace

std::unique_ptr<Strategy::WorkerIterator> Strategy::worker_batches(const data::Dataset& dataset,
                                                                   const data::IterateOptions& options) const {
  return std::make_unique<WholeBatchIterator>(dataset.iterate(options));
}

bool Strategy::overlaps_communication() const {
  if (num_replicas_in_sync() <= 1) return false;
  if (distribution_.overlap_communication) return *distribution_.overlap_communication;
  if (distribution_.zero >= ZeroStage::k2) return true;
  const bool cpus = std::all_of(devices_.begin(), devices_.end(),
                                [](const devices::Device* d) { return d->type() == devices::DeviceType::kCPU; });
  if (!cpus || workers_on_this_machine() < num_workers()) return true;
  int threads = 0;
  for (const devices::Device* d : devices_) threads += d->intra_op_threads();
  return threads * workers_on_this_machine() < devices::usable_cpu_cores();
}

bool Strategy::fetches_to_device() const {
  switch (distribution_.fetch_to_device) {
    case FetchToDevice::kNever: return false;
    case FetchToDevice::kAlways: return true;
    case FetchToDevice::kAuto: break;
  }
  return std::any_of(devices_.begin(), devices_.end(), [](const devices::Device* d) { return !d->host_accessible(); });
}

std::unique_ptr<Strategy::WorkerIterator> Strategy::iterate_for_worker(const data::Dataset& dataset,
                                                                       const data::IterateOptions& options) const {
  auto batches = worker_batches(dataset, options);
  if (!fetches_to_device()) return batches;
  return detail::stage_on_devices(std::move(batches), devices_,
                                  [this](const data::Element& batch) { return split_batch(batch); },
                                  {.batches_ahead = distribution_.device_prefetch_batches, .owner = name_});
}

Strategy::DistributedIterator Strategy::experimental_distribute_dataset(const data::Dataset& dataset) const {
  return DistributedIterator(*this, dataset.iterate());
}

int ReplicaContext::num_replicas_in_sync() const { return strategy_.num_replicas_in_sync(); }

devices::Device& ReplicaContext::device() const {
  return *strategy_.replica_devices()[static_cast<std::size_t>(replica_id_)];
}

collective::Communicator& ReplicaContext::communicator() const { return strategy_.communicator(replica_id_); }

Tensor ReplicaContext::all_reduce(ReduceOp op, const Tensor& value) {
  Tensor result = value.clone();
  communicator().all_reduce(result, op, {.timeout = strategy_.distribution_options().collective_timeout});
  return result;
}

Strategy& default_strategy() {
  static auto* strategy = new DefaultStrategy;  // lives as long as the variables it made
  return *strategy;
}

Strategy& get_strategy() {
  if (!tls_scope_stack.empty()) return *tls_scope_stack.back();
  Strategy* global = g_global_strategy.load();
  return global != nullptr ? *global : default_strategy();
}

void set_global_strategy(Strategy* strategy) { g_global_strategy.store(strategy); }

Strategy* global_strategy() { return g_global_strategy.load(); }

bool has_strategy() { return !tls_scope_stack.empty(); }

OneDeviceStrategy::OneDeviceStrategy(std::string_view device)
    : Strategy("OneDeviceStrategy", {&devices::get_device(device)}, std::make_shared<InProcessAllReduce>(), {}) {}

MirroredStrategy::MirroredStrategy(MirroredOptions options)
    : Strategy("MirroredStrategy", mirrored_devices(options.devices), std::move(options.cross_device_ops),
               options.distribution) {}

MirroredStrategy::MirroredStrategy(std::vector<std::string> devices)
    : MirroredStrategy(MirroredOptions{.devices = std::move(devices)}) {}

}  // namespace tandem::strategy
