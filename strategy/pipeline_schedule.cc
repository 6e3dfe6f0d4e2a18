// Pipeline schedules, their simulator and their table (pipeline_schedule.h explains the semantics).
#include "tandem/strategy/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <deque>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "tandem/base/errors.h"

namespace tandem::strategy {

namespace {

using Kind = PipelineAction::Kind;

PipelineAction compute(Kind kind, int microbatch, int chunk) { return {kind, microbatch, chunk, -1}; }

// ---------------------------------------------------------------------------------------------
// The order of computations on one device

std::vector<PipelineAction> gpipe_order(int m) {
  std::vector<PipelineAction> order;
  for (int i = 0; i < m; ++i) order.push_back(compute(Kind::kForward, i, 0));
  for (int i = 0; i < m; ++i) order.push_back(compute(Kind::kBackward, i, 0));
  return order;
}

// Warm-up forwards, then one forward and one backward at a time, then the remaining backwards.
std::vector<PipelineAction> one_f_one_b_order(int p, int m, int stage) {
  const int warmup = std::min(p - stage - 1, m);
  std::vector<PipelineAction> order;
  for (int i = 0; i < warmup; ++i) order.push_back(compute(Kind::kForward, i, 0));
  for (int k = 0; k < m - warmup; ++k) {
    order.push_back(compute(Kind::kForward, warmup + k, 0));
    order.push_back(compute(Kind::kBackward, k, 0));
  }
  for (int i = std::max(m - warmup, 0); i < m; ++i) order.push_back(compute(Kind::kBackward, i, 0));
  return order;
}

// Megatron-LM's interleaved order: the k-th forward of a device runs micro-batch
// (k / pv)·p + k % p on chunk (k % pv) / p, i.e. p micro-batches through chunk 0, the same p
// through chunk 1, ...; backwards likewise from the last chunk down.
std::vector<PipelineAction> interleaved_order(int p, int m, int v, int device) {
  const int group = p * v;
  const int total = m * v;
  auto microbatch = [&](int k) { return (k / group) * p + k % p; };
  auto forward = [&](int k) { return compute(Kind::kForward, microbatch(k), (k % group) / p); };
  auto backward = [&](int k) { return compute(Kind::kBackward, microbatch(k), v - 1 - (k % group) / p); };
  // With m = p Megatron runs every forward first (no steady state to fill).
  const int warmup = m == p ? total : std::min((p - device - 1) * 2 + (v - 1) * p, total);
  std::vector<PipelineAction> order;
  for (int k = 0; k < warmup; ++k) order.push_back(forward(k));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(forward(warmup + k));
    order.push_back(backward(k));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(backward(k));
  return order;
}

std::vector<PipelineAction> compute_order(const PipelineConfig& config, int device) {
  switch (config.schedule) {
    case PipelineSchedule::kGPipe: return gpipe_order(config.microbatches);
    case PipelineSchedule::k1F1B: return one_f_one_b_order(config.stages, config.microbatches, device);
    case PipelineSchedule::kInterleaved1F1B:
      return interleaved_order(config.stages, config.microbatches, config.virtual_stages, device);
  }
  TANDEM_ASSERT(false, "unknown schedule {}", static_cast<int>(config.schedule));
  return {};
}

// ---------------------------------------------------------------------------------------------
// The unit-time reference run that places the transfers

// Start times of every computation when each takes one time unit, transfers take none and a
// stage starts a computation as soon as its inputs exist (sends buffered). Indexed [device][k]
// like `orders`; also by virtual stage and micro-batch for the transfers' consumers.
struct ReferenceRun {
  std::vector<std::vector<long>> start;           // [device][k]
  std::vector<std::vector<long>> forward_start;   // [virtual stage][micro-batch]
  std::vector<std::vector<long>> backward_start;  // [virtual stage][micro-batch]
};

ReferenceRun reference_run(const std::vector<std::vector<PipelineAction>>& orders, int p, int m, int v) {
  const int virtual_stages = p * v;
  ReferenceRun run;
  run.forward_start.assign(virtual_stages, std::vector<long>(m, -1));
  run.backward_start.assign(virtual_stages, std::vector<long>(m, -1));
  run.start.resize(p);
  // End of a computation, -1 while it has not run.
  auto end_of = [&](const std::vector<std::vector<long>>& starts, int vs, int mb) {
    return starts[vs][mb] < 0 ? -1 : starts[vs][mb] + 1;
  };
  std::vector<long> clock(p, 0);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int d = 0; d < p; ++d) {
      while (run.start[d].size() < orders[d].size()) {
        const PipelineAction& a = orders[d][run.start[d].size()];
        const int vs = a.chunk * p + d;
        long ready = clock[d];
        bool runnable = true;
        auto need = [&](long end) {
          runnable = runnable && end >= 0;
          ready = std::max(ready, end);
        };
        if (a.kind == Kind::kForward) {
          if (vs > 0) need(end_of(run.forward_start, vs - 1, a.microbatch));
        } else {
          need(end_of(run.forward_start, vs, a.microbatch));
          if (vs < virtual_stages - 1) need(end_of(run.backward_start, vs + 1, a.microbatch));
        }
        if (!runnable) break;
        (a.kind == Kind::kForward ? run.forward_start : run.backward_start)[vs][a.microbatch] = ready;
        run.start[d].push_back(ready);
        clock[d] = ready + 1;
        progress = true;
      }
    }
  }
  for (int d = 0; d < p; ++d) {
    TANDEM_ASSERT(run.start[d].size() == orders[d].size(), "the reference run of stage {} stopped at {} of {}", d,
                  run.start[d].size(), orders[d].size());
  }
  return run;
}

