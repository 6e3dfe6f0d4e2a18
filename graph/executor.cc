#include "tandem/graph/executor.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string_view>
#include <span>

#include "tandem/base/env.h"
#include "tandem/base/log.h"
#include "tandem/devices/device_name.h"
#include "tandem/graph/memory_planner.h"
#include "tandem/graph/op_registry.h"

namespace tandem::graph {
namespace {

// Values that are placed in the arena are aligned for the widest vector load.
constexpr std::int64_t kArenaAlignmentBytes = static_cast<std::int64_t>(devices::kDefaultAlignmentBytes);

enum class SlotKind : std::uint8_t { kArena, kFeed, kVariable, kConstant, kForward, kGathered };

std::uint64_t mix64(std::uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

// Eager runs of a plan before its kernels are recorded as a CUDA graph: the first run plans
// memory and warms the allocator's cache, the second confirms the addresses are stable.
constexpr int kGraphWarmupRuns = 2;

struct Executor::Plan {
  struct Step {
    const Node* node = nullptr;
    KernelFn kernel = nullptr;  // null for forwarding nodes
    int forward_from = -1;      // slot forwarded into outputs[0] when kernel is null
    std::vector<const Tensor*> inputs;
    std::vector<Tensor*> outputs;
    // LowPrecision::kWidenToFloat32 with a 16-bit input or output: the kernel runs on float32
    // copies (allocated at the first run of the plan, reused after).
    bool widen = false;
    std::vector<Tensor> wide_inputs;   // per input: a float32 copy, or undefined
    std::vector<Tensor> wide_outputs;  // per output: a float32 buffer, or undefined
    // No kernel for this device (a GPU): the CPU kernel runs on host copies.
    bool on_host = false;
    std::vector<Tensor> host_inputs, host_outputs;
    bool capturable = false;  // a device kernel whose work can be recorded (CUDA graphs)
    KernelState state;        // scratch memory and deferred checks, kept across runs
  };

  // CUDA graphs: after kGraphWarmupRuns runs, the kernels' work is recorded once and replayed.
  // Feeds are copied into buffers of their own so that every replay reads the same addresses;
  // the recording is dropped when the arena or a variable's storage moves.
  bool graph_eligible = false;
  int runs = 0;
  std::unique_ptr<devices::CapturedWork> captured;
  bool capture_failed = false;
  std::vector<Tensor> feed_buffers;             // per feed slot (indexed like slots)
  std::vector<const void*> captured_addresses;  // arena, variables and the tail's memory when recorded
  bool captured_tail = false;                   // whether the recording holds a RunOptions::tail
  Tensor fault_word;                            // GPU plans: KernelContext::fault_word
  std::vector<std::function<void()>> captured_checks;

  std::vector<Tensor> slots;      // one per (node, output) in the plan; never resized after building
  std::vector<TensorSpec> specs;  // concrete spec per slot
  std::vector<SlotKind> kinds;
  std::vector<std::int64_t> arena_offsets;          // per slot, for kArena
  std::vector<int> slot_of_node;                    // first slot of each graph node, -1 when pruned
  std::vector<int> feed_slots;                      // in the order of sorted feeds
  std::vector<std::pair<int, int>> variable_slots;  // (slot, node id)
  std::vector<int> fetch_slots;
  std::vector<int> forward_slots;
  std::vector<Step> steps;
  // Gathered variables (bind_gathered_variable): one window per span of steps that reads one
  // whole value, which lives in the arena from the window's start to its last reader.
  struct Window {
    int slot = -1;            // the variable's slot
    int node = -1;            // its node id
    int start = 0;            // the step before which the gather starts: the previous window's first
    int first = 0;            // the first step reading it: the gather is finished before it runs
    int last = 0;             // the last step reading it or a view of it
    std::int64_t offset = 0;  // in the arena
    Tensor whole;             // the arena's bytes for it (made with the arena)
  };
  std::vector<Window> windows;                         // in the order they open
  std::vector<std::vector<int>> starts_at, needed_at;  // per step: windows to start / to finish before it
  std::vector<std::pair<int, int>> gathered_slots;     // (slot, node id)
  // RunOptions::hand_offs: per step (and one past the last), the tags to release before it.
  std::vector<std::vector<int>> releases_at;
  std::vector<char> handed_off;  // per fetch
  std::shared_ptr<Buffer> arena;
  int arena_slot_count = 0;
  PlanStats stats;
};

namespace {

// Runs `kernel` on `device` (a CPU device) for tensors there, widening 16-bit inputs and outputs
// to float32 copies when `widen`: the kernel computes in float32 and each output is rounded once.
// The copies live in `wide_inputs` / `wide_outputs` and are reused while their shapes last.
void run_on_cpu(KernelFn kernel, const Node& node, devices::Device& device, std::span<const Tensor* const> in,
                std::span<Tensor* const> out, std::uint64_t seed, bool widen, std::vector<Tensor>& wide_inputs,
                std::vector<Tensor>& wide_outputs) {
  std::vector<const Tensor*> inputs(in.begin(), in.end());
  std::vector<Tensor*> outputs(out.begin(), out.end());
  if (widen) {
    wide_inputs.resize(inputs.size());
    wide_outputs.resize(outputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const Tensor& x = *inputs[i];
      if (!is_low_precision(x.dtype())) continue;
      Tensor& wide = wide_inputs[i];
      if (!wide.defined() || wide.shape() != x.shape()) wide = Tensor::empty(x.shape(), DType::kF32, device);
      device.parallel_for(x.num_elements(), 32 * 1024, [&](std::int64_t b, std::int64_t e) {
        widen_to_float32(x.dtype(), static_cast<const char*>(x.raw_data()) + b * 2,
                         static_cast<float*>(wide.raw_data()) + b, e - b);
      });
      inputs[i] = &wide;
    }
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const Tensor& y = *outputs[i];
      if (!is_low_precision(y.dtype())) continue;
      Tensor& wide = wide_outputs[i];
      if (!wide.defined() || wide.shape() != y.shape()) wide = Tensor::empty(y.shape(), DType::kF32, device);
      outputs[i] = &wide;
    }
  }
  KernelContext context(node, device, inputs.data(), outputs.data(), seed);
  kernel(context);
  if (!widen) return;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i] == out[i]) continue;
    Tensor& y = *out[i];
    const Tensor& wide = *outputs[i];
    device.parallel_for(y.num_elements(), 32 * 1024, [&](std::int64_t b, std::int64_t e) {
      narrow_from_float32(static_cast<const float*>(wide.raw_data()) + b, y.dtype(),
                          static_cast<char*>(y.raw_data()) + b * 2, e - b);
    });
  }
}

}  // namespace

