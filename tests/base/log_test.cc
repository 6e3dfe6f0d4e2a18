// base/log: levels, formatting, and a sink that captures what the library says.
#include <doctest/doctest.h>

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/base/log.h"

using namespace tandem;

namespace {

// Captures every message for one scope, at the given level; restores both afterwards.
class Capture {
 public:
  explicit Capture(logging::Level level) : previous_level_(logging::level()) {
    logging::set_level(level);
    previous_sink_ = logging::set_sink(
        [this](logging::Level at, std::string_view message) { messages.emplace_back(at, std::string(message)); });
  }
  ~Capture() {
    logging::set_sink(std::move(previous_sink_));
    logging::set_level(previous_level_);
  }
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;

  std::vector<std::pair<logging::Level, std::string>> messages;

 private:
  logging::Level previous_level_;
  logging::Sink previous_sink_;
};

}  // namespace

TEST_CASE("the default level is info: warnings and reports print, debug output does not") {
  // CTest runs this suite without TANDEM_LOG_LEVEL.
  CHECK(logging::level() == logging::Level::kInfo);
  CHECK(logging::enabled(logging::Level::kWarn));
  CHECK(logging::enabled(logging::Level::kInfo));
  CHECK_FALSE(logging::enabled(logging::Level::kDebug));
}

TEST_CASE("messages are formatted with fmt and filtered by level") {
  Capture capture(logging::Level::kWarn);
  logging::debug("not shown {}", 1);
  logging::info("not shown {}", 2);
  logging::warn("model \"{}\": {} steps", "mlp", 3);
  logging::error("{:.2f}", 0.125);
  REQUIRE(capture.messages.size() == 2);
  CHECK(capture.messages[0] == std::pair{logging::Level::kWarn, std::string("model \"mlp\": 3 steps")});
  CHECK(capture.messages[1] == std::pair{logging::Level::kError, std::string("0.12")});
}

TEST_CASE("off silences everything; trace lets everything through") {
  {
    Capture capture(logging::Level::kOff);
    logging::error("x");
    CHECK(capture.messages.empty());
  }
  {
    Capture capture(logging::Level::kTrace);
    logging::trace("t");
    logging::debug("d");
    CHECK(capture.messages.size() == 2);
  }
}

TEST_CASE("messages from several threads arrive whole") {
  Capture capture(logging::Level::kInfo);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 100; ++i) logging::info("thread {} message {}", t, i);
    });
  }
  for (auto& thread : threads) thread.join();
  REQUIRE(capture.messages.size() == 400);
  for (const auto& [level, text] : capture.messages) CHECK(text.starts_with("thread "));
}