// Where an action goes in its stage's list: computations at 2·start+1, transfers at 2·time (so
// before a computation starting at that time, after one ending then), transfers at one time
// ordered the same way on every stage.
using PlaceKey = std::tuple<long, int, int, int>;

// ---------------------------------------------------------------------------------------------
// Names

std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string microbatch_label(const PipelineAction& a) {
  return a.chunk == 0 ? fmt::format("{}", a.microbatch) : fmt::format("{}.{}", a.microbatch, a.chunk);
}

std::string predicted_formula(const PipelineConfig& config) {
  const int p = config.stages;
  const int m = config.microbatches;
  const int v = config.virtual_stages;
  if (config.schedule == PipelineSchedule::kInterleaved1F1B) {
    return fmt::format("(p-1)/(v*m+p-1) = {}/{}", p - 1, v * m + p - 1);
  }
  return fmt::format("(p-1)/(m+p-1) = {}/{}", p - 1, m + p - 1);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

std::string_view pipeline_schedule_name(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kGPipe: return "gpipe";
    case PipelineSchedule::k1F1B: return "1f1b";
    case PipelineSchedule::kInterleaved1F1B: return "interleaved-1f1b";
  }
  return "unknown";
}

PipelineSchedule parse_pipeline_schedule(std::string_view name) {
  const std::string key = lower(name);
  if (key == "gpipe") return PipelineSchedule::kGPipe;
  if (key == "1f1b") return PipelineSchedule::k1F1B;
  if (key == "interleaved-1f1b" || key == "interleaved") return PipelineSchedule::kInterleaved1F1B;
  throw InvalidArgument(fmt::format(
      "unknown pipeline schedule \"{}\": expected gpipe, 1f1b or interleaved-1f1b (also \"interleaved\")", name));
}

std::string to_string(const PipelineAction& action) {
  const std::string mb = microbatch_label(action);
  switch (action.kind) {
    case Kind::kForward: return "F" + mb;
    case Kind::kBackward: return "B" + mb;
    case Kind::kRecvActivation: return fmt::format("recv-act {} from {}", mb, action.peer);
    case Kind::kSendActivation: return fmt::format("send-act {} to {}", mb, action.peer);
    case Kind::kRecvGradient: return fmt::format("recv-grad {} from {}", mb, action.peer);
    case Kind::kSendGradient: return fmt::format("send-grad {} to {}", mb, action.peer);
  }
  return "unknown action";
}

