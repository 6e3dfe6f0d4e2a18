// The conformance suite's driver (contract.h): runs a section's body on every rank of a backend's
// group (threads, or worker processes), collects the ranks' outcomes, and hands them to the
// section's verdict. The same program is the worker process (--contract-worker) and lists the
// backends for CTest (--list-backends).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <fmt/ranges.h>

#include <cstdio>
#include <deque>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/worker_processes.h"
#include "contract.h"
#include "tandem/base/errors.h"
#include "tandem/collective/store.h"
#include "tandem/collective/tcp_store.h"

namespace tandem::testing::contract {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::string_view kWorkerFlag = "--contract-worker";
constexpr int kSkipped = 77;  // CTest's SKIP_RETURN_CODE for these tests

// The backends this run checks (--backend=NAME, or every one that can run here).
std::vector<const Backend*>& selected() {
  static std::vector<const Backend*> list;
  return list;
}

std::deque<Section>& sections() {
  static std::deque<Section> list;  // a deque: add_section's references stay valid
  return list;
}

const Backend* find_backend(std::string_view name) {
  for (const Backend& b : backends()) {
    if (b.name == name) return &b;
  }
  return nullptr;
}

const Section* find_section(std::string_view name) {
  for (const Section& s : sections()) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

std::string key(std::string_view what, int rank) { return fmt::format("contract/{}/{}", what, rank); }

// Runs the section's body on this rank and tells the others it is done (for hold()).
void run_body(const Section& section, RankContext& ctx, Outcome& outcome) {
  ctx.step("body", [&] { section.body(ctx); });
  outcome.reported = true;
  ctx.store().set(key("done", ctx.rank()), {'1'});
}

// --- threads --------------------------------------------------------------------------------------

std::vector<Outcome> run_on_threads(const Section& section, const Run& run) {
  auto store = collective::make_in_memory_store();
  Group group;
  try {
    group = run.backend.make_group(run.size);
  } catch (const std::exception& e) {
    FAIL("making the group failed: " << e.what());
  }
  REQUIRE(static_cast<int>(group.size()) == run.size);
  std::vector<Outcome> outcomes(static_cast<std::size_t>(run.size));
  std::vector<std::thread> threads;
  for (int r = 0; r < run.size; ++r) {
    threads.emplace_back([&, r] {
      Outcome& outcome = outcomes[static_cast<std::size_t>(r)];
      outcome.rank = r;
      RankContext ctx(*group[static_cast<std::size_t>(r)], *store, run, r, outcome);
      run_body(section, ctx, outcome);
    });
  }
  for (auto& t : threads) t.join();
  return outcomes;
}

// --- worker processes -----------------------------------------------------------------------------

// A result file: "step\t<name>\t<type>\t<ms>\t<message>" lines, then "note\t<text>".
std::string one_line(std::string text) {
  for (char& c : text) {
    if (c == '\n' || c == '\t') c = ' ';
  }
  return text;
}

void write_outcome(const std::string& path, const Outcome& outcome) {
  std::ofstream out(path);
  for (const Step& s : outcome.steps) {
    out << "step\t" << s.name << "\t" << s.type << "\t" << s.ms << "\t" << one_line(s.message) << "\n";
  }
  out << "note\t" << one_line(outcome.note) << "\n";
}

Outcome read_outcome(const std::string& path, int rank) {
  Outcome outcome;
  outcome.rank = rank;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> fields;
    std::istringstream split(line);
    for (std::string f; std::getline(split, f, '\t');) fields.push_back(f);
    if (fields.size() >= 1 && fields[0] == "note") {
      outcome.note = fields.size() > 1 ? fields[1] : "";
      outcome.reported = true;
    } else if (fields.size() >= 4 && fields[0] == "step") {
      outcome.steps.push_back(
          {fields[1], fields[2], fields.size() > 4 ? fields[4] : "", std::atoll(fields[3].c_str())});
    }
  }
  return outcome;
}

// The worker process: argv = exe, flag, "<backend>|<section>|<param>", store address, rank, size,
// result file.
int worker_main(int argc, char** argv) {
  if (argc != 7) return 2;
  const std::string scenario = argv[2];
  const auto bar1 = scenario.find('|');
  const auto bar2 = scenario.find('|', bar1 + 1);
  const Backend* backend = find_backend(scenario.substr(0, bar1));
  const Section* section = find_section(scenario.substr(bar1 + 1, bar2 - bar1 - 1));
  if (backend == nullptr || section == nullptr || bar2 == std::string::npos) return 2;
  const Run run{*backend, std::atoi(argv[5]), std::atoi(scenario.substr(bar2 + 1).c_str())};
  const int rank = std::atoi(argv[4]);
  Outcome outcome;
  outcome.rank = rank;
  std::shared_ptr<collective::Store> store;
  std::unique_ptr<Communicator> comm;
  try {
    // The rank is announced, so that the store's server notices this process's death.
    store = collective::connect_tcp_store(argv[3], {.connect_timeout = 20s, .rank = rank});
    comm = backend->make_rank(rank, run.size, store);
  } catch (const std::exception& e) {
    outcome.steps.push_back({"make", "std::exception", e.what(), 0});
    write_outcome(argv[6], outcome);
    return 0;
  }
  RankContext ctx(*comm, *store, run, rank, outcome);
  run_body(*section, ctx, outcome);
  write_outcome(argv[6], outcome);
  return 0;
}

class WorkerControl final : public Workers {
 public:
  explicit WorkerControl(WorkerProcesses& workers) : workers_(workers) {}
  collective::Store& store() override { return workers_.store(); }
  void kill(int rank) override { workers_.kill(rank); }

