// tandem/keras_like/callbacks.h — hooks into fit/evaluate/predict, with Keras's callbacks.
//
//   model.fit(train, {.epochs = 20, .callbacks = {std::make_shared<keras::EarlyStopping>(
//                                                     keras::EarlyStoppingOptions{.patience = 3})}});
//
// fit() adds a History (always) and a ProgbarLogger (unless verbose = 0) to the callbacks it is
// given, like Keras. Callbacks run on the thread that called fit(), between steps; `logs` hold
// the metric values so far (batch hooks: running means over the epoch; on_epoch_end: the epoch's
// values, then val_* ones). A callback may add entries to the epoch's logs (the learning rate).
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "tandem/graph/tensor.h"
#include "tandem/keras_like/logs.h"

namespace tandem::keras {

class Model;

struct TrainingParams {
  int epochs = 1;
  std::int64_t steps = -1;  // per epoch; -1 when not known in advance
  int verbose = 1;
};

class Callback {
 public:
  virtual ~Callback() = default;

  // Set by fit/evaluate/predict before the first hook. model() throws FailedPrecondition when
  // the callback is used outside them.
  void set_model(Model* model) { model_ = model; }
  Model& model() const;
  void set_params(const TrainingParams& params) { params_ = params; }
  const TrainingParams& params() const { return params_; }

  virtual void on_train_begin(Logs& /*logs*/) {}
  virtual void on_train_end(Logs& /*logs*/) {}
  virtual void on_epoch_begin(int /*epoch*/, Logs& /*logs*/) {}
  virtual void on_epoch_end(int /*epoch*/, Logs& /*logs*/) {}
  virtual void on_train_batch_begin(std::int64_t /*batch*/, Logs& /*logs*/) {}
  virtual void on_train_batch_end(std::int64_t /*batch*/, Logs& /*logs*/) {}
  virtual void on_test_begin(Logs& /*logs*/) {}
  virtual void on_test_end(Logs& /*logs*/) {}
  virtual void on_test_batch_begin(std::int64_t /*batch*/, Logs& /*logs*/) {}
  virtual void on_test_batch_end(std::int64_t /*batch*/, Logs& /*logs*/) {}
  virtual void on_predict_begin(Logs& /*logs*/) {}
  virtual void on_predict_end(Logs& /*logs*/) {}
  virtual void on_predict_batch_begin(std::int64_t /*batch*/, Logs& /*logs*/) {}
  virtual void on_predict_batch_end(std::int64_t /*batch*/, Logs& /*logs*/) {}

 protected:
  // Whether this process writes files and logs: the chief of a multi-worker job (or the only
  // worker; also true when the callback is used outside fit).
  bool is_chief() const;

 private:
  Model* model_ = nullptr;
  TrainingParams params_;
};

using CallbackPtr = std::shared_ptr<Callback>;

// Calls every callback's hook in order.
class CallbackList {
 public:
  CallbackList(std::vector<CallbackPtr> callbacks, Model* model, const TrainingParams& params);
  void on_train_begin(Logs& logs);
  void on_train_end(Logs& logs);
  void on_epoch_begin(int epoch, Logs& logs);
  void on_epoch_end(int epoch, Logs& logs);
  void on_train_batch_begin(std::int64_t batch, Logs& logs);
  void on_train_batch_end(std::int64_t batch, Logs& logs);
  void on_test_begin(Logs& logs);
  void on_test_end(Logs& logs);
  void on_test_batch_begin(std::int64_t batch, Logs& logs);
  void on_test_batch_end(std::int64_t batch, Logs& logs);
  void on_predict_begin(Logs& logs);
  void on_predict_end(Logs& logs);
  void on_predict_batch_begin(std::int64_t batch, Logs& logs);
  void on_predict_batch_end(std::int64_t batch, Logs& logs);
  const std::vector<CallbackPtr>& callbacks() const { return callbacks_; }

 private:
  std::vector<CallbackPtr> callbacks_;
};

// Per-epoch logs by name; what fit() returns.
class History : public Callback {
 public:
  std::vector<int> epoch;
  std::map<std::string, std::vector<double>> history;

