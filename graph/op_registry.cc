#include "tandem/graph/op_registry.h"

#include <algorithm>
#include <mutex>

namespace tandem::graph {
namespace {

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      const bool same =
          std::tolower(static_cast<unsigned char>(a[i - 1])) == std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::vector<TensorSpec> spec_from_attrs(ShapeContext& ctx) {
  return {TensorSpec{ctx.attrs().get<DType>("dtype"), ctx.attrs().get<Shape>("shape")}};
}

std::vector<TensorSpec> constant_spec(ShapeContext& ctx) {
  const auto& value = ctx.attrs().get<Tensor>("value");
  ctx.require(value.defined(), "the constant's value is an undefined tensor");
  return {TensorSpec{value.dtype(), value.shape()}};
}

}  // namespace

std::string ShapeContext::label() const { return fmt::format("{} \"{}\"", op_.name, node_name_); }

void ShapeContext::require_float(int i) const {
  require(is_floating(dtype(i)), "input {} has dtype {}; expected a floating-point tensor", i, dtype(i));
}

void ShapeContext::require_same_dtype(int i, int j) const {
  require(dtype(i) == dtype(j), "inputs {} and {} have different dtypes: {} and {}", i, j, dtype(i), dtype(j));
}

void ShapeContext::require_rank(int i, int rank) const {
  require(shape(i).rank() == rank, "input {} has shape {}; expected rank {}", i, shape(i), rank);
}

OpRegistry::OpRegistry() {
  // The source ops the graph itself creates; every other op comes from tandem::ops.
  add(OpDef{.name = "Placeholder", .kind = OpKind::kPlaceholder, .shape_fn = spec_from_attrs});
  add(OpDef{.name = "Const", .kind = OpKind::kConstant, .shape_fn = constant_spec});
  add(OpDef{.name = "Variable", .kind = OpKind::kVariable, .shape_fn = spec_from_attrs});
}

OpRegistry& OpRegistry::global() {
  static auto* registry = new OpRegistry;  // never destroyed: nodes point into it
  return *registry;
}

void OpRegistry::add(OpDef def) {
  std::unique_lock lock(mutex_);
  TANDEM_REQUIRE(!by_name_.contains(def.name), AlreadyExists, "op \"{}\" is already registered", def.name);
  TANDEM_ASSERT(def.shape_fn != nullptr, "op {} has no shape function", def.name);
  auto& stored = defs_.emplace_back(std::move(def));
  by_name_.emplace(stored.name, &stored);
}

Tensor& KernelContext::scratch(std::size_t index, const Shape& shape, DType dtype) {
  TANDEM_ASSERT(state_ != nullptr, "{}: scratch memory outside an executor", label());
  if (state_->scratch.size() <= index) state_->scratch.resize(index + 1);
  Tensor& t = state_->scratch[index];
  if (!t.defined() || t.shape() != shape || t.dtype() != dtype || &t.device() != &device_) {
    t = Tensor::empty(shape, dtype, device_);
  }
  return t;
}

void KernelContext::defer(std::function<void()> check) {
  if (state_ == nullptr) {
    check();
    return;
  }
  state_->deferred.push_back(std::move(check));
}

void OpRegistry::add_kernel(std::string_view op, devices::DeviceType type, KernelFn kernel, KernelOptions options) {
  std::unique_lock lock(mutex_);
  const auto it = by_name_.find(std::string(op));
  TANDEM_ASSERT(it != by_name_.end(), "kernel for unregistered op {}", op);
  it->second->kernels[static_cast<std::size_t>(type)] = kernel;
  it->second->kernel_options[static_cast<std::size_t>(type)] = options;
}

const OpDef* OpRegistry::find(std::string_view name) const {
  std::shared_lock lock(mutex_);
  const auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : it->second;
}

const OpDef& OpRegistry::get(std::string_view name) const {
  if (const OpDef* def = find(name)) return *def;
  std::shared_lock lock(mutex_);
  std::string closest;
  std::size_t best = name.size() / 2 + 2;
  for (const auto& def : defs_) {
    const auto d = edit_distance(name, def.name);
    if (d < best) {
      best = d;
      closest = def.name;
    }
  }
  std::string hint;
  if (defs_.size() <= 3) {
    hint = "; only the graph's source ops are registered: call tandem::ops::register_all() first";
  } else if (!closest.empty()) {
    hint = fmt::format("; did you mean \"{}\"?", closest);
  }
  throw InvalidArgument(fmt::format("unknown op \"{}\" ({} ops registered){}", name, defs_.size(), hint));
}

std::vector<std::string> OpRegistry::op_names() const {
  std::shared_lock lock(mutex_);
  std::vector<std::string> names;
  for (const auto& def : defs_) names.push_back(def.name);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace tandem::graph