void validate_pipeline_config(const PipelineConfig& config) {
  TANDEM_REQUIRE(config.stages >= 1, InvalidArgument, "pipeline stages must be at least 1, got {}", config.stages);
  TANDEM_REQUIRE(config.microbatches >= 1, InvalidArgument, "pipeline microbatches must be at least 1, got {}",
                 config.microbatches);
  TANDEM_REQUIRE(config.virtual_stages >= 1, InvalidArgument, "pipeline virtual_stages must be at least 1, got {}",
                 config.virtual_stages);
  const bool interleaved = config.schedule == PipelineSchedule::kInterleaved1F1B;
  TANDEM_REQUIRE(interleaved || config.virtual_stages == 1, InvalidArgument,
                 "virtual_stages ({}) above 1 needs the interleaved-1f1b schedule, not {}", config.virtual_stages,
                 pipeline_schedule_name(config.schedule));
  if (!interleaved) return;
  TANDEM_REQUIRE(config.virtual_stages >= 2, InvalidArgument,
                 "interleaved 1F1B needs virtual_stages of at least 2 (model chunks per stage), got {}",
                 config.virtual_stages);
  TANDEM_REQUIRE(config.microbatches % config.stages == 0, InvalidArgument,
                 "interleaved 1F1B needs microbatches ({}) to be a multiple of stages ({}), as Megatron-LM's "
                 "schedule does",
                 config.microbatches, config.stages);
}

double predicted_bubble(const PipelineConfig& config) {
  validate_pipeline_config(config);
  const double p = config.stages;
  const double work = static_cast<double>(config.microbatches) * config.virtual_stages;
  return (p - 1) / (work + p - 1);
}

PipelinePlan make_pipeline_schedule(const PipelineConfig& config) {
  validate_pipeline_config(config);
  const int p = config.stages;
  const int m = config.microbatches;
  const int v = config.virtual_stages;
  std::vector<std::vector<PipelineAction>> orders(p);
  for (int d = 0; d < p; ++d) orders[d] = compute_order(config, d);
  const ReferenceRun run = reference_run(orders, p, m, v);

  std::vector<std::vector<std::pair<PlaceKey, PipelineAction>>> placed(p);
  // A transfer from virtual stage `from` to `to`, placed where its consumer starts.
  auto transfer = [&](bool activation, int mb, int from, int to, long consumer_start) {
    const int sender = from % p;
    const int receiver = to % p;
    if (sender == receiver) return;  // one device: the data is already there
    const PlaceKey key{2 * consumer_start, activation ? 0 : 1, mb, from};
    placed[sender].push_back({key, {activation ? Kind::kSendActivation : Kind::kSendGradient, mb, from / p, receiver}});
    placed[receiver].push_back({key, {activation ? Kind::kRecvActivation : Kind::kRecvGradient, mb, to / p, sender}});
  };
  for (int d = 0; d < p; ++d) {
    for (size_t k = 0; k < orders[d].size(); ++k) {
      const PipelineAction& a = orders[d][k];
      placed[d].push_back({PlaceKey{2 * run.start[d][k] + 1, 0, 0, 0}, a});
      const int vs = a.chunk * p + d;
      if (a.kind == Kind::kForward && vs < p * v - 1) {
        transfer(true, a.microbatch, vs, vs + 1, run.forward_start[vs + 1][a.microbatch]);
      } else if (a.kind == Kind::kBackward && vs > 0) {
        transfer(false, a.microbatch, vs, vs - 1, run.backward_start[vs - 1][a.microbatch]);
      }
    }
  }
  PipelinePlan plan(p);
  for (int d = 0; d < p; ++d) {
    std::sort(placed[d].begin(), placed[d].end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [key, action] : placed[d]) plan[d].push_back(action);
  }
  return plan;
}

// ---------------------------------------------------------------------------------------------
// The simulator

double PipelineSimulation::bubble_fraction() const {
  if (busy.empty() || makespan <= 0) return 0;
  double idle = 0;
  for (double b : busy) idle += (makespan - b) / makespan;
  return idle / static_cast<double>(busy.size());
}

