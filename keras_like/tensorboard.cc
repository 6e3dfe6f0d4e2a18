// tandem/keras_like/tensorboard.cc — the TensorBoard callback (Keras 3's
// keras/src/callbacks/tensorboard.py): what it logs, under which tags, to which run, at which step.
// The files themselves are detail/event_file.cc's.
#include "tandem/keras_like/callbacks.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <set>

#include "tandem/base/errors.h"
#include "tandem/keras_like/detail/event_file.h"
#include "tandem/keras_like/layer.h"
#include "tandem/keras_like/model.h"

namespace tandem::keras {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Batches between batch-level scalars: 0 for "epoch", 1 for "batch", N for N.
std::int64_t parse_update_freq(const std::string& log_dir, const std::variant<std::string, std::int64_t>& freq) {
  if (const auto* n = std::get_if<std::int64_t>(&freq)) {
    TANDEM_REQUIRE(*n >= 1, InvalidArgument,
                   "TensorBoard \"{}\": update_freq is {}; expected \"epoch\", \"batch\" or a number of batches >= 1",
                   log_dir, *n);
    return *n;
  }
  const auto& word = std::get<std::string>(freq);
  if (word == "epoch") return 0;
  if (word == "batch") return 1;
  throw InvalidArgument(fmt::format(
      "TensorBoard \"{}\": update_freq \"{}\" is not \"epoch\", \"batch\" or a number of batches", log_dir, word));
}

// The model's layer graph for TensorBoard's graph plugin: one node per layer call (a layer
// called twice gets "name_1" for its second call), inputs as Placeholders, as TensorFlow names
// its ops. Walks back from the outputs, so nodes come after their inputs.
std::vector<detail::GraphNode> layer_graph(const Model& model) {
  std::vector<detail::GraphNode> nodes;
  std::map<const detail::LayerNode*, std::string> names;
  std::map<std::string, int> calls;  // layer name -> calls named so far
  std::set<std::string> taken;
  const auto unique = [&](const std::string& base) {
    std::string name = base;
    for (int k = calls[base]++; k > 0 || taken.count(name) > 0; ++k) name = fmt::format("{}_{}", base, k + 1);
    taken.insert(name);
    return name;
  };
  const auto visit = [&](const auto& self, const std::shared_ptr<detail::LayerNode>& node) -> std::string {
    if (const auto it = names.find(node.get()); it != names.end()) return it->second;
    detail::GraphNode out;
    for (const auto& input : node->inputs) {
      const std::string from = self(self, input.node());
      out.inputs.push_back(input.index() == 0 ? from : fmt::format("{}:{}", from, input.index()));
    }
    const bool is_input = node->layer == nullptr;
    out.name = unique(is_input ? (node->input_name.empty() ? "input" : node->input_name) : node->layer->name());
    out.op = is_input ? "Placeholder" : node->layer->class_name();
    names[node.get()] = out.name;
    nodes.push_back(std::move(out));
    return nodes.back().name;
  };
  for (const auto& output : model.outputs()) {
    if (output.defined()) visit(visit, output.node());
  }
  return nodes;
}

// Host values of a weight as doubles, whatever its dtype.
std::vector<double> values_of(const Tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.num_elements()));
  switch (t.dtype()) {
    case DType::kF32: std::ranges::copy(t.to_vector<float>(), out.begin()); break;
    case DType::kF64: return t.to_vector<double>();
    case DType::kI32: std::ranges::copy(t.to_vector<std::int32_t>(), out.begin()); break;
    case DType::kI64: std::ranges::copy(t.to_vector<std::int64_t>(), out.begin()); break;
    case DType::kU8: std::ranges::copy(t.to_vector<std::uint8_t>(), out.begin()); break;
    case DType::kF16:
    case DType::kBF16: {
      std::vector<float> wide(out.size());
      widen_to_float32(t.dtype(), t.raw_data(), wide.data(), t.num_elements());
      std::ranges::copy(wide, out.begin());
      break;
    }
  }
  return out;
}

}  // namespace

struct TensorBoard::State {
  std::unique_ptr<detail::EventFileWriter> train, validation;
  std::string train_path, validation_path;
  std::int64_t global_batch = 0;  // training batches of this fit, counted from 1 (Keras's step)
  std::int64_t epoch_batches = 0;
  Clock::time_point epoch_start, batch_start;
  bool graph_written = false;

  void close() {
    train.reset();
    validation.reset();
  }
};

TensorBoard::TensorBoard(std::string log_dir, TensorBoardOptions options)
    : log_dir_(std::move(log_dir)), options_(std::move(options)), state_(std::make_unique<State>()) {
  TANDEM_REQUIRE(!log_dir_.empty(), InvalidArgument, "TensorBoard: log_dir is empty");
  update_every_ = parse_update_freq(log_dir_, options_.update_freq);
  TANDEM_REQUIRE(options_.histogram_freq >= 0, InvalidArgument,
                 "TensorBoard \"{}\": histogram_freq is {}; expected 0 (no histograms) or a number of epochs", log_dir_,
                 options_.histogram_freq);
}

