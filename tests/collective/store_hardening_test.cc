// The TCP store against peers that do not play by its rules: huge unfinished frames, replies
// never read, another rank's keys, listening where it was not asked to, no or another secret,
// too many connections. Each attack runs against a server in this process, mostly from raw
// sockets that speak the wire format by hand; the server's memory is read from its own
// accounting (TcpStoreServer::stats) and from /proc/self/status.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tandem/base/errors.h"
#include "tandem/base/log.h"
#include "tandem/collective/detail/store_auth.h"
#include "tandem/collective/detail/store_wire.h"
#include "tandem/collective/rendezvous.h"
#include "tandem/collective/tcp_store.h"
#include "common/error_message.h"

namespace {

using namespace std::chrono_literals;
using namespace tandem::collective;
using namespace tandem::collective::detail::wire;
namespace auth = tandem::collective::detail::auth;
using tandem::testing::error_message;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kMiB = 1 << 20;
constexpr const char* kSecret = "correct horse battery staple";

std::vector<char> bytes(std::string_view s) { return std::vector<char>(s.begin(), s.end()); }
std::string text(const std::vector<char>& v) { return std::string(v.begin(), v.end()); }
std::string local(int port) { return fmt::format("127.0.0.1:{}", port); }
bool contains(const std::string& haystack, std::string_view needle) {
  return haystack.find(needle) != std::string::npos;
}

// Polls `condition` until it holds or `timeout` passes; whether it held.
bool eventually(const std::function<bool()>& condition, std::chrono::milliseconds timeout = 10s) {
  for (const auto end = Clock::now() + timeout; Clock::now() < end; std::this_thread::sleep_for(10ms)) {
    if (condition()) return true;
  }
  return condition();
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
// gives up after `timeout`).
class RawPeer {
 public:
  explicit RawPeer(int port, const char* host = "127.0.0.1", std::chrono::seconds timeout = 5s) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    const timeval tv{.tv_sec = static_cast<time_t>(timeout.count()), .tv_usec = 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
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

  // The handshake as the client does it, with `secret` (empty: none). Whether it was welcomed.
  bool handshake(const std::string& secret = "") {
    const auto challenge = receive_reply();
    if (!challenge || challenge->status != Status::kChallenge) return false;
    const std::string server_nonce = text(challenge->value);
    const std::string nonce(auth::kNonceBytes, 'n');
    const std::string proof = secret.empty() ? "" : auth::proof(auth::Side::kClient, secret, server_nonce, nonce);
    if (!send(Writer(Op::kAuth).str(nonce).str(proof).finish())) return false;
    const auto welcome = receive_reply();
    return welcome && welcome->status == Status::kWelcome;
  }

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
  std::optional<Reply> receive_reply() {
    const auto frame = receive();
    Reply reply;
    if (!frame || !parse_reply(*frame, reply)) return std::nullopt;
    return reply;
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

// Sets (or, with nullptr, unsets) an environment variable for one test, restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
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

// Collects tandem's log messages while alive.
class CapturedLog {
 public:
  CapturedLog() {
    previous_ = tandem::logging::set_sink([this](tandem::logging::Level, std::string_view message) {
      std::lock_guard lock(mutex_);
      messages_.emplace_back(message);
    });
  }
  ~CapturedLog() { tandem::logging::set_sink(previous_); }
  std::string all() const {
    std::lock_guard lock(mutex_);
    std::string out;
    for (const auto& m : messages_) out += m + "\n";
    return out;
  }

 private:
  tandem::logging::Sink previous_;
  mutable std::mutex mutex_;
  std::vector<std::string> messages_;
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
    char address[INET_ADDRSTRLEN];
    if (::inet_ntop(AF_INET, &in->sin_addr, address, sizeof address) != nullptr) found = address;
  }
  ::freeifaddrs(list);
  return found;
}

TcpStoreOptions quick(std::string secret = "") {
  TcpStoreOptions options;
  options.connect_timeout = 5s;
  options.retry_interval = 20ms;
  options.secret = std::move(secret);
  return options;
}

// A port that was free a moment ago (a server bound it and let it go).
int unused_port() { return TcpStoreServer::start("127.0.0.1", 0)->port(); }

// Rank `rank` of a rendezvous of two at 127.0.0.1:port.
RendezvousOptions two_ranks(int port, int rank) {
  RendezvousOptions o;
  o.address = local(port);
  o.rank = rank;
  o.world_size = 2;
  o.timeout = 20s;
  return o;
}

// How many of `readers` clients, getting `key` at once, read `value`.
int readers_matching(const TcpStoreServer& server, int readers, const std::string& key,
                     const std::vector<char>& value) {
  std::vector<std::thread> threads;
  std::atomic<int> matched{0};
  for (int i = 0; i < readers; ++i) {
    threads.emplace_back([&] {
      auto reader = connect_tcp_store(server.address(), quick());
      if (reader->get(key, 60s) == value) ++matched;
    });
  }
  for (auto& t : threads) t.join();
  return matched;
}

// ---- Memory ------------------------------------------------------------------------------------

TEST_CASE("store hardening: unfinished huge frames do not grow the server") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
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
  // Before its handshake a peer is read no further than one small frame: its header gave it away.
  CHECK(eventually([&] { return server->stats().refused_connections == 4; }));
  CHECK(server->stats().peak_buffered_bytes < 64 * 1024);
}

TEST_CASE("store hardening: authenticated peers' large frames wait for the budget; small requests go on") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 16 * kMiB;
  auto server = TcpStoreServer::start("127.0.0.1", 0, options);
  std::vector<std::unique_ptr<RawPeer>> senders;
  for (int i = 0; i < 3; ++i) {
    senders.push_back(std::make_unique<RawPeer>(server->port(), "127.0.0.1", 1s));
    REQUIRE(senders.back()->handshake());
    // 12 MiB frames, each one byte short: the first is admitted, the others wait unread.
    senders.back()->send_unfinished_frame(12 * kMiB, 12 * kMiB - 1);
  }
  const TcpStoreServerStats during = server->stats();
  MESSAGE("buffered " << during.buffered_bytes / kMiB << " MiB (peak " << during.peak_buffered_bytes / kMiB
                      << " MiB) with a 16 MiB budget and three 12 MiB frames arriving");
  CHECK(during.peak_buffered_bytes <= 16 * kMiB + 4 * 128 * 1024);
  // Small requests of other clients are served meanwhile.
  auto client = connect_tcp_store(server->address(), quick());
  client->set("small", bytes("still served"));
  CHECK(text(client->get("small", 1s)) == "still served");
  // Once the senders go, so does what they held, and a large value fits again.
  senders.clear();
  CHECK(eventually([&] { return server->stats().buffered_bytes < 1 * kMiB; }));
  const std::vector<char> large(12 * kMiB, 'L');
  client->set("large", large);
  CHECK(client->get("large", 5s) == large);
}

TEST_CASE("store hardening: pipelined gets of a big value, replies never read, do not grow the server") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  auto client = connect_tcp_store(server->address(), quick());
  const std::vector<char> big(16 * kMiB, 'v');
  client->set("big", big);
  const std::size_t baseline = resident_bytes();
  RawPeer attacker(server->port());
  REQUIRE(attacker.handshake());
  std::vector<char> gets;
  for (int i = 0; i < 32; ++i) {
    const std::vector<char> frame = Writer(Op::kGet).str("big").finish();
    gets.insert(gets.end(), frame.begin(), frame.end());
  }
  attacker.send(gets);
  const std::size_t growth = growth_within(baseline, 1500ms);
  const TcpStoreServerStats stats = server->stats();
  MESSAGE("the server grew by " << growth / kMiB << " MiB (buffers: peak " << stats.peak_buffered_bytes / kMiB
                                << " MiB) answering 32 unread gets of a 16 MiB value");
  CHECK(growth < 64 * kMiB);
  CHECK(stats.peak_buffered_bytes < 17 * kMiB);  // one reply at a time
  CHECK(client->check("big"));                   // still serving
  // Held back, not dropped: a peer that reads gets every reply.
  int replies = 0;
  for (int i = 0; i < 32; ++i) {
    const auto reply = attacker.receive_reply();
    if (reply && reply->status == Status::kValue && reply->value.size() == big.size()) ++replies;
  }
  CHECK(replies == 32);
}

TEST_CASE("store hardening: a large value waits for the budget and is served in turn") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  TcpStoreServerOptions options;
  options.max_buffered_bytes = 16 * kMiB;
  auto server = TcpStoreServer::start("127.0.0.1", 0, options);
  auto writer = connect_tcp_store(server->address(), quick());
  const std::vector<char> value(12 * kMiB, 'w');
  writer->set("value", value);
  // Four readers at once: only one 12 MiB reply fits the budget at a time.
  CHECK(readers_matching(*server, 4, "value", value) == 4);
  CHECK(server->stats().peak_buffered_bytes <= 16 * kMiB + 8 * 128 * 1024);
  // A value larger than the whole budget cannot be buffered at all: refused with the reason, and
  // the connection stays usable.
  const std::string error =
      error_message<tandem::ResourceExhausted>([&] { writer->set("too large", std::vector<char>(20 * kMiB, 't')); });
  CHECK_MESSAGE(contains(error, "max_buffered_bytes"), error);
  CHECK_FALSE(writer->check("too large"));
  CHECK(server->stats().peak_buffered_bytes <= 16 * kMiB + 8 * 128 * 1024);
}

