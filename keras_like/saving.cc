// tandem/keras_like/saving.cc — model weights and training checkpoints, in safetensors files
// (safetensors.cc reads and writes the format).
#include "tandem/keras_like/saving.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include <nlohmann/json.hpp>

#include "tandem/base/detail/json.h"
#include "tandem/base/errors.h"
#include "tandem/base/log.h"
#include "tandem/keras_like/model.h"

namespace tandem::keras {
namespace {

constexpr std::string_view kFormatKey = "format";
constexpr std::string_view kWeightsFormat = "tandem.weights";
constexpr std::string_view kCheckpointFormat = "tandem.checkpoint";
constexpr std::string_view kOptimizerPrefix = "optimizer/";
constexpr std::string_view kIterationsName = "optimizer/iterations";
constexpr std::string_view kLearningRateName = "optimizer/learning_rate";
// Metadata: a scheduled optimizer's schedule, as Keras serialises it (LearningRate::to_json).
constexpr std::string_view kScheduleKey = "learning_rate_schedule";

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += fmt::format("{}{}", out.empty() ? "" : ", ", item);
  return out;
}

std::string describe(DType dtype, const Shape& shape) { return fmt::format("{} {}", dtype, shape); }

// A weight name without the numbers unique_layer_name appends ("dense_3/kernel" -> "dense/kernel",
// "conv2d_1/bias" -> "conv2d/bias"): what two models built by the same code share.
std::string without_numbering(std::string_view name) {
  std::string out;
  while (true) {
    const auto slash = name.find('/');
    std::string_view part = name.substr(0, slash);
    const auto underscore = part.rfind('_');
    if (underscore != std::string_view::npos && underscore > 0 && underscore + 1 < part.size() &&
        part.find_first_not_of("0123456789", underscore + 1) == std::string_view::npos) {
      part = part.substr(0, underscore);
    }
    out += part;
    if (slash == std::string_view::npos) return out;
    out += '/';
    name = name.substr(slash + 1);
  }
}

// Where the model's variables are in a file. By name; or, when the file was written by a model
// built the same way whose layers were numbered otherwise (auto-generated names count up through
// the process: dense, dense_1, then dense_2, dense_3 for an identical second model), by structure
// as Keras 3 loads weights: the model's weights in order against the file's, pairwise, their names
// equal but for the numbering. Optimizer slots ("<weight>/m") follow their weight.
class FileNames {
 public:
  // weights: the model's unique weights in order; file: the file's weights (no optimizer state), in
  // file order (the order save_weights writes).
  FileNames(const std::vector<VariablePtr>& weights, const NamedTensors& file) {
    std::set<std::string> in_file;
    for (const auto& [name, tensor] : file) in_file.insert(name);
    const bool by_name =
        std::all_of(weights.begin(), weights.end(), [&](const VariablePtr& w) { return in_file.contains(w->name()); });
    if (by_name) return;
    const std::size_t n = std::min(weights.size(), file.size());
    const auto same_name = [&](std::size_t k) {
      return without_numbering(weights[k]->name()) == without_numbering(file[k].first);
    };
    std::size_t i = 0;
    while (i < n && same_name(i)) ++i;
    if (i == weights.size() && i == file.size()) {
      // Paired; a dtype or shape that differs is then reported under the model's name.
      for (std::size_t k = 0; k < n; ++k) {
        if (weights[k]->name() != file[k].first) renamed_.emplace(weights[k]->name(), file[k].first);
      }
      return;
    }
    // Neither: say where the two part, for the error the missing names will raise.
    i = 0;
    while (i < n && same_name(i) && weights[i]->dtype() == file[i].second.dtype() &&
           weights[i]->shape() == file[i].second.shape()) {
      ++i;
    }
    if (i < n) {
      first_difference_ = fmt::format("in order, weight {} of the model is \"{}\" ({}) where the file has \"{}\" ({})",
                                      i + 1, weights[i]->name(), describe(weights[i]->dtype(), weights[i]->shape()),
                                      file[i].first, describe(file[i].second.dtype(), file[i].second.shape()));
    } else {
      first_difference_ = fmt::format(
          "in order, the model has {} weights and the file {}; the first without a partner is "
          "\"{}\"",
          weights.size(), file.size(), i < weights.size() ? weights[i]->name() : file[i].first);
    }
  }

