// The TCP store: a server thread polling every connection, and a client with a pool of
// connections. See tcp_store.h for the contract; this file is about how.
//
// Server. One thread runs poll() over an eventfd (the stop signal), the listening socket and every
// client socket, all non-blocking. Requests on one connection are answered in order; a GET or
// WAIT whose keys are missing is parked on its connection (at most one per connection: a client
// sends its next request only after the reply) and answered when a SET or ADD creates the key.
// CANCEL unparks it and is answered with kCancelled, so that a client whose wait timed out can
// reuse the connection: it reads until kCancelled, taking an answer that crossed the cancel as
// the result. A connection that announced a rank (HELLO) and closes without BYE makes the server
// set that rank's lost key.
//
// Client. Every call leases a connection from a pool (or opens one), so concurrent callers never
// queue behind a waiting get. The connection that says HELLO stays out of the pool: its only
// job is to stay open while the process lives and to say BYE when the client is destroyed.
#include "tandem/collective/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>

#include "tandem/base/errors.h"
#include "tandem/collective/detail/common.h"

namespace tandem::collective {
namespace {

using detail::Clock;
using detail::deadline_after;
using detail::format_duration;
using detail::quoted_list;
using Deadline = Clock::time_point;

// A frame this large is a protocol error (or someone else's protocol on our port), not a value.
constexpr std::uint32_t kMaxFrameBytes = 256u << 20;
// Key and value of one set, leaving room in the frame for the fields around them.
constexpr std::size_t kMaxValueBytes = kMaxFrameBytes - 1024;
// How long the destructor waits for the server to acknowledge goodbye, and how long a timed-out
// get/wait waits for its cancel to be acknowledged: a live server answers both at once.
constexpr auto kGoodbyeTimeout = std::chrono::seconds(2);
constexpr auto kCancelTimeout = std::chrono::seconds(5);
// Idle connections a client keeps for later calls; more concurrent callers than this open and
// close their own.
constexpr std::size_t kMaxIdleConnections = 8;

// "connection refused": strerror, thread-safe, in the lower case messages use mid-sentence.
std::string socket_error_text(int err) {
  std::string text = std::error_code(err, std::system_category()).message();
  if (!text.empty() && text[0] >= 'A' && text[0] <= 'Z' && (text.size() < 2 || !(text[1] >= 'A' && text[1] <= 'Z'))) {
    text[0] = static_cast<char>(text[0] - 'A' + 'a');
  }
  return text;
}

// ---- Wire format ---------------------------------------------------------------------------

enum class Op : std::uint8_t { kHello = 1, kBye, kSet, kGet, kWait, kCheck, kAdd, kCancel };
enum class Status : std::uint8_t { kOk = 0, kValue, kBool, kInt, kError, kCancelled };

// Builds one frame: the u32 length is filled in by finish().
class Writer {
 public:
  explicit Writer(std::uint8_t tag) {
    buffer_.resize(4);
    buffer_.push_back(static_cast<char>(tag));
  }
  explicit Writer(Op op) : Writer(static_cast<std::uint8_t>(op)) {}
  explicit Writer(Status status) : Writer(static_cast<std::uint8_t>(status)) {}

  Writer& u8(std::uint8_t v) {
    buffer_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) buffer_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& i64(std::int64_t value) {
    const auto v = static_cast<std::uint64_t>(value);
    for (int i = 0; i < 8; ++i) buffer_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& bytes(const char* data, std::size_t size) {
    u32(static_cast<std::uint32_t>(size));
    buffer_.insert(buffer_.end(), data, data + size);
    return *this;
  }
  Writer& str(std::string_view s) { return bytes(s.data(), s.size()); }
  Writer& bytes(const std::vector<char>& v) { return bytes(v.data(), v.size()); }

  std::vector<char> finish() {
    const auto length = static_cast<std::uint32_t>(buffer_.size() - 4);
    for (int i = 0; i < 4; ++i) buffer_[static_cast<std::size_t>(i)] = static_cast<char>((length >> (8 * i)) & 0xff);
    return std::move(buffer_);
  }

 private:
  std::vector<char> buffer_;
};

// Reads the fields of one frame's payload; every read fails (returns false) once the payload
// runs out, so a truncated frame is caught by the caller's single check.
class Reader {
 public:
  Reader(const char* data, std::size_t size) : p_(data), end_(data + size) {}

  bool u8(std::uint8_t& v) {
    if (end_ - p_ < 1) return fail();
    v = static_cast<std::uint8_t>(*p_++);
    return true;
  }
  bool u32(std::uint32_t& v) {
    if (end_ - p_ < 4) return fail();
    v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(*p_++)) << (8 * i);
    return true;
  }
  bool i64(std::int64_t& value) {
    if (end_ - p_ < 8) return fail();
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(*p_++)) << (8 * i);
    value = static_cast<std::int64_t>(v);
    return true;
  }
  bool bytes(std::vector<char>& v) {
    std::uint32_t n = 0;
    if (!u32(n) || static_cast<std::size_t>(end_ - p_) < n) return fail();
    v.assign(p_, p_ + n);
    p_ += n;
    return true;
  }
  bool str(std::string& s) {
    std::uint32_t n = 0;
    if (!u32(n) || static_cast<std::size_t>(end_ - p_) < n) return fail();
    s.assign(p_, p_ + n);
    p_ += n;
    return true;
  }
  bool ok() const { return ok_; }
  bool at_end() const { return ok_ && p_ == end_; }

