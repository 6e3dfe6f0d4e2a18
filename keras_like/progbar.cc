// tandem/keras_like/progbar.cc — ProgbarLogger: Keras's progress bar, byte for byte.
//
// The layouts are tf.keras's, which most training logs out there show:
//   verbose 1, running:  120/469 [=====>........................] - ETA: 1s - loss: 0.5000
//   verbose 1, done:     469/469 [==============================] - 2s 4ms/step - loss: 0.5000
//   verbose 1, unknown:      120/Unknown - 1s 4ms/step - loss: 0.5000
//   verbose 2, done:     469/469 - 2s - 4ms/step - loss: 0.5000
// The per-step time leaves out the first step (graph planning, warm-up), as Keras does.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <iostream>
#include <optional>

#include "tandem/keras_like/callbacks.h"

namespace tandem::keras {
namespace {

using Clock = std::chrono::steady_clock;

// Keras redraws at most every 0.05 s: drawing is kept out of the step time.
constexpr auto kRedrawInterval = std::chrono::milliseconds(50);
constexpr int kBarWidth = 30;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// " 4ms/step": Keras picks s, ms or us so the number is at least 1.
std::string format_time(double per_unit, std::string_view unit) {
  if (per_unit >= 1.0 || per_unit == 0.0) return fmt::format(" {:.0f}s/{}", per_unit, unit);
  if (per_unit >= 1e-3) return fmt::format(" {:.0f}ms/{}", per_unit * 1e3, unit);
  return fmt::format(" {:.0f}us/{}", per_unit * 1e6, unit);
}

std::string format_eta(double eta) {
  const auto s = static_cast<std::int64_t>(eta);  // Keras's %d truncates
  if (eta > 3600) return fmt::format("{}:{:02d}:{:02d}", s / 3600, (s % 3600) / 60, s % 60);
  if (eta > 60) return fmt::format("{}:{:02d}", s / 60, s % 60);
  return fmt::format("{}s", s);
}

std::string format_values(const Logs& logs) {
  std::string out;
  for (const auto& [k, v] : logs) {
    // Keras: 4 decimals, or scientific notation once that would print (nearly) zero.
    out += std::abs(v) > 1e-3 ? fmt::format(" - {}: {:.4f}", k, v) : fmt::format(" - {}: {:.4e}", k, v);
  }
  return out;
}

int digits(std::int64_t n) { return n <= 0 ? 1 : static_cast<int>(std::floor(std::log10(static_cast<double>(n)))) + 1; }

}  // namespace

struct ProgbarLogger::State {
  std::ostream* out = nullptr;
  bool interactive = false;

  // Of the current fit/evaluate/predict, captured when it begins: evaluations inside fit()
  // re-set the callbacks' params.
  int verbose = 1;
  int epochs = 1;
  std::int64_t target = -1;  // steps per bar; learned from the first epoch when unknown
  bool in_epoch = false;     // test hooks inside an epoch are fit's validation: no bar for them

  // The bar being drawn.
  Clock::time_point start;
  std::optional<Clock::time_point> after_first_step;
  std::optional<Clock::time_point> last_step;  // the per-step time ends here, before validation
  std::optional<Clock::time_point> last_draw;
  std::int64_t seen = 0;
  std::size_t previous_width = 0;

  void begin(int run_verbose, std::int64_t run_target) {
    verbose = run_verbose;
    target = run_target > 0 ? run_target : -1;
    reset();
  }

  void reset() {
    start = Clock::now();
    after_first_step.reset();
    last_step.reset();
    last_draw.reset();
    seen = 0;
    previous_width = 0;
  }

  // The hot path: a count and a clock read; text only when the bar is redrawn in place.
  void step(std::int64_t batch, const Logs& logs) {
    seen = batch + 1;
    if (verbose == 0) return;
    const auto now = Clock::now();
    last_step = now;
    if (seen == 1) after_first_step = now;
    if (verbose != 1 || !interactive) return;
    if (last_draw && now - *last_draw < kRedrawInterval) return;
    draw(seen, logs, false, now);
  }

  void finish(const Logs& logs) {
    if (verbose == 0) return;
    if (target <= 0) target = seen;  // now known, for this bar and the epochs after it
    // The steps that ran: fewer than the target when training stopped early.
    draw(seen, logs, true, Clock::now());
  }

