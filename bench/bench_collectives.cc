// bench_collectives — all_reduce (SUM, float32, in place) of the in-process group, one thread per
// rank, next to the memory-copy bandwidth the same threads reach in the same run on buffers of
// the same size; then the Gloo communicator across processes next to raw Gloo and the
// shared-memory communicator in the same processes. See bench/README.md for what the ceiling is
// and why.
//
//   bench_collectives [--ranks 2,4] [--gloo-ranks 2,4] [--min 4K] [--max 256M] [--gloo-max 64M]
//                     [--factor 4] [--iters N] [--samples N] [--gloo-samples 9] [--gloo-check]
//                     [--gloo-pack BYTES] [--gloo-algorithm ordered|ring]
//
// Columns follow nccl-tests: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n (the rate at
// which a ring all-reduce moves data over its busiest link; it makes rank counts comparable).
//
// The ceiling. An in-place all-reduce in shared memory must read every rank's buffer once and
// write every rank's buffer once: at least 2 * n * bytes of memory traffic, however it is done.
// The same n threads, each on a buffer of `bytes` of its own, move memory at `copy GB/s` (bytes
// read + written): the better of two passes, a memcpy (one half of the buffer onto the other and
// back) and an in-place read-modify-write (x[i] += c over n parts side by side) which, like the
// all-reduce at n ranks, walks n streams and writes lines it has just read. No all-reduce can take less than t_min = 2
// * n * bytes / copy GB/s. "bound" is the busbw at t_min, copy GB/s * (n - 1) / n^2, and "ratio" is busbw / bound =
// t_min / time. "moved" is the all-reduce's own rate of that least traffic, 2 * n * bytes / time.
//
// Timing. Each sample is the mean over back-to-back calls (all ranks start together; the sample
// is the slowest rank's), and the table shows the median of --samples samples. All-reduce and
// copy samples alternate, so a noisy phase of a shared machine reaches both.
//
// Gloo. `--gloo-ranks n` runs n processes on 127.0.0.1: this one is rank 0 (it serves the
// TcpStore on a free port) and re-executes itself as ranks 1..n-1 (`--gloo-worker RANK N
// ADDRESS` plus the same options). Each process holds two Gloo meshes, each with its own
// buffers: tandem's (make_gloo_communicator, Communicator::all_reduce) and a raw one
// (gloo::rendezvous::Context over the same store under another prefix, gloo::allreduce ring with
// the options built once per size, as a careful direct user would); and, as a third column,
// tandem's shared-memory communicator (make_shared_memory_communicator, default slot_bytes),
// which needs no network at all. Their samples alternate, the order rotated every sample; a
// sample starts after a barrier and is the slowest rank's time (an all-reduce MAX of the ranks'
// elapsed times, outside the timed region). ours/raw is the throughput ratio raw time / our time
// of each back-to-back pair of samples (median and range over --gloo-samples pairs); shm/raw
// likewise for the shared-memory communicator. Ours all-reduces with --gloo-algorithm: `ordered`
// (GlooAllReduceAlgorithm::kRankOrdered, the default) or `ring` (kRing, Gloo's ring, what raw gloo
// runs): with `ordered`, ours/raw is the rank-ordered algorithm's cost against the ring.
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "machine_info.h"
#include "tandem/collective/communicator.h"
#include "tandem/collective/gloo.h"
#include "tandem/collective/in_process.h"
#include "tandem/collective/shared_memory.h"
#include "tandem/collective/tcp_store.h"
#include "tandem/devices/device.h"

extern char** environ;  // the children of the Gloo section inherit ours

namespace {

using namespace tandem;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<int> ranks = {2, 4};       // in-process group sizes; {0}: skip
  std::vector<int> gloo_ranks = {2, 4};  // process counts of the Gloo section; {0}: skip
  std::size_t min_bytes = 4 << 10;
  std::size_t max_bytes = 256 << 20;
  std::size_t gloo_max_bytes = 64 << 20;  // the Gloo section stops at min(--max, --gloo-max)
  int factor = 4;
  int iters = 0;  // 0: enough calls for ~20 ms per sample (~40 ms per variant for Gloo)
  int samples = 5;
  int gloo_samples = 9;                    // the Gloo section is noisier (two processes per core at 4 ranks)
  bool gloo_check = false;                 // GlooOptions::check_consistency for ours
  std::int64_t gloo_pack_bytes = 0;        // GlooOptions::bytes_per_pack for ours
  std::string gloo_algorithm = "ordered";  // GlooOptions::all_reduce_algorithm for ours: ordered or ring
};

