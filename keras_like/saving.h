// tandem/keras_like/saving.h — weights and training checkpoints in the safetensors format.
//
// A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor
// with its dtype ("F32", "F64", "I32", "I64", "U8"), shape and byte range, and the raw
// little-endian data; any safetensors reader loads what tandem writes. tandem adds to the
// header's "__metadata__" a "checksum" ("crc32:<8 hex digits>" over the data bytes) and a
// "format" ("tandem.weights" or "tandem.checkpoint"). Files are written atomically (a temporary
// file .NAME.tmp-HOST-PID-N in the same folder, flushed, then renamed), so a crash never leaves
// half a file under the final name; each write removes the temporaries that killed writers left
// for the same file (safetensors.cc says which, and why a live writer's never are). Reading
// checks the header, every tensor's byte range and the checksum (when there is one) before
// returning: a corrupt file raises DataLoss naming the file and what was wrong. Whatever a file
// holds, reading allocates no more than the file's size (every length, offset and shape is
// checked against it first), refuses JSON nested over 32 levels and shapes whose nonzero
// dimensions multiply past int64, and quotes names short and escaped.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tandem/graph/tensor.h"

namespace tandem::keras {

class Model;

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

struct SafetensorsContent {
  NamedTensors tensors;  // in file order, on the host
  std::map<std::string, std::string> metadata;
};

// Writes `tensors` (any device; copied to the host) with `metadata` plus the checksum, and
// returns the byte offset of the data section: the tensors' bytes lie back to back from there,
// in the order given (what a sharded checkpoint's index records). Throws InvalidArgument for
// duplicate names or unsupported dtypes, Unavailable when the file cannot be written (naming the
// path and the system's reason).
std::uint64_t write_safetensors(const std::string& path, const NamedTensors& tensors,
                                const std::map<std::string, std::string>& metadata = {});
// NotFound for a missing file; DataLoss for a corrupt or truncated one.
SafetensorsContent read_safetensors(const std::string& path);

// Checkpoint directories (sharded_checkpoint.h): save_model_weights and save_training_checkpoint
// write one instead of a file when the model holds a sharded variable (ZeRO: Variable::sharding(),
// so that no worker needs the whole value and each writes what it holds), or when the path ends
// with '/' or names an existing directory (DeepSpeed's and PyTorch DCP's checkpoints are
// directories too); the directory takes the path's name as given, so "run/model.weights.safetensors"
// becomes a directory for a sharded model. Writing a directory is collective: every worker calls
// (ModelCheckpoint and BackupAndRestore then do). Every loader takes a file or a directory
// whatever the model (a directory written on N replicas loads on M, or into an unsharded model).
// A directory, or any checkpoint into a model with sharded state, is loaded by every worker
// together (collective), each reading its own shards: it fails on every worker or on none.
//
// The model's weights under their variable names ("dense/kernel"): what Model::save_weights and
// Model::load_weights call. Loading matches the file's tensors by name, or, when the names differ
// only by the numbers of auto-generated layer names (a second model built by the same code in the
// same process has dense_2 where the first had dense), by structure like Keras 3: the weights in
// order, pairwise. It checks every tensor (missing, extra, dtype, shape) before it assigns any, and
// raises naming the tensor and, when neither names nor structure match, the first weight where the
// two part; the model is unchanged on error. Training checkpoints load the same way.
void save_model_weights(const Model& model, const std::string& path);
void load_model_weights(Model& model, const std::string& path);

// What a training checkpoint holds besides the weights.
struct TrainingState {
  int epoch = 0;          // epochs completed
  std::int64_t step = 0;  // batches completed in the current epoch
};

// Weights, the optimizer's slots and iteration count, its learning rate (a constant's value as
// "optimizer/learning_rate"; a schedule's kind and config, as Keras serialises it, in the metadata
// "learning_rate_schedule"), and the training state. The model must be compiled.
void save_training_checkpoint(const Model& model, const std::string& path, const TrainingState& state);
// Restores what save_training_checkpoint wrote into a model of the same architecture (compiled,
// with the same optimizer). Checks every tensor before changing anything. A constant learning
// rate is restored; a schedule stays the compiled optimizer's (as with Keras's BackupAndRestore:
// the schedule is code, the iterations state, so the same step gets the same rate), and when the
// checkpoint's learning rate differs from it (another schedule or config, a constant) a warning
// names both and the compiled one is used.
TrainingState load_training_checkpoint(Model& model, const std::string& path);

}  // namespace tandem::keras