  // The file's name for a model variable or optimizer slot.
  std::string operator()(const std::string& name) const {
    if (renamed_.empty()) return name;
    if (const auto it = renamed_.find(name); it != renamed_.end()) return it->second;
    // A slot "<weight>/<slot>": the longest renamed weight it starts with.
    const std::pair<const std::string, std::string>* owner = nullptr;
    for (const auto& entry : renamed_) {
      if (name.size() > entry.first.size() && name.starts_with(entry.first) && name[entry.first.size()] == '/' &&
          (owner == nullptr || entry.first.size() > owner->first.size())) {
        owner = &entry;
      }
    }
    return owner == nullptr ? name : owner->second + name.substr(owner->first.size());
  }
  // "" unless the names differ and the structures too: where they part.
  const std::string& first_difference() const { return first_difference_; }

 private:
  std::map<std::string, std::string> renamed_;  // model name -> file name, matched by structure
  std::string first_difference_;
};

// The file's weights in file order: every tensor but a training checkpoint's optimizer state.
NamedTensors weights_in_file(const SafetensorsContent& content, bool checkpoint) {
  NamedTensors out;
  for (const auto& [name, tensor] : content.tensors) {
    if (!checkpoint || !std::string_view(name).starts_with(kOptimizerPrefix)) out.emplace_back(name, tensor);
  }
  return out;
}

// Pairs every variable with the file's tensor of its name (in_file's), checking dtype and shape,
// and marks the names used. Every problem is collected so one error lists them all.
std::vector<std::pair<VariablePtr, Tensor>> match_variables(const std::vector<VariablePtr>& variables,
                                                            const std::map<std::string, Tensor>& file,
                                                            const FileNames& in_file, std::set<std::string>& used,
                                                            std::string_view prefix, std::vector<std::string>& missing,
                                                            std::vector<std::string>& mismatched) {
  std::vector<std::pair<VariablePtr, Tensor>> plan;
  for (const auto& v : variables) {
    const std::string name = fmt::format("{}{}", prefix, in_file(v->name()));
    if (!used.insert(name).second) continue;  // the same variable listed twice: assign once
    const auto it = file.find(name);
    if (it == file.end()) {
      missing.push_back(name);
      continue;
    }
    const Tensor& t = it->second;
    if (t.dtype() != v->dtype() || t.shape() != v->global_shape()) {
      const std::string model_name = fmt::format("{}{}", prefix, v->name());
      mismatched.push_back(fmt::format("\"{}\"{} is {} in the file but {} in the model", model_name,
                                       model_name == name ? "" : fmt::format(" (the file's \"{}\")", name),
                                       describe(t.dtype(), t.shape()), describe(v->dtype(), v->global_shape())));
      continue;
    }
    plan.emplace_back(v, t);
  }
  return plan;
}

std::string mismatch_report(const std::vector<std::string>& missing, const std::vector<std::string>& extra,
                            const std::vector<std::string>& mismatched, const FileNames& in_file) {
  std::vector<std::string> parts;
  if (!missing.empty()) parts.push_back(fmt::format("missing from the file: {}", join(missing)));
  if (!extra.empty()) parts.push_back(fmt::format("in the file but not in the model: {}", join(extra)));
  for (const auto& m : mismatched) parts.push_back(m);
  if (!missing.empty() && !in_file.first_difference().empty()) parts.push_back(in_file.first_difference());
  std::string out;
  for (const auto& p : parts) out += fmt::format("{}{}", out.empty() ? "" : "; ", p);
  return out;
}

std::vector<VariablePtr> unique_variables(const std::vector<VariablePtr>& variables) {
  std::vector<VariablePtr> out;
  for (const auto& v : variables) {
    if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  }
  return out;
}

std::int64_t parse_metadata_int(const SafetensorsContent& content, const std::string& path, const std::string& key) {
  const auto it = content.metadata.find(key);
  if (it == content.metadata.end()) {
    throw DataLoss(fmt::format("\"{}\": the training checkpoint has no \"{}\" in its metadata", path, key));
  }
  std::int64_t value = 0;
  const auto& s = it->second;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr != s.data() + s.size() || value < 0) {
    throw DataLoss(fmt::format("\"{}\": metadata \"{}\" is \"{}\", not a non-negative integer", path, key, s));
  }
  return value;
}

