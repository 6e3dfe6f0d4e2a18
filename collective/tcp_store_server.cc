// The TCP store's server (tcp_store.h): one thread polling every connection. The sockets are
// socket.h's, the frames store_wire.h's; this file is about serving them.
//
// One thread runs poll() over an eventfd (the stop signal), the listening socket and every client
// socket, all non-blocking. Requests on one connection are answered in order; a GET or WAIT whose
// keys are missing is parked on its connection (at most one per connection: a client sends its
// next request only after the reply) and answered when a SET or ADD creates the key. CANCEL
// unparks it and is answered with CANCELLED, so that a client whose wait timed out can reuse the
// connection. A connection that announced a rank (HELLO) and closes without BYE makes the server
// set that rank's lost key.
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <thread>
#include <unordered_map>
#include <utility>

#include "tandem/base/errors.h"
#include "tandem/collective/detail/socket.h"
#include "tandem/collective/detail/store_wire.h"
#include "tandem/collective/tcp_store.h"

namespace tandem::collective {

using detail::bind_listener;
using detail::bound_port;
using detail::enable_keepalive;
using detail::Fd;
using detail::format_sockaddr;
using detail::set_no_delay;
using detail::socket_error_text;
using detail::wire::kInvalidArgument;
using detail::wire::kMaxFrameBytes;
using detail::wire::kProtocol;
using detail::wire::Op;
using detail::wire::read_u32;
using detail::wire::Reader;
using detail::wire::Status;
using detail::wire::Writer;

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
    return host_.find(':') != std::string::npos ? fmt::format("[{}]:{}", host_, port_)
                                                : fmt::format("{}:{}", host_, port_);
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
      const int fd =
          ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&addr), &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
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
        const std::string reason =
            fmt::format("connection from {} closed without goodbye ({})", peer->name, peer->close_reason);
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
      const std::uint32_t length = read_u32(peer.in.data() + offset);
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
      const ssize_t n =
          ::send(peer.fd.get(), peer.out.data() + peer.out_sent, peer.out.size() - peer.out_sent, MSG_NOSIGNAL);
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
    reply_error(peer, kProtocol, fmt::format("protocol error: {}", what));
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
            return reply_error(peer, kInvalidArgument,
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
            return reply_error(
                peer, kInvalidArgument,
                fmt::format("add(\"{}\"): the key holds a value that is not a decimal integer ({} bytes)", key,
                            it->second.size()));
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
      throw AlreadyExists(
          fmt::format("cannot serve the store at {}: port {} is already in use (another job on this "
                      "machine, or a process of a previous run still alive?)",
                      where, port));
    }
    throw Unavailable(fmt::format("cannot serve the store at {}: {}", where, socket_error_text(bind_errno)));
  }
  const int port_bound = bound_port(listener.get());
  Fd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake)
    throw Unavailable(
        fmt::format("cannot serve the store at {}:{}: eventfd: {}", host_name, port_bound, socket_error_text(errno)));
  auto impl = std::make_unique<Impl>(host_name, port_bound, std::move(listener), std::move(wake));
  impl->start_thread();
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

int TcpStoreServer::port() const { return impl_->port(); }
std::string TcpStoreServer::address() const { return impl_->address(); }

}  // namespace tandem::collective
