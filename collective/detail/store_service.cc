// The TCP store's service (store_service.h): connections as byte streams in and out, served
// without sockets. tcp_store_server.cc moves the bytes.
#include "tandem/collective/detail/store_service.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <utility>

#include "tandem/base/errors.h"
#include "tandem/base/log.h"
#include "tandem/collective/detail/store_auth.h"

namespace tandem::collective::detail {

using wire::FrameScan;
using wire::KeyOwner;
using wire::Op;
using wire::Request;
using wire::Status;
using wire::Writer;

namespace {

// What a stored key or a parked key costs beyond its bytes (the map's node, the string).
constexpr std::size_t kEntryOverhead = 64;

// The bytes a VALUE reply carrying `value_bytes` takes: header, status, length, value.
std::size_t value_reply_bytes(std::size_t value_bytes) { return 4 + 1 + 4 + value_bytes; }

// A key as error replies and log lines show it: quoted, with control characters escaped (it
// comes from the peer), whole when short, else its start and its size (a reply that is not
// admitted against the budget must stay small).
std::string shown(std::string_view key) {
  constexpr std::size_t kShown = 200;
  if (key.size() <= kShown) return fmt::format("{:?}", key);
  return fmt::format("{:?}... ({} bytes)", key.substr(0, kShown), key.size());
}

std::string mib(std::size_t bytes) {
  return bytes >= (1u << 20) ? fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1u << 20))
                             : fmt::format("{} bytes", bytes);
}

}  // namespace

enum class PeerState { kHandshake, kReady, kFinishing, kClosed };

struct StoreService::Session {
  int rank = -1;
  std::string prefix;
  std::string token;
  bool live = true;
};

struct StoreService::Peer {
  Id id = 0;
  std::string name;  // "10.0.0.2:41234"
  PeerState state = PeerState::kHandshake;
  Clock::time_point deadline{};  // kHandshake, kFinishing
  std::string server_nonce;      // kHandshake
  std::vector<char> in;          // the frame arriving (and a little read ahead for small ones)
  std::vector<char> out;         // replies; out_sent of them went
  std::size_t out_sent = 0;
  std::size_t counted = 0;  // what this connection adds to buffered_
  bool admitted = false;    // the large frame arriving has its budget
  std::size_t discard = 0;  // bytes still to drop of a frame larger than the whole budget
  bool waits_for_budget = false;
  bool told_about_budget = false;        // the budget warning names each connection once
  Op parked = Op::kBye;                  // kGet or kWait while a request is parked; kBye: none
  std::vector<std::string> parked_keys;  // kGet: the key; kWait: those missing when it parked
  std::size_t missing = 0;               // kWait: parked_keys not yet set
  std::size_t parked_bytes = 0;
  std::shared_ptr<Session> session;  // the rank this connection acts for (HELLO or JOIN)
  bool announcer = false;            // it said HELLO: its close without BYE is a lost rank
  bool said_goodbye = false;
  std::string close_reason;

  bool is_parked() const { return parked != Op::kBye; }
  std::size_t unsent() const { return out.size() - out_sent; }
};

StoreService::StoreService(TcpStoreServerOptions options, std::string address, Random random)
    : options_(std::move(options)), address_(std::move(address)), random_(std::move(random)) {
  if (!random_) random_ = [](std::size_t n) { return auth::random_bytes(n); };
}

StoreService::~StoreService() = default;

template <class... Args>
void StoreService::warn_throttled(fmt::format_string<Args...> format, Args&&... args) {
  // A peer hammering the port with bad handshakes must not flood the log.
  const auto now = Clock::now();
  if (now - last_warning_ < std::chrono::seconds(1)) {
    ++suppressed_warnings_;
    return;
  }
  last_warning_ = now;
  const std::uint64_t suppressed = std::exchange(suppressed_warnings_, 0);
  std::string message = fmt::format(format, std::forward<Args>(args)...);
  if (suppressed > 0)
    message += fmt::format(" ({} similar message{} suppressed)", suppressed, suppressed == 1 ? "" : "s");
  logging::warn("{}", message);
}

