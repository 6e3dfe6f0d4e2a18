// The gradient reducer: bucket planning, the per-replica communication thread, overlap with
// backward, 16-bit compression, accumulation without communication, and the device-side path.
#include "tandem/strategy/gradient_reducer.h"

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "tandem/base/errors.h"
#include "tandem/graph/dtype.h"
#include "tandem/graph/op_registry.h"
#include "tandem/ops/array_ops.h"
#include "tandem/ops/detail/device_update.h"
#include "tandem/strategy/strategy.h"

namespace tandem::strategy {
namespace {

// Element-wise work on host memory runs in chunks of this many elements per task.
constexpr std::int64_t kAddGrain = 1 << 14;

// Runs a replica's bucket collectives on a thread of its own while the replica's backward goes
// on. Work runs in submission order; after an error the rest of the step's work is dropped (the
// strategy aborts the group, so the other replicas' matching calls fail too).
class CommThread {
 public:
  CommThread() : thread_([this] { loop(); }) {}
  ~CommThread() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  // Queues work for this step; called by the replica's thread. Returns the work's ticket, for wait.
  std::uint64_t submit(std::function<void()> work) {
    std::uint64_t ticket = 0;
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(work));
      ticket = ++submitted_;
    }
    wake_.notify_all();
    return ticket;
  }
  // Blocks until the work of `ticket` (and all work before it) has run; rethrows the step's first
  // error, which stays for drain and reset to see.
  void wait(std::uint64_t ticket) {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return completed_ >= ticket; });
    if (error_) std::rethrow_exception(error_);
  }
  // Blocks until everything submitted has run; rethrows the first error.
  void drain() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return queue_.empty() && !busy_; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }
  // At the start of a step: waits for work a failed step left (its collectives were aborted, so
  // this is quick) and forgets that step's error.
  void reset() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return queue_.empty() && !busy_; });
    error_ = nullptr;
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    while (true) {
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      auto work = std::move(queue_.front());
      queue_.erase(queue_.begin());
      busy_ = true;
      const bool failed = error_ != nullptr;
      lock.unlock();
      try {
        if (!failed) work();
      } catch (...) {
        std::lock_guard error_lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      // Before the work counts as done: what it captured (views of an executor's arena) must be
      // let go of by then, or the executor's next run would see the arena held and move it.
      work = nullptr;
      lock.lock();
      busy_ = false;
      ++completed_;
      idle_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::vector<std::function<void()>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::uint64_t submitted_ = 0, completed_ = 0;
  std::exception_ptr error_;
  std::thread thread_;
};

// dst += src, element-wise, on the device's threads (gradient accumulation).
void add_into(Tensor& dst, const Tensor& src) {
  TANDEM_REQUIRE(dst.device().host_accessible(), Unimplemented,
                 "gradient accumulation on {}: accumulation runs on host memory only so far",
                 dst.device().short_name());
  graph::dispatch<graph::FloatTypes>(dst.dtype(), "gradient accumulation", [&]<class T>() {
    T* __restrict d = static_cast<T*>(dst.raw_data());
    const T* __restrict s = static_cast<const T*>(src.raw_data());
    dst.device().parallel_for(dst.num_elements(), kAddGrain, [=](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) d[i] += s[i];
    });
  });
}

// value *= factor, on the host (a few per-channel statistics: no kernel needed).
void scale_in_place(Tensor& value, double factor) {
  Tensor host = value.to(devices::default_cpu_device());
  if (&host.device() != &value.device()) host = host.clone();
  graph::dispatch<graph::FloatTypes>(host.dtype(), "weighted sum across replicas", [&]<class T>() {
    T* p = host.data<T>();
    for (std::int64_t i = 0; i < host.num_elements(); ++i) p[i] = static_cast<T>(p[i] * factor);
  });
  if (host.raw_data() != value.raw_data()) value.copy_from(host);
}

// Shard `shard` of `gradient` (flattened) copied into `buffer`, a zero-padded [shard_elements]
// tensor made on the gradient's device at the first call (its padding stays zero).
const Tensor& copy_shard(Tensor& buffer, const Tensor& gradient, const ShardSpec& spec, int shard) {
  if (!buffer.defined()) buffer = Tensor::zeros({spec.shard_elements}, gradient.dtype(), gradient.device());
  const std::int64_t begin = spec.begin(shard), end = spec.end(shard);
  if (end > begin) flat_view(buffer, 0, end - begin).copy_from(flat_view(gradient, begin, end - begin));
  return buffer;
}

// A graph value (node, output) as one map key.
std::uint64_t value_key(int node, int index) {
  return static_cast<std::uint64_t>(node) << 32 | static_cast<std::uint32_t>(index);
}
std::uint64_t value_key(graph::Output value) { return value_key(value.node, value.index); }

