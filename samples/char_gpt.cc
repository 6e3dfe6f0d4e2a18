// A character-level GPT on the Jargon File: token + learned position embeddings, pre-LN
// transformer blocks with causal self-attention, a final LayerNormalization and an output
// projection, trained with AdamW under warmup + cosine decay. The model, data split, initialisers
// and optimizer are those of bench/peers/torch_char_gpt.py (PyTorch), so that the two curves
// compare; bench/bench_char_gpt runs both.
//
//   build/samples/char_gpt [--steps 2000] [--layers 4] [--heads 4] [--width 128] [--context 128]
//       [--batch 32] [--dropout 0.1] [--lr 1e-3] [--warmup 100] [--eval-every 250] [--eval-batches 20]
//       [--tie-embeddings] [--save PREFIX] [--load PREFIX] [--generate N] [--prompt TEXT]
//       [--temperature T] [--top-k K] [--loss-log FILE] [--eval-starts FILE]
//       [--train-starts FILE] [--init-from FILE.safetensors]
//       [--strategy one|mirrored|multiworker] [--cpu-devices N] [--dtype-policy P] [--backup DIR] ...
//
// Reads Debian's jargon-text package (/usr/share/doc/jargon-text/jargon.txt.gz) or --data FILE
// (plain text or gzip). Prints the validation loss in nats per character every --eval-every steps
// (the peer's format: "step S train_loss L val_loss V tokens/s T") and, with --generate N, N
// characters sampled from the trained model after --prompt. --save PREFIX writes
// PREFIX.weights.safetensors and the vocabulary PREFIX.vocab.json; --load PREFIX reads them back
// (with --steps 0: evaluate and generate only).
//
// Comparing with the peer step by step: --init-from starts from the peer's initial weights (its
// --save-init writes them under these names), --train-starts trains on the windows the peer draws
// (its --save-train-starts), --loss-log writes each step's loss (so does the peer's). With
// --dropout 0 the two logs agree to about 5e-5 nats over the first 250 steps.
//
// The transformer block is a custom layer (TransformerBlock below): how a user writes one.
#include <tandem/data/text.h>
#include <tandem/keras_like/keras.h>
#include <tandem/ops/ops.h>

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/args.h"

namespace {

using namespace tandem;

struct GptOptions {
  std::string data = "/usr/share/doc/jargon-text/jargon.txt.gz";
  int layers = 4;
  int heads = 4;
  std::int64_t width = 128;
  std::int64_t context = 128;
  double dropout = 0.1;
  double lr = 1e-3;
  int warmup = 100;
  int steps = 2000;
  int eval_every = 250;
  int eval_batches = 20;
  std::string eval_starts;   // a file of validation window starts (bench_char_gpt: the peer's)
  std::string train_starts;  // a file of training window starts, --batch a step (diagnostics)
  std::string init_from;     // initial weights (diagnostics: the peer's, from --save-init)
  int skip = 10;             // warm-up steps left out of tokens/s (as the peer)
  bool tie_embeddings = false;
  std::string save, load, loss_log;
  int generate = 0;
  std::string prompt = "hacker";
  double temperature = 0.8;
  int top_k = 0;
};

// PyTorch's xavier_uniform on a [width, width] projection: U(-l, l), l = sqrt(6 / (2 * width)).
// Keras's glorot_uniform on MultiHeadAttention's 3-D kernels counts fans over [C, H, D] instead
// (Keras's compute_fans), which gives a smaller range; the sample matches the peer.
keras::Initializer projection_initializer(std::int64_t width) {
  const double limit = std::sqrt(6.0 / (2.0 * static_cast<double>(width)));
  return keras::Initializer::random_uniform(-limit, limit);
}

// Adds a learned embedding of each position (keras_hub's PositionEmbedding):
// y[b, t, :] = x[b, t, :] + embeddings[t, :].
class PositionEmbeddingImpl final : public keras::LayerImpl {
 public:
  explicit PositionEmbeddingImpl(std::int64_t sequence_length)
      : LayerImpl("PositionEmbedding", ""), sequence_length_(sequence_length) {}