namespace {

class Simulator {
 public:
  Simulator(const PipelinePlan& plan, const PipelineTimes& times, SendSemantics semantics)
      : plan_(plan), times_(times), semantics_(semantics), p_(static_cast<int>(plan.size())) {
    stages_.resize(p_);
    result_.busy.assign(p_, 0);
    result_.timeline.resize(p_);
    result_.peak_live_activations.assign(p_, 0);
    check_plan();
  }

  PipelineSimulation run() {
    bool progress = true;
    while (progress) {
      progress = false;
      for (int d = 0; d < p_; ++d) {
        while (step(d)) progress = true;
      }
    }
    for (int d = 0; d < p_; ++d) {
      if (!finished(d)) throw_deadlock();
    }
    for (const auto& [channel, queue] : channels_) {
      TANDEM_REQUIRE(queue.empty(), InvalidArgument, "pipeline plan: {} was never received by stage {}",
                     where(queue.front().sender, queue.front().index), channel.second);
    }
    for (int d = 0; d < p_; ++d) result_.makespan = std::max(result_.makespan, stages_[d].clock);
    return std::move(result_);
  }

 private:
  struct Stage {
    size_t next = 0;
    double clock = 0;
    std::set<std::pair<int, int>> live;  // (micro-batch, chunk) forwarded, not yet backwarded
  };
  struct InFlight {  // a buffered send: plan_[sender][index], arriving at `arrival`
    int sender;
    size_t index;
    double arrival;
  };

  std::string where(int d, size_t k) const {
    return fmt::format("stage {}'s action {} ({})", d, k, to_string(plan_[d][k]));
  }

  void check_plan() const {
    for (int d = 0; d < p_; ++d) {
      for (size_t k = 0; k < plan_[d].size(); ++k) {
        const PipelineAction& a = plan_[d][k];
        TANDEM_REQUIRE(a.microbatch >= 0 && a.chunk >= 0, InvalidArgument,
                       "pipeline plan: {}: micro-batch and chunk must not be negative", where(d, k));
        if (a.is_compute()) continue;
        TANDEM_REQUIRE(a.peer >= 0 && a.peer < p_ && a.peer != d, InvalidArgument,
                       "pipeline plan: {}: peer {} is not another stage of this {}-stage pipeline", where(d, k), a.peer,
                       p_);
      }
    }
  }

  bool finished(int d) const { return stages_[d].next >= plan_[d].size(); }
  int virtual_stage(int d, const PipelineAction& a) const { return a.chunk * p_ + d; }

  void record(int d, double start, double end) {
    result_.timeline[d].push_back({plan_[d][stages_[d].next], start, end});
    stages_[d].clock = end;
    ++stages_[d].next;
  }

  // Runs stage d's next action if it can; false when it waits (or is done).
  bool step(int d) {
    if (finished(d)) return false;
    const PipelineAction& a = plan_[d][stages_[d].next];
    if (a.is_compute()) return run_compute(d, a);
    if (semantics_ == SendSemantics::kBuffered) return a.is_send() ? buffered_send(d, a) : buffered_recv(d, a);
    return rendezvous(d, a);
  }

  bool run_compute(int d, const PipelineAction& a) {
    Stage& s = stages_[d];
    const std::pair<int, int> id{a.microbatch, a.chunk};
    const size_t k = s.next;
    if (a.kind == Kind::kForward) {
      TANDEM_REQUIRE(s.live.insert(id).second, InvalidArgument,
                     "pipeline plan: {}: a second forward of micro-batch {} on chunk {} before its backward",
                     where(d, k), a.microbatch, a.chunk);
      result_.peak_live_activations[d] = std::max(result_.peak_live_activations[d], static_cast<int>(s.live.size()));
    } else {
      TANDEM_REQUIRE(s.live.erase(id) == 1, InvalidArgument,
                     "pipeline plan: {}: backward of micro-batch {} on chunk {} before its forward", where(d, k),
                     a.microbatch, a.chunk);
    }
    const auto& per_stage = a.kind == Kind::kForward ? times_.stage_forward : times_.stage_backward;
    const double duration = !per_stage.empty()         ? per_stage[d]
                            : a.kind == Kind::kForward ? times_.forward
                                                       : times_.backward;
    result_.busy[d] += duration;
    record(d, s.clock, s.clock + duration);
    return true;
  }