 private:
  bool fail() {
    ok_ = false;
    return false;
  }
  const char* p_;
  const char* end_;
  bool ok_ = true;
};

// ---- Sockets -------------------------------------------------------------------------------

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

enum class IoKind { kOk, kTimeout, kClosed, kError };
struct IoResult {
  IoKind kind = IoKind::kOk;
  int err = 0;
};

// Waits until fd is ready for `events` (or hung up / failed: the next read or write says how).
IoResult wait_ready(int fd, short events, Deadline deadline) {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::clamp<long long>(left, 0, INT_MAX)));
    if (r < 0) {
      if (errno == EINTR) continue;
      return {IoKind::kError, errno};
    }
    if (r > 0) return {};
    if (Clock::now() >= deadline) return {IoKind::kTimeout, 0};
  }
}

IoResult send_all(int fd, const std::vector<char>& data, Deadline deadline) {
  std::size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const IoResult r = wait_ready(fd, POLLOUT, deadline);
      if (r.kind != IoKind::kOk) return r;
    } else {
      return {IoKind::kError, n < 0 ? errno : EPIPE};
    }
  }
  return {};
}

IoResult recv_all(int fd, char* data, std::size_t size, Deadline deadline) {
  std::size_t got = 0;
  while (got < size) {
    const ssize_t n = ::recv(fd, data + got, size - got, 0);
    if (n > 0) {
      got += static_cast<std::size_t>(n);
    } else if (n == 0) {
      return {IoKind::kClosed, 0};
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      const IoResult r = wait_ready(fd, POLLIN, deadline);
      if (r.kind != IoKind::kOk) return r;
    } else {
      return {IoKind::kError, errno};
    }
  }
  return {};
}

// Reads one frame. `deadline` bounds the wait for its first byte; once that has come, the rest is
// in flight and gets until `rest_deadline` (a reply cut off halfway would leave the connection
// unusable, where a reply not yet begun can still be cancelled).
IoResult recv_frame(int fd, std::vector<char>& frame, Deadline deadline, Deadline rest_deadline) {
  char header[4];
  IoResult r = recv_all(fd, header, 1, deadline);
  if (r.kind == IoKind::kOk) r = recv_all(fd, header + 1, sizeof header - 1, std::max(deadline, rest_deadline));
  if (r.kind != IoKind::kOk) return r;
  std::uint32_t length = 0;
  for (int i = 0; i < 4; ++i) length |= static_cast<std::uint32_t>(static_cast<unsigned char>(header[i])) << (8 * i);
  if (length > kMaxFrameBytes) return {IoKind::kError, EPROTO};
  frame.resize(length);
  return recv_all(fd, frame.data(), length, std::max(deadline, rest_deadline));
}

void set_no_delay(int fd) {
  // Requests are small and answered one at a time: Nagle's delay would only add latency.
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// A rank's machine that vanishes (power, network) sends no FIN: keepalive probes close its
// connection after about kKeepAliveIdle + kKeepAliveCount x kKeepAliveInterval, so that its
// lost key still appears.
constexpr int kKeepAliveIdleSeconds = 30;
constexpr int kKeepAliveIntervalSeconds = 5;
constexpr int kKeepAliveCount = 3;

void enable_keepalive(int fd) {
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &kKeepAliveIdleSeconds, sizeof kKeepAliveIdleSeconds);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &kKeepAliveIntervalSeconds, sizeof kKeepAliveIntervalSeconds);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &kKeepAliveCount, sizeof kKeepAliveCount);
}

// "10.0.0.2:41234" (IPv4-mapped IPv6 addresses print as IPv4).
std::string format_sockaddr(const sockaddr* addr, socklen_t length) {
  char host[NI_MAXHOST];
  char service[NI_MAXSERV];
  if (::getnameinfo(addr, length, host, sizeof host, service, sizeof service, NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "<unknown peer>";
  }
  std::string_view h(host);
  if (h.starts_with("::ffff:") && h.find('.') != std::string_view::npos) h.remove_prefix(7);
  if (h.find(':') != std::string_view::npos) return fmt::format("[{}]:{}", h, service);
  return fmt::format("{}:{}", h, service);
}

// A client retrying towards a local port nobody listens on can connect to itself (TCP
// simultaneous open, when the kernel picks the destination port as the source port): that is
// no server.
bool is_self_connection(int fd) {
  sockaddr_storage local{};
  sockaddr_storage peer{};
  socklen_t local_length = sizeof local;
  socklen_t peer_length = sizeof peer;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_length) != 0) return false;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_length) != 0) return false;
  return local_length == peer_length && std::memcmp(&local, &peer, local_length) == 0;
}

