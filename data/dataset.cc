// Dataset handles, the two sources (from_tensor_slices, from_tensors) and the transformations
// that pass elements through one at a time (map, repeat, take, skip, shard). shuffle, batch and
// prefetch keep buffers and live in files of their own.
//
// Cardinalities follow tf.data's CardinalityInternal of each op, so code ported from Python sees
// the same numbers, including the corner cases (repeat(-1) of an empty dataset is empty, take(-1)
// takes everything, skip(-1) skips everything).
#include "tandem/data/dataset.h"

#include <algorithm>
#include <limits>
#include <mutex>

#include "tandem/base/errors.h"
#include "tandem/base/random.h"
#include "tandem/data/detail/dataset_node.h"

namespace tandem::data {
namespace detail {

std::int64_t IteratorBase::skip(std::int64_t n) {
  std::int64_t skipped = 0;
  while (skipped < n && next()) ++skipped;
  return skipped;
}

std::optional<std::int64_t> IteratorBase::next_row() {
  TANDEM_ASSERT(false, "next_row() on an iterator that is not in row mode");
  return std::nullopt;
}

Element SliceSource::row(std::int64_t index) const {
  Element element;
  element.reserve(components.size());
  for (std::size_t c = 0; c < components.size(); ++c) {
    element.emplace_back(row_specs[c].shape, row_specs[c].dtype, components[c].buffer(),
                         components[c].byte_offset() + static_cast<std::size_t>(index) * row_stride_bytes[c]);
  }
  return element;
}

}  // namespace detail

namespace {

using detail::DatasetNode;
using detail::IterateContext;
using detail::IteratorBase;
using graph::TensorSpec;
using NodePtr = std::shared_ptr<const DatasetNode>;

// Elements must be host tensors: batch memcpys them and users read them with data<T>().
void check_host_component(const Tensor& t, std::size_t index, std::string_view what) {
  TANDEM_REQUIRE(t.defined(), InvalidArgument, "{}: component {} is an undefined tensor", what, index);
  TANDEM_REQUIRE(t.device().host_accessible(), InvalidArgument,
                 "{}: component {} (shape {}) is on {}, which the host cannot read; datasets hold host tensors, "
                 "so copy it first with .to(devices::default_cpu_device())",
                 what, index, t.shape(), t.device().short_name());
}

std::vector<TensorSpec> specs_of(const Element& element) {
  std::vector<TensorSpec> specs;
  specs.reserve(element.size());
  for (const auto& t : element) specs.push_back({t.dtype(), t.shape()});
  return specs;
}

// ---------------------------------------------------------------------------------------------
// A row-mode source (from_tensor_slices, text_windows): element i is a view of row i of every
// component.

class SlicesNode final : public DatasetNode {
 public:
  SlicesNode(std::shared_ptr<const detail::SliceSource> source, const char* name)
      : source_(std::move(source)), name_(name) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext&) const override {
    return std::make_unique<SlicesIterator>(source_);
  }
  std::int64_t cardinality() const override { return source_->rows; }
  std::vector<TensorSpec> element_spec() const override { return source_->row_specs; }
  const char* name() const override { return name_; }
  std::shared_ptr<const detail::SliceSource> slice_source() const override { return source_; }

 private:
  class SlicesIterator final : public IteratorBase {
   public:
    explicit SlicesIterator(std::shared_ptr<const detail::SliceSource> source) : source_(std::move(source)) {}
    std::optional<Element> next() override {
      if (index_ >= source_->rows) return std::nullopt;
      return source_->row(index_++);
    }
    std::optional<std::int64_t> next_row() override {
      if (index_ >= source_->rows) return std::nullopt;
      return index_++;
    }
    std::int64_t skip(std::int64_t n) override {
      const auto k = std::clamp<std::int64_t>(n, 0, source_->rows - index_);
      index_ += k;
      return k;
    }

   private:
    std::shared_ptr<const detail::SliceSource> source_;
    std::int64_t index_ = 0;
  };

  std::shared_ptr<const detail::SliceSource> source_;
  const char* name_;
};

// ---------------------------------------------------------------------------------------------
// from_tensors: a single element.

class TensorsNode final : public DatasetNode {
 public:
  explicit TensorsNode(Element components) : components_(std::move(components)) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext&) const override {
    return std::make_unique<TensorsIterator>(self_as<TensorsNode>());
  }
  std::int64_t cardinality() const override { return 1; }
  std::vector<TensorSpec> element_spec() const override { return specs_of(components_); }
  const char* name() const override { return "from_tensors"; }