// Most steps call their kernel directly. Two kinds need help:
//   widen:   a CPU kernel without 16-bit code, given 16-bit tensors (run_on_cpu widens them);
//   on_host: an op with no kernel for this (GPU) device: its inputs are copied to the host, the
//            CPU kernel runs there, and the outputs are copied back. Correct but slow (two copies
//            and a synchronisation); `TANDEM_PROFILE` names such ops, and the GPU kernels cover the
//            ops of dense models.
void Executor::run_kernel(Plan& plan, std::size_t step_index, KernelContext& original) {
  Plan::Step& step = plan.steps[step_index];
  if (!step.widen && !step.on_host) {
    step.kernel(original);
    return;
  }
  std::span<const Tensor* const> inputs(step.inputs);
  std::span<Tensor* const> outputs(step.outputs);
  if (!step.on_host) {
    run_on_cpu(step.kernel, original.node(), device_, inputs, outputs, original.random_seed(), true, step.wide_inputs,
               step.wide_outputs);
    return;
  }
  devices::Device& host = devices::default_cpu_device();
  step.host_inputs.resize(inputs.size());
  step.host_outputs.resize(outputs.size());
  std::vector<const Tensor*> host_in;
  std::vector<Tensor*> host_out;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    step.host_inputs[i] = inputs[i]->to(host);
    host_in.push_back(&step.host_inputs[i]);
  }
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    Tensor& h = step.host_outputs[i];
    if (!h.defined() || h.shape() != outputs[i]->shape() || h.dtype() != outputs[i]->dtype()) {
      h = Tensor::empty(outputs[i]->shape(), outputs[i]->dtype(), host);
    }
    host_out.push_back(&h);
  }
  run_on_cpu(step.kernel, original.node(), host, host_in, host_out, original.random_seed(), step.widen,
             step.wide_inputs, step.wide_outputs);
  for (std::size_t i = 0; i < outputs.size(); ++i) outputs[i]->copy_from(step.host_outputs[i]);
  for (auto& t : step.host_inputs) t = Tensor();  // do not pin the inputs until the next run
}

Executor::Executor(std::shared_ptr<const Graph> graph, devices::Device& device, ExecutorOptions options)
    : graph_(std::move(graph)), device_(device), options_(options) {
  TANDEM_REQUIRE(graph_ != nullptr, InvalidArgument, "Executor needs a graph");
  if (!env::get_bool(env::kCudaGraphs)) options_.cuda_graphs = false;
}

Executor::~Executor() = default;

void Executor::bind_variable(Output variable, Tensor value) {
  TANDEM_REQUIRE(variable.graph == graph_.get(), InvalidArgument, "bind_variable: {} belongs to another graph",
                 variable.name());
  const Node& node = variable.producer();
  TANDEM_REQUIRE(node.op->kind == OpKind::kVariable, InvalidArgument, "bind_variable: {} is not a Variable",
                 node.label());
  const auto& spec = node.outputs[0];
  TANDEM_REQUIRE(value.defined() && value.dtype() == spec.dtype && value.shape() == spec.shape, InvalidArgument,
                 "bind_variable {}: got a {} tensor of shape {}; expected {} {}", node.label(),
                 value.defined() ? dtype_name(value.dtype()) : "undefined", value.defined() ? value.shape() : Shape{},
                 spec.dtype, spec.shape);
  TANDEM_REQUIRE(&value.device() == &device_, InvalidArgument,
                 "bind_variable {}: the tensor is on {} but this executor runs on {}", node.label(),
                 value.device().short_name(), device_.short_name());
  gathered_.erase(node.id);
  variables_[node.id] = std::move(value);
}

