// tandem/strategy/cluster_resolver.cc — reading TF_CONFIG, torchrun's and SLURM's variables.
//
// Every check here exists because a wrong value would otherwise surface minutes later as a
// rendezvous timeout on some other machine: a worker that believes it is rank 3 of 4 when the
// chief expects 3 workers waits forever. So the environment is validated up front, and each
// message quotes the variable or JSON part that is wrong.
#include "tandem/strategy/cluster_resolver.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <utility>

#include "tandem/base/detail/json.h"
#include "tandem/base/detail/text.h"
#include "tandem/base/errors.h"

namespace tandem::strategy {
namespace {

using Json = nlohmann::json;

// A bound on ranks and world sizes, far above any real job: a typo like WORLD_SIZE=80000000
// would otherwise allocate a cluster spec of that many entries before anything else fails.
constexpr std::int64_t kMaxWorkers = 1 << 20;
// TF_CONFIG of a cluster of thousands of tasks takes a few hundred KiB; more is not a TF_CONFIG
// (and Linux passes no environment string over 128 KiB to a program anyway).
constexpr std::size_t kMaxTfConfigBytes = std::size_t{1} << 20;
// RFC 1035: a host name has at most 253 bytes (without a final dot), each label at most 63.
constexpr std::size_t kMaxHostNameBytes = 253;
constexpr std::size_t kMaxHostLabelBytes = 63;
// An IPv6 address has at most 45 characters (INET6_ADDRSTRLEN - 1), a %zone an interface name.
constexpr std::size_t kMaxIpv6Chars = 45 + 1 + 15;
// Job names and task types are "chief", "worker", "evaluator" (and the refused "ps"): a longer
// one is a mistake, quoted short.
constexpr std::size_t kMaxJobNameBytes = 64;
// What an expanded SLURM node list may hold in all: a 100,000-node cluster of 20-character names
// takes 2 MiB, and a list like n[0-999999] with long names would take gigabytes.
constexpr std::size_t kMaxSlurmHostBytes = std::size_t{64} << 20;

constexpr std::string_view kChief = "chief";
constexpr std::string_view kWorker = "worker";
constexpr std::string_view kEvaluator = "evaluator";

using tandem::detail::escape;
using tandem::detail::escape_char;
using tandem::detail::trim;

// A value from outside in double quotes, escaped and cut short, for messages.
std::string quote(std::string_view s) { return tandem::detail::quote_value(s); }

// A JSON value as JSON text ("localhost" keeps its quotes, 5 does not), for messages.
std::string dump(const Json& value) { return tandem::detail::json_for_message(value); }

// The variable's value, trimmed; nullopt when unset or blank (launchers sometimes export an
// empty variable to "unset" it).
std::optional<std::string> get(const EnvironmentLookup& env, std::string_view name) {
  auto value = env(name);
  if (!value) return std::nullopt;
  std::string_view trimmed = trim(*value);
  if (trimmed.empty()) return std::nullopt;
  return std::string(trimmed);
}

// A decimal integer filling all of text.
std::optional<std::int64_t> parse_int(std::string_view text) {
  std::int64_t value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

// An integer variable in [min, max]; InvalidArgument "<prefix>: NAME "x" is not ..." otherwise.
int int_variable(std::string_view prefix, std::string_view name, const std::string& text, std::int64_t min,
                 std::int64_t max) {
  auto value = parse_int(text);
  TANDEM_REQUIRE(value.has_value(), InvalidArgument, "{}: {} {} is not an integer", prefix, name, quote(text));
  TANDEM_REQUIRE(*value >= min && *value <= max, InvalidArgument, "{}: {} {} is out of range: expected {}..{}", prefix,
                 name, *value, min, max);
  return static_cast<int>(*value);
}

std::optional<int> optional_int_variable(const EnvironmentLookup& env, std::string_view prefix, std::string_view name,
                                         std::int64_t min, std::int64_t max) {
  auto text = get(env, name);
  if (!text) return std::nullopt;
  return int_variable(prefix, name, *text, min, max);
}

// The comma-separated parts of text, empty ones included: "a,,b" has three, "" has one.
std::vector<std::string_view> split_at_commas(std::string_view text) {
  std::vector<std::string_view> parts;
  std::size_t start = 0;
  while (start <= text.size()) {
    auto comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    parts.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return parts;
}

// The first character of text that is neither a letter, a digit nor one of `punctuation`.
std::optional<char> first_character_not_in(std::string_view text, std::string_view punctuation) {
  for (char c : text) {
    const bool allowed =
        std::isalnum(static_cast<unsigned char>(c)) != 0 || punctuation.find(c) != std::string_view::npos;
    if (!allowed) return c;
  }
  return std::nullopt;
}

// Why host cannot be a host name (RFC 1035's lengths) or an IPv4 address; nullopt when it can.
// Lengths and characters are checked first, so that the messages after them quote a short,
// printable host.
std::optional<std::string> host_name_problem(std::string_view host) {
  std::string_view name = host;
  if (name.size() > 1 && name.back() == '.') name.remove_suffix(1);  // a fully qualified "h.example."
  if (name.size() > kMaxHostNameBytes) {
    return fmt::format("the host name is {} bytes; at most {}", name.size(), kMaxHostNameBytes);
  }
  if (auto c = first_character_not_in(host, ".-_:")) {
    return fmt::format("the host has the character '{}', which no host name has", escape_char(*c));
  }
  if (host.find(':') != std::string_view::npos) {
    return fmt::format("an IPv6 host must be in brackets, as in [{}]:2222", host);
  }
  for (std::size_t start = 0; start <= name.size();) {
    const auto dot = std::min(name.find('.', start), name.size());
    const std::size_t label = dot - start;
    if (label == 0) return std::string("the host name has an empty label (a dot at the start or two in a row)");
    if (label > kMaxHostLabelBytes) {
      return fmt::format("the host name has a label of {} bytes; at most {}", label, kMaxHostLabelBytes);
    }
    start = dot + 1;
  }
  return std::nullopt;
}

// Why host cannot be a host name or (unbracketed) IP address; nullopt when it can.
std::optional<std::string> host_problem(std::string_view host, bool bracketed) {
  if (host.empty()) return std::string("empty host");
  if (!bracketed) return host_name_problem(host);
  if (host.size() > kMaxIpv6Chars) {
    return fmt::format("the bracketed host is {} bytes, longer than any IPv6 address with a %zone ({})", host.size(),
                       kMaxIpv6Chars);
  }
  if (host.find(':') == std::string_view::npos) {
    return fmt::format("brackets are for IPv6 addresses, and \"{}\" is not one", escape(host));
  }
  // Hex digits, ':' and '.' (an embedded IPv4 part), and '%zone' such as %eth0.
  if (auto c = first_character_not_in(host, ":.%")) {
    return fmt::format("the IPv6 address has the character '{}'", escape_char(*c));
  }
  return std::nullopt;
}

std::optional<std::string> port_problem(std::string_view port_text, int* port) {
  if (port_text.empty()) return std::string("no port");
  auto value = parse_int(port_text);
  if (!value) return fmt::format("port {} is not a number", quote(port_text));
  if (*value < 1 || *value > 65535) return fmt::format("port {} is not in 1..65535", *value);
  *port = static_cast<int>(*value);
  return std::nullopt;
}

// Splits address into out; returns why it is not host:port instead when it is not.
std::optional<std::string> address_problem(std::string_view address, HostPort* out) {
  if (address.empty()) return std::string("empty");
  std::string_view host;
  std::string_view port_text;
  bool bracketed = false;
  if (address.front() == '[') {
    const auto close = address.find(']');
    if (close == std::string_view::npos) return std::string("no closing ']'");
    host = address.substr(1, close - 1);
    bracketed = true;
    std::string_view rest = address.substr(close + 1);
    if (rest.empty() || rest.front() != ':') return std::string("no port");
    port_text = rest.substr(1);
  } else {
    const auto colon = address.rfind(':');
    if (colon == std::string_view::npos) return std::string("no port");
    host = address.substr(0, colon);
    port_text = address.substr(colon + 1);
  }
  if (auto problem = host_problem(host, bracketed)) return problem;
  int port = 0;
  if (auto problem = port_problem(port_text, &port)) return problem;
  out->host = std::string(host);
  out->port = port;
  return std::nullopt;
}

// A port variable (1..65535).
int port_variable(std::string_view prefix, std::string_view name, const std::string& text) {
  return int_variable(prefix, name, text, 1, 65535);
}

// The rank-0 entry is known, the others are not: {"worker": [address, "", "", ...]}.
ClusterSpec chief_only_cluster(const std::string& chief_address, int num_workers) {
  ClusterSpec spec;
  auto& tasks = spec.jobs[std::string(kWorker)];
  tasks.assign(static_cast<std::size_t>(num_workers), std::string());
  tasks.front() = chief_address;
  return spec;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Environments, addresses, ClusterSpec

EnvironmentLookup process_environment() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

EnvironmentLookup map_environment(std::map<std::string, std::string> variables) {
  return [vars = std::move(variables)](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

HostPort split_host_port(std::string_view address) {
  HostPort result;
  auto problem = address_problem(address, &result);
  TANDEM_REQUIRE(!problem, InvalidArgument, "{} is not host:port ({})", quote(address), problem.value_or(""));
  return result;
}

std::string join_host_port(std::string_view host, int port) {
  if (host.find(':') != std::string_view::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

int ClusterSpec::num_tasks(std::string_view job) const {
  auto it = jobs.find(std::string(job));
  return it == jobs.end() ? 0 : static_cast<int>(it->second.size());
}

const std::string& ClusterSpec::task_address(std::string_view job, int index) const {
  auto it = jobs.find(std::string(job));
  TANDEM_REQUIRE(it != jobs.end(), InvalidArgument, "cluster spec has no job \"{}\" (task {})", job, index);
  TANDEM_REQUIRE(index >= 0 && index < static_cast<int>(it->second.size()), InvalidArgument,
                 "cluster spec has no task {}[{}]: job \"{}\" has {} tasks", job, index, job, it->second.size());
  return it->second[static_cast<std::size_t>(index)];
}

std::string ClusterSpec::to_json() const {
  Json out = Json::object();
  for (const auto& [job, tasks] : jobs) out[job] = tasks;
  return out.dump();
}

// ---------------------------------------------------------------------------------------------
// SLURM's compressed syntaxes

std::vector<std::string> expand_slurm_nodelist(std::string_view nodelist) {
  const std::string_view list = trim(nodelist);
  const auto fail = [&](std::string_view why) {
    throw InvalidArgument(fmt::format("SLURM node list {}: {}", quote(nodelist), why));
  };
  if (list.empty()) fail("it is empty");

  // One host pattern: literal text and bracket groups, each group a list of numbers.
  using Group = std::vector<std::string>;  // a literal is a group of one
  std::vector<std::string> hosts;
  std::size_t host_bytes = 0;  // an upper bound on the bytes of hosts' names
  std::size_t start = 0;
  while (start <= list.size()) {
    // Find the end of this pattern: the next comma outside brackets.
    std::size_t end = start;
    int depth = 0;
    for (; end < list.size(); ++end) {
      const char c = list[end];
      if (c == '[') {
        if (depth > 0) fail("nested '[' brackets");
        ++depth;
      } else if (c == ']') {
        if (depth == 0) fail("']' without '['");
        --depth;
      } else if (c == ',' && depth == 0) {
        break;
      }
    }
    if (depth != 0) fail("'[' without ']'");
    const std::string_view pattern = list.substr(start, end - start);
    if (pattern.empty()) fail("an empty host name (two commas, or a comma at an end)");

    std::vector<Group> groups;
    // The pattern's names so far: how many, and the longest one's bytes. Checked as each group
    // comes, so that no group is expanded after the limits are passed.
    std::size_t count = 1;
    std::size_t name_bytes = 0;
    const auto add_group = [&](Group group) {
      std::size_t longest = 0;
      for (const auto& piece : group) longest = std::max(longest, piece.size());
      name_bytes += longest;
      if (name_bytes > kMaxHostNameBytes) {
        fail(fmt::format("{} makes host names of {} bytes or more; at most {}", quote(pattern), name_bytes,
                         kMaxHostNameBytes));
      }
      count *= group.size();
      if (count + hosts.size() > static_cast<std::size_t>(kMaxSlurmNodes)) {
        fail(fmt::format("more than {} nodes", kMaxSlurmNodes));
      }
      if (host_bytes + count * name_bytes > kMaxSlurmHostBytes) {
        fail(fmt::format("it expands to more than {} bytes of host names", kMaxSlurmHostBytes));
      }
      groups.push_back(std::move(group));
    };
    std::size_t pos = 0;
    while (pos < pattern.size()) {
      if (pattern[pos] != '[') {
        const auto next = pattern.find('[', pos);
        const auto stop = next == std::string_view::npos ? pattern.size() : next;
        add_group({std::string(pattern.substr(pos, stop - pos))});
        pos = stop;
        continue;
      }
      const auto close = pattern.find(']', pos);
      const std::string_view body = pattern.substr(pos + 1, close - pos - 1);
      pos = close + 1;
      if (body.empty()) fail(fmt::format("empty brackets in {}", quote(pattern)));
      Group numbers;
      for (const std::string_view part : split_at_commas(body)) {
        const auto dash = part.find('-');
        const std::string_view lo_text = part.substr(0, dash);
        const std::string_view hi_text = dash == std::string_view::npos ? lo_text : part.substr(dash + 1);
        const auto is_number = [](std::string_view s) {
          return !s.empty() && s.size() <= 18 &&
                 std::all_of(s.begin(), s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
        };
        if (!is_number(lo_text) || !is_number(hi_text)) {
          fail(fmt::format("{} in {} is not a number or a range like 1-4", quote(part), quote(pattern)));
        }
        const auto lo = *parse_int(lo_text);
        const auto hi = *parse_int(hi_text);
        if (hi < lo) fail(fmt::format("the range {} in {} runs backwards", quote(part), quote(pattern)));
        if (hi - lo >= kMaxSlurmNodes) fail(fmt::format("more than {} nodes", kMaxSlurmNodes));
        // SLURM pads every number of a range to the width of its lower bound: node[001-010].
        const int width = static_cast<int>(lo_text.size());
        for (std::int64_t n = lo; n <= hi; ++n) numbers.push_back(fmt::format("{:0{}}", n, width));
        if (numbers.size() > static_cast<std::size_t>(kMaxSlurmNodes)) {
          fail(fmt::format("more than {} nodes", kMaxSlurmNodes));
        }
      }
      add_group(std::move(numbers));
    }

    // The product of the groups, first group outermost.
    std::vector<std::string> names{std::string()};
    for (const auto& group : groups) {
      std::vector<std::string> longer;
      longer.reserve(names.size() * group.size());
      for (const auto& prefix : names) {
        for (const auto& piece : group) longer.push_back(prefix + piece);
      }
      names = std::move(longer);
    }
    for (auto& name : names) hosts.push_back(std::move(name));
    host_bytes += count * name_bytes;
    start = end + 1;
  }
  return hosts;
}

std::vector<int> expand_slurm_tasks_per_node(std::string_view tasks_per_node) {
  const std::string_view text = trim(tasks_per_node);
  const auto fail = [&](std::string_view why) {
    throw InvalidArgument(
        fmt::format("SLURM tasks per node {}: {} (expected a list like \"2(x3),1\")", quote(tasks_per_node), why));
  };
  if (text.empty()) fail("it is empty");
  std::vector<int> counts;
  for (const std::string_view item : split_at_commas(text)) {
    std::string_view count_text = item;
    std::int64_t repeat = 1;
    if (const auto paren = item.find('('); paren != std::string_view::npos) {
      count_text = item.substr(0, paren);
      const std::string_view suffix = item.substr(paren);
      if (suffix.size() < 4 || suffix.substr(0, 2) != "(x" || suffix.back() != ')') {
        fail(fmt::format("{} is not N or N(xM)", quote(item)));
      }
      auto parsed = parse_int(suffix.substr(2, suffix.size() - 3));
      if (!parsed || *parsed < 1) fail(fmt::format("{} is not N or N(xM) with M >= 1", quote(item)));
      repeat = *parsed;
    }
    auto count = parse_int(count_text);
    if (!count || *count < 1 || *count > kMaxWorkers) {
      fail(fmt::format("{} is not N or N(xM) with N >= 1", quote(item)));
    }
    if (repeat + static_cast<std::int64_t>(counts.size()) > kMaxSlurmNodes) {
      fail(fmt::format("more than {} nodes", kMaxSlurmNodes));
    }
    counts.insert(counts.end(), static_cast<std::size_t>(repeat), static_cast<int>(*count));
  }
  return counts;
}

// ---------------------------------------------------------------------------------------------
// ClusterResolver

int ClusterResolver::restart_count() const { return restart_count_; }

void ClusterResolver::read_restart_count(const EnvironmentLookup& env) {
  if (auto text = get(env, kRestartCountVariable)) {
    restart_count_ = static_cast<int>(env::parse_int(env::kRestartCount, *text));
  }
}

void ClusterResolver::check_rank(int rank) const {
  TANDEM_REQUIRE(rank >= 0 && rank < num_workers(), InvalidArgument,
                 "{}: rank {} is out of range: there are {} training processes", kind(), rank, num_workers());
}

// ---------------------------------------------------------------------------------------------
// TF_CONFIG

TFConfigClusterResolver::TFConfigClusterResolver(const EnvironmentLookup& env) {
  auto text = get(env, "TF_CONFIG");
  TANDEM_REQUIRE(text.has_value(), InvalidArgument,
                 "TF_CONFIG: the TF_CONFIG environment variable is not set (or empty); it should "
                 "hold {{\"cluster\": {{...}}, \"task\": {{\"type\": ..., \"index\": ...}}}}");
  parse(*text, env);
}

TFConfigClusterResolver TFConfigClusterResolver::from_json(std::string_view tf_config, const EnvironmentLookup& env) {
  TFConfigClusterResolver resolver{Unparsed{}};
  resolver.parse(tf_config, env);
  return resolver;
}

// A function try block: whatever nlohmann throws while the value is read (a type_error or
// out_of_range a check here missed) is still InvalidArgument naming TF_CONFIG, never an uncaught
// exception.
void TFConfigClusterResolver::parse(std::string_view tf_config, const EnvironmentLookup& env) try {
  read_restart_count(env);
  TANDEM_REQUIRE(tf_config.size() <= kMaxTfConfigBytes, InvalidArgument,
                 "TF_CONFIG: is {} bytes; at most {} are accepted (a TF_CONFIG of thousands of tasks takes a few "
                 "hundred KiB)",
                 tf_config.size(), kMaxTfConfigBytes);
  Json doc;
  if (auto problem = tandem::detail::parse_json(tf_config, doc)) {
    throw InvalidArgument(fmt::format("TF_CONFIG: {} (TF_CONFIG is {})", *problem, quote(tf_config)));
  }
  TANDEM_REQUIRE(doc.is_object(), InvalidArgument,
                 "TF_CONFIG: must be a JSON object with \"cluster\" and \"task\", got {}", dump(doc));

  // --- cluster
  auto cluster_it = doc.find("cluster");
  TANDEM_REQUIRE(cluster_it != doc.end(), InvalidArgument,
                 "TF_CONFIG: has no \"cluster\" (expected \"cluster\": {{\"worker\": [\"host:port\", "
                 "...]}}), got {}",
                 dump(doc));
  const Json& cluster = *cluster_it;
  TANDEM_REQUIRE(cluster.is_object(), InvalidArgument, "TF_CONFIG: \"cluster\" must be an object of jobs, got {}",
                 dump(cluster));

  std::map<std::string, std::string> owner_of_address;  // address -> "cluster.job[i]"
  for (const auto& item : cluster.items()) {
    // Not a structured binding: add_address below captures job, which clang before 16 refuses.
    const std::string& job = item.key();
    const Json& tasks = item.value();
    TANDEM_REQUIRE(job.size() <= kMaxJobNameBytes, InvalidArgument,
                   "TF_CONFIG: cluster has a job name of {} bytes, {}; the jobs are \"chief\", \"worker\" and "
                   "\"evaluator\"",
                   job.size(), quote(job));
    TANDEM_REQUIRE(job != "ps", InvalidArgument,
                   "TF_CONFIG: cluster.ps: parameter servers are not supported: tandem trains with "
                   "MultiWorkerMirroredStrategy, whose jobs are \"chief\" and \"worker\"");
    TANDEM_REQUIRE(job == kChief || job == kWorker || job == kEvaluator, InvalidArgument,
                   "TF_CONFIG: cluster.{}: unknown job {}; the jobs are \"chief\", \"worker\" and "
                   "\"evaluator\"",
                   escape(job), quote(job));
    std::vector<std::string> addresses;
    const auto add_address = [&](std::size_t index, const Json& value) {
      const std::string where = fmt::format("cluster.{}[{}]", job, index);
      TANDEM_REQUIRE(value.is_string(), InvalidArgument, "TF_CONFIG: {} is {}, not a \"host:port\" string", where,
                     dump(value));
      const auto& address = value.get_ref<const std::string&>();
      HostPort parts;
      auto problem = address_problem(address, &parts);
      TANDEM_REQUIRE(!problem, InvalidArgument, "TF_CONFIG: {} {} is not host:port ({})", where, quote(address),
                     problem.value_or(""));
      auto [it, inserted] = owner_of_address.emplace(address, where);
      TANDEM_REQUIRE(inserted, InvalidArgument,
                     "TF_CONFIG: {} {} is also the address of {}: every task needs its own address", where,
                     quote(address), it->second);
      addresses.push_back(address);
    };
    if (tasks.is_array()) {
      for (std::size_t i = 0; i < tasks.size(); ++i) add_address(i, tasks[i]);
    } else if (tasks.is_object()) {
      // TF also accepts {"0": "h:p", "1": ...} (sparse in TF). tandem needs every task of a job,
      // so the indices must run 0..n-1.
      std::map<std::int64_t, const Json*> by_index;
      for (const auto& [key, value] : tasks.items()) {
        auto index = parse_int(key);
        TANDEM_REQUIRE(index && *index >= 0 && *index < kMaxWorkers, InvalidArgument,
                       "TF_CONFIG: cluster.{} has the key {}: the keys of a job given as an object "
                       "must be task indices \"0\", \"1\", ...",
                       job, quote(key));
        by_index.emplace(*index, &value);
      }
      std::int64_t expected = 0;
      for (const auto& [index, value] : by_index) {
        TANDEM_REQUIRE(index == expected, InvalidArgument,
                       "TF_CONFIG: cluster.{} has no task {} but has task {}: the task indices "
                       "must run 0..{} without gaps (sparse jobs are not supported)",
                       job, expected, index, by_index.size() - 1);
        add_address(static_cast<std::size_t>(index), *value);
        ++expected;
      }
    } else {
      throw InvalidArgument(
          fmt::format("TF_CONFIG: cluster.{} must be a list of \"host:port\" strings, got {}", job, dump(tasks)));
    }
    cluster_.jobs.emplace(job, std::move(addresses));
  }
  const int num_chiefs = cluster_.num_tasks(kChief);
  const int num_plain_workers = cluster_.num_tasks(kWorker);
  TANDEM_REQUIRE(num_chiefs <= 1, InvalidArgument,
                 "TF_CONFIG: cluster.chief has {} tasks: there can be at most one chief", num_chiefs);
  TANDEM_REQUIRE(cluster_.num_tasks(kEvaluator) <= 1, InvalidArgument,
                 "TF_CONFIG: cluster.evaluator has {} tasks: there can be at most one evaluator",
                 cluster_.num_tasks(kEvaluator));
  num_workers_ = num_chiefs + num_plain_workers;
  TANDEM_REQUIRE(num_workers_ > 0, InvalidArgument,
                 "TF_CONFIG: the cluster has no \"chief\" or \"worker\" task, so nobody trains; "
                 "cluster is {}",
                 dump(cluster));

  // --- task
  auto task_it = doc.find("task");
  TANDEM_REQUIRE(task_it != doc.end(), InvalidArgument,
                 "TF_CONFIG: has no \"task\" (expected \"task\": {{\"type\": \"worker\", "
                 "\"index\": 0}})");
  const Json& task = *task_it;
  TANDEM_REQUIRE(task.is_object(), InvalidArgument,
                 "TF_CONFIG: \"task\" must be an object like {{\"type\": \"worker\", \"index\": 0}}, "
                 "got {}",
                 dump(task));
  auto type_it = task.find("type");
  TANDEM_REQUIRE(type_it != task.end(), InvalidArgument, "TF_CONFIG: task has no \"type\": got {}", dump(task));
  TANDEM_REQUIRE(type_it->is_string(), InvalidArgument,
                 "TF_CONFIG: task.type must be a string such as \"worker\", got {}", dump(*type_it));
  const auto& type = type_it->get_ref<const std::string&>();
  TANDEM_REQUIRE(type.size() <= kMaxJobNameBytes, InvalidArgument,
                 "TF_CONFIG: task.type is {} bytes long, {}; the task types are \"chief\", \"worker\" and "
                 "\"evaluator\"",
                 type.size(), quote(type));
  task_type_ = type;
  TANDEM_REQUIRE(task_type_ != "ps", InvalidArgument,
                 "TF_CONFIG: task.type \"ps\": parameter servers are not supported: tandem trains "
                 "with MultiWorkerMirroredStrategy, whose tasks are \"chief\" and \"worker\"");
  if (cluster_.jobs.find(task_type_) == cluster_.jobs.end()) {
    std::string jobs;
    for (const auto& [job, tasks] : cluster_.jobs) {
      jobs += fmt::format("{}\"{}\"", jobs.empty() ? "" : ", ", job);
    }
    throw InvalidArgument(
        fmt::format("TF_CONFIG: task.type {} is not a job of the cluster (its "
                    "jobs are {})",
                    quote(task_type_), jobs));
  }
  auto index_it = task.find("index");
  TANDEM_REQUIRE(index_it != task.end(), InvalidArgument, "TF_CONFIG: task has no \"index\": got {}", dump(task));
  const Json& index = *index_it;
  TANDEM_REQUIRE(index.is_number_integer(), InvalidArgument,
                 "TF_CONFIG: task.index must be a non-negative integer, got {}", dump(index));
  TANDEM_REQUIRE(index.is_number_unsigned() || index.get<std::int64_t>() >= 0, InvalidArgument,
                 "TF_CONFIG: task.index must be a non-negative integer, got {}", dump(index));
  const int job_size = cluster_.num_tasks(task_type_);
  TANDEM_REQUIRE(index.get<std::uint64_t>() < static_cast<std::uint64_t>(job_size), InvalidArgument,
                 "TF_CONFIG: task.index {} is out of range: cluster.{} has {} {}", dump(index), task_type_, job_size,
                 job_size == 1 ? "task" : "tasks");
  task_id_ = static_cast<int>(index.get<std::uint64_t>());

  // --- rank (multi_worker_util.id_in_cluster) and the tasks sharing this task's host
  if (task_type_ == kChief) {
    rank_ = 0;
  } else if (task_type_ == kWorker) {
    rank_ = task_id_ + num_chiefs;
  } else {
    rank_ = -1;  // the evaluator does not train
  }
  if (rank_ >= 0) {
    const std::string my_host = split_host_port(expected_address(rank_)).host;
    local_rank_ = 0;
    local_world_size_ = 0;
    for (int r = 0; r < num_workers_; ++r) {
      if (split_host_port(expected_address(r)).host != my_host) continue;
      if (r < rank_) ++local_rank_;
      ++local_world_size_;
    }
  }
} catch (const Json::exception& e) {
  throw InvalidArgument(
      fmt::format("TF_CONFIG: {} (TF_CONFIG is {})", tandem::detail::shorten(e.what()), quote(tf_config)));
}

std::pair<std::string_view, int> TFConfigClusterResolver::training_task(int rank) const {
  check_rank(rank);
  if (cluster_.num_tasks(kChief) == 1) {
    if (rank == 0) return {kChief, 0};
    return {kWorker, rank - 1};
  }
  return {kWorker, rank};
}

std::string TFConfigClusterResolver::rendezvous_address() const { return expected_address(0); }

std::string TFConfigClusterResolver::task_label(int rank) const {
  auto [job, index] = training_task(rank);
  const std::string& address = cluster_.task_address(job, index);
  if (job == kChief) return fmt::format("chief ({})", address);
  return fmt::format("worker {} ({})", index, address);
}

std::string TFConfigClusterResolver::expected_address(int rank) const {
  auto [job, index] = training_task(rank);
  return cluster_.task_address(job, index);
}

// ---------------------------------------------------------------------------------------------
// torchrun

TorchrunClusterResolver::TorchrunClusterResolver(const EnvironmentLookup& env) {
  constexpr std::string_view kPrefix = "torchrun";
  read_restart_count(env);
  const auto required = [&](std::string_view name) {
    auto value = get(env, name);
    TANDEM_REQUIRE(value.has_value(), InvalidArgument,
                   "{}: {} is not set (torchrun sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE "
                   "for every worker)",
                   kPrefix, name);
    return *value;
  };
  const std::string master_addr = required("MASTER_ADDR");
  const std::string master_port = required("MASTER_PORT");
  const std::string rank_text = required("RANK");
  const std::string world_size_text = required("WORLD_SIZE");

  world_size_ = int_variable(kPrefix, "WORLD_SIZE", world_size_text, 1, kMaxWorkers);
  auto rank = parse_int(rank_text);
  TANDEM_REQUIRE(rank.has_value(), InvalidArgument, "{}: RANK {} is not an integer", kPrefix, quote(rank_text));
  TANDEM_REQUIRE(*rank >= 0 && *rank < world_size_, InvalidArgument,
                 "{}: RANK {} is out of range: WORLD_SIZE is {}, so ranks are 0..{}", kPrefix, *rank, world_size_,
                 world_size_ - 1);
  rank_ = static_cast<int>(*rank);

  // MASTER_ADDR is a host (an IPv6 one may come with or without brackets).
  std::string_view host = master_addr;
  const bool bracketed = host.size() >= 2 && host.front() == '[' && host.back() == ']';
  if (bracketed) host = host.substr(1, host.size() - 2);
  auto problem = host_problem(host, /*bracketed=*/host.find(':') != std::string_view::npos);
  TANDEM_REQUIRE(!problem, InvalidArgument, "{}: MASTER_ADDR {} is not a host ({})", kPrefix, quote(master_addr),
                 problem.value_or(""));
  int port = port_variable(kPrefix, "MASTER_PORT", master_port);
  if (auto override_port = get(env, kRendezvousPortVariable)) {
    port = port_variable(kPrefix, kRendezvousPortVariable, *override_port);
  } else if (get(env, "TORCHELASTIC_USE_AGENT_STORE") == std::optional<std::string>("True")) {
    // torchrun's agent serves PyTorch's own TCPStore on MASTER_PORT (it tells its workers so
    // with this variable): ours goes on the next port.
    TANDEM_REQUIRE(port < 65535, InvalidArgument,
                   "{}: MASTER_PORT is 65535 and torchrun's agent serves it; set {} to a free port for tandem's "
                   "rendezvous",
                   kPrefix, kRendezvousPortVariable);
    port += 1;
  }
  rendezvous_address_ = join_host_port(host, port);

  if (auto size = optional_int_variable(env, kPrefix, "LOCAL_WORLD_SIZE", 1, world_size_)) {
    local_world_size_ = *size;
  }
  if (auto local = get(env, "LOCAL_RANK")) {
    auto value = parse_int(*local);
    TANDEM_REQUIRE(value.has_value(), InvalidArgument, "{}: LOCAL_RANK {} is not an integer", kPrefix, quote(*local));
    const bool size_known = get(env, "LOCAL_WORLD_SIZE").has_value();
    TANDEM_REQUIRE(*value >= 0 && (!size_known || *value < local_world_size_) && *value < world_size_, InvalidArgument,
                   "{}: LOCAL_RANK {} is out of range: {} is {}", kPrefix, *value,
                   size_known ? "LOCAL_WORLD_SIZE" : "WORLD_SIZE", size_known ? local_world_size_ : world_size_);
    local_rank_ = static_cast<int>(*value);
  }
  if (auto group = optional_int_variable(env, kPrefix, "GROUP_RANK", 0, world_size_ - 1)) {
    group_rank_ = *group;
  }
  cluster_ = chief_only_cluster(rendezvous_address_, world_size_);
}

std::string TorchrunClusterResolver::task_label(int rank) const {
  check_rank(rank);
  return fmt::format("rank {}", rank);
}

std::string TorchrunClusterResolver::expected_address(int rank) const {
  check_rank(rank);
  return rank == 0 ? rendezvous_address_ : std::string();
}

// ---------------------------------------------------------------------------------------------
// SLURM

SlurmClusterResolver::SlurmClusterResolver(const EnvironmentLookup& env) {
  constexpr std::string_view kPrefix = "SLURM";
  read_restart_count(env);
  auto procid = get(env, "SLURM_PROCID");
  TANDEM_REQUIRE(procid.has_value(), InvalidArgument,
                 "{}: SLURM_PROCID is not set (srun sets it for every task: start the program "
                 "with srun)",
                 kPrefix);
  std::string_view ntasks_name = "SLURM_NTASKS";
  auto ntasks = get(env, ntasks_name);
  if (!ntasks) {
    ntasks_name = "SLURM_NPROCS";  // the older name
    ntasks = get(env, ntasks_name);
  }
  TANDEM_REQUIRE(ntasks.has_value(), InvalidArgument,
                 "{}: SLURM_NTASKS is not set (srun sets it: start the program with srun)", kPrefix);
  num_tasks_ = int_variable(kPrefix, ntasks_name, *ntasks, 1, kMaxWorkers);
  auto rank = parse_int(*procid);
  TANDEM_REQUIRE(rank.has_value(), InvalidArgument, "{}: SLURM_PROCID {} is not an integer", kPrefix, quote(*procid));
  TANDEM_REQUIRE(*rank >= 0 && *rank < num_tasks_, InvalidArgument, "{}: SLURM_PROCID {} is out of range: {} is {}",
                 kPrefix, *rank, ntasks_name, num_tasks_);
  rank_ = static_cast<int>(*rank);

  // The step's nodes: the chief is the first.
  std::string_view nodelist_name;
  std::optional<std::string> nodelist;
  for (std::string_view name : {"SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"}) {
    nodelist = get(env, name);
    if (nodelist) {
      nodelist_name = name;
      break;
    }
  }
  TANDEM_REQUIRE(nodelist.has_value(), InvalidArgument,
                 "{}: none of SLURM_STEP_NODELIST, SLURM_NODELIST and SLURM_JOB_NODELIST is set, "
                 "so the chief's node is unknown",
                 kPrefix);
  try {
    nodes_ = expand_slurm_nodelist(*nodelist);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("{}: {}: {}", kPrefix, nodelist_name, e.what()));
  }
  for (const auto& node : nodes_) {
    auto problem = host_problem(node, false);
    TANDEM_REQUIRE(!problem, InvalidArgument, "{}: {} has the node {}, which is not a host ({})", kPrefix,
                   nodelist_name, quote(node), problem.value_or(""));
  }

  // Tasks per node, when SLURM says.
  for (std::string_view name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    auto text = get(env, name);
    if (!text) continue;
    try {
      tasks_per_node_ = expand_slurm_tasks_per_node(*text);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("{}: {}: {}", kPrefix, name, e.what()));
    }
    TANDEM_REQUIRE(tasks_per_node_.size() == nodes_.size(), InvalidArgument,
                   "{}: {} {} describes {} nodes, but {} {} has {}", kPrefix, name, quote(*text),
                   tasks_per_node_.size(), nodelist_name, quote(*nodelist), nodes_.size());
    const auto total = std::accumulate(tasks_per_node_.begin(), tasks_per_node_.end(), std::int64_t{0});
    TANDEM_REQUIRE(total == num_tasks_, InvalidArgument, "{}: {} {} adds up to {} tasks, but {} is {}", kPrefix, name,
                   quote(*text), total, ntasks_name, num_tasks_);
    break;
  }
  if (tasks_per_node_.empty()) {
    if (auto per_node = optional_int_variable(env, kPrefix, "SLURM_NTASKS_PER_NODE", 1, kMaxWorkers)) {
      tasks_per_node_.assign(nodes_.size(), *per_node);
    }
  }
  if (auto distribution = get(env, "SLURM_DISTRIBUTION")) {
    block_distribution_ = distribution->rfind("block", 0) == 0;
  }

  // This process's node: SLURM_NODEID, else where block distribution puts its rank.
  std::optional<int> node_index =
      optional_int_variable(env, kPrefix, "SLURM_NODEID", 0, static_cast<std::int64_t>(nodes_.size()) - 1);
  if (!node_index && !tasks_per_node_.empty() && block_distribution_) {
    int first = 0;
    for (std::size_t i = 0; i < tasks_per_node_.size(); ++i) {
      if (rank_ < first + tasks_per_node_[i]) {
        node_index = static_cast<int>(i);
        break;
      }
      first += tasks_per_node_[i];
    }
  }
  const bool local_size_known = node_index && !tasks_per_node_.empty();
  if (local_size_known) local_world_size_ = tasks_per_node_[static_cast<std::size_t>(*node_index)];
  if (auto local = optional_int_variable(env, kPrefix, "SLURM_LOCALID", 0, kMaxWorkers)) {
    TANDEM_REQUIRE(!local_size_known || *local < local_world_size_, InvalidArgument,
                   "{}: SLURM_LOCALID {} is out of range: node {} runs {} tasks", kPrefix, *local,
                   nodes_[static_cast<std::size_t>(*node_index)], local_world_size_);
    local_rank_ = *local;
  }

  // Rank 0 serves the store on the first node; with an arbitrary distribution it may be
  // elsewhere, and every other rank would wait at the wrong address until its deadline.
  if (rank_ == 0) {
    auto my_node = get(env, "SLURMD_NODENAME");
    TANDEM_REQUIRE(!my_node || *my_node == nodes_.front(), InvalidArgument,
                   "{}: rank 0 runs on node {} (SLURMD_NODENAME), but the chief must be the first "
                   "node of {}, {}: use srun's block or cyclic distribution",
                   kPrefix, quote(*my_node), nodelist_name, quote(nodes_.front()));
    TANDEM_REQUIRE(!node_index || *node_index == 0, InvalidArgument,
                   "{}: rank 0 runs on node index {} (SLURM_NODEID), but the chief must be on the "
                   "first node of {}, {}: use srun's block or cyclic distribution",
                   kPrefix, node_index.value_or(0), nodelist_name, quote(nodes_.front()));
  }

  int port = kDefaultSlurmPort;
  for (std::string_view name : {kRendezvousPortVariable, std::string_view("MASTER_PORT")}) {
    if (auto text = get(env, name)) {
      port = port_variable(kPrefix, name, *text);
      break;
    }
  }
  rendezvous_address_ = join_host_port(nodes_.front(), port);
  cluster_ = chief_only_cluster(rendezvous_address_, num_tasks_);
}

std::string SlurmClusterResolver::node_of_rank(int rank) const {
  if (rank == 0) return nodes_.front();
  if (tasks_per_node_.empty() || !block_distribution_) return {};
  int first = 0;
  for (std::size_t i = 0; i < tasks_per_node_.size(); ++i) {
    if (rank < first + tasks_per_node_[i]) return nodes_[i];
    first += tasks_per_node_[i];
  }
  return {};
}

std::string SlurmClusterResolver::task_label(int rank) const {
  check_rank(rank);
  const std::string node = node_of_rank(rank);
  if (node.empty()) return fmt::format("rank {}", rank);
  return fmt::format("rank {} (SLURM node {})", rank, node);
}

std::string SlurmClusterResolver::expected_address(int rank) const {
  check_rank(rank);
  return rank == 0 ? rendezvous_address_ : std::string();
}

// ---------------------------------------------------------------------------------------------
// Local and the choice

LocalClusterResolver::LocalClusterResolver(const EnvironmentLookup& env) {
  read_restart_count(env);
  cluster_.jobs[std::string(kWorker)] = {std::string(kLocalRendezvousAddress)};
}

std::string LocalClusterResolver::task_label(int rank) const {
  check_rank(rank);
  return "worker 0 (local)";
}

std::string LocalClusterResolver::expected_address(int rank) const {
  check_rank(rank);
  return {};  // port 0: the address is chosen when the store binds
}

std::unique_ptr<ClusterResolver> resolve_cluster(const EnvironmentLookup& env) {
  if (get(env, "TF_CONFIG")) return std::make_unique<TFConfigClusterResolver>(env);
  if (get(env, "RANK") && get(env, "WORLD_SIZE")) {
    return std::make_unique<TorchrunClusterResolver>(env);
  }
  if (get(env, "SLURM_PROCID")) return std::make_unique<SlurmClusterResolver>(env);
  return std::make_unique<LocalClusterResolver>(env);
}

}  // namespace tandem::strategy
