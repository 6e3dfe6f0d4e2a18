#include "tandem/base/random.h"

#include <atomic>

namespace tandem {
namespace {
std::atomic<std::uint64_t> g_seed{0};
std::atomic<std::uint64_t> g_counter{0};

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
}  // namespace

void set_global_seed(std::uint64_t seed) {
  g_seed.store(seed);
  g_counter.store(0);
}

std::uint64_t global_seed() { return g_seed.load(); }

std::uint64_t next_seed() { return mix_seed(g_seed.load(), g_counter.fetch_add(1) + 1); }

std::uint64_t mix_seed(std::uint64_t a, std::uint64_t b) { return splitmix(a ^ splitmix(b)); }

}  // namespace tandem