 private:
  WorkerProcesses& workers_;
};

std::vector<Outcome> run_in_processes(const Section& section, const Run& run) {
  WorkerProcesses workers({.flag = std::string(kWorkerFlag),
                           .scenario = fmt::format("{}|{}|{}", run.backend.name, section.name, run.param),
                           .size = run.size});
  if (section.drive) {
    WorkerControl control(workers);
    section.drive(run, control);
  }
  const auto deadline = Clock::now() + kRunLimit;
  std::vector<Outcome> outcomes;
  for (int r = 0; r < run.size; ++r) {
    workers.wait_exit(r, deadline, kRunLimit);
    outcomes.push_back(read_outcome(workers.result_path(r), r));
  }
  return outcomes;
}

}  // namespace

// --- contract.h -----------------------------------------------------------------------------------

const Step& Outcome::step(std::string_view name) const {
  for (const Step& s : steps) {
    if (s.name == name) return s;
  }
  static const Step none{"", "<no such step>", "", 0};
  std::string had;
  for (const Step& s : steps) had += fmt::format("\n  {}: {}: {}", s.name, s.type, s.message);
  FAIL_CHECK("rank " << rank << " has no step \"" << std::string(name) << "\"; it "
                     << (reported ? "reported" : "did not report (killed, or crashed?)") << had);
  return none;
}

bool RankContext::step(std::string_view name, const std::function<void()>& fn, bool record_success) {
  Step s{std::string(name), "none", "", 0};
  const auto start = Clock::now();
  try {
    fn();
  } catch (const Error& e) {
    s.type = std::string(error_code_name(e.code()));
    s.message = e.what();
  } catch (const std::exception& e) {
    s.type = "std::exception";
    s.message = e.what();
  }
  s.ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  const bool returned = s.type == "none";
  if (!returned || record_success) outcome_.steps.push_back(std::move(s));
  return returned;
}

void RankContext::hold() {
  store_.set(key("held", rank_), {'1'});
  const auto deadline = Clock::now() + kRunLimit;
  for (;;) {
    bool others_done = true;
    for (int q = 0; q < size() && others_done; ++q) {
      others_done = q == rank_ || store_.check(key("done", q)) || store_.check(key("held", q));
    }
    if (others_done) return;
    if (Clock::now() > deadline) throw ContractViolation("hold(): the other ranks did not finish");
    std::this_thread::sleep_for(10ms);
  }
}

void RankContext::ready() { store_.set(key("ready", rank_), {'1'}); }

const Section& add_section(Section section) { return sections().emplace_back(std::move(section)); }

void check_contract(const Section& section) {
  for (const Backend* backend : selected()) {
    if (!section.applies(*backend)) continue;
    for (int size : section.sizes(*backend)) {
      if (const std::string why = backend->unavailable(size); !why.empty()) {
        MESSAGE(backend->name << " with " << size << " ranks skipped: " << why);
        continue;
      }
      for (int param : section.params(*backend, size)) {
        INFO("section " << section.name << " on " << backend->name << ", " << size << " ranks, param " << param);
        const Run run{*backend, size, param};
        const std::vector<Outcome> outcomes =
            backend->processes() ? run_in_processes(section, run) : run_on_threads(section, run);
        (section.verdict ? section.verdict : every_rank_succeeds)(run, outcomes);
      }
    }
  }
}

void every_rank_succeeds(const Run& run, const std::vector<Outcome>& outcomes) {
  for (const Outcome& o : outcomes) {
    CAPTURE(o.rank);
    CHECK(o.reported);
    const Step& body = o.step("body");
    INFO(body.message);
    CHECK(body.type == "none");
    CHECK(o.note == outcomes.front().note);  // bitwise the same results on every rank
  }
  CHECK(static_cast<int>(outcomes.size()) == run.size);
}

void check_step(const Step& step, std::string_view type, const std::vector<std::string>& parts) {
  INFO("step " << step.name << ": " << step.type << ": " << step.message);
  CHECK(step.type == type);
  for (const std::string& part : parts) {
    INFO("expected to contain: " << part);
    CHECK(step.message.find(part) != std::string::npos);
  }
}

std::string ranks_named(const std::vector<int>& ranks, int size) {
  return fmt::format("{} {} of {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "), size);
}

}  // namespace tandem::testing::contract

namespace contract = tandem::testing::contract;

// --list-backends                   the backends' names, one a line (CTest makes a test of each)
// --backend=NAME [doctest options]  checks that backend; exits 77 when it cannot run here
// [doctest options]                 checks every backend that can run here
// --contract-worker ...             a worker process (see worker_main)
int main(int argc, char** argv) {
  const std::string_view first = argc > 1 ? argv[1] : "";
  if (first == contract::kWorkerFlag) return contract::worker_main(argc, argv);
  if (first == "--list-backends") {
    for (const auto& b : contract::backends()) std::printf("%s\n", b.name.c_str());
    return 0;
  }
  std::vector<char*> args = {argv[0]};
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with("--backend=")) {
      only = arg.substr(10);
    } else {
      args.push_back(argv[i]);
    }
  }
  for (const auto& b : contract::backends()) {
    if (!only.empty() && b.name != only) continue;
    const int smallest = *std::min_element(b.traits.sizes.begin(), b.traits.sizes.end());
    if (const std::string why = b.unavailable(smallest); !why.empty()) {
      std::printf("skipped %s: %s\n", b.name.c_str(), why.c_str());
      continue;
    }
    contract::selected().push_back(&b);
  }
  if (!only.empty() && contract::find_backend(only) == nullptr) {
    std::fprintf(stderr, "no backend \"%s\" (--list-backends lists them)\n", only.c_str());
    return 2;
  }
  if (contract::selected().empty()) return contract::kSkipped;
  doctest::Context context(static_cast<int>(args.size()), args.data());
  return context.run();
}
