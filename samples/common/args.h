// samples/common/args.h — the samples' command line: --epochs N --batch N --seed N (and --help).
#pragma once

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "tandem/base/errors.h"

namespace samples {

struct Args {
  int epochs;
  std::int64_t batch;
  std::uint64_t seed = 0;
  int verbose = 1;
  double expect_accuracy = 0.0;  // exit non-zero when the test accuracy ends below this
  bool help = false;
};

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
    } else if (flag == "--verbose") {
      a.verbose = static_cast<int>(parse_int(flag, value()));
    } else if (flag == "--help" || flag == "-h") {
      std::printf("%s\n  --epochs N   (default %d)\n  --batch N    (default %lld)\n  --seed N     (default 0)\n"
                  "  --verbose N  0 silent, 1 progress bar, 2 one line per epoch (default 1)\n"
                  "  --expect-accuracy A  exit with status 3 when the final test accuracy is below A\n",
                  usage, defaults.epochs, static_cast<long long>(defaults.batch));
      a.help = true;
    } else {
      throw tandem::InvalidArgument(fmt::format("unknown argument \"{}\" (see --help)", flag));
    }
  }
  return a;
}

}  // namespace samples
