// bench_pipeline — the pipeline bubble measured against the formula. An MLP cut into --stages
// stages, one logical CPU device (one core) each, trains under strategy::PipelineRunner for each
// schedule and micro-batch count; the table shows the step time, each stage's measured forward
// and backward time per micro-batch, the measured bubble (the stages' mean idle share of the
// step), the formula's (p-1)/(m+p-1), and the schedule simulator's bubble with the measured
// times (which allows for stages that are not equally fast).
//
//   bench_pipeline [--stages 2] [--microbatches 1,2,4,8] [--schedules gpipe,1f1b,interleaved-1f1b]
//                  [--width 512] [--layers 2] [--chunks 2] [--batch 512] [--steps 8]
//
// Interleaved 1F1B splits each stage's layers into --chunks chunks (the same model); its
// formula is (p-1)/(v·m+p-1), and it skips micro-batch counts that are not multiples of p.
//
// Backward recomputes the stage's forward (PipelineRunner's re-materialisation), so "backward"
// here is a forward and a backward. Transfers are in-process copies (a few microseconds). The
// ceiling is the formula: no schedule of these computations can idle less than (p-1)/(m+p-1) of a
// step when the stages are equally fast. No peer is timed: PyTorch's pipelining API needs one
// process per stage and its bubble is the same formula.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "machine_info.h"
#include "tandem/collective/in_process.h"
#include "tandem/devices/device.h"
#include "tandem/graph/autodiff.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/pipeline_runner.h"
#include "tandem/strategy/variable.h"

using namespace tandem;
using graph::Output;

namespace {

struct Options {
  int stages = 2;
  std::vector<int> microbatches{1, 2, 4, 8};
  std::vector<std::string> schedules{"gpipe", "1f1b", "interleaved-1f1b"};
  std::int64_t width = 512;
  int layers = 2;  // per stage
  int chunks = 2;  // model chunks per stage under interleaved 1F1B
  std::int64_t batch = 512;
  int steps = 8;
};

// Virtual stage vs of `stages` (chunk vs / devices of device vs % devices): `layers` Dense(width,
// tanh) layers; the last adds the MSE loss.
strategy::PipelineStage make_stage(int vs, int stages, int layers, const Options& o, devices::Device& device) {
  auto g = std::make_shared<graph::Graph>();
  strategy::PipelineStage st;
  st.index = vs % o.stages;
  st.chunk = vs / o.stages;
  st.device = &device;
  const int s = vs;
  Output h = g->placeholder(kFloat32, {-1, o.width}, s == 0 ? "x" : "input");
  if (s == 0) {
    st.data.push_back({h, 0});
  } else {
    st.input = h;
  }
  std::mt19937 rng(static_cast<unsigned>(s + 1));
  const float limit = std::sqrt(3.0f / static_cast<float>(o.width));
  std::uniform_real_distribution<float> u(-limit, limit);
  for (int l = 0; l < layers; ++l) {
    std::vector<float> w(static_cast<std::size_t>(o.width * o.width));
    for (auto& e : w) e = u(rng);
    st.variables.push_back(g->variable(kFloat32, {o.width, o.width}, fmt::format("s{}l{}/kernel", s, l)));
    st.values.push_back(Tensor::from_vector(w, {o.width, o.width}, device));
    h = ops::tanh(ops::matmul(h, st.variables.back()));
  }
  if (s == stages - 1) {
    const Output y = g->placeholder(kFloat32, {-1, o.width}, "y");
    st.data.push_back({y, 1});
    const Output sum = ops::reduce_sum(ops::square(h - y));
    st.loss = sum * ops::scalar_like(sum, 1.0 / static_cast<double>(o.batch));
  } else {
    st.output = h;
    st.output_gradient = g->placeholder(kFloat32, {-1, o.width}, "output_gradient");
  }
  st.add_gradients();
  st.graph = g;
  return st;
}

struct Row {
  std::string schedule;
  int microbatches = 0;
  double step_ms = 0, forward_ms = 0, backward_ms = 0, measured = 0, formula = 0, simulated = 0;
};

Row measure(const Options& o, strategy::PipelineSchedule schedule, int m) {
  // Interleaved: each device's layers in o.chunks chunks (the same model in all).
  const int v = schedule == strategy::PipelineSchedule::kInterleaved1F1B ? o.chunks : 1;
  std::vector<strategy::PipelineStage> stages;
  for (int d = 0; d < o.stages; ++d) {
    for (int c = 0; c < v; ++c) {
      stages.push_back(
          make_stage(c * o.stages + d, o.stages * v, o.layers / v, o, devices::get_device(fmt::format("CPU:{}", d))));
    }
  }
  auto comms = collective::make_in_process_group(o.stages);
  std::vector<collective::Communicator*> group;
  for (auto& c : comms) group.push_back(c.get());
  const strategy::PipelineConfig config{
      .stages = o.stages, .microbatches = m, .virtual_stages = v, .schedule = schedule};
  strategy::PipelineRunner runner(std::move(stages), config, group);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> xs(static_cast<std::size_t>(o.batch * o.width)), ys(xs.size());
  for (auto& e : xs) e = normal(rng);
  for (auto& e : ys) e = 0.5f * normal(rng);
  const Tensor x = Tensor::from_vector(xs, {o.batch, o.width}), y = Tensor::from_vector(ys, {o.batch, o.width});
  const std::int64_t rows = o.batch / m;
  std::vector<std::vector<Tensor>> mbs;
  for (int k = 0; k < m; ++k) {
    mbs.push_back({strategy::flat_view(x, k * rows * o.width, rows * o.width).reshape({rows, o.width}),
                   strategy::flat_view(y, k * rows * o.width, rows * o.width).reshape({rows, o.width})});
  }
  for (int w = 0; w < 2; ++w) runner.step(mbs);  // plans made, memory touched
  Row row{.schedule = std::string(strategy::pipeline_schedule_name(schedule)), .microbatches = m};
  std::vector<double> forward(static_cast<std::size_t>(o.stages * v)), backward(forward.size());
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < o.steps; ++step) {
    const auto r = runner.step(mbs);
    for (std::size_t s = 0; s < forward.size(); ++s) {
      forward[s] += r.forward_seconds[s];
      backward[s] += r.backward_seconds[s];
    }
  }
  const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / o.steps;
  // Per device (its chunks together) and per chunk (the simulator's unit).
  std::vector<double> device_compute(static_cast<std::size_t>(o.stages), 0.0);
  double idle = 0, f_mean = 0, b_mean = 0;
  strategy::PipelineTimes times;
  for (std::size_t i = 0; i < forward.size(); ++i) {
    device_compute[i / static_cast<std::size_t>(v)] += (forward[i] + backward[i]) / o.steps;
    f_mean += forward[i] / o.steps / m;
    b_mean += backward[i] / o.steps / m;
  }
  for (const double compute : device_compute) idle += 1.0 - compute / step_s;
  for (std::size_t d = 0; d < device_compute.size(); ++d) {
    // A chunk's time: its device's chunks averaged (the simulator takes one time per device).
    double f = 0, b = 0;
    for (int c = 0; c < v; ++c) {
      f += forward[d * static_cast<std::size_t>(v) + static_cast<std::size_t>(c)] / o.steps / m / v;
      b += backward[d * static_cast<std::size_t>(v) + static_cast<std::size_t>(c)] / o.steps / m / v;
    }
    times.stage_forward.push_back(f);
    times.stage_backward.push_back(b);
  }
  const double p = o.stages;
  row.step_ms = step_s * 1e3;
  row.forward_ms = f_mean / p * 1e3;  // per micro-batch and device, its chunks together
  row.backward_ms = b_mean / p * 1e3;
  row.measured = idle / p;
  row.formula = strategy::predicted_bubble(config);
  if (std::getenv("BENCH_PIPELINE_DEBUG") != nullptr) {
    for (std::size_t s = 0; s < forward.size(); ++s) {
      std::printf("  stage %zu: forward %.2f ms, backward %.2f ms a step; step %.2f ms\n", s,
                  forward[s] / o.steps * 1e3, backward[s] / o.steps * 1e3, step_s * 1e3);
    }
  }
  row.simulated = strategy::simulate_pipeline(strategy::make_pipeline_schedule(config), times).bubble_fraction();
  return row;
}

}  // namespace

