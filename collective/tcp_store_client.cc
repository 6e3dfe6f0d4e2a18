// The TCP store's client (tcp_store.h): a Store whose calls each lease a connection from a
// pool. The sockets are socket.h's, the frames store_wire.h's, the handshake's proofs
// store_auth.h's; this file is about the calls.
//
// Every connection starts with the handshake (the server's challenge, our proof, the server's
// proof). Every call leases a connection from the pool (or opens one), so concurrent callers
// never queue behind a waiting get. A get/wait that times out sends CANCEL and reads until
// CANCELLED, taking an answer that crossed the cancel as the result, so that its connection can
// be reused. The connection that says HELLO stays out of the pool: its only job is to stay open
// while the process lives and to say BYE when the client is destroyed; HELLO's answer is a
// session token with which each pool connection JOINs, so that it may write the rank's keys.
#include <algorithm>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "tandem/base/errors.h"
#include "tandem/collective/detail/socket.h"
#include "tandem/collective/detail/store_auth.h"
#include "tandem/collective/detail/store_wire.h"
#include "tandem/collective/tcp_store.h"

namespace tandem::collective {
namespace {

using detail::Clock;
using detail::connect_once;
using detail::Deadline;
using detail::deadline_after;
using detail::Fd;
using detail::format_duration;
using detail::IoKind;
using detail::IoResult;
using detail::quoted_list;
using detail::recv_frame;
using detail::send_all;
using detail::socket_error_text;
using detail::wire::kMaxValueBytes;
using detail::wire::kMaxWaitKeys;
using detail::wire::Op;
using detail::wire::parse_reply;
using detail::wire::Reply;
using detail::wire::Status;
using detail::wire::Writer;

// How long the destructor waits for the server to acknowledge goodbye, and how long a timed-out
// get/wait waits for its cancel to be acknowledged: a live server answers both at once.
constexpr auto kGoodbyeTimeout = std::chrono::seconds(2);
constexpr auto kCancelTimeout = std::chrono::seconds(5);
// Idle connections a client keeps for later calls; more concurrent callers than this open and
// close their own.
constexpr std::size_t kMaxIdleConnections = 8;
// Attempts at opening a pool connection whose handshake the server cut short (it makes room for
// new connections by closing those still in their handshake).
constexpr int kOpenAttempts = 3;

class TcpStoreClient final : public Store {
 public:
  TcpStoreClient(std::string address, HostPort target, TcpStoreOptions options)
      : address_(std::move(address)),
        target_(std::move(target)),
        options_(std::move(options)),
        secret_(detail::auth::resolve_secret(options_.secret)) {
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

  // The handshake on a new connection: proves this process holds the secret and checks that the
  // server does. Returns why it failed when trying again may help (the connection closed or
  // stalled); throws Unauthenticated when the secrets differ, and what the server says when it
  // refuses the connection (ResourceExhausted: at its connection limit).
  std::optional<std::string> handshake(int fd, Deadline deadline) const {
    const std::string what = "the handshake";
    std::vector<char> frame;
    Reply challenge;
    if (const auto failed = exchange(fd, nullptr, frame, challenge, deadline)) return failed;
    if (challenge.status == Status::kError) throw_server_error(challenge, what);
    if (challenge.status != Status::kChallenge) throw_malformed_reply(what);
    if (challenge.number != detail::wire::kProtocolVersion) {
      throw FailedPrecondition(
          fmt::format("{} speaks version {} of the store's protocol and this process version {}: "
                      "every worker must run the same tandem",
                      description_, challenge.number, detail::wire::kProtocolVersion));
    }
    if (!secret_.empty() && !challenge.flag) {
      throw Unauthenticated(fmt::format(
          "{} does not check TANDEM_STORE_SECRET, and this process has one set: the secrets differ (set the same "
          "TANDEM_STORE_SECRET for the chief and every worker, or none)",
          description_));
    }
    const std::string server_nonce(challenge.value.begin(), challenge.value.end());
    const std::string nonce = detail::auth::random_bytes(detail::auth::kNonceBytes);
    const std::string proof = secret_.empty()
                                  ? std::string()
                                  : detail::auth::proof(detail::auth::Side::kClient, secret_, server_nonce, nonce);
    const std::vector<char> auth = Writer(Op::kAuth).str(nonce).str(proof).finish();
    Reply welcome;
    if (const auto failed = exchange(fd, &auth, frame, welcome, deadline)) return failed;
    if (welcome.status == Status::kError && welcome.error_code == detail::wire::kUnauthenticated) {
      throw Unauthenticated(fmt::format("{} refused this process: {}", description_,
                                        secret_.empty()
                                            ? "it requires TANDEM_STORE_SECRET, and this process has none set"
                                            : "TANDEM_STORE_SECRET differs"));
    }
    if (welcome.status == Status::kError) throw_server_error(welcome, what);
    if (welcome.status != Status::kWelcome) throw_malformed_reply(what);
    const std::string expected = secret_.empty()
                                     ? std::string()
                                     : detail::auth::proof(detail::auth::Side::kServer, secret_, server_nonce, nonce);
    const std::string offered(welcome.value.begin(), welcome.value.end());
    if (!secret_.empty() && !detail::auth::proofs_equal(offered, expected)) {
      throw Unauthenticated(
          fmt::format("{} could not prove that it holds TANDEM_STORE_SECRET: the secrets differ, or "
                      "another program answers at that address",
                      description_));
    }
    return std::nullopt;
  }

  // Takes the first connection (past its handshake): it announces the rank, or else joins the pool.
  void adopt_first_connection(Fd fd) {
    if (options_.rank < 0) {
      idle_.push_back(std::move(fd));
      return;
    }
    const std::string what = fmt::format("announcing rank {}", options_.rank);
    const std::vector<char> hello = Writer(Op::kHello).i64(options_.rank).str(options_.lost_key_prefix).finish();
    std::vector<char> frame;
    Reply reply;
    if (const auto failed = exchange(fd.get(), &hello, frame, reply, deadline_after(options_.request_timeout))) {
      throw Unavailable(fmt::format("{}: lost the connection while {}: {}", description_, what, *failed));
    }
    expect(reply, Status::kValue, what);
    token_.assign(reply.value.begin(), reply.value.end());
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
    TANDEM_REQUIRE(keys.size() <= kMaxWaitKeys, InvalidArgument, "{}: {}: at most {} keys per wait", description_, what,
                   kMaxWaitKeys);
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
    return Lease(this, open_connection(what));
  }

  // A new pool connection: connected, past its handshake, and acting for the announced rank.
  Fd open_connection(const std::string& what) {
    std::string error;
    for (int attempt = 0; attempt < kOpenAttempts; ++attempt) {
      const Deadline deadline = deadline_after(options_.request_timeout);
      Fd fd = connect_once(target_, deadline, &error);
      if (!fd) break;
      if (const auto failed = handshake(fd.get(), deadline)) {
        error = *failed;
        continue;
      }
      if (!token_.empty()) join(fd.get(), what);
      return fd;
    }
    throw Unavailable(fmt::format("{}: cannot open a connection for {}: {} (has the server's process exited?)",
                                  description_, what, error));
  }

  void join(int fd, const std::string& what) {
    const std::vector<char> request = Writer(Op::kJoin).str(token_).finish();
    std::vector<char> frame;
    Reply reply;
    if (const auto failed = exchange(fd, &request, frame, reply, deadline_after(options_.request_timeout))) {
      throw Unavailable(fmt::format("{}: lost a new connection for {}: {}", description_, what, *failed));
    }
    expect(reply, Status::kOk, what);
  }

  // Sends `request` (unless null) and reads one reply, for the calls made while connecting.
  // Returns why it failed when the connection closed or stalled; throws DataLoss for a reply
  // that does not parse.
  std::optional<std::string> exchange(int fd, const std::vector<char>* request, std::vector<char>& frame, Reply& reply,
                                      Deadline deadline) const {
    IoResult io;
    if (request != nullptr) io = send_all(fd, *request, deadline);
    if (io.kind == IoKind::kOk) io = recv_frame(fd, frame, deadline, deadline);
    switch (io.kind) {
      case IoKind::kOk: break;
      case IoKind::kTimeout: return "the server did not answer in time";
      case IoKind::kClosed: return "the server closed the connection";
      case IoKind::kError: return socket_error_text(io.err);
    }
    if (!parse_reply(frame, reply)) throw_malformed_reply("connecting");
    return std::nullopt;
  }

  void release(Fd fd) {
    std::lock_guard lock(mutex_);
    if (idle_.size() < kMaxIdleConnections) idle_.push_back(std::move(fd));
  }

  [[noreturn]] void throw_io_error(const std::string& what, const IoResult& io) const {
    switch (io.kind) {
      case IoKind::kTimeout:
        throw DeadlineExceeded(fmt::format("{}: no reply to {} within {} (the server does not respond)", description_,
                                           what, format_duration(options_.request_timeout)));
      case IoKind::kClosed:
        throw Unavailable(
            fmt::format("{}: the server closed the connection during {} (its process exited or stopped "
                        "serving)",
                        description_, what));
      case IoKind::kOk:
      case IoKind::kError: break;
    }
    throw Unavailable(
        fmt::format("{}: lost the connection during {}: {}", description_, what, socket_error_text(io.err)));
  }

  [[noreturn]] void throw_malformed_reply(const std::string& what) const {
    throw DataLoss(
        fmt::format("{}: malformed reply to {} (is something else listening on that port?)", description_, what));
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
    if (reply.status == Status::kError) throw_server_error(reply, what);
    throw DataLoss(
        fmt::format("{}: unexpected reply (status {}) to {}", description_, static_cast<int>(reply.status), what));
  }

  // The tandem error an ERROR reply stands for.
  [[noreturn]] void throw_server_error(const Reply& reply, const std::string& what) const {
    const std::string message = fmt::format("{}: {}", description_, reply.error);
    switch (reply.error_code) {
      case detail::wire::kInvalidArgument: throw InvalidArgument(message);
      case detail::wire::kResourceExhausted: throw ResourceExhausted(message);
      case detail::wire::kPermissionDenied: throw PermissionDenied(message);
      case detail::wire::kUnauthenticated: throw Unauthenticated(message);
      default: break;
    }
    throw Internal(fmt::format("{}: {} failed on the server: {}", description_, what, reply.error));
  }

  const std::string address_;
  const HostPort target_;
  const TcpStoreOptions options_;
  const std::string secret_;  // resolved: the option, else TANDEM_STORE_SECRET; never printed
  std::string description_;
  Fd liveness_;        // says HELLO at connect and BYE in the destructor; no requests
  std::string token_;  // HELLO's answer: what pool connections JOIN with
  std::mutex mutex_;
  std::vector<Fd> idle_;
};

}  // namespace

std::shared_ptr<Store> connect_tcp_store(std::string_view address, TcpStoreOptions options) {
  const HostPort target = parse_host_port(address);
  TANDEM_REQUIRE(target.port != 0, InvalidArgument, "connect_tcp_store(\"{}\"): port 0 names no server", address);
  TANDEM_REQUIRE(options.lost_key_prefix.size() <= detail::wire::kMaxPrefixBytes, InvalidArgument,
                 "connect_tcp_store(\"{}\"): the lost-key prefix has {} bytes; at most {}", address,
                 options.lost_key_prefix.size(), detail::wire::kMaxPrefixBytes);
  const std::chrono::milliseconds connect_timeout = options.connect_timeout;
  const std::chrono::milliseconds request_timeout = options.request_timeout;
  auto interval = std::clamp(options.retry_interval, std::chrono::milliseconds(1), kMaxRetryInterval);
  auto client = std::make_shared<TcpStoreClient>(std::string(address), target, std::move(options));

  const Deadline deadline = deadline_after(connect_timeout);
  std::string last_error = "no attempt made";
  int attempts = 0;
  for (;;) {
    ++attempts;
    Fd fd = connect_once(target, deadline, &last_error);
    // A server that accepted but did not finish the handshake (it was stopping, or made room
    // for others) is retried like one that refused.
    const auto failed = fd ? client->handshake(fd.get(), std::min(deadline, deadline_after(request_timeout)))
                           : std::optional<std::string>();
    if (fd && !failed) {
      client->adopt_first_connection(std::move(fd));
      return client;
    }
    if (failed) last_error = *failed;
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
