// Pipelines under fit (keras::distribution::ModelParallel with a stage axis of several devices):
// the model's layer calls, cut into virtual stages at compile (ModelParallel::planned_stages),
// become one graph per stage and model chunk on each local replica, run over micro-batches by a
// strategy::PipelineRunner per pipeline (the replicas sharing a data shard), in the schedule's
// order (GPipe, 1F1B, interleaved 1F1B). Each stage's variables live on its replicas only
// (ModelParallel::prepare_pipeline); the last stage computes the loss and the step's sums.
//
// A training step: each pipeline's runner runs forward and backward over its shard's
// micro-batches, the loss of each being its rows' losses times 1 / global batch, so that the
// gradients summed over micro-batches and pipelines are the global batch's mean, as one device's;
// then, on every replica in parallel (Strategy::run), the stage's gradients are summed over the
// batch axis (the replica's communicator: the same stage of every pipeline) and the optimizer
// updates the replica's variables (the others' copies hold nothing: their gradients are empty).
// Evaluation and prediction run forward only (the inference graphs, training = false).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "tandem/keras_like/detail/model_state.h"
#include "tandem/keras_like/distribution.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/pipeline_runner.h"

namespace tandem::keras::detail {
namespace {

constexpr std::size_t kNotTrained = static_cast<std::size_t>(-1);

// Rows [begin, begin + count) of every component: views, no copy.
data::Element rows_of(const data::Element& element, std::int64_t begin, std::int64_t count) {
  data::Element out;
  for (const Tensor& component : element) {
    const std::int64_t n = component.shape()[0];
    Shape shape = component.shape();
    shape[0] = count;
    const std::size_t row_bytes = static_cast<std::size_t>(component.shape().num_elements() / std::max<std::int64_t>(1, n)) *
                                  graph::dtype_size(component.dtype());
    out.emplace_back(shape, component.dtype(), component.buffer(),
                     component.byte_offset() + static_cast<std::size_t>(begin) * row_bytes);
  }
  return out;
}

// A shard's rows as `m` micro-batches (the first ones one row more when m does not divide), each
// with `extra` appended (the loss's scale).
std::vector<std::vector<Tensor>> microbatches(const data::Element& shard, int m, const std::vector<Tensor>& extra) {
  const std::int64_t n = shard.empty() ? 0 : shard.front().shape()[0];
  std::vector<std::vector<Tensor>> out;
  std::int64_t begin = 0;
  for (int i = 0; i < m; ++i) {
    const std::int64_t count = n / m + (i < n % m ? 1 : 0);
    auto mb = rows_of(shard, begin, count);
    mb.insert(mb.end(), extra.begin(), extra.end());
    out.push_back(std::move(mb));
    begin += count;
  }
  return out;
}

// The tensor that crosses the cut before call `cut` (cut_into_stages checked that exactly one
// does): made by an earlier call, read by a later call or a model output.
KerasTensor crossing(const ModelState& model, std::size_t cut) {
  std::set<const LayerNode*> before;
  for (std::size_t n = 0; n < cut; ++n) before.insert(model.nodes[n].get());
  const auto crosses = [&](const KerasTensor& t) { return before.contains(t.node().get()); };
  for (std::size_t n = cut; n < model.nodes.size(); ++n) {
    for (const auto& in : model.nodes[n]->inputs) {
      if (crosses(in)) return in;
    }
  }
  for (const auto& out : model.outputs) {
    if (crosses(out)) return out;
  }
  throw Internal(fmt::format("model \"{}\": no tensor crosses the pipeline cut before call {}", model.name, cut));
}

}  // namespace

struct Trainer::Pipeline {
  const distribution::ModelParallel* strategy = nullptr;
  strategy::PipelineConfig config;
  std::vector<VariablePtr> trainable;
  // One pipeline: the local replicas that share a data shard, one per stage.
  struct Line {
    // Training (forward and backward), evaluation (forward: the loss and metric sums) and
    // prediction (forward: the model's outputs).
    std::unique_ptr<strategy::PipelineRunner> train, infer, predict;
    // Per stage of the runners (in their order): its replica and, per variable, its index in
    // `trainable` (kNotTrained for a frozen one).
    std::vector<int> stage_replica;
    std::vector<std::vector<std::size_t>> trainable_index;
    int last_replica = -1;  // the replica of the last stage, when here
    // Whether its sums and outputs count: one pipeline per data shard (tensor parallelism runs
    // one per tensor rank, each computing the same loss).
    bool counts = true;
  };
  std::vector<Line> lines;
  std::size_t num_sums = 0;  // the last stage's fetched sums [loss, output losses..., metrics...]

