// Which rank to blame (peer_records.h): the keys a failed rank of a group across processes writes,
// and the survey of its peers' keys that decides whom its error names.
#include "tandem/collective/detail/peer_records.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "tandem/base/errors.h"
#include "tandem/collective/detail/common.h"
#include "tandem/collective/tcp_store.h"

namespace tandem::collective::detail {
namespace {

// How often a survey reads the peers' records.
constexpr auto kSurveyPoll = std::chrono::milliseconds(20);

std::string_view cause_name(FailureCause cause) {
  switch (cause) {
    case FailureCause::kTimeout: return "timeout";
    case FailureCause::kConnection: return "connection";
    case FailureCause::kError: return "error";
    case FailureCause::kAborted: return "aborted";
  }
  return "?";
}

std::vector<char> bytes_of(std::string_view s) { return {s.begin(), s.end()}; }

// A progress record: how many collectives the rank issued, and why it failed.
struct Progress {
  std::uint64_t issued = 0;
  bool timed_out = false;
};

Progress parse_progress(const std::vector<char>& value) {
  const std::string text(value.begin(), value.end());
  char* end = nullptr;
  Progress p;
  p.issued = std::strtoull(text.c_str(), &end, 10);
  p.timed_out = std::string_view(end) == fmt::format(" {}", cause_name(FailureCause::kTimeout));
  return p;
}

}  // namespace

std::string group_prefix(Store& store, std::string_view backend, int rank) {
  const std::int64_t generation = store.add(fmt::format("tandem/{}/generation/{}", backend, rank), 1);
  return fmt::format("tandem/{}/{}/", backend, generation);
}

std::vector<int> wait_for_ranks(Store& store, const std::function<std::string(int)>& key_of, int size,
                                std::chrono::milliseconds timeout) {
  std::vector<std::string> keys;
  for (int q = 0; q < size; ++q) keys.push_back(key_of(q));
  try {
    store.wait(keys, timeout);
    return {};
  } catch (const DeadlineExceeded&) {
  }
  std::vector<int> missing;
  for (int q = 0; q < size; ++q) {
    if (!store.check(keys[static_cast<std::size_t>(q)])) missing.push_back(q);
  }
  return missing;
}

PeerRecords::PeerRecords(std::shared_ptr<Store> store, std::string prefix, int rank, int size,
                         std::vector<std::string> labels, std::string chief)
    : store_(std::move(store)),
      prefix_(std::move(prefix)),
      rank_(rank),
      size_(size),
      labels_(std::move(labels)),
      chief_(std::move(chief)),
      earlier_losses_(static_cast<std::size_t>(size), false) {}

std::string PeerRecords::key(std::string_view what, int rank) const {
  return fmt::format("{}{}/{}", prefix_, what, rank);
}

void PeerRecords::forget_earlier_losses() {
  for (int q = 0; q < size_; ++q) {
    earlier_losses_[static_cast<std::size_t>(q)] = q != rank_ && store_->check(lost_rank_key(q));
  }
}

bool PeerRecords::record_failure(std::uint64_t issued, FailureCause cause, std::string_view call) noexcept {
  try {
    if (!call.empty()) store_->set(failed_call_key(rank_), bytes_of(call));
    store_->set(key("progress", rank_), bytes_of(fmt::format("{} {}", issued, cause_name(cause))));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void PeerRecords::record_abort(std::uint64_t issued, std::string_view reason) noexcept {
  try {
    // The reason first: a peer that sees the progress record looks for it.
    store_->set(key("aborted", rank_), bytes_of(reason));
  } catch (const std::exception&) {
    return;  // the store is gone too: the peers will say so themselves
  }
  record_failure(issued, FailureCause::kAborted);
}

bool PeerRecords::lost_now(int rank) {
  return !earlier_losses_[static_cast<std::size_t>(rank)] && store_->check(lost_rank_key(rank));
}

bool PeerRecords::peer_failed() {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_ && (store_->check(key("progress", q)) || lost_now(q))) return true;
  }
  return false;
}

std::vector<int> PeerRecords::lost_peers() {
  std::vector<int> lost;
  for (int q = 0; q < size_; ++q) {
    if (q != rank_ && lost_now(q)) lost.push_back(q);
  }
  return lost;
}

PeerSurvey PeerRecords::survey(std::uint64_t seq, std::chrono::milliseconds grace, bool stop_at_culprit) {
  PeerSurvey s;
  const auto n = static_cast<std::size_t>(size_);
  std::vector<bool> reached(n, false), lost(n, false), aborted(n, false);
  std::vector<std::string> elsewhere(n);  // the call a peer that never reached this one failed in
  reached[static_cast<std::size_t>(rank_)] = true;
  const auto deadline = Clock::now() + grace;
  try {
    while (true) {
      for (int q = 0; q < size_; ++q) {
        const auto qu = static_cast<std::size_t>(q);
        if (q == rank_) continue;
        if (!reached[qu] && store_->check(key("progress", q))) {
          const Progress p = parse_progress(store_->get(key("progress", q), grace));
          reached[qu] = p.issued >= seq + 1;
          if (reached[qu] && p.issued == seq + 1 && p.timed_out) s.peer_timed_out = true;
        }
        if (!lost[qu] && lost_now(q)) lost[qu] = true;
        if (!reached[qu] && elsewhere[qu].empty() && !store_->check(key("progress", q)) &&
            store_->check(failed_call_key(q))) {
          const std::vector<char> call = store_->get(failed_call_key(q), grace);
          elsewhere[qu].assign(call.begin(), call.end());
        }
        if (!aborted[qu] && store_->check(key("aborted", q))) {
          const std::vector<char> reason = store_->get(key("aborted", q), grace);
          aborted[qu] = true;
          s.aborted.emplace_back(q, std::string(reason.begin(), reason.end()));
        }
      }
      bool accounted = true, culprit = false;
      for (std::size_t q = 0; q < n; ++q) {
        accounted = accounted && (reached[q] || lost[q] || aborted[q] || !elsewhere[q].empty());
        culprit = culprit || lost[q] || aborted[q];
      }
      if (accounted || (stop_at_culprit && culprit) || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(kSurveyPoll);
    }
  } catch (const std::exception& e) {
    s.store_reachable = false;
    s.store_error = e.what();
  }
  for (int q = 0; q < size_; ++q) {
    const auto qu = static_cast<std::size_t>(q);
    if (lost[qu]) {
      s.lost.push_back(q);
    } else if (!reached[qu] && !aborted[qu]) {
      s.behind.push_back(q);
      if (!elsewhere[qu].empty()) s.elsewhere.emplace_back(q, elsewhere[qu]);
    }
  }
  return s;
}

std::string PeerRecords::names(const std::vector<int>& ranks) const { return rank_names(labels_, ranks, size_); }

std::string PeerRecords::lost_message(const std::vector<int>& lost) const {
  return fmt::format("lost {}: {} process died (the store saw its connection close)", names(lost),
                     lost.size() == 1 ? "its" : "their");
}

std::string PeerRecords::store_unreachable_message(std::string_view how) const {
  return fmt::format(
      "the store at {} is unreachable{}: the process serving it (tandem-run on the first node, else {}) has "
      "died or stopped, or the network to it is cut",
      store_->address(), how, chief_);
}

}  // namespace tandem::collective::detail