// Which node reads each value of a graph first: one pass over the graph, then a lookup per
// gradient (a transformer's graph has thousands of nodes and hundreds of gradients).
class FirstReaders {
 public:
  explicit FirstReaders(const graph::Graph& graph) {
    for (int id = 0; id < graph.num_nodes(); ++id) {
      for (const auto& in : graph.node(id).inputs) first_.try_emplace(value_key(in), id);
    }
  }
  // The node that reads `value`, or -1; `value`'s own node when it is a view (an op that forwards
  // its input shares that input's buffer).
  int of(graph::Output value) const {
    if (value.producer().op->forwards_input >= 0) return value.node;
    const auto it = first_.find(value_key(value));
    return it == first_.end() ? -1 : it->second;
  }

 private:
  std::unordered_map<std::uint64_t, int> first_;
};

// Per value (undefined: skipped), the last node of `graph` that reads it, directly or through
// views of it (ops that forward an input); -1 when none does. The executor runs a plan's nodes in
// id order. One pass over the graph for all of them.
std::vector<int> last_readers(const graph::Graph& graph, std::span<const graph::Output> values) {
  std::unordered_map<std::uint64_t, std::size_t> root;  // a value or a view of it -> its index
  for (std::size_t v = 0; v < values.size(); ++v) {
    if (values[v].defined()) root.emplace(value_key(values[v]), v);
  }
  std::vector<int> last(values.size(), -1);
  for (int id = 0; id < graph.num_nodes() && !root.empty(); ++id) {
    const auto& node = graph.node(id);
    for (int i = 0; i < static_cast<int>(node.inputs.size()); ++i) {
      const auto& in = node.inputs[static_cast<std::size_t>(i)];
      const auto it = root.find(value_key(in));
      if (it == root.end()) continue;
      last[it->second] = id;
      if (node.op->forwards_input == i || node.op->forwards_input_of_same_shape == i)
        root.emplace(value_key(id, 0), it->second);
    }
  }
  return last;
}

}  // namespace

void make_gradients_reducible(graph::Graph& graph, std::span<graph::Output> gradients) {
  const FirstReaders readers(graph);  // before the copies: they read gradients themselves
  for (auto& gradient : gradients) {
    if (gradient.defined() && readers.of(gradient) >= 0) gradient = ops::copy(gradient);
  }
}

// Which gradients each bucket holds, and the order every replica reduces the buckets in.
struct GradientReducer::Plan {
  std::vector<std::vector<std::size_t>> buckets;       // gradient indices, per bucket
  std::vector<std::ptrdiff_t> bucket_of;               // per gradient; -1 when it is not communicated
  std::vector<std::size_t> order;                      // bucket ids, in the order backward completes them
  std::vector<std::vector<std::size_t>> dtype_groups;  // the communicated gradients, one group per dtype
  // ZeRO: per bucket, whether it is reduce-scattered, and its gradients' shard sizes (in the
  // bucket's order, as Communicator::reduce_scatter_ranges takes them); per gradient, its ShardSpec.
  std::vector<bool> scatter;
  bool any_scatter = false;
  std::vector<std::vector<std::int64_t>> shard_elements;
  std::vector<ShardSpec> spec;
  std::unordered_map<int, std::vector<std::pair<std::size_t, int>>> grads_of_node;  // node -> (gradient, output)
  // ZeRO stage 2 and 3 with a communication thread: per gradient the executor hands over
  // (graph::HandOff), the node after which its memory may be reused: the node that completes the
  // next bucket in order (every reduce-scattered bucket but the last); -1 for the others.
  std::vector<int> release_after;
  bool handed_off(std::size_t gradient) const { return release_after[gradient] >= 0; }
  // Per handed-off gradient, whether GradientReducerOptions::update applies its shard at the
  // release: no node reads its variable after the release's node.
  std::vector<char> updated_in_backward;
};

// Files a replica's gradients as backward computes them, and hands every bucket that is complete
// (in order) to the communication thread, except the last: backward is over when it completes,
// so the replica's own thread reduces it (a hand-off would only add a wake-up).
class GradientReducer::Observer final : public graph::NodeObserver {
 public:
  Observer(GradientReducer& reducer, int replica) : reducer_(reducer), replica_(replica) {}
  void node_done(int node_id, std::span<Tensor* const> outputs) override;
  void release(int gradient) override { reducer_.release_gradient(replica_, static_cast<std::size_t>(gradient)); }

 private:
  GradientReducer& reducer_;
  int replica_;
};

// ZeRO stage 3: gathers a replica's sharded parameters for its executor (graph::VariableGatherer).
// Each gather is one all_gather_ranges of the whole value's buffer, the replica's own shard copied
// into its range first; with a communication thread it is queued there, behind the gradient
// buckets handed over before it, so that every replica's collectives keep one order (the
// executor and the observer both submit from the replica's thread, in the plan's order).
class GradientReducer::Gatherer final : public graph::VariableGatherer {
 public:
  Gatherer(GradientReducer& reducer, int replica) : reducer_(reducer), replica_(replica) {}
  void add(int node_id, std::shared_ptr<Variable> variable) { entries_[node_id].variable = std::move(variable); }
  void start_gather(int node_id, const Tensor& whole) override;
  void finish_gather(int node_id) override;

 private:
  struct Entry {
    std::shared_ptr<Variable> variable;
    std::uint64_t ticket = 0;  // of the gather queued last; 0: none queued
  };
  Entry& entry(int node_id);
  GradientReducer& reducer_;
  int replica_;
  std::unordered_map<int, Entry> entries_;
};

