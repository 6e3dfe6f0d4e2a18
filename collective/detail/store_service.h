// tandem/collective/detail/store_service.h — what the TCP store's server does with the bytes of
// its connections, without the sockets: the handshake, the requests, parked gets and waits, rank
// sessions and key ownership, and every bound on memory. tcp_store_server.cc's poll loop feeds it
// what it reads and sends what it queues; the wire fuzzer (tests/fuzz/store_wire_fuzz.cc) feeds it
// bytes directly. Not part of the public contract.
//
// One thread calls it (the server's); nothing blocks, and nothing throws but std::bad_alloc and
// auth::random_bytes's Internal. Each connection goes:
//   handshake -> ready -> (finishing: an error reply is queued, then it closes) -> closed
// Memory, as tcp_store.h promises it (TcpStoreServerOptions):
//   - before its handshake a connection is read only up to one small frame (the AUTH);
//   - a ready connection always may hold kAllowance bytes of requests and of replies; a larger
//     frame or reply is admitted against max_buffered_bytes (what every connection holds:
//     requests arriving, replies unsent, parked requests' keys), and waits, unread or
//     unanswered, until the others have drained enough;
//   - a connection with more than kAllowance bytes of replies unsent is not read (a client that
//     pipelines requests and never reads cannot pile up replies);
//   - stored keys and values count against max_stored_bytes.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "tandem/collective/detail/store_wire.h"
#include "tandem/collective/tcp_store.h"

namespace tandem::collective::detail {

class StoreService {
 public:
  using Id = std::uint64_t;
  using Clock = std::chrono::steady_clock;
  // Random bytes for nonces and session tokens; the fuzzer passes a predictable one.
  using Random = std::function<std::string(std::size_t)>;

  // What a connection may always buffer each way, whatever the budget says (one small request
  // or reply, read ahead in one recv).
  static constexpr std::size_t kAllowance = 64 * 1024;
  // How long a connection refused with an error reply has to read it before it is closed.
  static constexpr std::chrono::seconds kFinishTimeout{2};

  // `address` names the store in log messages ("10.0.0.1:29500"). options.secret is used as
  // given (empty: no authentication); TcpStoreServer resolves TANDEM_STORE_SECRET before.
  StoreService(TcpStoreServerOptions options, std::string address, Random random = {});
  ~StoreService();
  StoreService(const StoreService&) = delete;
  StoreService& operator=(const StoreService&) = delete;

  // A connection just accepted from `peer` ("10.0.0.2:41234"). Queues the challenge; over
  // max_connections it first closes the oldest connection still in its handshake, and when there
  // is none queues a ResourceExhausted error instead (the connection finishes).
  Id open(std::string peer, Clock::time_point now);
  // How many bytes to read from the connection now (0: leave them in the socket for later).
  std::size_t wants(Id id) const;
  // Bytes read from the connection: whole frames are served at once.
  void receive(Id id, const char* data, std::size_t size);
  // The peer closed the connection or it failed (`reason`, e.g. "connection reset by peer").
  void hang_up(Id id, std::string reason);
  // Bytes queued for the connection; sent(id, n) when the first n of them went out.
  std::string_view output(Id id) const;
  void sent(Id id, std::size_t n);
  // Closes connections past their deadline (a handshake not finished in handshake_timeout, an
  // error reply not read in kFinishTimeout). Returns the next deadline (time_point::max: none).
  Clock::time_point expire(Clock::time_point now);
  // accept() failed for lack of descriptors: closes the oldest connection still in its
  // handshake. False when there is none.
  bool evict_a_handshake();
  // The connections closed since the last call, for the caller to close their sockets. A
  // connection that announced a rank and left without goodbye sets that rank's lost key here.
  std::vector<Id> take_closed();

  TcpStoreServerStats stats() const;
  bool requires_secret() const { return !options_.secret.empty(); }

 private:
  struct Peer;
  struct Session;

  // What serving one frame did: go on to the next, stop (the connection is finishing), or not
  // yet (it waits for budget; the frame stays).
  enum class Served { kNext, kStop, kNotYet };

  Peer* find(Id id) const;
  void advance(Peer& p);
  Served serve_frame(Peer& p, const char* payload, std::size_t size);
  static std::size_t parking_cost(const std::vector<std::string_view>& keys);
  void handshake(Peer& p, const wire::Request& q);
  void handle(Peer& p, const wire::Request& q);
  void hello(Peer& p, const wire::Request& q);
  void join(Peer& p, const wire::Request& q);
  void set(Peer& p, const wire::Request& q);
  void add(Peer& p, const wire::Request& q);
  void park(Peer& p, wire::Op op, const std::vector<std::string_view>& keys);
  void unpark(Peer& p);
  bool try_answer(Peer& p);
  bool admit(Peer& p, std::size_t extra, std::string_view what);
  void queue(Peer& p, std::vector<char> frame);
  void recount(Peer& p);
  void finish(Peer& p, std::uint8_t code, const std::string& message);
  void refuse(Peer& p, std::uint8_t code, const std::string& why);
  void close(Peer& p, std::string reason);
  void end_session(Peer& p);
  bool may_store(Peer& p, std::string_view key, std::size_t value_bytes, std::string_view what);
  std::string why_not_writable(const Peer& p, std::string_view key) const;
  void put(const std::string& key, std::vector<char> value);
  void settle();
  template <class... Args>
  void warn_throttled(fmt::format_string<Args...> format, Args&&... args);

  TcpStoreServerOptions options_;
  std::string address_;
  Random random_;
  Id next_id_ = 1;
  std::map<Id, std::unique_ptr<Peer>> peers_;  // by id: the oldest first
  std::vector<Id> closed_;
  std::deque<Id> budget_queue_;  // connections waiting for budget, first come first served
  std::unordered_map<std::string, std::shared_ptr<Session>> sessions_;  // live ones, by token
  std::unordered_map<std::string, std::vector<char>> data_;
  std::unordered_map<std::string, std::vector<Id>> waiting_for_;  // missing key -> parked peers
  std::size_t buffered_ = 0;
  std::size_t peak_buffered_ = 0;
  std::size_t stored_ = 0;
  std::uint64_t refused_ = 0;
  // Warnings about misbehaving peers: at most one a second, the rest counted.
  Clock::time_point last_warning_{};
  std::uint64_t suppressed_warnings_ = 0;
};

}  // namespace tandem::collective::detail
