// tandem/keras_like/callbacks.cc — Keras 3's callbacks (the progress bar is in progbar.cc).
//
// Each callback follows its Keras 3 counterpart's rules (when it counts an improvement, when it
// waits, what it prints), so settings carry over from Python unchanged. Epoch numbers passed to
// the hooks are 0-based; the ones printed and put in file names are 1-based, as in Keras.
#include "tandem/keras_like/callbacks.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <system_error>

#include "tandem/base/errors.h"
#include "tandem/base/log.h"
#include "tandem/keras_like/detail/checkpoints.h"
#include "tandem/keras_like/detail/model_state.h"
#include "tandem/keras_like/model.h"
#include "tandem/keras_like/saving.h"

namespace tandem::keras {
namespace {

// Keras's "auto": accuracy-like quantities (and AUC, F-measures) grow as they improve.
bool maximizes(const std::string& monitor, MonitorMode mode) {
  switch (mode) {
    case MonitorMode::kMin: return false;
    case MonitorMode::kMax: return true;
    case MonitorMode::kAuto:
      return monitor.find("acc") != std::string::npos || monitor.find("auc") != std::string::npos ||
             monitor.starts_with("fmeasure");
  }
  return false;
}

// Whether `current` beats `reference` by more than min_delta in the monitored direction. No
// reference yet means any value is an improvement.
bool is_improvement(double current, std::optional<double> reference, bool maximize, double min_delta) {
  if (!reference) return true;
  const double delta = std::abs(min_delta);
  return maximize ? current - delta > *reference : current + delta < *reference;
}

std::string keys_of(const Logs& logs) {
  std::string out;
  for (const auto& [k, v] : logs) out += fmt::format("{}{}", out.empty() ? "" : ", ", k);
  return out.empty() ? "none" : out;
}

void warn_missing(std::string_view callback, const std::string& monitor, const Logs& logs,
                  std::string_view consequence) {
  logging::warn("{} monitors \"{}\", which is not in the logs (present: {}); {}", callback, monitor, keys_of(logs),
                consequence);
}

// The callbacks that set the learning rate refuse a scheduled optimizer before the first step:
// Keras's optimizer raises TypeError at their first change, which may come epochs in.
void require_settable_learning_rate(std::string_view callback, const Optimizer& optimizer) {
  TANDEM_REQUIRE(!optimizer.learning_rate_config().is_schedule(), FailedPrecondition,
                 "{}: the optimizer ({}) was created with a learning-rate schedule ({}), so its learning rate cannot "
                 "be set; give it a constant learning_rate to use this callback",
                 callback, optimizer.name(), optimizer.learning_rate_config().kind());
}

// Python's str(float): the shortest repr, always with a decimal point or an exponent.
std::string python_float(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", value);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// A best value for messages: Keras starts from +-inf.
std::string best_string(std::optional<double> best, bool maximize) {
  if (best) return fmt::format("{:.5f}", *best);
  return maximize ? "-inf" : "inf";
}

// One "{name}" or "{name:spec}" field of a ModelCheckpoint path, formatted like Python's
// str.format: integer fields take integer specs ("02d") and float ones ("5.2f") alike.
std::string format_field(const std::string& pattern, std::string_view name, std::string_view spec,
                         std::optional<std::int64_t> integer, double value) {
  const std::string format = spec.empty() ? std::string("{}") : fmt::format("{{:{}}}", spec);
  const char type = spec.empty() ? '\0' : spec.back();
  const bool float_type = std::string_view("eEfFgG%").find(type) != std::string_view::npos && type != '\0';
  try {
    if (integer && !float_type) return fmt::format(fmt::runtime(format), *integer);
    if (spec.empty()) return python_float(value);
    if (type == '%') {
      // Python's percent: the value times 100, fixed-point, with a percent sign.
      const std::string inner = fmt::format("{{:{}f}}", spec.substr(0, spec.size() - 1));
      return fmt::format(fmt::runtime(inner), value * 100.0) + "%";
    }
    return fmt::format(fmt::runtime(format), value);
  } catch (const fmt::format_error& e) {
    throw InvalidArgument(fmt::format("ModelCheckpoint: filepath \"{}\": field {{{}:{}}} cannot format {} ({})",
                                      pattern, name, spec, integer ? "an integer" : "a number", e.what()));
  }
}

// Fills a ModelCheckpoint path: {epoch} (1-based), {batch} (1-based, batch saves only) and any
// log value; "{{" and "}}" are literal braces.
std::string format_checkpoint_path(const std::string& pattern, int epoch, std::optional<std::int64_t> batch,
                                   const Logs& logs) {
  std::string out;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '}') {
      TANDEM_REQUIRE(i + 1 < pattern.size() && pattern[i + 1] == '}', InvalidArgument,
                     "ModelCheckpoint: filepath \"{}\" has a lone '}}' at {} (write '}}}}' for a brace)", pattern, i);
      out += '}';
      ++i;
      continue;
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < pattern.size() && pattern[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    const auto close = pattern.find('}', i);
    TANDEM_REQUIRE(close != std::string::npos, InvalidArgument,
                   "ModelCheckpoint: filepath \"{}\" has an unclosed '{{' at {}", pattern, i);
    const std::string_view field(pattern.data() + i + 1, close - i - 1);
    const auto colon = field.find(':');
    const std::string_view name = field.substr(0, colon);
    const std::string_view spec = colon == std::string_view::npos ? std::string_view() : field.substr(colon + 1);
    if (name == "epoch") {
      out += format_field(pattern, name, spec, epoch, epoch);
    } else if (name == "batch" && batch) {
      out += format_field(pattern, name, spec, *batch, static_cast<double>(*batch));
    } else if (const auto value = logs.get(name)) {
      out += format_field(pattern, name, spec, std::nullopt, *value);
    } else {
      throw InvalidArgument(
          fmt::format("ModelCheckpoint: filepath \"{}\" uses {{{}}}, which is not in the logs (present: {}{})", pattern,
                      name, keys_of(logs), batch ? ", epoch, batch" : ", epoch"));
    }
    i = close;
  }
  return out;
}

// Checks a path pattern's syntax once, when the callback is made, so a typo fails before
// training instead of after the first epoch.
void check_checkpoint_pattern(const std::string& pattern) {
  TANDEM_REQUIRE(!pattern.empty(), InvalidArgument, "ModelCheckpoint: the filepath is empty");
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '{') {
      if (i + 1 < pattern.size() && pattern[i + 1] == '{') {
        ++i;
        continue;
      }
      const auto close = pattern.find('}', i);
      TANDEM_REQUIRE(close != std::string::npos && close > i + 1, InvalidArgument,
                     "ModelCheckpoint: filepath \"{}\" has an unclosed or empty field at {}", pattern, i);
      i = close;
    } else if (pattern[i] == '}') {
      TANDEM_REQUIRE(i + 1 < pattern.size() && pattern[i + 1] == '}', InvalidArgument,
                     "ModelCheckpoint: filepath \"{}\" has a lone '}}' at {} (write '}}}}' for a brace)", pattern, i);
      ++i;
    }
  }
}

}  // namespace

