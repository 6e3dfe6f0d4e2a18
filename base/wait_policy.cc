#include "tandem/base/wait_policy.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include "tandem/base/detail/spin_gate.h"
#include "tandem/base/env.h"
#include "tandem/base/errors.h"

namespace tandem {
namespace {

std::atomic<detail::LoadProbe> load_probe{&detail::machine_full};

std::int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

WaitPolicy parse_wait_policy(std::string_view value) {
  // The env table's rules: blank is the default; otherwise one of the listed words, any case.
  const bool blank = value.find_first_not_of(" \t\n\r") == std::string_view::npos;
  const std::string word =
      blank ? std::string(env::kWaitPolicy.default_value) : env::parse_choice(env::kWaitPolicy, value);
  if (word == "active") return WaitPolicy::kActive;
  if (word == "passive") return WaitPolicy::kPassive;
  return WaitPolicy::kAdaptive;
}

WaitPolicy wait_policy() {
  static const WaitPolicy policy = parse_wait_policy(env::get_string(env::kWaitPolicy));
  return policy;
}

std::chrono::microseconds spin_budget(std::chrono::microseconds nominal, int threads, int cores) {
  if (wait_policy() == WaitPolicy::kPassive || threads > cores) return std::chrono::microseconds(0);
  return nominal;
}

namespace {
// The policy, for the checks that must not throw: the owners' constructors have reported a bad
// value already (spin_budget), and a waiter that meets one anyway does not spin.
WaitPolicy wait_policy_or_passive() noexcept {
  try {
    return wait_policy();
  } catch (...) {
    return WaitPolicy::kPassive;
  }
}
}  // namespace

bool spin_allowed() noexcept {
  switch (wait_policy_or_passive()) {
    case WaitPolicy::kActive: return true;
    case WaitPolicy::kPassive: return false;
    case WaitPolicy::kAdaptive: break;
  }
  return detail::process_spin_gate().open(steady_now_ns, [] { return load_probe.load(std::memory_order_relaxed)(); });
}

bool spinner_preempted() noexcept {
  if (wait_policy_or_passive() != WaitPolicy::kAdaptive) return false;
  // The core may have gone to one of our own threads (the input pipeline's, a communication
  // thread): that is no reason to stop spinning, and on an idle machine it is the usual reason.
  // Only other processes' demand starts a quiet period. The look costs a few small reads of /proc,
  // after a spin that has just lost a quarter of a millisecond anyway.
  if (!load_probe.load(std::memory_order_relaxed)()) return false;
  try {
    detail::process_spin_gate().preempted(steady_now_ns());
  } catch (...) {  // std::mutex::lock may throw system_error in theory; a lost report is harmless
  }
  return true;
}

namespace detail {

bool loadavg_says_full(std::string_view loadavg, long cores, int own_runnable) {
  // "0.52 0.58 0.59 3/121 4567": the fourth field is runnable / all threads.
  std::size_t at = 0;
  for (int field = 0; field < 3; ++field) {
    at = loadavg.find(' ', at);
    if (at == std::string_view::npos) return false;
    ++at;
  }
  int running = 0;
  const auto [end, ec] = std::from_chars(loadavg.data() + at, loadavg.data() + loadavg.size(), running);
  if (ec != std::errc() || end == loadavg.data() + loadavg.size() || *end != '/' || cores <= 0) return false;
  // Our own threads crowding the cores is the owners' business (spin_budget's thread count); the
  // policy yields to other processes.
  return running > cores && running > own_runnable;
}

int own_runnable_threads() {
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return 0;
  int runnable = 0;
  while (const dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    // "1234 (name) R ...": the state follows the last ')' (a thread's name may hold one).
    const int fd = openat(dirfd(tasks), (std::string(entry->d_name) + "/stat").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;  // the thread has ended
    char text[256];
    const ssize_t length = read(fd, text, sizeof(text));
    close(fd);
    const std::string_view stat(text, static_cast<std::size_t>(std::max<ssize_t>(0, length)));
    const std::size_t paren = stat.rfind(')');
    if (paren != std::string_view::npos && paren + 2 < stat.size() && stat[paren + 2] == 'R') ++runnable;
  }
  closedir(tasks);
  return runnable;
}

bool machine_full() {
  // A few small reads, once per quiet period at most.
  char text[128];
  std::FILE* file = std::fopen("/proc/loadavg", "r");
  if (file == nullptr) return false;
  const std::size_t length = std::fread(text, 1, sizeof(text), file);
  std::fclose(file);
  return loadavg_says_full(std::string_view(text, length), sysconf(_SC_NPROCESSORS_ONLN), own_runnable_threads());
}

LoadProbe set_load_probe(LoadProbe probe) { return load_probe.exchange(probe); }

SpinGate& process_spin_gate() {
  static SpinGate gate;
  return gate;
}

bool SpinGate::open_at(std::int64_t now_ns, FunctionRef<bool()> machine_full) {
  if (now_ns < quiet_until_.load(std::memory_order_relaxed)) return false;
  std::lock_guard lock(mutex_);
  if (!quiet_.load(std::memory_order_relaxed)) return true;  // another waiter ended it
  if (now_ns < quiet_until_.load(std::memory_order_relaxed)) return false;
  if (machine_full()) {
    start_quiet_locked(now_ns);
    return false;
  }
  quiet_.store(false, std::memory_order_relaxed);
  return true;
}

void SpinGate::preempted(std::int64_t now_ns) {
  std::lock_guard lock(mutex_);
  if (quiet_.load(std::memory_order_relaxed)) return;  // another spinner lost its core to the same load
  start_quiet_locked(now_ns);
}

void SpinGate::start_quiet_locked(std::int64_t now_ns) {
  const std::int64_t last_end = quiet_until_.load(std::memory_order_relaxed);
  const bool still_busy = quiet_length_ > 0 && now_ns - last_end < quiet_length_;
  quiet_length_ = still_busy ? std::min(2 * quiet_length_, options_.longest_quiet_ns) : options_.first_quiet_ns;
  quiet_until_.store(now_ns + quiet_length_, std::memory_order_relaxed);
  quiet_.store(true, std::memory_order_relaxed);
}

std::int64_t SpinGate::quiet_length_ns() const {
  std::lock_guard lock(mutex_);
  return quiet_length_;
}

}  // namespace detail
}  // namespace tandem