  // history.at(name) with a NotFound listing the names recorded.
  const std::vector<double>& at(const std::string& name) const;
  void on_train_begin(Logs& logs) override;
  void on_epoch_end(int epoch, Logs& logs) override;
};

struct ProgbarOptions {
  std::ostream* out = nullptr;  // default: std::cout
  // Redraw one line in place (a terminal) or print one line per epoch (a file, a pipe).
  // Default: in place when `out` is std::cout and standard output is a terminal.
  std::optional<bool> interactive;
};
// Keras's progress bar:
//   Epoch 3/10
//   469/469 [==============================] - 2s 4ms/step - loss: 0.5000 - accuracy: 0.8200 - val_loss: ...
// While an epoch runs on a terminal the bar is redrawn in place with an ETA; otherwise one line is
// printed when the epoch ends. verbose 2 prints "469/469 - 2s - 4ms/step - loss: ..." per epoch.
class ProgbarLogger : public Callback {
 public:
  explicit ProgbarLogger(ProgbarOptions options = {});
  ~ProgbarLogger() override;
  void on_train_begin(Logs& logs) override;
  void on_epoch_begin(int epoch, Logs& logs) override;
  void on_train_batch_end(std::int64_t batch, Logs& logs) override;
  void on_epoch_end(int epoch, Logs& logs) override;
  void on_test_begin(Logs& logs) override;
  void on_test_batch_end(std::int64_t batch, Logs& logs) override;
  void on_test_end(Logs& logs) override;
  void on_predict_begin(Logs& logs) override;
  void on_predict_batch_end(std::int64_t batch, Logs& logs) override;
  void on_predict_end(Logs& logs) override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

enum class MonitorMode { kAuto, kMin, kMax };  // kAuto: max for accuracy-like names, else min

struct ModelCheckpointOptions {
  std::string monitor = "val_loss";
  int verbose = 0;
  bool save_best_only = false;
  MonitorMode mode = MonitorMode::kAuto;
  bool save_weights_only = true;  // false: a training checkpoint (weights, optimizer, epoch)
  std::int64_t save_freq = 0;     // 0: every epoch; N: every N training batches
};
// Saves the weights after every epoch (or the best ones). The path may hold Keras-style fields:
// "ckpt/epoch{epoch:02d}-{val_loss:.2f}.weights.safetensors". Only the chief writes, except a
// checkpoint directory (a sharded model, or a path ending in '/': saving.h), which every worker
// writes together.
class ModelCheckpoint : public Callback {
 public:
  explicit ModelCheckpoint(std::string filepath, ModelCheckpointOptions options = {});
  void on_train_begin(Logs& logs) override;
  void on_epoch_begin(int epoch, Logs& logs) override;
  void on_train_batch_end(std::int64_t batch, Logs& logs) override;
  void on_epoch_end(int epoch, Logs& logs) override;
  std::optional<double> best() const { return best_; }

 private:
  void save(int epoch, const Logs& logs);
  std::string filepath_;
  ModelCheckpointOptions options_;
  std::optional<double> best_;
  std::int64_t batches_ = 0;
  int epoch_ = 0;
};

struct EarlyStoppingOptions {
  std::string monitor = "val_loss";
  double min_delta = 0.0;
  int patience = 0;
  int verbose = 0;
  MonitorMode mode = MonitorMode::kAuto;
  std::optional<double> baseline;
  bool restore_best_weights = false;
  int start_from_epoch = 0;
};
// Stops training when the monitored value has not improved by min_delta for `patience` epochs.
class EarlyStopping : public Callback {
 public:
  explicit EarlyStopping(EarlyStoppingOptions options = {});
  void on_train_begin(Logs& logs) override;
  void on_epoch_end(int epoch, Logs& logs) override;
  void on_train_end(Logs& logs) override;
  // The epoch training stopped at (0 when it did not stop early), as Keras's stopped_epoch.
  int stopped_epoch() const { return stopped_epoch_; }
  int best_epoch() const { return best_epoch_; }