TEST_CASE("store hardening: values of the largest size still cross under the default budget") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  auto writer = connect_tcp_store(server->address(), quick());
  const std::string key = "largest";
  std::vector<char> value(kMaxValueBytes - key.size());
  for (std::size_t i = 0; i < value.size(); i += 4096) value[i] = static_cast<char>(i / 4096);
  writer->set(key, value);
  CHECK(readers_matching(*server, 2, key, value) == 2);
}

TEST_CASE("store hardening: what the store holds is bounded too") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  TcpStoreServerOptions options;
  options.max_stored_bytes = 1 * kMiB;
  auto server = TcpStoreServer::start("127.0.0.1", 0, options);
  auto client = connect_tcp_store(server->address(), quick());
  client->set("a", std::vector<char>(600 * 1024, 'a'));
  const std::string error =
      error_message<tandem::ResourceExhausted>([&] { client->set("b", std::vector<char>(600 * 1024, 'b')); });
  CHECK_MESSAGE(contains(error, "max_stored_bytes"), error);
  CHECK_FALSE(client->check("b"));
  client->set("a", bytes("smaller"));  // replacing a value frees its room
  client->set("b", std::vector<char>(600 * 1024, 'b'));
  CHECK(client->add("counter", 1) == 1);
}

// ---- Connections -------------------------------------------------------------------------------

