// Fuzzing harness: the cluster resolvers (strategy/cluster_resolver.cc), which read TF_CONFIG,
// torchrun's and SLURM's variables, i.e. whatever a launcher or a user put in the environment.
//
// An input is either TF_CONFIG itself (JSON), or, when its first line looks like NAME=value,
// an environment of such lines handed to resolve_cluster (so the fuzzer can set any of the
// launchers' variables, TF_CONFIG among them). Whatever the input, the resolver must answer a
// resolver or InvalidArgument: any other exception, a crash or a sanitizer report is a finding.
// A resolver's accessors must then hold up for every rank.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz/fuzz_input.h"
#include "tandem/base/errors.h"
#include "tandem/strategy/cluster_resolver.h"

namespace {

using tandem::strategy::ClusterResolver;

// NAME=value lines (NAME in capitals, digits and '_'); nullopt when the first line is not one.
std::optional<std::map<std::string, std::string>> environment_lines(std::string_view text) {
  std::map<std::string, std::string> variables;
  bool first = true;
  while (!text.empty()) {
    const auto newline = text.find('\n');
    const std::string_view line = text.substr(0, newline);
    text = newline == std::string_view::npos ? std::string_view() : text.substr(newline + 1);
    const auto equals = line.find('=');
    const std::string_view name = line.substr(0, equals);
    const bool is_assignment =
        equals != std::string_view::npos && !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
          return std::isupper(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) || c == '_';
        });
    if (!is_assignment) {
      if (first) return std::nullopt;
      continue;
    }
    first = false;
    variables[std::string(name)] = std::string(line.substr(equals + 1));
  }
  if (first) return std::nullopt;
  return variables;
}

// What every resolver promises (cluster_resolver.h), for every rank.
void check(const ClusterResolver& resolver) {
  const int workers = resolver.num_workers();
  TANDEM_FUZZ_CHECK(workers >= 1);
  TANDEM_FUZZ_CHECK(resolver.rank() >= -1 && resolver.rank() < workers);
  TANDEM_FUZZ_CHECK(resolver.is_chief() == (resolver.rank() == 0));
  TANDEM_FUZZ_CHECK(resolver.local_rank() >= 0 && resolver.local_world_size() >= 1);
  TANDEM_FUZZ_CHECK(resolver.restart_count() >= 0);
  (void)resolver.kind();
  (void)resolver.task_type();
  (void)resolver.task_id();
  (void)resolver.rendezvous_address();
  (void)resolver.cluster_spec().to_json();
  // Every rank has a label and an expected address; a rank outside is InvalidArgument. A million
  // ranks is allowed, so only the first ones and the last are asked for.
  for (int rank = 0; rank < workers && rank < 64; ++rank) {
    (void)resolver.task_label(rank);
    (void)resolver.expected_address(rank);
  }
  (void)resolver.task_label(workers - 1);
  for (const int outside : {-1, workers}) {
    try {
      (void)resolver.task_label(outside);
      TANDEM_FUZZ_CHECK(false);
    } catch (const tandem::InvalidArgument&) {
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    if (auto variables = environment_lines(text)) {
      check(*tandem::strategy::resolve_cluster(tandem::strategy::map_environment(std::move(*variables))));
    } else {
      check(tandem::strategy::TFConfigClusterResolver::from_json(text, tandem::strategy::map_environment({})));
    }
  } catch (const tandem::InvalidArgument&) {
    // The one answer to bad input.
  }
  return 0;
}