 private:
  class TensorsIterator final : public IteratorBase {
   public:
    explicit TensorsIterator(std::shared_ptr<const TensorsNode> node) : node_(std::move(node)) {}
    std::optional<Element> next() override {
      if (done_) return std::nullopt;
      done_ = true;
      return node_->components_;
    }

   private:
    std::shared_ptr<const TensorsNode> node_;
    bool done_ = false;
  };

  Element components_;
};

// ---------------------------------------------------------------------------------------------
// map

class MapNode final : public DatasetNode {
 public:
  using Fn = std::function<Element(const Element&)>;
  MapNode(NodePtr input, Fn fn) : input_(std::move(input)), fn_(std::move(fn)) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext& context) const override {
    return std::make_unique<MapIterator>(self_as<MapNode>(), input_->make_iterator(context));
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }

  // The function's output shapes are only known by running it (tf.data traces it; we have no
  // tracer), so the first call runs it once on the first input element of a probe pass and keeps
  // the answer. When the input's first dimension varies (a partial last batch) and the output
  // keeps that dimension, the output's first dimension varies too.
  std::vector<TensorSpec> element_spec() const override {
    std::call_once(spec_once_, [&] {
      auto probe = input_->make_iterator(IterateContext{.probe = true});
      auto first = probe->next();
      TANDEM_REQUIRE(first.has_value(), FailedPrecondition,
                     "map: element_spec runs the function on the first input element to learn its output, "
                     "but the input dataset is empty");
      auto specs = specs_of(apply(*first));
      const auto input_specs = specs_of(*first);
      const auto declared = input_->element_spec();
      const bool first_dim_varies =
          !declared.empty() && declared[0].shape.rank() > 0 && declared[0].shape[0] == Shape::kUnknown;
      if (first_dim_varies && input_specs[0].shape.rank() > 0) {
        for (auto& spec : specs) {
          if (spec.shape.rank() > 0 && spec.shape[0] == input_specs[0].shape[0]) spec.shape[0] = Shape::kUnknown;
        }
      }
      spec_ = std::move(specs);
    });
    return spec_;
  }
  const char* name() const override { return "map"; }
  bool reads_files() const override { return input_->reads_files(); }

 private:
  class MapIterator final : public IteratorBase {
   public:
    MapIterator(std::shared_ptr<const MapNode> node, std::unique_ptr<IteratorBase> input)
        : node_(std::move(node)), input_(std::move(input)) {}
    std::optional<Element> next() override {
      auto element = input_->next();
      if (!element) return std::nullopt;
      return node_->apply(*element);
    }

   private:
    std::shared_ptr<const MapNode> node_;
    std::unique_ptr<IteratorBase> input_;
  };

  Element apply(const Element& element) const {
    Element out = fn_(element);
    for (std::size_t i = 0; i < out.size(); ++i) check_host_component(out[i], i, "map: the function's result");
    return out;
  }

  NodePtr input_;
  Fn fn_;
  mutable std::once_flag spec_once_;
  mutable std::vector<TensorSpec> spec_;
};

// ---------------------------------------------------------------------------------------------
// repeat, take, skip and shard only count and select elements, so each works the same on
// Elements and on row numbers (row mode): next() and next_row() share one template, `advance`,
// given the matching way to pull from the input.

