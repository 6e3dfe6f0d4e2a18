#include "tandem/base/log.h"

#include <spdlog/logger.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/dist_sink.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>

#include "tandem/base/env.h"
#include "tandem/base/errors.h"

namespace tandem::logging {
namespace {

constexpr Level kLevels[] = {Level::kTrace, Level::kDebug, Level::kInfo, Level::kWarn, Level::kError, Level::kOff};
static_assert(std::size(kLevels) == std::size(env::kLogLevelChoices), "one Level per TANDEM_LOG_LEVEL choice");

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::kTrace: return spdlog::level::trace;
    case Level::kDebug: return spdlog::level::debug;
    case Level::kInfo: return spdlog::level::info;
    case Level::kWarn: return spdlog::level::warn;
    case Level::kError: return spdlog::level::err;
    case Level::kOff: break;
  }
  return spdlog::level::off;
}

Level from_spdlog(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::trace: return Level::kTrace;
    case spdlog::level::debug: return Level::kDebug;
    case spdlog::level::info: return Level::kInfo;
    case spdlog::level::warn: return Level::kWarn;
    default: return Level::kError;
  }
}

// Hands each message to a user's function (set_sink). The distributing sink around it holds the
// lock, so this one needs none.
class FunctionSink final : public spdlog::sinks::base_sink<spdlog::details::null_mutex> {
 public:
  explicit FunctionSink(Sink function) : function_(std::move(function)) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& message) override {
    function_(from_spdlog(message.level), std::string_view(message.payload.data(), message.payload.size()));
  }
  void flush_() override {}

 private:
  Sink function_;
};

struct State {
  std::shared_ptr<spdlog::sinks::stderr_sink_mt> to_stderr = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  // The logger's one sink; set_sink swaps what it distributes to, under its lock.
  std::shared_ptr<spdlog::sinks::dist_sink_mt> destination = std::make_shared<spdlog::sinks::dist_sink_mt>();
  // Not registered with spdlog: a program's own spdlog loggers and tandem's stay apart.
  spdlog::logger logger{"tandem", destination};
  std::atomic<Level> level{Level::kInfo};
  std::mutex sink_mutex;  // set_sink's read-modify-write
  Sink sink;              // guarded by sink_mutex; empty: stderr

  State() {
    to_stderr->set_pattern("tandem %l: %v");
    destination->set_sinks({to_stderr});
    logger.set_level(spdlog::level::trace);  // level() filters, before any formatting
  }
};

// Never destroyed: destructors of other statics may still log at exit.
State& state() {
  static State* instance = [] {
    auto* s = new State;
    try {
      const std::string choice = env::get_string(env::kLogLevel);
      const auto* at = std::find(env::kLogLevelChoices, std::end(env::kLogLevelChoices), choice);
      s->level = kLevels[at - env::kLogLevelChoices];
    } catch (const Error& e) {
      s->logger.error("{}; using {}", e.what(), env::kLogLevel.default_value);
    }
    return s;
  }();
  return *instance;
}

}  // namespace

Level level() { return state().level.load(std::memory_order_relaxed); }

void set_level(Level level) { state().level.store(level, std::memory_order_relaxed); }

Sink set_sink(Sink sink) {
  State& s = state();
  std::lock_guard lock(s.sink_mutex);
  Sink previous = std::move(s.sink);
  s.sink = std::move(sink);
  if (s.sink) {
    s.destination->set_sinks({std::make_shared<FunctionSink>(s.sink)});
  } else {
    s.destination->set_sinks({s.to_stderr});
  }
  return previous;
}

void write(Level level, std::string_view message) noexcept {
  if (!enabled(level)) return;
  // spdlog reports its own failures through its error handler, not by throwing.
  state().logger.log(to_spdlog(level), spdlog::string_view_t(message.data(), message.size()));
}

}  // namespace tandem::logging