// One connection attempt to every address host resolves to, in order. Returns a connected,
// non-blocking socket, or an empty Fd and *error saying why the last attempt failed.
Fd connect_once(const HostPort& target, Deadline deadline, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(target.port);
  const int rc = ::getaddrinfo(target.host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) {
    *error = fmt::format("cannot resolve host \"{}\": {}", target.host, ::gai_strerror(rc));
    return Fd();
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, &::freeaddrinfo);
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) {
      *error = socket_error_text(errno);
      continue;
    }
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        *error = socket_error_text(errno);
        continue;
      }
      const IoResult ready = wait_ready(fd.get(), POLLOUT, deadline);
      if (ready.kind == IoKind::kTimeout) {
        *error = "connection attempt timed out";
        continue;
      }
      if (ready.kind != IoKind::kOk) {
        *error = socket_error_text(ready.err);
        continue;
      }
      int so_error = 0;
      socklen_t length = sizeof so_error;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &length);
      if (so_error != 0) {
        *error = socket_error_text(so_error);
        continue;
      }
    }
    if (is_self_connection(fd.get())) {
      *error = socket_error_text(ECONNREFUSED);
      continue;
    }
    set_no_delay(fd.get());
    return fd;
  }
  return Fd();
}

// ---- Replies -------------------------------------------------------------------------------

struct Reply {
  Status status = Status::kOk;
  std::vector<char> value;  // kValue
  bool flag = false;        // kBool
  std::int64_t number = 0;  // kInt
  std::uint8_t error_code = 0;
  std::string error;  // kError
};

bool parse_reply(const std::vector<char>& frame, Reply& reply) {
  Reader r(frame.data(), frame.size());
  std::uint8_t status = 0;
  if (!r.u8(status) || status > static_cast<std::uint8_t>(Status::kCancelled)) return false;
  reply.status = static_cast<Status>(status);
  switch (reply.status) {
    case Status::kOk:
    case Status::kCancelled:
      break;
    case Status::kValue:
      r.bytes(reply.value);
      break;
    case Status::kBool: {
      std::uint8_t b = 0;
      r.u8(b);
      reply.flag = b != 0;
      break;
    }
    case Status::kInt:
      r.i64(reply.number);
      break;
    case Status::kError:
      r.u8(reply.error_code);
      r.str(reply.error);
      break;
  }
  return r.at_end();
}

// Error codes a kError reply carries.
constexpr std::uint8_t kWireInvalidArgument = 1;
constexpr std::uint8_t kWireProtocol = 2;

}  // namespace

std::string lost_rank_key(int rank) { return fmt::format("tandem/lost/{}", rank); }

HostPort parse_host_port(std::string_view address) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgument(fmt::format("address \"{}\" is not host:port: {}", address, why));
  };
  std::string_view host;
  std::string_view port;
  if (address.starts_with('[')) {
    const auto close = address.find(']');
    if (close == std::string_view::npos) throw bad("'[' without ']'");
    host = address.substr(1, close - 1);
    if (close + 1 >= address.size() || address[close + 1] != ':') throw bad("no ':port' after the bracketed host");
    port = address.substr(close + 2);
  } else {
    const auto colon = address.rfind(':');
    if (colon == std::string_view::npos) throw bad("no ':port'");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) throw bad("an IPv6 host must be in brackets, e.g. [::1]:2222");
  }
  if (host.empty()) throw bad("the host is empty");
  int value = -1;
  const auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || ptr != port.data() + port.size() || value < 0 || value > 65535) {
    throw bad(fmt::format("the port \"{}\" is not a number in 0..65535", port));
  }
  return HostPort{std::string(host), value};
}

// ---- Server --------------------------------------------------------------------------------

class TcpStoreServer::Impl {
 public:
  Impl(std::string host, int port, Fd listener, Fd wake)
      : host_(std::move(host)), port_(port), listener_(std::move(listener)), wake_(std::move(wake)) {}

  ~Impl() {
    if (thread_.joinable()) {
      const std::uint64_t one = 1;
      // The eventfd cannot be full after one write; the thread wakes and leaves its loop.
      [[maybe_unused]] const auto written = ::write(wake_.get(), &one, sizeof one);
      thread_.join();
    }
  }

  void start_thread() {
    thread_ = std::thread([this] { serve(); });
  }

  int port() const { return port_; }
  std::string address() const {
    return host_.find(':') != std::string::npos ? fmt::format("[{}]:{}", host_, port_) : fmt::format("{}:{}", host_, port_);
  }

 private:
  enum class Parked { kNone, kGet, kWait };

  struct Peer {
    Fd fd;
    std::string name;  // "10.0.0.2:41234"
    std::vector<char> in;
    std::vector<char> out;
    std::size_t out_sent = 0;
    bool closed = false;
    std::string close_reason;
    int rank = -1;
    std::string lost_prefix;
    bool said_goodbye = false;
    Parked parked = Parked::kNone;
    std::vector<std::string> parked_keys;  // kGet: the key; kWait: those still missing
  };

