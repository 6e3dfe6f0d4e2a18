// tandem/data/detail/dataset_node.h — the nodes behind a Dataset handle (internal).
//
// A Dataset is a shared_ptr to an immutable DatasetNode; every transformation is a node that owns
// its input node(s). Nodes hold only configuration, so one node may be iterated by several threads
// at once; everything that changes during a pass (positions, buffers, random state, threads) lives
// in the iterator that make_iterator() returns. The one mutable thing in a node is an atomic
// counter (a shuffle's epoch), which is safe to bump from any thread.
//
// Other modules (the strategy's per-replica splitting) may add nodes of their own: derive from
// DatasetNode and wrap it with Dataset(std::shared_ptr<const DatasetNode>).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/data/dataset.h"

namespace tandem::data::detail {

// How a pass is made.
struct IterateContext {
  // A probe pass only needs its first element's shapes (map's element_spec runs the function on
  // one element). It must leave no trace that later passes could see: a shuffle does not consume
  // an epoch (it passes elements through unshuffled) and a prefetch starts no thread.
  bool probe = false;
  // Dataset::iterate's options. `repetition` counts the passes a repeat() above has made over its
  // input (mixed, for nested repeats), so that an epoch's repeated shuffles still differ.
  IterateOptions options;
  std::uint64_t repetition = 0;
};

// The arrays behind a from_tensor_slices dataset, or a text_windows one.
//
// Row mode: transformations that only choose and order elements (shuffle, take, skip, shard,
// repeat) pass row numbers of these arrays instead of Elements when their input is such a source.
// A shuffle buffer of 60000 rows is then 480 KB of integers rather than 60000 small vectors on
// the heap, and batch copies each row straight from the source array into the batch. For
// Fashion-MNIST's shuffle(60000).batch(128) that halves the time of an epoch.
//
// Row i of component c is the row_bytes[c] bytes at byte i * row_stride_bytes[c] of
// components[c]. Slices of an array have stride == size; text windows overlap (a stride of one
// token, a size of `length` tokens), so 1.5 million windows over one token array need no copy.
struct SliceSource {
  std::vector<Tensor> components;            // host tensors the rows are read from (contiguous)
  std::vector<graph::TensorSpec> row_specs;  // of one row of each component
  std::vector<std::size_t> row_bytes;        // bytes of one row of each component
  std::vector<std::size_t> row_stride_bytes;  // bytes from one row's start to the next's
  std::int64_t rows = 0;

  // Row `index` as an element of views (no copy). Callers: any thread.
  Element row(std::int64_t index) const;
};

// An iterator with the extras the transformations use between themselves.
class IteratorBase : public Iterator {
 public:
  // Skips up to n >= 0 elements and returns how many were skipped (fewer only at the end). The
  // default calls next() n times, so upstream functions still run and their errors still surface
  // (as tf.data's skip does); sources override it to skip without producing elements.
  virtual std::int64_t skip(std::int64_t n);

  // Row mode only (the node's slice_source() is non-null): the row number of the element next()
  // would return, or nullopt at the end. next() and next_row() advance the same position.
  virtual std::optional<std::int64_t> next_row();
};

class DatasetNode : public std::enable_shared_from_this<DatasetNode> {
 public:
  virtual ~DatasetNode() = default;

  // Starts one pass. Callers: any thread, concurrently with other passes. Does not block, except
  // that a prefetch starts its thread here.
  virtual std::unique_ptr<IteratorBase> make_iterator(const IterateContext& context) const = 0;
  // As Dataset::cardinality: a count, Dataset::kInfinite or Dataset::kUnknown. Cheap; no pass.
  virtual std::int64_t cardinality() const = 0;
  // As Dataset::element_spec. May run a probe pass (map); callers: any thread.
  virtual std::vector<graph::TensorSpec> element_spec() const = 0;
  // The transformation's name for error messages: "batch", "shuffle", ...
  virtual const char* name() const = 0;
  // Non-null when this node's iterators run in row mode over that source (see SliceSource).
  virtual std::shared_ptr<const SliceSource> slice_source() const { return nullptr; }
  // Whether this node or one below it is a from_files source.
  virtual bool reads_files() const { return false; }

 protected:
  // This node as its own type, for iterators to keep it alive. Nodes are made with make_shared.
  template <class Derived>
  std::shared_ptr<const Derived> self_as() const {
    return std::static_pointer_cast<const Derived>(shared_from_this());
  }
};

// Set on the thread of a prefetch (data/prefetch.cc), which runs its pipeline while the training
// step's kernels use the device's threads: batch's copies stay on that thread there, so that they
// never take a thread from a kernel (a kernel that finds the pool busy runs on its caller alone).
inline thread_local bool tls_pipeline_in_background = false;

// Node factories, one per transformation (data/*.cc). Arguments are validated by the caller
// (Dataset's methods), which throw InvalidArgument before a node is made.
std::shared_ptr<const DatasetNode> make_prefetch_node(std::shared_ptr<const DatasetNode> input,
                                                      std::int64_t buffer_size, PrefetchOptions options);
std::shared_ptr<const DatasetNode> make_shuffle_node(std::shared_ptr<const DatasetNode> input, std::int64_t buffer_size,
                                                     std::uint64_t seed, bool reshuffle_each_iteration);
// A row-mode source over `source` (from_tensor_slices, text_windows); `name` for messages.
std::shared_ptr<const DatasetNode> make_slices_node(std::shared_ptr<const SliceSource> source, const char* name);
std::shared_ptr<const DatasetNode> make_batch_node(std::shared_ptr<const DatasetNode> input, std::int64_t batch_size,
                                                   bool drop_remainder);

}  // namespace tandem::data::detail
