// tandem/devices/detail/thread_pool.h — the fork-join pool behind a CPU device's parallel_for.
//
// One pool per logical CPU device, with (threads - 1) workers: the thread that calls
// parallel_for is the last worker. Between the kernels of a step, workers and the caller poll
// briefly (a pause loop, no system calls; base/wait_policy.h says how long) before sleeping on a
// condition variable: a training step issues kernel after kernel, and a sleeping thread takes
// tens of microseconds to wake on a VM. An idle device sleeps, and N replicas never compete for
// cores they do not own.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "tandem/base/function_ref.h"

namespace tandem::devices::detail {

class ThreadPool {
 public:
  // num_threads counts the calling thread: ThreadPool(1) has no workers and runs inline.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // See Device::parallel_for. Blocks until all chunks are done.
  void parallel_for(std::int64_t n, std::int64_t min_grain, FunctionRef<void(std::int64_t, std::int64_t)> fn);

 private:
  struct Job {
    FunctionRef<void(std::int64_t, std::int64_t)>* fn = nullptr;
    std::int64_t n = 0;
    std::int64_t chunk = 1;
    std::int64_t num_chunks = 0;
    std::atomic<std::int64_t> next_chunk{0};
    std::atomic<std::int64_t> chunks_done{0};
    std::exception_ptr error;
    std::mutex error_mutex;
  };

  void worker_loop();
  void run_chunks(Job& job);

  // How long workers poll for the next job and the caller for the workers (spin_budget).
  const std::chrono::microseconds worker_spin_, caller_spin_;
  std::vector<std::thread> workers_;
  std::mutex submit_mutex_;  // one job at a time; a second caller runs inline

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  Job* job_ = nullptr;                        // guarded by mutex_
  std::atomic<int> workers_in_job_{0};        // taken under mutex_: the job outlives them all
  std::atomic<std::uint64_t> generation_{0};  // bumped (under mutex_) for each new job
  bool stopping_ = false;
};

}  // namespace tandem::devices::detail
