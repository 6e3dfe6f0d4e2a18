// tandem/graph/executor.h — runs a graph on one device.
//
// An Executor is one instance of a graph on one device: its own variable bindings, its own
// planned memory, its own random stream. Several executors of the same graph may run at the
// same time on different devices in different threads (that is how replicas run); one executor
// is used by one thread at a time.
//
// run(feeds, fetches) runs only the nodes the fetches need (dead nodes are pruned), in node
// order, on the calling thread; kernels parallelise internally on the device's threads. The
// first run for a given set of fetches and feed shapes builds a plan: concrete shapes, kernels,
// and one arena holding every intermediate tensor, packed by lifetime (memory_planner.h). Later
// runs with the same key reuse the plan and allocate nothing.
//
// Fetched tensors that are intermediates are views into the arena. Holding one across the next
// run is safe: the executor sees the arena is still referenced and moves to a fresh one.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <string>
#include <vector>

#include "tandem/devices/device.h"
#include "tandem/graph/graph.h"
#include "tandem/graph/tensor.h"

namespace tandem::graph {

struct ExecutorOptions {
  std::uint64_t seed = 0;  // mixed into every random op's stream (replicas pass different seeds)
  // Time every kernel and keep totals per op (profile()). Costs two clock reads per node.
  bool profile = false;
  // On GPUs, after two runs of a plan, record its kernels once as a CUDA graph and replay that:
  // one launch per run instead of one per node. Only for plans whose every kernel can be
  // recorded (no host fallback, no random op); a failed recording falls back to normal runs with
  // a one-line warning. TANDEM_CUDA_GRAPHS=0 turns it off for every executor. Ignored on CPUs.
  bool cuda_graphs = true;
};

// Kernel time per op, summed over the nodes and runs of an executor.
struct OpProfile {
  std::string op;
  std::int64_t calls = 0;
  double seconds = 0;
};

// Told when each node of a run has finished, on the thread running the executor. A gradient
// reducer uses it to start all-reducing a bucket while the rest of backward runs. The outputs are
// the node's values in this run; they stay valid until the next run of the same executor.
class NodeObserver {
 public:
  virtual ~NodeObserver() = default;
  virtual void node_done(int node_id, std::span<Tensor* const> outputs) = 0;
  // A handed-off fetch's memory is about to be reused (RunOptions::hand_offs): returns once the
  // observer no longer reads the value it was given in node_done.
  virtual void release(int /*tag*/) {}
};

// A fetch the observer takes over as it is computed (RunOptions::hand_offs): the run returns it
// undefined, and its arena bytes are reused once node `until_node` has run and the observer's
// release(tag) has returned. ZeRO's gradients: reduce-scattered while backward goes on, their
// shards copied out, the whole gradient's memory then reused by the rest of backward.
struct HandOff {
  int fetch = 0;       // index into the run's fetches
  int until_node = 0;  // a node of the plan that runs at or after the fetch's
  int tag = 0;         // passed to NodeObserver::release
};

// The source of a variable whose whole value an executor does not keep between runs (ZeRO stage
// 3: each replica stores one shard of each parameter; strategy/gradient_reducer.h). The executor
// asks for the whole value, into memory of its arena, just before the steps that read it, and
// reuses that memory for other values after them: a plan reads each such variable in windows
// (a window ends where another gathered variable's window opens before this one's next reader,
// so that a layer's weights are gathered once for its forward and once again for its backward),
// and each window's gather is started one window ahead (prefetch), while the steps before it run.
// Who calls: the executor, on its own thread, in the plan's order, the same on every run of a
// plan. What blocks: finish_gather, until the value is whole. Throws: what the gather throws
// (a collective's DeadlineExceeded or Unavailable), out of Executor::run.
class VariableGatherer {
 public:
  virtual ~VariableGatherer() = default;
  // Starts writing variable node `node_id`'s whole value into `whole` (its dtype and shape); may
  // return before it is written (a communication thread).
  virtual void start_gather(int node_id, const Tensor& whole) = 0;
  // Returns once the gather started last for `node_id` has written its value.
  virtual void finish_gather(int node_id) = 0;
};

// What RunOptions::tail is given.
struct TailContext {
  std::span<const Tensor> fetched;   // the run's fetches (the values it will return)
  const void* fault_word = nullptr;  // the plan's fault word (KernelContext::fault_word); null on CPUs
};

struct RunOptions {
  // Random ops (Dropout) draw from a stream keyed by (seed, node, step); the step counts runs.
  // Setting it replays a step's randomness exactly (gradient checks, deterministic tests).
  std::optional<std::uint64_t> random_step;
  NodeObserver* observer = nullptr;
  // Device work queued right after the plan's kernels, as part of the run (a trainer's gradient
  // all-reduce and optimizer update: the whole training step). When the plan is recorded as a
  // CUDA graph the tail is recorded into the same graph and replayed with it, not called again:
  // it must queue the same work on every call, and read what changes from step to step from
  // device memory. Otherwise it is called on every run, after the kernels, before the deferred
  // checks. It must not block on the device.
  std::function<void(const TailContext&)> tail;
  // Memory the tail uses outside the plan (the variables and optimizer slots it updates): the
  // graph is recorded again when any of it moves. Give the same list, in the same order, on
  // every run with a tail.
  std::vector<const void*> tail_addresses;
  // Fetches handed to `observer` instead of returned (HandOff); part of the plan's key. Needs an
  // observer. Plans with hand-offs are not recorded as CUDA graphs.
  std::span<const HandOff> hand_offs;
};

struct PlanStats {
  int nodes_run = 0;  // nodes in the pruned plan that execute a kernel
  int nodes_in_graph = 0;
  std::int64_t arena_bytes = 0;     // peak bytes of intermediates, with reuse
  std::int64_t unshared_bytes = 0;  // what one buffer per intermediate would need
  int plans_cached = 0;
  // Gathered variables (bind_gathered_variable): windows per run, and their bytes (each window
  // holds its variable's whole value in the arena, counted in arena_bytes too).
  int gathers = 0;
  std::int64_t gathered_bytes = 0;
  // Ops without a kernel for the executor's device (GPU) that run on host copies, by op name.
  std::vector<std::string> ops_on_host;
  // Whether the plan's kernels may be recorded as a CUDA graph (ExecutorOptions::cuda_graphs).
  bool graph_eligible = false;
};

using Feed = std::pair<Output, Tensor>;

class KernelContext;

class Executor {
 public:
  Executor(std::shared_ptr<const Graph> graph, devices::Device& device, ExecutorOptions options = {});
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  const Graph& graph() const { return *graph_; }
  devices::Device& device() const { return device_; }

