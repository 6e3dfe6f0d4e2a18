// tandem/strategy/variable.h — variables created through a strategy.
//
// A Variable holds one copy of its value per replica device of the strategy that created it
// (one for OneDeviceStrategy; one per device for MirroredStrategy). Keras layers create their
// weights, optimizers their slots and metrics their state through Strategy::create_variable, so
// a model written once works under every strategy.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/graph/tensor.h"

namespace tandem::strategy {

class Strategy;
namespace tensor_parallel {
class Group;
}

// How updates from several replicas combine (TF's tf.VariableAggregation).
enum class VariableAggregation { kNone, kSum, kMean, kOnlyFirstReplica };
// When copies are kept equal (TF's tf.VariableSynchronization): on write (mirrored weights,
// updated identically everywhere) or on read (metric state: each replica accumulates locally,
// reading combines them with the aggregation).
enum class VariableSynchronization { kAuto, kOnWrite, kOnRead };

// How a sharded variable splits its value over the replicas in sync (ZeRO's partitioning, as a
// strategy with DistributionOptions::zero makes optimizer slots, gradients and parameters): the
// value flattened in row-major order and padded with zeros to num_shards x shard_elements
// elements; shard s holds elements [s x shard_elements, (s + 1) x shard_elements). Shard s is
// the replica with global index s (worker rank x local replicas + local replica); each replica's
// copy of the variable is its shard, a 1-D tensor of shard_elements. Sizes that do not divide
// are padded, never refused.
struct ShardSpec {
  int num_shards = 1;
  std::int64_t shard_elements = 0;
  Shape global_shape;  // the variable's shape as the model sees it

  static ShardSpec even(const Shape& global_shape, int num_shards);
  // The elements of the flattened value that shard s holds, padding excluded: [begin, end).
  std::int64_t begin(int shard) const;
  std::int64_t end(int shard) const;
};

// How tensor parallelism splits a variable (keras::distribution::ModelParallel's layouts,
// Megatron-LM's column- and row-parallel weights): the value cut along dimension `dim` into
// `parts` equal pieces, piece p holding indices [p x n / parts, (p + 1) x n / parts) of that
// dimension. Each replica's copy is one piece: the one of its rank along the split's mesh axis;
// replicas along the other axes (the batch axis) hold the same pieces. Dimensions that do not
// divide are refused before a variable is split (keras::distribution::check_layouts).
// Pipeline parallelism places a variable with parts = 1: piece 0 (the whole value) on the
// replicas of the stage that computes with it, and piece -1 elsewhere: a replica holding piece
// -1 holds nothing of the variable (its copy has no elements).
struct TensorSplit {
  int dim = 0;
  int parts = 1;
  std::string axis;    // the mesh axis, for messages ("model")
  Shape global_shape;  // the whole value's
  // Per replica in sync (every worker's, by global replica index): the piece it holds (-1: none).
  std::vector<int> piece_of_replica;
  // The devices that compute with the pieces together (their layers' f and g collectives).
  std::shared_ptr<tensor_parallel::Group> group;

  Shape piece_shape() const;
  // Piece p of `whole` (host or device; global_shape), as a new host tensor.
  Tensor piece(const Tensor& whole, int p) const;
  // Writes `piece` (piece p, any device) into its place in `whole` (a host tensor of global_shape).
  void put_piece(const Tensor& piece, int p, Tensor& whole) const;
};

// Elements [offset, offset + count) of `tensor` flattened: a 1-D view of its buffer, no copy
// (how shards are cut out of whole values and packed into collective buffers).
Tensor flat_view(const Tensor& tensor, std::int64_t offset, std::int64_t count);

struct VariableOptions {
  std::string name;
  Tensor initial_value;  // host or device tensor: the variable's dtype, shape and first value
  bool trainable = true;
  VariableSynchronization synchronization = VariableSynchronization::kAuto;
  VariableAggregation aggregation = VariableAggregation::kNone;
  // Split across the replicas in sync (ShardSpec) instead of copied whole to each. Strategies
  // that do not shard ignore it.
  bool sharded = false;
  // Tensor parallelism: each copy is the replica's piece of initial_value (an optimizer slot of a
  // split weight is split as the weight).
  std::optional<TensorSplit> tensor_split;
};

class Variable {
 public:
  // sharding: set when each copy is one shard of the value (ShardSpec), unset when each copy is
  // the whole value.
  Variable(Strategy& strategy, VariableOptions options, std::vector<Tensor> copies,
           std::optional<ShardSpec> sharding = std::nullopt);
  virtual ~Variable() = default;
  Variable(const Variable&) = delete;
  Variable& operator=(const Variable&) = delete;

