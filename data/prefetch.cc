// prefetch: a background thread runs the pipeline ahead of the consumer.
//
// Each iterator owns one std::thread that pulls elements from the input iterator into a queue of
// at most buffer_size. An error the input raises is queued like an element and rethrown by the
// consumer's next() in order, after the elements produced before it; the producer then goes on
// with the next element, as tf.data's prefetch does. Nothing waits forever: the consumer waits at
// most PrefetchOptions::timeout for an element, and the producer waits on a full queue only until
// the iterator is destroyed, whose destructor wakes it and joins it.
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "tandem/data/detail/dataset_node.h"

namespace tandem::data::detail {
namespace {

class PrefetchNode final : public DatasetNode {
 public:
  PrefetchNode(std::shared_ptr<const DatasetNode> input, std::int64_t buffer_size, PrefetchOptions options)
      : input_(std::move(input)), buffer_size_(buffer_size), options_(options) {}

  std::unique_ptr<IteratorBase> make_iterator(const IterateContext& context) const override {
    if (context.probe) return input_->make_iterator(context);  // one element: no thread worth starting
    return std::make_unique<PrefetchIterator>(input_->make_iterator(context), buffer_size_, options_.timeout);
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }
  std::vector<graph::TensorSpec> element_spec() const override { return input_->element_spec(); }
  const char* name() const override { return "prefetch"; }
  bool reads_files() const override { return input_->reads_files(); }

 private:
  class PrefetchIterator final : public IteratorBase {
   public:
    PrefetchIterator(std::unique_ptr<IteratorBase> input, std::int64_t buffer_size, std::chrono::milliseconds timeout)
        : input_(std::move(input)), capacity_(static_cast<std::size_t>(buffer_size)), timeout_(timeout) {
      thread_ = std::thread([this] { produce(); });
    }

    ~PrefetchIterator() override {
      {
        std::lock_guard lock(mutex_);
        stopping_ = true;
      }
      space_.notify_all();
      // Returns once the producer finishes the input element it is working on, if any.
      thread_.join();
    }

    PrefetchIterator(const PrefetchIterator&) = delete;
    PrefetchIterator& operator=(const PrefetchIterator&) = delete;

    std::optional<Element> next() override {
      if (ended_) return std::nullopt;
      std::unique_lock lock(mutex_);
      if (!ready_.wait_for(lock, timeout_, [&] { return !queue_.empty(); })) {
        throw DeadlineExceeded(fmt::format(
            "prefetch: no element within {} ms (buffer of {}); the pipeline before prefetch is slower than that "
            "or stuck. If elements legitimately take this long, raise PrefetchOptions::timeout",
            timeout_.count(), capacity_));
      }
      Item item = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      space_.notify_one();
      if (item.error) std::rethrow_exception(item.error);
      if (!item.element) ended_ = true;
      return std::move(item.element);
    }

   private:
    // An element, an error, or (neither) the end of the input.
    struct Item {
      std::optional<Element> element;
      std::exception_ptr error;
    };

    // The producer thread. It alone touches input_, and destroys it before returning so that
    // upstream resources (a nested prefetch's thread) go as soon as this pass no longer needs them.
    void produce() {
      tls_pipeline_in_background = true;
      for (;;) {
        Item item;
        try {
          item.element = input_->next();
        } catch (...) {
          item.error = std::current_exception();
        }
        const bool end = !item.element && !item.error;
        {
          std::unique_lock lock(mutex_);
          space_.wait(lock, [&] { return stopping_ || queue_.size() < capacity_; });
          if (stopping_) break;
          queue_.push_back(std::move(item));
        }
        ready_.notify_one();
        if (end) break;
        std::lock_guard lock(mutex_);
        if (stopping_) break;
      }
      input_.reset();
    }

    std::unique_ptr<IteratorBase> input_;
    const std::size_t capacity_;
    const std::chrono::milliseconds timeout_;
    bool ended_ = false;  // the consumer has seen the end (consumer thread only)

    std::mutex mutex_;
    std::condition_variable ready_;  // an item was queued
    std::condition_variable space_;  // an item was taken, or stopping_ was set
    std::deque<Item> queue_;
    bool stopping_ = false;
    std::thread thread_;  // last: starts after, and is joined before, everything above goes
  };

  std::shared_ptr<const DatasetNode> input_;
  std::int64_t buffer_size_;
  PrefetchOptions options_;
};

}  // namespace

std::shared_ptr<const DatasetNode> make_prefetch_node(std::shared_ptr<const DatasetNode> input,
                                                      std::int64_t buffer_size, PrefetchOptions options) {
  return std::make_shared<const PrefetchNode>(std::move(input), buffer_size, options);
}

}  // namespace tandem::data::detail
