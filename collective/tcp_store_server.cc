// The TCP store's server (tcp_store.h): one thread polling every connection. The sockets are
// socket.h's; what the bytes mean, and every bound on them, is detail/store_service.h's. This
// file moves bytes between the two.
//
// One thread runs poll() over an eventfd (the stop signal), the listening sockets and every client
// socket, all non-blocking. A connection is polled for input only while the service wants bytes
// from it (so a client that does not read its replies, or a frame waiting for budget, is left in
// the kernel's buffers: TCP flow control slows the sender) and for output while it has replies
// queued. poll() wakes at the service's next deadline too (a handshake taking too long).
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "tandem/base/errors.h"
#include "tandem/base/log.h"
#include "tandem/collective/detail/socket.h"
#include "tandem/collective/detail/store_auth.h"
#include "tandem/collective/detail/store_service.h"
#include "tandem/collective/tcp_store.h"

namespace tandem::collective {

using detail::BoundAddress;
using detail::enable_keepalive;
using detail::Fd;
using detail::format_sockaddr;
using detail::set_no_delay;
using detail::socket_error_text;
using detail::StoreService;

namespace {

using Clock = StoreService::Clock;

// How long accepting pauses when the process is out of file descriptors and no connection could
// make room: the listener stays readable, and polling it at once would spin.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);
// Reads from one connection per wake-up, so that one fast sender does not starve the others.
constexpr int kReadsPerWake = 16;

// "host:port", bracketing an IPv6 host.
std::string join_host_port(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

// Whether the user named loopback on purpose: a numeric address, or localhost.
bool names_an_address_or_localhost(const std::string& host) {
  in6_addr v6{};
  in_addr v4{};
  return ::inet_pton(AF_INET, host.c_str(), &v4) == 1 || ::inet_pton(AF_INET6, host.c_str(), &v6) == 1 ||
         host == "localhost" || host.ends_with(".localhost");
}

}  // namespace

class TcpStoreServer::Impl {
 public:
  Impl(std::string host, std::vector<Fd> listeners, Fd wake, TcpStoreServerOptions options)
      : host_(std::move(host)),
        listeners_(std::move(listeners)),
        wake_(std::move(wake)),
        bound_(detail::bound_address(listeners_.front().get())),
        service_(std::move(options), join_host_port(host_, bound_.port)) {}

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

  int port() const { return bound_.port; }
  std::string address() const { return join_host_port(host_, bound_.port); }
  std::string local_address() const { return bound_.any ? fmt::format("127.0.0.1:{}", bound_.port) : bound_.text; }
  TcpStoreServerStats stats() const {
    std::lock_guard lock(mutex_);
    return service_.stats();
  }

 private:
  void serve() {
    try {
      loop();
    } catch (const std::exception& e) {
      // Nothing sensible is left to do on this thread (out of memory): stop serving, so that
      // clients see closed connections (Unavailable) instead of waiting out their timeouts.
      logging::error("the store at {} stopped serving: {}", address(), e.what());
    }
    sockets_.clear();
    listeners_.clear();
  }

