// tandem/keras_like/detail/checkpoints.h — what saving.cc and callbacks.cc share about choosing
// and running checkpoint formats (sharded_checkpoint.h has the directory format itself). Defined
// in sharded_checkpoint.cc (agree_on_outcome, shards_state, writes_directory) and saving.cc
// (load_training_checkpoint).
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "tandem/keras_like/saving.h"

namespace tandem::strategy {
class Strategy;
}

namespace tandem::keras::detail {

// Runs `body` on this worker, then tells every worker whether any worker's body threw (one
// Strategy::sum_across_workers): the worker that failed rethrows its own error, the others throw
// DataLoss (every failure was DataLoss: a corrupt or missing checkpoint) or Unavailable, naming
// the workers that failed. So a collective save or load fails on every worker or on none, and a
// caller that catches DataLoss (BackupAndRestore) decides the same everywhere. Collective under
// several workers (every worker calls it, in the same order); just runs `body` on one.
void agree_on_outcome(strategy::Strategy& strategy, std::string_view what, const std::function<void()>& body);

// Whether the model's training state is, or will be once the optimizer builds, sharded across
// replicas: a weight or slot has a ShardSpec, or the strategy shards (DistributionOptions::zero).
bool shards_state(const Model& model);

// The rule for the format of save_weights (with_optimizer false) and training checkpoints (true):
// a checkpoint directory when the path ends with '/' or names an existing directory, or when a
// variable written is sharded (ZeRO), or split by ModelParallel in a job of several workers (its
// pieces or stages may be on several); else one safetensors file, as before sharding existed. A directory
// is written by every worker together (collective), a file by whoever calls.
bool writes_directory(const Model& model, const std::string& path, bool with_optimizer);

// load_training_checkpoint; every_worker_calls false lets one worker (BackupAndRestore's chief,
// which then broadcasts) read a checkpoint directory on its own, without the workers' agreement.
TrainingState load_training_checkpoint(Model& model, const std::string& path, bool every_worker_calls);

}  // namespace tandem::keras::detail