  double time_per_step(std::int64_t current, Clock::time_point now) const {
    if (current <= 0) return 0.0;
    // Steps end at the last batch: the validation that runs before the epoch's line is not a step.
    if (last_step) now = *last_step;
    if (after_first_step && current > 1) return seconds(now - *after_first_step) / static_cast<double>(current - 1);
    return seconds(now - start) / static_cast<double>(current);
  }

  std::string line(std::int64_t current, const Logs& logs, bool final, Clock::time_point now) const {
    const double per_step = time_per_step(current, now);
    const double elapsed = seconds(now - start);
    if (verbose == 2) {
      return fmt::format("{:>{}}/{} - {:.0f}s -{}{}", current, digits(target), target, elapsed,
                         format_time(per_step, "step"), format_values(logs));
    }
    std::string text;
    if (target > 0) {
      text = fmt::format("{:>{}}/{} [", current, digits(target), target);
      const auto filled = std::min<std::int64_t>(
          kBarWidth, static_cast<std::int64_t>(kBarWidth * static_cast<double>(current) / static_cast<double>(target)));
      if (filled > 0) {
        text.append(static_cast<std::size_t>(filled - 1), '=');
        text += current < target ? '>' : '=';
      }
      text.append(static_cast<std::size_t>(kBarWidth - filled), '.');
      text += ']';
    } else {
      text = fmt::format("{:>7}/Unknown", current);
    }
    if (target <= 0 || final) {
      text += fmt::format(" - {:.0f}s{}", elapsed, format_time(per_step, "step"));
    } else {
      text += " - ETA: " + format_eta(per_step * static_cast<double>(target - current));
    }
    return text + format_values(logs);
  }

  void draw(std::int64_t current, const Logs& logs, bool final, Clock::time_point now) {
    std::string text = line(current, logs, final, now);
    if (interactive && verbose == 1) {
      // Back to the start of the line; blanks erase what a longer previous line left.
      const std::size_t width = text.size();
      if (previous_width > width) text.append(previous_width - width, ' ');
      previous_width = width;
      text.insert(text.begin(), '\r');
    }
    if (final) text += '\n';
    *out << text << std::flush;
    last_draw = now;
  }
};

ProgbarLogger::ProgbarLogger(ProgbarOptions options) : state_(std::make_unique<State>()) {
  state_->out = options.out != nullptr ? options.out : &std::cout;
  state_->interactive = options.interactive.value_or(state_->out == &std::cout && ::isatty(STDOUT_FILENO) == 1);
}

ProgbarLogger::~ProgbarLogger() = default;

void ProgbarLogger::on_train_begin(Logs& /*logs*/) {
  state_->epochs = params().epochs;
  state_->begin(params().verbose, params().steps);
  state_->in_epoch = false;
}

void ProgbarLogger::on_epoch_begin(int epoch, Logs& /*logs*/) {
  auto& s = *state_;
  s.in_epoch = true;
  s.reset();
  // Keras prints the epoch header only when there is more than one epoch.
  if (s.verbose > 0 && s.epochs > 1) *s.out << fmt::format("Epoch {}/{}\n", epoch + 1, s.epochs) << std::flush;
}

void ProgbarLogger::on_train_batch_end(std::int64_t batch, Logs& logs) { state_->step(batch, logs); }

void ProgbarLogger::on_epoch_end(int /*epoch*/, Logs& logs) {
  state_->in_epoch = false;
  state_->finish(logs);  // the epoch's values, validation ones included
}

void ProgbarLogger::on_test_begin(Logs& /*logs*/) {
  if (state_->in_epoch) return;
  state_->begin(params().verbose, params().steps);
}

void ProgbarLogger::on_test_batch_end(std::int64_t batch, Logs& logs) {
  if (!state_->in_epoch) state_->step(batch, logs);
}

void ProgbarLogger::on_test_end(Logs& logs) {
  if (!state_->in_epoch) state_->finish(logs);
}

void ProgbarLogger::on_predict_begin(Logs& /*logs*/) { state_->begin(params().verbose, params().steps); }

void ProgbarLogger::on_predict_batch_end(std::int64_t batch, Logs& /*logs*/) {
  // Predict batches have no values to show.
  static const Logs kNone;
  state_->step(batch, kNone);
}

void ProgbarLogger::on_predict_end(Logs& /*logs*/) { state_->finish(Logs{}); }

}  // namespace tandem::keras