TEST_CASE("store hardening: a connection limit; handshakes make room, a full house refuses at once") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  TcpStoreServerOptions options;
  options.max_connections = 3;
  auto server = TcpStoreServer::start("127.0.0.1", 0, options);
  // Peers that connect and never finish their handshake hold places only until someone needs them.
  std::vector<std::unique_ptr<RawPeer>> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(std::make_unique<RawPeer>(server->port()));
  std::vector<std::shared_ptr<Store>> clients;
  for (int i = 0; i < 3; ++i) {
    clients.push_back(connect_tcp_store(server->address(), quick()));
    clients.back()->set(fmt::format("k{}", i), bytes("1"));
  }
  CHECK(server->stats().connections == 3);
  const auto start = Clock::now();
  const std::string error =
      error_message<tandem::ResourceExhausted>([&] { connect_tcp_store(server->address(), quick()); });
  CHECK(Clock::now() - start < 3s);  // at once, not at the connect timeout
  CHECK_MESSAGE(contains(error, "at most 3 connections"), error);
  CHECK_MESSAGE(contains(error, server->address()), error);
  clients.pop_back();
  CHECK(eventually([&] { return server->stats().connections == 2; }));
  CHECK_NOTHROW(connect_tcp_store(server->address(), quick()));
}

TEST_CASE("store hardening: a connection that does not finish its handshake in time is closed") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  TcpStoreServerOptions options;
  options.handshake_timeout = 200ms;
  CapturedLog log;
  auto server = TcpStoreServer::start("127.0.0.1", 0, options);
  RawPeer silent(server->port());
  REQUIRE(silent.connected());
  const auto challenge = silent.receive_reply();
  REQUIRE(challenge);
  CHECK(challenge->status == Status::kChallenge);
  CHECK_FALSE(silent.receive());  // closed by the server, well before the 5 s receive timeout
  CHECK(server->stats().refused_connections == 1);
  CHECK_MESSAGE(contains(log.all(), "no handshake within 200 ms"), log.all());
}