  // The thread holds mutex_ except while it waits in poll(), so that stats() sees the effects of
  // everything a client could have observed.
  void loop() {
    std::vector<pollfd> fds;
    std::vector<StoreService::Id> ids;
    std::unique_lock lock(mutex_);
    for (;;) {
      const auto now = Clock::now();
      auto wake_at = service_.expire(now);
      close_finished();
      const bool accepting = now >= accept_paused_until_;
      if (!accepting) wake_at = std::min(wake_at, accept_paused_until_);

      fds.clear();
      ids.clear();
      fds.push_back({wake_.get(), POLLIN, 0});
      for (const auto& listener : listeners_)
        fds.push_back({listener.get(), static_cast<short>(accepting ? POLLIN : 0), 0});
      for (const auto& [id, fd] : sockets_) {
        const short events =
            static_cast<short>((service_.wants(id) > 0 ? POLLIN : 0) | (service_.output(id).empty() ? 0 : POLLOUT));
        fds.push_back({fd.get(), events, 0});
        ids.push_back(id);
      }
      int timeout = -1;
      if (wake_at != Clock::time_point::max()) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(wake_at - Clock::now()).count();
        timeout = static_cast<int>(std::clamp<long long>(left, 0, INT_MAX));
      }
      lock.unlock();
      const int polled = ::poll(fds.data(), fds.size(), timeout);
      const int poll_errno = errno;
      lock.lock();
      if (polled < 0) {
        if (poll_errno == EINTR) continue;
        throw Unavailable(fmt::format("poll: {}", socket_error_text(poll_errno)));
      }
      if (fds[0].revents != 0) return;
      const std::size_t first_peer = 1 + listeners_.size();
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const short revents = fds[first_peer + i].revents;
        const int fd = fds[first_peer + i].fd;
        if ((revents & (POLLIN | POLLHUP | POLLERR)) != 0) read_from(ids[i], fd, revents);
        if ((revents & POLLOUT) != 0 || !service_.output(ids[i]).empty()) write_to(ids[i], fd);
      }
      for (std::size_t l = 0; l < listeners_.size(); ++l) {
        if ((fds[1 + l].revents & POLLIN) != 0) accept_all(listeners_[l].get());
      }
      close_finished();
    }
  }

  void accept_all(int listener) {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t length = sizeof addr;
      const int fd = ::accept4(listener, reinterpret_cast<sockaddr*>(&addr), &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        // Out of descriptors (or memory): a connection still in its handshake makes room, else
        // the waiting clients stay in the backlog for a while (their connect retries).
        if (service_.evict_a_handshake()) {
          close_finished();
          continue;
        }
        logging::warn("the store at {} cannot accept connections for now: {}", address(), socket_error_text(errno));
        accept_paused_until_ = Clock::now() + kAcceptPause;
        return;
      }
      Fd socket(fd);
      set_no_delay(fd);
      enable_keepalive(fd);
      const StoreService::Id id =
          service_.open(format_sockaddr(reinterpret_cast<sockaddr*>(&addr), length), Clock::now());
      sockets_.emplace(id, std::move(socket));
      write_to(id, fd);  // the challenge (or the refusal)
    }
  }

  void read_from(StoreService::Id id, int fd, short revents) {
    char buffer[StoreService::kAllowance];
    for (int reads = 0; reads < kReadsPerWake; ++reads) {
      const std::size_t want = std::min(service_.wants(id), sizeof buffer);
      if (want == 0) {
        // Not reading now; a hang-up still counts (the kernel reports it whatever we ask for).
        if ((revents & (POLLHUP | POLLERR)) != 0) service_.hang_up(id, hang_up_reason(fd));
        return;
      }
      const ssize_t n = ::recv(fd, buffer, want, 0);
      if (n > 0) {
        service_.receive(id, buffer, static_cast<std::size_t>(n));
        continue;
      }
      if (n == 0) return service_.hang_up(id, "connection closed");
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) service_.hang_up(id, socket_error_text(errno));
      return;
    }
  }

  static std::string hang_up_reason(int fd) {
    int error = 0;
    socklen_t length = sizeof error;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
    return error != 0 ? socket_error_text(error) : "connection closed";
  }

  void write_to(StoreService::Id id, int fd) {
    for (std::string_view out = service_.output(id); !out.empty(); out = service_.output(id)) {
      const ssize_t n = ::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        service_.sent(id, static_cast<std::size_t>(n));
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return;  // the rest goes when poll says the socket is writable
      } else {
        return service_.hang_up(id, socket_error_text(n < 0 ? errno : EPIPE));
      }
    }
  }

  void close_finished() {
    for (const StoreService::Id id : service_.take_closed()) sockets_.erase(id);
  }

  std::string host_;
  std::vector<Fd> listeners_;
  Fd wake_;
  BoundAddress bound_;
  StoreService service_;
  std::unordered_map<StoreService::Id, Fd> sockets_;
  Clock::time_point accept_paused_until_{};
  std::thread thread_;
  mutable std::mutex mutex_;  // the service's state, for stats()
};

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TcpStoreServer::~TcpStoreServer() = default;