StoreService::Peer* StoreService::find(Id id) const {
  const auto it = peers_.find(id);
  return it == peers_.end() ? nullptr : it->second.get();
}

StoreService::Id StoreService::open(std::string peer_name, Clock::time_point now) {
  std::size_t open_now = 0;
  for (const auto& [id, p] : peers_) open_now += p->state != PeerState::kClosed ? 1 : 0;
  if (open_now >= options_.max_connections && !evict_a_handshake()) {
    auto p = std::make_unique<Peer>();
    p->id = next_id_++;
    p->name = std::move(peer_name);
    Peer& peer = *p;
    peers_.emplace(peer.id, std::move(p));
    ++refused_;
    warn_throttled("the store at {} refused a connection from {}: it already serves {} (its limit)", address_,
                   peer.name, open_now);
    finish(peer, wire::kResourceExhausted,
           fmt::format("it serves at most {} connections (TcpStoreServerOptions::max_connections)",
                       options_.max_connections));
    return peer.id;
  }
  auto p = std::make_unique<Peer>();
  p->id = next_id_++;
  p->name = std::move(peer_name);
  p->deadline = now + options_.handshake_timeout;
  p->server_nonce = random_(auth::kNonceBytes);
  Peer& peer = *p;
  peers_.emplace(peer.id, std::move(p));
  queue(peer, Writer(Status::kChallenge)
                  .u8(wire::kProtocolVersion)
                  .u8(requires_secret() ? 1 : 0)
                  .str(peer.server_nonce)
                  .finish());
  return peer.id;
}

bool StoreService::evict_a_handshake() {
  // The map is ordered by id, the oldest connection first.
  for (const auto& [id, p] : peers_) {
    if (p->state != PeerState::kHandshake) continue;
    ++refused_;
    warn_throttled("the store at {} closed the connection from {} to make room: it had not finished its handshake",
                   address_, p->name);
    close(*p, "closed to make room for another connection before it finished its handshake");
    return true;
  }
  return false;
}

std::size_t StoreService::wants(Id id) const {
  const Peer* p = find(id);
  if (p == nullptr || p->unsent() > kAllowance) return 0;
  if (p->state == PeerState::kReady && p->discard > 0) return std::min(p->discard, kAllowance);
  std::size_t cap = 0;
  if (p->state == PeerState::kHandshake) {
    cap = 4 + wire::kMaxHandshakeFrameBytes;
  } else if (p->state == PeerState::kReady) {
    const FrameScan scan = wire::scan_frame(p->in.data(), p->in.size(), wire::kMaxFrameBytes);
    const std::size_t frame = 4 + static_cast<std::size_t>(scan.length);
    if (scan.kind == FrameScan::kComplete || scan.kind == FrameScan::kTooLarge) {
      cap = 0;  // served (or refused) before anything more is read
    } else if (p->in.size() < 4 || frame <= kAllowance) {
      cap = kAllowance;
    } else {
      cap = p->admitted ? frame : 0;
    }
  }
  return cap > p->in.size() ? cap - p->in.size() : 0;
}

void StoreService::receive(Id id, const char* data, std::size_t size) {
  Peer* p = find(id);
  if (p == nullptr || (p->state != PeerState::kHandshake && p->state != PeerState::kReady)) return;
  const std::size_t dropped = std::min(p->discard, size);
  p->discard -= dropped;
  data += dropped;
  size -= dropped;
  // Grow by doubling, but never past the allowance (or the admitted frame, reserved whole):
  // the capacity is what the budget counts.
  const std::size_t need = p->in.size() + size;
  if (need > p->in.capacity()) p->in.reserve(std::max(need, std::min(kAllowance, 2 * p->in.capacity())));
  p->in.insert(p->in.end(), data, data + size);
  advance(*p);
  settle();
}