  void build(const std::vector<graph::TensorSpec>& inputs) override {
    const Shape& x = inputs[0].shape;
    TANDEM_REQUIRE(x.rank() == 3 && x[1] == sequence_length_ && x[2] != Shape::kUnknown, InvalidArgument,
                   "{}: input has shape {}; expected (batch, {}, features)", label(), x, sequence_length_);
    embeddings_ = add_weight({.name = "embeddings", .shape = {sequence_length_, x[2]}, .initializer = "uniform"});
  }

  std::vector<Output> call(keras::CallContext& ctx, const std::vector<Output>& inputs) override {
    return {inputs[0] + ctx.read(embeddings_)};  // broadcasts over the batch
  }

 private:
  std::int64_t sequence_length_;
  keras::VariablePtr embeddings_;
};

class PositionEmbedding : public keras::Layer {
 public:
  explicit PositionEmbedding(std::int64_t sequence_length)
      : Layer(std::make_shared<PositionEmbeddingImpl>(sequence_length)) {}
};

// x + Dropout(MHA(LN(x), causal)); then x + Dropout(Dense(width)(gelu(Dense(4 width)(LN(x))))).
class TransformerBlockImpl final : public keras::LayerImpl {
 public:
  TransformerBlockImpl(std::int64_t width, int heads, double dropout)
      : LayerImpl("TransformerBlock", ""),
        ln1_(keras::LayerNormalization()),
        attention_(heads, width / heads, {.dropout = dropout, .kernel_initializer = projection_initializer(width)}),
        ln2_(keras::LayerNormalization()),
        fc_(4 * width, "gelu"),
        proj_(width),
        drop1_(dropout),
        drop2_(dropout) {
    for (const keras::Layer& l :
         std::initializer_list<keras::Layer>{ln1_, attention_, ln2_, fc_, proj_, drop1_, drop2_}) {
      track(l);
    }
  }

  std::vector<Output> call(keras::CallContext& ctx, const std::vector<Output>& inputs) override {
    Output x = inputs[0];
    const Output a = ln1_(ctx, x);
    x = x + drop1_(ctx, attention_(ctx, {a, a}, {.use_causal_mask = true})[0]);
    return {x + drop2_(ctx, proj_(ctx, fc_(ctx, ln2_(ctx, x))))};
  }

 private:
  keras::LayerNormalization ln1_;
  keras::MultiHeadAttention attention_;
  keras::LayerNormalization ln2_;
  keras::Dense fc_, proj_;
  keras::Dropout drop1_, drop2_;
};

class TransformerBlock : public keras::Layer {
 public:
  TransformerBlock(std::int64_t width, int heads, double dropout)
      : Layer(std::make_shared<TransformerBlockImpl>(width, heads, dropout)) {}
};

// The output projection tied to the token embedding (--tie-embeddings): logits = x @ E^T, with E
// the Embedding's [vocab, width] table, so one matrix serves both ends (GPT-2's choice). It holds
// no weight of its own: the embedding layer owns E, and autodiff adds both uses' gradients.
class TiedOutputImpl final : public keras::LayerImpl {
 public:
  explicit TiedOutputImpl(keras::Layer embedding) : LayerImpl("TiedOutput", ""), embedding_(std::move(embedding)) {}

  std::vector<Output> call(keras::CallContext& ctx, const std::vector<Output>& inputs) override {
    const Output table = ctx.read(embedding_->weights().at(0));  // [vocab, width]
    const Shape& x = inputs[0].shape();
    const Output flat = ops::reshape(inputs[0], {-1, x.dim(-1)});
    const Output logits = ops::matmul(flat, table, {.transpose_b = true});
    return {ops::reshape(logits, {-1, x[1], table.shape()[0]})};
  }

 private:
  keras::Layer embedding_;
};

class TiedOutput : public keras::Layer {
 public:
  explicit TiedOutput(keras::Layer embedding) : Layer(std::make_shared<TiedOutputImpl>(std::move(embedding))) {}
};

}  // namespace

