// tandem/strategy/strategy.h — where replicas run and how they agree (tf.distribute).
//
// A Strategy owns a set of replica devices. Under `auto scope = strategy.scope();`, variables
// (Keras weights, optimizer slots, metric state) are created through it, one copy per replica.
// Changing one line — the strategy — moves a model from one device to many:
//
//   tandem::OneDeviceStrategy strategy("CPU:0");       // later: MirroredStrategy, MultiWorker...
//   { auto scope = strategy.scope(); model = keras::Sequential({...}); model.compile(...); }
//   model.fit(dataset, {.epochs = 10});
//
// With no scope active, get_strategy() is the default strategy: one replica on the default device.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/devices/device.h"
#include "tandem/strategy/variable.h"

namespace tandem::strategy {

enum class ReduceOp { kSum, kMean };

class Strategy;

// What a function run by Strategy::run sees: which replica it is, and collective operations
// across the replicas in sync.
class ReplicaContext {
 public:
  ReplicaContext(Strategy& strategy, int replica_id) : strategy_(strategy), replica_id_(replica_id) {}
  Strategy& strategy() const { return strategy_; }
  int replica_id_in_sync_group() const { return replica_id_; }
  int num_replicas_in_sync() const;
  devices::Device& device() const;
  // Combines `value` across the replicas in sync (each replica calls it; it blocks until all
  // have). With one replica it returns the value.
  Tensor all_reduce(ReduceOp op, const Tensor& value);

 private:
  Strategy& strategy_;
  int replica_id_;
};

class Strategy {
 public:
  virtual ~Strategy();
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  // Makes this the current strategy of the calling thread until the guard ends. Entering the
  // scope of a second strategy inside another's raises FailedPrecondition naming both (TF does
  // the same); re-entering the same strategy nests.
  class [[nodiscard]] Scope {
   public:
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    friend class Strategy;
    explicit Scope(Strategy& strategy);
  };
  Scope scope();

  // "OneDeviceStrategy#1 (CPU:0)": how errors name it.
  const std::string& name() const { return name_; }
  // Replicas taking part in each step, across all workers.
  virtual int num_replicas_in_sync() const { return static_cast<int>(devices_.size()); }
  // This worker's replica devices, in replica order.
  const std::vector<devices::Device*>& replica_devices() const { return devices_; }

  // A variable with one copy per replica device, each initialised to options.initial_value.
  std::shared_ptr<Variable> create_variable(VariableOptions options);

  // Calls fn once per local replica with its ReplicaContext (in parallel for several replicas)
  // and returns when all have returned; the first exception is rethrown.
  virtual void run(const std::function<void(ReplicaContext&)>& fn);
  // Combines one tensor per local replica (host result).
  virtual Tensor reduce(ReduceOp op, const std::vector<Tensor>& per_replica) const;
  // Whether this worker writes checkpoints and logs (the chief; always true on one worker).
  virtual bool should_checkpoint() const { return true; }

 protected:
  Strategy(std::string kind, std::vector<devices::Device*> devices);

 private:
  std::string name_;
  std::vector<devices::Device*> devices_;
};

// The strategy of the innermost active scope on this thread, else the default strategy.
Strategy& get_strategy();
// True when a strategy scope is active on this thread.
bool has_strategy();
// One replica on the default device (CPU:0), used when no scope is active.
Strategy& default_strategy();

// One replica on one device.
class OneDeviceStrategy final : public Strategy {
 public:
  // device: any accepted device name ("CPU:0", "/device:GPU:0"); InvalidArgument / NotFound as
  // devices::get_device raises.
  explicit OneDeviceStrategy(std::string_view device);
};

}  // namespace tandem::strategy

namespace tandem {
using strategy::OneDeviceStrategy;
using strategy::Strategy;
}  // namespace tandem