struct GradientReducer::ReplicaState {
  std::unique_ptr<Observer> observer;
  std::unique_ptr<Gatherer> gatherer;  // made by the first bind_gathered_variable
  StepKind kind = StepKind::kReduce;
  // This step's gradients: views of the run's outputs, or zeros for an empty shard.
  std::vector<Tensor> grads;
  std::vector<Tensor> zero_grads;
  std::vector<int> bucket_pending;  // gradients each bucket still waits for
  std::vector<std::uint64_t> bucket_ticket;  // per bucket, its work on `comm` this step (0: none)
  // Per gradient, this step: whether the executor took its memory back (a handed-off gradient:
  // accumulated at once on a micro-step, its shard copied out or applied on a reduce step), and
  // whether GradientReducerOptions::update applied its shard.
  std::vector<char> released;
  std::vector<char> updated;
  std::size_t next_bucket = 0;      // position in Plan::order of the next bucket to reduce
  std::int64_t overlapped = 0;      // buckets handed to `comm` during backward, all steps
  bool overlap = false;
  std::unique_ptr<CommThread> comm;
  std::vector<Tensor> extras;  // sum_with_last_bucket's tensors for this step
  // DistributionOptions::gradient_all_reduce_dtype: per bucket, its gradients rounded to 16 bits
  // in one buffer (made at the first step that needs it).
  std::vector<Tensor> compressed;
  std::vector<Tensor> device_group;  // queue_reduction_on_device's tensors of one call (reused)
  std::vector<Tensor> out;           // finish_step's gradients: grads, shards for reduce-scattered ones
  std::vector<Tensor> bucket;        // the tensors of one range collective (reused)
  // Per gradient, a copy of the replica's shard of the sum (copy_shard): for a handed-off
  // gradient, made after its bucket's reduce-scatter (stage 2's 1/N of the gradients); for
  // another, when its range is cut short by the variable's end (zero-padded).
  std::vector<Tensor> shard_copy;
};

void GradientReducer::Observer::node_done(int node_id, std::span<Tensor* const> outputs) {
  const Plan& plan = *reducer_.plan_;
  const auto it = plan.grads_of_node.find(node_id);
  if (it == plan.grads_of_node.end()) return;
  ReplicaState& s = reducer_.state(replica_);
  for (const auto& [grad, out] : it->second) {
    s.grads[grad] = *outputs[static_cast<std::size_t>(out)];
    if (plan.bucket_of[grad] >= 0) --s.bucket_pending[static_cast<std::size_t>(plan.bucket_of[grad])];
  }
  if (s.kind != StepKind::kReduce || !s.overlap) return;
  while (s.next_bucket + 1 < plan.order.size() && s.bucket_pending[plan.order[s.next_bucket]] == 0) {
    const std::size_t bucket = plan.order[s.next_bucket++];
    ++s.overlapped;
    s.bucket_ticket[bucket] = s.comm->submit([this, bucket] { reducer_.reduce_bucket(replica_, bucket); });
  }
}

GradientReducer::Gatherer::Entry& GradientReducer::Gatherer::entry(int node_id) {
  const auto it = entries_.find(node_id);
  TANDEM_REQUIRE(it != entries_.end(), FailedPrecondition,
                 "gradient reducer: replica {} was asked to gather graph node {}, which no variable was bound to",
                 replica_, node_id);
  return it->second;
}

void GradientReducer::Gatherer::start_gather(int node_id, const Tensor& whole) {
  Entry& e = entry(node_id);
  const Variable& variable = *e.variable;
  const ShardSpec& spec = *variable.sharding();
  Strategy& strategy = reducer_.strategy_;
  const int me = strategy.data_shard(replica_);
  const std::int64_t begin = spec.begin(me), end = spec.end(me);
  if (end > begin) flat_view(whole, begin, end - begin).copy_from(flat_view(variable.value(replica_), 0, end - begin));
  if (spec.num_shards == 1) return;
  auto gather = [&strategy, replica = replica_, target = Tensor(whole), shard = spec.shard_elements]() mutable {
    strategy.communicator(replica).all_gather_ranges({&target, 1}, {&shard, 1},
                                                     {.timeout = strategy.distribution_options().collective_timeout});
  };
  ReplicaState& s = reducer_.state(replica_);
  if (s.comm) {
    e.ticket = s.comm->submit(std::move(gather));
  } else {
    gather();
  }
}

void GradientReducer::Gatherer::finish_gather(int node_id) {
  Entry& e = entry(node_id);
  if (e.ticket == 0) return;
  reducer_.state(replica_).comm->wait(std::exchange(e.ticket, 0));
}

void GradientReducer::bind_gathered_variable(int replica, graph::Executor& executor, graph::Output node,
                                             std::shared_ptr<Variable> variable) {
  TANDEM_REQUIRE(variable != nullptr && variable->sharding().has_value(), InvalidArgument,
                 "gradient reducer of {}: bind_gathered_variable needs a sharded variable; \"{}\" is whole",
                 strategy_.name(), variable == nullptr ? std::string("(null)") : variable->name());
  ReplicaState& s = state(replica);
  if (!s.gatherer) s.gatherer = std::make_unique<Gatherer>(*this, replica);
  s.gatherer->add(node.node, std::move(variable));
  executor.bind_gathered_variable(node, s.gatherer.get());
}

