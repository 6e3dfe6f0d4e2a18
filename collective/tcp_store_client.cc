// The TCP store's client (tcp_store.h): a Store whose calls each lease a connection from a
// pool. The sockets are socket.h's, the frames store_wire.h's; this file is about the calls.
//
// Every call leases a connection from the pool (or opens one), so concurrent callers never queue
// behind a waiting get. A get/wait that times out sends CANCEL and reads until CANCELLED, taking
// an answer that crossed the cancel as the result, so that its connection can be reused. The
// connection that says HELLO stays out of the pool: its only job is to stay open while the
// process lives and to say BYE when the client is destroyed.
#include <algorithm>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "tandem/base/errors.h"
#include "tandem/collective/detail/socket.h"
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
using detail::send_all;
using detail::socket_error_text;
using detail::wire::kInvalidArgument;
using detail::wire::kMaxValueBytes;
using detail::wire::Op;
using detail::wire::parse_reply;
using detail::wire::recv_frame;
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
    IoResult io =
        send_all(fd.get(), Writer(Op::kHello).i64(options_.rank).str(options_.lost_key_prefix).finish(), deadline);
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
    if (reply.status == Status::kError) {
      if (reply.error_code == kInvalidArgument) throw InvalidArgument(fmt::format("{}: {}", description_, reply.error));
      throw Internal(fmt::format("{}: {} failed on the server: {}", description_, what, reply.error));
    }
    throw DataLoss(
        fmt::format("{}: unexpected reply (status {}) to {}", description_, static_cast<int>(reply.status), what));
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
