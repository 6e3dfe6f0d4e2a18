// tandem/keras_like/sharded_checkpoint.h — checkpoints as a directory of per-worker safetensors
// files plus an index, which load on any number of shards (PyTorch DCP's and Orbax's design).
//
// Who calls: saving.cc (Model::save_weights / load_weights, training checkpoints) when the model
// holds a sharded variable (ZeRO: Variable::sharding()) or the path names a directory;
// BackupAndRestore and ModelCheckpoint through them; tools/tandem-consolidate; users.
//
// The directory:
//   index.json                            what follows; written last: a directory without it is
//                                         a save that never finished, and is refused
//   rank-00000-of-00002.safetensors       worker 0's chunks (ordinary safetensors files)
//   rank-00001-of-00002.safetensors       worker 1's chunks
// index.json (format "tandem.sharded_checkpoint", version 1):
//   {"format": "tandem.sharded_checkpoint", "version": 1,
//    "num_shards": 4,                 replicas in sync when it was written (ZeRO's shard count)
//    "num_workers": 2,                writing ranks: one file each
//    "files": ["rank-00000-of-00002.safetensors", ...],
//    "checksum": {"algorithm": "crc32", "block_bytes": 1048576},
//    "metadata": {"format": "tandem.checkpoint", "epoch": "3", "step": "0", ...},
//    "tensors": {"dense/kernel": {"dtype": "F32", "shape": [784, 128],
//                                 "layout": {"kind": "flat", "num_shards": 4},  or {"kind": "replicated"},
//                                           or {"kind": "split", "dim": 1, "parts": 2, "axis": "model"}
//                                 "chunks": [{"file": "rank-00000-of-00002.safetensors",
//                                             "key": "dense/kernel[0:25088]",
//                                             "range": [0, 25088],       elements [begin, end) of the
//                                                                        value flattened row-major
//                                             "bytes": [4096, 100352],   offset and length in the file
//                                             "crc32": ["1c291ca3", ...]}, ...]}, ...}}
// A chunk's bytes are checksummed in blocks of block_bytes (zlib's CRC-32, one per block, the last
// block shorter), so that a reader fetching part of a chunk verifies what it reads without reading
// the rest. Every chunk is a flat element range: ZeRO's shards are one each, and a block (tensor
// parallelism's pieces, CheckpointContents::blocks) is one per contiguous run of its elements in
// the whole tensor, so that the format needs no N-D chunks and every reader reads blocks. Readers
// refuse a chunk without "range", naming it. Replicated variables are written once, by the
// chief; a sharded variable's shards by the workers that hold them (padding is never written); a
// variable split by ModelParallel (tensor parallelism's pieces, a pipeline stage's weights) as
// blocks, each piece by the worker of the first replica holding it (layout "split").
//
// Writing is atomic: every worker writes its file into a hidden sibling directory
// (.NAME.tmp-<nonce>, the nonce drawn by the chief and broadcast), the workers agree that all
// files are complete (Strategy::sum_across_workers), then the chief writes index.json, syncs and
// swaps the directory into place (renameat2 RENAME_EXCHANGE: an older checkpoint of the same name
// stays whole until the new one is), and removes the old one. A crash at any point leaves the
// previous checkpoint under the name, loadable. Under several workers the directory must be on a
// file system every worker sees (as for PyTorch DCP's FileSystemWriter).
//
// Reading computes the overlap of the saved chunks with what each replica holds now (a sharded
// variable's shard under its current ShardSpec, any shard count; a replicated one's whole value)
// and reads only those byte ranges (pread), rounded out to checksum blocks.
//
// Blocking: file I/O. save_checkpoint_directory is collective: every worker calls it with the
// same contents. Throws: DataLoss for a corrupt, truncated, incomplete or missing-chunk checkpoint
// (naming the file and the tensor), NotFound for a missing path, InvalidArgument for contents that
// do not fit the format, Unavailable when the file system fails.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/graph/graph.h"
#include "tandem/keras_like/saving.h"

namespace tandem::strategy {
class Strategy;
class Variable;
}  // namespace tandem::strategy

namespace tandem::keras {

inline constexpr std::string_view kCheckpointIndexName = "index.json";
inline constexpr std::string_view kCheckpointIndexFormat = "tandem.sharded_checkpoint";
inline constexpr int kCheckpointIndexVersion = 1;
inline constexpr std::uint64_t kChecksumBlockBytes = std::uint64_t{1} << 20;

// ----- the index ---------------------------------------------------------------------------------

// One piece of a tensor in one file: elements [begin, end) of the value flattened row-major.
struct CheckpointChunk {
  std::string file;  // a file of the directory (a plain name)
  std::string key;   // the tensor in that file
  std::int64_t begin = 0, end = 0;
  std::uint64_t byte_offset = 0, byte_length = 0;  // where the elements lie in the file
  std::vector<std::uint32_t> crc32;                // one per checksum block of the chunk's bytes
};

// How ModelParallel split a tensor when it was written: `parts` pieces along `dim`, one per device
// of mesh axis `axis` (parts 1: a pipeline stage's weight, held by that stage's devices). It
// tells a reader how the chunks came about; reading never needs it (chunks are flat ranges).
struct CheckpointSplit {
  int dim = 0;
  int parts = 1;
  std::string axis;
  bool operator==(const CheckpointSplit&) const = default;
};

struct CheckpointTensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;                          // the whole value's
  int num_shards = 0;                   // 0: written whole (replicated); N: as N flat shards (ShardSpec::even)
  std::optional<CheckpointSplit> split;  // written as ModelParallel's pieces (num_shards 0)
  std::vector<CheckpointChunk> chunks;  // sorted by begin, tiling [0, elements) exactly
};

