// tandem/collective/detail/store_wire.h — the TCP store's wire format, shared by its client
// (tcp_store_client.cc), its server's service (store_service.cc) and the wire fuzzer
// (tests/fuzz/store_wire_fuzz.cc). Not part of the public contract.
//
// Both directions carry frames: a little-endian u32 length and that many bytes. A request is an
// opcode byte and its fields, a reply a status byte and its fields. Fields are u8, u32, i64 (little
// endian) and byte strings (a u32 length, then the bytes).
//
// A connection opens with the handshake (see store_auth.h for the proofs):
//   server: CHALLENGE version:u8 secret_required:u8 server_nonce:bytes
//   client: AUTH client_nonce:bytes proof:bytes      (proof empty without a secret)
//   server: WELCOME proof:bytes                       (empty without a secret), or ERROR
// and only then carries requests:
//   HELLO rank:i64 lost_key_prefix:str      announces the rank -> VALUE session token
//   JOIN token:bytes                        this connection acts for the announced rank -> OK
//   BYE                                     the announced rank leaves cleanly -> OK
//   SET key:str value:bytes                 -> OK
//   GET key:str                             -> VALUE value:bytes (parked until the key exists)
//   WAIT count:u32 key:str x count          -> OK (parked until every key exists)
//   CHECK key:str                           -> BOOL u8
//   ADD key:str delta:i64                   -> INT i64 (counters are decimal text)
//   CANCEL                                  withdraws a parked GET/WAIT -> CANCELLED
// Any request may instead be answered ERROR code:u8 message:str. Nothing here does I/O or throws:
// a malformed frame is a false return (socket.h's recv_frame reads frames off a socket).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::collective::detail::wire {

// A frame this large is a protocol error (or someone else's protocol on our port), not a value.
constexpr std::uint32_t kMaxFrameBytes = 256u << 20;
// Key and value of one set, leaving room in the frame for the fields around them.
constexpr std::size_t kMaxValueBytes = kMaxFrameBytes - 1024;
// Before the handshake the only frame a server accepts is AUTH, well under this: a peer that has
// not proved anything cannot make the server buffer more.
constexpr std::uint32_t kMaxHandshakeFrameBytes = 512;
// Keys one WAIT may name.
constexpr std::uint32_t kMaxWaitKeys = 65536;
// A HELLO's lost-key prefix ("run/3/"): the server keeps it while the rank is announced.
constexpr std::uint32_t kMaxPrefixBytes = 1024;
// The handshake's version: a client and a server of different versions refuse each other.
constexpr std::uint8_t kProtocolVersion = 1;

enum class Op : std::uint8_t { kHello = 1, kBye, kSet, kGet, kWait, kCheck, kAdd, kCancel, kAuth, kJoin };
enum class Status : std::uint8_t { kOk = 0, kValue, kBool, kInt, kError, kCancelled, kChallenge, kWelcome };

// Error codes an ERROR reply carries; the client throws the tandem error of the same name
// (Internal for kProtocol).
constexpr std::uint8_t kInvalidArgument = 1;
constexpr std::uint8_t kProtocol = 2;
constexpr std::uint8_t kResourceExhausted = 3;
constexpr std::uint8_t kPermissionDenied = 4;
constexpr std::uint8_t kUnauthenticated = 5;

// The little-endian u32 at p (4 bytes): a frame's length, or a u32 field.
std::uint32_t read_u32(const char* p);

// Builds one frame: the u32 length is filled in by finish().
class Writer {
 public:
  explicit Writer(Op op) : Writer(static_cast<std::uint8_t>(op)) {}
  explicit Writer(Status status) : Writer(static_cast<std::uint8_t>(status)) {}