// ----- Callback, CallbackList -----

Model& Callback::model() const {
  TANDEM_REQUIRE(model_ != nullptr, FailedPrecondition,
                 "this callback has no model: callbacks are attached by fit(), evaluate() and predict()");
  return *model_;
}

bool Callback::is_chief() const { return model_ == nullptr || model_->distribute_strategy().should_checkpoint(); }

CallbackList::CallbackList(std::vector<CallbackPtr> callbacks, Model* model, const TrainingParams& params)
    : callbacks_(std::move(callbacks)) {
  for (std::size_t i = 0; i < callbacks_.size(); ++i) {
    TANDEM_REQUIRE(callbacks_[i] != nullptr, InvalidArgument, "callback {} of {} is null", i, callbacks_.size());
    callbacks_[i]->set_model(model);
    callbacks_[i]->set_params(params);
  }
}

void CallbackList::on_train_begin(Logs& logs) {
  for (auto& c : callbacks_) c->on_train_begin(logs);
}
void CallbackList::on_train_end(Logs& logs) {
  for (auto& c : callbacks_) c->on_train_end(logs);
}
void CallbackList::on_epoch_begin(int epoch, Logs& logs) {
  for (auto& c : callbacks_) c->on_epoch_begin(epoch, logs);
}
void CallbackList::on_epoch_end(int epoch, Logs& logs) {
  for (auto& c : callbacks_) c->on_epoch_end(epoch, logs);
}
void CallbackList::on_train_batch_begin(std::int64_t batch, Logs& logs) {
  for (auto& c : callbacks_) c->on_train_batch_begin(batch, logs);
}
void CallbackList::on_train_batch_end(std::int64_t batch, Logs& logs) {
  for (auto& c : callbacks_) c->on_train_batch_end(batch, logs);
}
void CallbackList::on_test_begin(Logs& logs) {
  for (auto& c : callbacks_) c->on_test_begin(logs);
}
void CallbackList::on_test_end(Logs& logs) {
  for (auto& c : callbacks_) c->on_test_end(logs);
}
void CallbackList::on_test_batch_begin(std::int64_t batch, Logs& logs) {
  for (auto& c : callbacks_) c->on_test_batch_begin(batch, logs);
}
void CallbackList::on_test_batch_end(std::int64_t batch, Logs& logs) {
  for (auto& c : callbacks_) c->on_test_batch_end(batch, logs);
}
void CallbackList::on_predict_begin(Logs& logs) {
  for (auto& c : callbacks_) c->on_predict_begin(logs);
}
void CallbackList::on_predict_end(Logs& logs) {
  for (auto& c : callbacks_) c->on_predict_end(logs);
}
void CallbackList::on_predict_batch_begin(std::int64_t batch, Logs& logs) {
  for (auto& c : callbacks_) c->on_predict_batch_begin(batch, logs);
}
void CallbackList::on_predict_batch_end(std::int64_t batch, Logs& logs) {
  for (auto& c : callbacks_) c->on_predict_batch_end(batch, logs);
}