// A constant rate comes back as it was saved (a callback may have changed it). A schedule is the
// compiled optimizer's, as in Keras, where it is code rather than state (BackupAndRestore and
// load_weights restore variables only; load_model rebuilds the optimizer it saved, but there is no
// compiled one to disagree with): with the iterations restored, the same schedule gives the same
// rate at the same step. When the checkpoint's rate was another schedule, or a constant where the
// optimizer now has a schedule (or the reverse), the compiled one is kept and a warning says so:
// changing the schedule between runs (a longer decay to train on) is a choice, not corruption.
void restore_learning_rate(Optimizer& optimizer, const SafetensorsContent& content, std::optional<double> constant,
                           const std::string& path, const std::string& model_name) {
  const LearningRate& compiled = optimizer.learning_rate_config();
  std::optional<std::string> saved;
  if (const auto it = content.metadata.find(std::string(kScheduleKey)); it != content.metadata.end()) {
    saved = it->second;
  } else if (constant) {
    if (!compiled.is_schedule()) {
      optimizer.set_learning_rate(*constant);
      return;
    }
    saved = LearningRate(*constant).to_json();
  }
  if (!saved || *saved == compiled.to_json()) return;
  // The file's text is from outside: shown through the JSON parser, short and escaped.
  nlohmann::ordered_json parsed;
  const std::string shown = tandem::detail::parse_json(*saved, parsed) ? tandem::detail::quote_value(*saved)
                                                                        : tandem::detail::json_for_message(parsed);
  logging::warn(
      "load_training_checkpoint \"{}\": the checkpoint was trained with learning rate {}, but model \"{}\"'s "
      "optimizer has {}; training continues with the optimizer's",
      path, shown, model_name, compiled.to_json());
}

}  // namespace

void save_model_weights(const Model& model, const std::string& path) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition,
                 "save_weights \"{}\": model \"{}\" is not built yet (build it, or call it on data, first)", path,
                 model.name());
  NamedTensors tensors;
  std::set<std::string> seen;
  for (const auto& w : unique_variables(model.weights())) {
    TANDEM_REQUIRE(seen.insert(w->name()).second, InvalidArgument,
                   "save_weights \"{}\": model \"{}\" has two weights named \"{}\"; a weights file needs unique names "
                   "(give the layers distinct names)",
                   path, model.name(), w->name());
    tensors.emplace_back(w->name(), w->read_value());
  }
  write_safetensors(path, tensors, {{std::string(kFormatKey), std::string(kWeightsFormat)}});
}

void load_model_weights(Model& model, const std::string& path) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition,
                 "load_weights \"{}\": model \"{}\" is not built yet (build it, or call it on data, first)", path,
                 model.name());
  auto content = read_safetensors(path);
  // A training checkpoint holds the weights too; its optimizer state is not the model's.
  const auto format = content.metadata.find(std::string(kFormatKey));
  const bool checkpoint = format != content.metadata.end() && format->second == kCheckpointFormat;
  const NamedTensors weights = weights_in_file(content, checkpoint);
  const std::map<std::string, Tensor> file(weights.begin(), weights.end());
  const FileNames in_file(unique_variables(model.weights()), weights);
  std::set<std::string> used;
  std::vector<std::string> missing, mismatched, extra;
  const auto plan = match_variables(model.weights(), file, in_file, used, "", missing, mismatched);
  for (const auto& [name, tensor] : file) {
    if (!used.contains(name)) extra.push_back(name);
  }
  if (!missing.empty() || !extra.empty() || !mismatched.empty()) {
    throw InvalidArgument(
        fmt::format("load_weights \"{}\" into model \"{}\": the file does not match the model ({}); "
                    "nothing was loaded",
                    path, model.name(), mismatch_report(missing, extra, mismatched, in_file)));
  }
  for (const auto& [variable, value] : plan) variable->assign(value);
}

