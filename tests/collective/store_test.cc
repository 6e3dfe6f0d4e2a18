// The stores (in-memory, prefix, TCP) and the rendezvous. Behaviour about processes (a rank
// killed, ranks that meet) runs real processes: this binary re-executes itself with
// `--store-test-child <role> ...` (see child_main) and the tests read what each child reports.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tandem/base/errors.h"
#include "tandem/collective/detail/store_auth.h"
#include "tandem/collective/detail/store_wire.h"
#include "tandem/collective/rendezvous.h"
#include "tandem/collective/store.h"
#include "tandem/collective/tcp_store.h"

extern char** environ;

namespace {

using namespace std::chrono_literals;
using namespace tandem::collective;
using Clock = std::chrono::steady_clock;

constexpr std::string_view kChildFlag = "--store-test-child";

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

bool contains(const std::string& haystack, std::string_view needle) {
  return haystack.find(needle) != std::string::npos;
}

// A port nobody listens on right now (bound to port 0 and released).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  socklen_t length = sizeof addr;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string local(int port) { return "127.0.0.1:" + std::to_string(port); }

// A child process running this binary in one of child_main's roles. Killed (and reaped) if still
// running when destroyed, so a failing test leaves nothing behind.
class Child {
 public:
  explicit Child(const std::vector<std::string>& args) {
    std::vector<std::string> all = {"/proc/self/exe", std::string(kChildFlag)};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = ::posix_spawn(&pid_, "/proc/self/exe", nullptr, nullptr, argv.data(), environ);
    REQUIRE_MESSAGE(rc == 0, "posix_spawn failed: " << rc);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  void kill_hard() const { ::kill(pid_, SIGKILL); }

  static constexpr int kTimedOut = -1000;
  // The exit code, -signal when killed, kTimedOut (after killing it) when it outlives timeout.
  int wait(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
      if (Clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        pid_ = -1;
        return kTimedOut;
      }
      std::this_thread::sleep_for(10ms);
    }
  }

