#include "tandem/devices/device_name.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <vector>

#include "tandem/base/errors.h"

namespace tandem::devices {
namespace {

constexpr std::string_view kExpectedForms =
    "expected a name like \"CPU:0\", \"/device:GPU:1\" or "
    "\"/job:localhost/replica:0/task:0/device:CPU:0\"";

[[noreturn]] void fail(std::string_view text, std::string_view why) {
  throw InvalidArgument(fmt::format("malformed device name \"{}\": {}; {}", text, why, kExpectedForms));
}

std::string upper(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::toupper(c); });
  return out;
}

int parse_number(std::string_view text, std::string_view component, std::string_view value) {
  int result = -1;
  const auto* end = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(value.data(), end, result);
  if (value.empty() || ec != std::errc() || ptr != end || result < 0) {
    fail(text, fmt::format("{} \"{}\" is not a non-negative integer", component, value));
  }
  return result;
}

void parse_type_and_index(std::string_view text, std::string_view type_and_index, DeviceName& name) {
  const auto colon = type_and_index.find(':');
  if (colon == std::string_view::npos) fail(text, fmt::format("\"{}\" has no \":<index>\"", type_and_index));
  const std::string type = upper(type_and_index.substr(0, colon));
  if (type == "CPU") {
    name.type = DeviceType::kCPU;
  } else if (type == "GPU") {
    name.type = DeviceType::kGPU;
  } else {
    fail(text, fmt::format("unknown device type \"{}\" (known: CPU, GPU)", type_and_index.substr(0, colon)));
  }
  name.index = parse_number(text, "device index", type_and_index.substr(colon + 1));
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  std::size_t start = 0;
  while (true) {
    const auto pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string_view::npos ? std::string_view::npos : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return parts;
}

}  // namespace

std::string_view device_type_name(DeviceType type) { return type == DeviceType::kCPU ? "CPU" : "GPU"; }

DeviceName DeviceName::parse(std::string_view text) {
  if (text.empty()) fail(text, "the name is empty");
  DeviceName name;
  if (text.front() != '/') {
    // Short form: "CPU:0".
    parse_type_and_index(text, text, name);
    return name;
  }
  // Components in TF's order; each may appear at most once and the device must come last.
  enum Rank { kJob, kReplica, kTask, kDevice };
  int last_rank = -1;
  bool has_device = false;
  const auto parts = split(text.substr(1), '/');
  for (const auto part : parts) {
    if (part.empty()) fail(text, "it has an empty component (\"//\" or a trailing \"/\")");
    if (has_device) fail(text, "the device component must come last");
    const auto colon = part.find(':');
    if (colon == std::string_view::npos) fail(text, fmt::format("component \"{}\" has no \":\"", part));
    const std::string key(part.substr(0, colon));
    const auto value = part.substr(colon + 1);
    int rank = 0;
    if (key == "job") {
      rank = kJob;
      const bool valid =
          !value.empty() && std::isalpha(static_cast<unsigned char>(value[0])) &&
          std::all_of(value.begin(), value.end(), [](unsigned char c) { return std::isalnum(c) || c == '_'; });
      if (!valid) fail(text, fmt::format("job name \"{}\" must be a letter followed by letters, digits or _", value));
      name.job = std::string(value);
    } else if (key == "replica") {
      rank = kReplica;
      name.replica = parse_number(text, "replica", value);
    } else if (key == "task") {
      rank = kTask;
      name.task = parse_number(text, "task", value);
    } else if (key == "device") {
      rank = kDevice;
      parse_type_and_index(text, value, name);
      has_device = true;
    } else if (upper(key) == "CPU" || upper(key) == "GPU") {
      rank = kDevice;  // legacy "/cpu:0"
      parse_type_and_index(text, part, name);
      has_device = true;
    } else {
      fail(text, fmt::format("unknown component \"{}\" (known: job, replica, task, device)", key));
    }
    if (rank <= last_rank) fail(text, fmt::format("component \"{}\" is repeated or out of order", key));
    last_rank = rank;
  }
  if (!has_device) fail(text, "it names no device (\"device:<TYPE>:<index>\")");
  return name;
}

std::string DeviceName::full() const {
  return fmt::format("/job:{}/replica:{}/task:{}/device:{}:{}", job, replica, task, device_type_name(type), index);
}

std::string DeviceName::short_form() const { return fmt::format("{}:{}", device_type_name(type), index); }

}  // namespace tandem::devices