// ---- Authentication ----------------------------------------------------------------------------

TEST_CASE("store hardening: a peer without the secret can neither write nor read a key") {
  ScopedEnv secret("TANDEM_STORE_SECRET", kSecret);
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
  // Nor with a handshake and no proof, or a wrong one.
  RawPeer no_proof(server->port());
  CHECK_FALSE(no_proof.handshake());
  RawPeer wrong_proof(server->port());
  CHECK_FALSE(wrong_proof.handshake("Tr0ub4dor&3"));
  RawPeer right_proof(server->port());
  CHECK(right_proof.handshake(kSecret));
}

TEST_CASE("store hardening: secrets that differ are refused with a clear error, logged, never shown") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  CapturedLog log;
  TcpStoreServerOptions options;
  options.secret = kSecret;
  auto server = TcpStoreServer::start("127.0.0.1", 0, options);
  TcpStoreOptions same = quick(kSecret);
  same.label_of_server = "chief";
  auto client = connect_tcp_store(server->address(), same);
  client->set("k", bytes("v"));

  TcpStoreOptions other = quick("Tr0ub4dor&3");
  other.label_of_server = "chief";
  const auto start = Clock::now();
  const std::string wrong =
      error_message<tandem::Unauthenticated>([&] { connect_tcp_store(server->address(), other); });
  CHECK(Clock::now() - start < 3s);  // not retried until the connect timeout
  CHECK_MESSAGE(contains(wrong, fmt::format("the store at {} (served by chief) refused this process: "
                                            "TANDEM_STORE_SECRET differs",
                                            server->address())),
                wrong);

  const std::string none =
      error_message<tandem::Unauthenticated>([&] { connect_tcp_store(server->address(), quick()); });
  CHECK_MESSAGE(contains(none, "requires TANDEM_STORE_SECRET, and this process has none set"), none);

  // The server logs whom it refused, by address.
  const std::string logged = log.all();
  CHECK_MESSAGE(contains(logged, "refused the connection from 127.0.0.1:"), logged);
  // The secret appears nowhere.
  for (const std::string& shown : {wrong, none, logged}) {
    CHECK_FALSE(contains(shown, kSecret));
    CHECK_FALSE(contains(shown, "Tr0ub4dor"));
  }

  // A server without a secret, and a client with one: the client refuses it (no downgrade).
  auto open_server = TcpStoreServer::start("127.0.0.1", 0, {});
  const std::string downgrade =
      error_message<tandem::Unauthenticated>([&] { connect_tcp_store(open_server->address(), quick(kSecret)); });
  CHECK_MESSAGE(contains(downgrade, "does not check TANDEM_STORE_SECRET"), downgrade);
}

TEST_CASE("store hardening: the environment's secret serves both sides, and the rendezvous") {
  ScopedEnv secret("TANDEM_STORE_SECRET", kSecret);
  const int port = unused_port();
  Rendezvous chief;
  std::thread chief_thread([&] { chief = rendezvous(two_ranks(port, 0)); });
  {
    // Someone with another secret is turned away at the door.
    auto intruder_options = quick("not the secret");
    intruder_options.connect_timeout = 10s;
    const std::string refused =
        error_message<tandem::Unauthenticated>([&] { connect_tcp_store(local(port), intruder_options); });
    CHECK_MESSAGE(contains(refused, "TANDEM_STORE_SECRET differs"), refused);
    Rendezvous worker = rendezvous(two_ranks(port, 1));
    CHECK(worker.rank == 1);
  }
  chief_thread.join();
  REQUIRE(chief.store != nullptr);
  CHECK(chief.store->check("rendezvous/rank/1"));
}