  const std::string& name() const { return name_; }
  DType dtype() const { return copies_.front().dtype(); }
  const Shape& shape() const { return copies_.front().shape(); }
  bool trainable() const { return trainable_; }
  VariableSynchronization synchronization() const { return synchronization_; }
  VariableAggregation aggregation() const { return aggregation_; }
  // Unset for a variable whose every copy is the whole value; else how the copies split it.
  const std::optional<ShardSpec>& sharding() const { return sharding_; }
  // Set when tensor parallelism split the value into pieces, one per copy (TensorSplit).
  const std::optional<TensorSplit>& tensor_split() const { return tensor_split_; }
  // The value's shape as the model sees it: shape() unless sharded (each copy is then a 1-D shard)
  // or split (each copy a piece).
  const Shape& global_shape() const {
    return tensor_split_ ? tensor_split_->global_shape : sharding_ ? sharding_->global_shape : shape();
  }
  // The shape a replica's graph computes with: global_shape() (a ZeRO shard is gathered whole for
  // its steps), except for a split variable, whose graph computes with its piece (shape()).
  const Shape& graph_shape() const { return tensor_split_ ? piece_shape_ : global_shape(); }
  // Replaces each whole copy by the replica's piece of it (keras::distribution::ModelParallel, at
  // compile, once the layouts are checked against the model); a variable ZeRO stage 3 sharded
  // becomes its shards of the replica's piece (then collective: every worker calls it for the same
  // variables in the same order). Callers: one thread, not during a step. FailedPrecondition for
  // one already split otherwise; a no-op when split alike.
  void split_into_pieces(TensorSplit split);
  // The strategy whose scope created it.
  Strategy& strategy() const { return *strategy_; }

  int num_replicas() const { return static_cast<int>(copies_.size()); }
  // The copy on replica `replica`'s device; kernels and optimizers update it in place.
  Tensor& value(int replica = 0);
  const Tensor& value(int replica = 0) const;

  // A host copy of the value: replica 0's copy for on-write variables; for on-read variables,
  // the copies combined with the aggregation (SUM adds, MEAN averages, otherwise replica 0); for
  // a sharded variable, the shards gathered into global_shape(), padding dropped. Across workers
  // that is a collective (Strategy::sum_across_workers): every worker reads the same sharded
  // variables in the same order, as Keras's get_weights of a sharded model.
  Tensor read_value() const;
  // Sets the variable to `value` from outside the replicas (TF's cross-replica assign): every copy
  // becomes `value`, except for an on-read SUM variable, whose copies become value / replicas so
  // that reading it gives `value` back. Any device; same dtype and shape, else InvalidArgument
  // naming the variable. A sharded variable takes a value of global_shape() and keeps its shards
  // of it (padding zero); every worker takes the same value. Callers: one thread at a time, not
  // during a step.
  void assign(const Tensor& value);
  // A split variable (tensor_split()) reads its pieces put together and takes a whole value, which
  // each copy cuts its piece from.
  // Sets the variable from one value per replica (what each replica computed in Strategy::run),
  // combined as TF combines replica-context updates: on-write variables take the SUM or MEAN of
  // the values, or replica 0's for ONLY_FIRST_REPLICA, on every copy; NONE with several replicas
  // is FailedPrecondition (TF: "you must specify an aggregation method"). On-read variables keep
  // each replica's own value. A sharded variable is FailedPrecondition (use assign).
  void assign_per_replica(const std::vector<Tensor>& per_replica);
  // For on-write (mirrored) variables: throws FailedPrecondition naming the variable, the
  // replicas and the first element where the copies differ. Copies must stay bit-identical: every
  // replica applies the same update. Sharded variables (each copy another shard) are skipped; the
  // copies of a split variable are compared with those holding the same piece.
  void check_copies_equal() const;

 private:
  Strategy* strategy_;
  std::string name_;
  bool trainable_;
  VariableSynchronization synchronization_;
  VariableAggregation aggregation_;
  std::vector<Tensor> copies_;
  std::optional<ShardSpec> sharding_;
  std::optional<TensorSplit> tensor_split_;
  Shape piece_shape_;  // tensor_split_->piece_shape()

  // read_value across workers: `out` holds this worker's shards, zeros elsewhere.
  Tensor sum_over_workers(const Tensor& out) const;
};

// A variable kept equal on every replica: each replica applies the same update to its copy
// (Keras weights, optimizer slots). TF's MirroredVariable.
class MirroredVariable final : public Variable {
 public:
  using Variable::Variable;
};

// A variable each replica updates on its own (metric state); reading combines the copies with
// the aggregation (SUM adds, MEAN averages). TF's SyncOnReadVariable.
class SyncOnReadVariable final : public Variable {
 public:
  using Variable::Variable;
};

}  // namespace tandem::strategy
