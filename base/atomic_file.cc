// The atomic writer (base/detail/atomic_file.h): a temporary file next to the destination,
// renamed into place. The same folder keeps the rename atomic (one file system).
#include "tandem/base/detail/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string_view>
#include <system_error>

#include "tandem/base/errors.h"
#include "tandem/base/log.h"

namespace tandem::detail {
namespace {

// Temporary files are named .NAME.tmp-HOST-PID-N: NAME the destination's file name, HOST and PID
// the writer's, N a count of the process. A writer killed between creating its temporary file and
// renaming it leaves the file behind (ten SIGKILLs of a training run left 58 MB), so the next
// write to the same destination removes the temporaries of writers that are gone: those of this
// host whose process no longer exists and that have not been written for kGoneWriterIdle (a
// process in another PID namespace of this host might still own one), and any not written for
// kStaleTemporaryIdle (another host's process sharing the folder cannot be asked, and a PID can be
// reused). A live writer's file is never removed: its process exists, or it writes to the file
// far more often than that.
constexpr auto kGoneWriterIdle = std::chrono::minutes(1);
constexpr auto kStaleTemporaryIdle = std::chrono::hours(6);

// This machine's name as temporary files carry it: letters, digits, '.', '-' and '_' only.
const std::string& this_host() {
  static const std::string host = [] {
    char buffer[256] = {};
    std::string name = ::gethostname(buffer, sizeof(buffer) - 1) == 0 ? buffer : "";
    for (char& c : name) {
      if (std::isalnum(static_cast<unsigned char>(c)) == 0 && c != '.' && c != '-' && c != '_') c = '_';
    }
    return name.empty() ? std::string("unknown") : name;
  }();
  return host;
}

// The writer of a temporary file: HOST ("" in the older name .NAME.tmp-PID-N) and PID.
struct TemporaryWriter {
  std::string_view host;
  pid_t pid = 0;
};

// The writer named by `entry` when it is a temporary file of the destination whose temporaries
// start with `prefix` (".NAME.tmp-"); nullopt for any other file. HOST may hold '-', so the
// numbers are taken from the right.
std::optional<TemporaryWriter> temporary_writer(std::string_view entry, std::string_view prefix) {
  if (!entry.starts_with(prefix)) return std::nullopt;
  std::string_view rest = entry.substr(prefix.size());
  const auto take_number = [&rest]() -> std::optional<std::int64_t> {
    const auto dash = rest.rfind('-');
    const std::string_view digits = dash == std::string_view::npos ? rest : rest.substr(dash + 1);
    std::int64_t value = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
    rest = dash == std::string_view::npos ? std::string_view() : rest.substr(0, dash);
    return value;
  };
  const auto count = take_number();
  const auto pid = count ? take_number() : std::nullopt;
  if (!pid || *pid <= 0 || *pid > std::numeric_limits<pid_t>::max()) return std::nullopt;
  return TemporaryWriter{rest, static_cast<pid_t>(*pid)};
}

// Removes the temporaries of `name` in `dir` whose writers are gone (see above). Best effort:
// a folder that cannot be listed or a file that cannot be removed is left as it is.
void remove_stale_temporaries(const std::filesystem::path& dir, const std::string& name) {
  namespace fs = std::filesystem;
  const std::string prefix = fmt::format(".{}.tmp-", name);
  const auto now = fs::file_time_type::clock::now();
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string entry = it->path().filename().string();
    const auto writer = temporary_writer(entry, prefix);
    if (!writer) continue;
    std::error_code time_ec;
    const auto idle = now - fs::last_write_time(it->path(), time_ec);
    if (time_ec) continue;
    const bool gone =
        writer->host == this_host() && idle >= kGoneWriterIdle && ::kill(writer->pid, 0) != 0 && errno == ESRCH;
    if (!gone && idle < kStaleTemporaryIdle) continue;
    if (::unlink(it->path().c_str()) == 0) {
      logging::debug("removed {}, a temporary file left by process {} on {}, which is {}", it->path().string(),
                     writer->pid, writer->host.empty() ? "an unknown host" : writer->host,
                     gone ? "gone" : "idle for hours");
    }
  }
}

}  // namespace

// Creating the temporary file first removes the stale temporaries of the same destination.
AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  namespace fs = std::filesystem;
  const fs::path target(path_);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  remove_stale_temporaries(dir, target.filename().string());
  static std::atomic<std::uint64_t> counter{0};
  for (int attempt = 0; attempt < 100; ++attempt) {
    const auto name = fmt::format(".{}.tmp-{}-{}-{}", target.filename().string(), this_host(), ::getpid(),
                                  counter.fetch_add(1, std::memory_order_relaxed));
    temp_ = (dir / name).string();
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ >= 0 || errno != EEXIST) break;
  }
  if (fd_ < 0) fail(errno);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, std::size_t bytes) {
  if (bytes >= kBufferBytes) {
    flush_buffer();
    write_fully(data, bytes);
    return;
  }
  if (buffer_.size() + bytes > kBufferBytes) flush_buffer();
  const auto* p = static_cast<const char*>(data);
  buffer_.insert(buffer_.end(), p, p + bytes);
}

void AtomicFile::commit() {
  flush_buffer();
  // The data must be on disk before the name points at it, or a crash could leave the new
  // name on an empty file.
  if (::fsync(fd_) != 0) fail(errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail(errno);
  if (::rename(temp_.c_str(), path_.c_str()) != 0) fail(errno);
  committed_ = true;
  // Make the rename itself durable; a failure here leaves a complete file either way.
  const auto dir = std::filesystem::path(path_).parent_path();
  const int dir_fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

void AtomicFile::fail(int error) const {
  throw Unavailable(fmt::format("cannot write \"{}\": {}", path_, std::system_category().message(error)));
}

void AtomicFile::flush_buffer() {
  write_fully(buffer_.data(), buffer_.size());
  buffer_.clear();
}

void AtomicFile::write_fully(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(errno);
    }
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

}  // namespace tandem::detail
