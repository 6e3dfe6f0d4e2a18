// tandem/data/dataset.h — input pipelines, after tf.data.
//
// A Dataset is an immutable description of a sequence of elements; each element is a small tuple
// of tensors (x), (x, y) or (x, y, sample_weight). Transformations return new Datasets and share
// the upstream ones, so they are cheap to build and safe to copy:
//
//   auto train = data::Dataset::from_tensor_slices({x, y}).shuffle(60000).batch(128).prefetch(2);
//   for (auto it = train.iterate(); auto element = it->next();) { ... (*element)[0] ... }
//
// iterate() starts one pass (an epoch). Iterators are used by one thread at a time; several
// iterators of one dataset may run at once. Every element's tensors are on the host (CPU:0).
//
// Randomness is deterministic: shuffle() without a seed draws one from the global seed
// (tandem::set_global_seed), and each new pass of a reshuffling dataset uses the next epoch's
// order, so the same seed gives the same sequence of epochs.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/graph/graph.h"
#include "tandem/graph/tensor.h"

namespace tandem::data {

using Element = std::vector<Tensor>;

// One pass over a dataset.
class Iterator {
 public:
  virtual ~Iterator() = default;
  // The next element, or nullopt at the end. Blocks while an upstream prefetch fills (up to its
  // timeout); rethrows errors raised upstream (a bad file, a map function's exception).
  virtual std::optional<Element> next() = 0;
};

struct PrefetchOptions {
  // next() waits at most this long for the background thread before raising DeadlineExceeded.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
};

// How one pass is made (Dataset::iterate). The defaults give tf.data's behaviour.
struct IterateOptions {
  // Which epoch this pass is. Without it, a reshuffling shuffle draws pass k's order from
  // mix_seed(seed, k), k counting the passes started on it in this process; with it, from
  // mix_seed(seed, epoch). Model::fit passes its epoch so that a run resumed from a backup in a
  // new process sees the orders the interrupted run would have seen.
  std::optional<std::uint64_t> epoch;
  // FILE auto-sharding (MultiWorkerMirroredStrategy): a from_files source reads only the files
  // file_shard_index, file_shard_index + file_shards, ... of its list.
  std::int64_t file_shards = 1;
  std::int64_t file_shard_index = 0;
};

namespace detail {
class DatasetNode;
}

class Dataset {
 public:
  static constexpr std::int64_t kInfinite = -1;  // cardinality of repeat()
  static constexpr std::int64_t kUnknown = -2;   // cardinality that needs a pass to know

  Dataset() = default;  // an empty handle; using it throws FailedPrecondition

  // One element per index of the components' first dimension, which must be equal (views: no copy).
  static Dataset from_tensor_slices(std::vector<Tensor> components);
  // The concatenation of reader(path) over the files, in order (tf.data's list of files followed
  // by interleave with cycle length 1). Under MultiWorkerMirroredStrategy the FILE auto-shard
  // policy gives each worker every N-th file. The reader runs when a pass reaches the file;
  // element_spec() reads the first file.
  static Dataset from_files(std::vector<std::string> paths, std::function<Dataset(const std::string& path)> reader);
  // One element holding the components whole.
  static Dataset from_tensors(std::vector<Tensor> components);

  // Draws elements at random from a buffer of `buffer_size` (a buffer at least as large as the
  // dataset gives a uniform permutation). seed: nullopt draws one from the global seed.
  Dataset shuffle(std::int64_t buffer_size, std::optional<std::uint64_t> seed = std::nullopt,
                  bool reshuffle_each_iteration = true) const;
  // Stacks consecutive elements along a new first dimension; the last batch may be smaller
  // unless drop_remainder. Elements of different shapes raise InvalidArgument naming them.
  Dataset batch(std::int64_t batch_size, bool drop_remainder = false) const;
  // Repeats the dataset `count` times (-1: forever).
  Dataset repeat(std::int64_t count = -1) const;
  Dataset take(std::int64_t count) const;
  Dataset skip(std::int64_t count) const;
  Dataset map(std::function<Element(const Element&)> fn) const;
  // Prepares up to buffer_size elements ahead on a background thread.
  Dataset prefetch(std::int64_t buffer_size = 2, PrefetchOptions options = {}) const;
  // Every num_shards-th element starting at index (each worker reads its share).
  Dataset shard(std::int64_t num_shards, std::int64_t index) const;

  std::unique_ptr<Iterator> iterate() const;
  std::unique_ptr<Iterator> iterate(const IterateOptions& options) const;
  // Whether a pass reads a from_files source (the FILE auto-shard policy applies).
  bool reads_files() const;
  // Elements in one pass when known without iterating; kInfinite or kUnknown otherwise.
  std::int64_t cardinality() const;
  // dtype and shape of each component; a dimension that varies (the last partial batch) is -1.
  std::vector<graph::TensorSpec> element_spec() const;
  bool defined() const { return node_ != nullptr; }

  explicit Dataset(std::shared_ptr<const detail::DatasetNode> node) : node_(std::move(node)) {}
  const std::shared_ptr<const detail::DatasetNode>& node() const { return node_; }

 private:
  std::shared_ptr<const detail::DatasetNode> node_;
};

}  // namespace tandem::data
