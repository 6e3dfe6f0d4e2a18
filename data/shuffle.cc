// shuffle: tf.data's buffered shuffle.
//
// The iterator fills a buffer of buffer_size elements, returns one from a random slot, and puts
// the next input element into that slot; once the input ends, the buffer drains in random order.
// A buffer of 1 is the identity; a buffer at least as large as the dataset is a uniform
// permutation. Pass k of a reshuffling node draws from mix_seed(seed, k), where k counts the
// passes started on this node, so a program that sets the global seed sees the same epochs in
// every run; a node that does not reshuffle uses k = 0 every time.
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "tandem/base/random.h"
#include "tandem/data/detail/dataset_node.h"

namespace tandem::data::detail {
namespace {

// Reserving the whole buffer up front would allocate for a buffer_size meant as "everything"
// (tf code often passes a huge number); when the input's size is unknown, the vector grows as it
// fills beyond this. When it is known, the buffer holds at most that many items and is reserved
// exactly (1.5 million text windows: 12 MB of row numbers rather than the 16 MB of a doubling).
constexpr std::int64_t kMaxReservedElements = std::int64_t{1} << 20;

// splitmix64: a fast generator with a fixed definition, so orders do not depend on the standard
// library (std::uniform_int_distribution is implementation-defined).
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n > 0: rejects the top partial range so that no slot is favoured.
  std::uint64_t below(std::uint64_t n) {
    const std::uint64_t threshold = (~n + 1) % n;  // 2^64 mod n
    for (;;) {
      const std::uint64_t x = next();
      if (x >= threshold) return x % n;
    }
  }

 private:
  std::uint64_t state_;
};

class ShuffleNode final : public DatasetNode {
 public:
  ShuffleNode(std::shared_ptr<const DatasetNode> input, std::int64_t buffer_size, std::uint64_t seed,
              bool reshuffle_each_iteration)
      : input_(std::move(input)), buffer_size_(buffer_size), seed_(seed), reshuffle_(reshuffle_each_iteration) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext& context) const override {
    // A probe needs one element's shapes, not an order: pass elements through, and leave the
    // epoch counter alone so that the training passes see the orders they would have seen.
    if (context.probe) return input_->make_iterator(context);
    std::uint64_t epoch = 0;
    if (reshuffle_ && context.options.epoch) {
      epoch = context.repetition == 0 ? *context.options.epoch : mix_seed(*context.options.epoch, context.repetition);
    } else if (reshuffle_) {
      epoch = epochs_.fetch_add(1, std::memory_order_relaxed);
    }
    const auto n = input_->cardinality();
    const std::int64_t reserve = std::min(buffer_size_, n >= 0 ? n : kMaxReservedElements);
    auto input = input_->make_iterator(context);
    const auto seed = mix_seed(seed_, epoch);
    if (auto source = input_->slice_source()) {
      return std::make_unique<ShuffleIterator<std::int64_t>>(std::move(input), std::move(source), buffer_size_, seed,
                                                             reserve);
    }
    return std::make_unique<ShuffleIterator<Element>>(std::move(input), nullptr, buffer_size_, seed, reserve);
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }
  std::vector<graph::TensorSpec> element_spec() const override { return input_->element_spec(); }
  const char* name() const override { return "shuffle"; }
  bool reads_files() const override { return input_->reads_files(); }
  std::shared_ptr<const SliceSource> slice_source() const override { return input_->slice_source(); }

 private:
  // Shuffles Elements, or row numbers in row mode (Item = std::int64_t).
  template <class Item>
  class ShuffleIterator final : public IteratorBase {
   public:
    static constexpr bool kRowMode = std::is_same_v<Item, std::int64_t>;

    ShuffleIterator(std::unique_ptr<IteratorBase> input, std::shared_ptr<const SliceSource> source,
                    std::int64_t buffer_size, std::uint64_t seed, std::int64_t reserve)
        : input_(std::move(input)),
          source_(std::move(source)),
          buffer_size_(static_cast<std::size_t>(buffer_size)),
          random_(seed) {
      buffer_.reserve(static_cast<std::size_t>(reserve));
    }

    std::optional<Element> next() override {
      if constexpr (kRowMode) {
        const auto row = advance();
        if (!row) return std::nullopt;
        return source_->row(*row);
      } else {
        return advance();
      }
    }
    std::optional<std::int64_t> next_row() override {
      if constexpr (kRowMode) {
        return advance();
      } else {
        return IteratorBase::next_row();
      }
    }
    std::int64_t skip(std::int64_t n) override {
      std::int64_t skipped = 0;
      while (skipped < n && advance()) ++skipped;
      return skipped;
    }

   private:
    std::optional<Item> advance() {
      // The slot emptied by the previous call is refilled now rather than then, so an input error
      // surfaces from the call that needs the element, after everything produced before it.
      if (hole_) {
        if (auto item = pull()) {
          buffer_[*hole_] = std::move(*item);
        } else {
          if (*hole_ + 1 != buffer_.size()) buffer_[*hole_] = std::move(buffer_.back());
          buffer_.pop_back();
        }
        hole_.reset();
      }
      while (buffer_.size() < buffer_size_) {
        auto item = pull();
        if (!item) break;
        buffer_.push_back(std::move(*item));
      }
      if (buffer_.empty()) return std::nullopt;
      const auto slot = static_cast<std::size_t>(random_.below(buffer_.size()));
      hole_ = slot;
      return std::move(buffer_[slot]);
    }

    // The next input item; nullopt once the input has ended (the input is then released).
    std::optional<Item> pull() {
      if (!input_) return std::nullopt;
      std::optional<Item> item;
      if constexpr (kRowMode) {
        item = input_->next_row();
      } else {
        item = input_->next();
      }
      if (!item) input_.reset();
      return item;
    }

    std::unique_ptr<IteratorBase> input_;
    std::shared_ptr<const SliceSource> source_;  // row mode only
    std::size_t buffer_size_;
    SplitMix64 random_;
    std::vector<Item> buffer_;
    std::optional<std::size_t> hole_;  // slot whose item was returned last
  };

  std::shared_ptr<const DatasetNode> input_;
  std::int64_t buffer_size_;
  std::uint64_t seed_;
  bool reshuffle_;
  mutable std::atomic<std::uint64_t> epochs_{0};  // passes started; the one mutable field of a node
};

}  // namespace

std::shared_ptr<const DatasetNode> make_shuffle_node(std::shared_ptr<const DatasetNode> input, std::int64_t buffer_size,
                                                     std::uint64_t seed, bool reshuffle_each_iteration) {
  return std::make_shared<const ShuffleNode>(std::move(input), buffer_size, seed, reshuffle_each_iteration);
}

}  // namespace tandem::data::detail