// ----- History -----

const std::vector<double>& History::at(const std::string& name) const {
  if (const auto it = history.find(name); it != history.end()) return it->second;
  std::string names;
  for (const auto& [k, v] : history) names += fmt::format("{}{}", names.empty() ? "" : ", ", k);
  throw NotFound(fmt::format("History has no \"{}\" (recorded: {})", name, names.empty() ? "nothing yet" : names));
}

void History::on_train_begin(Logs& /*logs*/) {
  // Keras keeps the dict across fits; starting both afresh keeps epoch and values aligned when a
  // History is reused.
  epoch.clear();
  history.clear();
}

void History::on_epoch_end(int epoch_index, Logs& logs) {
  epoch.push_back(epoch_index);
  for (const auto& [k, v] : logs) history[k].push_back(v);
}

// ----- ModelCheckpoint -----

ModelCheckpoint::ModelCheckpoint(std::string filepath, ModelCheckpointOptions options)
    : filepath_(std::move(filepath)), options_(std::move(options)) {
  check_checkpoint_pattern(filepath_);
  TANDEM_REQUIRE(options_.save_freq >= 0, InvalidArgument,
                 "ModelCheckpoint \"{}\": save_freq {} must be 0 (every epoch) or a number of batches", filepath_,
                 options_.save_freq);
}

void ModelCheckpoint::on_train_begin(Logs& /*logs*/) {
  epoch_ = 0;
  batches_ = 0;
}

void ModelCheckpoint::on_epoch_begin(int epoch, Logs& /*logs*/) { epoch_ = epoch; }

void ModelCheckpoint::on_train_batch_end(std::int64_t batch, Logs& logs) {
  if (options_.save_freq == 0) return;
  // Counted across epochs, as Keras does: every save_freq-th batch of the whole run.
  if (++batches_ < options_.save_freq) return;
  batches_ = 0;
  // save() takes the batch through the logs, where Keras's path formatting looks for it too.
  Logs with_batch = logs;
  with_batch.set("batch", static_cast<double>(batch + 1));
  save(epoch_, with_batch);
}

void ModelCheckpoint::on_epoch_end(int epoch, Logs& logs) {
  if (options_.save_freq == 0) save(epoch, logs);
}