void Executor::bind_gathered_variable(Output variable, VariableGatherer* gatherer) {
  TANDEM_REQUIRE(variable.graph == graph_.get(), InvalidArgument, "bind_gathered_variable: {} belongs to another graph",
                 variable.name());
  const Node& node = variable.producer();
  TANDEM_REQUIRE(node.op->kind == OpKind::kVariable, InvalidArgument, "bind_gathered_variable: {} is not a Variable",
                 node.label());
  TANDEM_REQUIRE(gatherer != nullptr, InvalidArgument, "bind_gathered_variable {}: no gatherer", node.label());
  variables_.erase(node.id);
  gathered_[node.id] = gatherer;
}

const Tensor& Executor::variable(Output variable) const {
  const auto it = variables_.find(variable.node);
  TANDEM_REQUIRE(variable.graph == graph_.get() && it != variables_.end(), NotFound,
                 "variable {} is not bound on the executor for {}", variable.name(), device_.short_name());
  return it->second;
}

const Tensor& Executor::constant_on_device(const Node& node) {
  auto it = constants_.find(node.id);
  if (it == constants_.end()) it = constants_.emplace(node.id, node.attrs.get<Tensor>("value").to(device_)).first;
  return it->second;
}

std::vector<OpProfile> Executor::profile() const {
  std::vector<OpProfile> out;
  for (const auto& [op, entry] : profile_) {
    out.push_back(entry);
    out.back().op = op->name;
  }
  std::sort(out.begin(), out.end(), [](const OpProfile& a, const OpProfile& b) { return a.seconds > b.seconds; });
  return out;
}

PlanStats Executor::last_plan_stats() const {
  PlanStats stats = last_plan_ != nullptr ? last_plan_->stats : PlanStats{};
  stats.plans_cached = static_cast<int>(plans_.size());
  return stats;
}

Executor::Plan& Executor::plan_for(std::span<const Feed> feeds, std::span<const Output> fetches,
                                   std::span<const HandOff> hand_offs) {
  // The key: fetches, then feeds sorted by node with dtype and concrete dims. Reusing one scratch
  // vector keeps the lookup free of allocations once it has grown.
  auto& key = key_scratch_;
  key.clear();
  for (const auto& f : fetches) {
    TANDEM_REQUIRE(f.graph == graph_.get(), InvalidArgument, "fetch {} belongs to another graph", f.name());
    key.push_back(f.node);
    key.push_back(f.index);
  }
  key.push_back(-1);
  const std::size_t feeds_begin = key.size();
  for (const auto& [output, tensor] : feeds) {
    TANDEM_REQUIRE(output.graph == graph_.get(), InvalidArgument, "feed {} belongs to another graph", output.name());
    TANDEM_REQUIRE(tensor.defined(), InvalidArgument, "feed for {} is an undefined tensor", output.name());
    key.push_back(output.node);
    key.push_back(static_cast<std::int64_t>(tensor.dtype()));
    for (auto d : tensor.shape().dims()) key.push_back(d);
    key.push_back(-2);
  }
  (void)feeds_begin;
  key.push_back(-3);
  for (const auto& h : hand_offs) {
    key.push_back(h.fetch);
    key.push_back(h.until_node);
    key.push_back(h.tag);
  }
  const auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  auto plan = build_plan(feeds, fetches, hand_offs);
  auto& stored = *plans_.emplace(key, std::move(plan)).first->second;
  return stored;
}

