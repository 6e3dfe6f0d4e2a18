// The wait policy: TANDEM_WAIT_POLICY's values, the adaptive gate's quiet periods (driven with
// made-up times), and poll_for under each policy. CTest runs this suite once per policy (and
// once with a bad value); TANDEM_WAIT_POLICY tells the suite which run it is.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "tandem/base/detail/spin_gate.h"
#include "tandem/base/errors.h"
#include "tandem/base/spin.h"
#include "tandem/base/wait_policy.h"

using namespace tandem;
using detail::SpinGate;

namespace {

constexpr std::int64_t kMs = 1'000'000;

std::string policy_variable() {
  const char* value = std::getenv("TANDEM_WAIT_POLICY");
  return value == nullptr ? "" : value;
}

bool bad_policy_run() {
  const std::string v = policy_variable();
  return !v.empty() && v != "adaptive" && v != "active" && v != "passive";
}

// A done() for poll_for that loses its core once, on its 100th call (the sleep stands for a time
// slice given to another thread: it is at least kPreemptionGap long, whatever the machine's load),
// and turns true on its 300th call.
struct PreemptedOnce {
  int calls = 0;
  bool operator()() {
    if (++calls == 100) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return calls >= 300;
  }
};

}  // namespace

TEST_CASE("parse_wait_policy accepts the three policies and names the variable and value otherwise") {
  CHECK(parse_wait_policy("") == WaitPolicy::kAdaptive);
  CHECK(parse_wait_policy("adaptive") == WaitPolicy::kAdaptive);
  CHECK(parse_wait_policy("active") == WaitPolicy::kActive);
  CHECK(parse_wait_policy("passive") == WaitPolicy::kPassive);
  CHECK(parse_wait_policy(" Passive ") == WaitPolicy::kPassive);  // the env table's rule: any case, trimmed
  try {
    parse_wait_policy("Passively");
    FAIL("expected InvalidArgument");
  } catch (const InvalidArgument& e) {
    const std::string message = e.what();
    CHECK(message.find("TANDEM_WAIT_POLICY") != std::string::npos);
    CHECK(message.find("\"Passively\"") != std::string::npos);
    CHECK(message.find("adaptive") != std::string::npos);
  }
}

TEST_CASE("a quiet period follows a preemption and ends when the machine has a free core") {
  SpinGate gate(SpinGate::Options{.first_quiet_ns = 10 * kMs, .longest_quiet_ns = 40 * kMs});
  int clock_reads = 0;
  int load_reads = 0;
  bool full = false;
  const auto at = [&](std::int64_t t) {
    return [&clock_reads, t] {
      ++clock_reads;
      return t;
    };
  };
  const auto load = [&] {
    ++load_reads;
    return full;
  };
  CHECK(gate.open(at(0), load));
  CHECK(clock_reads == 0);  // no quiet period yet: no clock read, no load read

  gate.preempted(100 * kMs);
  CHECK(gate.quiet_length_ns() == 10 * kMs);
  CHECK_FALSE(gate.open(at(100 * kMs), load));
  CHECK_FALSE(gate.open(at(109 * kMs), load));
  gate.preempted(105 * kMs);  // during the quiet period: the same load, nothing changes
  CHECK(gate.quiet_until_ns() == 110 * kMs);
  CHECK(load_reads == 0);  // the load is read when a period ends, not before
  CHECK(gate.open(at(110 * kMs), load));
  CHECK(load_reads == 1);
  const int reads_before = clock_reads;
  CHECK(gate.open(at(111 * kMs), load));
  CHECK(clock_reads == reads_before);  // spinning again: no clock read, no load read
  CHECK(load_reads == 1);
}

TEST_CASE("quiet periods double while the load lasts, up to the longest, and start over after a spell of spinning") {
  SpinGate gate(SpinGate::Options{.first_quiet_ns = 10 * kMs, .longest_quiet_ns = 40 * kMs});
  bool full = true;
  const auto load = [&] { return full; };
  const auto at = [](std::int64_t t) { return [t] { return t; }; };

  gate.preempted(0);
  CHECK(gate.quiet_until_ns() == 10 * kMs);
  // Every core still busy when the period ends: the next one follows at once, twice as long.
  CHECK_FALSE(gate.open(at(10 * kMs), load));
  CHECK(gate.quiet_length_ns() == 20 * kMs);
  CHECK(gate.quiet_until_ns() == 30 * kMs);
  CHECK_FALSE(gate.open(at(30 * kMs), load));
  CHECK(gate.quiet_length_ns() == 40 * kMs);
  CHECK_FALSE(gate.open(at(70 * kMs), load));
  CHECK(gate.quiet_length_ns() == 40 * kMs);  // the longest
  CHECK(gate.quiet_until_ns() == 110 * kMs);

  // A core is free: spinning resumes; a preemption within the last period's length after its end
  // means the load is still there (80 ms).
  full = false;
  CHECK(gate.open(at(110 * kMs), load));
  gate.preempted(120 * kMs);
  CHECK(gate.quiet_length_ns() == 40 * kMs);
  CHECK(gate.quiet_until_ns() == 160 * kMs);
  CHECK(gate.open(at(160 * kMs), load));

  // Spinning for longer than the last period without losing a core: the next preemption is
  // isolated and costs the first period only.
  gate.preempted(200 * kMs);
  CHECK(gate.quiet_length_ns() == 10 * kMs);
  CHECK(gate.quiet_until_ns() == 210 * kMs);
}