void save_training_checkpoint(const Model& model, const std::string& path, const TrainingState& state) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition, "save_training_checkpoint \"{}\": model \"{}\" is not built yet",
                 path, model.name());
  const Optimizer& optimizer = model.optimizer();  // FailedPrecondition before compile()
  NamedTensors tensors;
  for (const auto& w : unique_variables(model.weights())) tensors.emplace_back(w->name(), w->read_value());
  for (const auto& [name, slot] : optimizer.slots()) {
    tensors.emplace_back(fmt::format("{}{}", kOptimizerPrefix, name), slot->read_value());
  }
  tensors.emplace_back(std::string(kIterationsName), Tensor::scalar<std::int64_t>(optimizer.iterations()));
  std::map<std::string, std::string> metadata{{std::string(kFormatKey), std::string(kCheckpointFormat)},
                                              {"optimizer", optimizer.name()},
                                              {"epoch", std::to_string(state.epoch)},
                                              {"step", std::to_string(state.step)}};
  const LearningRate& rate = optimizer.learning_rate_config();
  if (rate.is_schedule()) {
    // Its rate follows from iterations; the config says which schedule it was.
    metadata.emplace(std::string(kScheduleKey), rate.to_json());
  } else {
    // Kept so a learning rate changed during training (ReduceLROnPlateau) resumes as it was.
    tensors.emplace_back(std::string(kLearningRateName), Tensor::scalar<double>(optimizer.learning_rate()));
  }
  write_safetensors(path, tensors, metadata);
}