std::unique_ptr<Executor::Plan> Executor::build_plan(std::span<const Feed> feeds, std::span<const Output> fetches,
                                                     std::span<const HandOff> hand_offs) {
  const Graph& g = *graph_;
  auto plan = std::make_unique<Plan>();
  const int num_nodes = g.num_nodes();

  // Feeds: placeholders only, with a compatible dtype and shape.
  std::vector<const Tensor*> fed(static_cast<std::size_t>(num_nodes), nullptr);
  for (const auto& [output, tensor] : feeds) {
    const Node& node = output.producer();
    TANDEM_REQUIRE(node.op->kind == OpKind::kPlaceholder, InvalidArgument,
                   "only placeholders can be fed; {} is not one", node.label());
    const auto& spec = node.outputs[0];
    TANDEM_REQUIRE(tensor.dtype() == spec.dtype && tensor.shape().compatible_with(spec.shape), InvalidArgument,
                   "{}: fed a {} tensor of shape {}; expected {} {}", node.label(), tensor.dtype(), tensor.shape(),
                   spec.dtype, spec.shape);
    TANDEM_REQUIRE(fed[static_cast<std::size_t>(node.id)] == nullptr, InvalidArgument, "{} is fed twice", node.label());
    fed[static_cast<std::size_t>(node.id)] = &tensor;
  }

  // Prune: the nodes the fetches reach, walking inputs backwards and stopping at feeds.
  std::vector<char> needed(static_cast<std::size_t>(num_nodes), 0);
  std::vector<int> stack;
  for (const auto& f : fetches) stack.push_back(f.node);
  while (!stack.empty()) {
    const int id = stack.back();
    stack.pop_back();
    if (needed[static_cast<std::size_t>(id)]) continue;
    needed[static_cast<std::size_t>(id)] = 1;
    if (fed[static_cast<std::size_t>(id)] != nullptr) continue;
    for (const auto& in : g.node(id).inputs) stack.push_back(in.node);
  }

  // Slots and concrete shapes, in node order (already topological).
  plan->slot_of_node.assign(static_cast<std::size_t>(num_nodes), -1);
  std::vector<int> order;
  int num_slots = 0;
  for (int id = 0; id < num_nodes; ++id) {
    if (!needed[static_cast<std::size_t>(id)]) continue;
    order.push_back(id);
    plan->slot_of_node[static_cast<std::size_t>(id)] = num_slots;
    num_slots += static_cast<int>(g.node(id).outputs.size());
  }
  plan->slots.resize(static_cast<std::size_t>(num_slots));
  plan->specs.resize(static_cast<std::size_t>(num_slots));
  plan->kinds.resize(static_cast<std::size_t>(num_slots), SlotKind::kArena);
  plan->arena_offsets.resize(static_cast<std::size_t>(num_slots), 0);
  const auto slot = [&](const Output& o) { return plan->slot_of_node[static_cast<std::size_t>(o.node)] + o.index; };

  std::vector<int> forward_root(static_cast<std::size_t>(num_slots), -1);  // arena slot a forward aliases
  std::vector<TensorSpec> input_specs;
  for (const int id : order) {
    const Node& node = g.node(id);
    const int first = plan->slot_of_node[static_cast<std::size_t>(id)];
    auto& spec0 = plan->specs[static_cast<std::size_t>(first)];
    if (const Tensor* feed = fed[static_cast<std::size_t>(id)]) {
      spec0 = TensorSpec{feed->dtype(), feed->shape()};
      plan->kinds[static_cast<std::size_t>(first)] = SlotKind::kFeed;
      plan->feed_slots.push_back(first);
      continue;
    }
    switch (node.op->kind) {
      case OpKind::kPlaceholder:
        throw InvalidArgument(fmt::format("{} must be fed: the fetches depend on it (for example {})", node.label(),
                                          fetches.empty() ? std::string("-") : fetches.front().name()));
      case OpKind::kVariable:
        if (gathered_.contains(id)) {
          spec0 = node.outputs[0];
          plan->kinds[static_cast<std::size_t>(first)] = SlotKind::kGathered;
          plan->gathered_slots.emplace_back(first, id);
          continue;
        }
        TANDEM_REQUIRE(variables_.contains(id), FailedPrecondition,
                       "{} is not bound on the executor for {}; call bind_variable() before running", node.label(),
                       device_.short_name());
        spec0 = node.outputs[0];
        plan->kinds[static_cast<std::size_t>(first)] = SlotKind::kVariable;
        plan->variable_slots.emplace_back(first, id);
        continue;
      case OpKind::kConstant:
        spec0 = node.outputs[0];
        plan->kinds[static_cast<std::size_t>(first)] = SlotKind::kConstant;
        plan->slots[static_cast<std::size_t>(first)] = constant_on_device(node);
        continue;
      case OpKind::kKernel: break;
    }
    if (!node.device.empty()) {
      const auto requested = devices::DeviceName::parse(node.device);
      TANDEM_REQUIRE(requested.type == device_.type(), FailedPrecondition,
                     "{} is placed on {} but this executor runs on {}; a graph runs on one device type", node.label(),
                     node.device, device_.short_name());
    }
    input_specs.clear();
    for (const auto& in : node.inputs) input_specs.push_back(plan->specs[static_cast<std::size_t>(slot(in))]);
    ShapeContext shape_context(*node.op, node.name, node.attrs, input_specs);
    auto outputs = node.op->shape_fn(shape_context);
    Plan::Step step;
    step.node = &node;
    for (int i = 0; i < static_cast<int>(outputs.size()); ++i) {
      const auto s = static_cast<std::size_t>(first + i);
      TANDEM_ASSERT(outputs[static_cast<std::size_t>(i)].shape.is_fully_defined(),
                    "{}: output {} has shape {} after planning with concrete inputs", node.label(), i,
                    outputs[static_cast<std::size_t>(i)].shape);
      plan->specs[s] = outputs[static_cast<std::size_t>(i)];
      step.outputs.push_back(&plan->slots[s]);
    }
    for (const auto& in : node.inputs) step.inputs.push_back(&plan->slots[static_cast<std::size_t>(slot(in))]);
    int forwarded = node.op->forwards_input;
    if (const int same = node.op->forwards_input_of_same_shape;
        forwarded < 0 && same >= 0 && input_specs[static_cast<std::size_t>(same)] == outputs.front()) {
      forwarded = same;
    }
    if (forwarded >= 0) {
      const int source = slot(node.inputs[static_cast<std::size_t>(forwarded)]);
      step.forward_from = source;
      plan->kinds[static_cast<std::size_t>(first)] = SlotKind::kForward;
      plan->forward_slots.push_back(first);
      const int root = plan->kinds[static_cast<std::size_t>(source)] == SlotKind::kForward
                           ? forward_root[static_cast<std::size_t>(source)]
                           : source;
      forward_root[static_cast<std::size_t>(first)] = root;
    } else {
      step.kernel = node.op->kernel(device_.type());
      devices::DeviceType kernel_device = device_.type();
      if (step.kernel == nullptr && device_.type() != devices::DeviceType::kCPU) {
        step.kernel = node.op->kernel(devices::DeviceType::kCPU);
        step.on_host = step.kernel != nullptr;
        kernel_device = devices::DeviceType::kCPU;
      }
      TANDEM_REQUIRE(step.kernel != nullptr, Unimplemented, "{}: op {} has no {} kernel yet", node.label(),
                     node.op->name, devices::device_type_name(device_.type()));
      if (node.op->options(kernel_device).low_precision == LowPrecision::kWidenToFloat32) {
        for (int i = 0; i < static_cast<int>(outputs.size()); ++i) {
          step.widen = step.widen || is_low_precision(outputs[static_cast<std::size_t>(i)].dtype);
        }
        for (const auto& in : node.inputs) step.widen = step.widen || is_low_precision(in.dtype());
        // Widening converts on the host; a device kernel must take 16-bit tensors itself.
        TANDEM_REQUIRE(!step.widen || kernel_device == devices::DeviceType::kCPU, Unimplemented,
                       "{}: op {} has no float16/bfloat16 kernel on {}", node.label(), node.op->name,
                       devices::device_type_name(device_.type()));
      }
      step.capturable =
          kernel_device == devices::DeviceType::kGPU && !step.widen && node.op->options(kernel_device).capturable;
    }
    plan->steps.push_back(std::move(step));
  }

  // Lifetimes of the arena slots, in step positions; fetched values live to the end.
  const int num_steps = static_cast<int>(plan->steps.size());
  std::vector<int> first_step(static_cast<std::size_t>(num_slots), -1);
  std::vector<int> last_step(static_cast<std::size_t>(num_slots), -1);
  const auto root_of = [&](int s) {
    return plan->kinds[static_cast<std::size_t>(s)] == SlotKind::kForward ? forward_root[static_cast<std::size_t>(s)]
                                                                          : s;
  };
  const auto use = [&](int s, int position) {
    const int r = root_of(s);
    if (r >= 0 && plan->kinds[static_cast<std::size_t>(r)] == SlotKind::kArena) {
      last_step[static_cast<std::size_t>(r)] = std::max(last_step[static_cast<std::size_t>(r)], position);
    }
  };
  for (int p = 0; p < num_steps; ++p) {
    const auto& step = plan->steps[static_cast<std::size_t>(p)];
    const int first = plan->slot_of_node[static_cast<std::size_t>(step.node->id)];
    for (int i = 0; i < static_cast<int>(step.outputs.size()); ++i) {
      if (plan->kinds[static_cast<std::size_t>(first + i)] == SlotKind::kArena) {
        first_step[static_cast<std::size_t>(first + i)] = p;
        last_step[static_cast<std::size_t>(first + i)] = p;
      }
    }
    for (const auto& in : step.node->inputs) use(slot(in), p);
  }
  // A handed-off fetch lives until its until_node's step; the observer releases it before the next.
  std::vector<int> step_of_node(static_cast<std::size_t>(num_nodes), -1);
  for (int p = 0; p < num_steps; ++p)
    step_of_node[static_cast<std::size_t>(plan->steps[static_cast<std::size_t>(p)].node->id)] = p;
  std::vector<int> fetch_until(fetches.size(), num_steps);
  plan->handed_off.assign(fetches.size(), 0);
  plan->releases_at.assign(static_cast<std::size_t>(num_steps) + 1, {});
  for (const auto& h : hand_offs) {
    TANDEM_REQUIRE(h.fetch >= 0 && static_cast<std::size_t>(h.fetch) < fetches.size(), InvalidArgument,
                   "hand-off of fetch {}: the run has {} fetches", h.fetch, fetches.size());
    TANDEM_REQUIRE(h.until_node >= 0 && h.until_node < num_nodes, InvalidArgument,
                   "hand-off of fetch {}: node {} is not in the graph", h.fetch, h.until_node);
    const int until = step_of_node[static_cast<std::size_t>(h.until_node)];
    const auto& f = fetches[static_cast<std::size_t>(h.fetch)];
    const int produced = step_of_node[static_cast<std::size_t>(f.node)];
    TANDEM_REQUIRE(until >= 0 && until >= produced, InvalidArgument,
                   "hand-off of fetch {} ({}): node {} does not run after it in this plan", h.fetch, f.name(),
                   graph_->node(h.until_node).label());
    plan->handed_off[static_cast<std::size_t>(h.fetch)] = 1;
    fetch_until[static_cast<std::size_t>(h.fetch)] = until;
    plan->releases_at[static_cast<std::size_t>(until) + 1].push_back(h.tag);
  }
  for (std::size_t i = 0; i < fetches.size(); ++i) {
    const auto& f = fetches[i];
    TANDEM_REQUIRE(plan->kinds[static_cast<std::size_t>(root_of(slot(f)))] != SlotKind::kGathered, InvalidArgument,
                   "fetch {}: it is (a view of) a gathered variable, whose whole value exists during the run only; "
                   "fetch a copy of it",
                   f.name());
    plan->fetch_slots.push_back(slot(f));
    use(slot(f), fetch_until[i]);
  }
  plan_gather_windows(*plan);

  std::vector<BufferRequest> requests;
  std::vector<int> request_slots;
  for (int s = 0; s < num_slots; ++s) {
    if (plan->kinds[static_cast<std::size_t>(s)] != SlotKind::kArena) continue;
    const auto& spec = plan->specs[static_cast<std::size_t>(s)];
    const auto bytes = spec.shape.num_elements() * static_cast<std::int64_t>(dtype_size(spec.dtype));
    requests.push_back({bytes, first_step[static_cast<std::size_t>(s)], last_step[static_cast<std::size_t>(s)]});
    request_slots.push_back(s);
  }
  const std::size_t slot_requests = requests.size();
  for (const auto& w : plan->windows) {
    const auto& spec = plan->specs[static_cast<std::size_t>(w.slot)];
    const auto bytes = spec.shape.num_elements() * static_cast<std::int64_t>(dtype_size(spec.dtype));
    requests.push_back({bytes, w.start, w.last});
    plan->stats.gathered_bytes += bytes;
  }
  plan->stats.gathers = static_cast<int>(plan->windows.size());
  const MemoryPlan memory = plan_memory(requests, kArenaAlignmentBytes);
  for (std::size_t r = 0; r < slot_requests; ++r) {
    plan->arena_offsets[static_cast<std::size_t>(request_slots[r])] = memory.offsets[r];
  }
  for (std::size_t w = 0; w < plan->windows.size(); ++w) plan->windows[w].offset = memory.offsets[slot_requests + w];
  plan->arena_slot_count = static_cast<int>(slot_requests);
  // A gather or a release is host work between kernels (a collective): such plans are not recorded.
  plan->graph_eligible = plan->windows.empty() && hand_offs.empty() && options_.cuda_graphs &&
                         device_.type() == devices::DeviceType::kGPU &&
                         std::all_of(plan->steps.begin(), plan->steps.end(),
                                     [](const Plan::Step& st) { return st.kernel == nullptr || st.capturable; });
  for (const auto& st : plan->steps) {
    if (st.on_host && std::find(plan->stats.ops_on_host.begin(), plan->stats.ops_on_host.end(), st.node->op->name) ==
                          plan->stats.ops_on_host.end()) {
      plan->stats.ops_on_host.push_back(st.node->op->name);
    }
  }
  plan->stats.graph_eligible = plan->graph_eligible;
  if (!device_.host_accessible()) {
    plan->fault_word = Tensor::zeros({1}, DType::kI32, device_);
    for (auto& st : plan->steps) st.state.fault_word = plan->fault_word.raw_data();
  }
  plan->stats.nodes_run = static_cast<int>(
      std::count_if(plan->steps.begin(), plan->steps.end(), [](const Plan::Step& s) { return s.kernel != nullptr; }));
  plan->stats.nodes_in_graph = num_nodes;
  plan->stats.arena_bytes = memory.arena_bytes;
  plan->stats.unshared_bytes = memory.unshared_bytes;
  return plan;
}

