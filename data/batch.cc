// batch: stacks consecutive elements along a new first dimension.
//
// Each component of a batch is one freshly allocated host tensor, filled with one memcpy per
// element: for the usual pipeline (slices of a big array, shuffled) that is the only copy of the
// data between the source array and the replica's input buffer.
#include <algorithm>
#include <cstring>
#include <span>

#include "tandem/data/detail/dataset_node.h"

namespace tandem::data::detail {
namespace {

// Enough for any real batch; a larger batch_size grows the vector as it fills instead of
// reserving memory that a short dataset would never use.
constexpr std::int64_t kMaxReservedElements = std::int64_t{1} << 16;
// About what a thread copies of a batch component at a time (parallel_for's grain): a component
// no larger (labels, a few features a row) is not worth waking a thread for.
constexpr std::size_t kRowsChunkBytes = 64 * 1024;

// Copies row rows[i] of `src` (rows `stride` bytes apart, `bytes` each) to dst + i * bytes, over
// the threads of `device` (where the batch is allocated). Shuffled rows of a large array are
// scattered cache misses; one core waits on them row by row, two keep twice as many in flight:
// Fashion-MNIST's batch of 128 random rows of 3136 bytes (from 188 MB) took 42 against 71 and 30
// against 55 us in two runs of 2000 alternated copies on a 2-core Zen 4, and fit's loop around
// mlp's 0.35 ms step spent about 100 us a step in this copy. Behind a prefetch it stays on the
// prefetch's thread (tls_pipeline_in_background).
void copy_rows(devices::Device& device, std::span<const std::int64_t> rows, const char* src, std::size_t stride,
               std::size_t bytes, char* dst) {
  const auto copy = [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const auto row = static_cast<std::size_t>(rows[static_cast<std::size_t>(i)]);
      std::memcpy(dst + static_cast<std::size_t>(i) * bytes, src + row * stride, bytes);
    }
  };
  const auto n = static_cast<std::int64_t>(rows.size());
  if (tls_pipeline_in_background) {
    copy(0, n);
    return;
  }
  const auto grain =
      static_cast<std::int64_t>(std::max<std::size_t>(1, kRowsChunkBytes / std::max<std::size_t>(bytes, 1)));
  device.parallel_for(n, grain, copy);
}

class BatchNode final : public DatasetNode {
 public:
  BatchNode(std::shared_ptr<const DatasetNode> input, std::int64_t batch_size, bool drop_remainder)
      : input_(std::move(input)), batch_size_(batch_size), drop_remainder_(drop_remainder) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext& context) const override {
    return std::make_unique<BatchIterator>(self_as<BatchNode>(), input_->make_iterator(context));
  }
  std::int64_t cardinality() const override {
    const auto n = input_->cardinality();
    if (n == Dataset::kInfinite || n == Dataset::kUnknown) return n;
    return n / batch_size_ + (n % batch_size_ == 0 || drop_remainder_ ? 0 : 1);
  }
  // The batch dimension is batch_size when every batch is full: drop_remainder, an input that
  // divides evenly, or an infinite one (which never reaches a last batch). Otherwise it is -1.
  std::vector<graph::TensorSpec> element_spec() const override {
    const auto n = input_->cardinality();
    const bool always_full = drop_remainder_ || n == Dataset::kInfinite || (n >= 0 && n % batch_size_ == 0);
    auto specs = input_->element_spec();
    for (std::size_t c = 0; c < specs.size(); ++c) {
      const auto& shape = specs[c].shape;
      TANDEM_REQUIRE(shape.rank() < Shape::kMaxRank, InvalidArgument,
                     "batch: component {} has shape {}; a batch of it would have {} dimensions, more than {}", c, shape,
                     shape.rank() + 1, Shape::kMaxRank);
      Shape batched{always_full ? batch_size_ : Shape::kUnknown};
      for (auto d : shape.dims()) batched.push_back(d);
      specs[c].shape = batched;
    }
    return specs;
  }
  const char* name() const override { return "batch"; }
  bool reads_files() const override { return input_->reads_files(); }

 private:
  class BatchIterator final : public IteratorBase {
   public:
    BatchIterator(std::shared_ptr<const BatchNode> node, std::unique_ptr<IteratorBase> input)
        : node_(std::move(node)), input_(std::move(input)), source_(node_->input_->slice_source()) {
      std::int64_t reserve = std::min(node_->batch_size_, kMaxReservedElements);
      if (const auto n = node_->input_->cardinality(); n >= 0) reserve = std::min(reserve, n);
      if (source_) {
        rows_.reserve(static_cast<std::size_t>(reserve));
      } else {
        pending_.reserve(static_cast<std::size_t>(reserve));
      }
    }