  void serve() {
    try {
      loop();
    } catch (const std::exception&) {
      // Nothing sensible is left to do on this thread (out of memory): stop serving, so that
      // clients see closed connections (Unavailable) instead of waiting out their timeouts.
    }
    peers_.clear();
    listener_.reset();
  }

  void loop() {
    std::vector<pollfd> fds;
    for (;;) {
      fds.clear();
      fds.push_back({wake_.get(), POLLIN, 0});
      fds.push_back({listener_.get(), POLLIN, 0});
      for (const auto& peer : peers_) {
        const short events = static_cast<short>(POLLIN | (peer->out_sent < peer->out.size() ? POLLOUT : 0));
        fds.push_back({peer->fd.get(), events, 0});
      }
      // No timeout: the destructor wakes this thread through the eventfd.
      if (::poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[0].revents != 0) return;
      const std::size_t polled = peers_.size();
      for (std::size_t i = 0; i < polled; ++i) {
        Peer& peer = *peers_[i];
        const short revents = fds[i + 2].revents;
        if (!peer.closed && (revents & (POLLIN | POLLHUP | POLLERR)) != 0) read_from(peer);
        if (!peer.closed && (revents & POLLOUT) != 0) flush(peer);
      }
      if ((fds[1].revents & POLLIN) != 0) accept_all();
      reap();
    }
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t length = sizeof addr;
      const int fd = ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&addr), &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // EAGAIN: all taken; EMFILE and friends: the client's connect times out or retries
      }
      auto peer = std::make_unique<Peer>();
      peer->fd = Fd(fd);
      peer->name = format_sockaddr(reinterpret_cast<sockaddr*>(&addr), length);
      set_no_delay(fd);
      enable_keepalive(fd);
      peers_.push_back(std::move(peer));
    }
  }

  void close_peer(Peer& peer, std::string reason) {
    if (peer.closed) return;
    peer.closed = true;
    peer.close_reason = std::move(reason);
  }

  // Removes closed connections. One that announced a rank and did not say goodbye sets the
  // lost key, which may answer parked waits (and a failed reply there closes another peer:
  // hence the loop).
  void reap() {
    for (;;) {
      const auto it = std::find_if(peers_.begin(), peers_.end(), [](const auto& p) { return p->closed; });
      if (it == peers_.end()) return;
      std::unique_ptr<Peer> peer = std::move(*it);
      peers_.erase(it);
      if (peer->rank >= 0 && !peer->said_goodbye) {
        const std::string reason = fmt::format("connection from {} closed without goodbye ({})", peer->name, peer->close_reason);
        put(peer->lost_prefix + lost_rank_key(peer->rank), std::vector<char>(reason.begin(), reason.end()));
      }
    }
  }

  void read_from(Peer& peer) {
    char buffer[64 * 1024];
    bool eof = false;
    for (;;) {
      const ssize_t n = ::recv(peer.fd.get(), buffer, sizeof buffer, 0);
      if (n > 0) {
        peer.in.insert(peer.in.end(), buffer, buffer + n);
        continue;
      }
      if (n == 0) {
        eof = true;
        peer.close_reason = "connection closed";
        break;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        eof = true;
        peer.close_reason = socket_error_text(errno);
      }
      break;
    }
    // Frames that arrived with the close still count: a goodbye comes right before it.
    std::size_t offset = 0;
    while (!peer.closed && peer.in.size() - offset >= 4) {
      std::uint32_t length = 0;
      for (int i = 0; i < 4; ++i) {
        length |= static_cast<std::uint32_t>(static_cast<unsigned char>(peer.in[offset + static_cast<std::size_t>(i)])) << (8 * i);
      }
      if (length > kMaxFrameBytes) {
        close_peer(peer, fmt::format("protocol error: a frame of {} bytes", length));
        break;
      }
      if (peer.in.size() - offset - 4 < length) break;
      try {
        handle(peer, Reader(peer.in.data() + offset + 4, length));
      } catch (const std::exception& e) {
        close_peer(peer, fmt::format("error serving the connection: {}", e.what()));
      }
      offset += 4 + length;
    }
    peer.in.erase(peer.in.begin(), peer.in.begin() + static_cast<std::ptrdiff_t>(std::min(offset, peer.in.size())));
    if (eof) close_peer(peer, peer.close_reason);
  }

  void flush(Peer& peer) {
    while (!peer.closed && peer.out_sent < peer.out.size()) {
      const ssize_t n = ::send(peer.fd.get(), peer.out.data() + peer.out_sent, peer.out.size() - peer.out_sent, MSG_NOSIGNAL);
      if (n > 0) {
        peer.out_sent += static_cast<std::size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return;  // the rest goes when poll says the socket is writable
      } else {
        close_peer(peer, socket_error_text(n < 0 ? errno : EPIPE));
      }
    }
    if (peer.out_sent == peer.out.size()) {
      peer.out.clear();
      peer.out_sent = 0;
    }
  }

  void reply(Peer& peer, std::vector<char> frame) {
    if (peer.closed) return;
    peer.out.insert(peer.out.end(), frame.begin(), frame.end());
    flush(peer);
  }

  void reply_error(Peer& peer, std::uint8_t code, const std::string& message) {
    reply(peer, Writer(Status::kError).u8(code).str(message).finish());
  }

  void protocol_error(Peer& peer, std::string_view what) {
    reply_error(peer, kWireProtocol, fmt::format("protocol error: {}", what));
    close_peer(peer, fmt::format("protocol error: {}", what));
  }

  // Stores a value and answers the parked requests it completes.
  void put(const std::string& key, std::vector<char> value) {
    data_[key] = std::move(value);
    for (const auto& other : peers_) {
      Peer& p = *other;
      if (p.closed || p.parked == Parked::kNone) continue;
      if (p.parked == Parked::kGet) {
        if (p.parked_keys.front() != key) continue;
        p.parked = Parked::kNone;
        p.parked_keys.clear();
        reply(p, Writer(Status::kValue).bytes(data_.at(key)).finish());
      } else {
        std::erase(p.parked_keys, key);
        if (!p.parked_keys.empty()) continue;
        p.parked = Parked::kNone;
        reply(p, Writer(Status::kOk).finish());
      }
    }
  }

  void handle(Peer& peer, Reader r) {
    std::uint8_t op_byte = 0;
    if (!r.u8(op_byte)) return protocol_error(peer, "empty frame");
    const auto op = static_cast<Op>(op_byte);
    if (peer.parked != Parked::kNone && op != Op::kCancel) {
      return protocol_error(peer, "a request while another waits");
    }
    switch (op) {
      case Op::kHello: {
        std::int64_t rank = -1;
        std::string prefix;
        r.i64(rank);
        r.str(prefix);
        if (!r.at_end() || rank < 0 || rank > INT_MAX) return protocol_error(peer, "malformed HELLO");
        if (peer.rank >= 0) return protocol_error(peer, "HELLO twice on one connection");
        for (const auto& other : peers_) {
          if (other.get() != &peer && !other->closed && !other->said_goodbye && other->rank == rank &&
              other->lost_prefix == prefix) {
            return reply_error(peer, kWireInvalidArgument,
                               fmt::format("rank {} is already claimed by a live process (connected from {}): two "
                                           "processes were started as rank {}; each task needs its own index",
                                           rank, other->name, rank));
          }
        }
        peer.rank = static_cast<int>(rank);
        peer.lost_prefix = std::move(prefix);
        return reply(peer, Writer(Status::kOk).finish());
      }
      case Op::kBye:
        if (!r.at_end()) return protocol_error(peer, "malformed BYE");
        peer.said_goodbye = true;
        return reply(peer, Writer(Status::kOk).finish());
      case Op::kSet: {
        std::string key;
        std::vector<char> value;
        r.str(key);
        r.bytes(value);
        if (!r.at_end()) return protocol_error(peer, "malformed SET");
        reply(peer, Writer(Status::kOk).finish());
        return put(key, std::move(value));
      }
      case Op::kGet: {
        std::string key;
        r.str(key);
        if (!r.at_end()) return protocol_error(peer, "malformed GET");
        if (const auto it = data_.find(key); it != data_.end()) {
          return reply(peer, Writer(Status::kValue).bytes(it->second).finish());
        }
        peer.parked = Parked::kGet;
        peer.parked_keys = {std::move(key)};
        return;
      }
      case Op::kWait: {
        std::uint32_t count = 0;
        r.u32(count);
        std::vector<std::string> missing;
        for (std::uint32_t i = 0; i < count && r.ok(); ++i) {
          std::string key;
          if (r.str(key) && !data_.contains(key)) missing.push_back(std::move(key));
        }
        if (!r.at_end()) return protocol_error(peer, "malformed WAIT");
        if (missing.empty()) return reply(peer, Writer(Status::kOk).finish());
        peer.parked = Parked::kWait;
        peer.parked_keys = std::move(missing);
        return;
      }
      case Op::kCheck: {
        std::string key;
        r.str(key);
        if (!r.at_end()) return protocol_error(peer, "malformed CHECK");
        return reply(peer, Writer(Status::kBool).u8(data_.contains(key) ? 1 : 0).finish());
      }
      case Op::kAdd: {
        std::string key;
        std::int64_t delta = 0;
        r.str(key);
        r.i64(delta);
        if (!r.at_end()) return protocol_error(peer, "malformed ADD");
        std::int64_t value = 0;
        if (const auto it = data_.find(key); it != data_.end() && !it->second.empty()) {
          const char* begin = it->second.data();
          const char* end = begin + it->second.size();
          const auto [ptr, ec] = std::from_chars(begin, end, value);
          if (ec != std::errc() || ptr != end) {
            return reply_error(peer, kWireInvalidArgument,
                               fmt::format("add(\"{}\"): the key holds a value that is not a decimal integer ({} bytes)",
                                           key, it->second.size()));
          }
        }
        value += delta;
        reply(peer, Writer(Status::kInt).i64(value).finish());
        const std::string text = std::to_string(value);
        return put(key, std::vector<char>(text.begin(), text.end()));
      }
      case Op::kCancel:
        if (!r.at_end()) return protocol_error(peer, "malformed CANCEL");
        peer.parked = Parked::kNone;
        peer.parked_keys.clear();
        return reply(peer, Writer(Status::kCancelled).finish());
    }
    protocol_error(peer, fmt::format("unknown request {}", op_byte));
  }

  std::string host_;
  int port_;
  Fd listener_;
  Fd wake_;
  std::thread thread_;
  std::unordered_map<std::string, std::vector<char>> data_;
  std::vector<std::unique_ptr<Peer>> peers_;
};

