// tandem/collective/detail/store_wire.h — the TCP store's wire format, shared by its client
// (tcp_store_client.cc) and server (tcp_store_server.cc). Not part of the public contract.
//
// Both directions carry frames: a little-endian u32 length and that many bytes. A request is an
// opcode byte and its fields, a reply a status byte and its fields. Fields are u8, u32, i64 (little
// endian) and byte strings (a u32 length, then the bytes). Requests and their fields:
//   HELLO rank:i64 lost_key_prefix:str      announces the rank whose lost key the server keeps
//   BYE                                     the announced rank leaves cleanly
//   SET key:str value:bytes                 -> OK
//   GET key:str                             -> VALUE value:bytes (parked until the key exists)
//   WAIT count:u32 key:str x count          -> OK (parked until every key exists)
//   CHECK key:str                           -> BOOL u8
//   ADD key:str delta:i64                   -> INT i64 (counters are decimal text)
//   CANCEL                                  withdraws a parked GET/WAIT -> CANCELLED
// Any request may instead be answered ERROR code:u8 message:str. Nothing here does I/O but
// recv_frame; nothing throws: a malformed frame is a false return.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/collective/detail/socket.h"

namespace tandem::collective::detail::wire {

// A frame this large is a protocol error (or someone else's protocol on our port), not a value.
constexpr std::uint32_t kMaxFrameBytes = 256u << 20;
// Key and value of one set, leaving room in the frame for the fields around them.
constexpr std::size_t kMaxValueBytes = kMaxFrameBytes - 1024;

enum class Op : std::uint8_t { kHello = 1, kBye, kSet, kGet, kWait, kCheck, kAdd, kCancel };
enum class Status : std::uint8_t { kOk = 0, kValue, kBool, kInt, kError, kCancelled };

// Error codes an ERROR reply carries: the client throws InvalidArgument for the first, Internal
// for the others.
constexpr std::uint8_t kInvalidArgument = 1;
constexpr std::uint8_t kProtocol = 2;

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
  bool ok() const { return ok_; }
  bool at_end() const { return ok_ && p_ == end_; }

 private:
  // The next `n` bytes (advancing past them), or null when fewer remain.
  const char* take(std::size_t n);
  // The next length-prefixed run: its bytes and length, or null.
  const char* take_run(std::uint32_t& n);

  const char* p_;
  const char* end_;
  bool ok_ = true;
};

// One reply, whichever its status.
struct Reply {
  Status status = Status::kOk;
  std::vector<char> value;  // kValue
  bool flag = false;        // kBool
  std::int64_t number = 0;  // kInt
  std::uint8_t error_code = 0;
  std::string error;  // kError
};

// Parses a reply frame's payload; false when it is malformed.
bool parse_reply(const std::vector<char>& frame, Reply& reply);

// Reads one frame's payload. `deadline` bounds the wait for its first byte; once that has come,
// the rest is in flight and gets until `rest_deadline` (a reply cut off halfway would leave the
// connection unusable, where a reply not yet begun can still be cancelled). A length above
// kMaxFrameBytes is kError (EPROTO).
IoResult recv_frame(int fd, std::vector<char>& frame, Deadline deadline, Deadline rest_deadline);

}  // namespace tandem::collective::detail::wire
