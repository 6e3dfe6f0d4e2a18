// keras::distribution: cutting a model's layer calls into pipeline stages (cut_into_stages).
#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "tandem/base/errors.h"
#include "tandem/keras_like/detail/model_state.h"
#include "tandem/keras_like/distribution.h"

namespace tandem::keras::distribution {
namespace {

using detail::LayerNode;

std::int64_t own_parameter_bytes(const LayerImpl& layer) {
  std::int64_t bytes = 0;
  for (const auto& w : layer.weights()) {
    bytes += w->global_shape().num_elements() * static_cast<std::int64_t>(graph::dtype_size(w->dtype()));
  }
  return bytes;
}

// The tensors made by calls [0, cut) (or model inputs) that calls [cut, n) read, or that are
// model outputs: what a boundary before call `cut` would have to carry. Model inputs read after
// the cut cross it too: only the first stage is fed the inputs.
std::vector<KerasTensor> crossing(const std::vector<const LayerNode*>& calls, std::size_t cut,
                                  const std::vector<KerasTensor>& outputs) {
  std::set<const LayerNode*> before(calls.begin(), calls.begin() + static_cast<std::ptrdiff_t>(cut));
  std::set<std::pair<const LayerNode*, int>> seen;
  std::vector<KerasTensor> tensors;  // in the order they are read: the same on every run
  const auto consider = [&](const KerasTensor& t) {
    if ((t.node()->layer == nullptr || before.contains(t.node().get())) &&
        seen.insert({t.node().get(), t.index()}).second) {
      tensors.push_back(t);
    }
  };
  for (std::size_t i = cut; i < calls.size(); ++i) {
    for (const auto& in : calls[i]->inputs) consider(in);
  }
  for (const auto& o : outputs) consider(o);
  return tensors;
}

}  // namespace

std::vector<PlannedStage> cut_into_stages(const Model& model, int stages, const std::vector<std::string>& cuts) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition,
                 "pipeline: model \"{}\" is not built, so its layers' calls are not known yet; give the Sequential an "
                 "Input or call model.build(shape) first",
                 model.name());
  const auto& state = *model.state();
  std::vector<const LayerNode*> calls;
  for (const auto& node : state.nodes) {
    if (node->layer != nullptr) calls.push_back(node.get());
  }
  const auto n = static_cast<int>(calls.size());
  TANDEM_REQUIRE(stages >= 1 && stages <= n, InvalidArgument,
                 "pipeline: {} stages for model \"{}\", which has {} layer call{}; give 1 to {} stages", stages,
                 model.name(), n, n == 1 ? "" : "s", n);
  const auto name_of = [&](std::size_t i) { return calls[i]->layer->name(); };
  // Where each stage starts (call index); stage 0 at 0.
  std::vector<std::size_t> starts{0};
  if (!cuts.empty()) {
    TANDEM_REQUIRE(
        static_cast<int>(cuts.size()) == stages - 1, InvalidArgument,
        "pipeline: {} cut{} given for {} stages of model \"{}\"; give the {} layers that start stages 1 to {}",
        cuts.size(), cuts.size() == 1 ? "" : "s", stages, model.name(), stages - 1, stages - 1);
    for (const auto& cut : cuts) {
      std::size_t i = 0;
      while (i < calls.size() && name_of(i) != cut) ++i;
      TANDEM_REQUIRE(i < calls.size(), InvalidArgument, "pipeline: cut '{}' is not a layer of model \"{}\"", cut,
                     model.name());
      TANDEM_REQUIRE(i > starts.back(), InvalidArgument,
                     "pipeline: cut '{}' (layer call {}) does not come after the previous stage's start (layer call "
                     "{}, '{}'); list the cuts in model order",
                     cut, i, starts.back(), name_of(starts.back()));
      starts.push_back(i);
    }
  } else {
    // Balanced: stage k starts at the first valid boundary where the bytes before it reach k/p of
    // the total (at least one call per stage).
    std::vector<std::int64_t> bytes;
    std::int64_t total = 0;
    std::set<const LayerImpl*> counted;  // a layer called twice holds its weights once
    for (const auto* call : calls) {
      const bool first_call = counted.insert(call->layer.get()).second;
      bytes.push_back(first_call ? own_parameter_bytes(*call->layer) : 0);
      total += bytes.back();
    }
    std::vector<std::int64_t> prefix{0};  // prefix[i]: the bytes of calls [0, i)
    for (const auto b : bytes) prefix.push_back(prefix.back() + b);
    for (int k = 1; k < stages; ++k) {
      const double target = static_cast<double>(total) * k / stages;
      // Stage k may start anywhere that leaves every stage at least one call.
      const std::size_t lo = starts.back() + 1, hi = calls.size() - static_cast<std::size_t>(stages - k);
      std::optional<std::size_t> chosen, last_valid;
      for (std::size_t c = lo; c <= hi && !chosen; ++c) {
        if (crossing(calls, c, state.outputs).size() != 1) continue;
        last_valid = c;
        if (static_cast<double>(prefix[c]) >= target) chosen = c;
      }
      TANDEM_REQUIRE(chosen || last_valid, InvalidArgument,
                     "pipeline: model \"{}\" has no boundary for stage {} between layer calls {} and {} that exactly "
                     "one tensor crosses; give fewer stages or cut it by hand (PipelineOptions::cuts)",
                     model.name(), k, lo, hi);
      starts.push_back(chosen ? *chosen : *last_valid);
    }
  }
  std::vector<PlannedStage> out;
  for (int k = 0; k < stages; ++k) {
    const std::size_t begin = starts[static_cast<std::size_t>(k)];
    const std::size_t end = k + 1 < stages ? starts[static_cast<std::size_t>(k) + 1] : calls.size();
    PlannedStage stage{
        .first_layer = name_of(begin), .last_layer = name_of(end - 1), .layer_calls = static_cast<int>(end - begin)};
    std::set<const LayerImpl*> seen;
    for (std::size_t i = begin; i < end; ++i) {
      if (seen.insert(calls[i]->layer.get()).second) stage.parameter_bytes += own_parameter_bytes(*calls[i]->layer);
    }
    if (k + 1 < stages) {
      const auto cross = crossing(calls, end, state.outputs);
      std::string names;
      for (const auto& t : cross) names += fmt::format("{}{}", names.empty() ? "" : ", ", t.name());
      TANDEM_REQUIRE(cross.size() == 1, InvalidArgument,
                     "pipeline: the boundary before layer '{}' of model \"{}\" is crossed by {} tensors ({}); a stage "
                     "boundary must carry exactly one (move the cut past the connection that skips it)",
                     name_of(end), model.name(), cross.size(), names);
      stage.boundary = cross[0].spec();
    }
    out.push_back(std::move(stage));
  }
  return out;
}

}  // namespace tandem::keras::distribution