void ModelCheckpoint::save(int epoch, const Logs& logs) {
  const auto batch_value = logs.get("batch");
  const bool batch_save = options_.save_freq != 0 && batch_value.has_value();
  const std::optional<std::int64_t> batch =
      batch_save ? std::optional<std::int64_t>(static_cast<std::int64_t>(*batch_value)) : std::nullopt;
  Logs values = logs;
  if (batch_save) values.erase("batch");  // formatted as an integer field, not a log value
  const std::string path = format_checkpoint_path(filepath_, epoch + 1, batch, values);
  const bool maximize = maximizes(options_.monitor, options_.mode);
  const bool chief = model().distribute_strategy().should_checkpoint();

  if (options_.save_best_only) {
    const auto current = values.get(options_.monitor);
    if (!current) {
      warn_missing("ModelCheckpoint", options_.monitor, values, "can save the best model only with it; skipping");
      return;
    }
    // NaN never improves anything (every comparison with it is false).
    if (!is_improvement(*current, best_, maximize, 0.0) || std::isnan(*current)) {
      if (options_.verbose > 0 && chief) {
        std::cout << fmt::format("\nEpoch {}: {} did not improve from {}\n", epoch + 1, options_.monitor,
                                 best_string(best_, maximize))
                  << std::flush;
      }
      return;
    }
    if (options_.verbose > 0 && chief) {
      std::cout << fmt::format("\nEpoch {}: {} improved from {} to {:.5f}, saving model to {}\n", epoch + 1,
                               options_.monitor, best_string(best_, maximize), *current, path)
                << std::flush;
    }
    best_ = *current;
  } else if (options_.verbose > 0 && chief) {
    std::cout << fmt::format("\nEpoch {}: saving model to {}\n", epoch + 1, path) << std::flush;
  }
  // Only the chief writes a file; the others keep the same best value so they agree on what it
  // saved. A checkpoint directory (a sharded model) is written by every worker together.
  if (!chief && !detail::writes_directory(model(), path, !options_.save_weights_only)) return;

  const auto dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    TANDEM_REQUIRE(!ec, Unavailable, "ModelCheckpoint: cannot create the folder \"{}\" for \"{}\": {}", dir.string(),
                   path, ec.message());
  }
  if (options_.save_weights_only) {
    model().save_weights(path);
  } else {
    TrainingState state;
    state.epoch = batch_save ? epoch : epoch + 1;  // epochs completed
    state.step = batch_save ? *batch : 0;
    save_training_checkpoint(model(), path, state);
  }
}

// ----- EarlyStopping -----

EarlyStopping::EarlyStopping(EarlyStoppingOptions options) : options_(std::move(options)) {
  TANDEM_REQUIRE(options_.patience >= 0, InvalidArgument, "EarlyStopping: patience {} must not be negative",
                 options_.patience);
  TANDEM_REQUIRE(options_.start_from_epoch >= 0, InvalidArgument,
                 "EarlyStopping: start_from_epoch {} must not be negative", options_.start_from_epoch);
}

void EarlyStopping::on_train_begin(Logs& /*logs*/) {
  // Reset so one instance serves several fit() calls, as in Keras.
  wait_ = 0;
  stopped_epoch_ = 0;
  best_epoch_ = 0;
  best_.reset();
  best_weights_.clear();
}

void EarlyStopping::on_epoch_end(int epoch, Logs& logs) {
  const auto current = logs.get(options_.monitor);
  if (!current) {
    warn_missing("EarlyStopping", options_.monitor, logs, "this epoch does not count");
    return;
  }
  if (epoch < options_.start_from_epoch) return;  // still warming up
  const bool maximize = maximizes(options_.monitor, options_.mode);
  if (options_.restore_best_weights && best_weights_.empty()) {
    // Until something improves, the weights we started from are the best ones.
    best_weights_ = model().get_weights();
    best_epoch_ = epoch;
  }
  ++wait_;
  if (!std::isnan(*current) && is_improvement(*current, best_, maximize, options_.min_delta)) {
    best_ = *current;
    best_epoch_ = epoch;
    if (options_.restore_best_weights) best_weights_ = model().get_weights();
    // Patience restarts only once the value beats both the baseline and the previous best.
    if (!options_.baseline || is_improvement(*current, options_.baseline, maximize, options_.min_delta)) wait_ = 0;
    return;
  }
  if (wait_ >= options_.patience && epoch > 0) {
    stopped_epoch_ = epoch;
    model().set_stop_training(true);
  }
}