class RepeatNode final : public DatasetNode {
 public:
  RepeatNode(NodePtr input, std::int64_t count) : input_(std::move(input)), count_(count) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext& context) const override {
    return std::make_unique<RepeatIterator>(input_, count_, context);
  }
  std::int64_t cardinality() const override {
    const auto n = input_->cardinality();
    if (count_ < 0) return n == 0 ? 0 : Dataset::kInfinite;
    if (count_ == 0) return 0;
    if (n == Dataset::kInfinite || n == Dataset::kUnknown) return n;
    return n * count_;
  }
  std::vector<TensorSpec> element_spec() const override { return input_->element_spec(); }
  const char* name() const override { return "repeat"; }
  bool reads_files() const override { return input_->reads_files(); }
  std::shared_ptr<const detail::SliceSource> slice_source() const override { return input_->slice_source(); }

 private:
  class RepeatIterator final : public IteratorBase {
   public:
    RepeatIterator(NodePtr input, std::int64_t count, IterateContext context)
        : input_node_(std::move(input)), count_(count), context_(context) {}

    std::optional<Element> next() override {
      return advance([this] { return input_->next(); });
    }
    std::optional<std::int64_t> next_row() override {
      return advance([this] { return input_->next_row(); });
    }
    std::int64_t skip(std::int64_t n) override {
      std::int64_t skipped = 0;
      while (skipped < n && open_pass()) {
        const auto k = input_->skip(n - skipped);
        skipped += k;
        if (k > 0) pass_empty_ = false;
        if (skipped < n) close_pass();
      }
      return skipped;
    }

   private:
    template <class Pull>
    auto advance(Pull pull) -> decltype(pull()) {
      while (open_pass()) {
        if (auto item = pull()) {
          pass_empty_ = false;
          return item;
        }
        close_pass();
      }
      return std::nullopt;
    }
    // Makes sure a pass over the input is open; false when every pass is done.
    bool open_pass() {
      if (input_) return true;
      if (done_ || (count_ >= 0 && passes_ >= count_)) return false;
      IterateContext context = context_;
      context.repetition =
          passes_ == 0 ? context_.repetition : mix_seed(context_.repetition + 1, static_cast<std::uint64_t>(passes_));
      input_ = input_node_->make_iterator(context);
      pass_empty_ = true;
      return true;
    }
    void close_pass() {
      input_.reset();
      ++passes_;
      // An input that ends at once would end at once forever: stop rather than spin (tf.data
      // does the same for repeat(-1) of an empty dataset).
      if (pass_empty_) done_ = true;
    }

    NodePtr input_node_;
    std::int64_t count_;
    IterateContext context_;
    std::unique_ptr<IteratorBase> input_;
    std::int64_t passes_ = 0;
    bool pass_empty_ = true;
    bool done_ = false;
  };

  NodePtr input_;
  std::int64_t count_;
};

class TakeNode final : public DatasetNode {
 public:
  TakeNode(NodePtr input, std::int64_t count) : input_(std::move(input)), count_(count) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext& context) const override {
    return std::make_unique<TakeIterator>(input_->make_iterator(context), count_);
  }
  std::int64_t cardinality() const override {
    const auto n = input_->cardinality();
    if (n == Dataset::kUnknown) return Dataset::kUnknown;
    if (n == Dataset::kInfinite) return count_ < 0 ? Dataset::kInfinite : count_;
    return count_ < 0 ? n : std::min(n, count_);
  }
  std::vector<TensorSpec> element_spec() const override { return input_->element_spec(); }
  const char* name() const override { return "take"; }
  bool reads_files() const override { return input_->reads_files(); }
  std::shared_ptr<const detail::SliceSource> slice_source() const override { return input_->slice_source(); }

 private:
  class TakeIterator final : public IteratorBase {
   public:
    TakeIterator(std::unique_ptr<IteratorBase> input, std::int64_t count)
        : input_(std::move(input)), remaining_(count < 0 ? std::numeric_limits<std::int64_t>::max() : count) {}

    std::optional<Element> next() override {
      return advance([this] { return input_->next(); });
    }
    std::optional<std::int64_t> next_row() override {
      return advance([this] { return input_->next_row(); });
    }
    std::int64_t skip(std::int64_t n) override {
      if (!has_more()) return 0;
      const auto wanted = std::min(n, remaining_);
      const auto k = input_->skip(wanted);
      remaining_ -= k;
      if (k < wanted) input_.reset();  // the input ended
      return k;
    }

   private:
    template <class Pull>
    auto advance(Pull pull) -> decltype(pull()) {
      if (!has_more()) return std::nullopt;
      auto item = pull();
      if (!item) {
        input_.reset();
        return std::nullopt;
      }
      --remaining_;
      return item;
    }
    // Releases the input as soon as the count is reached, so that an upstream prefetch thread
    // stops now rather than when this iterator is destroyed.
    bool has_more() {
      if (input_ && remaining_ == 0) input_.reset();
      return input_ != nullptr;
    }

    std::unique_ptr<IteratorBase> input_;
    std::int64_t remaining_;
  };

  NodePtr input_;
  std::int64_t count_;
};