void StoreService::hang_up(Id id, std::string reason) {
  Peer* p = find(id);
  if (p != nullptr) close(*p, std::move(reason));
}

std::string_view StoreService::output(Id id) const {
  const Peer* p = find(id);
  if (p == nullptr || p->state == PeerState::kClosed) return {};
  return std::string_view(p->out.data() + p->out_sent, p->unsent());
}

void StoreService::sent(Id id, std::size_t n) {
  Peer* p = find(id);
  if (p == nullptr) return;
  p->out_sent += std::min(n, p->unsent());
  if (p->unsent() == 0) {
    // A connection that once carried a large reply gives its memory back.
    if (p->out.capacity() > kAllowance) {
      std::vector<char>().swap(p->out);
    } else {
      p->out.clear();
    }
    p->out_sent = 0;
    if (p->state == PeerState::kFinishing) close(*p, p->close_reason);
  }
  recount(*p);
  advance(*p);  // requests held back while replies were waiting
  settle();
}

StoreService::Clock::time_point StoreService::expire(Clock::time_point now) {
  auto next = Clock::time_point::max();
  for (const auto& [id, p] : peers_) {
    if (p->state != PeerState::kHandshake && p->state != PeerState::kFinishing) continue;
    if (p->deadline > now) {
      next = std::min(next, p->deadline);
      continue;
    }
    if (p->state == PeerState::kHandshake) {
      ++refused_;
      warn_throttled("the store at {} closed the connection from {}: no handshake within {} ms", address_, p->name,
                     options_.handshake_timeout.count());
      close(*p, "no handshake in time");
    } else {
      close(*p, p->close_reason);
    }
  }
  settle();
  return next;
}

std::vector<StoreService::Id> StoreService::take_closed() {
  std::vector<Id> ids;
  // Setting a lost key answers parked requests, which may close more connections (a failed
  // reply cannot happen here, but the loop keeps it simple to reason about).
  while (!closed_.empty()) {
    const Id id = closed_.back();
    closed_.pop_back();
    const auto it = peers_.find(id);
    if (it == peers_.end()) continue;
    std::unique_ptr<Peer> p = std::move(it->second);
    peers_.erase(it);
    unpark(*p);
    buffered_ -= p->counted;
    if (p->announcer && p->session && p->session->live && !p->said_goodbye) {
      const std::string reason =
          fmt::format("connection from {} closed without goodbye ({})", p->name, p->close_reason);
      const std::string key = p->session->prefix + lost_rank_key(p->session->rank);
      end_session(*p);
      if (stored_ + key.size() + reason.size() + kEntryOverhead <= options_.max_stored_bytes) {
        put(key, std::vector<char>(reason.begin(), reason.end()));
      } else {
        logging::warn(
            "the store at {} is full (TcpStoreServerOptions::max_stored_bytes): it could not record that "
            "rank {} was lost ({})",
            address_, p->session->rank, reason);
      }
    } else if (p->announcer) {
      end_session(*p);
    }
    ids.push_back(id);
  }
  settle();
  return ids;
}

TcpStoreServerStats StoreService::stats() const {
  TcpStoreServerStats s;
  for (const auto& [id, p] : peers_) s.connections += p->state != PeerState::kClosed ? 1 : 0;
  s.buffered_bytes = buffered_;
  s.peak_buffered_bytes = peak_buffered_;
  s.stored_bytes = stored_;
  s.refused_connections = refused_;
  return s;
}

// ---- One connection's frames -------------------------------------------------------------------