  // A replica's sums when it computes none (not a last stage): zeros, of the sums' shape.
  StepSums zeros(std::size_t outputs) const {
    StepSums sums;
    sums.output_loss.assign(outputs > 1 ? outputs : 0, 0.0);
    sums.metrics.assign(num_sums - 1 - sums.output_loss.size(), 0.0);
    return sums;
  }

  // Every pipeline's `runner` over its shard's micro-batches (each with `extra` appended), at once.
  std::vector<strategy::PipelineStepResult> run(std::unique_ptr<strategy::PipelineRunner> Line::*runner,
                                                const std::vector<data::Element>& shards,
                                                const std::vector<Tensor>& extra);
  // Per local replica, a step's sums: from the last stages of the pipelines that count, zeros
  // elsewhere.
  std::vector<StepSums> step_sums(const std::vector<strategy::PipelineStepResult>& results,
                                  const std::vector<data::Element>& shards, std::size_t replicas,
                                  std::size_t outputs) const;
};

std::size_t Trainer::build_pipeline() {
  ModelState& model = model_;
  const auto& mp = dynamic_cast<const distribution::ModelParallel&>(*model.strategy);
  const distribution::PipelineOptions& options = *mp.pipeline();
  auto pipeline = std::make_shared<Pipeline>();
  Pipeline& P = *pipeline;
  P.strategy = &mp;
  const int p = options.stages, v = options.virtual_stages;
  P.config = {.stages = p, .microbatches = options.microbatches, .virtual_stages = v, .schedule = options.schedule};
  const auto& planned = mp.planned_stages();
  TANDEM_REQUIRE(static_cast<int>(planned.size()) == p * v, FailedPrecondition,
                 "model \"{}\": the pipeline's stages are not cut yet (ModelParallel::check_model)", model.name);
  // Virtual stage k runs calls [begin[k], begin[k + 1]).
  std::vector<std::size_t> begin{0};
  for (const auto& stage : planned) begin.push_back(begin.back() + static_cast<std::size_t>(stage.layer_calls));
  std::vector<KerasTensor> boundary;  // boundary[k]: what virtual stage k sends to k + 1
  for (int k = 0; k + 1 < p * v; ++k) boundary.push_back(crossing(model, begin[static_cast<std::size_t>(k) + 1]));

  for (const auto& layer : model.layers) {
    for (const auto& w : layer->trainable_weights()) {
      if (std::find(P.trainable.begin(), P.trainable.end(), w) == P.trainable.end()) P.trainable.push_back(w);
    }
  }
  const bool training = with_targets_ && model.compiled;
  if (training) model.optimizer->build(P.trainable);
  const std::size_t n_in = model.inputs.size(), n_out = model.outputs.size();
  std::size_t num_sums = 0;

  // Stage k's graph on local replica r: for training, for evaluation (with_targets) or for
  // prediction.
  const auto build_stage = [&](int k, int r, bool train_graph, bool with_targets) {
    const auto& devices = model.strategy->replica_devices();
    strategy::PipelineStage st;
    st.index = k % p;
    st.chunk = k / p;
    st.device = devices[static_cast<std::size_t>(r)];
    auto graph = std::make_shared<Graph>();
    CallContext::VariableNodes nodes;
    CallContext ctx(*graph, train_graph, nodes);
    LayerValues values;
    if (k == 0) {
      for (std::size_t i = 0; i < n_in; ++i) {
        Shape fed = element_spec_[i].shape;
        if (fed.rank() > 0) fed[0] = Shape::kUnknown;
        const Output x = graph->placeholder(element_spec_[i].dtype, fed, fmt::format("x_{}", i));
        st.data.emplace_back(x, static_cast<int>(i));
        const DType want = model.inputs[i].spec().dtype;
        values[model.inputs[i].node().get()] = {element_spec_[i].dtype == want ? x : ops::cast(x, want)};
      }
    } else {
      const KerasTensor& in = boundary[static_cast<std::size_t>(k) - 1];
      st.input = graph->placeholder(in.dtype(), in.shape(), "stage_input");
      auto& slot = values[in.node().get()];
      slot.resize(std::max<std::size_t>(slot.size(), in.node()->outputs.size()));
      slot[static_cast<std::size_t>(in.index())] = st.input;
    }
    run_layer_calls(model, ctx, values, begin[static_cast<std::size_t>(k)], begin[static_cast<std::size_t>(k) + 1]);
    if (k + 1 < p * v) {
      const KerasTensor& out = boundary[static_cast<std::size_t>(k)];
      st.output = values.at(out.node().get())[static_cast<std::size_t>(out.index())];
      if (train_graph) st.output_gradient = graph->placeholder(st.output.dtype(), st.output.shape(), "output_gradient");
    } else {
      std::vector<Output> outputs;
      for (const auto& out : model.outputs) {
        Output o = values.at(out.node().get())[static_cast<std::size_t>(out.index())];
        outputs.push_back(graph::is_low_precision(o.dtype()) ? ops::cast(o, DType::kF32) : o);
      }
      if (with_targets) {
        std::vector<Output> ys;
        for (std::size_t j = 0; j < n_out; ++j) {
          Shape fed = element_spec_[n_in + j].shape;
          if (fed.rank() > 0) fed[0] = Shape::kUnknown;
          ys.push_back(graph->placeholder(element_spec_[n_in + j].dtype, fed, fmt::format("y_{}", j)));
          st.data.emplace_back(ys.back(), static_cast<int>(n_in + j));
        }
        auto sums = step_sum_outputs(model, *graph, outputs, ys, "loss");
        st.fetches = sums.fetches;
        num_sums = sums.fetches.size();
        if (train_graph) {
          // The micro-batch's share of the global batch's mean loss: its loss sum times the scale fed.
          const Output scale = graph->placeholder(DType::kF32, {}, "loss_scale");
          st.data.emplace_back(scale, static_cast<int>(n_in + n_out));
          st.loss = sums.total * ops::cast(scale, sums.total.dtype());
        }
      } else {
        st.fetches = outputs;
      }
    }
    std::vector<std::size_t> index;
    for (const auto& variable : nodes.variables) {
      TANDEM_ASSERT(variable->value(r).shape() == variable->graph_shape(),
                    "model \"{}\": variable {} is not on replica {}, which runs pipeline stage {}", model.name,
                    variable->name(), r, k);
      st.variables.push_back(nodes.nodes.at(variable.get()));
      st.values.push_back(variable->value(r));
      const auto it = std::find(P.trainable.begin(), P.trainable.end(), variable);
      index.push_back(it == P.trainable.end() ? kNotTrained : static_cast<std::size_t>(it - P.trainable.begin()));
    }
    if (train_graph) st.add_gradients();
    st.graph = graph;
    return std::pair{std::move(st), std::move(index)};
  };

  // The pipelines here (the local replicas by pipeline: one per data shard, and per tensor rank
  // under tensor parallelism), each pipeline's stages in order.
  const auto replicas = static_cast<int>(model.strategy->replica_devices().size());
  std::map<int, std::vector<int>> by_pipeline;
  for (int r = 0; r < replicas; ++r) by_pipeline[mp.pipeline_of(r)].push_back(r);
  for (auto& [id, members] : by_pipeline) {
    std::sort(members.begin(), members.end(),
              [&](int a, int b) { return mp.pipeline_stage(a) < mp.pipeline_stage(b); });
    Pipeline::Line line;
    line.counts = mp.leads_pipeline(members.front());
    std::vector<strategy::PipelineStage> train_stages, infer_stages, predict_stages;
    std::vector<collective::Communicator*> communicators;
    for (const int r : members) {
      const int s = mp.pipeline_stage(r);
      communicators.push_back(mp.pipeline_communicator(r));
      if (s == p - 1) line.last_replica = r;
      for (int c = 0; c < v; ++c) {
        const int k = c * p + s;
        auto [predict, index] = build_stage(k, r, false, false);
        predict_stages.push_back(std::move(predict));
        if (training) {
          train_stages.push_back(build_stage(k, r, true, true).first);
          infer_stages.push_back(build_stage(k, r, false, true).first);
        }
        line.stage_replica.push_back(r);
        line.trainable_index.push_back(std::move(index));
      }
    }
    const strategy::PipelineRunnerOptions forward_only{.forward_only = true};
    if (training) {
      line.train = std::make_unique<strategy::PipelineRunner>(std::move(train_stages), P.config, communicators);
      line.infer =
          std::make_unique<strategy::PipelineRunner>(std::move(infer_stages), P.config, communicators, forward_only);
    }
    line.predict =
        std::make_unique<strategy::PipelineRunner>(std::move(predict_stages), P.config, communicators, forward_only);
    P.lines.push_back(std::move(line));
  }
  // What the last stage fetches, known on every worker (the last stage may be on another):
  // [loss, output losses (several outputs only)..., metrics...].
  std::size_t expected = 1 + (n_out > 1 ? n_out : 0);
  if (model.compiled) {
    for (const auto& out : model.compiled_outputs) expected += out.metrics.size();
  }
  TANDEM_ASSERT(num_sums == 0 || num_sums == expected, "model \"{}\": the last stage fetches {} sums, not {}",
                model.name, num_sums, expected);
  P.num_sums = expected;
  pipeline_ = std::move(pipeline);
  return expected;
}

namespace {

// Runs fn(line) for every pipeline at once (each runner runs its stages on threads of its own).
template <class Lines, class Fn>
void for_each_line(Lines& lines, const Fn& fn) {
  std::vector<std::thread> threads;
  std::exception_ptr first;
  std::mutex mutex;
  for (std::size_t i = 1; i < lines.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        fn(lines[i], i);
      } catch (...) {
        std::lock_guard lock(mutex);
        if (!first) first = std::current_exception();
      }
    });
  }
  try {
    if (!lines.empty()) fn(lines[0], 0);
  } catch (...) {
    std::lock_guard lock(mutex);
    if (!first) first = std::current_exception();
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// The last stage's fetched sums of every micro-batch, added up, as StepSums.
StepSums sums_of(const std::vector<std::vector<Tensor>>& fetched, std::size_t outputs, std::int64_t rows) {
  StepSums sums;
  std::vector<double> total;
  for (const auto& mb : fetched) {
    total.resize(mb.size(), 0.0);
    for (std::size_t k = 0; k < mb.size(); ++k) total[k] += static_cast<double>(mb[k].item<float>());
  }
  std::size_t k = 0;
  if (!total.empty()) sums.loss = total[k++];
  if (outputs > 1) {
    for (std::size_t j = 0; j < outputs; ++j) sums.output_loss.push_back(total[k++]);
  }
  for (; k < total.size(); ++k) sums.metrics.push_back(total[k]);
  sums.examples = rows;
  return sums;
}

std::int64_t rows_in(const data::Element& e) { return e.empty() ? 0 : e.front().shape()[0]; }

}  // namespace