    std::optional<Element> next() override {
      if (source_) return next_from_rows();
      // Elements collected before an input error are dropped with it (as tf.data does); the
      // next call starts a new batch.
      pending_.clear();
      const auto batch_size = static_cast<std::size_t>(node_->batch_size_);
      while (input_ && pending_.size() < batch_size) {
        auto element = input_->next();
        if (!element) {
          input_.reset();
          break;
        }
        pending_.push_back(std::move(*element));
      }
      if (pending_.empty() || (node_->drop_remainder_ && pending_.size() < batch_size)) {
        pending_.clear();
        return std::nullopt;
      }
      Element batch = stack();
      pending_.clear();  // let go of the source views now, not at the next call
      return batch;
    }

   private:
    // Row mode: the input yields row numbers of source_'s arrays; each row is copied from there
    // into the batch, with no Element in between. Rows of one source all have the same shape.
    std::optional<Element> next_from_rows() {
      rows_.clear();
      const auto batch_size = static_cast<std::size_t>(node_->batch_size_);
      while (input_ && rows_.size() < batch_size) {
        const auto row = input_->next_row();
        if (!row) {
          input_.reset();
          break;
        }
        rows_.push_back(*row);
      }
      if (rows_.empty() || (node_->drop_remainder_ && rows_.size() < batch_size)) return std::nullopt;
      Element batch;
      batch.reserve(source_->components.size());
      for (std::size_t c = 0; c < source_->components.size(); ++c) {
        const auto& spec = source_->row_specs[c];
        TANDEM_REQUIRE(spec.shape.rank() < Shape::kMaxRank, InvalidArgument,
                       "batch: component {} has shape {}; a batch of it would have {} dimensions, more than {}", c,
                       spec.shape, spec.shape.rank() + 1, Shape::kMaxRank);
        Shape shape{static_cast<std::int64_t>(rows_.size())};
        for (auto d : spec.shape.dims()) shape.push_back(d);
        auto& device = devices::default_cpu_device();
        Tensor out = Tensor::empty(shape, spec.dtype, device);
        copy_rows(device, rows_, static_cast<const char*>(source_->components[c].raw_data()),
                  source_->row_stride_bytes[c], source_->row_bytes[c], static_cast<char*>(out.raw_data()));
        batch.push_back(std::move(out));
      }
      return batch;
    }

    Element stack() const {
      const auto& first = pending_.front();
      const auto count = static_cast<std::int64_t>(pending_.size());
      Element batch;
      batch.reserve(first.size());
      for (std::size_t c = 0; c < first.size(); ++c) {
        const Tensor& model = first[c];
        TANDEM_REQUIRE(model.shape().rank() < Shape::kMaxRank, InvalidArgument,
                       "batch: component {} has shape {}; a batch of it would have {} dimensions, more than {}", c,
                       model.shape(), model.shape().rank() + 1, Shape::kMaxRank);
        Shape shape{count};
        for (auto d : model.shape().dims()) shape.push_back(d);
        Tensor out = Tensor::empty(shape, model.dtype(), devices::default_cpu_device());
        const std::size_t bytes = model.nbytes();
        auto* dst = static_cast<char*>(out.raw_data());
        for (std::size_t i = 0; i < pending_.size(); ++i) {
          const auto& element = pending_[i];
          TANDEM_REQUIRE(element.size() == first.size(), InvalidArgument,
                         "batch: element {} of the batch has {} components but element 0 has {}", i, element.size(),
                         first.size());
          const Tensor& t = element[c];
          TANDEM_REQUIRE(t.dtype() == model.dtype() && t.shape() == model.shape(), InvalidArgument,
                         "batch: component {} of element {} in the batch is {} {} but in element 0 it is {} {}; "
                         "the elements of a batch must have equal shapes and dtypes",
                         c, i, t.dtype(), t.shape(), model.dtype(), model.shape());
          if (t.device().host_accessible()) {
            std::memcpy(dst + i * bytes, t.raw_data(), bytes);
          } else {
            t.device().copy_to_host(dst + i * bytes, t.raw_data(), bytes);
          }
        }
        batch.push_back(std::move(out));
      }
      return batch;
    }

    std::shared_ptr<const BatchNode> node_;
    std::unique_ptr<IteratorBase> input_;
    std::shared_ptr<const SliceSource> source_;  // non-null in row mode
    std::vector<Element> pending_;               // reused across batches: one reservation per pass
    std::vector<std::int64_t> rows_;             // the same, in row mode
  };

  std::shared_ptr<const DatasetNode> input_;
  std::int64_t batch_size_;
  bool drop_remainder_;
};

}  // namespace

std::shared_ptr<const DatasetNode> make_batch_node(std::shared_ptr<const DatasetNode> input, std::int64_t batch_size,
                                                   bool drop_remainder) {
  return std::make_shared<const BatchNode>(std::move(input), batch_size, drop_remainder);
}

}  // namespace tandem::data::detail