GradientReducer::GradientReducer(Strategy& strategy, std::vector<GradientSource> gradients,
                                 GradientReducerOptions options)
    : strategy_(strategy),
      sources_(std::move(gradients)),
      options_(std::move(options)),
      plan_(std::make_unique<Plan>()) {
  TANDEM_REQUIRE(options_.accumulators.empty() || options_.accumulators.size() == sources_.size(), InvalidArgument,
                 "gradient reducer: {} accumulators for {} gradients", options_.accumulators.size(), sources_.size());
  std::unique_ptr<FirstReaders> readers;  // of the gradients' graph, made at the first gradient
  for (std::size_t k = 0; k < sources_.size(); ++k) {
    const auto& variable = sources_[k].variable;
    const auto& gradient = sources_[k].gradient;
    TANDEM_REQUIRE(variable != nullptr && gradient.defined(), InvalidArgument,
                   "gradient reducer: gradient {} has no {}", k, variable == nullptr ? "variable" : "graph value");
    TANDEM_REQUIRE(&variable->strategy() == &strategy_, FailedPrecondition,
                   "gradient reducer of {}: variable \"{}\" was created under {}", strategy_.name(), variable->name(),
                   variable->strategy().name());
    TANDEM_REQUIRE(gradient.dtype() == variable->dtype() && gradient.shape().compatible_with(variable->graph_shape()),
                   InvalidArgument, "gradient reducer: the gradient of variable \"{}\" ({} {}) is {} {} ({})",
                   variable->name(), variable->dtype(), variable->graph_shape(), gradient.dtype(), gradient.shape(),
                   gradient.name());
    if (!readers) readers = std::make_unique<FirstReaders>(*gradient.graph);
    TANDEM_REQUIRE(gradient.graph == sources_.front().gradient.graph, InvalidArgument,
                   "gradient reducer: the gradient of variable \"{}\" ({}) is in another graph than the first one's",
                   variable->name(), gradient.name());
    const int reader = readers->of(gradient);
    TANDEM_REQUIRE(
        reader < 0, InvalidArgument,
        "gradient reducer: the gradient of variable \"{}\" ({}) is {}; it is reduced in place while backward "
        "goes on, so give it a buffer of its own first (make_gradients_reducible)",
        variable->name(), gradient.name(),
        reader == gradient.node ? std::string("a view of another value")
                                : fmt::format("read by {}", gradient.graph->node(reader).label()));
    if (!options_.accumulators.empty()) {
      const auto& acc = *options_.accumulators[k];
      TANDEM_REQUIRE(acc.dtype() == variable->dtype() && acc.shape() == variable->graph_shape(), InvalidArgument,
                     "gradient reducer: accumulator \"{}\" is {} {}, its variable \"{}\" {} {}", acc.name(),
                     acc.dtype(), acc.shape(), variable->name(), variable->dtype(), variable->graph_shape());
    }
  }

  // Buckets in reverse creation order: backward computes the last layer's gradients first. A new
  // bucket starts when the next gradient would overflow this one, or has another dtype (a bucket
  // is reduced as one buffer).
  const auto& distribution = strategy_.distribution_options();
  auto& plan = *plan_;
  plan.bucket_of.assign(sources_.size(), -1);
  plan.spec.resize(sources_.size());
  std::int64_t bytes = 0;
  for (std::size_t k = sources_.size(); k-- > 0;) {
    const auto& variable = sources_[k].variable;
    const auto& gradient = sources_[k].gradient;
    plan.grads_of_node[gradient.node].emplace_back(k, gradient.index);
    const auto reduction = strategy_.variable_plan(*variable).reduction;
    if (reduction == VariablePlan::Reduction::kNone) continue;
    const bool scatter = reduction == VariablePlan::Reduction::kReduceScatter;
    std::int64_t limit = plan.buckets.size() == 1 ? distribution.first_bucket_bytes : distribution.bucket_bytes;
    if (scatter && distribution.zero >= ZeroStage::k2) limit = std::min(limit, distribution.reduce_bucket_bytes);
    const auto size =
        variable->graph_shape().num_elements() * static_cast<std::int64_t>(graph::dtype_size(variable->dtype()));
    const bool starts_new = plan.buckets.empty() || (bytes > 0 && bytes + size > limit) ||
                            sources_[plan.buckets.back().front()].variable->dtype() != variable->dtype() ||
                            plan.scatter.back() != scatter;
    if (starts_new) {
      plan.buckets.emplace_back();
      plan.scatter.push_back(scatter);
      plan.shard_elements.emplace_back();
      bytes = 0;
    }
    plan.buckets.back().push_back(k);
    plan.bucket_of[k] = static_cast<std::ptrdiff_t>(plan.buckets.size() - 1);
    bytes += size;
    if (scatter) {
      plan.any_scatter = true;
      plan.spec[k] = *strategy_.zero_shard_spec(*variable);
      plan.shard_elements.back().push_back(plan.spec[k].shard_elements);
    }
  }
  // Backward completes a bucket with its last-computed gradient: the order is by that node.
  std::vector<std::pair<int, std::size_t>> completion;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    int last = -1;
    for (auto k : plan.buckets[b]) last = std::max(last, sources_[k].gradient.node);
    completion.emplace_back(last, b);
  }
  std::sort(completion.begin(), completion.end());
  for (const auto& [node, b] : completion) plan.order.push_back(b);
  plan.release_after.assign(sources_.size(), -1);
  const bool overlap = strategy_.overlaps_communication();
  if (distribution.zero >= ZeroStage::k2 && overlap) {
    for (std::size_t i = 0; i + 1 < completion.size(); ++i) {
      const std::size_t b = completion[i].second;
      if (!plan.scatter[b]) continue;
      for (const auto k : plan.buckets[b]) plan.release_after[k] = completion[i + 1].first;
    }
  }
  plan.updated_in_backward.assign(sources_.size(), 0);
  if (options_.update && !sources_.empty()) {
    std::vector<graph::Output> values;
    for (std::size_t k = 0; k < sources_.size(); ++k) {
      const auto& value = sources_[k].value;
      TANDEM_REQUIRE(!value.defined() || value.graph == sources_[k].gradient.graph, InvalidArgument,
                     "gradient reducer: variable \"{}\"'s node ({}) is in another graph than its gradient",
                     sources_[k].variable->name(), value.name());
      values.push_back(plan.handed_off(k) ? value : graph::Output{});
    }
    // An update must wait until backward no longer reads the variable: the release runs after
    // release_after's node.
    const auto last = last_readers(*sources_.front().gradient.graph, values);
    for (std::size_t k = 0; k < sources_.size(); ++k) {
      plan.updated_in_backward[k] = values[k].defined() && last[k] <= plan.release_after[k];
    }
  }
  // The device-side reduction: one call per dtype (a bucket has one dtype).
  std::map<DType, std::size_t> group_of;
  for (const auto& bucket : plan.buckets) {
    const DType dtype = sources_[bucket.front()].variable->dtype();
    const auto [it, added] = group_of.try_emplace(dtype, plan.dtype_groups.size());
    if (added) plan.dtype_groups.emplace_back();
    auto& group = plan.dtype_groups[it->second];
    group.insert(group.end(), bucket.begin(), bucket.end());
  }

  for (std::size_t r = 0; r < strategy_.replica_devices().size(); ++r) {
    auto s = std::make_unique<ReplicaState>();
    s->observer = std::make_unique<Observer>(*this, static_cast<int>(r));
    s->overlap = overlap;
    s->shard_copy.resize(sources_.size());
    if (overlap) s->comm = std::make_unique<CommThread>();
    replicas_.push_back(std::move(s));
  }
}