class SkipNode final : public DatasetNode {
 public:
  SkipNode(NodePtr input, std::int64_t count) : input_(std::move(input)), count_(count) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext& context) const override {
    return std::make_unique<SkipIterator>(input_->make_iterator(context), count_);
  }
  std::int64_t cardinality() const override {
    const auto n = input_->cardinality();
    if (n == Dataset::kInfinite || n == Dataset::kUnknown) return n;
    return count_ < 0 ? 0 : std::max<std::int64_t>(0, n - count_);
  }
  std::vector<TensorSpec> element_spec() const override { return input_->element_spec(); }
  const char* name() const override { return "skip"; }
  bool reads_files() const override { return input_->reads_files(); }
  std::shared_ptr<const detail::SliceSource> slice_source() const override { return input_->slice_source(); }

 private:
  class SkipIterator final : public IteratorBase {
   public:
    SkipIterator(std::unique_ptr<IteratorBase> input, std::int64_t count)
        : input_(std::move(input)), to_skip_(count < 0 ? std::numeric_limits<std::int64_t>::max() : count) {}

    std::optional<Element> next() override {
      return advance([this] { return input_->next(); });
    }
    std::optional<std::int64_t> next_row() override {
      return advance([this] { return input_->next_row(); });
    }
    std::int64_t skip(std::int64_t n) override {
      if (!skip_prefix()) return 0;
      const auto k = input_->skip(n);
      if (k < n) input_.reset();
      return k;
    }

   private:
    template <class Pull>
    auto advance(Pull pull) -> decltype(pull()) {
      if (!skip_prefix()) return std::nullopt;
      auto item = pull();
      if (!item) input_.reset();
      return item;
    }
    // Skips the prefix one element at a time, so that an error in the middle (a map function
    // upstream) leaves the count right for the next call.
    bool skip_prefix() {
      while (input_ && to_skip_ > 0) {
        if (input_->skip(1) == 0) input_.reset();
        --to_skip_;
      }
      return input_ != nullptr;
    }

    std::unique_ptr<IteratorBase> input_;
    std::int64_t to_skip_;
  };

  NodePtr input_;
  std::int64_t count_;
};

class ShardNode final : public DatasetNode {
 public:
  ShardNode(NodePtr input, std::int64_t num_shards, std::int64_t index)
      : input_(std::move(input)), num_shards_(num_shards), index_(index) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext& context) const override {
    return std::make_unique<ShardIterator>(input_->make_iterator(context), num_shards_, index_);
  }
  std::int64_t cardinality() const override {
    const auto n = input_->cardinality();
    if (n == Dataset::kInfinite || n == Dataset::kUnknown) return n;
    return n / num_shards_ + (index_ < n % num_shards_ ? 1 : 0);
  }
  std::vector<TensorSpec> element_spec() const override { return input_->element_spec(); }
  const char* name() const override { return "shard"; }
  bool reads_files() const override { return input_->reads_files(); }
  std::shared_ptr<const detail::SliceSource> slice_source() const override { return input_->slice_source(); }

 private:
  class ShardIterator final : public IteratorBase {
   public:
    ShardIterator(std::unique_ptr<IteratorBase> input, std::int64_t num_shards, std::int64_t index)
        : input_(std::move(input)), num_shards_(num_shards), index_(index) {}

    std::optional<Element> next() override {
      return advance([this] { return input_->next(); });
    }
    std::optional<std::int64_t> next_row() override {
      return advance([this] { return input_->next_row(); });
    }

   private:
    template <class Pull>
    auto advance(Pull pull) -> decltype(pull()) {
      // One element at a time, so that an error upstream leaves position_ right.
      while (input_ && position_ % num_shards_ != index_) {
        if (input_->skip(1) == 0) input_.reset();
        ++position_;
      }
      if (!input_) return std::nullopt;
      auto item = pull();
      if (!item) {
        input_.reset();
        return std::nullopt;
      }
      ++position_;
      return item;
    }

    std::unique_ptr<IteratorBase> input_;
    std::int64_t num_shards_;
    std::int64_t index_;
    std::int64_t position_ = 0;  // index in the input of the next element it yields
  };

  NodePtr input_;
  std::int64_t num_shards_;
  std::int64_t index_;
};

}  // namespace