void EarlyStopping::on_train_end(Logs& /*logs*/) {
  if (stopped_epoch_ > 0 && options_.verbose > 0) {
    std::cout << fmt::format("Epoch {}: early stopping\n", stopped_epoch_ + 1) << std::flush;
  }
  if (options_.restore_best_weights && !best_weights_.empty()) {
    if (options_.verbose > 0) {
      std::cout << fmt::format("Restoring model weights from the end of the best epoch: {}.\n", best_epoch_ + 1)
                << std::flush;
    }
    model().set_weights(best_weights_);
  }
}

// ----- CSVLogger -----

struct CSVLogger::State {
  std::FILE* file = nullptr;
  bool write_header = true;
  std::vector<std::string> keys;  // fixed by the first epoch, as Keras's csv.DictWriter
  bool keys_set = false;

  ~State() { close(); }
  void close() {
    if (file != nullptr) std::fclose(file);
    file = nullptr;
  }
};

CSVLogger::CSVLogger(std::string filename, CsvLoggerOptions options)
    : filename_(std::move(filename)), options_(options), state_(std::make_unique<State>()) {
  TANDEM_REQUIRE(!filename_.empty(), InvalidArgument, "CSVLogger: the filename is empty");
  TANDEM_REQUIRE(options_.separator != '"' && options_.separator != '\n' && options_.separator != '\r', InvalidArgument,
                 "CSVLogger \"{}\": the separator cannot be a quote or a line break", filename_);
}

CSVLogger::~CSVLogger() = default;

void CSVLogger::on_train_begin(Logs& /*logs*/) {
  state_->close();
  if (!is_chief()) return;
  state_->keys.clear();
  state_->keys_set = false;
  state_->write_header = true;
  if (options_.append) {
    // A file with anything in it already has its header (Keras checks the first line).
    if (std::FILE* existing = std::fopen(filename_.c_str(), "r")) {
      state_->write_header = std::fgetc(existing) == EOF;
      std::fclose(existing);
    }
  }
  state_->file = std::fopen(filename_.c_str(), options_.append ? "a" : "w");
  TANDEM_REQUIRE(state_->file != nullptr, Unavailable, "CSVLogger: cannot open \"{}\" for writing: {}", filename_,
                 std::system_category().message(errno));
}

void CSVLogger::on_epoch_end(int epoch, Logs& logs) {
  if (!is_chief()) return;
  if (state_->file == nullptr) {
    Logs none;
    on_train_begin(none);  // used without fit(): open as fit would have
  }
  auto& s = *state_;
  if (!s.keys_set) {
    for (const auto& [k, v] : logs) s.keys.push_back(k);
    std::sort(s.keys.begin(), s.keys.end());
    // With validation_freq > 1 the first epoch has no val_ values; make room for them anyway.
    const bool has_val = std::any_of(s.keys.begin(), s.keys.end(), [](const auto& k) { return k.starts_with("val_"); });
    if (!has_val) {
      const auto n = s.keys.size();
      for (std::size_t i = 0; i < n; ++i) s.keys.push_back("val_" + s.keys[i]);
    }
    s.keys_set = true;
  }
  const auto field = [&](const std::string& text) {
    // Quoted only when needed, as Python's csv module does.
    if (text.find_first_of(std::string{options_.separator, '"', '\n', '\r'}) == std::string::npos) return text;
    std::string quoted = "\"";
    for (const char c : text) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
    return quoted + "\"";
  };
  std::string text;
  if (s.write_header) {
    text += "epoch";
    for (const auto& k : s.keys) text += options_.separator + field(k);
    text += '\n';
    s.write_header = false;
  }
  text += std::to_string(epoch);
  for (const auto& k : s.keys) {
    const auto v = logs.get(k);
    text += options_.separator + (v ? python_float(*v) : std::string("NA"));
  }
  text += '\n';
  // One flush per row: a crash loses at most the epoch being written.
  const bool ok = std::fwrite(text.data(), 1, text.size(), s.file) == text.size() && std::fflush(s.file) == 0;
  TANDEM_REQUIRE(ok, Unavailable, "CSVLogger: cannot write to \"{}\": {}", filename_,
                 std::system_category().message(errno));
}