namespace {

// The model: ids [B, T] -> logits [B, T, vocab].
keras::Model make_gpt(const GptOptions& o, std::int64_t vocab_size) {
  auto ids = keras::Input({o.context}, DType::kI32, "ids");
  keras::Embedding token_embedding(vocab_size, o.width, {.name = "token_embedding"});
  auto x = PositionEmbedding(o.context)(token_embedding(ids));
  x = keras::Dropout(o.dropout)(x);
  for (int i = 0; i < o.layers; ++i) x = TransformerBlock(o.width, o.heads, o.dropout)(x);
  x = keras::LayerNormalization()(x);
  const keras::KerasTensor logits =
      o.tie_embeddings ? TiedOutput(token_embedding)(x) : keras::Dense(vocab_size, {.name = "head"})(x);
  return keras::Model(ids, logits, "char_gpt");
}

// AdamW with the peer's numbers: linear warmup from 0 to --lr over --warmup steps, then cosine
// decay to 0.1 x --lr at --steps (Keras 3's CosineDecay with warmup_target); weight decay 0.1 on
// kernels and embeddings, none on biases and LayerNormalization's gamma and beta.
// The peer counts steps from 1 (its first step already takes lr / warmup); Keras's schedule reads
// the optimizer's iterations, from 0. Starting the warmup one step in (at lr / warmup, reaching
// lr one step earlier) gives every step the peer's rate, instead of a first step at rate 0 and
// every later one a step behind.
keras::AdamW make_optimizer(const GptOptions& o) {
  const int warmup = std::max(1, o.warmup);
  const double first_rate = o.warmup > 0 ? o.lr / warmup : o.lr;
  return keras::AdamW{.learning_rate = keras::CosineDecay{.initial_learning_rate = first_rate,
                                                          .decay_steps = std::max(1, o.steps - warmup),
                                                          .alpha = 0.1,
                                                          .warmup_target = o.lr,
                                                          .warmup_steps = warmup - 1},
                      .weight_decay = 0.1,
                      .beta_1 = 0.9,
                      .beta_2 = 0.99,
                      .epsilon = 1e-7,
                      .exclude_from_weight_decay = {"bias", "gamma", "beta"}};
}

// Prints the peer's line every --eval-every steps (an epoch of fit here), counts training
// tokens/s after the first --skip steps (wall time between steps, data included, validation
// excluded), and writes every step's loss to --loss-log.
class Progress final : public keras::Callback {
 public:
  Progress(const GptOptions& o, std::int64_t tokens_per_step, bool log)
      : o_(o), tokens_per_step_(tokens_per_step), log_(log) {
    if (!o.loss_log.empty() && log) loss_log_.open(o.loss_log);
  }

  void on_epoch_begin(int /*epoch*/, keras::Logs& /*logs*/) override {
    batch_in_epoch_ = 0;
    running_mean_ = 0;
    mark_.reset();
  }
  void on_train_batch_begin(std::int64_t /*batch*/, keras::Logs& /*logs*/) override {
    if (!mark_) mark_ = Clock::now();
  }
  void on_train_batch_end(std::int64_t /*batch*/, keras::Logs& logs) override {
    const auto now = Clock::now();
    ++step_;
    if (step_ > o_.skip) {
      train_seconds_ += std::chrono::duration<double>(now - *mark_).count();
      tokens_ += tokens_per_step_;
    }
    mark_ = now;
    // fit's "loss" is the mean over the epoch's steps so far (Keras's progress bar); this step's
    // own loss is what moved it.
    const double mean = logs.at("loss");
    ++batch_in_epoch_;
    last_loss_ = static_cast<double>(batch_in_epoch_) * mean - static_cast<double>(batch_in_epoch_ - 1) * running_mean_;
    running_mean_ = mean;
    if (loss_log_.is_open()) loss_log_ << step_ << ' ' << fmt::format("{:.9g}", last_loss_) << '\n';
  }
  void on_epoch_end(int /*epoch*/, keras::Logs& logs) override {
    if (!log_) return;
    std::printf("step %lld train_loss %.4f val_loss %.4f tokens/s %.0f\n", static_cast<long long>(step_), last_loss_,
                logs.get("val_loss").value_or(NAN), tokens_per_second());
    std::fflush(stdout);
  }
  double tokens_per_second() const { return train_seconds_ > 0 ? static_cast<double>(tokens_) / train_seconds_ : 0; }