  static bool carries_activation(const PipelineAction& a) {
    return a.kind == Kind::kSendActivation || a.kind == Kind::kRecvActivation;
  }

  // A send pairs with the next recv from its stage on the peer (as a transport without tags pairs
  // them): both must carry the same kind of tensor of one micro-batch between neighbouring virtual
  // stages (downstream for activations, upstream for gradients).
  void check_pair(int sender, size_t send_k, int receiver, size_t recv_k) const {
    const PipelineAction& send = plan_[sender][send_k];
    const PipelineAction& recv = plan_[receiver][recv_k];
    const bool activation = carries_activation(send);
    const int from = virtual_stage(sender, send);
    const int to = from + (activation ? 1 : -1);
    TANDEM_REQUIRE(carries_activation(recv) == activation && recv.microbatch == send.microbatch &&
                       virtual_stage(receiver, recv) == to,
                   InvalidArgument,
                   "pipeline plan: {} meets {}: they must carry the {} of micro-batch {} from virtual stage {} to {}",
                   where(sender, send_k), where(receiver, recv_k), activation ? "activation" : "gradient",
                   send.microbatch, from, to);
  }

  bool rendezvous(int d, const PipelineAction& a) {
    const int q = a.peer;
    if (finished(q)) return false;
    const PipelineAction& b = plan_[q][stages_[q].next];
    // Both sending (or both receiving), or q busy with another stage: wait.
    if (b.is_compute() || b.peer != d || a.is_send() == b.is_send()) return false;
    const int sender = a.is_send() ? d : q;
    const int receiver = a.is_send() ? q : d;
    check_pair(sender, stages_[sender].next, receiver, stages_[receiver].next);
    const double end = std::max(stages_[d].clock, stages_[q].clock) + times_.transfer;
    record(d, stages_[d].clock, end);
    record(q, stages_[q].clock, end);
    return true;
  }

  using Channel = std::pair<int, int>;  // sender, receiver

  bool buffered_send(int d, const PipelineAction& a) {
    const double now = stages_[d].clock;
    channels_[Channel{d, a.peer}].push_back({d, stages_[d].next, now + times_.transfer});
    record(d, now, now);
    return true;
  }

  bool buffered_recv(int d, const PipelineAction& a) {
    auto& queue = channels_[Channel{a.peer, d}];
    if (queue.empty()) return false;
    const InFlight message = queue.front();
    check_pair(message.sender, message.index, d, stages_[d].next);
    queue.pop_front();
    const double start = stages_[d].clock;
    record(d, start, std::max(start, message.arrival));
    return true;
  }

  [[noreturn]] void throw_deadlock() const {
    std::string blocked;
    double at = 0;
    for (int d = 0; d < p_; ++d) {
      if (!blocked.empty()) blocked += "; ";
      at = std::max(at, stages_[d].clock);
      if (finished(d)) {
        blocked += fmt::format("stage {} has finished", d);
      } else {
        blocked +=
            fmt::format("stage {} waits at action {} ({})", d, stages_[d].next, to_string(plan_[d][stages_[d].next]));
      }
    }
    throw FailedPrecondition(fmt::format("pipeline schedule deadlocks ({} semantics, by t={:g}): {}",
                                         semantics_ == SendSemantics::kRendezvous ? "rendezvous" : "buffered", at,
                                         blocked));
  }

  const PipelinePlan& plan_;
  PipelineTimes times_;
  SendSemantics semantics_;
  int p_;
  std::vector<Stage> stages_;
  std::map<Channel, std::deque<InFlight>> channels_;
  PipelineSimulation result_;
};

}  // namespace

PipelineSimulation simulate_pipeline(const PipelinePlan& plan, const PipelineTimes& times, SendSemantics semantics) {
  TANDEM_REQUIRE(!plan.empty(), InvalidArgument, "pipeline plan has no stages");
  TANDEM_REQUIRE(times.forward > 0 && times.backward > 0 && times.transfer >= 0, InvalidArgument,
                 "pipeline times must be positive (transfer non-negative): forward {}, backward {}, transfer {}",
                 times.forward, times.backward, times.transfer);
  for (const auto* per_stage : {&times.stage_forward, &times.stage_backward}) {
    TANDEM_REQUIRE(per_stage->empty() || per_stage->size() == plan.size(), InvalidArgument,
                   "pipeline times: {} per-stage times for {} stages", per_stage->size(), plan.size());
    for (const double t : *per_stage) {
      TANDEM_REQUIRE(t > 0, InvalidArgument, "pipeline times: a stage's time is {}; it must be positive", t);
    }
  }
  return Simulator(plan, times, semantics).run();
}

