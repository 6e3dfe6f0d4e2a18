// Cluster resolvers: TF_CONFIG, torchrun's and SLURM's variables, and the choice between them.
// Environments are maps (map_environment): no test touches its own process environment.
#include <doctest/doctest.h>

#include <functional>
#include <string>

#include "common/error_message.h"
#include "tandem/base/errors.h"
#include "tandem/strategy/cluster_resolver.h"

using namespace tandem;
using namespace tandem::strategy;

namespace {

using Vars = std::map<std::string, std::string>;

EnvironmentLookup env_of(Vars vars) { return map_environment(std::move(vars)); }

std::string tf_config_error(const std::string& json) {
  return testing::error_message([&] { (void)TFConfigClusterResolver::from_json(json, env_of({})); });
}

#define CHECK_CONTAINS(message, part) \
  CHECK_MESSAGE(std::string(message).find(part) != std::string::npos, \
                "expected \"" << std::string(part) << "\" in the message: " << std::string(message))

const char* kChiefAndWorkers =
    R"({"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]},
        "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc", "environment": "cloud"})";

}  // namespace

// ---------------------------------------------------------------------------------------------
// Environments and addresses

TEST_CASE("process_environment reads the real environment, map_environment a map") {
  auto env = process_environment();
  CHECK(env("PATH").has_value());
  CHECK_FALSE(env("TANDEM_SURELY_NOT_SET_8d1f2c").has_value());
  auto map = env_of({{"A", "1"}, {"B", ""}});
  CHECK(map("A") == std::optional<std::string>("1"));
  CHECK(map("B") == std::optional<std::string>(""));
  CHECK_FALSE(map("C").has_value());
}

TEST_CASE("split_host_port / join_host_port, IPv6 in brackets") {
  auto hp = split_host_port("127.0.0.1:2223");
  CHECK(hp.host == "127.0.0.1");
  CHECK(hp.port == 2223);
  auto v6 = split_host_port("[::1]:2222");
  CHECK(v6.host == "::1");
  CHECK(v6.port == 2222);
  CHECK(join_host_port("::1", 2222) == "[::1]:2222");
  CHECK(join_host_port("node-1.cluster", 80) == "node-1.cluster:80");
  CHECK(split_host_port("my_host.example.com:65535").port == 65535);

  CHECK_CONTAINS(testing::error_message([] { split_host_port("localhost"); }),
                 "\"localhost\" is not host:port (no port)");
  CHECK_CONTAINS(testing::error_message([] { split_host_port(":1"); }), "empty host");
  CHECK_CONTAINS(testing::error_message([] { split_host_port("h:x1"); }), "port \"x1\" is not a number");
  CHECK_CONTAINS(testing::error_message([] { split_host_port("h:0"); }), "port 0 is not in 1..65535");
  CHECK_CONTAINS(testing::error_message([] { split_host_port("::1:22"); }), "must be in brackets");
  CHECK_CONTAINS(testing::error_message([] { split_host_port("[h]:22"); }), "brackets are for IPv6");
  CHECK_CONTAINS(testing::error_message([] { split_host_port(""); }), "(empty)");
}

TEST_CASE("ClusterSpec: num_tasks, task_address, to_json") {
  ClusterSpec spec;
  spec.jobs["chief"] = {"c:1"};
  spec.jobs["worker"] = {"w:1", "w:2"};
  CHECK(spec.num_tasks("worker") == 2);
  CHECK(spec.num_tasks("ps") == 0);
  CHECK(spec.task_address("worker", 1) == "w:2");
  CHECK_CONTAINS(testing::error_message([&] { (void)spec.task_address("ps", 0); }), "no job \"ps\"");
  CHECK_CONTAINS(testing::error_message([&] { (void)spec.task_address("worker", 2); }),
                 "no task worker[2]: job \"worker\" has 2 tasks");
  CHECK(spec.to_json() == R"({"chief":["c:1"],"worker":["w:1","w:2"]})");
  // to_json is TF_CONFIG's "cluster": it reads back as the same spec.
  auto back = TFConfigClusterResolver::from_json(
      R"({"cluster": )" + spec.to_json() + R"(, "task": {"type": "chief", "index": 0}})", env_of({}));
  CHECK(back.cluster_spec() == spec);
}

// ---------------------------------------------------------------------------------------------
// TF_CONFIG: valid

TEST_CASE("TF_CONFIG with a chief and workers: the chief is rank 0, worker i is rank i+1") {
  auto r = TFConfigClusterResolver::from_json(kChiefAndWorkers, env_of({}));
  CHECK(r.kind() == "TF_CONFIG");
  CHECK(r.task_type() == "worker");
  CHECK(r.task_id() == 1);
  CHECK(r.rank() == 2);
  CHECK(r.num_workers() == 3);
  CHECK_FALSE(r.is_chief());
  CHECK(r.rendezvous_address() == "c:2222");
  CHECK(r.task_label(0) == "chief (c:2222)");
  CHECK(r.task_label(1) == "worker 0 (w0:2222)");
  CHECK(r.task_label(2) == "worker 1 (w1:2222)");
  CHECK(r.expected_address(1) == "w0:2222");
  CHECK(r.local_rank() == 0);  // every task on its own host
  CHECK(r.local_world_size() == 1);
  CHECK(r.restart_count() == 0);
  CHECK_CONTAINS(testing::error_message([&] { (void)r.task_label(3); }),
                 "TF_CONFIG: rank 3 is out of range: there are 3 training processes");
  CHECK_CONTAINS(testing::error_message([&] { (void)r.expected_address(-1); }), "rank -1 is out of range");

  auto chief = TFConfigClusterResolver::from_json(
      R"({"cluster": {"chief": ["c:2222"], "worker": ["w0:2222"]}, "task": {"type": "chief", "index": 0}})",
      env_of({}));
  CHECK(chief.rank() == 0);
  CHECK(chief.is_chief());
  CHECK(chief.task_type() == "chief");
}