void Executor::ensure_arena(Plan& plan) {
  // Held by the plan and by each arena slot; any other holder is a caller keeping a fetched view.
  const long internal_holders = 1 + plan.arena_slot_count + static_cast<long>(plan.windows.size());
  if (plan.arena != nullptr && plan.arena.use_count() <= internal_holders) return;
  plan.arena = std::make_shared<Buffer>(device_, static_cast<std::size_t>(plan.stats.arena_bytes));
  for (std::size_t s = 0; s < plan.slots.size(); ++s) {
    if (plan.kinds[s] != SlotKind::kArena) continue;
    plan.slots[s] =
        Tensor(plan.specs[s].shape, plan.specs[s].dtype, plan.arena, static_cast<std::size_t>(plan.arena_offsets[s]));
  }
  for (auto& w : plan.windows) {
    const auto& spec = plan.specs[static_cast<std::size_t>(w.slot)];
    w.whole = Tensor(spec.shape, spec.dtype, plan.arena, static_cast<std::size_t>(w.offset));
  }
}

// Windows of the gathered variables, in step order. A step reading a gathered variable continues
// the variable's open window when no other window has opened since the window's last reader (a
// layer's kernel read by forward's MatMul, then by nothing until backward: the layers in between
// open windows of their own, so backward gathers it again), and opens a new one otherwise;
// steps reading a view of it extend the window the view was made in. Each window's gather
// starts before the previous window's first reader: one window of prefetch.
void Executor::plan_gather_windows(Plan& plan) const {
  if (plan.gathered_slots.empty()) return;
  const auto num_slots = plan.slots.size();
  const auto num_steps = plan.steps.size();
  std::vector<int> node_of(num_slots, -1), open(num_slots, -1), view_window(num_slots, -1);
  for (const auto& [s, id] : plan.gathered_slots) node_of[static_cast<std::size_t>(s)] = id;
  std::vector<std::int64_t> opened_at_last_read(num_slots, -1);
  std::int64_t opened = 0;
  std::vector<int> read;
  for (std::size_t p = 0; p < num_steps; ++p) {
    const auto& step = plan.steps[p];
    const int position = static_cast<int>(p);
    const std::int64_t opened_before = opened;
    read.clear();
    for (const auto& in : step.node->inputs) {
      const auto s = static_cast<std::size_t>(plan.slot_of_node[static_cast<std::size_t>(in.node)] + in.index);
      if (plan.kinds[s] == SlotKind::kGathered) {
        int& w = open[s];
        if (w >= 0 &&
            (plan.windows[static_cast<std::size_t>(w)].last == position || opened_at_last_read[s] == opened_before)) {
          plan.windows[static_cast<std::size_t>(w)].last = position;
        } else {
          plan.windows.push_back(
              {.slot = static_cast<int>(s), .node = node_of[s], .first = position, .last = position});
          w = static_cast<int>(plan.windows.size()) - 1;
          ++opened;
        }
        read.push_back(static_cast<int>(s));
      } else if (plan.kinds[s] == SlotKind::kForward && view_window[s] >= 0) {
        auto& w = plan.windows[static_cast<std::size_t>(view_window[s])];
        w.last = std::max(w.last, position);
      }
    }
    if (step.forward_from >= 0) {
      const auto source = static_cast<std::size_t>(step.forward_from);
      const auto out = static_cast<std::size_t>(plan.slot_of_node[static_cast<std::size_t>(step.node->id)]);
      if (plan.kinds[source] == SlotKind::kGathered) view_window[out] = open[source];
      if (plan.kinds[source] == SlotKind::kForward) view_window[out] = view_window[source];
    }
    for (const int s : read) opened_at_last_read[static_cast<std::size_t>(s)] = opened;
  }
  plan.starts_at.assign(num_steps, {});
  plan.needed_at.assign(num_steps, {});
  for (std::size_t w = 0; w < plan.windows.size(); ++w) {
    auto& window = plan.windows[w];
    window.start = w == 0 ? 0 : std::min(plan.windows[w - 1].first, window.first);
    plan.starts_at[static_cast<std::size_t>(window.start)].push_back(static_cast<int>(w));
    plan.needed_at[static_cast<std::size_t>(window.first)].push_back(static_cast<int>(w));
  }
}