GradientReducer::~GradientReducer() = default;

std::vector<std::vector<std::size_t>> GradientReducer::buckets() const {
  std::vector<std::vector<std::size_t>> out;
  for (const std::size_t b : plan_->order) out.push_back(plan_->buckets[b]);
  return out;
}

GradientReducer::ReplicaState& GradientReducer::state(int replica) {
  TANDEM_REQUIRE(replica >= 0 && static_cast<std::size_t>(replica) < replicas_.size(), InvalidArgument,
                 "gradient reducer of {}: replica {} out of range [0, {})", strategy_.name(), replica,
                 replicas_.size());
  return *replicas_[static_cast<std::size_t>(replica)];
}

graph::NodeObserver* GradientReducer::observer(int replica) { return state(replica).observer.get(); }

std::int64_t GradientReducer::overlapped_buckets(int replica) { return state(replica).overlapped; }

void GradientReducer::begin_step(int replica, StepKind kind) {
  TANDEM_REQUIRE(kind == StepKind::kReduce || !options_.accumulators.empty(), FailedPrecondition,
                 "gradient reducer of {}: an accumulation step needs accumulators (GradientReducerOptions)",
                 strategy_.name());
  ReplicaState& s = state(replica);
  if (s.comm) s.comm->reset();
  s.kind = kind;
  s.grads.assign(sources_.size(), Tensor());
  s.bucket_pending.resize(plan_->buckets.size());
  for (std::size_t b = 0; b < plan_->buckets.size(); ++b)
    s.bucket_pending[b] = static_cast<int>(plan_->buckets[b].size());
  s.next_bucket = 0;
  s.bucket_ticket.assign(plan_->buckets.size(), 0);
  s.released.assign(sources_.size(), 0);
  s.updated.assign(sources_.size(), 0);
  s.extras.clear();
  s.out.clear();  // views of the last run's arena: held, they would move it
}