 private:
  EarlyStoppingOptions options_;
  int wait_ = 0;
  int stopped_epoch_ = 0;
  int best_epoch_ = 0;
  std::optional<double> best_;
  std::vector<Tensor> best_weights_;
};

struct CsvLoggerOptions {
  char separator = ',';
  bool append = false;
};
// One CSV row per epoch: epoch, then each log value (header from the first epoch's keys). Only
// the chief writes.
class CSVLogger : public Callback {
 public:
  explicit CSVLogger(std::string filename, CsvLoggerOptions options = {});
  ~CSVLogger() override;
  void on_train_begin(Logs& logs) override;
  void on_epoch_end(int epoch, Logs& logs) override;
  void on_train_end(Logs& logs) override;

 private:
  struct State;
  std::string filename_;
  CsvLoggerOptions options_;
  std::unique_ptr<State> state_;
};

struct TensorBoardOptions {
  // "epoch": scalars once per epoch; "batch" or N: also batch_<metric> every N training batches
  // (counted over the whole fit, as Keras's global batch), at that batch number as the step.
  std::variant<std::string, std::int64_t> update_freq = std::string("epoch");
  int histogram_freq = 0;  // N > 0: a histogram of every weight every N epochs (0, N, 2N, ...)
  bool write_graph = true;
  bool write_steps_per_second = false;  // epoch_steps_per_second (and batch_ with update_freq N)
};
// Logs for TensorBoard (keras.callbacks.TensorBoard), in Keras's layout: log_dir/train and
// log_dir/validation each get an event file (events.out.tfevents.<secs>.<host>.<pid>.<n>.v2) per
// fit. At every epoch end, train/ gets epoch_<name> for each log value without the val_ prefix
// (epoch_loss, epoch_accuracy), epoch_learning_rate, and epoch_steps_per_second when asked;
// validation/ gets epoch_<name> for each val_<name>; the step is the 0-based epoch. After each
// validation pass, validation/ gets evaluation_<name>_vs_iterations at the optimizer's
// iterations. Histograms are tagged "<weight path>/histogram" ("dense/kernel/histogram"); the
// graph is the model's layers (op: the layer's class), written once at the first batch. Files
// are flushed at every epoch end, so a running TensorBoard shows progress.
//
// Bad options are InvalidArgument from the constructor; a log_dir that cannot be created or
// written is Unavailable naming the path, from on_train_begin (before the first step). Only the
// chief writes; the other workers still read the weights with it when histograms are due (a
// sharded weight is gathered by all of them).
class TensorBoard : public Callback {
 public:
  explicit TensorBoard(std::string log_dir = "logs", TensorBoardOptions options = {});
  ~TensorBoard() override;
  void on_train_begin(Logs& logs) override;
  void on_train_end(Logs& logs) override;
  void on_epoch_begin(int epoch, Logs& logs) override;
  void on_epoch_end(int epoch, Logs& logs) override;
  void on_train_batch_begin(std::int64_t batch, Logs& logs) override;
  void on_train_batch_end(std::int64_t batch, Logs& logs) override;
  void on_test_end(Logs& logs) override;

  const std::string& log_dir() const { return log_dir_; }
  // The event files of the last fit ("" for one not opened).
  std::string train_file() const;
  std::string validation_file() const;