namespace {

// Binds the listening socket: IPv6 dual-stack (every IPv4 and IPv6 interface) where the machine
// has IPv6, IPv4 otherwise. Returns the bound socket, or an empty Fd with errno set.
Fd bind_listener(int port, int* bind_errno) {
  for (const int family : {AF_INET6, AF_INET}) {
    Fd fd(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) {
      *bind_errno = errno;
      continue;
    }
    const int one = 1;
    const int zero = 0;
    // A restarted job binds the port again at once, while the previous run's connections linger
    // in TIME_WAIT.
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc = 0;
    if (family == AF_INET6) {
      ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      sockaddr_in6 addr{};
      addr.sin6_family = AF_INET6;
      addr.sin6_addr = in6addr_any;
      addr.sin6_port = htons(static_cast<std::uint16_t>(port));
      rc = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
    } else {
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_ANY);
      addr.sin_port = htons(static_cast<std::uint16_t>(port));
      rc = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
    }
    if (rc == 0 && ::listen(fd.get(), SOMAXCONN) == 0) return fd;
    *bind_errno = errno;
    // A taken port is taken for IPv4 too; anything else (IPv6 disabled) may work with IPv4.
    if (*bind_errno == EADDRINUSE) return Fd();
  }
  return Fd();
}

}  // namespace

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TcpStoreServer::~TcpStoreServer() = default;