void GradientReducer::set_zero_gradients(int replica) {
  ReplicaState& s = state(replica);
  if (s.zero_grads.empty()) {
    for (const auto& source : sources_) {
      const auto& variable = source.variable;
      s.zero_grads.push_back(
          Tensor::zeros(variable->graph_shape(), variable->dtype(), variable->value(replica).device()));
    }
  }
  for (std::size_t k = 0; k < sources_.size(); ++k) {
    Tensor& z = s.zero_grads[k];
    z.device().fill_zero(z.raw_data(), z.nbytes());  // an earlier step may have reduced into it
    s.grads[k] = z;
  }
  std::fill(s.bucket_pending.begin(), s.bucket_pending.end(), 0);
}

DType GradientReducer::extra_dtype() const {
  if (plan_->order.empty()) return DType::kF32;
  return sources_[plan_->buckets[plan_->order.back()].front()].variable->dtype();
}

bool GradientReducer::sum_with_last_bucket(int replica, std::span<const Tensor> extras) {
  ReplicaState& s = state(replica);
  if (s.kind != StepKind::kReduce || plan_->order.empty()) return false;
  for (const Tensor& extra : extras) {
    TANDEM_REQUIRE(extra.dtype() == extra_dtype(), InvalidArgument,
                   "gradient reducer: a tensor summed with the last bucket is {} {}; expected {} (the last bucket's "
                   "dtype)",
                   extra.dtype(), extra.shape(), extra_dtype());
  }
  s.extras.insert(s.extras.end(), extras.begin(), extras.end());
  return true;
}

std::span<const Tensor> GradientReducer::finish_step(int replica) {
  ReplicaState& s = state(replica);
  for (std::size_t k = 0; k < sources_.size(); ++k) {
    TANDEM_REQUIRE(s.grads[k].defined(), FailedPrecondition,
                   "gradient reducer: replica {} finished its step without the gradient of variable \"{}\" ({}); run "
                   "the graph with RunOptions::observer = reducer.observer({}) and fetch every gradient, or call "
                   "set_zero_gradients",
                   replica, sources_[k].variable->name(), sources_[k].gradient.name(), replica);
  }
  if (s.kind == StepKind::kAccumulate) {
    for (std::size_t k = 0; k < sources_.size(); ++k) {
      if (!s.released[k]) add_into(options_.accumulators[k]->value(replica), s.grads[k]);
    }
    return s.grads;
  }
  // The buckets handed over during backward first; then the rest, in the same order.
  if (s.comm) s.comm->drain();
  while (s.next_bucket < plan_->order.size()) reduce_bucket(replica, plan_->order[s.next_bucket++]);
  if (!plan_->any_scatter) return s.grads;
  s.out.assign(s.grads.begin(), s.grads.end());
  for (std::size_t k = 0; k < sources_.size(); ++k) {
    const auto b = plan_->bucket_of[k];
    if (b < 0 || !plan_->scatter[static_cast<std::size_t>(b)]) continue;
    if (plan_->updated_in_backward[k]) {
      // Not released: the replica had no run this step (set_zero_gradients); the sum is still whole.
      if (!s.updated[k]) update_in_backward(replica, k);
      s.out[k] = Tensor();
      continue;
    }
    if (plan_->handed_off(k)) {  // copied out after its bucket's reduce-scatter
      s.out[k] = s.shard_copy[k];
      continue;
    }
    s.out[k] = shard_of_sum(replica, k);
  }
  return s.out;
}

// One bucket, all-reduced (SUM) across the replicas in sync, in place. After accumulated
// micro-steps, this replica's accumulated sums are added first.
void GradientReducer::reduce_bucket(int replica, std::size_t bucket) {
  ReplicaState& s = state(replica);
  std::vector<Tensor> tensors;
  tensors.reserve(plan_->buckets[bucket].size() + s.extras.size());
  for (const auto k : plan_->buckets[bucket]) {
    if (!options_.accumulators.empty()) add_into(s.grads[k], options_.accumulators[k]->value(replica));
    tensors.push_back(s.grads[k]);
  }
  const bool with_extras = !s.extras.empty() && bucket == plan_->order.back();
  if (plan_->scatter[bucket]) {
    reduce_scatter_bucket(replica, bucket, with_extras ? std::span<Tensor>(s.extras) : std::span<Tensor>());
    return;
  }
  auto& comm = strategy_.communicator(replica);
  const auto& distribution = strategy_.distribution_options();
  const collective::CallOptions call{.timeout = distribution.collective_timeout};
  if (comm.size() > 1 && distribution.gradient_all_reduce_dtype && tensors.front().dtype() == DType::kF32) {
    reduce_compressed(replica, bucket, tensors, *distribution.gradient_all_reduce_dtype);
    if (with_extras) comm.all_reduce(s.extras, collective::ReduceOp::kSum, call);  // the sums stay exact
    return;
  }
  if (with_extras) tensors.insert(tensors.end(), s.extras.begin(), s.extras.end());
  if (comm.size() > 1) comm.all_reduce(tensors, collective::ReduceOp::kSum, call);
}

