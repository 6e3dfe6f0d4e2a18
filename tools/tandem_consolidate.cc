// tandem-consolidate DIR OUT: writes a sharded checkpoint directory (save_weights or a training
// checkpoint of a sharded model; keras_like/sharded_checkpoint.h) as one ordinary safetensors
// file with every tensor whole, which load_weights, load_training_checkpoint and any safetensors
// reader take. The command line of keras::consolidate.
//
// Exit status: 0 on success; 2 for a bad command line (one line naming the problem); 1 when the
// checkpoint cannot be read or the file written (tandem's message, naming the file and tensor).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <string>

#include "tandem/base/errors.h"
#include "tandem/keras_like/saving.h"
#include "tandem/keras_like/sharded_checkpoint.h"

namespace {
constexpr int kUsageExitCode = 2;  // as tandem-run's
}

int main(int argc, char** argv) {
  CLI::App app{"Writes a sharded checkpoint directory as one safetensors file with every tensor whole.",
               "tandem-consolidate"};
  std::string dir, out;
  app.add_option("DIR", dir, "the checkpoint directory (holds index.json)")->required();
  app.add_option("OUT", out, "the safetensors file to write (replaced atomically when it exists)")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fputs(fmt::format("tandem-consolidate: {} (see tandem-consolidate --help)\n", e.what()).c_str(), stderr);
    return kUsageExitCode;
  }
  try {
    tandem::keras::consolidate(dir, out);
    const auto written = tandem::keras::read_safetensors(out);
    std::size_t bytes = 0;
    for (const auto& [name, tensor] : written.tensors) bytes += tensor.nbytes();
    std::fputs(fmt::format("wrote {}: {} tensors, {} bytes of data\n", out, written.tensors.size(), bytes).c_str(),
               stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fputs(fmt::format("tandem-consolidate: {}\n", e.what()).c_str(), stderr);
    return 1;
  }
}