 private:
  pid_t pid_ = -1;
};

// A scratch directory for children's reports, removed at the end of the test.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "tandem_store_test_XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Labels and addresses as a cluster resolver would give them: rank 0 is the chief at the store's
// address, worker r at port + r.
RendezvousOptions cluster_options(int port, int rank, int world_size, std::chrono::milliseconds timeout) {
  RendezvousOptions options;
  options.address = local(port);
  options.rank = rank;
  options.world_size = world_size;
  options.timeout = timeout;
  for (int r = 0; r < world_size; ++r) {
    options.task_labels.push_back(r == 0 ? std::string("chief") : "worker " + std::to_string(r));
    options.task_addresses.push_back(local(port + r));
  }
  return options;
}

// ---- Child roles -------------------------------------------------------------------------------

// hold <address> <rank> <lost prefix>: announce rank, set "held/<rank>", sleep until killed.
// exit <address> <rank>: announce rank, set "exited/<rank>", exit cleanly.
// rendezvous <port> <rank> <world size> <timeout ms> <report file>: rendezvous, then write "ok" or
//   "<ErrorCode>: <message>" to the report file. The chief stays until every rank set "done/<r>".
int child_main(int argc, char** argv) {
  if (argc < 3) return 2;
  const std::string role = argv[2];
  const std::vector<std::string> args(argv + 3, argv + argc);
  try {
    if (role == "hold" && args.size() == 3) {
      TcpStoreOptions options;
      options.connect_timeout = 10s;
      options.rank = std::stoi(args[1]);
      options.lost_key_prefix = args[2];
      auto store = connect_tcp_store(args[0], options);
      store->set(args[2] + "held/" + args[1], bytes("1"));
      std::this_thread::sleep_for(60s);  // the test kills it long before
      return 0;
    }
    if (role == "exit" && args.size() == 2) {
      TcpStoreOptions options;
      options.connect_timeout = 10s;
      options.rank = std::stoi(args[1]);
      auto store = connect_tcp_store(args[0], options);
      store->set("exited/" + args[1], bytes("1"));
      return 0;
    }
    if (role == "rendezvous" && args.size() == 5) {
      const int rank = std::stoi(args[1]);
      const int world_size = std::stoi(args[2]);
      std::ofstream report(args[4]);
      try {
        Rendezvous group = rendezvous(
            cluster_options(std::stoi(args[0]), rank, world_size, std::chrono::milliseconds(std::stoi(args[3]))));
        group.store->set("done/" + std::to_string(rank), bytes("1"));
        if (rank == 0) {
          std::vector<std::string> done;
          for (int r = 0; r < world_size; ++r) done.push_back("done/" + std::to_string(r));
          group.store->wait(done, 20s);
        }
        report << "ok " << group.rank << " " << group.world_size << (group.server ? " server" : "");
        return 0;
      } catch (const tandem::Error& e) {
        report << tandem::error_code_name(e.code()) << ": " << e.what();
        return 1;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "store_test child %s: %s\n", role.c_str(), e.what());
    return 3;
  }
  std::fprintf(stderr, "store_test child: unknown role or arguments: %s\n", role.c_str());
  return 2;
}

// ---- In-memory and prefix stores ---------------------------------------------------------------

// What every store must do; run on the in-memory store, a prefix store and a TCP client.
void check_store_basics(Store& store) {
  CHECK_FALSE(store.check("a"));
  store.set("a", bytes("alpha"));
  CHECK(store.check("a"));
  CHECK(text(store.get("a", 1s)) == "alpha");
  store.set("a", bytes("again"));  // last write wins
  CHECK(text(store.get("a", 0ms)) == "again");
  const std::vector<char> binary = {'\0', '\x01', '\xff', '\0'};
  store.set("binary", binary);
  CHECK(store.get("binary", 1s) == binary);
  store.set("empty", {});
  CHECK(store.check("empty"));
  CHECK(store.get("empty", 1s).empty());
  CHECK(store.add("counter", 2) == 2);
  CHECK(store.add("counter", -5) == -3);
  CHECK(text(store.get("counter", 1s)) == "-3");
  store.wait({"a", "counter"}, 1s);
  store.wait({}, 0ms);
  CHECK(thrown<tandem::InvalidArgument>([&] { store.add("a", 1); }).find("a\")") != std::string::npos);
}

void check_store_timeouts(Store& store) {
  const auto start = Clock::now();
  const std::string get_error = thrown<tandem::DeadlineExceeded>([&] { store.get("never", 150ms); });
  CHECK(Clock::now() - start >= 150ms);
  CHECK_MESSAGE(contains(get_error, "never\")"), get_error);  // a prefix store names "<prefix>never"
  CHECK_MESSAGE(contains(get_error, "150 ms"), get_error);
  CHECK_MESSAGE(contains(get_error, store.address()), get_error);

  store.set("present", bytes("1"));
  const std::string wait_error = thrown<tandem::DeadlineExceeded>([&] {
    store.wait({"present", "missing_1", "missing_2"}, 100ms);
  });
  CHECK_MESSAGE(contains(wait_error, "missing_1\", \""), wait_error);
  CHECK_MESSAGE(contains(wait_error, "missing_2\""), wait_error);
  CHECK_MESSAGE(!contains(wait_error, "present\""), wait_error);
}

void check_get_waits_for_later_set(Store& reader, Store& writer) {
  std::thread late([&] {
    std::this_thread::sleep_for(100ms);
    writer.set("late", bytes("here"));
  });
  const auto start = Clock::now();
  CHECK(text(reader.get("late", 10s)) == "here");
  CHECK(Clock::now() - start < 5s);
  late.join();
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    writer.set("w1", bytes("1"));
    writer.add("w2", 1);
  });
  reader.wait({"w1", "w2"}, 10s);
  later.join();
}

void check_add_is_atomic(const std::vector<std::shared_ptr<Store>>& clients, int adds_each) {
  std::vector<std::vector<std::int64_t>> seen(clients.size());
  std::vector<std::thread> threads;
  for (std::size_t c = 0; c < clients.size(); ++c) {
    threads.emplace_back([&, c] {
      for (int i = 0; i < adds_each; ++i) seen[c].push_back(clients[c]->add("shared", 1));
    });
  }
  for (auto& t : threads) t.join();
  std::vector<std::int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  const auto total = static_cast<std::int64_t>(clients.size()) * adds_each;
  REQUIRE(all.size() == static_cast<std::size_t>(total));
  bool each_value_once = true;
  for (std::int64_t i = 0; i < total; ++i)
    each_value_once = each_value_once && all[static_cast<std::size_t>(i)] == i + 1;
  CHECK(each_value_once);
  CHECK(text(clients[0]->get("shared", 1s)) == std::to_string(total));
}