constexpr double kSampleSeconds = 0.02;
// Gloo calls cost tens of microseconds to hundreds of milliseconds: a sample of each variant is
// ~50 ms of calls, at least one call, which keeps the default Gloo section well under a minute.
constexpr double kGlooSampleSeconds = 0.05;
constexpr double kGlooWarmupSeconds = 0.02;
// Every Gloo wait (connecting, each collective) and the store's connect give up after this: a
// dead or hung rank ends the run with an error instead of a hang.
constexpr std::chrono::milliseconds kGlooTimeout = std::chrono::seconds(60);
// How long rank 0 waits for its children to exit after the last collective.
constexpr std::chrono::seconds kChildExitTimeout = std::chrono::seconds(30);

std::string size_text(std::size_t bytes) {
  if (bytes >= (1u << 30) && bytes % (1u << 30) == 0) return fmt::format("{} GiB", bytes >> 30);
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= (1u << 10) && bytes % (1u << 10) == 0) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// The read-modify-write pass of the ceiling: x[i] += c over the thread's own buffer, cut into
// `streams` parts walked side by side: the all-reduce's access pattern at n ranks (rank r walks
// chunk r of n buffers, reading and writing each), without its sharing and synchronisation. It
// writes lines it has just read, so there is no read-for-ownership; a memcpy below glibc's
// non-temporal threshold reads its destination first, and so moves 3 bytes for every 2 counted.
[[gnu::noinline]] void add_in_place(float* __restrict x, std::size_t n, int streams, float c) {
  const std::size_t per = n / static_cast<std::size_t>(streams);
  if (streams == 2) {
    float* __restrict y = x + per;
    for (std::size_t i = 0; i < per; ++i) {
      x[i] += c;
      y[i] += c;
    }
    return;
  }
  constexpr std::size_t kBlock = 1024;
  for (std::size_t base = 0; base < per; base += kBlock) {
    const std::size_t len = std::min(kBlock, per - base);
    for (int q = 0; q < streams; ++q) {
      float* __restrict p = x + static_cast<std::size_t>(q) * per + base;
      for (std::size_t i = 0; i < len; ++i) p[i] += c;
    }
  }
}

struct Row {
  std::size_t bytes = 0;
  double allreduce_seconds = 0;  // per call
  double copy_seconds = 0;       // per call: 2 * bytes moved by each thread, memcpy
  double rmw_seconds = 0;        // per call: 2 * bytes moved by each thread, in place
};