void StoreService::advance(Peer& p) {
  std::size_t offset = 0;
  while (p.state == PeerState::kHandshake || p.state == PeerState::kReady) {
    // A parked request whose keys are there but whose reply waited for budget; while it stays
    // parked, only a CANCEL may come, read like any frame.
    if (p.is_parked()) try_answer(p);
    if (p.unsent() > kAllowance) break;  // the client must read its replies first
    const bool handshaking = p.state == PeerState::kHandshake;
    const std::uint32_t limit = handshaking ? wire::kMaxHandshakeFrameBytes : wire::kMaxFrameBytes;
    const FrameScan scan = wire::scan_frame(p.in.data() + offset, p.in.size() - offset, limit);
    if (scan.kind == FrameScan::kTooLarge) {
      if (handshaking) {
        refuse(p, wire::kUnauthenticated,
               fmt::format("its first frame declares {} bytes, where a handshake takes at most {} (not a tandem "
                           "store client, or one of another version)",
                           scan.length, wire::kMaxHandshakeFrameBytes));
      } else {
        finish(p, wire::kProtocol, fmt::format("protocol error: a frame of {} bytes", scan.length));
        warn_throttled("the store at {} closed the connection from {}: a frame of {} bytes (at most {})", address_,
                       p.name, scan.length, wire::kMaxFrameBytes);
      }
      break;
    }
    if (scan.kind == FrameScan::kIncomplete) {
      const std::size_t frame = 4 + static_cast<std::size_t>(scan.length);
      if (!handshaking && p.in.size() - offset >= 4 && frame > kAllowance && !p.admitted) {
        if (frame > options_.max_buffered_bytes) {
          // It can never be buffered: its bytes are read and dropped as they come, and the
          // client gets the reason instead of a broken connection.
          p.discard = frame - (p.in.size() - offset);
          p.in.resize(offset);
          warn_throttled("the store at {} dropped a request of {} from {}: more than its whole budget of {}", address_,
                         mib(frame), p.name, mib(options_.max_buffered_bytes));
          queue(p, Writer(Status::kError)
                       .u8(wire::kResourceExhausted)
                       .str(fmt::format("a request of {} is more than the store buffers for all connections "
                                        "together ({}, TcpStoreServerOptions::max_buffered_bytes)",
                                        mib(frame), mib(options_.max_buffered_bytes)))
                       .finish());
          break;
        }
        // The frame's bytes move to the front of `in` first, so that the reservation is exact.
        p.in.erase(p.in.begin(), p.in.begin() + static_cast<std::ptrdiff_t>(offset));
        offset = 0;
        const std::size_t extra = frame > p.in.capacity() ? frame - p.in.capacity() : 0;
        if (admit(p, extra, fmt::format("a {} request", mib(frame)))) {
          p.in.reserve(frame);
          p.admitted = true;
        }
      }
      break;
    }
    const Served served = serve_frame(p, p.in.data() + offset + 4, scan.length);
    if (served == Served::kNotYet) break;  // the frame stays, waiting for budget
    offset += 4 + static_cast<std::size_t>(scan.length);
    p.admitted = false;
    if (served == Served::kStop) break;
  }
  if (p.state == PeerState::kClosed) return;
  p.in.erase(p.in.begin(), p.in.begin() + static_cast<std::ptrdiff_t>(std::min(offset, p.in.size())));
  // A large request's buffer goes once it has been served (not while one is admitted and
  // arriving into it).
  if (!p.admitted && p.in.capacity() > kAllowance && p.in.size() <= kAllowance) {
    std::vector<char>(p.in.begin(), p.in.end()).swap(p.in);
  }
  recount(p);
}