// A ZeRO bucket: its gradients reduce-scattered by ranges (Communicator::reduce_scatter_ranges),
// each replica's shard of each sum left in the replica's range of the gradient's own buffer,
// where finish_step's view finds it; the extras riding with the last bucket are summed whole on
// every replica in the same call. The in-process group reads and writes the ranges in place;
// other backends pack them into one buffer for the call (one bucket's worth at a time).
void GradientReducer::reduce_scatter_bucket(int replica, std::size_t bucket, std::span<Tensor> extras) {
  ReplicaState& s = state(replica);
  auto& comm = strategy_.communicator(replica);
  const int n = strategy_.data_shards_in_sync();
  TANDEM_REQUIRE(comm.size() == n && comm.rank() == strategy_.data_shard(replica), FailedPrecondition,
                 "gradient reducer of {}: replica {} is rank {} of {} in its communicator; a reduce-scatter over the "
                 "data-parallel replicas needs rank {} of {}",
                 strategy_.name(), replica, comm.rank(), comm.size(), strategy_.data_shard(replica), n);
  if (n == 1) return;  // the replica's range is the whole gradient, and the extras are their own sums
  s.bucket.clear();
  for (const auto k : plan_->buckets[bucket]) s.bucket.push_back(s.grads[k]);
  comm.reduce_scatter_ranges(s.bucket, plan_->shard_elements[bucket], extras, collective::ReduceOp::kSum,
                             {.timeout = strategy_.distribution_options().collective_timeout});
  s.bucket.clear();  // views of the run's arena: held, they would move it next run
  // Handed-off gradients: the shard copied out, so that the executor can reuse the whole buffer
  // (or applied at the release, GradientReducerOptions::update).
  for (const auto k : plan_->buckets[bucket]) {
    if (plan_->handed_off(k) && !plan_->updated_in_backward[k]) {
      copy_shard(s.shard_copy[k], s.grads[k], plan_->spec[k], comm.rank());
    }
  }
}

std::vector<graph::HandOff> GradientReducer::hand_offs(int first_fetch) const {
  std::vector<graph::HandOff> out;
  for (std::size_t k = 0; k < sources_.size(); ++k) {
    if (!plan_->handed_off(k)) continue;
    out.push_back({.fetch = first_fetch + static_cast<int>(k),
                   .until_node = plan_->release_after[k],
                   .tag = static_cast<int>(k)});
  }
  return out;
}

// The executor is about to reuse gradient k's memory: on a micro-step it is added to its
// accumulator now; on a reduce step its bucket's work (the reduce-scatter, the shard copied out)
// must be done, which the communication thread's ticket tells.
void GradientReducer::release_gradient(int replica, std::size_t k) {
  ReplicaState& s = state(replica);
  if (s.released[k] || !s.grads[k].defined()) return;
  s.released[k] = 1;
  if (s.kind == StepKind::kAccumulate) {
    add_into(options_.accumulators[k]->value(replica), s.grads[k]);
    return;
  }
  const auto b = static_cast<std::size_t>(plan_->bucket_of[k]);
  TANDEM_ASSERT(s.comm && s.bucket_ticket[b] != 0,
                "gradient reducer of {}: gradient {} released before its bucket was "
                "handed to the communication thread",
                strategy_.name(), k);
  s.comm->wait(s.bucket_ticket[b]);
  if (plan_->updated_in_backward[k]) update_in_backward(replica, k);
}

// The reduce-scatter left the replica's shard of the sum in its range of the whole gradient: a
// view of it, or a zero-padded copy where the variable's end cuts the range short.
Tensor GradientReducer::shard_of_sum(int replica, std::size_t k) {
  ReplicaState& s = state(replica);
  const ShardSpec& spec = plan_->spec[k];
  const int me = strategy_.data_shard(replica);
  const std::int64_t begin = spec.begin(me), end = spec.end(me);
  return end - begin == spec.shard_elements ? flat_view(s.grads[k], begin, spec.shard_elements)
                                            : copy_shard(s.shard_copy[k], s.grads[k], spec, me);
}

void GradientReducer::update_in_backward(int replica, std::size_t k) {
  options_.update(replica, k, shard_of_sum(replica, k));
  state(replica).updated[k] = 1;
}

void GradientReducer::gather_updated(int replica) {
  ReplicaState& s = state(replica);
  TANDEM_REQUIRE(s.kind == StepKind::kReduce, FailedPrecondition,
                 "gradient reducer of {}: gather_updated on replica {} after a micro-step; call it after the "
                 "optimizer applied a reduce step's gradients",
                 strategy_.name(), replica);
  const int n = strategy_.data_shards_in_sync();
  if (n == 1) return;  // the replica's range is the whole variable
  // Each bucket's variables gathered where they are: no packed copy in the in-process group.
  // Sharded parameters (stage 3) stay sharded: the executor gathers them when it needs them.
  std::vector<std::int64_t> shard_elements;
  for (const std::size_t bucket : plan_->order) {
    if (!plan_->scatter[bucket]) continue;
    s.bucket.clear();
    shard_elements.clear();
    const auto& members = plan_->buckets[bucket];
    for (std::size_t i = 0; i < members.size(); ++i) {
      const Variable& variable = *sources_[members[i]].variable;
      if (variable.sharding()) continue;
      s.bucket.push_back(sources_[members[i]].variable->value(replica));
      shard_elements.push_back(plan_->shard_elements[bucket][i]);
    }
    if (s.bucket.empty()) continue;
    strategy_.communicator(replica).all_gather_ranges(s.bucket, shard_elements,
                                                      {.timeout = strategy_.distribution_options().collective_timeout});
  }
  s.bucket.clear();
}