 private:
  using Clock = std::chrono::steady_clock;
  const GptOptions& o_;
  std::int64_t tokens_per_step_;
  bool log_;
  std::ofstream loss_log_;
  std::int64_t step_ = 0, batch_in_epoch_ = 0, tokens_ = 0;
  double running_mean_ = 0, last_loss_ = 0, train_seconds_ = 0;
  std::optional<Clock::time_point> mark_;
};

// The windows of `context` characters starting at the offsets listed in `path` (whitespace-
// separated integers), as a dataset of (x, y = x shifted by one) pairs in file order.
data::Dataset windows_at(const Tensor& tokens, const std::string& path, const char* flag, std::int64_t context) {
  const std::int64_t span = tokens.shape()[0] - context - 1;
  std::ifstream in(path);
  TANDEM_REQUIRE(in.good(), NotFound, "{} \"{}\" cannot be read", flag, path);
  std::vector<std::int32_t> x, y;
  const std::int32_t* t = tokens.data<std::int32_t>();
  std::int64_t count = 0;
  for (long long start = 0; in >> start; ++count) {
    TANDEM_REQUIRE(start >= 0 && start <= span, InvalidArgument,
                   "{} \"{}\": start {} (entry {}) is outside [0, {}], the windows of {} characters that fit the text",
                   flag, path, start, count, span, context);
    x.insert(x.end(), t + start, t + start + context);
    y.insert(y.end(), t + start + 1, t + start + context + 1);
  }
  TANDEM_REQUIRE(in.eof() && count > 0, InvalidArgument,
                 "{} \"{}\": expected whitespace-separated window starts (integers); entry {} is not one", flag, path,
                 count);
  return data::Dataset::from_tensor_slices(
      {Tensor::from_vector<std::int32_t>(x, {count, context}), Tensor::from_vector<std::int32_t>(y, {count, context})});
}

// The validation windows: --eval-batches batches spread evenly over the validation text, or the
// windows starting at the offsets listed in --eval-starts (bench_char_gpt passes the 20 random
// batches the peer draws with its fixed seed, so that both curves are measured on the same text).
data::Dataset validation_batches(const Tensor& validation, const GptOptions& o, std::int64_t batch) {
  if (o.eval_starts.empty()) {
    const std::int64_t span = validation.shape()[0] - o.context - 1;
    const std::int64_t windows = static_cast<std::int64_t>(o.eval_batches) * batch;
    const std::int64_t stride = std::max<std::int64_t>(1, span / windows);
    return data::text_windows(validation, {.length = o.context, .stride = stride}).take(windows).batch(batch);
  }
  return windows_at(validation, o.eval_starts, "--eval-starts", o.context).batch(batch);
}

// The training batches: random windows like the peer's (every start position, reshuffled each
// pass), or with --train-starts the windows at the listed offsets, --batch a step in file order
// (the peer's --save-train-starts writes the ones it draws: both then see the same batches).
data::Dataset training_batches(const Tensor& train, const GptOptions& o, std::int64_t batch) {
  if (!o.train_starts.empty()) {
    return windows_at(train, o.train_starts, "--train-starts", o.context)
        .batch(batch, /*drop_remainder=*/true)
        .repeat();
  }
  auto windows = data::text_windows(train, {.length = o.context});
  return windows.shuffle(windows.cardinality()).batch(batch, /*drop_remainder=*/true).repeat();
}

// Samples n characters after the prompt: each from the last position's logits over a window of
// the last `context` ids (right-padded while shorter: the causal mask keeps the padding out of
// earlier positions), divided by the temperature, among the top-k when k > 0.
std::string generate(keras::Model& model, const data::Vocabulary& vocab, const GptOptions& o, std::uint64_t seed) {
  const Tensor prompt = vocab.encode(o.prompt);
  std::vector<std::int32_t> ids(prompt.data<std::int32_t>(), prompt.data<std::int32_t>() + prompt.num_elements());
  TANDEM_REQUIRE(!ids.empty(), InvalidArgument, "--prompt is empty; give at least one character");
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> out;
  for (int i = 0; i < o.generate; ++i) {
    const std::size_t len = std::min<std::size_t>(ids.size(), static_cast<std::size_t>(o.context));
    std::vector<std::int32_t> window(static_cast<std::size_t>(o.context), 0);
    std::copy(ids.end() - static_cast<std::ptrdiff_t>(len), ids.end(), window.begin());
    const Tensor logits = model.predict(Tensor::from_vector<std::int32_t>(window, {1, o.context}));
    const std::int64_t vocab_size = logits.shape()[2];
    const float* row = logits.data<float>() + static_cast<std::int64_t>(len - 1) * vocab_size;
    std::vector<double> p(row, row + vocab_size);
    if (o.top_k > 0 && o.top_k < vocab_size) {
      std::vector<double> sorted = p;
      std::nth_element(sorted.begin(), sorted.begin() + (o.top_k - 1), sorted.end(), std::greater<>());
      const double kth = sorted[static_cast<std::size_t>(o.top_k - 1)];
      for (double& v : p) {
        if (v < kth) v = -INFINITY;
      }
    }
    const double top = *std::max_element(p.begin(), p.end());
    for (double& v : p) v = std::exp((v - top) / o.temperature);
    std::discrete_distribution<std::int32_t> pick(p.begin(), p.end());
    const std::int32_t next = pick(rng);
    ids.push_back(next);
    out.push_back(next);
  }
  return vocab.decode(out);
}

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

}  // namespace

