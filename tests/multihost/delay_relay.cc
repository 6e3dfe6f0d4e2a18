// delay_relay — the multi-host tests' stand-in for netem (the kernel here has none): it moves IP
// packets between two TUN devices, each in its own network namespace, holding every packet for a
// fixed one-way delay and dropping a chosen fraction, so that two namespaces talk as two machines
// on a slow link.
//
//   delay_relay --netns-a /run/netns/A --netns-b /run/netns/B [--dev tun0] [--delay-ms 50] [--loss 0.01]
//
// The TUN devices must exist already, persistent and without packet information (as
// `ip -n A tuntap add dev tun0 mode tun` makes them); the relay attaches to them, prints "ready"
// on stdout, and relays until SIGTERM or SIGINT, then prints what it moved and dropped.
// SIGUSR1 toggles a partition: while it is on, every packet is dropped (both directions).
// Needs CAP_SYS_ADMIN (setns) and CAP_NET_ADMIN (TUNSETIFF): the tests run it as root.
//
// One thread, one ppoll() loop over the two devices; the signals are unblocked only inside
// ppoll, so a signal never interrupts anything else. Packets wait in one FIFO per direction
// (a fixed delay keeps them in order), bounded by --max-queue packets: beyond it they are dropped
// as a full router queue would.
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t kMaxPacketBytes = 65536;  // TUN's largest frame

volatile std::sig_atomic_t g_stop = 0;
volatile std::sig_atomic_t g_toggle_partition = 0;

extern "C" void on_stop(int) { g_stop = 1; }
extern "C" void on_toggle(int) { g_toggle_partition = 1; }

struct Options {
  std::string netns_a, netns_b;  // the two namespaces' files
  std::string dev = "tun0";
  double delay_ms = 0;
  double loss = 0;
  std::size_t max_queue = 100000;
  unsigned seed = 1;
};

std::runtime_error system_error(const std::string& what) {
  return std::runtime_error(fmt::format("{}: {}", what, std::strerror(errno)));
}