// ---------------------------------------------------------------------------------------------
// The table

namespace {

constexpr size_t kLineWidth = 120;
constexpr long kMaxSlots = 512;

void trim_right(std::string& line) {
  while (!line.empty() && line.back() == ' ') line.pop_back();
}

}  // namespace

std::string format_pipeline_table(const PipelineConfig& config, const PipelineSimulation& simulation) {
  const int p = static_cast<int>(simulation.timeline.size());
  TANDEM_REQUIRE(p == config.stages, InvalidArgument,
                 "format_pipeline_table: the simulation has {} stages, the config {}", p, config.stages);
  // One slot is the shortest computation.
  double unit = 0;
  for (const auto& stage : simulation.timeline) {
    for (const TimedAction& t : stage) {
      if (t.action.is_compute() && (unit == 0 || t.end - t.start < unit)) unit = t.end - t.start;
    }
  }
  if (unit <= 0) unit = 1;
  const long slots = std::lround(std::ceil(simulation.makespan / unit - 1e-9));
  const long shown = std::min(slots, kMaxSlots);

  bool rounded = false;
  auto slot_of = [&](double time) {
    const double exact = time / unit;
    const long slot = std::lround(exact);
    rounded = rounded || std::abs(exact - static_cast<double>(slot)) > 1e-9;
    return slot;
  };
  // grid[d][slot]: a computation's label in its first slot, "-" in the slots it goes on for.
  std::vector<std::vector<std::string>> grid(p, std::vector<std::string>(shown, "."));
  size_t width = std::to_string(std::max(shown - 1, 0L)).size();
  for (int d = 0; d < p; ++d) {
    for (const TimedAction& t : simulation.timeline[d]) {
      if (!t.action.is_compute()) continue;
      const long first = slot_of(t.start);
      const long last = std::max(first + 1, slot_of(t.end));
      const std::string label = to_string(t.action);
      width = std::max(width, label.size());
      for (long s = first; s < last && s < shown; ++s) grid[d][s] = s == first ? label : "-";
    }
  }

  std::string out =
      fmt::format("{}: {} stages, {} micro-batches", pipeline_schedule_name(config.schedule), p, config.microbatches);
  if (config.virtual_stages > 1) out += fmt::format(", {} chunks per stage", config.virtual_stages);
  out += fmt::format("; one slot = {:g}{}\n", unit, rounded ? " (times rounded to whole slots)" : "");
  const std::string stage_label = fmt::format("stage {}", p - 1);
  const size_t prefix = stage_label.size() + 2;
  const long per_block = std::max<long>(1, static_cast<long>((kLineWidth - prefix) / (width + 1)));
  for (long begin = 0; begin < shown; begin += per_block) {
    const long end = std::min(shown, begin + per_block);
    if (begin > 0) out += "\n";
    std::string line(prefix, ' ');
    for (long s = begin; s < end; ++s) line += fmt::format("{:<{}} ", s, width);
    trim_right(line);
    out += line + "\n";
    for (int d = 0; d < p; ++d) {
      line = fmt::format("{:<{}}", fmt::format("stage {}", d), prefix);
      for (long s = begin; s < end; ++s) line += fmt::format("{:<{}} ", grid[d][s], width);
      trim_right(line);
      out += line + "\n";
    }
  }
  if (shown < slots) out += fmt::format("(cut short: slots 0-{} of {} shown)\n", shown - 1, slots);
  const double predicted = predicted_bubble(config);
  out += fmt::format("bubble: {:.3f} (predicted {} = {:.3f})\n", simulation.bubble_fraction(),
                     predicted_formula(config), predicted);
  return out;
}

}  // namespace tandem::strategy