int main(int argc, char** argv) try {
  Options o;
  CLI::App app("bench_pipeline: the pipeline bubble, measured beside (p-1)/(m+p-1)");
  app.add_option("--stages", o.stages, "stages, one logical CPU device each")->capture_default_str();
  app.add_option("--microbatches", o.microbatches, "micro-batch counts, comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--schedules", o.schedules, "gpipe, 1f1b, interleaved-1f1b, comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--width", o.width, "features of every layer")->capture_default_str();
  app.add_option("--layers", o.layers, "Dense layers per stage")->capture_default_str();
  app.add_option("--chunks", o.chunks, "model chunks per stage under interleaved 1F1B (divides --layers)")
      ->capture_default_str();
  app.add_option("--batch", o.batch, "rows per step (divided among the micro-batches)")->capture_default_str();
  app.add_option("--steps", o.steps, "timed steps per row")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  devices::set_logical_device_configuration({.num_cpu_devices = o.stages});
  std::printf("bench_pipeline on %s, %s; %s\n", bench::cpu_model().c_str(), bench::memory_total().c_str(),
              bench::now_text().c_str());
  std::printf(
      "%d stages x %d Dense(%lld, tanh) each, batch %lld, %d logical CPU devices (one core each on a machine "
      "with as many), %d timed steps a row\n",
      o.stages, o.layers, static_cast<long long>(o.width), static_cast<long long>(o.batch), o.stages, o.steps);
  std::printf("%-16s %4s %9s %8s %8s %9s %9s %9s %9s\n", "sched", "m", "step ms", "fwd ms", "bwd ms", "measured",
              "formula", "simulated", "meas-sim");
  for (const auto& name : o.schedules) {
    const auto schedule = strategy::parse_pipeline_schedule(name);
    for (const int m : o.microbatches) {
      if (schedule == strategy::PipelineSchedule::kInterleaved1F1B && m % o.stages != 0) continue;  // Megatron's rule
      const Row r = measure(o, schedule, m);
      std::printf("%-16s %4d %9.2f %8.3f %8.3f %9.3f %9.3f %9.3f %+9.3f\n", r.schedule.c_str(), r.microbatches,
                  r.step_ms, r.forward_ms, r.backward_ms, r.measured, r.formula, r.simulated, r.measured - r.simulated);
    }
  }
  std::printf(
      "fwd/bwd: per micro-batch and device (its chunks together), averaged over devices (bwd recomputes the forward). "
      "measured: the "
      "stages' mean idle share of the step. simulated: the schedule run with each stage's measured times.\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_pipeline: %s\n", e.what());
  return 1;
}