StoreService::Served StoreService::serve_frame(Peer& p, const char* payload, std::size_t size) {
  Request q;
  std::string error;
  const bool parsed = wire::parse_request(payload, size, q, error);
  if (p.state == PeerState::kHandshake) {
    if (!parsed || q.op != Op::kAuth) {
      refuse(p, wire::kUnauthenticated,
             parsed ? "it sent a request before the handshake (a client of another tandem version, or not a tandem "
                      "store client)"
                    : fmt::format("a malformed handshake ({})", error));
      return Served::kStop;
    }
    handshake(p, q);
    return p.state == PeerState::kReady ? Served::kNext : Served::kStop;
  }
  if (!parsed) {
    finish(p, wire::kProtocol, fmt::format("protocol error: {}", error));
    return Served::kStop;
  }
  // A request that parks holds its keys until answered: they need budget like a frame does.
  if ((q.op == Op::kGet || q.op == Op::kWait) && !p.is_parked()) {
    const std::size_t cost = parking_cost(q.op == Op::kGet ? std::vector<std::string_view>{q.key} : q.keys);
    if (cost > kAllowance && cost + p.in.capacity() > options_.max_buffered_bytes) {
      queue(p, Writer(Status::kError)
                   .u8(wire::kResourceExhausted)
                   .str(fmt::format("the keys of this {} take {} to keep while it waits, more than the store buffers "
                                    "for all connections together ({}, TcpStoreServerOptions::max_buffered_bytes)",
                                    q.op == Op::kGet ? "get" : "wait", mib(cost), mib(options_.max_buffered_bytes)))
                   .finish());
      return Served::kNext;
    }
    if (cost > kAllowance && !admit(p, cost, fmt::format("a wait for keys of {}", mib(cost)))) return Served::kNotYet;
  }
  handle(p, q);
  return p.state == PeerState::kReady ? Served::kNext : Served::kStop;
}

void StoreService::handshake(Peer& p, const Request& q) {
  if (q.nonce.size() != auth::kNonceBytes) {
    return refuse(p, wire::kUnauthenticated, "a malformed handshake (its nonce)");
  }
  std::string server_proof;
  if (requires_secret()) {
    if (q.proof.empty()) {
      return refuse(p, wire::kUnauthenticated, "it holds no secret, and this store requires TANDEM_STORE_SECRET");
    }
    const std::string expected = auth::proof(auth::Side::kClient, options_.secret, p.server_nonce, q.nonce);
    if (!auth::proofs_equal(q.proof, expected)) {
      return refuse(p, wire::kUnauthenticated, "its secret differs from this store's (TANDEM_STORE_SECRET)");
    }
    server_proof = auth::proof(auth::Side::kServer, options_.secret, p.server_nonce, q.nonce);
  }
  p.state = PeerState::kReady;
  p.server_nonce.clear();
  queue(p, Writer(Status::kWelcome).str(server_proof).finish());
}

void StoreService::handle(Peer& p, const Request& q) {
  if (p.is_parked() && q.op != Op::kCancel) {
    return finish(p, wire::kProtocol, "protocol error: a request while another waits");
  }
  switch (q.op) {
    case Op::kAuth: return finish(p, wire::kProtocol, "protocol error: a second handshake");
    case Op::kHello: return hello(p, q);
    case Op::kJoin: return join(p, q);
    case Op::kBye:
      p.said_goodbye = true;
      if (p.announcer) end_session(p);
      return queue(p, Writer(Status::kOk).finish());
    case Op::kSet: return set(p, q);
    case Op::kAdd: return add(p, q);
    case Op::kGet: return park(p, Op::kGet, {q.key});
    case Op::kWait: return park(p, Op::kWait, q.keys);
    case Op::kCheck: return queue(p, Writer(Status::kBool).u8(data_.contains(std::string(q.key)) ? 1 : 0).finish());
    case Op::kCancel: unpark(p); return queue(p, Writer(Status::kCancelled).finish());
  }
}

void StoreService::hello(Peer& p, const Request& q) {
  if (p.session) return finish(p, wire::kProtocol, "protocol error: HELLO on a connection that acts for a rank");
  const int rank = static_cast<int>(q.rank);
  for (const auto& [token, s] : sessions_) {
    if (s->rank != rank || s->prefix != q.prefix) continue;
    // Name the connection that holds it.
    std::string holder = "another connection";
    for (const auto& [id, other] : peers_) {
      if (other->announcer && other->session == s) holder = other->name;
    }
    return queue(p, Writer(Status::kError)
                        .u8(wire::kInvalidArgument)
                        .str(fmt::format("rank {} is already claimed by a live process (connected from {}): two "
                                         "processes were started as rank {}; each task needs its own index",
                                         rank, holder, rank))
                        .finish());
  }
  auto session = std::make_shared<Session>();
  session->rank = rank;
  session->prefix = std::string(q.prefix);
  session->token = random_(auth::kTokenBytes);
  sessions_[session->token] = session;
  p.session = session;
  p.announcer = true;
  queue(p, Writer(Status::kValue).str(session->token).finish());
}