std::unique_ptr<TcpStoreServer> TcpStoreServer::start(std::string_view host, int port) {
  TANDEM_REQUIRE(port >= 0 && port <= 65535, InvalidArgument, "TcpStoreServer::start(\"{}\", {}): port not in 0..65535",
                 host, port);
  const std::string host_name = host.empty() ? std::string("0.0.0.0") : std::string(host);
  int bind_errno = 0;
  Fd listener = bind_listener(port, &bind_errno);
  if (!listener) {
    const std::string where = fmt::format("{}:{}", host_name, port);
    if (bind_errno == EADDRINUSE) {
      throw AlreadyExists(fmt::format("cannot serve the store at {}: port {} is already in use (another job on this "
                                      "machine, or a process of a previous run still alive?)",
                                      where, port));
    }
    throw Unavailable(fmt::format("cannot serve the store at {}: {}", where, socket_error_text(bind_errno)));
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &length);
  const int bound_port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                                                     : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  Fd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) throw Unavailable(fmt::format("cannot serve the store at {}:{}: eventfd: {}", host_name, bound_port, socket_error_text(errno)));
  auto impl = std::make_unique<Impl>(host_name, bound_port, std::move(listener), std::move(wake));
  impl->start_thread();
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

int TcpStoreServer::port() const { return impl_->port(); }
std::string TcpStoreServer::address() const { return impl_->address(); }

// ---- Client --------------------------------------------------------------------------------

namespace {

class TcpStoreClient final : public Store {
 public:
  TcpStoreClient(std::string address, HostPort target, TcpStoreOptions options)
      : address_(std::move(address)), target_(std::move(target)), options_(std::move(options)) {
    description_ = options_.label_of_server.empty()
                       ? fmt::format("the store at {}", address_)
                       : fmt::format("the store at {} (served by {})", address_, options_.label_of_server);
  }

  ~TcpStoreClient() override {
    if (!liveness_) return;
    // Goodbye, and wait for its acknowledgement: once the destructor returns, the server knows
    // this exit was clean. Failures are ignored (the server may be gone already).
    const Deadline deadline = deadline_after(kGoodbyeTimeout);
    if (send_all(liveness_.get(), Writer(Op::kBye).finish(), deadline).kind == IoKind::kOk) {
      std::vector<char> frame;
      recv_frame(liveness_.get(), frame, deadline, deadline);
    }
  }

  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  const std::string& description() const { return description_; }