TEST_CASE("TF_CONFIG with workers only: worker 0 is the chief; tasks on one host share it") {
  auto r = TFConfigClusterResolver::from_json(
      R"({"cluster": {"worker": ["127.0.0.1:2222", "other:2222", "127.0.0.1:2223", "127.0.0.1:2224"]},
          "task": {"type": "worker", "index": 2}})",
      env_of({{"TANDEM_RESTART_COUNT", "2"}}));
  CHECK(r.rank() == 2);
  CHECK(r.num_workers() == 4);
  CHECK(r.rendezvous_address() == "127.0.0.1:2222");
  CHECK(r.task_label(0) == "worker 0 (127.0.0.1:2222)");
  CHECK(r.local_rank() == 1);  // 127.0.0.1 runs ranks 0, 2, 3
  CHECK(r.local_world_size() == 3);
  CHECK(r.restart_count() == 2);

  auto zero = TFConfigClusterResolver::from_json(
      R"({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}})", env_of({}));
  CHECK(zero.is_chief());
  CHECK(zero.task_type() == "worker");
}

TEST_CASE("TF_CONFIG evaluator: not training (rank -1), num_workers counts the trainers") {
  auto r = TFConfigClusterResolver::from_json(
      R"({"cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"], "evaluator": ["e:1"]},
          "task": {"type": "evaluator", "index": 0}})",
      env_of({}));
  CHECK(r.task_type() == "evaluator");
  CHECK(r.rank() == -1);
  CHECK_FALSE(r.is_chief());
  CHECK(r.num_workers() == 3);
  CHECK(r.local_rank() == 0);
  CHECK(r.local_world_size() == 1);
  CHECK(r.rendezvous_address() == "c:1");
  // A worker of the same cluster is not affected by the evaluator.
  auto w = TFConfigClusterResolver::from_json(
      R"({"cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"], "evaluator": ["e:1"]},
          "task": {"type": "worker", "index": 1}})",
      env_of({}));
  CHECK(w.rank() == 2);
  CHECK(w.num_workers() == 3);
}

TEST_CASE("TF_CONFIG with IPv6 addresses") {
  auto r = TFConfigClusterResolver::from_json(
      R"({"cluster": {"worker": ["[::1]:2222", "[::1]:2223", "[fe80::1%eth0]:2222"]},
          "task": {"type": "worker", "index": 1}})",
      env_of({}));
  CHECK(r.rank() == 1);
  CHECK(r.rendezvous_address() == "[::1]:2222");
  CHECK(r.local_world_size() == 2);
  CHECK(r.local_rank() == 1);
}

TEST_CASE("TF_CONFIG jobs given as {\"0\": ..., \"1\": ...}: accepted when indices run 0..n-1") {
  auto r = TFConfigClusterResolver::from_json(
      R"({"cluster": {"worker": {"1": "b:1", "0": "a:1", "10": "k:1", "2": "c:1", "3": "d:1",
                                 "4": "e:1", "5": "f:1", "6": "g:1", "7": "h:1", "8": "i:1", "9": "j:1"}},
          "task": {"type": "worker", "index": 10}})",
      env_of({}));
  CHECK(r.num_workers() == 11);
  CHECK(r.expected_address(0) == "a:1");
  CHECK(r.expected_address(2) == "c:1");
  CHECK(r.expected_address(10) == "k:1");  // numeric order, not "10" < "2"
  CHECK_CONTAINS(tf_config_error(R"({"cluster": {"worker": {"0": "a:1", "2": "c:1"}},
                                     "task": {"type": "worker", "index": 0}})"),
                 "TF_CONFIG: cluster.worker has no task 1 but has task 2");
  CHECK_CONTAINS(tf_config_error(R"({"cluster": {"worker": {"0": "a:1", "x": "c:1"}},
                                     "task": {"type": "worker", "index": 0}})"),
                 "cluster.worker has the key \"x\"");
  CHECK_CONTAINS(tf_config_error(R"({"cluster": {"worker": {"0": 7}},
                                     "task": {"type": "worker", "index": 0}})"),
                 "cluster.worker[0] is 7, not a \"host:port\" string");
}

TEST_CASE("TFConfigClusterResolver reads TF_CONFIG from the environment; unset or empty is refused") {
  TFConfigClusterResolver r(env_of({{"TF_CONFIG", kChiefAndWorkers}}));
  CHECK(r.rank() == 2);
  for (const char* empty : {"", "  "}) {
    CHECK_CONTAINS(testing::error_message([&] {
                     TFConfigClusterResolver x(env_of({{"TF_CONFIG", empty}}));
                   }),
                   "TF_CONFIG environment variable is not set");
  }
  CHECK_CONTAINS(testing::error_message([] { TFConfigClusterResolver x(env_of({})); }),
                 "TF_CONFIG environment variable is not set");
}

// ---------------------------------------------------------------------------------------------
// TF_CONFIG: every refusal quotes the offending part