TEST_CASE("in-memory store: set, get, check, add, wait") {
  auto store = make_in_memory_store();
  CHECK(store->address() == "in-memory");
  check_store_basics(*store);
  check_store_timeouts(*store);
  check_get_waits_for_later_set(*store, *store);
  check_add_is_atomic({store, store, store, store}, 1000);
}

TEST_CASE("prefix store: keys live under the prefix") {
  auto inner = make_in_memory_store();
  auto gloo = make_prefix_store(inner, "gloo/");
  auto nccl = make_prefix_store(inner, "nccl/");
  check_store_basics(*gloo);
  CHECK(inner->check("gloo/a"));
  CHECK_FALSE(inner->check("a"));
  CHECK_FALSE(nccl->check("a"));
  nccl->set("a", bytes("n"));
  CHECK(text(gloo->get("a", 0ms)) == "again");
  CHECK(text(nccl->get("a", 0ms)) == "n");
  CHECK(gloo->address() == "in-memory");
  // Messages name the key as the server holds it.
  const std::string error = thrown<tandem::DeadlineExceeded>([&] { nccl->wait({"x"}, 10ms); });
  CHECK_MESSAGE(contains(error, "\"nccl/x\""), error);
  check_store_timeouts(*nccl);
  CHECK(thrown<tandem::InvalidArgument>([] { make_prefix_store(nullptr, "p/"); }) != "<no error>");
}

// ---- TCP store ---------------------------------------------------------------------------------

TcpStoreOptions quick(std::chrono::milliseconds connect_timeout = 5s) {
  TcpStoreOptions options;
  options.connect_timeout = connect_timeout;
  options.retry_interval = 20ms;
  return options;
}

TEST_CASE("tcp store wire format: fields round-trip; a truncated, padded or unknown reply is refused") {
  using namespace tandem::collective::detail::wire;
  // A frame's length covers what follows it.
  const std::vector<char> frame = Writer(Status::kError).u8(kInvalidArgument).str("bad key").finish();
  REQUIRE(frame.size() > 4);
  CHECK(read_u32(frame.data()) == frame.size() - 4);
  const std::vector<char> payload(frame.begin() + 4, frame.end());
  Reply reply;
  REQUIRE(parse_reply(payload, reply));
  CHECK(reply.status == Status::kError);
  CHECK(reply.error_code == kInvalidArgument);
  CHECK(reply.error == "bad key");

  const auto payload_of = [](Writer w) {
    std::vector<char> f = w.finish();
    return std::vector<char>(f.begin() + 4, f.end());
  };
  REQUIRE(parse_reply(payload_of(std::move(Writer(Status::kInt).i64(-3))), reply));
  CHECK(reply.number == -3);
  REQUIRE(parse_reply(payload_of(std::move(Writer(Status::kValue).bytes(bytes(std::string("a\0b", 3))))), reply));
  CHECK(reply.value == bytes(std::string("a\0b", 3)));
  // Requests read back field by field.
  const std::vector<char> wait = payload_of(std::move(Writer(Op::kWait).u32(2).str("a").str("bc")));
  Reader r(wait.data(), wait.size());
  std::uint8_t op = 0;
  std::uint32_t count = 0;
  std::string first, second;
  CHECK((r.u8(op) && r.u32(count) && r.str(first) && r.str(second) && r.at_end()));
  CHECK(op == static_cast<std::uint8_t>(Op::kWait));
  CHECK(count == 2);
  CHECK(first == "a");
  CHECK(second == "bc");

  std::vector<char> truncated = payload;
  truncated.pop_back();
  CHECK_FALSE(parse_reply(truncated, reply));
  std::vector<char> padded = payload;
  padded.push_back('x');
  CHECK_FALSE(parse_reply(padded, reply));
  CHECK_FALSE(parse_reply({static_cast<char>(99)}, reply));
  CHECK_FALSE(parse_reply({}, reply));
}

