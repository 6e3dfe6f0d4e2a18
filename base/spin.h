// tandem/base/spin.h — polling waits for the short gaps between a training step's phases.
//
// A thread woken from a condition variable on a VM takes tens of microseconds, longer than many
// of the waits between kernels, replicas and collectives; so waiters poll for a bounded budget
// first and sleep only after it. Polling pays only while every polling thread has a core of its
// own: callers pass a zero budget when their threads outnumber the cores.
#pragma once

#include <chrono>
#include <thread>

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
template <class Done>
bool poll_for(std::chrono::microseconds budget, Done&& done) {
  constexpr int kPollsPerClockRead = 64;
  for (int i = 0; i < kPollsPerClockRead; ++i) {
    if (done()) return true;
    cpu_relax();
  }
  const auto until = std::chrono::steady_clock::now() + budget;
  while (true) {
    for (int i = 0; i < kPollsPerClockRead; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= until) return done();
  }
}

}  // namespace tandem