 private:
  struct State;
  std::string log_dir_;
  TensorBoardOptions options_;
  std::int64_t update_every_ = 0;  // batches between batch_ scalars; 0: per epoch only
  std::unique_ptr<State> state_;
};

struct BackupAndRestoreOptions {
  // Keras's save_freq: 0 ("epoch") backs up at the end of every epoch; N backs up every N
  // training batches (counted over the whole run) as well.
  std::int64_t save_freq = 0;
  // Delete the backups when fit ends normally (a run that fails or is killed keeps them).
  bool delete_checkpoint = true;
};
// Fault tolerance (keras.callbacks.BackupAndRestore): backs training up into `backup_dir`, and
// when fit starts with a backup there — the previous run was interrupted — resumes from it:
// weights, optimizer slots and step count, learning rate, epoch, and the position in the data
// (the epoch's shuffle and the batches already trained; Dropout's randomness follows the step
// count), so that the finished run equals one that was never interrupted.
//
// Two generations are kept (backup.safetensors and backup.previous.safetensors), each written
// atomically with a checksum: a backup that is truncated or corrupt is reported and the previous
// one is used. Under MultiWorkerMirroredStrategy only the chief writes and reads backups; on
// restore it broadcasts the state to the other workers, so they need no shared file system.
// Every worker must pass the callback (restoring is a collective). A model whose state is sharded
// (ZeRO) backs up into checkpoint directories of the same names (sharded_checkpoint.h), which
// every worker writes together and, under several workers, reads its own shards of: those need a
// file system every worker sees, and load on any number of replicas or workers.
class BackupAndRestore : public Callback {
 public:
  explicit BackupAndRestore(std::string backup_dir, BackupAndRestoreOptions options = {});
  void on_train_begin(Logs& logs) override;
  void on_epoch_begin(int epoch, Logs& logs) override;
  void on_train_batch_end(std::int64_t batch, Logs& logs) override;
  void on_epoch_end(int epoch, Logs& logs) override;
  void on_train_end(Logs& logs) override;

  // The files it writes.
  std::string latest_path() const;
  std::string previous_path() const;
  // What the last on_train_begin restored from ("" when it started afresh).
  const std::string& restored_from() const { return restored_from_; }

 private:
  void backup(int epochs_done, std::int64_t step);
  std::string backup_dir_;
  BackupAndRestoreOptions options_;
  std::string restored_from_;
  std::int64_t batches_ = 0;
  int epoch_ = 0;
};

// Sets the learning rate at the start of each epoch: schedule(epoch, current_lr) -> new lr.
// An optimizer with a learning-rate schedule (schedules.h) cannot take it: fit() fails before the
// first step with FailedPrecondition (Keras raises TypeError at the first epoch). Same for
// ReduceLROnPlateau.
class LearningRateScheduler : public Callback {
 public:
  explicit LearningRateScheduler(std::function<double(int epoch, double learning_rate)> schedule, int verbose = 0);
  void on_train_begin(Logs& logs) override;
  void on_epoch_begin(int epoch, Logs& logs) override;
  void on_epoch_end(int epoch, Logs& logs) override;  // adds "learning_rate" to the logs

 private:
  std::function<double(int, double)> schedule_;
  int verbose_;
};

struct ReduceLROnPlateauOptions {
  std::string monitor = "val_loss";
  double factor = 0.1;
  int patience = 10;
  int verbose = 0;
  MonitorMode mode = MonitorMode::kAuto;
  double min_delta = 1e-4;
  int cooldown = 0;
  double min_lr = 0.0;
};
class ReduceLROnPlateau : public Callback {
 public:
  explicit ReduceLROnPlateau(ReduceLROnPlateauOptions options = {});
  void on_train_begin(Logs& logs) override;
  void on_epoch_end(int epoch, Logs& logs) override;

 private:
  ReduceLROnPlateauOptions options_;
  std::optional<double> best_;
  int wait_ = 0;
  int cooldown_counter_ = 0;
};

// Stops training as soon as a batch's loss is NaN or infinite.
class TerminateOnNaN : public Callback {
 public:
  void on_train_batch_end(std::int64_t batch, Logs& logs) override;
};

struct LambdaCallbackOptions {
  std::function<void(int, Logs&)> on_epoch_begin, on_epoch_end;
  std::function<void(std::int64_t, Logs&)> on_train_batch_begin, on_train_batch_end;
  std::function<void(Logs&)> on_train_begin, on_train_end;
};
class LambdaCallback : public Callback {
 public:
  explicit LambdaCallback(LambdaCallbackOptions functions);
  void on_epoch_begin(int epoch, Logs& logs) override;
  void on_epoch_end(int epoch, Logs& logs) override;
  void on_train_batch_begin(std::int64_t batch, Logs& logs) override;
  void on_train_batch_end(std::int64_t batch, Logs& logs) override;
  void on_train_begin(Logs& logs) override;
  void on_train_end(Logs& logs) override;

 private:
  LambdaCallbackOptions functions_;
};

}  // namespace tandem::keras