void CSVLogger::on_train_end(Logs& /*logs*/) { state_->close(); }

// ----- BackupAndRestore -----

namespace {
// All of a model's training state as host tensors, in one fixed order on every worker: unique
// weights, optimizer slots, then iterations and learning rate.
std::vector<VariablePtr> state_variables(Model& model) {
  std::vector<VariablePtr> out;
  for (const auto& w : model.weights()) {
    if (std::find(out.begin(), out.end(), w) == out.end()) out.push_back(w);
  }
  for (const auto& [name, slot] : model.optimizer().slots()) out.push_back(slot);
  return out;
}
}  // namespace

BackupAndRestore::BackupAndRestore(std::string backup_dir, BackupAndRestoreOptions options)
    : backup_dir_(std::move(backup_dir)), options_(options) {
  TANDEM_REQUIRE(!backup_dir_.empty(), InvalidArgument, "BackupAndRestore: backup_dir is empty");
  TANDEM_REQUIRE(options_.save_freq >= 0, InvalidArgument,
                 "BackupAndRestore \"{}\": save_freq is {}; expected 0 (every epoch) or a number of batches",
                 backup_dir_, options_.save_freq);
}

std::string BackupAndRestore::latest_path() const {
  return (std::filesystem::path(backup_dir_) / "backup.safetensors").string();
}
std::string BackupAndRestore::previous_path() const {
  return (std::filesystem::path(backup_dir_) / "backup.previous.safetensors").string();
}

void BackupAndRestore::on_train_begin(Logs& /*logs*/) {
  Model& m = model();
  auto& strategy = m.distribute_strategy();
  batches_ = 0;
  restored_from_.clear();
  if (strategy.num_workers() > 1 && detail::shards_state(m)) {
    // Sharded state cannot go through the chief: every worker reads its own shards of the backup
    // directory (on a file system they all see), agreeing on the outcome of each attempt.
    for (const auto& path : {latest_path(), previous_path()}) {
      if (!std::filesystem::exists(path)) continue;
      try {
        const TrainingState state = detail::load_training_checkpoint(m, path, /*every_worker_calls=*/true);
        m.state()->resume = detail::ModelState::ResumePoint{.epoch = state.epoch, .step = state.step};
        batches_ = m.optimizer().iterations();
        restored_from_ = path;
        return;
      } catch (const DataLoss& e) {
        logging::warn("BackupAndRestore: ignoring the backup \"{}\": {}", path, e.what());
      }
    }
    return;
  }
  // [found, epochs done, step, iterations] decided by the chief, then told to everyone.
  std::vector<Tensor> header{Tensor::zeros({4}, DType::kI64)};
  if (is_chief()) {
    for (const auto& path : {latest_path(), previous_path()}) {
      if (!std::filesystem::exists(path)) continue;
      try {
        // Checks everything first; a backup directory is read by the chief alone and broadcast.
        const TrainingState state = detail::load_training_checkpoint(m, path, /*every_worker_calls=*/false);
        auto* h = header[0].data<std::int64_t>();
        h[0] = 1;
        h[1] = state.epoch;
        h[2] = state.step;
        h[3] = m.optimizer().iterations();
        restored_from_ = path;
        break;
      } catch (const DataLoss& e) {
        // A backup cut short by the crash it is meant to survive: say so, use the one before.
        // (A backup of another model is the user's mistake: load_training_checkpoint's
        // InvalidArgument goes up, rather than a silent fresh start.)
        logging::warn("BackupAndRestore: ignoring the backup \"{}\": {}", path, e.what());
      }
    }
  }
  strategy.broadcast_from_chief(header);
  const auto* h = header[0].data<std::int64_t>();
  if (h[0] == 0) return;  // nothing to resume: a fresh run
  if (strategy.num_workers() > 1) {
    // The chief's restored state, to every worker (they may not see the chief's files).
    auto variables = state_variables(m);
    std::vector<Tensor> values;
    for (const auto& v : variables) values.push_back(v->read_value().to(devices::default_cpu_device()).clone());
    values.push_back(Tensor::scalar<double>(m.optimizer().learning_rate()));
    strategy.broadcast_from_chief(values);
    if (!is_chief()) {
      for (std::size_t i = 0; i < variables.size(); ++i) variables[i]->assign(values[i]);
      m.optimizer().set_iterations(h[3]);
      // A schedule is the same on every worker (compiled from the same code) and follows iterations.
      if (!m.optimizer().learning_rate_config().is_schedule())
        m.optimizer().set_learning_rate(values.back().item<double>());
    }
  }
  m.state()->resume = detail::ModelState::ResumePoint{.epoch = static_cast<int>(h[1]), .step = h[2]};
  batches_ = h[3];
}