TrainingState load_training_checkpoint(Model& model, const std::string& path) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition, "load_training_checkpoint \"{}\": model \"{}\" is not built yet",
                 path, model.name());
  Optimizer& optimizer = model.optimizer();
  auto content = read_safetensors(path);
  const auto format = content.metadata.find(std::string(kFormatKey));
  TANDEM_REQUIRE(format != content.metadata.end() && format->second == kCheckpointFormat, InvalidArgument,
                 "\"{}\" is not a training checkpoint (its format is \"{}\"; expected \"{}\"); load weights with "
                 "load_weights()",
                 path, format == content.metadata.end() ? "unknown" : format->second, kCheckpointFormat);
  TrainingState state;
  const auto epoch = parse_metadata_int(content, path, "epoch");
  TANDEM_REQUIRE(epoch <= std::numeric_limits<int>::max(), DataLoss, "\"{}\": metadata epoch {} is out of range", path,
                 epoch);
  state.epoch = static_cast<int>(epoch);
  state.step = parse_metadata_int(content, path, "step");
  // Loss scaling is a wrapper: a mixed_float16 run's checkpoint (loss_scale_optimizer(adam)) loads
  // into a float32 model compiled with adam, and the other way round. Only the scale state is
  // left out (dropped, or started at the initial scale).
  const auto without_loss_scaling = [](std::string_view name) {
    constexpr std::string_view kWrapper = "loss_scale_optimizer(";
    if (name.starts_with(kWrapper) && name.ends_with(")"))
      name = name.substr(kWrapper.size(), name.size() - kWrapper.size() - 1);
    return std::string(name);
  };
  if (const auto it = content.metadata.find("optimizer"); it != content.metadata.end()) {
    TANDEM_REQUIRE(without_loss_scaling(it->second) == without_loss_scaling(optimizer.name()), InvalidArgument,
                   "load_training_checkpoint \"{}\": the checkpoint holds the state of optimizer \"{}\"; model \"{}\" "
                   "was compiled with \"{}\"",
                   path, it->second, model.name(), optimizer.name());
  }

  const FileNames in_file(unique_variables(model.weights()), weights_in_file(content, /*checkpoint=*/true));
  std::map<std::string, Tensor> file;
  for (auto& [name, tensor] : content.tensors) file.emplace(name, std::move(tensor));
  const auto take_scalar = [&](std::string_view name, DType dtype, bool required) -> std::optional<Tensor> {
    const auto it = file.find(std::string(name));
    if (it == file.end()) {
      TANDEM_REQUIRE(!required, DataLoss, "\"{}\": the training checkpoint has no \"{}\"", path, name);
      return std::nullopt;
    }
    TANDEM_REQUIRE(it->second.dtype() == dtype && it->second.shape() == Shape{}, DataLoss,
                   "\"{}\": \"{}\" is {}; expected a {} scalar", path, name,
                   describe(it->second.dtype(), it->second.shape()), dtype);
    Tensor t = it->second;
    file.erase(it);
    return t;
  };
  const auto iterations = take_scalar(kIterationsName, DType::kI64, true)->item<std::int64_t>();
  TANDEM_REQUIRE(iterations >= 0, DataLoss, "\"{}\": \"{}\" is {}; expected a count", path, kIterationsName,
                 iterations);
  const auto learning_rate_tensor = take_scalar(kLearningRateName, DType::kF64, false);
  std::optional<double> learning_rate;
  if (learning_rate_tensor) {
    learning_rate = learning_rate_tensor->item<double>();
    TANDEM_REQUIRE(std::isfinite(*learning_rate) && *learning_rate >= 0, DataLoss,
                   "\"{}\": \"{}\" is {}; expected a finite, non-negative rate", path, kLearningRateName,
                   *learning_rate);
  }

  std::set<std::string> used;
  std::vector<std::string> missing, mismatched, extra;
  auto plan = match_variables(model.weights(), file, in_file, used, "", missing, mismatched);
  bool has_slots_in_file = false;
  for (const auto& [name, tensor] : file) {
    if (std::string_view(name).starts_with(kOptimizerPrefix)) has_slots_in_file = true;
  }
  if (missing.empty() && mismatched.empty() && has_slots_in_file && optimizer.slots().empty()) {
    // A freshly compiled model has no slots until its first step; create them now (zeros, for
    // the same variables fit() would use) so they can take the checkpoint's values.
    optimizer.build(unique_variables(model.trainable_weights()));
  }
  std::vector<VariablePtr> slots;
  for (const auto& [name, slot] : optimizer.slots()) slots.push_back(slot);
  auto slot_plan = match_variables(slots, file, in_file, used, kOptimizerPrefix, missing, mismatched);
  for (const auto& [name, tensor] : file) {
    if (!used.contains(name)) extra.push_back(name);
  }
  const auto is_loss_scale_state = [](const std::string& name) {
    return std::string_view(name).starts_with(fmt::format("{}loss_scale_optimizer/", kOptimizerPrefix));
  };
  std::erase_if(extra, is_loss_scale_state);
  std::erase_if(missing, is_loss_scale_state);
  if (!missing.empty() || !extra.empty() || !mismatched.empty()) {
    throw InvalidArgument(
        fmt::format("load_training_checkpoint \"{}\" into model \"{}\": the checkpoint does not match "
                    "the model and its {} optimizer ({}); nothing was loaded",
                    path, model.name(), optimizer.name(), mismatch_report(missing, extra, mismatched, in_file)));
  }
  for (const auto& [variable, value] : plan) variable->assign(value);
  for (const auto& [variable, value] : slot_plan) variable->assign(value);
  optimizer.set_iterations(iterations);
  restore_learning_rate(optimizer, content, learning_rate, path, model.name());
  return state;
}

}  // namespace tandem::keras
