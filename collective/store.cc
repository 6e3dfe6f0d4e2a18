// The in-memory store (a map behind a mutex; waiters sleep on a condition variable) and the
// prefix store (a key rewriter in front of another store).
#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <mutex>
#include <unordered_map>

#include "tandem/base/errors.h"
#include "tandem/collective/detail/common.h"
#include "tandem/collective/store.h"

namespace tandem::collective {
namespace {

using detail::deadline_after;
using detail::format_duration;
using detail::quoted_list;

class InMemoryStore final : public Store {
 public:
  void set(const std::string& key, const std::vector<char>& value) override {
    {
      std::lock_guard lock(mutex_);
      data_[key] = value;
    }
    changed_.notify_all();
  }

  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    if (!changed_.wait_until(lock, deadline_after(timeout), [&] { return data_.contains(key); })) {
      throw DeadlineExceeded(fmt::format("store {}: get(\"{}\") timed out after {}: no client set the key", address(),
                                         key, format_duration(timeout)));
    }
    return data_.at(key);
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    const auto all_present = [&] {
      return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.contains(k); });
    };
    if (changed_.wait_until(lock, deadline_after(timeout), all_present)) return;
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (!data_.contains(k)) missing.push_back(k);
    }
    throw DeadlineExceeded(fmt::format("store {}: wait for {} key(s) timed out after {}; still missing: {}", address(),
                                       keys.size(), format_duration(timeout), quoted_list(missing)));
  }

  bool check(const std::string& key) override {
    std::lock_guard lock(mutex_);
    return data_.contains(key);
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    std::int64_t value = 0;
    {
      std::lock_guard lock(mutex_);
      auto& bytes = data_[key];
      if (!bytes.empty()) {
        const char* end = bytes.data() + bytes.size();
        const auto [ptr, ec] = std::from_chars(bytes.data(), end, value);
        TANDEM_REQUIRE(ec == std::errc() && ptr == end, InvalidArgument,
                       "store {}: add(\"{}\"): the key holds a value that is not a decimal integer ({} bytes)",
                       address(), key, bytes.size());
      }
      value += delta;
      const std::string text = std::to_string(value);
      bytes.assign(text.begin(), text.end());
    }
    changed_.notify_all();
    return value;
  }

  std::string address() const override { return "in-memory"; }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::unordered_map<std::string, std::vector<char>> data_;
};

class PrefixStore final : public Store {
 public:
  PrefixStore(std::shared_ptr<Store> inner, std::string prefix)
      : inner_(std::move(inner)), prefix_(std::move(prefix)) {}

  void set(const std::string& key, const std::vector<char>& value) override { inner_->set(prefix_ + key, value); }
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return inner_->get(prefix_ + key, timeout);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::vector<std::string> prefixed;
    prefixed.reserve(keys.size());
    for (const auto& k : keys) prefixed.push_back(prefix_ + k);
    inner_->wait(prefixed, timeout);
  }
  bool check(const std::string& key) override { return inner_->check(prefix_ + key); }
  std::int64_t add(const std::string& key, std::int64_t delta) override { return inner_->add(prefix_ + key, delta); }
  std::string address() const override { return inner_->address(); }

 private:
  std::shared_ptr<Store> inner_;
  std::string prefix_;
};

}  // namespace

std::shared_ptr<Store> make_in_memory_store() { return std::make_shared<InMemoryStore>(); }

std::string failed_call_key(int rank) { return fmt::format("tandem/failed_call/{}", rank); }

bool is_job_wide_key(std::string_view key) {
  return key.starts_with("tandem/lost/") || key.starts_with("tandem/failed_call/");
}

std::shared_ptr<Store> make_prefix_store(std::shared_ptr<Store> inner, std::string prefix) {
  TANDEM_REQUIRE(inner != nullptr, InvalidArgument, "make_prefix_store(prefix \"{}\"): the inner store is null",
                 prefix);
  return std::make_shared<PrefixStore>(std::move(inner), std::move(prefix));
}

}  // namespace tandem::collective