TEST_CASE("store hardening: with a secret, the rendezvous meets while a peer without it attacks") {
  ScopedEnv secret("TANDEM_STORE_SECRET", kSecret);
  const int port = unused_port();
  Rendezvous chief;
  std::thread chief_thread([&] { chief = rendezvous(two_ranks(port, 0)); });
  REQUIRE(eventually([&] { return RawPeer(port).connected(); }));
  const std::size_t baseline = resident_bytes();
  // Every attack of the report, from peers that do not hold the secret.
  std::vector<std::unique_ptr<RawPeer>> attackers;
  for (int i = 0; i < 4; ++i) {
    attackers.push_back(std::make_unique<RawPeer>(port));
    attackers.back()->send_unfinished_frame(255 * kMiB, 32 * kMiB);
  }
  RawPeer pipeliner(port);
  for (int i = 0; i < 32; ++i) pipeliner.send(Writer(Op::kGet).str("run/0/rendezvous/rank/0").finish());
  RawPeer injector(port);
  injector.send(Writer(Op::kSet).str("run/0/rendezvous/rank/1").str("an intruder").finish());
  auto impostor_options = quick("a guess");
  CHECK_FALSE(
      error_message<tandem::Unauthenticated>([&] { connect_tcp_store(local(port), impostor_options); }).empty());
  const std::size_t growth = growth_within(baseline, 500ms);
  MESSAGE("the chief's process grew by " << growth / kMiB << " MiB under the attacks");
  CHECK(growth < 16 * kMiB);
  // The real worker arrives, and the chief meets it.
  Rendezvous worker = rendezvous(two_ranks(port, 1));
  chief_thread.join();
  REQUIRE(chief.store != nullptr);
  CHECK(text(chief.store->get("rendezvous/rank/1", 1s)) != "an intruder");
  CHECK(chief.server->stats().refused_connections >= 7);
  CHECK(chief.server->stats().peak_buffered_bytes < 1 * kMiB);
}

// ---- Keys that belong to a rank ----------------------------------------------------------------

TEST_CASE("store hardening: another connection cannot write a rank's arrival keys") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  const int port = unused_port();
  Rendezvous chief;
  std::string chief_error;
  std::thread chief_thread([&] {
    try {
      chief = rendezvous(two_ranks(port, 0));
    } catch (const tandem::Error& e) {
      chief_error = e.what();
    }
  });
  // Another process, holding no rank, writes rank 1's arrival and claim.
  auto intruder = connect_tcp_store(local(port), quick());
  const std::string injected =
      error_message<tandem::PermissionDenied>([&] { intruder->set("run/0/rendezvous/rank/1", bytes("an intruder")); });
  CHECK_MESSAGE(contains(injected, "belongs to rank 1"), injected);
  CHECK_FALSE(
      error_message<tandem::PermissionDenied>([&] { intruder->add("run/0/rendezvous/rank/1/claims", 1); }).empty());

  // The real rank 1 still arrives, and the chief meets it, not the intruder.
  CHECK_NOTHROW(Rendezvous worker = rendezvous(two_ranks(port, 1)));
  chief_thread.join();
  CHECK_MESSAGE(chief_error.empty(), chief_error);
  if (chief.store) CHECK(text(chief.store->get("rendezvous/rank/1", 1s)) != "an intruder");
}

TEST_CASE("store hardening: a rank's keys are written only by the client that announced it") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  TcpStoreOptions as_rank_1 = quick();
  as_rank_1.rank = 1;
  as_rank_1.lost_key_prefix = "run/0/";
  auto rank1 = connect_tcp_store(server->address(), as_rank_1);
  // Its calls go over pool connections that joined its announcement, several at once.
  std::vector<std::thread> threads;
  std::atomic<int> written{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      rank1->set(fmt::format("run/0/rendezvous/rank/1/item/{}", t), bytes("mine"));
      rank1->add("run/0/rendezvous/rank/1/count", 1);
      ++written;
    });
  }
  for (auto& t : threads) t.join();
  CHECK(written == 4);
  CHECK(text(rank1->get("run/0/rendezvous/rank/1/count", 1s)) == "4");
  // Not another rank's, not another run's, not the server's lost keys, not a key of two ranks.
  for (const char* key :
       {"run/0/rendezvous/rank/2", "run/1/rendezvous/rank/1", "run/0/tandem/lost/1", "run/0/rank/1/rank/2"}) {
    INFO(key);
    CHECK_FALSE(error_message<tandem::PermissionDenied>([&] { rank1->set(key, bytes("x")); }).empty());
  }
  // Keys with "rank" in other places are anyone's.
  auto anyone = connect_tcp_store(server->address(), quick());
  for (const char* key : {"rank/x", "ranks/1", "rank/01", "rank/-1", "my_rank/1", "rank"}) {
    INFO(key);
    CHECK_NOTHROW(anyone->set(key, bytes("x")));
  }
  // Everyone reads everything.
  CHECK(text(anyone->get("run/0/rendezvous/rank/1/item/0", 1s)) == "mine");
  // The lost key is still the server's to write when rank 1 goes without goodbye; a clean exit
  // ends the announcement, and with it the right to write.
  rank1.reset();
  CHECK_FALSE(anyone->check("run/0/tandem/lost/1"));
}