void StoreService::join(Peer& p, const Request& q) {
  if (p.session) return finish(p, wire::kProtocol, "protocol error: JOIN on a connection that acts for a rank");
  const auto it = sessions_.find(std::string(q.token));
  if (it == sessions_.end()) {
    return queue(p, Writer(Status::kError)
                        .u8(wire::kPermissionDenied)
                        .str("this client's announcement of its rank has ended (its first connection closed or said "
                             "goodbye)")
                        .finish());
  }
  p.session = it->second;
  queue(p, Writer(Status::kOk).finish());
}

void StoreService::set(Peer& p, const Request& q) {
  if (!may_store(p, q.key, q.value.size(), "set")) return;
  queue(p, Writer(Status::kOk).finish());
  put(std::string(q.key), std::vector<char>(q.value.begin(), q.value.end()));
}

void StoreService::add(Peer& p, const Request& q) {
  const std::string key(q.key);
  std::int64_t value = 0;
  if (const auto it = data_.find(key); it != data_.end() && !it->second.empty()) {
    const char* begin = it->second.data();
    const char* end = begin + it->second.size();
    const auto [ptr, ec] = std::from_chars(begin, end, value);
    if (ec != std::errc() || ptr != end) {
      return queue(p, Writer(Status::kError)
                          .u8(wire::kInvalidArgument)
                          .str(fmt::format("add({}): the key holds a value that is not a decimal integer ({} bytes)",
                                           shown(key), it->second.size()))
                          .finish());
    }
  }
  // Wrapping around is two's complement, as a counter of int64 would; never undefined.
  value = static_cast<std::int64_t>(static_cast<std::uint64_t>(value) + static_cast<std::uint64_t>(q.delta));
  const std::string text = std::to_string(value);
  if (!may_store(p, key, text.size(), "add")) return;
  queue(p, Writer(Status::kInt).i64(value).finish());
  put(key, std::vector<char>(text.begin(), text.end()));
}

bool StoreService::may_store(Peer& p, std::string_view key, std::size_t value_bytes, std::string_view what) {
  if (const std::string why = why_not_writable(p, key); !why.empty()) {
    warn_throttled("the store at {} refused {}({}) from {}: {}", address_, what, shown(key), p.name, why);
    queue(p, Writer(Status::kError)
                 .u8(wire::kPermissionDenied)
                 .str(fmt::format("{}({}) refused: {}", what, shown(key), why))
                 .finish());
    return false;
  }
  std::size_t held = 0;
  if (const auto it = data_.find(std::string(key)); it != data_.end()) {
    held = it->first.size() + it->second.size() + kEntryOverhead;
  }
  const std::size_t after = stored_ - held + key.size() + value_bytes + kEntryOverhead;
  if (after > options_.max_stored_bytes && after > stored_) {
    warn_throttled("the store at {} refused {}({}) from {}: it holds {} of its {} (max_stored_bytes)", address_, what,
                   shown(key), p.name, mib(stored_), mib(options_.max_stored_bytes));
    queue(p, Writer(Status::kError)
                 .u8(wire::kResourceExhausted)
                 .str(fmt::format("{}({}) refused: the store holds {} and may hold at most {} "
                                  "(TcpStoreServerOptions::max_stored_bytes)",
                                  what, shown(key), mib(stored_), mib(options_.max_stored_bytes)))
                 .finish());
    return false;
  }
  return true;
}