void BackupAndRestore::on_epoch_begin(int epoch, Logs& /*logs*/) { epoch_ = epoch; }

void BackupAndRestore::on_train_batch_end(std::int64_t batch, Logs& /*logs*/) {
  ++batches_;
  if (options_.save_freq > 0 && batches_ % options_.save_freq == 0) backup(epoch_, batch + 1);
}

void BackupAndRestore::on_epoch_end(int epoch, Logs& /*logs*/) { backup(epoch + 1, 0); }

void BackupAndRestore::on_train_end(Logs& /*logs*/) {
  if (!options_.delete_checkpoint || !is_chief()) return;
  std::error_code ignored;
  std::filesystem::remove_all(latest_path(), ignored);  // a file, or a checkpoint directory
  std::filesystem::remove_all(previous_path(), ignored);
}

void BackupAndRestore::backup(int epochs_done, std::int64_t step) {
  // A file is the chief's to write; a checkpoint directory (sharded state) every worker's.
  const bool every_worker = detail::writes_directory(model(), latest_path(), /*with_optimizer=*/true);
  if (!is_chief()) {
    if (every_worker) save_training_checkpoint(model(), latest_path(), {.epoch = epochs_done, .step = step});
    return;
  }
  std::error_code error;
  std::filesystem::create_directories(backup_dir_, error);
  TANDEM_REQUIRE(!error, Unavailable, "BackupAndRestore: cannot create \"{}\": {}", backup_dir_, error.message());
  // The newest backup becomes the previous one (a rename: atomic), then the new one is written
  // (atomically too). A crash at any point leaves at least one complete backup. A directory is not
  // renamed over another: the previous one goes first (the newest is still whole meanwhile).
  if (std::filesystem::is_directory(previous_path())) {
    std::filesystem::remove_all(previous_path(), error);
    TANDEM_REQUIRE(!error, Unavailable, "BackupAndRestore: cannot remove \"{}\": {}", previous_path(),
                   error.message());
  }
  if (std::filesystem::exists(latest_path())) {
    std::filesystem::rename(latest_path(), previous_path(), error);
    TANDEM_REQUIRE(!error, Unavailable, "BackupAndRestore: cannot rename \"{}\": {}", latest_path(), error.message());
  }
  save_training_checkpoint(model(), latest_path(), {.epoch = epochs_done, .step = step});
}

// ----- LearningRateScheduler -----

LearningRateScheduler::LearningRateScheduler(std::function<double(int, double)> schedule, int verbose)
    : schedule_(std::move(schedule)), verbose_(verbose) {
  TANDEM_REQUIRE(static_cast<bool>(schedule_), InvalidArgument, "LearningRateScheduler: the schedule is empty");
}

void LearningRateScheduler::on_train_begin(Logs& /*logs*/) {
  require_settable_learning_rate("LearningRateScheduler", model().optimizer());
}

void LearningRateScheduler::on_epoch_begin(int epoch, Logs& /*logs*/) {
  Optimizer& optimizer = model().optimizer();
  const double learning_rate = schedule_(epoch, optimizer.learning_rate());
  TANDEM_REQUIRE(std::isfinite(learning_rate) && learning_rate >= 0, InvalidArgument,
                 "LearningRateScheduler: the schedule returned {} for epoch {}; a learning rate must be finite and not "
                 "negative",
                 learning_rate, epoch);
  optimizer.set_learning_rate(learning_rate);
  if (verbose_ > 0) {
    std::cout << fmt::format("\nEpoch {}: LearningRateScheduler setting learning rate to {}.\n", epoch + 1,
                             python_float(learning_rate))
              << std::flush;
  }
}