// Enters the namespace at `netns_path` and attaches to its TUN device `dev`; the descriptor
// stays bound to that namespace when the thread moves on to the next one.
int attach(const std::string& netns_path, const std::string& dev) {
  const int ns = ::open(netns_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (ns < 0) throw system_error(fmt::format("cannot open network namespace {}", netns_path));
  const int entered = ::setns(ns, CLONE_NEWNET);
  ::close(ns);
  if (entered != 0) throw system_error(fmt::format("cannot enter network namespace {}", netns_path));
  const int fd = ::open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw system_error("cannot open /dev/net/tun");
  ifreq request{};
  request.ifr_flags = IFF_TUN | IFF_NO_PI;
  if (dev.size() >= sizeof request.ifr_name) throw std::runtime_error(fmt::format("device name '{}' is too long", dev));
  std::memcpy(request.ifr_name, dev.data(), dev.size());
  if (::ioctl(fd, TUNSETIFF, &request) != 0) {
    throw system_error(fmt::format("cannot attach to TUN device {} in {}", dev, netns_path));
  }
  return fd;
}

struct Packet {
  Clock::time_point due;
  std::vector<char> bytes;
};

// One direction of the link: packets read from `from` wait in `queue` until due, then go to `to`.
struct Direction {
  int from = -1;
  int to = -1;
  std::deque<Packet> queue;
  std::uint64_t moved = 0, lost = 0, partitioned = 0, overflowed = 0;
};

class Relay {
 public:
  Relay(const Options& options, int a, int b)
      : delay_(
            std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(options.delay_ms))),
        loss_(options.loss),
        max_queue_(options.max_queue),
        random_(options.seed) {
    directions_[0].from = a, directions_[0].to = b;
    directions_[1].from = b, directions_[1].to = a;
  }

  void run(const sigset_t& unblocked) {
    while (!g_stop) {
      if (g_toggle_partition) {
        g_toggle_partition = 0;
        partition_ = !partition_;
        std::fprintf(stderr, "delay_relay: partition %s\n", partition_ ? "on" : "off");
      }
      pollfd fds[2] = {{directions_[0].from, POLLIN, 0}, {directions_[1].from, POLLIN, 0}};
      timespec wait{};
      const timespec* timeout = next_wait(wait);
      const int ready = ::ppoll(fds, 2, timeout, &unblocked);
      if (ready < 0 && errno != EINTR) throw system_error("ppoll");
      for (int d = 0; d < 2 && ready > 0; ++d) {
        if (fds[d].revents & (POLLERR | POLLHUP | POLLNVAL)) {
          throw std::runtime_error("a TUN device went away (its namespace was deleted?)");
        }
        if (fds[d].revents & POLLIN) receive(directions_[d]);
      }
      for (Direction& d : directions_) send_due(d);
    }
  }

  void report() const {
    for (int d = 0; d < 2; ++d) {
      const Direction& dir = directions_[d];
      std::printf(
          "delay_relay: %s: %llu packets moved, %llu lost at random, %llu dropped by the partition, %llu "
          "dropped on a full queue\n",
          d == 0 ? "first -> second" : "second -> first", static_cast<unsigned long long>(dir.moved),
          static_cast<unsigned long long>(dir.lost), static_cast<unsigned long long>(dir.partitioned),
          static_cast<unsigned long long>(dir.overflowed));
    }
    std::fflush(stdout);
  }

 private:
  // How long ppoll may sleep: until the earliest queued packet is due, or indefinitely.
  const timespec* next_wait(timespec& wait) const {
    std::optional<Clock::time_point> earliest;
    for (const Direction& d : directions_) {
      if (!d.queue.empty() && (!earliest || d.queue.front().due < *earliest)) earliest = d.queue.front().due;
    }
    if (!earliest) return nullptr;
    const auto left = std::max(Clock::duration::zero(), *earliest - Clock::now());
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    wait.tv_sec = static_cast<time_t>(ns / 1000000000);
    wait.tv_nsec = static_cast<long>(ns % 1000000000);
    return &wait;
  }

  // Reads every packet that is there (the descriptor is non-blocking).
  void receive(Direction& d) {
    for (;;) {
      const ssize_t n = ::read(d.from, buffer_.data(), buffer_.size());
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN) return;
        throw system_error("read from a TUN device");
      }
      if (partition_) {
        ++d.partitioned;
      } else if (loss_ > 0 && std::uniform_real_distribution<double>(0, 1)(random_) < loss_) {
        ++d.lost;
      } else if (d.queue.size() >= max_queue_) {
        ++d.overflowed;
      } else {
        d.queue.push_back({Clock::now() + delay_, std::vector<char>(buffer_.begin(), buffer_.begin() + n)});
      }
    }
  }

  void send_due(Direction& d) {
    const auto now = Clock::now();
    while (!d.queue.empty() && d.queue.front().due <= now) {
      const Packet& p = d.queue.front();
      // A packet the other side cannot take now (EAGAIN, or its device is down) is lost, as on a wire.
      if (::write(d.to, p.bytes.data(), p.bytes.size()) == static_cast<ssize_t>(p.bytes.size())) ++d.moved;
      d.queue.pop_front();
    }
  }

  Clock::duration delay_;
  double loss_;
  std::size_t max_queue_;
  std::mt19937_64 random_;
  bool partition_ = false;
  std::vector<char> buffer_ = std::vector<char>(kMaxPacketBytes);
  Direction directions_[2];
};

int run(const Options& options) {
  // Blocked except inside ppoll (see the top of the file).
  sigset_t handled, unblocked;
  sigemptyset(&handled);
  for (const int sig : {SIGTERM, SIGINT, SIGUSR1}) sigaddset(&handled, sig);
  ::sigprocmask(SIG_BLOCK, &handled, &unblocked);
  struct sigaction stop {
  }, toggle{};
  stop.sa_handler = on_stop;
  toggle.sa_handler = on_toggle;
  ::sigaction(SIGTERM, &stop, nullptr);
  ::sigaction(SIGINT, &stop, nullptr);
  ::sigaction(SIGUSR1, &toggle, nullptr);
  for (const int sig : {SIGTERM, SIGINT, SIGUSR1}) sigdelset(&unblocked, sig);

  const int a = attach(options.netns_a, options.dev);
  const int b = attach(options.netns_b, options.dev);
  Relay relay(options, a, b);
  std::printf("ready\n");
  std::fflush(stdout);
  relay.run(unblocked);
  relay.report();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app("delay_relay: moves packets between TUN devices in two network namespaces, with a delay");
  app.add_option("--netns-a", options.netns_a, "the first network namespace's file (/run/netns/NAME)")->required();
  app.add_option("--netns-b", options.netns_b, "the second network namespace's file")->required();
  app.add_option("--dev", options.dev, "the TUN device's name in both namespaces");
  app.add_option("--delay-ms", options.delay_ms, "one-way delay in milliseconds")->check(CLI::Range(0.0, 60000.0));
  app.add_option("--loss", options.loss, "fraction of packets dropped at random")->check(CLI::Range(0.0, 1.0));
  app.add_option("--max-queue", options.max_queue, "packets waiting per direction before drops")
      ->check(CLI::Range(1, 10000000));
  app.add_option("--seed", options.seed, "seed of the random losses");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "delay_relay: error: %s\n", e.what());
    return 1;
  }
}
