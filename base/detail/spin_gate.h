// tandem/base/detail/spin_gate.h — the adaptive wait policy's state (see base/wait_policy.h).
//
// Who calls it: spin_allowed() and spinner_preempted() (base/wait_policy.cc) on the process's
// gate, and tests on their own gates with made-up times and loads (or on the process's gate with
// a made-up load probe). Never blocks beyond its own
// mutex; never throws but for std::mutex's system_error.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string_view>

#include "tandem/base/function_ref.h"

namespace tandem::detail {

// The adaptive policy's state, shared by every waiter of the process (the machine's load is the
// same for all). A spinner that loses its core starts a quiet period, during which nobody spins.
// When it ends, the machine's load decides (machine_full): if other processes still want the
// cores, the next period follows at once; else waiters spin again (and the next preemption starts
// a new period). Periods double while the load lasts (a preemption or a full machine
// within one period's length after the last one ended) up to longest_quiet_ns, and start over
// at first_quiet_ns after a spell of spinning as long as the last period.
//
// Times are nanoseconds of any monotonic clock and the load is a callable, passed in so that
// tests can drive the gate. Thread-safe: while no quiet period is on, the check is one relaxed
// load (no clock read); reports and the end of a period take a mutex (they come at most once per
// time slice lost and once per period).
class SpinGate {
 public:
  struct Options {
    std::int64_t first_quiet_ns = 50'000'000;
    std::int64_t longest_quiet_ns = 2'000'000'000;
  };
  SpinGate() : SpinGate(Options{}) {}
  explicit SpinGate(Options options) : options_(options) {}

  // Whether a waiter may spin now. `now()` gives the time and `machine_full()` whether other
  // processes want the cores; they are called only while a quiet period is on, and when it ends.
  template <class Now>
  bool open(Now&& now, FunctionRef<bool()> machine_full) {
    if (!quiet_.load(std::memory_order_relaxed)) return true;
    return open_at(now(), machine_full);
  }
  bool open_at(std::int64_t now_ns, FunctionRef<bool()> machine_full);

  // A spinner lost its core at `now_ns`: starts a quiet period unless one is on.
  void preempted(std::int64_t now_ns);

  // For tests and diagnostics: the current or last quiet period's end and length (0 before the
  // first).
  std::int64_t quiet_until_ns() const { return quiet_until_.load(std::memory_order_relaxed); }
  std::int64_t quiet_length_ns() const;

 private:
  void start_quiet_locked(std::int64_t now_ns);

  const Options options_;
  std::atomic<bool> quiet_{false};            // a quiet period was set and not yet seen to end
  std::atomic<std::int64_t> quiet_until_{0};  // its end
  mutable std::mutex mutex_;                  // serialises reports and ends
  std::int64_t quiet_length_ = 0;             // guarded by mutex_
};

// The process's gate (what spin_allowed and spinner_preempted consult), for tests.
SpinGate& process_spin_gate();

// Whether the machine has no core to spare for polling: more runnable threads than online cores
// (/proc/loadavg), some of them another process's (ours are counted in /proc/self/task). False
// when it cannot tell.
bool machine_full();
// What the process's gate asks about the load (when a spinner lost its core, and when a quiet
// period ends): machine_full, unless a test has set another probe. Returns the previous one.
using LoadProbe = bool (*)();
LoadProbe set_load_probe(LoadProbe probe);
// The same judgement on a /proc/loadavg text, a core count and our runnable threads.
bool loadavg_says_full(std::string_view loadavg, long cores, int own_runnable);
// This process's runnable threads (the caller included).
int own_runnable_threads();

}  // namespace tandem::detail
