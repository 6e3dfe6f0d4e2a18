// tandem/strategy/pipeline_schedule.h — pipeline-parallel schedules (GPipe, 1F1B, interleaved
// 1F1B), a discrete-event simulator of them and a printable schedule table. Pure logic: nothing
// here communicates.
//
// Who calls: a pipeline runner (one per stage, i.e. per device) asks make_pipeline_schedule for
// its stage's ordered action list and executes it: forward and backward computations of one
// micro-batch on one model chunk, and the point-to-point transfers between neighbouring stages
// (activations downstream, gradients upstream). Tools and tests call simulate_pipeline and
// format_pipeline_table to see what a schedule costs before any device runs it.
//
// The schedules (p stages, m micro-batches, v model chunks per stage):
//   GPipe (arXiv:1811.06965): every forward, then every backward, micro-batches in order. Every
//     stage holds m micro-batches' activations at its peak.
//   1F1B (PipeDream-Flush, Megatron-LM's non-interleaved schedule): stage s runs min(p-s-1, m)
//     warm-up forwards, then alternates one forward and one backward, then drains the remaining
//     backwards. Stage s holds at most min(p-s, m) micro-batches' activations. Same bubble as GPipe,
//     (p-1)/(m+p-1).
//   Interleaved 1F1B (Megatron-LM, arXiv:2104.04473 §2.2): each device holds v chunks; chunk c of
//     device d is virtual stage c·p+d, so device p-1's chunk c feeds device 0's chunk c+1. The order
//     of computations is Megatron's (warm-up of 2(p-d-1)+(v-1)p forwards, all of them when m = p);
//     m must be a multiple of p, as Megatron-LM requires. Bubble (p-1)/(v·m+p-1).
//
// Send/recv semantics the action lists assume: BLOCKING RENDEZVOUS. A send and its matching recv
// complete together; neither completes before the peer has posted the other. Each send is matched
// by the next recv from the same stage on the peer, in list order, and the two agree on kind,
// micro-batch and chunk, so a transport without tags pairs them right. The lists are deadlock-free
// under these semantics by construction: every transfer has one place in a single global order (the
// time the consumer needs it in a unit-time reference run of the schedule, then activations before
// gradients, then micro-batch, then virtual stage), and every stage's list holds its transfers in
// that order, so the earliest unfinished transfer can always complete. A recv sits right before the
// computation that needs it, a send after the one that produced it, both where the consumer is
// about to run in the reference run; with equal forward and backward chunk times that is the ideal
// timing, so the simulated bubble is exactly the formula. GPipe and 1F1B keep it when the backward
// time differs (the tests try ½, 2 and 3 times the forward): their stages meet when both are
// between computations. Interleaved 1F1B does not when the times differ: its transfers have slack,
// and a rendezvous placed for equal times holds a sender that is ahead (e.g. p=4, m=8, v=2,
// backward twice forward: 0.226 against 0.158). Pairing transfers into one simultaneous send_recv
// is not needed for deadlock freedom and would not help there. An executor may instead run the
// lists with asynchronous sends (isend) and blocking recvs (SendSemantics::kBuffered in the
// simulator): a list that is deadlock-free under rendezvous stays so, and no action completes
// later.
//
// Blocks: nothing. Throws: InvalidArgument naming the field and its value for a bad
// PipelineConfig, the name list for an unknown schedule name, and the stage, position and action
// for a malformed action list given to simulate_pipeline (a peer out of range, a backward before
// its forward, a send met by a recv of another micro-batch); FailedPrecondition naming every
// blocked stage and the action it waits on when a list deadlocks in the simulator.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tandem::strategy {

enum class PipelineSchedule { kGPipe, k1F1B, kInterleaved1F1B };

// "gpipe", "1f1b", "interleaved-1f1b".
std::string_view pipeline_schedule_name(PipelineSchedule schedule);
// Those names in any case, and "interleaved"; anything else is InvalidArgument listing them.
PipelineSchedule parse_pipeline_schedule(std::string_view name);

