// bench/machine_info.h — what every benchmark prints about the machine it ran on.
#pragma once

#include <ctime>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "tandem/base/cpu_isa.h"

namespace bench {

// "Intel(R) Xeon(R) Processor (family 6, model 207)": the model name alone does not say which
// generation a VM's CPU is.
inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU", family, number;
  while (std::getline(in, line)) {
    const auto value = [&] { return line.substr(line.find(':') + 2); };
    if (line.rfind("model name", 0) == 0 && model == "unknown CPU") model = value();
    if (line.rfind("cpu family", 0) == 0 && family.empty()) family = value();
    if (line.rfind("model\t", 0) == 0 && number.empty()) number = value();
  }
  return fmt::format("{} (family {}, model {})", model, family, number);
}

inline std::string memory_total() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  long kib = 0;
  in >> key >> kib >> unit;
  return fmt::format("{:.1f} GiB", static_cast<double>(kib) / (1 << 20));
}

// The local date and time, "2026-11-29 20:10".
inline std::string now_text() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M", std::localtime(&t));
  return buf;
}

// "avx512 (this CPU: baseline, avx2, avx512)": the build of the CPU kernels this run uses
// (TANDEM_CPU_ISA forces another).
inline std::string cpu_kernels_text() {
  return fmt::format("{} (this CPU: {})", tandem::cpu_isa_name(tandem::cpu_isa()), tandem::supported_cpu_isa_names());
}

}  // namespace bench