int main(int argc, char** argv) try {
  GptOptions o;
  const auto args = samples::parse_args(
      argc, argv, {.epochs = 0, .has_epochs = false, .batch = 32},
      "char_gpt: a character-level GPT on the Jargon File, beside bench/peers/torch_char_gpt.py", [&o](CLI::App& app) {
        app.add_option("--data", o.data, "text file, plain or gzip")->capture_default_str();
        app.add_option("--layers", o.layers, "transformer blocks")->capture_default_str()->check(CLI::Range(1, 64));
        app.add_option("--heads", o.heads, "attention heads")->capture_default_str()->check(CLI::Range(1, 64));
        app.add_option("--width", o.width, "model width")->capture_default_str()->check(CLI::Range(1, 1 << 16));
        app.add_option("--context", o.context, "characters per window")
            ->capture_default_str()
            ->check(CLI::Range(2, 1 << 16));
        app.add_option("--dropout", o.dropout, "dropout rate (0: none)")
            ->capture_default_str()
            ->check(CLI::Range(0.0, 0.99));
        app.add_option("--lr", o.lr, "peak learning rate")->capture_default_str()->check(CLI::PositiveNumber);
        app.add_option("--warmup", o.warmup, "warmup steps")->capture_default_str()->check(CLI::NonNegativeNumber);
        app.add_option("--steps", o.steps, "training steps")->capture_default_str()->check(CLI::NonNegativeNumber);
        app.add_option("--eval-every", o.eval_every, "steps between validation losses")
            ->capture_default_str()
            ->check(CLI::PositiveNumber);
        app.add_option("--eval-batches", o.eval_batches, "validation batches")
            ->capture_default_str()
            ->check(CLI::PositiveNumber);
        app.add_option("--eval-starts", o.eval_starts,
                       "validate on the windows starting at these offsets of the\nvalidation text (a file of integers) "
                       "instead of --eval-batches\nevenly spaced batches")
            ->type_name("FILE");
        app.add_option("--train-starts", o.train_starts,
                       "diagnostics: train on the windows starting at these offsets of\nthe training text, --batch a "
                       "step in file order (the peer's\n--save-train-starts writes the ones it draws)")
            ->type_name("FILE");
        app.add_option("--init-from", o.init_from,
                       "diagnostics: start from these weights (safetensors, tandem's\nnames; the peer's --save-init "
                       "writes its own initial ones)")
            ->type_name("FILE");
        app.add_flag("--tie-embeddings", o.tie_embeddings, "output projection = token embeddings transposed");
        app.add_option("--save", o.save, "write PREFIX.weights.safetensors and PREFIX.vocab.json")->type_name("PREFIX");
        app.add_option("--load", o.load, "start from PREFIX.weights.safetensors (and its vocabulary)")
            ->type_name("PREFIX");
        app.add_option("--generate", o.generate, "characters to sample after training")
            ->capture_default_str()
            ->check(CLI::NonNegativeNumber);
        app.add_option("--prompt", o.prompt, "text the samples continue")->capture_default_str();
        app.add_option("--temperature", o.temperature, "sampling temperature")
            ->capture_default_str()
            ->check(CLI::PositiveNumber);
        app.add_option("--top-k", o.top_k, "sample among the k likeliest (0: all)")
            ->capture_default_str()
            ->check(CLI::NonNegativeNumber);
        app.add_option("--loss-log", o.loss_log, "write each step's loss to FILE")->type_name("FILE");
      });
  if (args.exit_code) return *args.exit_code;
  if (o.steps > 0 && o.eval_every > o.steps) o.eval_every = o.steps;
  TANDEM_REQUIRE(o.steps % o.eval_every == 0, InvalidArgument,
                 "--steps {} is not a multiple of --eval-every {} (validation runs every --eval-every steps)", o.steps,
                 o.eval_every);
  TANDEM_REQUIRE(o.width % o.heads == 0, InvalidArgument, "--width {} is not a multiple of --heads {}", o.width,
                 o.heads);
  set_global_seed(args.seed);

  // The strategy first: it sets up the devices, which the first tensor would otherwise fix.
  auto strategy = samples::make_strategy(args);
  const bool log = strategy->should_log();

  // The data: the characters of the text, the first 90% to train on, the last 10% to validate.
  const std::string text = data::read_text_file(o.data);
  const data::Vocabulary vocab =
      o.load.empty() ? data::Vocabulary::from_text(text) : data::Vocabulary::load(o.load + ".vocab.json");
  const auto [train, validation] = data::split_tokens(vocab.encode(text), 0.9);

  keras::Model model;
  {
    auto scope = strategy->scope();
    model = make_gpt(o, vocab.size());
    samples::compile_model(args, model, [&] {  // --print-plan shows a --mesh layout compile refuses
      model.compile(make_optimizer(o), keras::SparseCategoricalCrossentropy{.from_logits = true});
    }, o.context);
  }
  if (!o.load.empty()) model.load_weights(o.load + ".weights.safetensors");
  if (!o.init_from.empty()) model.load_weights(o.init_from);
  if (log) {
    std::printf("char_gpt: vocab %lld params %lld train chars %lld val chars %lld, %d replica(s), policy %s\n",
                static_cast<long long>(vocab.size()), static_cast<long long>(model.count_params()),
                static_cast<long long>(train.shape()[0]), static_cast<long long>(validation.shape()[0]),
                strategy->num_replicas_in_sync(), args.dtype_policy.c_str());
    if (args.verbose > 0) model.summary();
  }
  samples::print_plan_if_asked(args, model, o.context);  // --print-plan

  const auto val_data = validation_batches(validation, o, args.batch);
  auto progress = std::make_shared<Progress>(o, args.batch * o.context, log);
  if (o.steps > 0) {
    // An epoch of fit is --eval-every steps, so validation runs every --eval-every steps.
    auto batches = training_batches(train, o, args.batch);
    auto callbacks = samples::fit_callbacks(args, *strategy);
    callbacks.push_back(progress);
    const int epochs = o.steps / o.eval_every;
    model.fit(batches, {.epochs = epochs,
                        .verbose = 0,
                        .callbacks = callbacks,
                        .validation_data = val_data,
                        .steps_per_epoch = o.eval_every});
  }
  const double val_loss = model.evaluate(val_data, {.verbose = 0}).at("loss");
  if (log) {
    std::printf("final val_loss %.6f nats/char\n", val_loss);
    if (o.steps > 0) std::printf("tokens/s %.0f peak_rss_mb %.0f\n", progress->tokens_per_second(), peak_rss_mb());
  }
  samples::export_if_asked(args, model);  // --export model.onnx
  if (!o.save.empty()) {
    model.save_weights(o.save + ".weights.safetensors");
    if (log) vocab.save(o.save + ".vocab.json");
  }
  if (o.generate > 0 && log) {
    std::printf("--- %d characters after \"%s\" (temperature %.2f, top-k %d):\n%s%s\n", o.generate, o.prompt.c_str(),
                o.temperature, o.top_k, o.prompt.c_str(), generate(model, vocab, o, args.seed).c_str());
  }
  return 0;
} catch (const tandem::Error& e) {
  std::fprintf(stderr, "char_gpt: %s\n", e.what());
  return 1;
}
