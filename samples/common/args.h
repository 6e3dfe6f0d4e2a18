// samples/common/args.h — the samples' command line: --epochs N --batch N --seed N
// --strategy one|mirrored|multiworker --cpu-devices N (and --help), and the strategy they choose.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "tandem/base/errors.h"
#include "tandem/devices/device.h"
#include "tandem/keras_like/mixed_precision.h"
#include "tandem/strategy/multi_worker.h"
#include "tandem/strategy/strategy.h"

namespace samples {

struct Args {
  int epochs;
  std::int64_t batch;
  std::uint64_t seed = 0;
  int verbose = 1;
  double expect_accuracy = 0.0;  // exit non-zero when the test accuracy ends below this
  std::string strategy = "mirrored";  // "one" or "mirrored"
  int cpu_devices = 0;                // logical CPU devices; 0: mirrored gets one per usable core (at most 8)
  std::string dtype_policy = "float32";  // keras::mixed_precision's global policy, set by parse_args
  bool help = false;
};

// How many logical CPU devices a sample gets when --cpu-devices is not given: one per core, so
// that MirroredStrategy on a CPU-only machine trains on all of it (capped: more replicas than 8
// only add synchronisation on the machines the samples are meant for).
inline constexpr int kMaxDefaultCpuDevices = 8;

inline std::int64_t parse_int(std::string_view flag, std::string_view text) {
  std::int64_t value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  TANDEM_REQUIRE(ec == std::errc() && ptr == text.data() + text.size() && value >= 0, InvalidArgument,
                 "{} \"{}\": expected a non-negative integer", flag, text);
  return value;
}

// Parses the common flags; defaults are the sample's own. Throws InvalidArgument on bad input.
inline Args parse_args(int argc, char** argv, Args defaults, const char* usage) {
  Args a = defaults;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    const auto value = [&]() -> std::string_view {
      TANDEM_REQUIRE(i + 1 < argc, InvalidArgument, "{} needs a value (see --help)", flag);
      return argv[++i];
    };
    if (flag == "--epochs") {
      a.epochs = static_cast<int>(parse_int(flag, value()));
    } else if (flag == "--batch") {
      a.batch = parse_int(flag, value());
    } else if (flag == "--seed") {
      a.seed = static_cast<std::uint64_t>(parse_int(flag, value()));
    } else if (flag == "--expect-accuracy") {
      a.expect_accuracy = std::stod(std::string(value()));
    } else if (flag == "--strategy") {
      a.strategy = std::string(value());
      TANDEM_REQUIRE(a.strategy == "one" || a.strategy == "mirrored" || a.strategy == "multiworker", InvalidArgument,
                     "--strategy \"{}\": expected one, mirrored or multiworker", a.strategy);
    } else if (flag == "--cpu-devices") {
      a.cpu_devices = static_cast<int>(parse_int(flag, value()));
      TANDEM_REQUIRE(a.cpu_devices >= 1, InvalidArgument, "--cpu-devices must be at least 1");
    } else if (flag == "--dtype-policy") {
      a.dtype_policy = std::string(value());
      tandem::keras::mixed_precision::Policy{a.dtype_policy};  // rejects an unknown name now
    } else if (flag == "--verbose") {
      a.verbose = static_cast<int>(parse_int(flag, value()));
    } else if (flag == "--help" || flag == "-h") {
      std::printf("%s\n  --epochs N   (default %d)\n  --batch N    (default %lld)\n  --seed N     (default 0)\n"
                  "  --verbose N  0 silent, 1 progress bar, 2 one line per epoch (default 1)\n"
                  "  --strategy S  one (OneDeviceStrategy on CPU:0) or mirrored (MirroredStrategy on every GPU,\n"
                  "                else every logical CPU device; default %s) or multiworker\n"
                  "                (MultiWorkerMirroredStrategy: start it with tandem-run, or set TF_CONFIG)\n"
                  "  --cpu-devices N  logical CPU devices (default: one per usable core, at most %d;\n"
                  "                TANDEM_NUM_CPU_DEVICES also sets it)\n"
                  "  --dtype-policy P  float32 (default), mixed_bfloat16 or mixed_float16 (compute in 16 bits,\n"
                  "                weights in float32; mixed_float16 adds loss scaling)\n"
                  "  --expect-accuracy A  exit with status 3 when the final test accuracy is below A\n",
                  usage, defaults.epochs, static_cast<long long>(defaults.batch), defaults.strategy.c_str(),
                  kMaxDefaultCpuDevices);
      a.help = true;
    } else {
      throw tandem::InvalidArgument(fmt::format("unknown argument \"{}\" (see --help)", flag));
    }
  }
  tandem::keras::mixed_precision::set_global_policy(a.dtype_policy);
  return a;
}

// Prints the final test figures; returns the sample's exit status: 3 when the accuracy is below
// --expect-accuracy, else 0.
inline int report_test(double loss, double accuracy, const Args& a) {
  std::printf("test loss %.4f, test accuracy %.4f\n", loss, accuracy);
  if (accuracy < a.expect_accuracy) {
    std::printf("below the expected accuracy %.4f\n", a.expect_accuracy);
    return 3;
  }
  return 0;
}

// The strategy --strategy names, after dividing the CPU into --cpu-devices logical devices. The
// samples' code reads as if it had written one of these two lines itself:
//   tandem::OneDeviceStrategy strategy("CPU:0");
//   tandem::MirroredStrategy strategy;  // every GPU, else every logical CPU device
inline std::unique_ptr<tandem::Strategy> make_strategy(const Args& a) {
  int cpu_devices = a.cpu_devices;
  // One device keeps every core for itself; mirrored gets one device per core unless told.
  if (cpu_devices == 0 && a.strategy == "mirrored" && std::getenv("TANDEM_NUM_CPU_DEVICES") == nullptr) {
    cpu_devices = std::min(tandem::devices::usable_cpu_cores(), kMaxDefaultCpuDevices);
  }
  if (a.strategy == "multiworker") {
    // One replica per worker on CPU:0 (TF's choice), or --cpu-devices replicas per worker (the
    // all-reduce is then hierarchical). The worker's share of the cores is the strategy's call.
    tandem::strategy::MultiWorkerOptions options;
    for (int d = 0; d < a.cpu_devices; ++d) options.local_devices.push_back(fmt::format("CPU:{}", d));
    auto multi = std::make_unique<tandem::MultiWorkerMirroredStrategy>(options);
    if (multi->should_log()) {
      std::printf("MultiWorkerMirroredStrategy: %d workers, %d replicas in sync (%s)\n", multi->num_workers(),
                  multi->num_replicas_in_sync(), std::string(multi->cluster_resolver().kind()).c_str());
    }
    return multi;
  }
  if (cpu_devices > 0) tandem::devices::set_logical_device_configuration({.num_cpu_devices = cpu_devices});
  if (a.strategy == "one") return std::make_unique<tandem::OneDeviceStrategy>("CPU:0");
  auto mirrored = std::make_unique<tandem::MirroredStrategy>();
  std::printf("MirroredStrategy on %d devices\n", mirrored->num_replicas_in_sync());
  return mirrored;
}

}  // namespace samples
