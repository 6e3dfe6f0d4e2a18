// tandem/base/spin.h — polling waits for the short gaps between a training step's phases.
//
// A thread woken from a condition variable on a VM takes tens of microseconds, longer than many
// of the waits between kernels, replicas and collectives; so waiters poll for a bounded budget
// first and sleep only after it. Polling pays only while every polling thread has a core of its
// own: owners take their budget from spin_budget() (base/wait_policy.h), which is zero when their
// threads outnumber the cores or under TANDEM_WAIT_POLICY=passive, and poll_for stops polling
// after its first few polls while the adaptive policy has seen spinners lose their cores to other
// processes.
#pragma once

#include <chrono>
#include <thread>

#include "tandem/base/wait_policy.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tandem {

// One polling pause: tells the core this is a spin loop (x86 PAUSE), else yields.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Polls `done` until it returns true or `budget` has passed; returns whether it did. The clock is
// read only after the first polls have failed (most waits are shorter than a clock read's worth).
// Those first polls (a few microseconds) run whatever the wait policy says: they cost a busy
// machine nothing worth a time slice and save a wake-up when the peer is right behind. After
// them, polling stops while the policy says no (spin_allowed), and when this thread has lost its
// core in the middle (two clock reads kPreemptionGap apart: the machine has no core to spare), it
// says so even if `done` turned true meanwhile: a spinner is often preempted while the thread it
// waits for moves on, and finds its wait over when it gets a core back.
template <class Done>
bool poll_for(std::chrono::microseconds budget, Done&& done) {
  if (budget.count() <= 0) return done();
  constexpr int kPollsPerClockRead = 64;
  for (int i = 0; i < kPollsPerClockRead; ++i) {
    if (done()) return true;
    cpu_relax();
  }
  if (!spin_allowed()) return done();
  auto last = std::chrono::steady_clock::now();
  const auto until = last + budget;
  while (true) {
    bool finished = false;
    for (int i = 0; i < kPollsPerClockRead && !finished; ++i) {
      finished = done();
      if (!finished) cpu_relax();
    }
    const auto now = std::chrono::steady_clock::now();
    if (now - last >= kPreemptionGap && spinner_preempted()) return finished || done();
    if (finished) return true;
    if (now >= until || !spin_allowed()) return done();
    last = now;
  }
}

}  // namespace tandem
