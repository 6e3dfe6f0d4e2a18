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

#include "tandem/collective/detail/store_wire.h"

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

IoResult recv_frame(int fd, std::vector<char>& frame, Deadline deadline, Deadline rest_deadline) {
  char header[4];
  IoResult r = recv_all(fd, header, 1, deadline);
  if (r.kind == IoKind::kOk) r = recv_all(fd, header + 1, sizeof header - 1, std::max(deadline, rest_deadline));
  if (r.kind != IoKind::kOk) return r;
  const std::uint32_t length = wire::read_u32(header);
  if (length > wire::kMaxFrameBytes) return {IoKind::kError, EPROTO};
  frame.resize(length);
  return recv_all(fd, frame.data(), length, std::max(deadline, rest_deadline));
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

bool is_any_host(std::string_view host) { return host.empty() || host == "0.0.0.0" || host == "::" || host == "*"; }

namespace {

// A listening socket on one address, or an empty Fd with *err set.
Fd listen_on(const sockaddr* addr, socklen_t length, int* err) {
  Fd fd(::socket(addr->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) {
    *err = errno;
    return Fd();
  }
  const int one = 1;
  // A restarted job binds the port again at once, while the previous run's connections linger
  // in TIME_WAIT.
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (addr->sa_family == AF_INET6) {
    // The wildcard takes IPv4 too (dual-stack); a specific IPv6 address only itself, so that
    // "localhost" can bind ::1 beside 127.0.0.1.
    const bool any = IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr);
    const int v6_only = any ? 0 : 1;
    ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &v6_only, sizeof v6_only);
  }
  if (::bind(fd.get(), addr, length) != 0 || ::listen(fd.get(), SOMAXCONN) != 0) {
    *err = errno;
    return Fd();
  }
  return fd;
}

void set_port(sockaddr_storage& addr, int port) {
  const auto p = htons(static_cast<std::uint16_t>(port));
  if (addr.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = p;
  } else {
    reinterpret_cast<sockaddr_in*>(&addr)->sin_port = p;
  }
}

// The addresses to bind: the wildcard (IPv6 dual-stack first, IPv4 as the fallback: only one of
// them is bound), or what `host` resolves to, without repeats.
std::vector<sockaddr_storage> addresses_to_bind(const std::string& host, Listeners& out) {
  std::vector<sockaddr_storage> found;
  if (is_any_host(host)) {
    sockaddr_storage v6{};
    reinterpret_cast<sockaddr_in6*>(&v6)->sin6_family = AF_INET6;
    reinterpret_cast<sockaddr_in6*>(&v6)->sin6_addr = in6addr_any;
    sockaddr_storage v4{};
    reinterpret_cast<sockaddr_in*>(&v4)->sin_family = AF_INET;
    reinterpret_cast<sockaddr_in*>(&v4)->sin_addr.s_addr = htonl(INADDR_ANY);
    return {v6, v4};
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* list = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &list);
  if (rc != 0) {
    out.error = fmt::format("cannot resolve host \"{}\": {}", host, ::gai_strerror(rc));
    return {};
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(list, &::freeaddrinfo);
  for (const addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_addrlen > sizeof(sockaddr_storage)) continue;
    sockaddr_storage addr{};
    std::memcpy(&addr, ai->ai_addr, ai->ai_addrlen);
    const bool seen = std::any_of(found.begin(), found.end(), [&](const sockaddr_storage& other) {
      return std::memcmp(&other, &addr, sizeof addr) == 0;
    });
    if (!seen) found.push_back(addr);
  }
  return found;
}

socklen_t length_of(const sockaddr_storage& addr) {
  return addr.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

}  // namespace

Listeners bind_listeners(const std::string& host, int port) {
  Listeners out;
  const std::vector<sockaddr_storage> addresses = addresses_to_bind(host, out);
  const bool any = is_any_host(host);
  for (sockaddr_storage addr : addresses) {
    set_port(addr, port);
    int err = 0;
    Fd fd = listen_on(reinterpret_cast<const sockaddr*>(&addr), length_of(addr), &err);
    if (!fd) {
      // A taken port is taken for every address; an address this machine cannot bind (IPv6
      // disabled, an address of another machine) is skipped while another one works.
      if (err == EADDRINUSE) {
        out.fds.clear();
        out.bind_errno = err;
        out.error = socket_error_text(err);
        return out;
      }
      if (out.bind_errno == 0) {
        out.bind_errno = err;
        out.error = socket_error_text(err);
      }
      continue;
    }
    // Port 0: the others take the port the kernel gave the first.
    if (port == 0) port = bound_address(fd.get()).port;
    out.fds.push_back(std::move(fd));
    if (any) break;  // the dual-stack wildcard covers IPv4 too
  }
  if (!out.fds.empty()) {
    out.bind_errno = 0;
    out.error.clear();
  } else if (out.error.empty()) {
    out.error = fmt::format("host \"{}\" has no address to listen on", host);
  }
  return out;
}

BoundAddress bound_address(int fd) {
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
  BoundAddress out;
  out.text = format_sockaddr(reinterpret_cast<const sockaddr*>(&bound), length);
  if (bound.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&bound);
    out.port = ntohs(in6->sin6_port);
    out.any = IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr);
    out.loopback = IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr) ||
                   (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr) && in6->sin6_addr.s6_addr[12] == 127);
  } else {
    const auto* in4 = reinterpret_cast<const sockaddr_in*>(&bound);
    out.port = ntohs(in4->sin_port);
    out.any = in4->sin_addr.s_addr == htonl(INADDR_ANY);
    out.loopback = (ntohl(in4->sin_addr.s_addr) >> 24) == 127;
  }
  return out;
}

}  // namespace tandem::collective::detail