// Runs the whole schedule for one rank count on n threads (one per rank) and returns the rows.
std::vector<Row> measure(int n, const std::vector<std::size_t>& sizes, const Options& options) {
  auto group = collective::make_in_process_group(n);
  std::vector<Row> rows(sizes.size());
  // Per sample, each rank's seconds per call; the sample is the slowest rank's.
  std::vector<double> rank_seconds(static_cast<std::size_t>(n));
  std::vector<double> samples[3];  // all_reduce, memcpy, read-modify-write
  std::barrier sync(n);
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  int iters = 0;  // calls per sample, set by rank 0 for every size

  const auto rank_main = [&](int rank) {
    try {
      collective::Communicator& comm = *group[static_cast<std::size_t>(rank)];
      for (std::size_t s = 0; s < sizes.size(); ++s) {
        const std::size_t bytes = sizes[s];
        const std::int64_t count = static_cast<std::int64_t>(bytes / sizeof(float));
        // Each rank allocates and first touches its own buffers, as a replica's would be.
        Tensor buffer = Tensor::filled<float>({count}, 1e-3f);
        Tensor scratch = Tensor::filled<float>({count}, 0.0f);
        auto* half_a = reinterpret_cast<std::byte*>(scratch.data<float>());
        std::byte* half_b = half_a + bytes / 2;
        const auto all_reduce = [&] { comm.all_reduce(buffer, collective::ReduceOp::kSum); };
        const auto copy = [&] {
          std::memcpy(half_b, half_a, bytes / 2);
          std::memcpy(half_a, half_b, bytes / 2);
        };
        float sign = 1;
        const auto rmw = [&] {
          add_in_place(scratch.data<float>(), static_cast<std::size_t>(count), n, sign * 1e-3f);
          sign = -sign;
        };
        // Calls per sample: from one timed warm-up call of each, agreed by all ranks (rank 0's).
        all_reduce();
        copy();
        rmw();
        const auto t0 = Clock::now();
        all_reduce();
        copy();
        const double warm = std::chrono::duration<double>(Clock::now() - t0).count();
        sync.arrive_and_wait();
        if (rank == 0) {
          iters = options.iters > 0 ? options.iters
                                    : static_cast<int>(std::clamp(kSampleSeconds / std::max(warm, 1e-7), 2.0, 20000.0));
          for (auto& v : samples) v.clear();
        }
        sync.arrive_and_wait();
        for (int sample = 0; sample < options.samples; ++sample) {
          for (int which = 0; which < 3; ++which) {
            sync.arrive_and_wait();
            const auto start = Clock::now();
            for (int i = 0; i < iters; ++i) {
              if (which == 0) {
                all_reduce();
              } else if (which == 1) {
                copy();
              } else {
                rmw();
              }
            }
            rank_seconds[static_cast<std::size_t>(rank)] =
                std::chrono::duration<double>(Clock::now() - start).count() / iters;
            sync.arrive_and_wait();
            if (rank == 0) {
              const double slowest = *std::max_element(rank_seconds.begin(), rank_seconds.end());
              samples[which].push_back(slowest);
            }
          }
        }
        sync.arrive_and_wait();
        if (rank == 0) rows[s] = {bytes, median(samples[0]), median(samples[1]), median(samples[2])};
      }
    } catch (const std::exception& e) {
      // Let the other ranks out: their collectives throw Unavailable, and the thread barrier
      // no longer counts this one.
      errors[static_cast<std::size_t>(rank)] = e.what();
      group[static_cast<std::size_t>(rank)]->abort(e.what());
      sync.arrive_and_drop();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (!e.empty()) throw std::runtime_error(e);
  }
  return rows;
}

// One all-reduce with known values on every rank: the bench times a correct collective.
void check_correctness(int n) {
  auto group = collective::make_in_process_group(n);
  const std::int64_t count = (1 << 16) + 5;
  std::vector<int> wrong(static_cast<std::size_t>(n), 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Tensor t = Tensor::filled<float>({count}, static_cast<float>(r + 1));
      group[static_cast<std::size_t>(r)]->all_reduce(t, collective::ReduceOp::kSum);
      const float expected = static_cast<float>(n * (n + 1) / 2);
      for (float x : t.to_vector<float>()) wrong[static_cast<std::size_t>(r)] += x != expected;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (wrong[static_cast<std::size_t>(r)] != 0) {
      throw Internal(fmt::format("bench_collectives: all_reduce over {} ranks gave {} wrong values on rank {}", n,
                                 wrong[static_cast<std::size_t>(r)], r));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Gloo: tandem's communicator next to raw Gloo, n processes on 127.0.0.1.

// Our Store as gloo's rendezvous store, under the raw mesh's own prefix (tandem's communicator
// keeps its keys under "tandem/gloo/").
class RawStoreAdapter final : public gloo::rendezvous::Store {
 public:
  RawStoreAdapter(std::shared_ptr<collective::Store> store, std::string prefix)
      : store_(std::move(store)), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::vector<char>& data) override { store_->set(prefix_ + key, data); }
  std::vector<char> get(const std::string& key) override { return store_->get(prefix_ + key, kGlooTimeout); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, kGlooTimeout); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> prefixed;
    for (const auto& key : keys) prefixed.push_back(prefix_ + key);
    store_->wait(prefixed, timeout <= std::chrono::milliseconds(0) ? kGlooTimeout : std::min(timeout, kGlooTimeout));
  }

 private:
  std::shared_ptr<collective::Store> store_;
  std::string prefix_;
};

using GlooReduceFn = void (*)(void*, const void*, const void*, std::size_t);

// One process's raw Gloo mesh: the baseline's all-reduces, and the bench's own synchronisation
// (barriers, the MAX of elapsed times), which stay outside every timed region.
class RawGloo {
 public:
  RawGloo(int rank, int size, std::shared_ptr<collective::Store> store) {
    device_ = gloo::transport::tcp::CreateDevice(gloo::transport::tcp::attr("127.0.0.1"));
    context_ = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context_->setTimeout(kGlooTimeout);
    RawStoreAdapter adapter(std::move(store), "bench/raw-gloo/");
    context_->connectFullMesh(adapter, device_);
  }

  // An in-place SUM over data: the options (their unbound buffers) are made once, as tandem's
  // communicator caches them.
  class Allreduce {
   public:
    Allreduce(RawGloo& gloo, float* data, std::size_t count) : gloo_(gloo), options_(gloo.context_) {
      options_.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      options_.setOutput<float>(data, count);
      options_.setReduceFunction(static_cast<GlooReduceFn>(&gloo::sum<float>));
      options_.setTimeout(kGlooTimeout);
    }
    void operator()() {
      options_.setTag(gloo_.next_tag());
      gloo::allreduce(options_);
    }

   private:
    RawGloo& gloo_;
    gloo::AllreduceOptions options_;
  };

  void barrier() {
    gloo::BarrierOptions o(context_);
    o.setTag(next_tag());
    o.setTimeout(kGlooTimeout);
    gloo::barrier(o);
  }

  double max(double value) {
    gloo::AllreduceOptions o(context_);
    o.setOutput<double>(&value, 1);
    o.setReduceFunction(static_cast<GlooReduceFn>(&gloo::max<double>));
    o.setTag(next_tag());
    o.setTimeout(kGlooTimeout);
    gloo::allreduce(o);
    return value;
  }

 private:
  std::uint32_t next_tag() { return tag_++; }

  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::uint32_t tag_ = 0;
};

struct GlooRow {
  std::size_t bytes = 0;
  int calls = 0;            // per sample, each variant
  double ours_seconds = 0;  // per call, median over samples
  double raw_seconds = 0;   // per call, median over samples
  double shm_seconds = 0;   // per call, median over samples
  // raw / ours of each sample pair (the two variants' samples taken back to back): the median,
  // the lowest and the highest. Pairing cancels the slow drifts of a shared machine.
  double ratio = 0;
  double ratio_low = 0;
  double ratio_high = 0;
  double shm_ratio = 0;  // raw / shm, the median over sample pairs
};

std::vector<std::size_t> gloo_sizes(const Options& options) {
  std::vector<std::size_t> sizes;
  const std::size_t max_bytes = std::min(options.max_bytes, options.gloo_max_bytes);
  for (std::size_t b = options.min_bytes; b <= max_bytes; b *= static_cast<std::size_t>(options.factor)) {
    sizes.push_back(b);
  }
  return sizes;
}

// One rank's whole Gloo schedule (every rank runs it; rank 0 gets the rows).
std::vector<GlooRow> gloo_rank_main(int rank, int n, const std::string& store_address, const Options& options) {
  collective::TcpStoreOptions store_options;
  store_options.connect_timeout = kGlooTimeout;
  store_options.label_of_server = "bench_collectives rank 0";
  store_options.rank = rank;  // a rank that dies is then named by the communicator
  auto store = collective::connect_tcp_store(store_address, store_options);

  collective::GlooOptions gloo_options;
  gloo_options.rank = rank;
  gloo_options.size = n;
  gloo_options.store = store;
  gloo_options.listen_host = "127.0.0.1";
  gloo_options.timeout = kGlooTimeout;
  gloo_options.check_consistency = options.gloo_check;
  gloo_options.bytes_per_pack = options.gloo_pack_bytes;
  gloo_options.all_reduce_algorithm = options.gloo_algorithm == "ring"
                                          ? collective::GlooAllReduceAlgorithm::kRing
                                          : collective::GlooAllReduceAlgorithm::kRankOrdered;
  auto ours = collective::make_gloo_communicator(gloo_options);
  RawGloo raw(rank, n, store);
  auto shm =
      collective::make_shared_memory_communicator({.rank = rank, .size = n, .store = store, .timeout = kGlooTimeout});

  // Both must compute the right sum: the bench times correct collectives. Rank r holds r + 1.
  {
    const std::int64_t count = (1 << 16) + 5;
    const float expected = static_cast<float>(n * (n + 1) / 2);
    Tensor a = Tensor::filled<float>({count}, static_cast<float>(rank + 1));
    Tensor b = Tensor::filled<float>({count}, static_cast<float>(rank + 1));
    Tensor c = Tensor::filled<float>({count}, static_cast<float>(rank + 1));
    ours->all_reduce(a, collective::ReduceOp::kSum);
    RawGloo::Allreduce(raw, b.data<float>(), static_cast<std::size_t>(count))();
    shm->all_reduce(c, collective::ReduceOp::kSum);
    int wrong[3] = {0, 0, 0};
    for (float x : a.to_vector<float>()) wrong[0] += x != expected;
    for (float x : b.to_vector<float>()) wrong[1] += x != expected;
    for (float x : c.to_vector<float>()) wrong[2] += x != expected;
    if (wrong[0] + wrong[1] + wrong[2] > 0) {
      throw Internal(
          fmt::format("bench_collectives: all_reduce over {} processes gave {} wrong values (tandem gloo), "
                      "{} (raw gloo) and {} (shared memory) on rank {}",
                      n, wrong[0], wrong[1], wrong[2], rank));
    }
  }

  std::vector<GlooRow> rows;
  for (const std::size_t bytes : gloo_sizes(options)) {
    const std::int64_t count = static_cast<std::int64_t>(bytes / sizeof(float));
    Tensor ours_buffer = Tensor::filled<float>({count}, 1e-3f);
    Tensor raw_buffer = Tensor::filled<float>({count}, 1e-3f);
    Tensor shm_buffer = Tensor::filled<float>({count}, 1e-3f);
    RawGloo::Allreduce raw_all_reduce(raw, raw_buffer.data<float>(), static_cast<std::size_t>(count));
    const auto ours_all_reduce = [&] { ours->all_reduce(ours_buffer, collective::ReduceOp::kSum); };
    const auto shm_all_reduce = [&] { shm->all_reduce(shm_buffer, collective::ReduceOp::kSum); };

    // Calls per sample, from timed warm-up pairs (one call of each Gloo variant) until they add
    // up to kGlooWarmupSeconds: one pair alone is too noisy here (small calls take 0.1 or 0.6 ms,
    // depending on the scheduler). The slowest rank's total decides, so all ranks agree. The
    // shared-memory variant makes the same number of calls (it is faster: its samples are shorter).
    ours_all_reduce();
    raw_all_reduce();
    shm_all_reduce();
    double warm_total = 0;
    int warm_pairs = 0;
    while (warm_total < kGlooWarmupSeconds && warm_pairs < 1000) {
      raw.barrier();
      const auto t0 = Clock::now();
      ours_all_reduce();
      raw_all_reduce();
      warm_total += raw.max(std::chrono::duration<double>(Clock::now() - t0).count());
      ++warm_pairs;
    }
    const double warm = warm_total / warm_pairs;
    const int calls = options.iters > 0
                          ? options.iters
                          : static_cast<int>(std::clamp(2 * kGlooSampleSeconds / std::max(warm, 1e-7), 1.0, 20000.0));

    std::vector<double> samples[3];  // ours, raw, shm
    for (int sample = 0; sample < options.gloo_samples; ++sample) {
      for (int turn = 0; turn < 3; ++turn) {
        const int which = (sample + turn) % 3;  // the order rotates every sample
        raw.barrier();
        const auto start = Clock::now();
        for (int i = 0; i < calls; ++i) {
          if (which == 0) {
            ours_all_reduce();
          } else if (which == 1) {
            raw_all_reduce();
          } else {
            shm_all_reduce();
          }
        }
        const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
        samples[which].push_back(raw.max(elapsed) / calls);
      }
    }
    std::vector<double> ratios, shm_ratios;
    for (std::size_t k = 0; k < samples[0].size(); ++k) {
      ratios.push_back(samples[1][k] / samples[0][k]);
      shm_ratios.push_back(samples[1][k] / samples[2][k]);
    }
    rows.push_back({bytes, calls, median(samples[0]), median(samples[1]), median(samples[2]), median(ratios),
                    *std::min_element(ratios.begin(), ratios.end()), *std::max_element(ratios.begin(), ratios.end()),
                    median(shm_ratios)});
  }
  raw.barrier();  // nobody tears its mesh down while another rank still reads from it
  return rows;
}

// The arguments that make this program rank `rank` of a Gloo group: ours plus --gloo-worker.
std::vector<std::string> worker_arguments(const std::vector<std::string>& argv, int rank, int n,
                                          const std::string& store_address) {
  std::vector<std::string> args = argv;
  args.insert(args.end(), {"--gloo-worker", std::to_string(rank), std::to_string(n), store_address});
  return args;
}

std::string program_path() {
  char path[4096] = {};
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length <= 0) throw Unavailable("bench_collectives: cannot read /proc/self/exe to start the gloo ranks");
  return std::string(path, static_cast<std::size_t>(length));
}

// Rank 0: serves the store, starts ranks 1..n-1 as processes, runs its own part and collects the
// children. Any rank's failure fails the run (the children's errors go to stderr).
std::vector<GlooRow> measure_gloo(int n, const std::vector<std::string>& argv, const Options& options) {
  auto server = collective::TcpStoreServer::start("127.0.0.1", 0);
  const std::string address = server->address();
  const std::string program = program_path();
  std::vector<pid_t> children;
  // Waits for every child (killing those still running after `grace`); returns what went wrong.
  const auto reap = [&](std::chrono::milliseconds grace) {
    std::vector<std::string> failures;
    const auto deadline = Clock::now() + grace;
    for (std::size_t i = 0; i < children.size(); ++i) {
      const pid_t pid = children[i];
      const int rank = static_cast<int>(i) + 1;
      int status = 0;
      pid_t done = 0;
      while ((done = waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (done == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        failures.push_back(fmt::format("rank {} (pid {}) was still running and was killed", rank, pid));
      } else if (WIFSIGNALED(status)) {
        failures.push_back(fmt::format("rank {} (pid {}) died of signal {}", rank, pid, WTERMSIG(status)));
      } else if (WEXITSTATUS(status) != 0) {
        failures.push_back(fmt::format("rank {} (pid {}) exited with status {}", rank, pid, WEXITSTATUS(status)));
      }
    }
    children.clear();
    return failures;
  };
  try {
    for (int rank = 1; rank < n; ++rank) {
      const auto args = worker_arguments(argv, rank, n, address);
      std::vector<char*> c_args;
      c_args.push_back(const_cast<char*>(program.c_str()));
      for (std::size_t i = 1; i < args.size(); ++i) c_args.push_back(const_cast<char*>(args[i].c_str()));
      c_args.push_back(nullptr);
      pid_t pid = 0;
      if (const int rc = posix_spawn(&pid, program.c_str(), nullptr, nullptr, c_args.data(), environ); rc != 0) {
        throw Unavailable(
            fmt::format("bench_collectives: cannot start gloo rank {} ({}): {}", rank, program, std::strerror(rc)));
      }
      children.push_back(pid);
    }
    auto rows = gloo_rank_main(0, n, address, options);
    const auto failures = reap(kChildExitTimeout);
    if (!failures.empty()) {
      throw Internal(fmt::format("gloo section with {} processes: {}", n, fmt::join(failures, "; ")));
    }
    return rows;
  } catch (const std::exception& e) {
    // The children fail promptly too (their connections to this rank close); give them a moment
    // to say why on stderr.
    const auto failures = reap(std::chrono::seconds(3));
    throw Internal(fmt::format("gloo section with {} processes, rank 0: {}{}{}", n, e.what(),
                               failures.empty() ? "" : "; ", fmt::join(failures, "; ")));
  }
}

void print_gloo(int n, const std::vector<GlooRow>& rows, const Options& options) {
  const int rule = 167;
  fmt::print(
      "\nall_reduce SUM, float32, in place, Gloo over TCP on 127.0.0.1 and shared memory, {} processes{}, ours "
      "{}{}{}\n",
      n, n > devices::usable_cpu_cores() ? " (more processes than cores)" : "",
      options.gloo_algorithm == "ring" ? "ring" : "rank-ordered",
      options.gloo_check ? ", ours with check_consistency" : "",
      options.gloo_pack_bytes > 0 ? fmt::format(", ours with bytes_per_pack {}", options.gloo_pack_bytes) : "");
  fmt::print("{:-<{}}\n", "", rule);
  fmt::print("{:>8} {:>10} {:>6} | {:<33} | {:<33} | {:<18} | {:<33} | {}\n", "", "", "", "tandem gloo", "raw gloo",
             "ours/raw", "tandem shm", "shm/raw");
  fmt::print(
      "{:>8} {:>10} {:>6} | {:>11} {:>10} {:>10} | {:>11} {:>10} {:>10} | {:>6} {:>11} | {:>11} {:>10} {:>10} | "
      "{:>7}\n",
      "size", "count", "calls", "time us", "algbw GB/s", "busbw GB/s", "time us", "algbw GB/s", "busbw GB/s", "median",
      "range", "time us", "algbw GB/s", "busbw GB/s", "median");
  fmt::print("{:-<{}}\n", "", rule);
  double worst_large = 0;
  bool any_large = false;
  for (const GlooRow& row : rows) {
    const double bytes = static_cast<double>(row.bytes);
    const double bus = 2.0 * (n - 1) / n;
    const double ours_alg = bytes / row.ours_seconds / 1e9;
    const double raw_alg = bytes / row.raw_seconds / 1e9;
    const double shm_alg = bytes / row.shm_seconds / 1e9;
    const double ratio = row.ratio;
    if (row.bytes >= (16u << 20)) {
      worst_large = any_large ? std::min(worst_large, ratio) : ratio;
      any_large = true;
    }
    fmt::print(
        "{:>8} {:>10} {:>6} | {:>11.1f} {:>10.3f} {:>10.3f} | {:>11.1f} {:>10.3f} {:>10.3f} | {:>6.2f} {:>11} | "
        "{:>11.1f} {:>10.3f} {:>10.3f} | {:>7.2f}\n",
        size_text(row.bytes), row.bytes / sizeof(float), row.calls, row.ours_seconds * 1e6, ours_alg, ours_alg * bus,
        row.raw_seconds * 1e6, raw_alg, raw_alg * bus, ratio,
        fmt::format("{:.2f}-{:.2f}", row.ratio_low, row.ratio_high), row.shm_seconds * 1e6, shm_alg, shm_alg * bus,
        row.shm_ratio);
  }
  fmt::print("{:-<{}}\n", "", rule);
  if (any_large) {
    fmt::print("target ours/raw (median) >= 0.90 at >= 16 MiB: lowest {:.2f}, {}\n", worst_large,
               worst_large >= 0.9 ? "met" : "NOT met");
  }
}

int run(const Options& options, const std::vector<std::string>& argv) {
  std::vector<std::size_t> sizes;
  for (std::size_t b = options.min_bytes; b <= options.max_bytes; b *= static_cast<std::size_t>(options.factor)) {
    sizes.push_back(b);
  }
  fmt::print("tandem bench_collectives, {}\n", bench::now_text());
  fmt::print("CPU:           {}\n", bench::cpu_model());
  fmt::print("cores:         {} usable; memory {}\n", devices::usable_cpu_cores(), bench::memory_total());
  fmt::print("compiler:      GCC {}.{}.{}\n", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__);
  fmt::print("timing:        median of {} samples, each the mean over back-to-back calls ({}), slowest rank\n",
             options.samples, options.iters > 0 ? fmt::format("{} calls", options.iters) : "~20 ms of calls");
  fmt::print(
      "ceiling:       copy GB/s = the better of memcpy and an in-place read-modify-write pass, same threads,\n"
      "               same bytes per thread (read + written); an in-place all-reduce moves >= 2 n bytes:\n"
      "               bound busbw = copy GB/s * (n-1)/n^2; ratio = busbw / bound (bench/README.md)\n");
  fmt::print(
      "gloo:          tandem's make_gloo_communicator vs raw gloo::allreduce (ring, options made once per size)\n"
      "               and make_shared_memory_communicator (shm), in the same processes; {} samples of each,\n"
      "               rotating ({} per sample, at least 1 call); ours/raw = raw time / our time of each\n"
      "               back-to-back pair: median and range; shm/raw likewise\n",
      options.gloo_samples, options.iters > 0 ? fmt::format("{} calls", options.iters) : "~50 ms of calls");
  for (int n : options.ranks) {
    if (n == 0) continue;
    check_correctness(n);
    const auto rows = measure(n, sizes, options);
    const int rule = 130;
    fmt::print("\nall_reduce SUM, float32, in place, in-process group of {} ranks (one thread each{})\n", n,
               n > devices::usable_cpu_cores() ? "; more ranks than cores" : "");
    fmt::print("{:-<{}}\n", "", rule);
    fmt::print("{:>8} {:>10} {:>10} {:>10} {:>10} | {:>10} {:>10} {:>10} {:>11} {:>6} | {:>10}\n", "size", "count",
               "time us", "algbw GB/s", "busbw GB/s", "memcpy", "in-place", "copy GB/s", "bound busbw", "ratio",
               "moved GB/s");
    fmt::print("{:-<{}}\n", "", rule);
    for (const Row& row : rows) {
      const double bytes = static_cast<double>(row.bytes);
      const double algbw = bytes / row.allreduce_seconds / 1e9;
      const double busbw = algbw * 2.0 * (n - 1) / n;
      const double memcpy_gbps = 2.0 * n * bytes / row.copy_seconds / 1e9;  // read + written by n threads
      const double rmw_gbps = 2.0 * n * bytes / row.rmw_seconds / 1e9;
      const double copy_gbps = std::max(memcpy_gbps, rmw_gbps);
      const double bound = copy_gbps * (n - 1) / (static_cast<double>(n) * n);
      const double moved = 2.0 * n * bytes / row.allreduce_seconds / 1e9;  // the all-reduce's least traffic
      fmt::print(
          "{:>8} {:>10} {:>10.1f} {:>10.2f} {:>10.2f} | {:>10.1f} {:>10.1f} {:>10.1f} {:>11.2f} {:>6.2f} | {:>10.1f}\n",
          size_text(row.bytes), row.bytes / sizeof(float), row.allreduce_seconds * 1e6, algbw, busbw, memcpy_gbps,
          rmw_gbps, copy_gbps, bound, busbw / bound, moved);
    }
    fmt::print("{:-<{}}\n", "", rule);
    std::fflush(stdout);
  }
  for (int n : options.gloo_ranks) {
    if (n == 0) continue;
    const auto started = Clock::now();
    const auto rows = measure_gloo(n, argv, options);
    print_gloo(n, rows, options);
    fmt::print("({:.1f} s for this table, starting the processes included)\n",
               std::chrono::duration<double>(Clock::now() - started).count());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app(
      "bench_collectives: all-reduce bandwidth of tandem's communicators next to a memory ceiling, and "
      "Gloo's between processes (--ranks 0 or --gloo-ranks 0 skips that section)");
  app.add_option("--ranks", options.ranks, "in-process group sizes")->delimiter(',')->check(CLI::Range(0, 1024));
  app.add_option("--gloo-ranks", options.gloo_ranks, "process counts of the Gloo section (at least 2 each)")
      ->delimiter(',')
      ->check(CLI::Range(0, 1024));
  const CLI::AsSizeValue size(/*kb_is_1000=*/false);  // 4K, 256M, 1G: powers of 1024
  app.add_option("--min", options.min_bytes, "smallest message")->transform(size);
  app.add_option("--max", options.max_bytes, "largest message")->transform(size);
  app.add_option("--gloo-max", options.gloo_max_bytes, "largest message of the Gloo section")->transform(size);
  app.add_option("--factor", options.factor, "growth of the message size from row to row")->check(CLI::Range(2, 1024));
  app.add_option("--iters", options.iters, "calls per sample (default: enough for ~20 ms)")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--samples", options.samples, "samples per row (the table shows their median)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--gloo-samples", options.gloo_samples, "samples per row of the Gloo section")
      ->check(CLI::Range(1, 1000));
  app.add_flag("--gloo-check", options.gloo_check, "GlooOptions::check_consistency for ours");
  app.add_option("--gloo-pack", options.gloo_pack_bytes, "GlooOptions::bytes_per_pack for ours")->transform(size);
  app.add_option("--gloo-algorithm", options.gloo_algorithm,
                 "GlooOptions::all_reduce_algorithm for ours: ordered (rank order, the default) or ring")
      ->check(CLI::IsMember({"ordered", "ring"}));
  // Internal: a Gloo rank this program started (rank, group size, the store's address).
  std::tuple<int, int, std::string> worker{-1, 0, ""};
  app.add_option("--gloo-worker", worker)->group("");
  CLI11_PARSE(app, argc, argv);
  const auto& [worker_rank, worker_size, worker_store] = worker;
  for (int n : options.gloo_ranks) {
    if (n == 1) {
      fmt::print(stderr, "bench_collectives: --gloo-ranks 1: a Gloo group needs at least 2 processes (0 skips)\n");
      return 2;
    }
  }
  if (options.min_bytes < 64 || options.min_bytes > options.max_bytes) {
    fmt::print(stderr, "bench_collectives: --min must be at least 64 bytes and at most --max\n");
    return 2;
  }
  // What a Gloo rank is started with, before --gloo-worker: our own command line.
  const std::vector<std::string> forwarded(argv, argv + argc);
  if (worker_rank >= 0) {
    try {
      gloo_rank_main(worker_rank, worker_size, worker_store, options);
      return 0;
    } catch (const std::exception& e) {
      fmt::print(stderr, "bench_collectives: gloo rank {} of {}: {}\n", worker_rank, worker_size, e.what());
      return 1;
    }
  }
  try {
    return run(options, forwarded);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_collectives: {}\n", e.what());
    return 1;
  }
}