TEST_CASE("the machine is full when more threads than cores are runnable, some of another process") {
  // 3 runnable on 2 cores: full when one of them is not ours.
  CHECK(detail::loadavg_says_full("2.10 1.90 1.50 3/121 4567\n", 2, 2));
  CHECK(detail::loadavg_says_full("2.10 1.90 1.50 3/121 4567\n", 2, 1));
  CHECK_FALSE(detail::loadavg_says_full("2.10 1.90 1.50 3/121 4567\n", 2, 3));  // all ours
  CHECK(detail::loadavg_says_full("2.10 1.90 1.50 17/121 4567\n", 16, 8));
  CHECK_FALSE(detail::loadavg_says_full("0.52 0.58 0.59 2/121 4567\n", 2, 1));  // a core each
  CHECK_FALSE(detail::loadavg_says_full("0.52 0.58 0.59 9/121 4567\n", 16, 1));
  // Unreadable: spin as usual rather than give up on a text we do not know.
  CHECK_FALSE(detail::loadavg_says_full("", 2, 1));
  CHECK_FALSE(detail::loadavg_says_full("0.52 0.58 0.59", 2, 1));
  CHECK_FALSE(detail::loadavg_says_full("0.52 0.58 0.59 x/121 4567", 2, 1));
  CHECK_FALSE(detail::loadavg_says_full("0.52 0.58 0.59 9", 2, 1));
  CHECK_FALSE(detail::loadavg_says_full("0.52 0.58 0.59 9/121 4567", 0, 1));
  CHECK(detail::own_runnable_threads() >= 1);  // this thread, reading
  (void)detail::machine_full();                // this machine's: either answer will do
}

TEST_CASE("spin_budget is zero when the waiting threads outnumber the cores, and under passive") {
  if (bad_policy_run()) return;
  const auto nominal = std::chrono::microseconds(100);
  CHECK(spin_budget(nominal, 3, 2) == std::chrono::microseconds(0));
  const bool passive = wait_policy() == WaitPolicy::kPassive;
  CHECK(spin_budget(nominal, 2, 2) == (passive ? std::chrono::microseconds(0) : nominal));
  CHECK(spin_budget(nominal) == (passive ? std::chrono::microseconds(0) : nominal));
}

TEST_CASE("TANDEM_WAIT_POLICY chooses how poll_for waits") {
  if (bad_policy_run()) {
    CHECK_THROWS_AS(wait_policy(), InvalidArgument);
    CHECK_THROWS_AS(spin_budget(std::chrono::microseconds(100)), InvalidArgument);
    return;
  }
  const std::string variable = policy_variable();
  const WaitPolicy expected = parse_wait_policy(variable);
  REQUIRE(wait_policy() == expected);

  // The budget is far longer than the test: only done() or the policy ends each poll.
  const auto budget = spin_budget(std::chrono::seconds(30));
  if (expected == WaitPolicy::kAdaptive) {
    // A core lost to one of our own threads (the machine has room for them): polling goes on.
    const auto real_probe = detail::set_load_probe([] { return false; });
    PreemptedOnce own;
    CHECK(poll_for(budget, own));
    CHECK(own.calls == 300);
    CHECK(detail::process_spin_gate().quiet_length_ns() == 0);  // no quiet period
    // A core lost to another process: polling stops at the first clock read after the loss
    // (calls 1-64 and 65-128 are batches of polls, then one last look), and a quiet period begins.
    detail::set_load_probe([] { return true; });
    PreemptedOnce other;
    CHECK_FALSE(poll_for(budget, other));
    CHECK(other.calls <= 129);
    CHECK(detail::process_spin_gate().quiet_length_ns() > 0);
    CHECK_FALSE(spin_allowed());  // while it lasts, and while the machine stays full
    detail::set_load_probe(real_probe);
    return;
  }
  PreemptedOnce done;
  const bool result = poll_for(budget, done);
  if (expected == WaitPolicy::kPassive) {  // no budget: one look, no polling
    CHECK(budget.count() == 0);
    CHECK_FALSE(result);
    CHECK(done.calls == 1);
    CHECK_FALSE(spin_allowed());
  } else {  // active: polls through the lost core, to done()
    CHECK(result);
    CHECK(done.calls == 300);
    CHECK(spin_allowed());
  }
}
