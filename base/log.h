// tandem/base/log.h — tandem's messages to the user: warnings, errors it recovers from, and the
// reports the user asked for (TANDEM_PROFILE).
//
// Library code never writes to stderr itself: it calls logging::warn("...{}...", x) and the like
// (fmt formatting, checked at compile time). A message prints on stderr as one block,
//   tandem warning: BackupAndRestore: ignoring the backup "b/backup.safetensors": ...
// when its level is at least the current one: TANDEM_LOG_LEVEL (base/env.h; default info), or
// set_level. Programs keep their own output (progress bars, tables) on stdout; this is only for
// what the library has to say on the side.
//
// Callers: any thread; messages from several threads never interleave. Nothing here throws, so it
// may be called from destructors and catch blocks: a TANDEM_LOG_LEVEL that does not parse is
// reported once, as an error message, and the default used. spdlog does the work (base/log.cc);
// this header does not include it, so a program built against tandem needs no spdlog.
#pragma once

#include <functional>
#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace tandem::logging {

enum class Level { kTrace, kDebug, kInfo, kWarn, kError, kOff };

// The least severe level that prints. The first call reads TANDEM_LOG_LEVEL.
Level level();
void set_level(Level level);
inline bool enabled(Level message_level) { return message_level != Level::kOff && message_level >= level(); }

// Where messages go instead of stderr: tests capture them with this. The sink is called with the
// message alone (no "tandem warning: " prefix), one call at a time. An empty function restores
// stderr. Returns the previous sink (empty for stderr).
using Sink = std::function<void(Level level, std::string_view message)>;
Sink set_sink(Sink sink);

// Writes message at level when enabled(level).
void write(Level level, std::string_view message) noexcept;

template <class... Args>
void log(Level level, fmt::format_string<Args...> format, Args&&... args) noexcept {
  if (!enabled(level)) return;
  try {
    write(level, fmt::format(format, std::forward<Args>(args)...));
  } catch (...) {
    // Out of memory while formatting: the message is lost, the caller goes on.
  }
}

template <class... Args>
void trace(fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(Level::kTrace, format, std::forward<Args>(args)...);
}
template <class... Args>
void debug(fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(Level::kDebug, format, std::forward<Args>(args)...);
}
template <class... Args>
void info(fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(Level::kInfo, format, std::forward<Args>(args)...);
}
template <class... Args>
void warn(fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(Level::kWarn, format, std::forward<Args>(args)...);
}
template <class... Args>
void error(fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(Level::kError, format, std::forward<Args>(args)...);
}

}  // namespace tandem::logging