// Before step `index`: starts the gathers that prefetch from here (the next window's, queued
// behind the one this step needs, so that it runs while this step computes), then finishes the
// gathers this step's readers need and binds each whole value to its variable's slot.
void Executor::gather_before(Plan& plan, std::size_t index) {
  for (const int w : plan.starts_at[index]) {
    auto& window = plan.windows[static_cast<std::size_t>(w)];
    gathered_.at(window.node)->start_gather(window.node, window.whole);
  }
  for (const int w : plan.needed_at[index]) {
    auto& window = plan.windows[static_cast<std::size_t>(w)];
    gathered_.at(window.node)->finish_gather(window.node);
    plan.slots[static_cast<std::size_t>(window.slot)] = window.whole;
  }
}

void Executor::release_before(Plan& plan, std::size_t index, NodeObserver* observer) {
  for (const int tag : plan.releases_at[index]) observer->release(tag);
}

std::vector<Tensor> Executor::run(std::span<const Feed> feeds, std::span<const Output> fetches,
                                  const RunOptions& options) {
  TANDEM_REQUIRE(options.hand_offs.empty() || options.observer != nullptr, InvalidArgument,
                 "Executor::run: hand-offs need an observer to take them");
  Plan& plan = plan_for(feeds, fetches, options.hand_offs);
  last_plan_ = &plan;
  ensure_arena(plan);

  // Bind this run's feeds (sorted by node in the plan, so match by node id) and variables.
  const bool use_graph = plan.graph_eligible && !plan.capture_failed;
  if (use_graph && plan.feed_buffers.size() != plan.slots.size()) plan.feed_buffers.resize(plan.slots.size());
  for (const auto& [output, tensor] : feeds) {
    const int s = plan.slot_of_node[static_cast<std::size_t>(output.node)];
    if (s < 0) continue;  // fed but not needed
    if (!use_graph) {
      plan.slots[static_cast<std::size_t>(s)] = &tensor.device() == &device_ ? tensor : tensor.to(device_);
      continue;
    }
    // Recorded work reads fixed addresses: copy the feed into this slot's own buffer.
    Tensor& buffer = plan.feed_buffers[static_cast<std::size_t>(s)];
    if (!buffer.defined() || buffer.shape() != tensor.shape() || buffer.dtype() != tensor.dtype()) {
      buffer = Tensor::empty(tensor.shape(), tensor.dtype(), device_);
    }
    buffer.copy_from(tensor);
    plan.slots[static_cast<std::size_t>(s)] = buffer;
  }
  for (const auto& [s, node_id] : plan.variable_slots) {
    const auto it = variables_.find(node_id);
    TANDEM_REQUIRE(it != variables_.end(), FailedPrecondition, "{} is no longer bound", graph_->node(node_id).label());
    plan.slots[static_cast<std::size_t>(s)] = it->second;
  }
  for (const auto& [s, node_id] : plan.gathered_slots) {
    TANDEM_REQUIRE(gathered_.contains(node_id), FailedPrecondition, "{} is no longer bound to a gatherer",
                   graph_->node(node_id).label());
  }

  const std::uint64_t step = options.random_step.value_or(step_);
  ++step_;
  const std::uint64_t run_seed = mix64(options_.seed ^ mix64(step));
  // Forwarding nodes (views) are host bookkeeping, done on every run.
  const auto forward = [&](Plan::Step& st) {
    const Tensor& source = plan.slots[static_cast<std::size_t>(st.forward_from)];
    *st.outputs[0] = source.reshape(
        plan.specs[static_cast<std::size_t>(plan.slot_of_node[static_cast<std::size_t>(st.node->id)])].shape);
  };
  const auto queue_kernel = [&](std::size_t index) {
    auto& st = plan.steps[index];
    KernelContext context(*st.node, device_, st.inputs.data(), st.outputs.data(),
                          mix64(run_seed ^ static_cast<std::uint64_t>(st.node->id)), &st.state);
    run_kernel(plan, index, context);
  };
  const auto run_checks = [](std::vector<std::function<void()>>& checks) {
    for (auto& check : checks) check();
  };
  const auto clear_fault_word = [&] {
    if (plan.fault_word.defined()) device_.fill_zero(plan.fault_word.raw_data(), plan.fault_word.nbytes());
  };
  const auto queue_tail = [&] {
    if (!options.tail) return;
    std::vector<Tensor> fetched;
    fetched.reserve(plan.fetch_slots.size());
    for (const int s : plan.fetch_slots) fetched.push_back(plan.slots[static_cast<std::size_t>(s)]);
    options.tail(TailContext{.fetched = fetched,
                             .fault_word = plan.fault_word.defined() ? plan.fault_word.raw_data() : nullptr});
  };

  if (use_graph && plan.runs >= kGraphWarmupRuns && !options_.profile) {
    std::vector<const void*> addresses{plan.arena ? plan.arena->data() : nullptr};
    for (const auto& [s, node_id] : plan.variable_slots)
      addresses.push_back(plan.slots[static_cast<std::size_t>(s)].raw_data());
    addresses.insert(addresses.end(), options.tail_addresses.begin(), options.tail_addresses.end());
    const bool with_tail = static_cast<bool>(options.tail);
    if (plan.captured != nullptr && (addresses != plan.captured_addresses || with_tail != plan.captured_tail)) {
      plan.captured.reset();
    }
    if (plan.captured == nullptr) {
      for (auto& st : plan.steps) st.state.deferred.clear();
      std::string why;
      plan.captured = device_.capture(
          [&] {
            clear_fault_word();
            for (std::size_t index = 0; index < plan.steps.size(); ++index) {
              if (plan.steps[index].kernel == nullptr) {
                forward(plan.steps[index]);
              } else {
                queue_kernel(index);
              }
            }
            queue_tail();
          },
          &why);
      if (plan.captured == nullptr) {
        plan.capture_failed = true;
        logging::warn("CUDA graph capture failed on {} ({}); this plan runs without graphs", device_.short_name(), why);
      } else {
        plan.captured_addresses = std::move(addresses);
        plan.captured_tail = with_tail;
        plan.captured_checks.clear();
        for (auto& st : plan.steps) {
          for (auto& check : st.state.deferred) plan.captured_checks.push_back(std::move(check));
          st.state.deferred.clear();
        }
      }
    }
    if (plan.captured != nullptr) {
      plan.captured->replay();
      ++plan.runs;
      for (auto& st : plan.steps) {
        if (st.kernel == nullptr) forward(st);
        if (options.observer != nullptr) options.observer->node_done(st.node->id, st.outputs);
      }
      run_checks(plan.captured_checks);
      return collect_results(plan);
    }
  }

  clear_fault_word();
  for (std::size_t index = 0; index < plan.steps.size(); ++index) {
    auto& st = plan.steps[index];
    // Released first: a gather started here may write where a handed-off value was.
    if (!options.hand_offs.empty()) release_before(plan, index, options.observer);
    if (!plan.windows.empty()) gather_before(plan, index);
    if (st.kernel == nullptr) {
      forward(st);
      if (options.observer != nullptr) options.observer->node_done(st.node->id, st.outputs);
      continue;
    }
    if (!options_.profile) {
      queue_kernel(index);
      if (options.observer != nullptr) options.observer->node_done(st.node->id, st.outputs);
      continue;
    }
    const auto start = std::chrono::steady_clock::now();
    queue_kernel(index);
    device_.synchronize();
    auto& entry = profile_[st.node->op];
    entry.calls += 1;
    entry.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (options.observer != nullptr) options.observer->node_done(st.node->id, st.outputs);
  }
  if (!options.hand_offs.empty()) release_before(plan, plan.steps.size(), options.observer);
  queue_tail();
  ++plan.runs;
  std::vector<std::function<void()>> checks;
  for (auto& st : plan.steps) {
    for (auto& check : st.state.deferred) checks.push_back(std::move(check));
    st.state.deferred.clear();
  }
  run_checks(checks);
  return collect_results(plan);
}

std::vector<Tensor> Executor::collect_results(Plan& plan) {
  std::vector<Tensor> results;
  results.reserve(plan.fetch_slots.size());
  for (std::size_t i = 0; i < plan.fetch_slots.size(); ++i) {
    // A handed-off value's bytes may hold something else by now: returned undefined.
    results.push_back(plan.handed_off[i] ? Tensor() : plan.slots[static_cast<std::size_t>(plan.fetch_slots[i])]);
  }
  // Let go of the caller's feeds and of views that might pin them, until the next run.
  for (const int s : plan.feed_slots) plan.slots[static_cast<std::size_t>(s)] = Tensor();
  for (const int s : plan.forward_slots) plan.slots[static_cast<std::size_t>(s)] = Tensor();
  for (const auto& [s, node_id] : plan.gathered_slots) plan.slots[static_cast<std::size_t>(s)] = Tensor();
  return results;
}

}  // namespace tandem::graph