TEST_CASE("TF_CONFIG refusals") {
  struct Case {
    const char* json;
    const char* expected;  // a part of the message
  };
  const Case cases[] = {
      {R"({"cluster": {"worker": ["a:1"]}, "task": )", "TF_CONFIG: invalid JSON at byte 42"},
      {R"([1, 2])", "TF_CONFIG: must be a JSON object with \"cluster\" and \"task\", got [1,2]"},
      {R"({"task": {"type": "worker", "index": 0}})", "TF_CONFIG: has no \"cluster\""},
      {R"({"cluster": 5, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: \"cluster\" must be an object of jobs, got 5"},
      {R"({"cluster": {"worker": ["a:1"]}})", "TF_CONFIG: has no \"task\""},
      {R"({"cluster": {"worker": ["a:1"]}, "task": "worker"})", "TF_CONFIG: \"task\" must be an object"},
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}})", "TF_CONFIG: task has no \"type\""},
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"type": 3, "index": 0}})",
       "TF_CONFIG: task.type must be a string such as \"worker\", got 3"},
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}})",
       "TF_CONFIG: task.type \"chief\" is not a job of the cluster (its jobs are \"worker\")"},
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}})",
       "TF_CONFIG: task.type \"ps\": parameter servers are not supported"},
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}})", "TF_CONFIG: task has no \"index\""},
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}})",
       "TF_CONFIG: task.index must be a non-negative integer, got \"0\""},
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0.5}})",
       "TF_CONFIG: task.index must be a non-negative integer, got 0.5"},
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}})",
       "TF_CONFIG: task.index must be a non-negative integer, got -1"},
      {R"({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 3}})",
       "TF_CONFIG: task.index 3 is out of range: cluster.worker has 2 tasks"},
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 18446744073709551615}})",
       "TF_CONFIG: task.index 18446744073709551615 is out of range: cluster.worker has 1 task"},
      {R"({"cluster": {"chief": ["c:1", "d:1"], "worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.chief has 2 tasks: there can be at most one chief"},
      {R"({"cluster": {"evaluator": ["e:1", "f:1"], "worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.evaluator has 2 tasks: there can be at most one evaluator"},
      {R"({"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.worker must be a list of \"host:port\" strings, got \"a:1\""},
      {R"({"cluster": {"worker": ["a:1", 5]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.worker[1] is 5, not a \"host:port\" string"},
      {R"({"cluster": {"worker": ["a:1", "localhost"]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.worker[1] \"localhost\" is not host:port (no port)"},
      {R"({"cluster": {"worker": [":2222"]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.worker[0] \":2222\" is not host:port (empty host)"},
      {R"({"cluster": {"worker": ["h:"]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.worker[0] \"h:\" is not host:port (no port)"},
      {R"({"cluster": {"worker": ["h:http"]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.worker[0] \"h:http\" is not host:port (port \"http\" is not a number)"},
      {R"({"cluster": {"worker": ["h:65536"]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.worker[0] \"h:65536\" is not host:port (port 65536 is not in 1..65535)"},
      {R"({"cluster": {"worker": ["h:0"]}, "task": {"type": "worker", "index": 0}})", "(port 0 is not in 1..65535)"},
      {R"({"cluster": {"worker": ["::1:2222"]}, "task": {"type": "worker", "index": 0}})",
       "\"::1:2222\" is not host:port (an IPv6 host must be in brackets"},
      {R"({"cluster": {"worker": ["[::1]2222"]}, "task": {"type": "worker", "index": 0}})",
       "\"[::1]2222\" is not host:port (no port)"},
      {R"({"cluster": {"worker": ["[::1:2222"]}, "task": {"type": "worker", "index": 0}})",
       "\"[::1:2222\" is not host:port (no closing ']')"},
      {R"({"cluster": {"worker": ["a b:1"]}, "task": {"type": "worker", "index": 0}})",
       "\"a b:1\" is not host:port (the host has the character ' '"},
      {R"({"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:1"]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.worker[1] \"h:1\" is also the address of cluster.chief[0]"},
      {R"({"cluster": {"chief": ["c:1"], "worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.ps: parameter servers are not supported"},
      {R"({"cluster": {"master": ["m:1"], "worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: cluster.master: unknown job \"master\""},
      {R"({"cluster": {"evaluator": ["e:1"]}, "task": {"type": "evaluator", "index": 0}})",
       "TF_CONFIG: the cluster has no \"chief\" or \"worker\" task"},
      {R"({"cluster": {}, "task": {"type": "worker", "index": 0}})",
       "TF_CONFIG: the cluster has no \"chief\" or \"worker\" task"},
  };
  for (const auto& c : cases) {
    const std::string json = c.json;
    CAPTURE(json);
    const std::string message = tf_config_error(c.json);
    CHECK(message.rfind("TF_CONFIG: ", 0) == 0);
    CHECK_CONTAINS(message, c.expected);
  }
}

TEST_CASE("TANDEM_RESTART_COUNT must be a non-negative integer") {
  CHECK(LocalClusterResolver(env_of({{"TANDEM_RESTART_COUNT", "3"}})).restart_count() == 3);
  CHECK_CONTAINS(testing::error_message([] {
                   LocalClusterResolver r(env_of({{"TANDEM_RESTART_COUNT", "-1"}}));
                 }),
                 "environment variable TANDEM_RESTART_COUNT=\"-1\": expected a non-negative integer");
  CHECK_CONTAINS(testing::error_message([] {
                   LocalClusterResolver r(env_of({{"TANDEM_RESTART_COUNT", "x"}}));
                 }),
                 "TANDEM_RESTART_COUNT=\"x\"");
}

// ---------------------------------------------------------------------------------------------
// torchrun

namespace {
Vars torchrun_vars() {
  return {{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"},  {"RANK", "3"},      {"WORLD_SIZE", "8"},
          {"LOCAL_RANK", "1"},         {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"}};
}
std::string torchrun_error(Vars vars) {
  return testing::error_message([&] { TorchrunClusterResolver r(env_of(std::move(vars))); });
}
}  // namespace

TEST_CASE("torchrun: ranks from RANK/WORLD_SIZE, the chief at MASTER_ADDR:MASTER_PORT") {
  TorchrunClusterResolver r(env_of(torchrun_vars()));
  CHECK(r.kind() == "torchrun");
  CHECK(r.rank() == 3);
  CHECK(r.task_type() == "worker");
  CHECK(r.task_id() == 3);
  CHECK(r.num_workers() == 8);
  CHECK(r.local_rank() == 1);
  CHECK(r.local_world_size() == 2);
  CHECK(r.group_rank() == 1);
  CHECK(r.rendezvous_address() == "10.0.0.1:29500");
  CHECK(r.cluster_spec().num_tasks("worker") == 8);
  CHECK(r.cluster_spec().task_address("worker", 0) == "10.0.0.1:29500");
  CHECK(r.cluster_spec().task_address("worker", 7).empty());
  CHECK(r.task_label(5) == "rank 5");
  CHECK(r.expected_address(0) == "10.0.0.1:29500");
  CHECK(r.expected_address(1).empty());
  CHECK_CONTAINS(testing::error_message([&] { (void)r.task_label(8); }),
                 "torchrun: rank 8 is out of range: there are 8 training processes");

  // Under torchrun's agent store, MASTER_PORT is PyTorch's TCPStore: ours takes the next port,
  // unless TANDEM_RENDEZVOUS_PORT says otherwise.
  auto agent = torchrun_vars();
  agent["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  CHECK(TorchrunClusterResolver(env_of(agent)).rendezvous_address() == "10.0.0.1:29501");
  agent["TANDEM_RENDEZVOUS_PORT"] = "31000";
  CHECK(TorchrunClusterResolver(env_of(agent)).rendezvous_address() == "10.0.0.1:31000");

  auto minimal = torchrun_vars();
  minimal.erase("LOCAL_RANK");
  minimal.erase("LOCAL_WORLD_SIZE");
  minimal.erase("GROUP_RANK");
  minimal["RANK"] = "0";
  minimal["MASTER_ADDR"] = "::1";
  minimal["TANDEM_RENDEZVOUS_PORT"] = "29600";
  TorchrunClusterResolver m(env_of(minimal));
  CHECK(m.is_chief());
  CHECK(m.local_rank() == 0);
  CHECK(m.local_world_size() == 1);
  CHECK(m.group_rank() == -1);
  CHECK(m.rendezvous_address() == "[::1]:29600");
}

TEST_CASE("torchrun: missing, malformed and out-of-range variables are named") {
  for (const char* name : {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"}) {
    auto vars = torchrun_vars();
    vars.erase(name);
    const std::string name_text = name;
    CAPTURE(name_text);
    CHECK_CONTAINS(torchrun_error(vars), fmt::format("torchrun: {} is not set", name));
  }
  const std::pair<std::pair<const char*, const char*>, const char*> cases[] = {
      {{"RANK", "8"}, "torchrun: RANK 8 is out of range: WORLD_SIZE is 8"},
      {{"RANK", "-1"}, "torchrun: RANK -1 is out of range"},
      {{"RANK", "one"}, "torchrun: RANK \"one\" is not an integer"},
      {{"WORLD_SIZE", "0"}, "torchrun: WORLD_SIZE 0 is out of range"},
      {{"WORLD_SIZE", "8.0"}, "torchrun: WORLD_SIZE \"8.0\" is not an integer"},
      {{"MASTER_PORT", "70000"}, "torchrun: MASTER_PORT 70000 is out of range: expected 1..65535"},
      {{"MASTER_ADDR", "bad host"}, "torchrun: MASTER_ADDR \"bad host\" is not a host"},
      {{"LOCAL_RANK", "2"}, "torchrun: LOCAL_RANK 2 is out of range: LOCAL_WORLD_SIZE is 2"},
      {{"LOCAL_RANK", "x"}, "torchrun: LOCAL_RANK \"x\" is not an integer"},
      {{"LOCAL_WORLD_SIZE", "0"}, "torchrun: LOCAL_WORLD_SIZE 0 is out of range"},
      {{"GROUP_RANK", "-2"}, "torchrun: GROUP_RANK -2 is out of range"},
      {{"TANDEM_RENDEZVOUS_PORT", "0"}, "torchrun: TANDEM_RENDEZVOUS_PORT 0 is out of range"},
  };
  for (const auto& [change, expected] : cases) {
    auto vars = torchrun_vars();
    vars[change.first] = change.second;
    const std::string variable = fmt::format("{}={}", change.first, change.second);
    CAPTURE(variable);
    CHECK_CONTAINS(torchrun_error(vars), expected);
  }
}

// ---------------------------------------------------------------------------------------------
// SLURM

TEST_CASE("expand_slurm_nodelist") {
  using V = std::vector<std::string>;
  CHECK(expand_slurm_nodelist("n1") == V{"n1"});
  CHECK(expand_slurm_nodelist("n[1-3,5],gpu07") == V{"n1", "n2", "n3", "n5", "gpu07"});
  CHECK(expand_slurm_nodelist("node[001-010]") == V{"node001", "node002", "node003", "node004", "node005", "node006",
                                                    "node007", "node008", "node009", "node010"});
  CHECK(expand_slurm_nodelist("n[9-11]") == V{"n9", "n10", "n11"});
  CHECK(expand_slurm_nodelist("n[098-101]") == V{"n098", "n099", "n100", "n101"});
  CHECK(expand_slurm_nodelist("a[1-2]-b[3-4]") == V{"a1-b3", "a1-b4", "a2-b3", "a2-b4"});
  CHECK(expand_slurm_nodelist("rack1-n[1-2]x,y[01,03]") == V{"rack1-n1x", "rack1-n2x", "y01", "y03"});
  CHECK(expand_slurm_nodelist(" c[7] ") == V{"c7"});
  CHECK(expand_slurm_nodelist("a,b,a") == V{"a", "b", "a"});

  const std::pair<const char*, const char*> bad[] = {
      {"", "is empty"},
      {"n[1-3", "'[' without ']'"},
      {"n1-3]", "']' without '['"},
      {"n[[1]]", "nested '[' brackets"},
      {"n[3-1]", "the range \"3-1\" in \"n[3-1]\" runs backwards"},
      {"n[a-b]", "\"a-b\" in \"n[a-b]\" is not a number"},
      {"n[1-]", "\"1-\" in \"n[1-]\" is not a number"},
      {"n[]", "empty brackets in \"n[]\""},
      {"n1,,n2", "an empty host name"},
      {"n1,", "an empty host name"},
      {"n[1,,2]", "\"\" in \"n[1,,2]\" is not a number"},
      {"n[0-99999999]", "more than 1000000 nodes"},
      {"a[0-999]b[0-9999]", "more than 1000000 nodes"},
  };
  for (const auto& [list, expected] : bad) {
    const std::string list_text = list;
    CAPTURE(list_text);
    const std::string message = testing::error_message([&] { expand_slurm_nodelist(list); });
    CHECK_CONTAINS(message, fmt::format("SLURM node list \"{}\"", list));
    CHECK_CONTAINS(message, expected);
  }
}

TEST_CASE("expand_slurm_tasks_per_node") {
  CHECK(expand_slurm_tasks_per_node("2(x3),1") == std::vector<int>{2, 2, 2, 1});
  CHECK(expand_slurm_tasks_per_node("4") == std::vector<int>{4});
  CHECK(expand_slurm_tasks_per_node("1,3(x2)") == std::vector<int>{1, 3, 3});
  for (const char* bad : {"", "2(x0)", "a", "2(3)", "2(x3", "0", "2,,1"}) {
    const std::string bad_text = bad;
    CAPTURE(bad_text);
    CHECK_CONTAINS(testing::error_message([&] { expand_slurm_tasks_per_node(bad); }),
                   fmt::format("SLURM tasks per node \"{}\"", bad));
  }
}

namespace {
// Rank 5 of 8 on gpu03, the third of four nodes with two tasks each.
Vars slurm_vars() {
  return {{"SLURM_PROCID", "5"},
          {"SLURM_NTASKS", "8"},
          {"SLURM_LOCALID", "1"},
          {"SLURM_NODEID", "2"},
          {"SLURMD_NODENAME", "gpu03"},
          {"SLURM_STEP_NODELIST", "gpu[01-03],cpu1"},
          {"SLURM_JOB_NODELIST", "gpu[01-03],cpu[1-4]"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x4)"},
          {"SLURM_TASKS_PER_NODE", "2(x7)"}};
}
std::string slurm_error(Vars vars) {
  return testing::error_message([&] { SlurmClusterResolver r(env_of(std::move(vars))); });
}
}  // namespace

TEST_CASE("SLURM: a full srun environment") {
  SlurmClusterResolver r(env_of(slurm_vars()));
  CHECK(r.kind() == "SLURM");
  CHECK(r.rank() == 5);
  CHECK(r.task_id() == 5);
  CHECK(r.num_workers() == 8);
  CHECK(r.local_rank() == 1);
  CHECK(r.local_world_size() == 2);
  CHECK(r.nodes() == std::vector<std::string>{"gpu01", "gpu02", "gpu03", "cpu1"});
  CHECK(r.rendezvous_address() == "gpu01:29500");
  CHECK(r.cluster_spec().num_tasks("worker") == 8);
  CHECK(r.expected_address(0) == "gpu01:29500");
  CHECK(r.expected_address(5).empty());
  CHECK(r.task_label(0) == "rank 0 (SLURM node gpu01)");
  CHECK(r.task_label(5) == "rank 5 (SLURM node gpu03)");
  CHECK(r.task_label(7) == "rank 7 (SLURM node cpu1)");

  auto vars = slurm_vars();
  vars["MASTER_PORT"] = "1234";
  CHECK(SlurmClusterResolver(env_of(vars)).rendezvous_address() == "gpu01:1234");
  vars["TANDEM_RENDEZVOUS_PORT"] = "4321";
  CHECK(SlurmClusterResolver(env_of(vars)).rendezvous_address() == "gpu01:4321");
}

TEST_CASE("SLURM: job-level variables, uneven nodes, no SLURM_NODEID, cyclic distribution") {
  Vars vars = {{"SLURM_PROCID", "3"},
               {"SLURM_NTASKS", "5"},
               {"SLURM_LOCALID", "0"},
               {"SLURM_NODELIST", "n[1-3]"},
               {"SLURM_TASKS_PER_NODE", "2(x2),1"}};
  SlurmClusterResolver r(env_of(vars));
  CHECK(r.local_world_size() == 2);  // rank 3 is on n2 under block distribution
  CHECK(r.task_label(3) == "rank 3 (SLURM node n2)");
  CHECK(r.task_label(4) == "rank 4 (SLURM node n3)");
  // The first rank of a node belongs to it, not to the node before.
  SlurmClusterResolver first(env_of(
      {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_NODELIST", "n[1-2]"}, {"SLURM_TASKS_PER_NODE", "1,3"}}));
  CHECK(first.local_world_size() == 3);
  CHECK(first.task_label(1) == "rank 1 (SLURM node n2)");
  CHECK(first.task_label(0) == "rank 0 (SLURM node n1)");
  vars["SLURM_DISTRIBUTION"] = "cyclic";
  SlurmClusterResolver cyclic(env_of(vars));
  CHECK(cyclic.task_label(3) == "rank 3");
  CHECK(cyclic.task_label(0) == "rank 0 (SLURM node n1)");
  CHECK(cyclic.local_world_size() == 1);  // unknown without SLURM_NODEID

  Vars uniform = {
      {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_NODELIST", "a,b"}, {"SLURM_NTASKS_PER_NODE", "2"}};
  SlurmClusterResolver u(env_of(uniform));
  CHECK(u.is_chief());
  CHECK(u.local_world_size() == 2);
  CHECK(u.local_rank() == 0);
  CHECK(u.rendezvous_address() == "a:29500");
  CHECK(u.task_label(3) == "rank 3 (SLURM node b)");

  // Nothing about the layout: local rank 0 of 1.
  SlurmClusterResolver bare(env_of({{"SLURM_PROCID", "1"}, {"SLURM_NPROCS", "2"}, {"SLURM_NODELIST", "x1"}}));
  CHECK(bare.num_workers() == 2);
  CHECK(bare.local_world_size() == 1);
  CHECK(bare.task_label(1) == "rank 1");
}

TEST_CASE("SLURM: refusals") {
  struct Case {
    std::vector<std::string> erase;
    Vars set;
    const char* expected;
  };
  const Case cases[] = {
      {{"SLURM_NTASKS"}, {}, "SLURM: SLURM_NTASKS is not set"},
      {{"SLURM_PROCID"}, {}, "SLURM: SLURM_PROCID is not set"},
      {{}, {{"SLURM_PROCID", "8"}}, "SLURM: SLURM_PROCID 8 is out of range: SLURM_NTASKS is 8"},
      {{}, {{"SLURM_PROCID", "x"}}, "SLURM: SLURM_PROCID \"x\" is not an integer"},
      {{"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"},
       {},
       "SLURM: none of SLURM_STEP_NODELIST, SLURM_NODELIST and SLURM_JOB_NODELIST is set"},
      {{},
       {{"SLURM_STEP_NODELIST", "gpu[01-03"}},
       "SLURM: SLURM_STEP_NODELIST: SLURM node list \"gpu[01-03\": '[' without ']'"},
      {{},
       {{"SLURM_STEP_TASKS_PER_NODE", "2(x3)"}},
       "SLURM: SLURM_STEP_TASKS_PER_NODE \"2(x3)\" describes 3 nodes, but SLURM_STEP_NODELIST"},
      {{},
       {{"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"}},
       "SLURM: SLURM_STEP_TASKS_PER_NODE \"2(x3),1\" adds up to 7 tasks, but SLURM_NTASKS is 8"},
      {{}, {{"SLURM_STEP_TASKS_PER_NODE", "2(x"}}, "SLURM: SLURM_STEP_TASKS_PER_NODE: SLURM tasks per node"},
      {{}, {{"SLURM_LOCALID", "2"}}, "SLURM: SLURM_LOCALID 2 is out of range: node gpu03 runs 2 tasks"},
      {{}, {{"SLURM_NODEID", "4"}}, "SLURM: SLURM_NODEID 4 is out of range"},
      {{}, {{"MASTER_PORT", "0"}}, "SLURM: MASTER_PORT 0 is out of range"},
      {{}, {{"TANDEM_RENDEZVOUS_PORT", "port"}}, "SLURM: TANDEM_RENDEZVOUS_PORT \"port\" is not an integer"},
      {{},
       {{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}},
       "SLURM: rank 0 runs on node \"gpu03\" (SLURMD_NODENAME), but the chief must be the first node "
       "of SLURM_STEP_NODELIST, \"gpu01\""},
      {{"SLURMD_NODENAME"},
       {{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}},
       "SLURM: rank 0 runs on node index 2 (SLURM_NODEID)"},
      {{},
       {{"SLURM_STEP_NODELIST", "gpu_01,a b"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}},
       "SLURM: SLURM_STEP_NODELIST has the node \"a b\", which is not a host"},
  };
  for (const auto& c : cases) {
    auto vars = slurm_vars();
    for (const auto& name : c.erase) vars.erase(name);
    for (const auto& [name, value] : c.set) vars[name] = value;
    const std::string expected = c.expected;
    CAPTURE(expected);
    CHECK_CONTAINS(slurm_error(vars), c.expected);
  }
}

// ---------------------------------------------------------------------------------------------
// resolve_cluster

TEST_CASE("resolve_cluster: TF_CONFIG, then torchrun, then SLURM, then one local worker") {
  Vars all = slurm_vars();
  for (const auto& [name, value] : torchrun_vars()) all[name] = value;
  all["TF_CONFIG"] = kChiefAndWorkers;
  CHECK(resolve_cluster(env_of(all))->kind() == "TF_CONFIG");

  all["TF_CONFIG"] = "";  // empty is unset
  auto torchrun = resolve_cluster(env_of(all));
  CHECK(torchrun->kind() == "torchrun");
  CHECK(torchrun->rank() == 3);

  all.erase("WORLD_SIZE");  // RANK alone is not torchrun
  auto slurm = resolve_cluster(env_of(all));
  CHECK(slurm->kind() == "SLURM");
  CHECK(slurm->rank() == 5);

  auto local = resolve_cluster(env_of({{"TANDEM_RESTART_COUNT", "1"}}));
  CHECK(local->kind() == "local");
  CHECK(local->rank() == 0);
  CHECK(local->num_workers() == 1);
  CHECK(local->is_chief());
  CHECK(local->task_type() == "worker");
  CHECK(local->task_id() == 0);
  CHECK(local->local_rank() == 0);
  CHECK(local->local_world_size() == 1);
  CHECK(local->rendezvous_address() == "127.0.0.1:0");
  CHECK(local->restart_count() == 1);
  CHECK(local->task_label(0) == "worker 0 (local)");
  CHECK(local->expected_address(0).empty());
  CHECK(local->cluster_spec().num_tasks("worker") == 1);
  CHECK_CONTAINS(testing::error_message([&] { (void)local->task_label(1); }), "local: rank 1 is out of range");

  // A malformed environment is an error, never a silent single worker.
  CHECK_CONTAINS(testing::error_message([] {
                   resolve_cluster(env_of({{"TF_CONFIG", "{"}}));
                 }),
                 "TF_CONFIG: invalid JSON");
  CHECK_CONTAINS(testing::error_message([] {
                   resolve_cluster(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}}));
                 }),
                 "torchrun: MASTER_ADDR is not set");
  CHECK_CONTAINS(testing::error_message([] {
                   resolve_cluster(env_of({{"SLURM_PROCID", "0"}}));
                 }),
                 "SLURM: SLURM_NTASKS is not set");
}

// ---------------------------------------------------------------------------------------------
// Hostile input: whatever a launcher's variable holds, the resolver answers InvalidArgument with
// a message of bounded size that names the variable or field, never a crash or an uncaught
// exception.

namespace {

constexpr std::size_t kShortMessage = 1000;  // every message quotes at most a few hundred bytes

// The message of the InvalidArgument, checked for a bounded size.
template <class Fn>
std::string short_error(Fn&& fn) {
  std::string message = testing::error_message(std::forward<Fn>(fn));
  CHECK_MESSAGE(message.size() < kShortMessage, "a message of " << message.size() << " bytes");
  return message;
}

std::string tf_config_with_worker(const std::string& address) {
  return R"({"cluster": {"worker": [")" + address + R"("]}, "task": {"type": "worker", "index": 0}})";
}

std::string nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

}  // namespace

TEST_CASE("TF_CONFIG: numbers beyond double's range are refused, not an uncaught exception") {
  for (const char* json : {"1e999", "-1e999", R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker",
                                                  "index": 1e999}})"}) {
    const std::string json_text = json;
    CAPTURE(json_text);
    const std::string message = short_error([&] { (void)TFConfigClusterResolver::from_json(json, env_of({})); });
    CHECK(message.rfind("TF_CONFIG: ", 0) == 0);
    CHECK_CONTAINS(message, "number");
  }
  // Through the environment too, as `TF_CONFIG=1e999 program` does.
  CHECK_CONTAINS(short_error([] { resolve_cluster(env_of({{"TF_CONFIG", "1e999"}})); }), "TF_CONFIG: ");
}

TEST_CASE("TF_CONFIG: nesting deeper than the limit is refused while parsing, before any walk of the value") {
  // Each of these overflowed the stack (SIGSEGV) when a message dumped the value.
  const std::string deep = nested(200'000);
  const std::string cases[] = {
      deep, R"({"cluster": )" + deep + R"(, "task": {"type": "worker", "index": 0}})",
      R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}, "environment": )" + deep + "}",
      R"({"cluster": {"worker": ["a:1"]}, "task": )" + std::string(100'000, '[') + "{",  // unfinished as well
  };
  for (const auto& json : cases) {
    const std::string message = short_error([&] { (void)TFConfigClusterResolver::from_json(json, env_of({})); });
    CHECK(message.rfind("TF_CONFIG: ", 0) == 0);
    CHECK_CONTAINS(message, "nested deeper than 32 levels");
  }
  // Real TF_CONFIGs nest 3 or 4 levels; the limit leaves room.
  const std::string ok =
      R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}, "environment": )" + nested(28) + "}";
  CHECK(TFConfigClusterResolver::from_json(ok, env_of({})).num_workers() == 1);
}

TEST_CASE("TF_CONFIG: sizes and characters are bounded, and the message names the field") {
  CHECK_CONTAINS(
      short_error([] { (void)TFConfigClusterResolver::from_json(std::string(2 << 20, ' ') + "{}", env_of({})); }),
      "TF_CONFIG: is 2097154 bytes; at most 1048576");
  // Host names: 253 bytes at most (RFC 1035), 63 per label.
  const std::string cases[][2] = {
      {std::string(1'000'000, 'a') + ":1", "cluster.worker[0]"},
      {std::string(254, 'a') + ":1", "the host name is 254 bytes; at most 253"},
      {std::string(64, 'a') + ".example.com:1", "the host name has a label of 64 bytes; at most 63"},
      {"a..b:1", "the host name has an empty label"},
      {"a\\u0001b:1", "the host has the character '\\x01'"},
      {"a\\u00e9:1", "the host has the character '\\xc3'"},
      {"[" + std::string(100, '1') + "]:1", "longer than any IPv6 address"},
      {"h:" + std::string(100'000, '9'), "not a number"},
  };
  for (const auto& [address, expected] : cases) {
    CAPTURE(expected);
    const std::string message =
        short_error([&] { (void)TFConfigClusterResolver::from_json(tf_config_with_worker(address), env_of({})); });
    CHECK_CONTAINS(message, "TF_CONFIG: cluster.worker[0]");
    CHECK_CONTAINS(message, expected);
  }
  // The longest names that are allowed still are.
  const std::string longest = std::string(63, 'a') + "." + std::string(63, 'b') + "." + std::string(63, 'c') + "." +
                              std::string(61, 'd') + ":1";
  CHECK(TFConfigClusterResolver::from_json(tf_config_with_worker(longest), env_of({})).num_workers() == 1);

  // Job and task type names are short words: a long or odd one is quoted short and escaped.
  const std::string long_name(100'000, 'j');
  CHECK_CONTAINS(short_error([&] {
                   (void)TFConfigClusterResolver::from_json(
                       R"({"cluster": {")" + long_name + R"(": ["a:1"]}, "task": {"type": "worker", "index": 0}})",
                       env_of({}));
                 }),
                 "TF_CONFIG: cluster has a job name of 100000 bytes");
  CHECK_CONTAINS(short_error([&] {
                   (void)TFConfigClusterResolver::from_json(
                       R"({"cluster": {"worker": ["a:1"]}, "task": {"type": ")" + long_name + R"(", "index": 0}})",
                       env_of({}));
                 }),
                 "TF_CONFIG: task.type is 100000 bytes long");
  CHECK_CONTAINS(short_error([&] {
                   (void)TFConfigClusterResolver::from_json(
                       R"({"cluster": {"work\ner": ["a:1"]}, "task": {"type": "worker", "index": 0}})", env_of({}));
                 }),
                 R"(unknown job "work\ner")");
  // Not UTF-8: a parse error, still InvalidArgument.
  CHECK_CONTAINS(
      short_error([] { (void)TFConfigClusterResolver::from_json("{\"cluster\": \"\xff\xfe\"}", env_of({})); }),
      "TF_CONFIG: invalid JSON");
}

TEST_CASE("torchrun and SLURM: long and odd values are refused with short messages naming the variable") {
  auto vars = torchrun_vars();
  vars["MASTER_ADDR"] = std::string(1'000'000, 'm');
  CHECK_CONTAINS(short_error([&] { TorchrunClusterResolver r(env_of(vars)); }), "torchrun: MASTER_ADDR \"mmm");
  CHECK_CONTAINS(short_error([&] { TorchrunClusterResolver r(env_of(vars)); }),
                 "the host name is 1000000 bytes; at most 253");
  vars = torchrun_vars();
  vars["MASTER_ADDR"] = "host\x1b[31m";
  CHECK_CONTAINS(short_error([&] { TorchrunClusterResolver r(env_of(vars)); }), R"(MASTER_ADDR "host\x1b[31m")");
  vars = torchrun_vars();
  vars["RANK"] = std::string(100'000, '7');
  CHECK_CONTAINS(short_error([&] { TorchrunClusterResolver r(env_of(vars)); }), "torchrun: RANK \"777");

  auto slurm = slurm_vars();
  slurm["SLURM_STEP_NODELIST"] = std::string(300, 'n') + "[1-3]";
  CHECK_CONTAINS(short_error([&] { SlurmClusterResolver r(env_of(slurm)); }),
                 "SLURM: SLURM_STEP_NODELIST: SLURM node list");
  CHECK_CONTAINS(short_error([&] { SlurmClusterResolver r(env_of(slurm)); }), "253");
  // A million long names would take gigabytes: refused by the total size before expanding.
  slurm["SLURM_STEP_NODELIST"] = std::string(200, 'n') + "[000000-999999]";
  CHECK_CONTAINS(short_error([&] { SlurmClusterResolver r(env_of(slurm)); }), "bytes of host names");
  slurm = slurm_vars();
  slurm["SLURMD_NODENAME"] = std::string(100'000, 'x');
  slurm["SLURM_PROCID"] = "0";
  slurm["SLURM_LOCALID"] = "0";
  CHECK_CONTAINS(short_error([&] { SlurmClusterResolver r(env_of(slurm)); }), "SLURMD_NODENAME");
  slurm = slurm_vars();
  slurm["SLURM_STEP_TASKS_PER_NODE"] = std::string(100'000, '2');
  CHECK_CONTAINS(short_error([&] { SlurmClusterResolver r(env_of(slurm)); }), "SLURM_STEP_TASKS_PER_NODE");
}