std::vector<strategy::PipelineStepResult> Trainer::Pipeline::run(
    std::unique_ptr<strategy::PipelineRunner> Line::*runner, const std::vector<data::Element>& shards,
    const std::vector<Tensor>& extra) {
  std::vector<strategy::PipelineStepResult> results(lines.size());
  for_each_line(lines, [&](Line& line, std::size_t i) {
    // Every replica of a pipeline has the same data shard.
    const auto r = static_cast<std::size_t>(line.stage_replica.front());
    results[i] = (line.*runner)->step(microbatches(shards[r], config.microbatches, extra));
  });
  return results;
}

std::vector<StepSums> Trainer::Pipeline::step_sums(const std::vector<strategy::PipelineStepResult>& results,
                                                   const std::vector<data::Element>& shards, std::size_t replicas,
                                                   std::size_t outputs) const {
  std::vector<StepSums> sums(replicas, zeros(outputs));
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const auto& line = lines[i];
    if (line.last_replica < 0 || !line.counts) continue;
    const auto r = static_cast<std::size_t>(line.last_replica);
    sums[r] = sums_of(results[i].fetched, outputs, rows_in(shards[r]));
  }
  return sums;
}

void Trainer::pipeline_train_step(const strategy::Strategy::WorkerBatch& batch) {
  TANDEM_REQUIRE(with_targets_ && model_.compiled, FailedPrecondition,
                 "model \"{}\": training needs a compiled model and data with targets", model_.name);
  const auto start = std::chrono::steady_clock::now();
  Pipeline& P = *pipeline_;
  auto& strategy = *model_.strategy;
  const auto shards = shards_of(batch);
  const Tensor scale = Tensor::scalar<float>(1.0f / static_cast<float>(std::max<std::int64_t>(1, batch.global_examples)));
  const auto results = P.run(&Pipeline::Line::train, shards, {scale});
  // Each replica: its stages' gradients summed over the batch axis, then its variables updated.
  std::vector<std::vector<Tensor>> grads(static_cast<std::size_t>(strategy.replica_devices().size()));
  for (std::size_t r = 0; r < grads.size(); ++r) {
    for (const auto& w : P.trainable) {
      grads[r].push_back(Tensor::empty({0}, w->dtype(), *strategy.replica_devices()[r]));
    }
  }
  for (std::size_t i = 0; i < P.lines.size(); ++i) {
    const auto& line = P.lines[i];
    for (std::size_t st = 0; st < line.stage_replica.size(); ++st) {
      const auto r = static_cast<std::size_t>(line.stage_replica[st]);
      for (std::size_t k = 0; k < line.trainable_index[st].size(); ++k) {
        const std::size_t t = line.trainable_index[st][k];
        if (t != kNotTrained) grads[r][t] = results[i].gradients[st][k];
      }
    }
  }
  std::vector<char> applied(grads.size(), 1);
  // ZeRO (stages 1 and 2): the gradients of the variables the strategy reduce-scatters are
  // summed into this replica's shard only (its range along the batch axis: data_shard), the
  // optimizer updates that range, and the ranges are gathered back into every copy.
  std::vector<std::optional<strategy::ShardSpec>> zero;
  for (const auto& w : P.trainable) zero.push_back(strategy.zero_shard_spec(*w));
  const auto update = [&](int r) {
    auto& g = grads[static_cast<std::size_t>(r)];
    std::vector<Tensor> held, scattered, gathered;
    std::vector<std::int64_t> shard_elements;
    for (std::size_t t = 0; t < g.size(); ++t) {
      if (g[t].num_elements() == 0) continue;
      if (zero[t]) {
        scattered.push_back(g[t]);
        gathered.push_back(P.trainable[t]->value(r));
        shard_elements.push_back(zero[t]->shard_elements);
      } else {
        held.push_back(g[t]);
      }
    }
    auto& comm = strategy.communicator(r);
    const collective::CallOptions call{.timeout = strategy.distribution_options().collective_timeout};
    if (comm.size() > 1 && !held.empty()) comm.all_reduce(held, collective::ReduceOp::kSum, call);
    if (comm.size() > 1 && !scattered.empty())
      comm.reduce_scatter_ranges(scattered, shard_elements, {}, collective::ReduceOp::kSum, call);
    // The optimizer takes a sharded variable's gradient as the replica's [shard_elements] range,
    // zero-padded where the last range is short.
    const int s = strategy.data_shard(r);
    for (std::size_t t = 0; t < g.size(); ++t) {
      if (!zero[t] || g[t].num_elements() == 0) continue;
      Tensor shard = Tensor::zeros({zero[t]->shard_elements}, g[t].dtype(), g[t].device());
      const std::int64_t b = zero[t]->begin(s), e = zero[t]->end(s);
      if (e > b) strategy::flat_view(shard, 0, e - b).copy_from(strategy::flat_view(g[t], b, e - b));
      g[t] = shard;
    }
    applied[static_cast<std::size_t>(r)] = model_.optimizer->apply(r, g) ? 1 : 0;
    if (comm.size() > 1 && !gathered.empty()) comm.all_gather_ranges(gathered, shard_elements, call);
  };
  if (grads.size() == 1) {
    update(0);
  } else {
    strategy.run([&](strategy::ReplicaContext& ctx) { update(ctx.replica_id_in_sync_group()); });
  }
  model_.optimizer->finish_step();
  auto sums = P.step_sums(results, shards, grads.size(), model_.outputs.size());
  pipeline_add_sums(Phase::kTrain, sums);
  count_step(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

void Trainer::pipeline_test_step(const strategy::Strategy::WorkerBatch& batch) {
  TANDEM_REQUIRE(with_targets_ && model_.compiled, FailedPrecondition,
                 "model \"{}\": evaluation needs a compiled model and data with targets", model_.name);
  Pipeline& P = *pipeline_;
  const auto shards = shards_of(batch);
  const auto results = P.run(&Pipeline::Line::infer, shards, {});
  auto sums = P.step_sums(results, shards, model_.strategy->replica_devices().size(), model_.outputs.size());
  pipeline_add_sums(Phase::kTest, sums);
}

std::vector<Tensor> Trainer::pipeline_predict_step(const data::Element& batch) {
  Pipeline& P = *pipeline_;
  const auto results = P.run(&Pipeline::Line::predict, model_.strategy->split_batch(batch), {});
  // The last stages' outputs, micro-batch by micro-batch, pipeline by pipeline (data shard order).
  std::vector<Tensor> out;
  for (std::size_t j = 0; j < model_.outputs.size(); ++j) {
    std::vector<Tensor> parts;
    std::int64_t rows = 0;
    for (std::size_t i = 0; i < P.lines.size(); ++i) {
      if (P.lines[i].last_replica < 0 || !P.lines[i].counts) continue;
      for (const auto& mb : results[i].fetched) {
        parts.push_back(mb[j].to(devices::default_cpu_device()));
        rows += parts.back().shape()[0];
      }
    }
    TANDEM_REQUIRE(!parts.empty(), Unimplemented,
                   "model \"{}\": predict under a pipeline whose last stage is on another worker is not built yet",
                   model_.name);
    Shape shape = parts.front().shape();
    shape[0] = rows;
    Tensor whole = Tensor::empty(shape, parts.front().dtype());
    std::size_t offset = 0;
    for (const auto& part : parts) {
      std::memcpy(static_cast<char*>(whole.raw_data()) + offset, part.raw_data(), part.nbytes());
      offset += part.nbytes();
    }
    out.push_back(std::move(whole));
  }
  return out;
}

}  // namespace tandem::keras::detail