struct CheckpointIndex {
  int num_shards = 1;
  int num_workers = 1;
  std::uint64_t checksum_block_bytes = kChecksumBlockBytes;
  std::vector<std::string> files;
  std::map<std::string, std::string> metadata;  // saving.h's: format, epoch, step, optimizer, ...
  std::vector<CheckpointTensorInfo> tensors;    // in the order written

  const CheckpointTensorInfo* find(std::string_view name) const;
};

// Parses index.json's text; `path` names it in errors. Input from outside: every field is checked
// (types, ranges, chunks tiling each tensor exactly, byte lengths matching dtype and range, file
// names without folders), JSON nesting is limited, and whatever the text holds the answer is a
// CheckpointIndex or DataLoss naming the path and the tensor. It allocates in proportion to the
// text only.
CheckpointIndex parse_checkpoint_index(std::string_view text, const std::string& path);
// The JSON text of `index` (what parse_checkpoint_index reads back).
std::string checkpoint_index_json(const CheckpointIndex& index);

// ----- writing -----------------------------------------------------------------------------------

struct CheckpointContents {
  // Each written under its name: a sharded variable as its shards, by the workers holding them;
  // any other once, whole, by the chief (read_value()).
  std::vector<std::pair<std::string, std::shared_ptr<strategy::Variable>>> variables;
  NamedTensors values;  // host values written whole by the chief (step counters, learning rate)
  std::map<std::string, std::string> metadata;
  // Tensors held as blocks (tensor parallelism's pieces, a pipeline stage's weights): every
  // worker lists every such tensor in `block_tensors` (name, dtype, whole shape), and in `blocks`
  // the pieces it holds, each a host tensor and its offset in every dimension. The pieces of each
  // tensor, over every worker, must tile it exactly (else the save fails, InvalidArgument). A
  // piece is written as one flat chunk per contiguous run of its elements in the whole tensor
  // (one for a split along the first dimension; one per row of a column split), so that readers
  // of flat chunks (any ShardSpec, a single device) read it as they read everything else.
  struct Block {
    std::string name;
    std::vector<std::int64_t> offsets;
    Tensor piece;
  };
  std::vector<std::pair<std::string, graph::TensorSpec>> block_tensors;
  std::vector<Block> blocks;
};

// Writes `contents` as a checkpoint directory at `path` (see above). Collective: every worker of
// `strategy` calls it with the same names in the same order; it returns on every worker once the
// directory is in place, or throws on every worker (the one that failed with its error, the others
// with Unavailable naming it) leaving any previous checkpoint as it was.
void save_checkpoint_directory(strategy::Strategy& strategy, const std::string& path,
                               const CheckpointContents& contents);

// Whether `path` is a folder (a checkpoint directory, complete or not), rather than a file.
bool is_checkpoint_directory(const std::string& path);

// ----- reading -----------------------------------------------------------------------------------

// A checkpoint opened for reading: a directory (index.json read and checked at once; the chunk
// files opened as they are needed) or a single safetensors file (read whole and checked, as
// read_safetensors does), behind one interface so that every loader reads both. Not collective;
// one thread at a time.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path);
  ~CheckpointReader();
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;

  const std::string& path() const;
  bool is_directory() const;
  const std::map<std::string, std::string>& metadata() const;
  // Every tensor's name, dtype and whole shape, in the order written.
  const std::vector<std::pair<std::string, graph::TensorSpec>>& tensors() const;
  // The elements [begin, end) of tensor `name` flattened, as a host tensor [end - begin]: only the
  // chunks' bytes that overlap are read, and their checksum blocks verified.
  Tensor read_range(const std::string& name, std::int64_t begin, std::int64_t end) const;
  // The whole value of `name`, in its shape.
  Tensor read(const std::string& name) const;
  // What `variable` holds in this process of tensor `name`: one host tensor per copy for a sharded
  // variable (its shard under its current ShardSpec, padding zero), else one tensor, the whole
  // value. The caller has checked dtype and shape (variable->global_shape()).
  std::vector<Tensor> read_for(const std::string& name, const strategy::Variable& variable) const;

 private:
  struct Source;
  std::unique_ptr<Source> source_;
};

// Assigns what read_for returned: each copy its shard, or the whole value (Variable::assign).
void assign_checkpoint_value(strategy::Variable& variable, const std::vector<Tensor>& values);

// Writes one ordinary safetensors file with every tensor of the checkpoint directory `dir` whole,
// and its metadata (so load_weights and load_training_checkpoint read it as if it had been saved
// unsharded). Verifies every checksum on the way. tools/tandem-consolidate is its command line.
void consolidate(const std::string& dir, const std::string& out);

}  // namespace tandem::keras