namespace detail {
std::shared_ptr<const DatasetNode> make_slices_node(std::shared_ptr<const SliceSource> source, const char* name) {
  return std::make_shared<const SlicesNode>(std::move(source), name);
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Dataset

namespace {
const DatasetNode& checked(const std::shared_ptr<const DatasetNode>& node, std::string_view method) {
  TANDEM_REQUIRE(node != nullptr, FailedPrecondition,
                 "Dataset::{}: this Dataset handle is empty (default-constructed); make one with "
                 "Dataset::from_tensor_slices or Dataset::from_tensors",
                 method);
  return *node;
}
}  // namespace

Dataset Dataset::from_tensor_slices(std::vector<Tensor> components) {
  TANDEM_REQUIRE(!components.empty(), InvalidArgument, "from_tensor_slices: needs at least one component tensor");
  for (std::size_t i = 0; i < components.size(); ++i) {
    check_host_component(components[i], i, "from_tensor_slices");
    TANDEM_REQUIRE(components[i].shape().rank() >= 1, InvalidArgument,
                   "from_tensor_slices: component {} is a scalar (shape ()); slicing needs at least one dimension "
                   "(use from_tensors for whole tensors)",
                   i);
    TANDEM_REQUIRE(components[i].shape()[0] == components[0].shape()[0], InvalidArgument,
                   "from_tensor_slices: component {} has shape {} and component 0 has shape {}; every component "
                   "needs the same first dimension ({} vs {})",
                   i, components[i].shape(), components[0].shape(), components[i].shape()[0], components[0].shape()[0]);
  }
  auto source = std::make_shared<detail::SliceSource>();
  source->rows = components.front().shape()[0];
  for (const auto& c : components) {
    const Shape row(c.shape().dims().subspan(1));
    source->row_specs.push_back({c.dtype(), row});
    source->row_bytes.push_back(static_cast<std::size_t>(row.num_elements()) * graph::dtype_size(c.dtype()));
  }
  source->row_stride_bytes = source->row_bytes;
  source->components = std::move(components);
  return Dataset(detail::make_slices_node(std::move(source), "from_tensor_slices"));
}

Dataset Dataset::from_tensors(std::vector<Tensor> components) {
  TANDEM_REQUIRE(!components.empty(), InvalidArgument, "from_tensors: needs at least one component tensor");
  for (std::size_t i = 0; i < components.size(); ++i) check_host_component(components[i], i, "from_tensors");
  return Dataset(std::make_shared<const TensorsNode>(std::move(components)));
}

Dataset Dataset::shuffle(std::int64_t buffer_size, std::optional<std::uint64_t> seed,
                         bool reshuffle_each_iteration) const {
  checked(node_, "shuffle");
  TANDEM_REQUIRE(buffer_size >= 1, InvalidArgument, "shuffle: buffer_size is {}; expected at least 1", buffer_size);
  // The seed is fixed now, not at the first pass, so the global seed's sequence is consumed in the
  // order the program builds its pipelines, which is what makes runs repeatable.
  const std::uint64_t chosen = seed ? *seed : next_seed();
  return Dataset(detail::make_shuffle_node(node_, buffer_size, chosen, reshuffle_each_iteration));
}

Dataset Dataset::batch(std::int64_t batch_size, bool drop_remainder) const {
  checked(node_, "batch");
  TANDEM_REQUIRE(batch_size >= 1, InvalidArgument, "batch: batch_size is {}; expected at least 1", batch_size);
  return Dataset(detail::make_batch_node(node_, batch_size, drop_remainder));
}

Dataset Dataset::repeat(std::int64_t count) const {
  checked(node_, "repeat");
  return Dataset(std::make_shared<const RepeatNode>(node_, count));
}

Dataset Dataset::take(std::int64_t count) const {
  checked(node_, "take");
  return Dataset(std::make_shared<const TakeNode>(node_, count));
}

Dataset Dataset::skip(std::int64_t count) const {
  checked(node_, "skip");
  return Dataset(std::make_shared<const SkipNode>(node_, count));
}

Dataset Dataset::map(std::function<Element(const Element&)> fn) const {
  checked(node_, "map");
  TANDEM_REQUIRE(fn != nullptr, InvalidArgument, "map: the function is empty");
  return Dataset(std::make_shared<const MapNode>(node_, std::move(fn)));
}

Dataset Dataset::prefetch(std::int64_t buffer_size, PrefetchOptions options) const {
  checked(node_, "prefetch");
  TANDEM_REQUIRE(buffer_size >= 0, InvalidArgument, "prefetch: buffer_size is {}; expected 0 or more", buffer_size);
  TANDEM_REQUIRE(options.timeout.count() > 0, InvalidArgument, "prefetch: timeout is {} ms; expected more than 0",
                 options.timeout.count());
  if (buffer_size == 0) return *this;  // tf.data's prefetch(0) prepares nothing ahead
  return Dataset(detail::make_prefetch_node(node_, buffer_size, options));
}

Dataset Dataset::shard(std::int64_t num_shards, std::int64_t index) const {
  checked(node_, "shard");
  TANDEM_REQUIRE(num_shards >= 1, InvalidArgument, "shard: num_shards is {}; expected at least 1", num_shards);
  TANDEM_REQUIRE(index >= 0 && index < num_shards, InvalidArgument,
                 "shard: index is {}; expected 0 to {} for {} shards", index, num_shards - 1, num_shards);
  return Dataset(std::make_shared<const ShardNode>(node_, num_shards, index));
}

namespace {

// from_files: the readers' datasets one after another. Each file is read when a pass reaches it;
// the FILE auto-shard policy (IterateOptions::file_shards) picks every N-th file.
class FilesNode final : public DatasetNode {
 public:
  FilesNode(std::vector<std::string> paths, std::function<Dataset(const std::string&)> reader)
      : paths_(std::move(paths)), reader_(std::move(reader)) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext& context) const override {
    return std::make_unique<FilesIterator>(self_as<FilesNode>(), context);
  }
  std::int64_t cardinality() const override { return paths_.empty() ? 0 : Dataset::kUnknown; }
  std::vector<TensorSpec> element_spec() const override {
    TANDEM_REQUIRE(!paths_.empty(), InvalidArgument, "from_files: the list of files is empty");
    return read(paths_.front()).element_spec();
  }
  const char* name() const override { return "from_files"; }
  bool reads_files() const override { return true; }

 private:
  Dataset read(const std::string& path) const {
    Dataset d = reader_(path);
    TANDEM_REQUIRE(d.defined(), InvalidArgument, "from_files: the reader returned an empty Dataset for \"{}\"", path);
    return d;
  }

  class FilesIterator final : public IteratorBase {
   public:
    FilesIterator(std::shared_ptr<const FilesNode> node, IterateContext context)
        : node_(std::move(node)),
          context_(context),
          next_file_(static_cast<std::size_t>(context.options.file_shard_index)) {}

    std::optional<Element> next() override {
      while (true) {
        if (!current_) {
          if (next_file_ >= node_->paths_.size()) return std::nullopt;
          const Dataset d = node_->read(node_->paths_[next_file_]);
          next_file_ += static_cast<std::size_t>(context_.options.file_shards);
          IterateContext inner = context_;
          inner.options.file_shards = 1;  // the file's own dataset is read whole
          inner.options.file_shard_index = 0;
          current_ = d.node()->make_iterator(inner);
        }
        if (auto element = current_->next()) return element;
        current_.reset();
      }
    }

   private:
    std::shared_ptr<const FilesNode> node_;
    IterateContext context_;
    std::size_t next_file_;
    std::unique_ptr<IteratorBase> current_;
  };

  std::vector<std::string> paths_;
  std::function<Dataset(const std::string&)> reader_;
};

}  // namespace

Dataset Dataset::from_files(std::vector<std::string> paths, std::function<Dataset(const std::string& path)> reader) {
  TANDEM_REQUIRE(reader != nullptr, InvalidArgument, "from_files: no reader function");
  return Dataset(std::make_shared<const FilesNode>(std::move(paths), std::move(reader)));
}

std::unique_ptr<Iterator> Dataset::iterate() const { return checked(node_, "iterate").make_iterator(IterateContext{}); }

std::unique_ptr<Iterator> Dataset::iterate(const IterateOptions& options) const {
  TANDEM_REQUIRE(
      options.file_shards >= 1 && options.file_shard_index >= 0 && options.file_shard_index < options.file_shards,
      InvalidArgument, "iterate: file shard {} of {} is out of range", options.file_shard_index, options.file_shards);
  return checked(node_, "iterate").make_iterator(IterateContext{.options = options});
}

bool Dataset::reads_files() const { return checked(node_, "reads_files").reads_files(); }

std::int64_t Dataset::cardinality() const { return checked(node_, "cardinality").cardinality(); }

std::vector<graph::TensorSpec> Dataset::element_spec() const { return checked(node_, "element_spec").element_spec(); }

}  // namespace tandem::data