void LearningRateScheduler::on_epoch_end(int /*epoch*/, Logs& logs) {
  logs.set("learning_rate", model().optimizer().learning_rate());
}

// ----- ReduceLROnPlateau -----

ReduceLROnPlateau::ReduceLROnPlateau(ReduceLROnPlateauOptions options) : options_(std::move(options)) {
  TANDEM_REQUIRE(options_.factor > 0.0 && options_.factor < 1.0, InvalidArgument,
                 "ReduceLROnPlateau: factor {} must be in (0, 1) (the new rate is the old one times the factor)",
                 options_.factor);
  TANDEM_REQUIRE(options_.patience >= 0 && options_.cooldown >= 0, InvalidArgument,
                 "ReduceLROnPlateau: patience ({}) and cooldown ({}) must not be negative", options_.patience,
                 options_.cooldown);
  TANDEM_REQUIRE(options_.min_lr >= 0.0, InvalidArgument, "ReduceLROnPlateau: min_lr {} must not be negative",
                 options_.min_lr);
}

void ReduceLROnPlateau::on_train_begin(Logs& /*logs*/) {
  require_settable_learning_rate("ReduceLROnPlateau", model().optimizer());
  best_.reset();
  wait_ = 0;
  cooldown_counter_ = 0;
}

void ReduceLROnPlateau::on_epoch_end(int epoch, Logs& logs) {
  Optimizer& optimizer = model().optimizer();
  // The rate this epoch trained with, before any change below.
  logs.set("learning_rate", optimizer.learning_rate());
  const auto current = logs.get(options_.monitor);
  if (!current) {
    warn_missing("ReduceLROnPlateau", options_.monitor, logs, "the learning rate stays as it is");
    return;
  }
  if (cooldown_counter_ > 0) {
    --cooldown_counter_;
    wait_ = 0;
  }
  const bool maximize = maximizes(options_.monitor, options_.mode);
  if (!std::isnan(*current) && is_improvement(*current, best_, maximize, options_.min_delta)) {
    best_ = *current;
    wait_ = 0;
    return;
  }
  if (cooldown_counter_ > 0) return;
  if (++wait_ < options_.patience) return;
  const double old_lr = optimizer.learning_rate();
  if (old_lr <= options_.min_lr) return;
  const double new_lr = std::max(old_lr * options_.factor, options_.min_lr);
  optimizer.set_learning_rate(new_lr);
  if (options_.verbose > 0) {
    std::cout << fmt::format("\nEpoch {}: ReduceLROnPlateau reducing learning rate to {}.\n", epoch + 1,
                             python_float(new_lr))
              << std::flush;
  }
  cooldown_counter_ = options_.cooldown;
  wait_ = 0;
}

// ----- TerminateOnNaN -----

void TerminateOnNaN::on_train_batch_end(std::int64_t batch, Logs& logs) {
  const auto loss = logs.get("loss");
  if (!loss || std::isfinite(*loss)) return;
  std::cout << fmt::format("Batch {}: Invalid loss, terminating training\n", batch) << std::flush;
  model().set_stop_training(true);
}

// ----- LambdaCallback -----

LambdaCallback::LambdaCallback(LambdaCallbackOptions functions) : functions_(std::move(functions)) {}

void LambdaCallback::on_epoch_begin(int epoch, Logs& logs) {
  if (functions_.on_epoch_begin) functions_.on_epoch_begin(epoch, logs);
}
void LambdaCallback::on_epoch_end(int epoch, Logs& logs) {
  if (functions_.on_epoch_end) functions_.on_epoch_end(epoch, logs);
}
void LambdaCallback::on_train_batch_begin(std::int64_t batch, Logs& logs) {
  if (functions_.on_train_batch_begin) functions_.on_train_batch_begin(batch, logs);
}
void LambdaCallback::on_train_batch_end(std::int64_t batch, Logs& logs) {
  if (functions_.on_train_batch_end) functions_.on_train_batch_end(batch, logs);
}
void LambdaCallback::on_train_begin(Logs& logs) {
  if (functions_.on_train_begin) functions_.on_train_begin(logs);
}
void LambdaCallback::on_train_end(Logs& logs) {
  if (functions_.on_train_end) functions_.on_train_end(logs);
}

}  // namespace tandem::keras
