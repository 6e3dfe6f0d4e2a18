// The TCP store's sockets (socket.h): all non-blocking, every wait bounded by a deadline.
#include "tandem/collective/detail/socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>
#include <system_error>

#include <fmt/format.h>

namespace tandem::collective::detail {
namespace {

// Keepalive probes close a silent peer's connection after about kKeepAliveIdle + kKeepAliveCount
// x kKeepAliveInterval (a minute), so that its lost key still appears.
constexpr int kKeepAliveIdleSeconds = 30;
constexpr int kKeepAliveIntervalSeconds = 5;
constexpr int kKeepAliveCount = 3;

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

}  // namespace

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string socket_error_text(int err) {
  std::string text = std::error_code(err, std::system_category()).message();
  if (!text.empty() && text[0] >= 'A' && text[0] <= 'Z' && (text.size() < 2 || !(text[1] >= 'A' && text[1] <= 'Z'))) {
    text[0] = static_cast<char>(text[0] - 'A' + 'a');
  }
  return text;
}

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

void set_no_delay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void enable_keepalive(int fd) {
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &kKeepAliveIdleSeconds, sizeof kKeepAliveIdleSeconds);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &kKeepAliveIntervalSeconds, sizeof kKeepAliveIntervalSeconds);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &kKeepAliveCount, sizeof kKeepAliveCount);
}

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

int bound_port(int fd) {
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
  return bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                                     : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
}

}  // namespace tandem::collective::detail