std::size_t store_connections_for(int world_size) {
  return 16 * static_cast<std::size_t>(std::max(world_size, 1)) + 16;
}

std::unique_ptr<TcpStoreServer> TcpStoreServer::start(std::string_view host, int port, TcpStoreServerOptions options) {
  TANDEM_REQUIRE(port >= 0 && port <= 65535, InvalidArgument, "TcpStoreServer::start(\"{}\", {}): port not in 0..65535",
                 host, port);
  TANDEM_REQUIRE(options.max_connections >= 1 && options.max_buffered_bytes >= StoreService::kAllowance &&
                     options.handshake_timeout.count() > 0,
                 InvalidArgument,
                 "TcpStoreServer::start(\"{}\", {}): max_connections must be at least 1, max_buffered_bytes at least "
                 "{} and handshake_timeout positive (got {}, {} and {} ms)",
                 host, port, StoreService::kAllowance, options.max_connections, options.max_buffered_bytes,
                 options.handshake_timeout.count());
  std::string host_name = host.empty() ? std::string("0.0.0.0") : std::string(host);
  const std::string where = join_host_port(host_name, port);
  detail::Listeners bound = detail::bind_listeners(host_name, port);
  // A name this machine resolves only to loopback (Debian's 127.0.1.1 for its own name) while the
  // other machines resolve it to a reachable address: listening there would lock them out.
  const auto only_loopback = [](const detail::Listeners& l) {
    return std::all_of(l.fds.begin(), l.fds.end(),
                       [](const Fd& fd) { return detail::bound_address(fd.get()).loopback; });
  };
  if (!bound.fds.empty() && !names_an_address_or_localhost(host_name) && !detail::is_any_host(host_name) &&
      only_loopback(bound)) {
    const BoundAddress first = detail::bound_address(bound.fds.front().get());
    logging::warn(
        "the store's host \"{}\" resolves to {} on this machine, a loopback address other machines cannot reach: "
        "the store listens on every interface instead (give the chief's address as a number to listen there only)",
        host_name, first.text);
    bound.fds.clear();
    bound = detail::bind_listeners("", first.port);
  }
  if (bound.fds.empty()) {
    if (bound.bind_errno == EADDRINUSE) {
      throw AlreadyExists(
          fmt::format("cannot serve the store at {}: port {} is already in use (another job on this "
                      "machine, or a process of a previous run still alive?)",
                      where, port));
    }
    throw Unavailable(fmt::format("cannot serve the store at {}: {}", where, bound.error));
  }
  Fd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake)
    throw Unavailable(fmt::format("cannot serve the store at {}: eventfd: {}", where, socket_error_text(errno)));

  options.secret = detail::auth::resolve_secret(options.secret);
  const bool has_secret = !options.secret.empty();
  std::string exposed;
  for (const Fd& fd : bound.fds) {
    const BoundAddress a = detail::bound_address(fd.get());
    if (!a.loopback) exposed = a.any ? fmt::format("every interface (port {})", a.port) : a.text;
  }
  auto impl = std::make_unique<Impl>(host_name, std::move(bound.fds), std::move(wake), std::move(options));
  if (!has_secret && !exposed.empty()) {
    logging::warn(
        "the store at {} listens on {} without a secret: any process that reaches the port can read and write its keys "
        "and pose as a worker; set TANDEM_STORE_SECRET, the same for every worker, to require one",
        impl->address(), exposed);
  }
  impl->start_thread();
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

int TcpStoreServer::port() const { return impl_->port(); }
std::string TcpStoreServer::address() const { return impl_->address(); }
std::string TcpStoreServer::local_address() const { return impl_->local_address(); }
TcpStoreServerStats TcpStoreServer::stats() const { return impl_->stats(); }

}  // namespace tandem::collective