// One step of a stage's list. Computations (kForward, kBackward) have peer -1; transfers name the
// stage (device rank in the pipeline group) on the other end. chunk is the model chunk on this
// device (0 unless interleaved): the chunk the computation runs, or the chunk whose input (recv of
// an activation, send of a gradient) or output (send of an activation, recv of a gradient) the
// transfer carries.
struct PipelineAction {
  enum class Kind { kForward, kBackward, kRecvActivation, kSendActivation, kRecvGradient, kSendGradient };
  Kind kind = Kind::kForward;
  int microbatch = 0;
  int chunk = 0;
  int peer = -1;

  bool is_compute() const { return kind == Kind::kForward || kind == Kind::kBackward; }
  bool is_send() const { return kind == Kind::kSendActivation || kind == Kind::kSendGradient; }
  bool is_recv() const { return kind == Kind::kRecvActivation || kind == Kind::kRecvGradient; }
  friend bool operator==(const PipelineAction&, const PipelineAction&) = default;
};

// "F3", "B3", "F3.1" (chunk 1), "recv-act 3 from 0", "send-grad 3.1 to 2", ...
std::string to_string(const PipelineAction& action);

struct PipelineConfig {
  int stages = 1;
  int microbatches = 1;
  int virtual_stages = 1;  // model chunks per stage; > 1 only for kInterleaved1F1B
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
};

// Throws InvalidArgument naming the field and value (see the file comment).
void validate_pipeline_config(const PipelineConfig& config);

// Stage s's ordered actions at [s], s = 0..stages-1, transfers included.
using PipelinePlan = std::vector<std::vector<PipelineAction>>;
PipelinePlan make_pipeline_schedule(const PipelineConfig& config);

// (p-1)/(m+p-1); interleaved (p-1)/(v·m+p-1). Validates the config.
double predicted_bubble(const PipelineConfig& config);

// Times of one micro-batch on one model chunk (interleaved: pass the whole stage's times / v).
// transfer is the time a send/recv pair takes once both ends are there.
struct PipelineTimes {
  double forward = 1;
  double backward = 1;
  double transfer = 0;
  // Per stage (one entry per stage, or empty: the uniform times above): stages that are not
  // equally fast, as measured.
  std::vector<double> stage_forward, stage_backward;
};

enum class SendSemantics {
  kRendezvous,  // what the lists assume: a send completes with its recv, both ends wait
  kBuffered,    // sends are asynchronous (isend): the sender goes on, the data arrives after transfer
};

// One executed action: start is when the stage reached it, end when it completed.
struct TimedAction {
  PipelineAction action;
  double start = 0;
  double end = 0;
};

struct PipelineSimulation {
  double makespan = 0;                             // every stage starts at 0
  std::vector<double> busy;                        // compute time per stage
  std::vector<std::vector<TimedAction>> timeline;  // per stage, every action in list order
  // Per stage, the most (micro-batch, chunk) pairs whose forward is done and backward not yet:
  // for interleaved 1F1B each holds 1/v of the stage's layers' activations.
  std::vector<int> peak_live_activations;

  // Idle (not computing) time over the makespan, averaged over the stages: (p-1)/(m+p-1) for GPipe
  // and 1F1B with any forward and backward times and no transfer time.
  double bubble_fraction() const;
};

// Runs each stage's list in order: computations take their time, transfers follow `semantics`.
// Throws InvalidArgument for a malformed plan, FailedPrecondition on a deadlock (see above).
PipelineSimulation simulate_pipeline(const PipelinePlan& plan, const PipelineTimes& times = {},
                                     SendSemantics semantics = SendSemantics::kRendezvous);

// One row per stage, one column per time slot (the shortest computation's time): "F0", "B0",
// "F0.1" for chunk 1, "." for idle; then the simulated bubble beside the predicted one, e.g.
//   bubble: 0.429 (predicted (p-1)/(m+p-1) = 3/7 = 0.429)
// Rows wrap in blocks of at most 120 characters; beyond 512 slots the table is cut short and says
// so. Times that are not whole slots (a transfer time) are rounded to the nearest slot.
std::string format_pipeline_table(const PipelineConfig& config, const PipelineSimulation& simulation);

}  // namespace tandem::strategy
