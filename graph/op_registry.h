// tandem/graph/op_registry.h — how an op is defined: shape function, gradient, kernels.
//
// graph/ declares the registry; ops/ fills it through an explicit tandem::ops::register_all()
// (no static initialisers a linker could drop). An OpDef carries:
//   shape_fn  infers output dtypes and shapes from the inputs' (at construction, with unknown
//             dimensions; at planning, with concrete ones) and rejects bad inputs.
//   grad_fn   adds the nodes computing input gradients from output gradients (reverse mode);
//             null means "not differentiable": no gradient flows through the op.
//   kernels   one function per device type, filling preallocated outputs.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tandem/devices/device.h"
#include "tandem/graph/graph.h"
#include "tandem/graph/tensor.h"

namespace tandem::graph {

// Input to a shape function: the node being added (or planned) and its inputs' specs.
class ShapeContext {
 public:
  ShapeContext(const OpDef& op, std::string_view node_name, const Attrs& attrs, const std::vector<TensorSpec>& inputs)
      : op_(op), node_name_(node_name), attrs_(attrs), inputs_(inputs) {}

  std::string label() const;  // MatMul "dense/MatMul"
  int num_inputs() const { return static_cast<int>(inputs_.size()); }
  const TensorSpec& input(int i) const { return inputs_[static_cast<std::size_t>(i)]; }
  const Shape& shape(int i) const { return input(i).shape; }
  DType dtype(int i) const { return input(i).dtype; }
  const Attrs& attrs() const { return attrs_; }

  // Throws InvalidArgument("<label>: <message>").
  template <class... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) const {
    throw InvalidArgument(fmt::format("{}: {}", label(), fmt::format(format, std::forward<Args>(args)...)));
  }
  template <class... Args>
  void require(bool condition, fmt::format_string<Args...> format, Args&&... args) const {
    if (!condition) [[unlikely]]
      fail(format, std::forward<Args>(args)...);
  }
  // Checks that input i has a dtype from List (for example FloatTypes).
  void require_float(int i) const;
  void require_same_dtype(int i, int j) const;
  void require_rank(int i, int rank) const;

 private:
  const OpDef& op_;
  std::string_view node_name_;
  const Attrs& attrs_;
  const std::vector<TensorSpec>& inputs_;
};

// Input to a gradient function, run by autodiff under the name scope "gradients/<node>".
class GradContext {
 public:
  GradContext(Graph& graph, const Node& node, const std::vector<Output>& output_grads)
      : graph_(graph), node_(node), output_grads_(output_grads) {}

  Graph& graph() const { return graph_; }
  const Node& node() const { return node_; }
  const Attrs& attrs() const { return node_.attrs; }
  Output input(int i) const { return node_.inputs[static_cast<std::size_t>(i)]; }
  Output output(int i) const { return Output{&graph_, node_.id, i}; }
  // The gradient flowing into output i; undefined when none does (an unused output).
  Output grad(int i) const { return output_grads_[static_cast<std::size_t>(i)]; }
  bool has_grad(int i) const { return grad(i).defined(); }

 private:
  Graph& graph_;
  const Node& node_;
  const std::vector<Output>& output_grads_;
};

// Per-step state the executor keeps for a kernel across runs (see KernelContext::scratch and
// KernelContext::defer).
struct KernelState {
  std::vector<Tensor> scratch;
  // Checks that read device results (a bad label found by a GPU kernel), run once the step's work
  // is queued: after the whole run, and after every replay of captured work.
  std::vector<std::function<void()>> deferred;
  // The plan's fault word (KernelContext::fault_word), set by the executor.
  void* fault_word = nullptr;
};

// What a kernel sees: its node, its inputs, and outputs already allocated to the planned shape.
class KernelContext {
 public:
  KernelContext(const Node& node, devices::Device& device, const Tensor* const* inputs, Tensor* const* outputs,
                std::uint64_t random_seed, KernelState* state = nullptr)
      : node_(node), device_(device), inputs_(inputs), outputs_(outputs), random_seed_(random_seed), state_(state) {}

  const Node& node() const { return node_; }
  const std::string& label() const { return node_.label(); }
  const Attrs& attrs() const { return node_.attrs; }
  devices::Device& device() const { return device_; }
  int num_inputs() const { return static_cast<int>(node_.inputs.size()); }
  const Tensor& input(int i) const { return *inputs_[i]; }
  int num_outputs() const { return static_cast<int>(node_.outputs.size()); }
  Tensor& output(int i) const { return *outputs_[i]; }
  // Differs between nodes, executors (replicas) and steps; fixed by RunOptions::random_step.
  std::uint64_t random_seed() const { return random_seed_; }