TEST_CASE("tcp store wire format: requests parse field by field; malformed ones say how") {
  using namespace tandem::collective::detail::wire;
  const auto payload_of = [](Writer w) {
    std::vector<char> f = w.finish();
    return std::vector<char>(f.begin() + 4, f.end());
  };
  const auto parse = [](const std::vector<char>& payload, Request& request) {
    std::string error;
    const bool ok = parse_request(payload.data(), payload.size(), request, error);
    return ok ? std::string("ok") : error;
  };
  // The fields are views into the payload: each payload outlives the checks of its fields.
  Request q;
  const auto set = payload_of(std::move(Writer(Op::kSet).str("key").bytes(bytes(std::string("v\0", 2)))));
  REQUIRE(parse(set, q) == "ok");
  CHECK(q.op == Op::kSet);
  CHECK(q.key == "key");
  CHECK(q.value == std::string_view("v\0", 2));
  const auto hello = payload_of(std::move(Writer(Op::kHello).i64(3).str("run/1/")));
  REQUIRE(parse(hello, q) == "ok");
  CHECK(q.rank == 3);
  CHECK(q.prefix == "run/1/");
  const auto wait = payload_of(std::move(Writer(Op::kWait).u32(2).str("a").str("bc")));
  REQUIRE(parse(wait, q) == "ok");
  CHECK(q.keys == std::vector<std::string_view>{"a", "bc"});
  const auto auth = payload_of(std::move(Writer(Op::kAuth).str("nonce").str("")));
  REQUIRE(parse(auth, q) == "ok");
  CHECK(q.nonce == "nonce");
  CHECK(q.proof.empty());

  CHECK(parse({}, q) == "empty frame");
  CHECK(parse({static_cast<char>(99)}, q) == "unknown request 99");
  CHECK(parse(payload_of(std::move(Writer(Op::kGet).str("k").u8(0))), q) == "malformed GET");  // padded
  CHECK(parse(payload_of(std::move(Writer(Op::kHello).i64(-1).str(""))), q) == "malformed HELLO");
  CHECK(parse(payload_of(std::move(Writer(Op::kHello).i64(0).str(std::string(kMaxPrefixBytes + 1, 'p')))), q) ==
        "malformed HELLO");
  // A count the frame cannot hold is refused before anything is allocated for it.
  CHECK(parse(payload_of(std::move(Writer(Op::kWait).u32(kMaxWaitKeys))), q) == "malformed WAIT");
  CHECK(parse(payload_of(std::move(Writer(Op::kWait).u32(kMaxWaitKeys + 1))), q) == "malformed WAIT");

  // Frames in a byte stream: complete, still arriving, or declaring too much.
  const std::vector<char> frame = Writer(Op::kCheck).str("k").finish();
  CHECK(scan_frame(frame.data(), 2, 100).kind == FrameScan::kIncomplete);
  CHECK(scan_frame(frame.data(), 2, 100).missing == 2);
  CHECK(scan_frame(frame.data(), frame.size() - 1, 100).missing == 1);
  CHECK(scan_frame(frame.data(), frame.size(), 100).kind == FrameScan::kComplete);
  CHECK(scan_frame(frame.data(), frame.size(), 5).kind == FrameScan::kTooLarge);
}

TEST_CASE("tcp store keys: who may write a key") {
  using namespace tandem::collective::detail::wire;
  const auto owner = [](std::string_view key) {
    const KeyOwner o = key_owner(key);
    switch (o.kind) {
      case KeyOwner::kAnyone: return std::string("anyone");
      case KeyOwner::kRank: return "rank " + std::to_string(o.rank);
      case KeyOwner::kServer: return "server " + std::to_string(o.rank);
      case KeyOwner::kConflict: return std::string("nobody");
    }
    return std::string("?");
  };
  CHECK(owner("run/0/rendezvous/rank/1") == "rank 1");
  CHECK(owner("run/0/rendezvous/rank/1/claims") == "rank 1");
  CHECK(owner("rank/0") == "rank 0");
  CHECK(owner("run/0/tandem/lost/3") == "server 3");
  CHECK(owner("tandem/lost/3") == "server 3");
  CHECK(owner("rank/1/x/rank/1") == "rank 1");
  CHECK(owner("rank/1/rank/2") == "nobody");
  for (const char* anyone : {"k", "", "rank", "rank/", "rank/x", "rank/01", "rank/-1", "rank/+1", "ranks/1",
                             "my_rank/1", "rank/99999999999", "tandem/lost/x", "tandem/lost/1/more"}) {
    CHECK_MESSAGE(owner(anyone) == "anyone", anyone);
  }
}