// The bucket's float32 gradients, all-reduced as 16-bit values (PyTorch DDP's compression hooks):
// narrowed into one buffer, summed, widened back in place.
void GradientReducer::reduce_compressed(int replica, std::size_t bucket, std::span<Tensor> grads, DType wire) {
  TANDEM_REQUIRE(graph::is_low_precision(wire), InvalidArgument,
                 "DistributionOptions::gradient_all_reduce_dtype is {}; expected float16 or bfloat16", wire);
  std::int64_t elements = 0;
  for (const auto& g : grads) elements += g.num_elements();
  auto& device = grads.front().device();
  const bool on_host = device.host_accessible();
  auto& buffers = state(replica).compressed;
  if (buffers.size() != plan_->buckets.size()) buffers.assign(plan_->buckets.size(), Tensor());
  Tensor& buffer = buffers[bucket];
  if (!buffer.defined() || buffer.num_elements() != elements || buffer.dtype() != wire) {
    buffer = Tensor::empty({elements}, wire, device);
  }
  auto* wire_bytes = static_cast<std::byte*>(buffer.raw_data());
  const auto convert = [&](bool narrow) {
    std::int64_t offset = 0;
    for (auto& g : grads) {
      std::byte* w = wire_bytes + offset * 2;
      const std::int64_t n = g.num_elements();
      if (on_host && narrow) {
        graph::narrow_from_float32(static_cast<const float*>(g.raw_data()), wire, w, n);
      } else if (on_host) {
        graph::widen_to_float32(wire, w, static_cast<float*>(g.raw_data()), n);
      } else if (narrow) {
        ops::detail::convert_on_device(device, g.raw_data(), DType::kF32, w, wire, n);
      } else {
        ops::detail::convert_on_device(device, w, wire, g.raw_data(), DType::kF32, n);
      }
      offset += n;
    }
  };
  convert(/*narrow=*/true);
  strategy_.communicator(replica).all_reduce({&buffer, 1}, collective::ReduceOp::kSum,
                                             {.timeout = strategy_.distribution_options().collective_timeout});
  convert(/*narrow=*/false);
}

bool GradientReducer::reduces_on_device(int replica) {
  if (strategy_.num_workers() > 1 || strategy_.distribution_options().gradient_all_reduce_dtype) return false;
  if (plan_->any_scatter) return false;
  if (!options_.accumulators.empty()) return false;
  if (strategy_.replica_devices().size() == 1) return true;
  return strategy_.communicator(replica).enqueues_on_device();
}

void GradientReducer::queue_reduction_on_device(int replica, std::span<Tensor> gradients) {
  TANDEM_REQUIRE(reduces_on_device(replica), FailedPrecondition,
                 "gradient reducer of {}: replica {}'s reduction cannot be queued on its device", strategy_.name(),
                 replica);
  TANDEM_REQUIRE(gradients.size() == sources_.size(), InvalidArgument,
                 "gradient reducer: {} gradients for {} variables", gradients.size(), sources_.size());
  if (strategy_.replica_devices().size() == 1) return;
  // One call per dtype: NCCL groups a call's tensors into one launch. No buckets: nothing
  // overlaps backward here, the whole step is one graph.
  auto& tensors = state(replica).device_group;
  for (const auto& group : plan_->dtype_groups) {
    tensors.clear();
    for (const auto k : group) tensors.push_back(gradients[k]);
    strategy_.communicator(replica).all_reduce_on_device(tensors, collective::ReduceOp::kSum);
  }
  tensors.clear();  // views of the run's arena: held, they would move it next run
}

void GradientReducer::weighted_sum_across_replicas(int replica, std::span<Tensor> values, double weight) {
  auto& comm = strategy_.communicator(replica);
  if (comm.size() == 1 || values.empty()) return;
  for (Tensor& value : values) scale_in_place(value, weight);
  const collective::CallOptions call{.timeout = strategy_.distribution_options().collective_timeout};
  const bool one_dtype =
      std::all_of(values.begin(), values.end(), [&](const Tensor& v) { return v.dtype() == values.front().dtype(); });
  if (one_dtype) {
    comm.all_reduce(values, collective::ReduceOp::kSum, call);
    return;
  }
  for (Tensor& value : values) comm.all_reduce(value, collective::ReduceOp::kSum, call);
}

bool GradientReducer::weighted_sum_with_last_bucket(int replica, std::span<Tensor> values, double weight) {
  ReplicaState& s = state(replica);
  if (s.kind != StepKind::kReduce || plan_->order.empty()) return false;
  for (const Tensor& value : values) {
    if (value.dtype() != extra_dtype()) return false;
  }
  if (strategy_.communicator(replica).size() > 1) {
    for (Tensor& value : values) scale_in_place(value, weight);
  }
  return sum_with_last_bucket(replica, values);
}

}  // namespace tandem::strategy