TensorBoard::~TensorBoard() = default;

std::string TensorBoard::train_file() const { return state_->train_path; }
std::string TensorBoard::validation_file() const { return state_->validation_path; }

namespace {
// The run's writer, opened on first use: validation/ only once there is something to put there,
// as Keras (a fit without validation data leaves no empty run).
detail::EventFileWriter& writer(std::unique_ptr<detail::EventFileWriter>& w, std::string& path,
                                const std::string& log_dir, const char* run) {
  if (w == nullptr) {
    w = std::make_unique<detail::EventFileWriter>((std::filesystem::path(log_dir) / run).string());
    path = w->path();
  }
  return *w;
}
}  // namespace

void TensorBoard::on_train_begin(Logs& /*logs*/) {
  auto& s = *state_;
  s.close();
  s.global_batch = 0;
  s.graph_written = !options_.write_graph;
  if (!is_chief()) return;
  s.validation_path.clear();
  // Opened now, so that a log_dir that cannot be written fails before the first step.
  writer(s.train, s.train_path, log_dir_, "train");
}

void TensorBoard::on_train_end(Logs& /*logs*/) {
  if (state_->train) state_->train->flush();
  if (state_->validation) state_->validation->flush();
  state_->close();
}

void TensorBoard::on_epoch_begin(int /*epoch*/, Logs& /*logs*/) {
  state_->epoch_batches = 0;
  state_->epoch_start = Clock::now();
}

void TensorBoard::on_train_batch_begin(std::int64_t /*batch*/, Logs& /*logs*/) {
  auto& s = *state_;
  ++s.global_batch;
  ++s.epoch_batches;
  s.batch_start = Clock::now();
}

void TensorBoard::on_train_batch_end(std::int64_t /*batch*/, Logs& logs) {
  auto& s = *state_;
  if (!is_chief()) return;
  auto& train = writer(s.train, s.train_path, log_dir_, "train");
  if (!s.graph_written) {
    // At the first batch, as Keras writes its train graph: the model is built by then.
    train.add_graph(layer_graph(model()));
    s.graph_written = true;
  }
  if (update_every_ == 0 || s.global_batch % update_every_ != 0) return;
  if (options_.write_steps_per_second) {
    train.add_scalar("batch_steps_per_second", 1.0 / std::max(seconds_since(s.batch_start), 1e-9), s.global_batch);
  }
  for (const auto& [name, value] : logs) train.add_scalar("batch_" + name, value, s.global_batch);
}

void TensorBoard::on_epoch_end(int epoch, Logs& logs) {
  auto& s = *state_;
  const bool histograms = options_.histogram_freq > 0 && epoch % options_.histogram_freq == 0;
  // Every worker reads the weights: reading a sharded one is a collective (Variable::read_value).
  std::vector<std::pair<std::string, Tensor>> weights;
  if (histograms) {
    const auto variables = model().weights();
    const auto values = model().get_weights();
    std::set<const Variable*> seen;
    for (std::size_t i = 0; i < variables.size() && i < values.size(); ++i) {
      if (seen.insert(variables[i].get()).second) weights.emplace_back(variables[i]->name(), values[i]);
    }
  }
  if (!is_chief()) return;
  auto& train = writer(s.train, s.train_path, log_dir_, "train");
  // Keras's _log_epoch_metrics: training values plus the learning rate (and steps per second) to
  // train/, val_ values without their prefix to validation/, each as epoch_<name>.
  Logs train_logs;
  for (const auto& [name, value] : logs) {
    if (!name.starts_with("val_")) train_logs.set(name, value);
  }
  train_logs.set("learning_rate", model().optimizer().learning_rate());
  if (options_.write_steps_per_second) {
    train_logs.set("steps_per_second",
                   static_cast<double>(s.epoch_batches) / std::max(seconds_since(s.epoch_start), 1e-9));
  }
  for (const auto& [name, value] : train_logs) train.add_scalar("epoch_" + name, value, epoch);
  for (const auto& [name, value] : logs) {
    if (!name.starts_with("val_")) continue;
    writer(s.validation, s.validation_path, log_dir_, "validation").add_scalar("epoch_" + name.substr(4), value, epoch);
  }
  for (const auto& [name, value] : weights) {
    train.add_histogram(name + "/histogram", detail::make_histogram(values_of(value)), epoch);
  }
  // Every epoch reaches the files, so a running TensorBoard shows it.
  train.flush();
  if (s.validation) s.validation->flush();
}

void TensorBoard::on_test_end(Logs& logs) {
  if (!is_chief() || logs.empty() || !model().compiled()) return;
  auto& s = *state_;
  auto& validation = writer(s.validation, s.validation_path, log_dir_, "validation");
  const std::int64_t step = model().optimizer().iterations();
  for (const auto& [name, value] : logs) {
    validation.add_scalar(fmt::format("evaluation_{}_vs_iterations", name), value, step);
  }
  validation.flush();
}

}  // namespace tandem::keras