  Writer& u8(std::uint8_t v) {
    buffer_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& u32(std::uint32_t v) { return little_endian(v, 4); }
  Writer& i64(std::int64_t v) { return little_endian(static_cast<std::uint64_t>(v), 8); }
  Writer& bytes(const char* data, std::size_t size) {
    u32(static_cast<std::uint32_t>(size));
    buffer_.insert(buffer_.end(), data, data + size);
    return *this;
  }
  Writer& str(std::string_view s) { return bytes(s.data(), s.size()); }
  Writer& bytes(const std::vector<char>& v) { return bytes(v.data(), v.size()); }

  std::vector<char> finish();

 private:
  explicit Writer(std::uint8_t tag) {
    buffer_.resize(4);
    buffer_.push_back(static_cast<char>(tag));
  }
  Writer& little_endian(std::uint64_t v, int count) {
    for (int i = 0; i < count; ++i) buffer_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }

  std::vector<char> buffer_;
};

// Reads the fields of one frame's payload; every read fails (returns false) once the payload
// runs out, so a truncated frame is caught by the caller's single check.
class Reader {
 public:
  Reader(const char* data, std::size_t size) : p_(data), end_(data + size) {}

  bool u8(std::uint8_t& v);
  bool u32(std::uint32_t& v);
  bool i64(std::int64_t& v);
  bool bytes(std::vector<char>& v);
  bool str(std::string& s);
  // A byte string as a view into the payload (valid while the payload is).
  bool view(std::string_view& s);
  bool ok() const { return ok_; }
  bool at_end() const { return ok_ && p_ == end_; }
  std::size_t remaining() const { return static_cast<std::size_t>(end_ - p_); }

 private:
  // The next `n` bytes (advancing past them), or null when fewer remain.
  const char* take(std::size_t n);
  // The next length-prefixed run: its bytes and length, or null.
  const char* take_run(std::uint32_t& n);

  const char* p_;
  const char* end_;
  bool ok_ = true;
};

// Where the next frame of a byte stream stands: complete (its payload is data[4, 4 + length)),
// still arriving (`missing` more bytes), or declaring more than `limit` payload bytes.
struct FrameScan {
  enum Kind { kIncomplete, kComplete, kTooLarge } kind = kIncomplete;
  std::uint32_t length = 0;  // the payload's, once the 4 header bytes are in
  std::size_t missing = 0;   // kIncomplete: bytes still to come, header included
};
FrameScan scan_frame(const char* data, std::size_t size, std::uint32_t limit);

// One request, its fields as views into the frame's payload.
struct Request {
  Op op = Op::kBye;
  std::int64_t rank = -1;              // kHello: 0..INT_MAX
  std::string_view prefix;             // kHello
  std::string_view key;                // kSet, kGet, kCheck, kAdd
  std::string_view value;              // kSet
  std::string_view nonce;              // kAuth: the client's
  std::string_view proof;              // kAuth
  std::string_view token;              // kJoin
  std::int64_t delta = 0;              // kAdd
  std::vector<std::string_view> keys;  // kWait
};

// Parses a request frame's payload. False when it is malformed, with `error` saying how
// ("malformed SET", "unknown request 77").
bool parse_request(const char* data, std::size_t size, Request& request, std::string& error);

// One reply, whichever its status.
struct Reply {
  Status status = Status::kOk;
  std::vector<char> value;  // kValue; kChallenge: the server's nonce; kWelcome: its proof
  bool flag = false;        // kBool; kChallenge: whether the server requires a secret
  std::int64_t number = 0;  // kInt; kChallenge: the protocol version
  std::uint8_t error_code = 0;
  std::string error;  // kError
};

// Parses a reply frame's payload; false when it is malformed.
bool parse_reply(const std::vector<char>& frame, Reply& reply);

// Who may write a key (SET, ADD). A key with the path segments "rank/<r>" (r a decimal rank
// without sign or leading zeros, e.g. "run/0/rendezvous/rank/1" or ".../rank/1/claims") belongs
// to rank r; one ending in "tandem/lost/<r>" (tcp_store.h's lost keys) to the server; any other
// key to anyone. A key naming two different ranks belongs to nobody (kConflict).
struct KeyOwner {
  enum Kind { kAnyone, kRank, kServer, kConflict } kind = kAnyone;
  int rank = -1;  // kRank, kServer
};
KeyOwner key_owner(std::string_view key);

}  // namespace tandem::collective::detail::wire