  // Binds the storage of a Variable node for this executor. The tensor must be on this
  // executor's device with the variable's dtype and shape; the executor reads it in place, so
  // updates made to it between runs are seen by the next run.
  void bind_variable(Output variable, Tensor value);
  const Tensor& variable(Output variable) const;
  // Binds a Variable node whose whole value `gatherer` provides at each run (VariableGatherer)
  // instead of storage the executor reads in place. The gatherer must outlive the executor's
  // runs. Fetching such a variable (or a view of it) is InvalidArgument: its value is transient.
  void bind_gathered_variable(Output variable, VariableGatherer* gatherer);

  // Runs the graph. Every placeholder the fetches depend on must be fed (InvalidArgument
  // otherwise); feeds on another device are copied to this one. Blocks until the results are
  // computed; returns them in fetch order.
  std::vector<Tensor> run(std::span<const Feed> feeds, std::span<const Output> fetches, const RunOptions& options = {});
  // The same, for braced lists: ex.run({{x, batch}}, {loss, grad}).
  std::vector<Tensor> run(const std::vector<Feed>& feeds, const std::vector<Output>& fetches,
                          const RunOptions& options = {}) {
    return run(std::span<const Feed>(feeds), std::span<const Output>(fetches), options);
  }

  // Statistics of the plan used by the most recent run.
  PlanStats last_plan_stats() const;
  // With ExecutorOptions::profile: kernel time per op, most expensive first.
  std::vector<OpProfile> profile() const;

 private:
  struct Plan;
  Plan& plan_for(std::span<const Feed> feeds, std::span<const Output> fetches, std::span<const HandOff> hand_offs);
  std::unique_ptr<Plan> build_plan(std::span<const Feed> feeds, std::span<const Output> fetches,
                                   std::span<const HandOff> hand_offs);
  void ensure_arena(Plan& plan);
  void plan_gather_windows(Plan& plan) const;
  void gather_before(Plan& plan, std::size_t index);
  static void release_before(Plan& plan, std::size_t index, NodeObserver* observer);
  // Runs one step's kernel, widening 16-bit tensors to float32 where the kernel asks for it.
  void run_kernel(Plan& plan, std::size_t step, KernelContext& context);
  // The run's fetched values; lets go of feeds and views until the next run.
  std::vector<Tensor> collect_results(Plan& plan);
  const Tensor& constant_on_device(const Node& node);

  std::shared_ptr<const Graph> graph_;
  devices::Device& device_;
  ExecutorOptions options_;
  std::unordered_map<int, Tensor> variables_;  // node id -> bound storage
  std::unordered_map<int, VariableGatherer*> gathered_;  // node id -> its gatherer
  std::unordered_map<int, Tensor> constants_;  // node id -> copy on this device
  std::map<std::vector<std::int64_t>, std::unique_ptr<Plan>> plans_;
  std::vector<std::int64_t> key_scratch_;
  Plan* last_plan_ = nullptr;
  std::uint64_t step_ = 0;
  std::unordered_map<const OpDef*, OpProfile> profile_;
};

}  // namespace tandem::graph
