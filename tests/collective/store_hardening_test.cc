// The TCP store against peers that do not play by its rules: huge unfinished frames, replies
// never read, another rank's keys, listening where it was not asked to, no credentials. Each
// attack runs against a server in this process, from raw sockets that speak the wire format by
// hand; the server's memory is read from /proc/self/status.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tandem/base/errors.h"
#include "tandem/collective/detail/store_wire.h"
#include "tandem/collective/rendezvous.h"
#include "tandem/collective/tcp_store.h"

namespace {

using namespace std::chrono_literals;
using namespace tandem::collective;
using namespace tandem::collective::detail::wire;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kMiB = 1 << 20;

std::vector<char> bytes(std::string_view s) { return std::vector<char>(s.begin(), s.end()); }
std::string text(const std::vector<char>& v) { return std::string(v.begin(), v.end()); }

// The message of the E that fn throws; a description of anything else.
template <class E>
std::string thrown(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<another error: ") + e.what() + ">";
  }
  return "<no error>";
}

// This process's resident memory, in bytes.
std::size_t resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with("VmRSS:")) return std::stoull(line.substr(6)) * 1024;
  }
  FAIL("no VmRSS in /proc/self/status");
  return 0;
}

// The most this process's resident memory rises above `baseline` within `window`.
std::size_t growth_within(std::size_t baseline, std::chrono::milliseconds window) {
  std::size_t most = 0;
  for (const auto end = Clock::now() + window; Clock::now() < end; std::this_thread::sleep_for(20ms)) {
    const std::size_t now = resident_bytes();
    most = std::max(most, now > baseline ? now - baseline : 0);
  }
  return most;
}