  // Takes the first connection: it announces the rank, or else joins the pool.
  void adopt_first_connection(Fd fd) {
    if (options_.rank < 0) {
      idle_.push_back(std::move(fd));
      return;
    }
    const std::string what = fmt::format("announcing rank {}", options_.rank);
    const Deadline deadline = deadline_after(options_.request_timeout);
    IoResult io = send_all(fd.get(), Writer(Op::kHello).i64(options_.rank).str(options_.lost_key_prefix).finish(), deadline);
    std::vector<char> frame;
    if (io.kind == IoKind::kOk) io = recv_frame(fd.get(), frame, deadline, deadline);
    if (io.kind != IoKind::kOk) throw_io_error(what, io);
    Reply reply;
    if (!parse_reply(frame, reply)) throw_malformed_reply(what);
    expect(reply, Status::kOk, what);
    liveness_ = std::move(fd);
  }

  void set(const std::string& key, const std::vector<char>& value) override {
    const std::string what = fmt::format("set(\"{}\")", key);
    TANDEM_REQUIRE(key.size() + value.size() <= kMaxValueBytes, InvalidArgument,
                   "{}: {}: {} bytes is more than the store carries ({} bytes)", description_, what,
                   key.size() + value.size(), kMaxValueBytes);
    Lease lease = acquire(what);
    send(lease, what, Writer(Op::kSet).str(key).bytes(value).finish());
    expect(receive(lease, what, deadline_after(options_.request_timeout)).value(), Status::kOk, what);
  }

  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) override {
    const std::string what = fmt::format("get(\"{}\")", key);
    Lease lease = acquire(what);
    send(lease, what, Writer(Op::kGet).str(key).finish());
    std::optional<Reply> reply = receive(lease, what, deadline_after(timeout), /*timeout_throws=*/false);
    if (!reply) reply = cancel(lease);
    if (!reply) {
      throw DeadlineExceeded(fmt::format("{}: get(\"{}\") timed out after {}: no client set the key", description_, key,
                                         format_duration(timeout)));
    }
    expect(*reply, Status::kValue, what);
    return std::move(reply->value);
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    if (keys.empty()) return;
    const std::string what = fmt::format("wait for {} key(s)", keys.size());
    {
      Lease lease = acquire(what);
      Writer request(Op::kWait);
      request.u32(static_cast<std::uint32_t>(keys.size()));
      for (const auto& k : keys) request.str(k);
      send(lease, what, request.finish());
      std::optional<Reply> reply = receive(lease, what, deadline_after(timeout), /*timeout_throws=*/false);
      if (!reply) reply = cancel(lease);
      if (reply) return expect(*reply, Status::kOk, what);
    }
    // Timed out: name the keys still missing (asking again; if even that fails, all of them).
    std::vector<std::string> missing;
    try {
      for (const auto& k : keys) {
        if (!check(k)) missing.push_back(k);
      }
    } catch (const Error&) {
      missing = keys;
    }
    throw DeadlineExceeded(fmt::format("{}: wait for {} key(s) timed out after {}; still missing: {}", description_,
                                       keys.size(), format_duration(timeout), quoted_list(missing)));
  }

  bool check(const std::string& key) override {
    const std::string what = fmt::format("check(\"{}\")", key);
    Lease lease = acquire(what);
    send(lease, what, Writer(Op::kCheck).str(key).finish());
    const Reply reply = receive(lease, what, deadline_after(options_.request_timeout)).value();
    expect(reply, Status::kBool, what);
    return reply.flag;
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    const std::string what = fmt::format("add(\"{}\", {})", key, delta);
    Lease lease = acquire(what);
    send(lease, what, Writer(Op::kAdd).str(key).i64(delta).finish());
    const Reply reply = receive(lease, what, deadline_after(options_.request_timeout)).value();
    expect(reply, Status::kInt, what);
    return reply.number;
  }

  std::string address() const override { return address_; }

 private:
  // One call's connection. Back to the pool when the call is done, unless it broke (or may hold
  // an unread reply): then it is closed.
  class Lease {
   public:
    Lease(TcpStoreClient* owner, Fd fd) : owner_(owner), fd_(std::move(fd)) {}
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = delete;
    ~Lease() {
      if (fd_) owner_->release(std::move(fd_));
    }
    int fd() const { return fd_.get(); }
    bool alive() const { return static_cast<bool>(fd_); }
    void discard() { fd_.reset(); }

   private:
    TcpStoreClient* owner_;
    Fd fd_;
  };

  Lease acquire(const std::string& what) {
    {
      std::lock_guard lock(mutex_);
      if (!idle_.empty()) {
        Fd fd = std::move(idle_.back());
        idle_.pop_back();
        return Lease(this, std::move(fd));
      }
    }
    std::string error;
    Fd fd = connect_once(target_, deadline_after(options_.request_timeout), &error);
    if (!fd) {
      throw Unavailable(fmt::format("{}: cannot open a connection for {}: {} (has the server's process exited?)",
                                    description_, what, error));
    }
    return Lease(this, std::move(fd));
  }

  void release(Fd fd) {
    std::lock_guard lock(mutex_);
    if (idle_.size() < kMaxIdleConnections) idle_.push_back(std::move(fd));
  }