TEST_CASE("tcp store handshake: proofs depend on the side, both nonces and the secret") {
  namespace auth = tandem::collective::detail::auth;
  const std::string ns(auth::kNonceBytes, 's');
  const std::string nc(auth::kNonceBytes, 'c');
  const std::string client = auth::proof(auth::Side::kClient, "secret", ns, nc);
  CHECK(client.size() == auth::kProofBytes);
  CHECK(auth::proofs_equal(client, auth::proof(auth::Side::kClient, "secret", ns, nc)));
  CHECK_FALSE(auth::proofs_equal(client, auth::proof(auth::Side::kServer, "secret", ns, nc)));
  CHECK_FALSE(auth::proofs_equal(client, auth::proof(auth::Side::kClient, "secret!", ns, nc)));
  CHECK_FALSE(auth::proofs_equal(client, auth::proof(auth::Side::kClient, "secret", nc, ns)));
  CHECK_FALSE(auth::proofs_equal(client, auth::proof(auth::Side::kClient, "secret", ns, nc + "x")));
  CHECK_FALSE(auth::proofs_equal(client, client.substr(1)));
  CHECK_FALSE(auth::proofs_equal("", ""));
  // Nonces do not repeat.
  CHECK(auth::random_bytes(auth::kNonceBytes) != auth::random_bytes(auth::kNonceBytes));
}

TEST_CASE("tcp store: the Store contract over TCP") {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  CHECK(server->port() > 0);
  CHECK(server->address() == local(server->port()));
  auto client = connect_tcp_store(server->address(), quick());
  auto other = connect_tcp_store(server->address(), quick());
  CHECK(client->address() == server->address());
  check_store_basics(*client);
  CHECK(text(other->get("a", 1s)) == "again");  // one server, many clients
  check_store_timeouts(*client);
  check_get_waits_for_later_set(*client, *other);

  // Values of any size cross intact.
  std::vector<char> big(3 << 20);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7 + i / 251);
  client->set("big", big);
  CHECK(other->get("big", 5s) == big);
}

TEST_CASE("tcp store: a waiting get does not block the client's other threads") {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  auto client = connect_tcp_store(server->address(), quick());
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    CHECK(text(client->get("later", 10s)) == "value");
    got = true;
  });
  std::this_thread::sleep_for(50ms);
  // Same client, other thread, while the get is parked on the server.
  const auto start = Clock::now();
  client->set("x", bytes("1"));
  CHECK(client->check("x"));
  CHECK(client->add("n", 1) == 1);
  CHECK(Clock::now() - start < 2s);
  CHECK_FALSE(got.load());
  client->set("later", bytes("value"));
  waiter.join();
  CHECK(got.load());
}

TEST_CASE("tcp store: a timed-out get leaves its connection usable") {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  auto client = connect_tcp_store(server->address(), quick());
  // Many timeouts on the pooled connection(s), then the key they waited for arrives: later
  // requests must read their own replies, not stale ones.
  for (int i = 0; i < 5; ++i) {
    CHECK(thrown<tandem::DeadlineExceeded>([&] { client->get("k", 20ms); }) != "<no error>");
    CHECK(thrown<tandem::DeadlineExceeded>([&] { client->wait({"k", "j"}, 20ms); }) != "<no error>");
  }
  client->set("k", bytes("K"));
  client->set("other", bytes("O"));
  CHECK(text(client->get("other", 1s)) == "O");
  CHECK(text(client->get("k", 1s)) == "K");
  CHECK(client->add("c", 5) == 5);
  CHECK_FALSE(client->check("j"));
}

TEST_CASE("tcp store: add is atomic across clients") {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  std::vector<std::shared_ptr<Store>> clients;
  for (int c = 0; c < 4; ++c) clients.push_back(connect_tcp_store(server->address(), quick()));
  check_add_is_atomic(clients, 1000);
}

