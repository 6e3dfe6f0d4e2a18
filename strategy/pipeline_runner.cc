// The pipeline runner: each stage's thread walks its schedule list (pipeline_schedule.h), running
// forward and backward passes of its graph and the transfers between neighbours.
#include "tandem/strategy/pipeline_runner.h"

#include <chrono>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "tandem/base/errors.h"
#include "tandem/graph/autodiff.h"

namespace tandem::strategy {
namespace {

using Clock = std::chrono::steady_clock;
using Kind = PipelineAction::Kind;

// The error `code` names, with `message`: how a stage's failure keeps its type when rethrown.
[[noreturn]] void throw_with_code(ErrorCode code, const std::string& message) {
  switch (code) {
    case ErrorCode::kInvalidArgument: throw InvalidArgument(message);
    case ErrorCode::kFailedPrecondition: throw FailedPrecondition(message);
    case ErrorCode::kNotFound: throw NotFound(message);
    case ErrorCode::kAlreadyExists: throw AlreadyExists(message);
    case ErrorCode::kPermissionDenied: throw PermissionDenied(message);
    case ErrorCode::kUnauthenticated: throw Unauthenticated(message);
    case ErrorCode::kOutOfRange: throw OutOfRange(message);
    case ErrorCode::kDeadlineExceeded: throw DeadlineExceeded(message);
    case ErrorCode::kUnavailable: throw Unavailable(message);
    case ErrorCode::kResourceExhausted: throw ResourceExhausted(message);
    case ErrorCode::kDataLoss: throw DataLoss(message);
    case ErrorCode::kUnimplemented: throw Unimplemented(message);
    case ErrorCode::kInternal: throw Internal(message);
  }
  throw Internal(message);
}

std::string_view action_name(Kind kind) {
  switch (kind) {
    case Kind::kForward: return "forward";
    case Kind::kBackward: return "backward";
    case Kind::kRecvActivation: return "recv of its input activation";
    case Kind::kSendActivation: return "send of its output activation";
    case Kind::kRecvGradient: return "recv of its output's gradient";
    case Kind::kSendGradient: return "send of its input's gradient";
  }
  return "action";
}

// ", chunk c" where stages hold several chunks.
std::string chunk_text(int chunks, int chunk) { return chunks > 1 ? fmt::format(" chunk {}", chunk) : std::string(); }

// `spec`'s shape with its unknown batch dimension set to `rows`.
Shape with_rows(const Shape& shape, std::int64_t rows) {
  Shape out = shape;
  if (out.rank() > 0 && out[0] == Shape::kUnknown) out[0] = rows;
  return out;
}

}  // namespace

void PipelineStage::add_gradients() {
  std::vector<graph::Output> xs = variables;
  if (input.defined()) xs.push_back(input);
  std::vector<graph::Output> grads;
  if (loss.defined()) {
    grads = graph::gradients({&loss, 1}, xs, {}, {.unconnected = graph::UnconnectedGradients::kZero});
  } else {
    grads =
        graph::gradients({&output, 1}, xs, {&output_gradient, 1}, {.unconnected = graph::UnconnectedGradients::kZero});
  }
  if (input.defined()) {
    input_gradient = grads.back();
    grads.pop_back();
  }
  gradients = std::move(grads);
}

double PipelineStepResult::loss() const {
  double sum = 0;
  for (const double l : losses) sum += l;
  return sum;
}

PipelineRunner::PipelineRunner(std::vector<PipelineStage> stages, PipelineConfig config,
                               std::vector<collective::Communicator*> communicators, PipelineRunnerOptions options)
    : stages_(std::move(stages)),
      config_(config),
      communicators_(std::move(communicators)),
      options_(std::move(options)) {
  const int p = config_.stages, v = config_.virtual_stages;
  plan_ = make_pipeline_schedule(config_);  // validates the config
  if (options_.forward_only) {
    for (auto& actions : plan_) {
      std::erase_if(actions, [](const PipelineAction& a) {
        return a.kind != Kind::kForward && a.kind != Kind::kRecvActivation && a.kind != Kind::kSendActivation;
      });
    }
  }
  TANDEM_REQUIRE(!stages_.empty() && static_cast<int>(stages_.size()) <= p * v, InvalidArgument,
                 "PipelineRunner: {} stages given for a pipeline of {} stage{} x {} chunk{}", stages_.size(), p,
                 p == 1 ? "" : "s", v, v == 1 ? "" : "s");
  // Group the stages by device, each device's chunks 0..v-1 in order.
  for (std::size_t i = 0; i < stages_.size(); ++i) {
    auto& st = stages_[i];
    if (st.index < 0) st.index = v == 1 ? static_cast<int>(i) : static_cast<int>(i) / v;
    if (devices_.empty() || devices_.back().index != st.index) {
      TANDEM_REQUIRE(st.index < p && (devices_.empty() || st.index > devices_.back().index), InvalidArgument,
                     "PipelineRunner: stage {} (position {}) is not in [0, {}) after the stages before it", st.index, i,
                     p);
      devices_.push_back({.index = st.index});
    }
    Device& device = devices_.back();
    TANDEM_REQUIRE(st.chunk == static_cast<int>(device.chunks.size()) && st.chunk < v, InvalidArgument,
                   "PipelineRunner: stage {} chunk {} (position {}): give each stage's chunks 0 to {} in order",
                   st.index, st.chunk, i, v - 1);
    device.chunks.push_back(i);
  }
  TANDEM_REQUIRE(communicators_.size() == devices_.size(), InvalidArgument,
                 "PipelineRunner: {} stages but {} communicators; give stage s rank s of one group", devices_.size(),
                 communicators_.size());
  for (std::size_t k = 0; k < devices_.size(); ++k) {
    Device& device = devices_[k];
    const int s = device.index;
    TANDEM_REQUIRE(static_cast<int>(device.chunks.size()) == v, InvalidArgument,
                   "PipelineRunner: stage {} has {} chunk graphs; interleaving gives each stage {}", s,
                   device.chunks.size(), v);
    device.communicator = communicators_[k];
    const auto* c = device.communicator;
    TANDEM_REQUIRE(c != nullptr && c->rank() == s && c->size() == p, InvalidArgument,
                   "PipelineRunner: stage {}'s communicator must be rank {} of a group of {}", s, s, p);
  }
  for (std::size_t i = 0; i < stages_.size(); ++i) {
    const PipelineStage& st = stages_[i];
    const int s = st.index;
    const int virtual_stage = st.chunk * p + s;
    const bool first = virtual_stage == 0, last = virtual_stage == p * v - 1;
    const std::string name = v == 1 ? fmt::format("stage {}", s) : fmt::format("stage {} chunk {}", s, st.chunk);
    TANDEM_REQUIRE(st.graph != nullptr && st.device != nullptr, InvalidArgument,
                   "PipelineRunner: {} has no graph or no device", name);
    // The gradient sums are added on the host: GPU stages wait for an on-device sum.
    TANDEM_REQUIRE(st.device->type() == devices::DeviceType::kCPU, Unimplemented,
                   "PipelineRunner: {} is on {}; pipeline stages run on CPU devices only for now", name,
                   st.device->short_name());
    TANDEM_REQUIRE(first != st.input.defined(), InvalidArgument,
                   "PipelineRunner: {} {} an input placeholder; every stage but the first needs one", name,
                   first ? "has" : "lacks");
    if (options_.forward_only) {
      TANDEM_REQUIRE(last != st.output.defined() && (!last || st.loss.defined() || !st.fetches.empty()),
                     InvalidArgument, "PipelineRunner: {} must have {}", name,
                     last ? "a loss or fetches, and no output" : "an output");
    } else {
      TANDEM_REQUIRE(
          last != st.output.defined() && last == st.loss.defined() && last != st.output_gradient.defined(),
          InvalidArgument,
          "PipelineRunner: {} must have {} (the last stage a loss; the others an output and an output_gradient "
          "placeholder)",
          name, last ? "a loss and no output" : "an output, an output_gradient and no loss");
      TANDEM_REQUIRE(first || st.input_gradient.defined(), InvalidArgument,
                     "PipelineRunner: {} has no input_gradient (call add_gradients())", name);
      TANDEM_REQUIRE(st.gradients.size() == st.variables.size(), InvalidArgument,
                     "PipelineRunner: {} has {} variables and {} gradients", name, st.variables.size(),
                     st.gradients.size());
    }
    TANDEM_REQUIRE(st.values.size() == st.variables.size(), InvalidArgument,
                   "PipelineRunner: {} has {} variables and {} values", name, st.variables.size(), st.values.size());
    auto executor = std::make_unique<graph::Executor>(st.graph, *st.device);
    for (std::size_t k = 0; k < st.variables.size(); ++k) executor->bind_variable(st.variables[k], st.values[k]);
    executors_.push_back(std::move(executor));
  }
  // Neighbouring virtual stages that are both here must chain.
  std::map<int, const PipelineStage*> by_virtual_stage;
  for (const auto& st : stages_) by_virtual_stage[st.chunk * p + st.index] = &st;
  for (const auto& [vs, st] : by_virtual_stage) {
    const auto next = by_virtual_stage.find(vs + 1);
    if (next == by_virtual_stage.end()) continue;  // the neighbour is elsewhere
    const auto& out = st->output;
    const auto& in = next->second->input;
    bool same = out.dtype() == in.dtype() && out.shape().rank() == in.shape().rank();
    for (int d = 1; same && d < out.shape().rank(); ++d) same = out.shape()[d] == in.shape()[d];
    TANDEM_REQUIRE(same, InvalidArgument, "PipelineRunner: stage {}'s output is {} {} but stage {}'s input is {} {}",
                   vs, graph::dtype_name(out.dtype()), out.shape(), vs + 1, graph::dtype_name(in.dtype()), in.shape());
  }
}

PipelineRunner::~PipelineRunner() = default;

PipelineStepResult PipelineRunner::step(const std::vector<std::vector<Tensor>>& microbatches) {
  TANDEM_REQUIRE(static_cast<int>(microbatches.size()) == config_.microbatches, InvalidArgument,
                 "PipelineRunner::step: {} micro-batches given; the schedule has {}", microbatches.size(),
                 config_.microbatches);
  const std::size_t p = stages_.size();  // the local ones
  PipelineStepResult result;
  const PipelineStage& last = stages_.back();
  result.has_loss = last.index == config_.stages - 1 && last.chunk == config_.virtual_stages - 1;
  result.losses.assign(microbatches.size(), 0.0);
  result.fetched.assign(microbatches.size(), {});
  result.gradients.resize(p);
  result.peak_stashed.assign(p, 0);
  result.forward_seconds.assign(p, 0.0);
  result.backward_seconds.assign(p, 0.0);
  // The first failure (run_device has named its stage, micro-batch and action), as Strategy::run
  // keeps its replicas' first error.
  std::mutex mutex;
  std::exception_ptr first_error;
  const auto run = [&](std::size_t k) {
    try {
      run_device(devices_[k], microbatches, result);
    } catch (const std::exception& e) {
      {
        std::lock_guard lock(mutex);
        if (!first_error) first_error = std::current_exception();
      }
      // Neighbours waiting on this stage stop now, not at their timeout.
      devices_[k].communicator->abort(e.what());
    }
  };
  std::vector<std::thread> threads;
  for (std::size_t k = 1; k < devices_.size(); ++k) threads.emplace_back(run, k);
  run(0);
  for (auto& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
  return result;
}

void PipelineRunner::run_device(const Device& device, const std::vector<std::vector<Tensor>>& microbatches,
                                PipelineStepResult& result) {
  const int s = device.index, v = config_.virtual_stages;
  collective::Communicator& comm = *device.communicator;
  // Per (micro-batch, chunk): what is held between actions.
  std::map<std::pair<int, int>, Tensor> received, outputs, output_grads, input_grads;
  std::vector<int> live(device.chunks.size(), 0);
  const auto rows = [&](int mb) {
    const auto& element = microbatches[static_cast<std::size_t>(mb)];
    return element.empty() ? std::int64_t{0} : element[0].shape()[0];
  };
  for (const PipelineAction& a : plan_[static_cast<std::size_t>(s)]) {
    const int mb = a.microbatch;
    const std::pair<int, int> key{mb, a.chunk};
    const std::size_t index = device.chunks.at(static_cast<std::size_t>(a.chunk));
    PipelineStage& st = stages_[index];
    graph::Executor& executor = *executors_[index];
    std::vector<Tensor>& sums = result.gradients[index];
    const auto feeds = [&] {
      std::vector<graph::Feed> f;
      for (const auto& [placeholder, component] : st.data) {
        f.push_back({placeholder, microbatches[static_cast<std::size_t>(mb)].at(static_cast<std::size_t>(component))});
      }
      if (st.input.defined()) f.push_back({st.input, received.at(key)});
      return f;
    };
    try {
      if (options_.before_action) options_.before_action(s, a);
      switch (a.kind) {
        case Kind::kRecvActivation: {
          Tensor t = Tensor::empty(with_rows(st.input.shape(), rows(mb)), st.input.dtype(), *st.device);
          comm.recv(t, a.peer, options_.transfers);
          received[key] = std::move(t);
          break;
        }
        case Kind::kForward: {
          const auto start = Clock::now();
          std::vector<graph::Output> fetch;
          if (st.loss.defined() || st.output.defined()) fetch.push_back(st.loss.defined() ? st.loss : st.output);
          fetch.insert(fetch.end(), st.fetches.begin(), st.fetches.end());
          auto out = executor.run(feeds(), fetch);
          result.forward_seconds[index] += std::chrono::duration<double>(Clock::now() - start).count();
          if (!st.fetches.empty()) {
            auto& fetched = result.fetched[static_cast<std::size_t>(mb)];
            for (std::size_t k = fetch.size() - st.fetches.size(); k < out.size(); ++k) fetched.push_back(out[k].clone());
          }
          if (st.loss.defined()) {
            result.losses[static_cast<std::size_t>(mb)] = out[0].to_vector<float>().at(0);
          } else if (st.output.defined()) {
            outputs[key] = std::move(out[0]);
          }
          if (options_.forward_only) {  // nothing waits for a backward
            received.erase(key);
            break;
          }
          result.peak_stashed[index] = std::max(result.peak_stashed[index], ++live[static_cast<std::size_t>(a.chunk)]);
          break;
        }
        case Kind::kSendActivation:
          comm.send(outputs.at(key), a.peer, options_.transfers);
          outputs.erase(key);
          break;
        case Kind::kRecvGradient: {
          Tensor t = Tensor::empty(with_rows(st.output.shape(), rows(mb)), st.output.dtype(), *st.device);
          comm.recv(t, a.peer, options_.transfers);
          output_grads[key] = std::move(t);
          break;
        }
        case Kind::kBackward: {
          const auto start = Clock::now();
          auto f = feeds();
          if (st.output_gradient.defined()) f.push_back({st.output_gradient, output_grads.at(key)});
          std::vector<graph::Output> fetches = st.gradients;
          if (st.input_gradient.defined()) fetches.push_back(st.input_gradient);
          auto out = executor.run(f, fetches);
          if (st.input_gradient.defined()) {
            input_grads[key] = std::move(out.back());
            out.pop_back();
          }
          // Summed in micro-batch order on every run: the same sums, bitwise, run to run.
          if (sums.empty()) {
            for (const auto& g : out) sums.push_back(g.clone());
          } else {
            for (std::size_t k = 0; k < out.size(); ++k) {
              TANDEM_ASSERT(out[k].dtype() == graph::DType::kF32, "pipeline gradients are summed as float32");
              float* sum = sums[k].data<float>();
              const float* g = out[k].data<float>();
              for (std::int64_t i = 0; i < out[k].num_elements(); ++i) sum[i] += g[i];
            }
          }
          result.backward_seconds[index] += std::chrono::duration<double>(Clock::now() - start).count();
          received.erase(key);
          output_grads.erase(key);
          --live[static_cast<std::size_t>(a.chunk)];
          break;
        }
        case Kind::kSendGradient:
          comm.send(input_grads.at(key), a.peer, options_.transfers);
          input_grads.erase(key);
          break;
      }
    } catch (const Error& e) {
      throw_with_code(e.code(), fmt::format("pipeline stage {}{}, micro-batch {}, {}: {}", s, chunk_text(v, a.chunk),
                                            mb, action_name(a.kind), e.what()));
    } catch (const std::exception& e) {
      throw Internal(fmt::format("pipeline stage {}{}, micro-batch {}, {}: {}", s, chunk_text(v, a.chunk), mb,
                                 action_name(a.kind), e.what()));
    }
  }
}

}  // namespace tandem::strategy
