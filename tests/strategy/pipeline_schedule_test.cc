// Pipeline schedules (GPipe, 1F1B, interleaved 1F1B): their action lists, the simulator that
// runs them under rendezvous send/recv, the bubble formulas it reproduces, and the table.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "common/error_message.h"
#include "tandem/base/errors.h"
#include "tandem/strategy/pipeline_schedule.h"

using namespace tandem;
using namespace tandem::strategy;

namespace {

using Kind = PipelineAction::Kind;

std::vector<std::string> names(const std::vector<PipelineAction>& actions) {
  std::vector<std::string> out;
  for (const PipelineAction& a : actions) out.push_back(to_string(a));
  return out;
}

PipelineConfig config_of(PipelineSchedule schedule, int p, int m, int v = 1) {
  return {.stages = p, .microbatches = m, .virtual_stages = v, .schedule = schedule};
}

// The configurations a schedule accepts among p stages and m micro-batches (interleaved: v = 2, 3
// when m is a multiple of p).
std::vector<PipelineConfig> valid_configs(PipelineSchedule schedule, int p, int m) {
  if (schedule != PipelineSchedule::kInterleaved1F1B) return {config_of(schedule, p, m)};
  if (m % p != 0) return {};
  return {config_of(schedule, p, m, 2), config_of(schedule, p, m, 3)};
}

const PipelineSchedule kSchedules[] = {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                                       PipelineSchedule::kInterleaved1F1B};

std::string describe(const PipelineConfig& c) {
  return std::string(pipeline_schedule_name(c.schedule)) + " p=" + std::to_string(c.stages) +
         " m=" + std::to_string(c.microbatches) + " v=" + std::to_string(c.virtual_stages);
}

// Checks the structural properties every schedule must have; the simulation of it with unit times.
void check_plan_properties(const PipelineConfig& c) {
  INFO(describe(c));
  const int p = c.stages;
  const int v = c.virtual_stages;
  const PipelinePlan plan = make_pipeline_schedule(c);
  REQUIRE(plan.size() == static_cast<size_t>(p));

  // Exactly one forward and one backward per (micro-batch, chunk) on every stage, the backward
  // after the forward in the list.
  for (int d = 0; d < p; ++d) {
    std::map<std::pair<int, int>, int> forward_at, backward_at;
    for (size_t k = 0; k < plan[d].size(); ++k) {
      const PipelineAction& a = plan[d][k];
      if (a.kind == Kind::kForward) CHECK(forward_at.emplace(std::pair{a.microbatch, a.chunk}, k).second);
      if (a.kind == Kind::kBackward) CHECK(backward_at.emplace(std::pair{a.microbatch, a.chunk}, k).second);
    }
    CHECK(forward_at.size() == static_cast<size_t>(c.microbatches * v));
    CHECK(backward_at.size() == static_cast<size_t>(c.microbatches * v));
    for (int mb = 0; mb < c.microbatches; ++mb) {
      for (int chunk = 0; chunk < v; ++chunk) {
        INFO("stage " << d << " micro-batch " << mb << " chunk " << chunk);
        REQUIRE(forward_at.count({mb, chunk}) == 1);
        REQUIRE(backward_at.count({mb, chunk}) == 1);
        CHECK(forward_at[{mb, chunk}] < backward_at[{mb, chunk}]);
      }
    }
  }

  // Every send has the matching recv on its peer, in the same order: per (sender, receiver) the
  // sequences of (kind, micro-batch, virtual stage from, virtual stage to) agree, so even a
  // transport without tags pairs them right.
  using Key = std::pair<int, int>;
  std::map<Key, std::vector<std::tuple<bool, int, int, int>>> sent, received;
  for (int d = 0; d < p; ++d) {
    for (const PipelineAction& a : plan[d]) {
      if (a.is_compute()) {
        CHECK(a.peer == -1);
        continue;
      }
      CHECK(a.peer >= 0);
      CHECK(a.peer < p);
      CHECK(a.peer != d);
      const bool activation = a.kind == Kind::kSendActivation || a.kind == Kind::kRecvActivation;
      const int vs = a.chunk * p + d;
      const int step = activation ? 1 : -1;
      if (a.is_send()) sent[{d, a.peer}].emplace_back(activation, a.microbatch, vs, vs + step);
      if (a.is_recv()) received[{a.peer, d}].emplace_back(activation, a.microbatch, vs - step, vs);
    }
  }
  CHECK(sent == received);

  // It runs to the end under rendezvous semantics (and buffered), and each computation starts
  // after the ones whose results it needs.
  const PipelineSimulation sim = simulate_pipeline(plan, {.forward = 1, .backward = 1});
  CHECK_NOTHROW(simulate_pipeline(plan, {.forward = 1, .backward = 2, .transfer = 0.25}));
  CHECK_NOTHROW(simulate_pipeline(plan, {.forward = 1, .backward = 2, .transfer = 0.25}, SendSemantics::kBuffered));
  std::map<std::tuple<bool, int, int>, std::pair<double, double>> when;  // (forward, mb, vs)
  for (int d = 0; d < p; ++d) {
    CHECK(sim.timeline[d].size() == plan[d].size());
    for (const TimedAction& t : sim.timeline[d]) {
      if (t.action.is_compute()) {
        when[{t.action.kind == Kind::kForward, t.action.microbatch, t.action.chunk * p + d}] = {t.start, t.end};
      }
    }
  }
  const int last = p * v - 1;
  for (const auto& [key, span] : when) {
    const auto [forward, mb, vs] = key;
    if (forward && vs > 0) CHECK(span.first >= when[{true, mb, vs - 1}].second);
    if (!forward) CHECK(span.first >= when[{true, mb, vs}].second);
    if (!forward && vs < last) CHECK(span.first >= when[{false, mb, vs + 1}].second);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Names and validation

TEST_CASE("schedule names round-trip and parse in any case") {
  for (PipelineSchedule s : kSchedules) CHECK(parse_pipeline_schedule(pipeline_schedule_name(s)) == s);
  CHECK(pipeline_schedule_name(PipelineSchedule::kGPipe) == "gpipe");
  CHECK(pipeline_schedule_name(PipelineSchedule::k1F1B) == "1f1b");
  CHECK(pipeline_schedule_name(PipelineSchedule::kInterleaved1F1B) == "interleaved-1f1b");
  CHECK(parse_pipeline_schedule("GPipe") == PipelineSchedule::kGPipe);
  CHECK(parse_pipeline_schedule("1F1B") == PipelineSchedule::k1F1B);
  CHECK(parse_pipeline_schedule("Interleaved") == PipelineSchedule::kInterleaved1F1B);
  CHECK(parse_pipeline_schedule("INTERLEAVED-1F1B") == PipelineSchedule::kInterleaved1F1B);
  CHECK(testing::error_message([] { parse_pipeline_schedule("pipedream"); }) ==
        "unknown pipeline schedule \"pipedream\": expected gpipe, 1f1b or interleaved-1f1b (also \"interleaved\")");
  CHECK(testing::error_message([] { parse_pipeline_schedule(""); }) ==
        "unknown pipeline schedule \"\": expected gpipe, 1f1b or interleaved-1f1b (also \"interleaved\")");
}

TEST_CASE("actions print as F3, B3, F3.1 and the transfers with their peer") {
  CHECK(to_string({Kind::kForward, 3, 0, -1}) == "F3");
  CHECK(to_string({Kind::kBackward, 3, 0, -1}) == "B3");
  CHECK(to_string({Kind::kForward, 3, 1, -1}) == "F3.1");
  CHECK(to_string({Kind::kRecvActivation, 3, 0, 0}) == "recv-act 3 from 0");
  CHECK(to_string({Kind::kSendActivation, 3, 0, 2}) == "send-act 3 to 2");
  CHECK(to_string({Kind::kRecvGradient, 3, 1, 2}) == "recv-grad 3.1 from 2");
  CHECK(to_string({Kind::kSendGradient, 0, 0, 1}) == "send-grad 0 to 1");
}

TEST_CASE("a bad config names the field and its value") {
  auto message = [](PipelineConfig c) { return testing::error_message([&] { (void)make_pipeline_schedule(c); }); };
  CHECK(message(config_of(PipelineSchedule::k1F1B, 0, 4)) == "pipeline stages must be at least 1, got 0");
  CHECK(message(config_of(PipelineSchedule::k1F1B, 2, 0)) == "pipeline microbatches must be at least 1, got 0");
  CHECK(message(config_of(PipelineSchedule::k1F1B, 2, -3)) == "pipeline microbatches must be at least 1, got -3");
  CHECK(message(config_of(PipelineSchedule::kInterleaved1F1B, 2, 4, 0)) ==
        "pipeline virtual_stages must be at least 1, got 0");
  CHECK(message(config_of(PipelineSchedule::k1F1B, 2, 4, 2)) ==
        "virtual_stages (2) above 1 needs the interleaved-1f1b schedule, not 1f1b");
  CHECK(message(config_of(PipelineSchedule::kGPipe, 2, 4, 3)) ==
        "virtual_stages (3) above 1 needs the interleaved-1f1b schedule, not gpipe");
  CHECK(message(config_of(PipelineSchedule::kInterleaved1F1B, 2, 4, 1)) ==
        "interleaved 1F1B needs virtual_stages of at least 2 (model chunks per stage), got 1");
  CHECK(message(config_of(PipelineSchedule::kInterleaved1F1B, 4, 6, 2)) ==
        "interleaved 1F1B needs microbatches (6) to be a multiple of stages (4), as Megatron-LM's schedule does");
  CHECK(message(config_of(PipelineSchedule::kInterleaved1F1B, 4, 2, 2)) ==
        "interleaved 1F1B needs microbatches (2) to be a multiple of stages (4), as Megatron-LM's schedule does");
  CHECK(testing::error_message([] { (void)predicted_bubble(config_of(PipelineSchedule::kGPipe, 0, 1)); }) ==
        "pipeline stages must be at least 1, got 0");
}

// ---------------------------------------------------------------------------------------------
// The lists

TEST_CASE("1F1B on 2 stages with 2 micro-batches, hand-checked") {
  const PipelinePlan plan = make_pipeline_schedule(config_of(PipelineSchedule::k1F1B, 2, 2));
  REQUIRE(plan.size() == 2);
  CHECK(names(plan[0]) == std::vector<std::string>{"F0", "send-act 0 to 1", "F1", "send-act 1 to 1",
                                                   "recv-grad 0 from 1", "B0", "recv-grad 1 from 1", "B1"});
  // The last stage takes micro-batch 1's activation before it gives micro-batch 0's gradient: at
  // that meeting stage 0 does the same (send-act 1, then recv-grad 0), so neither waits forever.
  CHECK(names(plan[1]) == std::vector<std::string>{"recv-act 0 from 0", "F0", "B0", "recv-act 1 from 0",
                                                   "send-grad 0 to 0", "F1", "B1", "send-grad 1 to 0"});
}

TEST_CASE("GPipe runs every forward, then every backward, in micro-batch order") {
  const PipelinePlan plan = make_pipeline_schedule(config_of(PipelineSchedule::kGPipe, 3, 3));
  std::vector<std::string> computes;
  for (const PipelineAction& a : plan[1]) {
    if (a.is_compute()) computes.push_back(to_string(a));
  }
  CHECK(computes == std::vector<std::string>{"F0", "F1", "F2", "B0", "B1", "B2"});
  CHECK(names(plan[2]).front() == "recv-act 0 from 1");
  CHECK(names(plan[0]).back() == "B2");
}

TEST_CASE("interleaved: the last device's chunk c feeds device 0's chunk c+1") {
  const PipelinePlan plan = make_pipeline_schedule(config_of(PipelineSchedule::kInterleaved1F1B, 2, 2, 2));
  auto has = [](const std::vector<PipelineAction>& list, PipelineAction a) {
    return std::find(list.begin(), list.end(), a) != list.end();
  };
  // Virtual stages: device 0 holds 0 and 2, device 1 holds 1 and 3.
  CHECK(has(plan[1], {Kind::kSendActivation, 0, 0, 0}));  // virtual stage 1 -> 2
  CHECK(has(plan[0], {Kind::kRecvActivation, 0, 1, 1}));
  CHECK(has(plan[0], {Kind::kSendGradient, 1, 1, 1}));  // virtual stage 2 -> 1
  CHECK(has(plan[1], {Kind::kRecvGradient, 1, 0, 0}));
  // The first virtual stage receives nothing, the last sends no activation.
  CHECK_FALSE(has(plan[0], {Kind::kRecvActivation, 0, 0, 1}));
  CHECK_FALSE(has(plan[1], {Kind::kSendActivation, 0, 1, 0}));
  // One device: every chunk is local, no transfers.
  const PipelinePlan one = make_pipeline_schedule(config_of(PipelineSchedule::kInterleaved1F1B, 1, 3, 2));
  for (const PipelineAction& a : one.front()) CHECK(a.is_compute());
}

TEST_CASE("every schedule completes with one forward and backward each and matched transfers") {
  for (PipelineSchedule s : kSchedules) {
    for (int p : {1, 2, 3, 4, 8}) {
      for (int m = 1; m <= 9; ++m) {
        for (const PipelineConfig& c : valid_configs(s, p, m)) check_plan_properties(c);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The bubble

TEST_CASE("GPipe and 1F1B: the simulated bubble is (p-1)/(m+p-1) with uniform, 2x, 3x and 0.5x backward") {
  for (PipelineSchedule s : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
    for (int p : {2, 4}) {
      for (int m : {1, 2, 4, 8}) {
        const PipelineConfig c = config_of(s, p, m);
        const double formula = static_cast<double>(p - 1) / (m + p - 1);
        CHECK(std::abs(predicted_bubble(c) - formula) < 1e-12);
        const PipelinePlan plan = make_pipeline_schedule(c);
        for (double backward : {1.0, 2.0, 3.0, 0.5}) {
          INFO(describe(c) << " backward " << backward);
          const PipelineSimulation sim = simulate_pipeline(plan, {.forward = 1, .backward = backward});
          CHECK(std::abs(sim.bubble_fraction() - formula) < 1e-12);
          CHECK(std::abs(sim.makespan - (m + p - 1) * (1 + backward)) < 1e-12);
          for (double busy : sim.busy) CHECK(busy == doctest::Approx(m * (1 + backward)));
        }
      }
    }
  }
}

TEST_CASE("interleaved 1F1B, v=2: the simulated bubble is (p-1)/(v*m+p-1) with chunk times 1/v") {
  const int v = 2;
  for (int p : {2, 4}) {
    for (int m : {1, 2, 4, 8}) {
      if (m % p != 0) continue;
      const PipelineConfig c = config_of(PipelineSchedule::kInterleaved1F1B, p, m, v);
      const double formula = static_cast<double>(p - 1) / (v * m + p - 1);
      CHECK(std::abs(predicted_bubble(c) - formula) < 1e-12);
      const PipelinePlan plan = make_pipeline_schedule(c);
      INFO(describe(c));
      const PipelineSimulation sim = simulate_pipeline(plan, {.forward = 1.0 / v, .backward = 1.0 / v});
      CHECK(std::abs(sim.bubble_fraction() - formula) < 1e-12);
      // Backward twice forward: the lists were placed by a run with equal times, and a rendezvous
      // holds a sender that is ahead, so the bubble is larger (never smaller); asynchronous sends
      // at the same places do not recover it either (they are placed where the consumer needs them).
      const PipelineTimes uneven{.forward = 1.0 / v, .backward = 2.0 / v};
      const PipelineSimulation rendezvous = simulate_pipeline(plan, uneven);
      CHECK(rendezvous.bubble_fraction() >= formula - 1e-12);
      const PipelineSimulation buffered = simulate_pipeline(plan, uneven, SendSemantics::kBuffered);
      CHECK(buffered.bubble_fraction() >= formula - 1e-12);
      CHECK(buffered.makespan <= rendezvous.makespan + 1e-12);
      MESSAGE(describe(c) << ": bubble " << sim.bubble_fraction() << " (formula " << formula
                          << "); backward 2x: rendezvous " << rendezvous.bubble_fraction() << ", buffered "
                          << buffered.bubble_fraction());
    }
  }
}

TEST_CASE("buffered sends give the same bubble as rendezvous for GPipe and 1F1B") {
  for (PipelineSchedule s : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
    const PipelineConfig c = config_of(s, 4, 8);
    const PipelinePlan plan = make_pipeline_schedule(c);
    const PipelineSimulation sim = simulate_pipeline(plan, {.forward = 1, .backward = 2}, SendSemantics::kBuffered);
    CHECK(std::abs(sim.bubble_fraction() - predicted_bubble(c)) < 1e-12);
  }
}

TEST_CASE("a transfer time lengthens the run") {
  const PipelineConfig c = config_of(PipelineSchedule::k1F1B, 4, 4);
  const PipelinePlan plan = make_pipeline_schedule(c);
  const PipelineSimulation instant = simulate_pipeline(plan);
  const PipelineSimulation costly = simulate_pipeline(plan, {.transfer = 0.5});
  CHECK(costly.makespan > instant.makespan);
  CHECK(costly.bubble_fraction() > instant.bubble_fraction());
  CHECK(costly.busy == instant.busy);
}

// ---------------------------------------------------------------------------------------------
// Memory: live activations

TEST_CASE("peak live activations: GPipe m on every stage, 1F1B min(p-s, m), interleaved reported") {
  for (int p : {1, 2, 3, 4, 8}) {
    for (int m = 1; m <= 9; ++m) {
      INFO("p=" << p << " m=" << m);
      const auto gpipe = simulate_pipeline(make_pipeline_schedule(config_of(PipelineSchedule::kGPipe, p, m)));
      const auto one_f_one_b = simulate_pipeline(make_pipeline_schedule(config_of(PipelineSchedule::k1F1B, p, m)));
      for (int s = 0; s < p; ++s) {
        CHECK(gpipe.peak_live_activations[s] == m);
        CHECK(one_f_one_b.peak_live_activations[s] == std::min(p - s, m));
        CHECK(one_f_one_b.peak_live_activations[s] <= p);
      }
    }
  }
  // Interleaved (v chunks, each 1/v of a stage's layers): Megatron's warm-up plus one, in chunk
  // micro-batches; all m·v when m = p.
  for (int p : {2, 4}) {
    for (int m : {p, 2 * p, 4 * p}) {
      const int v = 2;
      const auto sim =
          simulate_pipeline(make_pipeline_schedule(config_of(PipelineSchedule::kInterleaved1F1B, p, m, v)));
      std::string figures;
      for (int d = 0; d < p; ++d) {
        const int expected = m == p ? m * v : std::min(2 * (p - d - 1) + (v - 1) * p + 1, m * v);
        CHECK(sim.peak_live_activations[d] == expected);
        figures += fmt::format(" {}", sim.peak_live_activations[d]);
      }
      MESSAGE("interleaved p=" << p << " m=" << m
                               << " v=2: peak live (micro-batch, chunk) pairs per stage:" << figures);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The simulator's checks

TEST_CASE("a deadlock names every blocked stage and the action it waits on") {
  // Both stages send first: under rendezvous neither send can complete.
  const PipelinePlan plan = {
      {{Kind::kForward, 0, 0, -1},
       {Kind::kSendActivation, 0, 0, 1},
       {Kind::kRecvGradient, 0, 0, 1},
       {Kind::kBackward, 0, 0, -1}},
      {{Kind::kSendGradient, 0, 0, 0},
       {Kind::kRecvActivation, 0, 0, 0},
       {Kind::kForward, 0, 0, -1},
       {Kind::kBackward, 0, 0, -1}},
  };
  CHECK(testing::error_message<FailedPrecondition>([&] { (void)simulate_pipeline(plan); }) ==
        "pipeline schedule deadlocks (rendezvous semantics, by t=1): stage 0 waits at action 1 (send-act 0 to 1); "
        "stage 1 waits at action 0 (send-grad 0 to 0)");
  // A recv nobody sends.
  const PipelinePlan orphan = {{{Kind::kRecvActivation, 0, 0, 1}, {Kind::kForward, 0, 0, -1}},
                               {{Kind::kForward, 0, 0, -1}, {Kind::kBackward, 0, 0, -1}}};
  CHECK(testing::error_message<FailedPrecondition>(
            [&] { (void)simulate_pipeline(orphan, {}, SendSemantics::kBuffered); }) ==
        "pipeline schedule deadlocks (buffered semantics, by t=2): stage 0 waits at action 0 (recv-act 0 from 1); "
        "stage 1 has finished");
}

TEST_CASE("a malformed plan is named: mismatched transfer, backward first, bad peer") {
  const PipelinePlan mismatched = {{{Kind::kForward, 0, 0, -1}, {Kind::kSendActivation, 0, 0, 1}},
                                   {{Kind::kRecvActivation, 1, 0, 0}, {Kind::kForward, 1, 0, -1}}};
  CHECK(testing::error_message([&] { (void)simulate_pipeline(mismatched); }) ==
        "pipeline plan: stage 0's action 1 (send-act 0 to 1) meets stage 1's action 0 (recv-act 1 from 0): they must "
        "carry the activation of micro-batch 0 from virtual stage 0 to 1");
  const PipelinePlan other_kind = {{{Kind::kForward, 0, 0, -1}, {Kind::kSendActivation, 0, 0, 1}},
                                   {{Kind::kRecvGradient, 0, 0, 0}, {Kind::kForward, 0, 0, -1}}};
  CHECK(testing::error_message([&] { (void)simulate_pipeline(other_kind, {}, SendSemantics::kBuffered); }) ==
        "pipeline plan: stage 0's action 1 (send-act 0 to 1) meets stage 1's action 0 (recv-grad 0 from 0): they "
        "must carry the activation of micro-batch 0 from virtual stage 0 to 1");
  const PipelinePlan backward_first = {{{Kind::kBackward, 2, 0, -1}, {Kind::kForward, 2, 0, -1}}};
  CHECK(testing::error_message([&] { (void)simulate_pipeline(backward_first); }) ==
        "pipeline plan: stage 0's action 0 (B2): backward of micro-batch 2 on chunk 0 before its forward");
  const PipelinePlan bad_peer = {{{Kind::kSendActivation, 0, 0, 2}}, {}};
  CHECK(testing::error_message([&] { (void)simulate_pipeline(bad_peer); }) ==
        "pipeline plan: stage 0's action 0 (send-act 0 to 2): peer 2 is not another stage of this 2-stage pipeline");
  const PipelinePlan unreceived = {{{Kind::kForward, 0, 0, -1}, {Kind::kSendActivation, 0, 0, 1}}, {}};
  CHECK(testing::error_message([&] { (void)simulate_pipeline(unreceived, {}, SendSemantics::kBuffered); }) ==
        "pipeline plan: stage 0's action 1 (send-act 0 to 1) was never received by stage 1");
}

// ---------------------------------------------------------------------------------------------
// The table

TEST_CASE("the table of 1F1B on 2 stages with 2 micro-batches, hand-checked") {
  const PipelineConfig c = config_of(PipelineSchedule::k1F1B, 2, 2);
  const std::string table = format_pipeline_table(c, simulate_pipeline(make_pipeline_schedule(c)));
  CHECK(table ==
        "1f1b: 2 stages, 2 micro-batches; one slot = 1\n"
        "         0  1  2  3  4  5\n"
        "stage 0  F0 F1 .  B0 .  B1\n"
        "stage 1  .  F0 B0 F1 B1 .\n"
        "bubble: 0.333 (predicted (p-1)/(m+p-1) = 1/3 = 0.333)\n");
}

TEST_CASE("tables: longer computations, chunks, wrapping, the predicted formula") {
  const PipelineConfig gpipe = config_of(PipelineSchedule::kGPipe, 2, 1);
  CHECK(format_pipeline_table(gpipe, simulate_pipeline(make_pipeline_schedule(gpipe), {.forward = 1, .backward = 2})) ==
        "gpipe: 2 stages, 1 micro-batches; one slot = 1\n"
        "         0  1  2  3  4  5\n"
        "stage 0  F0 .  .  .  B0 -\n"
        "stage 1  .  F0 B0 -  .  .\n"
        "bubble: 0.500 (predicted (p-1)/(m+p-1) = 1/2 = 0.500)\n");

  const PipelineConfig four = config_of(PipelineSchedule::k1F1B, 4, 4);
  const std::string table = format_pipeline_table(four, simulate_pipeline(make_pipeline_schedule(four)));
  CHECK(table.find("bubble: 0.429 (predicted (p-1)/(m+p-1) = 3/7 = 0.429)\n") != std::string::npos);

  const PipelineConfig inter = config_of(PipelineSchedule::kInterleaved1F1B, 2, 2, 2);
  const std::string chunks =
      format_pipeline_table(inter, simulate_pipeline(make_pipeline_schedule(inter), {.forward = 0.5, .backward = 0.5}));
  CHECK(chunks.find("F0.1") != std::string::npos);
  CHECK(chunks.find("bubble: 0.200 (predicted (p-1)/(v*m+p-1) = 1/5 = 0.200)\n") != std::string::npos);
  CHECK(chunks.find("; one slot = 0.5\n") != std::string::npos);

  // 8 stages, 16 micro-batches: 46 slots wrap into blocks of at most 120 characters.
  const PipelineConfig big = config_of(PipelineSchedule::k1F1B, 8, 16);
  const std::string wide = format_pipeline_table(big, simulate_pipeline(make_pipeline_schedule(big)));
  size_t start = 0, rows = 0;
  while (start < wide.size()) {
    const size_t end = wide.find('\n', start);
    CHECK(end - start <= 120);
    rows += wide.compare(start, 6, "stage ") == 0;
    start = end + 1;
  }
  CHECK(rows == 8 * 2);  // two blocks
  MESSAGE(wide);
}

TEST_CASE("simulate_pipeline takes per-stage times: equal ones give the uniform result, a slow stage sets the pace") {
  const PipelineConfig config{.stages = 2, .microbatches = 4, .schedule = PipelineSchedule::k1F1B};
  const PipelinePlan plan = make_pipeline_schedule(config);
  const double uniform = simulate_pipeline(plan, {.forward = 1, .backward = 2}).makespan;
  CHECK(simulate_pipeline(plan, {.stage_forward = {1, 1}, .stage_backward = {2, 2}}).makespan == uniform);
  // Stage 1 twice as slow: its 4 forwards and backwards (4 x 6) plus stage 0's first forward and
  // last backward (1 + 2) are the critical path.
  CHECK(simulate_pipeline(plan, {.stage_forward = {1, 2}, .stage_backward = {2, 4}}).makespan == doctest::Approx(27));
  CHECK_THROWS_WITH_AS(simulate_pipeline(plan, {.stage_forward = {1, 2, 3}}),
                       "pipeline times: 3 per-stage times for 2 stages", InvalidArgument);
}