TEST_CASE("tcp store: a client started before the server connects once it appears") {
  const int port = free_port();
  std::shared_ptr<Store> client;
  std::string error;
  std::thread connecting([&] {
    try {
      client = connect_tcp_store(local(port), quick(10s));
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(300ms);
  auto server = TcpStoreServer::start("127.0.0.1", port);
  connecting.join();
  REQUIRE_MESSAGE(client != nullptr, error);
  client->set("hello", bytes("world"));
  CHECK(text(client->get("hello", 1s)) == "world");
}

TEST_CASE("tcp store: connecting times out naming the address, the owner and the socket error") {
  const int port = free_port();
  TcpStoreOptions options = quick(300ms);
  options.label_of_server = "chief";
  const auto start = Clock::now();
  const std::string error = thrown<tandem::DeadlineExceeded>([&] { connect_tcp_store(local(port), options); });
  CHECK(Clock::now() - start < 3s);
  CHECK_MESSAGE(contains(error, local(port)), error);
  CHECK_MESSAGE(contains(error, "chief"), error);
  CHECK_MESSAGE(contains(error, "connection refused"), error);
  CHECK_MESSAGE(contains(error, "300 ms"), error);
}

TEST_CASE("tcp store: a client of a destroyed server throws Unavailable") {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  const std::string address = server->address();
  TcpStoreOptions options = quick();
  options.label_of_server = "chief";
  auto client = connect_tcp_store(address, options);
  client->set("a", bytes("1"));
  std::string waiting_error;
  std::thread waiter([&] { waiting_error = thrown<tandem::Unavailable>([&] { client->get("never", 20s); }); });
  std::this_thread::sleep_for(100ms);
  const auto start = Clock::now();
  server.reset();
  waiter.join();
  CHECK(Clock::now() - start < 5s);  // promptly, not at the get's timeout
  CHECK_MESSAGE(contains(waiting_error, address), waiting_error);
  CHECK_MESSAGE(contains(waiting_error, "chief"), waiting_error);
  // The idle pooled connection is broken, and new ones are refused: both are Unavailable.
  for (int i = 0; i < 3; ++i) {
    const std::string error = thrown<tandem::Unavailable>([&] { client->set("b", bytes("2")); });
    CHECK_MESSAGE(contains(error, address), error);
  }
}

TEST_CASE("tcp store: bad addresses and taken ports") {
  for (const char* address : {"localhost", "host:abc", "host:70000", ":80", "::1:80", "[::1", "host:"}) {
    const std::string error = thrown<tandem::InvalidArgument>([&] { connect_tcp_store(address, quick(100ms)); });
    CHECK_MESSAGE(contains(error, address), error);
  }
  CHECK(parse_host_port("[::1]:2222").host == "::1");
  CHECK(parse_host_port("[::1]:2222").port == 2222);
  CHECK(parse_host_port("worker-1.example:80").host == "worker-1.example");

  auto server = TcpStoreServer::start("127.0.0.1", 0);
  const std::string error = thrown<tandem::AlreadyExists>([&] { TcpStoreServer::start("127.0.0.1", server->port()); });
  CHECK_MESSAGE(contains(error, local(server->port())), error);
  CHECK(thrown<tandem::InvalidArgument>([] { TcpStoreServer::start("127.0.0.1", 70000); }) != "<no error>");
}

TEST_CASE("tcp store: one live client per announced rank") {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  TcpStoreOptions options = quick();
  options.rank = 3;
  auto first = connect_tcp_store(server->address(), options);
  const std::string error = thrown<tandem::InvalidArgument>([&] { connect_tcp_store(server->address(), options); });
  CHECK_MESSAGE(contains(error, "rank 3"), error);
  options.lost_key_prefix = "run/2/";  // another run's rank 3 is another rank
  auto other_run = connect_tcp_store(server->address(), options);
  first.reset();  // goodbye: the rank is free again, and nobody is reported lost
  options.lost_key_prefix = "";
  auto again = connect_tcp_store(server->address(), options);
  CHECK_FALSE(again->check(lost_rank_key(3)));
}

TEST_CASE("tcp store: a killed client process is reported lost; a clean exit is not") {
  auto server = TcpStoreServer::start("127.0.0.1", 0);
  auto observer = connect_tcp_store(server->address(), quick());

  Child killed({"hold", server->address(), "5", "run/7/"});
  REQUIRE(text(observer->get("run/7/held/5", 20s)) == "1");
  CHECK_FALSE(observer->check("run/7/" + lost_rank_key(5)));
  killed.kill_hard();
  CHECK(killed.wait(10s) == -SIGKILL);
  const std::string reason = text(observer->get("run/7/" + lost_rank_key(5), 5s));
  CHECK_MESSAGE(contains(reason, "without goodbye"), reason);
  CHECK(lost_rank_key(5) == "tandem/lost/5");

  Child clean({"exit", server->address(), "6"});
  CHECK(clean.wait(20s) == 0);
  CHECK(observer->check("exited/6"));
  const std::string error = thrown<tandem::DeadlineExceeded>([&] { observer->get(lost_rank_key(6), 300ms); });
  CHECK_MESSAGE(contains(error, "tandem/lost/6"), error);
}

// ---- Rendezvous --------------------------------------------------------------------------------

TEST_CASE("rendezvous: bad options are InvalidArgument") {
  const auto error_of = [](RendezvousOptions options) {
    return thrown<tandem::InvalidArgument>([&] { rendezvous(options); });
  };
  RendezvousOptions options = cluster_options(29500, 0, 2, 100ms);
  options.rank = 2;
  CHECK_MESSAGE(contains(error_of(options), "rank 2 is not in 0..1"), error_of(options));
  options.rank = -1;
  CHECK(contains(error_of(options), "rank -1"));
  options = cluster_options(29500, 0, 2, 100ms);
  options.world_size = 0;
  options.task_labels.clear();
  options.task_addresses.clear();
  CHECK(contains(error_of(options), "world_size is 0"));
  options = cluster_options(29500, 1, 2, 100ms);
  options.address = "no-port";
  CHECK(contains(error_of(options), "no-port"));
  options = cluster_options(29500, 1, 3, 100ms);
  options.task_labels.pop_back();
  CHECK(contains(error_of(options), "2 task labels for world_size 3"));
  options = cluster_options(29500, 1, 2, 100ms);
  options.run_id = "";
  CHECK(contains(error_of(options), "run id"));
  options = cluster_options(0, 1, 2, 100ms);
  CHECK(contains(error_of(options), "port 0"));
}

TEST_CASE("rendezvous: one rank alone") {
  RendezvousOptions options;
  options.address = "127.0.0.1:0";
  options.timeout = 5s;
  Rendezvous group = rendezvous(options);
  REQUIRE(group.server != nullptr);
  CHECK(group.world_size == 1);
  group.store->set("x", bytes("1"));
  CHECK(group.store->check("x"));
}

TEST_CASE("rendezvous: three processes meet") {
  ScratchDir dir;
  const int port = free_port();
  std::vector<std::unique_ptr<Child>> ranks;
  // Workers first: they wait for the chief's store to appear.
  for (const int r : {2, 1, 0}) {
    ranks.push_back(std::make_unique<Child>(std::vector<std::string>{
        "rendezvous", std::to_string(port), std::to_string(r), "3", "20000", dir.file("rank" + std::to_string(r))}));
  }
  for (auto& child : ranks) CHECK(child->wait(30s) == 0);
  CHECK(read_file(dir.file("rank0")) == "ok 0 3 server");
  CHECK(read_file(dir.file("rank1")) == "ok 1 3");
  CHECK(read_file(dir.file("rank2")) == "ok 2 3");
}

TEST_CASE("rendezvous: a missing rank is named with its expected address") {
  ScratchDir dir;
  const int port = free_port();
  Child chief({"rendezvous", std::to_string(port), "0", "3", "2000", dir.file("rank0")});
  Child worker({"rendezvous", std::to_string(port), "1", "3", "2000", dir.file("rank1")});
  const auto start = Clock::now();
  CHECK(chief.wait(15s) == 1);
  CHECK(worker.wait(15s) == 1);
  CHECK(Clock::now() - start < 10s);
  const std::string expected = "DeadlineExceeded: rendezvous at " + local(port) +
                               ": 1 of 3 workers did not arrive within 2 s: worker 2 (expected at " + local(port + 2) +
                               ")";
  CHECK(read_file(dir.file("rank0")) == expected);
  // The worker times out too, or (when the chief gave up a moment earlier) loses the chief's store
  // and looks for it again until its own deadline.
  const std::string worker_report = read_file(dir.file("rank1"));
  CHECK_MESSAGE(
      (worker_report == expected || worker_report.starts_with("DeadlineExceeded: rendezvous at " + local(port))),
      worker_report);
}

TEST_CASE("rendezvous: a rank that cannot reach the chief names it") {
  const int port = free_port();
  RendezvousOptions options = cluster_options(port, 1, 2, 500ms);
  const std::string error = thrown<tandem::DeadlineExceeded>([&] { rendezvous(options); });
  CHECK_MESSAGE(contains(error, "chief (expected at " + local(port) + ")"), error);
  CHECK_MESSAGE(contains(error, "connection refused"), error);
}

TEST_CASE("rendezvous: two live processes claiming one rank") {
  ScratchDir dir;
  const int port = free_port();
  Child chief({"rendezvous", std::to_string(port), "0", "3", "20000", dir.file("rank0")});
  Child worker({"rendezvous", std::to_string(port), "1", "3", "20000", dir.file("rank1")});
  // Watch the store until both have arrived, then start a second rank 1.
  auto observer = connect_tcp_store(local(port), quick(10s));
  observer->wait({"run/0/rendezvous/rank/0", "run/0/rendezvous/rank/1"}, 15s);
  Child duplicate({"rendezvous", std::to_string(port), "1", "3", "20000", dir.file("duplicate")});
  CHECK(duplicate.wait(15s) == 1);
  const std::string report = read_file(dir.file("duplicate"));
  CHECK_MESSAGE(report.starts_with("InvalidArgument: "), report);
  CHECK_MESSAGE(contains(report, "rank 1"), report);
  // The group is not disturbed: rank 2 arrives and all three meet.
  Child last({"rendezvous", std::to_string(port), "2", "3", "20000", dir.file("rank2")});
  CHECK(last.wait(20s) == 0);
  CHECK(worker.wait(20s) == 0);
  CHECK(chief.wait(20s) == 0);
  CHECK(read_file(dir.file("rank0")) == "ok 0 3 server");
  CHECK(read_file(dir.file("rank1")) == "ok 1 3");
}

TEST_CASE("rendezvous: a restarted rank that meets a previous run's store looks again instead of failing") {
  // A rank whose earlier process claimed its index and died there (the store's lost key says so)
  // has met a store its chief has not given up yet: not a duplicate, but a store to leave.
  ScratchDir dir;
  const int port = free_port();
  Child chief({"rendezvous", std::to_string(port), "0", "3", "20000", dir.file("rank0")});
  Child first({"rendezvous", std::to_string(port), "1", "3", "20000", dir.file("first")});
  auto observer = connect_tcp_store(local(port), quick(10s));
  observer->wait({"run/0/rendezvous/rank/1"}, 15s);
  first.kill_hard();
  CHECK(first.wait(10s) == -SIGKILL);
  observer->wait({"run/0/" + lost_rank_key(1)}, 10s);
  Child restarted({"rendezvous", std::to_string(port), "1", "3", "2000", dir.file("restarted")});
  CHECK(restarted.wait(15s) == 1);
  const std::string report = read_file(dir.file("restarted"));
  CHECK_MESSAGE(report.starts_with("DeadlineExceeded: "), report);
  CHECK_MESSAGE(contains(report, "found no usable store within 2 s"), report);
  CHECK_MESSAGE(contains(report, "the store belongs to an earlier run: rank 1 was claimed there by pid "), report);
  chief.kill_hard();
}

// Threads of one process are enough when the processes' deaths are not the point.
TEST_CASE("rendezvous: a rank claimed again in the same run, and mismatched world sizes") {
  const int port = free_port();
  Rendezvous chief;
  std::thread chief_thread([&] { chief = rendezvous(cluster_options(port, 0, 2, 10s)); });
  {
    Rendezvous worker = rendezvous(cluster_options(port, 1, 2, 10s));
    CHECK(worker.rank == 1);
    CHECK(worker.server == nullptr);
  }  // worker 1 said goodbye
  chief_thread.join();
  REQUIRE(chief.server != nullptr);
  CHECK_FALSE(chief.store->check(lost_rank_key(1)));
  const std::string error = thrown<tandem::InvalidArgument>([&] { rendezvous(cluster_options(port, 1, 2, 2s)); });
  CHECK_MESSAGE(contains(error, "rank 1 (worker 1) was claimed twice in run \"0\""), error);

  // A later run (the launcher restarted the job) on the same server has its own keys.
  RendezvousOptions restarted = cluster_options(port, 1, 2, 500ms);
  restarted.run_id = "1";
  std::string restarted_error = thrown<tandem::DeadlineExceeded>([&] { rendezvous(restarted); });
  CHECK_MESSAGE(contains(restarted_error, "1 of 2 workers did not arrive within 500 ms: chief"), restarted_error);

  // A worker told world_size 2 by a chief that was told 3.
  chief = Rendezvous();
  const int port2 = free_port();
  // Both sides learn it as soon as they meet, not at the deadline, and name both sizes.
  std::string chief_error;
  const auto start = std::chrono::steady_clock::now();
  std::thread chief3(
      [&] { chief_error = thrown<tandem::InvalidArgument>([&] { rendezvous(cluster_options(port2, 0, 3, 10s)); }); });
  std::this_thread::sleep_for(100ms);
  const std::string mismatch = thrown<tandem::InvalidArgument>([&] { rendezvous(cluster_options(port2, 1, 2, 10s)); });
  chief3.join();
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  CHECK_MESSAGE(contains(mismatch, "world_size 2, but chief with world_size 3"), mismatch);
  CHECK_MESSAGE(contains(chief_error, "was started with world_size 3, but rank 1 (worker 1) arrived with world_size 2"),
                chief_error);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string_view(argv[1]) == kChildFlag) return child_main(argc, argv);
  doctest::Context context(argc, argv);
  return context.run();
}