// A client that speaks the wire format by hand over a blocking socket (each send or receive
// gives up after a few seconds).
class RawPeer {
 public:
  explicit RawPeer(int port, const char* host = "127.0.0.1") {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    const timeval timeout{.tv_sec = 5, .tv_usec = 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    REQUIRE(::inet_pton(AF_INET, host, &addr.sin_addr) == 1);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~RawPeer() { ::close(fd_); }
  RawPeer(const RawPeer&) = delete;
  RawPeer& operator=(const RawPeer&) = delete;

  bool connected() const { return connected_; }

  // Sends what it can of `data`; the bytes sent.
  std::size_t send(const char* data, std::size_t size) {
    std::size_t sent = 0;
    while (sent < size) {
      const ssize_t n = ::send(fd_, data + sent, size - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<std::size_t>(n);
    }
    return sent;
  }
  bool send(const std::vector<char>& frame) { return send(frame.data(), frame.size()) == frame.size(); }

  // The header of a frame of `length` bytes, then `body` bytes of it (not the whole frame).
  std::size_t send_unfinished_frame(std::uint32_t length, std::size_t body) {
    const char header[4] = {static_cast<char>(length & 0xff), static_cast<char>((length >> 8) & 0xff),
                            static_cast<char>((length >> 16) & 0xff), static_cast<char>((length >> 24) & 0xff)};
    if (send(header, 4) != 4) return 0;
    const std::vector<char> chunk(kMiB, 'x');
    std::size_t sent = 0;
    while (sent < body) {
      const std::size_t n = send(chunk.data(), std::min(chunk.size(), body - sent));
      sent += n;
      if (n == 0) break;
    }
    return sent;
  }

  // The next frame's payload, or nullopt when the connection closed or nothing came in time.
  std::optional<std::vector<char>> receive() {
    char header[4];
    if (!receive(header, 4)) return std::nullopt;
    std::vector<char> payload(read_u32(header));
    if (!receive(payload.data(), payload.size())) return std::nullopt;
    return payload;
  }

 private:
  bool receive(char* data, std::size_t size) {
    std::size_t got = 0;
    while (got < size) {
      const ssize_t n = ::recv(fd_, data + got, size - got, 0);
      if (n <= 0) return false;
      got += static_cast<std::size_t>(n);
    }
    return true;
  }

  int fd_ = -1;
  bool connected_ = false;
};

// Sets an environment variable for one test, restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// An IPv4 address of this machine other than loopback, if it has one.
std::optional<std::string> non_loopback_address() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return std::nullopt;
  std::optional<std::string> found;
  for (const ifaddrs* i = list; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    const auto* in = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if ((ntohl(in->sin_addr.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN];
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text) != nullptr) found = text;
  }
  ::freeifaddrs(list);
  return found;
}

TcpStoreOptions quick() {
  TcpStoreOptions options;
  options.connect_timeout = 5s;
  options.retry_interval = 20ms;
  return options;
}

TEST_CASE("store hardening: unfinished huge frames do not grow the server") {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  const std::size_t baseline = resident_bytes();
  std::vector<std::unique_ptr<RawPeer>> attackers;
  for (int i = 0; i < 4; ++i) {
    attackers.push_back(std::make_unique<RawPeer>(server->port()));
    REQUIRE(attackers.back()->connected());
    attackers.back()->send_unfinished_frame(255 * kMiB, 32 * kMiB);
  }
  const std::size_t growth = growth_within(baseline, 500ms);
  MESSAGE("the server grew by " << growth / kMiB << " MiB while 4 peers sent 32 MiB each of 255 MiB frames");
  CHECK(growth < 32 * kMiB);
}

TEST_CASE("store hardening: pipelined gets of a big value, replies never read, do not grow the server") {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  auto client = connect_tcp_store(server->address(), quick());
  client->set("big", std::vector<char>(16 * kMiB, 'v'));
  const std::size_t baseline = resident_bytes();
  RawPeer attacker(server->port());
  REQUIRE(attacker.connected());
  std::vector<char> gets;
  for (int i = 0; i < 32; ++i) {
    const std::vector<char> frame = Writer(Op::kGet).str("big").finish();
    gets.insert(gets.end(), frame.begin(), frame.end());
  }
  attacker.send(gets);
  const std::size_t growth = growth_within(baseline, 1500ms);
  MESSAGE("the server grew by " << growth / kMiB << " MiB answering 32 unread gets of a 16 MiB value");
  CHECK(growth < 64 * kMiB);
  CHECK(client->check("big"));  // still serving
}

TEST_CASE("store hardening: another connection cannot write a rank's arrival keys") {
  const auto options = [](int port, int rank) {
    RendezvousOptions o;
    o.address = "127.0.0.1:" + std::to_string(port);
    o.rank = rank;
    o.world_size = 2;
    o.timeout = 10s;
    return o;
  };
  // A port for the chief: bind one and let it go.
  int port = 0;
  {
    auto probe = TcpStoreServer::start("127.0.0.1", 0);
    port = probe->port();
  }
  Rendezvous chief;
  std::string chief_error;
  std::thread chief_thread([&] {
    chief_error = thrown<tandem::Error>([&] { chief = rendezvous(options(port, 0)); });
  });
  // Another process, holding no rank, writes rank 1's arrival and claim.
  auto intruder = connect_tcp_store("127.0.0.1:" + std::to_string(port), quick());
  const std::string injected = thrown<tandem::Error>([&] {
    intruder->set("run/0/rendezvous/rank/1", bytes("an intruder"));
  });
  thrown<tandem::Error>([&] { intruder->add("run/0/rendezvous/claims/1", 1); });
  thrown<tandem::Error>([&] { intruder->add("run/0/rendezvous/rank/1/claims", 1); });
  MESSAGE("the intruder's write: " << injected);

  // The real rank 1 still arrives, and the chief meets it, not the intruder.
  std::string worker_error = thrown<tandem::Error>([&] { Rendezvous worker = rendezvous(options(port, 1)); });
  chief_thread.join();
  CHECK_MESSAGE(worker_error == "<no error>", worker_error);
  CHECK_MESSAGE(chief_error == "<no error>", chief_error);
  if (chief.store) CHECK(text(chief.store->get("rendezvous/rank/1", 1s)) != "an intruder");
}

TEST_CASE("store hardening: the server listens only on the address it is given") {
  const std::optional<std::string> other = non_loopback_address();
  if (!other) {
    MESSAGE("skipped: this machine has no IPv4 address besides loopback");
    return;
  }
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  RawPeer through_loopback(server->port());
  CHECK(through_loopback.connected());
  RawPeer through_other(server->port(), other->c_str());
  CHECK_MESSAGE(!through_other.connected(), "the store served on 127.0.0.1 accepted a connection on " << *other);
}

TEST_CASE("store hardening: a peer without the secret can neither write nor read a key") {
  ScopedEnv secret("TANDEM_STORE_SECRET", "correct horse battery staple");
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  auto client = connect_tcp_store(server->address(), quick());
  client->set("private", bytes("the chief's"));

  RawPeer intruder(server->port());
  REQUIRE(intruder.connected());
  intruder.send(Writer(Op::kSet).str("injected").bytes(bytes("x")).finish());
  intruder.send(Writer(Op::kGet).str("private").finish());
  bool read_the_value = false;
  while (auto frame = intruder.receive()) {
    Reply reply;
    if (parse_reply(*frame, reply) && reply.status == Status::kValue && text(reply.value) == "the chief's") {
      read_the_value = true;
    }
  }
  CHECK_FALSE(read_the_value);
  CHECK_FALSE(client->check("injected"));
}

}  // namespace
