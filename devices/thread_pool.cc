#include "tandem/devices/detail/thread_pool.h"

#include "tandem/base/spin.h"
#include "tandem/devices/device.h"

#include <algorithm>
#include <chrono>

namespace tandem::devices::detail {
namespace {
// A worker that finished a job polls this long for the next one before it sleeps: longer than
// the gaps between a step's kernels, short enough that an idle device is idle.
constexpr auto kWorkerSpin = std::chrono::microseconds(2000);
// The caller, done with its own chunks, polls this long for the workers before it sleeps.
constexpr auto kCallerSpin = std::chrono::microseconds(500);

// Chunks per thread: a little over-decomposition evens out uneven chunks.
constexpr std::int64_t kChunksPerThread = 4;

thread_local bool tls_inside_pool_job = false;
}  // namespace

ThreadPool::ThreadPool(int num_threads)
    : worker_spin_(spin_budget(kWorkerSpin, num_threads, usable_cpu_cores())),
      caller_spin_(spin_budget(kCallerSpin, num_threads, usable_cpu_cores())) {
  const int workers = std::max(0, num_threads - 1);
  workers_.reserve(static_cast<std::size_t>(workers));
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::run_chunks(Job& job) {
  const bool was_inside = tls_inside_pool_job;
  tls_inside_pool_job = true;
  while (true) {
    const std::int64_t c = job.next_chunk.fetch_add(1, std::memory_order_relaxed);
    if (c >= job.num_chunks) break;
    const std::int64_t begin = c * job.chunk;
    const std::int64_t end = std::min(job.n, begin + job.chunk);
    try {
      (*job.fn)(begin, end);
    } catch (...) {
      std::lock_guard lock(job.error_mutex);
      if (!job.error) job.error = std::current_exception();
    }
    job.chunks_done.fetch_add(1, std::memory_order_acq_rel);
  }
  tls_inside_pool_job = was_inside;
}

void ThreadPool::worker_loop() {
  std::uint64_t seen_generation = 0;
  while (true) {
    Job* job = nullptr;
    // Poll briefly without the lock, then sleep.
    poll_for(worker_spin_, [&] { return generation_.load(std::memory_order_acquire) != seen_generation; });
    {
      std::unique_lock lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen_generation; });
      if (stopping_) return;
      seen_generation = generation_.load(std::memory_order_relaxed);
      job = job_;
      if (job != nullptr) workers_in_job_.fetch_add(1, std::memory_order_relaxed);
    }
    if (job != nullptr) {
      run_chunks(*job);
      workers_in_job_.fetch_sub(1, std::memory_order_acq_rel);
      std::lock_guard lock(mutex_);  // a caller that went to sleep must not miss this
      work_done_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(std::int64_t n, std::int64_t min_grain,
                              FunctionRef<void(std::int64_t, std::int64_t)> fn) {
  if (n <= 0) return;
  min_grain = std::max<std::int64_t>(1, min_grain);
  const std::int64_t threads = num_threads();
  if (threads == 1 || n <= min_grain || tls_inside_pool_job) {
    fn(0, n);
    return;
  }
  std::unique_lock submit(submit_mutex_, std::try_to_lock);
  if (!submit.owns_lock()) {  // another thread is using this device's pool: stay on our core
    fn(0, n);
    return;
  }
  Job job;
  job.fn = &fn;
  job.n = n;
  const std::int64_t max_chunks = std::min(threads * kChunksPerThread, (n + min_grain - 1) / min_grain);
  job.chunk = (n + max_chunks - 1) / max_chunks;
  job.num_chunks = (n + job.chunk - 1) / job.chunk;
  {
    std::lock_guard lock(mutex_);
    job_ = &job;
    generation_.fetch_add(1, std::memory_order_release);
  }
  work_ready_.notify_all();
  run_chunks(job);
  {
    std::lock_guard lock(mutex_);
    job_ = nullptr;  // from here on no worker can pick the job up; the ones that did are counted
  }
  // Wait for the chunks, and for every worker that picked the job up to let go of it: the job
  // lives on this stack frame.
  const auto finished = [&] {
    return job.chunks_done.load(std::memory_order_acquire) == job.num_chunks &&
           workers_in_job_.load(std::memory_order_acquire) == 0;
  };
  if (!poll_for(caller_spin_, finished)) {
    std::unique_lock lock(mutex_);
    work_done_.wait(lock, finished);
  }
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace tandem::devices::detail
