// The GPT sample's data, Debian's jargon-text package, read the way the PyTorch peer reads it:
// the same vocabulary, split and window count, and what a full shuffle of the training windows
// costs (the sample's .shuffle(cardinality) with stride 1). Exits 77 (CTest: skipped) when the
// package is not installed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "tandem/data/text.h"

using namespace tandem;

namespace {

// Resident memory of this process, in MB (/proc/self/statm's second field, in pages).
double resident_mb() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE("the Jargon File gives the PyTorch peer's vocabulary, split and windows") {
  const std::string text = data::read_text_file(data::kDebianJargonFile);
  CHECK(text.size() == 1681817);
  const auto vocab = data::Vocabulary::from_text(text);
  // torch_char_gpt.py: vocab 155, train chars 1456881, val chars 161876.
  CHECK(vocab.size() == 155);
  CHECK(vocab.characters().front() == U'\n');
  CHECK(vocab.characters().back() == char32_t{0x3009});
  const auto tokens = vocab.encode(text);
  CHECK(tokens.shape() == Shape{1618757});
  const auto [train, validation] = data::split_tokens(tokens, 0.9);
  CHECK(train.shape() == Shape{1456881});
  CHECK(validation.shape() == Shape{161876});
  CHECK(vocab.decode(tokens) == text);  // the file is valid UTF-8: nothing was replaced

  // The sample's training input: every window of 128 (stride 1), fully shuffled, batches of 32.
  const auto windows = data::text_windows(train, {.length = 128});
  const auto n = windows.cardinality();
  CHECK(n == 1456881 - 128);
  const auto pipeline = windows.shuffle(n).batch(32);
  for (int epoch = 0; epoch < 2; ++epoch) {
    const double before_mb = resident_mb();
    const auto start = std::chrono::steady_clock::now();
    auto it = pipeline.iterate();
    const auto first = it->next();  // fills the shuffle buffer: the epoch's start
    const double start_ms = ms_since(start);
    const double buffer_mb = resident_mb() - before_mb;
    REQUIRE(first);
    CHECK((*first)[0].shape() == Shape{32, 128});
    const auto steps_start = std::chrono::steady_clock::now();
    constexpr int kSteps = 1000;
    for (int step = 1; step < kSteps; ++step) REQUIRE(it->next());
    MESSAGE("epoch ", epoch, ": ", n, " windows, shuffle(", n, ").batch(32): first batch after ", start_ms,
            " ms, resident memory +", buffer_mb, " MB; then ", ms_since(steps_start) / (kSteps - 1), " ms per batch");
  }
}

int main(int argc, char** argv) {
  if (!std::filesystem::exists(data::kDebianJargonFile)) {
    std::printf("skipped: %s is absent (apt-get install jargon-text)\n", data::kDebianJargonFile);
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