  [[noreturn]] void throw_io_error(const std::string& what, const IoResult& io) const {
    switch (io.kind) {
      case IoKind::kTimeout:
        throw DeadlineExceeded(fmt::format("{}: no reply to {} within {} (the server does not respond)", description_, what,
                                            format_duration(options_.request_timeout)));
      case IoKind::kClosed:
        throw Unavailable(fmt::format("{}: the server closed the connection during {} (its process exited or stopped "
                                       "serving)",
                                       description_, what));
      case IoKind::kOk:
      case IoKind::kError:
        break;
    }
    throw Unavailable(fmt::format("{}: lost the connection during {}: {}", description_, what, socket_error_text(io.err)));
  }

  [[noreturn]] void throw_malformed_reply(const std::string& what) const {
    throw DataLoss(fmt::format("{}: malformed reply to {} (is something else listening on that port?)", description_, what));
  }

  void send(Lease& lease, const std::string& what, const std::vector<char>& request) {
    const IoResult io = send_all(lease.fd(), request, deadline_after(options_.request_timeout));
    if (io.kind != IoKind::kOk) {
      lease.discard();
      throw_io_error(what, io);
    }
  }

  // The next reply on the lease's connection. A timeout returns nullopt when !timeout_throws
  // (the caller cancels); every other failure throws, discarding the connection.
  std::optional<Reply> receive(Lease& lease, const std::string& what, Deadline deadline, bool timeout_throws = true) {
    std::vector<char> frame;
    const IoResult io = recv_frame(lease.fd(), frame, deadline, deadline_after(options_.request_timeout));
    if (io.kind == IoKind::kTimeout && !timeout_throws) return std::nullopt;
    if (io.kind != IoKind::kOk) {
      lease.discard();
      throw_io_error(what, io);
    }
    Reply reply;
    if (!parse_reply(frame, reply)) {
      lease.discard();
      throw_malformed_reply(what);
    }
    return reply;
  }

  // After a get/wait timed out: withdraws it. Returns its reply if that crossed the cancel (the
  // key arrived just in time), else nullopt. Whatever fails here discards the connection (closing
  // it drops the parked request on the server too).
  std::optional<Reply> cancel(Lease& lease) {
    const Deadline deadline = deadline_after(kCancelTimeout);
    if (send_all(lease.fd(), Writer(Op::kCancel).finish(), deadline).kind != IoKind::kOk) {
      lease.discard();
      return std::nullopt;
    }
    std::vector<char> frame;
    Reply first;
    if (recv_frame(lease.fd(), frame, deadline, deadline).kind != IoKind::kOk || !parse_reply(frame, first)) {
      lease.discard();
      return std::nullopt;
    }
    if (first.status == Status::kCancelled) return std::nullopt;
    Reply second;
    if (recv_frame(lease.fd(), frame, deadline, deadline).kind != IoKind::kOk || !parse_reply(frame, second) ||
        second.status != Status::kCancelled) {
      lease.discard();
    }
    return first;
  }

  void expect(const Reply& reply, Status status, const std::string& what) const {
    if (reply.status == status) return;
    if (reply.status == Status::kError) {
      if (reply.error_code == kWireInvalidArgument) throw InvalidArgument(fmt::format("{}: {}", description_, reply.error));
      throw Internal(fmt::format("{}: {} failed on the server: {}", description_, what, reply.error));
    }
    throw DataLoss(fmt::format("{}: unexpected reply (status {}) to {}", description_, static_cast<int>(reply.status), what));
  }

  const std::string address_;
  const HostPort target_;
  const TcpStoreOptions options_;
  std::string description_;
  Fd liveness_;  // says HELLO at connect and BYE in the destructor; no requests
  std::mutex mutex_;
  std::vector<Fd> idle_;
};

}  // namespace

std::shared_ptr<Store> connect_tcp_store(std::string_view address, TcpStoreOptions options) {
  const HostPort target = parse_host_port(address);
  TANDEM_REQUIRE(target.port != 0, InvalidArgument, "connect_tcp_store(\"{}\"): port 0 names no server", address);
  const std::chrono::milliseconds connect_timeout = options.connect_timeout;
  auto interval = std::clamp(options.retry_interval, std::chrono::milliseconds(1), kMaxRetryInterval);
  auto client = std::make_shared<TcpStoreClient>(std::string(address), target, std::move(options));

  const Deadline deadline = deadline_after(connect_timeout);
  std::string last_error = "no attempt made";
  int attempts = 0;
  for (;;) {
    ++attempts;
    Fd fd = connect_once(target, deadline, &last_error);
    if (fd) {
      client->adopt_first_connection(std::move(fd));
      return client;
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(interval, deadline - now));
    interval = std::min(interval * 3 / 2, kMaxRetryInterval);
  }
  throw DeadlineExceeded(fmt::format("could not connect to {} within {} ({} attempt{}); last error: {}",
                                     client->description(), format_duration(connect_timeout), attempts,
                                     attempts == 1 ? "" : "s", last_error));
}

}  // namespace tandem::collective