// ---- Where it listens --------------------------------------------------------------------------

TEST_CASE("store hardening: the server listens only on the address it is given") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  const std::optional<std::string> other = non_loopback_address();
  if (!other) {
    MESSAGE("skipped: this machine has no IPv4 address besides loopback");
    return;
  }
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  CHECK(server->local_address() == local(server->port()));
  RawPeer through_loopback(server->port());
  CHECK(through_loopback.connected());
  RawPeer through_other(server->port(), other->c_str());
  CHECK_MESSAGE(!through_other.connected(), "the store served on 127.0.0.1 accepted a connection on " << *other);

  // Its other address only; clients on this machine reach it there.
  auto outside = TcpStoreServer::start(*other, 0);
  CHECK(outside->local_address() == fmt::format("{}:{}", *other, outside->port()));
  CHECK_FALSE(RawPeer(outside->port()).connected());
  auto client = connect_tcp_store(outside->local_address(), quick());
  client->set("k", bytes("v"));

  // Every interface when asked for.
  auto everywhere = TcpStoreServer::start("0.0.0.0", 0);
  CHECK(everywhere->local_address() == local(everywhere->port()));
  CHECK(RawPeer(everywhere->port()).connected());
  CHECK(RawPeer(everywhere->port(), other->c_str()).connected());
}

TEST_CASE("store hardening: localhost binds every loopback address it names") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  auto server = TcpStoreServer::start("localhost", 0);
  CHECK(server->address() == fmt::format("localhost:{}", server->port()));
  auto client = connect_tcp_store(server->address(), quick());
  client->set("k", bytes("v"));
  CHECK(RawPeer(server->port()).connected());
}

TEST_CASE("store hardening: without a secret, listening beyond loopback is warned about") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  {
    CapturedLog log;
    auto server = TcpStoreServer::start("127.0.0.1", 0);
    CHECK_FALSE(contains(log.all(), "without a secret"));
  }
  {
    CapturedLog log;
    auto server = TcpStoreServer::start("0.0.0.0", 0);
    CHECK_MESSAGE(
        contains(log.all(), fmt::format("listens on every interface (port {}) without a secret", server->port())),
        log.all());
  }
  {
    CapturedLog log;
    TcpStoreServerOptions options;
    options.secret = kSecret;
    auto server = TcpStoreServer::start("0.0.0.0", 0, options);
    CHECK_FALSE(contains(log.all(), "without a secret"));
  }
}

TEST_CASE("store hardening: a host name that resolves only to loopback here listens everywhere, with a warning") {
  ScopedEnv no_secret("TANDEM_STORE_SECRET", nullptr);
  char name[256] = {};
  REQUIRE(::gethostname(name, sizeof name - 1) == 0);
  CapturedLog log;
  auto server = TcpStoreServer::start(name, 0);
  const bool fell_back = contains(log.all(), "a loopback address other machines cannot reach");
  if (!fell_back) {
    MESSAGE("skipped: this machine's name \"" << name << "\" resolves beyond loopback");
    return;
  }
  CHECK(server->local_address() == local(server->port()));
  if (const auto other = non_loopback_address()) CHECK(RawPeer(server->port(), other->c_str()).connected());
}

}  // namespace