std::string StoreService::why_not_writable(const Peer& p, std::string_view key) const {
  const KeyOwner owner = wire::key_owner(key);
  switch (owner.kind) {
    case KeyOwner::kAnyone: return {};
    case KeyOwner::kServer:
      return fmt::format("lost keys are written only by the server, when rank {}'s connection closes without goodbye",
                         owner.rank);
    case KeyOwner::kConflict: return "the key names two different ranks (\"rank/<r>\" segments), so nobody owns it";
    case KeyOwner::kRank: break;
  }
  const Session* s = p.session.get();
  if (s != nullptr && s->live && s->rank == owner.rank && key.starts_with(s->prefix)) return {};
  const std::string mine = s == nullptr ? "this connection announced no rank"
                           : !s->live   ? fmt::format("this connection's announcement of rank {} has ended", s->rank)
                                      : fmt::format("this connection acts for rank {} under {:?}", s->rank, s->prefix);
  return fmt::format(
      "the key belongs to rank {}, and only the client that announced rank {} (under a prefix the "
      "key starts with) may write it; {}",
      owner.rank, owner.rank, mine);
}

// ---- Parked requests ---------------------------------------------------------------------------

// What parking these keys holds: each in the connection's list and in the index of waiters.
std::size_t StoreService::parking_cost(const std::vector<std::string_view>& keys) {
  std::size_t cost = 0;
  for (const std::string_view key : keys) cost += 2 * (key.size() + kEntryOverhead);
  return cost;
}

void StoreService::park(Peer& p, Op op, const std::vector<std::string_view>& keys) {
  p.parked = op;
  p.parked_keys.clear();
  p.missing = 0;
  p.parked_bytes = 0;
  for (const std::string_view key : keys) {
    std::string k(key);
    if (op == Op::kWait && data_.contains(k)) continue;
    p.parked_bytes += 2 * (k.size() + kEntryOverhead);
    if (!data_.contains(k)) {
      waiting_for_[k].push_back(p.id);
      ++p.missing;
    }
    p.parked_keys.push_back(std::move(k));
  }
  // The parked keys count against the budget like buffered bytes (serve_frame admitted them).
  recount(p);
  try_answer(p);
}

void StoreService::unpark(Peer& p) {
  for (const std::string& key : p.parked_keys) {
    const auto it = waiting_for_.find(key);
    if (it == waiting_for_.end()) continue;
    std::erase(it->second, p.id);
    if (it->second.empty()) waiting_for_.erase(it);
  }
  p.parked = Op::kBye;
  p.parked_keys.clear();
  p.missing = 0;
  p.parked_bytes = 0;
  recount(p);
}

// Answers a parked request whose keys are all there, if its reply fits the budget. True when
// it was answered.
bool StoreService::try_answer(Peer& p) {
  if (!p.is_parked() || p.missing > 0) return false;
  if (p.parked == Op::kWait) {
    unpark(p);
    queue(p, Writer(Status::kOk).finish());
    return true;
  }
  const auto it = data_.find(p.parked_keys.front());
  if (it == data_.end()) return false;  // set, then overwritten? never removed: cannot happen
  // The reply is smaller than the SET frame that brought the value, which fit the budget: it
  // fits too once others drain.
  const std::size_t reply = value_reply_bytes(it->second.size());
  if (reply > kAllowance && !admit(p, reply, fmt::format("a {} reply", mib(reply)))) return false;
  std::vector<char> frame = Writer(Status::kValue).bytes(it->second).finish();
  unpark(p);
  queue(p, std::move(frame));
  return true;
}

// Whether `extra` more bytes for the connection fit the budget now; if not, the connection
// waits in budget_queue_ (and the first time, the log says so).
bool StoreService::admit(Peer& p, std::size_t extra, std::string_view what) {
  if (extra > options_.max_buffered_bytes) return true;  // never fits: the caller refuses it
  if (buffered_ + extra <= options_.max_buffered_bytes) {
    p.waits_for_budget = false;
    return true;
  }
  if (!p.waits_for_budget) {
    p.waits_for_budget = true;
    budget_queue_.push_back(p.id);
  }
  if (!p.told_about_budget) {
    p.told_about_budget = true;
    warn_throttled(
        "the store at {} buffers {} of its {} (TcpStoreServerOptions::max_buffered_bytes): {} for {} waits "
        "until other connections drain",
        address_, mib(buffered_), mib(options_.max_buffered_bytes), what, p.name);
  }
  return false;
}

