// bench_collectives — all_reduce (SUM, float32, in place) of the in-process group, one thread per
// rank, next to the memory-copy bandwidth the same threads reach in the same run on buffers of
// the same size. See bench/README.md for what the ceiling is and why.
//
//   bench_collectives [--ranks 2,4] [--min 4K] [--max 256M] [--factor 4] [--iters N] [--samples N]
//
// Columns follow nccl-tests: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n (the rate at
// which a ring all-reduce moves data over its busiest link; it makes rank counts comparable).
//
// The ceiling. An in-place all-reduce in shared memory must read every rank's buffer once and
// write every rank's buffer once: at least 2 * n * bytes of memory traffic, however it is done.
// The same n threads, each on a buffer of `bytes` of its own, move memory at `copy GB/s` (bytes
// read + written): the better of two passes, a memcpy (one half of the buffer onto the other and
// back) and an in-place read-modify-write (x[i] += c over n parts side by side) which, like the
// all-reduce at n ranks, walks n streams and writes lines it has just read. No all-reduce can take less than t_min = 2 * n * bytes / copy GB/s. "bound" is
// the busbw at t_min, copy GB/s * (n - 1) / n^2, and "ratio" is busbw / bound = t_min / time.
// "moved" is the all-reduce's own rate of that least traffic, 2 * n * bytes / time.
//
// Timing. Each sample is the mean over back-to-back calls (all ranks start together; the sample
// is the slowest rank's), and the table shows the median of --samples samples. All-reduce and
// copy samples alternate, so a noisy phase of a shared machine reaches both.
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
#include <vector>

#include <fmt/format.h>

#include "machine_info.h"
#include "tandem/collective/communicator.h"
#include "tandem/devices/device.h"

namespace {

using namespace tandem;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<int> ranks = {2, 4};
  std::size_t min_bytes = 4 << 10;
  std::size_t max_bytes = 256 << 20;
  int factor = 4;
  int iters = 0;  // 0: enough calls for ~20 ms per sample
  int samples = 5;
};

constexpr double kSampleSeconds = 0.02;

std::string size_text(std::size_t bytes) {
  if (bytes >= (1u << 30) && bytes % (1u << 30) == 0) return fmt::format("{} GiB", bytes >> 30);
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= (1u << 10) && bytes % (1u << 10) == 0) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

// "4K", "256M", "1G", "4096".
std::size_t parse_size(const std::string& text) {
  std::size_t pos = 0;
  const unsigned long long value = std::stoull(text, &pos);
  const std::string unit = text.substr(pos);
  if (unit.empty() || unit == "B") return value;
  if (unit == "K" || unit == "KiB") return value << 10;
  if (unit == "M" || unit == "MiB") return value << 20;
  if (unit == "G" || unit == "GiB") return value << 30;
  throw InvalidArgument(fmt::format("bench_collectives: size \"{}\" is not a number with K, M or G", text));
}

std::vector<int> parse_ranks(const std::string& text) {
  std::vector<int> ranks;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    ranks.push_back(std::stoi(text.substr(start, comma - start)));
    start = comma + 1;
  }
  return ranks;
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

int run(const Options& options) {
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
  fmt::print("ceiling:       copy GB/s = the better of memcpy and an in-place read-modify-write pass, same threads,\n"
             "               same bytes per thread (read + written); an in-place all-reduce moves >= 2 n bytes:\n"
             "               bound busbw = copy GB/s * (n-1)/n^2; ratio = busbw / bound (bench/README.md)\n");
  for (int n : options.ranks) {
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
      fmt::print("{:>8} {:>10} {:>10.1f} {:>10.2f} {:>10.2f} | {:>10.1f} {:>10.1f} {:>10.1f} {:>11.2f} {:>6.2f} | {:>10.1f}\n",
                 size_text(row.bytes), row.bytes / sizeof(float), row.allreduce_seconds * 1e6, algbw, busbw,
                 memcpy_gbps, rmw_gbps, copy_gbps, bound, busbw / bound, moved);
    }
    fmt::print("{:-<{}}\n", "", rule);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      const bool has_value = i + 1 < argc;
      if (arg == "--ranks" && has_value) {
        options.ranks = parse_ranks(argv[++i]);
      } else if (arg == "--min" && has_value) {
        options.min_bytes = parse_size(argv[++i]);
      } else if (arg == "--max" && has_value) {
        options.max_bytes = parse_size(argv[++i]);
      } else if (arg == "--factor" && has_value) {
        options.factor = std::max(2, std::atoi(argv[++i]));
      } else if (arg == "--iters" && has_value) {
        options.iters = std::max(1, std::atoi(argv[++i]));
      } else if (arg == "--samples" && has_value) {
        options.samples = std::max(1, std::atoi(argv[++i]));
      } else {
        fmt::print(stderr,
                   "usage: bench_collectives [--ranks 2,4] [--min 4K] [--max 256M] [--factor 4] [--iters N] "
                   "[--samples N]\n");
        return 2;
      }
    }
    for (int n : options.ranks) TANDEM_REQUIRE(n >= 1, InvalidArgument, "bench_collectives: --ranks {}", n);
    TANDEM_REQUIRE(options.min_bytes >= 64 && options.min_bytes <= options.max_bytes, InvalidArgument,
                   "bench_collectives: --min must be at least 64 bytes and at most --max");
    return run(options);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_collectives: {}\n", e.what());
    return 1;
  }
}