  // Device memory of this node that keeps its address from run to run (so captured work can use
  // it): scratch(i, shape, dtype) is made on first use and remade only when shape or dtype change.
  Tensor& scratch(std::size_t index, const Shape& shape, DType dtype);
  // Queues a check to run once the run's work is queued (it may synchronise the device): how a
  // GPU kernel reports a bad input it found on the device without waiting in the middle of the
  // step. Checks registered while the executor captures a step (CUDA graphs) run after each
  // replay; a kernel that defers must therefore register the same check on every run.
  void defer(std::function<void()> check);
  // A device int that the executor zeroes at the start of every run of a GPU plan (inside its
  // CUDA graph too) and that a kernel finding bad input on the device sets to non-zero, besides
  // its deferred check: device work queued after the plan in the same graph (the optimizer update
  // of a whole-step graph) reads it and leaves the weights alone. Null on CPUs, whose kernels
  // throw at once.
  void* fault_word() const { return state_ != nullptr ? state_->fault_word : nullptr; }

 private:
  const Node& node_;
  devices::Device& device_;
  const Tensor* const* inputs_;
  Tensor* const* outputs_;
  std::uint64_t random_seed_;
  KernelState* state_;
};

using ShapeFn = std::vector<TensorSpec> (*)(ShapeContext&);
using GradFn = std::vector<Output> (*)(GradContext&);
using KernelFn = void (*)(KernelContext&);

// How a kernel treats float16/bfloat16 tensors.
enum class LowPrecision {
  // The executor hands the kernel float32 copies of 16-bit inputs and outputs and rounds each
  // output once afterwards: the kernel computes in float32 (what XLA:CPU and oneDNN do for
  // bfloat16 on CPUs without native 16-bit arithmetic). The default on CPU devices.
  kWidenToFloat32,
  // The kernel reads and writes 16-bit tensors itself (Cast; GPU kernels).
  kNative,
};

struct KernelOptions {
  LowPrecision low_precision = LowPrecision::kWidenToFloat32;
  // Whether the executor may record the kernel's device work once and replay it (CUDA graphs):
  // false for kernels that synchronise the host or whose work differs between runs beyond their
  // inputs' values (random ops take the step in their seed).
  bool capturable = true;
};

enum class OpKind {
  kKernel,       // computed by a kernel
  kPlaceholder,  // fed at run time
  kConstant,     // holds attrs["value"]
  kVariable,     // bound per executor
};

struct OpDef {
  std::string name;
  OpKind kind = OpKind::kKernel;
  int min_inputs = 0;
  int max_inputs = 0;  // kVariadic: no upper bound
  int num_outputs = 1;
  ShapeFn shape_fn = nullptr;
  GradFn grad_fn = nullptr;
  // >= 0: output 0 is a view of this input (Reshape, Identity); no kernel runs and no memory is planned.
  int forwards_input = -1;
  // >= 0: the same, in a plan where this input's concrete shape and dtype are output 0's (SumToShape
  // with nothing to sum: a residual add's gradient, whose operands' batch axes are unknown when the
  // graph is built); otherwise the kernel runs.
  int forwards_input_of_same_shape = -1;
  std::array<KernelFn, 2> kernels{};  // indexed by DeviceType
  std::array<KernelOptions, 2> kernel_options{};

  static constexpr int kVariadic = -1;
  KernelFn kernel(devices::DeviceType type) const { return kernels[static_cast<std::size_t>(type)]; }
  const KernelOptions& options(devices::DeviceType type) const {
    return kernel_options[static_cast<std::size_t>(type)];
  }
};

// The process-wide table of ops. Registration is thread-safe; OpDef pointers stay valid forever.
class OpRegistry {
 public:
  static OpRegistry& global();

  // Throws AlreadyExists when the name is taken.
  void add(OpDef def);
  void add_kernel(std::string_view op, devices::DeviceType type, KernelFn kernel, KernelOptions options = {});
  // Throws InvalidArgument for an unknown op, suggesting the closest known name.
  const OpDef& get(std::string_view name) const;
  const OpDef* find(std::string_view name) const;
  std::vector<std::string> op_names() const;

 private:
  OpRegistry();
  mutable std::shared_mutex mutex_;
  std::deque<OpDef> defs_;  // deque: pointers stay valid as it grows
  std::unordered_map<std::string, OpDef*> by_name_;
};

}  // namespace tandem::graph