// Retries the connections waiting for budget, in the order they started waiting.
void StoreService::settle() {
  for (std::size_t n = budget_queue_.size(); n > 0 && !budget_queue_.empty(); --n) {
    const Id id = budget_queue_.front();
    budget_queue_.pop_front();
    Peer* p = find(id);
    if (p == nullptr || !p->waits_for_budget || p->state == PeerState::kClosed) continue;
    p->waits_for_budget = false;
    advance(*p);
    if (p->waits_for_budget) {
      // advance put it back at the end; keep its place at the front instead.
      std::erase(budget_queue_, id);
      budget_queue_.push_front(id);
      break;
    }
  }
}

// Stores a value (no checks: the caller made them) and answers the parked requests it completes.
void StoreService::put(const std::string& key, std::vector<char> value) {
  auto [it, inserted] = data_.try_emplace(key);
  if (!inserted) stored_ -= it->first.size() + it->second.size() + kEntryOverhead;
  it->second = std::move(value);
  stored_ += it->first.size() + it->second.size() + kEntryOverhead;
  const auto waiting = waiting_for_.find(key);
  if (waiting == waiting_for_.end()) return;
  const std::vector<Id> ids = std::move(waiting->second);
  waiting_for_.erase(waiting);
  for (const Id id : ids) {
    Peer* p = find(id);
    if (p == nullptr || !p->is_parked() || p->missing == 0) continue;
    --p->missing;
    try_answer(*p);
  }
}

// ---- Replies, accounting and closing -----------------------------------------------------------

void StoreService::queue(Peer& p, std::vector<char> frame) {
  if (p.state == PeerState::kClosed) return;
  if (p.out.empty()) {
    p.out = std::move(frame);
    p.out_sent = 0;
  } else {
    p.out.erase(p.out.begin(), p.out.begin() + static_cast<std::ptrdiff_t>(p.out_sent));
    p.out_sent = 0;
    p.out.reserve(p.out.size() + frame.size());
    p.out.insert(p.out.end(), frame.begin(), frame.end());
  }
  recount(p);
}

void StoreService::recount(Peer& p) {
  const std::size_t now = p.in.capacity() + p.out.capacity() + p.parked_bytes;
  buffered_ = buffered_ - p.counted + now;
  p.counted = now;
  peak_buffered_ = std::max(peak_buffered_, buffered_);
}

// Queues an error reply and closes the connection once it is sent (or kFinishTimeout passed).
void StoreService::finish(Peer& p, std::uint8_t code, const std::string& message) {
  if (p.state == PeerState::kClosed || p.state == PeerState::kFinishing) return;
  unpark(p);
  queue(p, Writer(Status::kError).u8(code).str(message).finish());
  p.state = PeerState::kFinishing;
  p.close_reason = message;
  p.deadline = Clock::now() + kFinishTimeout;
  p.in.clear();
  std::vector<char>().swap(p.in);
  recount(p);
}

void StoreService::refuse(Peer& p, std::uint8_t code, const std::string& why) {
  ++refused_;
  warn_throttled("the store at {} refused the connection from {}: {}", address_, p.name, why);
  finish(p, code, why);
}

void StoreService::close(Peer& p, std::string reason) {
  if (p.state == PeerState::kClosed) return;
  p.state = PeerState::kClosed;
  p.close_reason = std::move(reason);
  closed_.push_back(p.id);
}

void StoreService::end_session(Peer& p) {
  if (!p.session || !p.session->live) return;
  p.session->live = false;
  sessions_.erase(p.session->token);
}

}  // namespace tandem::collective::detail
